"""Apply a `Policy` to a whole flax.nnx model, user-written modules included.

`wrap(model, policy)` converts `model` in place (NNX modules are mutable
objects, like `nnx.Optimizer` and `set_attributes` treat them) and returns it.
Its variables keep their structure, and afterwards:

- every float `nnx.Param` is stored in the param dtype of the module that owns
  it (the policy's, or its class override's);
- while the model runs, every float param reads as the running module's
  compute dtype (`self.w.value`, `self.w[...]`, in built-in layers and in
  user-written modules that call `jnp` directly), and gradients flow back
  through the cast, so they come back in the params' dtype;
- the model's float inputs are cast to the compute dtype and its float outputs
  to the output dtype;
- modules whose class has an override (by default LayerNorm, RMSNorm,
  BatchNorm and GroupNorm: float32 params and compute) get their inputs cast
  to the override's compute dtype and their outputs back to the enclosing
  compute dtype (or to the override's output dtype for user overrides);
- other variables (`nnx.BatchStat`, RNG state, counters) keep their dtypes.

How: the model's class, and the class of each overridden module inside it, is
swapped for a cached subclass whose `__call__` applies the policy, and each
float param's class for a cached subclass of its own (still an `nnx.Param`)
whose `get_value` casts to the running module's compute dtype while a wrapped
call is running, like linen's `self.param`. Nothing is mutated during a call,
so `nnx.split`/`nnx.merge`, `nnx.jit`, `nnx.grad`, `nnx.Optimizer` and plain
`jax.jit` over a closure all see an ordinary model.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import NamedTuple

import flax.nnx as nnx
import numpy as np

from jmp_train import policy as policy_lib

DEFAULT_FLOAT32_MODULES = (
  nnx.LayerNorm,
  nnx.RMSNorm,
  nnx.BatchNorm,
  nnx.GroupNorm,
)

_CONFIG = "_jmp_train_policy"


class _Config(NamedTuple):
  """What a converted module applies; a static (hashable) module attribute."""

  policy: policy_lib.Policy
  output_to_enclosing: bool  # defaults return to the enclosing compute dtype
  is_root: bool  # the module `wrap` was called on


class _Context(threading.local):
  def __init__(self):
    self.policies: list[policy_lib.Policy] = []  # running modules' policies


_CTX = _Context()


def _find_override(module: nnx.Module, overrides) -> tuple | None:
  by_class = {o[0]: o for o in overrides}
  for cls in type(module).__mro__:
    if cls in by_class:
      return by_class[cls]
  return None


def _param_policies(model: nnx.Module) -> dict[int, tuple]:
  """Maps id(param) -> (param, its owner's policy), for every float param.

  The owner's policy is that of the nearest enclosing module (itself
  included) converted by `wrap`: the root's, an override's or an inner
  `wrap`'s.
  """
  by_path: dict[tuple, policy_lib.Policy] = {}
  params: dict[int, tuple] = {}
  for path, node in nnx.iter_graph(model):
    if isinstance(node, nnx.Module):
      config = getattr(node, _CONFIG, None)
      if config is not None:
        by_path[tuple(path)] = config.policy
    elif isinstance(node, nnx.Param) and policy_lib._is_castable(
      node.get_value()
    ):
      params.setdefault(id(node), (node, tuple(path)))
  found: dict[int, tuple] = {}
  for key, (param, path) in params.items():
    owner = next(
      by_path[path[:end]]
      for end in range(len(path) - 1, -1, -1)
      if path[:end] in by_path
    )
    found[key] = (param, owner)
  return found


def _converted_call(self, *args, **kwargs):
  config: _Config = getattr(self, _CONFIG)
  policy, policies = config.policy, _CTX.policies
  base_call = super(type(self), self).__call__
  if not policies and not config.is_root:
    return base_call(*args, **kwargs)  # an inner module, called on its own
  enclosing = policies[-1].compute_dtype if policies else None
  policies.append(policy)
  try:
    out = base_call(
      *policy.cast_to_compute(args), **policy.cast_to_compute(kwargs)
    )
  finally:
    policies.pop()
  if config.output_to_enclosing and enclosing is not None:
    return policy_lib.cast_floating(out, enclosing)
  return policy.cast_to_output(out)


def _cast_on_read(self, **kwargs):
  value = super(type(self), self).get_value(**kwargs)
  policies = _CTX.policies
  if not policies:
    return value
  return policy_lib.cast_floating(value, policies[-1].compute_dtype)


_CLASSES: dict[tuple[type, str], type] = {}


def _subclass(cls: type, method: str, fn) -> type:
  """`cls` with `method` replaced by `fn`; one cached class per (cls, method).

  Same name, module and slots, so the instance's class can be swapped and
  graphdefs (which record the class) stay equal across wraps.
  """
  if getattr(cls, "_jmp_train_replaces", None) == method:
    return cls
  key = (cls, method)
  if key not in _CLASSES:
    _CLASSES[key] = type(cls)(
      cls.__name__,
      (cls,),
      {
        method: fn,
        "_jmp_train_replaces": method,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__slots__": (),
      },
    )
  return _CLASSES[key]


def _convert(module: nnx.Module, config: _Config) -> None:
  cls = _subclass(type(module), "__call__", _converted_call)
  object.__setattr__(module, "__class__", cls)
  object.__setattr__(module, _CONFIG, config)


def _override_table(policy, overrides) -> tuple:
  float32 = np.dtype(np.float32)
  table: dict[type, tuple] = {
    cls: (cls, policy_lib.Policy(float32, float32, policy.compute_dtype), True)
    for cls in DEFAULT_FLOAT32_MODULES
  }
  for cls, value in (overrides or {}).items():
    if not (isinstance(cls, type) and issubclass(cls, nnx.Module)):
      raise TypeError(
        f"overrides keys must be flax.nnx Module classes, got {cls!r}."
      )
    if value is None:
      table.pop(cls, None)
    else:
      table[cls] = (cls, policy_lib.get_policy(value), False)
  return tuple(table.values())


def wrap(
  model: nnx.Module,
  policy: policy_lib.Policy | str,
  overrides: Mapping[type, policy_lib.Policy | str | None] | None = None,
) -> nnx.Module:
  """Converts `model` in place to run under `policy`, and returns it.

  Args:
    model: any flax.nnx module (built-in layers and user-written modules).
    policy: a `Policy` or a policy string such as `"p=f32,c=bf16,o=f32"`.
    overrides: maps module classes to the policy their instances (and the
      modules inside them) use; subclasses match too, the most specific class
      wins. They extend the defaults, which keep LayerNorm, RMSNorm, BatchNorm
      and GroupNorm in float32 (params and compute) and return their outputs
      in the enclosing compute dtype; map a class to None to drop its default.
      A user override returns outputs in its policy's output dtype. Modules
      inside `model` that were wrapped before keep their own policy.

  Returns:
    `model` itself: same object, same attributes, same `nnx.state` structure,
    its float params stored in their owners' param dtypes. Only `__call__`
    applies the policy; call the model, not its other methods, from outside.

  Example:
    >>> import jax.numpy as jnp, flax.nnx as nnx, jmp_train
    >>> class MLP(nnx.Module):
    ...   def __init__(self, rngs):
    ...     self.dense = nnx.Linear(4, 8, rngs=rngs)
    ...     self.norm = nnx.LayerNorm(8, rngs=rngs)
    ...   def __call__(self, x):
    ...     return self.norm(self.dense(x))
    >>> model = jmp_train.nnx.wrap(MLP(nnx.Rngs(0)), "p=bf16,c=bf16,o=f32")
    >>> model.dense.kernel.dtype, model.norm.scale.dtype
    (dtype(bfloat16), dtype('float32'))
    >>> model(jnp.ones((1, 4))).dtype
    dtype('float32')
  """
  if not isinstance(model, nnx.Module):
    raise TypeError(f"wrap expects a flax.nnx Module, got {model!r}.")
  policy = policy_lib.get_policy(policy)
  table = _override_table(policy, overrides)
  for _, node in nnx.iter_graph(model):
    if not isinstance(node, nnx.Module) or node is model:
      continue
    if getattr(node, _CONFIG, None) is not None:
      continue  # wrapped before (or reached twice): keeps its policy
    override = _find_override(node, table)
    if override is not None:
      _, sub_policy, to_enclosing = override
      _convert(node, _Config(sub_policy, to_enclosing, False))
  if getattr(model, _CONFIG, None) is not None:
    object.__setattr__(model, _CONFIG, None)  # re-wrap with the new policy
  _convert(model, _Config(policy, False, True))
  for param, owner in _param_policies(model).values():
    param.set_value(
      policy_lib.cast_floating(param.get_value(), owner.param_dtype)
    )
    cls = _subclass(type(param), "get_value", _cast_on_read)
    object.__setattr__(param, "__class__", cls)
  return model
