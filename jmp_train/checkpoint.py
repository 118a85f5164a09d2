"""Checkpoints with orbax: params, optimizer state and loss scale.

`Checkpointer(directory, use_master_weights_in_ckpt=...)` saves and restores
the params and the whole optimizer state, loss-scale counters included:

* `use_master_weights_in_ckpt=True` (the default) keeps the float32 master
  weights: a resumed run continues bit for bit.
* `False` (NxD's switch of the same name) drops them; on restore they are
  rebuilt by upcasting the low-precision params, as apex O2 does. The
  checkpoint is smaller (2 instead of 6 bytes per bf16 param plus the
  optimizer's moments) and a resume is not bit-exact.

The state is stored without ZeRO padding, each leaf under its index and tree
path, so a checkpoint written on one mesh restores onto another (8 devices to
4 or 1): pass the `TrainStep` of the new mesh. Restore templates come from
the optimizer (`tx.init` traced on the params), leaves are matched by name,
and a leaf whose saved shape or dtype differs from the template raises
instead of being silently cast.

Steps only go forward: a save whose step is not above the latest checkpoint
raises. To roll back, restore the earlier step with `restore(..., step=n,
rollback=True)`: the checkpoints after `n` then belong to an abandoned run,
and the next save deletes them before writing, so the directory always holds
one run. A restore without `rollback=True` never leads to a deletion.

Orbax writes each checkpoint into a temporary directory and renames it when
complete, so a process killed while saving leaves the last good checkpoint
as the latest one. Saves run in the background; the interpreter waits for
them before it exits.
"""

from __future__ import annotations

import atexit
import logging
import numbers
import os
import re
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

from jmp_train import fp8, transform

_FORMAT = 1  # meta["format"]: leaves stored as `{index:05d}_{path}` keys.
_logger = logging.getLogger(__name__)

# Managers with saves in flight, finished before the interpreter exits: a
# script that ends right after `save` (or drops its Checkpointer) must not
# lose that checkpoint. Plain atexit hooks run after concurrent.futures has
# shut down its executors, which orbax's background commit still needs; the
# threading hook runs before that (concurrent.futures registers its own
# shutdown there, earlier, and these hooks run last-registered first).
_pending_saves: set = set()


def _finish_pending_saves() -> None:
  for manager in list(_pending_saves):
    manager.wait_until_finished()
    _pending_saves.discard(manager)


getattr(threading, "_register_atexit", atexit.register)(_finish_pending_saves)


def _is_mp(x: Any) -> bool:
  return isinstance(x, transform.MixedPrecisionState)


def _is_masked(x: Any) -> bool:
  return isinstance(x, optax.MaskedNode)


def _strip_masters(state: Any) -> Any:
  """The state with every master weight replaced by `optax.MaskedNode()`."""

  def strip(s):
    if not _is_mp(s):
      return s
    masked = jax.tree.map(
      lambda _: optax.MaskedNode(), s.master_params, is_leaf=_is_masked
    )
    return s._replace(master_params=masked)

  return jax.tree.map(strip, state, is_leaf=_is_mp)


def _rebuild_masters(template: Any, state: Any, params: Any) -> Any:
  """Fills the master weights that `template` has from upcast params."""
  mp_templates = transform._mixed_precision_states(template)
  it = iter(mp_templates)

  def fill(s):
    if not _is_mp(s):
      return s
    tmpl = next(it)
    masters = jax.tree.map(
      lambda m, p: m if _is_masked(m) else p.astype(jnp.float32),
      tmpl.master_params,
      params,
      is_leaf=_is_masked,
    )
    return s._replace(master_params=masters)

  return jax.tree.map(fill, state, is_leaf=_is_mp)


def _keystr(path: Any) -> str:
  return jax.tree_util.keystr(path)


def _names(tree: Any) -> list[tuple[str, str, Any]]:
  """`(name, tree path, leaf)` per leaf: the name is unique and readable.

  The index makes names unique where two paths sanitize alike. Restores look
  leaves up by these names, never by sorting them (as strings, "100000_"
  sorts before "10001_").
  """
  out = []
  for i, (path, leaf) in enumerate(jax.tree_util.tree_leaves_with_path(tree)):
    readable = re.sub(r"[^A-Za-z0-9]+", "_", _keystr(path)).strip("_")
    out.append((f"{i:05d}_{readable}", _keystr(path), leaf))
  return out


def _flat(tree: Any) -> dict[str, Any]:
  """A flat dict of the leaves, keyed by `_names`."""
  return {name: leaf for name, _, leaf in _names(tree)}


def _unflat(template: Any, flat: dict[str, Any]) -> Any:
  """The inverse of `_flat`: each leaf of `template` is read by its name."""
  return jax.tree.unflatten(
    jax.tree.structure(template),
    [flat[name] for name, _, _ in _names(template)],
  )


def _abstract(x: Any, sharding: Any) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype, sharding=sharding)


def _checked_step(step: Any) -> int:
  """`step` as an int, if it is a non-negative integer (a jax int counts)."""
  ok = isinstance(step, numbers.Integral) and not isinstance(step, bool)
  if isinstance(step, (np.ndarray, np.generic, jax.Array)):
    ok = np.ndim(step) == 0 and jnp.issubdtype(step.dtype, jnp.integer)
  if not ok or int(step) < 0:
    raise ValueError(
      f"step must be a non-negative integer (a Python, NumPy or JAX int), "
      f"got {step!r}."
    )
  return int(step)


def _looks_padded(state_shape: tuple, param_shape: tuple) -> bool:
  """One dimension longer than the param's, the others equal: ZeRO padding."""
  if len(state_shape) != len(param_shape):
    return False
  pairs = zip(state_shape, param_shape, strict=True)
  diff = [(s, p) for s, p in pairs if s != p]
  return len(diff) == 1 and diff[0][0] > diff[0][1]


def _padded_leaves(params: Any, state: Any) -> list[str]:
  """Messages for state leaves that mirror a param with a padded shape.

  Any subtree of the state with the params' structure (an FP8 state in the
  params may be a `MaskedNode` there, as may a param without a master copy)
  mirrors the params leaf for leaf: Adam's moments, the master weights. A
  mirror leaf with one dimension longer than its param's is what
  `make_train_step(...).init` stores for ZeRO-1.
  """
  params_def = jax.tree.structure(params, is_leaf=fp8.is_fp8_state)
  param_leaves = jax.tree_util.tree_leaves_with_path(
    params, is_leaf=fp8.is_fp8_state
  )
  found = []

  def visit(path, node):
    if _is_masked(node) or node is None:
      return
    node_def = jax.tree.structure(node, is_leaf=_is_masked)
    if node_def == params_def:
      mirror = jax.tree.leaves(node, is_leaf=_is_masked)
      for (ppath, p), s in zip(param_leaves, mirror, strict=True):
        if fp8.is_fp8_state(p) or not hasattr(s, "shape"):
          continue
        if _looks_padded(tuple(s.shape), tuple(p.shape)):
          found.append(
            f"opt_state{_keystr(path)}{_keystr(ppath)} has shape "
            f"{tuple(s.shape)}, the param {_keystr(ppath)} {tuple(p.shape)}"
          )
      return
    if jax.tree_util.treedef_is_leaf(node_def):
      return
    children = jax.tree_util.tree_flatten_with_path(
      node, is_leaf=lambda x: x is not node
    )[0]
    for child_path, child in children:
      visit(path + child_path, child)

  visit((), state)
  return found


class Checkpointer:
  """Saves and restores `(params, opt_state)` under `directory/<step>`.

  Steps only go forward. `save(step, ...)` with a step not above the latest
  checkpoint raises, unless this Checkpointer rolled back to an earlier step:

      restore(..., step=3, rollback=True)  # 1..5 exist; 4 and 5 abandoned
      save(4, ...)           # deletes 4 and 5, then writes the new 4

  so the directory holds one run, never steps of two runs mixed.

  Args:
    directory: where the checkpoints live (created if missing).
    use_master_weights_in_ckpt: save the float32 master weights (resume is
      bit-exact) or not (smaller; rebuilt from the params on restore).
    max_to_keep: how many checkpoints to keep, at least 1 (None: all).

  Example:
    >>> import tempfile, jax.numpy as jnp, optax, jmp_train as jmp
    >>> from jmp_train.checkpoint import Checkpointer
    >>> tx = jmp.mixed_precision(optax.adam(1e-3))
    >>> params = {"w": jnp.ones(3, jnp.bfloat16)}
    >>> state = tx.init(params)
    >>> with Checkpointer(tempfile.mkdtemp()) as ckpt:
    ...   ckpt.save(7, params, state)
    ...   step, params2, state2 = ckpt.restore(params, tx=tx)
    >>> step, params2["w"].dtype, state2.master_params["w"].dtype
    (7, dtype(bfloat16), dtype('float32'))
  """

  def __init__(
    self,
    directory: str | os.PathLike,
    *,
    use_master_weights_in_ckpt: bool = True,
    max_to_keep: int | None = None,
  ):
    if not isinstance(use_master_weights_in_ckpt, bool):
      raise ValueError(
        "use_master_weights_in_ckpt must be True or False, got "
        f"{use_master_weights_in_ckpt!r}."
      )
    if max_to_keep is not None and (
      not isinstance(max_to_keep, numbers.Integral)
      or isinstance(max_to_keep, bool)
      or max_to_keep < 1
    ):
      raise ValueError(
        "max_to_keep must be None (keep all) or an integer >= 1, got "
        f"{max_to_keep!r} (0 would delete every checkpoint it writes)."
      )
    self.directory = os.path.abspath(os.fspath(directory))
    self.use_master_weights_in_ckpt = use_master_weights_in_ckpt
    self._rolled_back_to: int | None = None
    self._closed = False
    self._manager = ocp.CheckpointManager(
      self.directory,
      options=ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, create=True
      ),
      # Named handlers, so a fresh process can read metadata before restoring.
      item_handlers={
        "params": ocp.StandardCheckpointHandler(),
        "opt_state": ocp.StandardCheckpointHandler(),
        "meta": ocp.JsonCheckpointHandler(),
      },
    )

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  def latest_step(self) -> int | None:
    """The newest complete checkpoint's step, or None."""
    self._manager.wait_until_finished()
    self._manager.reload()
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    """Steps of the complete checkpoints, oldest first."""
    self._manager.wait_until_finished()
    self._manager.reload()
    return sorted(self._manager.all_steps())

  def save(
    self,
    step: int,
    params: optax.Params,
    opt_state: optax.OptState,
    *,
    train_step: Any = None,
  ) -> None:
    """Saves a checkpoint in the background.

    `wait()` blocks until it is written; `close()` and the interpreter's exit
    wait too. Nothing is written when this raises.

    Args:
      step: the step number naming the checkpoint, above the latest one (or
        above the step this Checkpointer restored, which deletes the later
        checkpoints first: see the class docstring).
      params: the params.
      opt_state: the optimizer state, as `train_step` or `tx.init` built it.
      train_step: the `TrainStep` whose layout `opt_state` has, if any (its
        ZeRO padding is cut off before saving). Required for a state built by
        `make_train_step(...).init` with padding.

    Raises:
      ValueError: `step` is not above the latest checkpoint (or the restored
        one), or `opt_state` holds ZeRO padding and `train_step` is missing.
    """
    step = _checked_step(step)
    if train_step is None:
      padded = _padded_leaves(params, opt_state)
      if padded:
        raise ValueError(
          f"Checkpoint {step}: opt_state holds ZeRO-1 padding "
          f"({padded[0]}; {len(padded)} padded leaves). Pass train_step=, the "
          "TrainStep whose init built this state, so the padding is cut off "
          "before saving; a padded checkpoint does not restore."
        )
      state = opt_state
    else:
      state = train_step.to_logical(opt_state)
    if not self.use_master_weights_in_ckpt:
      state = _strip_masters(state)
    steps = self.all_steps()
    if self._rolled_back_to is not None:
      restored = self._rolled_back_to
      if step <= restored:
        raise ValueError(
          f"Cannot save step {step}: this Checkpointer restored step "
          f"{restored} and continues from it, so the next step must be above "
          f"{restored}."
        )
      abandoned = [s for s in steps if s > restored]
      if abandoned:
        _logger.warning(
          "Deleting checkpoints %s in %s: they follow step %d, which was "
          "restored, and belong to the abandoned run.",
          abandoned,
          self.directory,
          restored,
        )
      for s in abandoned:
        self._manager.delete(s)
      self._rolled_back_to = None
    elif steps and step <= steps[-1]:
      raise ValueError(
        f"Cannot save step {step}: the latest checkpoint in {self.directory} "
        f"is step {steps[-1]}, and steps only go forward. To roll back, "
        "restore an earlier step first with restore(..., step=n, "
        "rollback=True) (the next save deletes the checkpoints after n); "
        f"otherwise use a step above {steps[-1]}."
      )
    meta = {
      "master_weights": self.use_master_weights_in_ckpt,
      "format": _FORMAT,
    }
    written = self._manager.save(
      step,
      args=ocp.args.Composite(
        params=ocp.args.StandardSave(_flat(params)),
        opt_state=ocp.args.StandardSave(_flat(state)),
        meta=ocp.args.JsonSave(meta),
      ),
    )
    if written:
      for manager in list(_pending_saves):  # forget finished ones
        if not manager.is_saving_in_progress():
          _pending_saves.discard(manager)
      _pending_saves.add(self._manager)
    else:
      raise RuntimeError(
        f"orbax did not write checkpoint {step} in {self.directory} (its "
        "CheckpointManager.save returned False)."
      )

  def restore(
    self,
    params: optax.Params,
    *,
    train_step: Any = None,
    tx: optax.GradientTransformation | None = None,
    step: int | None = None,
    rollback: bool = False,
  ) -> tuple[int, optax.Params, optax.OptState]:
    """Restores `(step, params, opt_state)`, resharded for the target.

    With `rollback=True`, the checkpoints after `step` become an abandoned
    run: the next `save` (with a step above `step`) deletes them before it
    writes. Without it a restore changes nothing on disk.

    Args:
      params: params or `jax.ShapeDtypeStruct`s with the target structure,
        shapes, dtypes and shardings (their values are not used).
      train_step: the target `TrainStep` (its mesh and ZeRO layout); or
      tx: the optimizer, for a state as `jax.jit(tx.init)(params)` builds
        and places it; the params keep their shardings (or go to the
        default device).
      step: which checkpoint (default: the latest).
      rollback: resume from `step` as a new branch of the run (see above).

    Returns:
      The step number, the params and the optimizer state.

    Raises:
      FileNotFoundError: no checkpoint, or none at `step`.
      ValueError: the checkpoint does not match the target (structure, shape
        or dtype of a leaf) or was written in another format.
      OSError: stored data cannot be read; names the leaves.
    """
    if (train_step is None) == (tx is None):
      raise ValueError("Pass exactly one of train_step= or tx=.")
    if not isinstance(rollback, bool):
      raise TypeError(f"rollback must be True or False, got {rollback!r}.")
    steps = self.all_steps()
    if step is None:
      if not steps:
        raise FileNotFoundError(f"No complete checkpoint in {self.directory}.")
      step = steps[-1]
    else:
      step = _checked_step(step)
      if step not in steps:
        raise FileNotFoundError(
          f"No checkpoint for step {step} in {self.directory}; the complete "
          f"checkpoints are steps {steps}."
        )
    meta = self._read(
      step,
      "meta",
      lambda: self._manager.restore(
        step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
      )["meta"],
    )
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
      found = meta.get("format") if isinstance(meta, dict) else meta
      raise ValueError(
        f"Checkpoint {step} in {self.directory} has format {found!r}; this "
        f"version of jmp_train reads format {_FORMAT}."
      )

    if train_step is not None:
      param_shardings = train_step.param_shardings(params)
      state_template = train_step.plan(params).opt_state_logical
      state_shardings = train_step.logical_opt_state_shardings(params)
    else:
      # Compiling (not running) tx.init gives where jit puts each state
      # leaf: on the params' devices and shardings, moments like their param.
      target = jax.tree.map(
        lambda p: jax.ShapeDtypeStruct(
          p.shape, p.dtype, sharding=getattr(p, "sharding", None)
        ),
        params,
      )
      compiled = jax.jit(tx.init).trace(target).lower().compile()
      param_shardings = compiled.input_shardings[0][0]
      state_template = compiled.out_info
      state_shardings = compiled.output_shardings
    params_abs = jax.tree.map(_abstract, params, param_shardings)
    state_abs = jax.tree.map(_abstract, state_template, state_shardings)
    saved_state_abs = state_abs
    if not meta["master_weights"]:
      saved_state_abs = _strip_masters(state_abs)
    targets = {"params": params_abs, "opt_state": saved_state_abs}
    self._check_metadata(step, targets)
    restored = self._restore_arrays(step, targets)
    new_params = _unflat(params_abs, restored["params"])
    state = _unflat(saved_state_abs, restored["opt_state"])
    if not meta["master_weights"]:
      state = jax.jit(
        lambda s, p: _rebuild_masters(state_abs, s, p),
        out_shardings=jax.tree.map(lambda a: a.sharding, state_abs),
      )(state, new_params)
    if train_step is not None:
      state = train_step.from_logical(state, params)
    self._rolled_back_to = step if rollback and step < steps[-1] else None
    return step, new_params, state

  def _read(self, step: int, what: str, read: Any) -> Any:
    """`read()`, with an error naming the step and what could not be read."""
    try:
      return read()
    except Exception as e:
      raise OSError(
        f"Checkpoint {step} in {self.directory}: cannot read its {what} "
        f"(damaged or missing files); the complete checkpoints are steps "
        f"{sorted(self._manager.all_steps())}."
      ) from e

  def _check_metadata(self, step: int, targets: dict[str, Any]) -> None:
    saved = self._read(
      step, "metadata", lambda: self._manager.item_metadata(step)
    )
    for item, tree in targets.items():
      meta = saved[item]
      names = _names(tree)
      wanted = {name for name, _, _ in names}
      if set(meta) != wanted:
        # Compared without the index prefix: one extra leaf shifts the index
        # of every later leaf.
        saved_paths = {name.split("_", 1)[-1] for name in meta}
        target_paths = {name.split("_", 1)[-1] for name in wanted}
        extra = sorted(saved_paths - target_paths)
        missing = [
          path
          for name, path, _ in names
          if name.split("_", 1)[-1] not in saved_paths
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
          f"Checkpoint {step} {item} does not match the target: leaves only "
          f"in the checkpoint {extra[:5]}, only in the target "
          f"{missing[:5]} ({len(meta)} saved leaves, {len(wanted)} wanted). "
          + why
        )
      for name, path, abs_leaf in names:
        m = meta[name]
        if tuple(m.shape) != tuple(abs_leaf.shape) or np.dtype(
          m.dtype
        ) != np.dtype(abs_leaf.dtype):
          raise ValueError(
            f"Checkpoint {step} {item} leaf {path} is {m.dtype}"
            f"{list(m.shape)}, the target wants {abs_leaf.dtype}"
            f"{list(abs_leaf.shape)}; orbax would cast silently, so this "
            "refuses."
          )

  def _restore_arrays(
    self, step: int, targets: dict[str, Any]
  ) -> dict[str, dict[str, Any]]:
    flats = {item: _flat(tree) for item, tree in targets.items()}
    try:
      return self._manager.restore(
        step,
        args=ocp.args.Composite(
          **{k: ocp.args.StandardRestore(v) for k, v in flats.items()}
        ),
      )
    except Exception as e:
      bad = [
        f"{item}{path}"
        for item, tree in targets.items()
        for path in self._unreadable(step, item, tree)
      ]
      if not bad:
        raise
      raise OSError(
        f"Checkpoint {step} in {self.directory}: cannot read leaves {bad} "
        "(up to 5 per item; damaged or missing data). Restore "
        "another step (all_steps() lists them)."
      ) from e

  def _unreadable(
    self, step: int, item: str, tree: Any, limit: int = 5
  ) -> list[str]:
    """Tree paths of (up to `limit`) leaves of `item` that fail to restore."""
    names = _names(tree)
    reader = ocp.PyTreeCheckpointer()
    path = os.path.join(self.directory, str(step), item)

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

  def wait(self) -> None:
    """Blocks until pending saves are complete."""
    self._manager.wait_until_finished()
    _pending_saves.discard(self._manager)

  def close(self) -> None:
    """Finishes pending saves and releases orbax's resources."""
    if self._closed:
      return
    self.wait()
    self._manager.close()
    self._closed = True
