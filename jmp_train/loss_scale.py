"""Loss scales: no-op, static and dynamic, plus finiteness helpers.

A drop-in superset of jmp 0.0.4's loss scales. Each loss scale is a pytree
whose settings are static fields (plain Python numbers in the tree
definition), so they survive flattening, `jax.jit`, `lax.scan` and
checkpoints; the evolving values (scale, growth counter, hysteresis budget)
are leaves. Unlike jmp, `min_loss_scale` is not lost under jit, integer
scales are rejected up front instead of crashing `adjust`, and the scale is
never allowed to grow to infinity.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

T = TypeVar("T")


def _is_float_array(x: Any) -> bool:
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def _reciprocal(scale: Any) -> Any:
  """1 / scale rounded to float32, as torch and jmp unscale (by multiplying).

  Multiplying by the reciprocal is what XLA does with a division by a
  constant anyway; writing it out keeps jit and eager results identical. For
  the power-of-two scales of dynamic scaling it is exact.
  """
  return jnp.float32(1.0) / jnp.asarray(scale, jnp.float32)


def _scale_leaves(tree: T, fn) -> T:
  """Applies `fn` to the floating leaves, computing in at least float32."""

  def apply(x):
    if not _is_float_array(x):
      return x
    return fn(x.astype(jnp.promote_types(x.dtype, jnp.float32)))

  return jax.tree.map(apply, tree)


def _positive_number(value: Any, name: str, allow_none: bool = False):
  """Returns a setting as a finite positive Python float, or raises.

  Settings are concrete real numbers (Python, NumPy or JAX scalars); booleans,
  strings and traced values are rejected. With `allow_none`, None and +inf
  mean "no bound".
  """
  if allow_none and (value is None or value == math.inf):
    return None
  if isinstance(value, (bool, np.bool_, str)) or (
    hasattr(value, "dtype") and value.dtype == np.bool_
  ):
    raise TypeError(f"{name} must be a positive number, got {value!r}.")
  try:
    number = float(value)
  except TypeError:
    raise TypeError(
      f"{name} must be a concrete positive number (a setting, not a traced "
      f"or array value), got {value!r}."
    ) from None
  if not math.isfinite(number) or number <= 0:
    raise ValueError(f"{name} must be finite and > 0, got {value!r}.")
  return number


def _check_scale_leaf(value: Any, name: str):
  """Normalises a scale leaf to float32; objects without a dtype pass as is.

  Pytree unflattening calls the constructor with tracers, abstract values and
  arbitrary objects (e.g. shardings). So: Python and NumPy numbers become
  float32 NumPy scalars (checked > 0 and finite, with no device sync); arrays
  of another float dtype are cast to float32; anything with a non-float dtype
  is rejected; anything else is left alone.
  """
  if isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be a float, got {value!r}.")
  if isinstance(value, numbers.Real) and not isinstance(value, np.ndarray):
    number = float(value)
    if not math.isfinite(number) or number <= 0:
      raise ValueError(f"{name} must be finite and > 0, got {value!r}.")
    return np.asarray(number, np.float32)
  if hasattr(value, "dtype"):
    if not jnp.issubdtype(value.dtype, jnp.floating):
      raise TypeError(
        f"{name} must be a floating array (gradients are multiplied by its "
        f"reciprocal), got dtype {value.dtype}; write e.g. jnp.float32(2**15)."
      )
    if value.dtype != np.float32 and hasattr(value, "astype"):
      # float16 cannot hold 2**16; float32 is the scale's dtype everywhere.
      return value.astype(np.float32)
  return value


class _ScalesByValue:
  """`scale`/`unscale` by `self.loss_scale`, in at least float32."""

  loss_scale: Any

  def scale(self, tree: T) -> T:
    scale = jnp.asarray(self.loss_scale, jnp.float32)
    return _scale_leaves(tree, lambda x: x * scale.astype(x.dtype))

  def unscale(self, tree: T) -> T:
    inv = _reciprocal(self.loss_scale)
    return _scale_leaves(tree, lambda x: x * inv.astype(x.dtype))


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
  """Scales and unscales by a fixed positive constant.

  The constant is a static field (a Python float), so this loss scale has no
  leaves, like jmp's. Floating leaves are scaled in at least float32, so a
  float16 loss times 2**16 does not overflow; other leaves pass through.

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
    object.__setattr__(
      self, "loss_scale", _positive_number(self.loss_scale, "loss_scale")
    )

  def adjust(self, grads_finite: jax.typing.ArrayLike) -> StaticLossScale:
    del grads_finite
    return self


@dataclasses.dataclass(frozen=True)
class DynamicLossScale(_ScalesByValue):
  """Dynamic loss scale with growth, backoff, hysteresis and min/max.

  It looks for the largest scale that keeps gradients finite. With the default
  `hysteresis=1` the trajectory is torch.amp.GradScaler's; with `hysteresis>1`
  it is Megatron-LM's DynamicGradScaler's, except that the scale never
  becomes infinite (growth that would overflow is refused) and
  `max_loss_scale` caps it::

      # period=growth_interval, factor=growth_factor
      if grads_finite:
        counter += 1
        if consecutive_hysteresis:
          hysteresis_tracker = hysteresis
        if counter == period:
          counter = 0
          hysteresis_tracker = hysteresis
          grown = min(loss_scale * factor, max_loss_scale)
          loss_scale = grown if isfinite(grown) else loss_scale
      else:
        counter = 0
        hysteresis_tracker -= 1
        if hysteresis_tracker <= 0:
          loss_scale = max(loss_scale * backoff_factor, min_loss_scale)

  `backoff_factor=None` (jmp's convention) backs off by dividing by `factor`.
  Settings are static fields; `loss_scale`, `counter` and
  `hysteresis_tracker` are the leaves (float32, int32, int32). Prefer the
  `dynamic_loss_scale` factory, which speaks torch.amp's vocabulary.

  Example:
    >>> import jax.numpy as jnp
    >>> ls = DynamicLossScale(jnp.float32(2**15), period=2, factor=2)
    >>> ls = ls.adjust(jnp.bool_(True)).adjust(jnp.bool_(True))
    >>> float(ls.loss_scale)
    65536.0
    >>> float(ls.adjust(jnp.bool_(False)).loss_scale)
    32768.0
  """

  loss_scale: Any
  counter: Any = dataclasses.field(
    default_factory=lambda: np.zeros([], np.int32)
  )
  period: int = 2000
  factor: float = 2
  min_loss_scale: float = 1.0
  _: dataclasses.KW_ONLY
  backoff_factor: float | None = None
  max_loss_scale: float | None = None
  hysteresis: int = 1
  hysteresis_tracker: Any = None
  consecutive_hysteresis: bool = False

  def __hash__(self):
    # The leaves may be arrays (unhashable); the settings are enough, and
    # equal instances have equal settings. jit hashes trees of shardings
    # shaped like this state, so the class must be hashable.
    return hash(
      (
        type(self),
        self.period,
        self.factor,
        self.min_loss_scale,
        self.backoff_factor,
        self.max_loss_scale,
        self.hysteresis,
        self.consecutive_hysteresis,
      )
    )

  def __post_init__(self):
    set_ = lambda k, v: object.__setattr__(self, k, v)
    set_("loss_scale", _check_scale_leaf(self.loss_scale, "loss_scale"))
    if isinstance(self.counter, numbers.Integral):
      set_("counter", np.asarray(self.counter, np.int32))
    if (
      isinstance(self.period, bool)
      or not isinstance(self.period, numbers.Integral)
      or self.period < 1
    ):
      raise ValueError(
        f"period (growth_interval) must be an integer >= 1, got "
        f"{self.period!r}."
      )
    set_("period", int(self.period))
    factor = _positive_number(self.factor, "factor (growth_factor)")
    if factor <= 1:
      raise ValueError(
        f"factor (growth_factor) must be > 1, got {self.factor!r}."
      )
    set_("factor", factor)
    if self.backoff_factor is not None:
      backoff = _positive_number(self.backoff_factor, "backoff_factor")
      if backoff >= 1:
        raise ValueError(
          f"backoff_factor must lie in (0, 1), got {self.backoff_factor!r}."
        )
      set_("backoff_factor", backoff)
    min_scale = _positive_number(self.min_loss_scale, "min_loss_scale")
    set_("min_loss_scale", min_scale)
    max_scale = _positive_number(
      self.max_loss_scale, "max_loss_scale", allow_none=True
    )
    if max_scale is not None and max_scale < min_scale:
      raise ValueError(
        f"max_loss_scale ({max_scale}) must be >= min_loss_scale ({min_scale})."
      )
    set_("max_loss_scale", max_scale)
    if (
      isinstance(self.hysteresis, bool)
      or not isinstance(self.hysteresis, numbers.Integral)
      or self.hysteresis < 1
    ):
      raise ValueError(
        f"hysteresis must be an integer >= 1, got {self.hysteresis!r}."
      )
    set_("hysteresis", int(self.hysteresis))
    set_("consecutive_hysteresis", bool(self.consecutive_hysteresis))
    # jax rebuilds this class with None (or sharding) leaves when it maps
    # over a tree of states (jit's out_layouts): keep such a None a None.
    if self.hysteresis_tracker is None and self.loss_scale is not None:
      set_("hysteresis_tracker", np.asarray(self.hysteresis, np.int32))
    elif isinstance(self.hysteresis_tracker, numbers.Integral):
      set_("hysteresis_tracker", np.asarray(self.hysteresis_tracker, np.int32))
    if isinstance(self.loss_scale, np.ndarray):
      # Compare as adjust() does: in float32.
      value = np.float32(self.loss_scale)
      if not np.isfinite(value) or value <= 0:
        raise ValueError(f"loss_scale must be finite and > 0, got {value}.")
      if value < np.float32(min_scale):
        raise ValueError(
          f"loss_scale ({value}) must be >= min_loss_scale ({min_scale})."
        )
      if max_scale is not None and value > np.float32(max_scale):
        raise ValueError(
          f"loss_scale ({value}) must be <= max_loss_scale ({max_scale})."
        )

  def adjust(self, grads_finite: jax.typing.ArrayLike) -> DynamicLossScale:
    """Returns the next state, given whether this step's grads were finite."""
    grads_finite = jnp.asarray(grads_finite)
    if grads_finite.ndim != 0 or grads_finite.dtype != jnp.bool_:
      raise ValueError(
        "adjust expects a boolean scalar (e.g. all_finite(grads)), got "
        f"{grads_finite.dtype}{list(grads_finite.shape)}."
      )
    scale = jnp.asarray(self.loss_scale, jnp.float32)
    counter = jnp.asarray(self.counter, jnp.int32)
    tracker = jnp.asarray(self.hysteresis_tracker, jnp.int32)
    full = jnp.int32(self.hysteresis)

    # Finite step: count, and grow once `period` finite steps have passed.
    grow = counter + 1 >= self.period
    grown = scale * self.factor
    if self.max_loss_scale is not None:
      grown = jnp.minimum(grown, self.max_loss_scale)
    grown = jnp.where(jnp.isfinite(grown), grown, scale)
    ok_scale = jnp.where(grow, grown, scale)
    ok_counter = jnp.where(grow, 0, counter + 1)
    refill = grow | self.consecutive_hysteresis
    ok_tracker = jnp.where(refill, full, tracker)

    # Non-finite step: spend hysteresis, then back off down to the floor.
    bad_tracker = jnp.maximum(tracker - 1, 0)
    if self.backoff_factor is None:
      backed = scale / self.factor
    else:
      backed = scale * self.backoff_factor
    backed = jnp.maximum(backed, self.min_loss_scale)
    bad_scale = jnp.where(bad_tracker <= 0, backed, scale)

    return dataclasses.replace(
      self,
      loss_scale=jnp.where(grads_finite, ok_scale, bad_scale),
      counter=jnp.where(grads_finite, ok_counter, 0),
      hysteresis_tracker=jnp.where(grads_finite, ok_tracker, bad_tracker),
    )


jax.tree_util.register_dataclass(NoOpLossScale, data_fields=[], meta_fields=[])
jax.tree_util.register_dataclass(
  StaticLossScale, data_fields=[], meta_fields=["loss_scale"]
)
jax.tree_util.register_dataclass(
  DynamicLossScale,
  data_fields=["loss_scale", "counter", "hysteresis_tracker"],
  meta_fields=[
    "period",
    "factor",
    "min_loss_scale",
    "backoff_factor",
    "max_loss_scale",
    "hysteresis",
    "consecutive_hysteresis",
  ],
)

LossScale = NoOpLossScale | StaticLossScale | DynamicLossScale


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
    init_scale: the first scale; in [min_scale, max_scale].
    growth_factor: multiplies the scale after `growth_interval` finite steps
      in a row; > 1.
    backoff_factor: multiplies the scale on an overflow once the hysteresis
      budget is spent; in (0, 1).
    growth_interval: finite steps between growths; >= 1.
    hysteresis: overflows tolerated before backing off; >= 1.
    min_scale: floor of the scale; > 0.
    max_scale: ceiling of the scale, or None for none (growth never reaches
      infinity either way).
    consecutive_hysteresis: refill the hysteresis budget on each finite step.

  Returns:
    A `DynamicLossScale`.

  Raises:
    ValueError: for settings outside the ranges above.

  Example:
    >>> ls = dynamic_loss_scale(init_scale=2.0**16, growth_interval=1000)
    >>> float(ls.loss_scale), ls.period, ls.backoff_factor
    (65536.0, 1000, 0.5)
  """
  init = _positive_number(init_scale, "init_scale")
  min_scale = _positive_number(min_scale, "min_scale")
  if min_scale > init:
    raise ValueError(f"min_scale ({min_scale}) must be <= init_scale ({init}).")
  return DynamicLossScale(
    np.asarray(init, np.float32),
    period=growth_interval,
    factor=growth_factor,
    min_loss_scale=min_scale,
    backoff_factor=backoff_factor,
    max_loss_scale=max_scale,
    hysteresis=hysteresis,
    consecutive_hysteresis=consecutive_hysteresis,
  )


def all_finite(tree: Any) -> jax.Array:
  """Returns a boolean scalar: whether every floating leaf is finite.

  One global predicate: under jit with sharded leaves the reduction spans all
  shards. Non-floating leaves are finite by definition.

  Example:
    >>> import jax.numpy as jnp
    >>> bool(all_finite({"a": jnp.ones(3), "b": jnp.array([1.0, jnp.inf])}))
    False
  """
  leaves = [x for x in jax.tree.leaves(tree) if _is_float_array(x)]
  if not leaves:
    return jnp.array(True)
  return jnp.stack([jnp.isfinite(x).all() for x in leaves]).all()


def select_tree(pred: jax.typing.ArrayLike, a: T, b: T) -> T:
  """Selects pytree `a` where `pred` is true, else `b`, leaf by leaf.

  Args:
    pred: a boolean scalar.
    a: a pytree.
    b: a pytree with the structure, shapes and dtypes of `a`.

  Returns:
    `a` if `pred` else `b`, without a host round trip.

  Raises:
    ValueError: if `pred` is not a boolean scalar or the trees differ.
  """
  pred = jnp.asarray(pred)
  if pred.ndim != 0 or pred.dtype != jnp.bool_:
    raise ValueError(
      "select_tree expected boolean scalar pred, got "
      f"{pred.dtype}{list(pred.shape)}."
    )
  tree_a, tree_b = jax.tree.structure(a), jax.tree.structure(b)
  if tree_a != tree_b:
    raise ValueError(
      f"select_tree needs trees of one structure, got {tree_a} and {tree_b}."
    )
  return jax.tree.map(lambda x, y: jax.lax.select(pred, x, y), a, b)
