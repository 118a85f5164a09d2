"""Storage formats for optimizer state: fewer bytes per moment.

`mixed_precision(inner, state_formats=...)` stores the state fields of
`inner` that mirror the params (Adam's `mu` and `nu`, momentum's `trace`,
...) in one of four formats. The inner optimizer always computes in float32:
the stored values are expanded before `inner.update` and compressed after it,
and a skipped step leaves the stored bits as they were.

| format                      | bytes per value | what is kept                      |
|-----------------------------|-----------------|-----------------------------------|
| `Float32()`                 | 4               | the value                         |
| `BFloat16()`                | 2               | the value rounded to bfloat16     |
| `Float16()`                 | 2 (+4 per leaf) | value / scale, one scale per leaf |
| `FP8()`                     | 1 (+4 per group)| value / scale, one scale per group|
| `FP8(expand_range=True)`    | 1 (+8 per group)| and one exponent per group        |

`Float16` is Megatron-Core's precision-aware optimizer's float16 state: a
per-tensor `scale = absmax / (65504 / 2)`. `FP8` follows Megatron's FP8
state (`scale = absmax / 448` for E4M3, 57344 for E5M2) with COAT's groups: one
scale per `group_size` consecutive values along a leaf's last axis (the
last group of a row may be shorter), and, with `expand_range=True`, COAT's
dynamic range expansion `x -> sign(x) |x / absmax|^k` with `k` chosen per
group so that the group's smallest non-zero magnitude lands on the format's
smallest normal value. `BFloat16` is a plain cast (round to nearest even, or
stochastic with `rounding="stochastic"`).

Values beyond float32's range (an `inf` second moment after huge finite
gradients) are stored as the largest finite float32 before scaling, so a
scale is always finite; NaN stays NaN. A scale is never below float32's
smallest normal (2**-126; 0 for an all-zero group), which CPUs and GPUs
would flush to 0: a group of tiny values keeps FP8's or float16's precision
down to about 2**-126.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmp_train._src import leaves, rounding

_FP8_DTYPES = {
  "e4m3": np.dtype(jnp.float8_e4m3fn),
  "e5m2": np.dtype(jnp.float8_e5m2),
}
_FLOAT16_RANGE = float(np.finfo(np.float16).max) / 2
# float32's smallest normal. XLA divides by a broadcast scale as a multiply by
# its reciprocal, and CPUs and GPUs flush subnormals to 0: a scale below this
# (or a reciprocal below it) would be 0 and store inf or 0 for every value.
_TINY = float(np.finfo(np.float32).tiny)


@dataclasses.dataclass(frozen=True)
class Float32:
  """Store the state field in float32 (what optax keeps): 4 bytes a value.

  Example:
    >>> import jax.numpy as jnp
    >>> compress(Float32(), jnp.ones(2, jnp.bfloat16)).dtype
    dtype('float32')
  """


@dataclasses.dataclass(frozen=True)
class BFloat16:
  """Store the state field in bfloat16: 2 bytes a value, a plain cast.

  DeepSeek-V3 keeps both Adam moments in bfloat16. The cast rounds to
  nearest even, or stochastically (`rounding="stochastic"`, unbiased, with
  random bits from `seed`, the step number and the leaf's position, so a
  resumed run draws the same bits).

  Attributes:
    rounding: "nearest" or "stochastic".
    seed: an int >= 0, used by stochastic rounding.

  Example:
    >>> import jax.numpy as jnp
    >>> stored = compress(BFloat16(), jnp.array([1.0, 1.001], jnp.float32))
    >>> expand(BFloat16(), stored).tolist()
    [1.0, 1.0]
  """

  rounding: str = "nearest"
  seed: int = 0

  def __post_init__(self):
    if self.rounding not in ("nearest", "stochastic"):
      raise ValueError(
        f"BFloat16 rounding must be 'nearest' or 'stochastic', got "
        f"{self.rounding!r}."
      )
    seed = rounding.check_seed(self.seed, "BFloat16 seed")
    object.__setattr__(self, "seed", seed)


@dataclasses.dataclass(frozen=True)
class Float16:
  """Store the state field in float16 with one float32 scale per leaf.

  Megatron-Core's float16 optimizer state: `scale = absmax / (65504 / 2)`,
  stored `value / scale`, so the largest magnitude lands at half of
  float16's range and small values keep float16's 11 significant bits down
  to `absmax * 2**-30` or so. 2 bytes a value, 4 per leaf.

  Example:
    >>> import jax.numpy as jnp
    >>> stored = compress(Float16(), jnp.array([1e-3, 3e5], jnp.float32))
    >>> print(stored.values.dtype, expand(Float16(), stored))
    float16 [1.0002049e-03 3.0000000e+05]
  """


@dataclasses.dataclass(frozen=True)
class FP8:
  """Store the state field in FP8 with one float32 scale per group.

  Groups are `group_size` consecutive values along a leaf's last axis (one
  group for a scalar); `scale = absmax / fp8_max` per group (448 for E4M3,
  57344 for E5M2) and the stored value is `value / scale` rounded to nearest
  even. With `expand_range=True`, COAT's dynamic range expansion: each group
  stores `sign(x) |x / absmax|^k` with `k = log(fp8_min_normal / fp8_max) /
  log(min_nonzero |x| / absmax)`, so the group's magnitudes fill the
  format's normal range, and one float32 `k` per group; expanding inverts
  the power.

  Attributes:
    dtype: "e4m3" (float8_e4m3fn, the default) or "e5m2".
    group_size: values per scale, an int >= 1 (128 by default, COAT's).
    expand_range: apply COAT's per-group range expansion.

  Example:
    >>> import jax.numpy as jnp
    >>> x = jnp.array([0.5, -1.0, 2.0, 100.0], jnp.float32)
    >>> stored = compress(FP8(group_size=2), x)
    >>> stored.values.dtype, (stored.scale == jnp.array([1.0, 100.0]) / 448)
    (dtype(float8_e4m3fn), Array([ True,  True], dtype=bool))
    >>> [round(v, 3) for v in expand(FP8(group_size=2), stored).tolist()]
    [0.5, -1.0, 2.009, 100.0]
  """

  dtype: str = "e4m3"
  group_size: int = 128
  expand_range: bool = False

  def __post_init__(self):
    if self.dtype not in _FP8_DTYPES:
      raise ValueError(
        f"FP8 dtype must be 'e4m3' or 'e5m2', got {self.dtype!r}."
      )
    leaves.check_int(self.group_size, "FP8 group_size", 1)
    object.__setattr__(self, "group_size", int(self.group_size))
    leaves.check_bool(self.expand_range, "FP8 expand_range")
    object.__setattr__(self, "expand_range", bool(self.expand_range))


StateFormat = Float32 | BFloat16 | Float16 | FP8

FORMATS = (Float32, BFloat16, Float16, FP8)
ACCEPTED = "jmp_train.state_format.Float32(), BFloat16(), Float16() or FP8(...)"


def check(value: Any, name: str) -> StateFormat:
  """`value` if it is a format, else a TypeError naming `name`."""
  if isinstance(value, FORMATS):
    return value
  hint = ""
  if isinstance(value, type) and issubclass(value, FORMATS):
    hint = f" (a class; pass an instance: {value.__name__}())"
  raise TypeError(f"{name} must be {ACCEPTED}, got {value!r}{hint}.")


class Scaled(NamedTuple):
  """A state leaf stored below float32 with its scales.

  Attributes:
    values: the stored values (float16 or FP8), the leaf's shape.
    scale: float32; `()` for `Float16`, the leaf's shape with the last axis
      cut to its number of groups for `FP8`.
    power: COAT's per-group exponent `k` (float32, `scale`'s shape), or None.
  """

  values: jax.Array
  scale: jax.Array
  power: jax.Array | None = None


def _finite(x: jax.Array) -> jax.Array:
  """`x` with +-inf as the largest finite float32 (NaN kept)."""
  big = jnp.finfo(jnp.float32).max
  return jnp.clip(x.astype(jnp.float32), -big, big)


def _absmax(x: jax.Array, axis: Any = None) -> jax.Array:
  """The largest magnitude, NaN ignored (a NaN keeps its own value NaN and
  leaves the other values their precision)."""
  magnitude = jnp.abs(x)
  return jnp.max(jnp.where(jnp.isnan(magnitude), 0.0, magnitude), axis=axis)


def _scale(amax: jax.Array, top: float) -> tuple[jax.Array, jax.Array]:
  """`(divisor, stored scale)` that put `amax` at `top`.

  The divisor is floored at float32's smallest normal; the stored scale is
  0 for an all-zero group or leaf (ZeRO-1's padding among them), the bits
  zero-padding gives it.
  """
  nonzero = amax > 0
  divisor = jnp.maximum(jnp.where(nonzero, amax, 1.0) / top, _TINY)
  return divisor, jnp.where(nonzero, divisor, 0.0)


def _groups(x: jax.Array, size: int) -> jax.Array:
  """`x` (..., L) as (..., ceil(L / size), size), zero-padded.

  Under Explicit mesh axes (the trace `zero1.make_plan` reads shardings
  from) a split of a sharded last axis keeps the sharding where the number
  of groups divides over it, and is replicated otherwise.
  """
  if x.ndim == 0:
    x = x.reshape(1)
  length = x.shape[-1]
  count = -(-length // size)
  sharding = _explicit_sharding(x)
  keep = sharding is not None and count % _last_axis_size(sharding, x.ndim) == 0
  if sharding is not None and not keep:
    # Replicated along the last axis before the padding: `jnp.pad` cannot
    # give a sharded axis a length its devices do not divide (204 on 6
    # devices, padded to 256), and the groups are replicated anyway.
    x = jax.sharding.reshard(x, _with_last(sharding, x.ndim, None))
  if count * size != length:
    widths = [(0, 0)] * (x.ndim - 1) + [(0, count * size - length)]
    x = jnp.pad(x, widths)
  shape = x.shape[:-1] + (count, size)
  out_sharding = None
  if sharding is not None:
    last = _spec(sharding, x.ndim)[-1] if keep else None
    out_sharding = _with_last(sharding, x.ndim, last, None)
  return jax.lax.reshape(x, shape, out_sharding=out_sharding)


def _spec(sharding: Any, ndim: int) -> tuple:
  return tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))


def _last_axis_size(sharding: Any, ndim: int) -> int:
  """How many devices the last of `ndim` axes is split over."""
  last = _spec(sharding, ndim)[-1]
  names = last if isinstance(last, tuple) else (last,)
  return math.prod(sharding.mesh.shape[a] for a in names if a is not None)


def _with_last(sharding: Any, ndim: int, *last: Any) -> Any:
  """`sharding` with its last axis's entry replaced by the entries `last`."""
  spec = _spec(sharding, ndim)[:-1] + last
  return jax.sharding.NamedSharding(
    sharding.mesh, jax.sharding.PartitionSpec(*spec)
  )


def _explicit_sharding(x: jax.Array) -> Any:
  """`x`'s sharding where it is part of its type (Explicit mesh axes)."""
  sharding = jax.typeof(x).sharding
  spec = tuple(getattr(sharding, "spec", ()) or ())
  if getattr(sharding, "mesh", None) is None or all(s is None for s in spec):
    return None
  return sharding


def _like(y: jax.Array, x: jax.Array) -> jax.Array:
  """`y` (shaped like `x`) with `x`'s Explicit sharding, if it has one: the
  stored values are laid out as the param they mirror."""
  sharding = _explicit_sharding(x)
  return y if sharding is None else jax.sharding.reshard(y, sharding)


def _ungroup(g: jax.Array, shape: tuple) -> jax.Array:
  """The inverse of `_groups`: (..., count, size) back to `shape`."""
  flat = g.reshape(g.shape[:-2] + (g.shape[-2] * g.shape[-1],))
  if not shape:
    return flat[0]
  return flat[..., : shape[-1]]


def _fp8_compress(fmt: FP8, x: jax.Array) -> Scaled:
  dtype = _FP8_DTYPES[fmt.dtype]
  info = jnp.finfo(dtype)
  fp8_max = float(info.max)
  g = _groups(_finite(x), fmt.group_size)
  magnitude = jnp.abs(g)
  amax = _absmax(g, axis=-1)
  power = None
  if fmt.expand_range:
    # COAT: |x / amax| in (0, 1] raised to k fills [fp8 min normal, 1].
    # An exact power of two first brings amax below 2**64, so that the
    # reciprocal XLA multiplies by stays normal (for an amax up to inf).
    nonzero = amax > 0
    safe_amax = jnp.where(nonzero, amax, 1.0)
    shift = jnp.where(safe_amax > 2.0**64, 2.0**-64, 1.0)
    z = (magnitude * shift[..., None]) / (safe_amax * shift)[..., None]
    z_min = jnp.min(jnp.where(z > 0, z, 1.0), axis=-1)
    target = float(np.log(float(info.smallest_normal) / fp8_max))
    power = jnp.where(z_min < 1.0, target / jnp.log(z_min), 1.0)
    y = jnp.sign(g) * jnp.power(z, power[..., None])
    values = jnp.clip(y * fp8_max, -fp8_max, fp8_max)
    # An all-zero group stores scale 0 and power 0, as zero-padding does.
    power = jnp.where(nonzero, power, 0.0)
    scale = amax  # expand multiplies |y|^(1/k) by it
  else:
    divisor, scale = _scale(amax, fp8_max)
    values = jnp.clip(g / divisor[..., None], -fp8_max, fp8_max)
  values = _like(_ungroup(values, x.shape).astype(dtype), x)
  if x.ndim == 0:
    scale, power = scale[0], None if power is None else power[0]
  return Scaled(values, scale, power)


def _fp8_expand(fmt: FP8, stored: Scaled) -> jax.Array:
  fp8_max = float(jnp.finfo(_FP8_DTYPES[fmt.dtype]).max)
  shape = stored.values.shape
  scale, power = stored.scale, stored.power
  if not shape:
    scale = scale.reshape(1)
    power = None if power is None else power.reshape(1)
  g = _groups(stored.values.astype(jnp.float32), fmt.group_size)
  if power is None:
    out = g * scale[..., None]
  else:
    z = jnp.abs(g) / fp8_max
    inverse = 1.0 / jnp.where(power > 0, power, 1.0)
    out = jnp.sign(g) * jnp.power(z, inverse[..., None])
    out = out * scale[..., None]
  return _like(_ungroup(out, shape), stored.values)


def compress(fmt: StateFormat, x: jax.Array, key: Any = None) -> Any:
  """`x` (a float32 or wider state leaf) stored in `fmt`.

  `mixed_precision(state_formats=...)` calls it after each update; call it
  to see what a format keeps of a value.

  Args:
    fmt: the format.
    x: a real floating array.
    key: a PRNG key, used by `BFloat16(rounding="stochastic")` only.

  Returns:
    An array (`Float32`, `BFloat16`) or a `Scaled` (`Float16`, `FP8`).

  Raises:
    ValueError: stochastic rounding without a key.

  Example:
    >>> import jax.numpy as jnp
    >>> stored = compress(FP8(group_size=4), jnp.arange(8.0))
    >>> stored.values.shape, stored.scale.shape
    ((8,), (2,))
  """
  if isinstance(fmt, Float32):
    return x.astype(jnp.float32)
  if isinstance(fmt, BFloat16):
    if fmt.rounding == "stochastic":
      if key is None:
        raise ValueError("BFloat16(rounding='stochastic') needs a key.")
      return rounding.cast_stochastic(x.astype(jnp.float32), jnp.bfloat16, key)
    return x.astype(jnp.bfloat16)
  if isinstance(fmt, Float16):
    wide = _finite(x)
    amax = _absmax(wide) if wide.size else jnp.float32(0)
    divisor, scale = _scale(amax, _FLOAT16_RANGE)
    return Scaled((wide / divisor).astype(jnp.float16), scale)
  return _fp8_compress(fmt, x)


def expand(fmt: StateFormat, stored: Any, dtype: Any = jnp.float32) -> Any:
  """The value of a leaf that `compress(fmt, ...)` stored.

  Read a stored state field with it, e.g. Adam's first moment of param `w`:
  `expand(fmt, opt_state.inner_state[0].mu["w"])`.

  Args:
    fmt: the format it was stored in.
    stored: what `compress` returned.
    dtype: the dtype to return (float32 by default).

  Returns:
    An array of `dtype`, shaped like the value that was stored.

  Example:
    >>> import jax.numpy as jnp
    >>> x = jnp.array([3.0, -0.0625, 0.0])
    >>> [round(v, 4) for v in expand(Float16(), compress(Float16(), x)).tolist()]
    [3.0, -0.0625, 0.0]
  """
  if isinstance(fmt, (Float32, BFloat16)):
    return stored.astype(dtype)
  if isinstance(fmt, Float16):
    return (stored.values.astype(jnp.float32) * stored.scale).astype(dtype)
  return _fp8_expand(fmt, stored).astype(dtype)
