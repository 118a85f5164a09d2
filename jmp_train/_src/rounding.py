"""Stochastic rounding from float32 to bfloat16 or float16.

Round-to-nearest loses every update smaller than half a unit in the last
place (ulp): a bfloat16 param near 1.0 ignores updates below 2**-9. Stochastic
rounding rounds `x` up to the next representable value `hi` with probability
`(x - lo) / (hi - lo)` and down to `lo` otherwise, so the rounded value equals
`x` on average and small updates survive in expectation (Gupta et al. 2015).
"""

from __future__ import annotations

import math
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import threefry2x32_p

from jmp_train._src import leaves

T = TypeVar("T")

_TARGETS = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
_WIDE = (np.dtype(jnp.float32), np.dtype(jnp.float64))


def _round_to_bfloat16(x: jax.Array, noise: jax.Array) -> jax.Array:
  """float32 `x` rounded stochastically to bfloat16, on its bits.

  bfloat16 is the top half of a float32, and within a binade a float32's
  bits grow linearly with its magnitude: adding 16 uniform random bits
  (`noise`) to the low half and cutting it off rounds the magnitude up with
  probability `low half / 2**16 = (|x| - |lo|) / (|hi| - |lo|)`, the rule.
  One add and one mask per value (torchao's trick), instead of finding both
  neighbours.
  """
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  mask = jnp.uint32(0xFFFF0000)
  up = (bits + noise.astype(jnp.uint32)) & mask
  up = jax.lax.bitcast_convert_type(up, jnp.float32)
  # inf/NaN (whose payload the add could change), values beyond bfloat16's
  # largest finite value (whose upper neighbour is inf), and float32
  # subnormals (which CPU and GPU arithmetic flushes to zero) round to
  # nearest, as a cast does.
  plain = ~jnp.isfinite(x) | (jnp.abs(x) > float(jnp.finfo(jnp.bfloat16).max))
  plain |= jnp.abs(x) < jnp.finfo(jnp.float32).tiny
  return jnp.where(plain, x.astype(jnp.bfloat16), up.astype(jnp.bfloat16))


def draw(key: jax.Array, shape: tuple, wide: Any, dtype: Any) -> jax.Array:
  """The random values that round an array of `shape` from `wide` to
  `dtype` (`round_leaf`'s `noise`): 16 random bits a value from float32 to
  bfloat16, else a uniform [0, 1) in `wide`.

  Drawn apart from the rounding, they can be drawn outside a conditional
  that rounds (`mixed_precision`'s skip): XLA:GPU keeps a conditional whose
  branch draws random numbers, and turns one without into selects.
  """
  if np.dtype(wide) == jnp.float32 and np.dtype(dtype) == jnp.bfloat16:
    return jax.random.bits(key, shape, jnp.uint16)
  return jax.random.uniform(key, shape, wide)


def draw_for_one(key: jax.Array, shape: tuple, wide: Any, dtype: Any):
  """What `cast_stochastic(x, dtype, key)` draws for one array `x` of
  `shape` and dtype `wide` (it splits `key` once per leaf)."""
  return draw(jax.random.split(key, 1)[0], shape, wide, dtype)


def round_leaf(x: jax.Array, dtype: Any, noise: jax.Array) -> jax.Array:
  """float32/float64 `x` rounded stochastically to `dtype` with `noise`
  (`draw(key, x.shape, x.dtype, dtype)`)."""
  if x.dtype == jnp.float32 and dtype == jnp.bfloat16:
    return _round_to_bfloat16(x, noise)
  wide = x.dtype
  nearest = x.astype(dtype)
  near = nearest.astype(wide)
  # The representable neighbour on the other side of x.
  toward = jnp.where(near < x, jnp.inf, -jnp.inf).astype(dtype)
  other = jnp.nextafter(nearest, toward).astype(wide)
  lo, hi = jnp.minimum(near, other), jnp.maximum(near, other)
  # Scaled by a power of two to magnitude ~1 (exact), so that x - lo (within
  # one target ulp) and hi - lo (a power of two) are exact and never
  # subnormal, which CPU and GPU arithmetic would flush to zero.
  _, exponent = jnp.frexp(jnp.maximum(jnp.abs(lo), jnp.abs(hi)))
  x_, lo_, hi_ = (jnp.ldexp(v, -exponent) for v in (x, lo, hi))
  p_up = (x_ - lo_) / (hi_ - lo_)
  up = noise < p_up
  rounded = jnp.where(up, hi, lo)
  # Exact values, inf/NaN, values beyond the largest finite target value
  # (whose upper neighbour is inf), and float32 subnormals (which CPU and GPU
  # arithmetic flushes to zero) round to nearest, as a plain cast does.
  plain = (near == x) | ~jnp.isfinite(x) | ~jnp.isfinite(hi) | ~jnp.isfinite(lo)
  plain |= jnp.abs(x) < jnp.finfo(wide).tiny
  return jnp.where(plain, near, rounded).astype(dtype)


def cast_stochastic(tree: T, dtype: Any, key: jax.Array) -> T:
  """Casts the float32/float64 leaves of `tree` to `dtype`, rounding stochastically.

  Each value rounds to one of its two neighbours in `dtype`, up with
  probability proportional to its distance from the lower one: unbiased, with
  variance `(x - lo) * (hi - lo - (x - lo))` per value. Leaves already in
  bfloat16 or float16 are cast plainly; integer, boolean, float8 and
  non-array leaves are returned untouched. Inf and NaN stay inf and NaN;
  values beyond the largest finite `dtype` value, and float32 subnormals
  (below 1.2e-38, flushed to zero by accelerator arithmetic), round to
  nearest.

  Args:
    tree: a pytree of arrays.
    dtype: `jnp.bfloat16` or `jnp.float16`.
    key: a JAX PRNG key; each leaf uses its own subkey.

  Returns:
    `tree` with its float32/float64 leaves in `dtype`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> x = jnp.full((10000,), 1.0 + 2.0**-10, jnp.float32)  # 1/8 of a bf16 ulp
    >>> y = cast_stochastic(x, jnp.bfloat16, jax.random.key(0))
    >>> sorted(set(y.tolist()))
    [1.0, 1.0078125]
    >>> round(float(y.astype(jnp.float32).mean()), 3)
    1.001
  """
  try:
    dtype = np.dtype(dtype)
  except TypeError:
    dtype = None
  if dtype not in _TARGETS:
    raise ValueError(
      f"cast_stochastic rounds to bfloat16 or float16, got dtype {dtype!r}."
    )
  flat, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(key, max(len(flat), 1))

  def cast(x, k):
    is_array = isinstance(x, (jax.Array, np.ndarray, np.generic))
    if not (is_array and leaves.is_real_float(x)):
      return x
    if x.dtype in _WIDE:
      x = jnp.asarray(x)
      return round_leaf(x, dtype, draw(k, x.shape, x.dtype, dtype))
    return jnp.asarray(x).astype(dtype)

  return jax.tree.unflatten(
    treedef, [cast(x, k) for x, k in zip(flat, keys, strict=False)]
  )


# Streams of random bits, so that two users of one seed never share bits.
PARAM_STREAM = 0  # `StochasticRounding` params
STATE_STREAM = 1  # `BFloat16(rounding="stochastic")` optimizer state


def check_seed(value: Any, name: str) -> int:
  """`value` if it is an int in [0, 2**63), which `jax.random.key` takes;
  else a ValueError naming `name`."""
  seed = leaves.check_int(value, name)
  if seed >= 2**63:
    raise ValueError(f"{name} must be an int in [0, 2**63), got {value!r}.")
  return seed


def leaf_key(seed: int, stream: int, steps: Any, index: int) -> jax.Array:
  """The key of one leaf's stochastic rounding at update `steps`, where it
  does not round float32 to bfloat16 (those draw from `stream_key`).

  A function of the seed, the stream, the update's index (the
  `mixed_precision` state's `steps` before it) and the leaf's position only,
  so a resumed run draws the same bits.
  """
  key = jax.random.fold_in(jax.random.key(seed), stream)
  return jax.random.fold_in(jax.random.fold_in(key, steps), index)


def stream_key(seed: int, stream: int, steps: Any) -> jax.Array:
  """The threefry key of one stream's bfloat16 stochastic rounding at update
  `steps` (the `mixed_precision` state's `steps` before it), whatever
  `jax_default_prng_impl` says: `stream_bits` counts from it."""
  key = jax.random.fold_in(jax.random.key(seed, impl="threefry2x32"), stream)
  return jax.random.fold_in(key, steps)


# Values per draw where `stream_bits` draws many arrays at once (an array of
# more is drawn alone). XLA:CPU holds the draws' 32-bit words at once: at
# 2**20 values GPT-2 small's update holds what drawing leaf by leaf held
# (`benchmarks/rounding_memory.py`).
MAX_DRAW = 2**20


def stream_bits(
  key: jax.Array, shapes: list, grouped: bool, layouts: list | None = None
) -> list:
  """16 random bits (uint16) for each value of arrays of `shapes`, counted
  along one stream: value `j` (row-major) of the `k`-th array takes the
  stream's value `offset_k + j`, `offset_k` the sizes of the arrays before
  it. So they are `jax.random.bits(key, (total,), jnp.uint16)` cut into
  `shapes` (with JAX's default `jax_threefry_partitionable=True`): the low
  16 bits of `x1 ^ x2`, `(x1, x2)` threefry2x32 of `key` and the 64-bit
  counter.

  `grouped=True` draws consecutive arrays together, up to `MAX_DRAW` values
  a draw, and slices: a few threefry calls in the compiled program instead
  of one per array, which XLA compiles several times faster (and XLA:GPU
  fuses into the kernels that round). With `grouped=False` (where GSPMD
  may split the arrays over devices) each is drawn in its own shape from
  its own counters, which GSPMD can partition, in its layout where
  `layouts` gives one (`layout_of`: an Explicit mesh's). The bits are the
  same either way.
  """
  sizes = [math.prod(shape) for shape in shapes]
  words = jax.random.key_data(key)
  offsets = np.cumsum([0, *sizes]).tolist()
  if not grouped:
    layouts = [None] * len(shapes) if layouts is None else layouts
    return [
      _bits(words, start, shape, layout)
      for start, shape, layout in zip(
        offsets[:-1], shapes, layouts, strict=True
      )
    ]
  out, first = [], 0
  while first < len(shapes):
    if sizes[first] > MAX_DRAW:  # a draw of its own, in its shape
      out.append(_bits(words, offsets[first], shapes[first]))
      first += 1
      continue
    last = first + 1  # arrays first..last-1 in one draw
    while last < len(shapes) and offsets[last + 1] - offsets[first] <= MAX_DRAW:
      last += 1
    drawn = _bits(words, offsets[first], (offsets[last] - offsets[first],))
    for k in range(first, last):
      start = offsets[k] - offsets[first]
      piece = jax.lax.slice(drawn, (start,), (start + sizes[k],))
      out.append(piece.reshape(shapes[k]))
    first = last
  return out


def _bits(
  words: jax.Array, start: int, shape: tuple, layout: Any = None
) -> jax.Array:
  """The stream's 16 bits at counters `start + row-major index`, in
  `shape` and `layout`."""
  hi, lo = counters(start, shape, layout)
  x1, x2 = threefry2x32_p.bind(words[0], words[1], hi, lo)
  return (x1 ^ x2).astype(jnp.uint16)


# Where an iota times its stride stops fitting one uint32 word (a test
# lowers it to take the two-word product on small shapes).
ONE_WORD = 2**32


def counters(start: int, shape: tuple, layout: Any = None) -> tuple:
  """`start` plus each value's row-major index in `shape`, as the high and
  low uint32 words of a 64-bit counter (mod 2**64), built from iotas in
  `layout` so that each device computes its own part's."""
  hi = jnp.full(
    shape, start >> 32 & 0xFFFFFFFF, jnp.uint32, out_sharding=layout
  )
  lo = jnp.full(shape, start & 0xFFFFFFFF, jnp.uint32, out_sharding=layout)
  stride = 1
  for axis in reversed(range(len(shape))):
    # An axis of one value (or none) adds nothing to any counter, and its
    # stride may not fit one word: (1, 2**32) would not make a uint32.
    if shape[axis] > 1:
      iota = jax.lax.broadcasted_iota(
        jnp.uint32, shape, axis, out_sharding=layout
      )
      if stride * (shape[axis] - 1) < ONE_WORD:  # the product fits a word
        zero = jnp.zeros_like(iota)
        hi, lo = add_wide(hi, lo, zero, iota * jnp.uint32(stride))
      else:
        hi, lo = add_wide(hi, lo, *mul_wide(iota, stride))
    stride *= shape[axis]
  return hi, lo


def mul_wide(a: jax.Array, b: int) -> tuple:
  """uint32 `a` times the int `b` (below 2**64), mod 2**64, as (high, low)
  uint32 words: 16-bit halves, so no product leaves 32 bits."""
  b_lo, b_hi = b & 0xFFFFFFFF, b >> 32 & 0xFFFFFFFF
  a0, a1 = a & jnp.uint32(0xFFFF), a >> jnp.uint32(16)
  c0, c1 = jnp.uint32(b_lo & 0xFFFF), jnp.uint32(b_lo >> 16)
  mid = a0 * c1
  mid2 = mid + a1 * c0
  mid_carry = (mid2 < mid).astype(jnp.uint32)  # a carry worth 2**48
  low = a0 * c0
  lo = low + (mid2 << jnp.uint32(16))
  hi = (
    a1 * c1
    + (mid2 >> jnp.uint32(16))
    + (mid_carry << jnp.uint32(16))
    + (lo < low).astype(jnp.uint32)
  )
  return hi + a * jnp.uint32(b_hi), lo


def add_wide(hi: jax.Array, lo: jax.Array, hi2: jax.Array, lo2: jax.Array):
  """(hi, lo) + (hi2, lo2) as 64-bit numbers in uint32 words, mod 2**64."""
  total = lo + lo2
  return hi + hi2 + (total < lo).astype(jnp.uint32), total


def layout_of(x: Any) -> Any:
  """`x`'s layout where its type carries one that splits it over devices
  (a `NamedSharding` over Explicit mesh axes), else None: the layout
  `stream_bits` draws `x`'s bits in, so each device draws its own part."""
  sharding = jax.typeof(x).sharding
  spec, mesh = getattr(sharding, "spec", None), getattr(sharding, "mesh", None)
  if spec is None or mesh is None or mesh.empty:
    return None
  named = [
    n
    for e in spec
    if e is not None
    for n in (e if isinstance(e, tuple) else (e,))
  ]
  kinds = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
  explicit = jax.sharding.AxisType.Explicit
  if not named or any(kinds.get(n) != explicit for n in named):
    return None
  return sharding
