"""The GPT model every example, benchmark and test imports: GPT-2's layout.

A pre-norm transformer with causal self-attention whose softmax runs in
float32 whatever the compute dtype; the loss is computed in float32. Written
as Flax users write models (plain `nn.Dense`/`nn.LayerNorm`/`nn.Embed`), so
`jmp_train.linen.wrap` applies a policy to it from outside.

`CONFIGS` holds GPT-2's sizes as `GPT` fields (`GPT(**CONFIGS["gpt2-small"])`,
tied embeddings as in GPT-2) and a tiny one for tests; `init_shapes` gives the
params' shapes without allocating them.
"""

import functools
import math
import operator

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jmp_train import fp8

VOCAB = 128  # ASCII

_GPT2 = dict(vocab=50257, seq_len=1024, tied=True)
CONFIGS = {
  "gpt2-small": dict(layers=12, d_model=768, heads=12, **_GPT2),
  "gpt2-medium": dict(layers=24, d_model=1024, heads=16, **_GPT2),
  # Every dimension divides 8, so ZeRO-1 on up to 8 devices pads nothing.
  "tiny-gpt": dict(layers=2, d_model=64, heads=4, vocab=96, seq_len=64),
}


# What `GPT(platform=...)` takes: JAX's backend names.
PLATFORMS = ("cpu", "gpu", "tpu")
# What `GPT(gelu=...)` takes: three ways to compute GPT-2's GELU, its tanh
# approximation, the same function each (their gradients round differently
# in 16-bit floats):
# - "tanh": `nn.gelu`, the MLP under a remat that keeps fc's matmul output
#   (`_fc_gelu`);
# - "logistic": `gelu_logistic`, under the same remat;
# - "epilogue": `gelu_epilogue`, no remat. Where fc's matmul goes to cuBLAS
#   (`--xla_gpu_enable_triton_gemm=false`), XLA:GPU computes its bias add
#   and the GELU in cuBLASLt's GEMM epilogue. Elsewhere it is `nn.gelu`
#   with a backward pass of its own, saving as much as "tanh". Meant for
#   `jmp_train.linen.wrap`'s policies: under `jmp_train.autocast` the bias
#   add runs in float32, and the GELU's input it keeps is float32 too.
GELUS = ("tanh", "logistic", "epilogue")
# What `GPT(qkv=...)` takes, three layouts of the attention's q, k and v
# projections, the same function of the same numbers (`qkv_params` maps
# the params from "packed" to the others):
# - "packed": one `DenseGeneral` to (3, heads, head_dim), named "qkv";
# - "dense": one `Dense` to 3 d_model, named "qkv", its bias a vector,
#   which XLA:GPU adds in cuBLASLt's epilogue (the packed projection's
#   bias, of rank 3, it writes out whole for the GEMM to add);
# - "split": three `Dense`s to d_model, named "q", "k" and "v", each output
#   written whole where the attention reads it, so long as XLA keeps the
#   three matmuls apart: its dot merger merges them back into one and
#   slices its output, unless `--xla_gpu_dot_merger_threshold_mb=0`.
QKVS = ("packed", "dense", "split")


def check_platform(platform: str | None, fused: bool) -> None:
  """Refuses a `platform` that is no backend name, or one given where no
  fused attention would read it."""
  if platform not in (None, *PLATFORMS):
    raise ValueError(
      f"platform must be None or one of {PLATFORMS}, got {platform!r}"
    )
  if platform is not None and not fused:
    raise ValueError(
      f"platform={platform!r} picks the fused attention's kernels: it needs"
      " fused_attention=True"
    )


def check_gelu(gelu: str) -> None:
  """Refuses a `gelu` that is not one of `GELUS`."""
  if gelu not in GELUS:
    raise ValueError(f"gelu must be one of {GELUS}, got {gelu!r}")


def check_qkv(qkv: str) -> None:
  """Refuses a `qkv` that is not one of `QKVS`."""
  if qkv not in QKVS:
    raise ValueError(f"qkv must be one of {QKVS}, got {qkv!r}")


def gelu_logistic(x):
  """`nn.gelu(x)` (GELU's tanh approximation, GPT-2's) through the logistic
  function: `0.5 * (1 + tanh(u)) == sigmoid(2 * u)`, so `x * sigmoid(2 *
  sqrt(2 / pi) * (x + 0.044715 * x**3))`. The same function in fewer
  instructions where XLA:GPU compiles it: an exponential and a reciprocal,
  which it emits as approximate instructions, where its tanh is a rational
  function with a division (BENCHMARKS.md's GPT-2 section counts them)."""
  two_u = 1.5957691216057308 * (x + 0.044715 * x * x * x)
  return x * jax.nn.sigmoid(two_u)


@jax.custom_vjp
def gelu_epilogue(x):
  """`nn.gelu(x)`, whose backward pass differentiates `gelu_logistic` (the
  same function, through the logistic: no tanh) from `x` alone, in float32
  or wider.

  After a `Dense` whose matmul goes to cuBLAS, XLA:GPU's GEMM rewriter then
  computes the bias add and the GELU in cuBLASLt's epilogue
  (`BIAS_GELU_AUX`: the GEMM writes `x` beside the GELU for the backward
  pass), where "tanh" writes the matmul's output and a kernel of its own
  reads it to write the GELU. The rewriter matches only `nn.gelu`'s form,
  with each of its steps used once: differentiating `nn.gelu` itself would
  share its tanh with the forward pass, and a tanh with two users is left
  out of the epilogue. In 16-bit floats its gradient rounds differently
  from autodiff's of `nn.gelu` (once, not at each step). Forward-mode
  autodiff (`jax.jvp`, `jax.jacfwd`) is not defined for it: a `custom_vjp`.
  """
  return nn.gelu(x)


def _gelu_epilogue_fwd(x):
  return nn.gelu(x), x


def _gelu_epilogue_bwd(x, g):
  # Computed in float32 (or x's wider float) inside the one fused kernel;
  # x, g and the result stay 16-bit in memory.
  wide = jnp.promote_types(x.dtype, jnp.float32)
  (dx,) = jax.vjp(gelu_logistic, x.astype(wide))[1](g.astype(wide))
  return (dx.astype(x.dtype),)


gelu_epilogue.defvjp(_gelu_epilogue_fwd, _gelu_epilogue_bwd)


class CausalSelfAttention(nn.Module):
  heads: int
  fused: bool = False  # jax.nn.dot_product_attention (cuDNN flash on GPU)
  # The platform compiled for (None: JAX's default backend). "gpu" where a
  # step is compiled for a GPU on a machine without one (benchmarks/
  # deviceless.py), so it gets the cuDNN attention the GPU would run.
  platform: str | None = None
  # The q, k and v projections' layout, one of QKVS.
  qkv: str = "packed"

  def __post_init__(self):
    check_platform(self.platform, self.fused)
    check_qkv(self.qkv)
    super().__post_init__()

  @nn.compact
  def __call__(self, x):
    batch, seq, d = x.shape
    head_dim = d // self.heads
    if self.qkv == "split":
      q, k, v = (
        nn.Dense(d, name=name)(x).reshape(batch, seq, self.heads, head_dim)
        for name in ("q", "k", "v")
      )
    else:
      if self.qkv == "dense":
        qkv = nn.Dense(3 * d, name="qkv")(x)
        qkv = qkv.reshape(batch, seq, 3, self.heads, head_dim)
      else:
        qkv = nn.DenseGeneral((3, self.heads, head_dim), name="qkv")(x)
      q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    if self.fused:  # the kernels keep softmax statistics in float32
      # cuDNN flash attention takes bf16/fp16 on GPUs; JAX's default (None)
      # is its XLA implementation, which materializes the T x T scores.
      platform = self.platform or jax.default_backend()
      cudnn = platform == "gpu" and q.dtype in (
        jnp.bfloat16,
        jnp.float16,
      )
      y = jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn" if cudnn else None
      )
      return nn.Dense(d, name="proj")(y.reshape(batch, seq, d))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(head_dim)
    causal = jnp.tril(jnp.ones((seq, seq), jnp.bool_))
    # Softmax in float32, whatever the compute dtype (the ANCHORS trap).
    logits = jnp.where(causal, logits.astype(jnp.float32), -1e30)
    weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    y = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, seq, d)
    return nn.Dense(d, name="proj")(y)


class Block(nn.Module):
  heads: int
  fused: bool = False
  platform: str | None = None
  gelu: str = "tanh"  # one of GELUS
  qkv: str = "packed"  # one of QKVS

  def __post_init__(self):
    check_gelu(self.gelu)
    check_qkv(self.qkv)
    super().__post_init__()

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    attn = CausalSelfAttention(
      self.heads, self.fused, self.platform, self.qkv, name="attn"
    )
    x = x + attn(nn.LayerNorm()(x))
    if self.gelu == "epilogue":  # no remat: the GEMM keeps the GELU's input
      h = gelu_epilogue(nn.Dense(4 * d, name="fc")(nn.LayerNorm()(x)))
    else:
      h = _fc_gelu(self, nn.LayerNorm()(x))
    return x + nn.Dense(d, name="out")(h)


def _saved_by_fc_gelu(prim, *avals, **params) -> bool:
  """What the backward pass of `_fc_gelu` reads from its forward pass: the
  matmul's output (a plain matmul's, or under `jmp_train`'s FP8 the
  matmul's output and its FP8 operands, by their checkpoint names), and
  casts to 16-bit floats of arrays of rank 2 or less (in this function, a
  precision policy's casts of the kernel and bias, so not cast again). The
  bias add and the GELU are recomputed from the matmul's output.

  Not the dots of FP8 operands: `dots_saveable` would keep their float32
  product (and under blockwise scaling every K-block's partial product).
  Not casts to FP8 either: `jax.checkpoint` passes a saved float through
  `lax.reduce_precision`, which turns E4M3 values of 256 or more into NaN.
  """
  if prim is jax.lax.dot_general_p:
    return not any(a.dtype.itemsize == 1 for a in avals)
  if prim is jax.lax.convert_element_type_p:
    return avals[0].ndim <= 2 and jnp.dtype(params["new_dtype"]).itemsize == 2
  return _SAVED_FP8(prim, *avals, **params)


_SAVED_FP8 = jax.checkpoint_policies.save_only_these_names(*fp8.REMAT_NAMES)


@functools.partial(nn.remat, policy=_saved_by_fc_gelu)
def _fc_gelu(block: nn.Module, x):
  """`gelu(Dense(4 d_model, name="fc")(x))` inside `block` (its GELU as
  `block.gelu` says), whose backward pass recomputes the bias add and the
  GELU from the matmul's output.

  Without the remat, XLA writes and reads back the GELU's tanh (or its
  input) per layer: GPT-2 small's step at batch 16, compiled for an H100,
  moved 2.4 GB more that way (`benchmarks/gpt2.py --kernels --target
  h100`). The params keep their names (`block{i}/fc/kernel`, `.../bias`).
  """
  gelu = gelu_logistic if block.gelu == "logistic" else nn.gelu
  return gelu(nn.Dense(4 * x.shape[-1], name="fc")(x))


class GPT(nn.Module):
  """GPT-2's layout; `tied=True` reads logits off the token embedding."""

  layers: int
  d_model: int
  heads: int
  seq_len: int
  vocab: int = VOCAB
  tied: bool = False
  fused_attention: bool = False
  # With fused_attention, the platform compiled for (None: JAX's default
  # backend): "gpu" takes cuDNN's attention for bf16 and fp16.
  platform: str | None = None
  # How the MLP computes its GELU (GELUS): "tanh" as `nn.gelu`, "logistic"
  # the same function as `gelu_logistic` computes it, "epilogue" as
  # `gelu_epilogue` (where XLA:GPU can put it in fc's GEMM; its gradient
  # rounds differently in 16-bit floats).
  gelu: str = "tanh"
  # The layout of the attention's q, k and v projections, one of QKVS
  # ("packed" as GPT-2's; `qkv_params` maps the params to the others).
  qkv: str = "packed"

  def __post_init__(self):
    check_platform(self.platform, self.fused_attention)
    check_gelu(self.gelu)
    check_qkv(self.qkv)
    super().__post_init__()

  @nn.compact
  def __call__(self, tokens, targets=None, loss_chunk=4096):
    """The logits of `tokens`; with `targets`, the mean cross-entropy of
    those next tokens instead, by `fused_cross_entropy` (`loss_chunk` rows
    of float32 logits at a time; tied embeddings only)."""
    if targets is not None and not self.tied:
      raise ValueError(
        "GPT(targets=...) computes the loss off the tied embedding; got"
        " tied=False (call without targets and use cross_entropy)"
      )
    embed = nn.Embed(self.vocab, self.d_model, name="embed")
    pos = self.param(
      "pos", nn.initializers.normal(0.02), (self.seq_len, self.d_model)
    )
    x = embed(tokens) + pos[: tokens.shape[1]]
    for i in range(self.layers):
      x = Block(
        self.heads,
        self.fused_attention,
        self.platform,
        self.gelu,
        self.qkv,
        name=f"block{i}",
      )(x)
    x = nn.LayerNorm(name="ln_f")(x)
    if targets is not None:  # the dtypes embed.attend would give
      x, table = embed.promote_dtype(x, embed.embedding, dtype=embed.dtype)
      rows = x.reshape(-1, x.shape[-1])
      return fused_cross_entropy(rows, table, targets.reshape(-1), loss_chunk)
    if self.tied:
      return embed.attend(x)
    return nn.Dense(self.vocab, name="head")(x)


def cross_entropy(
  logits, targets, *, one_pass: bool = True, slices: int | None = None
):
  """The mean cross-entropy of `logits` (..., vocab) at integer `targets`
  (...), computed in float32 whatever the logits' dtype.

  `optax.softmax_cross_entropy_with_integer_labels` of the float32 logits,
  with a backward pass written out: `(softmax(logits) - one_hot(targets)) /
  rows`, in float32 and rounded once to the logits' dtype, in one pass over
  the logits. Autodiff of optax's loss writes the float32 softmax, scatters
  the one-hot into it and casts the result: GPT-2 small's loss layer at batch
  16 x 1024, compiled for an H100, moved 26.7 GB that way and 13.5 GB this
  way with a two-pass log-sum-exp, 11.9 GB with the one-pass one
  (`benchmarks/loss_head.py --target h100`).

  Each row's log-sum-exp is read in one pass over the logits (`one_pass`,
  `logsumexp_one_pass`, its rows cut in `slices`); `one_pass=False` takes
  `jax.nn.logsumexp`'s two, its max then its sum of exponentials.

  A negative target counts from the end of the vocabulary, as in optax (and
  NumPy indexing); one outside [-vocab, vocab) gives a NaN loss. Forward-mode
  autodiff (`jax.jvp`, `jax.jacfwd`) is not defined for it: a `custom_vjp`.

  Raises:
    ValueError: if `targets` is not integer-typed or its shape is not the
      logits' without their last axis; if `slices` is given with
      `one_pass=False`, or does not divide the vocabulary.
  """
  targets = _checked_targets(targets, logits.shape[:-1], logits.shape[-1])
  if not one_pass and slices is not None:
    raise ValueError(
      f"slices cuts the one-pass log-sum-exp's rows; got slices={slices!r}"
      " with one_pass=False, whose passes read whole rows: drop slices"
    )
  if one_pass:
    slices = checked_slices(slices, logits.shape[-1])
  # Both passes under one name: the compiled HLO's metadata, and so a
  # profile, say which kernels are the loss's.
  with jax.named_scope("cross_entropy"):
    return _cross_entropy(one_pass, slices, logits, targets)


def _checked_targets(targets, shape: tuple, vocab: int) -> jax.Array:
  """`targets` checked against the rows' `shape`, each negative one made
  its class counted from the end: `take_along_axis` counts so in the
  forward pass, and the backward pass's one-hot must pick the same class.

  Raises:
    ValueError: for targets not integer-typed or not of shape `shape`.
  """
  targets = jnp.asarray(targets)
  if not jnp.issubdtype(targets.dtype, jnp.integer):
    raise ValueError(f"targets must be integers, got dtype {targets.dtype}")
  if targets.shape != shape:
    raise ValueError(
      f"targets must have the logits' shape without its last axis,"
      f" {shape}; got {targets.shape}"
    )
  return jnp.where(targets < 0, targets + vocab, targets)


def logsumexp_one_pass(x, slices: int | None = None):
  """`jax.nn.logsumexp(x, axis=-1)` in float32 (or wider), read in one pass
  over `x`.

  A reduction carries each row's running max `m` and its sum `s` of
  `exp(x - m)`: two partial results `(m1, s1)` and `(m2, s2)` combine to
  `max(m1, m2)` and the sum of the smaller one's `s` times `exp(-|m1 - m2|)`
  and the larger one's `s` (an online softmax's rule, one exponential per
  value). The row is cut in `slices` equal parts reduced side by side,
  whose partial results are then combined: one running sum over a whole
  row of 50304 (XLA:CPU's order) lost up to 110 float32 ulps, with a lean
  to below. `slices` must divide the row's length; None takes
  `math.gcd(length, 128)`, up to 128 parts with no padding (for GPT-2's
  50304, 128 of 393). How long a part is decides how XLA:GPU reads it:
  bfloat16 logits compiled for an H200 (jax 0.10.2 and 0.11.2), parts of
  393 values (an odd number) are read one value at a time, parts of 524,
  2096 or 4192 four at a time (BENCHMARKS.md, `benchmarks/ptx_loads.py`).
  `jax.nn.logsumexp` reads `x` twice: its max, then its sum of
  exponentials. A row of -inf gives -inf, a +inf gives +inf, a NaN NaN.

  Not differentiable by itself (a reduction with a combiner of its own):
  `cross_entropy`'s backward pass reads only its value.

  Raises:
    ValueError: if `slices` is not a positive int that divides the row.
  """
  dtype = jnp.promote_types(x.dtype, jnp.float32)
  x = x.astype(dtype)
  n = x.shape[-1]
  slices = checked_slices(slices, n)
  x = x.reshape(*x.shape[:-1], slices, n // slices)

  def combine(a, b):
    (m1, s1), (m2, s2) = a, b
    e = jnp.where(m1 == m2, 1.0, jnp.exp(-jnp.abs(m1 - m2)))  # -inf == -inf
    s = jnp.where(m1 >= m2, s1 + s2 * e, s1 * e + s2)
    return jnp.maximum(m1, m2), s

  init = (jnp.array(-jnp.inf, dtype), jnp.array(0, dtype))
  last = x.ndim - 1
  partial = jax.lax.reduce((x, jnp.ones_like(x)), init, combine, (last,))
  m, s = jax.lax.reduce(partial, init, combine, (last - 1,))
  return m + jnp.log(s)


def checked_slices(slices, n: int) -> int:
  """`logsumexp_one_pass`'s `slices` for rows of `n`: None as
  `math.gcd(n, 128)`, else a positive int that divides `n`. The benchmarks'
  `--lse-slices` flags are checked by it at parse time.

  Raises:
    ValueError: for anything else, naming the divisors of `n` up to 128.
  """
  if slices is None:
    return math.gcd(n, 128)
  try:
    count = operator.index(slices)
  except TypeError:
    count = 0
  if isinstance(slices, bool) or count < 1 or n % count:
    divisors = ", ".join(str(d) for d in range(1, 129) if n % d == 0)
    raise ValueError(
      f"slices must be a positive Python int that divides the rows' length"
      f" {n} (its divisors up to 128: {divisors}); got {slices!r}"
    )
  return count


def _lse_and_target(logits, targets, one_pass: bool = True, slices=None):
  """Each row's log-sum-exp and target logit, in float32."""
  x = logits.astype(jnp.float32)
  if one_pass:
    lse = logsumexp_one_pass(x, slices)
  else:
    lse = jax.nn.logsumexp(x, axis=-1)
  return lse, jnp.take_along_axis(x, targets[..., None], axis=-1)[..., 0]


def _softmax_minus_one_hot(logits, lse, targets):
  """The loss's gradient per row, unscaled: `softmax(logits) -
  one_hot(targets)` in float32, from the rows' log-sum-exp."""
  probs = jnp.exp(logits.astype(jnp.float32) - lse[..., None])
  return probs - (jnp.arange(logits.shape[-1]) == targets[..., None])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _cross_entropy(one_pass, slices, logits, targets):
  return _cross_entropy_fwd(one_pass, slices, logits, targets)[0]


def _cross_entropy_fwd(one_pass, slices, logits, targets):
  lse, target = _lse_and_target(logits, targets, one_pass, slices)
  return jnp.mean(lse - target), (logits, targets, lse)


def _cross_entropy_bwd(one_pass, slices, res, g):
  del one_pass, slices  # the backward pass reads the saved log-sum-exp
  logits, targets, lse = res
  d_logits = _softmax_minus_one_hot(logits, lse, targets) * (g / lse.size)
  return d_logits.astype(logits.dtype), None


_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def fused_cross_entropy(x, table, targets, chunk: int = 4096):
  """`cross_entropy(x @ table.T, targets)` without the whole logits.

  `x` is (rows, d), `table` (vocab, d) in the compute dtype, `targets`
  (rows,) integers. The logits are computed `chunk` rows at a time in
  float32 (the matmul accumulates in float32 and is not rounded to the
  compute dtype first), reduced to each row's log-sum-exp and target logit,
  and dropped; the backward pass computes them again, a chunk at a time, and
  sums the table's gradient over chunks in float32. So memory holds one
  chunk's (chunk, vocab) float32 logits, not the (rows, vocab) logits in the
  compute dtype plus their float32 copies and gradients: for GPT-2 small at
  batch 16 x 1024 those are 1.6 GB in bfloat16 and 3.3 GB per float32 copy.
  The price is the logits matmul once more in the backward pass. Targets
  are checked and counted as `cross_entropy` counts them.
  """
  try:
    rows = operator.index(chunk)
  except TypeError:
    rows = 0
  if rows < 1:
    raise ValueError(f"chunk must be a positive int, got {chunk!r}")
  targets = _checked_targets(targets, x.shape[:1], table.shape[0])
  return _fused_ce(min(rows, x.shape[0]), x, table, targets)


def _in_chunks(chunk, *rows):
  """Each array's rows padded to a multiple of `chunk` and split in chunks,
  and which rows are real."""
  n = rows[0].shape[0]
  pad = -n % chunk
  valid = (jnp.arange(n + pad) < n).reshape(-1, chunk)
  return [
    jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)).reshape(
      -1, chunk, *a.shape[1:]
    )
    for a in rows
  ] + [valid]


def _chunk_logits(x, table):
  return jax.lax.dot_general(
    x, table, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused_ce(chunk, x, table, targets):
  return _fused_ce_fwd(chunk, x, table, targets)[0]


def _fused_ce_fwd(chunk, x, table, targets):
  xs, ts, valid = _in_chunks(chunk, x, targets)

  def one(_, inputs):
    xc, tc = inputs
    lse, target = _lse_and_target(_chunk_logits(xc, table), tc)
    return None, (lse, lse - target)

  _, (lse, nll) = jax.lax.scan(one, None, (xs, ts))
  loss = jnp.sum(jnp.where(valid, nll, 0.0)) / x.shape[0]
  return loss, (x, table, targets, lse)


def _fused_ce_bwd(chunk, res, g):
  x, table, targets, lse = res
  xs, ts, valid = _in_chunks(chunk, x, targets)
  scale = g / x.shape[0]

  def one(d_table, inputs):
    xc, tc, lse_c, valid_c = inputs
    d_logits = _softmax_minus_one_hot(_chunk_logits(xc, table), lse_c, tc)
    d_logits = jnp.where(valid_c[:, None], d_logits * scale, 0.0)
    d_logits = d_logits.astype(x.dtype)  # as the logits' cast would give
    dxc = jnp.matmul(d_logits, table, preferred_element_type=jnp.float32)
    d_table += jax.lax.dot_general(
      d_logits, xc, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
    )
    return d_table, dxc.astype(x.dtype)

  d_table = jnp.zeros(table.shape, jnp.float32)
  d_table, dxs = jax.lax.scan(one, d_table, (xs, ts, lse, valid))
  dx = dxs.reshape(-1, x.shape[1])[: x.shape[0]]
  return dx, d_table.astype(table.dtype), None


_fused_ce.defvjp(_fused_ce_fwd, _fused_ce_bwd)


def step_loss(model: GPT):
  """`loss_fn(params, batch, model_state, key)` for
  `jmp_train.train.make_train_step`: the next-token cross-entropy of `batch`,
  token rows one longer than the context."""

  def loss_fn(params, batch, model_state, key):
    del model_state, key
    logits = model.apply({"params": params}, batch[:, :-1])
    return cross_entropy(logits, batch[:, 1:])

  return loss_fn


def init_shapes(model: GPT, dtype=jnp.float32) -> dict:
  """The params of `model` as `jax.ShapeDtypeStruct`s (nothing allocated)."""
  tokens = jax.ShapeDtypeStruct((1, model.seq_len), jnp.int32)
  shapes = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]
  return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), shapes)


def qkv_params(params: dict, qkv: str) -> dict:
  """`params` of a `GPT(qkv="packed")` as a `GPT(qkv=qkv)` takes them
  (`QKVS`): each block's `attn/qkv` kernel (d_model, 3, heads, head_dim) and
  bias (3, heads, head_dim) flattened to (d_model, 3 d_model) and (3
  d_model) for "dense", sliced along the axis of 3 into `attn/q`, `attn/k`
  and `attn/v` for "split"; every other leaf is passed on as it is.

  Raises:
    ValueError: for a `qkv` not in `QKVS`, params with no block (a
      `{"params": ...}` dict, say), or a block whose attention has no packed
      `qkv` projection (params already mapped).
  """
  check_qkv(qkv)
  blocks = [name for name in params if name.startswith("block")]
  if not blocks:
    raise ValueError(
      f"params has no block to map to qkv={qkv!r}: its keys are"
      f" {sorted(params)} (pass the GPT's params, not a dict holding them)"
    )
  out = dict(params)
  for name in blocks:
    block = params[name]
    attn = dict(block["attn"])
    packed = attn.pop("qkv", {})
    shape = getattr(packed.get("kernel"), "shape", None)
    if shape is None or len(shape) != 4:
      raise ValueError(
        f"params[{name!r}]['attn'] has no packed 'qkv' projection to map to"
        f" qkv={qkv!r}, a kernel of rank 4 (d_model, 3, heads, head_dim):"
        f" it has {sorted(block['attn'])}, the 'qkv' kernel of shape"
        f" {shape} (params already mapped?)"
      )
    kernel, bias = packed["kernel"], packed["bias"]
    d = kernel.shape[0]
    if qkv == "packed":
      attn["qkv"] = {"kernel": kernel, "bias": bias}
    elif qkv == "dense":
      attn["qkv"] = {"kernel": kernel.reshape(d, -1), "bias": bias.reshape(-1)}
    else:
      for i, part in enumerate(("q", "k", "v")):
        attn[part] = {
          "kernel": kernel[:, i].reshape(d, -1),
          "bias": bias[i].reshape(-1),
        }
    out[name] = {**block, "attn": attn}
  return out
