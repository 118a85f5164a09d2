"""Mixed-precision policies: which dtype params, computation and outputs use.

A `Policy` is a frozen, hashable value. Its casts touch only the floating
dtypes a policy can name (float16, bfloat16, float32, float64): integer,
boolean and float8 leaves, Python scalars and non-array objects pass through
unchanged. This module is a drop-in superset of jmp 0.0.4's policy API.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from collections.abc import Mapping
from typing import Any, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

T = TypeVar("T")

# The floating dtypes a policy names, and so the only dtypes a cast touches.
# float8 arrays carry their own scales (see fp8 recipes) and are never cast.
# A policy holds them as jnp scalar types, as jmp does: `policy.compute_dtype`
# is `jnp.bfloat16`, so it can be called, compared with `is` and used as a key.
_SCALAR_TYPES = {
  np.dtype(t): t for t in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)
}
CASTABLE = frozenset(_SCALAR_TYPES)

dtype_to_names: Mapping[Any, tuple[str, ...]] = types.MappingProxyType(
  {
    jnp.float32: ("float32", "f32", "full", "single"),
    jnp.bfloat16: ("bfloat16", "bf16"),
    jnp.float16: ("float16", "f16"),
    jnp.float64: ("float64", "f64", "double"),
  }
)
"""The names `get_policy` accepts for each dtype; `str(policy)` uses the first.

Keyed by the jnp scalar types (NumPy's `np.float16` finds the same entry).
jmp lists `"full"` first for float32; ours lists the full name, so
`str(policy)` reads `params=float32,...`.
"""

_NAME_TO_DTYPE = {n: d for d, names in dtype_to_names.items() for n in names}
_ACCEPTED_DTYPE_NAMES = ", ".join(sorted([*_NAME_TO_DTYPE, "half"]))

_KEYS = {
  "p": "param_dtype",
  "params": "param_dtype",
  "c": "compute_dtype",
  "compute": "compute_dtype",
  "o": "output_dtype",
  "output": "output_dtype",
}
_EXAMPLE = "'params=float32,compute=bfloat16,output=float32'"


def half_dtype() -> type[jnp.bfloat16] | type[jnp.float16]:
  """Returns the half-precision dtype for the current backend.

  `jnp.bfloat16` on TPU, `jnp.float16` elsewhere. As in jmp, this is the
  callable scalar type, so `half_dtype()(2**15)` makes a scalar.
  """
  on_tpu = jax.local_devices()[0].platform == "tpu"
  return jnp.bfloat16 if on_tpu else jnp.float16


def _parse_dtype(name: str, context: str) -> Any:
  key = name.strip().lower()
  if key == "half":
    return half_dtype()
  try:
    return _NAME_TO_DTYPE[key]
  except KeyError:
    raise ValueError(
      f"Unknown dtype {name!r} in policy {context!r}: accepted names are "
      f"{_ACCEPTED_DTYPE_NAMES}."
    ) from None


def _as_policy_dtype(value: Any, field: str) -> Any:
  """Normalises a dtype-like (np.float16, np.dtype, 'bf16') to a jnp type."""
  if isinstance(value, str):
    return _parse_dtype(value, f"{field}={value}")
  accepted = (
    "a floating dtype, float16, bfloat16, float32 or float64 (as "
    "jnp.bfloat16, np.float32, np.dtype('float16') or a name such as 'bf16')"
  )
  if value is float:
    # NumPy reads the builtin as float64, JAX as float32 (without x64).
    raise TypeError(
      f"{field} is the builtin float, which NumPy reads as float64 and JAX "
      f"as float32: pass jnp.float32 or jnp.float64. Accepted: {accepted}."
    )
  carries_dtype = not isinstance(value, (type, np.dtype)) and hasattr(
    value, "dtype"
  )
  if value is None or carries_dtype:
    # np.dtype(None) is float64 and np.dtype(array) is the array's dtype:
    # neither is what the caller meant.
    raise TypeError(f"{field} must be {accepted}; got {value!r}.")
  try:
    dtype = np.dtype(value)
  except TypeError:
    raise TypeError(f"{field} must be {accepted}; got {value!r}.") from None
  if dtype not in CASTABLE:
    raise ValueError(f"{field} must be {accepted}; got {dtype.name}.")
  return _SCALAR_TYPES[dtype]


def cast_arrays(tree: T, dtype: Any, is_opaque: Any) -> T:
  """`cast_floating`, but objects for which `is_opaque` holds pass by reference.

  The wrappers cast call arguments with it: NNX graph nodes (modules,
  `Rngs`, `Variable`s) are not looked into and are returned as they are, so
  an `nnx.Rngs` advances and a `Variable`'s in-place update reaches the
  caller. A tree with nothing to cast is returned itself, not a copy.
  """
  leaves, treedef = jax.tree.flatten(tree, is_leaf=is_opaque)
  cast = [x if is_opaque(x) else cast_floating(x, dtype) for x in leaves]
  if all(a is b for a, b in zip(cast, leaves, strict=True)):
    return tree
  return jax.tree.unflatten(treedef, cast)


def _policy_float(value: Any) -> np.dtype | None:
  """`value` as a NumPy dtype if it is a dtype setting naming a policy float.

  Used for modules' `dtype`/`param_dtype` fields: None, arrays, other objects
  and integer or float8 dtypes give None (such settings are left alone).
  """
  if not isinstance(value, (type, np.dtype, str)):
    return None
  try:
    dtype = np.dtype(jnp.dtype(value))
  except (TypeError, ValueError):
    return None
  return dtype if dtype in CASTABLE else None


def dtype_updates(values: Mapping[str, Any], policy: Policy) -> dict:
  """The float `dtype`/`param_dtype` settings among `values` that `policy`
  sets, with the policy's value for each (the compute and param dtypes)."""
  wanted = {"dtype": policy.compute_dtype, "param_dtype": policy.param_dtype}
  return {
    name: wanted[name]
    for name, value in values.items()
    if name in wanted
    and (current := _policy_float(value)) is not None
    and current != np.dtype(wanted[name])
  }


def dtype_field_updates(obj: Any, policy: Policy) -> dict:
  """`dtype_updates` of the init fields of dataclass `obj` (a linen module,
  a model config)."""
  fields = {
    f.name: getattr(obj, f.name)
    for f in dataclasses.fields(obj)
    if f.init and f.name in ("dtype", "param_dtype")
  }
  return dtype_updates(fields, policy)


def with_policy_dtypes(config: Any, policy: Policy) -> Any:
  """Dataclass `config` (a model config carrying `dtype`/`param_dtype`) with
  those fields set to `policy`'s, or None if it has none to set."""
  updates = dtype_field_updates(config, policy)
  return dataclasses.replace(config, **updates) if updates else None


# The name scope a wrapped module with a policy override runs in: autocast
# runs what is traced inside it as written, so the override wins.
OVERRIDE_SCOPE = "jmp_train_policy_override"


class Override(NamedTuple):
  """A module class's policy under `linen.wrap`/`nnx.wrap`."""

  cls: type
  policy: Policy | None  # None: an overridden class's subclass mapped to None
  output_to_enclosing: bool  # defaults return to the enclosing compute dtype


def override_table(
  policy: Policy,
  overrides: Mapping[type, Any] | None,
  defaults: tuple[type, ...],
  base: type,
  framework: str,
) -> tuple[Override, ...]:
  """The overrides a `wrap` applies: float32 params and compute for the
  `defaults` (normalization layers, outputs back to the enclosing compute
  dtype), then the user's `overrides` (a policy or its string; None removes
  a default), whose keys must be subclasses of `base` (`framework`'s
  Module, for the error)."""
  float32 = np.dtype(np.float32)
  table = {
    cls: Override(cls, Policy(float32, float32, policy.compute_dtype), True)
    for cls in defaults
  }
  if overrides is not None and not isinstance(overrides, Mapping):
    raise TypeError(
      "overrides must be a mapping from module classes to policies, e.g. "
      f"{{nn.BatchNorm: 'float32'}} (None removes a default), got "
      f"{overrides!r}."
    )
  for cls, value in (overrides or {}).items():
    if not (isinstance(cls, type) and issubclass(cls, base)):
      raise TypeError(
        f"overrides keys must be {framework} Module classes, got {cls!r}."
      )
    if value is None:
      # Classes with an override of their own or through a base class.
      overridden = [*defaults] + [
        c for c, v in overrides.items() if v is not None and c is not cls
      ]
      if not any(issubclass(cls, c) for c in overridden):
        raise ValueError(
          f"overrides maps {cls.__name__} to None, which makes an overridden "
          f"class follow the policy, and {cls.__name__} has no override "
          f"(the defaults: {', '.join(d.__name__ for d in defaults)}, and "
          "the classes given): leave it out, or give it a policy."
        )
      table.pop(cls, None)
      if cls not in defaults:
        # A subclass of an overridden class: it follows the policy.
        table[cls] = Override(cls, None, False)
    else:
      table[cls] = Override(cls, get_policy(value), False)
  return tuple(table.values())


def find_override(module: Any, overrides: tuple[Override, ...]):
  """The override of `module`'s class or its nearest base class, or None
  (also where that nearest one is a subclass mapped to None)."""
  by_class = {o.cls: o for o in overrides}
  for cls in type(module).__mro__:
    if cls in by_class:
      found = by_class[cls]
      return None if found.policy is None else found
  return None


def is_castable(x: Any) -> bool:
  return (
    isinstance(x, (jax.Array, np.ndarray, np.generic)) and x.dtype in CASTABLE
  )


def cast_floating(tree: T, dtype: Any) -> T:
  """Casts the float16/bfloat16/float32/float64 array leaves of `tree`.

  Args:
    tree: any pytree.
    dtype: the target floating dtype.

  Returns:
    `tree` with those leaves cast to `dtype`; every other leaf is returned
    as it is (the same object).

  Raises:
    TypeError: if `dtype` is None (NumPy would read it as float64).
  """
  if dtype is None:
    raise TypeError(
      "cast_floating: dtype is None; pass the target dtype, e.g. "
      "jnp.bfloat16 (NumPy would read None as float64)."
    )
  dtype = np.dtype(dtype)

  def cast(x):
    return x.astype(dtype) if is_castable(x) and x.dtype != dtype else x

  return jax.tree.map(cast, tree)


@dataclasses.dataclass(frozen=True)
class Policy:
  """Encapsulates casting for inputs, outputs and parameters.

  Each dtype field is normalised to a jnp scalar type (`jnp.float16`,
  `jnp.bfloat16`, `jnp.float32` or `jnp.float64`), as jmp stores them: so
  `policy.compute_dtype(1.0)` makes a scalar, `policy.compute_dtype is
  jnp.float16` holds and the dtype can key a dict. `np.float32`,
  `np.dtype("float32")` and names such as `"bf16"` are accepted and become
  the same type, so such policies are equal and hash alike. Anything else
  (None, an integer or float8 dtype, an array) raises an error naming the
  field. Use `np.dtype(policy.param_dtype)` for `.name` or `.itemsize`.

  Example:
    >>> import jax.numpy as jnp
    >>> policy = Policy(jnp.float32, "bf16", np.float32)
    >>> policy.compute_dtype is jnp.bfloat16
    True
    >>> print(policy)
    params=float32,compute=bfloat16,output=float32
    >>> policy.cast_to_compute({"w": jnp.ones(2), "step": jnp.int32(3)})["w"].dtype
    dtype(bfloat16)
    >>> get_policy(str(policy)) == policy
    True
  """

  param_dtype: Any
  compute_dtype: Any
  output_dtype: Any

  def __post_init__(self):
    for field in ("param_dtype", "compute_dtype", "output_dtype"):
      object.__setattr__(
        self, field, _as_policy_dtype(getattr(self, field), field)
      )

  def cast_to_param(self, x: T) -> T:
    """Converts floating point leaves to the param dtype."""
    return cast_floating(x, self.param_dtype)

  def cast_to_compute(self, x: T) -> T:
    """Converts floating point leaves to the compute dtype."""
    return cast_floating(x, self.compute_dtype)

  def cast_to_output(self, x: T) -> T:
    """Converts floating point leaves to the output dtype."""
    return cast_floating(x, self.output_dtype)

  def with_param_dtype(self, param_dtype: Any) -> Policy:
    return dataclasses.replace(self, param_dtype=param_dtype)

  def with_compute_dtype(self, compute_dtype: Any) -> Policy:
    return dataclasses.replace(self, compute_dtype=compute_dtype)

  def with_output_dtype(self, output_dtype: Any) -> Policy:
    return dataclasses.replace(self, output_dtype=output_dtype)

  def __str__(self) -> str:
    name = lambda dtype: dtype_to_names[dtype][0]
    return (
      f"params={name(self.param_dtype)},compute={name(self.compute_dtype)},"
      f"output={name(self.output_dtype)}"
    )

  def __repr__(self) -> str:
    return f"get_policy({str(self)!r})"


def get_policy(policy: str | Policy) -> Policy:
  """Returns a policy parsed from a string (a `Policy` is returned as is).

  The grammar is jmp's: comma-separated `key=dtype` parts with keys
  `params`/`p`, `compute`/`c`, `output`/`o`, or a single dtype name meaning all
  three. Unspecified params default to float32, compute follows params and
  output follows compute. Dtype names: f32, float32, full, single, bf16,
  bfloat16, f16, float16, half (bfloat16 on TPU, float16 elsewhere), f64,
  float64, double.

  Args:
    policy: a policy string, or a `Policy` (jmp's own `jmp.Policy` too).

  Returns:
    The parsed `Policy`.

  Raises:
    ValueError: for an empty string, an unknown key or dtype, a part without
      `=`, or a key given twice; the message names the bad part and what is
      accepted.

  Example:
    >>> get_policy("c=bf16")
    get_policy('params=float32,compute=bfloat16,output=bfloat16')
    >>> get_policy("half") == get_policy("p=f16,c=f16,o=f16")  # on CPU
    True
  """
  if isinstance(policy, Policy):
    return policy
  jmp = sys.modules.get("jmp")
  if jmp is not None and isinstance(policy, jmp.Policy):
    # jmp's own, from code half-way through the one-import switch.
    return Policy(policy.param_dtype, policy.compute_dtype, policy.output_dtype)
  if not isinstance(policy, str):
    hint = ""
    if isinstance(getattr(policy, "policy", None), Policy):  # a Preset
      hint = f" (pass its policy, .policy: {policy.policy!r})"
    raise TypeError(f"A policy is a string or a Policy, got {policy!r}{hint}.")
  text = policy.strip()
  if not text:
    raise ValueError(
      f"Empty policy string: expected a dtype name ({_ACCEPTED_DTYPE_NAMES}) "
      f"or key=dtype parts such as {_EXAMPLE}."
    )
  if "=" not in text:
    try:
      dtype = _parse_dtype(text, policy)
    except ValueError as error:
      # A preset's name is a likely slip; presets sit above policies, so
      # the hint says where its policy is rather than looking it up.
      raise ValueError(
        f"{error} A preset's name goes to jmp_train.get_preset(name), "
        "whose .policy is its policy."
      ) from None
    return Policy(dtype, dtype, dtype)

  found: dict[str, Any] = {}
  for part in text.split(","):
    key, sep, value = part.partition("=")
    key = key.strip().lower()
    if not sep or not key or not value.strip():
      raise ValueError(
        f"Bad part {part.strip()!r} in policy {policy!r}: expected key=dtype "
        f"parts such as {_EXAMPLE}."
      )
    if key not in _KEYS:
      raise ValueError(
        f"Unknown key {key!r} in policy {policy!r}: accepted keys are params "
        "(p), compute (c) and output (o)."
      )
    field = _KEYS[key]
    if field in found:
      raise ValueError(
        f"Key {key!r} sets {field} twice in policy {policy!r}: give each of "
        "params, compute and output at most once."
      )
    found[field] = _parse_dtype(value, policy)

  param = found.get("param_dtype", jnp.float32)
  compute = found.get("compute_dtype", param)
  output = found.get("output_dtype", compute)
  return Policy(param, compute, output)


def cast_to_full(tree: T) -> T:
  """Ensures floating point leaves of the given tree are float32."""
  return cast_floating(tree, jnp.float32)


def cast_to_half(tree: T) -> T:
  """Ensures floating point leaves of the given tree are half precision."""
  return cast_floating(tree, half_dtype())
