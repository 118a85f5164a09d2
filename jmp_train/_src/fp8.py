"""FP8 delayed scaling: the recipe, the scale rule and the per-matmul state.

Transformer Engine's recipe: each FP8 matmul multiplies its input, kernel and
output gradient by a scale before casting them to FP8 (`fp8_dot.py` does the
matmul). Each scale is *delayed*: it comes from the amaxes (max |value|) of
previous steps, kept in a history of `amax_history_len` entries (entry 0 the
most recent), rolled once per step:

    amax  = max(history)  if amax_compute_algo == "max"
            history[0]    if amax_compute_algo == "most_recent"
    scale = fp8_max / amax / 2**margin    (old scale kept if amax is 0 or
                                           not finite, or the result is inf)

The first step uses scale 1. The state of one matmul (`Fp8DotState`) lives in
the Flax variable collection "fp8_meta", beside "params", never inside them.
This step's amaxes come out of the backward pass as the gradient of
zero-valued `amax` entries of that state (one per call of the matmul); the
gradients of `scale` and `amax_history` are zero. A train step therefore:

    fp8_grads = grad(loss, argnums=fp8_meta)    # beside the params' gradients
    fp8_grads = max over micro-batches, pmax over devices    (amaxes >= 0)
    fp8_meta  = update(fp8_meta, fp8_grads, finite=finite)   (once per step)

`update` is the one place the state changes; it holds it on a skipped step.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jmp_train._src import loss_scale

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
FORMATS = ("hybrid", "e4m3")
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
COLLECTION = "fp8_meta"
# The three tensors of one matmul, in the order of `scale` and `amax`.
TENSORS = ("input", "kernel", "output_grad")


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
  """Delayed-scaling options, as Transformer Engine and NeMo name them.

  Attributes:
    format: "hybrid" (E4M3 forward, E5M2 gradients) or "e4m3" (E4M3 for
      both).
    margin: the scale is divided by 2**margin (headroom against growth);
      a non-negative int.
    amax_history_len: how many steps of amax the scale looks back over.
    amax_compute_algo: "max" (the largest amax in the history) or
      "most_recent" (the last step's amax).

  Example:
    >>> recipe = Fp8Recipe(margin=1, amax_history_len=16)
    >>> recipe.fp8_max
    (448.0, 448.0, 57344.0)
  """

  format: str = "hybrid"
  margin: int = 0
  amax_history_len: int = 1024
  amax_compute_algo: str = "max"

  def __post_init__(self):
    if self.format not in FORMATS:
      raise ValueError(
        f"Unknown FP8 format {self.format!r}: accepted formats are "
        f"{', '.join(map(repr, FORMATS))}."
      )
    if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
      raise ValueError(
        f"Unknown amax_compute_algo {self.amax_compute_algo!r}: accepted "
        f"values are {', '.join(map(repr, AMAX_COMPUTE_ALGOS))}."
      )
    for name, low in (("margin", 0), ("amax_history_len", 1)):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}.")

  @property
  def forward_dtype(self) -> np.dtype:
    """The FP8 dtype of inputs and kernels: E4M3."""
    return E4M3

  @property
  def backward_dtype(self) -> np.dtype:
    """The FP8 dtype of output gradients: E5M2 (hybrid) or E4M3."""
    return E5M2 if self.format == "hybrid" else E4M3

  @property
  def fp8_max(self) -> tuple[float, float, float]:
    """The largest FP8 value for input, kernel and output gradient."""
    fwd, bwd = FP8_MAX[self.forward_dtype], FP8_MAX[self.backward_dtype]
    return (fwd, fwd, bwd)


@flax.struct.dataclass
class Fp8DotState:
  """The FP8 state of one matmul, for its input, kernel and output gradient.

  Attributes:
    scale: float32[..., 3], the scales this step multiplies by.
    amax_history: float32[..., 3, amax_history_len], entry 0 the most recent.
    amax: one float32[..., 3] of zeros per call of the matmul; their
      gradients are the call's amaxes.
    recipe: the `Fp8Recipe` (static).
  """

  scale: jax.Array
  amax_history: jax.Array
  amax: tuple[jax.Array, ...]
  recipe: Fp8Recipe = flax.struct.field(pytree_node=False)


def is_fp8_state(x: Any) -> bool:
  """Whether `x` is an `Fp8DotState` (for `is_leaf=` in tree maps)."""
  return isinstance(x, Fp8DotState)


def init_state(recipe: Fp8Recipe, calls: int = 1) -> Fp8DotState:
  """The state of a matmul before its first step: scale 1, zero history."""
  return Fp8DotState(
    scale=jnp.ones((3,), jnp.float32),
    amax_history=jnp.zeros((3, recipe.amax_history_len), jnp.float32),
    amax=tuple(jnp.zeros((3,), jnp.float32) for _ in range(calls)),
    recipe=recipe,
  )


def compute_scale(
  amax_history: jax.Array,
  scale: jax.Array,
  fp8_max: jax.typing.ArrayLike,
  margin: int = 0,
  amax_compute_algo: str = "max",
) -> jax.Array:
  """The delayed scale from an amax history (last axis; entry 0 most recent).

  `fp8_max / amax / 2**margin`, where `amax` is the history's max or its
  entry 0; where that amax is zero or not finite, or the scale would be
  infinite, the previous `scale` is kept.
  """
  if amax_compute_algo == "max":
    amax = jnp.max(amax_history, axis=-1)
  elif amax_compute_algo == "most_recent":
    amax = amax_history[..., 0]
  else:
    raise ValueError(
      f"Unknown amax_compute_algo {amax_compute_algo!r}: accepted values are "
      f"{', '.join(map(repr, AMAX_COMPUTE_ALGOS))}."
    )
  amax = amax.astype(jnp.float32)
  new = jnp.asarray(fp8_max, jnp.float32) / amax / jnp.float32(2.0**margin)
  ok = (amax > 0) & jnp.isfinite(amax) & jnp.isfinite(new)
  return jnp.where(ok, new, scale)


def roll_amax_history(amax_history: jax.Array, amax: jax.Array) -> jax.Array:
  """Puts `amax` at entry 0 of the history and drops the oldest entry."""
  amax = jnp.asarray(amax, amax_history.dtype)[..., None]
  return jnp.concatenate([amax, amax_history[..., :-1]], axis=-1)


def step_state(state: Fp8DotState, amax: jax.Array) -> Fp8DotState:
  """One step of delayed scaling: roll `amax` (float32[..., 3]) in, rescale."""
  recipe = state.recipe
  history = roll_amax_history(state.amax_history, amax)
  scale = compute_scale(
    history,
    state.scale,
    jnp.asarray(recipe.fp8_max, jnp.float32),
    recipe.margin,
    recipe.amax_compute_algo,
  )
  return state.replace(scale=scale, amax_history=history)


def states(tree: Any) -> list[Fp8DotState]:
  """The `Fp8DotState`s in `tree`, in tree order."""
  return [
    s for s in jax.tree.leaves(tree, is_leaf=is_fp8_state) if is_fp8_state(s)
  ]


def combined_amax(grad_state: Fp8DotState) -> jax.Array:
  """This step's amaxes of one matmul: the max over its calls."""
  return functools.reduce(jnp.maximum, grad_state.amax)


def update(
  tree: Any, grads: Any, *, finite: jax.typing.ArrayLike | None = None
) -> Any:
  """Advances every FP8 state in `tree` by one step of delayed scaling.

  Call it once per train step with the gradients of the loss with respect to
  `tree` (which may hold params too: other leaves are returned unchanged).
  Only the gradients of the `amax` entries are read: each is a call's amaxes,
  >= 0 (or not finite), so gradients of several micro-batches or devices
  combine by elementwise max (`jnp.maximum` over the whole tree, then
  `jax.lax.pmax`), with zeros as the neutral start; the zero gradients of
  `scale` and `amax_history` stay zero under that max. Nothing changes when
  `finite` is False (a skipped step: pass
  `train_metrics(opt_state)["last_step_finite"]`) or when any of this step's
  amaxes is not finite, since one non-finite amax would freeze a "max" scale
  for the whole history. `jnp.maximum` keeps a NaN but `lax.pmax` may drop
  it (on CPU it does), so a step reducing over devices passes its global
  `finite`.

  Args:
    tree: a pytree holding `Fp8DotState`s (the "fp8_meta" collection, or the
      whole variables).
    grads: the gradients with respect to `tree`, or such gradients combined
      by max; its `Fp8DotState`s in the same order as `tree`'s.
    finite: whether the step was applied; None means yes.

  Returns:
    `tree` with each FP8 state's history rolled and scale recomputed.

  Example:
    >>> state = init_state(Fp8Recipe(amax_history_len=2))
    >>> grads = state.replace(amax=(jnp.array([2.0, 4.0, 8.0]),))
    >>> update({"dot": state}, {"dot": grads})["dot"].scale
    Array([ 224.,  112., 7168.], dtype=float32)
  """
  pairs = list(zip(states(tree), states(grads), strict=True))
  if not pairs:
    return tree
  amaxes = [combined_amax(g) for _, g in pairs]
  ok = jnp.all(jnp.stack([jnp.all(jnp.isfinite(a)) for a in amaxes]))
  if finite is not None:
    ok = ok & jnp.asarray(finite, jnp.bool_)
  advanced = iter(
    loss_scale.select_tree(ok, step_state(s, amax), s)
    for (s, _), amax in zip(pairs, amaxes, strict=True)
  )
  return jax.tree.map(
    lambda x: next(advanced) if is_fp8_state(x) else x,
    tree,
    is_leaf=is_fp8_state,
  )


def scales(tree: Any) -> dict[str, jax.Array]:
  """The smallest and largest scale per tensor kind over all FP8 matmuls."""
  found = states(tree)
  if not found:
    return {}
  out = {}
  for i, name in enumerate(TENSORS):
    values = jnp.concatenate([s.scale[..., i].reshape(-1) for s in found])
    out[f"fp8_{name}_scale_min"] = jnp.min(values)
    out[f"fp8_{name}_scale_max"] = jnp.max(values)
  return out
