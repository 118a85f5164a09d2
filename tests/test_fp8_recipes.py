"""Current and blockwise FP8 scaling against a float64 NumPy reference.

The reference below writes each rule of the recipes' docstrings
(`jmp_train.fp8.CurrentScaling`, `BlockwiseScaling`, `current_scale`,
`block_dot_general`) in float64 NumPy, with ml_dtypes for the FP8 rounding;
it never calls jmp_train. Scales and the products `x * scale` are float32
values, as the rules say: a float64 quotient or product of float32 values
rounded once to float32 is the correctly rounded float32 operation.
"""

import functools
import math
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jmp_train
from jmp_train import fp8

E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
# A float32 amax whose float32 `amax * (448 / amax)` is 448.00003 (57344.004
# for 57344): the clip, not the FP8 rounding, brings it to fp8_max.
OVER = float(np.float32(3) / np.float32(7))

# ---------------------------------------------------------------------------
# The reference.


def ref_scale(amax, fp8_max, power_of_two_scales):
  """1 if amax is 0 or not finite, else min(fp8_max / amax, 2**126) in
  float32, rounded down to a power of two with power_of_two_scales."""
  amax = np.asarray(amax, np.float64)
  ok = np.isfinite(amax) & (amax > 0)
  with np.errstate(all="ignore"):
    scale = (fp8_max / np.where(ok, amax, 1.0)).astype(np.float32)
  scale = np.minimum(scale.astype(np.float64), 2.0**126)
  if power_of_two_scales:
    scale = np.ldexp(1.0, np.frexp(scale)[1] - 1)  # scale = m * 2**e, m < 1
  return np.where(ok, scale, 1.0)


def ref_quantize(x, scale, dtype):
  """float32 `x * scale`, finite values clipped to +-fp8_max, rounded to
  nearest even in `dtype`; returned as float64."""
  fp8_max = FP8_MAX[dtype]
  with np.errstate(all="ignore"):
    y = (np.asarray(x, np.float64) * scale).astype(np.float32)
  y = np.where(np.isfinite(y), np.clip(y, -fp8_max, fp8_max), y)
  return y.astype(dtype).astype(np.float64)


def ref_current(x, w, g, spec, backward_dtype, pow2):
  """Current scaling: one scale per tensor, from its own amax.

  Returns `{name: (value, magnitude)}` for y, dx and dw, where magnitude is
  the same sum over |terms| (what float32 accumulation errors scale with).
  """
  lhs, rst = spec.split(",")
  rhs, out = rst.split("->")
  sx = ref_scale(np.max(np.abs(x)), 448.0, pow2)
  sw = ref_scale(np.max(np.abs(w)), 448.0, pow2)
  qx, qw = ref_quantize(x, sx, E4M3), ref_quantize(w, sw, E4M3)
  sg = ref_scale(np.max(np.abs(g)), FP8_MAX[backward_dtype], pow2)
  qg = ref_quantize(g, sg, backward_dtype)

  def dot(eq, a, b, inv):
    with np.errstate(invalid="ignore"):
      return (
        np.einsum(eq, a, b) * inv,
        np.einsum(eq, np.abs(a), np.abs(b)) * inv,
      )

  return {
    "y": dot(f"{lhs},{rhs}->{out}", qx, qw, 1 / (sx * sw)),
    "dx": dot(f"{out},{rhs}->{lhs}", qg, qw, 1 / (sg * sw)),
    "dw": dot(f"{lhs},{out}->{rhs}", qx, qg, 1 / (sg * sx)),
  }


def ref_tiles(x, rows, cols, pow2):
  """E4M3 values of [B, R, C] and, per element, its rows x cols tile's scale
  (tiles from index 0; those at the edges partial)."""
  scale = np.empty(x.shape)
  for i in range(0, x.shape[1], rows):
    for j in range(0, x.shape[2], cols):
      tile = np.abs(x[:, i : i + rows, j : j + cols])
      amax = tile.max(axis=(1, 2))  # NaN when the tile holds one
      scale[:, i : i + rows, j : j + cols] = ref_scale(amax, 448.0, pow2)[
        :, None, None
      ]
  return ref_quantize(x, scale, E4M3), scale


def ref_blocked(qa, sa, qb, sb, block):
  """[B, M, K] @ [B, K, N]: each K block's product of FP8 values times its
  two tiles' inverse scales, summed; `sa`, `sb` are per-element scales."""
  out = mag = 0.0
  for k in range(0, qa.shape[2], block):
    inv = 1.0 / (sa[:, :, k, None] * sb[:, None, k, :])
    a, b = qa[:, :, k : k + block], qb[:, k : k + block]
    with np.errstate(invalid="ignore"):
      out = out + np.einsum("bmk,bkn->bmn", a, b) * inv
      mag = mag + np.einsum("bmk,bkn->bmn", np.abs(a), np.abs(b)) * inv
  return out, mag


def ref_blockwise(x, w, g, block, pow2):
  """DeepSeek-V3's rule on [B, M, K] @ [B, K, N], E4M3 everywhere.

  forward y = x @ w: x in 1 x b tiles along K, w in b x b blocks; dgrad
  dx = g @ w^T: g in 1 x b tiles along N, w's blocks; wgrad dw = x^T @ g:
  x and g in b x 1 tiles along M.
  """
  t = functools.partial(np.swapaxes, axis1=1, axis2=2)
  qx, sx = ref_tiles(x, 1, block, pow2)
  qw, sw = ref_tiles(w, block, block, pow2)
  qg, sg = ref_tiles(g, 1, block, pow2)
  qxc, sxc = ref_tiles(x, block, 1, pow2)
  qgc, sgc = ref_tiles(g, block, 1, pow2)
  return {
    "y": ref_blocked(qx, sx, qw, sw, block),
    "dx": ref_blocked(qg, sg, t(qw), t(sw), block),
    "dw": ref_blocked(t(qxc), t(sxc), qgc, sgc, block),
  }


def assert_matches(got, want, mag, rtol=1e-6, out_rtol=0.0, atol=0.0):
  """Non-finite where the reference is (NaN as NaN, inf with its sign), and
  elsewhere within rtol * magnitude (+ out_rtol * |want| for a rounded
  output dtype, + atol)."""
  got = np.asarray(got, np.float64)
  assert got.shape == want.shape
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
  inf = np.isinf(want)
  np.testing.assert_array_equal(got[inf], want[inf])
  fin = np.isfinite(want)
  err = np.abs(got[fin] - want[fin])
  bound = rtol * mag[fin] + out_rtol * np.abs(want[fin]) + atol
  assert (err <= bound).all(), np.max(err - bound)


# ---------------------------------------------------------------------------
# The cases: a dot_general, its einsum, and how it lays out as [B, M, K] @
# [B, K, N] (letters grouped into batch, kept, contracted; the contracted
# ones in the order the lhs's contracting dims are listed).


class Case(NamedTuple):
  dimension_numbers: tuple
  lhs: str
  rhs: str
  out: str
  sizes: dict
  lhs_groups: tuple
  rhs_groups: tuple
  out_groups: tuple

  @property
  def spec(self):
    return f"{self.lhs},{self.rhs}->{self.out}"

  def shape(self, letters):
    return tuple(self.sizes[c] for c in letters)


DENSE = Case(
  (((1,), (0,)), ((), ())),
  "mk",
  "kn",
  "mn",
  dict(m=5, k=6, n=7),
  ("", "m", "k"),
  ("", "k", "n"),
  ("", "m", "n"),
)
# Batch dims at different positions, two contracting dims listed (p, q).
EINSUM = Case(
  (((1, 3), (3, 0)), ((0,), (1,))),
  "bpmq",
  "qbnp",
  "bmn",
  dict(b=2, p=3, m=5, q=2, n=6),
  ("b", "m", "pq"),
  ("b", "pq", "n"),
  ("b", "m", "n"),
)
CASES = {"dense": DENSE, "einsum": EINSUM}


def to_bmk(case, a, letters, groups):
  a = np.einsum(f"{letters}->{''.join(groups)}", a)
  return a.reshape([math.prod(case.shape(g)) for g in groups])


def from_bmk(case, a, letters, groups):
  a = a.reshape(case.shape("".join(groups)))
  return np.einsum(f"{''.join(groups)}->{letters}", a)


def operands(case, seed=0):
  """x, w, g (float32 values as float64) in the case's layout, built in
  [B, M, K] layout: magnitudes varying across tiles, a zero tile of x, a zero
  block of w, a zero edge tile of g, a tile whose amax is OVER and a row of g
  far below its largest value."""
  rng = np.random.default_rng(seed)
  b, m, k = (math.prod(case.shape(g)) for g in case.lhs_groups)
  n = math.prod(case.shape(case.rhs_groups[2]))
  x = rng.normal(size=(b, m, k)) * 2.0 ** rng.integers(-6, 7, (b, m, 1))
  x[..., :4] *= 2.0 ** rng.integers(-9, 9, (b, m, 1))  # its own tile scale
  x[0, 0, :4] = 0.0
  x[-1, 1, :4] = [OVER, -0.25, 0.125, 0.1]
  w = rng.normal(size=(b, k, n)) * 2.0 ** rng.integers(-4, 5, (b, 1, n))
  w[0, :4, :4] = 0.0
  g = rng.normal(size=(b, m, n)) * 1e-3 * 2.0 ** rng.integers(-8, 9, (b, m, 1))
  g[0, 1, 4:] = 0.0
  # A row 2**-24 below the largest: E5M2 subnormals unless the scale uses
  # E5M2's own fp8_max (57344, not 448).
  g[-1, -1] = np.abs(g).max() * 2.0**-24 * rng.uniform(1, 2, n)
  x, w, g = (a.astype(np.float32).astype(np.float64) for a in (x, w, g))
  return (
    from_bmk(case, x, case.lhs, case.lhs_groups),
    from_bmk(case, w, case.rhs, case.rhs_groups),
    from_bmk(case, g, case.out, case.out_groups),
  )


def _f32(*arrays):
  return tuple(jnp.asarray(a, jnp.float32) for a in arrays)


def _amaxes(*arrays):
  return [np.max(np.abs(a)) for a in arrays]


def _dot(case, recipe):
  def dot(x, w, amax):
    return fp8.fp8_dot_general(
      x, w, case.dimension_numbers, scale=jnp.ones(3), amax=amax, recipe=recipe
    )

  return dot


def _forward_and_vjp(dot):
  """(y, dx, dw, d amax) of `dot(x, w, amax)` for the output gradient g."""

  def run(x, w, g):
    y, vjp = jax.vjp(dot, x, w, jnp.zeros(3, jnp.float32))
    return (y, *vjp(g))

  return run


# ---------------------------------------------------------------------------
# The scale rule.


def _next(value, toward):
  """The float32 next to `value` toward `toward`."""
  return float(np.nextafter(np.float32(value), np.float32(toward)))


# Zero and non-finite amaxes first, the 2**126 cap last.
AMAXES = [0.0, np.inf, -np.inf, np.nan, 2.0, 3.0, OVER, 448.0, 1000.0]
AMAXES += [3.5, _next(3.5, 4), _next(3.5, 3)]  # 448 / 3.5 = 128 exactly
AMAXES += [_next(448, 449), 1e30, 3e38, 1e-3]
AMAXES += [2.0**-115, 2.0**-118, 2.0**-120, 2.0**-126]


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("fp8_max", [448.0, 57344.0])
def test_current_scale_is_the_written_rule_bit_for_bit(fp8_max, pow2, variant):
  amax = np.array(AMAXES, np.float32)
  rule = functools.partial(
    fp8.current_scale, fp8_max=fp8_max, power_of_two_scales=pow2
  )
  got = variant(rule)(jnp.asarray(amax))
  want = ref_scale(amax, fp8_max, pow2).astype(np.float32)
  assert got.dtype == jnp.float32
  np.testing.assert_array_equal(
    np.asarray(got).view(np.uint32), want.view(np.uint32)
  )
  # The regimes, spelled out: 1 for zero and non-finite amaxes, the cap for
  # tiny ones, and power-of-two scales rounded down (448 / 3.5 = 128; the
  # next float32 amax gives just under 128, so 64; the one before, 128).
  assert (want[:4] == 1).all() and want[-1] == 2.0**126
  if pow2 and fp8_max == 448.0:
    at = {a: s for a, s in zip(AMAXES, want, strict=True) if a == a}
    assert at[3.5] == 128 and at[_next(3.5, 4)] == 64
    assert at[_next(3.5, 3)] == 128 and at[1000.0] == 0.25


# ---------------------------------------------------------------------------
# Current scaling: forward, dgrad and wgrad against the reference.


def _check(got, want, atol=0.0):
  """got = (y, dx, dw, d amax) against want[name] = (value, magnitude)."""
  for name, value in zip(("y", "dx", "dw"), got[:3], strict=True):
    assert value.dtype == jnp.float32
    assert_matches(value, *want[name], atol=atol)


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_current_scaling_matches_the_reference(case, fmt, pow2):
  case = CASES[case]
  recipe = fp8.CurrentScaling(format=fmt, power_of_two_scales=pow2)
  x, w, g = operands(case)
  # jit only; the tests around it run current scaling eagerly too.
  got = jax.jit(_forward_and_vjp(_dot(case, recipe)))(*_f32(x, w, g))
  backward = E5M2 if fmt == "hybrid" else E4M3
  _check(got, ref_current(x, w, g, case.spec, backward, pow2))
  np.testing.assert_array_equal(got[3], _amaxes(x, w, g))


def test_current_scaling_keeps_products_float32_can_hold(variant):
  """Small operands: the product of two inverse scales, 1 / (s_x * s_w), is
  below float32's normal range (XLA flushes it to 0) while y, dx and dw are
  normal float32 values."""
  x, w, g = operands(DENSE)
  x, w, g = x * 2.0**-60, w * 2.0**-60, g * 2.0**-45
  got = variant(_forward_and_vjp(_dot(DENSE, fp8.CurrentScaling())))(
    *_f32(x, w, g)
  )
  want = ref_current(x, w, g, DENSE.spec, E5M2, False)
  sx, sw, sg = (
    ref_scale(np.abs(a).max(), m, False)
    for a, m in ((x, 448.0), (w, 448.0), (g, 57344.0))
  )
  assert 1 / (sx * sw) < 2.0**-126 and 1 / (sg * sw) < 2.0**-126
  for value, _ in want.values():
    assert np.abs(value).max() > 2.0**-115
  _check(got, want, atol=2.0**-126)  # results below it are flushed


# ---------------------------------------------------------------------------
# Blockwise scaling (block_size 4): tiles at the edges, a zero tile and block.


def _blockwise_reference(case, x, w, g, block, pow2):
  want = ref_blockwise(
    to_bmk(case, x, case.lhs, case.lhs_groups),
    to_bmk(case, w, case.rhs, case.rhs_groups),
    to_bmk(case, g, case.out, case.out_groups),
    block,
    pow2,
  )
  back = {
    "y": (case.out, case.out_groups),
    "dx": (case.lhs, case.lhs_groups),
    "dw": (case.rhs, case.rhs_groups),
  }
  return {
    name: tuple(from_bmk(case, a, *back[name]) for a in pair)
    for name, pair in want.items()
  }


def _block_dot(case, pow2):
  """block_dot_general itself (what fp8_dot_general runs for the recipe)."""

  def dot(x, w, amax):
    return fp8.block_dot_general(
      x,
      w,
      case.dimension_numbers,
      amax=amax,
      block_size=4,
      power_of_two_scales=pow2,
      out_dtype=jnp.float32,
    )

  return dot


@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("case", sorted(CASES))
def test_blockwise_scaling_matches_the_reference(case, pow2):
  # Dense through block_dot_general, the einsum through fp8_dot_general.
  case = CASES[case]
  recipe = fp8.BlockwiseScaling(block_size=4, power_of_two_scales=pow2)
  dot = _block_dot(case, pow2) if case is DENSE else _dot(case, recipe)
  x, w, g = operands(case)
  # jit only: eagerly, the op-by-op compiles take ~10 s.
  got = jax.jit(_forward_and_vjp(dot))(*_f32(x, w, g))
  _check(got, _blockwise_reference(case, x, w, g, 4, pow2))
  np.testing.assert_array_equal(got[3], _amaxes(x, w, g))


# ---------------------------------------------------------------------------
# Saturation, and inf / NaN.

SATURATING = {
  "current": fp8.CurrentScaling(),
  "blockwise": fp8.BlockwiseScaling(block_size=4, power_of_two_scales=False),
}


@pytest.mark.parametrize("name", sorted(SATURATING))
def test_each_tiles_largest_value_maps_to_fp8_max_exactly(name):
  """With an identity kernel y = q_x / s_x and dx = q_g / s_g, so the FP8
  values come back: each tile's largest is fp8_max (OVER's float32 product
  is above it; the clip brings it back), none beyond, none NaN."""
  recipe = SATURATING[name]
  tile = (3, 8) if name == "current" else (1, 4)  # current: one tile
  rng = np.random.default_rng(2)

  def tensor():
    a = rng.uniform(-1, 1, (3, 8)) * OVER / 2
    for i, j in np.ndindex(3, 2):  # a different amax in each 1 x 4 tile
      a[i, 4 * j + rng.integers(4)] = (-1) ** (i + j) * OVER * 2.0 ** (i - j)
    return a.astype(np.float32).astype(np.float64)

  x, g = tensor(), tensor()
  y, dx, *_ = jax.jit(_forward_and_vjp(_dot(DENSE, recipe)))(
    *_f32(x, np.eye(8), g)
  )
  backward = recipe.backward_dtype.type
  for out, a, dtype in ((y, x, E4M3), (dx, g, backward)):
    scale = np.empty(a.shape)
    for i, j in np.ndindex(3 // tile[0], 8 // tile[1]):
      at = np.s_[
        i * tile[0] : (i + 1) * tile[0], j * tile[1] : (j + 1) * tile[1]
      ]
      scale[at] = ref_scale(np.abs(a[at]).max(), FP8_MAX[dtype], False)
    q_out = np.asarray(out, np.float64) * scale
    q = q_out.astype(np.float32).astype(dtype).astype(np.float64)
    np.testing.assert_allclose(q_out, q, rtol=1e-6)  # FP8 values came back
    tiles = np.abs(q).reshape(3 // tile[0], tile[0], 8 // tile[1], tile[1])
    np.testing.assert_array_equal(tiles.max(axis=(1, 3)), FP8_MAX[dtype])
    # The clip, not the FP8 rounding, brought the largest to fp8_max.
    assert (np.abs(a) * scale).astype(np.float32).max() > FP8_MAX[dtype]


NON_FINITE = {
  "current-hybrid": fp8.CurrentScaling(),
  "current-e4m3": fp8.CurrentScaling(format="e4m3"),
  "blockwise": fp8.BlockwiseScaling(block_size=4),
}


@pytest.mark.parametrize("name", sorted(NON_FINITE))
def test_inf_and_nan_stay_non_finite_so_the_step_skips(name):
  recipe, case = NON_FINITE[name], EINSUM
  run = jax.jit(_forward_and_vjp(_dot(case, recipe)))
  x, w, g = operands(case)
  bad_x = to_bmk(case, x, case.lhs, case.lhs_groups)
  bad_x[0, 2, 4:6] = [np.inf, np.nan]  # one tile, at the edge of K
  bad_x = from_bmk(case, bad_x, case.lhs, case.lhs_groups)
  bad_g = g.copy()
  bad_g[1, 3, [0, 2]] = [-np.inf, np.nan]  # one 1 x 4 tile along N
  for x_, g_, bad in ((bad_x, g, 0), (x, bad_g, 2)):
    got = run(*_f32(x_, w, g_))
    if name == "blockwise":
      want = _blockwise_reference(case, x_, w, g_, 4, True)
    else:
      backward = recipe.backward_dtype.type
      want = ref_current(x_, w, g_, case.spec, backward, False)
    _check(got, want)
    amax = _amaxes(x_, w, g_)
    assert np.isnan(amax[bad])
    np.testing.assert_array_equal(got[3], amax)
    # The step's gradients are not finite: a loss-scaled step skips.
    assert not np.isfinite(got[2]).all()
    assert not np.isfinite(got[1 if bad else 0]).all()


# ---------------------------------------------------------------------------
# The amax gradient channel and the dtypes in the jaxpr.

RECIPES = {
  "current-hybrid": fp8.CurrentScaling(),
  "current-e4m3": fp8.CurrentScaling(format="e4m3"),
  "blockwise": fp8.BlockwiseScaling(block_size=4),
}


def _loss(case, recipe, g):
  def loss(x, w, amax=None):
    amax = jnp.zeros(3, jnp.float32) if amax is None else amax
    return jnp.sum(_dot(case, recipe)(x, w, amax) * g)

  return loss


@pytest.mark.parametrize(
  "name, variant",
  [
    ("current-hybrid", jax.jit),
    ("current-hybrid", lambda f: f),
    # Eagerly, blockwise's op-by-op compiles take ~6 s: jit only.
    ("blockwise", jax.jit),
  ],
  ids=["current-jit", "current-nojit", "blockwise-jit"],
)
def test_the_amax_gradient_is_each_operands_max_abs(name, variant):
  x, w, g = _f32(*operands(DENSE))
  grad = jax.grad(_loss(DENSE, RECIPES[name], g), argnums=2)
  got = variant(grad)(x, w, jnp.zeros(3, jnp.float32))
  np.testing.assert_array_equal(got, _amaxes(x, w, g))


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_dot_general_of_the_step_reads_fp8(name, operand_dtypes):
  recipe = RECIPES[name]
  x, w, g = _f32(*operands(EINSUM))
  found = operand_dtypes(jax.grad(_loss(EINSUM, recipe, g), (0, 1)), x, w)
  e4, bwd = "float8_e4m3fn", recipe.backward_dtype.name
  # The forward, dgrad and wgrad, and nothing else (blockwise: one or two
  # dot_generals each, for the K blocks), every one of FP8 operands.
  assert len(found) >= 3
  assert set(found) == {(e4, e4), (bwd, e4)}


# ---------------------------------------------------------------------------
# Through linen.wrap: nn.DenseGeneral over two axes and a per-head nn.Einsum.


class Heads(nn.Module):
  """Attention-style projections, as Flax models write them."""

  @nn.compact
  def __call__(self, x):  # x: [batch, heads, head_dim]
    proj = nn.DenseGeneral(7, axis=(-2, -1), use_bias=False, name="proj")(x)
    heads = nn.Einsum((2, 6, 3), "bhd,hdo->bho", use_bias=False, name="heads")
    return proj, heads(x)


SIZES = dict(n=5, h=2, d=6, f=7, b=5, o=3)
# The layouts the rule asks for: the inputs as lhs and the kernel as rhs
# (blocked); proj's contraction flattens (h, d), heads' batch is h.
PROJ = Case(
  None,
  "nhd",
  "hdf",
  "nf",
  SIZES,
  ("", "n", "hd"),
  ("", "hd", "f"),
  ("", "n", "f"),
)
HEADS = Case(
  None,
  "bhd",
  "hdo",
  "bho",
  SIZES,
  ("h", "b", "d"),
  ("h", "d", "o"),
  ("h", "b", "o"),
)
WRAPPED = {
  "current": fp8.CurrentScaling(),
  "blockwise": fp8.BlockwiseScaling(block_size=4),
}


# jnp.einsum hands `_dot_general` the kernel first when that spares it a
# transpose ("bhd,hdo->bho" does); the FP8 einsum keeps the input as lhs, so
# blockwise tiles the input 1 x b and blocks the kernel b x b, as the rule says.


@pytest.fixture(scope="module", params=sorted(WRAPPED))
def wrapped_run(request):
  """(recipe name, x, variables, outputs) of Heads under wrap("bf16")."""
  model = jmp_train.linen.wrap(Heads(), "bf16", fp8=WRAPPED[request.param])
  rng = np.random.default_rng(3)
  x = rng.normal(size=(5, 2, 6)) * 2.0 ** rng.integers(-6, 7, (5, 2, 1))
  v = jax.jit(model.init)(jax.random.key(0), jnp.asarray(x, jnp.float32))
  proj, heads = jax.jit(model.apply)(v, jnp.asarray(x, jnp.float32))
  return request.param, x, v, {"proj": proj, "heads": heads}


def test_wrapped_dense_general_over_two_axes_equals_the_reference(
  wrapped_run,
):
  _check_wrapped(*wrapped_run, "proj")


def test_wrapped_einsum_with_a_batch_dim_equals_the_reference(wrapped_run):
  _check_wrapped(*wrapped_run, "heads")


def _check_wrapped(name, x, v, outputs, layer):
  case, out = {"proj": PROJ, "heads": HEADS}[layer], outputs[layer]
  x = x.astype(ml_dtypes.bfloat16).astype(np.float64)  # the policy's cast
  kernel = np.asarray(v["params"][layer]["kernel"], np.float64)  # bf16
  g = np.zeros(case.shape(case.out))
  if name == "current":
    want = ref_current(x, kernel, g, case.spec, E5M2, False)["y"]
  else:
    want = _blockwise_reference(case, x, kernel, g, 4, True)["y"]
  assert out.dtype == jnp.bfloat16
  assert_matches(out, *want, out_rtol=2.0**-8)  # rounded to bfloat16


def test_review_cases_refused_or_saturated():
  # A finite value whose scaled product overflows float32 saturates at the
  # FP8 maximum (the written rule); only inf and NaN stay non-finite.
  from jmp_train._src import fp8_dot, fp8_recipe

  x = jnp.array([10.0, -10.0, jnp.inf, jnp.nan], jnp.float32)
  q = fp8_recipe.quantize(x, jnp.float32(5.7e37), jnp.float8_e5m2)
  got = np.asarray(q.astype(jnp.float32))
  np.testing.assert_array_equal(got[:3], [57344.0, -57344.0, np.inf])
  assert np.isnan(got[3])
  # Implicit-output or ellipsis einsums are refused by name.
  dot = jax.lax.dot_general
  for eq in ("ij,jk", "...j,jk->...k", "ij,jk->iz"):
    with pytest.raises(ValueError, match="accepted is an explicit"):
      fp8_dot.einsum(eq, jnp.ones((2, 3)), jnp.ones((3, 4)), dot)
  # State of one recipe applied by a module of another is refused.
  model = jmp_train.linen.wrap(nn.Dense(3), "f32", fp8="current")
  variables = model.init(jax.random.key(0), jnp.ones((2, 4)))
  other = jmp_train.linen.wrap(nn.Dense(3), "f32", fp8="delayed")
  with pytest.raises(ValueError, match="was given state of recipe"):
    other.apply(variables, jnp.ones((2, 4)))


@pytest.mark.parametrize(
  "build, error, match",
  [
    (
      lambda: fp8.CurrentScaling(format="e5m2"),
      ValueError,
      "Unknown FP8 format 'e5m2'",
    ),
    (
      lambda: fp8.CurrentScaling(power_of_two_scales=1),
      TypeError,
      "power_of_two_scales .* got 1",
    ),
    (
      lambda: fp8.BlockwiseScaling(block_size=0),
      ValueError,
      "block_size .* got 0",
    ),
    (lambda: fp8.BlockwiseScaling(block_size=True), ValueError, "got True"),
    (
      lambda: fp8.BlockwiseScaling(statistics="yes"),
      TypeError,
      "statistics .* got 'yes'",
    ),
    (
      lambda: fp8.DelayedScaling(statistics=None),
      TypeError,
      "statistics .* None",
    ),
  ],
)
def test_bad_recipe_settings_are_refused_by_name(build, error, match):
  with pytest.raises(error, match=match):
    build()
