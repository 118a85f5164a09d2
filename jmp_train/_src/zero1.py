"""The ZeRO-1 plan: where every leaf of a train state lives on a mesh.

A `Plan` is a value computed once by `make_plan(tx, params, mesh)`: for each
param, its `LeafLayout` (its spec over model axes, and the dimension that
ZeRO-1 partitions over the data axis, zero-padded to a multiple of N); the
shardings of params and optimizer state; and the optimizer state's shapes as
stored (padded) and as logical (unpadded, what a checkpoint holds). The step
builder (`jmp_train.train`), the memory table and the checkpointer read it;
nothing here holds a cache or recognises a state by its leaf shapes.

With `zero_stage=1`:

* params stay replicated over the data axis (sharded over model axes as their
  specs say), in their own dtype;
* every optimizer-state leaf that mirrors a param (any optax optimizer's
  moments, the float32 master weights of `mixed_precision`) is partitioned
  over the data axis along one dimension: each device holds 1/N of it (at
  most one padded row more). Scalars (step counts, the loss scale) stay
  replicated.

`zero_stage=0` is plain data parallelism: everything replicated.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.core import meta as flax_meta
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jmp_train._src import distributed, fp8_param, leaves, optimizer_state


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
    """`x` zero-padded along `dim` to `padded`."""
    if self.dim is None or x.shape[self.dim] == self.padded:
      return x
    widths = [(0, 0)] * x.ndim
    widths[self.dim] = (0, self.padded - x.shape[self.dim])
    return jnp.pad(x, widths)

  def zero_spec(self, data_axis: str) -> P:
    """The spec of the partitioned leaf: `spec` with `dim` over the data."""
    spec = list(self.spec)
    if self.dim is not None:
      spec[self.dim] = data_axis
    return P(*spec)

  def shard_spec(self, data_axis: str) -> P:
    """The spec of one device's shard inside `shard_map` (data axis only)."""
    return P(
      *[data_axis if d == self.dim else None for d in range(len(self.spec))]
    )


def is_layout(x: Any) -> bool:
  return isinstance(x, LeafLayout)


def _check_spec(
  spec: tuple, shape: tuple, data_axis: str, where: str, mesh: Mesh | None
) -> None:
  """Refuses a param's spec ZeRO-1 cannot lay out; `where` starts each
  message. With `mesh`, also axes it lacks and dimensions that do not
  split over theirs."""
  if len(spec) > len(shape):
    raise ValueError(f"{where} has more entries than ndim={len(shape)}.")
  for dim, entry in enumerate(spec):
    axes = [a for a in (entry if isinstance(entry, tuple) else (entry,)) if a]
    if data_axis in axes:
      raise ValueError(
        f"{where} uses the data axis {data_axis!r}, over which params stay "
        "replicated (ZeRO-1 splits the optimizer state, not the params); "
        "name only model axes."
      )
    if mesh is None:
      continue
    for axis in axes:
      if axis not in mesh.axis_names:
        raise ValueError(
          f"{where}: {axis!r} is not an axis of the mesh {mesh.axis_names}."
        )
    size = math.prod(mesh.shape[a] for a in axes)
    if shape[dim] % size:
      raise ValueError(
        f"{where}: dimension {dim} of the param {shape} does not split over "
        f"{size} devices."
      )


def _normalized_spec(spec: Any, shape: tuple, data_axis: str) -> tuple:
  spec = tuple(P() if spec is None else spec)
  _check_spec(spec, shape, data_axis, f"PartitionSpec {P(*spec)}", None)
  return spec + (None,) * (len(shape) - len(spec))


def leaf_layout(shape: tuple, spec: Any, n: int, data_axis: str) -> LeafLayout:
  """The ZeRO-1 layout of a leaf: the free dimension that splits it best.

  Among dimensions not already sharded over a model axis, picks the one that
  gives the fewest elements per device after padding to a multiple of `n`
  (so no padding when some dimension divides), then the longest.

  Example:
    >>> leaf_layout((10, 6), None, 4, "data")
    LeafLayout(spec=(None, None), dim=0, padded=12)
  """
  spec = _normalized_spec(spec, shape, data_axis)
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


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
  """Layouts and shardings of a train state on a mesh (see `make_plan`).

  Attributes:
    mesh: the device mesh.
    data_axis: the data-parallel mesh axis.
    zero_stage: 1 (optimizer state partitioned over the data axis) or 0.
    layouts: a `LeafLayout` per param (the params' tree structure).
    params: `jax.ShapeDtypeStruct`s of the params the plan was made for,
      with their shardings (`param_shardings` reads those).
    opt_state: `jax.ShapeDtypeStruct`s of the optimizer state as the step
      stores it (ZeRO-padded, with its shardings).
    logical_opt_state: the same without padding (what `tx.init(params)`
      builds and a checkpoint holds); padded leaves are not data-split.
  """

  mesh: Mesh
  data_axis: str
  zero_stage: int
  layouts: Any
  params: Any
  opt_state: Any
  logical_opt_state: Any

  @property
  def param_shardings(self) -> Any:
    """A NamedSharding per param."""
    return jax.tree.map(lambda p: p.sharding, self.params)

  @property
  def num_shards(self) -> int:
    """N, the size of the data axis."""
    return self.mesh.shape[self.data_axis]

  @property
  def batch_sharding(self) -> NamedSharding:
    """Batch leaves are split over the data axis along their first dim."""
    return NamedSharding(self.mesh, P(self.data_axis))

  @property
  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, P())

  @property
  def opt_state_shardings(self) -> Any:
    """NamedShardings of the stored optimizer state."""
    return jax.tree.map(lambda s: s.sharding, self.opt_state)

  def state_shardings(self, state: Any, *, logical: bool = False) -> Any:
    """The shardings of a train state: params and optimizer state as
    planned, everything else (model state, FP8 metadata, step, key)
    replicated. `logical=True` gives the unpadded optimizer state's."""
    opt = self.logical_opt_state if logical else self.opt_state
    return jax.tree.map(lambda _: self.replicated, state).replace(
      params=self.param_shardings,
      opt_state=jax.tree.map(lambda s: s.sharding, opt),
    )


def _explicit(mesh: Mesh) -> Mesh:
  return Mesh(
    mesh.devices,
    mesh.axis_names,
    axis_types=(AxisType.Explicit,) * len(mesh.axis_names),
  )


def _spec_of(p: Any, mesh: Mesh) -> P:
  """A param's current spec if it is a NamedSharding on `mesh`, else P()."""
  sharding = getattr(p, "sharding", None)
  if isinstance(sharding, NamedSharding) and sharding.mesh.shape == mesh.shape:
    return sharding.spec
  return P()


def _check_param_specs(
  param_specs: Any, params: Any, mesh: Mesh, data_axis: str, given: bool
) -> None:
  """Refuses param specs ZeRO-1 cannot lay out, naming the leaf (`given`:
  the user's `param_specs`, else read from the params' shardings)."""
  is_spec = lambda x: x is None or isinstance(x, P)  # noqa: E731
  got = jax.tree.structure(param_specs, is_leaf=is_spec)
  want = jax.tree.structure(params)
  if got != want:
    raise ValueError(
      "param_specs must have the params' tree structure (one PartitionSpec "
      f"per param): the params are {want}, param_specs is {got}."
    )
  named = jax.tree_util.tree_flatten_with_path(params)[0]
  for (path, p), spec in zip(
    named, want.flatten_up_to(param_specs), strict=True
  ):
    name = leaves.keystr(path)
    if spec is None:
      continue
    if not isinstance(spec, P):
      raise TypeError(
        f"param_specs leaf {name!r} must be a PartitionSpec or None, got "
        f"{spec!r} (e.g. P(None, 'model'))."
      )
    where = (
      f"param_specs leaf {name!r} ({spec})"
      if given
      else f"param {name!r} (placed with {spec})"
    )
    _check_spec(tuple(spec), tuple(np.shape(p)), data_axis, where, mesh)


def make_plan(
  tx: optax.GradientTransformation,
  params: optax.Params,
  mesh: Mesh,
  *,
  data_axis: str = "data",
  zero_stage: int = 1,
  param_specs: Any = None,
) -> Plan:
  """The ZeRO-1 (or plain data-parallel) plan of a train state on `mesh`.

  A pure function of the optimizer, the params' shapes and dtypes (arrays
  or `jax.ShapeDtypeStruct`s) and the mesh. The optimizer is needed because
  only its `init` knows which of its state leaves mirror a param: tracing it
  under Explicit mesh axes shows which leaves inherit a param's ZeRO
  sharding (any optax optimizer, no knowledge of its state's structure).

  Args:
    tx: the optimizer, typically `mixed_precision(...)`.
    params: the params (arrays or `jax.ShapeDtypeStruct`s).
    mesh: the device mesh; it may have model axes besides `data_axis`.
    data_axis: the data-parallel axis.
    zero_stage: 1 (optimizer state partitioned) or 0 (replicated).
    param_specs: a PartitionSpec per param over model axes (default: the
      params' own NamedShardings on this mesh, else replicated).

  Returns:
    The `Plan`.
  """
  if not isinstance(mesh, Mesh):
    raise ValueError(f"mesh must be a jax.sharding.Mesh, got {mesh!r}.")
  if data_axis not in mesh.axis_names:
    raise ValueError(
      f"data_axis {data_axis!r} is not an axis of the mesh {mesh.axis_names}."
    )
  if zero_stage not in (0, 1) or isinstance(zero_stage, bool):
    raise ValueError(f"zero_stage must be 0 or 1, got {zero_stage!r}.")

  def unplaced_box(x):
    # A box whose array is not on this mesh: with no specs given, its axis
    # names would be read as no spec, and the param replicated. (Boxes
    # placed by jit's out_shardings carry their spec in their sharding.)
    return (
      param_specs is None
      and isinstance(x, flax_meta.AxisMetadata)
      and _spec_of(getattr(x, "value", None), mesh) == P()
      and any(n is not None for n in getattr(x, "names", ()))
    )

  boxed = [
    leaves.keystr(path)
    for path, x in jax.tree_util.tree_flatten_with_path(
      params, is_leaf=lambda x: isinstance(x, flax_meta.AxisMetadata)
    )[0]
    if unplaced_box(x)
  ]
  if boxed:
    raise ValueError(
      f"params {boxed[:3]} are Flax partitioning boxes (nn.with_partitioning "
      "and the like) not placed on the mesh, whose names would be read as "
      "no spec: unbox them and pass their specs, "
      "make_plan(tx, nn.meta.unbox(params), mesh, "
      "param_specs=nn.get_partition_spec(params)) (with logical names, "
      "nn.logical_to_mesh_axes(...) first), and train the unboxed params."
    )
  n = mesh.shape[data_axis] if zero_stage == 1 else 1
  given = param_specs is not None
  if not given:
    param_specs = jax.tree.map(lambda p: _spec_of(p, mesh), params)
  _check_param_specs(param_specs, params, mesh, data_axis, given)
  layouts = jax.tree.map(
    lambda p, s: leaf_layout(tuple(p.shape), s, n, data_axis),
    params,
    param_specs,
    is_leaf=lambda x: x is None or isinstance(x, P),
  )
  emesh = _explicit(mesh)

  def padded(p, lay, m):
    shape = list(p.shape)
    if lay.dim is not None:
      shape[lay.dim] = lay.padded
    sharding = NamedSharding(m, lay.zero_spec(data_axis))
    return jax.ShapeDtypeStruct(tuple(shape), p.dtype, sharding=sharding)

  explicit = jax.tree.map(lambda p, lay: padded(p, lay, emesh), params, layouts)
  # Under Explicit axes the sharding of every array is part of its type, so
  # the traced init says which state leaves inherit a param's ZeRO sharding
  # (zeros_like, copies) and which are fresh scalars.
  with jax.set_mesh(emesh):
    traced = jax.jit(tx.init).trace(explicit)

  def stored(o):
    spec = o.sharding.spec if o.sharding is not None else P()
    return jax.ShapeDtypeStruct(
      o.shape, o.dtype, sharding=NamedSharding(mesh, spec)
    )

  opt_state = jax.tree.map(stored, traced.out_info)
  logical = jax.eval_shape(
    tx.init,
    jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params),
  )

  def unpadded(o, s):
    if tuple(o.shape) == tuple(s.shape):
      return jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=s.sharding)
    spec = [None if e == data_axis else e for e in tuple(s.sharding.spec)]
    sharding = NamedSharding(mesh, P(*spec))
    return jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=sharding)

  param_shardings = jax.tree.map(
    lambda lay: NamedSharding(mesh, P(*lay.spec)), layouts, is_leaf=is_layout
  )
  return Plan(
    mesh=mesh,
    data_axis=data_axis,
    zero_stage=zero_stage,
    layouts=layouts,
    params=jax.tree.map(
      # As jit holds them: NumPy float64 params train as float32.
      lambda p, s: jax.ShapeDtypeStruct(
        p.shape, jax.dtypes.canonicalize_dtype(p.dtype), sharding=s
      ),
      params,
      param_shardings,
    ),
    opt_state=opt_state,
    logical_opt_state=jax.tree.map(unpadded, logical, opt_state),
  )


def zero1_shardings(
  tx: optax.GradientTransformation,
  params: optax.Params,
  mesh: Mesh,
  *,
  data_axis: str = "data",
  param_specs: Any = None,
) -> Any:
  """The NamedSharding tree of `tx`'s ZeRO-1 optimizer state on `mesh`.

  `make_plan(tx, params, mesh, ...).opt_state_shardings`: padded dimensions
  have their padded length (build the state with `place`, which pads).
  """
  plan = make_plan(
    tx, params, mesh, data_axis=data_axis, param_specs=param_specs
  )
  return plan.opt_state_shardings


def resize(x: jax.Array, shape: tuple) -> jax.Array:
  """`x` zero-padded or cut to `shape` (same rank)."""
  if tuple(x.shape) == tuple(shape):
    return x
  x = x[tuple(slice(0, min(d, s)) for d, s in zip(x.shape, shape, strict=True))]
  return jnp.pad(x, [(0, s - d) for d, s in zip(x.shape, shape, strict=True)])


def check_tree(
  tree: Any, expected: Any, what: str, hint: str, by: str = "the plan"
) -> None:
  """Refuses `tree` unless it has `expected`'s structure, shapes and dtypes
  (what `by` gives, for the message).

  Runs where shapes are static (before or while tracing), so a state built
  for other params or another optimizer fails with the leaf's name rather
  than deep inside jit.
  """
  want, got = jax.tree.structure(expected), jax.tree.structure(tree)
  if want != got:
    names = lambda t: [  # noqa: E731
      leaves.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(t)[0]
    ]
    have, need = names(tree), names(expected)
    missing = [k for k in need if k not in set(have)][:3]
    extra = [k for k in have if k not in set(need)][:3]
    parts = [f"it lacks leaves {missing}"] * bool(missing)
    parts += [f"it has leaves {extra} {by} does not have"] * bool(extra)
    detail = " and ".join(parts) or f"expected {want}, got {got}"
    raise ValueError(
      f"{what} does not have the structure {by} gives: {detail}. {hint}"
    )
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  for (path, x), e in zip(flat, jax.tree.leaves(expected), strict=True):
    shape, dtype = tuple(np.shape(x)), getattr(x, "dtype", None)
    if dtype is None or shape != tuple(e.shape) or dtype != e.dtype:
      kind = f"{np.dtype(dtype).name}{list(shape)}" if dtype else repr(x)
      raise ValueError(
        f"{what} leaf {leaves.keystr(path)!r} is {kind}, but {by} has "
        f"{np.dtype(e.dtype).name}{list(e.shape)}. {hint}"
      )


def looks_padded(x: Any, param_shape: tuple) -> bool:
  """Whether `x` looks like a leaf as a ZeRO-1 plan stores it: the param's
  shape with one non-empty dimension padded up, and zeros in the padding (a
  padded row's gradient is zero) where the values are concrete. States
  shaped otherwise are an optimizer's own: Adafactor's factored rows,
  L-BFGS's memory, NovoGrad's per-leaf norms, a Shampoo factor (m, m) for
  an (m, n) param (its extra columns are not zeros)."""
  shape = tuple(x.shape)
  if len(shape) != len(param_shape):
    return False
  grown = [
    d for d, (a, b) in enumerate(zip(shape, param_shape, strict=True)) if a > b
  ]
  same = sum(a == b for a, b in zip(shape, param_shape, strict=True))
  if len(grown) != 1 or same != len(shape) - 1 or param_shape[grown[0]] == 0:
    return False
  if not isinstance(x, (jax.Array, np.ndarray)) or isinstance(
    x, jax.core.Tracer
  ):
    return True  # no values to look at
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return True  # a state spread over processes is laid out by a plan
  padding = np.take(
    np.asarray(x), np.arange(param_shape[grown[0]], shape[grown[0]]), grown[0]
  )
  return not np.any(padding)


def subtrees_like(structure: Any, tree: Any) -> list[tuple[Any, Any]]:
  """`(path, subtree)` for each subtree of `tree` with the tree structure
  `structure` (the params': Adam's mu and nu). None for one bare array as
  params, where every state leaf has its structure, counts included."""
  if structure.num_nodes == structure.num_leaves:
    return []
  found = jax.tree_util.tree_flatten_with_path(
    tree, is_leaf=lambda x: x is not None and jax.tree.structure(x) == structure
  )[0]
  return [(p, x) for p, x in found if jax.tree.structure(x) == structure]


def find_padded(params: Any, opt_state: Any) -> str | None:
  """The path of an optimizer-state leaf laid out as a plan pads it (see
  `looks_padded`), among the subtrees of `opt_state` with the params' tree
  structure (masters, Adam's moments); None if there is none."""
  # An Fp8Param is one param here (its master is one float32 array).
  named, structure = jax.tree_util.tree_flatten_with_path(
    params, is_leaf=fp8_param.is_fp8_param
  )
  shapes = [
    tuple(p.shape if fp8_param.is_fp8_param(p) else np.shape(p))
    for _, p in named
  ]
  # Masters first: None where a param keeps none, so their tree is not the
  # params' (a mixed_precision state's, wherever it sits).
  for state in optimizer_state.mixed_precision_states(opt_state):
    masters = structure.flatten_up_to(state.master_params)
    for (path, _), x, shape in zip(named, masters, shapes, strict=True):
      if isinstance(x, (jax.Array, np.ndarray)) and looks_padded(x, shape):
        return f"master_params/{leaves.keystr(path)}".rstrip("/")
  for path, node in subtrees_like(structure, opt_state):
    for (inner, x), shape in zip(
      jax.tree_util.tree_flatten_with_path(node)[0], shapes, strict=True
    ):
      if isinstance(x, (jax.Array, np.ndarray)) and looks_padded(x, shape):
        return leaves.keystr((*path, *inner))
  return None


def check_params(plan: Plan, params: Any, what: str) -> None:
  """Refuses `params` unlike those `plan` was made for (their structure,
  shapes and dtypes), naming the leaf: an optimizer with no per-param state
  (`optax.sgd`) would otherwise let them through to fail inside jit."""
  # As jit holds them (NumPy float64 becomes float32), as the plan does.
  held = jax.tree.map(
    lambda p: (
      jax.ShapeDtypeStruct(np.shape(p), jax.dtypes.canonicalize_dtype(p.dtype))
      if hasattr(p, "dtype")
      else p
    ),
    params,
  )
  check_tree(
    held,
    plan.params,
    what,
    "Make the plan from these params: zero1.make_plan(tx, params, mesh).",
  )


def laid_out(plan: Plan, state: Any) -> Any:
  """`state` (logical) padded as the plan stores it, params copied: the
  traced body of `place`, for callers that build the state inside jit."""
  opt = jax.tree.map(
    lambda x, o: resize(x, o.shape), state.opt_state, plan.opt_state
  )
  # A real copy: the step donates the state, params must not alias it.
  params = jax.tree.map(jnp.copy, state.params)
  return state.replace(params=params, opt_state=opt)


def place(plan: Plan, state: Any) -> Any:
  """A train state laid out as `plan` says: the step's input.

  Pads the optimizer-state leaves that ZeRO-1 partitions and puts every leaf
  on its sharding. `state` holds the logical optimizer state, as
  `tx.init(params)` or a checkpoint gives it. With several processes, its
  process-local leaves must be the same on every process (checked).
  """
  check_params(plan, state.params, "state.params")
  check_tree(
    state.opt_state,
    plan.logical_opt_state,
    "state.opt_state",
    "Build it with the plan's optimizer for these params (their dtypes "
    "and shapes); after adjust_precision, make the plan from the new "
    "preset's transformation (zero1.make_plan(preset.mixed_precision(inner), "
    "params, mesh)).",
  )
  if distributed.spans_processes(plan.mesh):
    distributed.check_same_on_every_process(state, "zero1.place's state")
  return jax.jit(
    lambda s: laid_out(plan, s), out_shardings=plan.state_shardings(state)
  )(state)


def abstract(plan: Plan, state: Any) -> Any:
  """`jax.ShapeDtypeStruct`s of `state` as `place` would lay it out.

  `state` may itself be abstract (`jax.eval_shape(TrainState.create, ...)`):
  nothing is allocated. For `step.lower(abstract(plan, state), batch)`, the
  memory table and checkpoint targets.
  """
  stored = jax.eval_shape(lambda s: laid_out(plan, s), state)
  return jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
    stored,
    plan.state_shardings(state),
  )


def to_logical(plan: Plan, state: Any) -> Any:
  """The train state with the ZeRO-1 padding cut off (for checkpoints)."""
  check_tree(
    state.opt_state,
    plan.opt_state,
    "state.opt_state",
    "Pass a state laid out by this plan (place(plan, state) or the step's "
    "output).",
  )

  def cut(state):
    opt = jax.tree.map(
      lambda x, o: resize(x, o.shape), state.opt_state, plan.logical_opt_state
    )
    return state.replace(opt_state=opt)

  shardings = plan.state_shardings(state, logical=True)
  return jax.jit(cut, out_shardings=shardings)(state)
