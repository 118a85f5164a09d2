"""ZeRO-1 on a device mesh: the optimizer state partitioned over data parallelism.

`make_train_step(loss_fn, tx, mesh=mesh)` builds a jitted step for a mesh with
a data-parallel axis of size N (and any model axes the params are already
sharded over). With `zero_stage=1`:

* params stay replicated over the data axis (sharded over model axes as their
  specs say) in their own dtype;
* every optimizer-state leaf that mirrors a param, the float32 master weights
  of `mixed_precision` included, is partitioned over the data axis along one
  dimension: each device holds 1/N of it. A dimension that N does not divide
  is zero-padded to a multiple of N, so a device holds at most one extra row.
  Scalars (step counts, the loss scale) stay replicated;
* each device takes the gradient of its shard of the batch, and the gradients
  are summed by a reduce-scatter (`jax.lax.psum_scatter` inside
  `jax.shard_map`, so every backend, CPU included, runs a real
  reduce-scatter); the optimizer updates its 1/N of the params; the new params
  come back by all-gather. One step moves the bytes of one all-reduce.

The optimizer update itself runs outside `shard_map`, on arrays with their
full (padded) shapes and ZeRO shardings, so global reductions inside `tx`
(`clip_by_global_norm`, the finite check and grad norm of
`mixed_precision`) see every shard: the compiler adds the scalar all-reduces.

FP8 states (`jmp_train.fp8`) in the params stay replicated and out of the
optimizer; their amax "gradients" are combined by a max over the data axis
(`pmax`), and the step advances them with `fp8.update` after the optimizer
update, not at all on a skipped step.

`zero_stage=0` is plain data parallelism (all-reduce of the gradients,
replicated optimizer state) with the same API, for comparison.

Nothing here assumes one process: inputs and outputs are global arrays. On
several hosts call `jax.distributed.initialize()` first and build the mesh
from `jax.devices()`; feed batches as global arrays (for example with
`jax.make_array_from_process_local_data`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jmp_train._src import accumulation, fp8, leaves, loss_scale, transform


class LeafLayout(NamedTuple):
  """Where ZeRO-1 partitions one param-shaped leaf.

  Attributes:
    spec: the param's PartitionSpec over model axes, one entry per dimension.
    dim: the dimension partitioned over the data axis, or None (replicated).
    padded: the length of `dim` after zero-padding to a multiple of N.
  """

  spec: tuple
  dim: int | None
  padded: int

  def pad(self, x: jax.Array) -> jax.Array:
    if self.dim is None or x.shape[self.dim] == self.padded:
      return x
    widths = [(0, 0)] * x.ndim
    widths[self.dim] = (0, self.padded - x.shape[self.dim])
    return jnp.pad(x, widths)

  def zero_spec(self, data_axis: str) -> P:
    spec = list(self.spec)
    if self.dim is not None:
      spec[self.dim] = data_axis
    return P(*spec)


def _normalized_spec(spec: Any, ndim: int, data_axis: str) -> tuple:
  spec = tuple(P() if spec is None else spec)
  if len(spec) > ndim:
    raise ValueError(
      f"PartitionSpec {P(*spec)} has more entries than ndim={ndim}."
    )
  names = []
  for entry in spec:
    names += list(entry) if isinstance(entry, tuple) else [entry]
  if data_axis in names:
    raise ValueError(
      f"Param spec {P(*spec)} uses the data axis {data_axis!r}: ZeRO-1 keeps "
      "params replicated over it; shard params over model axes only."
    )
  return spec + (None,) * (ndim - len(spec))


def leaf_layout(shape: tuple, spec: Any, n: int, data_axis: str) -> LeafLayout:
  """The ZeRO-1 layout of a leaf: the free dimension that splits it best.

  Among dimensions not already sharded over a model axis, picks the one that
  gives the fewest elements per device after padding to a multiple of `n`
  (so no padding when some dimension divides), then the longest.
  """
  spec = _normalized_spec(spec, len(shape), data_axis)
  size = math.prod(shape)
  best, best_key = None, None
  for d, length in enumerate(shape):
    if spec[d] is not None or length == 0:
      continue
    per_device = -(-length // n) * (size // length)
    key = (per_device, length % n != 0, -length)
    if best_key is None or key < best_key:
      best, best_key = d, key
  if n == 1 or best is None:
    return LeafLayout(spec, None, 0)
  return LeafLayout(spec, best, -(-shape[best] // n) * n)


def _explicit(mesh: Mesh) -> Mesh:
  return Mesh(
    mesh.devices,
    mesh.axis_names,
    axis_types=(AxisType.Explicit,) * len(mesh.axis_names),
  )


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Layouts and shardings for one params structure on one mesh."""

  layouts: Any  # tree of LeafLayout, params structure
  param_shardings: Any
  padded_params: Any  # tree of ShapeDtypeStruct (padded, ZeRO sharded)
  opt_state_shardings: Any
  opt_state_padded: Any  # ShapeDtypeStructs of the state as stored
  opt_state_logical: Any  # ShapeDtypeStructs of the state without padding


def _make_plan(tx, params, mesh, data_axis, zero_stage, param_specs) -> _Plan:
  if data_axis not in mesh.axis_names:
    raise ValueError(
      f"data_axis {data_axis!r} is not an axis of the mesh {mesh.axis_names}."
    )
  n = mesh.shape[data_axis] if zero_stage == 1 else 1
  if param_specs is None:
    param_specs = jax.tree.map(lambda p: _spec_of(p, mesh), params)
  try:
    # FP8 states stay replicated: laid out as on a data axis of size 1.
    layouts = jax.tree.map(
      lambda p, s, is_fp8: leaf_layout(
        tuple(p.shape), s, 1 if is_fp8 else n, data_axis
      ),
      params,
      param_specs,
      _fp8_leaves(params),
    )
  except ValueError as e:
    if "structure" not in str(e) and "Custom node" not in str(e):
      raise
    raise ValueError(
      "param_specs must have the params' tree structure (one PartitionSpec "
      f"per param): {e}"
    ) from None
  is_layout = lambda x: isinstance(x, LeafLayout)  # noqa: E731
  param_shardings = jax.tree.map(
    lambda lay: NamedSharding(mesh, P(*lay.spec)), layouts, is_leaf=is_layout
  )
  emesh = _explicit(mesh)

  def padded(p, lay, explicit):
    shape = list(p.shape)
    if lay.dim is not None:
      shape[lay.dim] = lay.padded
    m = emesh if explicit else mesh
    return jax.ShapeDtypeStruct(
      tuple(shape), p.dtype, sharding=NamedSharding(m, lay.zero_spec(data_axis))
    )

  explicit_params = jax.tree.map(
    lambda p, lay: padded(p, lay, True), params, layouts
  )
  # Under Explicit axes the sharding of every array is part of its type, so
  # tracing tx.init shows which state leaves inherit a param's ZeRO sharding
  # (zeros_like, copies) and which are fresh scalars: works for any optax
  # optimizer without knowing its state's structure.
  with jax.set_mesh(emesh):
    traced = jax.jit(_init_fn(tx)).trace(explicit_params)
  opt_state_padded = jax.tree.map(
    lambda o: jax.ShapeDtypeStruct(
      o.shape,
      o.dtype,
      sharding=NamedSharding(
        mesh, o.sharding.spec if o.sharding is not None else P()
      ),
    ),
    traced.out_info,
  )
  logical = jax.eval_shape(
    _init_fn(tx),
    jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params),
  )
  return _Plan(
    layouts=layouts,
    param_shardings=param_shardings,
    padded_params=jax.tree.map(
      lambda p, lay: padded(p, lay, False), params, layouts
    ),
    opt_state_shardings=jax.tree.map(lambda o: o.sharding, opt_state_padded),
    opt_state_padded=opt_state_padded,
    opt_state_logical=logical,
  )


def _init_fn(tx):
  """`tx.init` on the trainable params (FP8 states left out)."""
  return lambda params: tx.init(transform._trainable(params))


def _fp8_leaves(params: Any) -> Any:
  """A tree of bools with the params' leaves: True inside FP8 states."""
  return jax.tree.map(
    lambda x: jax.tree.map(lambda _: fp8.is_fp8_state(x), x),
    params,
    is_leaf=fp8.is_fp8_state,
  )


def _spec_of(p: Any, mesh: Mesh) -> P:
  """A param's current spec if it is a NamedSharding on `mesh`, else P()."""
  sharding = getattr(p, "sharding", None)
  if isinstance(sharding, NamedSharding) and sharding.mesh.shape == mesh.shape:
    return sharding.spec
  return P()


def zero1_shardings(
  tx: optax.GradientTransformation,
  params: optax.Params,
  mesh: Mesh,
  *,
  data_axis: str = "data",
  param_specs: Any = None,
) -> Any:
  """The NamedSharding tree of `tx`'s ZeRO-1 optimizer state on `mesh`.

  Every state leaf that mirrors a param (any optax optimizer's moments, the
  master weights of `mixed_precision`) is partitioned over `data_axis` along
  the dimension `leaf_layout` picks; the rest stays replicated. Padded
  dimensions have their padded length: build the state with
  `make_train_step(...).init`, which pads for you.

  Args:
    tx: the optimizer.
    params: the params (arrays or `jax.ShapeDtypeStruct`s).
    mesh: the device mesh.
    data_axis: the data-parallel mesh axis.
    param_specs: a PartitionSpec per param over model axes (default: the
      params' own NamedShardings on this mesh, else replicated).

  Returns:
    A tree of NamedSharding with the structure of `tx.init(params)`.
  """
  return _make_plan(
    tx, params, mesh, data_axis, 1, param_specs
  ).opt_state_shardings


def _slice_to(x: jax.Array, shape: tuple) -> jax.Array:
  if tuple(x.shape) == tuple(shape):
    return x
  return x[tuple(slice(0, s) for s in shape)]


def _pad_to(x: jax.Array, shape: tuple) -> jax.Array:
  if tuple(x.shape) == tuple(shape):
    return x
  return jnp.pad(x, [(0, s - d) for d, s in zip(x.shape, shape, strict=True)])


class TrainStep:
  """A jitted data-parallel train step with a ZeRO-1 (or replicated) state.

  Built by `make_train_step`. Call `init(params)` once to place params and
  build the optimizer state, then `step(params, opt_state, batch)`.
  """

  def __init__(
    self, loss_fn, tx, mesh, data_axis, zero_stage, accum_steps, param_specs
  ):
    self.loss_fn = loss_fn
    self.tx = tx
    self.mesh = mesh
    self.data_axis = data_axis
    self.zero_stage = zero_stage
    self.accum_steps = accum_steps
    self._param_specs = param_specs
    self._plans: dict = {}
    self._jitted: dict = {}

  @property
  def num_shards(self) -> int:
    """The size of the data axis."""
    return self.mesh.shape[self.data_axis]

  def plan(self, params: optax.Params) -> _Plan:
    key = (
      jax.tree.structure(params),
      tuple((tuple(p.shape), str(p.dtype)) for p in jax.tree.leaves(params)),
    )
    if key not in self._plans:
      self._plans[key] = _make_plan(
        self.tx,
        params,
        self.mesh,
        self.data_axis,
        self.zero_stage,
        self._param_specs,
      )
    return self._plans[key]

  def param_shardings(self, params: optax.Params) -> Any:
    """NamedShardings of the params: replicated over data, model per spec."""
    return self.plan(params).param_shardings

  def opt_state_shardings(self, params: optax.Params) -> Any:
    """NamedShardings of the optimizer state (ZeRO-1 partitioned if stage 1)."""
    return self.plan(params).opt_state_shardings

  def batch_sharding(self) -> NamedSharding:
    """Batch leaves are split over the data axis along their first dimension."""
    return NamedSharding(self.mesh, P(self.data_axis))

  def init(self, params: optax.Params) -> tuple[optax.Params, optax.OptState]:
    """Places `params` on the mesh and builds the (partitioned) state."""
    plan = self.plan(params)

    def init(params):
      padded = jax.tree.map(
        lambda lay, p: lay.pad(p),
        plan.layouts,
        params,
        is_leaf=lambda x: isinstance(x, LeafLayout),
      )
      # A real copy: params must not alias the state (both are donated).
      params = jax.tree.map(jnp.copy, params)
      return params, _init_fn(self.tx)(padded)

    return jax.jit(
      init, out_shardings=(plan.param_shardings, plan.opt_state_shardings)
    )(params)

  def to_logical(self, opt_state: optax.OptState) -> optax.OptState:
    """The optimizer state with the ZeRO padding cut off (for checkpoints)."""
    plan = self._plan_for_state(opt_state)
    shardings = self._logical_shardings(plan)
    return jax.jit(
      lambda s: jax.tree.map(
        lambda x, o: _slice_to(x, o.shape), s, plan.opt_state_logical
      ),
      out_shardings=shardings,
    )(opt_state)

  def from_logical(self, opt_state: optax.OptState, params) -> optax.OptState:
    """Pads a logical optimizer state back into this step's layout."""
    plan = self.plan(params)
    return jax.jit(
      lambda s: jax.tree.map(
        lambda x, o: _pad_to(x, o.shape), s, plan.opt_state_padded
      ),
      out_shardings=plan.opt_state_shardings,
    )(opt_state)

  def logical_opt_state_shardings(self, params) -> Any:
    """Shardings of the unpadded state: padded leaves are not data-split."""
    return self._logical_shardings(self.plan(params))

  def _logical_shardings(self, plan: _Plan) -> Any:
    def sharding(padded, logical):
      if padded.shape == logical.shape:
        return padded.sharding
      spec = [
        None if e == self.data_axis else e for e in tuple(padded.sharding.spec)
      ]
      return NamedSharding(self.mesh, P(*spec))

    return jax.tree.map(sharding, plan.opt_state_padded, plan.opt_state_logical)

  def _plan_for_state(self, opt_state) -> _Plan:
    shapes = [tuple(x.shape) for x in jax.tree.leaves(opt_state)]
    for plan in self._plans.values():
      if [o.shape for o in jax.tree.leaves(plan.opt_state_padded)] == shapes:
        return plan
    raise ValueError(
      "This optimizer state was not built by this TrainStep's init."
    )

  def _build(self, plan: _Plan):
    mesh, axis, n = self.mesh, self.data_axis, self.num_shards
    zero = self.zero_stage == 1
    is_layout = lambda x: isinstance(x, LeafLayout)  # noqa: E731
    fp8_leaves = _fp8_leaves(plan.param_shardings)

    def grad_spec(lay):
      return P(*[axis if d == lay.dim else None for d in range(len(lay.spec))])

    def local_grads(params, batch, scale):
      # Differentiating replicated params inside shard_map would sum their
      # gradients over the data axis (an all-reduce): mark them per-device.
      varying = jax.tree.map(
        lambda p: (
          jax.lax.pcast(p, axis, to="varying") if leaves.is_float(p) else p
        ),
        params,
      )
      loss, grads = accumulation.accumulate_gradients(
        self.loss_fn, varying, batch, self.accum_steps, loss_scale=scale
      )

      def reduce(lay, g, p, is_fp8):
        if not leaves.is_float(p):
          return jnp.zeros_like(p)
        if is_fp8:  # amaxes: the max over devices, not the sum
          return jax.lax.pmax(g, axis)
        if g.dtype == jnp.float16:
          # Divided before the sum, so the sum of N per-device means cannot
          # overflow where one device's mean over the whole batch would not:
          # the skip decision must not depend on N. (bfloat16 and float32
          # have float32's range; they are summed, then divided.)
          g = (g.astype(jnp.float32) * (1.0 / n)).astype(g.dtype)
        if zero and lay.dim is not None:
          return jax.lax.psum_scatter(
            lay.pad(g), axis, scatter_dimension=lay.dim, tiled=True
          )
        return jax.lax.psum(g, axis)

      grads = jax.tree.map(
        reduce, plan.layouts, grads, params, fp8_leaves, is_leaf=is_layout
      )
      return jax.lax.pmean(loss, axis), grads

    grad_specs = jax.tree.map(
      lambda lay: grad_spec(lay) if zero else P(),
      plan.layouts,
      is_leaf=is_layout,
    )

    def gather(lay, x):
      if not zero or lay.dim is None:
        return x

      def body(x):
        return jax.lax.all_gather(x, axis, axis=lay.dim, tiled=True)

      spec = grad_spec(lay)
      full = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=spec,
        out_specs=P(),
        axis_names={axis},
        check_vma=False,
      )(x)
      return full

    def step(params, opt_state, batch):
      scale = _loss_scale_or_one(opt_state)
      loss, grads = jax.shard_map(
        local_grads,
        mesh=mesh,
        in_specs=(P(), P(axis), P()),
        out_specs=(P(), grad_specs),
        axis_names={axis},
      )(params, batch, scale)

      def mean(g, is_fp8):
        if is_fp8 or not leaves.is_float(g):
          return g
        wide = g.astype(jnp.promote_types(g.dtype, jnp.float32))
        return wide if g.dtype == jnp.float16 else wide * (1.0 / n)

      grads = jax.tree.map(mean, grads, fp8_leaves)
      work = jax.tree.map(
        lambda lay, p: lay.pad(p) if zero else p,
        plan.layouts,
        params,
        is_leaf=is_layout,
      )
      if zero:
        work = jax.lax.with_sharding_constraint(
          work, jax.tree.map(lambda s: s.sharding, plan.padded_params)
        )
      updates, opt_state = self.tx.update(
        transform._trainable(grads), opt_state, transform._trainable(work)
      )
      updates = transform._pass_fp8_through(updates, work)
      new = optax.apply_updates(work, updates)
      new = jax.tree.map(
        lambda lay, x, p: _slice_to(gather(lay, x), p.shape),
        plan.layouts,
        new,
        params,
        is_leaf=is_layout,
      )
      metrics = {"loss": loss}
      if _has_mixed_precision(opt_state):
        metrics.update(transform.train_metrics(opt_state))
        finite = metrics["last_step_finite"]
      else:
        finite = loss_scale.all_finite(transform._trainable(grads))
      new = fp8.update(new, grads, finite=finite)
      return new, opt_state, metrics

    replicated = NamedSharding(mesh, P())
    return jax.jit(
      step,
      in_shardings=(
        plan.param_shardings,
        plan.opt_state_shardings,
        self.batch_sharding(),
      ),
      out_shardings=(
        plan.param_shardings,
        plan.opt_state_shardings,
        replicated,
      ),
      donate_argnums=(0, 1),
      # Every state leaf stays an argument, so memory_analysis() counts it.
      keep_unused=True,
    )

  def jitted(self, params: optax.Params):
    """The jitted step for this params structure (for `.lower(...)`)."""
    return self._jitted_for(self.plan(params))

  def _jitted_for(self, plan: _Plan):
    if id(plan) not in self._jitted:
      self._jitted[id(plan)] = self._build(plan)
    return self._jitted[id(plan)]

  def lower(self, params: optax.Params, batch: Any) -> jax.stages.Lowered:
    """Lowers the step for abstract inputs: nothing is allocated.

    `params` and `batch` may be arrays or `jax.ShapeDtypeStruct`s; the step's
    own shardings are used. `.compile().memory_analysis()` and
    `.compile().as_text()` then give per-device bytes and the collectives.
    """
    plan = self.plan(params)
    placed = jax.tree.map(
      lambda p, s: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=s),
      params,
      plan.param_shardings,
    )
    batch = jax.tree.map(
      lambda b: jax.ShapeDtypeStruct(
        np.shape(b), b.dtype, sharding=self.batch_sharding()
      ),
      batch,
    )
    return self.jitted(params).lower(placed, plan.opt_state_padded, batch)

  def __call__(self, params, opt_state, batch):
    """One step: returns `(params, opt_state, metrics)`; donates its inputs."""
    self._check_batch(batch)
    plan = self.plan(params)
    _check_not_donated(params, "params")
    if not _matches(opt_state, plan.opt_state_padded):
      _check_not_donated(opt_state, "opt_state")
      _check_opt_state(plan, opt_state)
    return self._jitted_for(plan)(params, opt_state, batch)

  def _check_batch(self, batch) -> None:
    multiple = self.num_shards * self.accum_steps
    for x in jax.tree.leaves(batch):
      if np.ndim(x) == 0 or np.shape(x)[0] % multiple:
        raise ValueError(
          f"Batch leaves need a leading dimension divisible by data shards x "
          f"accum_steps = {self.num_shards} x {self.accum_steps}; got shape "
          f"{np.shape(x)}."
        )


def _check_opt_state(plan: _Plan, opt_state: Any) -> None:
  """Refuses a state that is not what `init(params)` builds for this step.

  Another optimizer's state, or params of other dtypes or shapes than the
  state was built for, would otherwise fail deep inside jit with a pytree or
  type error that names neither.
  """
  expected = plan.opt_state_padded
  want = jax.tree.structure(expected)
  got = jax.tree.structure(opt_state)
  hint = (
    "Build the state with this step's init(params), for these params "
    "(their dtypes and shapes) and this optimizer."
  )
  flat, _ = jax.tree_util.tree_flatten_with_path(opt_state)
  if want != got:
    names = lambda tree: [leaves.keystr(p) for p, _ in tree]  # noqa: E731
    have = names(flat)
    need = names(jax.tree_util.tree_flatten_with_path(expected)[0])
    missing = [k for k in need if k not in set(have)][:3]
    extra = [k for k in have if k not in set(need)][:3]
    detail = (
      f"it lacks leaves {missing} and has leaves {extra} the step does not "
      "build"
      if missing or extra
      else f"expected {want}, got {got}"
    )
    raise ValueError(
      "opt_state does not have the structure this TrainStep's optimizer "
      f"builds for these params: {detail}. {hint}"
    )
  for (path, x), e in zip(flat, jax.tree.leaves(expected), strict=True):
    shape, dtype = tuple(np.shape(x)), getattr(x, "dtype", None)
    if dtype is None or shape != tuple(e.shape) or dtype != e.dtype:
      name = leaves.keystr(path)
      kind = f"{np.dtype(dtype).name}{list(shape)}" if dtype else repr(x)
      raise ValueError(
        f"opt_state leaf {name!r} is {kind}, but for "
        f"these params this TrainStep expects "
        f"{np.dtype(e.dtype).name}{list(e.shape)}. {hint}"
      )


def _matches(tree: Any, expected: Any) -> bool:
  """Whether `tree` has `expected`'s structure, shapes and dtypes, and none of
  its arrays was donated: one pass over the leaves (a fraction of a
  microsecond each), so every call can afford it."""
  leaves, want = jax.tree.leaves(tree), jax.tree.leaves(expected)
  return (
    len(leaves) == len(want)
    and all(
      isinstance(x, jax.Array)
      and not x.is_deleted()
      and x.shape == e.shape
      and x.dtype == e.dtype
      for x, e in zip(leaves, want, strict=True)
    )
    and jax.tree.structure(tree) == jax.tree.structure(expected)
  )


def _check_not_donated(tree: Any, name: str) -> None:
  """Refuses arrays a previous call donated (reusing them crashes XLA)."""
  flat = jax.tree.leaves(tree)
  if not any(isinstance(x, jax.Array) and x.is_deleted() for x in flat):
    return
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if isinstance(x, jax.Array) and x.is_deleted():
      leaf = leaves.keystr(path)
      raise ValueError(
        f"{name} leaf {leaf!r} was donated to an earlier call of this train "
        f"step and its buffer is gone: pass the {name} that call returned "
        "(params, opt_state, metrics = step(params, opt_state, batch))."
      )


def _has_mixed_precision(opt_state) -> bool:
  return bool(transform._mixed_precision_states(opt_state))


def _loss_scale_or_one(opt_state) -> jax.Array:
  if _has_mixed_precision(opt_state):
    return transform.current_loss_scale(opt_state)
  return jnp.ones([], jnp.float32)


def make_train_step(
  loss_fn: Callable[[optax.Params, Any], jax.Array],
  tx: optax.GradientTransformation,
  *,
  mesh: Mesh,
  data_axis: str = "data",
  zero_stage: int = 1,
  accum_steps: int = 1,
  param_specs: Any = None,
) -> TrainStep:
  """A jitted data-parallel train step, ZeRO-1 by default.

  The step computes `loss_fn(params, micro_batch)` on each device's share of
  the batch, multiplied by the loss scale of the `mixed_precision` state in
  `tx` (1 if there is none), accumulates `accum_steps` micro-batch gradients
  in float32 (see `accumulate_gradients`), reduces them over the data axis
  (reduce-scatter for `zero_stage=1`, all-reduce for 0), divides by the number
  of shards, runs `tx.update` and `optax.apply_updates` and all-gathers the new
  params. It donates params and optimizer state.

  Args:
    loss_fn: `loss_fn(params, batch) -> scalar`, the unscaled mean loss.
    tx: any optax optimizer, typically `mixed_precision(...)`.
    mesh: the device mesh; it may have model axes besides `data_axis`.
    data_axis: the data-parallel axis.
    zero_stage: 1 (partitioned optimizer state) or 0 (replicated).
    accum_steps: micro-batches per step, accumulated in float32.
    param_specs: a PartitionSpec per param over model axes (default: the
      params' own shardings on `mesh`, else replicated).

  Returns:
    A `TrainStep`: `params, opt_state = step.init(params)`, then
    `params, opt_state, metrics = step(params, opt_state, batch)` with
    `metrics` the mean loss plus `train_metrics(opt_state)`.
  """
  if zero_stage not in (0, 1):
    raise ValueError(f"zero_stage must be 0 or 1, got {zero_stage!r}.")
  accum_steps = accumulation._check_accum_steps(accum_steps)
  if not isinstance(mesh, Mesh):
    raise ValueError(f"mesh must be a jax.sharding.Mesh, got {mesh!r}.")
  return TrainStep(
    loss_fn, tx, mesh, data_axis, zero_stage, accum_steps, param_specs
  )
