"""linen.wrap: dtypes read from the jaxpr, numerics against unwrapped runs."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import primitive_operand_dtypes

import jmp_train
from jmp_train import linen as mp_linen

MATMULS = ("dot_general", "conv_general_dilated")


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
  return module.init(jax.random.key(0), X)


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
  variables = init(mp_linen.wrap(Model(), policy))
  params = variables["params"]
  for name, leaves in params.items():
    want = "float32" if name in NORM_KEYS else policy.param_dtype.name
    for path, leaf in jax.tree_util.tree_leaves_with_path(leaves):
      assert leaf.dtype.name == want, (name, path)
  assert set(jax.tree.leaves(dtypes_of(variables["batch_stats"]))) == {
    "float32"
  }


@pytest.mark.parametrize("compute", ["bfloat16", "float16", "float32"])
def test_every_matmul_runs_in_the_compute_dtype(compute):
  wrapped = mp_linen.wrap(Model(), f"p=f32,c={compute},o=f32")
  variables = init(wrapped)
  for primitive in MATMULS:
    found = primitive_operand_dtypes(
      lambda v: apply_train(wrapped, v), variables, primitive=primitive
    )
    assert found, primitive
    assert set(found) == {(compute, compute)}, (primitive, found)
  # Unwrapped, the same model computes every matmul in float32.
  plain = Model()
  found = primitive_operand_dtypes(
    lambda v: apply_train(plain, v), plain.init(jax.random.key(0), X)
  )
  assert set(found) == {("float32", "float32")}


def test_norms_compute_in_float32_and_return_the_compute_dtype():
  wrapped = mp_linen.wrap(Model(), "p=bf16,c=bf16,o=f32")
  variables = init(wrapped)
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
  variables = init(wrapped)
  out, _ = apply_train(wrapped, variables)
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
  plain_vars = plain.init(jax.random.key(0), X)
  wrapped = mp_linen.wrap(Model(), "float32")
  wrapped_vars = init(wrapped)
  jax.tree.map(np.testing.assert_array_equal, wrapped_vars, plain_vars)
  out_w, stats_w = apply_train(wrapped, wrapped_vars)
  out_p, stats_p = apply_train(plain, plain_vars)
  np.testing.assert_array_equal(out_w, out_p)
  jax.tree.map(np.testing.assert_array_equal, stats_w, stats_p)
  bf16_vars = init(mp_linen.wrap(Model(), "bf16"))
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
  variables = wrapped.init(jax.random.key(0), X)
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
  assert wrapped.apply(variables, X).dtype == jnp.bfloat16

  no_default = mp_linen.wrap(WithHead(), "bf16", overrides={nn.LayerNorm: None})
  nd_params = no_default.init(jax.random.key(0), X)["params"]
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
  variables = wrapped.init(rngs, X)
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
  grads = jax.jit(jax.grad(loss))(variables["params"])
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
  variables = model.init(jax.random.key(0), X)
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
  variables = outer.init(jax.random.key(0), X)
  dots = primitive_operand_dtypes(lambda v: outer.apply(v, X), variables)
  # The float32 region's output is float32; the last Dense reads bf16 params
  # and promotes, as any float32 value meeting bf16 would.
  assert dots[:2] == [("bfloat16", "bfloat16"), ("float32", "float32")]


def test_wrapped_model_trains_with_mixed_precision():
  preset = jmp_train.get_preset("fp16-mixed")
  wrapped = mp_linen.wrap(Model(), preset.policy)
  variables = init(wrapped)
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
  with pytest.raises(ValueError, match="Unknown dtype 'bf15'"):
    mp_linen.wrap(Model(), "p=bf15")
