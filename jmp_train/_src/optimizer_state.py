"""The `mixed_precision` state, and finding it inside an optimizer state.

Readers of the state (`current_loss_scale`, `train_metrics`, monitors, the
train step, checkpoints) call `find_state`, which finds the one
`MixedPrecisionState` wherever it sits (a one-element `optax.chain`,
`optax.inject_hyperparams`, an `nnx.Optimizer`'s state, any pytree) and
checks that `mixed_precision` is the outermost transformation: no neighbour
in a chain, and no optax wrapper that changes what it sees or what it
returns (`MultiSteps`, `masked`, `partition`/`multi_transform`,
`conditionally_transform`, `lookahead`, `apply_if_finite`). optax gives
`update` no view of its neighbours, so the order is checked where the state
is read.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import optax

from jmp_train._src import loss_scale as ls_lib


class MixedPrecisionState(NamedTuple):
  """State of `mixed_precision`.

  Attributes:
    loss_scaler: the loss scale (NoOp, Static or Dynamic) to multiply the
      next loss by; `current_loss_scale` reads it.
    master_params: what `param_update` keeps beside each param stored below
      float32: a float32 master (`MasterWeights`), the master's int16
      remainder (`ParamRemainders`) or a compensation in the param's dtype
      (`KahanSummation`); `None` where a param keeps nothing.
    inner_state: the wrapped optimizer's state, its fields stored as
      `state_formats` says (`jmp_train.state_format`).
    steps: number of `update` calls.
    skipped_steps: number of updates skipped for non-finite gradients.
    last_step_finite: whether the last step's gradients were all finite.
    grad_norm: global L2 norm of the last step's unscaled gradients (NaN
      when they were not all finite).
    skip_streak: number of consecutive skipped steps up to the last one (0
      after a finite step); `jmp_train.monitor.loss_scale_alarms` reads it.
  """

  loss_scaler: ls_lib.LossScale
  master_params: optax.Params
  inner_state: optax.OptState
  steps: jax.Array
  skipped_steps: jax.Array
  last_step_finite: jax.Array
  grad_norm: jax.Array
  skip_streak: jax.Array


def is_mixed_precision_state(x: Any) -> bool:
  return isinstance(x, MixedPrecisionState)


def _states_with_paths(opt_state: Any) -> list[tuple]:
  """`(tree path, state)` of every `mixed_precision` state, in tree order."""
  flat, _ = jax.tree_util.tree_flatten_with_path(
    opt_state, is_leaf=is_mixed_precision_state
  )
  return [(path, leaf) for path, leaf in flat if is_mixed_precision_state(leaf)]


def mixed_precision_states(opt_state: Any) -> list[MixedPrecisionState]:
  """Every `mixed_precision` state in `opt_state`, in tree order.

  No order check: for walking a state, or a tree of the same structure
  (shardings, templates), that may hold several or none.
  """
  return [state for _, state in _states_with_paths(opt_state)]


def find_state(opt_state: Any) -> MixedPrecisionState:
  """The one `mixed_precision` state in `opt_state`, checked outermost.

  Raises:
    ValueError: if there is not exactly one, or if it has neighbours in an
      optax chain or sits in an optax wrapper that breaks it (see
      `mixed_precision`: it must be outermost).
  """
  found = _states_with_paths(opt_state)
  if len(found) != 1:
    fix = (
      "use one, outermost (a chain or tuple of several has no one loss scale)"
      if found
      else "build the optimizer as jmp_train.mixed_precision(inner) or a "
      "preset's .mixed_precision(inner), outermost"
    )
    raise ValueError(
      "Expected exactly one mixed_precision state in the optimizer state, "
      f"found {len(found)}: {fix}."
    )
  path, state = found[0]
  _check_outermost(opt_state, path)
  return state


def _child(node: Any, key: Any) -> Any:
  """The child of `node` at one key of a tree path (None if unknown)."""
  tree_util = jax.tree_util
  if isinstance(key, tree_util.SequenceKey):
    return node[key.idx]
  if isinstance(key, tree_util.DictKey):
    return node[key.key]
  if isinstance(key, tree_util.GetAttrKey):
    return getattr(node, key.name)
  if isinstance(key, tree_util.FlattenedIndexKey):
    children = tree_util.tree_flatten(node, is_leaf=lambda x: x is not node)
    return children[0][key.key]
  return None


def _is_transformation_state(x: Any) -> bool:
  """An optax state: a NamedTuple (EmptyState, ScaleByAdamState, ...), the
  `()` or None of a hand-written stateless transformation, or a chain's
  tuple or dict of them."""
  if x is None or (type(x) is tuple and not x) or hasattr(x, "_fields"):
    return True
  if isinstance(x, (tuple, dict)):
    values = x.values() if isinstance(x, dict) else x
    return any(_is_transformation_state(v) for v in values)
  return False


# What each optax wrapper breaks when it holds `mixed_precision`, and the fix,
# by the wrapper's state type.
_WRAPPER_PROBLEMS = {
  optax.MultiStepsState: (
    "optax.MultiSteps(mixed_precision(...)) adds each micro-step's scaled "
    "gradients to its accumulator before mixed_precision can skip an "
    "overflow, and resets it as (1 - emit) * acc: one inf makes it NaN "
    "for every later window, so every later update is skipped (with "
    "should_skip_update_fn=optax.skip_not_finite it drops the micro-step "
    "instead, and the loss scale never backs off). Put MultiSteps inside: "
    "mixed_precision(optax.MultiSteps(optimizer, every_k_schedule=k)), or "
    "accumulate in the train step (make_train_step(..., accum_steps=k))."
  ),
  optax.PartitionState: (
    "optax.partition (multi_transform, selective_transform) with "
    "mixed_precision in one group gives the other groups the scaled "
    "gradients, and their non-finite values do not skip the step. Put it "
    "inside: mixed_precision(optax.partition(transforms, labels)) (frozen "
    "params: a group of optax.set_to_zero() there)."
  ),
  optax.MaskedState: (
    "optax.masked(mixed_precision(...), mask) passes the masked-out "
    "leaves' scaled gradients through as their updates. Put it inside: "
    "mixed_precision(optax.masked(optimizer, mask))."
  ),
  optax.ConditionallyTransformState: (
    "optax.conditionally_transform(mixed_precision(...), should_transform_fn) "
    "passes the scaled gradients through as updates on the steps it does "
    "not transform. Put it inside: mixed_precision("
    "optax.conditionally_transform(optimizer, should_transform_fn))."
  ),
  optax.LookaheadState: (
    "optax.lookahead(mixed_precision(...)) moves the fast params to the "
    "slow ones at each sync without mixed_precision: a sync on a skipped "
    "step moves the params, and the next step rebuilds them from master "
    "weights (or remainders, a Kahan compensation) that never saw the sync "
    "(with reset_state=True the sync also resets the loss scale and its "
    "counters). lookahead cannot go inside either (its updates are "
    "LookaheadParams): not supported."
  ),
  optax.ApplyIfFiniteState: (
    "optax.apply_if_finite(mixed_precision(...)) keeps non-finite steps "
    "from mixed_precision until more than max_consecutive_errors come in a "
    "row, so its loss scale backs off late and its counters miss them. "
    "mixed_precision skips them itself: drop apply_if_finite."
  ),
}


def _check_outermost(opt_state: Any, path: tuple) -> None:
  """Refuses a `mixed_precision` state that is not outermost.

  Inside an optax wrapper that breaks it: see `_WRAPPER_PROBLEMS`.

  `optax.chain(clip, mixed_precision(...))` clips the scaled gradients, and
  `optax.chain(mixed_precision(...), other)` changes the exact updates that
  keep params equal to their masters cast down. In the state, the first is a
  tuple (the chain's) holding this state after another transformation's
  state, the second one holding it before one (`optax.named_chain`: a dict
  of states). Neighbours that are not optax states (a step counter, a dict
  of arrays kept beside the state) are not transformations.
  """
  node = opt_state
  for key in path:
    problem = _WRAPPER_PROBLEMS.get(type(node))
    if problem:
      raise ValueError(
        f"mixed_precision must be the outermost transformation: {problem}"
      )
    child = _child(node, key)
    if child is None:
      return
    in_chain = type(node) is tuple and isinstance(
      key, jax.tree_util.SequenceKey
    )
    in_named = isinstance(node, dict) and is_mixed_precision_state(child)
    if in_chain or in_named:
      keys = range(len(node)) if in_chain else list(node)
      at = key.idx if in_chain else key.key
      position = list(keys).index(at)
      others = [
        position - i
        for i, k in enumerate(keys)
        if k != at and _is_transformation_state(node[k])
      ]
      if others:
        which = (
          "before it sees the scaled gradients (a clip would clip them)"
          if any(o > 0 for o in others)
          else "after it changes the updates that keep params == cast(master)"
        )
        raise ValueError(
          "mixed_precision must be the outermost transformation, but its "
          f"state is element {position} of an optax chain of {len(node)}: a "
          f"transformation {which}. Put the others inside it: "
          "mixed_precision(optax.chain(clip, ..., optimizer)). (If that "
          "container is not an optax chain's state, pass this function the "
          "mixed_precision state itself.)"
        )
    node = child
