"""nnx.wrap: dtypes from the jaxpr, and the same training as linen.wrap."""

import flax.linen as nn
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import primitive_operand_dtypes

import jmp_train
from jmp_train import linen as mp_linen
from jmp_train import nnx as mp_nnx

X = jnp.asarray(np.random.default_rng(0).standard_normal((6, 5)), jnp.float32)
Y = jnp.asarray(np.random.default_rng(1).standard_normal((6, 3)), jnp.float32)


class UserLayer(nnx.Module):
  """A user-written layer: raw nnx.Param and jnp, no dtype field."""

  def __init__(self, din, dout, rngs):
    self.w = nnx.Param(jax.random.normal(rngs.params(), (din, dout)) * 0.3)
    self.b = nnx.Param(jnp.zeros((dout,)))
    self.calls = nnx.Variable(jnp.zeros((), jnp.int32))

  def __call__(self, x):
    self.calls[...] += 1
    return jnp.einsum("bi,io->bo", x, self.w[...]) + self.b[...]


class Model(nnx.Module):
  def __init__(self, rngs):
    self.dense = nnx.Linear(5, 16, rngs=rngs)
    self.norm = nnx.LayerNorm(16, rngs=rngs)
    self.user = UserLayer(16, 16, rngs)
    self.bn = nnx.BatchNorm(16, use_running_average=False, rngs=rngs)
    self.head = nnx.Linear(16, 3, rngs=rngs)

  def __call__(self, x):
    x = self.norm(self.dense(x))
    x = nnx.relu(self.bn(self.user(x)))
    return self.head(x)


def new_model(policy="p=f32,c=bf16,o=f32", **kwargs):
  return mp_nnx.wrap(Model(nnx.Rngs(0)), policy, **kwargs)


run = nnx.jit(lambda model, x: model(x))


def dots(model, x):
  """Operand dtypes of every matmul when `model` runs on `x`, from the jaxpr."""
  graphdef, state = nnx.split(model)
  return primitive_operand_dtypes(
    lambda state, x: nnx.merge(graphdef, state)(x), state, x
  )


def dtypes_of(model, kind=nnx.Param):
  state = nnx.to_pure_dict(nnx.state(model, kind))
  return jax.tree.map(lambda a: jnp.dtype(a.dtype).name, state)


def test_params_stored_in_owners_param_dtype():
  model = new_model("p=bf16,c=bf16,o=f32")
  dtypes = dtypes_of(model)
  assert dtypes["dense"] == {"kernel": "bfloat16", "bias": "bfloat16"}
  assert dtypes["user"] == {"w": "bfloat16", "b": "bfloat16"}
  assert dtypes["norm"] == {"scale": "float32", "bias": "float32"}
  assert dtypes["bn"] == {"scale": "float32", "bias": "float32"}
  stats = dtypes_of(model, nnx.BatchStat)["bn"]
  assert stats == {"mean": "float32", "var": "float32"}
  assert model.user.calls[...].dtype == jnp.int32
  # Same object, same class name and attributes: a conversion in place.
  assert type(model).__name__ == "Model" and isinstance(model, Model)


def test_every_matmul_in_compute_dtype_and_output_dtype():
  model = new_model()
  assert (
    dots(model, X) == [("bfloat16", "bfloat16")] * 3
  )  # dense, user einsum, head
  out = run(model, X)
  assert out.dtype == jnp.float32
  # The stored params are untouched by the call.
  assert dtypes_of(model)["user"] == {"w": "float32", "b": "float32"}
  assert int(model.user.calls[...]) == 1


def test_norm_computes_in_float32_and_returns_compute_dtype():
  seen = {}

  class Probe(nnx.Module):
    def __init__(self, rngs):
      self.norm = nnx.LayerNorm(4, rngs=rngs)
      self.after = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
      y = self.norm(x)
      seen["norm_out"] = y.dtype
      return self.after(y)

  model = mp_nnx.wrap(Probe(nnx.Rngs(0)), "p=f32,c=f16,o=f32")
  jaxpr = jax.make_jaxpr(model)(jnp.ones((2, 4)))
  assert seen["norm_out"] == jnp.float16
  # The norm's statistics are computed from a float32 input.
  reductions = [
    e for e in jaxpr.jaxpr.eqns if e.primitive.name in ("reduce_sum", "var")
  ]
  assert reductions
  assert all(e.invars[0].aval.dtype == jnp.float32 for e in reductions)


def test_user_override_and_dropping_a_default():
  model = new_model(
    "p=bf16,c=bf16,o=bf16",
    overrides={UserLayer: "p=f32,c=f32,o=f32", nnx.LayerNorm: None},
  )
  dtypes = dtypes_of(model)
  assert dtypes["user"] == {"w": "float32", "b": "float32"}
  assert dtypes["norm"] == {"scale": "bfloat16", "bias": "bfloat16"}
  assert dots(model, X) == [
    ("bfloat16", "bfloat16"),
    ("float32", "float32"),
    ("bfloat16", "bfloat16"),
  ]


def test_inner_wrap_keeps_its_policy():
  inner = mp_nnx.wrap(UserLayer(4, 4, nnx.Rngs(0)), "p=f32,c=f32,o=bf16")

  class Outer(nnx.Module):
    def __init__(self, rngs):
      self.inner = inner
      self.dense = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
      y = self.inner(x)
      assert y.dtype == jnp.bfloat16
      return self.dense(y)

  outer = mp_nnx.wrap(Outer(nnx.Rngs(1)), "p=bf16,c=bf16,o=f32")
  assert outer.inner.w.dtype == jnp.float32
  assert outer.dense.kernel.dtype == jnp.bfloat16
  assert dots(outer, jnp.ones((2, 4))) == [
    ("float32", "float32"),
    ("bfloat16", "bfloat16"),
  ]


def test_gradients_in_param_dtype_and_split_merge():
  model = new_model("p=bf16,c=bf16,o=f32")
  grads = nnx.jit(nnx.grad(lambda m: jnp.mean((m(X) - Y) ** 2)))(model)
  assert dtypes_of(grads) == dtypes_of(model)
  graphdef, state = nnx.split(model)
  again = nnx.merge(graphdef, state)
  np.testing.assert_array_equal(run(again, X), run(model, X))
  assert dots(again, X) == [("bfloat16", "bfloat16")] * 3


def test_bad_input_errors():
  with pytest.raises(TypeError, match="flax.nnx Module"):
    mp_nnx.wrap(nn.Dense(3), "f32")
  with pytest.raises(TypeError, match="overrides keys"):
    mp_nnx.wrap(Model(nnx.Rngs(0)), "f32", overrides={nn.LayerNorm: "f32"})
  with pytest.raises(ValueError, match="dtype"):
    mp_nnx.wrap(Model(nnx.Rngs(0)), "params=float33")


# -- the same training in linen and NNX ---------------------------------------


class LinenModel(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.LayerNorm(name="norm")(nn.Dense(16, name="dense")(x))
    x = nn.relu(x)
    return nn.Dense(3, name="head")(x)


class NnxModel(nnx.Module):
  def __init__(self, rngs):
    self.dense = nnx.Linear(5, 16, rngs=rngs)
    self.norm = nnx.LayerNorm(16, rngs=rngs)
    self.head = nnx.Linear(16, 3, rngs=rngs)

  def __call__(self, x):
    return self.head(nnx.relu(self.norm(self.dense(x))))


def _tx():
  return jmp_train.mixed_precision(
    optax.adam(3e-2),
    # Starts high enough to overflow float16 and skip a few steps.
    loss_scale=jmp_train.dynamic_loss_scale(2.0**20, growth_interval=3),
  )


def _data(steps):
  rng = np.random.default_rng(2)
  xs = rng.standard_normal((2, 8, 5)).astype(np.float32)
  ys = rng.standard_normal((2, 8, 3)).astype(np.float32)
  return [(xs[i % 2], ys[i % 2]) for i in range(steps)]


def train_linen(policy, data):
  model = mp_linen.wrap(LinenModel(), policy)
  params = model.init(jax.random.key(0), X)["params"]
  tx = _tx()
  state = tx.init(params)

  @jax.jit
  def step(params, state, x, y):
    scale = jmp_train.current_loss_scale(state)

    def loss_fn(p):
      loss = jnp.mean((model.apply({"params": p}, x) - y) ** 2)
      return loss * scale, loss

    grads, loss = jax.grad(loss_fn, has_aux=True)(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  losses = []
  for x, y in data:
    params, state, loss = step(params, state, x, y)
    losses.append(loss)
  return params, state, np.asarray(losses)


def train_nnx(policy, data, linen_params):
  model = NnxModel(nnx.Rngs(0))
  for name in ("dense", "norm", "head"):  # start from linen's initial values
    for key, value in linen_params[name].items():
      getattr(getattr(model, name), key).set_value(value.astype(jnp.float32))
  model = mp_nnx.wrap(model, policy)
  optimizer = nnx.Optimizer(model, _tx(), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, x, y):
    scale = jmp_train.current_loss_scale(optimizer.opt_state)

    def loss_fn(m):
      loss = jnp.mean((m(x) - y) ** 2)
      return loss * scale, loss

    grads, loss = nnx.grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    return loss, jmp_train.train_metrics(optimizer.opt_state)

  losses, metrics = [], None
  for x, y in data:
    loss, metrics = step(model, optimizer, x, y)
    losses.append(loss)
  return model, optimizer, metrics, np.asarray(losses)


@pytest.mark.parametrize(
  "policy", ["p=f32,c=bf16,o=f32", "p=f32,c=f16,o=f32", "p=bf16,c=bf16,o=f32"]
)
def test_linen_and_nnx_train_to_the_same_losses(policy):
  data = _data(16)
  linen_init = mp_linen.wrap(LinenModel(), "f32").init(jax.random.key(0), X)
  _, linen_state, linen_losses = train_linen(policy, data)
  model, optimizer, metrics, nnx_losses = train_nnx(
    policy, data, linen_init["params"]
  )
  np.testing.assert_allclose(nnx_losses, linen_losses, rtol=1e-6, atol=0)
  assert nnx_losses[-2:].mean() < 0.6 * nnx_losses[:2].mean()
  linen_metrics = jmp_train.train_metrics(linen_state)
  for key, value in metrics.items():
    assert isinstance(value, jax.Array)
    np.testing.assert_allclose(value, linen_metrics[key], rtol=1e-5)
  if "c=f16" in policy:
    assert 0 < int(metrics["skipped_steps"]) < 10
  # bf16-stored params stay bf16 and equal the float32 masters cast down.
  if policy.startswith("p=bf16"):
    state = jmp_train.transform._find_state(nnx.as_pure(optimizer.opt_state))
    kernel = model.dense.kernel[...]
    assert kernel.dtype == jnp.bfloat16
    master = state.master_params["dense"]["kernel"]
    assert master.dtype == jnp.float32
    np.testing.assert_array_equal(kernel, master.astype(jnp.bfloat16))
