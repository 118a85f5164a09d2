"""The optax transformation: loss-scale handling, skipping and master weights.

`mixed_precision(inner)` wraps any optax optimizer. Its `update` receives the
gradients of the *scaled* loss, in the params' dtype, and

1. casts them to float32 (at least) and unscales them by the loss scale that
   was used for the backward pass;
2. checks, as one global predicate, that every gradient is finite;
3. on a finite step runs `inner` on the float32 gradients and float32 params
   (the master weights where params are stored below float32), then updates
   each low-precision param as `param_update` says (`param_update.py`);
4. on a non-finite step emits updates that leave params bit-identical and
   keeps the inner state and master weights bit-identical;
5. adjusts the loss scale and counts steps, skipped steps and the grad norm.

Float and complex params are trained (complex ones as optax trains them).
Integer and boolean param leaves are hidden from `inner` (like
`optax.masked`) and never change. A weight stored in FP8 (`fp8.Fp8Param`)
keeps a float32 master and is cast again from it after each step (see
`param_update.apply`). Bare float8 arrays and non-array objects are
refused, as are gradients whose shape is not their param's. FP8 metadata
(`jmp_train.fp8`) is not a param: keep it out of the params tree and
advance it with `fp8.update`, as the train step does.

`mixed_precision` must be the outermost transformation; the order is
checked where the state is read (`optimizer_state.find_state`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_train._src import finite_check, fp8_param, leaves, state_storage
from jmp_train._src import loss_scale as ls_lib
from jmp_train._src import param_update as param_update_lib
from jmp_train._src.optimizer_state import MixedPrecisionState, find_state

# The default rule: a frozen value, safe to share between calls.
_MASTER_WEIGHTS = param_update_lib.MasterWeights()

_LOSS_SCALE_KINDS = (
  "a NoOpLossScale, StaticLossScale or DynamicLossScale, a positive number "
  "(a static scale) or None"
)


def as_loss_scale(loss_scale: Any) -> ls_lib.LossScale:
  """The loss scale `mixed_precision` starts from, validated.

  None is `NoOpLossScale()`; a concrete real number is a `StaticLossScale`;
  a loss scale of the `jmp` package becomes ours.
  """
  if loss_scale is None:
    return ls_lib.NoOpLossScale()
  loss_scale = ls_lib.from_jmp(loss_scale)
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
      if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
        # optax.inject_hyperparams, run eagerly, stores a number in the
        # params' dtype: 1001.0 arrives as bfloat16 1000.
        raise ValueError(
          f"loss_scale={loss_scale!r} is a {dtype.name} number, which may "
          "already be rounded (optax.inject_hyperparams stores numbers in "
          "the params' dtype: 1001.0 becomes bfloat16 1000). Pass a Python "
          "number or a float32 one, with static_args=('loss_scale',) under "
          "inject_hyperparams, or a loss-scale object."
        )
      return as_loss_scale(ls_lib.StaticLossScale(float(loss_scale)))
  raise TypeError(
    f"loss_scale must be {_LOSS_SCALE_KINDS}, got {loss_scale!r}."
  )


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
    where = f"mixed_precision: {what} leaf {leaves.keystr(path)!r}"
    if fp8_param.is_fp8_param(x):
      if what == "gradients" and not (
        leaves.is_float(x.data) and not leaves.is_float8(x.data)
      ):
        raise TypeError(
          f"{where} is the gradient of an Fp8Param, with dtype "
          f"{x.data.dtype}: the weight's gradient did not come back "
          "(JAX's gradient of its integer bits is empty). Differentiate "
          "with respect to jmp_train.fp8.with_grad_slots(params) and pass "
          "jmp_train.fp8.grads_of(grads); the train step does both."
        )
      return x
    if not (hasattr(x, "dtype") and hasattr(x, "shape")):
      raise TypeError(
        f"{where} is {x!r}; expected arrays (float, complex, integer or "
        "boolean) or Python numbers."
      )
    if leaves.is_float8(x):
      raise TypeError(
        f"{where} has dtype {x.dtype}; float8 arrays are not trainable "
        "params (they carry no scale, and no optimizer updates them). Keep "
        "the weight in bfloat16 or float32 and run its matmuls in FP8 with "
        "jmp_train.fp8, or store it as a jmp_train.fp8.Fp8Param "
        "(fp8.cast_param; linen.wrap(..., fp8_params=True)), which carries "
        "its scale."
      )
    return x

  return jax.tree_util.tree_map_with_path(
    check, tree, is_leaf=fp8_param.is_fp8_param
  )


def _check_grads(grads: Any, params: Any) -> None:
  """Refuses gradients whose tree or shapes are not the params'."""
  grads_def, params_def = jax.tree.structure(grads), jax.tree.structure(params)
  if grads_def != params_def:
    raise ValueError(
      "mixed_precision: gradients and params must have the same tree "
      f"structure; got gradients {grads_def} and params {params_def}."
    )

  def check(path, g, p):
    # A gradient of another shape would broadcast silently.
    float_like = leaves.is_float(p) or fp8_param.is_fp8_param(p)
    if float_like and tuple(np.shape(g)) != tuple(np.shape(p)):
      raise ValueError(
        f"mixed_precision: the gradient of {leaves.keystr(path)!r} has shape "
        f"{tuple(np.shape(g))}, its param {tuple(np.shape(p))}; gradients "
        "must have their params' shapes."
      )

  jax.tree_util.tree_map_with_path(
    check, grads, params, is_leaf=fp8_param.is_fp8_param
  )


def mixed_precision(
  inner: optax.GradientTransformation,
  *,
  loss_scale: ls_lib.LossScale | float | None = None,
  param_update: param_update_lib.ParamUpdate = _MASTER_WEIGHTS,
  state_formats: Any = None,
) -> optax.GradientTransformationExtraArgs:
  """Wraps an optax optimizer for mixed-precision training.

  Multiply the loss by `current_loss_scale(opt_state)` before differentiating
  and pass the resulting gradients (in the params' dtype) to `update`; apply
  the updates with `optax.apply_updates`. Place this transformation last: it
  must see the raw gradients, and its updates are exact only when applied
  unchanged. Clipping, weight decay and schedules belong in `inner`, which
  sees unscaled float32 gradients and float32 params; so do optax's wrappers
  (`mixed_precision(optax.MultiSteps(...))` accumulates gradients, skipping
  an overflowing micro-step).

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
    param_update: how float params stored below float32 are updated:
      `MasterWeights()` (the default: float32 master copies, Megatron's main
      params, NxD's `use_master_weights`), `RoundToNearest()` (no masters)
      or `StochasticRounding(seed)` (no masters, rounded stochastically).
      `ParamRemainders()` (bfloat16 params: the master's low 16 bits,
      Megatron's `store_param_remainders`) and `KahanSummation()` (a
      compensation buffer in the param's dtype) keep 2 bytes instead of 4.
      float32 params are their own masters under all of them.
    state_formats: how the inner optimizer's state fields that hold one
      value per param are stored: None (as the optimizer makes them,
      float32), one `jmp_train.state_format` format for its moments (Adam's
      `mu` and `nu`, momentum's `trace`: `state_storage.MOMENT_FIELDS`), or
      a dict from field name to format, e.g. `{"mu": FP8(), "nu":
      BFloat16()}`. `inner` computes in float32: stored values are expanded
      before its update and compressed after it; a skipped step keeps the
      stored bits.

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is a
    `MixedPrecisionState`.

  Raises:
    TypeError: for an `inner` that is not a transformation, a loss scale or
      `param_update` of the wrong kind; in `init`/`update`, for float8 or
      non-array param leaves and for a state that is not a
      `MixedPrecisionState`.
    ValueError: for a zero static scale, and in `update` for gradients whose
      structure or shapes are not the params'.

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
    hint = ""
    if callable(getattr(inner, "mixed_precision", None)):  # a Preset
      hint = " (a preset builds its own: preset.mixed_precision(inner))"
    raise TypeError(
      "inner must be an optax.GradientTransformation (e.g. optax.adam(1e-3)), "
      f"got {inner!r}{hint}."
    )
  scaler0 = as_loss_scale(loss_scale)
  rule = param_update_lib.check(param_update)
  formats = state_storage.check_formats(state_formats)
  inner = optax.with_extra_args_support(inner)

  def formats_of(native, view):
    return state_storage.leaf_formats(formats, native, view)

  def init(params: optax.Params) -> MixedPrecisionState:
    params = _checked_leaves(params, "params")
    masters = param_update_lib.init_masters(rule, params)
    view = _full_view(params, masters)
    steps = jnp.zeros([], jnp.int32)
    if formats is None:
      inner_state = inner.init(view)
    else:
      # Stored leaves replace arrays; inside an nnx.Param (nnx.Optimizer's
      # init) nnx would later refill the Param with a dict of them.
      view = leaves.without_variables(view)
      native = inner.init(view)
      tree = formats_of(native, view)
      inner_state = state_storage.compress_state(tree, native, None)
    return MixedPrecisionState(
      loss_scaler=scaler0,
      master_params=masters,
      inner_state=inner_state,
      steps=steps,
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
    _check_grads(grads, params)
    params = _checked_leaves(params, "params")
    grads = _checked_leaves(grads, "gradients")
    scaler = state.loss_scaler

    # Unscaled gradients in float32 (at least); non-float leaves are masked.
    def to_full(g, p):
      if fp8_param.is_fp8_param(p):
        return leaves.widen(g.data)
      if not leaves.is_float(p):
        return leaves.MASKED
      return jnp.asarray(g).astype(leaves.full_dtype(p.dtype))

    widened = jax.tree.map(
      to_full, grads, params, is_leaf=fp8_param.is_fp8_param
    )
    grads_full = scaler.unscale(widened)
    sq_norm, finite = finite_check.sq_norm_and_finite(widened, scaler.unscale)

    # Stochastic rounding's random values, for the params and for the stored
    # state (None each where nothing rounds stochastically), drawn before the
    # conditional: XLA:GPU turns a conditional into selects unless a branch
    # draws random numbers; then it branches on the host and copies every
    # output. (XLA:CPU keeps it either way, and holds the drawn values at the
    # step's peak: 2 B a stochastically rounded bf16 value.)
    # A few draws for many leaves where each device holds them whole, one
    # per leaf where GSPMD may split them: the same bits.
    grouped = all(
      map(
        finite_check.whole_on_each_device,
        jax.tree.leaves((params, state.inner_state)),
      )
    )
    noise = param_update_lib.leaf_noise(
      rule, params, state.master_params, state.steps, grouped
    )
    state_noise = None
    if formats is not None:  # the stored state's layout, from shapes alone
      view = jax.eval_shape(_full_view, params, state.master_params)
      native = jax.eval_shape(inner.init, view)
      tree = formats_of(native, view)
      state_noise = state_storage.state_noise(
        tree, native, state.steps, grouped, state.inner_state
      )

    def apply_inner(operand):
      grads_full, inner_state, masters, params, (noise, state_noise) = operand
      view = _full_view(params, masters)
      if formats is None:
        inner_updates, inner_state = inner.update(
          grads_full, inner_state, view, **extra_args
        )
      else:
        expanded = state_storage.expand_state(tree, inner_state, native)
        inner_updates, new = inner.update(
          grads_full, expanded, view, **extra_args
        )
        inner_state = state_storage.compress_state(
          tree, new, state_noise, previous=(inner_state, expanded)
        )
      # An (update, master) pair per leaf, then the two trees.
      pairs = jax.tree.map(
        functools.partial(param_update_lib.apply, rule),
        params,
        masters,
        inner_updates,
        noise,
        is_leaf=fp8_param.is_fp8_param,
      )
      is_pair = lambda x: isinstance(x, param_update_lib.LeafUpdate)  # noqa: E731
      updates = jax.tree.map(lambda x: x.update, pairs, is_leaf=is_pair)
      masters = jax.tree.map(lambda x: x.master, pairs, is_leaf=is_pair)
      return updates, inner_state, masters

    def skip(operand):
      _, inner_state, masters, params, _ = operand
      return _skip_updates(params), inner_state, masters

    # A conditional, not a select: on XLA:CPU the inner update runs only on
    # finite steps and writes its state in place (measured in
    # benchmarks/overhead.py). XLA:GPU turns it into selects, as no branch
    # draws random numbers (`noise` and `state_noise` are drawn above).
    updates, inner_state, masters = jax.lax.cond(
      finite,
      apply_inner,
      skip,
      (
        grads_full,
        state.inner_state,
        state.master_params,
        params,
        (noise, state_noise),
      ),
    )
    new_state = MixedPrecisionState(
      loss_scaler=scaler.adjust(finite),
      master_params=masters,
      inner_state=inner_state,
      steps=state.steps + 1,
      skipped_steps=state.skipped_steps + jnp.where(finite, 0, 1),
      last_step_finite=_in_place_of(state.last_step_finite, finite),
      grad_norm=_in_place_of(state.grad_norm, jnp.sqrt(sq_norm)),
      skip_streak=jnp.where(finite, 0, state.skip_streak + 1),
    )
    return updates, new_state

  return optax.GradientTransformationExtraArgs(init, update)


def _in_place_of(old: jax.Array, new: jax.Array) -> jax.Array:
  """`new`, computed so that it reads `old`.

  A state leaf that the update overwrites without reading is dropped from
  the inputs of a jitted step, so a donated state has no buffer to give
  that leaf's output: it gets a fresh buffer each step, and on a GPU the
  step's CUDA graph is updated with the new address (`command_buffer::update`,
  51 us a call in the H200's trace of `benchmarks/overhead.py
  --update-only`). XLA folds the select away; the input stays, and the
  output is written into its buffer. (Where the two differ in shape or
  dtype, a state from elsewhere, `new` as it is: no promotion.)
  """
  if jnp.shape(old) != jnp.shape(new) or jnp.result_type(old) != new.dtype:
    return new
  return jnp.where(True, new, old)


def _skip_updates(params: optax.Params) -> optax.Params:
  """Updates that leave params bit-identical: -0.0 for floats, 0 otherwise.

  x + (-0.0) == x for every x, -0.0 included (x + 0.0 turns -0.0 into +0.0).
  """

  def skip(p):
    if fp8_param.is_fp8_param(p):
      return fp8_param.no_change(p)
    if not leaves.is_float(p):
      return jnp.zeros_like(p)
    # `_like`: laid out as `p` where its layout is in its type (Explicit).
    dtype = leaves.full_dtype(p.dtype)
    if jnp.issubdtype(dtype, jnp.complexfloating):
      return jnp.full_like(p, complex(-0.0, -0.0), dtype)
    return jnp.full_like(p, -0.0, dtype)

  return jax.tree.map(skip, params, is_leaf=fp8_param.is_fp8_param)


def _full_view(params: optax.Params, masters: optax.Params) -> optax.Params:
  """The params as the inner optimizer sees them: float32 or wider, floats
  only (a master, rebuilt from its remainder, or param + compensation)."""

  def view(p, m):
    if fp8_param.is_fp8_param(p):
      return m
    if not leaves.is_float(p):
      return leaves.MASKED
    return param_update_lib.full_value(p, m)

  return jax.tree.map(view, params, masters, is_leaf=fp8_param.is_fp8_param)


def current_loss_scale(opt_state: optax.OptState) -> jax.Array:
  """The loss scale to multiply the next loss by (a float32 scalar).

  Finds the `mixed_precision` state wherever it sits: in a one-element
  `optax.chain`, `optax.inject_hyperparams`, an `nnx.Optimizer` or any pytree
  of states. Raises ValueError where it is not outermost (a neighbour in a
  chain; `optax.MultiSteps`, `masked`, `partition`, `conditionally_transform`,
  `lookahead` or `apply_if_finite` around it): the message says where it goes.
  """
  scaler = find_state(opt_state).loss_scaler
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
  state = find_state(opt_state)
  return {
    "loss_scale": jnp.asarray(state.loss_scaler.loss_scale, jnp.float32),
    "steps": jnp.asarray(state.steps),
    "skipped_steps": jnp.asarray(state.skipped_steps),
    "last_step_finite": jnp.asarray(state.last_step_finite),
    "grad_norm": jnp.asarray(state.grad_norm),
    "skip_streak": jnp.asarray(state.skip_streak),
  }
