"""The GPT model's losses: `cross_entropy` of the logits, with its backward
pass written out, and the fused loss (`fused_cross_entropy`): the
cross-entropy of the tied-embedding logits, a chunk of rows at a time."""

import contextlib
import functools
import io
import math
import os
import pathlib
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import equations
from jax.ad_checkpoint import print_saved_residuals

import jmp_train

sys.path.insert(
  0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks")
)

import gpt2  # noqa: E402
import gpt_model  # noqa: E402


def logits_reference(logits, targets):
  """Loss and its gradient with respect to the logits, float64 NumPy,
  written out (a negative target indexes from the end, as NumPy does)."""
  flat = logits.reshape(-1, logits.shape[-1])
  shifted = flat - flat.max(-1, keepdims=True)
  probs = np.exp(shifted) / np.exp(shifted).sum(-1, keepdims=True)
  rows = np.arange(len(flat))
  loss = -np.mean(np.log(probs[rows, targets.reshape(-1)]))
  d_logits = probs.copy()
  d_logits[rows, targets.reshape(-1)] -= 1
  return loss, (d_logits / len(flat)).reshape(logits.shape)


def reference(x, table, targets):
  """Loss and gradients of the loss of `x @ table.T`, float64 NumPy."""
  loss, d_logits = logits_reference(x @ table.T, targets)
  return loss, d_logits @ table, d_logits.T @ x


@pytest.mark.parametrize("chunk", [1, 8, 13, 37, 4096])
def test_fused_loss_and_gradients_equal_float64_numpy(chunk):
  rng = np.random.default_rng(chunk)
  x = rng.normal(size=(37, 16))  # 37 rows: chunks of 8 and 13 pad the last
  table = rng.normal(size=(50, 16))
  # Negative targets count from the end, as NumPy's indexing in `reference`.
  targets = rng.integers(-50, 50, 37)
  want = reference(x, table, targets)
  loss_fn = jax.jit(
    jax.value_and_grad(gpt_model.fused_cross_entropy, (0, 1)),
    static_argnums=3,
  )
  loss, (dx, d_table) = loss_fn(
    jnp.asarray(x, jnp.float32),
    jnp.asarray(table, jnp.float32),
    jnp.asarray(targets),
    chunk,
  )
  np.testing.assert_allclose(loss, want[0], rtol=1e-6)
  np.testing.assert_allclose(dx, want[1], rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(d_table, want[2], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_fused_loss_in_a_narrow_dtype_pulls_back_any_cotangent(dtype):
  """bf16/fp16 inputs: cotangents in the inputs' dtypes, equal to float64
  NumPy's at that dtype's precision, for a cotangent of 2 (not 1)."""
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(40, 16)), dtype)
  table = jnp.asarray(rng.normal(size=(30, 16)), dtype)
  targets = rng.integers(0, 30, 40)
  loss, pull_back = jax.vjp(
    lambda x, t: gpt_model.fused_cross_entropy(x, t, jnp.asarray(targets), 16),
    x,
    table,
  )
  dx, d_table = pull_back(jnp.asarray(2.0, loss.dtype))
  assert loss.dtype == jnp.float32
  assert dx.dtype == dtype and d_table.dtype == dtype
  want = reference(
    np.asarray(x, np.float64), np.asarray(table, np.float64), targets
  )
  np.testing.assert_allclose(loss, want[0], rtol=1e-5)
  for got, ref in ((dx, 2 * want[1]), (d_table, 2 * want[2])):
    got = np.asarray(got, np.float64)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-2


@pytest.mark.parametrize("one_pass", [True, False])
@pytest.mark.parametrize(
  "dtype, rtol",
  [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2), (jnp.float16, 2e-3)],
)
def test_cross_entropy_and_its_written_out_gradient_equal_float64_numpy(
  dtype, rtol, one_pass
):
  """(batch, seq, vocab) logits: the loss in float32, the logits' gradient
  in their dtype, for a cotangent of 3 (not 1), and large logits (the
  log-sum-exp must subtract the maximum); its log-sum-exp in one pass or
  in jax.nn.logsumexp's two."""
  rng = np.random.default_rng(2)
  logits = jnp.asarray(rng.normal(size=(3, 5, 40)) * 8 + 60, dtype)
  targets = rng.integers(0, 40, (3, 5))
  loss, pull_back = jax.vjp(
    lambda z: gpt_model.cross_entropy(
      z, jnp.asarray(targets), one_pass=one_pass
    ),
    logits,
  )
  (d_logits,) = pull_back(jnp.asarray(3.0, jnp.float32))
  assert loss.dtype == jnp.float32 and d_logits.dtype == dtype
  want, want_grad = logits_reference(np.asarray(logits, np.float64), targets)
  np.testing.assert_allclose(loss, want, rtol=1e-6)
  got = np.asarray(d_logits, np.float64)
  np.testing.assert_allclose(got, 3 * want_grad, rtol=rtol, atol=rtol / 600)


def test_one_pass_logsumexp_equals_float64_numpy_and_reads_once():
  """Rows of large, tiny and mixed-scale values, -inf entries, all -inf,
  +inf and NaN, and rows of GPT-2's 50304 (where one running sum over the
  row lost up to 110 ulps), against float64 NumPy's max-shifted
  log-sum-exp; jitted and eagerly; bfloat16 in, float32 out. Each value is
  read by one reduction, where jax.nn.logsumexp reads it in two."""
  rng = np.random.default_rng(5)
  scales = np.array([[1], [30], [1e-3], [1], [80], [1], [1], [1], [1]])
  x = rng.normal(size=(9, 300)) * scales
  x[0] += 1e4  # far from 0: the shift matters
  x[3, ::2] = -np.inf  # masked entries
  x[5] = -np.inf  # a row of nothing: -inf
  x[6, 7] = np.inf
  x[7, 11] = np.nan
  x[8] = 0.0  # all equal: log(300)
  vocab = rng.normal(size=(4, 50304)) * np.array([[1], [3], [10], [0]])

  def reference(x):
    with np.errstate(invalid="ignore", divide="ignore"):
      m = np.max(x.astype(np.float64), -1, keepdims=True)
      shift = np.where(np.isfinite(m), m, 0.0)
      return np.log(np.exp(x - shift).sum(-1)) + shift[:, 0]

  for rows in (x.astype(np.float32), vocab.astype(np.float32)):
    for f in (
      gpt_model.logsumexp_one_pass,
      jax.jit(gpt_model.logsumexp_one_pass),
    ):
      got = np.asarray(f(jnp.asarray(rows)), np.float64)
      np.testing.assert_allclose(got, reference(rows), rtol=3e-7, atol=0)
  got = gpt_model.logsumexp_one_pass(jnp.asarray(x, jnp.float32))
  assert got[5] == -np.inf and got[6] == np.inf and np.isnan(got[7])
  half = gpt_model.logsumexp_one_pass(jnp.zeros((2, 50304), jnp.bfloat16))
  assert half.dtype == jnp.float32
  np.testing.assert_allclose(half, np.log(50304), rtol=3e-7)

  def reductions_reading(f, shape):  # stablehlo.reduce ops with x as input
    text = jax.jit(f).lower(jnp.zeros((9, 300))).as_text()
    return sum(
      "stablehlo.reduce" in line and f"tensor<{shape}xf32>" in line
      for line in text.splitlines()
    )

  assert reductions_reading(gpt_model.logsumexp_one_pass, "9x4x75") == 1
  assert reductions_reading(gpt_model.logsumexp_one_pass, "9x300") == 0
  two_pass = functools.partial(jax.nn.logsumexp, axis=-1)
  assert reductions_reading(two_pass, "9x300") == 2
  # Cut in as many parts as asked: read as (rows, slices, part).
  twelve = functools.partial(gpt_model.logsumexp_one_pass, slices=12)
  assert reductions_reading(twelve, "9x12x25") == 1


@pytest.mark.parametrize("slices", [1, 12, 24, 96])
def test_one_pass_logsumexp_in_any_slices_equals_float64_numpy(slices):
  """Rows cut in `slices` parts give the log-sum-exp of float64 NumPy: rows
  of GPT-2's 50304 at three scales, and rows with -inf, +inf and NaN;
  jitted. One part (a running sum over a whole row on XLA:CPU) within
  the 110 float32 ulps its docstring reports, the others within 3e-7."""
  rng = np.random.default_rng(7)
  rows = rng.normal(size=(3, 50304)) * np.array([[1], [3], [10]])
  rows = rows.astype(np.float32)
  with np.errstate(invalid="ignore", divide="ignore"):
    m = rows.astype(np.float64).max(-1, keepdims=True)
    want = np.log(np.exp(rows - m).sum(-1)) + m[:, 0]
  rtol = 110 * 2.0**-23 if slices == 1 else 3e-7
  odd = np.zeros((3, 96), np.float32)
  odd[0, 5], odd[1, 70], odd[2] = -np.inf, np.inf, -np.inf
  odd[2, 95] = np.nan
  for f in (
    gpt_model.logsumexp_one_pass,
    jax.jit(gpt_model.logsumexp_one_pass, static_argnums=1),
  ):
    got = np.asarray(f(jnp.asarray(rows), slices), np.float64)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=0)
    got = np.asarray(f(jnp.asarray(odd), math.gcd(slices, 96)))
    np.testing.assert_allclose(got[0], np.log(95.0), rtol=3e-7)
    assert got[1] == np.inf and np.isnan(got[2])


def test_slices_that_do_not_cut_the_row_evenly_are_refused():
  """A count of parts that does not divide the row, is not a positive int,
  or comes with the two-pass log-sum-exp, is refused by name, with the
  divisors it could be; the one-pass loss in slices equals the default's."""
  x = jnp.zeros((2, 300), jnp.float32)
  for bad in (7, 0, -4, True, 2.0, "4", 600):
    with pytest.raises(
      ValueError, match=r"slices must be a positive Python int"
    ):
      gpt_model.logsumexp_one_pass(x, bad)
  with pytest.raises(ValueError, match=r"up to 128: 1, 2, 3, 4, 5, 6, 10,"):
    gpt_model.logsumexp_one_pass(x, 7)
  targets = jnp.zeros((2,), jnp.int32)
  with pytest.raises(ValueError, match="slices=4 with one_pass=False"):
    gpt_model.cross_entropy(x, targets, one_pass=False, slices=4)
  with pytest.raises(ValueError, match="slices must be a positive Python int"):
    gpt_model.cross_entropy(x, targets, slices=7)
  rng = np.random.default_rng(8)
  logits = jnp.asarray(rng.normal(size=(4, 300)) * 5, jnp.float32)
  targets = jnp.asarray(rng.integers(0, 300, 4))
  want = logits_reference(np.asarray(logits, np.float64), np.asarray(targets))
  for slices, part in ((None, 75), (1, 300), (30, 10), (300, 1)):
    loss = jax.jit(
      jax.value_and_grad(
        lambda z, n=slices: gpt_model.cross_entropy(z, targets, slices=n)
      )
    )
    value, grad = loss(logits)
    np.testing.assert_allclose(value, want[0], rtol=1e-6)
    np.testing.assert_allclose(grad, want[1], rtol=1e-5, atol=1e-8)
    # The loss's one reduction over the logits reads them in those parts
    # (the default: gcd(300, 128) = 4 parts of 75).
    shape = f"float32[4,{300 // part},{part}]"
    reads = [
      e
      for e in equations(loss, logits)
      if e.primitive.name == "reduce"
      and any(str(v.aval) == shape for v in e.invars)
    ]
    assert len(reads) == 1, (slices, shape)


def test_cross_entropy_counts_negative_targets_from_the_end_like_optax():
  """A negative target is the class that many from the end, in the loss
  and in its gradient alike (the gradient once missed it); a target outside
  the vocabulary gives a NaN loss; a wrong dtype or shape is refused."""
  rng = np.random.default_rng(3)
  logits = jnp.asarray(rng.normal(size=(4, 9)), jnp.float32)
  targets = np.array([-1, 3, -9, 8])
  loss, grad = jax.value_and_grad(gpt_model.cross_entropy)(logits, targets)
  want, want_grad = logits_reference(
    np.asarray(logits, np.float64), targets % 9
  )
  np.testing.assert_allclose(loss, want, rtol=1e-6)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-8)
  assert np.isnan(gpt_model.cross_entropy(logits, np.array([0, 9, 1, 2])))
  with pytest.raises(ValueError, match="targets must be integers, got"):
    gpt_model.cross_entropy(logits, np.zeros(4, np.float32))
  with pytest.raises(ValueError, match=r"without its last axis, \(4,\); got"):
    gpt_model.cross_entropy(logits, np.zeros((4, 1), np.int32))


def test_cross_entropy_gradient_is_one_pass_without_a_scatter():
  """The backward pass is written out: no scatter of the one-hot into a
  float32 softmax, as autodiff of optax's loss gives."""
  logits = jnp.zeros((64, 50), jnp.bfloat16)
  targets = jnp.zeros((64,), jnp.int32)
  grad = jax.jit(jax.grad(gpt_model.cross_entropy))
  assert "scatter" not in grad.lower(logits, targets).as_text()

  def optax_loss(z, t):
    return optax.softmax_cross_entropy_with_integer_labels(
      z.astype(jnp.float32), t
    ).mean()

  assert (
    "scatter" in jax.jit(jax.grad(optax_loss)).lower(logits, targets).as_text()
  )


def test_the_model_with_targets_gives_the_loss_of_its_logits():
  """float32: the same loss and gradients as cross_entropy of the logits;
  under bf16-mixed, close to it (the fused logits are not rounded to
  bfloat16), with the gradients in the params' dtype."""
  base = gpt_model.GPT(layers=1, d_model=16, heads=2, seq_len=16, tied=True)
  tokens = jnp.asarray(
    np.random.default_rng(0).integers(0, gpt_model.VOCAB, (4, 17))
  )
  params = jax.jit(base.init)(jax.random.key(0), tokens[:, :-1])["params"]

  def losses(model):
    def logits_loss(p):
      logits = model.apply({"params": p}, tokens[:, :-1])
      return gpt_model.cross_entropy(logits, tokens[:, 1:])

    def fused_loss(p):  # chunks of 24 rows: the 64 rows pad the last
      return model.apply({"params": p}, tokens[:, :-1], tokens[:, 1:], 24)

    both = jax.jit(  # one compile for the two
      lambda p: [jax.value_and_grad(f)(p) for f in (logits_loss, fused_loss)]
    )
    return both(params)

  (want, want_grads), (got, got_grads) = losses(base)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
    got_grads,
    want_grads,
  )
  policy = jmp_train.get_policy(
    "params=float32,compute=bfloat16,output=float32"
  )
  (want, want_grads), (got, got_grads) = losses(
    jmp_train.linen.wrap(base, policy)
  )
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, want, rtol=1e-2)

  def relative(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b)

  for a, b in zip(
    jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True
  ):
    assert a.dtype == jnp.float32
    assert relative(np.asarray(a), np.asarray(b)) < 0.05


def test_the_fused_loss_refuses_what_it_cannot_do(capsys):
  x = jnp.ones((4, 8))
  for bad in (0, 2.0, None):
    with pytest.raises(ValueError, match=f"positive int, got {bad!r}"):
      gpt_model.fused_cross_entropy(x, jnp.ones((5, 8)), jnp.zeros(4, int), bad)
  with pytest.raises(ValueError, match="targets must be integers, got"):
    gpt_model.fused_cross_entropy(x, jnp.ones((5, 8)), jnp.zeros(4), 2)
  # The fused loss's float32 logits would be autocast: refused.
  with pytest.raises(SystemExit):  # refused by its argument checks
    gpt2.parse_args(["--tiny", "--loss", "fused"])
  assert "--loss fused runs without autocast" in capsys.readouterr().err
  untied = gpt_model.GPT(layers=1, d_model=8, heads=2, seq_len=4)
  tokens = jnp.zeros((1, 4), jnp.int32)
  params = jax.jit(untied.init)(jax.random.key(0), tokens)
  with pytest.raises(ValueError, match="tied=False"):
    untied.apply(params, tokens, tokens)


def test_gpt2_benchmark_runs_with_the_fused_loss(monkeypatch):
  # --xla-flags adds to XLA_FLAGS (restored after the test; this process's
  # backend has started, so only the record is checked here).
  flag = "--xla_force_host_platform_device_count=8"
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
  result = gpt2.main(
    [
      *("--tiny", "--presets", "bf16-mixed", "--batch", "2", "--rounds", "1"),
      *("--steps-per-round", "1", "--warmup", "1", "--no-plain"),
      *("--loss", "fused", "--loss-chunk", "48", "--autocast", ""),
      f"--xla-flags={flag}",
    ]
  )
  assert result["xla_flags"].endswith(flag)
  assert result["loss"] == "fused, chunks of 48 rows"
  assert [r["step"] for r in result["rows"]] == ["hand-bf16", "bf16-mixed"]
  label = f"fused, chunks of 48 rows; XLA_FLAGS {result['xla_flags']}"
  row = f"| bf16-mixed | 2 | 1 | {label} |"  # batch, steps per wait, loss
  assert row in gpt2.table({"gpt2-fused": result})


def test_a_float32_wrap_traces_to_the_bare_models_program():
  # benchmarks/page.md ("Compile time") says the loss's gradient traces to
  # the same program, wrapped in float32 or not.
  base = gpt_model.GPT(layers=2, d_model=32, heads=4, seq_len=16)
  wrapped = jmp_train.linen.wrap(base, jmp_train.get_preset("fp32").policy)
  tokens = jnp.zeros((2, 17), jnp.int32)

  def grad_jaxpr(model):
    params = jax.eval_shape(
      lambda: model.init(jax.random.key(0), tokens[:, :-1])["params"]
    )

    def loss(p):
      logits = model.apply({"params": p}, tokens[:, :-1])
      return gpt_model.cross_entropy(logits, tokens[:, 1:])

    return str(jax.make_jaxpr(jax.grad(loss))(params))

  bare = grad_jaxpr(base)
  assert "dot_general" in bare
  assert grad_jaxpr(wrapped) == bare
  # ... where bf16-mixed's is not (the check can tell programs apart).
  mixed = jmp_train.linen.wrap(base, jmp_train.get_preset("bf16-mixed").policy)
  assert grad_jaxpr(mixed) != bare


def test_platform_gpu_asks_for_cudnn_attention_where_it_applies():
  # benchmarks/gpt2.py --kernels --target h100 compiles on a CPU for a GPU:
  # GPT(platform="gpu") takes the cuDNN attention the GPU run takes (JAX's
  # default backend would say cpu, and give XLA's T x T scores instead).
  tokens = jnp.zeros((1, 8), jnp.int32)
  bf16 = jmp_train.get_preset("bf16-mixed").policy

  def jaxpr(platform, policy=None):
    model = gpt_model.GPT(
      layers=1,
      d_model=16,
      heads=2,
      seq_len=8,
      fused_attention=True,
      platform=platform,
    )
    if policy is not None:
      model = jmp_train.linen.wrap(model, policy)
    params = jax.eval_shape(model.init, jax.random.key(0), tokens)
    return str(jax.make_jaxpr(model.apply)(params, tokens))

  # On this CPU backend None means cpu: XLA's attention, as "cpu" says.
  assert jaxpr(None, bf16) == jaxpr("cpu", bf16)
  assert "dot_product_attention_fwd" not in jaxpr(None, bf16)
  # float32 has no cuDNN kernel: XLA's attention for "gpu" too.
  assert jaxpr("gpu") == jaxpr(None)
  try:
    program = jaxpr("gpu", bf16)
  except RuntimeError as e:  # no CUDA plugin here: JAX's cuDNN check says so
    assert "cuDNN" in str(e)
  else:  # with JAX's CUDA plugin installed, compiling for a GPU works
    assert "dot_product_attention_fwd" in program
  # Refused when the model is built, before any param is made.
  with pytest.raises(ValueError, match="one of .*'gpu'.*, got 'cuda'"):
    gpt_model.GPT(layers=1, d_model=16, heads=2, seq_len=8, platform="cuda")
  with pytest.raises(ValueError, match="needs fused_attention=True"):
    gpt_model.GPT(layers=1, d_model=16, heads=2, seq_len=8, platform="gpu")


class PlainBlock(gpt_model.Block):
  """GPT's block as GPT-2 writes it: autodiff keeps what it likes."""

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    attn = gpt_model.CausalSelfAttention(self.heads, name="attn")
    x = x + attn(nn.LayerNorm()(x))
    h = nn.gelu(nn.Dense(4 * d, name="fc")(nn.LayerNorm()(x)))
    return x + nn.Dense(d, name="out")(h)


@pytest.mark.parametrize("gelu", ["tanh", "epilogue"])
@pytest.mark.parametrize("fp8_recipe", [None, "current", "blockwise"])
def test_the_mlp_keeps_two_wide_arrays_a_layer(monkeypatch, fp8_recipe, gelu):
  """Per layer the backward pass reads at most two (batch, seq, 4 d_model)
  arrays from the forward pass, none in float32 under bf16-mixed: fc's
  matmul output ("tanh", whose remat recomputes the bias add and the GELU;
  "epilogue" keeps the output with the bias added) and the GELU's (the next
  matmul's input, or under FP8 its bytes), where autodiff of GPT-2's block
  keeps more. Under FP8 the dot's float32 product is not kept, nor under
  blockwise scaling each K-block's. Loss and gradients are the plain
  block's; with "epilogue" under the policy without FP8, its gradients are
  as near the plain block's in float32 as the plain block's under the
  policy are (under FP8, FP8's rounding would hide the GELU's)."""
  d, layers = 16, 2
  base = gpt_model.GPT(layers=layers, d_model=d, heads=2, seq_len=8, gelu=gelu)
  tokens = jnp.asarray(
    np.random.default_rng(0).integers(0, gpt_model.VOCAB, (2, 9)), jnp.int32
  )
  wide = f"[2,8,{4 * d}]"
  bf16 = jmp_train.get_preset("bf16-mixed").policy
  models = {"bf16": jmp_train.linen.wrap(base, bf16, fp8=fp8_recipe)}
  if fp8_recipe is None:
    models["f32"] = base
  variables = {
    k: jax.jit(m.init)(jax.random.key(0), tokens[:, :-1])
    for k, m in models.items()
  }

  def loss(model):
    def f(params, rest):
      logits = model.apply({"params": params, **rest}, tokens[:, :-1])
      return gpt_model.cross_entropy(logits, tokens[:, 1:])

    return f

  def split(name):  # params, and the FP8 metadata where there is some
    rest = dict(variables[name])
    return rest.pop("params"), rest

  def saved(name):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      print_saved_residuals(loss(models[name]), *split(name))
    return out.getvalue().splitlines()

  def value_and_grads(name):
    f = jax.value_and_grad(loss(models[name]), (0, 1))
    return jax.jit(f)(*split(name))

  for name in models:
    kept = [x for x in saved(name) if wide in x]
    assert 0 < len(kept) <= 2 * layers, kept
    dtypes = ("f32",) if name == "f32" else ("bf16", "u8")  # u8: FP8 bytes
    assert all(x.split("[")[0] in dtypes for x in kept), kept
  if fp8_recipe is None:
    # Under the policy fc's kernel is cast once, its bfloat16 copy kept.
    casts = [x for x in saved("bf16") if "convert_element_type" in x]
    assert sum(x.startswith(f"bf16[{d},{4 * d}]") for x in casts) == layers
  else:
    f32_dots = [x for x in saved("bf16") if x.startswith("f32[")]
    assert not [x for x in f32_dots if "dot_general" in x], f32_dots

  want = {name: value_and_grads(name) for name in models}
  monkeypatch.setattr(gpt_model, "Block", PlainBlock)
  for name in models:
    assert len([x for x in saved(name) if wide in x]) > 2 * layers
  exact = {name: value_and_grads(name) for name in models}
  for name in want:
    (value, grads), (ref_value, ref_grads) = want[name], exact[name]
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    if gelu == "epilogue" and name != "f32":
      # Its GELU's derivative is computed in float32, autodiff's of GPT-2's
      # block in bfloat16: other roundings, as near GPT-2's block's in
      # float32 (exact["f32"]).
      if fp8_recipe is not None:
        continue

      def dist(grads):  # from the float32 plain block's params' gradients
        pairs = zip(
          jax.tree.leaves(grads[0]),
          jax.tree.leaves(exact["f32"][1][0]),
          strict=True,
        )
        return sum(float(jnp.sum((a - b) ** 2)) for a, b in pairs) ** 0.5

      assert 0 < dist(grads) <= 1.25 * dist(ref_grads), name
      continue
    pairs = zip(jax.tree.leaves(ref_grads), jax.tree.leaves(grads), strict=True)
    for g, w in pairs:
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)


def test_gelu_through_the_logistic_is_gpt2s_gelu():
  # gelu_logistic against GELU's tanh form written out in float64 NumPy,
  # over the range a GPT's activations take and beyond, and its gradient
  # against its derivative written out there too (autodiff's, as nn.gelu's
  # is within 3.5e-6 of it).
  x = np.linspace(-12, 12, 4001)
  c, t = np.sqrt(2 / np.pi), np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3))
  want = 0.5 * x * (1 + t)
  got = np.asarray(gpt_model.gelu_logistic(jnp.asarray(x, jnp.float32)))
  np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-7)
  want = 0.5 * (1 + t) + 0.5 * x * (1 - t**2) * c * (1 + 3 * 0.044715 * x**2)
  xs = jnp.asarray(x, jnp.float32)
  grad = jax.vmap(jax.grad(gpt_model.gelu_logistic))(xs)
  np.testing.assert_allclose(grad, want, rtol=0, atol=5e-6)
  # The model with either computes the same logits to float32's rounding,
  # from the same params; an unknown form is refused by name.
  kwargs = dict(layers=1, d_model=16, heads=2, seq_len=8)
  tokens = jnp.arange(8)[None] % gpt_model.VOCAB
  params = gpt_model.GPT(**kwargs).init(jax.random.key(0), tokens)
  tanh_logits = gpt_model.GPT(**kwargs).apply(params, tokens)
  model = gpt_model.GPT(**kwargs, gelu="logistic")
  logistic_logits = model.apply(params, tokens)
  np.testing.assert_allclose(logistic_logits, tanh_logits, rtol=1e-5, atol=1e-5)
  jaxpr = str(jax.make_jaxpr(model.apply)(params, tokens))
  assert "logistic" in jaxpr and "tanh" not in jaxpr
  with pytest.raises(ValueError, match=r"gelu must be one of .*got 'erf'"):
    gpt_model.GPT(**kwargs, gelu="erf")


def test_gelu_epilogue_is_nn_gelu_with_a_backward_pass_of_its_own():
  # Its forward pass is nn.gelu's, bit for bit; its gradient is GELU's tanh
  # form's derivative written out in float64 NumPy at the input's values,
  # computed in float32 from 16-bit inputs too: within float32's error, and
  # in 16-bit floats within one rounding of a result up to 1.13 (bfloat16's
  # 2**-8 = 3.9e-3, float16's 2**-11 = 4.9e-4), where autodiff in 16-bit
  # floats is off by 1.6e-2 (bfloat16) and 2.8e-3 (float16).
  def derivative(x):
    c = np.sqrt(2 / np.pi)
    t = np.tanh(c * (x + 0.044715 * x**3))
    return 0.5 * (1 + t) + 0.5 * x * (1 - t**2) * c * (1 + 3 * 0.044715 * x**2)

  x = np.linspace(-12, 12, 4001)
  for dtype, atol in (
    (jnp.float32, 5e-6),
    (jnp.bfloat16, 8e-3),
    (jnp.float16, 1e-3),
  ):
    xs = jnp.asarray(x, dtype)
    np.testing.assert_array_equal(
      gpt_model.gelu_epilogue(xs), nn.gelu(xs), strict=True
    )
    grad = jax.vmap(jax.grad(gpt_model.gelu_epilogue))(xs)
    assert grad.dtype == dtype
    want = derivative(np.asarray(xs, np.float64))
    np.testing.assert_allclose(np.asarray(grad, np.float64), want, atol=atol)
  # In the model's gradient the forward pass's tanh is its only one (one a
  # layer): the backward pass shares none of it, so XLA:GPU can compute it
  # in fc's GEMM epilogue (the GELU's steps each used once); "tanh" computes
  # it again under its remat.
  kwargs = dict(layers=2, d_model=16, heads=2, seq_len=8)
  tokens = jnp.arange(9)[None] % gpt_model.VOCAB
  params = gpt_model.GPT(**kwargs).init(jax.random.key(0), tokens[:, :-1])

  def counts(gelu):  # tanh and logistic in the model's gradient
    model = gpt_model.GPT(**kwargs, gelu=gelu)

    def loss(p):
      logits = model.apply(p, tokens[:, :-1])
      return gpt_model.cross_entropy(logits, tokens[:, 1:])

    found = [e.primitive for e in equations(jax.grad(loss), params)]
    return found.count(jax.lax.tanh_p), found.count(jax.lax.logistic_p)

  assert counts("epilogue") == (2, 2)
  assert counts("tanh") == (4, 0)


@pytest.mark.parametrize("fused_attention", [False, True])
@pytest.mark.parametrize("qkv", ["dense", "split"])
def test_each_qkv_layout_is_the_packed_models_function(qkv, fused_attention):
  # The packed model (GPT-2's one DenseGeneral) is the reference: with its
  # params mapped by qkv_params, each layout gives its loss, and gradients
  # that qkv_params maps the packed ones onto (the map is a reshape and
  # slices, so linear). The params are perturbed, so the biases are not
  # zero and a bias in the wrong place changes the loss. Two blocks, with
  # XLA's attention and with jax.nn.dot_product_attention's.
  kwargs = dict(layers=2, d_model=32, heads=4, seq_len=16)
  kwargs["fused_attention"] = fused_attention
  tokens = jnp.asarray(
    np.random.default_rng(0).integers(0, gpt_model.VOCAB, (2, 17)), jnp.int32
  )
  packed = gpt_model.GPT(**kwargs)
  model = gpt_model.GPT(**kwargs, qkv=qkv)
  params = packed.init(jax.random.key(0), tokens[:, :-1])["params"]
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  params = jax.tree.unflatten(
    tree,
    [
      x + 0.05 * jax.random.normal(k, x.shape)
      for x, k in zip(leaves, keys, strict=True)
    ],
  )
  mapped = gpt_model.qkv_params(params, qkv)
  made = model.init(jax.random.key(0), tokens[:, :-1])["params"]
  assert jax.tree.map(jnp.shape, mapped) == jax.tree.map(jnp.shape, made)
  names = set(mapped["block1"]["attn"])
  assert names == (
    {"q", "k", "v", "proj"} if qkv == "split" else {"qkv", "proj"}
  )

  def loss(m, p):
    logits = m.apply({"params": p}, tokens[:, :-1])
    return gpt_model.cross_entropy(logits, tokens[:, 1:])

  want, want_grads = jax.value_and_grad(functools.partial(loss, packed))(params)
  got, grads = jax.value_and_grad(functools.partial(loss, model))(mapped)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  want_grads = gpt_model.qkv_params(want_grads, qkv)
  for path, g in jax.tree_util.tree_leaves_with_path(grads):
    w = functools.reduce(lambda t, k: t[k.key], path, want_grads)
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7, err_msg=str(path))
  # Under bf16-mixed each of the layout's projections is a matmul of
  # bfloat16 operands in the forward pass, as every other matmul is: q, k,
  # v and the output projection, (32, 32) kernels, or the (32, 96) one.
  mixed = jmp_train.linen.wrap(model, jmp_train.get_preset("bf16-mixed").policy)

  found = [
    e
    for e in equations(functools.partial(loss, mixed), mapped)
    if e.primitive.name == "dot_general"
  ]
  assert all(v.aval.dtype == jnp.bfloat16 for e in found for v in e.invars)
  kernels = [e.invars[1].aval.shape for e in found]
  if qkv == "split":
    assert kernels.count((32, 32)) == 2 * 4
  else:
    assert kernels.count((32, 96)) == 2 and kernels.count((32, 32)) == 2


def test_qkv_layouts_are_refused_by_name():
  kwargs = dict(layers=1, d_model=16, heads=2, seq_len=8)
  with pytest.raises(ValueError, match=r"qkv must be one of .*got 'fused'"):
    gpt_model.GPT(**kwargs, qkv="fused")
  tokens = jnp.zeros((1, 8), jnp.int32)
  variables = gpt_model.GPT(**kwargs).init(jax.random.key(0), tokens)
  params = variables["params"]
  with pytest.raises(ValueError, match=r"qkv must be one of .*got 'fused'"):
    gpt_model.qkv_params(params, "fused")
  with pytest.raises(ValueError, match=r"no block .*keys are \['params'\]"):
    gpt_model.qkv_params(variables, "dense")
  split = gpt_model.qkv_params(params, "split")
  with pytest.raises(ValueError, match=r"it has \['k', 'proj', 'q', 'v'\]"):
    gpt_model.qkv_params(split, "dense")
  dense = gpt_model.qkv_params(params, "dense")
  with pytest.raises(ValueError, match=r"kernel of shape \(16, 48\)"):
    gpt_model.qkv_params(dense, "split")
