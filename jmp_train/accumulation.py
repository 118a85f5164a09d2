"""Gradient accumulation in float32.

`accumulate_gradients` splits a batch into `accum_steps` micro-batches, takes
the gradient of the scaled loss on each and sums them in a float32 buffer, as
torch.amp does with `GradScaler` and accumulation: the gradients stay scaled
until the one optimizer update, so the finite check and the loss-scale
adjustment happen once per accumulated step, and one non-finite micro-batch
makes the sum non-finite and the whole step skip.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_train import fp8


def _is_float(x: Any) -> bool:
  """A differentiable leaf: a floating (float8 aside) or complex array."""
  dtype = jnp.asarray(x).dtype
  return jnp.issubdtype(dtype, jnp.inexact) and dtype.itemsize > 1


def _check_loss_scale(loss_scale: Any) -> jax.Array:
  """The loss scale as a float32 scalar, or an error naming the argument."""
  dtype = getattr(loss_scale, "dtype", None)
  if dtype is None and isinstance(loss_scale, (int, float)):
    dtype = np.asarray(loss_scale).dtype
  ok = (
    dtype is not None
    and not isinstance(loss_scale, bool)
    and (
      jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
    )
    and np.ndim(loss_scale) == 0
  )
  if not ok:
    raise TypeError(
      "accumulate_gradients: loss_scale must be a real scalar (e.g. "
      f"jmp_train.current_loss_scale(opt_state)), got {loss_scale!r}."
    )
  return jnp.asarray(loss_scale, jnp.float32)


def _float_loss(loss: Any) -> jax.Array:
  """The loss as a float32 scalar; integer or complex losses are refused."""
  loss = jnp.asarray(loss)
  if not jnp.issubdtype(loss.dtype, jnp.floating) or loss.ndim != 0:
    raise TypeError(
      "loss_fn must return a real floating-point scalar, got "
      f"{loss.dtype}{list(loss.shape)}: the gradient of an integer loss is "
      "zero everywhere (casting it to float would hide that)."
    )
  return loss.astype(jnp.float32)


def _check_accum_steps(accum_steps: Any) -> int:
  if (
    isinstance(accum_steps, bool)
    or not isinstance(accum_steps, int)
    or accum_steps < 1
  ):
    raise ValueError(f"accum_steps must be an int >= 1, got {accum_steps!r}.")
  return accum_steps


def _micro_batches(batch: Any, accum_steps: int) -> Any:
  """Reshapes every batch leaf (b, ...) to (accum_steps, b // accum_steps, ...)."""

  def split(x):
    x = jnp.asarray(x)
    if x.ndim == 0 or x.shape[0] % accum_steps:
      raise ValueError(
        f"Every batch leaf needs a leading dimension divisible by "
        f"accum_steps={accum_steps}; got shape {x.shape}."
      )
    return x.reshape(accum_steps, x.shape[0] // accum_steps, *x.shape[1:])

  return jax.tree.map(split, batch)


def accumulate_gradients(
  loss_fn: Callable[[optax.Params, Any], jax.Array],
  params: optax.Params,
  batch: Any,
  accum_steps: int = 1,
  *,
  loss_scale: jax.typing.ArrayLike = 1.0,
) -> tuple[jax.Array, optax.Params]:
  """Mean loss and mean gradients of `loss_scale * loss_fn` over micro-batches.

  Micro-batch `i` is rows `[i * m, (i + 1) * m)` of every batch leaf, with
  `m = batch_size // accum_steps`. Each micro-batch's gradient is cast to
  float32 (at least) and added to a float32 buffer; the result is the buffer
  divided by `accum_steps`, which equals the gradient of the mean loss over
  the whole batch within float32 rounding. With `accum_steps=1` there is no
  buffer and the gradients keep the params' dtypes.

  Args:
    loss_fn: `loss_fn(params, batch) -> scalar loss`, the *unscaled* loss.
    params: the params to differentiate; non-float leaves get zero gradients.
    batch: a pytree whose leaves share a leading batch dimension.
    accum_steps: the number of micro-batches.
    loss_scale: the loss scale to multiply each micro-batch loss by (for
      `mixed_precision`, `jmp_train.current_loss_scale(opt_state)`).

  Returns:
    `(loss, grads)`: the mean unscaled loss (float32) and the mean gradients
    of the scaled loss (float32 when accumulating).

  Example:
    >>> import jax.numpy as jnp
    >>> params = {"w": jnp.ones(2)}
    >>> batch = jnp.arange(8.0).reshape(4, 2)
    >>> loss_fn = lambda p, x: jnp.mean(x @ p["w"])
    >>> loss, grads = accumulate_gradients(loss_fn, params, batch, 2)
    >>> float(loss), grads["w"].tolist()
    (7.0, [3.0, 4.0])
  """
  accum_steps = _check_accum_steps(accum_steps)
  loss_scale = _check_loss_scale(loss_scale)

  def scaled_loss(p, b):
    loss = _float_loss(loss_fn(p, b))
    return loss * loss_scale, loss

  grad_fn = jax.value_and_grad(scaled_loss, has_aux=True, allow_int=True)

  def loss_and_grads(b):
    (_, loss), grads = grad_fn(params, b)
    # Non-float params get float0 gradients from allow_int; give them zeros.
    grads = jax.tree.map(
      lambda g, p: g if _is_float(p) else jnp.zeros_like(p), grads, params
    )
    return loss, grads

  if accum_steps == 1:
    return loss_and_grads(batch)

  def to_buffer(g):
    return (
      g.astype(jnp.promote_types(g.dtype, jnp.float32)) if _is_float(g) else g
    )

  micro = _micro_batches(batch, accum_steps)
  # The first micro-batch starts the buffer (rather than zeros), so the carry
  # has the gradients' own sharding and replication type inside shard_map.
  first_loss, first_grads = loss_and_grads(jax.tree.map(lambda x: x[0], micro))
  carry0 = (first_loss, jax.tree.map(to_buffer, first_grads))

  def combine(acc, g):
    if fp8.is_fp8_state(acc):
      return jax.tree.map(jnp.maximum, acc, g)
    return acc + to_buffer(g)

  def body(carry, b):
    loss_sum, buffer = carry
    loss, grads = loss_and_grads(b)
    buffer = jax.tree.map(combine, buffer, grads, is_leaf=fp8.is_fp8_state)
    return (loss_sum + loss, buffer), None

  rest = jax.tree.map(lambda x: x[1:], micro)
  (loss_sum, buffer), _ = jax.lax.scan(body, carry0, rest)
  inv = 1.0 / accum_steps
  grads = jax.tree.map(
    lambda g: (
      g * jnp.asarray(inv, g.dtype)
      if not fp8.is_fp8_state(g) and _is_float(g)
      else g
    ),
    buffer,
    is_leaf=fp8.is_fp8_state,
  )
  return loss_sum * inv, grads
