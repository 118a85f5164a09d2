"""The per-matmul FP8 state and its one update per step, for every recipe.

Each FP8 matmul multiplies its input, kernel and output gradient by scales
before casting them to FP8 (`fp8_dot.py`, `fp8_block.py`); the recipes and
their scale rules are in `fp8_recipe.py`. The state of one matmul
(`Fp8DotState`) lives in the Flax variable collection "fp8_meta", beside
"params", never inside them (under NNX, in `Fp8Meta` variables).

This step's amaxes (max |value|) come out of the backward pass as the
gradient of zero-valued `amax` entries of that state (one per call of the
matmul); the gradients of `scale` and `amax_history` are zero. A train step
therefore:

    fp8_grads = grad(loss, argnums=fp8_meta)    # beside the params' gradients
    fp8_grads = max over micro-batches, pmax over devices    (amaxes >= 0)
    fp8_meta  = update(fp8_meta, fp8_grads, finite=finite)   (once per step)

`update` is the one place the state changes; it holds it on a skipped step.
Under `DelayedScaling` it rolls the amaxes into a history of
`amax_history_len` entries (entry 0 the most recent) and computes the next
step's scales from it:

    amax  = max(history)  if amax_compute_algo == "max"
            history[0]    if amax_compute_algo == "most_recent"
    scale = fp8_max / amax / 2**margin    (old scale kept if amax is 0 or
                                           not finite, or the result is inf)

The first step uses scale 1. Under `CurrentScaling` and `BlockwiseScaling`
the matmul computes its scales from the values it casts and the state only
reports: a one-entry history holding the last applied step's amaxes, and
the per-tensor scales those amaxes give (for blockwise, the scale of the
largest tile).
"""

from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from jmp_train._src import loss_scale
from jmp_train._src.fp8_recipe import (
  Recipe,
  current_scale,
  delayed_scale,
  is_delayed,
)

COLLECTION = "fp8_meta"
# The three tensors of one matmul, in the order of `scale` and `amax`.
TENSORS = ("input", "kernel", "output_grad")


@flax.struct.dataclass
class Fp8DotState:
  """The FP8 state of one matmul, for its input, kernel and output gradient.

  Attributes:
    scale: float32[..., 3]. Delayed scaling: the scales this step multiplies
      by. Current and blockwise scaling: the scales the last applied step's
      amaxes give (reported, not used by the matmul).
    amax_history: float32[..., 3, L], entry 0 the most recent; L is the
      recipe's `amax_history_len` under delayed scaling, 1 otherwise.
    amax: one float32[..., 3] of zeros per call of the matmul; their
      gradients are the call's amaxes. With the recipe's `statistics`, one
      float32[..., 3, 3] per call: amax, fraction saturated, fraction
      flushed to zero.
    fractions: float32[..., 3, 2], the last applied step's fractions
      saturated and flushed (zeros without `statistics`).
    recipe: the recipe (static).
  """

  scale: jax.Array
  amax_history: jax.Array
  amax: tuple[jax.Array, ...]
  fractions: jax.Array
  recipe: Recipe = flax.struct.field(pytree_node=False)


def is_fp8_state(x: Any) -> bool:
  """Whether `x` is an `Fp8DotState` (for `is_leaf=` in tree maps)."""
  return isinstance(x, Fp8DotState)


def amax_entry(recipe: Recipe) -> jax.Array:
  """One call's zero-valued `amax` entry (its gradient: the call's amaxes)."""
  return jnp.zeros((3, 3) if recipe.statistics else (3,), jnp.float32)


def init_state(recipe: Recipe, calls: int = 1) -> Fp8DotState:
  """The state of a matmul before its first step: scale 1, zero history."""
  length = recipe.amax_history_len if is_delayed(recipe) else 1
  return Fp8DotState(
    scale=jnp.ones((3,), jnp.float32),
    amax_history=jnp.zeros((3, length), jnp.float32),
    amax=tuple(amax_entry(recipe) for _ in range(calls)),
    fractions=jnp.zeros((3, 2), jnp.float32),
    recipe=recipe,
  )


def roll_amax_history(amax_history: jax.Array, amax: jax.Array) -> jax.Array:
  """Puts `amax` at entry 0 of the history and drops the oldest entry."""
  amax = jnp.asarray(amax, amax_history.dtype)[..., None]
  return jnp.concatenate([amax, amax_history[..., :-1]], axis=-1)


def step_state(state: Fp8DotState, amax: jax.Array) -> Fp8DotState:
  """One step of the recipe: roll `amax` (float32[..., 3]) in, rescale.

  With the recipe's `statistics`, `amax` is float32[..., 3, 3] (amax,
  fraction saturated, fraction flushed), and the fractions are kept.
  """
  recipe = state.recipe
  if recipe.statistics:
    # A sum over calls (a layer reused where no max chain runs) can pass 1.
    state = state.replace(fractions=jnp.minimum(amax[..., 1:], 1.0))
    amax = amax[..., 0]
  history = roll_amax_history(state.amax_history, amax)
  fp8_max = jnp.asarray(recipe.fp8_max, jnp.float32)
  if is_delayed(recipe):
    scale = delayed_scale(
      history,
      state.scale,
      fp8_max,
      recipe.margin,
      recipe.amax_compute_algo,
    )
  else:
    scale = current_scale(amax, fp8_max, recipe.power_of_two_scales)
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
  """Advances every FP8 state in `tree` by one step of its recipe.

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
    >>> from jmp_train.fp8 import DelayedScaling
    >>> state = init_state(DelayedScaling(amax_history_len=2))
    >>> grads = state.replace(amax=(jnp.array([2.0, 4.0, 8.0]),))
    >>> update({"dot": state}, {"dot": grads})["dot"].scale
    Array([ 224.,  112., 7168.], dtype=float32)
  """
  held, given = states(tree), states(grads)
  if len(held) != len(given):
    raise ValueError(
      f"fp8.update(tree, grads): tree holds {len(held)} FP8 state(s) and "
      f"grads {len(given)}; pass the gradients with respect to tree itself "
      "(the FP8 metadata's, not the params'), in that order."
    )
  for s, g in zip(held, given, strict=True):
    if s.recipe != g.recipe:
      raise ValueError(
        f"fp8.update: a state of recipe {s.recipe!r} was given gradients of "
        f"recipe {g.recipe!r}; pass the gradients of this model's own FP8 "
        "metadata."
      )
  pairs = list(zip(held, given, strict=True))
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


def rescale_output_grads(tree: Any, factor: jax.typing.ArrayLike) -> Any:
  """Every FP8 state in `tree` moved to output gradients `factor` times larger.

  The output gradient a matmul casts is that of the scaled loss, so its
  amax history and scale are in units of the loss scale. Switching to a
  loss scale `factor` times the old one (fp16's 2**15 to bf16's none:
  `factor` 2**-15) would otherwise leave a delayed scale `factor` times
  off: too small, flushing gradients to zero in FP8 for up to
  `amax_history_len` steps, or too large, clipping them. This multiplies
  each state's output-gradient history by `factor` and divides its scale
  by it (a power of two changes no other bit); a state with no history yet
  keeps its first-step scale.

  Args:
    tree: a pytree holding `Fp8DotState`s (other leaves returned as they
      are).
    factor: the new loss scale over the old, a positive finite number
      (checked when it is concrete: call it between steps, as a switch
      is made; under jit nothing can check a traced factor).

  Returns:
    `tree` with each state's output-gradient row rescaled.

  Example:
    >>> from jmp_train.fp8 import DelayedScaling
    >>> state = init_state(DelayedScaling(amax_history_len=2))
    >>> grads = state.replace(amax=(jnp.array([2.0, 4.0, 8.0]),))
    >>> state = update(state, grads)
    >>> state.amax_history[2].tolist(), float(state.scale[2])
    ([8.0, 0.0], 7168.0)
    >>> moved = rescale_output_grads(state, 2.0**-4)  # a loss scale 16x smaller
    >>> moved.amax_history[2].tolist(), float(moved.scale[2])
    ([0.5, 0.0], 114688.0)
  """
  factor = jnp.asarray(factor, jnp.float32)
  if factor.shape != () or (
    not isinstance(factor, jax.core.Tracer)
    and not bool(jnp.isfinite(factor) & (factor > 0))
  ):
    raise ValueError(
      f"rescale_output_grads: factor must be a positive finite scalar (the "
      f"new loss scale over the old), got {factor!r}."
    )
  row = TENSORS.index("output_grad")

  def rescale(state: Fp8DotState) -> Fp8DotState:
    history = state.amax_history[..., row, :]
    seen = jnp.any(history > 0, axis=-1)
    scale = state.scale[..., row]
    return state.replace(
      amax_history=state.amax_history.at[..., row, :].set(history * factor),
      scale=state.scale.at[..., row].set(
        jnp.where(seen, scale / factor, scale)
      ),
    )

  return jax.tree.map(
    lambda x: rescale(x) if is_fp8_state(x) else x, tree, is_leaf=is_fp8_state
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
