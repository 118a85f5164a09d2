"""The gradients' global finite check and squared norm, in few kernels.

`mixed_precision` skips a step unless every gradient entry is finite, and
reports the gradients' global L2 norm. One sum of squares gives both: each
non-finite entry adds NaN instead of its square, so the sum is NaN exactly
when some gradient is not finite. Finite squares are >= 0 and can only sum
to +inf (huge finite grads whose squares overflow float32 are still finite
and applied). So there is one read of the gradients and no conditional
besides the skip's own.

How the sum is taken decides how many kernels it costs on a GPU. XLA gives
every reduction a kernel (two to a large one summed to a scalar) and splits
a sum of concatenated arrays back into one sum per array, so summing leaf
by leaf costs GPT-2 small's 148 leaves 185 kernels. Where enough leaves are
known to be whole on each device (`whole_on_each_device`), they are summed
in a few concatenations instead, each kept whole by an optimization barrier.
A leaf that may be split over devices (GSPMD lays arrays out after tracing)
is summed on its own shards: concatenating it would gather it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jmp_train._src import leaves

# Float32 leaves of at most this many values join one concatenation as they
# are (LayerNorm scales, biases): copying them costs less than a kernel.
SMALL_LEAF = 4096
# A larger leaf is summed over all axes but its first, when its rows hold at
# least this many values each, else summed whole; those sums are
# concatenated.
MIN_ROW = 64
# With fewer whole leaves, every leaf is summed alone. `overhead.py`'s MLP
# step with widths 512, compiled for an H100, had as many kernels leaf by
# leaf and grouped (8 leaves: 47 and 51; 12: 67 and 68; 14: 77 and 76; 20:
# 107 and 100; 28: 147 and 132): below 14 leaves XLA no longer merges the
# scalar bookkeeping after a grouped check into one kernel.
MIN_GROUPED = 14


def sq_norm_and_finite(
  grads: Any, unscale: Callable[[jax.Array], jax.Array]
) -> tuple[jax.Array, jax.Array]:
  """The squared L2 norm (float32) of `unscale`d `grads`, and whether all of
  them are finite; NaN norm on a non-finite step.

  `unscale` is elementwise (a loss scale's) and is applied to each leaf, or
  concatenation of leaves, before it is squared. Leaves below float32 are
  widened first; a float64 or complex128 leaf is summed whole in its own
  precision, then rounded to float32.
  """
  flat = jax.tree.leaves(grads)
  if not flat:
    return jnp.zeros([], jnp.float32), jnp.array(True)

  def squares(g):  # NaN where g is not finite; float64 stays float64
    g = leaves.widen(unscale(g))
    if jnp.issubdtype(g.dtype, jnp.complexfloating):  # |g|^2
      square = jnp.square(jnp.real(g)) + jnp.square(jnp.imag(g))
    else:
      square = jnp.square(g)
    return jnp.where(jnp.isfinite(g), square, jnp.nan)

  def sq_sum(g):
    return jnp.sum(squares(g)).astype(jnp.float32)

  def row_sums(g):  # a short float32 vector whose sum is the leaf's
    sq = squares(g)
    rows = g.ndim >= 2 and g.shape[0] * MIN_ROW <= g.size
    if rows and sq.dtype == jnp.float32:  # float64: summed whole
      return jnp.sum(sq, axis=tuple(range(1, g.ndim)))
    return jnp.sum(sq).astype(jnp.float32)[None]

  def in_one(arrays):  # one array, which XLA does not split again
    return jax.lax.optimization_barrier(jnp.concatenate(arrays))

  whole = [whole_on_each_device(g) for g in flat]
  if sum(whole) < MIN_GROUPED:
    whole = [False] * len(flat)
  total = jnp.zeros([], jnp.float32)
  small, sums = [], []
  for g, grouped in zip(flat, whole, strict=True):
    if not grouped:
      total += sq_sum(g)
    elif g.size <= SMALL_LEAF and g.dtype == jnp.float32:
      small.append(g.ravel())  # squared after the concatenation
    else:
      sums.append(row_sums(g))
  if small:
    total += jnp.sum(squares(in_one(small)))
  if sums:
    total += jnp.sum(in_one(sums))
  return total, ~jnp.isnan(total)


def whole_on_each_device(x: jax.Array) -> bool:
  """Whether each device holding `x` holds all of it, as far as is known
  while tracing: always where the process sees one device
  (`jax.device_count()`, every process's devices); else where `x`'s type
  carries its layout (no Auto mesh axis larger than 1: Explicit axes, or
  Manual ones inside `shard_map`) and that layout replicates it. Under Auto
  axes GSPMD lays arrays out after tracing, so nothing is known."""
  if jax.device_count() == 1:
    return True
  sharding = jax.typeof(x).sharding
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or mesh.empty:
    return False
  auto = jax.sharding.AxisType.Auto
  for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True):
    if kind == auto and mesh.shape[name] > 1:
      return False
  spec = sharding.spec
  if getattr(spec, "unreduced", None) or getattr(spec, "reduced", None):
    return False  # a partial sum on each device, or meant to become one
  return all(entry is None for entry in spec)
