"""How a checkpoint stores a tree: named flat leaves, read back by name.

Each item of a checkpoint (params, optimizer state, the rest of a train
state) is stored as a flat dict of arrays keyed `{index:05d}_{path}`: the
leaf's index in tree order and its tree path made filename-safe. A restore
builds the same names from the target tree and reads each leaf by its name,
after `check_matches` has compared the saved names, shapes and dtypes with
the target's (orbax would cast a leaf of another dtype silently). When the
data of a checkpoint cannot be read, `unreadable_leaves` names the damaged
leaves by restoring halves of the tree.

Master weights are part of the format's choices: a checkpoint written with
`use_master_weights_in_ckpt=False` stores the optimizer state with every
master weight replaced by `None` (`strip_masters`), and a
restore rebuilds them by upcasting the params (`rebuild_masters`).
"""

from __future__ import annotations

import re
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jmp_train._src import optimizer_state, param_update

FORMAT = 1  # meta["format"]: leaves stored as `{index:05d}_{path}` keys.


def leaf_names(tree: Any) -> list[tuple[str, str, Any]]:
  """`(name, tree path, leaf)` per leaf: the name is unique and readable.

  The index makes names unique where two paths sanitize alike. Restores look
  leaves up by these names, never by sorting them (as strings, "100000_"
  sorts before "10001_").
  """
  out = []
  for i, (path, leaf) in enumerate(jax.tree_util.tree_leaves_with_path(tree)):
    keystr = jax.tree_util.keystr(path)
    readable = re.sub(r"[^A-Za-z0-9]+", "_", keystr).strip("_")
    out.append((f"{i:05d}_{readable}", keystr, leaf))
  return out


def flat(tree: Any) -> dict[str, Any]:
  """A flat dict of the leaves, keyed by `leaf_names`."""
  return {name: leaf for name, _, leaf in leaf_names(tree)}


def unflat(template: Any, leaves_by_name: dict[str, Any]) -> Any:
  """The inverse of `flat`: each leaf of `template` is read by its name."""
  return jax.tree.unflatten(
    jax.tree.structure(template),
    [leaves_by_name[name] for name, _, _ in leaf_names(template)],
  )


def _path_of(name: str) -> str:
  """A stored name without its index: one extra leaf shifts every later
  index, so structures are compared by path."""
  return name.split("_", 1)[-1]


def check_matches(saved: Any, target: Any, where: str) -> None:
  """Refuses a saved item that differs from `target` in any leaf.

  Args:
    saved: orbax's metadata of the item: stored name -> shape and dtype.
    target: the tree to restore into (arrays or `jax.ShapeDtypeStruct`s).
    where: "Checkpoint <step> <item>", the start of every message.

  Raises:
    ValueError: names the leaves only in the checkpoint or only in the
      target, or the first leaf whose shape or dtype differs.
  """
  names = leaf_names(target)
  wanted = {name for name, _, _ in names}
  if set(saved) != wanted:
    saved_paths = {_path_of(name) for name in saved}
    extra = sorted(saved_paths - {_path_of(name) for name in wanted})
    missing = [
      path for name, path, _ in names if _path_of(name) not in saved_paths
    ]
    why = "The model or the optimizer differs from the one that saved it."
    if (
      extra
      and not missing
      and all(k.endswith("loss_scaler_hysteresis_tracker") for k in extra)
    ):
      # Before jmp's layout, a hysteresis=1 DynamicLossScale had a third
      # leaf (hysteresis_tracker), as one with hysteresis > 1 has.
      why = (
        "Either the saved dynamic loss scale has hysteresis > 1 and the "
        "target's 1, or an earlier jmp_train wrote it: its hysteresis=1 "
        "scale kept a hysteresis_tracker leaf that this version (jmp's "
        "two leaves) does not have, so only that version restores it."
      )
    raise ValueError(
      f"{where} does not match the target: leaves only in the checkpoint "
      f"{extra[:5]}, only in the target {missing[:5]} ({len(saved)} saved "
      f"leaves, {len(wanted)} wanted). {why}"
    )
  for name, path, want in names:
    got = saved[name]
    shape, dtype = tuple(got.shape), np.dtype(got.dtype)
    if shape != tuple(want.shape) or dtype != np.dtype(want.dtype):
      hint = ""
      if shape != tuple(want.shape) and where.endswith("train"):
        hint = (
          " Model state and FP8 metadata take their shapes from the model "
          "and its FP8 recipe (amax_history_len, calls per matmul): build "
          "the target as the run that saved it was built."
        )
      elif shape != tuple(want.shape) and where.endswith("opt_state"):
        hint = (
          " A ZeRO-1 optimizer state (laid out by a jmp_train.zero1 plan) "
          "must be saved and restored with plan=, which cuts its padding "
          "before saving and pads it again on restore."
        )
      raise ValueError(
        f"{where} leaf {path} is {dtype}{list(shape)}, the target wants "
        f"{np.dtype(want.dtype)}{list(want.shape)}; orbax would cast "
        f"silently, so this refuses.{hint}"
      )


def strip_masters(opt_state: Any) -> Any:
  """`opt_state` with every master weight replaced by `None`."""

  def strip(s):
    if not optimizer_state.is_mixed_precision_state(s):
      return s
    stripped = jax.tree.map(lambda _: None, s.master_params)
    return s._replace(master_params=stripped)

  return jax.tree.map(
    strip, opt_state, is_leaf=optimizer_state.is_mixed_precision_state
  )


def rebuild_masters(template: Any, opt_state: Any, params: Any) -> Any:
  """Fills the master weights `template` has from the upcast `params` (a
  zero remainder or compensation where it keeps those instead).

  `opt_state` is `strip_masters(template)` restored; `template` says which
  params keep a master copy (the others stay `None`).
  """

  def fill(s, t):
    if not optimizer_state.is_mixed_precision_state(s):
      return s
    masters = jax.tree.map(
      param_update.rebuilt,
      t.master_params,
      params,
      is_leaf=param_update.keeps_nothing,
    )
    return s._replace(master_params=masters)

  # `opt_state` leads: a MixedPrecisionState of it is a leaf there, so the
  # template's (with arrays where `opt_state` has `None`) pairs whole.
  return jax.tree.map(
    fill, opt_state, template, is_leaf=optimizer_state.is_mixed_precision_state
  )


def unreadable_leaves(path: str, tree: Any, limit: int = 5) -> list[str]:
  """Tree paths of (up to `limit`) leaves of `tree` that fail to restore
  from the item stored at `path`: where a damaged checkpoint is damaged."""
  names = leaf_names(tree)
  reader = ocp.PyTreeCheckpointer()

  def fails(chunk):
    sub = {name: leaf for name, _, leaf in chunk}
    try:
      reader.restore(
        path,
        args=ocp.args.PyTreeRestore(
          item=sub,
          restore_args=ocp.checkpoint_utils.construct_restore_args(sub),
          partial_restore=True,
        ),
      )
    except Exception:
      return True
    return False

  found: list[str] = []

  def search(chunk):
    # Depth first, and only until `limit` leaves are named: with every
    # leaf unreadable a full bisection would take ~2N partial restores.
    if not chunk or len(found) >= limit or not fails(chunk):
      return
    if len(chunk) == 1:
      found.append(chunk[0][1])
      return
    half = len(chunk) // 2
    search(chunk[:half])
    search(chunk[half:])

  search(names)
  return found
