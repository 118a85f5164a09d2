"""monitor: counts against NumPy, alarms against a simulated loss scale."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_train
from jmp_train import monitor


def _tree():
  rng = np.random.default_rng(0)
  a = rng.standard_normal((5, 7)).astype(np.float32)
  a[1, 2], a[3, 3], a[4, 0] = np.inf, np.nan, -np.inf
  a[0, :3] = 0.0
  a[2, 1] = -0.0
  b = rng.standard_normal((6,)).astype(np.float16)
  b[5] = np.nan
  b[0] = 0
  return {
    "blocks": [{"kernel": jnp.asarray(a)}, {"kernel": jnp.ones((3,))}],
    "head": {"bias": jnp.asarray(b)},
    "step": jnp.zeros((4,), jnp.int32),  # ints and bools are not counted
    "mask": jnp.zeros((2,), jnp.bool_),
  }, (a, b)


def test_counts_match_numpy_under_jit():
  tree, (a, b) = _tree()
  counts = jax.jit(monitor.nonfinite_counts)(tree)
  assert int(counts["blocks"][0]["kernel"]) == (~np.isfinite(a)).sum() == 3
  assert int(counts["head"]["bias"]) == (~np.isfinite(b)).sum() == 1
  assert int(counts["blocks"][1]["kernel"]) == 0
  assert counts["step"] is None and counts["mask"] is None
  assert monitor.nonfinite_report(counts) == {
    "blocks/0/kernel": 3,
    "head/bias": 1,
  }
  zeros = jax.jit(monitor.num_zeros)(tree)
  assert zeros.dtype == jnp.int32
  assert int(zeros) == (a == 0).sum() + (b == 0).sum() == 5


def test_report_names_nnx_gradients_by_module_path():
  """An `nnx.State` of gradients is named as the README names params: the
  module path, without the `value` each variable flattens through (which
  reads like a layer called "value", as attention's projection is)."""
  from flax import nnx

  class Attention(nnx.Module):
    def __init__(self, rngs):
      self.value = nnx.Linear(2, 3, rngs=rngs)
      self.out = nnx.Linear(3, 2, rngs=rngs)

    def __call__(self, x):
      return self.out(self.value(x))

  model = Attention(nnx.Rngs(0))
  x = jnp.asarray([[1.0, jnp.inf]])
  grads = nnx.grad(lambda m: m(x).sum())(model)
  counts = monitor.nonfinite_counts(grads)
  # the inf input makes value's kernel row 1 and everything after it inf
  kernel = np.asarray(grads["value"]["kernel"].get_value())
  assert monitor.nonfinite_report(counts) == {
    "out/kernel": 6,
    "value/kernel": int((~np.isfinite(kernel)).sum()),
  }


def _run_skips(loss_scale, pattern, falling_streak=3):
  """Feeds gradients that are finite ('o') or not ('x') through the step."""
  params = {"w": jnp.ones((3,))}
  tx = jmp_train.mixed_precision(optax.sgd(0.1), loss_scale=loss_scale)

  @jax.jit
  def step(state, bad):
    grads = {"w": jnp.where(bad, jnp.inf, 1.0) * jnp.ones((3,))}
    _, state = tx.update(grads, state, params)
    alarms = monitor.warn_loss_scale(state, falling_streak=falling_streak)
    return state, alarms, jmp_train.train_metrics(state)

  state, seen = tx.init(params), []
  for c in pattern:
    state, alarms, metrics = step(state, c == "x")
    seen.append(
      (
        bool(alarms["falling"]),
        bool(alarms["at_minimum"]),
        float(metrics["loss_scale"]),
        int(metrics["skip_streak"]),
      )
    )
  jax.effects_barrier()
  return seen


def _simulate(pattern, scale, min_scale, falling_streak=3):
  """The expected alarms, from the DESIGN.md rule with hysteresis 1."""
  out, streak = [], 0
  for c in pattern:
    if c == "x":
      streak += 1
      scale = max(scale * 0.5, min_scale)
    else:
      streak = 0
    at_min = streak > 0 and scale <= min_scale
    out.append((streak >= falling_streak, at_min, scale, streak))
  return out


def test_alarms_follow_the_loss_scale_and_warn_only_when_on():
  pattern = "oxxxoxxxxoxo"
  ls = jmp_train.dynamic_loss_scale(16.0, min_scale=1.0, growth_interval=100)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    seen = _run_skips(ls, pattern)
  expected = _simulate(pattern, 16.0, 1.0)
  assert seen == expected
  messages = [str(w.message) for w in caught if w.category is RuntimeWarning]
  on = [e for e in expected if e[0] or e[1]]
  assert len(messages) == len(on) == 6
  assert (
    "keeps falling (3 skipped steps in a row, loss scale now 2)"
    in (messages[0])
  )
  assert "minimum (1)" in messages[1] and "(1 skipped steps" in messages[1]


def test_static_scale_never_at_minimum_and_bad_streak():
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    seen = _run_skips(jmp_train.StaticLossScale(1.0), "xxxx", falling_streak=2)
  assert "steps keep failing (2 skipped" in str(caught[0].message)
  assert [s[:2] for s in seen] == [(False, False), (True, False)] + [
    (True, False)
  ] * 2
  state = jmp_train.mixed_precision(optax.sgd(0.1)).init({"w": jnp.ones(2)})
  with pytest.raises(ValueError, match="falling_streak must be >= 1, got 0"):
    monitor.loss_scale_alarms(state, falling_streak=0)
  with pytest.raises(TypeError, match="falling_streak must be an int"):
    monitor.loss_scale_alarms(state, falling_streak=True)


# --- FP8 statistics, through a train step -----------------------------------


def _np_fractions(x, scale, fp8_max, dtype):
  """Fractions saturated and flushed, by the written rule, in NumPy:
  saturated where the clip changes the value ml_dtypes rounds to."""
  y = np.asarray(x, np.float32) * np.float32(scale)  # the product in f32
  q = np.clip(y, -fp8_max, fp8_max).astype(dtype).astype(np.float32)
  unclipped = y.astype(dtype).astype(np.float32)  # NaN or inf past the range
  nonzero = x != 0
  saturated = np.mean(unclipped != q)
  flushed = np.sum(nonzero & (q == 0)) / max(nonzero.sum(), 1)
  return saturated, flushed


def test_a_product_that_rounds_to_fp8_max_is_not_saturated():
  import ml_dtypes

  from jmp_train import fp8

  # fp8_max / amax rounds up in float32 for this amax, in E4M3 and in E5M2:
  # amax * scale is a hair above fp8_max, and rounds to it with or without
  # the clip. Only products past 464 (E4M3) or from 61440 (E5M2) are
  # changed by the clip.
  amax = np.float32(0.205078125)
  x = np.array([[amax, 0.1, -0.05, 0.0]], np.float32)
  w = np.diag(np.float32([0.5, 2.0, 2.0, 2.0]))
  dims = (((1,), (0,)), ((), ()))
  recipe = fp8.CurrentScaling(statistics=True)  # hybrid: E5M2 gradients

  def forward(amax_grads):
    y = fp8.fp8_dot_general(
      jnp.asarray(x),
      jnp.asarray(w),
      dims,
      scale=jnp.ones(3),
      amax=amax_grads,
      recipe=recipe,
    )
    return jnp.sum(y * jnp.asarray(x))  # the output gradient is x again

  stats = np.asarray(jax.jit(jax.grad(forward))(jnp.zeros((3, 3))))
  for row, dtype, fp8_max in (
    (0, ml_dtypes.float8_e4m3fn, 448.0),  # the input
    (2, ml_dtypes.float8_e5m2, 57344.0),  # the output gradient
  ):
    scale = np.float32(fp8_max) / amax
    assert amax * scale > fp8_max
    assert _np_fractions(x, scale, fp8_max, dtype)[0] == 0.0
    assert stats[row, 0] == amax and stats[row, 1] == 0.0, (row, stats)
  # The reference still counts what the clip changes.
  e4m3, e5m2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
  assert _np_fractions(np.float32([464.0, 464.1]), 1.0, 448.0, e4m3)[0] == 0.5
  over = np.float32([61439.996, 61440.0])
  assert _np_fractions(over, 1.0, 57344.0, e5m2)[0] == 0.5


@pytest.mark.parametrize("name", ["delayed", "current"])
def test_fp8_statistics_follow_the_numpy_rule_and_hold_on_a_skipped_step(
  name,
):
  import flax.linen as nn
  import ml_dtypes

  from jmp_train import fp8, train

  recipe = {
    "delayed": fp8.DelayedScaling(amax_history_len=2, statistics=True),
    "current": fp8.CurrentScaling(statistics=True),
  }[name]
  model = jmp_train.linen.wrap(nn.Dense(4), "f32", fp8=recipe)
  rng = np.random.default_rng(0)
  x = rng.standard_normal((8, 6)).astype(np.float32)
  x[0, :3] = [600.0, -1000.0, 1e-4]  # saturate at scale 1; flush below 2^-10
  x[1, :2] = [2e-7, 0.0]
  variables = jax.jit(model.init)(jax.random.key(0), x)
  params = variables["params"]

  def loss_fn(params, batch, model_state, key):
    y = model.apply({"params": params, **model_state}, batch)
    return jnp.mean(y**2)

  tx = jmp_train.mixed_precision(optax.sgd(0.0))  # params stay put
  state = train.TrainState.create(
    params=params, tx=tx, fp8=variables["fp8_meta"]
  )
  step = train.make_train_step(loss_fn, tx)
  state, _ = step(state, x)
  stats = jax.device_get(monitor.fp8_statistics(state.fp8))
  e4m3 = ml_dtypes.float8_e4m3fn
  kernel = np.asarray(params["kernel"])
  for tensor, value in (("input", x), ("kernel", kernel)):
    amax = np.abs(value).max()
    # Delayed: step 1 casts with scale 1. Current: fp8_max / amax in f32.
    scale = 1.0 if name == "delayed" else np.float32(448.0) / amax
    saturated, flushed = _np_fractions(value, scale, 448.0, e4m3)
    assert stats[f"{tensor}/amax"] == np.float32(amax)
    np.testing.assert_allclose(stats[f"{tensor}/saturated"], saturated)
    np.testing.assert_allclose(stats[f"{tensor}/flushed"], flushed)
  if name == "delayed":  # the test data do saturate and flush
    assert stats["input/saturated"] > 0 and stats["input/flushed"] > 0
  # A step with an inf keeps every statistic.
  poisoned = x.copy()
  poisoned[2, 2] = np.inf
  after, metrics = step(state, poisoned)
  assert not bool(metrics["last_step_finite"])
  again = jax.device_get(monitor.fp8_statistics(after.fp8))
  assert again.keys() == stats.keys()
  for key in stats:
    np.testing.assert_array_equal(again[key], stats[key])
