"""Loss scales: no-op, static and dynamic, plus finiteness helpers.

A drop-in superset of jmp 0.0.4's loss scales. Each loss scale is a frozen
dataclass and a pytree: its evolving values (the scale, the growth counter
and, with `hysteresis > 1`, the hysteresis budget) are leaves; every other
field is a setting, carried as static data in the tree definition, so it
survives flattening, `jax.jit`, `lax.scan` and checkpoints.

The scale is always a normal float32 whose reciprocal is normal too: it lies
in [2**-126, 2**126]. Above 2**126, `1 / scale` is subnormal and XLA flushes
it to 0, so every unscaled gradient would be 0; below 2**-126 the scale itself
is subnormal or 0. Settings and concrete scales outside that range are refused
when a loss scale is built, and the dynamic scale's growth is capped (and its
backoff floored) so it never leaves the range.

Validation happens when a user builds a loss scale (the constructor, the
`dynamic_loss_scale` factory, `dataclasses.replace`), never when JAX rebuilds
one from its leaves: unflattening bypasses `__init__`, so tracers, shardings,
`jax.ShapeDtypeStruct`s and `None` placeholders pass through `jax.tree.map`,
jit, `jax.eval_shape` and checkpoints unchecked.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import sys
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jmp_train._src import leaves

T = TypeVar("T")

# The scale's range: a normal float32 whose reciprocal is a normal float32.
MIN_LOSS_SCALE = 2.0**-126
MAX_LOSS_SCALE = 2.0**126
_RANGE = "[2**-126, 2**126]"
_WHY_RANGE = (
  "about 1.2e-38 to 8.5e37: the scale and 1/scale must both be normal "
  "float32s, since XLA flushes subnormals to 0"
)
_INT32_MAX = 2**31 - 1


class _NotBooleanScalarError(ValueError, AssertionError):
  """A predicate that is not a boolean scalar.

  A ValueError, and an AssertionError as jmp raises (`assert ...,
  "expected boolean scalar"`), so code catching either keeps working.
  """


def _boolean_scalar(pred: Any, where: str, name: str) -> jax.Array:
  pred = jnp.asarray(pred)
  if pred.ndim != 0 or pred.dtype != jnp.bool_:
    raise _NotBooleanScalarError(
      f"{where} expected boolean scalar {name}, got "
      f"{pred.dtype}{list(pred.shape)}."
    )
  return pred


# Pytree plumbing: one registration for the three classes.


def _new(cls: type[T], **fields: Any) -> T:
  """An instance with these fields, built without `__init__` (no checks).

  For values JAX rebuilds (unflattening) and values this module computes or
  has already validated (`adjust`, the factory).
  """
  obj = object.__new__(cls)
  obj.__dict__.update(fields)  # what object.__setattr__ writes, at once
  return obj


# Where an instance keeps its flattened tree's aux data (leaf names and
# settings), computed on its first flattening: each jit call flattens its
# loss scale, and rebuilding the aux costs about 1.5 us a call in Python (4
# us with the unflattening, `benchmarks/host_cost.py`). The settings of an
# instance never change (frozen), and `adjust` copies them with the cache.
_AUX = "_tree_aux"


def _register(cls: type, leaf_names: Callable[[Any], tuple[str, ...]]):
  """Registers the dataclass `cls` as a pytree.

  The fields that `leaf_names(value)` names are its leaves; every other field
  is a setting (a hashable Python value) carried as static aux data, so no
  setting can be dropped. Unflattening bypasses `__init__` (see `_new`).
  """

  fields = [f.name for f in dataclasses.fields(cls)]

  def flatten(ls):
    # What every jit call runs on its arguments and results: no keys.
    d = ls.__dict__
    aux = d.get(_AUX)
    if aux is None:
      names = leaf_names(ls)
      aux = (names, tuple((k, d[k]) for k in fields if k not in names))
      d[_AUX] = aux
    return [d[k] for k in aux[0]], aux

  def flatten_with_keys(ls):
    leaves, aux = flatten(ls)
    keys = map(jax.tree_util.GetAttrKey, aux[0])
    return tuple(zip(keys, leaves, strict=True)), aux

  def unflatten(aux, children):
    names, settings = aux
    obj = _new(cls)  # filled here: no dict of keyword arguments to build
    d = obj.__dict__
    d.update(settings)
    d.update(zip(names, children, strict=True))
    d[_AUX] = aux
    return obj

  def getstate(ls):  # a pickle carries the fields, not the cache
    return {k: v for k, v in ls.__dict__.items() if k != _AUX}

  cls.__getstate__ = getstate
  jax.tree_util.register_pytree_with_keys(
    cls, flatten_with_keys, unflatten, flatten
  )


# Validation of user input. `name` is the argument's name in the caller's
# vocabulary (jmp's `period` or torch.amp's `growth_interval`).


def _f32(value: float) -> float:
  """`value` rounded to float32 (inf beyond its range), as adjust computes."""
  with np.errstate(over="ignore", under="ignore"):
    return float(np.float32(value))


def _host_scalar(value: Any, name: str, kind: str = "a number") -> np.ndarray:
  """A concrete real scalar as a 0-d NumPy array, or raises.

  Accepts Python, NumPy and (non-traced) JAX real scalars; rejects booleans
  (the message says `name` must be `kind`), strings, traced values and
  anything with a shape.
  """
  if isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be {kind}, got {value!r}.")
  if isinstance(value, jax.core.Tracer):
    raise TypeError(
      f"{name} is a setting (a static field) and must be a concrete number, "
      f"not a traced value; got {value!r}."
    )
  if isinstance(value, jax.Array) and not value.is_fully_addressable:
    value = value.addressable_data(0)
  host = None
  if isinstance(value, int) and not -(2**63) <= value < 2**63:
    # Beyond int64 (2**126 is a valid scale): as a float, inf if too large.
    try:
      host = np.asarray(float(value))
    except OverflowError:
      host = np.asarray(math.copysign(math.inf, value))
  elif not isinstance(value, (str, bytes)) and value is not None:
    try:
      host = np.asarray(value)
    except (TypeError, ValueError):
      pass
  if host is None or host.dtype.kind not in "iuf":
    raise TypeError(f"{name} must be a real number, got {value!r}.")
  if host.ndim:
    raise ValueError(
      f"{name} must be a scalar, got an array of shape {host.shape}."
    )
  return host


def _show(value: Any, host: np.ndarray) -> str:
  """How a user's value reads in a message: `1e-46`, `float32(inf)`."""
  if isinstance(value, numbers.Number):
    return repr(value)
  return f"{host.dtype}({host.item()!r})"


def _warn_if_integer(value: Any, name: str) -> None:
  """jmp's warning for an integer array (a Python int is simply converted)."""
  dtype = getattr(value, "dtype", None)
  if dtype is None or np.dtype(dtype).kind not in "iu":
    return
  # Attribute the warning to the user's line: the first frame outside this
  # module (the dataclass-generated __init__ runs in this module's globals).
  frame, level = sys._getframe(1), 2
  while frame is not None and frame.f_globals.get("__name__") == __name__:
    frame, level = frame.f_back, level + 1
  # jmp's words; jmp then crashes in adjust, we convert.
  warnings.warn(
    f"Expected floating type for {name}, got {dtype}; converted to float32.",
    stacklevel=level,
  )


def _integer_setting(value: Any, name: str, low: int, what: str) -> int:
  """An integer setting in [low, 2**31 - 1]; 5.0 counts as 5 (jmp passes it)."""
  host = _host_scalar(value, name, f"an integer ({what})")
  number = float(host)
  if not number.is_integer() or not low <= number <= _INT32_MAX:
    raise ValueError(
      f"{name} must be an integer in [{low}, 2**31 - 1] ({what}), got "
      f"{_show(value, host)}."
    )
  return int(number)


def _factor(value: Any, name: str, low: float, high: float) -> float:
  """A multiplier whose float32 rounding lies strictly inside (low, high)."""
  host = _host_scalar(value, name)
  number = float(host)
  # adjust multiplies in float32: 1 + 1e-9 would round to 1 and never grow.
  if not (math.isfinite(_f32(number)) and low < _f32(number) < high):
    bounds = f"> {low:g}" if high == math.inf else f"in ({low:g}, {high:g})"
    raise ValueError(
      f"{name} must be {bounds} in float32, got {_show(value, host)} "
      "(adjust multiplies in float32, where 1 + 1e-9 is 1)."
    )
  return number


def _scale_setting(value: Any, name: str, zero_ok: str | None = None) -> float:
  """A scale given as a setting, as a Python float in the scale's range.

  `zero_ok=None` refuses 0; a string lets 0 through and, if not empty, says
  in the message what 0 means ("" for StaticLossScale: jmp builds it at 0,
  and its scale/unscale refuse).
  """
  host = _host_scalar(value, name)
  number = float(host)
  if zero_ok is not None and number == 0:
    return 0.0
  if not (
    math.isfinite(number) and MIN_LOSS_SCALE <= _f32(number) <= MAX_LOSS_SCALE
  ):
    zero = f", or be 0 ({zero_ok})" if zero_ok else ""
    raise ValueError(
      f"{name} must lie in {_RANGE} ({_WHY_RANGE}){zero}, got "
      f"{_show(value, host)}."
    )
  return number


def _scale_leaf(value: Any, name: str) -> tuple[Any, float | None]:
  """The dynamic scale as a float32 scalar leaf, range-checked if concrete.

  Returns `(leaf, value)`: the leaf is a float32 NumPy scalar array for a
  Python or NumPy number, the same JAX array (cast to float32 if needed) for
  a JAX array; `value` is the concrete number, or None for a traced value,
  which is checked for shape and dtype only.
  """
  if isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be a float, got {value!r}.")
  number = None
  if not isinstance(value, jax.core.Tracer):
    _warn_if_integer(value, name)
    number = _scale_setting(value, name)
    if not isinstance(value, jax.Array):
      return np.asarray(number, np.float32), number
  elif value.shape != ():
    raise ValueError(
      f"{name} must be a scalar, got a traced array of shape {value.shape}."
    )
  elif value.dtype.kind not in "iuf":
    raise TypeError(f"{name} must be a real number, got dtype {value.dtype}.")
  else:
    _warn_if_integer(value, name)
  if value.dtype != jnp.float32:
    value = value.astype(jnp.float32)
  return value, number


def _count_leaf(value: Any, name: str, high: int, what: str) -> Any:
  """An int32 scalar counter in [0, high] (checked when concrete)."""
  traced = isinstance(value, jax.core.Tracer)
  host = value if traced else _host_scalar(value, name, "an integer")
  if host.dtype.kind not in "iu":
    raise TypeError(f"{name} must be an integer ({what}), got {value!r}.")
  if host.shape != ():
    raise ValueError(f"{name} must be a scalar, got shape {host.shape}.")
  if not traced and not 0 <= int(host) <= high:
    raise ValueError(
      f"{name} must lie in [0, {high}] ({what}), got {_show(value, host)}."
    )
  if isinstance(value, (jax.Array, jax.core.Tracer)):
    return value if value.dtype == jnp.int32 else value.astype(jnp.int32)
  return np.asarray(int(host), np.int32)


def _check_dynamic(
  fields: dict[str, Any], names: dict[str, str]
) -> dict[str, Any]:
  """A DynamicLossScale's fields, validated and converted.

  `names` renames fields in messages to the caller's vocabulary (torch.amp's
  `growth_interval` for `period`); fields it lacks keep their names.
  """
  f, n = dict(fields), {k: names.get(k, k) for k in fields}
  f["period"] = _integer_setting(
    f["period"], n["period"], 1, "finite steps per growth"
  )
  f["factor"] = _factor(f["factor"], n["factor"], 1.0, math.inf)
  if f["backoff_factor"] is not None:
    f["backoff_factor"] = _factor(
      f["backoff_factor"], n["backoff_factor"], 0.0, 1.0
    )
  # jmp's min_loss_scale may be 0: the floor is then 2**-126.
  _warn_if_integer(f["min_loss_scale"], n["min_loss_scale"])
  low = f["min_loss_scale"] = _scale_setting(
    f["min_loss_scale"], n["min_loss_scale"], "the floor is then 2**-126"
  )
  high = f["max_loss_scale"]
  if isinstance(high, numbers.Real) and high == math.inf:
    high = f["max_loss_scale"] = None
  if high is not None:
    high = f["max_loss_scale"] = _scale_setting(high, n["max_loss_scale"])
    if _f32(high) < _f32(low):
      raise ValueError(
        f"{n['max_loss_scale']} ({high}) must be >= {n['min_loss_scale']} "
        f"({low})."
      )
  f["hysteresis"] = _integer_setting(
    f["hysteresis"],
    n["hysteresis"],
    1,
    "overflows tolerated before backing off",
  )
  f["consecutive_hysteresis"] = leaves.check_bool(
    f["consecutive_hysteresis"], n["consecutive_hysteresis"]
  )
  f["loss_scale"], value = _scale_leaf(f["loss_scale"], n["loss_scale"])
  if value is not None:
    value = _f32(value)
    if value < _f32(low):
      raise ValueError(
        f"{n['loss_scale']} ({value}) must be >= {n['min_loss_scale']} "
        f"({low}); lower {n['min_loss_scale']} to start below it."
      )
    if high is not None and value > _f32(high):
      raise ValueError(
        f"{n['loss_scale']} ({value}) must be <= {n['max_loss_scale']} "
        f"({high})."
      )
  f["counter"] = _count_leaf(
    f["counter"],
    n["counter"],
    f["period"] - 1,
    f"finite steps since the last change, below {n['period']}",
  )
  tracker, budget = f["hysteresis_tracker"], f["hysteresis"]
  if budget == 1 and tracker is not None:
    raise ValueError(
      "hysteresis_tracker is only tracked with hysteresis > 1 (with 1, "
      f"every overflow backs off); got {tracker!r}: pass None."
    )
  if budget > 1 and tracker is None:
    f["hysteresis_tracker"] = np.asarray(budget, np.int32)
  elif budget > 1:
    f["hysteresis_tracker"] = _count_leaf(
      tracker,
      n["hysteresis_tracker"],
      budget,
      "overflows left before backing off",
    )
  return f


def _reciprocal(scale: Any) -> Any:
  """1 / scale rounded to float32, as torch and jmp unscale (by multiplying).

  Multiplying by the reciprocal is what XLA does with a division by a
  constant anyway; writing it out keeps jit and eager results identical. For
  the power-of-two scales of dynamic scaling it is exact, and for any scale
  in [2**-126, 2**126] it is a normal float32 (never flushed to 0).
  """
  return jnp.float32(1.0) / jnp.asarray(scale, jnp.float32)


def _python_number_as_array(x: Any) -> Any:
  """A Python float or complex leaf as an array (jmp scales and checks them:
  `scale(1.0)` is the loss scale); any other leaf as it is."""
  return jnp.asarray(x) if type(x) in (float, complex) else x


def _scale_leaves(tree: T, factor: Any) -> T:
  """The float and complex leaves of `tree` times `factor`, in >= float32."""
  factor = jnp.asarray(factor, jnp.float32)

  def apply(x):
    x = _python_number_as_array(x)
    if not leaves.is_inexact(x):
      return x
    x = leaves.widen(x)
    return x * factor.astype(x.dtype)

  return jax.tree.map(apply, tree)


class _ScalesByValue:
  """`scale`/`unscale` by `self.loss_scale`, in at least float32."""

  loss_scale: Any

  def scale(self, tree: T) -> T:
    """Multiplies the float and complex leaves of `tree` by the scale."""
    return _scale_leaves(tree, self.loss_scale)

  def unscale(self, tree: T) -> T:
    """Multiplies the float and complex leaves of `tree` by 1 / scale."""
    return _scale_leaves(tree, _reciprocal(self.loss_scale))


@dataclasses.dataclass(frozen=True)
class NoOpLossScale:
  """No-op loss scale: scale and unscale return their input unchanged."""

  @property
  def loss_scale(self):
    return 1

  def scale(self, tree: T) -> T:
    return tree

  def unscale(self, tree: T) -> T:
    return tree

  def adjust(self, grads_finite: jax.typing.ArrayLike) -> NoOpLossScale:
    del grads_finite
    return self


@dataclasses.dataclass(frozen=True)
class StaticLossScale(_ScalesByValue):
  """Scales and unscales by a fixed constant in [2**-126, 2**126].

  The constant is a static field (a Python float), so this loss scale has no
  leaves, like jmp's. Float and complex leaves are scaled in at least float32
  (complex64), so a float16 loss times 2**16 does not overflow; integer and
  boolean leaves pass through.

  `StaticLossScale(0)` builds, as in jmp, but `scale` and `unscale` raise:
  a zero scale would zero every gradient.

  Args:
    loss_scale: a concrete real number (Python, NumPy or JAX scalar) in
      [2**-126, 2**126], or 0.

  Raises:
    ValueError: for a scale outside that range (negative, NaN, inf, 1e39,
      1e-46) or an array that is not a scalar.
    TypeError: for a boolean, a string or a traced value.

  Example:
    >>> import jax.numpy as jnp
    >>> ls = StaticLossScale(128.0)
    >>> ls.scale(jnp.float32(0.5))
    Array(64., dtype=float32)
    >>> ls.unscale(jnp.float16(64.0))
    Array(0.5, dtype=float32)
  """

  loss_scale: float

  def __post_init__(self):
    # Runs when a user builds one; JAX's unflatten bypasses __init__.
    scale = _scale_setting(self.loss_scale, "loss_scale", zero_ok="")
    object.__setattr__(self, "loss_scale", scale)

  def _check_nonzero(self) -> None:
    if self.loss_scale == 0:
      raise ValueError(
        "StaticLossScale(0) cannot scale or unscale: a zero scale zeroes "
        f"every gradient. Use a scale in {_RANGE} or NoOpLossScale()."
      )

  def scale(self, tree: T) -> T:
    """Multiplies the float and complex leaves of `tree` by the scale."""
    self._check_nonzero()
    return super().scale(tree)

  def unscale(self, tree: T) -> T:
    """Multiplies the float and complex leaves of `tree` by 1 / scale."""
    self._check_nonzero()
    return super().unscale(tree)

  def adjust(self, grads_finite: jax.typing.ArrayLike) -> StaticLossScale:
    del grads_finite
    return self


@dataclasses.dataclass(frozen=True)
class DynamicLossScale(_ScalesByValue):
  """Dynamic loss scale with growth, backoff, hysteresis and min/max.

  It looks for the largest scale that keeps gradients finite. With the default
  `hysteresis=1` the trajectory is torch.amp.GradScaler's; with `hysteresis>1`
  it is Megatron-LM's DynamicGradScaler's. Unlike both, the scale stays a
  normal float32 whose reciprocal is normal (growth is capped at 2**126,
  backoff floored at 2**-126), so unscaling never flushes gradients to 0::

      # period=growth_interval, factor=growth_factor
      ceiling = min(max_loss_scale or inf, 2**126)
      floor = max(min_loss_scale, 2**-126)
      if grads_finite:
        counter += 1
        if consecutive_hysteresis:
          hysteresis_tracker = hysteresis
        if counter == period:
          counter = 0
          hysteresis_tracker = hysteresis
          loss_scale = min(loss_scale * factor, ceiling)
      else:
        counter = 0
        hysteresis_tracker = max(hysteresis_tracker - 1, 0)
        if hysteresis_tracker == 0:
          loss_scale = max(loss_scale * backoff_factor, floor)

  Products are taken in float32. `backoff_factor=None` (jmp's convention)
  backs off by dividing by `factor`. With `hysteresis=1` the budget is always
  spent by one overflow, so it is not tracked: `hysteresis_tracker` is None
  and the leaves are `loss_scale` (float32) and `counter` (int32), as in jmp;
  with `hysteresis>1`, `hysteresis_tracker` (int32) is a third leaf. The
  other fields are settings (static). Prefer the `dynamic_loss_scale`
  factory, which speaks torch.amp's vocabulary; `dataclasses.replace`
  adjusts a built one (and validates the result).

  Args:
    loss_scale: the initial scale: a real scalar (Python number or 0-d
      array) in [2**-126, 2**126], and in [min_loss_scale, max_loss_scale].
      Stored as float32; an integer array is converted with jmp's warning
      "Expected floating type for loss_scale".
    counter: finite steps since the last growth or overflow; an integer in
      [0, period).
    period: finite steps between growths; an integer >= 1 (`5.0` counts).
    factor: growth factor; > 1 in float32.
    min_loss_scale: floor of the scale: 0 (jmp's "no floor": the floor is
      then 2**-126) or a value in [2**-126, 2**126].
    backoff_factor: multiplies the scale on an overflow; in (0, 1), or None
      to divide by `factor`.
    max_loss_scale: ceiling of the scale, in [2**-126, 2**126] and >=
      `min_loss_scale`, or None (or inf) for 2**126.
    hysteresis: overflows tolerated before backing off; an integer >= 1.
    hysteresis_tracker: overflows left before backing off, in
      [0, hysteresis]; None for a full budget (required with hysteresis 1).
    consecutive_hysteresis: True to refill the budget on every finite step.

  Raises:
    ValueError: for a value outside the ranges above, or a non-scalar.
    TypeError: for a wrongly typed value (a string, a boolean number, a
      non-boolean `consecutive_hysteresis`, a traced setting).

  Example:
    >>> import jax.numpy as jnp
    >>> ls = DynamicLossScale(jnp.float32(2**15), period=2, factor=2)
    >>> ls = ls.adjust(jnp.bool_(True)).adjust(jnp.bool_(True))
    >>> float(ls.loss_scale)
    65536.0
    >>> float(ls.adjust(jnp.bool_(False)).loss_scale)
    32768.0
  """

  loss_scale: jax.typing.ArrayLike
  counter: jax.typing.ArrayLike = 0
  period: int = 2000
  factor: float = 2
  min_loss_scale: float = 1
  _: dataclasses.KW_ONLY
  backoff_factor: float | None = None
  max_loss_scale: float | None = None
  hysteresis: int = 1
  hysteresis_tracker: jax.typing.ArrayLike | None = None
  consecutive_hysteresis: bool = False

  def __post_init__(self):
    # Runs when a user builds one; JAX's unflatten bypasses __init__.
    for name, value in _check_dynamic(vars(self), {}).items():
      object.__setattr__(self, name, value)

  def adjust(self, grads_finite: jax.typing.ArrayLike) -> DynamicLossScale:
    """Returns the next state, given whether this step's grads were finite."""
    grads_finite = _boolean_scalar(
      grads_finite, "adjust", "grads_finite (e.g. all_finite(grads))"
    )
    scale = jnp.asarray(self.loss_scale, jnp.float32)
    counter = jnp.asarray(self.counter, jnp.int32)
    ceiling = min(self.max_loss_scale or MAX_LOSS_SCALE, MAX_LOSS_SCALE)
    floor = max(self.min_loss_scale, MIN_LOSS_SCALE)

    # Finite step: count, and grow once `period` finite steps have passed.
    grow = counter + 1 >= self.period
    grown = jnp.minimum(scale * self.factor, ceiling)
    ok_scale = jnp.where(grow, grown, scale)
    ok_counter = jnp.where(grow, 0, counter + 1)

    # Non-finite step: spend hysteresis, then back off down to the floor.
    if self.backoff_factor is None:
      backed = scale / self.factor
    else:
      backed = scale * self.backoff_factor
    backed = jnp.maximum(backed, floor)
    if self.hysteresis == 1:
      bad_scale, tracker = backed, None
    else:
      old = jnp.asarray(self.hysteresis_tracker, jnp.int32)
      spent = jnp.maximum(old - 1, 0)
      bad_scale = jnp.where(spent == 0, backed, scale)
      refill = grow | self.consecutive_hysteresis
      ok_tracker = jnp.where(refill, jnp.int32(self.hysteresis), old)
      tracker = jnp.where(grads_finite, ok_tracker, spent)

    return _new(
      type(self),
      **{
        **vars(self),
        "loss_scale": jnp.where(grads_finite, ok_scale, bad_scale),
        "counter": jnp.where(grads_finite, ok_counter, 0),
        "hysteresis_tracker": tracker,
      },
    )


def _dynamic_leaves(ls: DynamicLossScale) -> tuple[str, ...]:
  # With hysteresis 1 the budget is not tracked: jmp's two leaves.
  if ls.hysteresis == 1:
    return ("loss_scale", "counter")
  return ("loss_scale", "counter", "hysteresis_tracker")


_register(NoOpLossScale, lambda ls: ())
_register(StaticLossScale, lambda ls: ())
_register(DynamicLossScale, _dynamic_leaves)

LossScale = NoOpLossScale | StaticLossScale | DynamicLossScale


def from_jmp(loss_scale: Any) -> Any:
  """A loss scale of the `jmp` package itself as ours, anything else as is.

  Code half-way through `import jmp_train as jmp` passes jmp's objects
  along; they have the same fields and, with jmp's defaults, the same rule
  (backoff by 1 / factor, no hysteresis, no ceiling).
  """
  jmp = sys.modules.get("jmp")  # not imported: nothing can be jmp's
  if jmp is None:
    return loss_scale
  if isinstance(loss_scale, jmp.NoOpLossScale):
    return NoOpLossScale()
  if isinstance(loss_scale, jmp.StaticLossScale):
    return StaticLossScale(loss_scale.loss_scale)
  if isinstance(loss_scale, jmp.DynamicLossScale):
    return DynamicLossScale(
      loss_scale.loss_scale,
      counter=loss_scale.counter,
      period=loss_scale.period,
      factor=loss_scale.factor,
      min_loss_scale=loss_scale.min_loss_scale,
    )
  return loss_scale


def dynamic_loss_scale(
  init_scale: float = 2.0**15,
  growth_factor: float = 2.0,
  backoff_factor: float = 0.5,
  growth_interval: int = 2000,
  hysteresis: int = 1,
  min_scale: float = 1.0,
  max_scale: float | None = None,
  consecutive_hysteresis: bool = False,
) -> DynamicLossScale:
  """Creates a `DynamicLossScale` in the vocabulary of torch.amp and Megatron.

  `hysteresis=1` reproduces torch.amp.GradScaler (with a floor at
  `min_scale`; torch has none). `hysteresis=2, min_scale=1,
  growth_interval=1000` reproduces Megatron-LM's DynamicGradScaler, where the
  hysteresis budget counts overflows since the last growth.
  `consecutive_hysteresis=True` refills the budget on every finite step
  instead (DeepSpeed's option, apex/NeMo's behaviour).

  Args:
    init_scale: the first scale; in [2**-126, 2**126] and in
      [min_scale, max_scale].
    growth_factor: multiplies the scale after `growth_interval` finite steps
      in a row; > 1 in float32.
    backoff_factor: multiplies the scale on an overflow once the hysteresis
      budget is spent; in (0, 1) in float32.
    growth_interval: finite steps between growths; an integer >= 1.
    hysteresis: overflows tolerated before backing off; an integer >= 1.
    min_scale: floor of the scale; in [2**-126, 2**126], or 0 for no floor
      but float32's (2**-126, as torch.amp has none).
    max_scale: ceiling of the scale, in [2**-126, 2**126], or None for
      2**126 (the largest scale whose reciprocal is a normal float32).
    consecutive_hysteresis: True to refill the hysteresis budget on each
      finite step; a bool.

  Returns:
    A `DynamicLossScale`.

  Raises:
    ValueError: for settings outside the ranges above; the message names
      the argument and the value.
    TypeError: for settings of the wrong type (a string, a non-bool
      `consecutive_hysteresis`).

  Example:
    >>> ls = dynamic_loss_scale(init_scale=2.0**16, growth_interval=1000)
    >>> float(ls.loss_scale), ls.period, ls.backoff_factor
    (65536.0, 1000, 0.5)
  """
  fields = dict(
    loss_scale=init_scale,
    counter=0,
    period=growth_interval,
    factor=growth_factor,
    min_loss_scale=min_scale,
    backoff_factor=backoff_factor,
    max_loss_scale=max_scale,
    hysteresis=hysteresis,
    hysteresis_tracker=None,
    consecutive_hysteresis=consecutive_hysteresis,
  )
  torch_names = dict(
    loss_scale="init_scale",
    period="growth_interval",
    factor="growth_factor",
    min_loss_scale="min_scale",
    max_loss_scale="max_scale",
  )
  return _new(DynamicLossScale, **_check_dynamic(fields, torch_names))


def all_finite(tree: Any) -> jax.Array:
  """Returns a boolean scalar: whether every float and complex leaf is finite.

  Python floats count, as in jmp.

  One global predicate: under jit with sharded leaves the reduction spans all
  shards. A complex leaf is finite when both parts are; integer and boolean
  leaves are finite by definition.

  Example:
    >>> import jax.numpy as jnp
    >>> bool(all_finite({"a": jnp.ones(3), "b": jnp.array([1.0, jnp.inf])}))
    False
  """
  found = [
    x
    for x in map(_python_number_as_array, jax.tree.leaves(tree))
    if leaves.is_inexact(x)
  ]
  if not found:
    return jnp.array(True)
  return jnp.stack([jnp.isfinite(x).all() for x in found]).all()


def select_tree(pred: jax.typing.ArrayLike, a: T, b: T) -> T:
  """Selects pytree `a` where `pred` is true, else `b`, leaf by leaf.

  Args:
    pred: a boolean scalar.
    a: a pytree.
    b: a pytree with the structure, shapes and dtypes of `a`.

  Returns:
    `a` if `pred` else `b`, without a host round trip.

  Raises:
    ValueError: if `pred` is not a boolean scalar (the error is also an
      `AssertionError`, which jmp raises) or the trees differ.
  """
  pred = _boolean_scalar(pred, "select_tree", "pred")
  tree_a, tree_b = jax.tree.structure(a), jax.tree.structure(b)
  if tree_a != tree_b:
    raise ValueError(
      f"select_tree needs trees of one structure, got {tree_a} and {tree_b}."
    )
  return jax.tree.map(lambda x, y: jax.lax.select(pred, x, y), a, b)
