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

Under delayed scaling the scales `s` are inputs (`fp8.py` computes them from
past amaxes); under current scaling each is `fp8_max / amax` of the tensor
being cast (`fp8_recipe.current_scale`), computed here. Blockwise scaling has
its own matmul (`fp8_block.py`). This call's amaxes `max|x|, max|w|, max|g|` leave through the backward pass, as the
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
from jax.ad_checkpoint import checkpoint_name

from jmp_train._src import fp8_block
from jmp_train._src.fp8_param import Fp8Param, Fp8ParamWithGrad
from jmp_train._src.fp8_recipe import (
  DEFAULT_RECIPE,
  FP8_MAX,
  OUTPUT_NAME,
  BlockwiseScaling,
  Recipe,
  cast_fractions,
  current_scale,
  from_residual,
  is_delayed,
  to_residual,
)
from jmp_train._src.fp8_recipe import amax as _amax
from jmp_train._src.fp8_recipe import quantize as _quantize


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
  current: bool  # scales from this call's amaxes (else the `scale` input)
  power_of_two_scales: bool
  statistics: bool  # also the fractions saturated and flushed


def _channel(cfg: _DotConfig, amax, x, scale, q, dtype):
  """What one tensor sends back through the `amax` gradient."""
  if not cfg.statistics:
    return amax
  fractions = cast_fractions(x, scale, q, dtype)
  return jnp.concatenate([amax[None], fractions])


def _scale_of(cfg: _DotConfig, x_amax, given, dtype):
  """The scale a tensor is cast with: the given one, or its current one."""
  if not cfg.current:
    return given
  return current_scale(x_amax, FP8_MAX[dtype], cfg.power_of_two_scales)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_dot(cfg: _DotConfig, lhs, rhs, scale, amax):
  return _fp8_dot_fwd(cfg, lhs, rhs, scale, amax)[0]


def _fp8_dot_fwd(cfg, lhs, rhs, scale, amax):
  del amax  # only its gradient matters
  amax_lhs, amax_rhs = _amax(lhs), _amax(rhs)
  s_lhs = _scale_of(cfg, amax_lhs, scale[0], cfg.forward_dtype)
  s_rhs = _scale_of(cfg, amax_rhs, scale[1], cfg.forward_dtype)
  q_lhs = _quantize(lhs, s_lhs, cfg.forward_dtype)
  q_rhs = _quantize(rhs, s_rhs, cfg.forward_dtype)
  y = lax.dot_general(
    q_lhs, q_rhs, cfg.dimension_numbers, preferred_element_type=jnp.float32
  )
  # One inverse scale at a time: their product alone can fall below
  # float32's normal range (flushed to 0) where the result does not.
  y = (y * (1.0 / s_lhs) * (1.0 / s_rhs)).astype(cfg.out_dtype)
  y = checkpoint_name(y, OUTPUT_NAME)
  sent_lhs = _channel(cfg, amax_lhs, lhs, s_lhs, q_lhs, cfg.forward_dtype)
  sent_rhs = _channel(cfg, amax_rhs, rhs, s_rhs, q_rhs, cfg.forward_dtype)
  bits = to_residual(q_lhs), to_residual(q_rhs)
  return y, (*bits, s_lhs, s_rhs, scale, sent_lhs, sent_rhs)


def _fp8_dot_bwd(cfg, res, g):
  bits_lhs, bits_rhs, s_lhs, s_rhs, scale, sent_lhs, sent_rhs = res
  q_lhs = from_residual(bits_lhs, cfg.forward_dtype)
  q_rhs = from_residual(bits_rhs, cfg.forward_dtype)
  amax_g = _amax(g)
  s_g = _scale_of(cfg, amax_g, scale[2], cfg.backward_dtype)
  q_g = _quantize(g, s_g, cfg.backward_dtype)
  sent_g = _channel(cfg, amax_g, g, s_g, q_g, cfg.backward_dtype)
  inv_g = 1.0 / s_g
  d_lhs = (
    _transpose(q_g, q_rhs, cfg.dimension_numbers, q_lhs.ndim, of_lhs=True)
    * inv_g
    * (1.0 / s_rhs)
  )
  d_rhs = (
    _transpose(q_g, q_lhs, cfg.dimension_numbers, q_rhs.ndim, of_lhs=False)
    * inv_g
    * (1.0 / s_lhs)
  )
  amaxes = jnp.stack([sent_lhs, sent_rhs, sent_g])
  return (
    d_lhs.astype(cfg.lhs_dtype),
    d_rhs.astype(cfg.rhs_dtype),
    jnp.zeros_like(scale),
    amaxes,
  )


_fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _param_dot(cfg: _DotConfig, lhs, rhs: Fp8Param, scale, amax):
  return _param_dot_fwd(cfg, lhs, rhs, scale, amax)[0]


def _param_dot_fwd(cfg, lhs, rhs, scale, amax):
  """`_fp8_dot_fwd` with a kernel already in FP8 (an `Fp8Param`)."""
  del amax  # only its gradient matters
  amax_lhs = _amax(lhs)
  s_lhs = _scale_of(cfg, amax_lhs, scale[0], cfg.forward_dtype)
  q_lhs = _quantize(lhs, s_lhs, cfg.forward_dtype)
  q_rhs, inv_rhs = rhs.values, rhs.scale_inv
  y = lax.dot_general(
    q_lhs, q_rhs, cfg.dimension_numbers, preferred_element_type=jnp.float32
  )
  y = checkpoint_name(
    (y * (1.0 / s_lhs) * inv_rhs).astype(cfg.out_dtype), OUTPUT_NAME
  )
  sent_lhs = _channel(cfg, amax_lhs, lhs, s_lhs, q_lhs, cfg.forward_dtype)
  # The weight's amax, from its FP8 values (exact: they were cast with a
  # power-of-two scale, and none saturated).
  sent_rhs = _amax(q_rhs) * inv_rhs
  # The kernel's FP8 values come back from `rhs`, whose data is uint8.
  res = (to_residual(q_lhs), s_lhs, inv_rhs, scale, sent_lhs, sent_rhs, rhs)
  return y, res


def _param_dot_bwd(cfg, res, g):
  bits_lhs, s_lhs, inv_rhs, scale, sent_lhs, sent_rhs, rhs = res
  q_lhs = from_residual(bits_lhs, cfg.forward_dtype)
  q_rhs = rhs.values
  if not isinstance(rhs, Fp8ParamWithGrad):
    raise ValueError(
      "An FP8 matmul was differentiated through an Fp8Param kernel that has "
      "no gradient slot, so the kernel's gradient would be lost: "
      "differentiate with respect to "
      "jmp_train.fp8.with_grad_slots(params) and read the gradients with "
      "jmp_train.fp8.grads_of(grads) (the train step does both)."
    )
  amax_g = _amax(g)
  s_g = _scale_of(cfg, amax_g, scale[2], cfg.backward_dtype)
  q_g = _quantize(g, s_g, cfg.backward_dtype)
  sent_g = _channel(cfg, amax_g, g, s_g, q_g, cfg.backward_dtype)
  inv_g = 1.0 / s_g
  d_lhs = (
    _transpose(q_g, q_rhs, cfg.dimension_numbers, q_lhs.ndim, of_lhs=True)
    * inv_g
    * inv_rhs
  )
  d_rhs = (
    _transpose(q_g, q_lhs, cfg.dimension_numbers, q_rhs.ndim, of_lhs=False)
    * inv_g
    * (1.0 / s_lhs)
  )
  amaxes = jnp.stack([sent_lhs, sent_rhs, sent_g])
  d_kernel = Fp8ParamWithGrad(
    data=np.zeros(rhs.data.shape, jax.dtypes.float0),
    exponent=np.zeros((), jax.dtypes.float0),
    grad_dtype=rhs.grad_dtype,
    grad=d_rhs.astype(rhs.grad.dtype),
  )
  return (
    d_lhs.astype(cfg.lhs_dtype),
    d_kernel,
    jnp.zeros_like(scale),
    amaxes,
  )


_param_dot.defvjp(_param_dot_fwd, _param_dot_bwd)


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
  recipe: Recipe = DEFAULT_RECIPE,
  preferred_element_type: Any = None,
) -> jax.Array:
  """`lax.dot_general` in FP8 with the given scales (a pure function).

  Args:
    lhs, rhs, dimension_numbers: as for `jax.lax.dot_general`.
    scale: float32[3], the scales of lhs, rhs and the output gradient
      under delayed scaling; other recipes compute their own and ignore it.
    amax: float32[3] of zeros; its gradient is the amaxes of lhs, rhs and
      the output gradient. With the recipe's `statistics`, float32[3, 3]:
      each row amax, fraction saturated, fraction flushed to zero
      (`fp8_recipe.cast_fractions`).
    recipe: the recipe (`fp8_recipe.py`); it gives the FP8 dtypes.
    preferred_element_type: the output dtype (default: lhs and rhs promoted).

  Returns:
    The product, dequantized to the output dtype.

  Example:
    >>> from jmp_train.fp8 import DelayedScaling
    >>> x, w = jnp.array([[1.0, -2.0]]), jnp.array([[3.0], [0.5]])
    >>> dn = (((1,), (0,)), ((), ()))
    >>> def f(amax):
    ...   y = fp8_dot_general(
    ...     x, w, dn, scale=jnp.ones(3), amax=amax, recipe=DelayedScaling()
    ...   )
    ...   return y.sum()
    >>> f(jnp.zeros(3))
    Array(2., dtype=float32)
    >>> jax.grad(f)(jnp.zeros(3))  # max|x|, max|w|, max|dL/dy|
    Array([2., 3., 1.], dtype=float32)
  """
  # An Fp8Param kernel does not promote: the input's dtype.
  kernel_dtype = lhs.dtype if isinstance(rhs, Fp8Param) else rhs.dtype
  out_dtype = np.dtype(
    preferred_element_type or jnp.result_type(lhs.dtype, kernel_dtype)
  )
  if isinstance(rhs, Fp8Param) and isinstance(recipe, BlockwiseScaling):
    raise ValueError(
      "An Fp8Param kernel has one scale per tensor; blockwise scaling needs "
      "one per 128 x 128 block. Use current or delayed scaling with FP8 "
      "params, or keep this kernel in bfloat16."
    )
  if isinstance(recipe, BlockwiseScaling):
    return fp8_block.block_dot_general(
      lhs,
      rhs,
      _canonical(dimension_numbers),
      amax=amax,
      block_size=recipe.block_size,
      power_of_two_scales=recipe.power_of_two_scales,
      out_dtype=out_dtype,
      statistics=recipe.statistics,
    )
  cfg = _DotConfig(
    _canonical(dimension_numbers),
    recipe.forward_dtype,
    recipe.backward_dtype,
    out_dtype,
    np.dtype(lhs.dtype),
    np.dtype(rhs.dtype),
    not is_delayed(recipe),
    getattr(recipe, "power_of_two_scales", False),
    recipe.statistics,
  )
  if isinstance(rhs, Fp8Param):
    if cfg.statistics:
      raise ValueError(
        f"recipe={recipe!r} reports cast statistics, but an Fp8Param kernel "
        "was cast by the optimizer, where none are taken: use statistics="
        "False with FP8 params."
      )
    return _param_dot(cfg, lhs, rhs, scale, amax)
  return _fp8_dot(cfg, lhs, rhs, scale, amax)


def einsum(equation: str, lhs: jax.Array, rhs: jax.Array, dot) -> jax.Array:
  """A two-operand einsum as one `dot(lhs, rhs, dimension_numbers)`.

  `jnp.einsum` may hand its dot_general the operands in either order (it
  puts the kernel first where that saves a transpose), but an FP8 matmul
  must know which one is the kernel: its scale entry, and under blockwise
  scaling its 128 x 128 blocks. So the contraction is built here with `lhs`
  (the input) as lhs and `rhs` (the kernel) as rhs, then transposed to the
  output's order. Letters found in one operand only and not in the output
  are summed out first; an ellipsis or a repeated letter is refused.
  """
  eq = equation.replace(" ", "")
  inputs, arrow, out = eq.partition("->")
  a, _, b = inputs.partition(",")
  if (
    not arrow
    or inputs.count(",") != 1
    or "." in eq
    or any(len(set(s)) != len(s) for s in (a, b, out))
    or any(c not in a + b for c in out)
  ):
    raise ValueError(
      f"FP8 einsum equation {equation!r}: accepted is an explicit "
      "two-operand equation 'ab,bc->ac', every axis a letter, each once per "
      "operand, every output letter in an input (no '...', no implicit "
      "output)."
    )
  # Axes of one operand that neither the other nor the output has: sum them.
  for name, x, letters, other in (("lhs", lhs, a, b), ("rhs", rhs, b, a)):
    alone = [i for i, c in enumerate(letters) if c not in other + out]
    if alone and isinstance(x, Fp8Param):
      raise ValueError(
        f"FP8 einsum {equation!r} sums kernel axes {alone} away before the "
        "matmul, which an Fp8Param kernel (stored in FP8) cannot do; keep "
        "this kernel in bfloat16."
      )
    if alone:
      x = jnp.sum(x, axis=tuple(alone))
      letters = "".join(c for c in letters if c in other + out)
    if name == "lhs":
      lhs, a = x, letters
    else:
      rhs, b = x, letters
  batch = [c for c in a if c in b and c in out]
  contract = [c for c in a if c in b and c not in out]
  dn = (
    (tuple(a.index(c) for c in contract), tuple(b.index(c) for c in contract)),
    (tuple(a.index(c) for c in batch), tuple(b.index(c) for c in batch)),
  )
  y = dot(lhs, rhs, dn)
  # dot_general's output: batch, then lhs's kept axes, then rhs's.
  order = batch + [c for c in a if c not in b] + [c for c in b if c not in a]
  return jnp.transpose(y, [order.index(c) for c in out])
