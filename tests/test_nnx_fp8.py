"""FP8 matmuls under flax.nnx: nnx.wrap(fp8=...), Fp8Meta and update_fp8."""

import functools
from typing import Any

import flax.linen as nn
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import primitive_operand_dtypes

import jmp_train
from jmp_train import fp8
from jmp_train.nnx import Fp8Meta, update_fp8
from jmp_train.train import TrainState, make_train_step

E4M3, E5M2, BF16 = "float8_e4m3fn", "float8_e5m2", "bfloat16"
RECIPES = {
  "delayed": fp8.DelayedScaling(amax_history_len=5),
  "current": fp8.CurrentScaling(),
  "blockwise": fp8.BlockwiseScaling(block_size=4),
}
DIFF = nnx.DiffState(0, (nnx.Param, Fp8Meta))

# -- The same network in linen and NNX: dtype= fields as Flax's examples -----
# -- write them, and a layer called twice. -----------------------------------


class LinenNet(nn.Module):
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    hid = nn.Dense(8, dtype=self.dtype, name="hid")
    h = nn.relu(hid(x)) + nn.relu(hid(-2.0 * x))
    return nn.Dense(3, dtype=self.dtype, name="head")(h)


class NnxNet(nnx.Module):
  def __init__(self, rngs, dtype=jnp.float32):
    self.hid = nnx.Linear(4, 8, dtype=dtype, rngs=rngs)
    self.head = nnx.Linear(8, 3, dtype=dtype, rngs=rngs)

  def __call__(self, x):
    h = nnx.relu(self.hid(x)) + nnx.relu(self.hid(-2.0 * x))
    return self.head(h)


# float16 compute with a loss scale that overflows at first: the first steps
# are skipped, and FP8 state must be held on them in both frameworks.
POLICY = "p=f32,c=f16,o=f32"
STEPS = 6


def _tx():
  return jmp_train.mixed_precision(
    optax.adam(3e-2),
    loss_scale=jmp_train.dynamic_loss_scale(2.0**16, growth_interval=2),
  )


def _data():
  rng = np.random.default_rng(2)
  xs = rng.standard_normal((2, 8, 4)).astype(np.float32)
  ys = np.tanh(xs @ rng.standard_normal((4, 3))).astype(np.float32)
  return [(xs[i % 2], ys[i % 2]) for i in range(STEPS)]


def _mse(out, y):
  return jnp.mean((out - y) ** 2)


def nnx_model(name):
  return jmp_train.nnx.wrap(
    NnxNet(nnx.Rngs(0)), POLICY, fp8=RECIPES[name], fp8_exclude=("head",)
  )


def linen_run(name):
  """linen.wrap(fp8=...) from NnxNet's initial params, trained by
  make_train_step: (final params, final FP8 state, losses, skipped steps)."""
  model = jmp_train.linen.wrap(
    LinenNet(), POLICY, fp8=RECIPES[name], fp8_exclude=("head",)
  )
  params = nnx.to_pure_dict(nnx.state(nnx_model(name), nnx.Param))
  # linen's FP8 state, one amax entry per call of `hid` (no compiled init).
  meta = {"hid": {"Fp8DotGeneral_0": {"fp8": fp8.init_state(RECIPES[name], 2)}}}
  shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.ones((8, 4)))
  assert jax.tree.structure(shapes) == jax.tree.structure(
    {"params": params, "fp8_meta": meta}
  )
  tx = _tx()

  def loss_fn(params, batch, model_state, key):
    x, y = batch
    return _mse(model.apply({"params": params, **model_state}, x), y)

  state = TrainState.create(params=params, tx=tx, fp8=meta)
  step, losses = make_train_step(loss_fn, tx), []
  for batch in _data():
    state, metrics = step(state, batch)
    losses.append(metrics["loss"])
  skipped = int(metrics["skipped_steps"])
  return state.params, state.fp8, np.asarray(losses), skipped


def train_nnx_optimizer(model):
  """The NNX way: nnx.Optimizer for the params, update_fp8 for FP8."""
  optimizer = nnx.Optimizer(model, _tx(), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, x, y):
    scale = jmp_train.current_loss_scale(optimizer.opt_state)

    def loss_fn(model):
      loss = _mse(model(x), y)
      return loss * scale, loss

    grads, loss = nnx.grad(loss_fn, argnums=DIFF, has_aux=True)(model)
    optimizer.update(model, grads)
    finite = jmp_train.train_metrics(optimizer.opt_state)["last_step_finite"]
    update_fp8(model, grads, finite=finite)
    return loss

  return np.asarray([step(model, optimizer, x, y) for x, y in _data()])


def train_nnx_split(model):
  """make_train_step on the split model: params, FP8 state, the rest."""
  graphdef, params, fp8_meta, rest = nnx.split(model, nnx.Param, Fp8Meta, ...)
  tx = _tx()

  def loss_fn(params, batch, model_state, key):
    x, y = batch
    model = nnx.merge(graphdef, params, model_state["fp8_meta"], rest)
    return _mse(model(x), y)

  state = TrainState.create(
    params=nnx.to_pure_dict(params), tx=tx, fp8=nnx.to_pure_dict(fp8_meta)
  )
  step, losses = make_train_step(loss_fn, tx), []
  for batch in _data():
    state, metrics = step(state, batch)
    losses.append(metrics["loss"])
  nnx.update(model, state.params, state.fp8)
  return np.asarray(losses)


# Delayed scaling, whose state sets the scales, trains through
# make_train_step on the split model; the others through nnx.Optimizer and
# update_fp8 (as does the delayed run of the skipped-step test below).
TRAIN_NNX = {
  "delayed": lambda model: train_nnx_split(model),
  "current": lambda model: train_nnx_optimizer(model),
  "blockwise": lambda model: train_nnx_optimizer(model),
}


@pytest.mark.parametrize("name", list(RECIPES))
def test_linen_and_nnx_train_to_the_same_losses_and_fp8_states(name):
  params, meta, losses, skipped = linen_run(name)
  assert skipped == 2  # held on skipped steps, then trained:
  assert (losses[-2:] < 0.8 * losses[:2]).all()  # the same two batches
  model = nnx_model(name)
  # The same operations in the same order: bit for bit.
  np.testing.assert_array_equal(TRAIN_NNX[name](model), losses)
  nnx_params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  jax.tree.map(np.testing.assert_array_equal, nnx_params, params)
  assert set(nnx.to_pure_dict(nnx.state(model, Fp8Meta))) == {"hid"}
  ours = model.hid.fp8_meta.get_value()
  theirs = meta["hid"]["Fp8DotGeneral_0"]["fp8"]
  assert len(ours.amax) == 1 and len(theirs.amax) == 2  # linen: per call
  np.testing.assert_array_equal(ours.amax_history, theirs.amax_history)
  np.testing.assert_array_equal(ours.scale, theirs.scale)
  history = np.asarray(ours.amax_history)
  if name == "delayed":  # rolled once per applied step
    assert (history[:, : STEPS - skipped] > 0).all()
    np.testing.assert_array_equal(history[:, STEPS - skipped :], 0.0)


# -- A layer called twice: the max of its calls' amaxes. ---------------------

X1 = np.array([[4.0, -1.0, 0.5], [0.25, 1.0, -2.0]], np.float32)
X2 = np.array([[1.0, 2.0, -0.5], [-1.5, 0.5, 3.0]], np.float32)
CT1 = np.array([[1.0, -1.0, 0.5, 2.0], [0.0, 0.5, -0.25, 1.0]], np.float32)
CT2 = np.array([[0.25, 3.0, 0.5, 0.0], [-5.0, 1.0, 0.5, 0.125]], np.float32)


def _twice(model):
  return jnp.sum(model(X1) * CT1) + jnp.sum(model(X2) * CT2)


def _amax_grad_nnx_grad(model):
  return nnx.grad(_twice, argnums=DIFF)(model)["fp8_meta"].get_value()


def _amax_grad_jax_grad(model):
  graphdef, params, meta = nnx.split(model, nnx.Param, Fp8Meta)
  pure = lambda meta: _twice(nnx.merge(graphdef, params, meta))  # noqa: E731
  return jax.jit(jax.grad(pure))(nnx.to_pure_dict(meta))["fp8_meta"]


TRANSFORMS = {
  "nnx.jit(nnx.grad)": nnx.jit(_amax_grad_nnx_grad),
  "jax.jit(jax.grad) of merge": _amax_grad_jax_grad,
}


@pytest.mark.parametrize(
  "name, transform",
  [(n, t) for n in RECIPES for t in TRANSFORMS if n == "current" or "nnx" in t],
)
def test_a_layer_called_twice_gets_the_max_of_its_calls_amaxes(name, transform):
  model = jmp_train.nnx.wrap(
    nnx.Linear(3, 4, rngs=nnx.Rngs(0)), "float32", fp8=RECIPES[name]
  )
  grads = TRANSFORMS[transform](model)
  kernel = np.abs(np.asarray(model.kernel.get_value())).max()
  # Input amax from the first call, output gradient amax from the second;
  # a sum would give 4 + 3 and 2 + 5.
  want = [max(np.abs(X1).max(), np.abs(X2).max()), kernel, np.abs(CT2).max()]
  assert want[0] == np.abs(X1).max() and want[2] == np.abs(CT2).max()
  (amax,) = grads.amax
  np.testing.assert_array_equal(amax, np.float32(want))
  np.testing.assert_array_equal(grads.scale, 0.0)
  np.testing.assert_array_equal(grads.amax_history, 0.0)
  # The calls stored back the state they read: the model is unchanged.
  state = model.fp8_meta.get_value()
  np.testing.assert_array_equal(state.amax[0], 0.0)
  np.testing.assert_array_equal(state.scale, 1.0)


def test_a_cell_carried_through_nnx_scan_gets_the_max_over_its_steps():
  # An RNN cell applied at every time step. Carried (nnx.Carry) its calls
  # chain: the kernel's amax is max|W|, where broadcasting the cell
  # (in_axes=None, README's Limits) would sum it over the T steps.
  cell = jmp_train.nnx.wrap(
    nnx.Linear(4, 4, rngs=nnx.Rngs(0)), "float32", fp8="delayed"
  )
  xs = jnp.asarray(np.random.default_rng(0).normal(size=(5, 2, 4)) * 3)

  def loss(cell):
    def step(carry, x):
      cell, h = carry
      h = jnp.tanh(cell(h) + x)
      return (cell, h), h

    scan = nnx.scan(step, in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
    (_, h), _ = scan((cell, jnp.ones((2, 4))), xs)
    return jnp.sum(h)

  grads = nnx.jit(nnx.grad(loss, argnums=DIFF))(cell)
  (amax,) = grads["fp8_meta"].get_value().amax
  kernel = np.abs(np.asarray(cell.kernel.get_value())).max()
  assert amax[1] == np.float32(kernel)
  # The inputs are h: ones at the first step, tanh's after it.
  assert amax[0] == 1.0


def test_a_nan_in_one_call_survives_the_max():
  model = jmp_train.nnx.wrap(
    nnx.Linear(3, 4, rngs=nnx.Rngs(0)), "float32", fp8=RECIPES["current"]
  )

  def loss(model):
    return jnp.sum(model(X1) * CT1) + jnp.sum(model(X2) * (CT2 * jnp.nan))

  grads = nnx.jit(nnx.grad(loss, argnums=DIFF))(model)
  (amax,) = grads["fp8_meta"].get_value().amax
  assert np.isfinite(amax[:2]).all() and np.isnan(amax[2])


def test_an_einsum_reports_its_kernel_whichever_order_jnp_einsum_picks():
  # "bi,oi->ob" puts the kernel's axis first: jnp.einsum would hand it to
  # its dot_general as the lhs.
  layer = nnx.Einsum("bi,oi->ob", (4, 3), rngs=nnx.Rngs(0))
  model = jmp_train.nnx.wrap(layer, "float32", fp8=RECIPES["current"])
  ct = CT2.T * 3.0

  @nnx.jit
  def grads(model):
    loss = lambda m: jnp.sum(m(X1) * ct)  # noqa: E731
    return nnx.grad(loss, argnums=DIFF)(model)["fp8_meta"].get_value()

  kernel = np.abs(np.asarray(model.kernel.get_value())).max()
  want = [np.abs(X1).max(), kernel, np.abs(ct).max()]
  np.testing.assert_array_equal(grads(model).amax[0], np.float32(want))


class Layer(nnx.Module):
  def __init__(self, rngs):
    self.lin = nnx.Linear(3, 4, rngs=rngs)


class Stacked(nnx.Module):
  """Three layers built by nnx.vmap and run by nnx.scan (Flax's scan over
  layers); each layer is called twice on the same carry."""

  def __init__(self, rngs):
    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return Layer(rngs)

    self.layers = make(rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
    def body(x, layer):
      return x, layer.lin(x) + layer.lin(-2.0 * x)

    return body(x, self.layers)[1]


def test_stacked_layers_under_nnx_scan_keep_one_state_per_layer():
  model = nnx.jit(lambda: Stacked(nnx.Rngs(0)))()
  model = jmp_train.nnx.wrap(model, "float32", fp8=RECIPES["delayed"])
  meta = model.layers.lin.fp8_meta
  assert meta.get_value().scale.shape == (3, 3)
  kernels = np.abs(np.asarray(model.layers.lin.kernel.get_value()))

  @nnx.jit
  def step(model):
    grads = nnx.grad(lambda m: jnp.sum(m(X1)), argnums=DIFF)(model)
    update_fp8(model, grads)
    return grads

  grads = step(model)
  want = np.stack(
    [np.full(3, 2 * np.abs(X1).max()), kernels.max(axis=(1, 2)), np.ones(3)],
    axis=1,
  )
  (amax,) = grads["layers"]["lin"]["fp8_meta"].get_value().amax
  np.testing.assert_array_equal(amax, want.astype(np.float32))
  np.testing.assert_allclose(
    meta.get_value().scale, np.array([448, 448, 57344]) / want, rtol=1e-6
  )


# -- Skipped steps, and no stale overwrite. ----------------------------------


class Probe(nnx.Module):
  """An FP8 layer whose amaxes NumPy can compute, and a head kept out."""

  def __init__(self, rngs):
    self.hid = nnx.Linear(3, 4, rngs=rngs)
    self.head = nnx.Linear(4, 2, rngs=rngs)

  def __call__(self, x):
    return self.head(self.hid(x))


PROBE_X = np.array([[1.5, -3.0, 0.5], [2.0, 0.25, -1.0]], np.float32)
PROBE_CT = np.array([[1.0, -2.0], [0.5, 3.0]], np.float32)


def test_fp8_state_holds_on_skipped_steps_and_is_never_overwritten():
  recipe = fp8.DelayedScaling(amax_history_len=3)
  model = jmp_train.nnx.wrap(
    Probe(nnx.Rngs(0)), "float32", fp8=recipe, fp8_exclude=("head",)
  )
  tx = jmp_train.mixed_precision(
    optax.sgd(0.1), loss_scale=jmp_train.dynamic_loss_scale(4.0)
  )
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  assert "fp8_meta" not in nnx.to_pure_dict(nnx.state(model, nnx.Param))

  @nnx.jit
  def step(model, optimizer, poison):
    scale = jmp_train.current_loss_scale(optimizer.opt_state)

    def loss_fn(model):
      # `poison` reaches the head's bias only: the amaxes stay finite, so
      # only `finite` can hold the FP8 state.
      extra = poison * jnp.sum(model.head.bias[...])
      return scale * (jnp.sum(model(PROBE_X) * PROBE_CT) + extra)

    grads = nnx.grad(loss_fn, argnums=DIFF)(model)
    optimizer.update(model, grads)
    finite = jmp_train.train_metrics(optimizer.opt_state)["last_step_finite"]
    update_fp8(model, grads, finite=finite)
    # A forward pass after the update (an eval, a logging call) writes back
    # the state it reads: the new one.
    model(PROBE_X)

  history, scale = np.zeros((3, 3)), np.ones(3)
  for poison in (0.0, 0.0, np.inf, 0.0, 0.0):
    before = jax.tree.map(np.asarray, nnx.state(model))
    loss_scale = float(jmp_train.current_loss_scale(optimizer.opt_state))
    hid = np.asarray(model.hid.kernel.get_value(), np.float64)
    head = np.asarray(model.head.kernel.get_value(), np.float64)
    step(model, optimizer, poison)
    state = model.hid.fp8_meta.get_value()
    if not np.isfinite(poison):  # skipped: every bit held, params included
      jax.tree.map(np.testing.assert_array_equal, nnx.state(model), before)
      continue
    # The written rule, in float64 NumPy: roll this step's amaxes in, scale
    # from the history's max.
    amax = [
      np.abs(PROBE_X).max(),
      np.abs(hid).max(),
      loss_scale * np.abs(PROBE_CT @ head.T).max(),
    ]
    history = np.concatenate([np.array(amax)[:, None], history[:, :-1]], 1)
    scale = np.array([448.0, 448.0, 57344.0]) / history.max(axis=1)
    np.testing.assert_allclose(state.amax_history, history, rtol=1e-6)
    np.testing.assert_allclose(state.scale, scale, rtol=1e-6)
  # Four applied steps rolled a 3-long history four times.
  assert (np.asarray(state.amax_history) > 0).all()


# -- The jaxpr: FP8 operands for every converted layer, both passes. ---------


class Block(nnx.Module):
  """Every matmul layer NNX has, a norm, and an output head."""

  def __init__(self, rngs):
    self.dense = nnx.Linear(5, 16, rngs=rngs)
    self.norm = nnx.LayerNorm(16, rngs=rngs)
    self.general = nnx.LinearGeneral(16, (2, 4), rngs=rngs)
    self.einsum = nnx.Einsum("bi,io->bo", (8, 8), (8,), rngs=rngs)
    self.head = nnx.Linear(8, 10, rngs=rngs)

  def __call__(self, x):
    h = self.norm(self.dense(x))
    h = self.general(h).reshape(h.shape[0], -1)
    return self.head(nnx.relu(self.einsum(h)))


def _block_dots(model, **kwargs):
  """Operand dtypes of the forward dots, and of the backward ones alone."""
  jmp_train.nnx.wrap(model, "p=f32,c=bf16,o=f32", **kwargs)
  graphdef, params, meta = nnx.split(model, nnx.Param, ...)

  def loss(params, meta):
    return jnp.sum(nnx.merge(graphdef, params, meta)(jnp.ones((2, 5))) ** 2)

  forward = primitive_operand_dtypes(loss, params, meta)
  backward = primitive_operand_dtypes(jax.grad(loss, (0, 1)), params, meta)
  for dtypes in forward:
    backward.remove(dtypes)
  return sorted(forward), sorted(backward)


def test_every_converted_layer_takes_fp8_operands_both_ways():
  # Zeros for values: a jaxpr needs none, and no initialiser compiles.
  model = nnx.eval_shape(lambda: Block(nnx.Rngs(0)))
  nnx.update(model, jax.tree.map(jnp.zeros_like, nnx.state(model)))
  forward, backward = _block_dots(
    model, fp8=fp8.DelayedScaling(), fp8_exclude=("head",)
  )
  # dense, general, einsum in E4M3; the head in bfloat16; each FP8 layer's
  # dL/dx and dL/dw take the E5M2 gradient and an E4M3 operand.
  assert forward == sorted([(E4M3, E4M3)] * 3 + [(BF16, BF16)])
  assert backward == sorted([(E5M2, E4M3)] * 6 + [(BF16, BF16)] * 2)
  for layer in ("dense", "general", "einsum"):
    assert isinstance(getattr(model, layer).fp8_meta, Fp8Meta)
  assert not hasattr(model.head, "fp8_meta")
  # Excluded by class and by pattern; blockwise E4M3 both ways.
  forward, backward = _block_dots(
    model,
    fp8=RECIPES["blockwise"],
    fp8_exclude=(nnx.LinearGeneral, "ein*", "head"),
  )
  bf16 = [(BF16, BF16)]
  assert forward.count(bf16[0]) == 3 and set(forward) - set(bf16) == {
    (E4M3, E4M3)
  }  # the blockwise matmul: one dot per block of the contraction
  assert backward.count(bf16[0]) == 6 and set(backward) - set(bf16) == {
    (E4M3, E4M3)
  }
  assert [
    k
    for k in ("dense", "general", "einsum")
    if hasattr(getattr(model, k), "fp8_meta")
  ] == ["dense"]


def test_own_dot_general_is_kept_and_rewrapping_keeps_or_drops_fp8():
  mine = functools.partial(jax.lax.dot_general)

  class Two(nnx.Module):
    def __init__(self, rngs):
      self.own = nnx.Linear(2, 2, dot_general=mine, rngs=rngs)
      self.plain = nnx.Linear(2, 2, rngs=rngs)

  model = jmp_train.nnx.wrap(Two(nnx.Rngs(0)), "bf16", fp8="delayed")
  assert not hasattr(model.own, "fp8_meta") and model.own.dot_general is mine
  meta = model.plain.fp8_meta
  assert meta.get_value().recipe == fp8.DelayedScaling()
  # Another policy keeps the FP8 state (adjust_nnx_precision re-wraps so);
  # another recipe replaces it; no fp8 removes it.
  jmp_train.nnx.wrap(model, "p=f32,c=f16", fp8="delayed")
  assert model.plain.fp8_meta is meta
  jmp_train.nnx.wrap(model, "p=f32,c=f16", fp8="current")
  assert model.plain.fp8_meta.get_value().recipe == fp8.CurrentScaling()
  jmp_train.nnx.wrap(model, "p=f32,c=f16")
  assert not hasattr(model.plain, "fp8_meta")
  assert model.plain.dot_general is jax.lax.dot_general


def test_bad_fp8_arguments_are_refused_by_name():
  def build():
    return Probe(nnx.Rngs(0))

  with pytest.raises(ValueError, match="fp8 must be a jmp_train.fp8 recipe"):
    jmp_train.nnx.wrap(build(), "bf16", fp8="hybrid")
  with pytest.raises(TypeError, match="fp8 must be .* got 1"):
    jmp_train.nnx.wrap(build(), "bf16", fp8=1)
  with pytest.raises(TypeError, match="fp8_exclude takes .* got 3"):
    jmp_train.nnx.wrap(build(), "bf16", fp8=True, fp8_exclude=(3,))
  # A pattern that selects no module (a typo) would leave its layer in FP8.
  with pytest.raises(ValueError, match="'haed' matches no module.*: head, hid"):
    jmp_train.nnx.wrap(build(), "bf16", fp8=True, fp8_exclude=("head", "haed"))
  model = jmp_train.nnx.wrap(build(), "bf16", fp8_exclude=("haed",))
  assert not hasattr(model.hid, "fp8_meta")  # without FP8, not checked
  # A shared module is selected by any of its names.
  tied = build()
  tied.tied = tied.hid
  jmp_train.nnx.wrap(tied, "bf16", fp8=True, fp8_exclude=("tied",))
  assert not hasattr(tied.hid, "fp8_meta") and hasattr(tied.head, "fp8_meta")
  clash = build()
  clash.hid.fp8_meta = nnx.Variable(jnp.zeros(3))
  with pytest.raises(ValueError, match="'hid' has an attribute 'fp8_meta'"):
    jmp_train.nnx.wrap(clash, "bf16", fp8=True)
  model = jmp_train.nnx.wrap(build(), "float32", fp8=True)
  params_only = nnx.state(model, nnx.Param)  # as nnx.grad(loss)(model)
  with pytest.raises(ValueError, match="grads must hold the gradients"):
    update_fp8(model, params_only)
  with pytest.raises(TypeError, match="update_fp8 expects a flax.nnx Module"):
    update_fp8({"hid": 1}, params_only)
