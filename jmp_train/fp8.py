"""FP8 delayed scaling (Transformer Engine's recipe) for Flax matmuls.

A matmul `y = x @ w` runs in FP8 as

    q_x = fp8(clip(x * s_x))    q_w = fp8(clip(w * s_w))      (forward)
    y   = (q_x @ q_w) / (s_x * s_w)                            (f32 accumulation)
    q_g = fp8(clip(g * s_g))                                   (backward, g = dL/dy)
    dx  = (q_g @ q_w^T) / (s_g * s_w),  dw = (q_x^T @ q_g) / (s_g * s_x)

with E4M3 (max 448) for `x` and `w` and, in the "hybrid" format, E5M2 (max
57344) for `g`; the "e4m3" format uses E4M3 for `g` too. Finite values beyond
the FP8 range saturate; inf and NaN stay non-finite, so an overflow still
makes the step skip.

Each scale is *delayed*: it comes from the amaxes (max |value|) of previous
steps, kept in a history of `amax_history_len` entries (entry 0 the most
recent), rolled once per step:

    amax  = max(history)  if amax_compute_algo == "max"
            history[0]    if amax_compute_algo == "most_recent"
    scale = fp8_max / amax / 2**margin    (old scale kept if amax is 0 or
                                           not finite, or the result is inf)

The first step uses scale 1. The state of one matmul (`Fp8DotState`) lives in
the variable collection "fp8_meta". This step's amaxes come out of the
backward pass as the gradient of zero-valued `amax` entries of that state (one
per call, so a module called twice combines its amaxes by max, not sum):
differentiate the loss with respect to the "fp8_meta" collection too and
pass both trees to `update`, which the train step (never the optimizer) calls
once per step, and not at all on a skipped step.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any, NamedTuple

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_train import loss_scale

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


def _states(tree: Any) -> list[Fp8DotState]:
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
  Nothing changes when `finite` is False (a skipped step: pass
  `train_metrics(opt_state)["last_step_finite"]`) or when any of this step's
  amaxes is not finite, since one non-finite amax would freeze a "max" scale
  for the whole history.

  Args:
    tree: a pytree holding `Fp8DotState`s (the "fp8_meta" collection, or the
      whole variables).
    grads: the gradients with respect to `tree` (same structure).
    finite: whether the step was applied; None means yes.

  Returns:
    `tree` with each FP8 state's history rolled and scale recomputed.
  """
  pairs = list(zip(_states(tree), _states(grads), strict=True))
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
  found = _states(tree)
  if not found:
    return {}
  out = {}
  for i, name in enumerate(TENSORS):
    values = jnp.concatenate([s.scale[..., i].reshape(-1) for s in found])
    out[f"fp8_{name}_scale_min"] = jnp.min(values)
    out[f"fp8_{name}_scale_max"] = jnp.max(values)
  return out


# ----------------------------------------------------------------------------
# The FP8 matmul.


def _quantize(x: jax.Array, scale: jax.Array, dtype: np.dtype) -> jax.Array:
  """x * scale cast to `dtype`; finite values saturate, inf/NaN stay so."""
  fp8_max = FP8_MAX[np.dtype(dtype)]
  y = x.astype(jnp.float32) * scale
  y = jnp.where(jnp.isfinite(y), jnp.clip(y, -fp8_max, fp8_max), y)
  return y.astype(dtype)


def _amax(x: jax.Array) -> jax.Array:
  return jnp.max(jnp.abs(x)).astype(jnp.float32)


def _transpose(g, other, dimension_numbers, ndim, *, of_lhs):
  """dL/d(operand) of `dot_general(lhs, rhs)` given g = dL/dy, in float32.

  The same contraction as JAX's transpose rule, with a float32 result (JAX's
  would come out in the operand's dtype, here FP8).
  """
  (lc, rc), (lb, rb) = dimension_numbers
  xc, yc, xb, yb = (lc, rc, lb, rb) if of_lhs else (rc, lc, rb, lb)
  x_kept = [d for d in range(ndim) if d not in xc and d not in xb]
  y_kept = [d for d in range(other.ndim) if d not in yc and d not in yb]
  nb = len(xb)
  # y = dot_general(lhs, rhs) has dims [batch, lhs kept, rhs kept].
  first = nb + (0 if of_lhs else len(y_kept))
  g_x_kept = list(range(first, first + len(x_kept)))
  g_y_kept = [d for d in range(nb, g.ndim) if d not in g_x_kept]
  out = lax.dot_general(
    g,
    other,
    ((tuple(g_y_kept), tuple(y_kept)), (tuple(range(nb)), tuple(yb))),
    preferred_element_type=jnp.float32,
  )
  # out has dims [batch, x kept, the x dims paired with sorted(yc)].
  paired = [xc[list(yc).index(d)] for d in sorted(yc)]
  return lax.transpose(out, tuple(np.argsort(list(xb) + x_kept + paired)))


class _DotConfig(NamedTuple):
  dimension_numbers: tuple
  forward_dtype: np.dtype
  backward_dtype: np.dtype
  out_dtype: np.dtype
  lhs_dtype: np.dtype
  rhs_dtype: np.dtype


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_dot(cfg: _DotConfig, lhs, rhs, scale, amax):
  return _fp8_dot_fwd(cfg, lhs, rhs, scale, amax)[0]


def _fp8_dot_fwd(cfg, lhs, rhs, scale, amax):
  del amax  # only its gradient matters
  q_lhs = _quantize(lhs, scale[0], cfg.forward_dtype)
  q_rhs = _quantize(rhs, scale[1], cfg.forward_dtype)
  y = lax.dot_general(
    q_lhs, q_rhs, cfg.dimension_numbers, preferred_element_type=jnp.float32
  )
  y = (y * ((1.0 / scale[0]) * (1.0 / scale[1]))).astype(cfg.out_dtype)
  return y, (q_lhs, q_rhs, scale, _amax(lhs), _amax(rhs))


def _fp8_dot_bwd(cfg, res, g):
  q_lhs, q_rhs, scale, amax_lhs, amax_rhs = res
  q_g = _quantize(g, scale[2], cfg.backward_dtype)
  inv_g = 1.0 / scale[2]
  d_lhs = _transpose(
    q_g, q_rhs, cfg.dimension_numbers, q_lhs.ndim, of_lhs=True
  ) * (inv_g * (1.0 / scale[1]))
  d_rhs = _transpose(
    q_g, q_lhs, cfg.dimension_numbers, q_rhs.ndim, of_lhs=False
  ) * (inv_g * (1.0 / scale[0]))
  amaxes = jnp.stack([amax_lhs, amax_rhs, _amax(g)])
  return (
    d_lhs.astype(cfg.lhs_dtype),
    d_rhs.astype(cfg.rhs_dtype),
    jnp.zeros_like(scale),
    amaxes,
  )


_fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)


def _canonical(dimension_numbers) -> tuple:
  (lc, rc), (lb, rb) = dimension_numbers
  return ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))


def fp8_dot_general(
  lhs: jax.Array,
  rhs: jax.Array,
  dimension_numbers: Any,
  *,
  scale: jax.Array,
  amax: jax.Array,
  recipe: Fp8Recipe = Fp8Recipe(),
  preferred_element_type: Any = None,
) -> jax.Array:
  """`lax.dot_general` in FP8 with the given scales (a pure function).

  Args:
    lhs, rhs, dimension_numbers: as for `jax.lax.dot_general`.
    scale: float32[3], the scales of lhs, rhs and the output gradient.
    amax: float32[3] of zeros; its gradient is the amaxes of lhs, rhs and
      the output gradient.
    recipe: gives the FP8 dtypes.
    preferred_element_type: the output dtype (default: lhs and rhs promoted).

  Returns:
    The product, dequantized to the output dtype.
  """
  out_dtype = np.dtype(
    preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype)
  )
  cfg = _DotConfig(
    _canonical(dimension_numbers),
    recipe.forward_dtype,
    recipe.backward_dtype,
    out_dtype,
    np.dtype(lhs.dtype),
    np.dtype(rhs.dtype),
  )
  return _fp8_dot(cfg, lhs, rhs, scale, amax)


# One counter per apply (keyed by its root scope) and module path, so the n-th
# call of a shared module reads its own amax entry.
_CALLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _call_index(module: nn.Module) -> int:
  counts = _CALLS.setdefault(module.scope.root, {})
  n = counts.get(module.path, 0)
  counts[module.path] = n + 1
  return n


class Fp8DotGeneral(nn.Module):
  """An FP8 `dot_general` for `nn.Dense(dot_general_cls=...)` and friends.

  Keeps an `Fp8DotState` named "fp8" in the "fp8_meta" collection. Called
  with an einsum equation in place of `dimension_numbers`, it computes that
  two-operand einsum with its matmul in FP8 (see `Einsum`).

  Example:
    >>> import functools, jax, jax.numpy as jnp, flax.linen as nn
    >>> dot = functools.partial(Fp8DotGeneral, recipe=Fp8Recipe(amax_history_len=4))
    >>> layer = nn.Dense(3, dot_general_cls=dot)
    >>> variables = layer.init(jax.random.key(0), jnp.ones((2, 5)))
    >>> variables["fp8_meta"]["Fp8DotGeneral_0"]["fp8"].amax_history.shape
    (3, 4)
  """

  recipe: Fp8Recipe = Fp8Recipe()

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
    var = self.variable(COLLECTION, "fp8", init_state, self.recipe)
    n = _call_index(self)
    state = var.value
    if n >= len(state.amax):
      if not (
        self.is_initializing() and self.is_mutable_collection(COLLECTION)
      ):
        raise ValueError(
          f"FP8 matmul {'/'.join(self.path)} is called {n + 1} times but was "
          f"initialised with {len(state.amax)} call(s): init the model with "
          "the same calls as apply."
        )
      state = state.replace(amax=(*state.amax, jnp.zeros((3,), jnp.float32)))
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

    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    if isinstance(dimension_numbers, str):  # an einsum equation
      return jnp.einsum(
        dimension_numbers,
        lhs,
        rhs,
        preferred_element_type=preferred_element_type,
        _dot_general=dot,
      )
    return dot(
      lhs, rhs, dimension_numbers, preferred_element_type=preferred_element_type
    )


def _einsum(module: nn.Einsum, inputs, einsum_str=None, *, dot_general):
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
  inputs, kernel, bias = module.promote_dtype(
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
    return _einsum(self, inputs, einsum_str, dot_general=self.dot_general_cls())
