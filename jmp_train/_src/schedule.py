"""Switching precision mid-run without losing optimizer state.

NeMo RL's `adjust_precision` changes a running job's precision (for example
fp16 for the first steps of a fine-tune, then bf16; or bf16-true, then fp32 to
finish). Here the switch is a pure function of the params and the optimizer
state: `adjust_precision(params, opt_state, preset)` returns both converted
to `preset`. The new preset's transformation (the same inner optimizer)
steps them on; so does the old one, whose update is driven by its state
(which leaves carry masters and which loss scale runs), except for the
rounding of params that keep nothing beside them (`RoundToNearest`,
`StochasticRounding`), which is the transformation's.

What is kept, bit for bit: the inner optimizer's state (Adam moments, step
counts, schedules; it always sees float32), the step and skip counters, and
the float32 value of every param (a master where there was one, else the
param itself, upcast exactly). What changes: the params' storage dtype,
which leaves keep float32 masters, and the loss scale (kept when the new
preset uses the same kind with the same settings, else the new preset's).

`PrecisionSchedule({0: "fp16-mixed", 500: "bf16-mixed"})` names the preset
for each step and tells a training loop when to switch.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_train._src import (
  fp8_param,
  leaves,
  optimizer_state,
  state_format,
  state_storage,
  transform,
  zero1,
)
from jmp_train._src import loss_scale as ls_lib
from jmp_train._src import param_update as param_update_lib
from jmp_train._src import presets as presets_lib


def _as_preset(preset: presets_lib.Preset | str) -> presets_lib.Preset:
  if isinstance(preset, presets_lib.Preset):
    return preset
  return presets_lib.get_preset(preset)


def _full_values(params: Any, masters: Any) -> Any:
  """Each float param's float32 value: its master if it has one (rebuilt
  from a remainder, or param + compensation)."""

  def full(p, m):
    if not leaves.is_real_float(p):
      return p
    return param_update_lib.full_value(p, m)

  return jax.tree.map(full, params, masters)


def _reshaped(x: Any, param_shape: tuple) -> bool:
  return tuple(x.shape) != param_shape


def _check_logical(params: Any, state: Any, param_dtypes: Any) -> None:
  """Refuses masters, moments or `param_dtypes` shaped unlike the params:
  above all the padded layout a ZeRO-1 plan gives the optimizer state,
  whose padded masters would become params of the padded shape."""
  structure = jax.tree.structure(params)
  named = jax.tree_util.tree_flatten_with_path(params)[0]
  zero1_hint = (
    "This looks like a ZeRO-1 state as its plan lays it out, padded with "
    "zeros: adjust the logical state, logical = zero1.to_logical(plan, "
    "state), then lay the result out with zero1.place(new_plan, ...)."
  )

  def check(tree: Any, where: str, wrong: Any, hint: str) -> None:
    flat = structure.flatten_up_to(tree)
    for (path, p), x in zip(named, flat, strict=True):
      # Only arrays and ShapeDtypeStructs: np.dtype and jnp.float32 have a
      # `shape` attribute too.
      shaped = isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))
      if shaped and wrong(x, tuple(np.shape(p))):
        name = leaves.keystr(path)
        raise ValueError(
          f"adjust_precision: {(where + name).rstrip('/')} has shape "
          f"{tuple(x.shape)}, and its param {name or '(params)'!r} "
          f"{tuple(np.shape(p))}. {hint}"
        )

  check(
    state.master_params, "opt_state's master_params/", _reshaped, zero1_hint
  )
  # Every subtree of the inner state that has the params' structure (with
  # one bare array as params, only the masters can be compared).
  for path, node in zero1.subtrees_like(structure, state.inner_state):
    where = f"opt_state's inner_state/{leaves.keystr(path)}/"
    check(node, where.replace("//", "/"), zero1.looks_padded, zero1_hint)
  if param_dtypes is not None:
    check(
      param_dtypes,
      "param_dtypes/",
      _reshaped,
      "param_dtypes gives each param's new dtype; where its leaves have "
      "shapes (arrays, ShapeDtypeStructs), they must be the params'.",
    )


def _formats_repr(formats: Any) -> str:
  return repr(dict(formats) if isinstance(formats, Mapping) else formats)


def _stored_kind(x: Any) -> str:
  if isinstance(x, state_format.Scaled):
    return f"{np.dtype(x.values.dtype).name} with scales"
  return np.dtype(x.dtype).name


def _same_settings(a: ls_lib.LossScale, b: ls_lib.LossScale) -> bool:
  """Same kind and settings: a loss scale's settings are its tree's aux data."""
  return jax.tree.structure(a) == jax.tree.structure(b)


def adjust_precision(
  params: optax.Params,
  opt_state: optax.OptState,
  preset: presets_lib.Preset | str,
  *,
  param_dtypes: Any = None,
) -> tuple[optax.Params, optax.OptState]:
  """Converts params and a `mixed_precision` optimizer state to `preset`.

  Call it between two jitted steps (not inside jit: dtypes change, so the
  step retraces once), then wrap the model with `preset.policy`. FP8 state
  lives outside params and is not converted here: a kept delayed history
  whose loss scale changes needs `jmp_train.fp8.rescale_output_grads(
  fp8_meta, new_scale / old_scale)` (`adjust_nnx_precision` does it).

  Args:
    params: the current params (as passed to `tx.update`).
    opt_state: the optimizer state holding one `mixed_precision` state,
      anywhere in a chain.
    preset: the preset (or its name) to switch to.
    param_dtypes: the new storage dtype of each param: a tree like `params`
      of dtypes, arrays or `jax.ShapeDtypeStruct`s, typically
      `jax.eval_shape(new_model.init, key, x)["params"]` for the model
      wrapped with `preset.policy` (so normalization params stay float32).
      None: every float param takes `preset.policy.param_dtype`.

  Returns:
    `(params, opt_state)`: params cast from their float32 values to the new
    dtypes; the state with float32 masters for exactly the float params
    stored below float32 (when `preset.param_update` is `MasterWeights()`),
    the loss scale of `preset` (or the running one, if the settings are the
    same), and everything else unchanged. Integer and boolean leaves pass
    through untouched.

  Raises:
    ValueError: if `param_dtypes` does not have the structure or the shapes
      of `params`, params are stored in FP8 (`jmp_train.fp8.Fp8Param`), or
      the state holds masters shaped unlike their params or moments padded
      as a ZeRO-1 plan lays them out (pass `zero1.to_logical`'s state).
  """
  preset = _as_preset(preset)
  state = optimizer_state.find_state(opt_state)
  fp8_params = [
    leaves.keystr(path)
    for path, x in jax.tree_util.tree_flatten_with_path(
      params, is_leaf=fp8_param.is_fp8_param
    )[0]
    if fp8_param.is_fp8_param(x)
  ]
  if fp8_params:
    raise ValueError(
      f"adjust_precision: params {fp8_params[:3]} are stored in FP8 "
      "(Fp8Param), whose dtype a preset does not set; rebuild the model "
      "with linen.wrap(..., fp8_params=False) and restore its params from "
      "the float32 masters instead."
    )
  # The stored state does not say which formats made it, so it cannot be
  # converted to another preset's formats without guessing.
  if preset.state_formats is not None:
    raise ValueError(
      f"adjust_precision converts params and master weights, not optimizer "
      f"state storage: preset {preset.name!r} has state_formats="
      f"{_formats_repr(preset.state_formats)}. Switch to a preset whose "
      "state_formats is None, or start a new optimizer state with this "
      "preset's transformation."
    )
  view = jax.tree.map(
    lambda p: p if leaves.is_float(p) else leaves.MASKED, params
  )
  for path, x in state_storage.mirroring_leaves(state.inner_state, view):
    if isinstance(x, state_format.Scaled) or np.dtype(x.dtype).itemsize < 4:
      raise ValueError(
        "adjust_precision converts params and master weights, not optimizer "
        f"state storage: the state's leaf inner_state/{path} is stored "
        f"as {_stored_kind(x)}, by state_formats or by the optimizer's own "
        "dtype (optax.adam(mu_dtype=...)); the state does not say which, "
        "and a preset's transformation would read the first as float32. "
        "Start a new optimizer state with the new preset's transformation, "
        "or stay with the current one."
      )
  if param_dtypes is not None and (
    jax.tree.structure(param_dtypes) != jax.tree.structure(params)
  ):
    raise ValueError(
      "adjust_precision: param_dtypes must have the structure of params; "
      f"got {jax.tree.structure(param_dtypes)} for params "
      f"{jax.tree.structure(params)}."
    )
  _check_logical(params, state, param_dtypes)
  full = _full_values(params, state.master_params)
  if param_dtypes is None:
    target = jax.tree.map(
      lambda p: preset.policy.param_dtype if leaves.is_real_float(p) else None,
      params,
    )
  else:
    target = jax.tree.map(
      lambda d: np.dtype(getattr(d, "dtype", d)), param_dtypes
    )

  def new_param(path, x, dtype, old):
    if not leaves.is_real_float(x):
      return x
    name = leaves.keystr(path) or "(params)"
    if not jnp.issubdtype(dtype, jnp.floating):
      raise ValueError(
        f"adjust_precision: float param {name!r} cannot become {dtype}; "
        "param_dtypes must give float dtypes for float params."
      )
    wide = x
    x = x.astype(dtype)
    narrower = jnp.finfo(dtype).maxexp < jnp.finfo(wide.dtype).maxexp
    if (
      narrower  # float16 (bfloat16 has float32's range)
      and not isinstance(x, jax.core.Tracer)
      and bool(jnp.any(jnp.isfinite(wide) & ~jnp.isfinite(x)))
    ):
      raise ValueError(
        f"adjust_precision: param {name!r} holds values beyond "
        f"{np.dtype(dtype).name}'s range (largest |value| "
        f"{float(jnp.max(jnp.abs(wide))):.6g}): "
        f"as {np.dtype(dtype).name} it would be inf. Keep it in a wider "
        "dtype (param_dtypes=) or rescale it first."
      )
    if (
      isinstance(old, jax.Array)
      and not isinstance(old, jax.core.Tracer)
      and not x.sharding.is_equivalent_to(old.sharding, x.ndim)
    ):
      # Where the param was, not where its master was: a ZeRO-1 master is
      # split over the data axis, and a plan made from the new params would
      # read that split as the user's own spec. (Only then: a put would
      # commit an uncommitted param to its device.)
      x = jax.device_put(x, old.sharding)
    return x

  new_params = jax.tree_util.tree_map_with_path(new_param, full, target, params)
  masters = param_update_lib.init_masters(preset.param_update, new_params, full)
  scaler = state.loss_scaler
  if not _same_settings(scaler, preset.loss_scale):
    scaler = preset.loss_scale
  new_state = state._replace(loss_scaler=scaler, master_params=masters)
  is_state = optimizer_state.is_mixed_precision_state
  new_opt_state = jax.tree.map(
    lambda x: new_state if is_state(x) else x, opt_state, is_leaf=is_state
  )
  return new_params, new_opt_state


def adjust_nnx_precision(
  model: Any,
  optimizer: Any,
  preset: presets_lib.Preset | str,
  *,
  overrides: Mapping[type, Any] | None = None,
) -> None:
  """`adjust_precision` for Flax NNX: converts `model` and `optimizer` in place.

  Re-wraps `model` under `preset.policy` and with `preset.fp8`
  (`jmp_train.nnx.wrap`, with the `overrides`, `methods`,
  `respect_dtype_fields` and `fp8_exclude` it was last wrapped with;
  `overrides` replaces those), gives each param its float32 value in its new
  dtype, and replaces `optimizer.opt_state` (an `nnx.Optimizer` over
  `mixed_precision`) with the converted state; `optimizer.step` and its
  transformation are kept (a switch between `RoundToNearest` and
  `StochasticRounding` also needs `optimizer.tx =
  preset.mixed_precision(inner)`: that rule is the transformation's). FP8
  follows the preset: a preset without a recipe turns it off, the recipe
  the model has keeps its FP8 history (the output gradients' moved to the
  new loss scale, `jmp_train.fp8.rescale_output_grads`), another starts
  afresh (a recipe of your own rides in `dataclasses.replace(preset,
  fp8=recipe)`). Call it between steps: a jitted step retraces once.
  """
  from flax import nnx as flax_nnx
  from flax.nnx import filterlib
  from flax.nnx.training.optimizer import to_opt_state

  from jmp_train._src import fp8 as fp8_lib
  from jmp_train._src import fp8_nnx
  from jmp_train._src import nnx as mp_nnx

  if not isinstance(model, flax_nnx.Module) or isinstance(
    model, flax_nnx.Optimizer
  ):
    raise TypeError(
      "adjust_nnx_precision(model, optimizer, preset): model must be the "
      f"nnx.Module the optimizer trains, got {type(model).__name__}."
    )
  if not isinstance(optimizer, flax_nnx.Optimizer):
    raise TypeError(
      "adjust_nnx_precision(model, optimizer, preset): optimizer must be an "
      f"nnx.Optimizer over mixed_precision, got {type(optimizer).__name__}."
    )
  preset = _as_preset(preset)
  wrt = optimizer.wrt
  params = flax_nnx.as_pure(flax_nnx.state(model, wrt))
  opt_state = flax_nnx.as_pure(optimizer.opt_state)
  arguments = mp_nnx.wrap_arguments(model)  # as the model was wrapped
  if overrides is not None:
    arguments["overrides"] = overrides
  # The preset's recipe, not the last wrap's: bf16-fp8-mixed to fp32 must
  # leave FP8, and bf16-mixed to bf16-fp8-mixed enter it.
  if arguments.get("fp8") != preset.fp8:
    meta = fp8_nnx.Fp8Meta(jnp.zeros(()))
    if filterlib.to_predicate(wrt)((), meta):
      # Checked before anything changes: the FP8 state would join or leave
      # the optimizer's params.
      raise ValueError(
        f"adjust_nnx_precision: optimizer.wrt ({wrt!r}) also selects the "
        "FP8 state (jmp_train.nnx.Fp8Meta), which preset "
        f"{preset.name!r} would add, remove or replace (fp8 "
        f"{arguments.get('fp8')!r} -> {preset.fp8!r}); build the "
        "nnx.Optimizer with wrt=nnx.Param."
      )
  keeps_fp8 = preset.fp8 is not None and arguments.get("fp8") == preset.fp8
  arguments["fp8"] = preset.fp8
  mp_nnx.wrap(model, preset.policy, **arguments)  # the new storage dtypes
  dtypes = flax_nnx.as_pure(flax_nnx.state(model, wrt))
  new_params, new_state = adjust_precision(
    params, opt_state, preset, param_dtypes=dtypes
  )
  flax_nnx.update(model, new_params)
  optimizer.opt_state = flax_nnx.data(to_opt_state(new_state))
  if keeps_fp8:
    # The kept output-gradient amaxes were measured under the old loss
    # scale: move them to the new one.
    old, new = (transform.current_loss_scale(s) for s in (opt_state, new_state))
    if bool(new != old):
      meta = flax_nnx.as_pure(flax_nnx.state(model, fp8_nnx.Fp8Meta))
      flax_nnx.update(model, fp8_lib.rescale_output_grads(meta, new / old))


def _step_index(step: Any) -> int:
  """`step` as an int >= 0 (`leaves.check_int`), a concrete integer array
  (a train state's step) included."""
  if not isinstance(step, bool) and getattr(step, "dtype", None) != np.bool_:
    try:
      step = operator.index(step)
    except TypeError:
      pass  # check_int names it
  return leaves.check_int(step, "step")


class PrecisionSchedule:
  """Which preset runs at each step: `{first_step: preset, ...}`.

  Example:
    >>> schedule = PrecisionSchedule({0: "fp16-mixed", 100: "bf16-mixed"})
    >>> schedule.preset_at(99).name, schedule.preset_at(100).name
    ('fp16-mixed', 'bf16-mixed')
    >>> schedule.switch_at(100).name, schedule.switch_at(101)
    ('bf16-mixed', None)
  """

  def __init__(self, steps: Mapping[int, presets_lib.Preset | str]):
    if not steps or 0 not in steps:
      raise ValueError(
        f"PrecisionSchedule needs a preset for step 0, got {dict(steps)!r}."
      )
    checked = {
      leaves.check_int(step, "PrecisionSchedule step"): preset
      for step, preset in steps.items()
    }
    ordered = sorted((s, _as_preset(p)) for s, p in checked.items())
    # A step naming the preset already running switches nothing.
    self._steps = ordered[:1] + [
      (step, after)
      for (_, before), (step, after) in itertools.pairwise(ordered)
      if after != before
    ]

  def preset_at(self, step: int) -> presets_lib.Preset:
    """The preset that runs step `step` (an int >= 0, or an integer array
    such as `TrainState.step`)."""
    step = _step_index(step)
    current = self._steps[0][1]
    for first, preset in self._steps:
      if first <= step:
        current = preset
    return current

  def switch_at(self, step: int) -> presets_lib.Preset | None:
    """The preset to switch to before step `step` (> 0), or None."""
    step = _step_index(step)
    for first, preset in self._steps:
      if first == step and step > 0:
        return preset
    return None
