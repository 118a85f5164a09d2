"""FP8 delayed scaling: the recipe's scale rule, the FP8 matmul, Flax wiring."""

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jmp_train
from jmp_train import fp8

E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"

# ---------------------------------------------------------------------------
# The recipe: scale = fp8_max / amax / 2**margin over a rolled history.

# Per step amaxes: zeros first (scale stays 1), a spike, NaN, inf, a value so
# small the scale would overflow float32, and plain values in between.
AMAXES = [0.0, 0.0, 2.0, 3.0, 0.5, 1e4, 1.0, 1.0, 1.0, 1.0, 1.0, np.nan]
AMAXES += [2.0, 2.0, 2.0, 2.0, 2.0, np.inf, 0.25, 1e-44, 4.0, 0.0, 0.0, 0.0]


def _reference_scales(amaxes, fp8_max, margin, algo, history_len):
  """Transformer Engine's rule, in float64 NumPy, one step at a time."""
  history, scale, out = np.zeros(history_len), 1.0, []
  for a in amaxes:
    history = np.concatenate([[a], history[:-1]])
    amax = np.max(history) if algo == "max" else history[0]  # NaN propagates
    with np.errstate(all="ignore"):
      new = fp8_max / amax / 2.0**margin
      if amax > 0 and np.isfinite(amax):  # kept in float32's normal range
        scale = min(max(new, 2.0**-126), 2.0**126)
    out.append(scale)
  return np.array(out)


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_scales_follow_the_float64_reference(fmt, algo):
  recipe = fp8.DelayedScaling(
    format=fmt, margin=1, amax_history_len=4, amax_compute_algo=algo
  )
  # The three tensors see the same amaxes, scaled differently.
  factors = np.array([1.0, 0.5, 64.0])
  amaxes = np.array(AMAXES)[:, None] * factors

  @jax.jit
  def run(state):
    def body(state, amax):
      state = fp8.step_state(state, amax)
      return state, state.scale

    return jax.lax.scan(body, state, jnp.asarray(amaxes, jnp.float32))[1]

  got = np.asarray(run(fp8.init_state(recipe)))
  fp8_max = {"hybrid": [448, 448, 57344], "e4m3": [448, 448, 448]}[fmt]
  for i in range(3):
    want = _reference_scales(
      amaxes[:, i].astype(np.float32), fp8_max[i], 1, algo, 4
    )
    np.testing.assert_allclose(got[:, i], want, rtol=1e-6)
  # The rule did something in each regime: kept 1 on zeros, moved, and froze.
  assert got[0, 0] == 1.0 and len(set(got[:, 0].tolist())) > 4


def test_delayed_scales_stay_in_float32s_normal_range():
  """A scale of 0 (2**margin past float32's range) makes every output NaN,
  one above 2**126 a subnormal 1 / scale that XLA flushes to 0: both are
  clipped, as the current recipe's scales are."""
  cases = [  # (margin, amax, the written rule in float64, clipped)
    (200, 1.0, 448.0 / 2.0**200),
    (127, 448.0, 448.0 / 448.0 / 2.0**127),
    (3, 2e-37, 448.0 / 2e-37 / 8),
    (8, 1e-37, 448.0 / 1e-37 / 256),  # fp8_max / amax alone overflows
    (3, 2.0, 448.0 / 2.0 / 8),
  ]
  for margin, amax, exact in cases:
    recipe = fp8.DelayedScaling(margin=margin, amax_history_len=1)
    state = fp8.step_state(fp8.init_state(recipe), jnp.full(3, amax))
    want = np.float32(min(max(exact, 2.0**-126), 2.0**126))
    np.testing.assert_allclose(state.scale[:2], want, rtol=1e-6)
    x = jnp.full((2, 4), amax / 2, jnp.float32)
    y = fp8.fp8_dot_general(
      x,
      jnp.ones((4, 3)),
      (((1,), (0,)), ((), ())),
      scale=state.scale,
      amax=state.amax[0],
      recipe=recipe,
    )
    assert np.all(np.isfinite(np.asarray(y)))


def test_update_refuses_gradients_of_other_state():
  delayed = fp8.init_state(fp8.DelayedScaling(amax_history_len=2))
  current = fp8.init_state(fp8.CurrentScaling())
  with pytest.raises(
    ValueError, match=r"tree holds 1 FP8 state\(s\) and grads 0"
  ):
    fp8.update({"dot": delayed}, {"kernel": jnp.ones(3)})  # params' grads
  with pytest.raises(ValueError, match="recipe DelayedScaling.*CurrentScaling"):
    fp8.update({"dot": delayed}, {"dot": current})


def test_update_never_advances_on_a_skipped_step_or_a_non_finite_amax():
  recipe = fp8.DelayedScaling(amax_history_len=3)
  tree = {"dot": fp8.init_state(recipe, calls=2), "w": jnp.ones(2)}
  grads = {
    "dot": tree["dot"].replace(
      amax=(jnp.array([1.0, 8.0, 2.0]), jnp.array([4.0, 1.0, 2.0]))
    ),
    "w": jnp.ones(2),
  }
  new = fp8.update(tree, grads)
  # Two calls of one matmul combine by max: amax (4, 8, 2).
  np.testing.assert_array_equal(
    new["dot"].amax_history[:, 0], np.array([4.0, 8.0, 2.0], np.float32)
  )
  np.testing.assert_allclose(new["dot"].scale, [112.0, 56.0, 28672.0])
  assert new["w"] is tree["w"]
  unchanged = [
    fp8.update(tree, grads, finite=jnp.array(False)),
    fp8.update(
      tree,
      {
        **grads,
        "dot": grads["dot"].replace(amax=(jnp.array([1.0, np.nan, 1.0]),) * 2),
      },
    ),
  ]
  for out in unchanged:
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(tree), strict=True):
      np.testing.assert_array_equal(a, b)


def test_rescale_output_grads_moves_the_gradient_row_only():
  recipe = fp8.DelayedScaling(amax_history_len=3)
  fresh = fp8.init_state(recipe)
  grads = fresh.replace(amax=(jnp.array([2.0, 4.0, 64.0]),))
  tree = {"seen": fp8.update(fresh, grads), "fresh": fresh, "w": jnp.ones(2)}
  moved = fp8.rescale_output_grads(tree, 2.0**-15)
  # The written rule: the gradient history times the factor, the scale
  # (57344 / 64 before) divided by it; the other rows and leaves as they were.
  np.testing.assert_array_equal(moved["seen"].amax_history[2], [2.0**-9, 0, 0])
  assert moved["seen"].scale[2] == 57344 / 64 * 2.0**15
  np.testing.assert_array_equal(moved["seen"].scale[:2], tree["seen"].scale[:2])
  np.testing.assert_array_equal(
    moved["seen"].amax_history[:2], tree["seen"].amax_history[:2]
  )
  # No history yet: the first-step scale 1 stays.
  np.testing.assert_array_equal(moved["fresh"].scale, 1.0)
  assert moved["w"] is tree["w"]
  for bad in (0.0, -1.0, np.inf, jnp.ones(2)):
    with pytest.raises(ValueError, match="factor must be a positive finite"):
      fp8.rescale_output_grads(tree, bad)


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"format": "e5m2"}, "Unknown FP8 format 'e5m2'.*'hybrid', 'e4m3'"),
    ({"amax_compute_algo": "mean"}, "'mean'.*'max', 'most_recent'"),
    ({"margin": -1}, "margin must be an int >= 0, got -1"),
    ({"margin": 0.5}, "margin must be an int >= 0, got 0.5"),
    ({"amax_history_len": 0}, "amax_history_len must be an int >= 1, got 0"),
  ],
)
def test_bad_recipes_are_refused(kwargs, match):
  with pytest.raises(ValueError, match=match):
    fp8.DelayedScaling(**kwargs)


# ---------------------------------------------------------------------------
# The FP8 matmul.

DIMENSION_NUMBERS = [
  ((((1,), (0,)), ((), ())), (4, 5), (5, 3)),  # Dense
  ((((2,), (1,)), ((0,), (0,))), (2, 4, 5), (2, 5, 3)),  # batched
  ((((1, 3), (3, 0)), ((0,), (1,))), (2, 4, 3, 5), (5, 2, 6, 4)),  # mixed
  ((((0,), (1,)), ((), ())), (5, 4), (3, 5, 2)),  # transposed
]


@pytest.mark.parametrize("dn, lhs_shape, rhs_shape", DIMENSION_NUMBERS)
def test_fp8_dot_is_exact_on_fp8_values(dn, lhs_shape, rhs_shape):
  """Small integers are exact in E4M3 and E5M2: the product and both
  gradients equal lax.dot_general's, and the amax gradient is the amaxes."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.integers(-3, 4, lhs_shape), jnp.float32)
  w = jnp.asarray(rng.integers(-3, 4, rhs_shape), jnp.float32)
  y = jax.lax.dot_general(x, w, dn)
  ct = jnp.asarray(rng.integers(-5, 6, y.shape), jnp.float32)

  def ours(x, w, amax):
    out = fp8.fp8_dot_general(
      x, w, dn, scale=jnp.ones(3), amax=amax, recipe=fp8.DelayedScaling()
    )
    return jnp.sum(out * ct), out

  (_, out), grads = jax.jit(jax.value_and_grad(ours, (0, 1, 2), has_aux=True))(
    x, w, jnp.zeros(3)
  )
  want = jax.grad(
    lambda x, w: jnp.sum(jax.lax.dot_general(x, w, dn) * ct), (0, 1)
  )(x, w)
  np.testing.assert_array_equal(out, y)
  np.testing.assert_array_equal(grads[0], want[0])
  np.testing.assert_array_equal(grads[1], want[1])
  np.testing.assert_array_equal(
    grads[2], [jnp.abs(x).max(), jnp.abs(w).max(), jnp.abs(ct).max()]
  )


def _q(x, scale, dtype, fp8_max):
  """NumPy: float32 x * scale, saturated, rounded to an FP8 dtype."""
  y = np.float32(x) * np.float32(scale)
  y = np.where(np.isfinite(y), np.clip(y, -fp8_max, fp8_max), y)
  return y.astype(dtype).astype(np.float64)


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_fp8_dot_matches_numpy_quantization(fmt):
  rng = np.random.default_rng(1)
  x = (rng.normal(size=(6, 16)) * 100).astype(np.float32)  # some saturate
  w = rng.normal(size=(16, 5)).astype(np.float32)
  g = (rng.normal(size=(6, 5)) * 1e-3).astype(np.float32)
  scale = np.array([2.0, 64.0, 2.0**14], np.float32)
  recipe = fp8.DelayedScaling(format=fmt)
  dn = (((1,), (0,)), ((), ()))

  out, vjp = jax.vjp(
    lambda x, w: fp8.fp8_dot_general(
      x, w, dn, scale=jnp.asarray(scale), amax=jnp.zeros(3), recipe=recipe
    ),
    x,
    w,
  )
  dx, dw = vjp(jnp.asarray(g))
  e4, bwd = (
    ml_dtypes.float8_e4m3fn,
    {
      "hybrid": (ml_dtypes.float8_e5m2, 57344.0),
      "e4m3": (ml_dtypes.float8_e4m3fn, 448.0),
    }[fmt],
  )
  qx, qw = _q(x, scale[0], e4, 448.0), _q(w, scale[1], e4, 448.0)
  qg = _q(g, scale[2], *bwd)
  assert np.abs(qx).max() == 448.0  # saturation was exercised
  s = scale.astype(np.float64)
  np.testing.assert_allclose(out, qx @ qw / (s[0] * s[1]), rtol=1e-5)
  np.testing.assert_allclose(dx, qg @ qw.T / (s[2] * s[1]), rtol=1e-5)
  np.testing.assert_allclose(dw, qx.T @ qg / (s[2] * s[0]), rtol=1e-5)


def test_fp8_dot_keeps_inf_and_nan_non_finite():
  """Saturation is for finite values only: an overflow still skips the step."""
  dn = (((1,), (0,)), ((), ()))
  x = jnp.ones((2, 3)).at[0, 0].set(jnp.inf)
  w = jnp.ones((3, 2))
  fwd = functools.partial(
    fp8.fp8_dot_general, dimension_numbers=dn, scale=jnp.ones(3)
  )
  out = fwd(x, w, amax=jnp.zeros(3))
  assert not np.isfinite(out[0]).any() and np.isfinite(out[1]).all()
  _, vjp = jax.vjp(lambda w: fwd(jnp.ones((2, 3)), w, amax=jnp.zeros(3)), w)
  (dw,) = vjp(jnp.ones((2, 2)).at[1, 1].set(jnp.inf))
  assert not np.isfinite(dw).all()


# ---------------------------------------------------------------------------
# Flax: the dot_general module and linen.wrap(fp8=...).


class Block(nn.Module):
  """Every matmul module Flax has, and an output head."""

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(16)(x)
    h = nn.LayerNorm()(h)
    h = nn.DenseGeneral((2, 4))(h).reshape(h.shape[0], -1)
    h = nn.Einsum((8, 8), "bi,io->bo")(h)
    return nn.Dense(10, name="head")(nn.relu(h))


def _wrapped(recipe=None, init=jax.jit, **kwargs):
  recipe = recipe or fp8.DelayedScaling(amax_history_len=4)
  kwargs.setdefault("fp8_exclude", ("head",))
  model = jmp_train.linen.wrap(
    Block(), "p=f32,c=bf16,o=f32", fp8=recipe, **kwargs
  )
  return model, init(model.init)(jax.random.key(0), jnp.ones((2, 5)))


def _loss(model):
  def loss(params, meta, x):
    return jnp.sum(model.apply({"params": params, "fp8_meta": meta}, x) ** 2)

  return loss


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_forward_is_e4m3_and_backward_e5m2_in_the_jaxpr(fmt, operand_dtypes):
  model, v = _wrapped(fp8.DelayedScaling(format=fmt, amax_history_len=4))
  args = (v["params"], v["fp8_meta"], jnp.ones((2, 5)))
  forward = operand_dtypes(_loss(model), *args)
  assert sorted(forward) == sorted(
    [(E4M3, E4M3)] * 3 + [("bfloat16", "bfloat16")]
  )
  both = operand_dtypes(jax.grad(_loss(model), (0, 1)), *args)
  backward = list(both)
  for dtypes in forward:
    backward.remove(dtypes)
  grad_dtype = E5M2 if fmt == "hybrid" else E4M3
  fp8_backward = [d for d in backward if d != ("bfloat16", "bfloat16")]
  # dL/dx and dL/dw of each of the three FP8 matmuls: the gradient in
  # grad_dtype times the saved E4M3 operand.
  assert fp8_backward == [(grad_dtype, E4M3)] * 6
  assert len(backward) - len(fp8_backward) == 2  # the head's, in bfloat16


def test_wrap_puts_every_matmul_but_the_excluded_ones_in_fp8():
  model, v = _wrapped()
  plain = jmp_train.linen.wrap(Block(), "p=f32,c=bf16,o=f32")
  plain_v = jax.jit(plain.init)(jax.random.key(0), jnp.ones((2, 5)))
  assert set(v["fp8_meta"]) == {"Dense_0", "DenseGeneral_0", "Einsum_0"}
  # The params are untouched by FP8: same tree, dtypes and values.
  for a, b in zip(
    jax.tree.leaves(v["params"]),
    jax.tree.leaves(plain_v["params"]),
    strict=True,
  ):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)
  # Exclusion by class and by glob pattern, everything inside included.
  shapes = functools.partial(functools.partial, jax.eval_shape)
  _, v = _wrapped(init=shapes, fp8_exclude=(nn.DenseGeneral, "Ein*", "head"))
  assert set(v["fp8_meta"]) == {"Dense_0"}
  _, v = _wrapped(init=shapes, fp8_exclude=(Block,))
  assert "fp8_meta" not in v


def test_a_layer_with_its_own_dot_general_cls_keeps_it():
  mine = fp8.DelayedScaling(margin=3, amax_history_len=2)

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      dot = functools.partial(fp8.Fp8DotGeneral, recipe=mine)
      h = nn.Dense(4)(x)
      return nn.Dense(3, dot_general_cls=dot)(h)

  model = jmp_train.linen.wrap(Model(), "bf16", fp8=True)
  v = jax.jit(model.init)(jax.random.key(0), jnp.ones((1, 2)))
  states = v["fp8_meta"]
  assert states["Dense_1"]["Fp8DotGeneral_0"]["fp8"].recipe == mine
  assert (
    states["Dense_0"]["Fp8DotGeneral_0"]["fp8"].recipe == fp8.DEFAULT_RECIPE
  )


def test_a_module_called_twice_combines_its_amaxes_by_max():
  class Twice(nn.Module):
    @nn.compact
    def __call__(self, x):
      dense = nn.Dense(4, dot_general_cls=fp8.Fp8DotGeneral)
      return dense(x) + dense(3.0 * x)

  model, x = Twice(), jnp.asarray([[1.0, -2.0, 0.5]])
  v = jax.jit(model.init)(jax.random.key(0), x)
  state = v["fp8_meta"]["Dense_0"]["Fp8DotGeneral_0"]["fp8"]
  assert len(state.amax) == 2

  def loss(params, meta):
    return jnp.sum(model.apply({"params": params, "fp8_meta": meta}, x))

  _, meta_grads = jax.jit(jax.grad(loss, (0, 1)))(v["params"], v["fp8_meta"])
  new = fp8.update(v["fp8_meta"], meta_grads)["Dense_0"]["Fp8DotGeneral_0"]
  kernel = np.abs(np.asarray(v["params"]["Dense_0"]["kernel"])).max()
  # max(|x|, |3x|) = 6, not the sum 8; the output gradient is 1 both times.
  np.testing.assert_allclose(new["fp8"].amax_history[:, 0], [6.0, kernel, 1.0])
  with pytest.raises(ValueError, match="called 3 times but was initialised"):

    class Thrice(Twice):
      @nn.compact
      def __call__(self, x):
        dense = nn.Dense(4, dot_general_cls=fp8.Fp8DotGeneral)
        return dense(x) + dense(x) + dense(x)

    Thrice().apply(v, x)


def test_fp8_einsum_module_equals_nn_einsum_on_fp8_values():
  x = jnp.asarray([[1.0, -2.0, 0.5], [0.25, 3.0, -1.0]])
  kwargs = dict(shape=(3, 4), einsum_str="bi,io->bo")
  dot = functools.partial(fp8.Fp8DotGeneral, recipe=fp8.DelayedScaling())
  ours = fp8.Einsum(**kwargs, dot_general_cls=dot)
  v = ours.init(jax.random.key(0), x)
  kernel = jnp.round(v["params"]["kernel"] * 8) / 8  # exact in E4M3
  v = {**v, "params": {**v["params"], "kernel": kernel}}
  ref = nn.Einsum(**kwargs).apply({"params": v["params"]}, x)
  np.testing.assert_array_equal(ours.apply(v, x), ref)
  assert "fp8_meta" not in fp8.Einsum(**kwargs).init(jax.random.key(0), x)


def test_wrap_refuses_bad_fp8_arguments():
  with pytest.raises(ValueError, match="fp8 must be a jmp_train.fp8 recipe"):
    jmp_train.linen.wrap(Block(), "bf16", fp8="hybrid")
  with pytest.raises(TypeError, match="got 1"):
    jmp_train.linen.wrap(Block(), "bf16", fp8=1)
  with pytest.raises(TypeError, match="fp8_exclude takes .* got 3"):
    jmp_train.linen.wrap(Block(), "bf16", fp8=True, fp8_exclude=(3,))


@pytest.mark.parametrize("pattern", ["haed", "*/head", "lm_head"])
def test_a_pattern_that_excludes_nothing_is_refused(pattern):
  # A typo would leave the head in FP8 with no error. The check runs on the
  # params, so it holds on init (second pass) and on apply alike.
  shapes = functools.partial(functools.partial, jax.eval_shape)
  with pytest.raises(ValueError, match=f"pattern '{re.escape(pattern)}' ma"):
    _wrapped(init=shapes, fp8_exclude=("head", pattern))
  _, v = _wrapped(init=shapes)
  model = jmp_train.linen.wrap(
    Block(), "bf16", fp8=True, fp8_exclude=(pattern,)
  )
  with pytest.raises(
    ValueError,
    match=r"with params: DenseGeneral_0, Dense_0, Einsum_0, LayerNorm_0, head\.",
  ):
    jax.eval_shape(model.apply, v, jnp.ones((2, 5)))

  # An init through a method that does not reach every layer is not
  # checked (its params are partial); an apply of it is, on all params.
  class EncDec(nn.Module):
    def setup(self):
      self.enc, self.dec = nn.Dense(4), nn.Dense(4)

    def encode(self, x):
      return self.enc(x)

    def __call__(self, x):
      return self.dec(self.encode(x))

  enc_dec = jmp_train.linen.wrap(
    EncDec(), "bf16", fp8=True, fp8_exclude=("dec",)
  )
  key, x = jax.random.key(0), jnp.ones((2, 5))
  jax.eval_shape(functools.partial(enc_dec.init, method="encode"), key, x)
  full = jax.eval_shape(enc_dec.init, key, x)
  jax.eval_shape(functools.partial(enc_dec.apply, method="encode"), full, x)
  # Without FP8 the patterns change nothing and are not checked; a wrap
  # inside a model matches the full path.
  plain = jmp_train.linen.wrap(Block(), "bf16", fp8_exclude=(pattern,))
  jax.eval_shape(plain.init, jax.random.key(0), jnp.ones((2, 5)))

  class Outer(nn.Module):
    @nn.compact
    def __call__(self, x):
      inner = Block(name="inner")
      return jmp_train.linen.wrap(
        inner, "bf16", fp8=True, fp8_exclude=("inner/head",)
      )(x)

  v = jax.eval_shape(Outer().init, jax.random.key(0), jnp.ones((2, 5)))
  assert set(v["fp8_meta"]["inner"]) == {
    "Dense_0",
    "DenseGeneral_0",
    "Einsum_0",
  }


# ---------------------------------------------------------------------------
# The step: FP8 metadata beside the params. The user's step differentiates the
# loss with respect to "fp8_meta", combines the amaxes of micro-batches and
# devices by max, and calls fp8.update once.


def test_update_after_max_over_micro_batches_and_devices_follows_the_rule():
  """2 devices x 2 micro-batches, combined as a train step does: jnp.maximum
  over the gradient trees (from zeros), then lax.pmax; `update` then rolls in
  the max of the amaxes, by the written rule."""
  recipe = fp8.DelayedScaling(amax_history_len=3)
  model = nn.Dense(
    3, dot_general_cls=functools.partial(fp8.Fp8DotGeneral, recipe=recipe)
  )
  rng = np.random.default_rng(0)
  # [device, micro-batch, rows, features]; the largest input and the largest
  # output gradient sit in different micro-batches on different devices.
  x = (
    rng.normal(size=(2, 2, 4, 5))
    * np.array([[1, 2], [8, 0.5]])[..., None, None]
  )
  ct = (
    rng.normal(size=(2, 2, 4, 3))
    * np.array([[2, 16], [1, 0.5]])[..., None, None]
  )
  x, ct = jnp.asarray(x, jnp.float32), jnp.asarray(ct, jnp.float32)
  v = jax.jit(model.init)(jax.random.key(0), x[0, 0])
  meta = v["fp8_meta"]

  def device_grads(x, ct):
    # Per-device copies, as a data-parallel step makes them: otherwise the
    # backward pass would have to reduce their gradients over devices.
    params, meta_here = jax.tree.map(
      lambda a: jax.lax.pcast(a, "data", to="varying"), (v["params"], meta)
    )

    def micro(acc, batch):
      x, ct = batch
      grads = jax.grad(
        lambda m: jnp.sum(
          model.apply({"params": params, "fp8_meta": m}, x) * ct
        )
      )(meta_here)
      return jax.tree.map(jnp.maximum, acc, grads), grads

    zeros = jax.tree.map(jnp.zeros_like, meta_here)
    acc, each = jax.lax.scan(micro, zeros, (x[0], ct[0]))
    return jax.lax.pmax(acc, "data"), each

  mesh = jax.make_mesh(
    (2,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2]
  )
  grads_fn = jax.jit(
    jax.shard_map(
      device_grads,
      mesh=mesh,
      in_specs=(P("data"), P("data")),
      out_specs=(P(), P("data")),
    )
  )
  grads, each = grads_fn(x, ct)
  # What makes max-combining sound: amaxes >= 0 (zeros are neutral) and
  # zero gradients for the scale and the history, which max keeps zero.
  for g in (grads, each):
    (state,) = jax.tree.leaves(g, is_leaf=fp8.is_fp8_state)
    assert (np.asarray(state.amax) >= 0).all()
    np.testing.assert_array_equal(state.scale, 0.0)
    np.testing.assert_array_equal(state.amax_history, 0.0)

  (new,) = jax.tree.leaves(fp8.update(meta, grads), is_leaf=fp8.is_fp8_state)
  kernel = np.asarray(v["params"]["kernel"])
  want = np.array(
    [np.abs(x).max(), np.abs(kernel).max(), np.abs(ct).max()], np.float32
  )
  assert want[0] == np.abs(x[1, 0]).max() and want[2] == np.abs(ct[0, 1]).max()
  np.testing.assert_array_equal(new.amax_history[:, 0], want)
  np.testing.assert_array_equal(new.amax_history[:, 1:], 0.0)
  np.testing.assert_allclose(
    new.scale, np.array([448.0, 448.0, 57344.0]) / want, rtol=1e-6
  )
  # An inf output gradient in one micro-batch survives both maxes: held.
  grads, _ = grads_fn(x, ct.at[1, 0, 0, 0].set(jnp.inf))
  for a, b in zip(
    jax.tree.leaves(fp8.update(meta, grads)), jax.tree.leaves(meta), strict=True
  ):
    np.testing.assert_array_equal(a, b)


def test_a_step_written_by_hand_updates_fp8_meta_beside_the_optimizer():
  model, v = _wrapped()
  tx = jmp_train.mixed_precision(
    optax.adamw(1e-2, weight_decay=0.1),
    loss_scale=jmp_train.dynamic_loss_scale(),
  )
  params, meta, opt_state = v["params"], v["fp8_meta"], tx.init(v["params"])
  x = jnp.ones((2, 5))

  @jax.jit
  def step(params, meta, opt_state, poison):
    scale = jmp_train.current_loss_scale(opt_state)

    def loss(params, meta):
      # `poison` reaches the head's bias only: the FP8 amaxes stay finite,
      # so only `finite` can hold the FP8 state.
      extra = poison * jnp.sum(params["head"]["bias"])
      return scale * (_loss(model)(params, meta, x) + extra)

    grads, meta_grads = jax.grad(loss, (0, 1))(params, meta)
    updates, opt_state = tx.update(grads, opt_state, params)
    finite = jmp_train.train_metrics(opt_state)["last_step_finite"]
    meta = fp8.update(meta, meta_grads, finite=finite)
    return optax.apply_updates(params, updates), meta, opt_state

  new_params, new_meta, new_opt = step(params, meta, opt_state, 0.0)
  assert not np.array_equal(
    new_params["Dense_0"]["kernel"], params["Dense_0"]["kernel"]
  )
  states = jax.tree.leaves(new_meta, is_leaf=fp8.is_fp8_state)
  assert len(states) == 3
  for state in states:
    amax = np.asarray(state.amax_history[:, 0])
    assert (amax > 0).all()
    np.testing.assert_array_equal(state.amax_history[:, 1:], 0.0)
    np.testing.assert_allclose(
      state.scale, np.array([448.0, 448.0, 57344.0]) / amax, rtol=1e-6
    )
  # A skipped step: params and FP8 state keep their bits.
  skipped = step(new_params, new_meta, new_opt, jnp.inf)
  for a, b in zip(
    jax.tree.leaves(skipped[:2]),
    jax.tree.leaves((new_params, new_meta)),
    strict=True,
  ):
    np.testing.assert_array_equal(a, b)
  assert jmp_train.current_loss_scale(skipped[2]) < (
    jmp_train.current_loss_scale(new_opt)
  )


def test_scanned_layers_keep_one_fp8_state_per_layer():
  class Layer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      return nn.relu(nn.Dense(8)(x)), None

  class Deep(nn.Module):
    @nn.compact
    def __call__(self, x):
      scan = nn.scan(
        Layer,
        variable_axes={"params": 0, "fp8_meta": 0},
        split_rngs={"params": True},
        length=3,
      )
      return scan()(x, None)[0]

  model = jmp_train.linen.wrap(
    Deep(), "float32", fp8=fp8.DelayedScaling(amax_history_len=2)
  )
  x = jnp.full((2, 8), -2.0)
  v = jax.jit(model.init)(jax.random.key(0), x)

  def loss(params, meta):
    return jnp.sum(model.apply({"params": params, "fp8_meta": meta}, x))

  _, grads = jax.jit(jax.grad(loss, (0, 1)))(v["params"], v["fp8_meta"])
  (state,) = jax.tree.leaves(
    fp8.update(v["fp8_meta"], grads), is_leaf=fp8.is_fp8_state
  )
  assert state.scale.shape == (3, 3) and state.amax_history.shape == (3, 3, 2)
  history = np.asarray(state.amax_history[..., 0])
  assert history[0, 0] == 2.0  # layer 0 sees |x| = 2
  assert len(set(history[:, 1].tolist())) == 3  # each layer its own kernel
  np.testing.assert_allclose(state.scale, 448.0 / history * [1, 1, 128])


def test_a_lifted_transform_without_the_fp8_collection_says_how():
  """Flax's examples scan with variable_axes={"params": 0} and nn.RNN
  broadcasts only params: Flax's own error names neither fix."""

  class Layer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      return nn.Dense(8)(x), None

  class Deep(nn.Module):
    @nn.compact
    def __call__(self, x):
      scan = nn.scan(
        nn.remat(Layer),
        variable_axes={"params": 0},
        split_rngs={"params": True},
        length=3,
      )
      return scan(name="layers")(x, None)[0]

  class Rnn(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.RNN(nn.LSTMCell(8))(x)

  x = jnp.ones((2, 8))
  for model, inputs, fix in (
    (Deep(), x, r"variable_axes=\{'params': 0, 'fp8_meta': 0\}"),
    (Rnn(), x[:, None], r"variable_broadcast=\['params', 'fp8_meta'\]"),
  ):
    wrapped = jmp_train.linen.wrap(model, "float32", fp8="current")
    with pytest.raises(ValueError, match=f"finds no 'fp8_meta'.*{fix}"):
      wrapped.init(jax.random.key(0), inputs)
  # Outside a lifted transform: apply was not given the FP8 state.
  dense = jmp_train.linen.wrap(nn.Dense(3), "float32", fp8="current")
  v = dense.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="pass all the variables init"):
    dense.apply({"params": v["params"]}, x)


@pytest.mark.parametrize(
  "recipe, fp8_params",
  [
    ("delayed", False),
    ("current", False),
    ("blockwise", False),
    (fp8.CurrentScaling(power_of_two_scales=True), True),
  ],
  ids=["delayed", "current", "blockwise", "fp8-params"],
)
@pytest.mark.parametrize(
  "remat_policy",
  [
    jax.checkpoint_policies.everything_saveable,
    jax.checkpoint_policies.save_anything_except_these_names("none"),
    jax.checkpoint_policies.save_only_these_names(*fp8.REMAT_NAMES),
    jax.checkpoint_policies.dots_saveable,
  ],
  ids=["everything", "anything-except-names", "fp8-names", "dots"],
)
def test_fp8_layers_under_remat_give_the_loss_and_gradients_without_it(
  recipe, fp8_params, remat_policy
):
  """nn.remat with a policy that saves the FP8 operands: jax.checkpoint
  passes each saved float through reduce_precision, which made E4M3 values
  of 256 or more NaN (current scaling maps each amax to 448: a NaN loss)
  and flushed E4M3 subnormals to zero (delayed scaling at scale 1: a wrong
  loss). The FP8 matmul's own checkpoint names save what its backward pass
  reads."""

  class Mlp(nn.Module):
    remat: bool

    @nn.compact
    def __call__(self, x):
      def layer(module, x):
        return nn.gelu(nn.Dense(32, name="fc")(x))

      if self.remat:
        layer = nn.remat(layer, policy=remat_policy)
      return nn.Dense(4, name="out")(layer(self, x))

  x = jax.random.normal(jax.random.key(1), (16, 32))
  _assert_remat_changes_nothing(Mlp, x, fp8=recipe, fp8_params=fp8_params)


def _assert_remat_changes_nothing(module, x, **fp8_args):
  """`module(remat)` under bf16-mixed and `jmp_train.linen.wrap`'s FP8
  arguments: loss, param gradients and FP8 state gradients with remat equal
  those without it, which are finite."""
  policy = jmp_train.get_preset("bf16-mixed").policy
  fp8_params = fp8_args.get("fp8_params", False)

  def wrapped(remat):
    return jmp_train.linen.wrap(module(remat), policy, **fp8_args)

  variables = jax.jit(wrapped(False).init)(jax.random.key(0), x)
  params = variables["params"]
  if fp8_params:
    params = fp8.with_grad_slots(params)

  def grads(remat):
    model = wrapped(remat)

    def loss(params, meta):
      y = model.apply({"params": params, fp8.COLLECTION: meta}, x)
      return jnp.sum(jnp.square(y.astype(jnp.float32)))

    f = jax.value_and_grad(loss, argnums=(0, 1), allow_int=fp8_params)
    value, (g, g_meta) = jax.jit(f)(params, variables[fp8.COLLECTION])
    return value, fp8.grads_of(g) if fp8_params else g, g_meta

  want, got = grads(False), grads(True)
  floats = [x for x in jax.tree.leaves(want) if x.dtype != jax.dtypes.float0]
  assert all(np.isfinite(x).all() for x in floats)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    if w.dtype != jax.dtypes.float0:
      np.testing.assert_allclose(g, w, rtol=1e-6)


@pytest.mark.parametrize("recipe", ["delayed", "current", "blockwise"])
def test_fp8_layers_in_a_scan_of_remat_blocks_match_the_scan_without_remat(
  recipe,
):
  """Flax's stacked-layers idiom, nn.scan(nn.remat(Block)), with a policy
  that saves everything: NaN before the FP8 operands were saved as bytes."""

  class Layer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      return nn.gelu(nn.Dense(16)(x)), None

  class Deep(nn.Module):
    remat: bool

    @nn.compact
    def __call__(self, x):
      layer = Layer
      if self.remat:
        everything = jax.checkpoint_policies.everything_saveable
        layer = nn.remat(Layer, policy=everything)
      scan = nn.scan(
        layer,
        variable_axes={"params": 0, fp8.COLLECTION: 0},
        split_rngs={"params": True},
        length=3,
      )
      return scan(name="layers")(x, None)[0]

  x = jax.random.normal(jax.random.key(1), (8, 16))
  _assert_remat_changes_nothing(Deep, x, fp8=recipe)
