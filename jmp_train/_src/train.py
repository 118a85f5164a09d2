"""The train state and the step: one device, data parallelism and ZeRO-1.

`TrainState` holds what a step changes: params, optimizer state, model state
(e.g. BatchNorm's `batch_stats`), FP8 metadata, the step number and the base
PRNG key. `make_train_step(loss_fn, tx, plan=...)` returns a plain jitted
function `state, metrics = step(state, batch)`:

    scale = loss scale of tx's mixed_precision state (1 without one)
    for each device d (its rows of the batch) and micro-batch m:
      key_dm = fold_in(fold_in(fold_in(state.key, state.step), d), m)
      grads, fp8 amaxes, model_state = grad of scale * loss_fn(
          params, micro_batch, model_state, key_dm)   # model_state threaded
    grads summed over micro-batches in an accum_dtype buffer (float32),
      then over devices in grad_reduce_dtype (their own by default;
      reduce-scatter under ZeRO-1, all-reduce otherwise), divided by N * M
    fp8 amaxes: max over micro-batches and devices
    model_state: mean over devices (identity when BatchNorm already syncs)
    params, opt_state = apply_updates(params, tx.update(grads, opt_state))
    finite -> model_state and fp8 advance; skipped -> both keep their bits

The step number counts every step, skipped ones too, so a skipped batch's
retry draws new randomness.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from jmp_train._src import (
  accumulation,
  distributed,
  fp8_param,
  leaves,
  optimizer_state,
  transform,
  zero1,
)
from jmp_train._src import fp8 as fp8_lib
from jmp_train._src import loss_scale as ls_lib


@flax.struct.dataclass
class TrainState:
  """What one train step changes, as one value (a pytree).

  Attributes:
    step: int32 scalar, the number of steps taken (skipped ones included).
    params: the params.
    opt_state: the optimizer state (ZeRO-padded when laid out by a plan).
    model_state: the model's other mutable collections, e.g.
      `{"batch_stats": ...}`; `{}` if none.
    fp8: the FP8 metadata (the "fp8_meta" collection of `jmp_train.fp8`);
      `{}` if the model has no FP8 matmuls.
    key: the run's base PRNG key, or None when `loss_fn` needs no key.
  """

  step: jax.Array
  params: Any
  opt_state: Any
  model_state: Any
  fp8: Any
  key: jax.Array | None

  @classmethod
  def create(
    cls,
    *,
    params: optax.Params,
    tx: optax.GradientTransformation,
    model_state: Any = None,
    fp8: Any = None,
    key: jax.Array | None = None,
    plan: zero1.Plan | None = None,
  ) -> TrainState:
    """A state at step 0 with `tx.init(params)`.

    With a `plan`, the state is laid out as the plan says (`zero1.place`);
    the optimizer state is built inside jit with its final shardings, so it
    never exists whole on one device. When the plan's mesh spans several
    processes, the arguments each process passes must be the same on every
    process (checked; the error names the leaves that differ).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> state = TrainState.create(params={"w": jnp.ones(2)}, tx=optax.sgd(0.1))
      >>> int(state.step), state.model_state, state.fp8
      (0, {}, {})
    """
    distributed.check_joined()
    if key is not None and not (
      isinstance(key, jax.Array) and leaves.is_prng_key(key)
    ):
      raise TypeError(
        "key must be a typed PRNG key (jax.random.key(seed)) or None, got "
        f"{key!r}."
      )

    def build(params, model_state, fp8, key):
      return cls(
        step=jnp.zeros([], jnp.int32),
        params=params,
        opt_state=tx.init(params),
        model_state=model_state,
        fp8=fp8,
        key=key,
      )

    for name, tree in (("params", params), ("model_state", model_state)):
      _refuse_fp8_state(tree, name)
    args = (params, {} if model_state is None else model_state)
    args += ({} if fp8 is None else fp8, key)
    if plan is not None and distributed.spans_processes(plan.mesh):
      names = ("params", "model_state", "fp8", "key")
      distributed.check_same_on_every_process(
        dict(zip(names, args, strict=True)), "TrainState.create's arguments"
      )
    if plan is None:
      # Under jit the state gets its own buffers: the step donates it, and
      # the caller's params must survive that.
      return jax.jit(build)(*args)
    zero1.check_params(plan, params, "params")
    abstract = jax.eval_shape(build, *args)
    zero1.check_tree(
      abstract.opt_state,
      plan.logical_opt_state,
      "tx.init(params)",
      "Build the plan with this optimizer and these params.",
    )
    shardings = plan.state_shardings(abstract)
    return jax.jit(
      lambda *a: zero1.laid_out(plan, build(*a)), out_shardings=shardings
    )(*args)


def _refuse_fp8_state(tree: Any, name: str) -> None:
  """FP8 state outside `fp8=` would never advance, or be overwritten."""
  found = jax.tree_util.tree_flatten_with_path(
    tree, is_leaf=fp8_lib.is_fp8_state
  )[0]
  paths = [leaves.keystr(p) for p, x in found if fp8_lib.is_fp8_state(x)]
  if paths:
    raise ValueError(
      f"{name} holds FP8 state at {paths[:3]}: pass the FP8 state as "
      "TrainState.create(fp8=...) (linen: variables['fp8_meta']; NNX: the "
      "jmp_train.nnx.Fp8Meta state), where the step advances it once per "
      "applied step. Elsewhere it would never advance, or the forward pass's "
      "copy would overwrite it."
    )


def _has_mixed_precision(opt_state: Any) -> bool:
  return bool(optimizer_state.mixed_precision_states(opt_state))


def _check_batch(batch: Any, multiple: int, what: str) -> None:
  rows = {}
  for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
    if np.ndim(x) == 0 or np.shape(x)[0] % multiple:
      raise ValueError(
        f"batch leaf {leaves.keystr(path)!r} has shape {np.shape(x)}: every "
        f"batch leaf needs a leading dimension divisible by {what} = "
        f"{multiple}."
      )
    rows.setdefault(np.shape(x)[0], leaves.keystr(path))
  if multiple > 1 and len(rows) > 1:
    # Split in equal parts, 16 rows of inputs and 8 of labels pair 2 with 1
    # and broadcast: a loss, but not the batch's. Tasks of their own batch
    # sizes split correctly, so this warns (once per trace) and goes on.
    found = ", ".join(f"{name!r} has {n}" for n, name in sorted(rows.items()))
    warnings.warn(
      f"batch leaves have different leading dimensions ({found} rows), "
      f"each split in {multiple} parts over {what}: rows of one leaf are "
      "paired with the other's by part, not one to one. Right for tasks "
      "of their own batch sizes; wrong for inputs and labels of one batch.",
      stacklevel=4,
    )


def _micro_grads(loss_fn, has_aux, accum_steps, accum_dtype):
  """The gradient pass over one device's rows, micro-batch by micro-batch.

  Returns `run(params, fp8, model_state, batch, key, scale)` (`params`
  with gradient slots on their `Fp8Param`s) giving the loss, grads and metrics summed over micro-batches (loss and metrics in
  float32, grads in an `accum_dtype` buffer when there are several), the
  FP8 amax gradients combined by max and the model state after the last
  micro-batch.
  """

  def run(params, fp8, model_state, batch, key, scale):
    def one(model_state, micro_batch, index):
      def scaled(params, fp8):
        if fp8:
          inputs = {**model_state, fp8_lib.COLLECTION: fp8}
        else:
          inputs = model_state
        micro_key = None if key is None else jax.random.fold_in(key, index)
        out = loss_fn(params, micro_batch, inputs, micro_key)
        if has_aux:
          _check_aux(out)
        loss, (new_state, metrics) = out if has_aux else (out, (inputs, {}))
        loss = accumulation.float_loss(loss)
        new_state = _checked_model_state(new_state, model_state)
        metrics = jax.tree.map(lambda m: jnp.asarray(m, jnp.float32), metrics)
        return loss * scale, (loss, new_state, metrics)

      grad = jax.grad(scaled, argnums=(0, 1), has_aux=True, allow_int=True)
      (grads, fp8_grads), (loss, new_state, metrics) = grad(params, fp8)
      grads = accumulation.zeros_for_non_float(grads, params)
      # FP8 params: the weight's gradient came back in its slot.
      grads = fp8_param.grads_of(grads)
      return new_state, ((loss, metrics), grads, fp8_grads)

    model_state, (loss, metrics), grads, fp8_grads = (
      accumulation.over_micro_batches(
        one, model_state, batch, accum_steps, accum_dtype=accum_dtype
      )
    )
    return loss, grads, fp8_grads, model_state, metrics

  return run


def _check_aux(out: Any) -> None:
  """`out` is `(loss, (new_model_state, metrics))`, or a ValueError."""

  def pair(x):
    return isinstance(x, (tuple, list)) and len(x) == 2

  def shape(x, depth=0):
    if isinstance(x, (tuple, list)) and depth < 2:
      return "(" + ", ".join(shape(e, depth + 1) for e in x) + ")"
    if isinstance(x, dict):
      return f"a dict of {sorted(map(str, x))}"
    if hasattr(x, "dtype") and hasattr(x, "shape"):
      return f"{x.dtype}{list(x.shape)}"
    return type(x).__name__

  if not (pair(out) and pair(out[1])):
    got = shape(out)
    raise ValueError(
      "With has_aux=True, loss_fn must return (loss, (new_model_state, "
      f"metrics)), metrics a dict ({{}} for none); got {got}."
    )


def _checked_model_state(new: Any, old: Any) -> Any:
  """The collections of `old` taken from `new` (what loss_fn returned)."""
  if not isinstance(new, dict) or any(k not in new for k in old):
    got = sorted(new) if isinstance(new, dict) else type(new).__name__
    raise ValueError(
      "loss_fn's aux must be (new_model_state, metrics), new_model_state a "
      f"dict holding every collection of the model state {sorted(old)}; got "
      f"{got}."
    )
  # What a step drops on purpose: params (mutable=True returns them), sown
  # values of one step, and the FP8 metadata (the step keeps it itself).
  dropped = ("params", "intermediates", fp8_lib.COLLECTION)
  extra = sorted(k for k in new if k not in old and k not in dropped)
  if extra:
    raise ValueError(
      f"loss_fn returned model state {extra} that the train state does not "
      f"hold (it holds {sorted(old)}): their updates would be dropped after "
      "every step. Pass them to TrainState.create(model_state=...), or "
      "leave them out of new_model_state (values sown for one step: "
      "return them in metrics)."
    )
  for k in old:
    if jax.tree.structure(new[k]) != jax.tree.structure(old[k]):
      raise ValueError(
        f"loss_fn returned model state {k!r} with another tree structure "
        "than the state it was given (return the updated collection, e.g. "
        "the `mutable=` output of `model.apply`)."
      )
  return {k: new[k] for k in old}


def make_train_step(
  loss_fn: Callable[..., Any],
  tx: optax.GradientTransformation,
  *,
  plan: zero1.Plan | None = None,
  accum_steps: int = 1,
  has_aux: bool = False,
  accum_dtype: Any = jnp.float32,
  grad_reduce_dtype: Any = None,
) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]]:
  """A jitted train step: `state, metrics = step(state, batch)`.

  The step computes `loss_fn` on each device's share of the batch, times the
  loss scale of the `mixed_precision` state in `tx` (1 without one),
  accumulates `accum_steps` micro-batch gradients in an `accum_dtype`
  buffer, reduces them over the plan's data axis (reduce-scatter for
  ZeRO-1, all-reduce for stage 0, nothing without a plan) in
  `grad_reduce_dtype`, runs `tx.update` and `optax.apply_updates`, and
  all-gathers the new params. It donates the state. On a skipped
  (non-finite) step only the optimizer's loss-scale state and counters and
  `state.step` change.

  The two gradient dtypes, per device and float16/bfloat16/float32 grads
  (float64 and complex grads always keep their own dtype):

      # accum_steps > 1: the buffer (loss and metrics: float32 always)
      buffer = accum_dtype(grads_0)
      for m in 1 .. M - 1:
        buffer = accum_dtype(float32(buffer) + float32(grads_m))
      # the reduction over the data axis (with a plan)
      None:     sum(buffer) in buffer's dtype (float16: each divided by N
                first, so the sum overflows only where the mean would)
      float32:  sum(float32(buffer)) in float32
      bfloat16: all_to_all(bfloat16(buffer)) of 1/N chunks, each device
                adds the N chunks it gets in float32 (the bytes of a
                bfloat16 reduce-scatter); ZeRO-1 keeps that float32 shard,
                stage 0 (and ZeRO-1 leaves it keeps whole) rounds it to
                bfloat16 and all-gathers it (a bfloat16 all-reduce's bytes)
      grads = float32(sum) / (N * M)

  Args:
    loss_fn: `loss_fn(params, batch, model_state, key)`, the unscaled mean
      loss over `batch`. `model_state` is `state.model_state` (plus
      `{"fp8_meta": state.fp8}` when the model has FP8 matmuls, so
      `model.apply({"params": params, **model_state}, ...)` works); `key`
      is this step's, device's and micro-batch's PRNG key (None when
      `state.key` is None). Returns the loss, or with `has_aux=True`
      `(loss, (new_model_state, metrics))`: the updated collections of the
      model state (e.g. the `mutable=["batch_stats"]` output of
      `model.apply`) and a dict of scalars averaged over micro-batches and
      devices.
    tx: any optax optimizer, typically `mixed_precision(...)`.
    plan: a `zero1.Plan` (ZeRO-1 or data parallel on its mesh); None runs on
      one device without collectives (use a plan on a one-device mesh for a
      BatchNorm with `axis_name`), and only in a lone process.
    accum_steps: micro-batches per step.
    has_aux: whether `loss_fn` returns `(loss, (new_model_state, metrics))`.
    accum_dtype: the gradient accumulation buffer's dtype when
      `accum_steps > 1`: `jnp.float32` (default) or `jnp.bfloat16` (half
      the memory, 8 significant bits per partial sum).
    grad_reduce_dtype: the dtype gradients travel in for the reduction over
      the data axis: None (default: their own, or the buffer's when
      accumulating), `jnp.float32` (4 bytes per element, summed in float32)
      or `jnp.bfloat16` (2 bytes per element, summed in float32; the sum is
      rounded to bfloat16 once more for stage 0's all-gather). Needs a
      plan: without one the step has no reduction of its own to set.

  Returns:
    The jitted step. `metrics` holds the mean loss, the aux metrics and, with
    `mixed_precision`, `train_metrics(opt_state)`. When the plan's mesh spans
    several processes, the step takes global arrays only (`global_batch`)
    and refuses NumPy or process-local batch leaves, which JAX would take
    as the whole batch and keep only this process's rows of.

  Example:
    >>> import jax.numpy as jnp, optax, jmp_train
    >>> tx = jmp_train.mixed_precision(optax.sgd(0.1))
    >>> state = TrainState.create(params={"w": jnp.ones(2)}, tx=tx)
    >>> def loss_fn(params, batch, model_state, key):
    ...   return jnp.mean((batch @ params["w"]) ** 2)
    >>> step = make_train_step(loss_fn, tx)
    >>> state, metrics = step(state, jnp.ones((4, 2)))
    >>> int(state.step), float(metrics["loss"])
    (1, 4.0)
  """
  distributed.check_joined()
  accum_steps = leaves.check_int(accum_steps, "accum_steps", 1)
  has_aux = leaves.check_bool(has_aux, "has_aux")
  accum_dtype = accumulation.check_gradient_dtype(accum_dtype, "accum_dtype")
  reduce_dtype = accumulation.check_gradient_dtype(
    grad_reduce_dtype, "grad_reduce_dtype", allow_none=True
  )
  if plan is not None and not isinstance(plan, zero1.Plan):
    raise TypeError(
      f"plan must be a jmp_train.zero1.Plan (make_plan(...)) or None, got "
      f"{plan!r}."
    )
  if plan is None and reduce_dtype is not None:
    # A plan-less step fed a batch sharded over devices would still be
    # reduced, by XLA, in the gradients' own dtype.
    raise ValueError(
      f"grad_reduce_dtype={grad_reduce_dtype!r} sets the dtype of the "
      "step's reduction over the data axis, and plan=None has none: pass a "
      "plan (zero1.make_plan(tx, params, mesh), zero_stage=0 for plain data "
      "parallelism) or grad_reduce_dtype=None."
    )
  if plan is None and jax.process_count() > 1:
    raise ValueError(
      f"plan=None with {jax.process_count()} processes would train each "
      "process on its own batch with its own params, never reduced across "
      "processes. Pass a plan whose mesh holds every process's devices "
      "(zero1.make_plan(tx, params, mesh), zero_stage=0 for plain data "
      "parallelism)."
    )
  n = 1 if plan is None else plan.num_shards
  run = _micro_grads(loss_fn, has_aux, accum_steps, accum_dtype)

  def step(state: TrainState, batch: Any):
    what = "accum_steps" if plan is None else "data shards x accum_steps"
    _check_batch(batch, n * accum_steps, what)
    if plan is None:
      # An Adam state fed to an SGD step would train as SGD, the moments
      # carried along untouched.
      zero1.check_tree(
        state.opt_state,
        jax.eval_shape(tx.init, state.params),
        "state.opt_state",
        "Build the state with this step's tx: TrainState.create(params=..., "
        "tx=tx).",
        by="tx.init(state.params)",
      )
    else:
      zero1.check_params(plan, state.params, "state.params")
      hint = "Lay the state out with this plan (TrainState.create(..., plan=plan) or zero1.place)."
      zero1.check_tree(state.opt_state, plan.opt_state, "state.opt_state", hint)
    if _has_mixed_precision(state.opt_state):
      scale = transform.current_loss_scale(state.opt_state)
    else:
      scale = jnp.ones([], jnp.float32)
    key = state.key
    if key is not None:
      key = jax.random.fold_in(key, state.step)
    if plan is None:
      try:
        loss, grads, fp8_grads, model_state, metrics = run(
          fp8_param.with_grad_slots(state.params),
          state.fp8,
          state.model_state,
          batch,
          None if key is None else jax.random.fold_in(key, 0),
          scale,
        )
      except NameError as error:
        error.add_note(
          "jmp_train: if this is an unbound axis name, loss_fn runs a "
          "collective (BatchNorm(axis_name=...), psum, pmean) and plan=None "
          "names no axis: pass a plan whose data_axis is that name, "
          "zero1.make_plan(tx, params, mesh) (one device makes a one-device "
          "mesh)."
        )
        raise
      grads = jax.tree.map(_mean(accum_steps, 1), grads)
      work = state.params
    else:
      _check_no_keys(state.model_state, plan)
      loss, grads, fp8_grads, model_state, metrics = _sharded(
        plan, run, state, batch, key, scale, reduce_dtype
      )
      grads = jax.tree.map(_mean(accum_steps, n), grads)
      work = _padded_params(plan, state.params)
    metrics = jax.tree.map(lambda m: m / accum_steps, metrics)
    loss = loss / accum_steps
    updates, opt_state = tx.update(grads, state.opt_state, work)
    params = optax.apply_updates(work, updates)
    if plan is not None:
      params = _gathered(plan, params, state.params)
    out = {"loss": loss, **metrics}
    if _has_mixed_precision(opt_state):
      out.update(transform.train_metrics(opt_state))
      finite = out["last_step_finite"]
    else:
      finite = ls_lib.all_finite(grads)
    new = state.replace(
      step=state.step + 1,
      params=params,
      opt_state=opt_state,
      model_state=ls_lib.select_tree(finite, model_state, state.model_state),
      fp8=fp8_lib.update(state.fp8, fp8_grads, finite=finite),
    )
    return new, out

  if plan is None:
    return jax.jit(step, donate_argnums=0)

  def laid_out(state, batch):
    # The state's structure (which model state and FP8 collections) is
    # known when jit traces: a sharding constraint on the outputs fixes
    # their layout as out_shardings would.
    new, metrics = step(state, batch)
    new = jax.lax.with_sharding_constraint(new, plan.state_shardings(new))
    return new, jax.lax.with_sharding_constraint(metrics, plan.replicated)

  # keep_unused: every state leaf stays an argument, so memory_analysis()
  # counts it.
  jitted = jax.jit(laid_out, donate_argnums=0, keep_unused=True)
  if not distributed.spans_processes(plan.mesh):
    return jitted

  # With several processes a NumPy or process-local batch would be taken as
  # the whole batch, of which each process keeps its own rows: refused.
  @functools.wraps(step)
  def checked(state, batch):
    distributed.check_global_batch(batch)
    return jitted(state, batch)

  checked.lower = jitted.lower
  checked.trace = jitted.trace
  checked.eval_shape = jitted.eval_shape
  return checked


def global_batch(local_batch: Any, plan: zero1.Plan | None = None) -> Any:
  """The step's batch, built from this process's rows of it.

  With several processes each process passes its own rows (the same number
  on every process: compared with one small all-gather) and gets the
  global batch the step takes, its rows in the order of the mesh's data
  positions (process 0's first for a mesh over `jax.devices()`), through
  `jax.make_array_from_process_local_data` on the plan's batch sharding;
  nothing is copied between processes. Each data position must be on one
  process. In one process this is the whole batch, placed on the plan's
  devices (or on the default device without a plan).

  Args:
    local_batch: a pytree of arrays with this process's rows on axis 0
      (NumPy or JAX; with several processes, leaves that already are
      global arrays are kept).
    plan: the step's `zero1.Plan`; None for a step without one.

  Returns:
    The batch as global `jax.Array`s.

  Raises:
    ValueError: a leaf has no rows axis, or this process's rows do not
      split evenly over its devices on the data axis; processes pass
      different numbers of rows, or share a data position; or several
      processes and no plan.

  Example:
    >>> import numpy as np
    >>> batch = global_batch({"tokens": np.zeros((4, 9), np.int32)})
    >>> batch["tokens"].shape
    (4, 9)
  """
  if plan is None:
    if jax.process_count() > 1:
      raise ValueError(
        f"{distributed.process_prefix()}global_batch needs the step's plan "
        "when there are several processes (its mesh says which rows go "
        "where); got plan=None."
      )
    return jax.tree.map(jnp.asarray, local_batch)
  axis = plan.mesh.axis_names.index(plan.data_axis)
  owners: dict[int, set[int]] = {}
  for index, d in np.ndenumerate(plan.mesh.devices):
    owners.setdefault(index[axis], set()).add(d.process_index)
  shared = sorted(k for k, procs in owners.items() if len(procs) > 1)
  if shared:
    raise ValueError(
      f"{distributed.process_prefix()}the plan's mesh puts data positions "
      f"{shared} of axis {plan.data_axis!r} on several processes; "
      "global_batch takes each process's own rows, which needs each data "
      "position on one process (make the data axis the mesh's outermost, "
      "as jax.make_mesh over jax.devices() with it first does)."
    )
  here = jax.process_index()
  positions = {k for k, procs in owners.items() if here in procs}
  if jax.process_count() > 1:
    _check_same_rows(local_batch)

  def make(path, x):
    if not distributed.is_process_local(x):
      return x
    if np.ndim(x) == 0 or np.shape(x)[0] % len(positions):
      raise ValueError(
        f"{distributed.process_prefix()}local batch leaf "
        f"{leaves.keystr(path)!r} has shape {np.shape(x)}: this process's "
        f"rows must split evenly over its {len(positions)} positions on the "
        f"data axis {plan.data_axis!r}."
      )
    return jax.make_array_from_process_local_data(
      plan.batch_sharding, np.asarray(x)
    )

  return jax.tree_util.tree_map_with_path(make, local_batch)


def _check_same_rows(local_batch: Any) -> None:
  """Every process passes as many rows per leaf (a collective: every
  process raises the same error, naming the leaf and each one's count)."""
  from jax.experimental import multihost_utils  # noqa: PLC0415

  flat = jax.tree_util.tree_flatten_with_path(local_batch)[0]
  # The same leaves first (a gather of unequal lengths would not be one).
  distributed.check_same_on_every_process(
    jax.tree.map(lambda x: np.zeros((), np.int8), local_batch),
    "global_batch's local batch (its structure)",
  )
  rows = np.array([np.shape(x)[:1] or (-1,) for _, x in flat], np.int64)
  every = np.asarray(multihost_utils.process_allgather(rows.reshape(1, -1)))
  every = every.reshape(jax.process_count(), -1)
  for i, (path, _) in enumerate(flat):
    if (every[:, i] != every[0, i]).any():
      counts = {p: int(n) for p, n in enumerate(every[:, i])}
      raise ValueError(
        "global_batch's local batch leaf "
        f"{leaves.keystr(path)!r} has different numbers of rows on the "
        f"processes ({counts}, process: rows; -1 for no rows axis): every "
        "process passes the same number."
      )


def _mean(accum_steps: int, n: int):
  """Divides summed grads by micro-batches x devices, in >= float32.

  float16 grads were divided by N before the device sum (see `_sharded`).
  """

  def mean(g):
    if not leaves.is_float(g):
      return g
    if g.dtype == jnp.float16:
      return leaves.widen(g) * (1.0 / accum_steps)
    return leaves.widen(g) * (1.0 / (accum_steps * n))

  return mean


def _padded_params(plan: zero1.Plan, params: Any) -> Any:
  """The params padded as ZeRO-1 lays them out, with their ZeRO sharding."""
  if plan.zero_stage == 0:
    return params
  padded = jax.tree.map(
    lambda lay, p: lay.pad(p), plan.layouts, params, is_leaf=zero1.is_layout
  )
  shardings = jax.tree.map(
    lambda lay: jax.sharding.NamedSharding(
      plan.mesh, lay.zero_spec(plan.data_axis)
    ),
    plan.layouts,
    is_leaf=zero1.is_layout,
  )
  return jax.lax.with_sharding_constraint(padded, shardings)


def _gathered(plan: zero1.Plan, new: Any, old: Any) -> Any:
  """The updated 1/N shards all-gathered into full params, padding cut."""
  if plan.zero_stage == 0:
    return new
  axis = plan.data_axis

  def gather(lay, x, p):
    if lay.dim is not None:
      x = jax.shard_map(
        lambda x: jax.lax.all_gather(x, axis, axis=lay.dim, tiled=True),
        mesh=plan.mesh,
        in_specs=lay.shard_spec(axis),
        out_specs=P(),
        axis_names={axis},
        check_vma=False,
      )(x)
    return zero1.resize(x, p.shape)

  return jax.tree.map(gather, plan.layouts, new, old, is_leaf=zero1.is_layout)


def _sharded(plan, run, state, batch, key, scale, reduce_dtype):
  """`run` on every device's rows inside `shard_map`, then the reductions:
  grads summed in `reduce_dtype` (None: their own; reduce-scatter under
  ZeRO-1), FP8 amaxes maxed, model state and metrics averaged over the data
  axis."""
  axis, n = plan.data_axis, plan.num_shards
  zero = plan.zero_stage == 1

  def local(params, fp8, model_state, batch, key, scale):
    # Differentiating replicated inputs inside shard_map would sum their
    # gradients over the data axis: mark them per-device first.
    def varying(x):
      return jax.lax.pcast(x, axis, to="varying") if leaves.is_float(x) else x

    if key is not None:
      key = jax.random.fold_in(key, jax.lax.axis_index(axis))
    # What each gradient leaf is (an Fp8Param's: its weight's gradient).
    grad_ref = fp8_param.grad_like(params)
    params = fp8_param.with_grad_slots(params)
    loss, grads, fp8_grads, model_state, metrics = run(
      jax.tree.map(varying, params),
      jax.tree.map(varying, fp8),
      model_state,
      batch,
      key,
      scale,
    )

    def reduce(lay, g, p):
      if not leaves.is_float(p):
        return jnp.zeros_like(p)
      if reduce_dtype is not None:
        # Summed in float32 either way: float32's range needs no division
        # first (float16 grads travelling in float32 are not divided).
        g = g.astype(accumulation.buffer_dtype(g.dtype, reduce_dtype))
        if g.dtype == jnp.bfloat16:
          return _sum_in_float32(g, lay if zero else None, axis, n)
      if g.dtype == jnp.float16:
        # Divided before the sum, so the sum of N per-device means cannot
        # overflow where one device's mean over the whole batch would not:
        # the skip decision must not depend on N. (bfloat16 and float32
        # have float32's range; they are summed, then divided.)
        g = (leaves.widen(g) * (1.0 / n)).astype(g.dtype)
      if zero and lay.dim is not None:
        return jax.lax.psum_scatter(
          lay.pad(g), axis, scatter_dimension=lay.dim, tiled=True
        )
      return jax.lax.psum(g, axis)

    grads = jax.tree.map(
      reduce, plan.layouts, grads, grad_ref, is_leaf=zero1.is_layout
    )
    return (
      jax.lax.pmean(loss, axis),
      grads,
      jax.tree.map(lambda a: jax.lax.pmax(a, axis), fp8_grads),
      jax.tree.map(lambda x: _device_mean(x, axis), model_state),
      jax.tree.map(lambda m: jax.lax.pmean(m, axis), metrics),
    )

  grad_specs = jax.tree.map(
    lambda lay: lay.shard_spec(axis) if zero else P(),
    plan.layouts,
    is_leaf=zero1.is_layout,
  )
  return jax.shard_map(
    local,
    mesh=plan.mesh,
    in_specs=(P(), P(), P(), P(axis), P(), P()),
    out_specs=(P(), grad_specs, P(), P(), P()),
    axis_names={axis},
  )(state.params, state.fp8, state.model_state, batch, key, scale)


def _sum_in_float32(
  g: jax.Array, lay: zero1.LeafLayout | None, axis: str, n: int
) -> jax.Array:
  """The sum over `axis` of bfloat16 `g`, sent in bfloat16, added in float32.

  Each device splits `g` in N chunks and sends chunk d to device d (one
  all-to-all: the bytes of a bfloat16 reduce-scatter), then adds the N
  chunks it received in float32. Along ZeRO-1's dimension (`lay.dim`, after
  `lay.pad`) that float32 sum is the device's shard, as `psum_scatter`'s
  would be. Without one (`lay` None for stage 0, or a leaf ZeRO-1 keeps
  whole) the flattened leaf is split, and the summed chunks are rounded to
  bfloat16 and all-gathered: the bytes of a bfloat16 ring all-reduce, where
  a float32 `psum` would send twice as many.
  """
  whole = lay is None or lay.dim is None
  if whole:
    x = jnp.pad(g.reshape(-1), (0, -g.size % n))
    dim = 0
  else:
    x, dim = lay.pad(g), lay.dim
  x = jax.lax.all_to_all(x, axis, dim, dim, tiled=True)
  chunks = x.shape[:dim] + (n, x.shape[dim] // n) + x.shape[dim + 1 :]
  total = jnp.sum(x.reshape(chunks).astype(jnp.float32), axis=dim)
  if not whole:
    return total
  total = jax.lax.all_gather(
    total.astype(jnp.bfloat16), axis, tiled=True, to="invarying"
  )
  return total[: g.size].reshape(g.shape)


def _check_no_keys(model_state: Any, plan: zero1.Plan) -> None:
  """Refuses PRNG keys in the model state of a step over several devices:
  one copy of it is on every device, so each would draw the same numbers
  (NNX's `nnx.Rngs` held by a module: its dropout masks would repeat)."""
  if plan.num_shards == 1:
    return
  for path, x in jax.tree_util.tree_flatten_with_path(model_state)[0]:
    if leaves.is_prng_key(x):
      raise ValueError(
        f"model_state leaf {leaves.keystr(path)} is a PRNG key: with a plan "
        f"over {plan.num_shards} devices each device holds the same copy and "
        "would draw the same random numbers from it. Draw them from the "
        "step's key (loss_fn's `key`, different per step, micro-batch and "
        "device): model(x, rngs=nnx.Rngs(dropout=key)) in NNX, keeping the "
        "module's own Rngs out of model_state (nnx.split(model, nnx.Param, "
        "nnx.RngState, ...)); rngs={'dropout': key} in linen."
      )


def _device_mean(x: jax.Array, axis: str) -> jax.Array:
  """A model-state leaf made the same on every device: float leaves that
  differ per device (BatchNorm without `axis_name`) are averaged, as Flax's
  ImageNet example syncs batch_stats; leaves already the same are kept."""
  if axis not in jax.typeof(x).manual_axis_type.varying:
    return x
  if leaves.is_float(x):
    return jax.lax.pmean(x, axis)
  return jax.lax.pmax(x, axis)
