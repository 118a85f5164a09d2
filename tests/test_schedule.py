"""adjust_precision: state kept bit for bit, continued against plain optax."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import primitive_operand_dtypes

import jmp_train
from jmp_train import schedule


def _mp_state(opt_state):
  """The `MixedPrecisionState` inside an optimizer state."""
  is_mp = lambda x: isinstance(x, jmp_train.MixedPrecisionState)  # noqa: E731
  (found,) = [x for x in jax.tree.leaves(opt_state, is_leaf=is_mp) if is_mp(x)]
  return found


def _params():
  rng = np.random.default_rng(0)
  return {
    "dense": {"kernel": jnp.asarray(rng.standard_normal((4, 3)), jnp.float32)},
    "norm": {"scale": jnp.ones((3,), jnp.float32)},
    "count": jnp.arange(2, dtype=jnp.int32),
  }


def _grads(params, i):
  rng = np.random.default_rng(100 + i)
  return jax.tree.map(
    lambda p: (
      jnp.asarray(rng.standard_normal(p.shape), p.dtype)
      if jnp.issubdtype(p.dtype, jnp.floating)
      else jnp.zeros_like(p)
    ),
    params,
  )


def _run(tx, params, state, steps, start=0):
  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  for i in range(start, start + steps):
    params, state = step(params, state, _grads(params, i))
  return params, state


def _bf16_norm_f32(params):
  """What wrap gives under bf16-true: the norm stays float32."""
  return {
    "dense": {"kernel": jnp.bfloat16},
    "norm": {"scale": jnp.float32},
    "count": jnp.int32,
  }


def test_bf16_true_to_fp32_keeps_state_and_continues_like_optax():
  tx = jmp_train.get_preset("bf16-true").mixed_precision(optax.adam(1e-2))
  params = jmp_train.cast_floating(_params(), jnp.bfloat16)
  params["norm"]["scale"] = params["norm"]["scale"].astype(jnp.float32)
  params, state = _run(tx, params, tx.init(params), 4)
  masters = state.master_params
  new_params, new_state = schedule.adjust_precision(params, state, "fp32")
  # Params become their float32 masters exactly (the norm was its own).
  np.testing.assert_array_equal(
    new_params["dense"]["kernel"], masters["dense"]["kernel"]
  )
  assert new_params["dense"]["kernel"].dtype == jnp.float32
  # Left where they were: uncommitted, free to join any later computation.
  assert not any(x.committed for x in jax.tree.leaves(new_params))
  np.testing.assert_array_equal(
    new_params["norm"]["scale"], params["norm"]["scale"]
  )
  assert new_params["count"] is params["count"]
  # Inner state and counters are the same arrays; no masters remain.
  assert jax.tree.leaves(new_state.inner_state) == jax.tree.leaves(
    state.inner_state
  )
  assert int(new_state.steps) == 4
  kept = jax.tree.leaves(new_state.master_params, is_leaf=lambda x: x is None)
  assert kept and all(m is None for m in kept)
  # The same tx keeps going, exactly like plain Adam from that state.
  ours, _ = _run(tx, new_params, new_state, 3, start=4)
  adam = optax.adam(1e-2)
  floats = {"dense": new_params["dense"], "norm": new_params["norm"]}
  inner = new_state.inner_state
  # Plain Adam's state: ours without the masked integer leaf.
  ref_state = (
    inner[0]._replace(
      mu={k: v for k, v in inner[0].mu.items() if k != "count"},
      nu={k: v for k, v in inner[0].nu.items() if k != "count"},
    ),
    inner[1],
  )
  for i in range(4, 7):
    grads = _grads(floats, i)
    updates, ref_state = adam.update(grads, ref_state, floats)
    floats = optax.apply_updates(floats, updates)
  np.testing.assert_array_equal(
    ours["dense"]["kernel"], floats["dense"]["kernel"]
  )
  np.testing.assert_array_equal(ours["norm"]["scale"], floats["norm"]["scale"])


def test_fp32_to_bf16_true_makes_exact_masters_per_param_dtypes():
  tx = jmp_train.get_preset("fp32").mixed_precision(optax.sgd(0.1))
  params, state = _run(tx, _params(), tx.init(_params()), 2)
  new_params, new_state = schedule.adjust_precision(
    params, state, "bf16-true", param_dtypes=_bf16_norm_f32(params)
  )
  kernel = params["dense"]["kernel"]
  assert new_params["dense"]["kernel"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(
    new_params["dense"]["kernel"], kernel.astype(jnp.bfloat16)
  )
  np.testing.assert_array_equal(
    new_state.master_params["dense"]["kernel"], kernel
  )
  assert new_state.master_params["norm"]["scale"] is None
  assert new_params["norm"]["scale"].dtype == jnp.float32
  # Stepping on: params stay the masters cast down.
  p2, s2 = _run(tx, new_params, new_state, 2, start=2)
  np.testing.assert_array_equal(
    p2["dense"]["kernel"],
    s2.master_params["dense"]["kernel"].astype(jnp.bfloat16),
  )


def test_zero1_state_is_refused_padded_and_adjusts_logical():
  from jax.sharding import AxisType

  from jmp_train import train, zero1

  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  rng = np.random.default_rng(0)
  values = {  # 5 x 3 and 3 values: ZeRO-1 pads both to 8 rows on 8 devices
    "kernel": rng.standard_normal((5, 3)).astype(np.float32),
    "bias": rng.standard_normal(3).astype(np.float32),
    # 16 rows split without padding: its master is sharded over the data
    # axis, which a param rebuilt from it must not inherit.
    "wide": rng.standard_normal((16, 3)).astype(np.float32),
  }
  for name, new in (("bf16-true", "fp32"), ("fp32", "bf16-true")):
    preset = jmp_train.get_preset(name)
    params = jax.tree.map(
      lambda v, d=preset.policy.param_dtype: jnp.asarray(v, d), values
    )
    tx = preset.mixed_precision(optax.adam(1e-3))
    plan = zero1.make_plan(tx, params, mesh)
    state = train.TrainState.create(params=params, tx=tx, plan=plan)
    # bf16-true: padded float32 masters; fp32: no masters, padded moments.
    what = "master_params/" if name == "bf16-true" else "inner_state/0/mu/"
    with pytest.raises(
      ValueError, match=rf"{what}.* has shape \(8,?.*to_logical"
    ):
      schedule.adjust_precision(state.params, state.opt_state, new)
    logical = zero1.to_logical(plan, state)
    got, opt_state = schedule.adjust_precision(
      logical.params, logical.opt_state, new
    )
    # Each param's float32 value, cast to the new param dtype (NumPy).
    new_dtype = jmp_train.get_preset(new).policy.param_dtype
    for key, v in values.items():
      want = np.asarray(v, preset.policy.param_dtype).astype(new_dtype)
      assert got[key].shape == v.shape and got[key].dtype == new_dtype
      np.testing.assert_array_equal(got[key], want)
      assert got[key].sharding.is_equivalent_to(
        logical.params[key].sharding, v.ndim
      )
    new_tx = jmp_train.get_preset(new).mixed_precision(optax.adam(1e-3))
    new_plan = zero1.make_plan(new_tx, got, mesh)
    placed = zero1.place(
      new_plan, logical.replace(params=got, opt_state=opt_state)
    )
    assert jax.tree.structure(placed.opt_state) == jax.tree.structure(
      new_plan.opt_state
    )
  # An optimizer's own state shaped otherwise is no padding: Adafactor
  # factors the kernel's second moment into rows and columns, and keeps (1,)
  # for the bias.
  params = jax.tree.map(jnp.asarray, values)
  tx = jmp_train.mixed_precision(optax.adafactor(1e-2))
  got, _ = schedule.adjust_precision(params, tx.init(params), "bf16-true")
  for key, v in values.items():
    np.testing.assert_array_equal(got[key], v.astype(jnp.bfloat16))
  # Nor is a factor shaped (m, m) for an (m, n) param, as Shampoo keeps:
  # its extra columns are not the zeros ZeRO-1 pads with.
  factors = optax.GradientTransformation(
    lambda p: jax.tree.map(lambda x: jnp.eye(x.shape[0], dtype=x.dtype), p),
    lambda u, s, p=None: (u, s),
  )
  tx = jmp_train.mixed_precision(optax.chain(factors, optax.sgd(0.1)))
  got, _ = schedule.adjust_precision(params, tx.init(params), "bf16-true")
  assert got["kernel"].shape == (5, 3)
  # param_dtypes gives dtypes; shapes that are not the params' are refused.
  tx = jmp_train.get_preset("fp32").mixed_precision(optax.sgd(0.1))
  params = _params()
  wrong = jax.tree.map(
    lambda p: jax.ShapeDtypeStruct((*p.shape, 1), jnp.bfloat16), params
  )
  with pytest.raises(ValueError, match="param_dtypes/.* has shape"):
    schedule.adjust_precision(
      params, tx.init(params), "bf16-true", param_dtypes=wrong
    )


def test_loss_scale_kept_only_for_same_settings_and_found_in_a_chain():
  fp16 = jmp_train.get_preset("fp16-mixed")
  tx = optax.chain(fp16.mixed_precision(optax.sgd(0.1)))
  params = _params()
  state = tx.init(params)
  inf_grads = jax.tree.map(
    lambda g: g * jnp.inf if g.dtype == jnp.float32 else g, _grads(params, 0)
  )
  _, state = tx.update(inf_grads, state, params)  # one backoff: 2**14
  assert float(jmp_train.current_loss_scale(state)) == 2.0**14
  _, same = schedule.adjust_precision(params, state, "fp16-mixed")
  assert float(jmp_train.current_loss_scale(same)) == 2.0**14
  assert int(jmp_train.train_metrics(same)["skipped_steps"]) == 1
  _, bf16 = schedule.adjust_precision(params, state, "bf16-mixed")
  assert isinstance(
    optax.tree.get(bf16, "loss_scaler"), jmp_train.NoOpLossScale
  )
  assert float(jmp_train.current_loss_scale(bf16)) == 1.0
  _, back = schedule.adjust_precision(params, bf16, fp16)
  assert float(jmp_train.current_loss_scale(back)) == 2.0**15


def test_bad_input_and_schedule():
  tx = jmp_train.mixed_precision(optax.sgd(0.1))
  params = _params()
  state = tx.init(params)
  with pytest.raises(ValueError, match="structure of params"):
    schedule.adjust_precision(
      params, state, "fp32", param_dtypes={"dense": jnp.float32}
    )
  bad = _bf16_norm_f32(params)
  bad["dense"]["kernel"] = jnp.int8
  with pytest.raises(ValueError, match="'dense/kernel' cannot become int8"):
    schedule.adjust_precision(params, state, "fp32", param_dtypes=bad)
  # A value float16 cannot hold would become inf: refused, named.
  big = jax.tree.map(lambda p: p * 0 + 1e5, params)
  with pytest.raises(ValueError, match=r"beyond float16's range .* 100000"):
    schedule.adjust_precision(big, tx.init(big), "fp16-true")
  with pytest.raises(ValueError, match="Unknown preset 'fp12'"):
    schedule.adjust_precision(params, state, "fp12")
  with pytest.raises(ValueError, match="step 0"):
    schedule.PrecisionSchedule({5: "fp32"})
  with pytest.raises(ValueError, match="int >= 0, got -1"):
    schedule.PrecisionSchedule({0: "fp32", -1: "bf16-mixed"})
  # A step naming the preset already running switches nothing.
  phases = schedule.PrecisionSchedule(
    {0: "fp32", 5: "bf16-true", 9: "bf16-true"}
  )
  assert phases.switch_at(9) is None and phases.preset_at(9).name == "bf16-true"
  numpy_steps = schedule.PrecisionSchedule(
    {0: "fp32", np.int64(5): "bf16-true"}
  )
  assert numpy_steps.preset_at(5).name == "bf16-true"
  # A train state's step (an int32 array) names a step too.
  assert numpy_steps.switch_at(jnp.asarray(5, jnp.int32)).name == "bf16-true"
  for bad in (-3, 2.0, True):
    with pytest.raises(ValueError, match="step must be an int >= 0, got"):
      numpy_steps.preset_at(bad)
  plan = schedule.PrecisionSchedule({0: "fp32", 10: "bf16-true", 20: "fp32"})
  names = [plan.preset_at(s).name for s in (0, 9, 10, 19, 20, 99)]
  assert names == ["fp32", "fp32", "bf16-true", "bf16-true", "fp32", "fp32"]
  assert [plan.switch_at(s) is not None for s in (0, 10, 11, 20)] == [
    False,
    True,
    False,
    True,
  ]


def test_nnx_model_and_optimizer_switch_in_place():
  import flax.nnx as nnx

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.dense = nnx.Linear(4, 8, rngs=rngs)
      self.norm = nnx.LayerNorm(8, rngs=rngs)
      self.head = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
      return self.head(nnx.relu(self.norm(self.dense(x))))

  x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 4)), jnp.float32)
  y = jnp.asarray(np.random.default_rng(1).standard_normal((8, 2)), jnp.float32)
  bf16_true = jmp_train.get_preset("bf16-true")
  model = jmp_train.nnx.wrap(Net(nnx.Rngs(0)), bf16_true.policy)
  optimizer = nnx.Optimizer(
    model, bf16_true.mixed_precision(optax.adam(1e-2)), wrt=nnx.Param
  )

  def step(model, optimizer):
    grads = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)

  step = nnx.jit(step)
  for _ in range(3):
    step(model, optimizer)
  before = _mp_state(nnx.as_pure(optimizer.opt_state))
  kernel_master = before.master_params["dense"]["kernel"]
  assert model.dense.kernel.dtype == jnp.bfloat16

  schedule.adjust_nnx_precision(model, optimizer, "fp32")
  after = _mp_state(nnx.as_pure(optimizer.opt_state))
  assert model.dense.kernel.dtype == jnp.float32
  np.testing.assert_array_equal(model.dense.kernel[...], kernel_master)
  assert model.norm.scale.dtype == jnp.float32
  for a, b in zip(
    jax.tree.leaves(after.inner_state),
    jax.tree.leaves(before.inner_state),
    strict=True,
  ):
    np.testing.assert_array_equal(a, b)
  assert int(after.steps) == 3 and int(optimizer.step[...]) == 3
  # Stepping on in fp32: the same tx, a new trace, params stay float32.
  step(model, optimizer)
  assert model.dense.kernel.dtype == jnp.float32
  assert int(jmp_train.train_metrics(optimizer.opt_state)["steps"]) == 4
  dots = jax.make_jaxpr(lambda s: nnx.merge(nnx.graphdef(model), s)(x))(
    nnx.state(model)
  )
  assert "bf16" not in str(dots)


def test_nnx_switch_moves_the_kept_fp8_gradient_history_to_the_new_loss_scale():
  # The output gradients an FP8 matmul casts are the scaled loss's: fp16's
  # 2**15 to bf16's none must divide their kept amaxes by 2**15, or the
  # delayed scale stays 2**15 too small (gradients flushed to zero).
  from flax import nnx

  from jmp_train.nnx import Fp8Meta, update_fp8

  recipe = jmp_train.fp8.DelayedScaling(amax_history_len=4)
  fp16, bf16 = (
    dataclasses.replace(jmp_train.get_preset(n), fp8=recipe)
    for n in ("fp16-fp8-mixed", "bf16-fp8-mixed")
  )
  model = jmp_train.nnx.wrap(
    nnx.Linear(4, 3, rngs=nnx.Rngs(0)), fp16.policy, fp8=recipe
  )
  optimizer = nnx.Optimizer(
    model, fp16.mixed_precision(optax.sgd(1e-3)), wrt=nnx.Param
  )
  x = jnp.asarray(np.random.default_rng(0).normal(size=(5, 4)), jnp.float32)

  @nnx.jit
  def train_step(model, optimizer):
    scale = jmp_train.current_loss_scale(optimizer.opt_state)
    diff = nnx.DiffState(0, (nnx.Param, Fp8Meta))
    grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2) * scale, argnums=diff)(model)
    optimizer.update(model, grads)
    finite = jmp_train.train_metrics(optimizer.opt_state)["last_step_finite"]
    update_fp8(model, grads, finite=finite)

  for _ in range(2):
    train_step(model, optimizer)
  before = jax.tree.map(np.asarray, model.fp8_meta.get_value())
  old = float(jmp_train.current_loss_scale(optimizer.opt_state))
  assert old == 2.0**15 and before.amax_history[2, 0] > 0
  schedule.adjust_nnx_precision(model, optimizer, bf16)
  new = float(jmp_train.current_loss_scale(optimizer.opt_state))
  after = model.fp8_meta.get_value()
  factor = np.float32(new / old)  # 2**-15: exact
  np.testing.assert_array_equal(
    after.amax_history[2], before.amax_history[2] * factor
  )
  np.testing.assert_array_equal(after.scale[2], before.scale[2] / factor)
  np.testing.assert_array_equal(after.amax_history[:2], before.amax_history[:2])
  np.testing.assert_array_equal(after.scale[:2], before.scale[:2])
  # Back to fp16 (2**15 again): the history it had, bit for bit.
  schedule.adjust_nnx_precision(model, optimizer, fp16)
  back = model.fp8_meta.get_value()
  np.testing.assert_array_equal(back.amax_history, before.amax_history)
  np.testing.assert_array_equal(back.scale, before.scale)


def test_nnx_fp8_follows_the_preset():
  from flax import nnx

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.l1 = nnx.Linear(4, 8, rngs=rngs)
      self.l2 = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
      return self.l2(nnx.relu(self.l1(x)))

  x = jnp.ones((2, 4), jnp.float32)

  def dots(model):  # each matmul's operand dtypes, read from the jaxpr
    graphdef, state = nnx.split(model)
    run = lambda s: nnx.merge(graphdef, s)(x)  # noqa: E731
    return set(primitive_operand_dtypes(run, state))

  def wrapped(name):
    preset = jmp_train.get_preset(name)
    model = jmp_train.nnx.wrap(Net(nnx.Rngs(0)), preset.policy, fp8=preset.fp8)
    tx = preset.mixed_precision(optax.adam(1e-3))
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

  e4m3 = {("float8_e4m3fn", "float8_e4m3fn")}
  # Out of FP8: the preset has no recipe.
  model, optimizer = wrapped("bf16-fp8-mixed")
  assert dots(model) == e4m3
  schedule.adjust_nnx_precision(model, optimizer, "fp32")
  assert dots(model) == {("float32", "float32")}
  assert not hasattr(model.l1, "fp8_meta")
  # Into FP8: the preset's recipe, with fresh state.
  model, optimizer = wrapped("bf16-mixed")
  schedule.adjust_nnx_precision(model, optimizer, "bf16-fp8-mixed")
  assert dots(model) == e4m3
  recipe = jmp_train.get_preset("bf16-fp8-mixed").fp8
  assert model.l1.fp8_meta.get_value().recipe == recipe
  # The same recipe under another policy keeps the FP8 state itself.
  meta = model.l1.fp8_meta
  schedule.adjust_nnx_precision(model, optimizer, "fp16-fp8-mixed")
  assert model.l1.fp8_meta is meta and dots(model) == e4m3
  # An optimizer over every variable would gain or lose the FP8 state:
  # refused before the model changes.
  model, _ = wrapped("bf16-mixed")
  tx = jmp_train.get_preset("bf16-mixed").mixed_precision(optax.adam(1e-3))
  broad = nnx.Optimizer(model, tx, wrt=nnx.Variable)
  with pytest.raises(ValueError, match=r"wrt .* also selects the FP8 state"):
    schedule.adjust_nnx_precision(model, broad, "bf16-fp8-mixed")
  assert dots(model) == {("bfloat16", "bfloat16")}
  assert not hasattr(model.l1, "fp8_meta")
  # Arguments swapped, or an optimizer without mixed_precision: named.
  with pytest.raises(TypeError, match="model must be the nnx.Module"):
    schedule.adjust_nnx_precision(broad, model, "fp32")
  with pytest.raises(TypeError, match="optimizer must be an nnx.Optimizer"):
    schedule.adjust_nnx_precision(model, model, "fp32")
  plain = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  with pytest.raises(ValueError, match=r"found 0: build the optimizer as"):
    schedule.adjust_nnx_precision(model, plain, "fp32")


def test_a_switch_of_rounding_rule_steps_with_the_new_preset_transformation():
  # RoundToNearest and StochasticRounding keep nothing beside a param: the
  # rule is the transformation's, not the state's (README). Updates of 1e-4
  # are below half a bfloat16 ulp of 1 (2**-9): rounded to nearest nothing
  # moves; rounded stochastically the mean moves by their sum, 0.02.
  rtn = dataclasses.replace(
    jmp_train.get_preset("bf16-true"), param_update=jmp_train.RoundToNearest()
  )
  sr = dataclasses.replace(rtn, param_update=jmp_train.StochasticRounding(0))
  params = {"w": jnp.ones(256, jnp.bfloat16)}
  old_tx = rtn.mixed_precision(optax.sgd(1e-4))
  params, state = schedule.adjust_precision(params, old_tx.init(params), sr)
  new_tx = sr.mixed_precision(optax.sgd(1e-4))
  assert jax.tree.structure(new_tx.init(params)) == jax.tree.structure(state)

  def final_mean(tx):
    def step(carry, _):
      p, s = carry
      u, s = tx.update({"w": jnp.ones_like(p["w"])}, s, p)
      return (optax.apply_updates(p, u), s), None

    (p, _), _ = jax.lax.scan(step, (params, state), length=200)
    return float(jnp.mean(p["w"].astype(jnp.float32)))

  assert abs(final_mean(new_tx) - (1 - 200 * 1e-4)) < 0.005  # 9 sigma
  assert final_mean(old_tx) == 1.0  # the old transformation's rule
  # NNX: adjust_nnx_precision keeps optimizer.tx; the README sets it.
  from flax import nnx

  model = jmp_train.nnx.wrap(
    nnx.Linear(256, 1, use_bias=False, rngs=nnx.Rngs(0)), rtn.policy
  )
  model.kernel.set_value(jnp.ones((256, 1), jnp.bfloat16))
  optimizer = nnx.Optimizer(model, old_tx, wrt=nnx.Param)
  schedule.adjust_nnx_precision(model, optimizer, sr)
  optimizer.tx = new_tx

  @nnx.jit
  def step(model, optimizer):
    grads = nnx.grad(lambda m: jnp.sum(m(jnp.ones((1, 256)))))(model)
    optimizer.update(model, grads)

  for _ in range(200):
    step(model, optimizer)
  mean = float(jnp.mean(model.kernel.get_value().astype(jnp.float32)))
  assert abs(mean - (1 - 200 * 1e-4)) < 0.005
