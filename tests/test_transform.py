"""mixed_precision against plain optax runs, NumPy references and the rules."""

import contextlib
import json
import re
import subprocess
import sys

import _child_env
import _numpy_rules
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jmp_train

OPTIMIZERS = {
  "adam": lambda: optax.adam(1e-2),
  "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
  "clip_adamw": lambda: optax.chain(
    optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=0.1)
  ),
  "lion_schedule": lambda: optax.lion(optax.linear_schedule(1e-3, 1e-4, 10)),
}


def init_params(key=0, dtype=jnp.float32):
  k1, k2, k3 = jax.random.split(jax.random.key(key), 3)
  params = {
    "w1": jax.random.normal(k1, (6, 16)) * 0.3,
    "b1": jnp.zeros(16),
    "w2": jax.random.normal(k2, (16, 3)) * 0.3,
    "scale": jax.random.uniform(k3, (3,)) + 0.5,
  }
  return jax.tree.map(lambda x: x.astype(dtype), params)


def loss_fn(params, x, y):
  p = jax.tree.map(lambda a: a.astype(jnp.float32), params)
  h = jnp.tanh(x @ p["w1"] + p["b1"])
  return jnp.mean(((h @ p["w2"]) * p["scale"] - y) ** 2)


def batches(n, seed=0):
  rng = np.random.default_rng(seed)
  return [
    (
      rng.standard_normal((8, 6)).astype(np.float32),
      rng.standard_normal((8, 3)).astype(np.float32),
    )
    for _ in range(n)
  ]


def make_step(tx):
  """A jitted train step that differentiates the scaled loss."""

  def ours(params, state, x, y, poison):
    scale = jmp_train.current_loss_scale(state)
    grads = jax.grad(lambda p: loss_fn(p, x, y) * scale)(params)
    grads = jax.tree.map(lambda g: g + poison.astype(g.dtype), grads)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(ours)


def assert_close(a, b):
  """Two compiled programs may fuse float ops differently (FMA): a few ulps
  of the params' scale (about 0.3 here, where an ulp is 3e-8)."""
  chex.assert_trees_all_close(a, b, rtol=1e-6, atol=3e-7)


def poison_value(kind):
  return {"ok": 0.0, "inf": np.inf, "nan": np.nan}[kind]


def probe(report):
  """An inner 'optimizer' that keeps what it was given (grads or params) as
  its state and returns zero updates."""

  def update(grads, state, params):
    seen = grads if report == "grads" else params
    return jax.tree.map(jnp.zeros_like, grads), seen

  return optax.GradientTransformation(lambda params: params, update)


@pytest.mark.parametrize("scale", [2.0**12, 2.0**-3, 2.0**40])
def test_inner_sees_exactly_the_unscaled_grads_and_float32_params(
  scale, variant
):
  # Power-of-two scales make scaling exact: the inner optimizer must get the
  # gradients of the unscaled loss bit for bit, in float32.
  x, y = batches(1)[0]
  full = lambda tree: jax.tree.map(lambda a: a.astype(jnp.float32), tree)
  for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
    params = init_params(dtype=dtype)
    scaled = jax.grad(lambda p: loss_fn(p, x, y) * scale)(params)
    want = jax.tree.map(lambda g: g.astype(jnp.float32) / scale, scaled)
    tx = jmp_train.mixed_precision(
      probe("grads"),
      loss_scale=jmp_train.StaticLossScale(scale),
      param_update=jmp_train.RoundToNearest(),
    )
    _, state = variant(tx.update)(scaled, tx.init(params), params)
    if not jmp_train.all_finite(scaled):  # float16 at 2**40: overflow
      assert not bool(state.last_step_finite)
      chex.assert_trees_all_equal(state.inner_state, params)  # untouched
      continue
    chex.assert_trees_all_equal(state.inner_state, want)
    chex.assert_trees_all_equal_dtypes(state.inner_state, full(want))
    if dtype == jnp.float32:  # exactly plain jax.grad of the unscaled loss
      chex.assert_trees_all_equal(
        state.inner_state, jax.grad(loss_fn)(params, x, y)
      )
    # And float32 params: the masters where params are low precision.
    tx = jmp_train.mixed_precision(probe("params"))
    _, state = variant(tx.update)(scaled, tx.init(params), params)
    chex.assert_trees_all_equal(state.inner_state, full(params))
    chex.assert_trees_all_equal_dtypes(state.inner_state, full(params))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_finite_steps_equal_plain_optax(name):
  inner = OPTIMIZERS[name]()
  tx = jmp_train.mixed_precision(
    OPTIMIZERS[name](),
    loss_scale=jmp_train.dynamic_loss_scale(2.0**12, growth_interval=3),
  )
  ours = make_step(tx)
  params = ref = init_params()
  state, ref_state = tx.init(params), inner.init(ref)

  @jax.jit
  def plain(p, s, x, y):
    grads = jax.grad(loss_fn)(p, x, y)
    updates, s = inner.update(grads, s, p)
    return optax.apply_updates(p, updates), s

  for x, y in batches(6):
    params, state = ours(params, state, x, y, jnp.float32(0))
    ref, ref_state = plain(ref, ref_state, x, y)
  assert_close(params, ref)
  assert_close(state.inner_state, ref_state)
  assert int(state.skipped_steps) == 0 and int(state.steps) == 6
  assert float(jmp_train.current_loss_scale(state)) == 2.0**14  # grew twice


@pytest.mark.parametrize("params_dtype", [jnp.float32, jnp.bfloat16])
def test_fault_injection_skips_exactly_the_bad_steps(params_dtype):
  rng = np.random.default_rng(7)
  kinds = rng.choice(["ok", "ok", "ok", "inf", "nan"], size=30)
  inner = optax.adam(1e-2)
  tx = jmp_train.mixed_precision(
    optax.adam(1e-2),
    loss_scale=jmp_train.dynamic_loss_scale(2.0**10, growth_interval=4),
  )
  ours = make_step(tx)
  params = init_params(dtype=params_dtype)
  state = tx.init(params)
  data = batches(len(kinds), seed=1)
  finite_grads = []
  for (x, y), kind in zip(data, kinds, strict=True):
    before_p, before_s = params, state
    params, state = ours(params, state, x, y, jnp.float32(poison_value(kind)))
    if kind != "ok":
      # Params, inner state and master weights bit-identical on a skipped step.
      chex.assert_trees_all_equal(params, before_p)
      chex.assert_trees_all_equal(state.inner_state, before_s.inner_state)
      chex.assert_trees_all_equal(state.master_params, before_s.master_params)
      assert not bool(state.last_step_finite)
    else:
      finite_grads.append(jax.grad(loss_fn)(before_p, x, y))
      assert bool(state.last_step_finite)
  assert int(state.skipped_steps) == int((kinds != "ok").sum())
  assert int(state.steps) == len(kinds)

  if params_dtype == jnp.float32:
    # The finite steps alone, through plain optax, give the same params.
    ref, ref_state = init_params(), inner.init(init_params())
    for g in finite_grads:
      updates, ref_state = inner.update(g, ref_state, ref)
      ref = optax.apply_updates(ref, updates)
    assert_close(params, ref)
    assert_close(state.inner_state, ref_state)


def test_skipped_step_keeps_negative_zero_and_nan_params_bit_identical():
  params = {
    "w": jnp.array([-0.0, 0.0, 1.5, -2.0, np.nan], jnp.float32),
    "h": jnp.array([-0.0, 1.0], jnp.bfloat16),
  }
  tx = jmp_train.mixed_precision(optax.sgd(0.1))
  state = tx.init(params)
  grads = {
    "w": jnp.array([1.0, np.inf, 1.0, 1.0, 1.0]),
    "h": jnp.ones(2, jnp.bfloat16),
  }
  updates, state = jax.jit(tx.update)(grads, state, params)
  new = optax.apply_updates(params, updates)
  for k in params:
    np.testing.assert_array_equal(
      np.asarray(new[k]).view(np.uint16 if k == "h" else np.uint32),
      np.asarray(params[k]).view(np.uint16 if k == "h" else np.uint32),
    )


@pytest.mark.parametrize("params_dtype", [jnp.bfloat16, jnp.float16])
def test_master_weights_follow_float32_optax_and_params_are_their_cast(
  params_dtype, variant
):
  # The inner optimizer sees float32 grads and float32 masters: the masters
  # must evolve like plain optax on float32 params with those grads.
  inner = optax.adamw(3e-3, weight_decay=0.01)
  tx = jmp_train.mixed_precision(optax.adamw(3e-3, weight_decay=0.01))
  params32 = init_params(3)
  params = jax.tree.map(lambda x: x.astype(params_dtype), params32)
  state = tx.init(params)
  masters = state.master_params
  chex.assert_trees_all_equal_dtypes(masters, params32)
  ref, ref_state = masters, inner.init(masters)
  update = variant(tx.update)
  rng = np.random.default_rng(0)
  for _ in range(8):
    grads = jax.tree.map(
      lambda p: jnp.asarray(rng.standard_normal(p.shape), params_dtype), params
    )
    updates, state = update(grads, state, params)
    chex.assert_trees_all_equal_dtypes(
      updates, jax.tree.map(lambda p: p.astype(jnp.float32), params)
    )
    params = optax.apply_updates(params, updates)
    r_updates, ref_state = inner.update(
      jax.tree.map(lambda g: g.astype(jnp.float32), grads), ref_state, ref
    )
    ref = optax.apply_updates(ref, r_updates)
    assert_close(state.master_params, ref)
    # After apply_updates, params == cast(master), bit for bit, always.
    chex.assert_trees_all_equal(
      params,
      jax.tree.map(lambda m: m.astype(params_dtype), state.master_params),
    )
    chex.assert_trees_all_equal_dtypes(
      params, jax.tree.map(lambda m: m.astype(params_dtype), ref)
    )


def test_master_weights_matter_for_updates_below_half_an_ulp():
  # bf16 has 8 significant bits: at 1.0 half an ulp is 2**-8 ~ 0.0039. SGD
  # steps of 1e-4 vanish when added to bf16 params, not to float32 masters.
  lr, steps = 1e-4, 1000
  params32 = {"w": jnp.ones(4, jnp.float32)}
  params16 = {"w": jnp.ones(4, jnp.bfloat16)}

  def train(tx, params):
    state = tx.init(params)

    def body(carry, _):
      p, s = carry
      grads = jax.tree.map(jnp.ones_like, p)
      updates, s = tx.update(grads, s, p)
      return (optax.apply_updates(p, updates), s), None

    (params, state), _ = jax.jit(lambda c: jax.lax.scan(body, c, length=steps))(
      (params, state)
    )
    return params, state

  float32_run, _ = train(optax.sgd(lr), params32)
  with_master, state = train(jmp_train.mixed_precision(optax.sgd(lr)), params16)
  without, _ = train(
    jmp_train.mixed_precision(
      optax.sgd(lr), param_update=jmp_train.RoundToNearest()
    ),
    params16,
  )
  np.testing.assert_allclose(float32_run["w"], 1 - lr * steps, rtol=1e-4)
  np.testing.assert_array_equal(state.master_params["w"], float32_run["w"])
  np.testing.assert_array_equal(
    with_master["w"], float32_run["w"].astype(jnp.bfloat16)
  )
  assert float(with_master["w"][0]) == pytest.approx(0.9, abs=2**-8)
  np.testing.assert_array_equal(without["w"], params16["w"])  # frozen at 1.0


def test_master_weights_only_for_low_precision_floats():
  params = {
    "bf": jnp.ones(2, jnp.bfloat16),
    "f16": jnp.ones(2, jnp.float16),
    "f32": jnp.ones(2),
    "i": jnp.arange(2),
  }
  masked = lambda x: x is None  # a param that keeps nothing
  masters = lambda **kw: (  # noqa: E731
    jmp_train.mixed_precision(optax.sgd(1.0), **kw).init(params).master_params
  )
  for m in (masters(), masters(param_update=jmp_train.MasterWeights())):
    assert m["bf"].dtype == jnp.float32 and m["f16"].dtype == jnp.float32
    assert masked(m["f32"]) and masked(m["i"])
  for rule in (jmp_train.RoundToNearest(), jmp_train.StochasticRounding(1)):
    assert all(masked(v) for v in masters(param_update=rule).values())
  f32_only = jmp_train.mixed_precision(optax.adam(1.0)).init({"w": jnp.ones(2)})
  assert jax.tree.leaves(f32_only.master_params) == []


def test_integer_and_bool_leaves_pass_through_and_are_hidden_from_inner(
  variant,
):
  params = {
    "w": jnp.ones(3),
    "step": jnp.int32(5),
    "mask": jnp.array([True]),
    "h": jnp.ones(2, jnp.bfloat16),
  }
  tx = jmp_train.mixed_precision(optax.adam(0.1))
  state = tx.init(params)
  assert isinstance(state.inner_state[0].mu["step"], optax.MaskedNode)
  assert isinstance(state.inner_state[0].nu["mask"], optax.MaskedNode)
  grads = {
    "w": jnp.ones(3),
    "step": np.zeros((), jax.dtypes.float0),
    "mask": np.zeros((1,), jax.dtypes.float0),
    "h": jnp.ones(2, jnp.bfloat16),
  }
  updates, state = variant(tx.update)(grads, state, params)
  new = optax.apply_updates(params, updates)
  assert new["step"].dtype == jnp.int32 and int(new["step"]) == 5
  assert new["mask"].dtype == jnp.bool_ and bool(new["mask"][0])
  assert float(new["w"][0]) == pytest.approx(0.9)


def test_multisteps_inside_skips_an_overflowing_micro_step_and_recovers():
  # mixed_precision(optax.MultiSteps(...)): each micro-step's gradients are
  # unscaled and checked before MultiSteps adds them up. The micro-step that
  # overflows is skipped (MultiSteps' accumulator keeps its bits, the scale
  # halves) and the window goes on: what plain MultiSteps computes when that
  # micro-step is left out. (The other order never recovers: refused below.)
  k, bad = 3, 2
  inner = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=k)
  tx = jmp_train.mixed_precision(
    optax.MultiSteps(optax.adam(1e-2), every_k_schedule=k),
    loss_scale=jmp_train.dynamic_loss_scale(2.0**8),
  )
  ours = make_step(tx)
  params = ref = init_params()
  state, ref_state = tx.init(params), inner.init(ref)
  for i, (x, y) in enumerate(batches(3 * k + 1)):
    before = jax.tree.leaves(state.inner_state)
    poison = jnp.float32(np.inf if i == bad else 0.0)
    params, state = ours(params, state, x, y, poison)
    if i == bad:
      for a, b in zip(before, jax.tree.leaves(state.inner_state), strict=True):
        np.testing.assert_array_equal(a, b)
      continue
    g = jax.grad(loss_fn)(ref, x, y)
    updates, ref_state = inner.update(g, ref_state, ref)
    ref = optax.apply_updates(ref, updates)
  # Three windows of k finite micro-steps: three Adam updates, as plain's.
  assert int(ref_state.gradient_step) == 3
  assert int(state.inner_state.gradient_step) == 3
  assert_close(params, ref)
  metrics = jmp_train.train_metrics(state)
  assert int(metrics["steps"]) == 3 * k + 1  # it counts micro-steps
  assert int(metrics["skipped_steps"]) == 1
  assert float(jmp_train.current_loss_scale(state)) == 2.0**7


def test_inside_chain_with_inject_hyperparams_and_extra_args():
  inner = optax.chain(
    optax.inject_hyperparams(optax.adam)(learning_rate=0.1),
    optax.contrib.reduce_on_plateau(
      factor=0.5, patience=0, cooldown=0, accumulation_size=1
    ),
  )
  tx = optax.chain(
    jmp_train.mixed_precision(inner, loss_scale=jmp_train.StaticLossScale(4.0))
  )
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  assert float(jmp_train.current_loss_scale(state)) == 4.0
  update = jax.jit(tx.update)
  for value in [1.0, 2.0, 3.0]:  # a worsening loss: the plateau rule fires
    grads = {"w": jnp.full(2, 4.0)}  # scaled: unscaled gradient is 1
    updates, state = update(grads, state, params, value=jnp.float32(value))
  plateau = optax.tree.get(state, "scale")
  assert float(plateau) < 1.0  # `value` reached reduce_on_plateau
  assert float(optax.tree.get(state, "learning_rate")) == pytest.approx(0.1)
  metrics = jmp_train.train_metrics(state)
  assert int(metrics["steps"]) == 3
  # Our state's field names are unique in the chain: optax.tree.get finds them.
  assert int(optax.tree.get(state, "skipped_steps")) == 0
  assert float(optax.tree.get(state, "loss_scaler").loss_scale) == 4.0


def test_contract_shapes_no_recompile_and_types_preserved():
  tx = jmp_train.mixed_precision(
    optax.adam(1e-3), loss_scale=jmp_train.dynamic_loss_scale()
  )
  params = init_params(dtype=jnp.bfloat16)
  params["count"] = jnp.int32(0)
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params
  )
  state_shape = jax.eval_shape(tx.init, abstract)
  state = tx.init(params)
  chex.assert_trees_all_equal_shapes_and_dtypes(state, state_shape)

  traces = []

  @jax.jit
  def step(params, state, grads):
    traces.append(1)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  grads = jax.tree.map(
    lambda p: (
      jnp.ones_like(p)
      if jnp.issubdtype(p.dtype, jnp.floating)
      else np.zeros(p.shape, jax.dtypes.float0)
    ),
    params,
  )
  new_params, new_state = step(params, state, grads)
  new_params, new_state = step(new_params, new_state, grads)
  assert len(traces) == 1
  assert jax.tree.map(jax.typeof, new_params) == jax.tree.map(
    jax.typeof, params
  )
  assert jax.tree.map(jax.typeof, new_state) == jax.tree.map(jax.typeof, state)


def test_sharded_params_global_predicate_and_types_under_jit():
  mesh = jax.make_mesh(
    (8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,)
  )
  shard = NamedSharding(mesh, P("data"))
  repl = NamedSharding(mesh, P())
  params = {
    "w": jax.device_put(jnp.ones((64, 4), jnp.bfloat16), shard),
    "b": jax.device_put(jnp.zeros(4, jnp.float32), repl),
  }
  tx = jmp_train.mixed_precision(
    optax.adam(1e-2), loss_scale=jmp_train.dynamic_loss_scale(8.0)
  )
  state = jax.jit(tx.init)(params)
  step = jax.jit(lambda g, s, p: tx.update(g, s, p))
  host = np.ones((64, 4), np.float32)
  host[63, 3] = np.inf  # a single element, on the last device
  bad = {
    "w": jax.device_put(host.astype(jnp.bfloat16), shard),
    "b": jax.device_put(jnp.ones(4), repl),
  }
  updates, state1 = step(bad, state, params)
  assert not bool(state1.last_step_finite)
  assert float(jmp_train.current_loss_scale(state1)) == 4.0
  new = optax.apply_updates(params, updates)
  chex.assert_trees_all_equal(new, params)
  good = {
    "w": jax.device_put(jnp.ones((64, 4), jnp.bfloat16), shard),
    "b": jax.device_put(jnp.ones(4), repl),
  }
  updates, state2 = step(good, state1, params)
  assert bool(state2.last_step_finite)
  assert jax.tree.map(jax.typeof, state2) == jax.tree.map(jax.typeof, state)
  assert state2.master_params["w"].sharding.is_equivalent_to(shard, 2)
  # The unscaled global grad norm: sqrt(sum of (g / 4)**2) over all shards.
  want = np.sqrt((64 * 4 + 4) * (1 / 4.0) ** 2)
  np.testing.assert_allclose(float(state2.grad_norm), want, rtol=1e-6)


def test_train_metrics_against_numpy(variant):
  tx = jmp_train.mixed_precision(
    optax.sgd(0.1), loss_scale=jmp_train.dynamic_loss_scale(2.0**10)
  )
  params = init_params(dtype=jnp.float16)
  state = tx.init(params)
  rng = np.random.default_rng(3)
  grads = jax.tree.map(
    lambda p: jnp.asarray(rng.standard_normal(p.shape) * 50, jnp.float16),
    params,
  )
  _, state = variant(tx.update)(grads, state, params)
  metrics = variant(jmp_train.train_metrics)(state)
  want = np.sqrt(
    sum(
      np.sum((np.asarray(g, np.float64) / 2**10) ** 2)
      for g in jax.tree.leaves(grads)
    )
  )
  np.testing.assert_allclose(float(metrics["grad_norm"]), want, rtol=1e-6)
  assert metrics["grad_norm"].dtype == jnp.float32
  assert float(metrics["loss_scale"]) == 2.0**10
  assert int(metrics["steps"]) == 1 and int(metrics["skipped_steps"]) == 0
  assert bool(metrics["last_step_finite"])
  assert int(metrics["skip_streak"]) == 0
  assert set(metrics) == {
    "loss_scale",
    "steps",
    "skipped_steps",
    "last_step_finite",
    "grad_norm",
    "skip_streak",
  }


def test_loss_scale_adjusts_like_the_scaler_inside_update():
  sequence = [True, True, False, True, True, True, False, False]
  scaler = jmp_train.dynamic_loss_scale(
    2.0**10, growth_interval=2, hysteresis=2
  )
  tx = jmp_train.mixed_precision(optax.sgd(0.1), loss_scale=scaler)
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  for finite in sequence:
    grads = {"w": jnp.ones(2) if finite else jnp.array([1.0, np.nan])}
    _, state = update(grads, state, params)
    scaler = scaler.adjust(jnp.bool_(finite))
    assert float(jmp_train.current_loss_scale(state)) == float(
      scaler.loss_scale
    )
  assert int(state.skipped_steps) == 3


def test_bad_input_raises_clear_errors():
  tx = jmp_train.mixed_precision(optax.sgd(0.1))
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  with pytest.raises(ValueError, match="needs params"):
    tx.update({"w": jnp.ones(2)}, state)
  with pytest.raises(ValueError, match="same tree structure"):
    tx.update({"v": jnp.ones(2)}, state, params)
  with pytest.raises(TypeError, match="loss_scale must be"):
    jmp_train.mixed_precision(optax.sgd(0.1), loss_scale="dynamic")
  with pytest.raises(TypeError, match="param_update must be .*got 'yes'"):
    jmp_train.mixed_precision(optax.sgd(0.1), param_update="yes")
  with pytest.raises(TypeError, match="master_weights"):  # the old keyword
    jmp_train.mixed_precision(optax.sgd(0.1), master_weights=False)
  with pytest.raises(ValueError, match="found 0"):
    jmp_train.current_loss_scale(optax.adam(1.0).init(params))
  two = optax.chain(
    jmp_train.mixed_precision(optax.sgd(1.0)),
    jmp_train.mixed_precision(optax.sgd(1.0)),
  )
  with pytest.raises(ValueError, match="found 2"):
    jmp_train.train_metrics(two.init(params))
  # A number means a static scale.
  static = jmp_train.mixed_precision(optax.sgd(0.1), loss_scale=128.0)
  assert float(jmp_train.current_loss_scale(static.init(params))) == 128.0


def test_huge_finite_grads_are_applied_not_skipped(variant):
  # Their squares overflow float32 (the squared norm is +inf), yet they are
  # finite, so the step is applied; only a non-finite entry (NaN) skips it.
  params = {"w": jnp.zeros(3), "b": jnp.zeros(2, jnp.bfloat16)}
  tx = jmp_train.mixed_precision(optax.sgd(1.0))
  grads = {"w": jnp.array([1e20, -3e30, 1.0]), "b": jnp.ones(2, jnp.bfloat16)}
  updates, state = variant(tx.update)(grads, tx.init(params), params)
  assert bool(state.last_step_finite) and int(state.skipped_steps) == 0
  np.testing.assert_array_equal(updates["w"], -np.float32([1e20, -3e30, 1.0]))
  assert float(state.grad_norm) == np.inf  # the norm itself overflows float32
  grads["w"] = jnp.array([1e20, -np.inf, 1.0])
  _, state = variant(tx.update)(grads, tx.init(params), params)
  assert not bool(state.last_step_finite) and int(state.skipped_steps) == 1
  assert np.isnan(float(state.grad_norm))


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("where", ["w", "b"])
def test_one_non_finite_entry_anywhere_skips(bad, where):
  # float32 and bfloat16 leaves; one bad entry among finite ones, which are
  # large enough that their squares alone sum to +inf in float32.
  params = {"w": jnp.zeros(4), "b": jnp.zeros(3, jnp.bfloat16)}
  tx = jmp_train.mixed_precision(optax.sgd(1.0))
  grads = {
    "w": jnp.array([3e19, 3e19, 1.0, 0.0]),
    "b": jnp.array([1e30, 0.0, -2.0], jnp.bfloat16),
  }
  _, state = jax.jit(tx.update)(grads, tx.init(params), params)
  assert bool(state.last_step_finite)
  grads[where] = grads[where].at[2].set(bad)
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  assert not bool(state.last_step_finite) and int(state.skipped_steps) == 1
  for u in jax.tree.leaves(updates):  # -0.0 everywhere: params unchanged
    assert np.all(np.asarray(u, np.float32) == 0) and np.all(np.signbit(u))


# --- Composition, hyperparameter injection and exactness near zero ---------


def assert_refused(opt_state, fix=r"mixed_precision\("):
  """Both readers of the state refuse it, naming the layout that works."""
  for read in (jmp_train.current_loss_scale, jmp_train.train_metrics):
    with pytest.raises(ValueError, match=rf"outermost.*{fix}"):
      read(opt_state)


def test_chain_around_mixed_precision_is_refused_with_the_fix():
  params = {"w": jnp.ones(2)}
  sgd = lambda: jmp_train.mixed_precision(optax.sgd(0.1))  # noqa: E731
  wrong = {
    "clip before": optax.chain(optax.clip_by_global_norm(1.0), sgd()),
    "scale after": optax.chain(sgd(), optax.scale(0.5)),
    "named_chain": optax.named_chain(("clip", optax.clip(1.0)), ("mp", sgd())),
    "hand-written": optax.chain(
      optax.GradientTransformation(lambda p: (), lambda u, s, p=None: (u, s)),
      sgd(),
    ),
  }
  for name, tx in wrong.items():
    assert_refused(tx.init(params))
    assert name  # every wrong order is caught where the state is read
  fine = [
    optax.chain(sgd()),
    optax.named_chain(("mp", sgd())),
    optax.inject_hyperparams(jmp_train.mixed_precision)(optax.sgd(0.1)),
    # Inside it, optax's wrappers see unscaled float32 gradients.
    jmp_train.mixed_precision(optax.MultiSteps(optax.sgd(0.1), 2)),
    jmp_train.mixed_precision(optax.masked(optax.sgd(0.1), {"w": True})),
    # A masked step's updates are zeros and the inner state passes through.
    optax.conditionally_mask(sgd(), lambda step: step % 2 == 0),
  ]
  for tx in fine:
    assert float(jmp_train.current_loss_scale(tx.init(params))) == 1.0
  # Containers of a user's own beside the state are not chains.
  state = sgd().init(params)
  for mine in ({"opt": state, "ema": params}, (state, 0), (0, state)):
    assert float(jmp_train.current_loss_scale(mine)) == 1.0


# optax wrappers around mixed_precision that hand some leaves' scaled
# gradients on (masked-out leaves, another group, an untransformed step): the
# wrapper, and the layout the message gives.
SCALED_THROUGH = {
  "masked": (
    lambda tx: optax.masked(tx, {"w": True, "b": False}),
    r"mixed_precision\(optax.masked\(",
  ),
  "partition": (
    lambda tx: optax.partition(
      {"a": tx, "b": optax.sgd(0.1)}, {"w": "a", "b": "b"}
    ),
    r"mixed_precision\(optax.partition\(",
  ),
  "conditionally_transform": (
    lambda tx: optax.conditionally_transform(tx, lambda step: step >= 1),
    r"mixed_precision\(optax.conditionally_transform\(",
  ),
}


@pytest.mark.parametrize("name", sorted(SCALED_THROUGH))
def test_a_wrapper_that_hands_scaled_gradients_on_is_refused(name):
  wrap, fix = SCALED_THROUGH[name]
  scale = 2.0**8
  mp = jmp_train.mixed_precision(
    optax.sgd(0.1), loss_scale=jmp_train.StaticLossScale(scale)
  )
  tx, plain = wrap(mp), wrap(optax.sgd(0.1))
  params = {"w": jnp.ones(2), "b": jnp.ones(2)}
  grads = {"w": jnp.full(2, 0.5), "b": jnp.full(2, -0.25)}
  state = tx.init(params)
  # Past the check: leaf b's update is plain optax's times the loss scale.
  scaled = jax.tree.map(lambda g: g * scale, grads)
  updates, _ = tx.update(scaled, state, params)
  want, _ = plain.update(grads, plain.init(params), params)
  np.testing.assert_array_equal(updates["b"], scale * want["b"])
  assert_refused(state, fix)


@pytest.mark.parametrize("chained", [False, True])
def test_multisteps_outside_is_refused_with_the_layout_that_works(chained):
  mp = jmp_train.mixed_precision(optax.sgd(0.1))
  if chained:  # the wrapper is named even when a chain is wrong inside it
    mp = optax.chain(optax.clip_by_global_norm(1.0), mp)
  state = optax.MultiSteps(mp, every_k_schedule=2).init({"w": jnp.ones(2)})
  assert_refused(state, r"mixed_precision\(optax.MultiSteps\(")


def test_apply_if_finite_outside_delays_the_backoff_and_is_refused():
  # optax.apply_if_finite keeps the first max_consecutive_errors overflows
  # from mixed_precision: its scale stays, its skip count misses them.
  tx = optax.apply_if_finite(
    jmp_train.mixed_precision(
      optax.sgd(0.1), loss_scale=jmp_train.dynamic_loss_scale(2.0**8)
    ),
    max_consecutive_errors=2,
  )
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  scales = []
  for _ in range(4):
    _, state = tx.update({"w": jnp.full(2, jnp.inf)}, state, params)
    scales.append(float(state.inner_state.loss_scaler.loss_scale))
  assert scales == [2.0**8, 2.0**8, 2.0**7, 2.0**6]  # torch's: 128 at once
  assert int(state.inner_state.skipped_steps) == 2  # of 4
  assert_refused(state, "drop apply_if_finite")


def test_lookahead_outside_moves_params_on_a_skipped_step_and_is_refused():
  # float32 params (no masters): step 0 is finite, step 1 overflows and is
  # skipped, but it ends lookahead's sync period, and the sync moves the
  # fast params to slow + 0.5 * (fast - slow) all the same.
  mp = jmp_train.mixed_precision(
    optax.sgd(1.0), loss_scale=jmp_train.dynamic_loss_scale(2.0**8)
  )
  tx = optax.lookahead(mp, sync_period=2, slow_step_size=0.5)
  params = optax.LookaheadParams.init_synced({"w": jnp.ones(2)})
  state = tx.init(params)
  for grad in (2.0**8 * 0.25, np.inf):
    updates, state = tx.update({"w": jnp.full(2, grad)}, state, params)
    params = optax.apply_updates(params, updates)
  assert not bool(state.fast_state.last_step_finite)
  # By hand: the finite step took w to 1 - 0.25; the sync halves the way back.
  np.testing.assert_array_equal(params.fast["w"], [0.875, 0.875])
  assert_refused(state, "lookahead.*not supported")
  # bf16 params with float32 masters: the next step rebuilds the params from
  # masters that never saw the sync, undoing it.
  # Plain optax in float32 (every value here is exact in bfloat16 too).
  runs = {}
  for name, dtype, inner in (
    ("plain", jnp.float32, optax.sgd(1.0)),
    ("mixed", jnp.bfloat16, jmp_train.mixed_precision(optax.sgd(1.0))),
  ):
    tx = optax.lookahead(inner, sync_period=1, slow_step_size=0.5)
    params = optax.LookaheadParams.init_synced({"w": jnp.ones(2, dtype)})
    state = tx.init(params)
    for _ in range(2):
      grads = {"w": jnp.full(2, 0.25, dtype)}
      updates, state = tx.update(grads, state, params)
      params = optax.apply_updates(params, updates)
    runs[name] = (params, state)
  # 1 -> 0.875 after the first synced step, then 0.875 + 0.5 * (0.625 -
  # 0.875) = 0.75; the masters went 1 -> 0.75 -> 0.5, so the second step
  # started from 0.75, not 0.875: 0.875 + 0.5 * (0.5 - 0.875) = 0.6875.
  np.testing.assert_array_equal(runs["plain"][0].fast["w"], [0.75, 0.75])
  params, state = runs["mixed"]
  np.testing.assert_array_equal(state.fast_state.master_params["w"], [0.5] * 2)
  np.testing.assert_array_equal(params.fast["w"].astype(float), [0.6875] * 2)
  assert_refused(state, "lookahead.*not supported")


def test_conditionally_mask_outside_leaves_everything_on_masked_steps():
  mp = jmp_train.mixed_precision(
    optax.adam(0.1), loss_scale=jmp_train.dynamic_loss_scale(2.0**8)
  )
  tx = optax.conditionally_mask(mp, lambda step: step != 1)
  # Below float32, optax's cond refuses our float32 deltas beside its zeros
  # in the gradients' dtype: an error, not a wrong result.
  half = {"w": jnp.ones(3, jnp.bfloat16)}
  with pytest.raises(TypeError, match="dtypes do not match"):
    tx.update(half, tx.init(half), half)
  params = {"w": jnp.ones(3)}
  state = tx.init(params)
  for i, grad in enumerate((1.0, 3.0, np.inf)):
    before = (params, state.inner_state)
    grads = {"w": jnp.full(3, 2.0**8 * grad)}
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    if i == 1:  # masked: nothing moved, not even the counters
      chex.assert_trees_all_equal((params, state.inner_state), before)
  assert jmp_train.train_metrics(state)["steps"] == 2  # steps 0 and 2
  assert jmp_train.train_metrics(state)["skipped_steps"] == 1  # the inf
  assert float(jmp_train.current_loss_scale(state)) == 2.0**7


def test_multisteps_outside_never_recovers_from_one_overflow():
  # Why optax.MultiSteps(mixed_precision(...)) is refused, run by hand (the
  # scale read off the state, past the check): optax resets its accumulator
  # as (1 - emit) * acc, so the overflowing window leaves NaN behind, and
  # every later window is skipped though its gradients are finite. If optax
  # resets with a select one day, this fails: the refusal can then go.
  mp = jmp_train.mixed_precision(
    optax.sgd(0.1), loss_scale=jmp_train.dynamic_loss_scale(2.0**8)
  )

  def run(tx):
    """8 micro-steps of `tx`, the first with an inf gradient."""

    @jax.jit
    def step(params, state, x, y, poison):
      scale = state.inner_opt_state.loss_scaler.loss_scale
      grads = jax.grad(lambda p: loss_fn(p, x, y) * scale)(params)
      grads = jax.tree.map(lambda g: g + poison, grads)
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    params = init_params()
    state = tx.init(params)
    for i, (x, y) in enumerate(batches(8)):
      poison = jnp.float32(np.inf if i == 0 else 0.0)
      params, state = step(params, state, x, y, poison)
    return params, state

  params, state = run(optax.MultiSteps(mp, every_k_schedule=2))
  for acc in jax.tree.leaves(state.acc_grads):
    assert np.all(np.isnan(acc))
  inner = state.inner_opt_state
  assert int(inner.steps) == int(inner.skipped_steps) == 4  # every window
  assert float(inner.loss_scaler.loss_scale) == 2.0**4
  for a, b in zip(
    jax.tree.leaves(params), jax.tree.leaves(init_params()), strict=True
  ):
    np.testing.assert_array_equal(a, b)  # never trained
  # optax's own remedy, should_skip_update_fn=skip_not_finite, drops the
  # overflowing micro-step before mixed_precision sees it: the accumulator
  # stays finite, but the scale never backs off (no skip is counted).
  _, state = run(
    optax.MultiSteps(
      mp, every_k_schedule=2, should_skip_update_fn=optax.skip_not_finite
    )
  )
  assert all(np.all(np.isfinite(a)) for a in jax.tree.leaves(state.acc_grads))
  inner = state.inner_opt_state
  assert int(inner.skipped_steps) == 0 and int(inner.steps) > 0
  assert float(inner.loss_scaler.loss_scale) == 2.0**8


def test_the_fix_clips_unscaled_gradients_like_plain_optax():
  # What the error recommends: clipping inside mixed_precision sees the
  # unscaled gradients, so a float16 loss scale of 2**15 changes nothing.
  tx = jmp_train.mixed_precision(
    optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)),
    loss_scale=jmp_train.StaticLossScale(2.0**15),
  )
  ref_tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))
  ours, ref = (
    make_step(tx),
    jax.jit(lambda p, s, x, y: _plain_step(ref_tx, p, s, x, y)),
  )
  params = ref_params = init_params()
  state, ref_state = tx.init(params), ref_tx.init(ref_params)
  for x, y in batches(5):
    params, state = ours(params, state, x, y, jnp.float32(0))
    ref_params, ref_state = ref(ref_params, ref_state, x, y)
  assert_close(params, ref_params)


def _plain_step(tx, params, state, x, y):
  grads = jax.grad(loss_fn)(params, x, y)
  updates, state = tx.update(grads, state, params)
  return optax.apply_updates(params, updates), state


def test_inject_hyperparams_needs_no_static_args_and_honours_the_seed():
  # The param-update rule, seed included, is a setting, not a number: it
  # passes through optax.inject_hyperparams untraced.
  factory = optax.inject_hyperparams(jmp_train.mixed_precision)
  params = {"w": jnp.full((256,), 1.0 + 2.0**-10, jnp.bfloat16)}
  grads = {"w": jnp.full((256,), 2.0**-12, jnp.bfloat16)}

  def stepper(seed):
    tx = factory(
      optax.sgd(1.0), param_update=jmp_train.StochasticRounding(seed=seed)
    )
    state = tx.init(params)
    assert set(state.hyperparams) == set()  # nothing traced
    update = jax.jit(tx.update)
    return lambda: optax.apply_updates(params, update(grads, state, params)[0])

  three = stepper(3)
  a, b, c = three()["w"], three()["w"], stepper(4)()["w"]
  np.testing.assert_array_equal(a, b)  # reproducible
  assert not np.array_equal(a, c)  # and the seed is used
  # A numeric loss scale would become a hyperparameter we cannot honour:
  # traced, it raises; eagerly, optax stores it in the params' dtype, where
  # 1001.0 is bfloat16 1000 (checked in NumPy), and a half dtype is refused.
  floats = {"w": jnp.ones(3)}
  tx = factory(optax.sgd(0.1), loss_scale=128.0)
  state = tx.init(floats)
  with pytest.raises(TypeError, match=r"static_args=\('loss_scale',\)"):
    jax.jit(tx.update)({"w": jnp.ones(3)}, state, floats)
  assert float(np.asarray(1001.0, jnp.bfloat16)) == 1000.0
  tx = factory(optax.sgd(0.1), loss_scale=1001.0)
  with pytest.raises(ValueError, match=r"bfloat16 number.*static_args"):
    tx.init(params)
  for half in (jnp.bfloat16(128.0), np.float16(128.0)):  # even exact ones
    with pytest.raises(ValueError, match="may already be rounded"):
      jmp_train.mixed_precision(optax.sgd(0.1), loss_scale=half)
  static = optax.inject_hyperparams(
    jmp_train.mixed_precision, static_args=("loss_scale",)
  )(optax.sgd(0.1), loss_scale=128.0)
  state = static.init(params)
  jax.jit(static.update)(grads, state, params)
  assert float(jmp_train.current_loss_scale(state)) == 128.0


@pytest.mark.parametrize("params_dtype", [jnp.bfloat16, jnp.float16])
def test_params_equal_cast_master_bit_for_bit_when_crossing_zero(params_dtype):
  # Updates that take masters from ~p to within 2**-10..2**-30 of |p|: the
  # float32 delta cast(new_master) - param is inexact there, and without care
  # apply_updates lands one ulp (of the small new value) off cast(master).
  # Inner = identity, so the float32 reference is master + grad, in NumPy.
  n = 20000
  rng = np.random.default_rng(0)
  p0 = (rng.standard_normal(n) * 2.0 ** rng.integers(-8, 4, n)).astype(
    np.float32
  )
  params = {"w": jnp.asarray(p0, params_dtype)}
  tx = jmp_train.mixed_precision(optax.identity())
  state = tx.init(params)
  master = np.asarray(state.master_params["w"])
  update = jax.jit(tx.update)
  # Step 1 moves the masters off the low-precision grid; step 2 takes them
  # to tiny values of either sign; step 3 grows them 2**10..2**24-fold.
  g1 = (master * rng.uniform(-1e-3, 1e-3, n)).astype(np.float32)
  tiny = np.abs(master + g1) * 2.0 ** -rng.integers(10, 31, n)
  g2 = (-(master + g1) + rng.choice([-1, 1], n) * tiny).astype(np.float32)
  grow = rng.uniform(1, 2, n) * 2.0 ** rng.integers(10, 25, n)

  @jax.jit
  def fused(params, state, grads):  # XLA sees update and apply together
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  for g in (g1, g2, None):
    if g is None:
      g = np.clip(master * grow, -3e4, 3e4).astype(np.float32)  # float16 range
    fused_params, fused_state = fused(params, state, {"w": jnp.asarray(g)})
    updates, state = update({"w": jnp.asarray(g)}, state, params)
    old = np.asarray(params["w"], np.float32)
    params = optax.apply_updates(params, updates)
    chex.assert_trees_all_equal((fused_params, fused_state), (params, state))
    ref = (master + g).astype(np.float32)  # plain float32 optax
    new_master = np.asarray(state.master_params["w"])
    cast = new_master.astype(params_dtype)
    bits = np.uint16
    np.testing.assert_array_equal(
      np.asarray(params["w"]).view(bits), np.asarray(cast).view(bits)
    )
    # The master is the float32 reference, or (where the step's float32
    # delta rounds) within an ulp of that delta, ref - old, of it.
    ulp = np.spacing(np.abs(ref - old).astype(np.float32))
    assert np.all(np.abs(new_master - ref) <= ulp)
    if g is g1:  # away from zero the masters are float32 optax exactly
      np.testing.assert_array_equal(new_master, ref)
    master = new_master  # the next step starts from the kept master


def _ordinal(x, dtype):
  """Sign-magnitude bits of 16-bit floats as integers that count ulps."""
  bits = np.asarray(x, dtype).view(np.uint16).astype(np.int64)
  return np.where(bits < 0x8000, bits, -(bits & 0x7FFF))


@pytest.mark.parametrize("params_dtype", [jnp.bfloat16, jnp.float16])
def test_stochastic_rounding_lands_on_a_neighbour_when_crossing_zero(
  params_dtype,
):
  # Without masters, the param after apply_updates must be one of the two
  # neighbours (in the param dtype) of float32(param) + update, also where
  # the new value is 2**-10..2**-30 of the old one. NumPy reference.
  n = 20000
  rng = np.random.default_rng(1)
  p0 = rng.uniform(0.5, 2.0, n) * rng.choice([-1, 1], n)
  params = {"w": jnp.asarray(p0, params_dtype)}
  old = np.asarray(params["w"], np.float32)
  scale = 2.0 ** -rng.integers(10, 31, n) * rng.uniform(1, 2, n)
  tiny = np.abs(old) * scale * rng.choice([-1, 1], n)
  g = (-old + tiny).astype(np.float32)
  tx = jmp_train.mixed_precision(
    optax.identity(), param_update=jmp_train.StochasticRounding(seed=0)
  )
  updates, _ = jax.jit(tx.update)(
    {"w": jnp.asarray(g)}, tx.init(params), params
  )
  new = np.asarray(optax.apply_updates(params, updates)["w"])
  x = old + g  # float32, as the transformation computes it
  near = x.astype(params_dtype)
  steps = _ordinal(new, params_dtype) - _ordinal(near, params_dtype)
  other_side = (new.astype(np.float32) - x) * (near.astype(np.float32) - x)
  assert np.all((steps == 0) | ((np.abs(steps) == 1) & (other_side < 0)))
  assert np.mean(steps != 0) > 0.01  # and it does round stochastically


def test_inputs_that_failed_late_or_obscurely_get_clear_errors():
  params = {"layer": {"w": jnp.ones(3)}}
  for scale in (np.float32(128.0), jnp.float32(128.0), np.int64(128)):
    tx = jmp_train.mixed_precision(optax.sgd(0.1), loss_scale=scale)
    assert float(jmp_train.current_loss_scale(tx.init(params))) == 128.0
  for bad in ("dynamic", True, jnp.ones(2), 1j):
    with pytest.raises(TypeError, match="loss_scale must be"):
      jmp_train.mixed_precision(optax.sgd(0.1), loss_scale=bad)
  with pytest.raises(ValueError, match="loss_scale"):
    jmp_train.mixed_precision(optax.sgd(0.1), loss_scale=0.0)
  with pytest.raises(
    TypeError, match=r"inner must be an optax\.Gradient.*None"
  ):
    jmp_train.mixed_precision(None)
  with pytest.raises(TypeError, match=r"preset.mixed_precision\(inner\)"):
    jmp_train.mixed_precision(jmp_train.get_preset("bf16-mixed"))
  tx = jmp_train.mixed_precision(optax.sgd(0.1))
  grads = {"layer": {"w": jnp.ones(3)}}
  with pytest.raises(TypeError, match="state of type tuple.*MixedPrecision"):
    tx.update(grads, optax.sgd(0.1).init(params), params)
  with pytest.raises(ValueError, match=r"gradient of 'layer/w' has shape \(1,"):
    tx.update({"layer": {"w": jnp.ones(1)}}, tx.init(params), params)
  fp8 = {"layer": {"w": jnp.ones(3, jnp.float8_e4m3fn)}}
  with pytest.raises(TypeError, match="'layer/w' has dtype float8_e4m3fn"):
    tx.init(fp8)
  with pytest.raises(TypeError, match="'layer/w' has dtype float8_e4m3fn"):
    tx.update(grads, tx.init(params), fp8)


def test_python_number_params_train_like_optax(variant):
  params = {"w": 1.0, "n": 3}
  grads = {"w": 2.0, "n": 0}
  tx = jmp_train.mixed_precision(optax.sgd(0.1))
  updates, _ = variant(tx.update)(grads, tx.init(params), params)
  new = optax.apply_updates(params, updates)
  sgd = optax.sgd(0.1)
  ref = optax.apply_updates(params, sgd.update(grads, sgd.init(params))[0])
  assert float(new["w"]) == float(ref["w"]) == np.float32(0.8)
  assert int(new["n"]) == 3 and jnp.asarray(new["n"]).dtype == jnp.int32


def test_complex_params_train_like_plain_optax_and_skip_bit_identically():
  rng = np.random.default_rng(0)
  z = rng.standard_normal(4) + 1j * rng.standard_normal(4)
  params = {"z": jnp.asarray(z, jnp.complex64), "w": jnp.ones(3)}
  x = jnp.asarray(rng.standard_normal((8, 4)), jnp.float32)

  def loss(p):
    return jnp.mean(jnp.abs(x @ p["z"] - 1.0) ** 2) + jnp.sum(p["w"] ** 2)

  # SGD, not Adam: Adam would hide gradients left scaled by 2**4.
  tx = jmp_train.mixed_precision(
    optax.sgd(0.05, momentum=0.5), loss_scale=jmp_train.StaticLossScale(2.0**4)
  )
  ref_tx = optax.sgd(0.05, momentum=0.5)
  state, ref, ref_state = tx.init(params), params, ref_tx.init(params)
  update = jax.jit(tx.update)
  for i in range(4):
    grads = jax.grad(lambda p: loss(p) * 2.0**4)(params)
    if i == 2:  # one NaN imaginary part skips the step
      grads["z"] = grads["z"].at[1].set(complex(1.0, np.nan))
    before = params
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
    if i == 2:
      assert not bool(state.last_step_finite)
      for a, b in zip(
        jax.tree.leaves(params), jax.tree.leaves(before), strict=True
      ):
        np.testing.assert_array_equal(
          np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32)
        )
      continue
    r_updates, ref_state = ref_tx.update(jax.grad(loss)(ref), ref_state, ref)
    ref = optax.apply_updates(ref, r_updates)
    assert_close(params, ref)
  assert params["z"].dtype == jnp.complex64
  moved = jnp.abs(params["z"] - jnp.asarray(z, jnp.complex64))
  assert float(moved.max()) > 0.05


# The norm and finite check are computed one of two ways (transform.py,
# `finite_check.py`): leaf by leaf where a leaf may be split over devices
# by GSPMD (plain jit with 8 devices: nothing is known while tracing) or the
# tree has few leaves, or in a few concatenations where every device holds
# whole leaves (inside shard_map; replicated on an Explicit mesh; with one
# device). Both must give the float64 norm and catch one bad entry in any
# kind of leaf.
def _every_kind_of_leaf():
  rng = np.random.default_rng(11)

  def normal(shape, dtype=np.float32):
    return np.asarray(rng.standard_normal(shape), dtype)

  return {
    "small": normal((5,)),
    "scalar": normal(()),
    "empty": normal((0, 4)),
    "bf16": normal((7, 3)).astype(jnp.bfloat16),
    "rows": normal((256, 300)),  # summed per row, then with the others
    "tall": normal((70000, 1)),  # rows too short: summed whole
    "long": normal((70000,)),  # a large vector: summed whole
    "cplx": (normal((4,)) + 1j * normal((4,))).astype(np.complex64),
    "count": np.arange(3, dtype=np.int32),  # no gradient: masked
    # Enough leaves to be grouped (finite_check.MIN_GROUPED).
    **{f"bias{i}": normal((i + 1,)) for i in range(10)},
  }


def _norm_contexts():
  """tx.update run where leaves are not known whole, and where they are:
  (wrap the update, place its arguments, leaves grouped)."""
  devices = np.asarray(jax.devices())
  auto = jax.sharding.Mesh(devices, ("d",))
  explicit = jax.sharding.Mesh(
    devices, ("d",), axis_types=(jax.sharding.AxisType.Explicit,)
  )

  def in_shard_map(update):
    return jax.jit(
      jax.shard_map(update, mesh=auto, in_specs=P(), out_specs=P())
    )

  def nowhere(*args):
    return args

  def replicated(*args):
    return jax.device_put(args, NamedSharding(explicit, P()))

  return {
    "jit": (jax.jit, nowhere, False),
    "shard_map": (in_shard_map, nowhere, True),
    "explicit": (jax.jit, replicated, True),
  }


@pytest.mark.parametrize("context", ["jit", "shard_map", "explicit"])
def test_norm_and_finite_check_on_every_kind_of_leaf_both_ways(context):
  wrap, place, grouped = _norm_contexts()[context]
  params = jax.tree.map(jnp.asarray, _every_kind_of_leaf())
  tx = jmp_train.mixed_precision(
    optax.sgd(0.0), loss_scale=jmp_train.StaticLossScale(8.0)
  )
  state = tx.init(params)
  scaled = jax.tree.map(
    lambda g: g * 8 if jnp.issubdtype(g.dtype, jnp.inexact) else g, params
  )
  update = wrap(lambda g, s, p: tx.update(g, s, p)[1])
  jaxpr = str(jax.make_jaxpr(update)(*place(scaled, state, params)))
  assert ("optimization_barrier" in jaxpr) == grouped

  def want(grads):  # float64, of the unscaled grads
    return np.sqrt(
      sum(
        np.sum(np.abs(np.asarray(g, np.complex128) / 8) ** 2)
        for g in jax.tree.leaves(grads)
        if jnp.issubdtype(g.dtype, jnp.inexact)
      )
    )

  new = update(*place(scaled, state, params))
  assert bool(new.last_step_finite)
  np.testing.assert_allclose(float(new.grad_norm), want(scaled), rtol=1e-6)
  for name, g in scaled.items():
    if g.size == 0 or not jnp.issubdtype(g.dtype, jnp.inexact):
      continue
    for bad in (np.nan, np.inf):
      flat = np.asarray(g).ravel().copy()
      flat[-1] = bad
      grads = {**scaled, name: jnp.asarray(flat.reshape(g.shape), g.dtype)}
      new = update(*place(grads, state, params))
      assert not bool(new.last_step_finite), (name, bad)
      assert np.isnan(float(new.grad_norm)), (name, bad)


_ONE_DEVICE_CHILD = """
import json, jax
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp, numpy as np, optax, jmp_train
rng = np.random.default_rng(5)
grads = {f"g{i}": jnp.asarray(rng.standard_normal((i + 1, 90)), jnp.float32)
         for i in range(20)}
# float64 leaves whose float32 squares would flush to zero: summed in
# float64, then rounded.
grads["tiny"] = jnp.full((6000,), 1e-20, jnp.float64)
grads["tiny_rows"] = jnp.full((100, 600), 1e-20, jnp.float64)
tx = jmp_train.mixed_precision(optax.sgd(0.1))
update = jax.jit(lambda g, s, p: tx.update(g, s, p)[1])
state = tx.init(grads)
bad = dict(grads, g7=grads["g7"].at[3, 4].set(jnp.inf))
print(json.dumps({
  "devices": jax.device_count(),
  "grouped": "optimization_barrier" in str(jax.make_jaxpr(update)(
    grads, state, grads)),
  "norm": float(update(grads, state, grads).grad_norm),
  "want": float(np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2)
                            for g in grads.values()))),
  "tiny": float(update({k: grads[k] * (k.startswith("tiny")) for k in grads},
                       state, grads).grad_norm),
  "tiny_want": float(np.sqrt(66000 * 1e-40)),
  "bad_finite": bool(update(bad, state, grads).last_step_finite),
}))
"""


def test_one_device_groups_the_leaves_of_plain_jit():
  # With one device nothing can be split: a plain jit's 22 leaves are
  # grouped (a fresh process: this session has 8 devices), float64 ones
  # summed in float64.
  out = subprocess.run(
    [sys.executable, "-c", _ONE_DEVICE_CHILD],
    env=_child_env.child_env(),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  got = json.loads(out.stdout.strip().splitlines()[-1])
  assert got["devices"] == 1 and got["grouped"]
  np.testing.assert_allclose(got["norm"], got["want"], rtol=1e-6)
  np.testing.assert_allclose(got["tiny"], got["tiny_want"], rtol=1e-6)
  assert not got["bad_finite"]


def test_a_tree_of_few_leaves_is_summed_leaf_by_leaf_everywhere():
  # Grouping needs 14 leaves: with fewer, XLA:GPU's step had more kernels.
  wrap, place, _ = _norm_contexts()["shard_map"]
  tx = jmp_train.mixed_precision(optax.sgd(0.1))

  def jaxpr(n):
    params = {f"w{i}": jnp.ones((4, 3)) for i in range(n)}
    update = wrap(lambda g, s, p: tx.update(g, s, p)[1])
    args = place(params, tx.init(params), params)
    return str(jax.make_jaxpr(update)(*args))

  assert "optimization_barrier" not in jaxpr(13)
  assert "optimization_barrier" in jaxpr(14)


def test_leaves_gspmd_may_split_are_not_gathered_for_the_norm():
  # Concatenating leaves that GSPMD shards would all-gather them: such
  # leaves (sharded on an Auto mesh, or typed as sharded on an Explicit
  # one) are summed where they lie, and only the scalar sums all-reduced.
  devices = np.asarray(jax.devices())
  params = {  # enough leaves to be grouped if they were known whole
    **{f"w{i}": jnp.ones((64, 128)) for i in range(4)},
    **{f"v{i}": jnp.ones((64, 1200)) for i in range(4)},
    **{f"b{i}": jnp.ones(128) for i in range(8)},
  }
  tx = jmp_train.mixed_precision(optax.adam(1e-3))
  for kind in (jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit):
    mesh = jax.sharding.Mesh(devices, ("d",), axis_types=(kind,))
    split = NamedSharding(mesh, P("d"))
    placed = {k: jax.device_put(x, split) for k, x in params.items()}
    with jax.set_mesh(mesh):
      state = jax.jit(tx.init)(placed)
      text = (
        jax.jit(lambda g, s, p: tx.update(g, s, p))
        .lower(placed, state, placed)
        .compile()
        .as_text()
      )
    found = jmp_train.memory.summarize_collectives(
      jmp_train.memory.collective_stats(text, len(devices))
    )
    assert "all-gather" not in found, (kind, found)
    # Each device summed its rows: the sums meet in all-reduces of scalars.
    assert found["all-reduce"]["max_elements"] == 1, (kind, found)


def test_a_skipped_step_keeps_explicitly_sharded_params_and_layouts():
  # On an Explicit mesh a layout is part of an array's type: the skip's
  # -0.0 updates must carry each param's, or the conditional's branches
  # differ in type (it failed to trace until 2026-11-26).
  devices = np.asarray(jax.devices())
  mesh = jax.sharding.Mesh(
    devices, ("d",), axis_types=(jax.sharding.AxisType.Explicit,)
  )
  split, whole = NamedSharding(mesh, P("d")), NamedSharding(mesh, P())
  params = {
    "w": jax.device_put(
      jnp.arange(64.0).reshape(16, 4).astype(jnp.bfloat16), split
    ),
    "c": jax.device_put(jnp.ones(8, jnp.complex64) * -0.0, split),
    "b": jax.device_put(jnp.array([1.0, -0.0, 3.0]), whole),
    "i": jax.device_put(jnp.arange(8), split),
  }
  tx = jmp_train.mixed_precision(optax.adam(1e-1))
  with jax.set_mesh(mesh):
    state = jax.jit(tx.init)(params)

    @jax.jit
    def step(g, s, p):
      updates, s = tx.update(g, s, p)
      return optax.apply_updates(p, updates), s, updates

    grads = jax.tree.map(jnp.ones_like, params)
    for g, finite in (
      (dict(grads, b=grads["b"].at[0].set(jnp.nan)), False),
      (grads, True),
    ):
      new, new_state, updates = step(g, state, params)
      assert bool(new_state.last_step_finite) == finite
      for k in params:
        assert jax.typeof(new[k]) == jax.typeof(params[k]), k
        assert jax.typeof(updates[k]).sharding == jax.typeof(params[k]).sharding
        unchanged = np.array_equal(
          np.asarray(new[k]).view(np.uint8),
          np.asarray(params[k]).view(np.uint8),
        )
        assert unchanged == (not finite or k == "i"), k


@pytest.mark.parametrize("context", ["auto", "explicit", "explicit-split"])
def test_stochastic_rounding_draws_before_the_skip_from_the_documented_stream(
  context,
):
  # XLA:GPU keeps a conditional whose branch draws random numbers (a host
  # branch, a copy of every output): the bits are drawn before the skip.
  # They are the documented streams': for the bfloat16 params, jax.random.bits
  # of fold_in(fold_in(key(seed), 0), steps) over all of them, cut in leaf
  # order; for a BFloat16("stochastic", seed) moment, stream 1 of its seed,
  # counted over the moments with that seed. On 8 devices without a mesh
  # GSPMD may split the leaves, so each is drawn apart, as on an Explicit
  # mesh that splits them; on one that replicates them, in one draw per
  # stream: the same bits.
  rng = np.random.default_rng(8)
  params = {
    "0n": jnp.arange(8),  # an integer leaf first: it counts for nothing
    "a": jnp.asarray(1 + rng.random(320) / 64, jnp.bfloat16),
    "b": jnp.asarray(rng.standard_normal((24, 30)), jnp.bfloat16),
  }
  grads = jax.tree.map(lambda p: (p * 2.0**-11).astype(p.dtype), params)
  floats = ["a", "b"]  # the tree's order
  sizes = [params[k].size for k in floats]
  tx = jmp_train.mixed_precision(
    optax.sgd(1.0, momentum=0.5),
    param_update=jmp_train.StochasticRounding(seed=9),
    state_formats={
      "trace": jmp_train.state_format.BFloat16("stochastic", seed=4)
    },
  )
  mesh = jax.sharding.Mesh(
    np.asarray(jax.devices()),
    ("d",),
    axis_types=(jax.sharding.AxisType.Explicit,),
  )
  explicit = context != "auto"
  if explicit:
    spec = P("d") if context == "explicit-split" else P()
    params, grads = jax.device_put((params, grads), NamedSharding(mesh, spec))
  with jax.set_mesh(mesh) if explicit else contextlib.nullcontext():
    update = jax.jit(tx.update)
    state = jax.jit(tx.init)(params)
    _, state = update(grads, state, params)  # steps = 1 from here
    old = optax.tree.get(state, "trace")
    jaxpr = str(jax.make_jaxpr(tx.update)(grads, state, params).jaxpr)
    compiled = update.lower(grads, state, params).compile().as_text()
    updates, state = update(grads, state, params)
    new = optax.apply_updates(params, updates)
  (cond,) = [
    e
    for e in jax.make_jaxpr(tx.update)(grads, state, params).jaxpr.eqns
    if e.primitive.name == "cond"
  ]
  branches = " ".join(str(b) for b in cond.params["branches"])
  assert "threefry2x32" in jaxpr and "threefry2x32" not in branches
  draws = jaxpr.count("= threefry2x32 ")
  assert draws == (2 if context == "explicit" else 2 * len(floats)), draws
  if context == "explicit-split":  # each device draws its own part's bits
    assert "u32[3,30]" in compiled and "u32[40]" in compiled
    assert "u32[24,30]" not in compiled and "u32[320]" not in compiled

  def stream(seed, which):  # JAX's own bits, cut in leaf order
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), which), 1)
    flat = np.asarray(jax.random.bits(key, (sum(sizes),), jnp.uint16))
    return np.split(flat, np.cumsum(sizes)[:-1])

  trace = optax.tree.get(state, "trace")
  for name, p_bits, s_bits in zip(
    floats, stream(9, 0), stream(4, 1), strict=True
  ):
    shape = params[name].shape
    # optax.trace in float32: g + 0.5 * the stored trace, widened.
    old_trace = np.asarray(old[name], np.float32)
    want_trace = (
      np.asarray(grads[name], np.float32) + np.float32(0.5) * old_trace
    )
    np.testing.assert_array_equal(
      np.asarray(trace[name]).view(np.uint16),
      _numpy_rules.bf16_stochastic(want_trace, s_bits.reshape(shape)),
    )
    want = np.asarray(params[name], np.float32) - want_trace
    np.testing.assert_array_equal(
      np.asarray(new[name]).view(np.uint16),
      _numpy_rules.bf16_stochastic(want, p_bits.reshape(shape)),
    )
    assert not np.array_equal(new[name], params[name])  # it moved


def _outputs_without_a_buffer(compiled) -> list[str]:
  """The outputs of a compiled step that XLA writes into no donated input's
  buffer (read from the module's `input_output_alias`)."""
  config = re.search(r"input_output_alias=\{(.*?) \}", compiled.as_text())
  assert config is not None, "the compiled module aliases no output"
  aliased = {int(i) for i in re.findall(r"\{(\d+)\}: \(", config[1])}
  flat = jax.tree_util.tree_flatten_with_path(compiled.out_info)[0]
  return [
    jax.tree_util.keystr(path)
    for i, (path, _) in enumerate(flat)
    if i not in aliased
  ]


@pytest.mark.parametrize(
  "preset", ["fp16-mixed", "bf16-true", "bf16-sr-lean", "bf16-fp8-adam"]
)
def test_a_donated_state_is_updated_in_its_own_buffers(preset):
  # `jax.jit(step, donate_argnums=(0, 1))`, as optax users write it: each
  # new leaf must go into its old leaf's buffer. An input no output reads is
  # dropped by jit, and its output gets a fresh buffer every step (on a GPU,
  # a CUDA-graph update per call): the two metrics the update overwrites
  # without reading did, and the plain optax step has none.
  preset = jmp_train.get_preset(preset)
  params = init_params(dtype=preset.policy.param_dtype)
  x, y = batches(1)[0]

  def step_of(tx, scaled):
    def step(params, state, x, y):
      scale = jmp_train.current_loss_scale(state) if scaled else 1.0
      grads = jax.grad(lambda p: loss_fn(p, x, y) * scale)(params)
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    return jax.jit(step, donate_argnums=(0, 1))

  plain, ours = optax.adam(1e-3), preset.mixed_precision(optax.adam(1e-3))
  for tx in (plain, ours):
    state = jax.eval_shape(tx.init, params)  # compiled, not run
    compiled = step_of(tx, scaled=tx is ours).lower(params, state, x, y)
    assert _outputs_without_a_buffer(compiled.compile()) == []
