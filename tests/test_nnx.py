"""nnx.wrap: dtypes from the jaxpr, and the same training as linen.wrap."""

import functools

import _flax_models as fm
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


class TiedLM(nnx.Module):
  """A tied output head as people write it, reading the embedding through
  the array attributes nnx.Variable forwards (`.T`, `.reshape`, `.dtype`)."""

  def __init__(self, rngs):
    self.embed = nnx.Embed(11, 4, rngs=rngs)
    self.proj = nnx.Param(jnp.full((2, 2, 4), 0.25, jnp.float32))

  def __call__(self, tokens):
    h = self.embed(tokens)
    h = h @ self.proj.reshape(4, 4).astype(self.proj.dtype)
    return h @ self.embed.embedding.T


def test_array_attributes_of_a_param_read_in_the_compute_dtype():
  tokens = jnp.arange(6).reshape(2, 3)
  model = mp_nnx.wrap(TiedLM(nnx.Rngs(0)), "p=f32,c=bf16,o=f32")
  graphdef, state = nnx.split(model)
  dtypes = primitive_operand_dtypes(
    lambda state: nnx.merge(graphdef, state)(tokens), state
  )
  assert dtypes == [("bfloat16", "bfloat16")] * 2  # proj, tied head
  # The same sums by hand, in bf16 from the float32 params.
  table = np.asarray(model.embed.embedding[...], np.float32)
  bf16 = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
  h = bf16(table[np.asarray(tokens)]) @ bf16(np.full((4, 4), 0.25))
  want = (h @ bf16(table.T)).astype(jnp.float32)
  np.testing.assert_array_equal(model(tokens), want)
  # Outside a call the param reads as stored.
  assert model.embed.embedding.dtype == jnp.float32
  assert model.embed.embedding.T.dtype == jnp.float32


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
  params = jax.jit(model.init)(jax.random.key(0), X)["params"]
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
  linen_init = jax.jit(mp_linen.wrap(LinenModel(), "f32").init)(
    jax.random.key(0), X
  )
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
    state = optax.tree.get(nnx.as_pure(optimizer.opt_state), "master_params")
    kernel = model.dense.kernel[...]
    assert kernel.dtype == jnp.bfloat16
    master = state["dense"]["kernel"]
    assert master.dtype == jnp.float32
    np.testing.assert_array_equal(kernel, master.astype(jnp.bfloat16))


# -- Models built with dtype= layers, other methods, Rngs and Variable --------
# -- arguments (tests/_flax_models.py). ---------------------------------------

TOKENS = jnp.array([[1, 2, 3, 0], [4, 5, 0, 0]])
TARGETS = jnp.array([[3, 4, 5, 6], [7, 8, 9, 0]])
BF16_PAIR = ("bfloat16", "bfloat16")


@functools.cache
def _built(name):
  """Models built once, under nnx.jit (one compile, not one per op)."""
  bf16 = fm.NnxConfig(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  build = {
    "float32": lambda: fm.NnxEncoderDecoder(fm.NnxConfig(), rngs=nnx.Rngs(0)),
    "bfloat16": lambda: fm.NnxEncoderDecoder(bf16, rngs=nnx.Rngs(0)),
    "cnn": lambda: fm.CNN(rngs=nnx.Rngs(0)),
  }[name]
  return nnx.jit(build)()


def built(name):
  """A fresh copy of model `name` (wrap converts in place)."""
  return nnx.clone(_built(name))


def step_dots(model):
  """Operand dtypes of every matmul of a training step, both passes."""
  graphdef, state = nnx.split(model)

  def loss(state):
    out = nnx.merge(graphdef, state)(TOKENS, TARGETS)
    return jnp.sum(out.astype(jnp.float32) ** 2)

  dots = primitive_operand_dtypes(jax.grad(loss), state)
  convs = primitive_operand_dtypes(
    jax.grad(loss), state, primitive="conv_general_dilated"
  )
  return dots, convs


def test_dtype_attributes_follow_the_policy_forward_and_backward():
  # Every layer built with dtype=config.dtype, param_dtype=... (float32);
  # the reference is the same model built with bfloat16 by hand.
  model = mp_nnx.wrap(built("float32"), "p=bf16,c=bf16,o=f32")
  reference = built("bfloat16")
  dots, convs = step_dots(model)
  assert (dots, convs) == step_dots(reference)
  assert set(convs) == {BF16_PAIR} and len(convs) == 3
  # jax.nn.dot_product_attention's logits are float32 (preferred type) in
  # both runs, so their gradient matmuls take one float32 operand.
  assert set(dots) == {BF16_PAIR, ("float32", "bfloat16")}
  assert dots.count(BF16_PAIR) == len(dots) - 4
  assert (
    np.dtype(model.mlp.dtype) == np.dtype(model.config.dtype) == jnp.bfloat16
  )
  assert model.enc_norm.dtype is jnp.float32  # a norm: float32 by default
  assert model.out.dtype is None  # left to infer, as it was built


def test_respect_dtype_fields_and_rewrapping_start_from_the_model_as_built():
  model = built("float32")
  as_built = step_dots(model)
  mp_nnx.wrap(model, "p=bf16,c=bf16,o=f32")
  mp_nnx.wrap(model, "p=bf16,c=bf16,o=f32", respect_dtype_fields=True)
  # Flax casts the bf16-stored params back to each layer's own float32.
  assert step_dots(model) == as_built
  assert model.mlp.dtype is jnp.float32 and model.config == fm.NnxConfig()
  mp_nnx.wrap(model, "p=f32,c=f16,o=f32")
  assert set(step_dots(model)[1]) == {("float16", "float16")}


def test_respect_dtype_fields_takes_classes_and_path_patterns():
  for respect in (("conv",), (nnx.Conv,)):
    model = mp_nnx.wrap(
      built("float32"), "p=bf16,c=bf16,o=f32", respect_dtype_fields=respect
    )
    assert model.conv.dtype is jnp.float32
    assert np.dtype(model.mlp.dtype) == jnp.bfloat16
    dots, convs = step_dots(model)
    # Flax casts the conv's bf16 params back to its own float32.
    assert set(convs) == {("float32", "float32")}
    assert BF16_PAIR in set(dots)
  with pytest.raises(TypeError, match="respect_dtype_fields takes"):
    mp_nnx.wrap(built("float32"), "p=bf16", respect_dtype_fields=[3])
  # A shared module is selected by any of its names.
  model = built("float32")
  model.twin = model.conv  # after "conv": nnx.iter_graph names it "conv"
  mp_nnx.wrap(model, "p=bf16,c=bf16,o=f32", respect_dtype_fields=("twin",))
  assert model.conv.dtype is jnp.float32
  assert np.dtype(model.mlp.dtype) == jnp.bfloat16
  # A typo would leave the conv computing in bfloat16, with no error.
  with pytest.raises(ValueError, match="'cnov' matches no module .*: conv, "):
    mp_nnx.wrap(built("float32"), "p=bf16", respect_dtype_fields=("cnov",))


class TwoStage(nnx.Module):
  """`__call__` goes through another public method, as encode/decode do."""

  def __init__(self, seen, rngs):
    self.seen = seen
    self.hidden = nnx.Linear(4, 4, rngs=rngs)
    self.head = nnx.Linear(4, 2, rngs=rngs)

  def features(self, x):
    return nnx.relu(self.hidden(x))

  def __call__(self, x):
    h = self.features(x)
    self.seen.append(h.dtype)
    return self.head(h)


def test_other_methods_run_under_the_policy_when_called_from_outside():
  model = mp_nnx.wrap(built("float32"), "p=f32,c=bf16,o=f32", methods="encode")
  reference = built("bfloat16")

  def encode(model):
    graphdef, state = nnx.split(model)
    return lambda s: nnx.merge(graphdef, s).encode(TOKENS), state

  assert primitive_operand_dtypes(*encode(model)) == primitive_operand_dtypes(
    *encode(reference)
  )
  assert jax.eval_shape(*encode(model)).dtype == jnp.float32
  # A method called by another runs inside it: no cast to the output dtype
  # in between.
  seen = []
  two = mp_nnx.wrap(
    TwoStage(seen, nnx.Rngs(0)), "p=f32,c=bf16,o=f32", methods=["features"]
  )
  assert two(jnp.ones((1, 4))).dtype == jnp.float32 and seen == [jnp.bfloat16]
  assert two.features(jnp.ones((1, 4))).dtype == jnp.float32
  graphdef, state = nnx.split(two)
  features = lambda s, x: nnx.merge(graphdef, s).features(x)  # noqa: E731
  assert primitive_operand_dtypes(features, state, jnp.ones((1, 4))) == [
    BF16_PAIR
  ]
  with pytest.raises(ValueError, match="'nope' is not a method of TwoStage"):
    mp_nnx.wrap(TwoStage([], nnx.Rngs(0)), "p=f32,c=bf16", methods=["nope"])


class WithAccessors(nnx.Module):
  def __init__(self, rngs):
    self.lin = nnx.Linear(2, 2, rngs=rngs)

  def __call__(self, x):
    return self.lin(x)

  def load_kernel(self, w):
    self.lin.kernel[...] = w

  def kernel(self):
    return self.lin.kernel[...]


def test_methods_not_named_run_as_written():
  # A setter and a getter must not see the compute dtype: a float32 value
  # stored through them keeps every bit.
  model = mp_nnx.wrap(WithAccessors(nnx.Rngs(0)), "p=f32,c=bf16,o=f32")
  w = jnp.full((2, 2), 1.0 + 2.0**-12, jnp.float32)  # not a bfloat16 value
  model.load_kernel(w)
  assert model.kernel().dtype == jnp.float32
  np.testing.assert_array_equal(model.kernel(), w)
  assert model(jnp.ones((1, 2))).dtype == jnp.float32  # __call__ still wrapped


IMAGES = jnp.asarray(
  np.random.default_rng(4).standard_normal((2, 4, 8, 8, 1)), jnp.float32
)
LABELS = jnp.asarray(np.random.default_rng(5).integers(0, 10, (2, 4)))


def mnist_training(model):
  """Flax's NNX MNIST tutorial step, `model(batch["image"], rngs)`, run twice.

  Returns:
    Per step: the loss, the logits it came from and the logits of a second
    call on the same images and params (so they differ by the dropout mask
    only); then the count of keys drawn from the Rngs and the final params.
  """
  optimizer = nnx.Optimizer(model, optax.adamw(5e-3, 0.9), wrt=nnx.Param)
  rngs = nnx.Rngs(0)

  def loss_fn(model, rngs, batch):
    logits = model(batch["image"], rngs)
    loss = optax.softmax_cross_entropy_with_integer_labels(
      logits=logits.astype(jnp.float32), labels=batch["label"]
    ).mean()
    return loss, logits

  @nnx.jit
  def train_step(model, optimizer, rngs, batch):
    grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(model, rngs, batch)
    again = model(batch["image"], rngs)
    optimizer.update(model, grads)
    return loss, logits, again

  steps = [
    train_step(model, optimizer, rngs, {"image": x, "label": y})
    for x, y in zip(IMAGES, LABELS, strict=True)
  ]
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  return steps, int(rngs.default.count[...]), params


@functools.cache
def plain_mnist_training():
  return mnist_training(built("cnn"))


@pytest.mark.parametrize("preset", ["fp32", "bf16-mixed"])
def test_rngs_call_argument_advances_dropout_as_in_plain_code(preset):
  policy = jmp_train.get_preset(preset).policy
  model = mp_nnx.wrap(built("cnn"), policy)
  steps, keys_drawn, params = mnist_training(model)
  plain_steps, plain_keys_drawn, plain_params = plain_mnist_training()
  # Two calls a step, each drawing a key for each of its two Dropouts.
  assert keys_drawn == plain_keys_drawn == 2 * 2 * len(IMAGES)
  for _, logits, again in steps:
    assert not np.array_equal(logits, again)  # a new dropout mask
  if preset == "fp32":
    jax.tree.map(np.testing.assert_array_equal, steps, plain_steps)
    jax.tree.map(np.testing.assert_array_equal, params, plain_params)
  else:
    losses = [float(loss) for loss, _, _ in steps]
    plain_losses = [float(loss) for loss, _, _ in plain_steps]
    np.testing.assert_allclose(losses, plain_losses, rtol=2e-2)


class NormDrop(nnx.Module):
  """BatchNorm and a Dropout holding its own keys, as Flax examples write."""

  def __init__(self, rngs):
    self.linear = nnx.Linear(4, 8, rngs=rngs)
    self.bn = nnx.BatchNorm(8, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)
    self.out = nnx.Linear(8, 1, rngs=rngs)

  def __call__(self, x):
    return self.out(self.drop(self.bn(self.linear(x))))


def test_readme_step_keeps_batch_stats_and_keys_on_a_skipped_step():
  preset = jmp_train.get_preset("bf16-mixed")
  model = mp_nnx.wrap(NormDrop(nnx.Rngs(0)), preset.policy)
  optimizer = nnx.Optimizer(
    model, preset.mixed_precision(optax.adamw(1e-3)), wrt=nnx.Param
  )

  def loss_fn(out, y):
    return jnp.mean((out.astype(jnp.float32) - y) ** 2)

  @nnx.jit
  def train_step(model, optimizer, x, y):  # README.md, "Flax NNX"
    scale = jmp_train.current_loss_scale(optimizer.opt_state)
    held = nnx.clone(nnx.state(model, (nnx.BatchStat, nnx.RngState)))
    loss, grads = nnx.value_and_grad(lambda m: loss_fn(m(x), y) * scale)(model)
    optimizer.update(model, grads)
    metrics = jmp_train.train_metrics(optimizer.opt_state)
    moved = nnx.state(model, (nnx.BatchStat, nnx.RngState))
    nnx.update(
      model, jmp_train.select_tree(metrics["last_step_finite"], moved, held)
    )
    return loss / scale, metrics

  rng = np.random.default_rng(0)
  x, y = rng.normal(size=(2, 16, 4)), rng.normal(size=(2, 16, 1))
  x[1, 0, 0] = np.inf  # the second step skips

  def snapshot():
    state = nnx.to_pure_dict(nnx.state(model))
    keys = lambda a: (
      jax.random.key_data(a)
      if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)
      else a
    )  # noqa: E731
    return jax.device_get(jax.tree.map(keys, state))

  states = [snapshot()]
  for i in range(2):
    _, metrics = train_step(model, optimizer, x[i], y[i])
    assert bool(metrics["last_step_finite"]) == (i == 0)
    states.append(snapshot())
  first, skipped = states[1], states[2]
  assert not np.array_equal(states[0]["bn"]["mean"], first["bn"]["mean"])
  jax.tree.map(np.testing.assert_array_equal, skipped, first)
  assert np.isfinite(skipped["bn"]["mean"]).all()


class Accumulates(nnx.Module):
  """Updates `nnx.Variable`s it is given: a count and a running sum."""

  def __init__(self, rngs):
    self.linear = nnx.Linear(5, 3, rngs=rngs)

  def __call__(self, x, count, total):
    y = self.linear(x)
    count[...] += x.shape[0]
    total[...] += y.sum(0)
    return y


def test_variable_call_arguments_keep_their_in_place_updates():
  model = mp_nnx.wrap(Accumulates(nnx.Rngs(0)), "p=f32,c=bf16,o=f32")
  count = nnx.Variable(jnp.zeros((), jnp.int32))
  total = nnx.Variable(jnp.zeros((3,), jnp.float32))
  y1 = model(X, count, total)
  y2 = nnx.jit(lambda m, x, c, t: m(x, c, t))(model, X, count, total)
  assert int(count[...]) == 2 * X.shape[0]
  assert total[...].dtype == jnp.float32  # not cast: passed by reference
  np.testing.assert_allclose(
    total[...], (y1 + y2).astype(jnp.float32).sum(0), rtol=1e-2
  )


class Nested(nnx.Module):
  def __init__(self, rngs):
    self.a = nnx.Linear(2, 2, rngs=rngs)
    self.inner = mp_nnx.wrap(nnx.Linear(2, 2, rngs=rngs), "p=f32,c=f16,o=f32")

  def __call__(self, x):
    return self.inner(self.a(x))

  def encode(self, x):
    return self.a(x)


def _dots(model, method="__call__"):
  graphdef, state = nnx.split(model)
  run = lambda s: getattr(nnx.merge(graphdef, s), method)(jnp.ones((1, 2)))  # noqa: E731
  return primitive_operand_dtypes(run, state)


def test_rewrapping_starts_over_but_keeps_inner_wraps_and_settings():
  f32, f16 = ("float32", "float32"), ("float16", "float16")
  model = mp_nnx.wrap(
    Nested(nnx.Rngs(0)), "p=f32,c=bf16,o=f32", {nnx.Linear: "float32"}
  )
  assert _dots(model) == [f32, f16]  # the override, and the inner wrap
  mp_nnx.wrap(model, "p=f32,c=bf16,o=f32")  # no override any more
  assert _dots(model) == [BF16_PAIR, f16]
  # adjust_nnx_precision wraps again with the model's methods= and
  # respect_dtype_fields, not the defaults.
  model = mp_nnx.wrap(Nested(nnx.Rngs(0)), "p=f32,c=bf16", methods=["encode"])
  tx = jmp_train.get_preset("bf16-mixed").mixed_precision(optax.sgd(0.1))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  jmp_train.adjust_nnx_precision(model, optimizer, "fp16-mixed")
  assert _dots(model, "encode") == [f16]
  with pytest.raises(TypeError, match="methods takes names"):
    mp_nnx.wrap(Nested(nnx.Rngs(0)), "p=f32", methods=[Nested.encode])


def test_nnx_optimizer_keeps_stored_state_formats_across_jitted_steps():
  # nnx.Optimizer builds the state from nnx.Params and refills it after each
  # update; stored FP8/bf16 moments must come back as they were stored, and
  # the run must equal the same transformation driven by plain arrays.
  from jmp_train import state_format as sf

  formats = {"mu": sf.FP8(group_size=4), "nu": sf.BFloat16()}
  tx = jmp_train.mixed_precision(
    optax.adam(1e-2),
    param_update=jmp_train.ParamRemainders(),
    state_formats=formats,
  )
  model = nnx.Linear(8, 3, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16)
  x = jnp.linspace(-1, 1, 16, dtype=jnp.bfloat16).reshape(2, 8)

  def loss(m):
    return jnp.mean(jnp.square(m(x).astype(jnp.float32) - 0.5))

  params = nnx.as_pure(nnx.state(model, nnx.Param))
  opt_state = tx.init(params)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer):
    optimizer.update(model, nnx.grad(loss)(model))

  graphdef = nnx.graphdef(model)

  @jax.jit
  def functional(params, opt_state):
    grads = nnx.grad(loss)(nnx.merge(graphdef, params))
    grads = nnx.as_pure(nnx.state(grads, nnx.Param))
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  for _ in range(3):
    step(model, optimizer)
    params, opt_state = functional(params, opt_state)
  mu = nnx.as_pure(optimizer.opt_state).inner_state[0].mu["kernel"]
  assert mu.values.dtype == jnp.float8_e4m3fn and mu.scale.shape == (8, 1)
  for a, b in zip(
    jax.tree.leaves(nnx.as_pure(nnx.state(model, nnx.Param))),
    jax.tree.leaves(params),
    strict=True,
  ):
    np.testing.assert_array_equal(a, b)
