"""linen.wrap: dtypes read from the jaxpr, numerics against unwrapped runs."""

import functools
from typing import Any

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

MATMULS = ("dot_general", "conv_general_dilated")
# The wmt example's nn.SelfAttention warns that it will be deprecated.
pytestmark = pytest.mark.filterwarnings(
  "ignore:SelfAttention will be deprecated"
)


class UserLayer(nn.Module):
  """A user-written layer: raw self.param and jnp, no dtype field."""

  features: int

  @nn.compact
  def __call__(self, x):
    w = self.param(
      "w", nn.initializers.lecun_normal(), (x.shape[-1], self.features)
    )
    b = self.param("b", nn.initializers.zeros, (self.features,))
    return jnp.einsum("bi,io->bo", x, w) + b


class Model(nn.Module):
  @nn.compact
  def __call__(self, x, train=False):
    x = UserLayer(16)(x)
    x = nn.LayerNorm()(x)
    x = nn.Dense(16)(x)
    x = nn.BatchNorm(use_running_average=not train)(x)
    x = nn.relu(x)
    seq = jnp.stack([x, -x, 2 * x, x * x], axis=1)  # (batch, 4, 16)
    seq = seq + nn.MultiHeadDotProductAttention(num_heads=2)(seq)
    seq = nn.RMSNorm()(seq)
    seq = nn.Conv(8, (3,))(seq)
    seq = nn.GroupNorm(num_groups=2)(seq)
    return nn.Dense(3)(seq.mean(axis=1))


X = jnp.asarray(np.random.default_rng(0).standard_normal((4, 5)), jnp.float32)
NORM_KEYS = ("LayerNorm_0", "BatchNorm_0", "RMSNorm_0", "GroupNorm_0")


def init(module):
  """`module.init` on X, jitted (one compile instead of op by op)."""
  return jax.jit(module.init)(jax.random.key(0), X)


@functools.cache
def plain_init():
  """The unwrapped Model's variables (what a wrap's init stores, cast)."""
  return init(Model())


def abstract_init(module, *args, **kwargs):
  """`module.init`'s variables as shapes and dtypes (traced, not computed)."""
  init = functools.partial(module.init, **kwargs)
  return jax.eval_shape(init, jax.random.key(0), *args)


def apply_train(module, variables, x=X):
  return module.apply(variables, x, train=True, mutable=["batch_stats"])


def dtypes_of(tree):
  return jax.tree.map(lambda a: a.dtype.name, tree)


@pytest.mark.parametrize(
  "policy",
  ["p=f32,c=bf16,o=f32", "p=bf16,c=bf16,o=f32", "p=f16,c=f16,o=f16", "float32"],
)
def test_params_stored_in_owner_param_dtype(policy):
  policy = jmp_train.get_policy(policy)
  variables = abstract_init(mp_linen.wrap(Model(), policy), X)
  params = variables["params"]
  for name, leaves in params.items():
    want = "float32" if name in NORM_KEYS else np.dtype(policy.param_dtype).name
    for path, leaf in jax.tree_util.tree_leaves_with_path(leaves):
      assert leaf.dtype.name == want, (name, path)
  assert set(jax.tree.leaves(dtypes_of(variables["batch_stats"]))) == {
    "float32"
  }


@pytest.mark.parametrize("compute", ["bfloat16", "float16", "float32"])
def test_every_matmul_runs_in_the_compute_dtype(compute):
  wrapped = mp_linen.wrap(Model(), f"p=f32,c={compute},o=f32")
  variables = abstract_init(wrapped, X)
  for primitive in MATMULS:
    found = primitive_operand_dtypes(
      lambda v: apply_train(wrapped, v), variables, primitive=primitive
    )
    assert found, primitive
    assert set(found) == {(compute, compute)}, (primitive, found)
  # Unwrapped, the same model computes every matmul in float32.
  plain = Model()
  found = primitive_operand_dtypes(
    lambda v: apply_train(plain, v), abstract_init(plain, X)
  )
  assert set(found) == {("float32", "float32")}


def test_norms_compute_in_float32_and_return_the_compute_dtype():
  wrapped = mp_linen.wrap(Model(), "p=bf16,c=bf16,o=f32")
  variables = abstract_init(wrapped, X)
  rsqrts = primitive_operand_dtypes(
    lambda v: apply_train(wrapped, v), variables, primitive="rsqrt"
  )
  assert len(rsqrts) == 4 and set(rsqrts) == {("float32",)}
  # Numerics: a wrapped LayerNorm is float32 LayerNorm of the bf16 input,
  # returned in bf16 (checked against float64 NumPy, within half a bf16 ulp).
  ln = mp_linen.wrap(nn.LayerNorm(), "p=bf16,c=bf16,o=bf16")
  x = jnp.asarray(
    np.random.default_rng(1).standard_normal((8, 32)) * 3, jnp.float32
  )
  ln_vars = ln.init(jax.random.key(0), x)
  assert dtypes_of(ln_vars["params"]) == {"bias": "float32", "scale": "float32"}
  out = ln.apply(ln_vars, x)
  assert out.dtype == jnp.bfloat16
  xb = np.asarray(x.astype(jnp.bfloat16), np.float64)
  mean = xb.mean(-1, keepdims=True)
  ref = (xb - mean) / np.sqrt(((xb - mean) ** 2).mean(-1, keepdims=True) + 1e-6)
  np.testing.assert_allclose(
    np.asarray(out, np.float64), ref, rtol=2**-8, atol=2**-9
  )


@pytest.mark.parametrize(
  "policy", ["p=f32,c=bf16,o=f32", "p=bf16,c=bf16,o=bf16", "p=f16,c=f16,o=f32"]
)
def test_outputs_in_output_dtype_and_grads_in_param_dtype(policy):
  policy = jmp_train.get_policy(policy)
  wrapped = mp_linen.wrap(Model(), policy)
  # The wrap's init stores the model's own values in its dtypes (checked by
  # test_float32_wrap_is_the_identity and test_params_stored_...).
  variables = jax.tree.map(
    lambda x, s: x.astype(s.dtype), plain_init(), abstract_init(wrapped, X)
  )
  out, _ = jax.eval_shape(functools.partial(apply_train, wrapped), variables)
  assert out.dtype == policy.output_dtype

  def loss(params):
    out, _ = apply_train(wrapped, {**variables, "params": params})
    return jnp.sum(out.astype(jnp.float32) ** 2)

  grads = jax.jit(jax.grad(loss))(variables["params"])
  assert dtypes_of(grads) == dtypes_of(variables["params"])
  assert all(
    np.isfinite(np.asarray(g, np.float32)).all() for g in jax.tree.leaves(grads)
  )


def test_float32_wrap_is_the_identity_and_structure_is_unchanged():
  plain = Model()
  plain_vars = plain_init()
  wrapped = mp_linen.wrap(Model(), "float32")
  wrapped_vars = init(wrapped)
  jax.tree.map(np.testing.assert_array_equal, wrapped_vars, plain_vars)
  out_w, stats_w = jax.jit(functools.partial(apply_train, wrapped))(
    wrapped_vars
  )
  out_p, stats_p = jax.jit(functools.partial(apply_train, plain))(plain_vars)
  np.testing.assert_array_equal(out_w, out_p)
  jax.tree.map(np.testing.assert_array_equal, stats_w, stats_p)
  bf16_vars = abstract_init(mp_linen.wrap(Model(), "bf16"), X)
  assert jax.tree.structure(bf16_vars) == jax.tree.structure(plain_vars)
  assert jax.tree.map(jnp.shape, bf16_vars) == jax.tree.map(
    jnp.shape, plain_vars
  )


class Head(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(nn.Dense(4)(x))


class MyNorm(nn.LayerNorm):
  pass


class WithHead(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(8)(x)
    x = MyNorm()(x)
    x = nn.LayerNorm()(x)
    return Head()(x)


def test_user_overrides_subclasses_and_removing_a_default():
  wrapped = mp_linen.wrap(
    WithHead(), "p=bf16,c=bf16,o=bf16", overrides={Head: "float32"}
  )
  variables = abstract_init(wrapped, X)
  params = variables["params"]
  assert dtypes_of(params["Head_0"]["Dense_0"])["kernel"] == "float32"
  assert dtypes_of(params["MyNorm_0"])["scale"] == "float32"  # via LayerNorm
  assert dtypes_of(params["Dense_0"])["kernel"] == "bfloat16"
  dots = primitive_operand_dtypes(lambda v: wrapped.apply(v, X), variables)
  assert dots == [
    ("bfloat16", "bfloat16"),
    ("float32", "float32"),
    ("float32", "float32"),
  ]
  # The wrap's own output dtype applies last.
  assert jax.eval_shape(wrapped.apply, variables, X).dtype == jnp.bfloat16

  no_default = mp_linen.wrap(WithHead(), "bf16", overrides={nn.LayerNorm: None})
  nd_params = abstract_init(no_default, X)["params"]
  assert dtypes_of(nd_params["LayerNorm_0"])["scale"] == "bfloat16"
  assert dtypes_of(nd_params["MyNorm_0"])["scale"] == "bfloat16"


class EmaStats(nn.Module):
  @nn.compact
  def __call__(self, x):
    ema = self.variable(
      "batch_stats", "ema", jnp.zeros, x.shape[-1:], jnp.float32
    )
    h = nn.Dense(x.shape[-1])(x)
    if not self.is_initializing():
      ema.value = h.mean(0)  # bf16 under the policy
    return h


def test_mutable_collections_keep_their_dtype():
  wrapped = mp_linen.wrap(EmaStats(), "bf16")
  variables = wrapped.init(jax.random.key(0), X)
  out, updated = wrapped.apply(variables, X, mutable=["batch_stats"])
  assert out.dtype == jnp.bfloat16  # the stored mean was computed in bf16
  assert updated["batch_stats"]["ema"].dtype == jnp.float32
  np.testing.assert_allclose(
    updated["batch_stats"]["ema"],
    np.asarray(out, np.float32).mean(0),
    rtol=1e-2,
  )


class Block(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    h = nn.Dense(x.shape[-1])(x)
    h = nn.Dropout(0.5, deterministic=False)(h)
    return nn.LayerNorm()(x + h), None  # post-norm: carry crosses a norm


class Deep(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(8)(x)
    stack = nn.scan(
      nn.remat(Block),
      variable_axes={"params": 0},
      split_rngs={"params": True, "dropout": True},
      length=3,
    )
    x, _ = stack()(x, None)
    y = nn.RNN(nn.LSTMCell(6))(jnp.repeat(x[:, None, :], 3, axis=1))
    return nn.Dense(2)(y[:, -1])


def test_scan_remat_dropout_and_rnn_models_init_apply_and_differentiate():
  wrapped = mp_linen.wrap(Deep(), "p=bf16,c=bf16,o=f32")
  rngs = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
  variables = jax.eval_shape(wrapped.init, rngs, X)
  assert (
    variables["params"]["ScanCheckpointBlock_0"]["Dense_0"]["kernel"].shape[0]
    == 3
  )

  def loss(params):
    out = wrapped.apply(
      {"params": params}, X, rngs={"dropout": jax.random.key(2)}
    )
    return jnp.mean(out**2)

  dots = primitive_operand_dtypes(loss, variables["params"])
  # Scanned blocks and LSTM input projections run in bf16. The LSTM's carry
  # is created float32 by LSTMCell.initialize_carry, so its recurrent matmul
  # and the head promote to float32 (the policy never changes a scan carry).
  assert ("bfloat16", "bfloat16") in dots
  grads = jax.eval_shape(jax.grad(loss), variables["params"])
  assert dtypes_of(grads) == dtypes_of(variables["params"])


class Outer(nn.Module):
  def setup(self):
    self.encoder = mp_linen.wrap(
      nn.Sequential([nn.Dense(8), nn.LayerNorm(), nn.Dense(8)]), "bf16"
    )
    self.head = nn.Dense(2)

  def __call__(self, x):
    return self.head(self.encoder(x).astype(jnp.float32))


def test_wrapped_submodule_inside_an_unwrapped_model():
  model = Outer()
  variables = abstract_init(model, X)
  params = variables["params"]
  assert params["encoder"]["layers_0"]["kernel"].dtype == jnp.bfloat16
  assert params["encoder"]["layers_1"]["scale"].dtype == jnp.float32
  assert params["head"]["kernel"].dtype == jnp.float32
  dots = primitive_operand_dtypes(lambda v: model.apply(v, X), variables)
  assert dots == [("bfloat16", "bfloat16")] * 2 + [("float32", "float32")]


def test_nested_wraps_use_the_innermost_policy():
  inner = mp_linen.wrap(nn.Dense(4), "float32")
  outer = mp_linen.wrap(
    nn.Sequential([nn.Dense(4), inner, nn.Dense(4)]), "p=f32,c=bf16,o=f32"
  )
  variables = abstract_init(outer, X)
  dots = primitive_operand_dtypes(lambda v: outer.apply(v, X), variables)
  # The float32 region's output is float32; the last Dense reads bf16 params
  # and promotes, as any float32 value meeting bf16 would.
  assert dots[:2] == [("bfloat16", "bfloat16"), ("float32", "float32")]


def test_wrapped_model_trains_with_mixed_precision():
  preset = jmp_train.get_preset("fp16-mixed")
  wrapped = mp_linen.wrap(Model(), preset.policy)
  variables = plain_init()  # float32 params: the wrap's, as p=f32
  assert dtypes_of(variables) == dtypes_of(abstract_init(wrapped, X))
  tx = preset.mixed_precision(optax.adam(1e-2))
  opt_state = tx.init(variables["params"])
  y = jnp.asarray(np.random.default_rng(2).standard_normal((4, 3)), jnp.float32)

  @jax.jit
  def step(params, stats, opt_state):
    def loss_fn(p):
      out, new = wrapped.apply(
        {"params": p, "batch_stats": stats},
        X,
        train=True,
        mutable=["batch_stats"],
      )
      loss = jnp.mean((out - y) ** 2)
      return loss * jmp_train.current_loss_scale(opt_state), (loss, new)

    grads, (loss, new) = jax.grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (
      optax.apply_updates(params, updates),
      new["batch_stats"],
      opt_state,
      loss,
    )

  params, stats = variables["params"], variables["batch_stats"]
  losses = []
  for _ in range(30):
    params, stats, opt_state, loss = step(params, stats, opt_state)
    losses.append(float(loss))
  assert losses[-1] < 0.2 * losses[0]
  assert dtypes_of(params) == dtypes_of(variables["params"])
  assert int(jmp_train.train_metrics(opt_state)["skipped_steps"]) == 0


def test_bad_input():
  with pytest.raises(TypeError, match="flax.linen Module"):
    mp_linen.wrap(lambda x: x, "bf16")
  with pytest.raises(TypeError, match="Module classes"):
    mp_linen.wrap(Model(), "bf16", overrides={"LayerNorm": "float32"})
  with pytest.raises(TypeError, match=r"overrides must be a mapping.*\[<"):
    mp_linen.wrap(Model(), "bf16", overrides=[nn.LayerNorm])
  with pytest.raises(ValueError, match="maps Dense to None, .* no override"):
    mp_linen.wrap(Model(), "bf16", overrides={nn.Dense: None})


def test_none_for_a_subclass_of_a_default_makes_it_follow_the_policy():
  """The most specific class wins, None included: a LayerNorm subclass
  mapped to None follows the policy while LayerNorm keeps float32."""

  class MyNorm(nn.LayerNorm):
    pass

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = MyNorm(name="mine")(nn.Dense(4)(x))
      return nn.LayerNorm(name="plain")(x)

  model = mp_linen.wrap(Net(), "bf16", overrides={MyNorm: None})
  params = model.init(jax.random.key(0), jnp.ones((2, 4)))["params"]
  assert params["mine"]["scale"].dtype == jnp.bfloat16
  assert params["plain"]["scale"].dtype == jnp.float32

  # So does a subclass of a class the user overrides.
  class Head(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(2)(x)

  class SmallHead(Head):
    pass

  class Heads(nn.Module):
    @nn.compact
    def __call__(self, x):
      return Head(name="big")(x) + SmallHead(name="small")(x)

  model = mp_linen.wrap(
    Heads(), "bf16", overrides={Head: "float32", SmallHead: None}
  )
  params = model.init(jax.random.key(0), jnp.ones((2, 4)))["params"]
  assert params["big"]["Dense_0"]["kernel"].dtype == jnp.float32
  assert params["small"]["Dense_0"]["kernel"].dtype == jnp.bfloat16
  with pytest.raises(ValueError, match="Unknown dtype 'bf15'"):
    mp_linen.wrap(Model(), "p=bf15")


# -- Models written as Flax's examples write them: dtype fields, a config, ----
# -- encode/decode methods and a decode cache (tests/_flax_models.py). --------

BF16_MIXED = "p=f32,c=bf16,o=f32"
CONFIG = fm.TransformerConfig()
TOKENS = jnp.array([[1, 2, 3, 0], [4, 5, 0, 0]])
TARGETS = jnp.array([[3, 4, 5, 6], [7, 8, 9, 0]])
IMAGES = jnp.asarray(
  np.random.default_rng(3).standard_normal((2, 8, 8, 3)), jnp.float32
)
BF16_PAIR = ("bfloat16", "bfloat16")


def resnet_matmuls(model):
  """Operand dtypes of every conv and dot of a training step, both passes."""
  variables = abstract_init(model, IMAGES, train=False)

  def loss(params, batch_stats):
    out, _ = model.apply(
      {"params": params, "batch_stats": batch_stats},
      IMAGES,
      mutable=["batch_stats"],
    )
    return jnp.sum(out.astype(jnp.float32) ** 2)

  return {
    p: primitive_operand_dtypes(
      jax.grad(loss), variables["params"], variables["batch_stats"], primitive=p
    )
    for p in MATMULS
  }


def test_resnet_dtype_fields_follow_the_policy_forward_and_backward():
  # examples/imagenet threads `dtype=jnp.float32` into every conv, norm and
  # the head through functools.partial; the reference sets bfloat16 by hand.
  wrapped = mp_linen.wrap(fm.TinyResNet(num_classes=3), BF16_MIXED)
  reference = fm.TinyResNet(num_classes=3, dtype=jnp.bfloat16)
  found = resnet_matmuls(wrapped)
  assert found == resnet_matmuls(reference)
  # 6 convs, their kernel gradients and 5 input gradients (not the images').
  assert len(found["conv_general_dilated"]) == 6 + 6 + 5
  assert set(found["conv_general_dilated"]) == {BF16_PAIR}
  assert set(found["dot_general"]) == {BF16_PAIR}
  # The fields read through, dtype as the model runs (the policy's).
  assert wrapped.num_classes == 3 and wrapped.num_filters == 4
  assert np.dtype(wrapped.dtype) == jnp.bfloat16
  assert wrapped.module.dtype is jnp.float32  # the module as written
  with pytest.raises(AttributeError, match="no field or method 'depth'"):
    _ = wrapped.depth


def transformer_dots(model):
  """Operand dtypes of every dot of a wmt Transformer step, both passes."""
  variables = abstract_init(model, TOKENS, TARGETS)

  def loss(params):
    out = model.apply({"params": params}, TOKENS, TARGETS)
    return jnp.sum(out.astype(jnp.float32) ** 2)

  return primitive_operand_dtypes(jax.grad(loss), variables["params"])


def test_transformer_config_dtype_follows_the_policy_forward_and_backward():
  # examples/wmt: `dtype=config.dtype` in every layer, `x.astype(config.dtype)`
  # and masks made in config.dtype; the reference is the same model with
  # `config.dtype = bfloat16`, as its authors would run it in bfloat16.
  wrapped = mp_linen.wrap(fm.Transformer(CONFIG), BF16_MIXED)
  dots = transformer_dots(wrapped)
  assert dots == transformer_dots(
    fm.Transformer(CONFIG.replace(dtype=jnp.bfloat16))
  )
  # All but the logits, which the model computes from `y.astype(float32)`
  # with an nn.Embed whose dtype is None (so inferred), in both runs.
  assert dots.count(BF16_PAIR) == len(dots) - 3
  params = abstract_init(wrapped, TOKENS, TARGETS)["params"]
  norm = params["encoder"]["encoder_norm"]
  assert {norm["scale"].dtype, norm["bias"].dtype} == {jnp.dtype("float32")}
  assert np.dtype(wrapped.config.dtype) == jnp.bfloat16
  assert wrapped.module.config.dtype is jnp.float32


def test_respect_dtype_fields_keeps_the_modules_own_dtypes():
  wrapped = mp_linen.wrap(
    fm.Transformer(CONFIG), BF16_MIXED, respect_dtype_fields=True
  )
  # As before dtype fields followed the policy: Flax casts back to float32.
  assert set(transformer_dots(wrapped)) == {("float32", "float32")}
  assert wrapped.config.dtype is jnp.float32


class FloatHead(nn.Module):
  """Every layer built float32 on purpose, as some models keep their head."""

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(8, dtype=jnp.float32, name="body")(x)
    return nn.Dense(2, dtype=jnp.float32, name="head")(x)


def test_respect_dtype_fields_takes_classes_and_name_patterns():
  # Only the named modules (and what they hold) keep their float32 fields.
  x = jnp.ones((2, 4))
  variables = abstract_init(mp_linen.wrap(FloatHead(), BF16_MIXED), x)
  f32_pair = ("float32", "float32")
  for respect, want in [
    ((), [BF16_PAIR, BF16_PAIR]),
    (("head",), [BF16_PAIR, f32_pair]),
    ((nn.Dense,), [f32_pair, f32_pair]),
  ]:
    wrapped = mp_linen.wrap(
      FloatHead(), BF16_MIXED, respect_dtype_fields=respect
    )
    dots = primitive_operand_dtypes(
      lambda v, w=wrapped: w.apply(v, x), variables
    )
    assert dots == want, respect
  for bad in (["yes", 3], 7):
    with pytest.raises(TypeError, match="respect_dtype_fields takes"):
      mp_linen.wrap(FloatHead(), BF16_MIXED, respect_dtype_fields=bad)


class Upcast(nn.Module):
  """No params; a third, rounded to its own `dtype` field."""

  dtype: Any = jnp.float32

  def __call__(self, x):
    return jnp.full(x.shape, 1 / 3, self.dtype).astype(jnp.float32)


class HeadAndUpcast(nn.Module):
  def setup(self):
    self.net = FloatHead()
    self.up = Upcast()

  def features(self, x):  # does not run `up`
    return self.net(x)

  def __call__(self, x):
    return self.up(self.net(x))


def test_respect_dtype_fields_refuses_a_pattern_that_selects_nothing():
  # A typo would leave the head computing in bfloat16, with no error.
  x = jnp.ones((2, 4))
  model = mp_linen.wrap(FloatHead(), BF16_MIXED, respect_dtype_fields=("haed",))
  with pytest.raises(ValueError, match="'haed' matches no .*: body, head\\."):
    jax.eval_shape(model.init, jax.random.key(0), x)
  # Params made without the wrap (a restored or pretrained model): apply.
  variables = jax.eval_shape(FloatHead().init, jax.random.key(0), x)
  with pytest.raises(ValueError, match="'haed' matches no module"):
    jax.eval_shape(model.apply, variables, x)
  # A module without params is matched by the modules init runs; an apply
  # of a method that does not run it is not refused.
  for respect, dtype in [((), jnp.bfloat16), (("up",), np.float32)]:
    model = mp_linen.wrap(
      HeadAndUpcast(), BF16_MIXED, respect_dtype_fields=respect
    )
    variables = jax.jit(model.init)(jax.random.key(0), x)
    out = model.apply(variables, x)
    np.testing.assert_array_equal(out, np.float32(dtype(1 / 3)))
    assert model.apply(variables, x, method="features").shape == (2, 2)


@pytest.mark.parametrize(
  "method",
  ["encode", fm.Transformer.encode, lambda m, x: m.encode(x)],
  ids=["name", "function", "lambda"],
)
def test_other_methods_run_under_the_policy(method):
  wrapped = mp_linen.wrap(fm.Transformer(CONFIG), BF16_MIXED)
  variables = abstract_init(wrapped, TOKENS, method=method)
  reference = fm.Transformer(CONFIG.replace(dtype=jnp.bfloat16))

  def encode(model, method):
    return lambda v: model.apply(v, TOKENS, method=method)

  want = primitive_operand_dtypes(encode(reference, "encode"), variables)
  assert set(want) == {BF16_PAIR}
  assert primitive_operand_dtypes(encode(wrapped, method), variables) == want
  assert jax.eval_shape(encode(wrapped, method), variables).dtype == jnp.float32


class Classifier(nn.Module):
  """A parent calling a wrapped model's method, as it would the model's."""

  def setup(self):
    self.transformer = mp_linen.wrap(fm.Transformer(CONFIG), BF16_MIXED)
    self.head = nn.Dense(2)

  def __call__(self, inputs):
    return self.head(self.transformer.encode(inputs).mean(axis=1))


def test_a_parent_calls_a_wrapped_models_other_method():
  model = Classifier()
  variables = abstract_init(model, TOKENS)
  reference = fm.Transformer(CONFIG.replace(dtype=jnp.bfloat16))
  encoder_dots = primitive_operand_dtypes(
    lambda v: reference.apply(v, TOKENS, method="encode"),
    {"params": variables["params"]["transformer"]},
  )
  dots = primitive_operand_dtypes(lambda v: model.apply(v, TOKENS), variables)
  # The unwrapped head meets the wrapped model's float32 output.
  assert dots == encoder_dots + [("float32", "float32")]


def test_decode_cache_from_init_matches_what_decoding_computes():
  # examples/wmt decoding: `initialize_cache` inits the model with a decode
  # config, then each step applies `method=Transformer.decode` on the cache.
  config = CONFIG.replace(decode=True)
  params = abstract_init(fm.Transformer(CONFIG), TOKENS, TARGETS)["params"]

  def decode_step(model):
    cache = abstract_init(model, TOKENS, jnp.ones((2, 4)))["cache"]

    def step(params, cache):
      encoded = model.apply(
        {"params": params}, TOKENS, method=fm.Transformer.encode
      )
      return model.apply(
        {"params": params, "cache": cache},
        encoded,
        TOKENS,
        TARGETS[:, :1],
        mutable=["cache"],
        method=fm.Transformer.decode,
      )

    logits, updated = jax.eval_shape(step, params, cache)
    dots = primitive_operand_dtypes(step, params, cache)
    return cache, logits, updated["cache"], dots

  cache, logits, updated, dots = decode_step(
    mp_linen.wrap(fm.Transformer(config), BF16_MIXED)
  )
  ref_cache, _, _, ref_dots = decode_step(
    fm.Transformer(config.replace(dtype=jnp.bfloat16))
  )
  attention = cache["decoder"]["encoderdecoderblock_0"]["SelfAttention_0"]
  assert attention["cached_key"].dtype == jnp.bfloat16
  assert dtypes_of(cache) == dtypes_of(ref_cache) == dtypes_of(updated)
  assert dots == ref_dots and BF16_PAIR in dots
  assert logits.dtype == jnp.float32 and logits.shape == (2, 1, 11)


class Counted(nn.Module):
  """Takes a dict of arrays and an `nnx.Variable` it updates in place."""

  @nn.compact
  def __call__(self, batch, calls):
    calls[...] += 1
    assert batch["mask"].dtype == jnp.bool_
    return nn.Dense(2)(batch["x"]) * batch["mask"]


def test_call_arguments_cast_only_float_arrays_and_pass_objects_by_reference():
  wrapped = mp_linen.wrap(Counted(), BF16_MIXED)
  batch = {"x": X, "mask": jnp.ones((4, 1), jnp.bool_)}
  variables = wrapped.init(
    jax.random.key(0), batch, nnx.Variable(jnp.zeros((), jnp.int32))
  )
  calls = nnx.Variable(jnp.zeros((), jnp.int32))
  wrapped.apply(variables, batch, calls)
  wrapped.apply(variables, batch, calls)
  assert int(calls[...]) == 2  # the caller's Variable, updated in place

  def apply(variables, x):
    counter = nnx.Variable(jnp.zeros((), jnp.int32))  # of this trace
    return wrapped.apply(variables, {**batch, "x": x}, counter)

  assert primitive_operand_dtypes(apply, variables, X) == [BF16_PAIR]


def test_an_override_output_dtype_is_what_the_layers_after_it_see():
  """README: a user override returns its own output dtype, and a layer
  after it with dtype=None computes in that dtype; o= the enclosing
  compute dtype keeps the rest of the model in it."""

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(4, name="inner")(x)

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(3, name="after")(Block(name="block")(x))

  def dtypes(override):
    model = mp_linen.wrap(
      Net(), "p=f32,c=bf16,o=f32", overrides={Block: override}
    )
    x = jnp.ones((2, 4))
    params = jax.jit(model.init)(jax.random.key(0), x)["params"]
    found = jmp_train.fp8.matmuls(
      lambda p: model.apply({"params": p}, x), params
    )
    return {m.path.split("/")[-1]: m.dtypes for m in found}

  assert dtypes("float32") == {
    "inner": ("float32", "float32"),
    "after": ("float32", "float32"),
  }
  assert dtypes("p=f32,c=f32,o=bf16") == {
    "inner": ("float32", "float32"),
    "after": ("bfloat16", "bfloat16"),
  }
