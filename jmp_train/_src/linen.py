"""Apply a `Policy` to a whole flax.linen model, user-written modules included.

`wrap(module, policy)` returns a linen module with the same variables as
`module`. Inside it:

- every float param is stored in the param dtype of the module that owns it
  (the policy's, or its class override's), and is cast to that module's
  compute dtype each time the module reads it with `self.param` (also in
  user-written modules that then call `jnp` directly);
- every module's float `dtype` and `param_dtype` fields, and those of a
  dataclass field such as a `config` carrying them, read as its policy's
  compute and param dtypes (Flax's own examples pass `dtype=jnp.float32` to
  every layer; `promote_dtype` would otherwise cast back to it);
- the wrapped module's float inputs are cast to the compute dtype and its
  float outputs to the output dtype, for `__call__` and its other methods
  (`apply(..., method="encode")`); other arguments pass by reference;
- modules whose class has an override (by default LayerNorm, RMSNorm,
  BatchNorm and GroupNorm: float32 params and compute) get their inputs cast
  to the override's compute dtype and their outputs back to the enclosing
  compute dtype (or to the override's output dtype for user overrides);
- float variables in other collections (batch_stats, ...) keep the dtype they
  were created with.

`init` runs the model twice. First exactly as written, so initialisers,
shapes and values are the model's own; each param is then stored in its
owner's param dtype. Then under the policy, which creates the other
collections again, so a decode cache comes out in the dtype apply computes
in; they keep the first run's values. Gradients flow back through the casts,
so they come back in the params' dtype.

How: a method interceptor (`nn.intercept_methods`) tracks which module is
running and under which policy, and sets the dtype fields of each module's
per-apply bound clone before its first method (`setup` included) runs; and
`nn.map_variables` hands the model its params inside a small `AxisMetadata`
box whose `unbox()` (called by `self.param`) casts to the running module's
compute dtype.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import inspect
import threading
import types
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import flax.linen as nn
import flax.struct
import jax
import numpy as np
from flax.core import meta
from flax.nnx import graph as nnx_graph

from jmp_train._src import fp8_linen, fp8_param, fp8_recipe, leaves, patterns
from jmp_train._src import policy as policy_lib

DEFAULT_FLOAT32_MODULES = (nn.LayerNorm, nn.RMSNorm, nn.BatchNorm, nn.GroupNorm)


class _Frame(NamedTuple):
  policy: policy_lib.Policy  # the running module's effective policy
  overrides: tuple[policy_lib.Override, ...]  # the innermost wrap's overrides
  creating: bool  # init's first pass: run as written, record param owners
  fp8: fp8_recipe.Recipe | None = None  # FP8 matmuls here, with this recipe
  fp8_exclude: tuple = ()  # module classes and name patterns kept out of FP8
  set_dtype_fields: bool = True  # modules' dtype fields follow the policy
  respect: tuple = ()  # classes and name patterns whose dtype fields stay
  fp8_params: bool = False  # FP8 layers' kernels stored as Fp8Param


class _Context(threading.local):
  def __init__(self):
    self.frames: list[_Frame] = []
    self.owners: dict[tuple[str, ...], np.dtype] = {}
    self.fp8_modules: set[tuple[str, ...]] = set()  # their kernels go FP8
    self.called: set[tuple[str, ...]] = set()  # paths of modules run


_CTX = _Context()


def _effective_fields(module: nn.Module, policy: policy_lib.Policy) -> dict:
  """Fields of `module` to replace so that it runs under `policy`.

  Its float `dtype` and `param_dtype` fields, and those of a dataclass field
  carrying them (a config such as lm1b's `TransformerConfig`, replaced with
  `dataclasses.replace`); submodules are left to their own turn.
  """
  updates = policy_lib.dtype_field_updates(module, policy)
  for field in dataclasses.fields(module):
    value = getattr(module, field.name, None)
    if (
      field.name in ("parent", "name")
      or field.name in updates
      or isinstance(value, (nn.Module, type))
      or not dataclasses.is_dataclass(value)
    ):
      continue
    config = policy_lib.with_policy_dtypes(value, policy)
    if config is not None:
      updates[field.name] = config
  return updates


def _cast_arrays(tree: Any, dtype: Any) -> Any:
  """Float arrays cast to `dtype`; NNX graph nodes passed by reference."""
  return policy_lib.cast_arrays(tree, dtype, nnx_graph.is_graph_node)


def _cast_call(args: tuple, kwargs: dict, dtype: Any) -> tuple[tuple, dict]:
  """Casts call arguments one by one (see `_cast_arrays`).

  An argument with no float array to cast (a config, an `nnx.Rngs`, a
  callable) is passed on as the same object.
  """
  return (
    tuple(_cast_arrays(a, dtype) for a in args),
    {k: _cast_arrays(v, dtype) for k, v in kwargs.items()},
  )


class _ByReference:
  """Carries one call argument across `nn.map_variables` as it is.

  Flax rebuilds the arguments of its lifted transforms as pytrees, to re-bind
  the linen Modules and Variables among them; that would copy an `nnx.Rngs`,
  an `nnx.Variable` or a list the module appends to. Arguments holding no
  linen Module or Variable cross inside this box (a pytree leaf) instead.
  """

  __slots__ = ("value",)

  def __init__(self, value):
    self.value = value


def _is_linen_object(x: Any) -> bool:
  return isinstance(x, (nn.Module, nn.Variable))


def _box(x: Any) -> Any:
  leaves = jax.tree.leaves(x, is_leaf=_is_linen_object)
  return x if any(map(_is_linen_object, leaves)) else _ByReference(x)


def _unbox(x: Any) -> Any:
  return x.value if isinstance(x, _ByReference) else x


@flax.struct.dataclass
class _CastOnRead(meta.AxisMetadata):
  """A param box whose `unbox()` casts to the running module's compute dtype."""

  value: Any

  def unbox(self):
    frames = _CTX.frames
    if not frames or frames[-1].creating or _is_fp8_param(self.value):
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


def _is_fp8_param(x: Any) -> bool:
  return fp8_param.is_fp8_param(x)


def _is_box_or_fp8(x: Any) -> bool:
  return _is_box(x) or _is_fp8_param(x)


def _matches(module: nn.Module, selectors: tuple) -> bool:
  """Whether `module` is an instance of, or named like, one of `selectors`:
  module classes, or glob patterns on its name and "/"-joined path."""
  path = "/".join(module.path) if module.scope is not None else ""
  for item in selectors:
    if isinstance(item, str):
      if fnmatch.fnmatchcase(module.name or "", item) or fnmatch.fnmatchcase(
        path, item
      ):
        return True
    elif isinstance(module, item):
      return True
  return False


def _module_paths(params: Any, root: tuple) -> set[tuple[str, ...]]:
  """The paths of `root` and of every module above a param in `params`."""
  paths = {root}
  for path, _ in jax.tree_util.tree_flatten_with_path(
    params, is_leaf=_is_box_or_fp8
  )[0]:
    keys = _path_keys(path)
    paths.update(root + keys[:end] for end in range(1, len(keys)))
  return paths


def _with_fp8(module: nn.Module, next_fun, recipe, method_name: str):
  """`next_fun`, with the module's matmul in FP8 if it is a Dense or Einsum."""
  if recipe is None or method_name != "__call__":
    return next_fun
  dot_cls = functools.partial(fp8_linen.Fp8DotGeneral, recipe=recipe)
  if (
    isinstance(module, (nn.Dense, nn.DenseGeneral))
    and module.dot_general_cls is None
    and module.dot_general is None
  ):
    promote = module.promote_dtype

    def run(*args, **kwargs):
      # Set for this call only; the module is a per-apply bound clone.
      object.__setattr__(module, "dot_general_cls", dot_cls)
      keeping = fp8_linen.keeping_fp8_params(promote)
      object.__setattr__(module, "promote_dtype", keeping)
      try:
        return next_fun(*args, **kwargs)
      finally:
        object.__setattr__(module, "dot_general_cls", None)
        object.__setattr__(module, "promote_dtype", promote)

    return run
  if isinstance(module, nn.Einsum) and (
    getattr(module, "dot_general_cls", None) is None
  ):
    return lambda *args, **kwargs: fp8_linen.einsum(
      module, *args, dot_general=dot_cls(), **kwargs
    )
  return next_fun


def _interceptor(next_fun, args, kwargs, context):
  frames, module = _CTX.frames, context.module
  if not frames or isinstance(module, _Wrapped) or module.scope is None:
    return next_fun(*args, **kwargs)
  if not isinstance(module, fp8_linen.Fp8DotGeneral):  # ours, not the model's
    _CTX.called.add(module.path)
  outer = frames[-1]
  override = policy_lib.find_override(module, outer.overrides)
  policy = override.policy if override else outer.policy
  set_fields = outer.set_dtype_fields and not _matches(module, outer.respect)
  if set_fields and not outer.creating:
    # Before the module's first method (setup included) reads them. `module`
    # is this apply's bound clone, so the user's module is never changed.
    for name, value in _effective_fields(module, policy).items():
      object.__setattr__(module, name, value)
  recipe = outer.fp8
  if recipe is not None and _matches(module, outer.fp8_exclude):
    recipe = None
  call = _with_fp8(module, next_fun, recipe, context.method_name)
  if outer.creating:
    _CTX.owners[module.path] = policy.param_dtype
    if outer.fp8_params and call is not next_fun:
      _CTX.fp8_modules.add(module.path)
  if (
    override is None
    and recipe is outer.fp8
    and set_fields == outer.set_dtype_fields
  ):
    return call(*args, **kwargs)
  frames.append(
    outer._replace(policy=policy, fp8=recipe, set_dtype_fields=set_fields)
  )
  try:
    if override is None or outer.creating:
      return call(*args, **kwargs)
    args, kwargs = _cast_call(args, kwargs, policy.compute_dtype)
    with jax.named_scope(policy_lib.OVERRIDE_SCOPE):  # read by autocast
      out = call(*args, **kwargs)
  finally:
    frames.pop()
  if override.output_to_enclosing:
    return _cast_arrays(out, outer.policy.compute_dtype)
  return _cast_arrays(out, policy.output_dtype)


def _path_keys(path) -> tuple[str, ...]:
  return tuple(str(getattr(k, "key", k)) for k in path)


def _calls_inner(method: str | Any):
  """A `_Wrapped` method running the inner module's `method` under it."""

  def call(wrapped, *args, **kwargs):
    return wrapped._run(method, *args, **kwargs)

  return call


class _Wrapped(nn.Module):
  """`module` run under `policy`; built by `wrap`.

  The inner module's fields read through (`wrapped.num_classes`), its `dtype`
  and `param_dtype` fields (and a config's) as the policy sets them; its
  methods run under the policy (`wrapped.encode(x)`, `apply(...,
  method="encode")`, `method=Inner.encode`).
  """

  module: nn.Module
  policy: policy_lib.Policy
  overrides: tuple[policy_lib.Override, ...]
  fp8: fp8_recipe.Recipe | None = None
  fp8_exclude: tuple = ()
  respect_dtype_fields: bool | tuple = False
  fp8_params: bool = False

  def setup(self):
    nn.share_scope(self, self.module)

  def __call__(self, *args, **kwargs):
    return self._run("__call__", *args, **kwargs)

  @nn.nowrap
  def __getattr__(self, name: str) -> Any:
    try:
      return nn.Module.__getattr__(self, name)
    except AttributeError:
      inner = self.__dict__.get("module")
      if name.startswith("_") or inner is None:
        raise
    fields = {f.name for f in dataclasses.fields(inner)} - {"parent", "name"}
    if name in fields:
      value = getattr(inner, name)
      respect = self.respect_dtype_fields
      if respect is True or (respect and _matches(inner, respect)):
        return value
      override = policy_lib.find_override(inner, self.overrides)
      policy = override.policy if override else self.policy
      return _effective_fields(inner, policy).get(name, value)
    if inspect.isfunction(inspect.getattr_static(type(inner), name, None)):
      return types.MethodType(_calls_inner(name), self)
    raise AttributeError(
      f"{type(inner).__name__!r} wrapped by jmp_train.linen.wrap has no field "
      f"or method {name!r} (fields and methods read through; properties and "
      "attributes defined in setup do not)."
    )

  @nn.nowrap
  def _inner_method(self, method: Any) -> Any:
    """`apply`'s `method`, a function of the inner class made to run on it.

    `method=Inner.encode` would otherwise get the wrapper as `self`.
    """
    fn = method
    if inspect.ismethod(fn) and isinstance(fn.__self__, nn.Module):
      fn = fn.__func__
    name = getattr(fn, "__name__", None)
    if isinstance(method, str) or name is None:
      return method
    if not any(vars(k).get(name) is fn for k in type(self.module).__mro__):
      return method  # a wrapper method, or a function given the wrapper
    return None if name == "__call__" else _calls_inner(fn)

  @nn.nowrap
  def apply(self, variables, *args, method=None, **kwargs):
    """`flax.linen.Module.apply`; `method` may name the inner module's."""
    return super().apply(
      variables, *args, method=self._inner_method(method), **kwargs
    )

  @nn.nowrap
  def init_with_output(self, rngs, *args, method=None, **kwargs):
    """`flax.linen.Module.init_with_output` (and so `init`), as `apply`."""
    return super().init_with_output(
      rngs, *args, method=self._inner_method(method), **kwargs
    )

  def _run(self, method: str | Any, *args, **kwargs):
    """Runs the inner module's `method` (a name or a function) under it."""
    initializing = self.is_initializing()
    incoming: dict[tuple[str, ...], Any] = {}
    as_written: dict[tuple[str, ...], Any] = {}  # init's first-pass variables
    mapped = [False]
    known: set[tuple[str, ...]] = set()  # module paths, to check patterns
    # The patterns are checked against the whole model: an apply's params
    # (any method), or an init that runs the model's __call__. Modules
    # without params are seen only when run, so respect_dtype_fields is
    # checked on calls of __call__ (init and apply), against the modules
    # above params and those the call ran.
    whole = not initializing or method == "__call__"

    def owner_dtype(keys: tuple[str, ...]) -> Any:
      for end in range(len(keys) - 1, -1, -1):
        dtype = _CTX.owners.get(self.path + keys[:end])
        if dtype is not None:
          return dtype
      return self.policy.param_dtype

    def map_in(variables):
      mapped[0] = True
      known.update(_module_paths(variables.get("params", {}), self.path))
      if self.fp8 is not None and whole:  # every FP8 layer has params
        patterns.refuse_unmatched(
          "fp8_exclude", self.fp8_exclude, known, "modules with params"
        )
      if initializing:
        # init's second pass, under the policy, creates the other collections
        # again (a decode cache must not exist yet, and must come out in the
        # dtype apply computes in); map_out then gives them the first pass's
        # values.
        variables = {k: v for k, v in variables.items() if k == "params"}

      def record_and_box(path, x):
        keys = _path_keys(path)
        if hasattr(x, "dtype"):
          incoming[keys] = x.dtype
        return _CastOnRead(x) if keys[0] == "params" else x

      return jax.tree_util.tree_map_with_path(
        record_and_box, variables, is_leaf=_is_box_or_fp8
      )

    def map_out(variables):
      first_pass = initializing and not mapped[0]

      def restore(path, x):
        x = x.value if _is_box(x) else x
        keys = _path_keys(path)
        if _is_fp8_param(x):
          return x
        if (
          keys[0] == "params"
          and keys[-1] == "kernel"
          and self.path + keys[1:-1] in _CTX.fp8_modules
        ):
          # init: an FP8 layer's kernel, as the model made it, cast to FP8.
          return fp8_param.cast_param(x)
        if keys in incoming:
          return policy_lib.cast_floating(x, incoming[keys])
        if keys[0] == "params":
          return policy_lib.cast_floating(x, owner_dtype(keys[1:]))
        if first_pass:
          as_written[keys] = x
        elif keys in as_written and np.shape(as_written[keys]) == np.shape(x):
          # The value the model as written gives it (a random draw, a count
          # of calls), in the dtype the policy run created it with.
          if getattr(x, "dtype", None) in policy_lib.CASTABLE:
            return policy_lib.cast_floating(as_written[keys], x.dtype)
          return as_written[keys]
        return x

      return jax.tree_util.tree_map_with_path(
        restore, variables, is_leaf=_is_box_or_fp8
      )

    def body(mdl, *args, **kwargs):
      args = tuple(map(_unbox, args))
      kwargs = {k: _unbox(v) for k, v in kwargs.items()}
      creating = initializing and not mapped[0]
      _CTX.frames.append(
        _Frame(
          self.policy,
          self.overrides,
          creating,
          self.fp8,
          self.fp8_exclude,
          self.respect_dtype_fields is not True,
          _selectors_only(self.respect_dtype_fields),
          self.fp8_params,
        )
      )
      try:
        if not creating:
          args, kwargs = _cast_call(args, kwargs, self.policy.compute_dtype)
        if isinstance(method, str):
          return getattr(mdl.module, method)(*args, **kwargs)
        return method(mdl.module, *args, **kwargs)
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
    args = tuple(map(_box, args))
    kwargs = {k: _box(v) for k, v in kwargs.items()}
    outermost = not _CTX.frames
    if outermost:
      _CTX.owners.clear()
      _CTX.fp8_modules.clear()
      _CTX.called.clear()
      with nn.intercept_methods(_interceptor):
        out = run(self, *args, **kwargs)
    else:
      out = run(self, *args, **kwargs)
    known.update(p for p in _CTX.called if p[: len(self.path)] == self.path)
    if method == "__call__" and isinstance(self.respect_dtype_fields, tuple):
      patterns.refuse_unmatched(
        "respect_dtype_fields", self.respect_dtype_fields, known, "modules"
      )
    return _cast_arrays(out, self.policy.output_dtype)


def wrap(
  module: nn.Module,
  policy: policy_lib.Policy | str,
  overrides: Mapping[type, policy_lib.Policy | str | None] | None = None,
  *,
  fp8: fp8_recipe.Recipe | str | bool | None = None,
  fp8_exclude: Iterable[str | type] = (),
  respect_dtype_fields: bool | Iterable[str | type] = False,
  fp8_params: bool = False,
) -> nn.Module:
  """Returns `module` running under `policy`, with per-class overrides.

  Under the policy every module computes in its compute dtype and stores its
  params in its param dtype, whatever its own fields say: a float `dtype` or
  `param_dtype` field (Flax's ResNet and Transformer examples pass
  `dtype=jnp.float32` to every layer), and those of a dataclass field such as
  a `config` carrying them, read as the policy's (the override's, for an
  overridden module) in every method, `setup` included, so `x.astype(
  self.dtype)` and `nn.make_attention_mask(..., dtype=config.dtype)` follow
  it too. None and non-float values are left alone. `init` first runs the
  model as written, so params get the model's own initial values, then runs
  it under the policy, which creates the other collections (an attention
  decode cache comes out in the compute dtype).

  Float arrays among the call arguments are cast to the compute dtype; other
  arguments (NNX `Rngs` and `Variable`s, configs, callables) pass through by
  reference.

  Args:
    module: any flax.linen module (an unbound instance).
    policy: a `Policy` or a policy string such as `"p=f32,c=bf16,o=f32"`.
    overrides: maps module classes to the policy their instances (and the
      modules inside them) use; subclasses match too, the most specific class
      wins. They extend the defaults, which keep LayerNorm, RMSNorm, BatchNorm
      and GroupNorm in float32 (params and compute) and return their outputs
      in the enclosing compute dtype; map a class to None to drop its default.
      A user override returns outputs in its policy's output dtype.
    fp8: a `jmp_train.fp8` recipe (`DelayedScaling`, `CurrentScaling`,
      `BlockwiseScaling`), a recipe name ("delayed", "current", "blockwise")
      or True (the default, `CurrentScaling()`) to run the matmul of every
      `nn.Dense`, `nn.DenseGeneral` and `nn.Einsum` inside the model in FP8
      (`jmp_train.fp8.Fp8DotGeneral`, state in the "fp8_meta" collection).
      Layers given their own `dot_general` or `dot_general_cls` keep it.
    fp8_exclude: modules kept out of FP8, with everything inside them: module
      classes, or glob patterns matched against a module's name and its
      "/"-joined path (e.g. `"head"`, `"*/attention/*"`). With `fp8` set, a
      pattern that matches no module with params raises `ValueError` on
      `apply` and on an `init` of `__call__`.
    fp8_params: store the kernel of every layer that runs in FP8 as a
      `jmp_train.fp8.Fp8Param` (E4M3 values and a power-of-two scale, 1 byte
      per value; NeMo's `fp8_params`, Transformer Engine's
      `fp8_model_init`): `init` casts the kernel the model initialises, and
      the matmul reads the stored values, with no bfloat16 copy. Train with
      `mixed_precision` (the float32 master lives in its state) and the
      train step, which casts each kernel again after the optimizer update
      and, under ZeRO-1, all-gathers the FP8 values. Needs `fp8` with
      current or delayed scaling, without `statistics`.
    respect_dtype_fields: keep modules' own `dtype`/`param_dtype` fields
      (Flax's behaviour without a policy): True for every module, or module
      classes and name patterns (as `fp8_exclude` takes them) for those
      modules and everything inside them, e.g. `("head",)` for a logits layer
      built with `dtype=jnp.float32`. Such a layer then computes in float32,
      since Flax casts its inputs and params back; its params are still
      stored in the param dtype and read in the compute dtype (use
      `overrides` for a module that must keep float32 params too). A
      pattern that matches no module (with params, or run by the call)
      raises `ValueError` in `init` and `apply` of `__call__`; name a
      module without params that a call may skip (an eval apply) by its
      parent instead.

  Returns:
    A linen module whose variables have the structure of `module`'s. Call it,
    `init` it and `apply` it as you would `module`, other methods included
    (`method="encode"`, `method=Model.encode`, `wrapped.encode(x)` from a
    parent): each runs under the policy. Its fields read through
    (`wrapped.num_classes`); `dtype` and `param_dtype` read as the policy sets
    them, `wrapped.module.dtype` as the module was written.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, numpy as np, jmp_train
    >>> model = nn.Sequential([nn.Dense(8), nn.LayerNorm(), nn.Dense(2)])
    >>> wrapped = jmp_train.linen.wrap(model, "params=bfloat16,compute=bfloat16,output=float32")
    >>> variables = wrapped.init(jax.random.key(0), jnp.ones((1, 4)))
    >>> jax.tree.map(lambda x: x.dtype.name, variables["params"]["layers_1"])
    {'bias': 'float32', 'scale': 'float32'}
    >>> variables["params"]["layers_0"]["kernel"].dtype
    dtype(bfloat16)
    >>> wrapped.apply(variables, jnp.ones((1, 4))).dtype
    dtype('float32')
    >>> dense = jmp_train.linen.wrap(nn.Dense(2, dtype=jnp.float32), "p=f32,c=bf16,o=f32")
    >>> dense.features, np.dtype(dense.dtype).name, dense.module.dtype.__name__
    (2, 'bfloat16', 'float32')
  """
  if not isinstance(module, nn.Module):
    raise TypeError(f"wrap expects a flax.linen Module, got {module!r}.")
  policy = policy_lib.get_policy(policy)
  table = policy_lib.override_table(
    policy, overrides, DEFAULT_FLOAT32_MODULES, nn.Module, "flax.linen"
  )
  fp8 = fp8_recipe.check_recipe(fp8, "fp8")
  fp8_exclude = _selectors(fp8_exclude, "fp8_exclude")
  fp8_params = _check_fp8_params(fp8_params, fp8)
  if not isinstance(respect_dtype_fields, bool):
    respect_dtype_fields = _selectors(
      respect_dtype_fields, "respect_dtype_fields"
    )
  return _Wrapped(
    module=module,
    policy=policy,
    overrides=table,
    fp8=fp8,
    fp8_exclude=fp8_exclude,
    respect_dtype_fields=respect_dtype_fields,
    fp8_params=fp8_params,
  )


def _check_fp8_params(fp8_params: Any, recipe: Any) -> bool:
  fp8_params = leaves.check_bool(fp8_params, "fp8_params")
  if not fp8_params:
    return False
  if recipe is None:
    raise ValueError(
      "fp8_params=True stores the kernels of FP8 layers in FP8, but fp8 is "
      "None: pass fp8= a recipe (CurrentScaling() or DelayedScaling()) too."
    )
  if isinstance(recipe, fp8_recipe.BlockwiseScaling) or recipe.statistics:
    raise ValueError(
      f"fp8_params=True with fp8={recipe!r}: an FP8 param has one "
      "power-of-two scale per tensor, cast by the optimizer, so it takes "
      "current or delayed scaling without statistics (blockwise scaling "
      "needs one scale per block)."
    )
  return True


def _selectors(items: Any, argument: str) -> tuple:
  """Module classes and name patterns, validated, as a tuple."""
  if isinstance(items, (str, type)):
    items = (items,)
  try:
    items = tuple(items)
  except TypeError:
    raise TypeError(
      f"{argument} takes flax.linen Module classes and name patterns (str), "
      f"got {items!r}."
    ) from None
  for item in items:
    if not (
      isinstance(item, str)
      or (isinstance(item, type) and issubclass(item, nn.Module))
    ):
      raise TypeError(
        f"{argument} takes flax.linen Module classes and name patterns "
        f"(str), got {item!r}."
      )
  return items


def _selectors_only(respect: bool | tuple) -> tuple:
  return respect if isinstance(respect, tuple) else ()
