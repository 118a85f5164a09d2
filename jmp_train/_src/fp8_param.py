"""Weights stored in FP8: NeMo's `fp8_params`, Transformer Engine's
`fp8_model_init`.

An `Fp8Param` is a weight held as E4M3 values (their uint8 bits, as
Transformer Engine's `Float8Tensor` holds them) and one power-of-two scale,
its int32 `exponent`: the weight is `values * 2**exponent`. The float32
master lives in `mixed_precision`'s state; after each optimizer step the
weight is cast again from its new master (`cast_param`), and the FP8 matmul
reads the values directly, with no bfloat16 copy anywhere. Under ZeRO-1 the step
all-gathers these 1-byte values instead of 2-byte bfloat16 ones.

The scale rule is current scaling's, with a power-of-two scale: `2**-exponent
= power_of_two(448 / amax(master))`, 1 for an all-zero (or non-finite)
master. So no value saturates, and `values * 2**exponent` is exact.

Why uint8 bits and an int32 exponent: `optax.apply_updates` adds the update
to the param in the param's dtype. Integer addition wraps, so the update
`new - old` of the bits and of the exponent lands exactly on the new values
(an FP8 or float32 sum would round, and JAX refuses to add FP8 to float32).

Gradients: JAX's gradient with respect to integer bits is empty, so while
the loss is differentiated each `Fp8Param` carries a zero `grad` slot of the
weight's shape (`with_grad_slots`), and the FP8 matmul returns the weight's
gradient as the slot's. `grads_of` turns the result into a gradient tree
shaped like the params, the weight's gradient in the `data` field. The train
step does both.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jmp_train._src import leaves
from jmp_train._src.fp8_recipe import E4M3, FP8_MAX, amax, current_scale
from jmp_train._src.fp8_recipe import quantize as _quantize


@flax.struct.dataclass
class Fp8Param:
  """A weight stored in FP8 (E4M3) with a power-of-two scale.

  Attributes:
    data: uint8, the E4M3 bit patterns of the scaled weight (in a gradient
      tree: the weight's gradient).
    exponent: int32 scalar; the weight is `values * 2**exponent`.
    grad_dtype: the dtype of the weight's gradient, that of the weight it
      was cast from (so an FP8 kernel cast from a float32 param gets float32
      gradients, as the float32 param did); static, not a leaf.

  Example:
    >>> w = cast_param(jnp.array([[0.5, -3.0], [0.0, 1.25]]))
    >>> w.values, int(w.exponent)
    (Array([[64, -384],
           [0, 160]], dtype=float8_e4m3fn), -7)
    >>> w.dequantize()
    Array([[ 0.5 , -3.  ],
           [ 0.  ,  1.25]], dtype=float32)
  """

  data: jax.Array
  exponent: jax.Array
  grad_dtype: np.dtype = flax.struct.field(pytree_node=False)

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.data.shape)

  @property
  def ndim(self) -> int:
    return len(self.data.shape)

  @property
  def size(self) -> int:
    return int(np.prod(self.data.shape))

  @property
  def dtype(self) -> np.dtype:
    return E4M3

  @property
  def values(self) -> jax.Array:
    """The E4M3 values (the scaled weight)."""
    return jax.lax.bitcast_convert_type(self.data, E4M3)

  @property
  def scale_inv(self) -> jax.Array:
    """`2**exponent`, a float32 scalar."""
    return power_of_two(self.exponent)

  def dequantize(self, dtype: Any = jnp.float32) -> jax.Array:
    """The weight, `values * 2**exponent`, in `dtype` (exact in float32)."""
    wide = self.values.astype(jnp.float32) * self.scale_inv
    return wide.astype(dtype)


@flax.struct.dataclass
class Fp8ParamWithGrad(Fp8Param):
  """An `Fp8Param` with a gradient slot, while it is differentiated.

  Attributes:
    grad: zeros of the weight's shape; their gradient is the weight's.
  """

  grad: jax.Array


def is_fp8_param(x: Any) -> bool:
  return isinstance(x, Fp8Param)


def power_of_two(exponent: jax.Array) -> jax.Array:
  """`2.0**exponent` in float32, exact, for int `exponent` in [-126, 127]."""
  e = jnp.asarray(exponent, jnp.int32)
  return jax.lax.bitcast_convert_type((e + 127) << 23, jnp.float32)


def cast_param(weight: jax.Array) -> Fp8Param:
  """`weight` in FP8 with a power-of-two scale from its own amax.

  The scale is `fp8_recipe.current_scale(amax, 448, power_of_two=True)`:
  the largest power of two that keeps `amax * scale <= 448` (at most
  2**126), or 1 when the weight is all zeros or not finite. Non-finite
  entries stay non-finite (E4M3 has no inf: they become NaN), so a step
  that made one is seen.
  """
  weight = jnp.asarray(weight)
  scale = current_scale(amax(weight), FP8_MAX[E4M3], True)
  # scale = 2**k exactly: k is its biased exponent field minus 127.
  k = (jax.lax.bitcast_convert_type(scale, jnp.int32) >> 23) - 127
  values = _quantize(weight, scale, E4M3)
  return Fp8Param(
    data=jax.lax.bitcast_convert_type(values, jnp.uint8),
    exponent=(-k).astype(jnp.int32),
    grad_dtype=np.dtype(weight.dtype),
  )


def delta(old: Fp8Param, new: Fp8Param) -> Fp8Param:
  """The update `optax.apply_updates` adds to `old` to get `new` exactly:
  differences of the uint8 bits and int32 exponents, which wrap."""
  return old.replace(
    data=new.data - old.data, exponent=new.exponent - old.exponent
  )


def no_change(param: Fp8Param) -> Fp8Param:
  """The update that leaves `param` as it is (a skipped step)."""
  return param.replace(
    data=jnp.zeros_like(param.data), exponent=jnp.zeros_like(param.exponent)
  )


def cast_params(params: Any, select: Any = None) -> Any:
  """`params` with the selected float leaves cast to `Fp8Param`.

  Args:
    params: a pytree of arrays.
    select: a function `(path: str, leaf) -> bool`, the path joined by "/";
      None selects every float leaf of two or more dimensions.

  Example:
    >>> params = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}
    >>> cast_params(params)["w"].shape, cast_params(params)["b"].dtype
    ((2, 3), dtype('float32'))
  """

  def one(path, x):
    name = leaves.keystr(path)
    chosen = (
      select(name, x)
      if select is not None
      else leaves.is_real_float(x) and np.ndim(x) >= 2
    )
    if not chosen:
      return x
    if not leaves.is_real_float(x) or leaves.is_float8(x):
      raise TypeError(
        f"cast_params: leaf {name!r} of dtype {np.dtype(x.dtype).name} was "
        "selected; only float params (bfloat16, float16, float32) can be "
        "stored as FP8 params."
      )
    return cast_param(x)

  return jax.tree_util.tree_map_with_path(one, params, is_leaf=is_fp8_param)


def with_grad_slots(params: Any) -> Any:
  """Each `Fp8Param` of `params` with a zero gradient slot of its shape
  and `grad_dtype`.

  Differentiate with respect to the result, then take `grads_of` the
  gradient. The slots are zeros that nothing reads in the forward pass.
  """

  def slot(x):
    if not is_fp8_param(x):
      return x
    grad = jnp.zeros(x.shape, x.grad_dtype)
    return Fp8ParamWithGrad(x.data, x.exponent, x.grad_dtype, grad)

  return jax.tree.map(slot, params, is_leaf=is_fp8_param)


def grads_of(grads: Any) -> Any:
  """The gradient tree of params that had slots, shaped like the params:
  each `Fp8Param`'s entry holds the weight's gradient in `data` and a zero
  `exponent`."""

  def one(g):
    if not isinstance(g, Fp8ParamWithGrad):
      return g
    exponent = jnp.zeros([], jnp.int32)
    return Fp8Param(data=g.grad, exponent=exponent, grad_dtype=g.grad_dtype)

  return jax.tree.map(one, grads, is_leaf=is_fp8_param)


def grad_like(params: Any) -> Any:
  """Abstract arrays shaped and typed like `grads_of`'s result."""

  def one(p):
    if not is_fp8_param(p):
      return p
    return Fp8Param(
      data=jax.ShapeDtypeStruct(p.shape, p.grad_dtype),
      exponent=jax.ShapeDtypeStruct((), jnp.int32),
      grad_dtype=p.grad_dtype,
    )

  return jax.tree.map(one, params, is_leaf=is_fp8_param)
