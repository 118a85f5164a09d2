"""Flax models written the way Flax's own examples write them, shrunk.

Linen: the ResNet of examples/imagenet (`dtype: Any = jnp.float32` threaded
into every layer through `functools.partial`) and the Transformer of
examples/wmt (a `TransformerConfig` carrying `dtype`, `setup`,
`encode`/`decode` methods, a shared `nn.Embed` whose `attend` makes the
logits, masks made with `dtype=config.dtype`, an attention decode cache).
NNX: the CNN of Flax's NNX MNIST tutorial (`model(x, rngs)`, dropout and
BatchNorm) and an encoder-decoder built with `dtype=config.dtype` layers.
The code follows the examples line for line where it can; only sizes and
the number of layers are cut.
"""

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import flax.nnx as nnx
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

ModuleDef = Any

# -- examples/imagenet/models.py ----------------------------------------------


class ResNetBlock(nn.Module):
  """ResNet block."""

  filters: int
  conv: ModuleDef
  norm: ModuleDef
  act: Callable
  strides: tuple[int, int] = (1, 1)

  @nn.compact
  def __call__(self, x):
    residual = x
    y = self.conv(self.filters, (3, 3), self.strides)(x)
    y = self.norm()(y)
    y = self.act(y)
    y = self.conv(self.filters, (3, 3))(y)
    y = self.norm(scale_init=nn.initializers.zeros_init())(y)
    if residual.shape != y.shape:
      residual = self.conv(
        self.filters, (1, 1), self.strides, name="conv_proj"
      )(residual)
      residual = self.norm(name="norm_proj")(residual)
    return self.act(residual + y)


class ResNet(nn.Module):
  """ResNetV1.5 (the example's, without the cross-device BatchNorm axis)."""

  stage_sizes: Sequence[int]
  block_cls: ModuleDef
  num_classes: int
  num_filters: int = 64
  dtype: Any = jnp.float32
  act: Callable = nn.relu
  conv: ModuleDef = nn.Conv

  @nn.compact
  def __call__(self, x, train: bool = True):
    conv = functools.partial(self.conv, use_bias=False, dtype=self.dtype)
    norm = functools.partial(
      nn.BatchNorm,
      use_running_average=not train,
      momentum=0.9,
      epsilon=1e-5,
      dtype=self.dtype,
    )
    x = conv(
      self.num_filters,
      (7, 7),
      (2, 2),
      padding=[(3, 3), (3, 3)],
      name="conv_init",
    )(x)
    x = norm(name="bn_init")(x)
    x = nn.relu(x)
    x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
    for i, block_size in enumerate(self.stage_sizes):
      for j in range(block_size):
        strides = (2, 2) if i > 0 and j == 0 else (1, 1)
        x = self.block_cls(
          self.num_filters * 2**i,
          strides=strides,
          conv=conv,
          norm=norm,
          act=self.act,
        )(x)
    x = jnp.mean(x, axis=(1, 2))
    x = nn.Dense(self.num_classes, dtype=self.dtype)(x)
    x = jnp.asarray(x, self.dtype)
    return x


TinyResNet = functools.partial(
  ResNet, stage_sizes=[1, 1], block_cls=ResNetBlock, num_filters=4
)

# -- examples/wmt/models.py ---------------------------------------------------


@struct.dataclass
class TransformerConfig:
  """Global hyperparameters used to minimize obnoxious kwarg plumbing."""

  vocab_size: int = 11
  output_vocab_size: int = 11
  share_embeddings: bool = True
  logits_via_embedding: bool = True
  dtype: Any = jnp.float32
  emb_dim: int = 8
  num_heads: int = 2
  num_layers: int = 1
  qkv_dim: int = 8
  mlp_dim: int = 16
  max_len: int = 8
  dropout_rate: float = 0.1
  attention_dropout_rate: float = 0.1
  deterministic: bool = True
  decode: bool = False
  kernel_init: Callable = nn.initializers.xavier_uniform()
  bias_init: Callable = nn.initializers.normal(stddev=1e-6)


def shift_right(x, axis=1):
  """Shift the input to the right by padding on axis 1."""
  pad_widths = [(0, 0)] * len(x.shape)
  pad_widths[axis] = (1, 0)
  padded = jnp.pad(
    x, pad_widths, mode="constant", constant_values=x.dtype.type(0)
  )
  return padded[:, :-1]


def sinusoidal_init(max_len=2048, min_scale=1.0, max_scale=10000.0):
  """1D Sinusoidal Position Embedding Initializer."""

  def init(key, shape, dtype=np.float32):
    del key, dtype
    d_feature = shape[-1]
    pe = np.zeros((max_len, d_feature), dtype=np.float32)
    position = np.arange(0, max_len)[:, np.newaxis]
    scale_factor = -np.log(max_scale / min_scale) / (d_feature // 2 - 1)
    div_term = min_scale * np.exp(np.arange(0, d_feature // 2) * scale_factor)
    pe[:, : d_feature // 2] = np.sin(position * div_term)
    pe[:, d_feature // 2 : 2 * (d_feature // 2)] = np.cos(position * div_term)
    pe = pe[np.newaxis, :, :]  # [1, max_len, d_feature]
    return jnp.array(pe)

  return init


class AddPositionEmbs(nn.Module):
  """Adds fixed sinusoidal positional embeddings to the inputs."""

  config: TransformerConfig
  decode: bool = False

  @nn.compact
  def __call__(self, inputs):
    config = self.config
    length = inputs.shape[1]
    pos_emb_shape = (1, config.max_len, inputs.shape[-1])
    pos_embedding = sinusoidal_init(max_len=config.max_len)(
      None, pos_emb_shape, None
    )
    pe = pos_embedding[:, :length, :]
    # We use a cache position index for tracking decoding position.
    if self.decode:
      is_initialized = self.has_variable("cache", "cache_index")
      cache_index = self.variable(
        "cache", "cache_index", lambda: jnp.array(0, dtype=jnp.uint32)
      )
      if is_initialized:
        i = cache_index.value
        cache_index.value = i + 1
        _, _, df = pos_embedding.shape
        pe = lax.dynamic_slice(pos_embedding, jnp.array((0, i, 0)), (1, 1, df))
    return inputs + pe


class MlpBlock(nn.Module):
  """Transformer MLP / feed-forward block."""

  config: TransformerConfig
  out_dim: int | None = None

  @nn.compact
  def __call__(self, inputs):
    config = self.config
    actual_out_dim = inputs.shape[-1] if self.out_dim is None else self.out_dim
    x = nn.Dense(
      config.mlp_dim,
      dtype=config.dtype,
      kernel_init=config.kernel_init,
      bias_init=config.bias_init,
    )(inputs)
    x = nn.relu(x)
    x = nn.Dropout(rate=config.dropout_rate)(
      x, deterministic=config.deterministic
    )
    output = nn.Dense(
      actual_out_dim,
      dtype=config.dtype,
      kernel_init=config.kernel_init,
      bias_init=config.bias_init,
    )(x)
    return nn.Dropout(rate=config.dropout_rate)(
      output, deterministic=config.deterministic
    )


class Encoder1DBlock(nn.Module):
  """Transformer encoder layer."""

  config: TransformerConfig

  @nn.compact
  def __call__(self, inputs, encoder_mask=None):
    config = self.config
    x = nn.LayerNorm(dtype=config.dtype)(inputs)
    x = nn.SelfAttention(
      num_heads=config.num_heads,
      dtype=config.dtype,
      qkv_features=config.qkv_dim,
      kernel_init=config.kernel_init,
      bias_init=config.bias_init,
      use_bias=False,
      broadcast_dropout=False,
      dropout_rate=config.attention_dropout_rate,
      deterministic=config.deterministic,
    )(x, encoder_mask)
    x = nn.Dropout(rate=config.dropout_rate)(
      x, deterministic=config.deterministic
    )
    x = x + inputs
    y = nn.LayerNorm(dtype=config.dtype)(x)
    y = MlpBlock(config=config)(y)
    return x + y


class EncoderDecoder1DBlock(nn.Module):
  """Transformer encoder-decoder layer."""

  config: TransformerConfig

  @nn.compact
  def __call__(
    self, targets, encoded, decoder_mask=None, encoder_decoder_mask=None
  ):
    config = self.config
    x = nn.LayerNorm(dtype=config.dtype)(targets)
    x = nn.SelfAttention(
      num_heads=config.num_heads,
      dtype=config.dtype,
      qkv_features=config.qkv_dim,
      kernel_init=config.kernel_init,
      bias_init=config.bias_init,
      use_bias=False,
      broadcast_dropout=False,
      dropout_rate=config.attention_dropout_rate,
      deterministic=config.deterministic,
      decode=config.decode,
    )(x, decoder_mask)
    x = nn.Dropout(rate=config.dropout_rate)(
      x, deterministic=config.deterministic
    )
    x = x + targets
    y = nn.LayerNorm(dtype=config.dtype)(x)
    y = nn.MultiHeadDotProductAttention(
      num_heads=config.num_heads,
      dtype=config.dtype,
      qkv_features=config.qkv_dim,
      kernel_init=config.kernel_init,
      bias_init=config.bias_init,
      use_bias=False,
      broadcast_dropout=False,
      dropout_rate=config.attention_dropout_rate,
      deterministic=config.deterministic,
    )(y, encoded, mask=encoder_decoder_mask)
    y = nn.Dropout(rate=config.dropout_rate)(
      y, deterministic=config.deterministic
    )
    y = y + x
    z = nn.LayerNorm(dtype=config.dtype)(y)
    z = MlpBlock(config=config)(z)
    return y + z


class Encoder(nn.Module):
  """Transformer Model Encoder for sequence to sequence translation."""

  config: TransformerConfig
  shared_embedding: Any = None

  @nn.compact
  def __call__(self, inputs, encoder_mask=None):
    config = self.config
    input_embed = self.shared_embedding
    x = inputs.astype("int32")
    x = input_embed(x)
    x = AddPositionEmbs(config=config, decode=False, name="posembed_input")(x)
    x = nn.Dropout(rate=config.dropout_rate)(
      x, deterministic=config.deterministic
    )
    x = x.astype(config.dtype)
    for lyr in range(config.num_layers):
      x = Encoder1DBlock(config=config, name=f"encoderblock_{lyr}")(
        x, encoder_mask
      )
    return nn.LayerNorm(dtype=config.dtype, name="encoder_norm")(x)


class Decoder(nn.Module):
  """Transformer Model Decoder for sequence to sequence translation."""

  config: TransformerConfig
  shared_embedding: Any = None

  @nn.compact
  def __call__(
    self, encoded, targets, decoder_mask=None, encoder_decoder_mask=None
  ):
    config = self.config
    output_embed = self.shared_embedding
    y = targets.astype("int32")
    if not config.decode:
      y = shift_right(y)
    y = output_embed(y)
    y = AddPositionEmbs(
      config=config, decode=config.decode, name="posembed_output"
    )(y)
    y = nn.Dropout(rate=config.dropout_rate)(
      y, deterministic=config.deterministic
    )
    y = y.astype(config.dtype)
    for lyr in range(config.num_layers):
      y = EncoderDecoder1DBlock(
        config=config, name=f"encoderdecoderblock_{lyr}"
      )(
        y,
        encoded,
        decoder_mask=decoder_mask,
        encoder_decoder_mask=encoder_decoder_mask,
      )
    y = nn.LayerNorm(dtype=config.dtype, name="encoderdecoder_norm")(y)
    # Use the transpose of embedding matrix for logit transform.
    logits = output_embed.attend(y.astype(jnp.float32))
    # Correctly normalize pre-softmax logits for this shared case.
    return logits / jnp.sqrt(y.shape[-1])


class Transformer(nn.Module):
  """Transformer Model for sequence to sequence translation."""

  config: TransformerConfig

  def setup(self):
    config = self.config
    self.shared_embedding = nn.Embed(
      num_embeddings=config.vocab_size,
      features=config.emb_dim,
      embedding_init=nn.initializers.normal(stddev=1.0),
    )
    self.encoder = Encoder(
      config=config, shared_embedding=self.shared_embedding
    )
    self.decoder = Decoder(
      config=config, shared_embedding=self.shared_embedding
    )

  def encode(self, inputs):
    config = self.config
    # Make padding attention mask.
    encoder_mask = nn.make_attention_mask(
      inputs > 0, inputs > 0, dtype=config.dtype
    )
    return self.encoder(inputs, encoder_mask=encoder_mask)

  def decode(self, encoded, inputs, targets):
    config = self.config
    # Make padding attention masks.
    if config.decode:
      # for fast autoregressive decoding only a special encoder-decoder mask
      decoder_mask = None
      encoder_decoder_mask = nn.make_attention_mask(
        jnp.ones_like(targets) > 0, inputs > 0, dtype=config.dtype
      )
    else:
      decoder_mask = nn.combine_masks(
        nn.make_attention_mask(targets > 0, targets > 0, dtype=config.dtype),
        nn.make_causal_mask(targets, dtype=config.dtype),
      )
      encoder_decoder_mask = nn.make_attention_mask(
        targets > 0, inputs > 0, dtype=config.dtype
      )
    logits = self.decoder(
      encoded,
      targets,
      decoder_mask=decoder_mask,
      encoder_decoder_mask=encoder_decoder_mask,
    )
    return logits.astype(self.config.dtype)

  def __call__(self, inputs, targets):
    encoded = self.encode(inputs)
    return self.decode(encoded, inputs, targets)


# -- Flax's NNX MNIST tutorial ------------------------------------------------


class CNN(nnx.Module):
  """A simple CNN model (the tutorial's, for 8x8 images)."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 4, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm1 = nnx.BatchNorm(4, rngs=rngs)
    self.dropout1 = nnx.Dropout(rate=0.25)
    self.conv2 = nnx.Conv(4, 8, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm2 = nnx.BatchNorm(8, rngs=rngs)
    self.avg_pool = functools.partial(
      nnx.avg_pool, window_shape=(2, 2), strides=(2, 2)
    )
    self.linear1 = nnx.Linear(32, 16, rngs=rngs)
    self.dropout2 = nnx.Dropout(rate=0.25)
    self.linear2 = nnx.Linear(16, 10, rngs=rngs)

  def __call__(self, x, rngs: nnx.Rngs | None = None):
    x = self.avg_pool(
      nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs)))
    )
    x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
    x = x.reshape(x.shape[0], -1)  # flatten
    x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
    x = self.linear2(x)
    return x


# -- an NNX encoder-decoder with dtype=config.dtype layers --------------------


@dataclasses.dataclass(frozen=True)
class NnxConfig:
  vocab_size: int = 11
  emb_dim: int = 8
  num_heads: int = 2
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32


class NnxEncoderDecoder(nnx.Module):
  """Embed, attention and MLP layers built with the config's dtypes."""

  def __init__(self, config: NnxConfig, *, rngs: nnx.Rngs):
    self.config = config
    kw = dict(dtype=config.dtype, param_dtype=config.param_dtype, rngs=rngs)
    d = config.emb_dim
    self.embed = nnx.Embed(config.vocab_size, d, **kw)
    self.enc_attn = nnx.MultiHeadAttention(
      config.num_heads, d, decode=False, **kw
    )
    self.enc_norm = nnx.LayerNorm(d, **kw)
    self.conv = nnx.Conv(d, d, kernel_size=(3,), **kw)
    self.cross_attn = nnx.MultiHeadAttention(
      config.num_heads, d, decode=False, **kw
    )
    self.mlp = nnx.Linear(d, d, **kw)
    # dtype left unset: computes in what its inputs and params promote to.
    self.out = nnx.Linear(d, d, param_dtype=config.param_dtype, rngs=rngs)

  def encode(self, inputs):
    mask = nnx.make_attention_mask(
      inputs > 0, inputs > 0, dtype=self.config.dtype
    )
    x = self.embed(inputs)
    x = x + self.enc_attn(x, mask=mask)
    return self.enc_norm(self.conv(x))

  def decode(self, encoded, targets):
    y = self.embed(targets).astype(self.config.dtype)
    y = y + self.cross_attn(y, encoded, encoded)
    y = self.out(nnx.relu(self.mlp(y)))
    return self.embed.attend(y)

  def __call__(self, inputs, targets):
    return self.decode(self.encode(inputs), targets)
