"""FP8 recipes: how each FP8 matmul picks the scales of its operands.

Three recipes, named as Transformer Engine names them:

- `DelayedScaling`: each tensor's scale comes from the amaxes (max |value|)
  of previous steps, kept in a history (`fp8.py` holds that state):
  `fp8_max / amax / 2**margin`.
- `CurrentScaling` (TE's `Float8CurrentScaling`, torchao's "tensorwise"):
  each tensor's scale comes from its own amax at the moment it is cast,
  `fp8_max / amax(x)`; no history.
- `BlockwiseScaling` (DeepSeek-V3, TE's `Float8BlockScaling`): one scale per
  1 x 128 tile of activations and output gradients (128 consecutive values
  along the matmul's contraction) and per 128 x 128 block of weights, each
  from the tile's own amax; E4M3 in both passes; the matmul's partial sums are
  promoted to float32 every 128 values of the contraction (`fp8_block.py`).

The scale rule of the current and blockwise recipes, for one tensor or tile:

    scale = 1                               if amax is 0 or not finite
            min(fp8_max / amax, 2**126)     otherwise
    scale = 2**floor(log2(scale))           with power_of_two_scales

An amax of 0 leaves zeros zero; an infinite or NaN amax leaves the tensor's
inf and NaN non-finite after the cast (finite values saturate at fp8_max),
so the step that produced them still skips. The cap keeps `1 / scale` a
normal float32 (XLA flushes subnormals to zero).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jmp_train._src import leaves

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
# The `jax.ad_checkpoint.checkpoint_name`s of what every FP8 matmul's
# backward pass reads, for a remat policy to save by name
# (`jax.checkpoint_policies.save_only_these_names(*REMAT_NAMES)`): the
# matmul's output, in its output dtype, and its FP8 operands, as bytes.
# `dots_saveable` saves instead the float32 product of the FP8 dot (twice
# the bytes of a bfloat16 output), and under blockwise scaling every
# K-block's float32 partial product.
OUTPUT_NAME = "fp8_matmul_output"
OPERANDS_NAME = "fp8_matmul_operands"
REMAT_NAMES = (OUTPUT_NAME, OPERANDS_NAME)
# The largest float32 that rounds to FP8_MAX (to nearest even): beyond it a
# product would round past the range, and the clip changes its FP8 value
# (E4M3: 464 rounds to 448, above it to NaN; E5M2: 61440 rounds to inf).
LAST_TO_MAX = {
  E4M3: 464.0,
  E5M2: float(np.nextafter(np.float32(61440.0), np.float32(0.0))),
}
FORMATS = ("hybrid", "e4m3")
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
# The largest scale any recipe uses: 1 / 2**126 is float32's smallest
# normal.
MAX_SCALE = 2.0**126


def _check_format(value: Any) -> None:
  if value not in FORMATS:
    raise ValueError(
      f"Unknown FP8 format {value!r}: accepted formats are "
      f"{', '.join(map(repr, FORMATS))}."
    )


class _Formats:
  """The FP8 dtypes of a recipe with a `format` field."""

  format: str

  @property
  def forward_dtype(self) -> np.dtype:
    """The FP8 dtype of inputs and kernels: E4M3."""
    return E4M3

  @property
  def backward_dtype(self) -> np.dtype:
    """The FP8 dtype of output gradients: E5M2 (hybrid) or E4M3."""
    return E5M2 if self.format == "hybrid" else E4M3

  @property
  def fp8_max(self) -> tuple[float, float, float]:
    """The largest FP8 value for input, kernel and output gradient."""
    fwd, bwd = FP8_MAX[self.forward_dtype], FP8_MAX[self.backward_dtype]
    return (fwd, fwd, bwd)


@dataclasses.dataclass(frozen=True)
class DelayedScaling(_Formats):
  """Delayed scaling, as Transformer Engine and NeMo name its options.

  Attributes:
    format: "hybrid" (E4M3 forward, E5M2 gradients) or "e4m3" (E4M3 for
      both).
    margin: the scale is divided by 2**margin (headroom against growth);
      a non-negative int.
    amax_history_len: how many steps of amax the scale looks back over.
    amax_compute_algo: "max" (the largest amax in the history) or
      "most_recent" (the last step's amax).
    statistics: also measure, per tensor and step, the fraction of values
      saturated and the fraction of non-zero values flushed to zero by the
      cast (`jmp_train.monitor.fp8_statistics`); a few extra reductions per
      matmul.

  Example:
    >>> recipe = DelayedScaling(margin=1, amax_history_len=16)
    >>> recipe.fp8_max
    (448.0, 448.0, 57344.0)
  """

  format: str = "hybrid"
  margin: int = 0
  amax_history_len: int = 1024
  amax_compute_algo: str = "max"
  statistics: bool = False

  def __post_init__(self):
    _check_format(self.format)
    if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
      raise ValueError(
        f"Unknown amax_compute_algo {self.amax_compute_algo!r}: accepted "
        f"values are {', '.join(map(repr, AMAX_COMPUTE_ALGOS))}."
      )
    leaves.check_int(self.margin, "margin", 0)
    leaves.check_int(self.amax_history_len, "amax_history_len", 1)
    leaves.check_bool(self.statistics, "statistics")


@dataclasses.dataclass(frozen=True)
class CurrentScaling(_Formats):
  """Current (per-tensor, just-in-time) scaling: no history state.

  Each operand's scale is `fp8_max / amax` of that operand, computed where
  it is cast (the output gradient's in the backward pass).

  Attributes:
    format: "hybrid" (E4M3 forward, E5M2 gradients) or "e4m3".
    power_of_two_scales: round each scale down to a power of two, so that
      scaling and unscaling are exact.
    statistics: also measure, per tensor and step, the fraction of values
      saturated and the fraction of non-zero values flushed to zero by the
      cast (`jmp_train.monitor.fp8_statistics`); a few extra reductions per
      matmul.

  Example:
    >>> CurrentScaling(power_of_two_scales=True).backward_dtype
    dtype(float8_e5m2)
  """

  format: str = "hybrid"
  power_of_two_scales: bool = False
  statistics: bool = False

  def __post_init__(self):
    _check_format(self.format)
    leaves.check_bool(self.power_of_two_scales, "power_of_two_scales")
    leaves.check_bool(self.statistics, "statistics")


@dataclasses.dataclass(frozen=True)
class BlockwiseScaling(_Formats):
  """Blockwise scaling (DeepSeek-V3): one scale per tile or block, E4M3.

  Activations and output gradients get one scale per `1 x block_size` tile
  along the contraction of the matmul that reads them, kernels one per
  `block_size x block_size` block; tiles at the edges are partial. The
  matmul promotes its partial sums to float32 every `block_size` values of
  the contraction.

  Attributes:
    block_size: the tile length and block side (DeepSeek-V3: 128).
    power_of_two_scales: round each scale down to a power of two (the
      default, as Transformer Engine's `Float8BlockScaling`).
    statistics: also measure, per tensor and step, the fraction of values
      saturated and the fraction of non-zero values flushed to zero by the
      cast (`jmp_train.monitor.fp8_statistics`); a few extra reductions per
      matmul.

  Example:
    >>> BlockwiseScaling().fp8_max
    (448.0, 448.0, 448.0)
  """

  block_size: int = 128
  power_of_two_scales: bool = True
  statistics: bool = False

  def __post_init__(self):
    leaves.check_int(self.block_size, "block_size", 1)
    leaves.check_bool(self.power_of_two_scales, "power_of_two_scales")
    leaves.check_bool(self.statistics, "statistics")

  @property
  def format(self) -> str:
    """Always "e4m3": E4M3 for inputs, kernels and gradients."""
    return "e4m3"


Recipe = DelayedScaling | CurrentScaling | BlockwiseScaling
RECIPES = (DelayedScaling, CurrentScaling, BlockwiseScaling)
RECIPE_NAMES = {
  "delayed": DelayedScaling,
  "current": CurrentScaling,
  "blockwise": BlockwiseScaling,
}
# What `fp8=True` means: see README "FP8 matmuls" for the measurements.
DEFAULT_RECIPE = CurrentScaling()


def check_recipe(value: Any, name: str = "fp8") -> Recipe | None:
  """A recipe from what `wrap(fp8=...)` and presets accept, or None.

  Accepted: a recipe, a recipe name ("delayed", "current", "blockwise": that
  recipe's defaults), True (the default recipe, `CurrentScaling()`), False
  or None (no FP8).
  """
  if value is None or value is False:
    return None
  if value is True:
    return DEFAULT_RECIPE
  if isinstance(value, str) and value in RECIPE_NAMES:
    return RECIPE_NAMES[value]()
  if isinstance(value, RECIPES):
    return value
  raise (ValueError if isinstance(value, str) else TypeError)(
    f"{name} must be a jmp_train.fp8 recipe (DelayedScaling, CurrentScaling, "
    f"BlockwiseScaling), one of their names {sorted(RECIPE_NAMES)}, True, "
    f"False or None; got {value!r}."
  )


def is_delayed(recipe: Recipe) -> bool:
  """Whether the recipe keeps scales between steps (delayed scaling)."""
  return isinstance(recipe, DelayedScaling)


def power_of_two(scale: jax.Array) -> jax.Array:
  """Rounds positive normal float32 scales down to a power of two, exactly."""
  bits = jax.lax.bitcast_convert_type(scale.astype(jnp.float32), jnp.uint32)
  return jax.lax.bitcast_convert_type(
    bits & jnp.uint32(0xFF800000), jnp.float32
  )


def current_scale(
  amax: jax.Array, fp8_max: jax.typing.ArrayLike, power_of_two_scales: bool
) -> jax.Array:
  """The current and blockwise scale rule (module docstring), elementwise.

  Example:
    >>> current_scale(jnp.array([2.0, 0.0, jnp.inf, 3.0]), 448.0, False)
    Array([224.     ,   1.     ,   1.     , 149.33333], dtype=float32)
    >>> current_scale(jnp.array([3.0]), 448.0, True)
    Array([128.], dtype=float32)
  """
  amax = jnp.asarray(amax, jnp.float32)
  ok = (amax > 0) & jnp.isfinite(amax)
  scale = jnp.asarray(fp8_max, jnp.float32) / jnp.where(ok, amax, 1.0)
  scale = jnp.minimum(scale, jnp.float32(MAX_SCALE))
  if power_of_two_scales:
    scale = power_of_two(scale)
  return jnp.where(ok, scale, jnp.float32(1.0))


def delayed_scale(
  amax_history: jax.Array,
  scale: jax.Array,
  fp8_max: jax.typing.ArrayLike,
  margin: int = 0,
  amax_compute_algo: str = "max",
) -> jax.Array:
  """The delayed scale from an amax history (last axis; entry 0 most recent).

  `fp8_max / amax / 2**margin`, where `amax` is the history's max or its
  entry 0, kept in [2**-126, 2**126] as the other recipes' scales are (so
  `1 / scale` is a normal float32, and a large margin cannot make it 0);
  where that amax is zero or not finite, the previous `scale` is kept.
  """
  if amax_compute_algo == "max":
    amax = jnp.max(amax_history, axis=-1)
  elif amax_compute_algo == "most_recent":
    amax = amax_history[..., 0]
  else:
    raise ValueError(
      f"Unknown amax_compute_algo {amax_compute_algo!r}: accepted values are "
      f"{', '.join(map(repr, AMAX_COMPUTE_ALGOS))}."
    )
  amax = amax.astype(jnp.float32)
  # fp8_max / 2**margin first (exact: a power of two), by at most 2**126 at
  # a time (2**margin alone overflows past 127); then the amax, then the clip.
  top = jnp.asarray(fp8_max, jnp.float32) / jnp.float32(2.0 ** min(margin, 126))
  top = top / jnp.float32(2.0 ** min(max(margin - 126, 0), 126))
  new = top / amax
  new = jnp.clip(new, jnp.float32(1.0 / MAX_SCALE), jnp.float32(MAX_SCALE))
  ok = (amax > 0) & jnp.isfinite(amax)
  return jnp.where(ok, new, scale)


def quantize(x: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
  """`x * scale` cast to `dtype`; finite values saturate, inf/NaN stay so.

  `scale` broadcasts against `x`; the product is taken in float32 and
  rounded to nearest even. A finite product beyond the FP8 range, or one
  that overflows float32, saturates at +-fp8_max.
  """
  fp8_max = FP8_MAX[np.dtype(dtype)]
  y = x.astype(jnp.float32) * scale
  # A finite x whose product overflows float32 saturates too: only inf and
  # NaN inputs stay non-finite.
  y = jnp.where(jnp.isfinite(x), jnp.clip(y, -fp8_max, fp8_max), y)
  return y.astype(dtype)


def to_residual(q: jax.Array) -> jax.Array:
  """FP8 values `q` as their bit patterns (uint8), to be saved for the
  backward pass, named `OPERANDS_NAME`; `from_residual` gives them back.

  `jax.checkpoint` (`nn.remat`) passes every floating residual it saves
  through `lax.reduce_precision` with its dtype's exponent and mantissa bits
  (jax 0.10 and 0.11), which follows IEEE's layout: E4M3 has no infinities
  and keeps values of 256 to 448 in its top exponent, so a saved E4M3
  residual came back NaN wherever it held 256 or more (every tensor cast
  with current scaling, whose amax maps to 448). Integers are saved as they
  are.
  """
  bits = jax.lax.bitcast_convert_type(q, jnp.uint8)
  return checkpoint_name(bits, OPERANDS_NAME)


def from_residual(bits: jax.Array, dtype: Any) -> jax.Array:
  """The FP8 values of `to_residual`'s bit patterns, as `dtype`."""
  return jax.lax.bitcast_convert_type(bits, dtype)


def cast_fractions(
  x: jax.Array, scale: jax.Array, q: jax.Array, dtype: Any
) -> jax.Array:
  """float32[2]: the fractions of `x` saturated and flushed by its cast.

  Saturated: finite values whose product |x * scale| rounds past the FP8
  range, so that the clip to +-fp8_max changes their FP8 value (the product
  may overflow float32), over all values. A product just above fp8_max
  rounds to it anyway: `448 / amax` rounds up in float32 for some amaxes,
  and the amax itself then lands a hair above 448.
  Flushed: non-zero finite values whose FP8 value `q` is zero, over the
  non-zero values (0 when there are none).
  """
  y = x.astype(jnp.float32) * scale
  finite = jnp.isfinite(x)
  past = jnp.abs(y) > LAST_TO_MAX[np.dtype(dtype)]
  saturated = jnp.sum(finite & past, dtype=jnp.float32)
  nonzero = finite & (x != 0)
  flushed = jnp.sum(nonzero & (q.astype(jnp.float32) == 0), dtype=jnp.float32)
  count = jnp.sum(nonzero, dtype=jnp.float32)
  return jnp.stack([saturated / x.size, flushed / jnp.maximum(count, 1.0)])


def amax(x: jax.Array) -> jax.Array:
  """max |x| over all of `x`, in float32 (NaN if `x` holds a NaN)."""
  return jnp.max(jnp.abs(x)).astype(jnp.float32)
