"""The leaf rules every module shares: which leaves train, how they widen,
how settings are validated and how a leaf's path is written.

One home for them, so "is this a float leaf" has one answer everywhere:

* a *float* leaf is a floating or complex array other than float8: it has a
  gradient, gets master weights and is cast by policies (real ones only);
* float8 leaves are storage formats (FP8 params): never trained directly;
* integer and boolean leaves pass through casts and updates untouched.
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

MASKED = optax.MaskedNode()


def is_masked(x: Any) -> bool:
  """Whether `x` is the empty `optax.MaskedNode` of a masked subtree."""
  return isinstance(x, optax.MaskedNode)


def is_inexact(x: Any) -> bool:
  """A floating (float8 included) or complex array: what a loss scale
  multiplies and a finite check reads."""
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)


def is_float(x: Any) -> bool:
  """A trainable leaf: a floating or complex array, float8 excluded."""
  return is_inexact(x) and np.dtype(x.dtype).itemsize > 1


def is_real_float(x: Any) -> bool:
  """A float16/bfloat16/float32/float64 leaf: what a policy casts."""
  return is_float(x) and jnp.issubdtype(x.dtype, jnp.floating)


def is_prng_key(x: Any) -> bool:
  """A typed PRNG key array (`jax.random.key`), abstract or concrete."""
  return hasattr(x, "dtype") and jax.dtypes.issubdtype(
    x.dtype, jax.dtypes.prng_key
  )


def is_float8(x: Any) -> bool:
  """A float8 leaf (a storage format, never trained directly)."""
  return (
    hasattr(x, "dtype")
    and jnp.issubdtype(x.dtype, jnp.floating)
    and np.dtype(x.dtype).itemsize == 1
  )


def full_dtype(dtype: Any) -> np.dtype:
  """`dtype` promoted to at least float32 (float64 and complex kept)."""
  return np.dtype(jnp.promote_types(dtype, jnp.float32))


def widen(x: jax.Array) -> jax.Array:
  """`x` in at least float32: how gradients are summed and unscaled."""
  return x.astype(full_dtype(x.dtype))


def keystr(path: Any) -> str:
  """A tree path as `a/b/0`, the form every error message uses."""
  return jax.tree_util.keystr(path, simple=True, separator="/")


def check_int(value: Any, name: str, low: int = 0) -> int:
  """`value` if it is an int (not a bool) >= `low`, else a ValueError."""
  if (
    isinstance(value, bool)
    or not isinstance(value, numbers.Integral)
    or value < low
  ):
    raise ValueError(f"{name} must be an int >= {low}, got {value!r}.")
  return int(value)


def check_bool(value: Any, name: str) -> bool:
  """`value` if it is a bool, else a TypeError naming the argument."""
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be True or False, got {value!r}.")
  return bool(value)


def without_variables(tree: Any) -> Any:
  """`tree` with every `flax.nnx.Variable` replaced by its value.

  `nnx.Optimizer` passes `tx.init` a state of `nnx.Param`s and later
  `tx.update` plain arrays; a state built from the former keeps them as
  containers, which nnx later refills with whatever sits inside.
  """
  from flax import nnx  # noqa: PLC0415 (only where nnx states can appear)

  def value(x):
    return x.get_value() if isinstance(x, nnx.Variable) else x

  return jax.tree.map(
    value, tree, is_leaf=lambda x: isinstance(x, nnx.Variable)
  )
