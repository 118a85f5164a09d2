"""Gradient accumulation in a float32 (or bfloat16) buffer.

`accumulate_gradients` splits a batch into `accum_steps` micro-batches, takes
the gradient of the scaled loss on each and sums them in a float32 buffer, as
torch.amp does with `GradScaler` and accumulation: the gradients stay scaled
until the one optimizer update, so the finite check and the loss-scale
adjustment happen once per accumulated step, and one non-finite micro-batch
makes the sum non-finite and the whole step skip. `accum_dtype=jnp.bfloat16`
halves the buffer: each add is computed in float32 and rounded once to
bfloat16 (`buffer_dtype` says which leaves it holds).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_train._src import leaves

_GRADIENT_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16))


def check_gradient_dtype(
  value: Any, name: str, *, allow_none: bool = False
) -> np.dtype | None:
  """`value` as a NumPy dtype if it names float32 or bfloat16 (or is None
  where `allow_none`), else a ValueError naming the argument."""
  if value is None and allow_none:
    return None
  try:
    dtype = None if value is None else np.dtype(jnp.dtype(value))
  except (TypeError, ValueError):
    dtype = None
  if dtype not in _GRADIENT_DTYPES:
    accepted = "jnp.float32 or jnp.bfloat16"
    if allow_none:
      accepted += " or None"
    raise ValueError(f"{name} must be {accepted}, got {value!r}.")
  return dtype


def buffer_dtype(dtype: Any, target: Any) -> np.dtype:
  """The dtype gradients of `dtype` are held in when `target` is asked for.

  float16, bfloat16 and float32 gradients take `target` (float32 or
  bfloat16); float64 and complex gradients keep their own dtype (there is
  no bfloat16 complex, and a float64 model asked for float64).
  """
  dtype = np.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize <= 4:
    return np.dtype(target)
  return dtype


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
  if isinstance(loss, (tuple, list)):
    raise TypeError(
      f"loss_fn must return a scalar loss, got a {type(loss).__name__} of "
      f"{len(loss)}: a loss_fn that returns aux needs has_aux=True."
    )
  loss = jnp.asarray(loss)
  if loss.ndim != 0:
    raise TypeError(
      "loss_fn must return a real floating-point scalar, got "
      f"{loss.dtype}{list(loss.shape)}: reduce it (e.g. its mean over the "
      "batch) before returning it."
    )
  if not jnp.issubdtype(loss.dtype, jnp.floating):
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
  accum_dtype: Any = jnp.float32,
) -> tuple[jax.Array, optax.Params]:
  """Mean loss and mean gradients of `loss_scale * loss_fn` over micro-batches.

  Micro-batch `i` is rows `[i * m, (i + 1) * m)` of every batch leaf, with
  `m = batch_size // accum_steps`. Each micro-batch's gradient is cast to
  float32 (at least) and added to a float32 buffer; the result is the buffer
  divided by `accum_steps`, which equals the gradient of the mean loss over
  the whole batch within float32 rounding. With `accum_steps=1` there is no
  buffer and the gradients keep the params' dtypes.

  With `accum_dtype=jnp.bfloat16` the buffer is bfloat16 (float64 and
  complex gradients keep their own dtype, see `buffer_dtype`):

      buffer = bfloat16(grads_0)
      for i in 1 .. accum_steps - 1:
        buffer = bfloat16(float32(buffer) + float32(grads_i))
      grads = bfloat16(float32(buffer) / accum_steps)

  Each add rounds to bfloat16's 8 significant bits: half the memory, and a
  sum that loses low bits once it is much larger than one micro-batch's
  gradient.

  Args:
    loss_fn: `loss_fn(params, batch) -> scalar loss`, the *unscaled* loss.
    params: the params to differentiate; non-float leaves get zero gradients.
    batch: a pytree whose leaves share a leading batch dimension.
    accum_steps: the number of micro-batches.
    loss_scale: the loss scale to multiply each micro-batch loss by (for
      `mixed_precision`, `jmp_train.current_loss_scale(opt_state)`).
    accum_dtype: the buffer's dtype, `jnp.float32` or `jnp.bfloat16`.

  Returns:
    `(loss, grads)`: the mean unscaled loss (float32) and the mean gradients
    of the scaled loss (in the buffer's dtype when accumulating).

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
  accum_dtype = check_gradient_dtype(accum_dtype, "accum_dtype")

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
    loss, grads = loss_and_grads(micro_batch)
    return carry, (loss, grads, ())

  _, loss_sum, grads, _ = over_micro_batches(
    fn, (), batch, accum_steps, accum_dtype=accum_dtype
  )
  if accum_steps == 1:
    return loss_sum, grads
  inv = 1.0 / accum_steps

  def mean(g):
    if not leaves.is_float(g):
      return g
    return (leaves.widen(g) * inv).astype(g.dtype)

  return loss_sum * inv, jax.tree.map(mean, grads)


def over_micro_batches(
  fn: Callable[[Any, Any, Any], tuple[Any, tuple[Any, Any, Any]]],
  carry: Any,
  batch: Any,
  accum_steps: int,
  *,
  accum_dtype: Any = jnp.float32,
) -> tuple[Any, Any, Any, Any]:
  """Runs `fn` on each micro-batch in order and combines what it returns.

  `fn(carry, micro_batch, index) -> (carry, (summed, grads, maxed))`:
  `carry` is threaded from one micro-batch to the next (a model's BatchNorm
  statistics); `summed` is added up, float leaves in a float32 buffer at
  least (losses, metrics); `grads` is added up, float leaves in an
  `accum_dtype` buffer (`buffer_dtype`: each add computed in float32 at
  least and rounded once to the buffer's dtype); `maxed` is combined by
  elementwise max (FP8 amaxes). With one micro-batch `fn` runs once on the
  whole batch and its outputs come back as they are.

  Returns:
    `(carry, summed, grads, maxed)` after the last micro-batch.
  """
  if accum_steps == 1:
    carry, (summed, grads, maxed) = fn(carry, batch, jnp.zeros([], jnp.int32))
    return carry, summed, grads, maxed

  def to(target):
    def cast(x):
      if not leaves.is_float(x):
        return x
      return x.astype(buffer_dtype(x.dtype, target))

    return cast

  def add(total, x):
    if not leaves.is_float(x):
      return total + x
    # In float32 at least, rounded once to the buffer's dtype (a no-op cast
    # for a float32 buffer).
    return (leaves.widen(total) + leaves.widen(x)).astype(total.dtype)

  micro = micro_batches(batch, accum_steps)
  # The first micro-batch starts the buffers (rather than zeros), so the
  # carry has the outputs' own type (sharding, replication) in shard_map.
  first = jax.tree.map(lambda x: x[0], micro)
  carry, (summed, grads, maxed) = fn(carry, first, jnp.zeros([], jnp.int32))

  def body(state, xs):
    carry, totals, top = state
    index, micro_batch = xs
    carry, (summed, grads, maxed) = fn(carry, micro_batch, index)
    totals = jax.tree.map(add, totals, (summed, grads))
    return (carry, totals, jax.tree.map(jnp.maximum, top, maxed)), None

  rest = jax.tree.map(lambda x: x[1:], micro)
  index = jnp.arange(1, accum_steps, dtype=jnp.int32)
  totals = (
    jax.tree.map(to(jnp.float32), summed),
    jax.tree.map(to(accum_dtype), grads),
  )
  (carry, (summed, grads), maxed), _ = jax.lax.scan(
    body, (carry, totals, maxed), (index, rest)
  )
  return carry, summed, grads, maxed
