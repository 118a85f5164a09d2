"""The FP8 matmul: `lax.dot_general` with scaled FP8 operands, as a custom VJP.

A matmul `y = x @ w` runs in FP8 as

    q_x = fp8(clip(x * s_x))    q_w = fp8(clip(w * s_w))      (forward)
    y   = (q_x @ q_w) / (s_x * s_w)                            (f32 accumulation)
    q_g = fp8(clip(g * s_g))                                   (backward, g = dL/dy)
    dx  = (q_g @ q_w^T) / (s_g * s_w),  dw = (q_x^T @ q_g) / (s_g * s_x)

with E4M3 (max 448) for `x` and `w` and, in the "hybrid" format, E5M2 (max
57344) for `g`; the "e4m3" format uses E4M3 for `g` too. Finite values beyond
the FP8 range saturate; inf and NaN stay non-finite, so an overflow still
makes the step skip.

The scales `s` are inputs (`fp8.py` computes them from past amaxes). This
call's amaxes `max|x|, max|w|, max|g|` leave through the backward pass, as the
gradient of a zero-valued `amax` input: a function of the state cannot return
a new state from inside `jax.grad`, but it can return a gradient.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_train._src.fp8 import FP8_MAX, Fp8Recipe

DEFAULT_RECIPE = Fp8Recipe()


def _quantize(x: jax.Array, scale: jax.Array, dtype: np.dtype) -> jax.Array:
  """x * scale cast to `dtype`; finite values saturate, inf/NaN stay so."""
  fp8_max = FP8_MAX[np.dtype(dtype)]
  y = x.astype(jnp.float32) * scale
  y = jnp.where(jnp.isfinite(y), jnp.clip(y, -fp8_max, fp8_max), y)
  return y.astype(dtype)


def _amax(x: jax.Array) -> jax.Array:
  return jnp.max(jnp.abs(x)).astype(jnp.float32)


def _transpose(g, other, dimension_numbers, ndim, *, of_lhs):
  """dL/d(operand) of `dot_general(lhs, rhs)` given g = dL/dy, in float32.

  The same contraction as JAX's transpose rule, with a float32 result (JAX's
  would come out in the operand's dtype, here FP8).
  """
  (lc, rc), (lb, rb) = dimension_numbers
  xc, yc, xb, yb = (lc, rc, lb, rb) if of_lhs else (rc, lc, rb, lb)
  x_kept = [d for d in range(ndim) if d not in xc and d not in xb]
  y_kept = [d for d in range(other.ndim) if d not in yc and d not in yb]
  nb = len(xb)
  # y = dot_general(lhs, rhs) has dims [batch, lhs kept, rhs kept].
  first = nb + (0 if of_lhs else len(y_kept))
  g_x_kept = list(range(first, first + len(x_kept)))
  g_y_kept = [d for d in range(nb, g.ndim) if d not in g_x_kept]
  out = lax.dot_general(
    g,
    other,
    ((tuple(g_y_kept), tuple(y_kept)), (tuple(range(nb)), tuple(yb))),
    preferred_element_type=jnp.float32,
  )
  # out has dims [batch, x kept, the x dims paired with sorted(yc)].
  paired = [xc[list(yc).index(d)] for d in sorted(yc)]
  return lax.transpose(out, tuple(np.argsort(list(xb) + x_kept + paired)))


class _DotConfig(NamedTuple):
  dimension_numbers: tuple
  forward_dtype: np.dtype
  backward_dtype: np.dtype
  out_dtype: np.dtype
  lhs_dtype: np.dtype
  rhs_dtype: np.dtype


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_dot(cfg: _DotConfig, lhs, rhs, scale, amax):
  return _fp8_dot_fwd(cfg, lhs, rhs, scale, amax)[0]


def _fp8_dot_fwd(cfg, lhs, rhs, scale, amax):
  del amax  # only its gradient matters
  q_lhs = _quantize(lhs, scale[0], cfg.forward_dtype)
  q_rhs = _quantize(rhs, scale[1], cfg.forward_dtype)
  y = lax.dot_general(
    q_lhs, q_rhs, cfg.dimension_numbers, preferred_element_type=jnp.float32
  )
  y = (y * ((1.0 / scale[0]) * (1.0 / scale[1]))).astype(cfg.out_dtype)
  return y, (q_lhs, q_rhs, scale, _amax(lhs), _amax(rhs))


def _fp8_dot_bwd(cfg, res, g):
  q_lhs, q_rhs, scale, amax_lhs, amax_rhs = res
  q_g = _quantize(g, scale[2], cfg.backward_dtype)
  inv_g = 1.0 / scale[2]
  d_lhs = _transpose(
    q_g, q_rhs, cfg.dimension_numbers, q_lhs.ndim, of_lhs=True
  ) * (inv_g * (1.0 / scale[1]))
  d_rhs = _transpose(
    q_g, q_lhs, cfg.dimension_numbers, q_rhs.ndim, of_lhs=False
  ) * (inv_g * (1.0 / scale[0]))
  amaxes = jnp.stack([amax_lhs, amax_rhs, _amax(g)])
  return (
    d_lhs.astype(cfg.lhs_dtype),
    d_rhs.astype(cfg.rhs_dtype),
    jnp.zeros_like(scale),
    amaxes,
  )


_fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)


def _canonical(dimension_numbers) -> tuple:
  (lc, rc), (lb, rb) = dimension_numbers
  return ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))


def fp8_dot_general(
  lhs: jax.Array,
  rhs: jax.Array,
  dimension_numbers: Any,
  *,
  scale: jax.Array,
  amax: jax.Array,
  recipe: Fp8Recipe = DEFAULT_RECIPE,
  preferred_element_type: Any = None,
) -> jax.Array:
  """`lax.dot_general` in FP8 with the given scales (a pure function).

  Args:
    lhs, rhs, dimension_numbers: as for `jax.lax.dot_general`.
    scale: float32[3], the scales of lhs, rhs and the output gradient.
    amax: float32[3] of zeros; its gradient is the amaxes of lhs, rhs and
      the output gradient.
    recipe: gives the FP8 dtypes.
    preferred_element_type: the output dtype (default: lhs and rhs promoted).

  Returns:
    The product, dequantized to the output dtype.

  Example:
    >>> x, w = jnp.array([[1.0, -2.0]]), jnp.array([[3.0], [0.5]])
    >>> dn = (((1,), (0,)), ((), ()))
    >>> def f(amax):
    ...   y = fp8_dot_general(x, w, dn, scale=jnp.ones(3), amax=amax)
    ...   return y.sum()
    >>> f(jnp.zeros(3))
    Array(2., dtype=float32)
    >>> jax.grad(f)(jnp.zeros(3))  # max|x|, max|w|, max|dL/dy|
    Array([2., 3., 1.], dtype=float32)
  """
  out_dtype = np.dtype(
    preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype)
  )
  cfg = _DotConfig(
    _canonical(dimension_numbers),
    recipe.forward_dtype,
    recipe.backward_dtype,
    out_dtype,
    np.dtype(lhs.dtype),
    np.dtype(rhs.dtype),
  )
  return _fp8_dot(cfg, lhs, rhs, scale, amax)
