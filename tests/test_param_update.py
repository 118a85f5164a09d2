"""ParamRemainders and KahanSummation against written bit rules, the
MasterWeights run and float32 training."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import jmp_train
from jmp_train._src import param_update
from jmp_train.checkpoint import Checkpointer
from jmp_train.train import TrainState

BF16 = ml_dtypes.bfloat16


# -- The written rule (NumPy, uint32 arithmetic) -----------------------------


def rne_high(bits):
  """bits(bfloat16(master)) for float32 `bits`: round to nearest, ties to
  an even last bit (finite masters; the largest ones round to inf)."""
  bits = np.asarray(bits, np.uint32)
  odd = (bits >> np.uint32(16)) & np.uint32(1)
  return ((bits + np.uint32(0x7FFF) + odd) >> np.uint32(16)).astype(np.uint16)


def rule_rebuilt(bits, high):
  """What a bfloat16 param `high` and a 16-bit remainder can give back for
  the master `bits`: the master, except the one tie no int16 holds
  (`bits == high << 16 + 0x8000`), kept as `high << 16 + 0x7FFF`."""
  bits = np.asarray(bits, np.uint32)
  base = np.asarray(high, np.uint16).astype(np.uint32) << np.uint32(16)
  tie = bits == base + np.uint32(0x8000)
  return np.where(tie, base + np.uint32(0x7FFF), bits), tie


def rebuild(param, rem):
  """bits(param) << 16 + remainder, in NumPy: the master a remainder
  state stands for."""
  high = np.asarray(param).view(np.uint16).astype(np.int64)
  wide = (high << 16) + np.asarray(rem).astype(np.int64)
  return (wide & 0xFFFFFFFF).astype(np.uint32)


def u32(x):
  return np.asarray(x, np.float32).view(np.uint32)


def u16(x):
  return np.asarray(x).view(np.uint16)


# -- 1. The remainder encoding -----------------------------------------------


def test_remainder_encoding_follows_the_bit_rule(variant):
  # Every low half under a few high halves (zero and -0 with their
  # subnormals, even and odd, both signs, and one that rounds to inf),
  # plus random finite masters.
  highs = [0x0000, 0x8000, 0x0001, 0x3F80, 0x3F81, 0xBF80, 0xBF81, 0x7F7F]
  low = np.arange(1 << 16, dtype=np.uint32)
  sweep = [(np.uint32(h) << np.uint32(16)) | low for h in highs]
  rng = np.random.default_rng(0)
  random = rng.integers(0, 1 << 32, 1 << 16, dtype=np.uint32)
  random = random[((random >> np.uint32(23)) & np.uint32(0xFF)) != 0xFF]
  bits = np.concatenate(sweep + [random])
  master = bits.view(np.float32)

  high = rne_high(bits)
  np.testing.assert_array_equal(u16(master.astype(BF16)), high)  # ml_dtypes
  # The cast the param update uses is that rounding too.
  cast = variant(lambda m: m.astype(jnp.bfloat16))(master)
  np.testing.assert_array_equal(u16(cast), high)

  param = high.view(BF16)
  rem = np.asarray(variant(param_update.remainder)(param, master))
  assert rem.dtype == np.int16
  diff = bits.astype(np.int64) - (high.astype(np.int64) << 16)
  np.testing.assert_array_equal(rem, np.minimum(diff, 0x7FFF))

  back = u32(variant(param_update.from_remainder)(param, rem))
  want, tie = rule_rebuilt(bits, high)
  np.testing.assert_array_equal(back, want)
  # Exactly one tie per even high half of the sweep, none elsewhere; the
  # kept value rounds to the same param.
  assert tie[: len(highs) << 16].sum() == sum(h % 2 == 0 for h in highs)
  np.testing.assert_array_equal(rne_high(back), high)
  for zero in (0.0, -0.0):
    z = np.float32(zero)
    rem = param_update.remainder(jnp.bfloat16(zero), jnp.float32(zero))
    assert int(rem) == 0
    got = param_update.from_remainder(jnp.bfloat16(zero), rem)
    assert u32(got) == u32(z)


# -- 2. The remainder run is the MasterWeights run ---------------------------

STEPS = 1000
INF_AT = [7, 48, 89, 500, 501, 502, 503, 777]  # into "v"
NAN_AT = [30, 97, 164, 501, 999]  # into the float32 leaf "b"


def _params():
  rng = np.random.default_rng(1)
  return {
    "v": jnp.asarray(rng.standard_normal(64), jnp.bfloat16),
    "m": jnp.asarray(rng.standard_normal((4, 8)), jnp.bfloat16),
    "b": jnp.asarray(rng.standard_normal(5), jnp.float32),
  }


def _grads(params, scale, t):
  """The gradient of a loss whose targets move with the step `t`, times
  `scale`, in the params' dtypes."""

  def loss(p):
    total = 0.0
    for i, name in enumerate(sorted(p)):
      x = p[name].astype(jnp.float32)
      phase = jnp.arange(x.size, dtype=jnp.float32).reshape(x.shape)
      target = jnp.sin(0.013 * t + 0.37 * phase + i)
      total += 0.5 * jnp.sum((x - target) ** 2)
    return total * scale

  return jax.grad(loss)(params)


def _poison(steps, at):
  out = np.zeros(steps, np.float32)
  out[at] = 1.0
  return out


def _scan_run(tx, params, poison):
  def body(carry, xs):
    params, state = carry
    t, inf, nan = xs
    scale = jmp_train.current_loss_scale(state)
    grads = _grads(params, scale, t.astype(jnp.float32))
    grads["v"] = jnp.where(inf > 0, jnp.inf, grads["v"]).astype(jnp.bfloat16)
    grads["b"] = jnp.where(nan > 0, jnp.nan, grads["b"])
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    return (params, state), (params, state.master_params, state)

  steps = jnp.arange(len(poison[0]))
  _, out = jax.lax.scan(body, (params, tx.init(params)), (steps, *poison))
  return out


def _inner():
  return optax.adamw(1e-2, weight_decay=1e-2)


def _mixed(rule):
  loss_scale = jmp_train.dynamic_loss_scale(2.0**10, growth_interval=8)
  return jmp_train.mixed_precision(
    _inner(), loss_scale=loss_scale, param_update=rule
  )


@pytest.fixture(scope="module")
def remainder_and_master_runs():
  poison = (_poison(STEPS, INF_AT), _poison(STEPS, NAN_AT))
  masters = _mixed(jmp_train.MasterWeights())
  remainders = _mixed(jmp_train.ParamRemainders())
  both = jax.jit(
    lambda p: (_scan_run(masters, p, poison), _scan_run(remainders, p, poison))
  )
  return jax.tree.map(np.asarray, both(_params()))


def test_remainder_run_equals_master_weights_run_bit_for_bit(
  remainder_and_master_runs,
):
  (p_mw, m_mw, s_mw), (p_pr, m_pr, s_pr) = remainder_and_master_runs
  finite = s_mw.last_step_finite
  assert not finite[INF_AT + NAN_AT].any()
  assert finite.sum() > STEPS * 0.9  # mostly real steps
  np.testing.assert_array_equal(s_pr.last_step_finite, finite)
  np.testing.assert_array_equal(
    s_pr.loss_scaler.loss_scale, s_mw.loss_scaler.loss_scale
  )
  assert m_pr["b"] is None and m_mw["b"] is None
  np.testing.assert_array_equal(u32(p_pr["b"]), u32(p_mw["b"]))
  for name in ("v", "m"):
    assert m_pr[name].dtype == np.int16 and m_mw[name].dtype == np.float32
    # The MasterWeights params are their masters rounded to nearest even.
    np.testing.assert_array_equal(u16(p_mw[name]), rne_high(u32(m_mw[name])))
    # At every step (axis 0): the same params, the same masters.
    np.testing.assert_array_equal(u16(p_pr[name]), u16(p_mw[name]))
    np.testing.assert_array_equal(
      rebuild(p_pr[name], m_pr[name]), u32(m_mw[name])
    )


def test_master_weights_run_never_hits_the_unrepresentable_tie(
  remainder_and_master_runs,
):
  # Bit identity is the documented promise only where no kept master is a
  # tie rounded down to an even param (about one master in 2**17); this
  # run keeps 96,000 masters and none is, so the test above can demand it.
  (p_mw, m_mw, _), _ = remainder_and_master_runs
  kept = 0
  for name in ("v", "m"):
    _, tie = rule_rebuilt(u32(m_mw[name]), u16(p_mw[name]))
    assert not tie.any(), np.argwhere(tie)
    kept += tie.size
  assert kept == STEPS * (64 + 32)


def _step(tx):
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(step)


def test_forced_tie_is_kept_one_float32_ulp_toward_zero():
  # Even params and an SGD step of half a bfloat16 ulp away from zero: the
  # new masters are exactly `bits(param) << 16 + 0x8000`.
  start = np.array([1.0, -1.0, 1.5, -0.75, 40.0], BF16)
  away = np.nextafter(start, np.array(np.inf, BF16) * np.sign(start))
  half_ulp = (away.astype(np.float32) - start.astype(np.float32)) / 2
  grads = {"w": jnp.asarray(-half_ulp, jnp.bfloat16)}
  assert np.all(u16(start) % 2 == 0)
  assert np.all(np.asarray(grads["w"], np.float32) == -half_ulp)
  runs = {}
  for rule in (jmp_train.MasterWeights(), jmp_train.ParamRemainders()):
    tx = jmp_train.mixed_precision(optax.sgd(1.0), param_update=rule)
    step = _step(tx)
    params = {"w": jnp.asarray(start)}
    state = tx.init(params)
    trace = []
    # The tie, then one more half-ulp step onto the next bfloat16 value. (A
    # third would land on a tie under an odd param, which the master rounds
    # up and the nudged master down: after the tie the runs are no longer
    # promised to agree.)
    for _ in range(2):
      params, state = step(params, state, grads)
      trace.append((np.asarray(params["w"]), state.master_params["w"]))
    runs[type(rule).__name__] = trace

  for i, ((p_mw, m_mw), (p_pr, rem)) in enumerate(
    zip(runs["MasterWeights"], runs["ParamRemainders"], strict=True)
  ):
    exact = start.astype(np.float64) + (i + 1) * half_ulp.astype(np.float64)
    np.testing.assert_array_equal(u32(m_mw), u32(exact))
    np.testing.assert_array_equal(u16(p_pr), u16(p_mw))
    # One float32 ulp toward zero, from the tie on.
    np.testing.assert_array_equal(rebuild(p_pr, rem), u32(m_mw) - 1)
    if i == 0:
      _, tie = rule_rebuilt(u32(m_mw), u16(p_mw))
      assert tie.all()
      np.testing.assert_array_equal(u16(p_mw), u16(start))
      np.testing.assert_array_equal(np.asarray(rem), 0x7FFF)


# -- 3. Updates below half an ulp -------------------------------------------

TINY_STEPS = 64
TINY_SKIP_AT = [9, 10, 40]
N_PARAMS = 4096


def _tiny_update_runs(dtype, ulp):
  """Params in [1, 2) (one ulp `ulp` throughout) and an SGD update of
  +ulp/16 per step under three rules, with inf gradients at
  TINY_SKIP_AT."""
  k = np.arange(N_PARAMS) % 100
  start = (1.0 + k * ulp).astype(dtype)
  grads = jnp.full(N_PARAMS, -ulp / 16, dtype)
  poison = _poison(TINY_STEPS, TINY_SKIP_AT)
  rules = {
    "nearest": jmp_train.RoundToNearest(),
    "stochastic": jmp_train.StochasticRounding(seed=0),
  }
  if dtype == BF16:  # KahanSummation refuses float16 params
    rules["kahan"] = jmp_train.KahanSummation()
  txs = {
    name: jmp_train.mixed_precision(optax.sgd(1.0), param_update=rule)
    for name, rule in rules.items()
  }

  def run(start):
    def body(carry, bad):
      new = {}
      for name, tx in txs.items():
        params, state = carry[name]
        g = {"w": jnp.where(bad > 0, jnp.inf, grads).astype(dtype)}
        updates, state = tx.update(g, state, params)
        new[name] = (optax.apply_updates(params, updates), state)
      out = {
        name: (p["w"], s.master_params["w"]) for name, (p, s) in new.items()
      }
      return new, out

    init = {}
    for name, tx in txs.items():
      params = {"w": start}
      init[name] = (params, tx.init(params))
    return jax.lax.scan(body, init, poison)[1]

  out = jax.tree.map(np.asarray, jax.jit(run)(jnp.asarray(start)))
  # Plain float32 SGD (lr 1), skipping the same steps.
  f32, p = [], start.astype(np.float32)
  for bad in poison:
    if not bad:
      p = p - np.float32(1.0) * np.float32(-ulp / 16)
    f32.append(p)
  return start, out, np.stack(f32).astype(np.float64)


@pytest.mark.parametrize(
  "dtype, ulp", [(BF16, 2.0**-7), (np.float16, 2.0**-10)], ids=["bf16", "f16"]
)
def test_small_updates_nearest_kahan_stochastic(dtype, ulp):
  start, out, f32 = _tiny_update_runs(dtype, ulp)
  wide = lambda x: np.asarray(x, np.float64)

  nearest, nearest_kept = out["nearest"]
  assert nearest_kept is None
  # Every update is 1/16 ulp, below half an ulp: the param never moves.
  np.testing.assert_array_equal(
    u16(nearest), np.broadcast_to(u16(start), nearest.shape)
  )

  kept = [nearest]
  if dtype == BF16:
    kahan, comp = out["kahan"]
    assert comp.dtype == np.dtype(dtype)
    err = np.abs(wide(kahan) - f32) / ulp
    assert err.max() <= 1.0
    assert err[-1].max() <= 0.5
    assert np.abs(wide(kahan[-1]) - wide(start)).min() >= 3 * ulp  # moved
    kept += [kahan, comp]

  sr, sr_kept = out["stochastic"]
  assert sr_kept is None
  # Each real step rounds a grid value plus ulp/16 up with probability
  # 1/16: an unbiased step of variance ulp**2 * (1/16) * (15/16),
  # independent across params and steps. After n real steps the mean over
  # N_PARAMS params is off float32 training by a sum of such steps with
  # standard deviation ulp * sqrt(n * 15/256 / N_PARAMS); allow 6 of them.
  n = np.cumsum(_poison(TINY_STEPS, TINY_SKIP_AT) == 0)
  bound = 6 * ulp * np.sqrt(n * 15 / 256 / N_PARAMS)
  gap = np.abs((wide(sr) - f32).mean(axis=1))
  assert np.all(gap <= bound), (gap / ulp, bound / ulp)
  assert sr[-1].astype(np.float64).mean() - wide(start).mean() > 3 * ulp

  # A skipped step changes no param and no compensation, bit for bit.
  for t in TINY_SKIP_AT:
    for x in (*kept, sr):
      np.testing.assert_array_equal(u16(x[t]), u16(x[t - 1]))


# -- 4. Which params keep what -----------------------------------------------


@pytest.mark.parametrize(
  "rule", [jmp_train.ParamRemainders(), jmp_train.KahanSummation()]
)
def test_16_bit_rules_refuse_float16_naming_the_leaf(rule):
  """Remainders are the low half of a float32 whose high half is a bfloat16;
  a float16 Kahan carry has no value between 0 and 6e-8 (its smallest
  subnormal, 2**-24), so an update below half of that would be lost on
  every step, which is what the compensation is for."""
  carry = np.float32(2.0**-26)  # a small update, exact in float32
  assert np.float16(carry) == 0 and carry.astype(BF16) == carry
  tx = jmp_train.mixed_precision(optax.sgd(0.1), param_update=rule)
  params = {
    "ok": jnp.ones(2, jnp.bfloat16),
    "enc": {"w": jnp.ones(2, jnp.float16)},
  }
  with pytest.raises(TypeError, match=r"'enc/w'.*float16.*MasterWeights"):
    tx.init(params)
  tx.init({"ok": params["ok"], "b": jnp.ones(2)})  # bfloat16 and float32


@pytest.mark.parametrize(
  "rule, kept",
  [
    (jmp_train.ParamRemainders(), np.int16),
    (jmp_train.KahanSummation(), BF16),
  ],
  ids=["remainders", "kahan"],
)
def test_float32_params_keep_nothing(rule, kept):
  tx = jmp_train.mixed_precision(optax.adam(1e-2), param_update=rule)
  params = {"w": jnp.ones(3, jnp.bfloat16), "b": jnp.ones(2, jnp.float32)}
  grads = {"w": jnp.ones(3, jnp.bfloat16), "b": jnp.ones(2, jnp.float32)}
  step = _step(tx)
  state = tx.init(params)
  for _ in range(2):
    assert state.master_params["b"] is None
    assert state.master_params["w"].dtype == kept
    params, state = step(params, state, grads)
  # The float32 param is trained as plain optax trains it.
  plain = optax.adam(1e-2)
  ref = {"b": jnp.ones(2, jnp.float32)}
  ref_state = plain.init(ref)
  for _ in range(2):
    updates, ref_state = plain.update({"b": grads["b"]}, ref_state, ref)
    ref = optax.apply_updates(ref, updates)
  np.testing.assert_array_equal(u32(params["b"]), u32(ref["b"]))


# -- 5. Checkpoints with and without masters -----------------------------------


def _trained_state(rule):
  tx = jmp_train.mixed_precision(optax.adam(1e-2), param_update=rule)
  rng = np.random.default_rng(2)
  params = {
    "w": jnp.asarray(rng.standard_normal(16), jnp.bfloat16),
    "b": jnp.asarray(rng.standard_normal(3), jnp.float32),
  }
  state = TrainState.create(params=params, tx=tx)
  step = _step(tx)
  params, opt_state = state.params, state.opt_state
  for g in (0.3, 0.1, -0.1):
    grads = jax.tree.map(lambda p, g=g: jnp.full_like(p, g), params)
    params, opt_state = step(params, opt_state, grads)
  return state.replace(step=jnp.int32(3), params=params, opt_state=opt_state)


@pytest.mark.parametrize("with_masters", [True, False])
@pytest.mark.parametrize(
  "rule, kept",
  [
    (jmp_train.ParamRemainders(), np.int16),
    (jmp_train.KahanSummation(), BF16),
  ],
  ids=["remainders", "kahan"],
)
def test_checkpoint_with_and_without_masters(
  tmp_path, rule, kept, with_masters
):
  state = _trained_state(rule)
  assert np.any(np.asarray(state.opt_state.master_params["w"]) != 0)
  with Checkpointer(tmp_path, use_master_weights_in_ckpt=with_masters) as ckpt:
    ckpt.save_state(state)
    ckpt.wait()
    got = ckpt.restore_state(jax.eval_shape(lambda: state))

  def same(a, b):
    assert np.asarray(a).dtype == np.asarray(b).dtype
    np.testing.assert_array_equal(
      np.ravel(a).view(np.uint8), np.ravel(b).view(np.uint8)
    )

  if with_masters:
    jax.tree.map(same, got, state)
    return
  jax.tree.map(same, got.replace(opt_state=None), state.replace(opt_state=None))
  jax.tree.map(same, got.opt_state.inner_state, state.opt_state.inner_state)
  masters = got.opt_state.master_params
  assert masters["b"] is None
  same(masters["w"], np.zeros(16, kept))


# -- 6. adjust_precision -------------------------------------------------------


def test_adjust_precision_turns_masters_into_remainders():
  tx = jmp_train.get_preset("bf16-true").mixed_precision(optax.adam(1e-3))
  rng = np.random.default_rng(3)
  # Masters of every kind: random, ties under even and odd params, exact.
  random = rng.standard_normal(200).astype(np.float32)
  even_tie = u32(np.float32([1.0, -2.5, 0.75])) + np.uint32(0x8000)
  odd_tie = u32(np.float32([1.0078125, -3.015625])) + np.uint32(0x8000)
  bits = np.concatenate([u32(random), even_tie, odd_tie, u32([0.0, -0.0])])
  masters = bits.view(np.float32)
  params = {
    "w": jnp.asarray(masters.astype(BF16)),
    "b": jnp.asarray(random[:3]),
  }
  state = tx.init(params)
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), params)
  _, state = _step(tx)(params, state, grads)  # real inner state and counts
  state = state._replace(master_params={"w": jnp.asarray(masters), "b": None})

  new_params, new_state = jmp_train.adjust_precision(
    params, state, "bf16-remainders", param_dtypes=params
  )
  np.testing.assert_array_equal(u16(new_params["w"]), u16(params["w"]))
  np.testing.assert_array_equal(u32(new_params["b"]), u32(params["b"]))
  rem = new_state.master_params["w"]
  assert rem.dtype == jnp.int16 and new_state.master_params["b"] is None
  want, tie = rule_rebuilt(bits, rne_high(bits))
  assert tie.sum() == len(even_tie)
  np.testing.assert_array_equal(rebuild(new_params["w"], rem), want)
  jax.tree.map(
    np.testing.assert_array_equal, new_state.inner_state, state.inner_state
  )
  assert int(new_state.steps) == int(state.steps) == 1

  with pytest.raises(ValueError, match="state_formats"):
    jmp_train.adjust_precision(params, state, "bf16-lean")
