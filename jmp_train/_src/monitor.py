"""Monitoring inside jit: non-finite gradients per leaf, zeros, loss-scale alarms.

Every function that takes arrays returns arrays and works under `jax.jit`
without a host sync. The host sees nothing until it asks: `nonfinite_report`
(a dict of paths, after `jax.device_get`) and `warn_loss_scale` (a Python
warning raised from inside jit by `jax.debug.callback`, only on steps where an
alarm is on).

    grads = jax.grad(scaled_loss)(params)
    counts = monitor.nonfinite_counts(grads)       # per leaf, int32, in jit
    zeros = monitor.num_zeros(grads)               # int32, in jit
    updates, opt_state = tx.update(grads, opt_state, params)
    alarms = monitor.warn_loss_scale(opt_state)    # bools; a host warning
                                                   # only on alarmed steps
    ...
    print(monitor.nonfinite_report(counts))        # on the host, when asked:
    # {'blocks/0/mlp/kernel': 12, 'head/bias': 3}
"""

from __future__ import annotations

import functools
import re
import warnings
from typing import Any

import jax
import jax.numpy as jnp

from jmp_train._src import fp8 as fp8_lib
from jmp_train._src import leaves, optimizer_state
from jmp_train._src import loss_scale as ls_lib


def _float_leaves_map(fn, tree: Any) -> Any:
  """`fn` on each float leaf; None elsewhere (integers, booleans)."""
  return jax.tree.map(
    lambda x: fn(jnp.asarray(x)) if leaves.is_float(x) else None, tree
  )


def nonfinite_counts(tree: Any) -> Any:
  """Per float leaf, the number of inf/NaN elements (int32); None elsewhere.

  Same structure as `tree`. Under a mesh, a sharded leaf's count is global
  (the sum runs over the whole logical array).
  """
  return _float_leaves_map(
    lambda x: jnp.sum(~jnp.isfinite(x), dtype=jnp.int32), tree
  )


def num_zeros(tree: Any) -> jax.Array:
  """Number of elements equal to zero over all float leaves (int32 scalar).

  Colossal-AI's and Megatron's `log_num_zeros_in_grad`: a rising count in
  the gradients of a low-precision run shows underflow (loss scale too low,
  or float16 gradients flushed to zero). Counts up to 2**31 - 1 elements.
  """
  counts = _float_leaves_map(lambda x: jnp.sum(x == 0, dtype=jnp.int32), tree)
  return sum(jax.tree.leaves(counts), jnp.zeros([], jnp.int32))


def nonfinite_report(counts: Any) -> dict[str, int]:
  """On the host: `{"a/b/c": count}` for the leaves of `nonfinite_counts` > 0.

  Syncs with the device (it reads the counts). Paths join the tree's keys
  with "/" (an `nnx.State`'s variables are named by their module paths,
  without the `value` of the variable); an empty dict means every gradient
  was finite.
  """
  counts = jax.device_get(leaves.without_variables(counts))
  report = {}
  for path, count in jax.tree_util.tree_flatten_with_path(counts)[0]:
    if count is not None and int(count) > 0:
      report[leaves.keystr(path)] = int(count)
  return report


def loss_scale_alarms(
  opt_state: Any, *, falling_streak: int = 5
) -> dict[str, jax.Array]:
  """Loss-scale health from a state holding `mixed_precision`, as bools.

  Args:
    opt_state: an optimizer state containing one `mixed_precision` state
      (anywhere in a chain, or an `nnx.Optimizer`'s `opt_state`).
    falling_streak: how many consecutive skipped steps count as "keeps
      falling" (with hysteresis 1 each skipped step halves the scale).

  Returns:
    `{"falling": ..., "at_minimum": ...}`, bool scalars: `falling` when the
    last `falling_streak` or more steps were all skipped; `at_minimum` when a
    dynamic loss scale has come down to its `min_scale` and the last step was
    skipped: the next step runs at the minimum, and one that still
    overflows there is the model's fault, not the scale's (DeepSpeed raises
    on that step, one later: the state does not say which scale the skipped
    step ran at, so this cannot tell the two apart).
    Always False for static and no-op loss scales' `at_minimum`.
  """
  if isinstance(falling_streak, bool) or not isinstance(falling_streak, int):
    raise TypeError(
      f"falling_streak must be an int >= 1, got {falling_streak!r}."
    )
  if falling_streak < 1:
    raise ValueError(f"falling_streak must be >= 1, got {falling_streak}.")
  state = optimizer_state.find_state(opt_state)
  streak = jnp.asarray(state.skip_streak)
  scaler = state.loss_scaler
  if isinstance(scaler, ls_lib.DynamicLossScale):
    floor = max(scaler.min_loss_scale, ls_lib.MIN_LOSS_SCALE)
    at_min = jnp.asarray(scaler.loss_scale) <= floor
    at_min = at_min & (streak > 0)
  else:
    at_min = jnp.zeros([], jnp.bool_)
  return {"falling": streak >= falling_streak, "at_minimum": at_min}


def _emit(dynamic: bool, falling, at_minimum, scale, streak) -> None:
  # The callback runs on one process (the one holding device 0): say which,
  # and that the scale it reports is every process's.
  where = ""
  if jax.process_count() > 1:
    where = (
      f" (process {jax.process_index()} of {jax.process_count()}, for all: "
      "the loss scale is the same on every process)"
    )
  if at_minimum:
    warnings.warn(
      f"jmp_train{where}: loss scale has come down to its minimum "
      f"({float(scale):g}) with gradients still non-finite ({int(streak)} "
      "skipped steps in a row); if steps still overflow at this scale, the "
      "model itself produces inf/NaN: see jmp_train.monitor.nonfinite_report.",
      RuntimeWarning,
      stacklevel=2,
    )
  elif falling:
    what = "loss scale keeps falling" if dynamic else "steps keep failing"
    warnings.warn(
      f"jmp_train{where}: {what} ({int(streak)} skipped steps in a row, loss scale "
      f"now {float(scale):g}).",
      RuntimeWarning,
      stacklevel=2,
    )


def warn_loss_scale(opt_state: Any, *, falling_streak: int = 5) -> dict:
  """`loss_scale_alarms`, plus a host `RuntimeWarning` when one is on.

  Inside jit this costs a `lax.cond`: the host callback
  (`jax.debug.callback`) runs only on steps where an alarm is on, so healthy
  steps never sync. Returns the alarms, for logging. With several processes
  the warning is raised once, on the process holding the first device
  (process 0 for a mesh over `jax.devices()`), and names it; the returned
  alarms are on every process.
  """
  alarms = loss_scale_alarms(opt_state, falling_streak=falling_streak)
  state = optimizer_state.find_state(opt_state)
  scale = jnp.asarray(state.loss_scaler.loss_scale, jnp.float32)
  streak = jnp.asarray(state.skip_streak)
  falling, at_minimum = alarms["falling"], alarms["at_minimum"]
  jax.lax.cond(
    falling | at_minimum,
    lambda: jax.debug.callback(
      functools.partial(
        _emit, isinstance(state.loss_scaler, ls_lib.DynamicLossScale)
      ),
      falling,
      at_minimum,
      scale,
      streak,
    ),
    lambda: None,
  )
  return alarms


def fp8_statistics(fp8_tree: Any) -> dict[str, jax.Array]:
  """Per FP8 matmul and tensor: scale, amax, fractions saturated and flushed.

  Reads the FP8 state after a step (`state.fp8` of the train step, the
  "fp8_meta" collection, or an NNX model's FP8 state) inside or outside jit.
  Keys are `"{matmul path}/{tensor}/{statistic}"`, tensor one of "input",
  "kernel", "output_grad", statistic one of:

  - `scale`: the scale the next step casts with (delayed scaling), or the
    last applied step's (current scaling; blockwise: its largest tile's);
  - `amax`: the last applied step's max |value|, over every call of the
    matmul, micro-batch and device;
  - `saturated`: the fraction of values beyond the FP8 range, whose FP8
    value the clip changes (see `fp8_recipe.cast_fractions`);
  - `flushed`: the fraction of non-zero values cast to zero.

  The fractions need the recipe's `statistics=True` (else they are absent)
  and are the largest over calls, micro-batches and devices. A skipped step
  changes none of them.

  Example:
    >>> from jmp_train import fp8
    >>> state = fp8.init_state(fp8.CurrentScaling(statistics=True))
    >>> grads = state.replace(amax=(jnp.array([[2.0, 0, 0.5]] * 3),))
    >>> stats = fp8_statistics({"dense": fp8.update(state, grads)})
    >>> float(stats["dense/input/scale"]), float(stats["dense/input/flushed"])
    (224.0, 0.5)
  """
  out = {}
  found = jax.tree_util.tree_flatten_with_path(
    fp8_tree, is_leaf=fp8_lib.is_fp8_state
  )[0]
  for path, state in found:
    if not fp8_lib.is_fp8_state(state):
      continue
    name = _matmul_path(path)
    for i, tensor in enumerate(fp8_lib.TENSORS):
      prefix = f"{name}/{tensor}/" if name else f"{tensor}/"
      out[prefix + "scale"] = state.scale[..., i]
      out[prefix + "amax"] = state.amax_history[..., i, 0]
      if state.recipe.statistics:
        out[prefix + "saturated"] = state.fractions[..., i, 0]
        out[prefix + "flushed"] = state.fractions[..., i, 1]
  return out


def _matmul_path(path) -> str:
  """The layer's path: the state's tree path less the FP8 matmul's names.

  linen: `.../Dense_0/Fp8DotGeneral_0/fp8`; NNX: `.../dense/fp8_meta` (and
  `/value` after it in an `nnx.State`).
  """
  parts = leaves.keystr(path).split("/")
  if parts[-2:] == ["fp8_meta", "value"]:
    parts.pop()
  while parts and (
    parts[-1] in ("fp8", "fp8_meta", "")
    or re.fullmatch(r"Fp8DotGeneral_\d+", parts[-1])
  ):
    parts.pop()
  return "/".join(parts)
