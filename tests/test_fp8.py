"""FP8 delayed scaling: the recipe's scale rule, the FP8 matmul, Flax wiring."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.sharding import AxisType

import jmp_train
from jmp_train import accumulation, checkpoint, fp8, sharding

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
      if amax > 0 and np.isfinite(amax) and np.isfinite(np.float32(new)):
        scale = new
    out.append(scale)
  return np.array(out)


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_scales_follow_the_float64_reference(fmt, algo):
  recipe = fp8.Fp8Recipe(
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


def test_update_never_advances_on_a_skipped_step_or_a_non_finite_amax():
  recipe = fp8.Fp8Recipe(amax_history_len=3)
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
    fp8.Fp8Recipe(**kwargs)


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
    out = fp8.fp8_dot_general(x, w, dn, scale=jnp.ones(3), amax=amax)
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
  recipe = fp8.Fp8Recipe(format=fmt)
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
  recipe = recipe or fp8.Fp8Recipe(amax_history_len=4)
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
  model, v = _wrapped(fp8.Fp8Recipe(format=fmt, amax_history_len=4))
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
  mine = fp8.Fp8Recipe(margin=3, amax_history_len=2)

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
  assert states["Dense_0"]["Fp8DotGeneral_0"]["fp8"].recipe == fp8.Fp8Recipe()


def test_a_module_called_twice_combines_its_amaxes_by_max():
  class Twice(nn.Module):
    @nn.compact
    def __call__(self, x):
      dense = nn.Dense(4, dot_general_cls=fp8.Fp8DotGeneral)
      return dense(x) + dense(3.0 * x)

  model, x = Twice(), jnp.asarray([[1.0, -2.0, 0.5]])
  v = model.init(jax.random.key(0), x)
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
  ours = fp8.Einsum(**kwargs, dot_general_cls=fp8.Fp8DotGeneral)
  v = ours.init(jax.random.key(0), x)
  kernel = jnp.round(v["params"]["kernel"] * 8) / 8  # exact in E4M3
  v = {**v, "params": {**v["params"], "kernel": kernel}}
  ref = nn.Einsum(**kwargs).apply({"params": v["params"]}, x)
  np.testing.assert_array_equal(ours.apply(v, x), ref)
  assert "fp8_meta" not in fp8.Einsum(**kwargs).init(jax.random.key(0), x)


def test_wrap_refuses_bad_fp8_arguments():
  with pytest.raises(TypeError, match="fp8 must be an Fp8Recipe"):
    jmp_train.linen.wrap(Block(), "bf16", fp8="hybrid")
  with pytest.raises(TypeError, match="fp8_exclude takes .* got 3"):
    jmp_train.linen.wrap(Block(), "bf16", fp8=True, fp8_exclude=(3,))


# ---------------------------------------------------------------------------
# The step: mixed_precision passes FP8 state through; ZeRO-1 and accumulation
# combine amaxes by max; checkpoints keep it.


def test_mixed_precision_passes_fp8_state_through_untouched():
  model, v = _wrapped()
  tx = jmp_train.mixed_precision(
    optax.adamw(1e-2, weight_decay=0.1),
    loss_scale=jmp_train.dynamic_loss_scale(),
  )
  state = jax.jit(tx.init)(v)
  scale = jmp_train.current_loss_scale(state)
  x = jnp.ones((2, 5))

  @jax.jit
  def step(v, state):
    grads = jax.grad(
      lambda v: scale * _loss(model)(v["params"], v["fp8_meta"], x)
    )(v)
    updates, state = tx.update(grads, state, v)
    return grads, optax.apply_updates(v, updates), state

  grads, new, state = step(v, state)
  for a, b in zip(
    jax.tree.leaves(new["fp8_meta"]),
    jax.tree.leaves(v["fp8_meta"]),
    strict=True,
  ):
    np.testing.assert_array_equal(a, b)
  assert jax.tree.leaves(state.master_params) == []
  # The inner optimizer has moments for the params only.
  n_params = len(jax.tree.leaves(v["params"]))
  assert len(jax.tree.leaves(state.inner_state)) == 2 * n_params + 1
  # The grad norm is the params' (the amaxes are not gradients).
  unscaled = jax.tree.map(lambda g: np.asarray(g) / scale, grads["params"])
  want = np.sqrt(
    sum(np.sum(np.float64(g) ** 2) for g in jax.tree.leaves(unscaled))
  )
  np.testing.assert_allclose(state.grad_norm, want, rtol=1e-5)
  assert not np.array_equal(
    new["params"]["Dense_0"]["kernel"], v["params"]["Dense_0"]["kernel"]
  )


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(32)(x))
    x = nn.relu(nn.Dense(32)(x))
    return nn.Dense(4, name="head")(x)


def _mlp_setup():
  # float32 compute: FP8 is then the only rounding, so runs compare tightly.
  model = jmp_train.linen.wrap(
    MLP(), "float32", fp8=fp8.Fp8Recipe(amax_history_len=4), fp8_exclude="head"
  )
  rng = np.random.default_rng(0)
  x = rng.normal(size=(32, 16)).astype(np.float32)
  y = rng.integers(0, 4, 32)
  variables = jax.jit(model.init)(jax.random.key(0), x[:1])

  def loss_fn(variables, batch):
    logits = model.apply(variables, batch[0])
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch[1]
    ).mean()

  return loss_fn, variables, (x, y)


def _metas(variables):
  return [
    variables["fp8_meta"][k]["Fp8DotGeneral_0"]["fp8"]
    for k in ("Dense_0", "Dense_1")
  ]


def test_zero1_step_advances_fp8_state_with_the_max_over_devices():
  loss_fn, v, batch = _mlp_setup()
  tx = jmp_train.mixed_precision(optax.adam(1e-2))
  runs = {}
  for n in (8, 1):
    mesh = jax.make_mesh(
      (n,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n]
    )
    step = sharding.make_train_step(loss_fn, tx, mesh=mesh)
    params, state = step.init(jax.tree.map(jnp.copy, v))
    for _ in range(3):
      params, state, _ = step(params, state, batch)
    runs[n] = jax.tree.map(np.asarray, params)
    for meta in _metas(params):  # replicated, not partitioned
      assert meta.amax_history.sharding.is_fully_replicated
  for a, b in zip(_metas(runs[8]), _metas(runs[1]), strict=True):
    assert (a.amax_history[:, :3] > 0).all() and (
      a.amax_history[:, 3] == 0
    ).all()
    # Inputs and kernels: the max over devices is the max over the batch.
    np.testing.assert_allclose(
      a.amax_history[:2], b.amax_history[:2], rtol=1e-6
    )
    # Each device differentiates the mean over its 4 rows, not over 32: its
    # output gradients are 8x larger, and so their amax.
    np.testing.assert_allclose(
      a.amax_history[2], 8 * b.amax_history[2], rtol=1e-6
    )
  for a, b in zip(
    jax.tree.leaves(runs[8]["params"]),
    jax.tree.leaves(runs[1]["params"]),
    strict=True,
  ):
    # Per-device sums round differently from one sum; after FP8 rounding of
    # the next step's activations that stays a small fraction of one step.
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)


def test_accumulation_combines_amaxes_by_max():
  loss_fn, v, batch = _mlp_setup()
  grads = jax.jit(
    lambda k: accumulation.accumulate_gradients(loss_fn, v, batch, k)[1],
    static_argnums=0,
  )
  whole, micro = grads(1), grads(2)
  for a, b in zip(_metas(micro), _metas(whole), strict=True):
    a, b = fp8.combined_amax(a), fp8.combined_amax(b)
    np.testing.assert_array_equal(a[:2], b[:2])
    np.testing.assert_array_equal(a[2], 2 * b[2])  # means over half the rows


def test_checkpoints_keep_the_fp8_state(tmp_path):
  loss_fn, v, batch = _mlp_setup()
  tx = jmp_train.mixed_precision(optax.sgd(0.1))
  state = tx.init(v)
  grads = jax.jit(jax.grad(loss_fn))(v, batch)
  updates, state = jax.jit(tx.update)(grads, state, v)
  v = fp8.update(optax.apply_updates(v, updates), grads)
  ckpt = checkpoint.Checkpointer(tmp_path)
  ckpt.save(1, v, state)
  ckpt.wait()
  template = _mlp_setup()[1]
  _, restored, _ = ckpt.restore(template, tx=tx)
  for a, b in zip(_metas(restored), _metas(v), strict=True):
    assert a.recipe == b.recipe and (np.asarray(b.scale) != 1).any()
    np.testing.assert_array_equal(a.scale, b.scale)
    np.testing.assert_array_equal(a.amax_history, b.amax_history)


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
    Deep(), "float32", fp8=fp8.Fp8Recipe(amax_history_len=2)
  )
  x = jnp.full((2, 8), -2.0)
  v = jax.jit(model.init)(jax.random.key(0), x)

  def loss(params, meta):
    return jnp.sum(model.apply({"params": params, "fp8_meta": meta}, x))

  _, grads = jax.jit(jax.grad(loss, (0, 1)))(v["params"], v["fp8_meta"])
  (state,) = fp8._states(fp8.update(v["fp8_meta"], grads))
  assert state.scale.shape == (3, 3) and state.amax_history.shape == (3, 3, 2)
  history = np.asarray(state.amax_history[..., 0])
  assert history[0, 0] == 2.0  # layer 0 sees |x| = 2
  assert len(set(history[:, 1].tolist())) == 3  # each layer its own kernel
  np.testing.assert_allclose(state.scale, 448.0 / history * [1, 1, 128])
