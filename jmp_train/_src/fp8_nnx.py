"""FP8 matmuls for flax.nnx: the `Fp8Meta` variable, its matmul and update.

`nnx.wrap(model, policy, fp8=recipe)` gives each `nnx.Linear`,
`nnx.LinearGeneral` and `nnx.Einsum` it converts an attribute `fp8_meta`: an
`Fp8Meta` variable holding one `fp8.Fp8DotState` (a stacked one, with a
leading axis per stacked layer, for layers built by `nnx.vmap`). The layer's
class is swapped for a subclass in which its `dot_general` (`einsum_op` for
Einsum) reads as `fp8_dot.fp8_dot_general` with that state; Flax's own
`__call__` runs unchanged. `Fp8Meta` is not an `nnx.Param`, so
`nnx.Optimizer(model, tx, wrt=nnx.Param)` never sees it.

This step's amaxes leave through the backward pass as the gradient of the
state's zero-valued `amax` entry (`fp8.py`). A layer called twice must get
the max of its calls' amaxes, while JAX adds the cotangents of a value used
twice. So each call passes the entry through a "max chain", an identity with
two outputs whose backward pass takes their max:

    this, next = max_chain(amax)      # forward: both equal amax (zeros)
    y = fp8_dot_general(..., amax=this)
    fp8_meta.value = state.replace(amax=(next,))    # the value just read

    backward: d amax = max(d this, d next)

The second call reads `next`, so its amaxes reach the first call's `next`,
and the input's gradient is max(call 1, call 2, ...) (NaN kept), under
`nnx.grad`, `nnx.jit`, `nnx.scan`, `nnx.remat` and `jax.grad` of a function
that merges the model from its state. The write stores back the state it
read, with a fresh (still zero) entry: a call never changes the scales or
the history, so no forward pass can overwrite a newer state with an older
one. Only `update_fp8` (or a train step's `fp8.update`) changes them.

Calls on concrete values (eager, outside any transformation) write nothing.
Two limits, as with linen's FP8 modules under `nn.scan`/`nn.vmap`: where
NNX refuses the write (a layer closed over by a plain `jax.jit` or a
`jax.lax.scan` body raises `TraceContextError`, caught) the call runs
unchained, so a layer called several times there adds those calls'
amaxes (so does a layer an `autocast` function closes over); and under
`vmap` or `scan` with the layer's state not mapped (the model broadcast,
`nnx.vmap(..., in_axes=None)`, or an RNN cell broadcast into `nnx.scan`
over time), JAX sums the amaxes over the mapped axis. Both only overstate
an amax (a smaller delayed scale, never an overflow). Layers stacked by
`nnx.vmap` and run by `nnx.scan` map their state, one per layer, and are
exact; a cell carried through `nnx.scan` (`nnx.Carry`) chains its calls
and is exact too.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.errors
import flax.nnx as nnx
import jax
import jax.numpy as jnp
from jax import lax

from jmp_train._src import fp8 as fp8_lib
from jmp_train._src import fp8_dot
from jmp_train._src.fp8_dot import fp8_dot_general
from jmp_train._src.fp8_recipe import Recipe

ATTRIBUTE = "fp8_meta"


class Fp8Meta(nnx.Variable):
  """The FP8 state (`jmp_train.fp8.Fp8DotState`) of one NNX matmul layer.

  An `nnx.Variable` but not an `nnx.Param`: filter it with `Fp8Meta`
  (`nnx.state(model, Fp8Meta)`, `nnx.DiffState(0, (nnx.Param, Fp8Meta))`).
  """


@jax.custom_vjp
def _max_chain(amax: jax.Array) -> tuple[jax.Array, jax.Array]:
  return amax, amax


def _max_chain_fwd(amax):
  return (amax, amax), None


def _max_chain_bwd(_, cotangents):
  this, later = cotangents
  return (jnp.maximum(this, later),)  # amaxes are >= 0; a NaN stays NaN


_max_chain.defvjp(_max_chain_fwd, _max_chain_bwd)


def _this_call(meta: Fp8Meta) -> tuple[fp8_lib.Fp8DotState, jax.Array]:
  """The state and the `amax` entry one call of the layer uses (see top)."""
  state = meta.get_value()
  (amax,) = state.amax
  if not isinstance(amax, jax.core.Tracer):
    return state, amax  # nothing can differentiate a concrete value
  this, later = _max_chain(amax)
  try:
    meta.set_value(state.replace(amax=(later,)))
  except flax.errors.TraceContextError:
    pass  # closed over by a JAX transformation: unchained (see top)
  return state, this


def _dot_general(
  meta: Fp8Meta,
  lhs,
  rhs,
  dimension_numbers,
  precision=None,
  preferred_element_type=None,
  **kwargs,
):
  """`lax.dot_general`'s signature, in FP8 with `meta`'s state."""
  del precision, kwargs  # FP8 has one precision; out_sharding is unused
  state, amax = _this_call(meta)
  return fp8_dot_general(
    jnp.asarray(lhs),
    jnp.asarray(rhs),
    dimension_numbers,
    scale=state.scale,
    amax=amax,
    recipe=state.recipe,
    preferred_element_type=preferred_element_type,
  )


def _einsum(
  meta: Fp8Meta,
  subscripts,
  lhs,
  rhs,
  precision=None,
  preferred_element_type=None,
  **kwargs,
):
  """`jnp.einsum`'s signature for two operands, the input and the kernel,
  in FP8 with `meta`'s state (`fp8_dot.einsum` keeps the kernel the rhs)."""
  del precision, kwargs  # as _dot_general
  dot = functools.partial(
    _dot_general, meta, preferred_element_type=preferred_element_type
  )
  return fp8_dot.einsum(subscripts, jnp.asarray(lhs), jnp.asarray(rhs), dot)


# The attribute each layer does its matmul with, and its default: a layer
# whose attribute is not the default keeps its own (as linen's wrap keeps a
# Dense given a dot_general).
_HOOKS = (
  (nnx.Linear, "dot_general", lax.dot_general, _dot_general),
  (nnx.LinearGeneral, "dot_general", None, _dot_general),
  (nnx.Einsum, "einsum_op", jnp.einsum, _einsum),
)


def _hook(module: nnx.Module) -> tuple | None:
  """The hook of `module` (a row of `_HOOKS`), or None if it has no free one.

  Read from the instance's attributes as built, under any class `wrap`
  swapped in.
  """
  attributes = vars(module)
  for cls, name, default, op in _HOOKS:
    if not isinstance(module, cls) or attributes.get(name) is not default:
      continue
    if attributes.get("dot_general_cls") is not None:
      return None  # LinearGeneral(dot_general_cls=...)
    return cls, name, default, op
  return None


def _fp8_property(name: str, default: Any, op: Any) -> property:
  """Attribute `name` of an FP8 layer: `op` bound to its `Fp8Meta`, unless
  the attribute was set to something else since (that one is used)."""

  def get(self):
    own = vars(self).get(name)
    if own is not default:
      return own
    return functools.partial(op, getattr(self, ATTRIBUTE))

  def set_(self, value):
    vars(self)[name] = value

  return property(get, set_)


def fp8_members(module: nnx.Module) -> dict[str, Any] | None:
  """The class members that run `module`'s matmul in FP8, or None if it is
  not a Linear, LinearGeneral or Einsum with Flax's own matmul."""
  hook = _hook(module)
  if hook is None:
    return None
  _, name, default, op = hook
  return {name: _fp8_property(name, default, op)}


def _kernel_ndim(module: nnx.Module) -> int:
  """The kernel's rank as the layer builds it, stacked axes not counted."""
  if isinstance(module, nnx.Einsum):
    return len(module.kernel_shape)
  if isinstance(module, nnx.LinearGeneral):
    return (
      len(module.batch_axis)
      + len(module.in_features)
      + len(module.out_features)
    )
  return 2


def _initial_state(module: nnx.Module, recipe: Recipe) -> fp8_lib.Fp8DotState:
  """`init_state(recipe)`, with the kernel's stacked leading axes (a layer
  built under `nnx.vmap` for `nnx.scan`), one state per stacked layer."""
  shape = module.kernel.get_value().shape
  lead = shape[: max(len(shape) - _kernel_ndim(module), 0)]
  return jax.tree.map(
    lambda x: jnp.broadcast_to(x, lead + x.shape),
    fp8_lib.init_state(recipe),
  )


def install(module: nnx.Module, recipe: Recipe, path: str) -> None:
  """Gives `module` (an FP8 layer) its `Fp8Meta` for `recipe`.

  A state it has for the same recipe and shapes is kept (a wrap with
  another policy keeps the FP8 history); any other is replaced.
  """
  meta = getattr(module, ATTRIBUTE, None)
  if meta is not None and not isinstance(meta, Fp8Meta):
    raise ValueError(
      f"fp8: module {path or type(module).__name__!r} has an attribute "
      f"{ATTRIBUTE!r} ({meta!r}) that is not an Fp8Meta; rename it to run "
      "that layer in FP8, or keep it out with fp8_exclude."
    )
  state = _initial_state(module, recipe)
  if meta is not None and _same_layout(meta.get_value(), state):
    return
  setattr(module, ATTRIBUTE, Fp8Meta(state))


def _same_layout(a: fp8_lib.Fp8DotState, b: fp8_lib.Fp8DotState) -> bool:
  """Same recipe, same leaves, same shapes."""
  return jax.tree.structure(a) == jax.tree.structure(b) and all(
    x.shape == y.shape
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  )


def remove(module: nnx.Module) -> None:
  """Drops the `Fp8Meta` a previous `wrap(fp8=...)` gave `module`, if any."""
  if isinstance(getattr(module, ATTRIBUTE, None), Fp8Meta):
    delattr(module, ATTRIBUTE)


def _paths(state: Any) -> list[str]:
  return ["/".join(map(str, path)) for path, _ in nnx.to_flat_state(state)]


def update_fp8(
  model: nnx.Module, grads: Any, *, finite: jax.typing.ArrayLike | None = None
) -> None:
  """Advances the FP8 state of `model`'s matmuls by one step, in place.

  `fp8.update` applied to the model's `Fp8Meta` variables, once per train
  step: `grads` holds this step's amaxes as the gradients of those
  variables. Nothing changes when `finite` is False (a skipped step: pass
  `train_metrics(optimizer.opt_state)["last_step_finite"]`) or when an amax
  is not finite. `nnx.Optimizer(..., wrt=nnx.Param)` leaves the variables
  alone, so the two updates do not race.

  Args:
    model: a model wrapped with `jmp_train.nnx.wrap(..., fp8=...)`.
    grads: the gradients of the loss from `nnx.grad(loss_fn,
      argnums=nnx.DiffState(0, (nnx.Param, Fp8Meta)))(model, ...)` (Param
      gradients in it are ignored), or such gradients of several
      micro-batches or devices combined by max.
    finite: whether the step was applied; None means yes.

  Example:
    >>> import jax.numpy as jnp, flax.nnx as nnx, optax, jmp_train
    >>> from jmp_train.nnx import Fp8Meta
    >>> model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    >>> model = jmp_train.nnx.wrap(model, "float32", fp8="delayed")
    >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    >>> x = jnp.array([[1.0, -4.0]])
    >>> def loss_fn(model):
    ...   return jnp.sum(model(x))
    >>> diff = nnx.DiffState(0, (nnx.Param, Fp8Meta))
    >>> grads = nnx.grad(loss_fn, argnums=diff)(model)
    >>> _ = optimizer.update(model, grads)  # the params
    >>> update_fp8(model, grads)  # FP8 scales: input amax 4, output grad 1
    >>> model.fp8_meta.get_value().scale[jnp.array([0, 2])]
    Array([  112., 57344.], dtype=float32)
  """
  if not isinstance(model, nnx.Module):
    raise TypeError(f"update_fp8 expects a flax.nnx Module, got {model!r}.")
  states = nnx.state(model, Fp8Meta)
  fp8_grads = nnx.state(grads, Fp8Meta)
  if _paths(states) != _paths(fp8_grads):
    raise ValueError(
      "update_fp8: grads must hold the gradients of the model's Fp8Meta "
      f"variables {_paths(states)}; got {_paths(fp8_grads) or 'none'} in "
      f"{type(grads).__name__}. Differentiate with nnx.grad(loss_fn, "
      "argnums=nnx.DiffState(0, (nnx.Param, Fp8Meta)))."
    )
  if not states:
    return
  new = fp8_lib.update(
    nnx.as_pure(states), nnx.as_pure(fp8_grads), finite=finite
  )
  nnx.update(model, new)
