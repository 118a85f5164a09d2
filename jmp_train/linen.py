"""Apply a `Policy` to a whole flax.linen model, user-written modules included.

`wrap(module, policy)` returns a linen module with the same variables as
`module`. Inside it:

- every float param is stored in the param dtype of the module that owns it
  (the policy's, or its class override's), and is cast to that module's
  compute dtype each time the module reads it with `self.param` (also in
  user-written modules that then call `jnp` directly);
- the wrapped module's float inputs are cast to the compute dtype and its
  float outputs to the output dtype;
- modules whose class has an override (by default LayerNorm, RMSNorm,
  BatchNorm and GroupNorm: float32 params and compute) get their inputs cast
  to the override's compute dtype and their outputs back to the enclosing
  compute dtype (or to the override's output dtype for user overrides);
- float variables in other collections (batch_stats, ...) keep the dtype they
  were created with.

`init` runs the model exactly as written (so initialisers, shapes and scan
carries are the model's own) and then stores each param in its owner's param
dtype. Gradients flow back through the casts, so they come back in the
params' dtype.

How: a method interceptor (`nn.intercept_methods`) tracks which module is
running and under which policy, and `nn.map_variables` hands the model its
params inside a small `AxisMetadata` box whose `unbox()` (called by
`self.param`) casts to the running module's compute dtype.
"""

from __future__ import annotations

import fnmatch
import functools
import threading
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import flax.linen as nn
import flax.struct
import jax
import numpy as np
from flax.core import meta

from jmp_train import fp8 as fp8_lib
from jmp_train import policy as policy_lib

DEFAULT_FLOAT32_MODULES = (nn.LayerNorm, nn.RMSNorm, nn.BatchNorm, nn.GroupNorm)


class _Override(NamedTuple):
  cls: type
  policy: policy_lib.Policy
  output_to_enclosing: bool  # defaults return to the enclosing compute dtype


class _Frame(NamedTuple):
  policy: policy_lib.Policy  # the running module's effective policy
  overrides: tuple[_Override, ...]  # the innermost wrap's overrides
  creating: bool  # init's first pass: run as written, record param owners
  fp8: fp8_lib.Fp8Recipe | None = None  # FP8 matmuls here, with this recipe
  fp8_exclude: tuple = ()  # module classes and name patterns kept out of FP8


class _Context(threading.local):
  def __init__(self):
    self.frames: list[_Frame] = []
    self.owners: dict[tuple[str, ...], np.dtype] = {}


_CTX = _Context()


@flax.struct.dataclass
class _CastOnRead(meta.AxisMetadata):
  """A param box whose `unbox()` casts to the running module's compute dtype."""

  value: Any

  def unbox(self):
    frames = _CTX.frames
    if not frames or frames[-1].creating:
      return self.value
    return policy_lib.cast_floating(self.value, frames[-1].policy.compute_dtype)

  def replace_boxed(self, val):
    return self.replace(value=val)

  def add_axis(self, index, params):
    return self

  def remove_axis(self, index, params):
    return self


def _is_box(x: Any) -> bool:
  return isinstance(x, _CastOnRead)


def _find_override(module: nn.Module, overrides) -> _Override | None:
  by_class = {o.cls: o for o in overrides}
  for cls in type(module).__mro__:
    if cls in by_class:
      return by_class[cls]
  return None


def _fp8_excluded(module: nn.Module, exclude: tuple) -> bool:
  path = "/".join(module.path)
  for item in exclude:
    if isinstance(item, str):
      if fnmatch.fnmatchcase(module.name or "", item) or fnmatch.fnmatchcase(
        path, item
      ):
        return True
    elif isinstance(module, item):
      return True
  return False


def _with_fp8(module: nn.Module, next_fun, recipe, method_name: str):
  """`next_fun`, with the module's matmul in FP8 if it is a Dense or Einsum."""
  if recipe is None or method_name != "__call__":
    return next_fun
  dot_cls = functools.partial(fp8_lib.Fp8DotGeneral, recipe=recipe)
  if (
    isinstance(module, (nn.Dense, nn.DenseGeneral))
    and module.dot_general_cls is None
    and module.dot_general is None
  ):

    def run(*args, **kwargs):
      # Set for this call only; the module is a per-apply bound clone.
      object.__setattr__(module, "dot_general_cls", dot_cls)
      try:
        return next_fun(*args, **kwargs)
      finally:
        object.__setattr__(module, "dot_general_cls", None)

    return run
  if isinstance(module, nn.Einsum) and (
    getattr(module, "dot_general_cls", None) is None
  ):
    return lambda *args, **kwargs: fp8_lib._einsum(
      module, *args, dot_general=dot_cls(), **kwargs
    )
  return next_fun


def _interceptor(next_fun, args, kwargs, context):
  frames, module = _CTX.frames, context.module
  if not frames or isinstance(module, _Wrapped) or module.scope is None:
    return next_fun(*args, **kwargs)
  outer = frames[-1]
  override = _find_override(module, outer.overrides)
  policy = override.policy if override else outer.policy
  recipe = outer.fp8
  if recipe is not None and _fp8_excluded(module, outer.fp8_exclude):
    recipe = None
  call = _with_fp8(module, next_fun, recipe, context.method_name)
  if outer.creating:
    _CTX.owners[module.path] = policy.param_dtype
  if override is None and recipe is outer.fp8:
    return call(*args, **kwargs)
  frames.append(outer._replace(policy=policy, fp8=recipe))
  try:
    if override is None or outer.creating:
      return call(*args, **kwargs)
    out = call(*policy.cast_to_compute(args), **policy.cast_to_compute(kwargs))
  finally:
    frames.pop()
  if override.output_to_enclosing:
    return policy_lib.cast_floating(out, outer.policy.compute_dtype)
  return policy.cast_to_output(out)


def _path_keys(path) -> tuple[str, ...]:
  return tuple(str(getattr(k, "key", k)) for k in path)


class _Wrapped(nn.Module):
  """`module` run under `policy`; built by `wrap`."""

  module: nn.Module
  policy: policy_lib.Policy
  overrides: tuple[_Override, ...]
  fp8: fp8_lib.Fp8Recipe | None = None
  fp8_exclude: tuple = ()

  def setup(self):
    nn.share_scope(self, self.module)

  def __call__(self, *args, **kwargs):
    initializing = self.is_initializing()
    incoming: dict[tuple[str, ...], np.dtype] = {}
    mapped = [False]

    def owner_dtype(keys: tuple[str, ...]) -> np.dtype:
      for end in range(len(keys) - 1, -1, -1):
        dtype = _CTX.owners.get(self.path + keys[:end])
        if dtype is not None:
          return dtype
      return self.policy.param_dtype

    def map_in(variables):
      mapped[0] = True

      def record_and_box(path, x):
        keys = _path_keys(path)
        if hasattr(x, "dtype"):
          incoming[keys] = x.dtype
        return _CastOnRead(x) if keys[0] == "params" else x

      return jax.tree_util.tree_map_with_path(
        record_and_box, variables, is_leaf=_is_box
      )

    def map_out(variables):
      def restore(path, x):
        x = x.value if _is_box(x) else x
        keys = _path_keys(path)
        if keys in incoming:
          return policy_lib.cast_floating(x, incoming[keys])
        if keys[0] == "params":
          return policy_lib.cast_floating(x, owner_dtype(keys[1:]))
        return x

      return jax.tree_util.tree_map_with_path(
        restore, variables, is_leaf=_is_box
      )

    def body(mdl, *args, **kwargs):
      creating = initializing and not mapped[0]
      _CTX.frames.append(
        _Frame(
          self.policy, self.overrides, creating, self.fp8, self.fp8_exclude
        )
      )
      try:
        if creating:
          return mdl.module(*args, **kwargs)
        return mdl.module(
          *self.policy.cast_to_compute(args),
          **self.policy.cast_to_compute(kwargs),
        )
      finally:
        _CTX.frames.pop()

    run = nn.map_variables(
      body,
      mapped_collections=True,
      trans_in_fn=map_in,
      trans_out_fn=map_out,
      init=initializing,
      mutable=True,
    )
    outermost = not _CTX.frames
    if outermost:
      _CTX.owners.clear()
      with nn.intercept_methods(_interceptor):
        out = run(self, *args, **kwargs)
    else:
      out = run(self, *args, **kwargs)
    return self.policy.cast_to_output(out)


def wrap(
  module: nn.Module,
  policy: policy_lib.Policy | str,
  overrides: Mapping[type, policy_lib.Policy | str | None] | None = None,
  *,
  fp8: fp8_lib.Fp8Recipe | bool | None = None,
  fp8_exclude: Iterable[str | type] = (),
) -> nn.Module:
  """Returns `module` running under `policy`, with per-class overrides.

  Args:
    module: any flax.linen module (an unbound instance).
    policy: a `Policy` or a policy string such as `"p=f32,c=bf16,o=f32"`.
    overrides: maps module classes to the policy their instances (and the
      modules inside them) use; subclasses match too, the most specific class
      wins. They extend the defaults, which keep LayerNorm, RMSNorm, BatchNorm
      and GroupNorm in float32 (params and compute) and return their outputs
      in the enclosing compute dtype; map a class to None to drop its default.
      A user override returns outputs in its policy's output dtype.
    fp8: an `Fp8Recipe` (True: the default recipe) to run the matmul of every
      `nn.Dense`, `nn.DenseGeneral` and `nn.Einsum` inside the model in FP8
      (`jmp_train.fp8.Fp8DotGeneral`, state in the "fp8_meta" collection).
      Layers given their own `dot_general` or `dot_general_cls` keep it.
    fp8_exclude: modules kept out of FP8, with everything inside them: module
      classes, or glob patterns matched against a module's name and its
      "/"-joined path (e.g. `"head"`, `"*/attention/*"`).

  Returns:
    A linen module whose variables have the structure of `module`'s. Call it
    (or `init`/`apply` it) as you would `module`; only `__call__` is wrapped.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, jmp_train
    >>> model = nn.Sequential([nn.Dense(8), nn.LayerNorm(), nn.Dense(2)])
    >>> wrapped = jmp_train.linen.wrap(model, "params=bfloat16,compute=bfloat16,output=float32")
    >>> variables = wrapped.init(jax.random.key(0), jnp.ones((1, 4)))
    >>> jax.tree.map(lambda x: x.dtype.name, variables["params"]["layers_1"])
    {'bias': 'float32', 'scale': 'float32'}
    >>> variables["params"]["layers_0"]["kernel"].dtype
    dtype(bfloat16)
    >>> wrapped.apply(variables, jnp.ones((1, 4))).dtype
    dtype('float32')
  """
  if not isinstance(module, nn.Module):
    raise TypeError(f"wrap expects a flax.linen Module, got {module!r}.")
  policy = policy_lib.get_policy(policy)
  float32 = np.dtype(np.float32)
  table: dict[type, _Override] = {
    cls: _Override(
      cls, policy_lib.Policy(float32, float32, policy.compute_dtype), True
    )
    for cls in DEFAULT_FLOAT32_MODULES
  }
  for cls, value in (overrides or {}).items():
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
      raise TypeError(
        f"overrides keys must be flax.linen Module classes, got {cls!r}."
      )
    if value is None:
      table.pop(cls, None)
    else:
      table[cls] = _Override(cls, policy_lib.get_policy(value), False)
  if fp8 is True:
    fp8 = fp8_lib.Fp8Recipe()
  if not (fp8 is None or fp8 is False or isinstance(fp8, fp8_lib.Fp8Recipe)):
    raise TypeError(
      f"fp8 must be an Fp8Recipe, True, False or None, got {fp8!r}."
    )
  if isinstance(fp8_exclude, str):
    fp8_exclude = (fp8_exclude,)
  fp8_exclude = tuple(fp8_exclude)
  for item in fp8_exclude:
    if not (
      isinstance(item, str)
      or (isinstance(item, type) and issubclass(item, nn.Module))
    ):
      raise TypeError(
        "fp8_exclude takes flax.linen Module classes and name patterns "
        f"(str), got {item!r}."
      )
  return _Wrapped(
    module=module,
    policy=policy,
    overrides=tuple(table.values()),
    fp8=fp8 or None,
    fp8_exclude=fp8_exclude,
  )
