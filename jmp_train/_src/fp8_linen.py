"""Flax modules for FP8 matmuls: `Fp8DotGeneral` and an `Einsum` that takes it.

`nn.Dense(..., dot_general_cls=Fp8DotGeneral)` (and `nn.DenseGeneral`, and
`Einsum` below) runs its matmul with `fp8_dot.fp8_dot_general`, keeping one
`Fp8DotState` per matmul in the "fp8_meta" collection; `linen.wrap(fp8=...)`
installs it on every Dense, DenseGeneral and Einsum of a model.

Why not Flax's own `flax.linen.Fp8DirectDotGeneralOp` (alias `Fp8DotGeneral`;
`Fp8DotGeneralOp` is deprecated) and `flax.linen.Fp8Einsum` (Flax 0.12)? They
keep six float32 variables per matmul in the "_overwrite_with_gradient"
collection; their backward pass returns each variable's next value as its
gradient, and `flax.training.train_state.TrainState.apply_gradients` replaces
the collection with that gradient on every step. So:

- a step the loss scale skips still advances Flax's state: the overflowing
  step's amaxes enter the history (an inf there holds a "max" scale for the
  whole history). Ours changes only in `fp8.update`, which holds it on a
  skipped step or a non-finite amax;
- Flax's scale rule has no margin (`update_fp8_meta` calls `compute_scale`
  with margin 0) and always takes the max over the history (no
  "most_recent"); only the history length (`amax_history_length`) is
  configurable. `DelayedScaling` has all three, as Transformer Engine does;
- "gradients" of plain float32 variables add up: a module called twice gets
  the sum of two next scales and histories (so would micro-batches summed or
  devices reduced by `psum`), unless the variables use Flax's `fm32` dtype,
  whose addition is max; it is not the default. Our amaxes are one entry per
  call and combine by max.

`nn.Einsum` has no `dot_general_cls` hook, so `Einsum` adds one.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
from flax import errors as flax_errors

from jmp_train._src import fp8_dot
from jmp_train._src.fp8 import COLLECTION, amax_entry, init_state
from jmp_train._src.fp8_dot import fp8_dot_general
from jmp_train._src.fp8_param import is_fp8_param
from jmp_train._src.fp8_recipe import DEFAULT_RECIPE, Recipe

# One counter per apply (keyed by its root scope) and module path, so the n-th
# call of a shared module reads its own amax entry.
_CALLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _call_index(module: nn.Module) -> int:
  counts = _CALLS.setdefault(module.scope.root, {})
  n = counts.get(module.path, 0)
  counts[module.path] = n + 1
  return n


def _missing_state(module: nn.Module) -> str:
  """Why `module` may find no FP8 state, and the fixes (Flax names none)."""
  return (
    f"FP8 matmul {'/'.join(module.path)} finds no {COLLECTION!r} "
    "collection. Either apply was not given it: pass all the variables init "
    f"returned (params and {COLLECTION!r}), or the train state's FP8 "
    "metadata. Or it runs inside a lifted transform (nn.scan, nn.RNN, "
    "nn.vmap) that does not carry the collection: over layers, add it to "
    f"the axes, nn.scan(..., variable_axes={{'params': 0, {COLLECTION!r}: "
    "0}) (one FP8 state per layer); over time (an RNN cell), broadcast it, "
    f"nn.RNN(cell, variable_broadcast=['params', {COLLECTION!r}]), whose "
    "amaxes are summed over the steps (README, FP8 limits); or leave the "
    "layer out with wrap(..., fp8_exclude=(...))."
  )


class Fp8DotGeneral(nn.Module):
  """An FP8 `dot_general` for `nn.Dense(dot_general_cls=...)` and friends.

  Keeps an `Fp8DotState` named "fp8" in the "fp8_meta" collection. Called
  with an einsum equation in place of `dimension_numbers`, it computes that
  two-operand einsum with its matmul in FP8 (see `Einsum`).

  Example:
    >>> import functools, jax, jax.numpy as jnp, flax.linen as nn
    >>> from jmp_train.fp8 import DelayedScaling
    >>> recipe = DelayedScaling(amax_history_len=4)
    >>> dot = functools.partial(Fp8DotGeneral, recipe=recipe)
    >>> layer = nn.Dense(3, dot_general_cls=dot)
    >>> variables = layer.init(jax.random.key(0), jnp.ones((2, 5)))
    >>> variables["fp8_meta"]["Fp8DotGeneral_0"]["fp8"].amax_history.shape
    (3, 4)
  """

  recipe: Recipe = DEFAULT_RECIPE

  @nn.compact
  def __call__(
    self,
    lhs,
    rhs,
    dimension_numbers,
    precision=None,
    preferred_element_type=None,
    **kwargs,
  ):
    del precision, kwargs  # FP8 has one precision; out_sharding is unused
    try:
      var = self.variable(COLLECTION, "fp8", init_state, self.recipe)
    except flax_errors.ScopeCollectionNotFound:
      raise ValueError(_missing_state(self)) from None
    n = _call_index(self)
    state = var.value
    if state.recipe != self.recipe:
      raise ValueError(
        f"FP8 matmul {'/'.join(self.path)} was given state of recipe "
        f"{state.recipe!r} but runs recipe {self.recipe!r}: init the model "
        "with the recipe it runs (or build its state with "
        "jmp_train.fp8.init_state(recipe))."
      )
    if n >= len(state.amax):
      if not (
        self.is_initializing() and self.is_mutable_collection(COLLECTION)
      ):
        raise ValueError(
          f"FP8 matmul {'/'.join(self.path)} is called {n + 1} times but was "
          f"initialised with {len(state.amax)} call(s): init the model with "
          "the same calls as apply."
        )
      state = state.replace(amax=(*state.amax, amax_entry(self.recipe)))
      var.value = state

    def dot(lhs, rhs, dimension_numbers, precision=None, **kwargs):
      del precision  # FP8 has one precision
      return fp8_dot_general(
        lhs,
        rhs,
        dimension_numbers,
        scale=state.scale,
        amax=state.amax[n],
        recipe=self.recipe,
        preferred_element_type=kwargs.get("preferred_element_type"),
      )

    lhs = jnp.asarray(lhs)
    rhs = rhs if is_fp8_param(rhs) else jnp.asarray(rhs)
    if isinstance(dimension_numbers, str):  # an einsum equation
      return fp8_dot.einsum(
        dimension_numbers,
        lhs,
        rhs,
        functools.partial(dot, preferred_element_type=preferred_element_type),
      )
    return dot(
      lhs, rhs, dimension_numbers, preferred_element_type=preferred_element_type
    )


def einsum(module: nn.Einsum, inputs, einsum_str=None, *, dot_general):
  """nn.Einsum's computation with its matmul done by `dot_general`."""
  einsum_str = nn.module.merge_param(
    "einsum_str", module.einsum_str, einsum_str
  ).replace(" ", "")
  if "->" not in einsum_str or einsum_str.count(",") != 1:
    raise ValueError(
      f"Einsum needs an explicit two-operand equation, got {einsum_str!r}."
    )
  kernel = module.param(
    "kernel", module.kernel_init, module.shape, module.param_dtype
  )
  bias = None
  if module.use_bias:
    bias_shape, broadcast_shape = module._get_bias_shape(
      einsum_str, inputs, kernel
    )
    bias = module.param(
      "bias", module.bias_init, bias_shape, module.param_dtype
    )
  inputs, kernel, bias = keeping_fp8_params(module.promote_dtype)(
    inputs, kernel, bias, dtype=module.dtype
  )
  y = dot_general(
    inputs,
    kernel,
    einsum_str,
    preferred_element_type=module.preferred_element_type,
  )
  if bias is not None:
    y += jnp.reshape(bias, broadcast_shape)
  return y


def keeping_fp8_params(promote_dtype):
  """A module's `promote_dtype` that passes `Fp8Param` kernels through:
  the FP8 matmul reads their values as they are stored."""

  def promote(*args, **kwargs):
    plain = [a for a in args if not is_fp8_param(a)]
    promoted = iter(promote_dtype(*plain, **kwargs))
    return [a if is_fp8_param(a) else next(promoted) for a in args]

  return promote


class Einsum(nn.Einsum):
  """`nn.Einsum` with a `dot_general_cls` hook, like `nn.Dense` has.

  `Einsum(shape, "bi,io->bo", dot_general_cls=Fp8DotGeneral)` computes the
  einsum's matmul in FP8; without the hook it is `nn.Einsum`.
  """

  dot_general_cls: Any = None

  @nn.compact
  def __call__(self, inputs, einsum_str=None):
    if self.dot_general_cls is None:
      return super().__call__(inputs, einsum_str)
    return einsum(self, inputs, einsum_str, dot_general=self.dot_general_cls())
