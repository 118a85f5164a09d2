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

from jmp_train._src import leaves


def check_loss_scale(loss_scale: Any) -> jax.Array:
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


def float_loss(loss: Any) -> jax.Array:
  """The loss as a float32 scalar; integer or complex losses are refused."""
  loss = jnp.asarray(loss)
  if not jnp.issubdtype(loss.dtype, jnp.floating) or loss.ndim != 0:
    raise TypeError(
      "loss_fn must return a real floating-point scalar, got "
      f"{loss.dtype}{list(loss.shape)}: the gradient of an integer loss is "
      "zero everywhere (casting it to float would hide that)."
    )
  return loss.astype(jnp.float32)


def micro_batches(batch: Any, accum_steps: int) -> Any:
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


def zeros_for_non_float(grads: Any, params: Any) -> Any:
  """`grads` with zeros for non-float params, which `jax.grad(...,
  allow_int=True)` gives float0 gradients (no arithmetic works on those)."""
  return jax.tree.map(
    lambda g, p: g if leaves.is_float(p) else jnp.zeros_like(p), grads, params
  )


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
  accum_steps = leaves.check_int(accum_steps, "accum_steps", 1)
  loss_scale = check_loss_scale(loss_scale)

  def scaled_loss(p, b):
    loss = float_loss(loss_fn(p, b))
    return loss * loss_scale, loss

  grad_fn = jax.value_and_grad(scaled_loss, has_aux=True, allow_int=True)

  def loss_and_grads(b):
    (_, loss), grads = grad_fn(params, b)
    grads = zeros_for_non_float(grads, params)
    return loss, grads

  def fn(carry, micro_batch, index):
    del index
    return carry, (loss_and_grads(micro_batch), ())

  _, (loss_sum, grads), _ = over_micro_batches(fn, (), batch, accum_steps)
  if accum_steps == 1:
    return loss_sum, grads
  inv = 1.0 / accum_steps
  grads = jax.tree.map(
    lambda g: g * jnp.asarray(inv, g.dtype) if leaves.is_float(g) else g,
    grads,
  )
  return loss_sum * inv, grads


def over_micro_batches(
  fn: Callable[[Any, Any, Any], tuple[Any, tuple[Any, Any]]],
  carry: Any,
  batch: Any,
  accum_steps: int,
) -> tuple[Any, Any, Any]:
  """Runs `fn` on each micro-batch in order and combines what it returns.

  `fn(carry, micro_batch, index) -> (carry, (summed, maxed))`: `carry` is
  threaded from one micro-batch to the next (a model's BatchNorm
  statistics), `summed` is added up (float leaves in a float32 buffer at
  least: losses, gradients, metrics) and `maxed` combined by elementwise max
  (FP8 amaxes). With one micro-batch `fn` runs once on the whole batch and
  its outputs come back as they are.

  Returns:
    `(carry, summed, maxed)` after the last micro-batch.
  """
  if accum_steps == 1:
    carry, (summed, maxed) = fn(carry, batch, jnp.zeros([], jnp.int32))
    return carry, summed, maxed

  def widen(x):
    return leaves.widen(x) if leaves.is_float(x) else x

  micro = micro_batches(batch, accum_steps)
  # The first micro-batch starts the buffers (rather than zeros), so the
  # carry has the outputs' own type (sharding, replication) in shard_map.
  first = jax.tree.map(lambda x: x[0], micro)
  carry, (summed, maxed) = fn(carry, first, jnp.zeros([], jnp.int32))

  def body(state, xs):
    carry, total, top = state
    index, micro_batch = xs
    carry, (summed, maxed) = fn(carry, micro_batch, index)
    total = jax.tree.map(lambda a, x: a + widen(x), total, summed)
    return (carry, total, jax.tree.map(jnp.maximum, top, maxed)), None

  rest = jax.tree.map(lambda x: x[1:], micro)
  index = jnp.arange(1, accum_steps, dtype=jnp.int32)
  init = (carry, jax.tree.map(widen, summed), maxed)
  (carry, summed, maxed), _ = jax.lax.scan(body, init, (index, rest))
  return carry, summed, maxed
