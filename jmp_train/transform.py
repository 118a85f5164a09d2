"""The optax transformation: loss-scale handling, skipping and master weights.

`mixed_precision(inner)` wraps any optax optimizer. Its `update` receives the
gradients of the *scaled* loss, in the params' dtype, and

1. casts them to float32 (at least) and unscales them by the loss scale that
   was used for the backward pass;
2. checks, as one global predicate, that every gradient is finite;
3. on a finite step runs `inner` on the float32 gradients and float32 params
   (the master weights where params are stored below float32);
4. on a non-finite step emits updates that leave params bit-identical and
   keeps the inner state and master weights bit-identical;
5. adjusts the loss scale and counts steps, skipped steps and the grad norm.

Float and complex params are trained (complex ones as optax trains them).
Integer and boolean param leaves are hidden from `inner` (like
`optax.masked`) and never change; so are FP8 states (`jmp_train.fp8`), which
the train step advances with `fp8.update`: `mixed_precision` passes them
through bit-identical, keeps no master copy or optimizer state for them and
leaves them out of the finite check and the grad norm. float8 arrays and
non-array objects are refused, as are gradients whose shape is not their
param's.

`mixed_precision` must be the outermost transformation. optax gives
`update` no view of its neighbours, so the order is checked where the state
is read (`current_loss_scale`, `train_metrics`, the train step): a
`mixed_precision` state beside others in an `optax.chain` raises there.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_train import fp8 as fp8_lib
from jmp_train import loss_scale as ls_lib
from jmp_train import rounding

_MASKED = optax.MaskedNode()


def _is_masked(x: Any) -> bool:
  return isinstance(x, optax.MaskedNode)


def _is_float(x: Any) -> bool:
  """A trainable leaf: a floating or complex array (float8 excluded)."""
  return (
    hasattr(x, "dtype")
    and jnp.issubdtype(x.dtype, jnp.inexact)
    and np.dtype(x.dtype).itemsize > 1
  )


def _is_real_float(x: Any) -> bool:
  """A float16/bfloat16/float32/float64 leaf: what a policy casts."""
  return _is_float(x) and jnp.issubdtype(x.dtype, jnp.floating)


def _is_float8(x: Any) -> bool:
  return (
    hasattr(x, "dtype")
    and jnp.issubdtype(x.dtype, jnp.floating)
    and np.dtype(x.dtype).itemsize == 1
  )


def _trainable(tree: Any) -> Any:
  """`tree` with each FP8 state replaced by an (empty) `optax.MaskedNode`."""
  return jax.tree.map(
    lambda x: _MASKED if fp8_lib.is_fp8_state(x) else x,
    tree,
    is_leaf=fp8_lib.is_fp8_state,
  )


def _pass_fp8_through(updates: Any, params: Any) -> Any:
  """Fills the masked FP8 positions of `updates` with -0.0 (no change)."""

  def fill(u, p):
    return _skip_updates(p) if fp8_lib.is_fp8_state(p) else u

  return jax.tree.map(fill, updates, params, is_leaf=_is_masked)


def _full_dtype(dtype) -> np.dtype:
  """The dtype the inner optimizer sees for a float param: >= float32."""
  return jnp.promote_types(dtype, jnp.float32)


def _needs_master(x: Any) -> bool:
  return _is_float(x) and np.dtype(x.dtype).itemsize < 4


class _Pair(NamedTuple):
  update: Any
  master: Any


class MixedPrecisionState(NamedTuple):
  """State of `mixed_precision`.

  Attributes:
    loss_scaler: the loss scale (NoOp, Static or Dynamic) to multiply the
      next loss by; `current_loss_scale` reads it.
    master_params: float32 copies of the params stored below float32, with
      `optax.MaskedNode()` where a param keeps no master copy.
    inner_state: the wrapped optimizer's state.
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


_LOSS_SCALE_KINDS = (
  "a NoOpLossScale, StaticLossScale or DynamicLossScale, a positive number "
  "(a static scale) or None"
)


def _as_loss_scale(loss_scale: Any) -> ls_lib.LossScale:
  """The loss scale `mixed_precision` starts from, validated."""
  if loss_scale is None:
    return ls_lib.NoOpLossScale()
  if isinstance(loss_scale, ls_lib.StaticLossScale):
    if not float(loss_scale.loss_scale) > 0:
      raise ValueError(
        f"loss_scale={loss_scale!r} would multiply every gradient by 0 (and "
        f"unscale by 1/0); pass {_LOSS_SCALE_KINDS}."
      )
    return loss_scale
  if isinstance(loss_scale, (ls_lib.NoOpLossScale, ls_lib.DynamicLossScale)):
    return loss_scale
  if isinstance(loss_scale, jax.core.Tracer):
    # optax.inject_hyperparams turns every number into a traced hyperparameter
    # that it would let the user change; the scale lives in the state instead.
    raise TypeError(
      "loss_scale is traced: it is a setting fixed at init (the running scale "
      "lives in the state), so it cannot be a hyperparameter. With "
      "optax.inject_hyperparams(mixed_precision), pass "
      "static_args=('loss_scale',) or a loss-scale object."
    )
  # A real number: Python, NumPy or a concrete JAX scalar.
  if isinstance(loss_scale, (int, float, np.generic, np.ndarray, jax.Array)):
    dtype = np.asarray(loss_scale).dtype
    real = jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(
      dtype, jnp.floating
    )
    if real and np.ndim(loss_scale) == 0:
      return _as_loss_scale(ls_lib.StaticLossScale(float(loss_scale)))
  raise TypeError(
    f"loss_scale must be {_LOSS_SCALE_KINDS}, got {loss_scale!r}."
  )


def _path(path) -> str:
  return jax.tree_util.keystr(path, simple=True, separator="/")


def _checked_leaves(tree: Any, what: str) -> Any:
  """`tree` with Python numbers as arrays; refuses what cannot be trained.

  Float and complex arrays are trained, integer and boolean ones pass through
  unchanged. float8 arrays and non-array objects are refused: a policy never
  casts float8 and no optimizer can update it exactly, and any other object
  would otherwise be silently left alone.
  """

  def check(path, x):
    if isinstance(x, (bool, int, float, complex)):
      return jnp.asarray(x)
    if not (hasattr(x, "dtype") and hasattr(x, "shape")):
      raise TypeError(
        f"mixed_precision: {what} leaf {_path(path)!r} is {x!r}; expected "
        "arrays (float, complex, integer or boolean) or Python numbers."
      )
    if _is_float8(x):
      raise TypeError(
        f"mixed_precision: {what} leaf {_path(path)!r} has dtype {x.dtype}; "
        "float8 arrays are not trainable params (they carry no scale, and "
        "no optimizer updates them). Keep the weight in bfloat16 or float32 "
        "and run its matmuls in FP8 with jmp_train.fp8."
      )
    return x

  return jax.tree_util.tree_map_with_path(check, tree)


def _check_grad_shapes(grads: Any, params: Any) -> None:
  """Refuses a gradient whose shape is not its param's (it would broadcast)."""

  def check(path, g, p):
    if _is_float(p) and tuple(np.shape(g)) != tuple(np.shape(p)):
      raise ValueError(
        f"mixed_precision: the gradient of {_path(path)!r} has shape "
        f"{tuple(np.shape(g))}, its param {tuple(np.shape(p))}; gradients "
        "must have their params' shapes."
      )

  jax.tree_util.tree_map_with_path(check, grads, params)


def _check_same_structure(grads: Any, params: Any) -> None:
  grads_def, params_def = jax.tree.structure(grads), jax.tree.structure(params)
  if grads_def != params_def:
    raise ValueError(
      "mixed_precision: gradients and params must have the same tree "
      f"structure; got gradients {grads_def} and params {params_def}."
    )


def mixed_precision(
  inner: optax.GradientTransformation,
  *,
  loss_scale: ls_lib.LossScale | float | None = None,
  master_weights: bool | None = None,
  stochastic_rounding: bool = False,
  seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
  """Wraps an optax optimizer for mixed-precision training.

  Multiply the loss by `current_loss_scale(opt_state)` before differentiating
  and pass the resulting gradients (in the params' dtype) to `update`; apply
  the updates with `optax.apply_updates`. Place this transformation last: it
  must see the raw gradients, and its updates are exact only when applied
  unchanged. Clipping, weight decay and schedules belong in `inner`, which
  sees unscaled float32 gradients and float32 params.

  With master weights, after `optax.apply_updates` every low-precision param
  equals its new float32 master cast to the param dtype, bit for bit: the
  emitted update is the float32 difference `cast(new_master) - param`.

  Args:
    inner: the optimizer to wrap (any `optax.GradientTransformation`; extra
      args such as `value` are forwarded to it).
    loss_scale: a `NoOpLossScale` (the default, for float32 and bfloat16), a
      `StaticLossScale`, a `DynamicLossScale` (see `dynamic_loss_scale`), or a
      positive number (Python, NumPy or a concrete JAX scalar) meaning a
      static scale. It is the starting point: the running scale lives in the
      state, so under `optax.inject_hyperparams` a number must be among
      `static_args`.
    master_weights: keep float32 master copies of the float params stored
      below float32. None (the default) or True: yes, for exactly those
      params (float32 params are their own master); False: never, and
      low-precision params are updated by rounding `param + update`.
    stochastic_rounding: with `master_weights=False`, round `param + update`
      of bfloat16/float16 params stochastically (`cast_stochastic`) instead
      of to nearest, so updates below half an ulp survive on average. The
      random bits come from `seed`, the step number and the leaf, so a run
      (and a resumed run) is reproducible.
    seed: the seed of the stochastic rounding: an int, or an integer JAX
      scalar (`optax.inject_hyperparams` passes it as one).

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is a
    `MixedPrecisionState`.

  Raises:
    TypeError: for an `inner` that is not a transformation, a loss scale,
      `master_weights`, `stochastic_rounding` or `seed` of the wrong kind;
      in `init`/`update`, for float8 or non-array param leaves and for a
      state that is not a `MixedPrecisionState`.
    ValueError: for a zero static scale, stochastic rounding with master
      weights, and in `update` for gradients whose structure or shapes are
      not the params'.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jmp_train
    >>> params = {"w": jnp.ones(3, jnp.bfloat16)}
    >>> tx = jmp_train.mixed_precision(
    ...     optax.sgd(0.1), loss_scale=jmp_train.dynamic_loss_scale())
    >>> opt_state = tx.init(params)
    >>> scale = jmp_train.current_loss_scale(opt_state)
    >>> grads = jax.grad(lambda p: scale * jnp.sum(p["w"].astype(jnp.float32)))(params)
    >>> updates, opt_state = tx.update(grads, opt_state, params)
    >>> optax.apply_updates(params, updates)["w"]
    Array([0.898438, 0.898438, 0.898438], dtype=bfloat16)
    >>> opt_state.master_params["w"]
    Array([0.9, 0.9, 0.9], dtype=float32)
  """
  if not (
    callable(getattr(inner, "init", None))
    and callable(getattr(inner, "update", None))
  ):
    raise TypeError(
      "inner must be an optax.GradientTransformation (e.g. optax.adam(1e-3)), "
      f"got {inner!r}."
    )
  scaler0 = _as_loss_scale(loss_scale)
  if master_weights is not None and not isinstance(master_weights, bool):
    raise TypeError(
      f"master_weights must be True, False or None, got {master_weights!r}."
    )
  keep_masters = master_weights is not False
  if not isinstance(stochastic_rounding, bool):
    raise TypeError(
      f"stochastic_rounding must be True or False, got {stochastic_rounding!r}."
    )
  if stochastic_rounding and keep_masters:
    raise ValueError(
      "stochastic_rounding=True rounds low-precision params without master "
      f"weights: pass master_weights=False (got {master_weights!r})."
    )
  # An integer scalar; optax.inject_hyperparams hands it over as an int32
  # array (traced in update), which fold_in takes as well.
  seed_dtype = getattr(seed, "dtype", None)
  if isinstance(seed, bool) or not (
    isinstance(seed, int)
    or (
      seed_dtype is not None
      and jnp.issubdtype(seed_dtype, jnp.integer)
      and np.ndim(seed) == 0
    )
  ):
    raise TypeError(f"seed must be an integer scalar, got {seed!r}.")
  inner = optax.with_extra_args_support(inner)

  def init(params: optax.Params) -> MixedPrecisionState:
    params = _checked_leaves(_trainable(params), "params")

    def master(p):
      if keep_masters and _needs_master(p):
        return jnp.asarray(p, jnp.float32)
      return _MASKED

    masters = jax.tree.map(master, params)
    return MixedPrecisionState(
      loss_scaler=scaler0,
      master_params=masters,
      inner_state=inner.init(_full_view(params, masters)),
      steps=jnp.zeros([], jnp.int32),
      skipped_steps=jnp.zeros([], jnp.int32),
      last_step_finite=jnp.ones([], jnp.bool_),
      grad_norm=jnp.zeros([], jnp.float32),
      skip_streak=jnp.zeros([], jnp.int32),
    )

  def update(grads, state, params=None, **extra_args):
    if params is None:
      raise ValueError(
        "mixed_precision needs params: call tx.update(grads, state, params)."
      )
    if not isinstance(state, MixedPrecisionState):
      raise TypeError(
        "mixed_precision's update got a state of type "
        f"{type(state).__name__}, not the MixedPrecisionState its init "
        "returns: pass the state built by this transformation's init (in "
        "optax.chain, the element of the chain's state at its position)."
      )
    _check_same_structure(grads, params)
    full_params = params
    params = _checked_leaves(_trainable(params), "params")
    grads = _checked_leaves(_trainable(grads), "gradients")
    _check_grad_shapes(grads, params)
    scaler = state.loss_scaler

    # Unscaled gradients in float32 (at least); non-float leaves are masked.
    def to_full(g, p):
      if not _is_float(p):
        return _MASKED
      return jnp.asarray(g).astype(_full_dtype(p.dtype))

    grads_full = scaler.unscale(jax.tree.map(to_full, grads, params))
    sq_norm, finite = _sq_norm_and_finite(grads_full)

    def apply_inner(operand):
      grads_full, inner_state, masters, params = operand
      inner_updates, inner_state = inner.update(
        grads_full, inner_state, _full_view(params, masters), **extra_args
      )

      # Master leaves emit a float32 delta that optax.apply_updates turns
      # into the kept master cast down, exactly (`_exact_delta`); so do
      # stochastically rounded leaves, with their rounded value.
      def out_update(p, m, u, key):
        if _is_masked(p):
          return _Pair(_MASKED, m)
        if not _is_float(p):
          return _Pair(jnp.zeros_like(p), m)
        if not _is_masked(m):
          return _Pair(*_exact_delta(p, (m + u).astype(jnp.float32)))
        if stochastic_rounding and _needs_master(p):
          new = rounding.cast_stochastic(
            p.astype(jnp.float32) + u, p.dtype, key
          )
          return _Pair(new.astype(jnp.float32) - p.astype(jnp.float32), m)
        return _Pair(u.astype(_full_dtype(p.dtype)), m)

      pairs = jax.tree.map(
        out_update,
        params,
        masters,
        inner_updates,
        _leaf_keys(params, state.steps),
        is_leaf=_is_masked,
      )
      is_pair = lambda x: isinstance(x, _Pair)  # noqa: E731
      updates = jax.tree.map(lambda x: x.update, pairs, is_leaf=is_pair)
      masters = jax.tree.map(lambda x: x.master, pairs, is_leaf=is_pair)
      return updates, inner_state, masters

    def skip(operand):
      _, inner_state, masters, params = operand
      return _skip_updates(params), inner_state, masters

    # A conditional, not a select: the inner update runs only on finite steps
    # and writes its state in place (measured in benchmarks/overhead.py).
    updates, inner_state, masters = jax.lax.cond(
      finite,
      apply_inner,
      skip,
      (grads_full, state.inner_state, state.master_params, params),
    )
    updates = _pass_fp8_through(updates, full_params)
    new_state = MixedPrecisionState(
      loss_scaler=scaler.adjust(finite),
      master_params=masters,
      inner_state=inner_state,
      steps=state.steps + 1,
      skipped_steps=state.skipped_steps + jnp.where(finite, 0, 1),
      last_step_finite=finite,
      grad_norm=jnp.sqrt(sq_norm),
      skip_streak=jnp.where(finite, 0, state.skip_streak + 1),
    )
    return updates, new_state

  def _leaf_keys(params, steps):
    """One PRNG key per param leaf, from the seed and the step number."""
    leaves, treedef = jax.tree.flatten(params)
    if not stochastic_rounding:
      return jax.tree.unflatten(treedef, [None] * len(leaves))
    step_key = jax.random.fold_in(jax.random.key(seed), steps)
    keys = jax.random.split(step_key, max(len(leaves), 1))
    return jax.tree.unflatten(treedef, list(keys[: len(leaves)]))

  return optax.GradientTransformationExtraArgs(init, update)


def _sq_norm_and_finite(grads: Any) -> tuple[jax.Array, jax.Array]:
  """The grads' squared L2 norm (float32) and whether all of them are finite.

  One plain reduction per leaf gives both: each non-finite entry adds NaN
  instead of its square, so the sum is NaN exactly when some gradient is
  not finite. Finite squares are >= 0 and can only sum to +inf (huge finite
  grads whose squares overflow float32 are still finite and applied). So
  there is no second pass over the grads and no conditional besides the
  skip's own. On a non-finite step the returned norm is NaN.
  """
  leaves = jax.tree.leaves(grads)
  if not leaves:
    return jnp.zeros([], jnp.float32), jnp.array(True)

  def sq_sum(g):
    g = g.astype(jnp.promote_types(g.dtype, jnp.float32))
    if jnp.issubdtype(g.dtype, jnp.complexfloating):  # |g|^2
      square = jnp.square(jnp.real(g)) + jnp.square(jnp.imag(g))
    else:
      square = jnp.square(g)
    return jnp.sum(jnp.where(jnp.isfinite(g), square, jnp.nan))

  total = sum(sq_sum(g).astype(jnp.float32) for g in leaves)
  return total, ~jnp.isnan(total)


def _exact_delta(param: jax.Array, master: jax.Array) -> tuple:
  """The float32 update taking `param` to `cast(master)`, and the master.

  `optax.apply_updates` computes `cast(float32(param) + update)`. The update
  is `master - float32(param)` and the master kept is
  `float32(param) + update`, the very value `apply_updates` casts, so after
  it the params equal the kept master cast down, bit for bit, on every step.
  The subtraction is exact, and the kept master is the new one, unless the
  param halves, changes sign or grows more than 2**16-fold (2**13 for
  float16) in one step; then the kept master differs from the new one by at
  most one float32 ulp of the update, the size of the update's own
  rounding. (`cast(master) - float32(param)` would keep the master but
  misses `cast(master)` where the new value is below about 2**-16 of the
  old one: no float32 update reaches it.)
  """
  delta = master - param.astype(jnp.float32)
  return delta, param.astype(jnp.float32) + delta


def _skip_updates(params: optax.Params) -> optax.Params:
  """Updates that leave params bit-identical: -0.0 for floats, 0 otherwise.

  x + (-0.0) == x for every x, -0.0 included (x + 0.0 turns -0.0 into +0.0).
  """

  def skip(p):
    if not _is_float(p):
      return jnp.zeros_like(p)
    dtype = _full_dtype(p.dtype)
    if jnp.issubdtype(dtype, jnp.complexfloating):
      return jnp.full(p.shape, complex(-0.0, -0.0), dtype)
    return jnp.full(p.shape, -0.0, dtype)

  return jax.tree.map(skip, params)


def _full_view(params: optax.Params, masters: optax.Params) -> optax.Params:
  """The params as the inner optimizer sees them: float32 or wider, floats only."""

  def view(p, m):
    if not _is_masked(m):
      return m
    if not _is_float(p):
      return _MASKED
    return jnp.asarray(p).astype(_full_dtype(p.dtype))

  return jax.tree.map(view, params, masters, is_leaf=_is_masked)


def _states_with_paths(opt_state: Any) -> list[tuple]:
  """`(tree path, state)` of every `mixed_precision` state, in tree order."""
  is_state = lambda x: isinstance(x, MixedPrecisionState)  # noqa: E731
  flat, _ = jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=is_state)
  return [(path, leaf) for path, leaf in flat if is_state(leaf)]


def _mixed_precision_states(opt_state: Any) -> list[MixedPrecisionState]:
  """Every `mixed_precision` state in `opt_state`, in tree order."""
  return [state for _, state in _states_with_paths(opt_state)]


def _find_state(opt_state: Any) -> MixedPrecisionState:
  found = _states_with_paths(opt_state)
  if len(found) != 1:
    raise ValueError(
      "Expected exactly one mixed_precision state in the optimizer state, "
      f"found {len(found)}."
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


def _check_outermost(opt_state: Any, path: tuple) -> None:
  """Refuses a `mixed_precision` state that has neighbours in a chain.

  `optax.chain(clip, mixed_precision(...))` clips the scaled gradients, and
  `optax.chain(mixed_precision(...), other)` changes the exact updates that
  keep params equal to their masters cast down. In the state, the first is a
  tuple (the chain's) holding this state after another transformation's
  state, the second one holding it before one (`optax.named_chain`: a dict
  of states). Nothing in optax lets `update` see its neighbours, so the
  check runs where the state is read: `current_loss_scale`, `train_metrics`,
  the train step. Neighbours that are not optax states (a step counter, a
  dict of arrays kept beside the state) are not transformations.
  """
  node = opt_state
  for key in path:
    child = _child(node, key)
    if child is None:
      return
    in_chain = type(node) is tuple and isinstance(
      key, jax.tree_util.SequenceKey
    )
    in_named = isinstance(node, dict) and isinstance(child, MixedPrecisionState)
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


def current_loss_scale(opt_state: optax.OptState) -> jax.Array:
  """The loss scale to multiply the next loss by (a float32 scalar).

  Finds the `mixed_precision` state wherever it sits: inside `optax.chain`,
  `optax.MultiSteps`, `optax.inject_hyperparams` or any pytree of states.
  """
  scaler = _find_state(opt_state).loss_scaler
  return jnp.asarray(scaler.loss_scale, jnp.float32)


def train_metrics(opt_state: optax.OptState) -> dict[str, jax.Array]:
  """Scalars to log: loss scale, step counts, finiteness and the grad norm.

  Returns:
    A dict with `loss_scale` (float32), `steps` and `skipped_steps` (int32),
    `last_step_finite` (bool), `grad_norm` (float32, the global L2 norm of
    the last step's unscaled gradients) and `skip_streak` (int32, consecutive
    skipped steps). Works under jit; no host sync.
    Leaves held in `nnx.Optimizer`'s variables come back as plain arrays.
  """
  state = _find_state(opt_state)
  return {
    "loss_scale": jnp.asarray(state.loss_scaler.loss_scale, jnp.float32),
    "steps": jnp.asarray(state.steps),
    "skipped_steps": jnp.asarray(state.skipped_steps),
    "last_step_finite": jnp.asarray(state.last_step_finite),
    "grad_norm": jnp.asarray(state.grad_norm),
    "skip_streak": jnp.asarray(state.skip_streak),
  }
