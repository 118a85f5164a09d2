"""Which optimizer-state fields `mixed_precision` stores in which format.

`mixed_precision(inner, state_formats=...)` takes None, one format, or a
dict from state field name to format (`state_format.py` has the formats). A
state field is a field of a NamedTuple state of `inner` (optax's states,
found inside chains, named chains, `inject_hyperparams`, `MultiSteps`,
`masked` and `multi_transform`); it *mirrors the params* when it holds one
array per param, shaped like it (`optax.MaskedNode()` where a param is
masked out).

* A dict stores the fields it names, and only those; a name that is no
  mirroring field is refused.
* One format stores the *moments*, the mirroring fields named in
  `MOMENT_FIELDS` (Adam's `mu` and `nu`, momentum's `trace`, ...). Other
  mirroring fields can be copies of the params themselves (schedule-free's
  `z`, Prodigy's `params0`) or accumulated gradients (`MultiSteps`'
  `acc_grads`): name them in a dict to store them below float32.

`leaf_formats` gives one format (or `KEEP`) per leaf of the inner state;
`compress_state` and `expand_state` apply it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_train._src import leaves, rounding
from jmp_train._src import state_format as sf

# The moment fields of optax's optimizers: Adam/AdamW/Lion/AMSGrad/RMSProp/
# Adadelta/Novograd/Belief (mu, nu, nu_max, e_g, e_x), momentum (trace) and
# EMAs (ema).
MOMENT_FIELDS = ("mu", "nu", "nu_max", "trace", "ema", "e_g", "e_x")


@dataclasses.dataclass(frozen=True)
class _Keep:
  """The format-tree entry of a state leaf kept as the optimizer made it."""


KEEP = _Keep()


def check_formats(value: Any, name: str = "state_formats") -> Any:
  """`state_formats` validated: None, one format, or a mapping by field name
  (returned as a dict)."""
  if value is None or isinstance(value, sf.FORMATS):
    return value
  if isinstance(value, type) and issubclass(value, sf.FORMATS):
    raise TypeError(
      f"{name} must be a format instance, got the class {value.__name__}; "
      f"pass {value.__name__}()."
    )
  if isinstance(value, Mapping):
    for field, fmt in value.items():
      if not isinstance(field, str):
        raise TypeError(
          f"{name} keys must be state field names (str, e.g. 'mu'), got "
          f"{field!r}."
        )
      sf.check(fmt, f"{name}[{field!r}]")
    return dict(value)
  raise TypeError(
    f"{name} must be None, one format for the optimizer's moments, or a "
    "dict from state field name to format (e.g. {'mu': FP8(), 'nu': "
    f"BFloat16()}}) with formats {sf.ACCEPTED}; got {value!r}."
  )


def _mirrors(value: Any, view: Any) -> bool:
  """Whether `value` holds one array per param of `view`, shaped like it,
  or a masked-out hole."""
  flat_value, tree_value = jax.tree.flatten(value, is_leaf=_is_stored_leaf)
  flat_view, tree_view = jax.tree.flatten(view, is_leaf=leaves.is_masked)
  if tree_value != tree_view:
    return False

  def shape(v):
    return np.shape(v.values if isinstance(v, sf.Scaled) else v)

  return all(
    leaves.is_masked(v)
    or (hasattr(v, "shape") or isinstance(v, sf.Scaled))
    and tuple(shape(v)) == tuple(np.shape(p))
    for v, p in zip(flat_value, flat_view, strict=True)
  )


def _is_stored_leaf(x: Any) -> bool:
  """A masked-out hole, or one leaf stored with its scales."""
  return leaves.is_masked(x) or isinstance(x, sf.Scaled)


def mirroring_leaves(state: Any, view: Any) -> list[tuple[str, Any]]:
  """`(path, leaf)` of every float leaf in a field of `state` that mirrors
  `view`, stored or not."""
  tree = leaf_formats(sf.Float32(), state, view, fields=None)
  paths = jax.tree_util.tree_flatten_with_path(tree)[0]
  stored = jax.tree.structure(tree).flatten_up_to(state)
  return [
    (leaves.keystr(path), x)
    for (path, fmt), x in zip(paths, stored, strict=True)
    if fmt is not KEEP
  ]


def leaf_formats(
  formats: Any, state: Any, view: Any, *, fields: Any = MOMENT_FIELDS
) -> Any:
  """One format (or `KEEP`) per leaf of the inner optimizer's `state`.

  Args:
    formats: None, one format, or a dict from field name to format.
    state: the inner optimizer's state (arrays or `ShapeDtypeStruct`s).
    view: the params as the inner optimizer sees them.
    fields: the fields one format stores (None: every mirroring field).

  Raises:
    ValueError: for a name that is not a mirroring field of `state`, a
      named field holding a leaf that is not a real float, or one format
      that finds no field to store.
  """
  if formats is None:
    return jax.tree.map(lambda _: KEEP, state)
  named = formats if isinstance(formats, dict) else {}
  mirroring, other = set(), set()

  def field(name, value, where):
    if not _mirrors(value, view):
      other.add(name)
      return visit(value, where)
    mirroring.add(name)
    if isinstance(formats, dict):
      fmt = named.get(name)
    else:
      fmt = formats if fields is None or name in fields else None
    if fmt is None:
      return jax.tree.map(lambda _: KEEP, value)

    def leaf(path, x):
      if isinstance(x, sf.Scaled) or leaves.is_real_float(x):
        return fmt
      if isinstance(formats, dict):
        raise ValueError(
          f"state_formats[{name!r}] is {fmt!r}, but state leaf "
          f"{leaves.keystr(where + path)!r} is {np.dtype(x.dtype).name}: "
          "formats store real float leaves (bfloat16 to float64) only."
        )
      return KEEP

    return jax.tree_util.tree_map_with_path(
      leaf, value, is_leaf=lambda x: isinstance(x, sf.Scaled)
    )

  def visit(node, where=()):
    if isinstance(node, tuple) and hasattr(node, "_fields"):
      return type(node)(
        *[
          field(n, v, (*where, jax.tree_util.GetAttrKey(n)))
          for n, v in zip(node._fields, node, strict=True)
        ]
      )
    if isinstance(node, (tuple, list)):
      return type(node)(
        visit(v, (*where, jax.tree_util.SequenceKey(i)))
        for i, v in enumerate(node)
      )
    if isinstance(node, dict):
      return {
        k: visit(v, (*where, jax.tree_util.DictKey(k))) for k, v in node.items()
      }
    return jax.tree.map(lambda _: KEEP, node)

  tree = visit(state)
  found = ", ".join(sorted(mirroring)) or "none"
  for name in named:
    if name in mirroring:
      continue
    if name in other:
      raise ValueError(
        f"state_formats names {name!r}, a field of the inner optimizer's "
        "state that does not hold one value per param, so it has no "
        f"stored format. Fields that do: {found}."
      )
    raise ValueError(
      f"state_formats names {name!r}, which is no field of the inner "
      f"optimizer's state. Fields that hold one value per param: {found}."
    )
  if not named and fields is not None and not (mirroring & set(fields)):
    raise ValueError(
      f"state_formats={formats!r} stores the optimizer's moments (fields "
      f"{', '.join(fields)}), and the inner optimizer's state has none. "
      f"Fields that hold one value per param: {found}; name them in a dict "
      "to store them below float32, or pass state_formats=None."
    )
  return tree


def state_noise(
  formats: Any, native: Any, steps: jax.Array, grouped: bool, stored: Any
) -> list:
  """The random bits each leaf that `formats` rounds stochastically takes
  at update `steps`, None for the others, in `compress_state`'s order.

  Each seed is a stream (`rounding.stream_key(seed, STATE_STREAM, steps)`)
  counted over the leaves whose format has that seed, in that order
  (`rounding.stream_bits`: in a few draws where `grouped`, else each in
  its stored leaf's layout, from `stored`; the same bits); so a resumed run
  draws the same bits. Drawn apart from `compress_state`, so
  that `mixed_precision` draws them before its skip's conditional (see
  `param_update.leaf_noise`).
  """
  flat, treedef = jax.tree.flatten(formats)
  types = treedef.flatten_up_to(native)
  kept = treedef.flatten_up_to(stored)
  out = [None] * len(flat)
  streams: dict[int, list[int]] = {}
  for index, fmt in enumerate(flat):
    if isinstance(fmt, sf.BFloat16) and fmt.rounding == "stochastic":
      streams.setdefault(fmt.seed, []).append(index)
  for seed, indices in streams.items():
    key = rounding.stream_key(seed, rounding.STATE_STREAM, steps)
    shapes = [types[index].shape for index in indices]
    layouts = [rounding.layout_of(kept[index]) for index in indices]
    drawn = rounding.stream_bits(key, shapes, grouped, layouts)
    for index, bits in zip(indices, drawn, strict=True):
      out[index] = bits
  return out


def compress_state(
  formats: Any, state: Any, noise: list | None, previous: Any = None
) -> Any:
  """`state` with each leaf stored in its format (`leaf_formats`).

  Stochastic rounding takes its leaf's values in `noise` (`state_noise`);
  with `noise=None` (the initial state) it rounds to nearest instead, so
  that update 0 draws bits no earlier rounding used.

  With `previous` (the stored state and its expansion before the update), a
  leaf whose value the update left unchanged keeps its stored bits: storing
  an expanded value again need not give the same bits in a scaled format
  (a scale can move by an ulp), and `MultiSteps`' mini-steps must not move
  the moments. Where the expansion stores back to the same bits
  (`_stores_back`: float32 or bfloat16 storage of a float32 moment; an
  exactly representable value rounds to itself, stochastically too) no
  check is made.
  """
  flat, treedef = jax.tree.flatten(formats)
  values = treedef.flatten_up_to(state)
  if previous is None:
    old = [None] * len(flat)
  else:
    old = zip(*(treedef.flatten_up_to(t) for t in previous), strict=True)
  if noise is None:
    noise = [None] * len(flat)

  def store(fmt, x, before, bits):
    if fmt is KEEP:
      return x
    if isinstance(fmt, sf.BFloat16) and fmt.rounding == "stochastic":
      if bits is None:  # init: round to nearest, leaving step 0's bits
        new = sf.compress(sf.BFloat16(), x)
      else:
        new = rounding.round_leaf(x.astype(jnp.float32), jnp.bfloat16, bits)
    else:
      new = sf.compress(fmt, x)
    if before is None or _stores_back(fmt, x.dtype):
      return new
    stored, expanded = before
    same = jnp.all(x == expanded)
    return jax.tree.map(lambda a, b: jnp.where(same, a, b), stored, new)

  out = [
    store(fmt, x, before, bits)
    for fmt, x, before, bits in zip(flat, values, old, noise, strict=True)
  ]
  return jax.tree.unflatten(treedef, out)


def _stores_back(fmt: Any, dtype: Any) -> bool:
  """Whether a `dtype` value read back from `fmt` stores back to the same
  bits (a NaN stays NaN): float32 and bfloat16 storage of a float32 or
  float64 moment, bfloat16 storage of a bfloat16 one. A float16 moment
  stored in bfloat16 is not (65504 stores as 65536, which reads back inf)."""
  dtype = np.dtype(dtype)
  if isinstance(fmt, sf.BFloat16) and dtype == jnp.bfloat16:
    return True
  wide = dtype in (np.dtype(jnp.float32), np.dtype(jnp.float64))
  return wide and isinstance(fmt, (sf.Float32, sf.BFloat16))


def expand_state(formats: Any, stored: Any, native: Any) -> Any:
  """The inner optimizer's state from `stored`, each leaf in the dtype of
  `native` (its abstract state, `jax.eval_shape(inner.init, view)`)."""
  flat, treedef = jax.tree.flatten(formats)
  values = treedef.flatten_up_to(stored)
  types = treedef.flatten_up_to(native)
  out = [
    x if fmt is KEEP else sf.expand(fmt, x, t.dtype)
    for fmt, x, t in zip(flat, values, types, strict=True)
  ]
  return jax.tree.unflatten(treedef, out)
