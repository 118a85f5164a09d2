"""Apply a `Policy` to a whole flax.nnx model, user-written modules included.

`wrap(model, policy)` converts `model` in place (NNX modules are mutable
objects, like `nnx.Optimizer` and `set_attributes` treat them) and returns it.
Its variables keep their structure, and afterwards:

- every float `nnx.Param` is stored in the param dtype of the module that owns
  it (the policy's, or its class override's);
- every module's float `dtype` and `param_dtype` attributes (and those of a
  dataclass attribute such as a `config` carrying them) are its owner's
  policy's compute and param dtypes, so a layer built with
  `dtype=jnp.float32` computes in the compute dtype;
- while the model runs, every float param reads as the running module's
  compute dtype (`self.w.value`, `self.w[...]`, in built-in layers and in
  user-written modules that call `jnp` directly), and gradients flow back
  through the cast, so they come back in the params' dtype;
- the model's float inputs are cast to the compute dtype and its float outputs
  to the output dtype, for `__call__` and for its other methods called from
  outside (`model.encode(x)`); other arguments (`nnx.Rngs`, `nnx.Variable`s,
  modules) pass through by reference;
- modules whose class has an override (by default LayerNorm, RMSNorm,
  BatchNorm and GroupNorm: float32 params and compute) get their inputs cast
  to the override's compute dtype and their outputs back to the enclosing
  compute dtype (or to the override's output dtype for user overrides);
- other variables (`nnx.BatchStat`, RNG state, counters) keep their dtypes;
- with `fp8=recipe`, every `nnx.Linear`, `nnx.LinearGeneral` and `nnx.Einsum`
  (but those excluded, and those given their own `dot_general` or
  `einsum_op`) runs its matmul in FP8 and holds its FP8 state in an
  `Fp8Meta` variable `fp8_meta` (`fp8_nnx.py`).

How: the model's class, and the class of each overridden module inside it, is
swapped for a cached subclass whose public methods apply the policy, and each
float param's class for a cached subclass of its own (still an `nnx.Param`)
whose `get_value` (and the array attributes it forwards, `.T`, `.reshape`)
casts to the running module's compute dtype while a wrapped call is running,
like linen's `self.param`; an FP8 layer's class for one
whose `dot_general` (`einsum_op`) is the FP8 matmul. Nothing but an FP8
layer's `fp8_meta` (see `fp8_nnx.py`) is written during a call, so
`nnx.split`/`nnx.merge`, `nnx.jit`, `nnx.grad`, `nnx.Optimizer` and plain
`jax.jit` over a closure all see an ordinary model.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import inspect
import threading
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import flax.nnx as nnx
import jax
from flax.nnx import graph as nnx_graph

from jmp_train._src import fp8_nnx, fp8_recipe, patterns
from jmp_train._src import policy as policy_lib

DEFAULT_FLOAT32_MODULES = (
  nnx.LayerNorm,
  nnx.RMSNorm,
  nnx.BatchNorm,
  nnx.GroupNorm,
)

_CONFIG = "_jmp_train_policy"
# A module's dtype attributes as written, for a later wrap: ((name, value), ...)
_ORIGINAL_DTYPES = "_jmp_train_dtypes"


class _Config(NamedTuple):
  """What a converted module applies; a static (hashable) module attribute."""

  policy: policy_lib.Policy
  output_to_enclosing: bool  # defaults return to the enclosing compute dtype
  is_root: bool  # the module `wrap` was called on
  arguments: tuple = ()  # a root's other `wrap` arguments, as (name, value)


class _Context(threading.local):
  def __init__(self):
    self.policies: list[policy_lib.Policy] = []  # running modules' policies
    self.modules: list[nnx.Module] = []  # the converted modules running


_CTX = _Context()


def _owners(model: nnx.Module) -> tuple[list, list]:
  """Each module's and each float param's owner config.

  The owner is the nearest enclosing module (itself included) converted by
  `wrap`: the root's, an override's or an inner `wrap`'s.

  Returns:
    `(modules, params)`: a list of (module, owner config, whether an inner
    wrap encloses it, its path) and a list of (param, owner config), each
    node once.
  """
  configs: dict[tuple, _Config] = {}
  modules: dict[int, tuple] = {}
  params: dict[int, tuple] = {}
  for path, node in nnx.iter_graph(model):
    path = tuple(path)
    if isinstance(node, nnx.Module):
      config = getattr(node, _CONFIG, None)
      if config is not None:
        configs[path] = config
      modules.setdefault(id(node), (node, path))
    elif isinstance(node, nnx.Param) and policy_lib.is_castable(
      node.get_value()
    ):
      params.setdefault(id(node), (node, path))

  def owner(path: tuple, end: int) -> _Config:
    return next(
      configs[path[:e]] for e in range(end, -1, -1) if path[:e] in configs
    )

  def in_inner_wrap(path: tuple) -> bool:
    return any(
      path[:e] in configs and configs[path[:e]].is_root
      for e in range(1, len(path) + 1)
    )

  return (
    [(m, owner(p, len(p)), in_inner_wrap(p), p) for m, p in modules.values()],
    [(v, owner(p, len(p) - 1)) for v, p in params.values()],
  )


def _selectors(items: Any, argument: str, accepted: str = "") -> tuple:
  """Module classes and path patterns (`respect_dtype_fields`,
  `fp8_exclude`), validated, as a tuple."""
  if isinstance(items, (str, type)):
    items = (items,)
  try:
    items = tuple(items)
  except TypeError:
    items = (items,)
  for item in items:
    if not (
      isinstance(item, str)
      or (isinstance(item, type) and issubclass(item, nnx.Module))
    ):
      raise TypeError(
        f"{argument} takes {accepted}flax.nnx Module classes and path "
        f"patterns (str), got {item!r}."
      )
  return items


def _selected(module: nnx.Module, path: tuple, item: type | str) -> bool:
  """Whether `item` (a class, or a pattern on the module's attribute name or
  its "/"-joined path, as linen matches names and paths) selects `module`."""
  if isinstance(item, type):
    return isinstance(module, item)
  names = ["/".join(map(str, path)), *(map(str, path[-1:]))]
  return any(fnmatch.fnmatchcase(name, item) for name in names)


def _every_path(model: nnx.Module) -> dict[int, tuple]:
  """Each module of `model`, by id, with every path it sits at.

  `nnx.iter_graph` gives a shared module once, at its first path; a name
  pattern may name it at another (`self.tied = self.enc`).
  """
  found: dict[int, tuple] = {}

  def walk(node: Any, path: tuple, above: frozenset) -> None:
    if isinstance(node, nnx.Module):
      found.setdefault(id(node), (node, []))[1].append(path)
    impl = nnx_graph.get_node_impl(node)
    if impl is None or id(node) in above:
      return
    for key, child in impl.node_dict(node).items():
      if nnx_graph.is_node(child):
        walk(child, (*path, key), above | {id(node)})

  walk(model, (), frozenset())
  return found


def _selected_paths(every: dict[int, tuple], items: tuple) -> list[tuple]:
  """The paths (from `_every_path`) at which one of `items` selects."""
  return [
    path
    for node, paths in every.values()
    for path in paths
    if any(_selected(node, path, item) for item in items)
  ]


def _inside(path: tuple, paths: list) -> bool:
  """Whether `path` is one of `paths` or inside one of them."""
  return any(path[: len(p)] == p for p in paths)


def _respected(every: dict[int, tuple], modules: list, respect: bool | tuple):
  """`modules` (from `_owners`) with whether each keeps its dtype attributes:
  all with True; with selectors, those matching (at any of their paths in
  `every`, from `_every_path`) and everything inside them."""
  matched = [] if respect is True else _selected_paths(every, respect or ())
  for module, config, in_inner_wrap, path in modules:
    paths = every.get(id(module), (module, [path]))[1]
    respected = respect is True or any(_inside(p, matched) for p in paths)
    yield module, config, in_inner_wrap, respected


def _set_dtype_attributes(module: nnx.Module, policy) -> None:
  """Gives `module` the dtype attributes it has as written, then `policy`'s.

  With `policy` None, only the attributes as written are restored.
  """
  if _ORIGINAL_DTYPES in vars(module):
    for name, value in getattr(module, _ORIGINAL_DTYPES):
      setattr(module, name, value)
    object.__delattr__(module, _ORIGINAL_DTYPES)
  if policy is None:
    return
  attributes = vars(module)
  updates = policy_lib.dtype_updates(attributes, policy)
  for name, value in attributes.items():
    if (
      name.startswith("_pytree__")
      or name in updates
      or isinstance(value, type)
      or not dataclasses.is_dataclass(value)
      or nnx_graph.is_graph_node(value)
    ):
      continue
    config = policy_lib.with_policy_dtypes(value, policy)
    if config is not None:  # a config carrying dtypes, read at call time
      updates[name] = config
  originals = tuple((name, attributes[name]) for name in sorted(updates))
  for name, value in updates.items():
    setattr(module, name, value)
  if originals:
    object.__setattr__(module, _ORIGINAL_DTYPES, originals)


def _cast_arrays(tree: Any, dtype: Any) -> Any:
  """Float arrays cast to `dtype`; NNX graph nodes passed by reference."""
  return policy_lib.cast_arrays(tree, dtype, nnx_graph.is_graph_node)


def _run(self, base, args, kwargs):
  """Calls `base`, a method of converted module `self`, under its policy."""
  config: _Config = getattr(self, _CONFIG)
  policy, policies = config.policy, _CTX.policies
  if not policies and not config.is_root:
    return base(*args, **kwargs)  # an inner module, called on its own
  if any(m is self for m in _CTX.modules):
    return base(*args, **kwargs)  # one of its methods calls another
  enclosing = policies[-1].compute_dtype if policies else None
  args = tuple(_cast_arrays(a, policy.compute_dtype) for a in args)
  kwargs = {k: _cast_arrays(v, policy.compute_dtype) for k, v in kwargs.items()}
  policies.append(policy)
  _CTX.modules.append(self)
  try:
    if config.is_root:
      out = base(*args, **kwargs)
    else:  # an override: autocast runs what it traces here as written
      with jax.named_scope(policy_lib.OVERRIDE_SCOPE):
        out = base(*args, **kwargs)
  finally:
    policies.pop()
    _CTX.modules.pop()
  if config.output_to_enclosing and enclosing is not None:
    return _cast_arrays(out, enclosing)
  return _cast_arrays(out, policy.output_dtype)


def _policy_method(name: str, fn):
  """Method `name` of a module class (`fn`), run under the module's policy."""

  def method(self, *args, **kwargs):
    return _run(self, getattr(super(type(self), self), name), args, kwargs)

  return functools.wraps(fn)(method) if fn is not None else method


def _cast_on_read(self, **kwargs):
  value = super(type(self), self).get_value(**kwargs)
  policies = _CTX.policies
  if not policies:
    return value
  return policy_lib.cast_floating(value, policies[-1].compute_dtype)


def _attribute_on_read(self, name: str) -> Any:
  # nnx.Variable forwards an attribute it lacks (`.T`, `.reshape`,
  # `.astype`, `.dtype`) to its stored value, past `get_value`: read it from
  # `get_value` instead, so `h @ self.embed.embedding.T` is cast as
  # `self.embed.embedding[...]` is. Private names, metadata and attributes
  # the value lacks (a `hasattr` probe) stay flax's, with no cast.
  variable_getattr = super(type(self), self).__getattr__
  metadata = object.__getattribute__(self, "_var_metadata")
  if name.startswith("_") or name in metadata:
    return variable_getattr(name)
  variable_getattr(name)  # AttributeError as flax raises it
  return getattr(self.get_value(), name)


def _policy_methods(cls: type, names: tuple[str, ...]) -> dict[str, Any]:
  """`__call__` and the methods `names` of `cls`, to run under a policy."""
  methods = {"__call__": inspect.getattr_static(cls, "__call__", None)}
  for name in names:
    fn = inspect.getattr_static(cls, name, None)
    if not inspect.isfunction(fn):
      raise ValueError(
        f"methods: {name!r} is not a method of {cls.__name__} (got {fn!r}); "
        "name the model's own methods that compute, such as 'encode'."
      )
    methods[name] = fn
  return methods


_CLASSES: dict[tuple[type, str], type] = {}


def _subclass(cls: type, kind: str, methods: Mapping[str, Any]) -> type:
  """`cls` with `methods` replaced; one cached class per (cls, kind).

  Same name, module and slots, so the instance's class can be swapped and
  graphdefs (which record the class) stay equal across wraps.
  """
  if getattr(cls, "_jmp_train_kind", None) == kind:
    return cls
  key = (cls, kind)
  if key not in _CLASSES:
    _CLASSES[key] = type(cls)(
      cls.__name__,
      (cls,),
      {
        **methods,
        "_jmp_train_kind": kind,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__slots__": (),
      },
    )
  return _CLASSES[key]


def _original_class(cls: type) -> type:
  """The class as written, under the subclasses `wrap` swapped in."""
  while getattr(cls, "_jmp_train_kind", None) is not None:
    cls = cls.__mro__[1]
  return cls


def _unconvert(module: nnx.Module) -> None:
  """Gives `module` back its class as written, and no policy."""
  object.__setattr__(module, "__class__", _original_class(type(module)))
  if _CONFIG in vars(module):
    object.__delattr__(module, _CONFIG)


def _set_fp8(module: nnx.Module, recipe, path: tuple) -> None:
  """Runs the matmul of `module` (as written) in FP8 with `recipe`, if it is
  an FP8 layer and `recipe` is not None; otherwise drops a previous wrap's
  FP8 state."""
  members = None if recipe is None else fp8_nnx.fp8_members(module)
  if members is None:
    fp8_nnx.remove(module)
    return
  fp8_nnx.install(module, recipe, "/".join(map(str, path)))
  cls = _subclass(type(module), "fp8", members)
  object.__setattr__(module, "__class__", cls)


def wrap_arguments(model: nnx.Module) -> dict[str, Any]:
  """The `overrides`, `methods`, `respect_dtype_fields`, `fp8` and
  `fp8_exclude` that `model` was last wrapped with (empty if it was not), to
  wrap it again alike."""
  config = getattr(model, _CONFIG, None)
  if config is None or not config.is_root:
    return {}
  arguments = dict(config.arguments)
  arguments["overrides"] = dict(arguments["overrides"]) or None
  return arguments


def _convert(
  module: nnx.Module, config: _Config, names: tuple[str, ...] = ()
) -> None:
  """Runs `module` (as written, or an FP8 layer) under `config`'s policy."""
  cls = type(module)
  methods = {
    name: _policy_method(name, fn)
    for name, fn in _policy_methods(cls, names).items()
  }
  kind = "module:" + ",".join(names)
  object.__setattr__(module, "__class__", _subclass(cls, kind, methods))
  object.__setattr__(module, _CONFIG, config)


def wrap(
  model: nnx.Module,
  policy: policy_lib.Policy | str,
  overrides: Mapping[type, policy_lib.Policy | str | None] | None = None,
  *,
  methods: Iterable[str] = (),
  respect_dtype_fields: bool | Iterable[type | str] = False,
  fp8: fp8_recipe.Recipe | str | bool | None = None,
  fp8_exclude: Iterable[type | str] = (),
) -> nnx.Module:
  """Converts `model` in place to run under `policy`, and returns it.

  Under the policy every module computes in its compute dtype and stores its
  params in its param dtype, whatever it was built with: a float `dtype` or
  `param_dtype` attribute (`nnx.Linear(..., dtype=jnp.float32)`), and those
  of a dataclass attribute such as a `config` carrying them, are set to the
  policy's (the override's, for an overridden module); None and non-float
  values are left alone. The values as written are remembered, so wrapping
  again (with another policy, or `respect_dtype_fields=True`) starts from
  them.

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
    methods: names of the model's methods, besides `__call__`, that apply
      the policy when called from outside (`("encode", "decode")`). Other
      methods (getters, setters, a regulariser reading the params) run
      as written: the policy casts their arguments and reads, which would
      round a float32 value a setter stores.
    respect_dtype_fields: keep modules' own `dtype`/`param_dtype` attributes
      (Flax's behaviour without a policy): True for every module, or module
      classes and patterns matched against the "/"-joined attribute path
      (`"head"`, `"blocks/*/mlp"`) for those modules and everything inside
      them. A layer built with `dtype=jnp.float32` then computes in float32,
      since Flax casts its inputs and params back; its params are still
      stored in the param dtype and read in the compute dtype (use
      `overrides` for a module that must keep float32 params too). A
      pattern that matches no module raises `ValueError`.
    fp8: a `jmp_train.fp8` recipe (`DelayedScaling`, `CurrentScaling`,
      `BlockwiseScaling`), a recipe name ("delayed", "current", "blockwise")
      or True (the default, `CurrentScaling()`) to run the matmul of every
      `nnx.Linear`, `nnx.LinearGeneral` and `nnx.Einsum` inside the model in
      FP8. Each gets an attribute `fp8_meta`, an `Fp8Meta` variable (not an
      `nnx.Param`) holding its `jmp_train.fp8.Fp8DotState`, advanced once
      per step by `update_fp8` (or by `train.make_train_step`); layers built
      stacked by `nnx.vmap` get one state per layer. Layers given their own
      `dot_general`, `dot_general_cls` or `einsum_op` keep it. A state kept
      from an earlier wrap with the same recipe is kept; None or False
      removes FP8.
    fp8_exclude: modules kept out of FP8, with everything inside them: module
      classes, or glob patterns matched against the attribute name and the
      "/"-joined path (`"head"`, `"blocks/*/attention"`). With `fp8` set, a
      pattern that matches no module raises `ValueError`.

  Returns:
    `model` itself: same object, same attributes, same `nnx.state` structure
    (plus the FP8 layers' `fp8_meta`), its float params stored in their
    owners' param dtypes. `__call__` and the `methods` named apply the policy
    when called from outside; float arrays among their arguments are cast,
    other arguments (`nnx.Rngs`, `nnx.Variable`s, modules) are passed as they
    are.

  Example:
    >>> import jax.numpy as jnp, flax.nnx as nnx, numpy as np, jmp_train
    >>> class MLP(nnx.Module):
    ...   def __init__(self, rngs):
    ...     self.dense = nnx.Linear(4, 8, dtype=jnp.float32, rngs=rngs)
    ...     self.norm = nnx.LayerNorm(8, rngs=rngs)
    ...   def __call__(self, x):
    ...     return self.norm(self.dense(x))
    >>> model = jmp_train.nnx.wrap(MLP(nnx.Rngs(0)), "p=bf16,c=bf16,o=f32")
    >>> model.dense.kernel.dtype, model.norm.scale.dtype
    (dtype(bfloat16), dtype('float32'))
    >>> np.dtype(model.dense.dtype).name  # built float32, computes bfloat16
    'bfloat16'
    >>> model(jnp.ones((1, 4))).dtype
    dtype('float32')
  """
  if not isinstance(model, nnx.Module):
    raise TypeError(f"wrap expects a flax.nnx Module, got {model!r}.")
  policy = policy_lib.get_policy(policy)
  table = policy_lib.override_table(
    policy, overrides, DEFAULT_FLOAT32_MODULES, nnx.Module, "flax.nnx"
  )
  if isinstance(methods, str):
    methods = (methods,)
  if isinstance(methods, Iterable):
    methods = tuple(methods)
  if not isinstance(methods, tuple) or not all(
    isinstance(m, str) for m in methods
  ):
    raise TypeError(
      f"methods takes names of the model's methods (str), got {methods!r}."
    )
  recipe = fp8_recipe.check_recipe(fp8, "fp8")
  fp8_exclude = _selectors(fp8_exclude, "fp8_exclude")
  respect = respect_dtype_fields
  if not isinstance(respect, bool):
    respect = _selectors(respect, "respect_dtype_fields", "True/False, or ")
  modules = [
    (tuple(path), node)
    for path, node in nnx.iter_graph(model)
    if isinstance(node, nnx.Module) and node is not model
  ]
  inner_roots = [  # a user's own wraps inside the model keep their policy
    path
    for path, node in modules
    if getattr(node, _CONFIG, None) is not None
    and getattr(node, _CONFIG).is_root
  ]
  every = _every_path(model)  # a shared module at each of its paths
  # Kept out of FP8, with everything inside them.
  excluded = _selected_paths(every, fp8_exclude)

  def fp8_of(node: nnx.Module) -> Any:
    paths = every[id(node)][1]
    return None if any(_inside(p, excluded) for p in paths) else recipe

  paths = [p for _, node_paths in every.values() for p in node_paths]
  if recipe is not None:
    patterns.refuse_unmatched("fp8_exclude", fp8_exclude, paths, "modules")
  if isinstance(respect, tuple):
    patterns.refuse_unmatched("respect_dtype_fields", respect, paths, "modules")
  for path, node in modules:
    if _inside(path, inner_roots):
      continue
    _unconvert(node)  # as written, whatever this model's previous wrap did
    _set_fp8(node, fp8_of(node), path)
    override = policy_lib.find_override(node, table)
    if override is not None:
      _, sub_policy, to_enclosing = override
      _convert(node, _Config(sub_policy, to_enclosing, False))
  arguments = (
    ("overrides", tuple((overrides or {}).items())),
    ("methods", methods),
    ("respect_dtype_fields", respect),
    ("fp8", recipe),
    ("fp8_exclude", fp8_exclude),
  )
  _unconvert(model)
  _set_fp8(model, fp8_of(model), ())
  _convert(model, _Config(policy, False, True, arguments), methods)
  modules, params = _owners(model)
  for module, config, in_inner_wrap, respected in _respected(
    every, modules, respect
  ):
    if not in_inner_wrap:  # an inner wrap set its modules' dtype attributes
      _set_dtype_attributes(module, None if respected else config.policy)
  for param, config in params:
    param.set_value(
      policy_lib.cast_floating(param.get_value(), config.policy.param_dtype)
    )
    cls = _subclass(
      type(param),
      "param",
      {"get_value": _cast_on_read, "__getattr__": _attribute_on_read},
    )
    object.__setattr__(param, "__class__", cls)
  return model
