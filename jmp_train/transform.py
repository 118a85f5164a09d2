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

Integer and other non-float param leaves are hidden from `inner` (like
`optax.masked`) and never change; so are FP8 states (`jmp_train.fp8`), which
the train step advances with `fp8.update`: `mixed_precision` passes them
through bit-identical, keeps no master copy or optimizer state for them and
leaves them out of the finite check and the grad norm.
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
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


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


def _as_loss_scale(loss_scale: Any) -> ls_lib.LossScale:
  if isinstance(
    loss_scale,
    (ls_lib.NoOpLossScale, ls_lib.StaticLossScale, ls_lib.DynamicLossScale),
  ):
    return loss_scale
  if loss_scale is None:
    return ls_lib.NoOpLossScale()
  if isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
    return ls_lib.StaticLossScale(loss_scale)
  raise TypeError(
    "loss_scale must be a NoOpLossScale, StaticLossScale, DynamicLossScale, "
    f"a positive number (static scale) or None, got {loss_scale!r}."
  )


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
      positive number meaning a static scale.
    master_weights: keep float32 master copies of the float params stored
      below float32. None (the default) or True: yes, for exactly those
      params (float32 params are their own master); False: never, and
      low-precision params are updated by rounding `param + update`.
    stochastic_rounding: with `master_weights=False`, round `param + update`
      of bfloat16/float16 params stochastically (`cast_stochastic`) instead
      of to nearest, so updates below half an ulp survive on average. The
      random bits come from `seed`, the step number and the leaf, so a run
      (and a resumed run) is reproducible.
    seed: the seed of the stochastic rounding.

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is a
    `MixedPrecisionState`.

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
  if isinstance(seed, bool) or not isinstance(seed, int):
    raise TypeError(f"seed must be an int, got {seed!r}.")
  inner = optax.with_extra_args_support(inner)

  def init(params: optax.Params) -> MixedPrecisionState:
    params = _trainable(params)

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
    _check_same_structure(grads, params)
    full_params, grads, params = params, _trainable(grads), _trainable(params)
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

      def new_master(m, u):
        return m if _is_masked(m) else (m + u).astype(jnp.float32)

      masters = jax.tree.map(
        new_master, masters, inner_updates, is_leaf=_is_masked
      )

      # Master leaves emit the float32 delta cast(new_master) - param, which
      # optax.apply_updates turns into cast(new_master) exactly; so do
      # stochastically rounded leaves, with their rounded value.
      def out_update(p, m, u, key):
        if _is_masked(p):
          return _MASKED
        if not _is_float(p):
          return jnp.zeros_like(p)
        if not _is_masked(m):
          new = m.astype(p.dtype)
        elif stochastic_rounding and _needs_master(p):
          new = rounding.cast_stochastic(
            p.astype(jnp.float32) + u, p.dtype, key
          )
        else:
          return u.astype(_full_dtype(p.dtype))
        return new.astype(jnp.float32) - p.astype(jnp.float32)

      updates = jax.tree.map(
        out_update,
        params,
        masters,
        inner_updates,
        _leaf_keys(params, state.steps),
        is_leaf=_is_masked,
      )
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
    return jnp.sum(jnp.where(jnp.isfinite(g), jnp.square(g), jnp.nan))

  total = sum(sq_sum(g).astype(jnp.float32) for g in leaves)
  return total, ~jnp.isnan(total)


def _skip_updates(params: optax.Params) -> optax.Params:
  """Updates that leave params bit-identical: -0.0 for floats, 0 otherwise.

  x + (-0.0) == x for every x, -0.0 included (x + 0.0 turns -0.0 into +0.0).
  """

  def skip(p):
    if not _is_float(p):
      return jnp.zeros_like(p)
    return jnp.full(p.shape, -0.0, _full_dtype(p.dtype))

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


def _mixed_precision_states(opt_state: Any) -> list[MixedPrecisionState]:
  """Every `mixed_precision` state in `opt_state`, in tree order."""
  is_state = lambda x: isinstance(x, MixedPrecisionState)  # noqa: E731
  return [
    s for s in jax.tree.leaves(opt_state, is_leaf=is_state) if is_state(s)
  ]


def _find_state(opt_state: Any) -> MixedPrecisionState:
  found = _mixed_precision_states(opt_state)
  if len(found) != 1:
    raise ValueError(
      "Expected exactly one mixed_precision state in the optimizer state, "
      f"found {len(found)}."
    )
  return found[0]


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
