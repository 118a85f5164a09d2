"""The blockwise-scaled FP8 matmul (DeepSeek-V3), as a custom VJP.

Any `dot_general(lhs, rhs)` is first laid out as a batched matmul
`[B, M, K] @ [B, K, N]` (batch dims, kept dims and contracted dims each
flattened in order). With `b` the block size:

    forward   y  = x @ w      x: 1 x b tiles along K,   w: b x b blocks
    backward  dx = g @ w^T    g: 1 x b tiles along N,   w: the same blocks
              dw = x^T @ g    x and g: b x 1 tiles along M

Each tile's scale follows `fp8_recipe.current_scale` from the tile's own
amax; every operand is E4M3. A matmul over K sums `K / b` partial products
of `b` values each, each partial product of FP8 values accumulated in
float32 and multiplied by its two tiles' inverse scales before it joins the
float32 sum:

    y[m, n] = sum_k'  (q_x[m, k'] . q_w[k', n]) / (s_x[m, k'] * s_w[k', n'])

Tiles at the edges are partial: padding is zeros, which change neither an
amax nor a sum. The forward pass keeps for the backward the kernel's FP8
blocks and `x` quantized in `b x 1` tiles (FP8 values plus float32 scales),
not `x` itself.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jmp_train._src.fp8_recipe import (
  E4M3,
  FP8_MAX,
  OUTPUT_NAME,
  cast_fractions,
  current_scale,
  from_residual,
  quantize,
  to_residual,
)


def quantize_tiles(
  x: jax.Array, tile: tuple[int, int], power_of_two_scales: bool
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """E4M3 values and one scale per `tile` of the last two axes of `x`.

  Returns:
    `(q, scale, amax)`: `q` shaped like `x`, `scale` float32[...,
    ceil(R / tile[0]), ceil(C / tile[1])], and `amax` the largest tile amax
    (max |x|, NaN when `x` holds one).
  """
  *lead, rows, cols = x.shape
  tr, tc = tile
  rb, cb = -(-rows // tr), -(-cols // tc)
  pad = [(0, 0)] * len(lead) + [(0, rb * tr - rows), (0, cb * tc - cols)]
  tiles = jnp.pad(x.astype(jnp.float32), pad).reshape(*lead, rb, tr, cb, tc)
  tile_amax = jnp.max(jnp.abs(tiles), axis=(-3, -1))
  scale = current_scale(tile_amax, FP8_MAX[E4M3], power_of_two_scales)
  q = quantize(tiles, scale[..., :, None, :, None], E4M3)
  q = q.reshape(*lead, rb * tr, cb * tc)[..., :rows, :cols]
  return q, scale, jnp.max(tile_amax)


def tile_fractions(
  x: jax.Array, tile: tuple[int, int], scale: jax.Array, q: jax.Array
) -> jax.Array:
  """`cast_fractions` of `x` quantized by `quantize_tiles` to `q`, `scale`."""
  rows, cols = x.shape[-2:]
  full = jnp.repeat(jnp.repeat(scale, tile[0], axis=-2), tile[1], axis=-1)
  return cast_fractions(x, full[..., :rows, :cols], q, E4M3)


def _expand(inv: jax.Array, axis: int, tile: int, size: int) -> jax.Array:
  """Each scale repeated over the `tile` entries it covers, cut to `size`."""
  return lax.slice_in_dim(jnp.repeat(inv, tile, axis=axis), 0, size, axis=axis)


def blocked_matmul(
  qa: jax.Array,
  sa: jax.Array,
  row_tile: int,
  qb: jax.Array,
  sb: jax.Array,
  col_tile: int,
  block_size: int,
) -> jax.Array:
  """`[B, M, K] @ [B, K, N]` of FP8 tiles, promoted to float32 per K block.

  Args:
    qa, qb: the FP8 operands.
    sa: float32[B, ceil(M / row_tile), ceil(K / block_size)], qa's scales.
    row_tile: how many rows of qa share a scale (1 or block_size).
    sb: float32[B, ceil(K / block_size), ceil(N / col_tile)], qb's scales.
    col_tile: how many columns of qb share a scale.
    block_size: the length of each K block.

  Returns:
    float32[B, M, N].
  """
  batch, m, k = qa.shape
  n = qb.shape[2]
  kb = -(-k // block_size)
  pad_k = kb * block_size - k
  qa = jnp.pad(qa, [(0, 0), (0, 0), (0, pad_k)])
  qb = jnp.pad(qb, [(0, 0), (0, pad_k), (0, 0)])
  qa = qa.reshape(batch, m, kb, block_size).transpose(2, 0, 1, 3)
  qb = qb.reshape(batch, kb, block_size, n).transpose(1, 0, 2, 3)
  inv_a = _expand(1.0 / sa, 1, row_tile, m).transpose(2, 0, 1)  # [kb, B, M]
  inv_b = _expand(1.0 / sb, 2, col_tile, n).transpose(1, 0, 2)  # [kb, B, N]

  def product(a, b, ia, ib):
    part = lax.dot_general(
      a, b, (((2,), (1,)), ((0,), (0,))), preferred_element_type=jnp.float32
    )
    return part * ia[:, :, None] * ib[:, None, :]

  def one_block(acc, block):
    return acc + product(*block), None

  # The first block starts the sum (rather than zeros), so the carry has the
  # operands' type, also where they vary over a shard_map axis.
  blocks = (qa, qb, inv_a, inv_b)
  acc = product(*(x[0] for x in blocks))
  acc, _ = lax.scan(one_block, acc, tuple(x[1:] for x in blocks))
  return acc


class _Layout(NamedTuple):
  """How a dot_general maps onto `[B, M, K] @ [B, K, N]` and back."""

  lhs_perm: tuple[int, ...]  # lhs dims as (batch, kept, contracted)
  rhs_perm: tuple[int, ...]  # rhs dims as (batch, contracted, kept)
  lhs_shape: tuple[int, ...]
  rhs_shape: tuple[int, ...]
  batch_shape: tuple[int, ...]
  m_shape: tuple[int, ...]
  n_shape: tuple[int, ...]
  k: int


def _layout(dimension_numbers, lhs_shape, rhs_shape) -> _Layout:
  (lc, rc), (lb, rb) = dimension_numbers
  lk = [d for d in range(len(lhs_shape)) if d not in lc and d not in lb]
  rk = [d for d in range(len(rhs_shape)) if d not in rc and d not in rb]
  return _Layout(
    tuple(lb) + tuple(lk) + tuple(lc),
    tuple(rb) + tuple(rc) + tuple(rk),
    tuple(lhs_shape),
    tuple(rhs_shape),
    tuple(lhs_shape[d] for d in lb),
    tuple(lhs_shape[d] for d in lk),
    tuple(rhs_shape[d] for d in rk),
    math.prod(lhs_shape[d] for d in lc),
  )


def _to_matmul(lay: _Layout, lhs, rhs):
  b, m, n = (math.prod(s) for s in (lay.batch_shape, lay.m_shape, lay.n_shape))
  x = lhs.transpose(lay.lhs_perm).reshape(b, m, lay.k)
  w = rhs.transpose(lay.rhs_perm).reshape(b, lay.k, n)
  return x, w


def _back(shape, perm, value):
  """`value` laid out as `shape` permuted by `perm`, permuted back."""
  permuted = value.reshape([shape[d] for d in perm])
  return permuted.transpose(np.argsort(perm))


class _BlockConfig(NamedTuple):
  dimension_numbers: tuple
  block_size: int
  power_of_two_scales: bool
  statistics: bool
  out_dtype: np.dtype
  lhs_dtype: np.dtype
  rhs_dtype: np.dtype
  lhs_shape: tuple[int, ...]
  rhs_shape: tuple[int, ...]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _block_dot(cfg: _BlockConfig, lhs, rhs, amax):
  return _block_dot_fwd(cfg, lhs, rhs, amax)[0]


def _block_dot_fwd(cfg, lhs, rhs, amax):
  del amax  # only its gradient matters
  lay = _layout(cfg.dimension_numbers, lhs.shape, rhs.shape)
  x, w = _to_matmul(lay, lhs, rhs)
  blk, pow2 = cfg.block_size, cfg.power_of_two_scales
  q_x, s_x, amax_x = quantize_tiles(x, (1, blk), pow2)
  q_w, s_w, amax_w = quantize_tiles(w, (blk, blk), pow2)
  y = blocked_matmul(q_x, s_x, 1, q_w, s_w, blk, blk)
  y = y.reshape(lay.batch_shape + lay.m_shape + lay.n_shape)
  q_xc, s_xc, _ = quantize_tiles(x, (blk, 1), pow2)  # for dw = x^T @ g
  if cfg.statistics:  # of the forward casts
    amax_x = _with_fractions(amax_x, tile_fractions(x, (1, blk), s_x, q_x))
    amax_w = _with_fractions(amax_w, tile_fractions(w, (blk, blk), s_w, q_w))
  y = checkpoint_name(y.astype(cfg.out_dtype), OUTPUT_NAME)
  bits = to_residual(q_xc), to_residual(q_w)
  return y, (bits, s_xc, s_w, amax_x, amax_w)


def _with_fractions(amax, fractions):
  return jnp.concatenate([amax[None], fractions])


def _block_dot_bwd(cfg, res, g):
  (bits_xc, bits_w), s_xc, s_w, amax_x, amax_w = res
  q_xc, q_w = from_residual(bits_xc, E4M3), from_residual(bits_w, E4M3)
  batch, m, _ = q_xc.shape
  n = q_w.shape[2]
  blk, pow2 = cfg.block_size, cfg.power_of_two_scales
  g = g.reshape(batch, m, n)
  q_g, s_g, amax_g = quantize_tiles(g, (1, blk), pow2)
  if cfg.statistics:  # of the dgrad cast
    amax_g = _with_fractions(amax_g, tile_fractions(g, (1, blk), s_g, q_g))
  dx = blocked_matmul(
    q_g, s_g, 1, q_w.transpose(0, 2, 1), s_w.transpose(0, 2, 1), blk, blk
  )
  q_gc, s_gc, _ = quantize_tiles(g, (blk, 1), pow2)
  dw = blocked_matmul(
    q_xc.transpose(0, 2, 1), s_xc.transpose(0, 2, 1), 1, q_gc, s_gc, 1, blk
  )
  lay = _layout(cfg.dimension_numbers, cfg.lhs_shape, cfg.rhs_shape)
  return (
    _back(cfg.lhs_shape, lay.lhs_perm, dx).astype(cfg.lhs_dtype),
    _back(cfg.rhs_shape, lay.rhs_perm, dw).astype(cfg.rhs_dtype),
    jnp.stack([amax_x, amax_w, amax_g]),
  )


_block_dot.defvjp(_block_dot_fwd, _block_dot_bwd)


def block_dot_general(
  lhs: jax.Array,
  rhs: jax.Array,
  dimension_numbers: Any,
  *,
  amax: jax.Array,
  block_size: int,
  power_of_two_scales: bool,
  out_dtype: Any,
  statistics: bool = False,
) -> jax.Array:
  """`lax.dot_general` with blockwise-scaled E4M3 operands (module docstring).

  `rhs` is the kernel (`block_size` x `block_size` blocks); `lhs` and the
  output gradient get `1 x block_size` tiles. `amax` is a float32[3] of
  zeros whose gradient is max |lhs|, max |rhs| and max |dL/dy|; with
  `statistics`, a float32[3, 3] whose rows add the fractions saturated and
  flushed of the forward casts and the dgrad cast of dL/dy.
  """
  cfg = _BlockConfig(
    dimension_numbers,
    block_size,
    power_of_two_scales,
    statistics,
    np.dtype(out_dtype),
    np.dtype(lhs.dtype),
    np.dtype(rhs.dtype),
    tuple(lhs.shape),
    tuple(rhs.shape),
  )
  return _block_dot(cfg, lhs, rhs, amax)
