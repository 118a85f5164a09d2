"""Checkpoints with orbax: the train state, or params and optimizer state.

`Checkpointer(directory, use_master_weights_in_ckpt=...)` saves and restores
a whole `jmp_train.train.TrainState` (`save_state`, `restore_state`: params,
the optimizer state with its loss-scale counters, model state such as
`batch_stats`, FP8 metadata, the step number and the PRNG key) or params and
optimizer state alone (`save`, `restore`):

* `use_master_weights_in_ckpt=True` (the default) keeps the float32 master
  weights: a resumed run continues bit for bit.
* `False` (NxD's switch of the same name) drops them; on restore they are
  rebuilt by upcasting the low-precision params, as apex O2 does. The
  checkpoint is smaller (2 instead of 6 bytes per bf16 param plus the
  optimizer's moments) and a resume is not bit-exact.

The optimizer state is stored without ZeRO-1 padding, each leaf under its
index and tree path (`checkpoint_format`), so a checkpoint written on one
mesh restores onto another (8 devices to 4 or 1): pass `plan=`, the
`jmp_train.zero1` plan of the state being saved and of the mesh restored
onto; the plan says which leaves are padded and how. Leaves are matched by
name, and a leaf whose saved shape or dtype differs from the target raises
instead of being silently cast (a ZeRO-1 state saved without its plan keeps
its padding and fails there, naming the leaf).

Steps only go forward: a save whose step is not above the latest checkpoint
raises. To roll back, restore the earlier step with `rollback=True`: the
checkpoints after it then belong to an abandoned run, and the next save
deletes them before writing, so the directory always holds one run. A
restore without `rollback=True` never leads to a deletion.

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
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

from jmp_train._src import checkpoint_format as fmt
from jmp_train._src import distributed, leaves, train, zero1

_logger = logging.getLogger("jmp_train.checkpoint")

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


def _checked_plan(plan: Any) -> zero1.Plan:
  if not isinstance(plan, zero1.Plan):
    raise TypeError(
      "plan must be a jmp_train.zero1.Plan (zero1.make_plan(...)) or None, "
      f"got {plan!r}."
    )
  return plan


def _check_params_fit(params: Any, plan: zero1.Plan, what: str) -> None:
  want = jax.tree.structure(plan.param_shardings)
  if jax.tree.structure(params) != want:
    raise ValueError(
      f"{what} does not have the plan's params structure {want}: got "
      f"{jax.tree.structure(params)}. Pass the plan built for these params."
    )
  for (path, p), planned in zip(
    jax.tree_util.tree_flatten_with_path(params)[0],
    jax.tree.leaves(plan.params),
    strict=True,
  ):
    dtype = p.dtype if hasattr(p, "dtype") else np.result_type(p)
    got = (tuple(np.shape(p)), np.dtype(dtype))
    if got != (tuple(planned.shape), np.dtype(planned.dtype)):
      raise ValueError(
        f"{what}{jax.tree_util.keystr(path)} is {got[1].name}{list(got[0])}, "
        f"but the plan was made for {np.dtype(planned.dtype).name}"
        f"{list(planned.shape)}. Pass the plan built for these params "
        "(zero1.make_plan(tx, params, mesh))."
      )


def _bare_state(params: Any, opt_state: Any) -> train.TrainState:
  """A train state of params and optimizer state only, for the plan's
  functions (`zero1.to_logical`, `zero1.place`), which take a train state."""
  return train.TrainState(
    step=jnp.zeros([], jnp.int32),
    params=params,
    opt_state=opt_state,
    model_state={},
    fp8={},
    key=None,
  )


def _abstract(x: Any, sharding: Any) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype, sharding=sharding)


def _sharding_or_default(x: Any) -> Any:
  """Where a leaf of a target without a plan goes: its own sharding, or this
  process's first device for a leaf that has none (a NumPy or abstract
  leaf; `jax.devices()[0]` would be process 0's)."""
  sharding = getattr(x, "sharding", None)
  if sharding is None:
    sharding = jax.sharding.SingleDeviceSharding(distributed.local_device())
  return sharding


def _global(items: dict[str, Any], what: str) -> dict[str, Any]:
  """Items to save without a plan: with several processes, their
  process-local leaves, checked to be the same on every process, become
  replicated global arrays (orbax saves global arrays only)."""
  if jax.process_count() == 1:
    return items
  distributed.check_same_on_every_process(items, what)
  return distributed.replicated_global(items)


def _key_data(key: Any) -> jax.ShapeDtypeStruct:
  """The abstract `jax.random.key_data` of an abstract typed key."""
  data = jax.eval_shape(
    jax.random.key_data, jax.ShapeDtypeStruct(key.shape, key.dtype)
  )
  return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=key.sharding)


def _keys_as_data(tree: Any) -> tuple[Any, dict[str, str]]:
  """`tree` with each typed PRNG key as its `key_data` (orbax stores arrays
  of numbers), and each such leaf's path with its implementation."""
  impls: dict[str, str] = {}

  def data(path, x):
    if not leaves.is_prng_key(x):
      return x
    impls[leaves.keystr(path)] = str(jax.random.key_impl(x))
    return jax.random.key_data(x)

  return jax.tree_util.tree_map_with_path(data, tree), impls


class Checkpointer:
  """Saves and restores train states under `directory/<step>`.

  Steps only go forward. A save with a step not above the latest checkpoint
  raises, unless this Checkpointer rolled back to an earlier step:

      restore_state(..., step=3, rollback=True)  # 1..5 exist; 4, 5 abandoned
      save_state(state)      # state.step == 4: deletes 4 and 5, writes 4

  so the directory holds one run, never steps of two runs mixed.

  Args:
    directory: where the checkpoints live (created if missing).
    use_master_weights_in_ckpt: save the float32 master weights (resume is
      bit-exact) or not (smaller; rebuilt from the params on restore).
    max_to_keep: how many checkpoints to keep, at least 1 (None: all).

  Example:
    >>> import tempfile, jax, jax.numpy as jnp, optax, jmp_train as jmp
    >>> from jmp_train.checkpoint import Checkpointer
    >>> from jmp_train.train import TrainState
    >>> tx = jmp.mixed_precision(optax.adam(1e-3))
    >>> params = {"w": jnp.ones(3, jnp.bfloat16)}
    >>> state = TrainState.create(params=params, tx=tx, key=jax.random.key(0))
    >>> with Checkpointer(tempfile.mkdtemp()) as ckpt:
    ...   ckpt.save_state(state.replace(step=jnp.int32(7)))
    ...   target = jax.eval_shape(lambda: state)  # shapes, dtypes, no values
    ...   state2 = ckpt.restore_state(target)
    >>> int(state2.step), state2.params["w"].dtype
    (7, dtype(bfloat16))
    >>> state2.opt_state.master_params["w"].dtype
    dtype('float32')
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
      # "train" (step, key, model state, FP8 metadata) is in train-state
      # checkpoints only.
      item_handlers={
        "params": ocp.StandardCheckpointHandler(),
        "opt_state": ocp.StandardCheckpointHandler(),
        "train": ocp.StandardCheckpointHandler(),
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

  # -- Saving ----------------------------------------------------------------

  def save_state(
    self, state: train.TrainState, *, plan: zero1.Plan | None = None
  ) -> None:
    """Saves a train state in the background, as checkpoint `state.step`.

    Everything a resume needs: params, the optimizer state (without ZeRO-1
    padding; masters as `use_master_weights_in_ckpt` says), model state, FP8
    metadata, step number and PRNG key (its `jax.random.key_data` and
    implementation). `wait()` blocks until it is written; `close()` and the
    interpreter's exit wait too. Nothing is written when this raises.

    Args:
      state: the `TrainState`. Reading `state.step` waits for the step that
        computes it.
      plan: the `zero1.Plan` that laid `state` out, if any (its padding is
        cut off before saving).

    Raises:
      ValueError: `state.step` is not above the latest checkpoint (or above
        the one this Checkpointer restored with `rollback=True`), or the
        state is not laid out as `plan` says.
      TypeError: `state` is not a `TrainState` or `plan` not a `Plan`.
    """
    if not isinstance(state, train.TrainState):
      raise TypeError(
        f"state must be a jmp_train.train.TrainState, got {type(state)!r}; "
        "use save(step, params, opt_state) for params and optimizer state."
      )
    step = _checked_step(state.step)
    if plan is None:
      _refuse_padded(state.params, state.opt_state)
    else:
      state = zero1.to_logical(_checked_plan(plan), state)
    key = state.key
    if key is not None:
      key = jax.random.key_data(key)
    # Keys a model keeps (NNX's nnx.Rngs), as data with their implementation.
    model_state, model_keys = _keys_as_data(state.model_state)
    rest = {
      "step": state.step,
      "key": key,
      "model_state": model_state,
      "fp8": state.fp8,
    }
    items = {
      "params": state.params,
      "opt_state": state.opt_state,
      "train": rest,
    }
    impl = None if key is None else str(jax.random.key_impl(state.key))
    if plan is None:
      items = _global(items, "save_state's state (without a plan)")
    meta = {
      "train_state": True,
      "key_impl": impl,
      "model_keys": model_keys,
    }
    self._write(step, items, meta)

  def save(
    self,
    step: int,
    params: optax.Params,
    opt_state: optax.OptState,
    *,
    plan: zero1.Plan | None = None,
  ) -> None:
    """Saves params and optimizer state in the background.

    As `save_state`, for a loop that keeps no `TrainState`.

    Args:
      step: the step number naming the checkpoint, above the latest one (or
        above the step this Checkpointer restored with `rollback=True`,
        which deletes the later checkpoints first: see the class docstring).
      params: the params.
      opt_state: the optimizer state, as `tx.init` or a plan laid it out.
      plan: the `zero1.Plan` that laid `opt_state` out, if any (its padding
        is cut off before saving). A padded state saved without it keeps
        its padding and does not restore.

    Raises:
      ValueError: `step` is not above the latest checkpoint (or the restored
        one), or `opt_state` is not laid out as `plan` says.
    """
    step = _checked_step(step)
    if plan is None:
      _refuse_padded(params, opt_state)
    else:
      state = _bare_state(params, opt_state)
      opt_state = zero1.to_logical(_checked_plan(plan), state).opt_state
    items = {"params": params, "opt_state": opt_state}
    if plan is None:
      items = _global(items, "save's params and opt_state (without a plan)")
    self._write(step, items, {})

  def _write(self, step: int, items: dict[str, Any], meta: dict) -> None:
    """Saves `items` as checkpoint `step` if steps go forward, deleting an
    abandoned run's checkpoints first after a rollback."""
    if not self.use_master_weights_in_ckpt:
      items = {**items, "opt_state": fmt.strip_masters(items["opt_state"])}
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
          "%sDeleting checkpoints %s in %s: they follow step %d, which was "
          "restored, and belong to the abandoned run.",
          distributed.process_prefix(),
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
        "restore an earlier step first with step=n, rollback=True (the next "
        f"save deletes the checkpoints after n); otherwise use a step above "
        f"{steps[-1]}."
      )
    flats = {k: fmt.flat(v) for k, v in items.items()}
    # orbax refuses an item without leaves (optax.sgd's state): it is left
    # out, and the meta says so.
    empty = sorted(k for k, flat in flats.items() if not flat)
    meta = {
      "master_weights": self.use_master_weights_in_ckpt,
      "format": fmt.FORMAT,
      "empty_items": empty,
      **meta,
    }
    args = {k: ocp.args.StandardSave(flat) for k, flat in flats.items() if flat}
    written = self._manager.save(
      step, args=ocp.args.Composite(**args, meta=ocp.args.JsonSave(meta))
    )
    if not written:
      raise RuntimeError(
        f"orbax did not write checkpoint {step} in {self.directory} (its "
        "CheckpointManager.save returned False)."
      )
    for manager in list(_pending_saves):  # forget finished ones
      if not manager.is_saving_in_progress():
        _pending_saves.discard(manager)
    _pending_saves.add(self._manager)

  # -- Restoring -------------------------------------------------------------

  def restore_state(
    self,
    target: train.TrainState,
    *,
    plan: zero1.Plan | None = None,
    step: int | None = None,
    rollback: bool = False,
  ) -> train.TrainState:
    """Restores a train state written by `save_state`.

    With `rollback=True`, the checkpoints after `step` become an abandoned
    run: the next save (with a step above `step`) deletes them before it
    writes. Without it a restore changes nothing on disk.

    Args:
      target: a `TrainState` with the target structure, shapes and dtypes:
        a concrete one or `jax.eval_shape(lambda: TrainState.create(...))`
        (the values are not used). Without a plan, each leaf goes where
        `target`'s leaf is (its sharding; the default device for an abstract
        leaf without one).
      plan: the `zero1.Plan` of the mesh to restore onto: the state comes
        back laid out as `zero1.place(plan, ...)` lays it out (`target`'s
        optimizer state may then be padded or not).
      step: which checkpoint (default: the latest).
      rollback: resume from `step` as a new branch of the run (see above).

    Returns:
      The `TrainState`, its step number the checkpoint's.

    Raises:
      FileNotFoundError: no checkpoint, or none at `step`.
      ValueError: the checkpoint does not match the target (structure, shape
        or dtype of a leaf, PRNG key implementation), holds no train state
        (`save` wrote it) or was written in another format.
      TypeError: `target` is not a `TrainState` or `plan` not a `Plan`.
      OSError: stored data cannot be read; names the leaves.
    """
    if not isinstance(target, train.TrainState):
      raise TypeError(
        f"target must be a jmp_train.train.TrainState (concrete or from "
        f"jax.eval_shape), got {type(target)!r}."
      )
    _check_rollback(rollback)
    step, steps, meta = self._checkpoint(step)
    if not meta.get("train_state", False):
      raise ValueError(
        f"Checkpoint {step} in {self.directory} holds params and opt_state "
        "only (save wrote it, not save_state): restore it with "
        "restore(params, tx= or plan=)."
      )
    if plan is None:
      shardings = jax.tree.map(_sharding_or_default, target)
      logical = target
    else:
      _check_params_fit(target.params, _checked_plan(plan), "target.params")
      shardings = plan.state_shardings(target, logical=True)
      logical = target.replace(opt_state=plan.logical_opt_state)
    want = jax.tree.map(_abstract, logical, shardings)
    self._check_key(step, meta.get("key_impl"), want.key)
    model_keys = meta.get("model_keys", {})

    def key_data(path, x):
      if not leaves.is_prng_key(x):
        return x
      where = f"model_state leaf {leaves.keystr(path)}"
      if "model_keys" not in meta:
        raise ValueError(
          f"Checkpoint {step} in {self.directory} was written by an earlier "
          f"jmp_train, which kept no record of the PRNG key at {where}: "
          "restore into a target holding its jax.random.key_data there, "
          "then jax.random.wrap_key_data."
        )
      self._check_key(step, model_keys.get(leaves.keystr(path)), x, where)
      return _key_data(x)

    rest = {
      "step": want.step,
      "key": None if want.key is None else _key_data(want.key),
      "model_state": jax.tree_util.tree_map_with_path(
        key_data, want.model_state
      ),
      "fp8": want.fp8,
    }
    got = self._restore(step, meta, want.params, want.opt_state, rest)
    rest = got["train"]
    key = rest["key"]
    if key is not None:
      key = jax.random.wrap_key_data(key, impl=meta["key_impl"])
    model_state = jax.tree_util.tree_map_with_path(
      lambda path, x, w: (
        jax.random.wrap_key_data(x, impl=model_keys[leaves.keystr(path)])
        if leaves.is_prng_key(w)
        else x
      ),
      rest["model_state"],
      want.model_state,
    )
    state = train.TrainState(
      step=rest["step"],
      params=got["params"],
      opt_state=got["opt_state"],
      model_state=model_state,
      fp8=rest["fp8"],
      key=key,
    )
    if plan is not None:
      state = zero1.place(plan, state)
    self._rolled_back_to = step if rollback and step < steps[-1] else None
    return state

  def restore(
    self,
    params: optax.Params,
    *,
    plan: zero1.Plan | None = None,
    tx: optax.GradientTransformation | None = None,
    step: int | None = None,
    rollback: bool = False,
  ) -> tuple[int, optax.Params, optax.OptState]:
    """Restores `(step, params, opt_state)`, resharded for the target.

    Reads the params and optimizer state of a checkpoint that `save` or
    `save_state` wrote. `rollback` works as in `restore_state`.

    Args:
      params: params or `jax.ShapeDtypeStruct`s with the target structure,
        shapes, dtypes and shardings (their values are not used).
      plan: the `zero1.Plan` of the mesh to restore onto: params and
        optimizer state come back laid out as it says (padded); or
      tx: the optimizer, for a state as `jax.jit(tx.init)(params)` builds
        and places it; the params keep their shardings (or go to the
        default device).
      step: which checkpoint (default: the latest).
      rollback: resume from `step` as a new branch of the run.

    Returns:
      The step number, the params and the optimizer state.

    Raises:
      FileNotFoundError: no checkpoint, or none at `step`.
      ValueError: the checkpoint does not match the target (structure, shape
        or dtype of a leaf) or was written in another format.
      OSError: stored data cannot be read; names the leaves.
    """
    if (plan is None) == (tx is None):
      raise ValueError("Pass exactly one of plan= or tx=.")
    _check_rollback(rollback)
    step, steps, meta = self._checkpoint(step)
    if plan is not None:
      _check_params_fit(params, _checked_plan(plan), "params")
      param_shardings = plan.param_shardings
      opt_state = plan.logical_opt_state
    else:
      # Compiling (not running) tx.init gives where jit puts each state
      # leaf: on the params' devices and shardings, moments like their param.
      target = jax.tree.map(
        lambda p: _abstract(p, _sharding_or_default(p)), params
      )
      compiled = jax.jit(tx.init).trace(target).lower().compile()
      param_shardings = compiled.input_shardings[0][0]
      opt_state = jax.tree.map(
        _abstract, compiled.out_info, compiled.output_shardings
      )
    params = jax.tree.map(_abstract, params, param_shardings)
    got = self._restore(step, meta, params, opt_state)
    params, opt_state = got["params"], got["opt_state"]
    if plan is not None:
      placed = zero1.place(plan, _bare_state(params, opt_state))
      params, opt_state = placed.params, placed.opt_state
    self._rolled_back_to = step if rollback and step < steps[-1] else None
    return step, params, opt_state

  def _checkpoint(self, step: int | None) -> tuple[int, list[int], dict]:
    """The step to read (default: the latest), all steps and its meta."""
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
    if not isinstance(meta, dict) or meta.get("format") != fmt.FORMAT:
      found = meta.get("format") if isinstance(meta, dict) else meta
      raise ValueError(
        f"Checkpoint {step} in {self.directory} has format {found!r}; this "
        f"version of jmp_train reads format {fmt.FORMAT}."
      )
    return step, steps, meta

  def _check_key(
    self, step: int, impl: str | None, key: Any, where: str = "key"
  ) -> None:
    """Refuses a target whose PRNG key (`where`: the train state's, or a
    model-state leaf) differs from the saved one in presence or
    implementation (threefry, rbg, ...)."""
    at = "" if where == "key" else f" at {where}"
    if (impl is None) != (key is None):
      saved = "no PRNG key" if impl is None else f"a {impl} PRNG key"
      wanted = "none" if key is None else f"one ({key.dtype})"
      raise ValueError(
        f"Checkpoint {step} in {self.directory} holds {saved}{at}; the "
        f"target's {where} is {wanted}. Pass a target whose keys match the "
        "saved run's."
      )
    if impl is not None:
      saved = jax.eval_shape(lambda: jax.random.key(0, impl=impl)).dtype
      if saved != key.dtype:
        raise ValueError(
          f"Checkpoint {step} in {self.directory} holds a {impl} PRNG key "
          f"({saved}){at}; the target's {where} is {key.dtype}."
        )

  def _restore(
    self,
    step: int,
    meta: dict,
    params: Any,
    opt_state: Any,
    rest: Any = None,
  ) -> dict[str, Any]:
    """Reads params, the optimizer state (masters rebuilt if the checkpoint
    has none) and `rest` ("train"), each into its abstract target."""
    stored = opt_state
    if not meta["master_weights"]:
      stored = fmt.strip_masters(opt_state)
    targets = {"params": params, "opt_state": stored}
    if rest is not None:
      targets["train"] = rest
    empty = set(meta.get("empty_items", ()))
    self._check_metadata(step, targets, empty)
    stored = {k: v for k, v in targets.items() if k not in empty}
    flats = {k: {} for k in empty}
    flats.update(self._restore_arrays(step, stored).items())
    got = {item: fmt.unflat(targets[item], flats[item]) for item in targets}
    if not meta["master_weights"]:
      got["opt_state"] = jax.jit(
        lambda s, p: fmt.rebuild_masters(opt_state, s, p),
        out_shardings=jax.tree.map(lambda a: a.sharding, opt_state),
      )(got["opt_state"], got["params"])
    return got

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

  def _check_metadata(
    self, step: int, targets: dict[str, Any], empty: set[str]
  ) -> None:
    saved = self._read(
      step, "metadata", lambda: self._manager.item_metadata(step)
    )
    for item, tree in targets.items():
      where = f"Checkpoint {step} {item}"
      if item not in empty:
        fmt.check_matches(saved[item], tree, where)
      elif wanted := list(fmt.flat(tree))[:5]:
        raise ValueError(
          f"{where} holds no leaves; the target's has {wanted} (up to 5): "
          "another model or optimizer."
        )

  def _restore_arrays(
    self, step: int, targets: dict[str, Any]
  ) -> dict[str, dict[str, Any]]:
    flats = {item: fmt.flat(tree) for item, tree in targets.items()}
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
        for path in fmt.unreadable_leaves(
          os.path.join(self.directory, str(step), item), tree
        )
      ]
      if not bad:
        raise
      raise OSError(
        f"Checkpoint {step} in {self.directory}: cannot read leaves {bad} "
        "(up to 5 per item; damaged or missing data). Restore "
        "another step (all_steps() lists them)."
      ) from e

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


def _refuse_padded(params: Any, opt_state: Any) -> None:
  """Refuses an optimizer state laid out by a ZeRO-1 plan, saved without
  it: its padding would be saved, and such a checkpoint restores nowhere."""
  where = zero1.find_padded(params, opt_state)
  if where is not None:
    raise ValueError(
      f"opt_state leaf {where} has the padded shape a ZeRO-1 plan lays it "
      "out in, not its param's: pass plan= (the step's plan), which cuts "
      "the padding before saving; saved padded, it would restore nowhere."
    )


def _check_rollback(rollback: Any) -> None:
  if not isinstance(rollback, bool):
    raise TypeError(f"rollback must be True or False, got {rollback!r}.")
