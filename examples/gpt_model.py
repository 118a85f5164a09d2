"""The GPT model every example, benchmark and test imports: GPT-2's layout.

A pre-norm transformer with causal self-attention whose softmax runs in
float32 whatever the compute dtype; the loss is computed in float32. Written
as Flax users write models (plain `nn.Dense`/`nn.LayerNorm`/`nn.Embed`), so
`jmp_train.linen.wrap` applies a policy to it from outside.

`CONFIGS` holds GPT-2's sizes as `GPT` fields (`GPT(**CONFIGS["gpt2-small"])`,
tied embeddings as in GPT-2) and a tiny one for tests; `init_shapes` gives the
params' shapes without allocating them.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

VOCAB = 128  # ASCII

_GPT2 = dict(vocab=50257, seq_len=1024, tied=True)
CONFIGS = {
  "gpt2-small": dict(layers=12, d_model=768, heads=12, **_GPT2),
  "gpt2-medium": dict(layers=24, d_model=1024, heads=16, **_GPT2),
  # Every dimension divides 8, so ZeRO-1 on up to 8 devices pads nothing.
  "tiny-gpt": dict(layers=2, d_model=64, heads=4, vocab=96, seq_len=64),
}


class CausalSelfAttention(nn.Module):
  heads: int
  fused: bool = False  # jax.nn.dot_product_attention (cuDNN flash on GPU)

  @nn.compact
  def __call__(self, x):
    batch, seq, d = x.shape
    head_dim = d // self.heads
    qkv = nn.DenseGeneral((3, self.heads, head_dim), name="qkv")(x)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    if self.fused:  # the kernels keep softmax statistics in float32
      # cuDNN flash attention takes bf16/fp16 on GPUs; JAX's default (None)
      # is its XLA implementation, which materializes the T x T scores.
      cudnn = jax.default_backend() == "gpu" and q.dtype in (
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

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    attn = CausalSelfAttention(self.heads, self.fused, name="attn")
    x = x + attn(nn.LayerNorm()(x))
    h = nn.gelu(nn.Dense(4 * d, name="fc")(nn.LayerNorm()(x)))
    return x + nn.Dense(d, name="out")(h)


class GPT(nn.Module):
  """GPT-2's layout; `tied=True` reads logits off the token embedding."""

  layers: int
  d_model: int
  heads: int
  seq_len: int
  vocab: int = VOCAB
  tied: bool = False
  fused_attention: bool = False

  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(self.vocab, self.d_model, name="embed")
    pos = self.param(
      "pos", nn.initializers.normal(0.02), (self.seq_len, self.d_model)
    )
    x = embed(tokens) + pos[: tokens.shape[1]]
    for i in range(self.layers):
      x = Block(self.heads, self.fused_attention, name=f"block{i}")(x)
    x = nn.LayerNorm(name="ln_f")(x)
    if self.tied:
      return embed.attend(x)
    return nn.Dense(self.vocab, name="head")(x)


def cross_entropy(logits, targets):
  logits = logits.astype(jnp.float32)  # the loss in float32
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


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
