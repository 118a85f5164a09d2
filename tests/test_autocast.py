"""jmp_train.autocast: operand dtypes read from the jaxpr, forward and
backward, on models written elsewhere; numerics against the same function
cast by hand; control flow, custom rules, shard_map; composition with the
train step, ZeRO-1, linen.wrap overrides and FP8 layers."""

import functools
import importlib.util
import pathlib
import sys

import _flax_models as fm
import _models
import flax.linen as nn
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import equations
from conftest import primitive_operand_dtypes as dtypes_of
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import mlir

import jmp_train
from jmp_train import AutocastLists, autocast, fp8, train, zero1
from jmp_train import linen as mp_linen
from jmp_train import nnx as mp_nnx

BF16 = "p=f32,c=bf16,o=f32"
bf16, f32 = jnp.bfloat16, jnp.float32


def _all_operands(fn, *args):
  """(primitive, float operand dtypes) of every equation, nested included."""
  return [
    (
      eqn.primitive.name,
      tuple(
        v.aval.dtype.name
        for v in eqn.invars
        if hasattr(v.aval, "dtype")
        and jnp.issubdtype(v.aval.dtype, jnp.floating)
      ),
    )
    for eqn in equations(fn, *args)
  ]


def _check_lists(found, compute="bfloat16"):
  """Every matmul in `compute`, every float32-list op in float32."""
  lists = AutocastLists()
  dots = [d for p, d in found if p in lists.compute]
  assert dots and all(set(d) == {compute} for d in dots), dots
  wide = [(p, d) for p, d in found if p in lists.float32 and d]
  assert wide and all(set(d) == {"float32"} for _, d in wide), wide


# -- a plain-JAX MLP with softmax cross-entropy, against casts by hand --------


def _mlp_params():
  k1, k2 = jax.random.split(jax.random.key(0))
  return {
    "w1": jax.random.normal(k1, (6, 16)) * 0.5,
    "b1": jnp.full((16,), 0.1),
    "w2": jax.random.normal(k2, (16, 5)) * 0.5,
    "b2": jnp.full((5,), -0.2),
  }


def _mlp_loss(p, x, labels):
  h = jax.nn.gelu(x @ p["w1"] + p["b1"])
  logits = h @ p["w2"] + p["b2"]
  logp = jax.nn.log_softmax(logits)
  return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))


def _mlp_loss_by_hand(p, x, labels):
  """The rules written out: matmuls in bfloat16, everything after a float32
  operand joins in float32, exp/log/sums in float32."""
  dot = lambda a, b: jnp.dot(a.astype(bf16), b.astype(bf16))  # noqa: E731
  h = dot(x, p["w1"]).astype(f32) + p["b1"]
  h = jax.nn.gelu(h)
  logits = dot(h, p["w2"]).astype(f32) + p["b2"]
  logp = jax.nn.log_softmax(logits)
  return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))


@pytest.mark.parametrize("wrap", [jax.jit, lambda f: f], ids=["jit", "eager"])
def test_plain_mlp_equals_the_casts_by_hand(wrap):
  p = _mlp_params()
  x = jax.random.normal(jax.random.key(1), (8, 6))
  labels = jnp.arange(8) % 5
  loss = autocast(_mlp_loss, BF16)
  value, grads = wrap(jax.value_and_grad(loss))(p, x, labels)
  # Under jit XLA may fold a bfloat16 product's convert to float32 into the
  # dot: the same program in the same mode rounds the same way.
  want, want_grads = wrap(jax.value_and_grad(_mlp_loss_by_hand))(p, x, labels)
  np.testing.assert_allclose(value, want, rtol=1e-6)
  for k in p:
    np.testing.assert_allclose(grads[k], want_grads[k], rtol=1e-5, atol=1e-7)
    assert grads[k].dtype == jnp.float32  # params keep their dtype
  # And bfloat16 is really in use: the float32 loss differs.
  assert abs(float(value) - float(_mlp_loss(p, x, labels))) > 1e-5
  found = _all_operands(jax.grad(loss), p, x, labels)
  _check_lists(found)
  # 2 forward, 3 backward (no gradient for x)
  assert len([d for n, d in found if n == "dot_general"]) == 5


# -- a linen Transformer whose layers pass dtype=float32 ---------------------


def _wmt_loss(model):
  def loss(params, inputs, targets):
    logits = model.apply({"params": params}, inputs, targets)
    onehot = jax.nn.one_hot(targets, logits.shape[-1])
    return -jnp.mean(jnp.sum(onehot * jax.nn.log_softmax(logits), -1))

  return loss


def test_linen_transformer_with_float32_layers_runs_matmuls_in_bf16():
  model = fm.Transformer(fm.TransformerConfig())  # dtype=float32 everywhere
  inputs = jnp.array([[3, 4, 5, 0], [1, 2, 7, 9]], jnp.int32)
  targets = jnp.array([[2, 6, 1, 0], [4, 4, 8, 3]], jnp.int32)
  params = jax.jit(model.init)(jax.random.key(0), inputs, targets)["params"]
  loss = _wmt_loss(model)
  grad = jax.grad(autocast(loss, BF16))
  found = _all_operands(grad, params, inputs, targets)
  _check_lists(found)
  # Attention's softmax: its exp and sums in float32, the logits' divide too.
  assert ("exp", ("float32",)) in found
  assert ("rsqrt", ("float32",)) in found  # LayerNorm
  grads = jax.jit(grad)(params, inputs, targets)
  want = jax.jit(jax.grad(loss))(params, inputs, targets)
  for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
    assert g.dtype == w.dtype == jnp.float32
    np.testing.assert_allclose(g, w, rtol=0.1, atol=2e-2)


class _Head(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(5, name="proj")(x)


class _Net(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(16, dtype=jnp.float32)(x))
    return _Head()(x)


def test_a_linen_wrap_float32_override_wins():
  model = mp_linen.wrap(_Net(), BF16, overrides={_Head: "float32"})
  x = jax.random.normal(jax.random.key(1), (4, 6))
  params = model.init(jax.random.key(0), x)["params"]

  def loss(params, x):
    return jnp.sum(model.apply({"params": params}, x) ** 2)

  ops = fp8.matmuls(jax.grad(autocast(loss, BF16)), params, x)
  head = [m for m in ops if "_Head" in m.path]
  body = [m for m in ops if "_Head" not in m.path]
  assert len(head) == 3  # forward, and the gradients of its kernel and input
  assert len(body) == 2  # forward, and its kernel's gradient
  assert all(m.dtypes == ("float32", "float32") for m in head), head
  assert all(m.dtypes == ("bfloat16", "bfloat16") for m in body), body


# -- NNX: dtype= fields, BatchNorm, dropout with Rngs as a call argument -----


def test_nnx_model_with_rngs_argument_trains_and_writes_state_back():
  model = fm.CNN(rngs=nnx.Rngs(0))
  reference = nnx.clone(model)
  x = jax.random.normal(jax.random.key(1), (4, 8, 8, 1))
  labels = jnp.arange(4)

  def loss(model, x, rngs):
    logits = model(x, rngs)
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, labels
    ).mean()

  rngs, ref_rngs = nnx.Rngs(dropout=7), nnx.Rngs(dropout=7)
  grad_fn = nnx.jit(nnx.grad(autocast(loss, BF16)))
  # Forward and backward: convolutions and matmuls in bfloat16, BatchNorm's
  # sums and rsqrt and the loss's exp/log in float32.
  found = _all_operands(
    lambda m, x: nnx.grad(autocast(loss, BF16))(m, x, nnx.Rngs(dropout=7)),
    model,
    x,
  )
  _check_lists(found)
  convs = [d for p, d in found if p == "conv_general_dilated"]
  assert len(convs) >= 5  # 2 forward, 3 backward (no gradient for x)
  assert ("rsqrt", ("float32",)) in found
  first = grad_fn(model, x, rngs)
  second = grad_fn(model, x, rngs)
  # Dropout advanced: as many draws as the plain model makes, new masks.
  reference(x, ref_rngs)  # the plain model, eager: the same draws and stats
  reference(x, ref_rngs)
  assert rngs.dropout.count.get_value() == ref_rngs.dropout.count.get_value()
  a, b = (nnx.state(g, nnx.Param)["linear2"]["kernel"] for g in (first, second))
  assert not np.allclose(a.get_value(), b.get_value())
  # Batch statistics were written back, in float32, close to the plain run.
  mean = model.batch_norm1.mean.get_value()
  assert mean.dtype == jnp.float32 and np.abs(mean).max() > 0
  np.testing.assert_allclose(
    mean, reference.batch_norm1.mean.get_value(), rtol=0.05, atol=1e-3
  )
  for g in jax.tree.leaves(nnx.state(first, nnx.Param)):
    assert g.dtype == jnp.float32


# -- control flow, custom rules, shard_map ----------------------------------


W = jax.random.normal(jax.random.key(2), (4, 4))
X = jax.random.normal(jax.random.key(3), (8, 4))


def test_scan_while_cond_checkpoint_and_jit_are_autocast_inside():
  def fn(w, x):
    def body(c, xi):  # the carry stays float32 though the matmul is bf16
      return jnp.tanh(c @ w) + xi, jnp.sum(c)

    c, ys = lax.scan(body, x[0], x)
    c = lax.cond(c[0] > 0, lambda a: a @ w, lambda a: jnp.exp(a), c)
    c = jax.checkpoint(lambda a: jnp.cos(a @ w))(c)
    c = jax.jit(lambda a: a @ w)(c)
    return jnp.sum(c) + jnp.sum(ys)

  f = autocast(fn, BF16)
  found = dtypes_of(jax.grad(f), W, X)
  assert len(found) >= 9 and set(found) == {("bfloat16", "bfloat16")}
  jaxpr = jax.make_jaxpr(f)(W, X)
  (scan,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
  n = scan.params["num_consts"]
  assert scan.invars[n].aval.dtype == jnp.float32  # the carry
  # Against float32: close, not equal (bfloat16 matmuls).
  value, want = f(W, X), fn(W, X)
  assert value.dtype == jnp.float32 and value != want
  np.testing.assert_allclose(value, want, rtol=0.05)

  def loop(w, x):  # while_loop: forward only (JAX has no reverse mode)
    step = lambda s: (s[0] + 1, jnp.sin(s[1] @ w))  # noqa: E731
    return jnp.sum(lax.while_loop(lambda s: s[0] < 2, step, (0, x))[1])

  assert dtypes_of(autocast(loop, BF16), W, X) == [("bfloat16", "bfloat16")]
  np.testing.assert_allclose(autocast(loop, BF16)(W, X), loop(W, X), rtol=0.05)


def test_custom_jvp_and_custom_vjp_rules_are_kept():
  # relu's custom JVP gives 0 at 0 (max's own rule would give 0.5).
  g = jax.grad(autocast(lambda x: jnp.sum(jax.nn.relu(x)), BF16))(jnp.zeros(3))
  np.testing.assert_array_equal(g, np.zeros(3))

  # A straight-through estimator: round has no gradient, the rule passes 1.
  @jax.custom_vjp
  def ste(a):
    return jnp.round(a)

  ste.defvjp(lambda a: (jnp.round(a), None), lambda _, g: (g,))

  def loss(w, x):
    return jnp.sum(ste(x @ w) * 3.0)

  grads = jax.grad(autocast(loss, BF16))(W, X)
  want = 3.0 * X.astype(bf16).astype(f32).sum(0)[:, None] * jnp.ones((1, 4))
  np.testing.assert_allclose(grads, want, rtol=1e-2)

  # A VJP whose bwd does a matmul of its own: autocast there too.
  @jax.custom_vjp
  def sig(a):
    return jax.nn.sigmoid(a)

  def fwd(a):
    s = jax.nn.sigmoid(a)
    return s, s

  sig.defvjp(fwd, lambda s, g: ((g * s * (1 - s)) @ jnp.eye(s.shape[-1]),))
  loss2 = autocast(lambda w, x: jnp.sum(sig(x @ w) ** 2), BF16)
  assert set(dtypes_of(jax.grad(loss2), W, X)) == {("bfloat16", "bfloat16")}
  plain = jax.grad(lambda w, x: jnp.sum(jax.nn.sigmoid(x @ w) ** 2))(W, X)
  np.testing.assert_allclose(jax.grad(loss2)(W, X), plain, rtol=0.05, atol=0.02)


def _mixed_scale_primitive():
  """A primitive that takes a bfloat16 and a float32 operand and refuses
  others, as cuDNN attention's backward does (bfloat16 q, k and v, float32
  softmax statistics: given float32 for all, it fails to lower)."""
  prim = Primitive("bf16_times_f32")

  def abstract(g, stats):
    if (g.dtype, stats.dtype) != (bf16, f32):
      raise TypeError(
        f"bf16_times_f32 takes bfloat16 and float32, got {g.dtype} and"
        f" {stats.dtype}"
      )
    return jax.core.ShapedArray(g.shape, bf16)

  def compute(g, stats):
    return (g.astype(f32) * stats).astype(bf16)

  prim.def_abstract_eval(abstract)
  prim.def_impl(compute)
  mlir.register_lowering(prim, mlir.lower_fun(compute, False))
  return prim


def test_a_primitive_given_mixed_float_dtypes_keeps_them():
  # Found compiling autocast's GPT-2 for an H100 (benchmarks/page.md,
  # "Kernels of GPT-2 small's step"): autocast promoted the bfloat16 and
  # float32 operands of cuDNN attention's backward to float32.
  prim = _mixed_scale_primitive()

  @jax.custom_vjp
  def scaled(a):
    return a.astype(bf16)

  def fwd(a):
    return scaled(a), jnp.full(a.shape, 3.0, f32)

  def bwd(stats, g):  # g: bfloat16, as scaled's output
    return (prim.bind(g, stats).astype(f32),)

  scaled.defvjp(fwd, bwd)

  def loss(w, x):
    return jnp.sum(scaled(x @ w).astype(f32))

  # d/dw of sum(x @ w), times bwd's 3: 3 x^T 1. Under autocast the matmul
  # takes x in bfloat16 and gives its product in bfloat16 (the unrounded
  # sums differ from these by up to 1.1%).
  ones = np.ones((1, 4))
  want = jax.grad(loss)(W, X)
  np.testing.assert_allclose(want, 3.0 * X.sum(0)[:, None] * ones, rtol=1e-6)
  sums = 3.0 * X.astype(bf16).astype(f32).sum(0)[:, None] * ones
  rounded = sums.astype(bf16).astype(f32)
  for grad in (jax.grad, lambda f: jax.jit(jax.grad(f))):
    got = grad(autocast(loss, BF16))(W, X)
    np.testing.assert_allclose(got, rounded, rtol=3e-3)
  # Where the program gave one dtype, autocast still promotes: exp's
  # float32 result times the bfloat16 x it was written with multiplies in
  # float32 (as written it would be bfloat16).
  x16 = X.astype(bf16)
  found = _all_operands(autocast(lambda x: jnp.sum(jnp.exp(x) * x), BF16), x16)
  assert ("mul", ("float32", "float32")) in found


@pytest.mark.skipif(
  importlib.util.find_spec("jax_cuda12_plugin") is None,
  reason="compiling for a GPU without one needs JAX's CUDA plugin",
)
def test_cudnn_attention_under_autocast_compiles_for_a_gpu():
  # What the primitive above stands in for, compiled for an H100 on this
  # machine (benchmarks/deviceless.py), where JAX's CUDA plugin is
  # installed: forward and backward on cuDNN's kernels.
  sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))
  import deviceless

  def loss(w, q, k, v):
    q, k, v = (jnp.tanh(t @ w).astype(bf16) for t in (q, k, v))
    y = jax.nn.dot_product_attention(
      q, k, v, is_causal=True, implementation="cudnn"
    )
    return jnp.sum(y.astype(f32) @ w)

  topo = deviceless.topology("h100")
  qkv = jax.ShapeDtypeStruct((2, 128, 4, 64), f32)
  args = deviceless.abstract(
    (jax.ShapeDtypeStruct((64, 64), f32), qkv, qkv, qkv), topo
  )
  hlo = jax.jit(jax.grad(autocast(loss, BF16))).lower(*args).compile().as_text()
  assert 'custom_call_target="__cudnn$fmhaSoftmax"' in hlo
  assert 'custom_call_target="__cudnn$fmhaSoftmaxBackward"' in hlo


def _rows_over_data(local):
  """`fn(w, x)` running `local` under shard_map on the 8-device "data" mesh:
  `w` whole on each device, `x`'s rows split, one replicated result."""
  return jax.shard_map(
    local,
    mesh=_models.mesh(),
    in_specs=(jax.P(), jax.P("data")),
    out_specs=jax.P(),
  )


def test_shard_map_with_psum():
  fn = _rows_over_data(lambda w, x: lax.psum(jnp.sum(jnp.tanh(x @ w)), "data"))
  f = autocast(fn, BF16)
  assert dtypes_of(jax.jit(jax.grad(f)), W, X)  # traced through
  assert set(dtypes_of(jax.grad(f), W, X)) == {("bfloat16", "bfloat16")}
  g = jax.jit(jax.grad(f))(W, X)
  np.testing.assert_allclose(g, jax.grad(fn)(W, X), rtol=0.05, atol=0.05)


def test_a_custom_vjp_inside_shard_map_scales_a_varying_cotangent():
  # bwd scales each device's cotangent by a constant, as a written-out
  # mean's gradient does (examples/gpt_model.cross_entropy). Autocast
  # traced bwd with cotangents typed as replicated, and shard_map's check
  # then refused `varying / constant` ("div requires varying manual axes
  # to match").
  @jax.custom_vjp
  def mean_tanh(a):
    return jnp.mean(jnp.tanh(a))

  def fwd(a):
    return mean_tanh(a), a

  def bwd(a, g):
    return ((1 - jnp.tanh(a) ** 2) * (g / a.size),)

  mean_tanh.defvjp(fwd, bwd)
  fn = _rows_over_data(lambda w, x: lax.pmean(mean_tanh(x @ w), "data"))
  want = jax.grad(lambda w, x: jnp.mean(jnp.tanh(x @ w)))(W, X)
  np.testing.assert_allclose(jax.grad(fn)(W, X), want, rtol=1e-5)
  got = jax.jit(jax.grad(autocast(fn, BF16)))(W, X)
  # The gradients are about 0.03; bfloat16 matmuls put them within 0.3%.
  np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-3)


# -- what is never cast -----------------------------------------------------


def test_integers_booleans_and_constants_that_would_overflow():
  def fn(w, idx, x):
    rows = w[idx] * 2  # a gather with int indices
    return jnp.sum(rows), idx + 1

  value, ints = autocast(fn, "p=f32,c=f16,o=f16")(W, jnp.array([0, 3]), X)
  assert ints.dtype == jnp.int32 and list(ints) == [1, 4]
  assert value.dtype == jnp.float16  # the policy's output dtype
  np.testing.assert_allclose(
    float(value), float(jnp.sum(W[jnp.array([0, 3])] * 2)), 1e-3
  )

  # A program constant does not widen (0.1 with a bfloat16 product stays
  # bfloat16), unless the narrow dtype would make it inf: -1e30 in float16.
  # (An epsilon float16 can hold, as 1e-5 is, stays float16 too.)
  scaled = lambda w, x: (x @ w) * 0.1  # noqa: E731
  assert ("mul", ("bfloat16", "bfloat16")) in _all_operands(
    autocast(scaled, BF16), W, X
  )
  eps = lambda w, x: (x @ w) + 1e-5  # noqa: E731
  assert ("add", ("float16", "float16")) in _all_operands(
    autocast(eps, "p=f32,c=f16,o=f32"), W, X
  )
  floor = lambda w, x: jnp.minimum(x @ w, -1e30)  # noqa: E731
  np.testing.assert_array_equal(
    autocast(floor, "p=f32,c=f16,o=f32")(W, X), np.full((8, 4), -1e30, f32)
  )
  # The same for a constant in a primitive's parameters (gather's fill).
  take = lambda w, x: jnp.take(  # noqa: E731
    x @ w, jnp.array([0, 9]), axis=0, mode="fill", fill_value=-1e30
  )
  np.testing.assert_array_equal(
    autocast(take, "p=f32,c=f16,o=f32")(W, X)[1], np.full(4, -1e30, f32)
  )
  # Nor one the narrow dtype would make zero: 1e-9 in float16 (whose least
  # subnormal is 6e-8). The matmul still runs in float16, the rest in
  # float32, as by hand.
  tiny = lambda w, x: (x @ w) * 1e-9 * 1e9  # noqa: E731
  f16 = jnp.float16
  by_hand = (X.astype(f16) @ W.astype(f16)).astype(f32) * f32(1e-9) * f32(1e9)
  got = autocast(tiny, "p=f32,c=f16,o=f32")(W, X)
  assert np.all(np.abs(by_hand) > 0)
  np.testing.assert_allclose(got, by_hand, rtol=1e-6)
  ratio = lambda w, x: (x @ w) / 1e-9  # noqa: E731
  assert np.all(np.isfinite(autocast(ratio, "p=f32,c=f16,o=f32")(W, X)))


def test_what_the_program_asks_for_wins():
  # An inner autocast with its own policy (here float32: an opt-out).
  head = autocast(lambda h, w: h @ w, "float32")
  nested = lambda w, x: jnp.sum(head(jnp.tanh(x @ w), w))  # noqa: E731
  assert dtypes_of(autocast(nested, BF16), W, X) == [
    ("bfloat16", "bfloat16"),
    ("float32", "float32"),
  ]
  # An explicit matmul precision (an algorithm, or HIGHEST).
  exact = lambda w, x: jnp.dot(x, w, precision="highest")  # noqa: E731
  assert dtypes_of(autocast(exact, BF16), W, X) == [("float32", "float32")]
  # A product wider than its operands; a float32 matmul's product goes down.
  wide = lambda w, x: jnp.dot(  # noqa: E731
    x.astype(jnp.bfloat16),
    w.astype(jnp.bfloat16),
    preferred_element_type=jnp.float32,
  )
  for fn, want in ((wide, "float32"), (lambda w, x: x @ w, "bfloat16")):
    (dot,) = [
      e
      for e in equations(autocast(fn, BF16), W, X)
      if e.primitive.name == "dot_general"
    ]
    assert dot.params["preferred_element_type"] == want
    assert dot.outvars[0].aval.dtype == want
  # An nnx.wrap override.
  net = nnx.Sequential(
    nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.Linear(8, 2, rngs=nnx.Rngs(1))
  )
  net = mp_nnx.wrap(net, BF16, overrides={nnx.Linear: "float32"})
  graph, state = nnx.split(net)
  run = autocast(lambda m, x: m(x), BF16)
  assert set(dtypes_of(lambda s, x: run(nnx.merge(graph, s), x), state, X)) == {
    ("float32", "float32")
  }


def test_nnx_module_as_fn_and_a_module_only_read_from_outside():
  bn = nnx.BatchNorm(4, rngs=nnx.Rngs(0))
  y = autocast(bn, BF16)(X)  # the module is the function
  assert y.dtype == jnp.float32
  # momentum 0.99: the running mean moves 1% of the way to the batch mean
  np.testing.assert_allclose(bn.mean.get_value(), 0.01 * X.mean(0), rtol=1e-5)
  # A module closed over by jit is only read: nothing is written back.
  lin = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
  value = jax.jit(lambda x: autocast(lambda m, x: jnp.sum(m(x)), BF16)(lin, x))(
    X
  )
  np.testing.assert_allclose(value, jnp.sum(lin(X)), rtol=0.02)


def test_fp8_layers_are_left_alone():
  model = mp_linen.wrap(_Net(), "float32", fp8="current")
  x = jax.random.normal(jax.random.key(1), (4, 6))
  variables = model.init(jax.random.key(0), x)

  def loss(params, fp8_meta, x):
    y = model.apply({"params": params, "fp8_meta": fp8_meta}, x)
    return jnp.sum(y**2)

  grad = jax.grad(autocast(loss, BF16), argnums=(0, 1))
  args = (variables["params"], variables["fp8_meta"], x)
  ops = fp8.matmuls(grad, *args)
  assert len(ops) == 6
  assert all(all(d.startswith("float8") for d in m.dtypes) for m in ops), ops
  want = jax.grad(loss, argnums=(0, 1))(*args)
  got = grad(*args)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-6)


class _SharedFp8(nnx.Module):
  """A layer called twice (the max of its calls' amaxes) and a head."""

  def __init__(self, rngs):
    self.shared = nnx.Linear(6, 6, rngs=rngs)
    self.out = nnx.Linear(6, 3, rngs=rngs)

  def __call__(self, x):
    return self.out(self.shared(jnp.tanh(self.shared(x)) * 4.0))


def test_fp8_nnx_layers_are_left_alone_and_take_the_max_over_calls():
  # The layers' FP8 state goes back to the model after the call (the
  # variable's value is an Fp8DotState, not an array).
  model = mp_nnx.wrap(_SharedFp8(nnx.Rngs(0)), "float32", fp8="delayed")
  x = jax.random.normal(jax.random.key(1), (4, 6)) * 3
  graphdef, state = nnx.split(model)

  def loss(state, x, cast):
    m = nnx.merge(graphdef, state)
    return jnp.sum((autocast(m, BF16)(x) if cast else m(x)) ** 2)

  ops = dtypes_of(jax.grad(functools.partial(loss, cast=True)), state, x)
  assert len(ops) == 9, ops  # 3 matmuls forward, 6 backward, all in FP8
  assert all(d.startswith("float8") for op in ops for d in op), ops
  got = jax.grad(loss)(state, x, True)
  want = jax.grad(loss)(state, x, False)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-6)
  # The shared layer's amaxes by NumPy: its kernel's and its first input's
  # (|x| reaches past the second input's 4), once, not summed over calls.
  (amax,) = got["shared"]["fp8_meta"].get_value().amax
  kernel = np.asarray(state["shared"]["kernel"].get_value())
  np.testing.assert_array_equal(
    amax[:2], [np.abs(x).max(), np.abs(kernel).max()]
  )
  out = autocast(model, BF16)(x)  # eager, the model itself as the function
  np.testing.assert_allclose(out, model(x), rtol=1e-6)


# -- the train step: float16 with a loss scale, ZeRO-1 ------------------------


def test_fp16_train_step_with_zero1_equals_a_hand_written_loop():
  data = _models.batches(5, poison_at=(2,))
  params = _models.init_params()
  loss = autocast(_models.loss, "p=f32,c=f16,o=f32")
  tx = _models.tx()

  # The reference: one device, plain jax.grad of the scaled loss.
  state = tx.init(params)
  ref_params, ref_losses = params, []
  step = jax.jit(
    lambda p, s, b: (lambda v_g: (*tx.update(v_g[1], s, p), v_g[0]))(
      jax.value_and_grad(
        lambda p: loss(p, b) * jmp_train.current_loss_scale(s)
      )(p)
    )
  )
  for batch in data:
    updates, state, value = step(ref_params, state, batch)
    ref_params = optax.apply_updates(ref_params, updates)
    ref_losses.append(float(value / jmp_train.current_loss_scale(state)))

  plan = zero1.make_plan(tx, params, _models.mesh())
  tstate = train.TrainState.create(params=params, tx=tx, plan=plan)
  tstep = train.make_train_step(
    lambda p, b, model_state, key: loss(p, b), tx, plan=plan
  )
  assert set(dtypes_of(tstep, tstate, data[0])) == {("float16", "float16")}
  finite = []
  for batch in data:
    tstate, metrics = tstep(tstate, batch)
    finite.append(bool(metrics["last_step_finite"]))
  assert finite == [True, True, False, True, True]
  got = zero1.to_logical(plan, tstate).params
  for g, w in zip(
    jax.tree.leaves(got), jax.tree.leaves(ref_params), strict=True
  ):
    np.testing.assert_allclose(g, w, rtol=2e-3, atol=2e-4)


# -- the lists --------------------------------------------------------------


def test_lists_are_changeable_and_validated():
  tanh = lambda x: jnp.tanh(x.astype(bf16))  # noqa: E731
  default = _all_operands(autocast(tanh, BF16), X)
  assert ("tanh", ("bfloat16",)) in default  # promote: its own dtype
  lists = AutocastLists().with_ops(float32={"tanh"})
  assert ("tanh", ("float32",)) in _all_operands(
    autocast(tanh, BF16, lists=lists), X
  )
  # Moving dot_general off the compute list keeps the matmul in float32.
  lists = AutocastLists().with_ops(as_written={"dot_general"})
  assert dtypes_of(autocast(lambda a: a @ W, BF16, lists=lists), X) == [
    ("float32", "float32")
  ]
  with pytest.raises(ValueError, match="'exp' is on both"):
    AutocastLists(compute={"exp", "dot_general"})
  with pytest.raises(
    ValueError, match=r"no loaded primitive is named \['tnah'\]"
  ):
    AutocastLists().with_ops(float32={"tnah"})
  with pytest.raises(ValueError, match="unknown list"):
    AutocastLists().with_ops(half={"exp"})
  with pytest.raises(TypeError, match="set of primitive names"):
    AutocastLists(float32="exp")
  with pytest.raises(TypeError, match=r"float32 must be a set .*\{'tanh'\}"):
    AutocastLists().with_ops(float32="tanh")  # not four one-letter names
  with pytest.raises(ValueError, match="'scan' is evaluated structurally"):
    AutocastLists().with_ops(float32={"scan"})
  scatter = AutocastLists().with_ops(float32={"scatter-add"})
  with pytest.raises(ValueError, match="'scatter-add' is on the float32"):
    autocast(lambda x: x.at[0].add(x[1]), BF16, lists=scatter)(X)
  # scan on as_written: the whole loop as traced, its matmul in float32.
  whole = AutocastLists().with_ops(as_written={"scan"})
  loop = lambda x: lax.scan(lambda c, xi: (c @ W, None), x[0], x)[0]  # noqa: E731
  assert dtypes_of(autocast(loop, BF16, lists=whole), X) == [
    ("float32", "float32")
  ]
  with pytest.raises(ValueError, match="compute dtype float64"):
    autocast(tanh, "float64")
  with pytest.raises(TypeError, match="AutocastLists"):
    autocast(tanh, BF16, lists={"exp"})
