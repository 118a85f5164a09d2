"""State formats against NumPy / ml_dtypes references, and
`mixed_precision(state_formats=...)` against plain optax runs."""

import functools
import math
from typing import Any, NamedTuple

import _models
import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.sharding import AxisType

import jmp_train
from jmp_train import memory, zero1
from jmp_train.checkpoint import Checkpointer
from jmp_train.state_format import (
  FP8,
  BFloat16,
  Float16,
  Float32,
  compress,
  expand,
)
from jmp_train.train import TrainState, make_train_step

FP8_DTYPES = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
BF16 = ml_dtypes.bfloat16
F32_MAX = np.finfo(np.float32).max


def bits(x):
  """The raw bits of an array (unsigned ints of its item size)."""
  x = np.atleast_1d(np.asarray(x))
  return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def assert_same_bits(got, want):
  """Same tree, and every leaf has the same dtype and the same bits."""
  assert jax.tree.structure(got) == jax.tree.structure(want)
  chex.assert_trees_all_equal_dtypes(got, want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(bits(a), bits(b))


def fp8_info(dtype):
  info = ml_dtypes.finfo(FP8_DTYPES[dtype])
  return np.float32(info.max), float(info.smallest_normal), int(info.nmant)


def grouped(x, group_size):
  """`x` (float32, rank >= 1) as (..., groups, group_size), zero-padded."""
  length = x.shape[-1]
  count = -(-length // group_size)
  padded = np.zeros(x.shape[:-1] + (count * group_size,), np.float32)
  padded[..., :length] = x
  return padded.reshape(x.shape[:-1] + (count, group_size))


def fp8_reference(x, dtype, group_size):
  """(values, scale) by the written rule, in NumPy float32: per group of
  `group_size` along the last axis, scale = absmax / fp8_max and the stored
  value is clip(x / scale) rounded to nearest even by ml_dtypes."""
  fp8_max = fp8_info(dtype)[0]
  x = np.asarray(x, np.float32)
  rows = np.clip(x.reshape(x.shape or (1,)), -F32_MAX, F32_MAX)
  groups = grouped(rows, group_size)
  scale = np.abs(groups).max(-1) / fp8_max
  safe = np.where(scale > 0, scale, 1)  # an all-zero group stores zeros
  values = np.clip(groups / safe[..., None], -fp8_max, fp8_max)
  values = values.reshape(rows.shape[:-1] + (-1,))[..., : rows.shape[-1]]
  values = values.astype(FP8_DTYPES[dtype]).reshape(x.shape)
  return values, scale.reshape(scale.shape if x.ndim else ())


def fp8_expand_reference(values, scale, group_size):
  """values * their group's scale, in float32."""
  v = np.atleast_1d(np.asarray(values).astype(np.float32))
  s = np.repeat(np.atleast_1d(np.asarray(scale)), group_size, axis=-1)
  return (v * s[..., : v.shape[-1]]).reshape(np.shape(values))


def fp8_roundtrip(x, dtype, group_size):
  return fp8_expand_reference(*fp8_reference(x, dtype, group_size), group_size)


def expand_range_bound(k, nmant):
  """The relative error of COAT's range expansion: the stored
  y = |x / absmax|**k has relative error u = 2**-(nmant + 1) (round to
  nearest; y never falls below the smallest normal), and expanding raises
  it to the power 1/k: (1 + u)**(1/k) - 1 or 1 - (1 - u)**(1/k), plus
  float32's own pow and exp (1e-4)."""
  u = 2.0 ** -(nmant + 1)
  return np.maximum((1 + u) ** (1 / k) - 1, 1 - (1 - u) ** (1 / k)) + 1e-4


def spread(rng, shape, low, high):
  """Random signs times magnitudes log-uniform in [e**low, e**high]."""
  sign = rng.choice([-1.0, 1.0], shape)
  return (sign * np.exp(rng.uniform(low, high, shape))).astype(np.float32)


# -- Compression ---------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=0)
def round_trip(fmt, xs):
  """`compress` then `expand` of each array in the list `xs`, one compile."""
  stored = [compress(fmt, x) for x in xs]
  return stored, [expand(fmt, s) for s in stored]


def round_trip_one(fmt, x):
  stored, decoded = round_trip(fmt, [jnp.asarray(x)])
  return stored[0], np.asarray(decoded[0])


@pytest.mark.parametrize(
  "dtype,group_size",
  [("e4m3", 5), ("e5m2", 5), ("e4m3", 64)],  # 37 = 7 * 5 + 2; 64 > 37
)
def test_fp8_matches_numpy_reference(dtype, group_size):
  x = spread(np.random.default_rng(0), (6, 37), -8, 8)
  fmt = FP8(dtype, group_size=group_size)
  stored, decoded = round_trip_one(fmt, x)
  values, scale = fp8_reference(x, dtype, group_size)
  assert stored.values.dtype == values.dtype and stored.power is None
  assert stored.scale.dtype == np.float32
  assert stored.scale.shape == (6, -(-37 // group_size))
  # XLA turns the division by the constant fp8_max into a multiplication by
  # its float32 reciprocal: the scale may be 1 ulp off absmax / fp8_max.
  np.testing.assert_array_max_ulp(np.asarray(stored.scale), scale, maxulp=1)
  np.testing.assert_array_equal(bits(stored.values), bits(values))
  np.testing.assert_array_equal(
    decoded, fp8_expand_reference(stored.values, stored.scale, group_size)
  )
  # Round to nearest: half an FP8 ulp of the stored value times the scale
  # (subnormal FP8 values: half the smallest spacing), and float32's own.
  _, normal, nmant = fp8_info(dtype)
  per_value = np.repeat(scale, group_size, axis=-1)[:, :37]
  half_ulp = 2.0 ** -(nmant + 1)
  bound = np.maximum(np.abs(x) * half_ulp, normal * half_ulp * per_value)
  assert np.all(np.abs(decoded - x) <= bound * (1 + 2**-20))


@pytest.mark.parametrize(
  "fmt",
  [FP8("e4m3", 3), FP8("e5m2", 3), FP8("e4m3", 3, True), Float16()],
  ids=["e4m3", "e5m2", "e4m3_expand", "float16"],
)
def test_zeros_round_trip_exactly(fmt):
  x = np.array([[0.0, 0.0, -0.0, 1.0, -2.0, 0.0], [0.0] * 6], np.float32)
  stored, decoded = round_trip_one(fmt, x)
  assert np.all(np.isfinite(np.asarray(stored.scale)))
  if stored.power is not None:
    assert np.all(np.isfinite(np.asarray(stored.power)))
  zero = x == 0
  assert np.all(np.asarray(stored.values, np.float32)[zero] == 0)
  assert np.all(decoded[zero] == 0)
  np.testing.assert_allclose(decoded[~zero], x[~zero], rtol=2**-4)


@pytest.mark.parametrize("expand_range", [False, True])
@pytest.mark.parametrize("dtype", ["e4m3", "e5m2"])
def test_fp8_saturates_without_nan(dtype, expand_range):
  fp8_max, _, nmant = fp8_info(dtype)
  ulp_at_max = fp8_max - float(np.nextafter(FP8_DTYPES[dtype](fp8_max), 0))
  fmt = FP8(dtype, group_size=3, expand_range=expand_range)
  # Groups [inf, 1, -2], [3e38, -inf, 5e-3], [7, -7, 0.5], [3e38, -1e38, 2e37]
  x = [np.inf, 1, -2, 3e38, -np.inf, 5e-3, 7, -7, 0.5, 3e38, -1e38, 2e37]
  x = np.array(x, np.float32)
  stored, decoded = round_trip_one(fmt, x)
  values = np.asarray(stored.values, np.float32)
  assert np.all(np.isfinite(values)) and np.all(np.isfinite(stored.scale))
  np.testing.assert_array_equal(
    values[[0, 4, 6, 7, 9]], fp8_max * np.array([1, -1, 1, -1, 1])
  )
  assert not np.any(np.isnan(decoded))
  assert decoded[0] > 0.99 * F32_MAX and decoded[4] < -0.99 * F32_MAX
  # The values at a group's absmax decode within one FP8 ulp (at fp8_max, in
  # the group's units absmax / fp8_max).
  assert np.all(np.abs(decoded[6:8] - x[6:8]) <= ulp_at_max * 7.0 / fp8_max)
  # Finite values near float32's largest keep their precision.
  if expand_range:
    bound = expand_range_bound(np.asarray(stored.power)[3], nmant)
  else:
    bound = 2.0 ** -(nmant + 1) * (1 + 2**-20)
  assert np.all(np.abs(decoded[9:] - x[9:]) <= bound * np.abs(x[9:]))
  assert np.abs(decoded[3] - x[3]) <= 2.0**-nmant * x[3]


@pytest.mark.parametrize(
  "fmt",
  [FP8("e4m3", 3), FP8("e5m2", 3), Float16()],
  ids=["e4m3", "e5m2", "f16"],
)
def test_tiny_values_keep_their_precision(fmt):
  # absmax / fp8_max (or / 32752) is below float32's smallest normal, which
  # CPUs and GPUs flush to 0; the values themselves are normal floats.
  x = np.array([[1e-37, -3e-38, 5e-38], [4e-36, 1e-36, -2e-36]], np.float32)
  nmant = fp8_info(fmt.dtype)[2] if isinstance(fmt, FP8) else 10
  stored, decoded = round_trip_one(fmt, x)
  assert np.all(np.isfinite(np.asarray(stored.values, np.float32)))
  bound = 2.0 ** -(nmant + 1) * (1 + 2**-20)
  np.testing.assert_array_less(np.abs(decoded - x), bound * np.abs(x))


@pytest.mark.parametrize(
  "fmt",
  [FP8(), FP8("e5m2", expand_range=True), Float16()],
  ids=["e4m3", "e5m2_expand", "float16"],
)
def test_scalars_and_one_element_leaves(fmt):
  xs = [np.float32(-3.0), np.array([-3.0], np.float32)]
  xs.append(np.array([[-3.0], [0.25]], np.float32))
  stored, decoded = round_trip(fmt, [jnp.asarray(x) for x in xs])
  for x, s, d in zip(xs, stored, decoded, strict=True):
    assert s.values.shape == x.shape
    scale_shape = () if isinstance(fmt, Float16) else x.shape
    assert s.scale.shape == scale_shape
    assert s.power is None or s.power.shape == scale_shape
    # Under FP8 each value is its own group's absmax: it is stored at the
    # format's largest magnitude and comes back to float32 rounding. Float16
    # has one scale per leaf: 0.25 keeps float16's 11 bits.
    rtol = 2**-11 if isinstance(fmt, Float16) else 1e-6
    np.testing.assert_allclose(np.asarray(d), x, rtol=rtol)


@pytest.mark.parametrize("dtype", ["e4m3", "e5m2"])
def test_fp8_expand_range(dtype):
  fp8_max, normal, nmant = fp8_info(dtype)
  rng = np.random.default_rng(1)
  x = spread(rng, (4, 16), -7, 0)
  x[0, 3] = 0.0  # a zero is not the group's smallest non-zero magnitude
  x[1, :8] = np.array([2, -2] * 4)  # one magnitude: k = 1
  x[2, 8:] = spread(rng, 8, -5, 0)
  x[2, 9] = 1e-17  # a wide group: k < 1
  fmt = FP8(dtype, group_size=8, expand_range=True)
  stored, decoded = round_trip_one(fmt, x)
  assert stored.power.shape == stored.scale.shape == (4, 2)
  # COAT's k, in float64: the smallest non-zero |x| / absmax lands on the
  # smallest normal, k = log(normal / fp8_max) / log(z_min) (1 if z_min = 1).
  groups = np.abs(grouped(x, 8)).astype(np.float64)
  z_min = np.where(groups > 0, groups, np.inf).min(-1) / groups.max(-1)
  with np.errstate(divide="ignore"):
    k = np.where(z_min < 1, np.log(normal / fp8_max) / np.log(z_min), 1.0)
  np.testing.assert_allclose(np.asarray(stored.power), k, rtol=1e-5)
  assert 0 < k[2, 1] < 1 < k[0, 0]
  # The stored FP8 magnitudes of each group span exactly [normal, fp8_max].
  stored_groups = np.abs(grouped(np.asarray(stored.values, np.float32), 8))
  smallest = np.where(stored_groups > 0, stored_groups, np.inf).min(-1)
  np.testing.assert_array_equal(smallest[k != 1], normal)
  np.testing.assert_array_equal(stored_groups.max(-1), fp8_max)
  error = grouped(np.abs(decoded - x), 8) / np.where(groups > 0, groups, 1)
  assert np.all(error <= expand_range_bound(k, nmant)[..., None])
  assert decoded[0, 3] == 0


def test_float16_scale_and_error():
  x = spread(np.random.default_rng(2), (8, 33), -20, 10)
  x[3, 4] = 0.0
  stored, decoded = round_trip_one(Float16(), x)
  absmax = np.abs(x).max()
  assert stored.values.dtype == np.float16 and stored.scale.shape == ()
  # Megatron's scale: absmax / (65504 / 2) (within XLA's reciprocal, above).
  np.testing.assert_array_max_ulp(
    np.asarray(stored.scale), np.float32(absmax) / np.float32(32752), maxulp=1
  )
  assert np.abs(np.asarray(stored.values, np.float32)).max() == 32752
  error = np.abs(decoded.astype(np.float64) - x)
  # float16 keeps 11 significant bits: relative error 2**-11 (plus two
  # float32 roundings) for values above absmax * 2**-14.
  big = np.abs(x) > absmax * 2.0**-14
  assert big.sum() > 50 and (~big).sum() > 50
  assert np.all(error[big] <= np.abs(x[big]) * (2**-11 + 2**-22))
  # Smaller ones: the same where they stay normal float16 values, half the
  # subnormal spacing (2**-25) times the scale below.
  small = np.abs(x[~big]) * (2**-11 + 2**-22) + 2**-25 * float(stored.scale)
  assert np.all(error[~big] <= small)
  assert decoded[3, 4] == 0


def test_bfloat16_nearest_equals_ml_dtypes(variant):
  rng = np.random.default_rng(3)
  x = spread(rng, 512, -100, 88)  # float32 subnormals up to 1e38
  ties = 1 + np.arange(1, 64, 2, dtype=np.float32) * 2**-8  # halfway cases
  special = [0.0, -0.0, np.inf, -np.inf, F32_MAX, -F32_MAX, 1e-45]
  x = np.concatenate([x, ties, -ties, np.array(special, np.float32)])
  got = variant(lambda x: compress(BFloat16(), x))(jnp.asarray(x))
  assert got.dtype == jnp.bfloat16
  np.testing.assert_array_equal(bits(got), bits(x.astype(BF16)))
  np.testing.assert_array_equal(
    bits(expand(BFloat16(), got)), bits(x.astype(BF16).astype(np.float32))
  )


def test_bfloat16_stochastic_is_unbiased_and_reproducible():
  n, draws = 2048, 64
  rng = np.random.default_rng(4)
  exponent = rng.integers(-3, 4, n)
  # 1/8 or 3/8 of a bfloat16 ulp (2**-7 in [1, 2)) above a bfloat16 value,
  # where rounding to nearest always rounds down, or on one (kept exact).
  offset = rng.choice([0, 1, 3], n) / 8
  mantissa = 1 + (rng.integers(0, 128, n) + offset) * 2**-7
  lo = np.ldexp(mantissa - offset * 2**-7, exponent)
  ulp = np.ldexp(2**-7, exponent)
  sign = rng.choice([-1.0, 1.0], n)
  x = (sign * np.ldexp(mantissa, exponent)).astype(np.float32)
  fmt = BFloat16("stochastic", seed=5)
  draw = jax.jit(jax.vmap(lambda k: compress(fmt, jnp.asarray(x), k)))
  keys = jax.random.split(jax.random.key(0), draws)
  y = draw(keys)
  assert y.dtype == jnp.bfloat16
  # The same keys draw the same bits, other keys other ones.
  np.testing.assert_array_equal(bits(draw(keys)), bits(y))
  other = draw(jax.random.split(jax.random.key(1), draws))
  assert np.mean(bits(other) != bits(y)) > 0.1
  y = np.asarray(y, np.float64)
  # Always one of the two neighbours; exact values stay exact.
  magnitude = np.abs(y)
  assert np.all((magnitude == lo) | (magnitude == lo + ulp))
  assert np.all(np.sign(y) == sign)
  assert np.all(y[:, offset == 0] == x[offset == 0])
  # Unbiased: each draw is off by p - [up], of variance p (1 - p) <= 1/4
  # ulp**2; five standard deviations of the mean.
  error = (magnitude - np.abs(x)) / ulp
  assert np.all(np.abs(error.mean(0)) <= 5 * 0.5 / np.sqrt(draws))
  assert abs(error.mean()) <= 5 * 0.5 / np.sqrt(error.size)
  nearest = (np.abs(x.astype(BF16).astype(np.float64)) - np.abs(x)) / ulp
  assert nearest.mean() < -0.15  # what rounding to nearest would be off by


# -- Settings ------------------------------------------------------------------


class HitsState(NamedTuple):
  hits: Any  # an int32 array per param


def count_updates():
  """A transformation written the optax way, with an int field that mirrors
  the params (one int32 array per param, shaped like it)."""

  def init(params):
    return HitsState(
      jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.int32), params)
    )

  def update(updates, state, params=None):
    del params
    return updates, HitsState(jax.tree.map(lambda h: h + 1, state.hits))

  return optax.GradientTransformation(init, update)


@pytest.mark.parametrize(
  "make,error,match",
  [
    (lambda: FP8(group_size=0), ValueError, r"FP8 group_size .* int >= 1, got 0"),
    (lambda: FP8(group_size=1.5), ValueError, r"FP8 group_size .* got 1\.5"),
    (lambda: FP8(dtype="e3m4"), ValueError, r"'e4m3' or 'e5m2', got 'e3m4'"),
    (lambda: FP8(expand_range="yes"), TypeError, r"expand_range .* got 'yes'"),
    (lambda: BFloat16(rounding="up"), ValueError, r"'nearest' or 'stochastic', got 'up'"),
    (lambda: BFloat16(seed=-1), ValueError, r"seed must be an int >= 0, got -1"),
  ],
  ids=["group_0", "group_1.5", "e3m4", "expand_yes", "rounding_up", "seed_-1"],
)  # fmt: skip
def test_format_settings_are_checked(make, error, match):
  with pytest.raises(error, match=match):
    make()


PARAMS = {"w": jnp.ones((3, 5)), "b": jnp.ones(5, jnp.bfloat16)}


@pytest.mark.parametrize(
  "inner,formats,match",
  [
    (optax.adam(1e-2), {"mux": FP8()}, r"'mux', which is no field .*: mu, nu\."),
    (optax.adam(1e-2), {"count": FP8()}, r"'count', .* not hold one value per param.*: mu, nu\."),
    (count_updates(), {"hits": FP8()}, r"state_formats\['hits'\] .* 'hits/b' is int32"),
  ],
  ids=["unknown", "not_per_param", "int_leaf"],
)  # fmt: skip
def test_bad_state_field_names_fail_at_init(inner, formats, match):
  tx = jmp_train.mixed_precision(inner, state_formats=formats)
  with pytest.raises(ValueError, match=match):
    tx.init(PARAMS)


@pytest.mark.parametrize(
  "formats,match",
  [
    ("fp8", r"state_formats must be None, .* got 'fp8'"),
    (FP8, r"state_formats must be a format instance, .* pass FP8\(\)"),
    ({"mu": FP8}, r"state_formats\['mu'\] .* pass an instance: FP8\(\)"),
    (
      {"mu": "bf16"},
      r"state_formats\['mu'\] must be .*FP8\(\.\.\.\), got 'bf16'",
    ),
    ({0: FP8()}, r"keys must be state field names .* got 0"),
  ],
  ids=["string", "class", "class_in_dict", "string_in_dict", "int_key"],
)
def test_state_formats_must_be_formats(formats, match):
  with pytest.raises(TypeError, match=match):
    jmp_train.mixed_precision(optax.adam(1e-2), state_formats=formats)


def test_stochastic_compress_needs_a_key():
  with pytest.raises(ValueError, match="needs a key"):
    compress(BFloat16("stochastic"), jnp.ones(2))


def test_one_format_for_every_float_field():
  inner = optax.chain(count_updates(), optax.adam(1e-2))
  tx = jmp_train.mixed_precision(inner, state_formats=Float16())
  state = jax.eval_shape(tx.init, PARAMS)
  after = jax.eval_shape(tx.update, PARAMS, state, PARAMS)[1]
  chex.assert_trees_all_equal_dtypes(after, state)
  hits, adam = state.inner_state[0], state.inner_state[1][0]
  assert all(h.dtype == jnp.int32 for h in jax.tree.leaves(hits))  # kept
  assert adam.count.dtype == jnp.int32
  for field in (adam.mu, adam.nu):
    assert all(s.values.dtype == jnp.float16 for s in field.values())
    assert all(s.scale.shape == () for s in field.values())
  for fmt, dtype in ((BFloat16(), jnp.bfloat16), (Float32(), jnp.float32)):
    tx = jmp_train.mixed_precision(optax.adam(1e-2), state_formats=fmt)
    adam = jax.eval_shape(tx.init, PARAMS).inner_state[0]
    moments = jax.tree.leaves((adam.mu, adam.nu))
    assert len(moments) == 4 and {x.dtype for x in moments} == {np.dtype(dtype)}


# -- mixed_precision -----------------------------------------------------------

INNERS = {
  "adam": lambda: optax.adam(1e-2),
  "clip_adam": lambda: optax.chain(
    optax.clip_by_global_norm(1.0), optax.adam(1e-2)
  ),
  "inject": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
  "multisteps": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
}
FP8_MU_BF16_NU = {"mu": FP8(group_size=2), "nu": BFloat16()}


def quantize_fp8_mu_bf16_nu(mu, nu):
  mu = jax.tree.map(lambda m: fp8_roundtrip(m, "e4m3", 2), mu)
  nu = jax.tree.map(lambda v: np.asarray(v).astype(BF16).astype(np.float32), nu)
  return mu, nu


def quantize_float16(mu, nu):
  def one(x):
    x = np.asarray(x, np.float32)
    scale = np.abs(x).max() / np.float32(32752)
    return (x / scale).astype(np.float16).astype(np.float32) * scale

  return jax.tree.map(one, mu), jax.tree.map(one, nu)


CASES = {
  "adam": ("adam", FP8_MU_BF16_NU, quantize_fp8_mu_bf16_nu),
  "clip_adam": ("clip_adam", FP8_MU_BF16_NU, quantize_fp8_mu_bf16_nu),
  "inject": ("inject", FP8_MU_BF16_NU, quantize_fp8_mu_bf16_nu),
  "multisteps": ("multisteps", FP8_MU_BF16_NU, quantize_fp8_mu_bf16_nu),
  "adam_float16": ("adam", Float16(), quantize_float16),
}


@functools.cache
def case_step(case):
  """The case's jitted init and step (shared by tests)."""
  inner, formats, _ = CASES[case]
  tx = jmp_train.mixed_precision(INNERS[inner](), state_formats=formats)

  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(tx.init), step


def mp_params():
  rng = np.random.default_rng(5)
  return {
    "w": jnp.asarray(rng.standard_normal((3, 5)), jnp.float32),
    "b": jnp.asarray(rng.standard_normal(5), jnp.bfloat16),
  }


def mp_grads(steps):
  rng = np.random.default_rng(6)
  out = []
  for _ in range(steps):
    w = spread(rng, (3, 5), -6, 1)
    b = spread(rng, 5, -6, 1)
    out.append({"w": jnp.asarray(w), "b": jnp.asarray(b, jnp.bfloat16)})
  return out


def is_adam(x):
  return isinstance(x, optax.ScaleByAdamState)


def decode(stored):
  """A stored leaf's value by the written rules (FP8 groups of 2 here)."""
  if not isinstance(stored, jmp_train.state_format.Scaled):
    return np.asarray(stored, np.float32)
  if stored.values.dtype == np.float16:
    return np.asarray(stored.values, np.float32) * np.asarray(stored.scale)
  return fp8_expand_reference(stored.values, stored.scale, 2)


@pytest.mark.parametrize("case", list(CASES))
def test_update_equals_optax_with_quantized_moments(case):
  """Five steps, the third with an inf gradient (skipped), against plain
  optax on float32 (the bfloat16 param's master) whose moments are stored
  and read back by the NumPy reference after every step."""
  inner, _, quantize = CASES[case]
  init, step = case_step(case)
  params = mp_params()
  state = init(params)
  ref_tx = INNERS[inner]()
  ref_update = jax.jit(ref_tx.update)
  masters = jax.tree.map(lambda p: p.astype(jnp.float32), params)
  ref_state = ref_tx.init(masters)

  def quantized(s):
    if not is_adam(s):
      return s
    mu, nu = quantize(s.mu, s.nu)
    return s._replace(mu=mu, nu=nu)

  grads = mp_grads(5)
  grads[2] = dict(grads[2], w=grads[2]["w"].at[1, 2].set(jnp.inf))
  for i, g in enumerate(grads):
    new_params, new_state = step(params, state, g)
    if i == 2:  # skipped: params, masters and every stored bit kept
      assert int(new_state.skipped_steps) == 1
      assert_same_bits(new_params, params)
      assert_same_bits(new_state.master_params, state.master_params)
      assert_same_bits(new_state.inner_state, state.inner_state)
    else:
      g32 = jax.tree.map(lambda g: g.astype(jnp.float32), g)
      updates, ref_state = ref_update(g32, ref_state, masters)
      masters = optax.apply_updates(masters, updates)
      ref_state = jax.tree.map(quantized, ref_state, is_leaf=is_adam)
    params, state = new_params, new_state
    np.testing.assert_allclose(params["w"], masters["w"], rtol=1e-6)
    np.testing.assert_allclose(
      state.master_params["b"], masters["b"], rtol=1e-6
    )
    np.testing.assert_array_equal(
      bits(params["b"]), bits(state.master_params["b"].astype(jnp.bfloat16))
    )
  # The stored moments, read back by the written rules, are the reference's.
  (ref_adam,) = [
    s for s in jax.tree.leaves(ref_state, is_leaf=is_adam) if is_adam(s)
  ]
  for field in ("mu", "nu"):
    got = optax.tree.get(state.inner_state, field)
    for k in ("w", "b"):
      assert np.any(decode(got[k]) != 0)
      np.testing.assert_allclose(
        decode(got[k]), getattr(ref_adam, field)[k], rtol=1e-6
      )


def test_stored_dtypes_per_field():
  tx = jmp_train.mixed_precision(INNERS["adam"](), state_formats=FP8_MU_BF16_NU)
  params = mp_params()
  state = jax.eval_shape(tx.init, params)
  after = jax.eval_shape(tx.update, mp_grads(1)[0], state, params)[1]
  chex.assert_trees_all_equal_dtypes(after, state)
  chex.assert_trees_all_equal_shapes(after, state)
  adam = after.inner_state[0]
  assert adam.count.dtype == jnp.int32
  assert adam.mu["w"].values.dtype == jnp.float8_e4m3fn
  assert adam.mu["w"].scale.dtype == jnp.float32
  assert adam.mu["w"].scale.shape == (3, 3)  # groups of 2, 2 and 1
  assert adam.mu["b"].scale.shape == (3,)
  assert adam.nu["w"].dtype == adam.nu["b"].dtype == jnp.bfloat16
  assert after.master_params["b"].dtype == jnp.float32


# -- Composition: ZeRO-1, checkpoints, accumulation ----------------------------


def test_zero1_partitions_stored_values_and_scales():
  n = 8
  params = jax.eval_shape(lambda: _models.init_params(jnp.bfloat16))
  mu_fmt, nu_fmt = FP8(group_size=4), FP8("e5m2")  # 4 and 128 per group
  tx = jmp_train.mixed_precision(
    optax.adam(1e-3), state_formats={"mu": mu_fmt, "nu": nu_fmt}
  )
  plan = zero1.make_plan(tx, params, _models.mesh())
  plan1 = zero1.make_plan(tx, params, _models.mesh((1,)))
  is_scaled = lambda x: isinstance(x, jmp_train.state_format.Scaled)  # noqa: E731
  is_layout = lambda x: isinstance(x, zero1.LeafLayout)  # noqa: E731

  def expected(plan, n):
    """Per-device bytes of the stored state by the written rule: FP8
    values (and float32 masters) split 1/N along the param's partitioned
    dim; a scale split along it where it is a leading dim, or the last
    when the number of groups divides by N; scalars whole."""
    total = {"master_weights": 0, "optimizer_state": 0}
    layouts = jax.tree.leaves(plan.layouts, is_leaf=is_layout)
    for p, lay in zip(jax.tree.leaves(params), layouts, strict=True):
      shape = list(p.shape)
      if lay.dim is not None:
        shape[lay.dim] = lay.padded
      stored = [(tuple(shape), 4, lay.dim)]  # the master
      for fmt in (mu_fmt, nu_fmt):
        count = -(-shape[-1] // fmt.group_size)
        last = len(shape) - 1
        split = lay.dim is not None and (lay.dim < last or count % n == 0)
        stored.append((tuple(shape), 1, lay.dim))
        stored.append(
          (tuple(shape[:-1]) + (count,), 4, lay.dim if split else None)
        )
      for i, (s, size, dim) in enumerate(stored):
        s = list(s)
        if dim is not None:
          assert s[dim] % n == 0
          s[dim] //= n
        part = "master_weights" if i == 0 else "optimizer_state"
        total[part] += math.prod(s) * size
    scalars = [x for x in jax.tree.leaves(plan.opt_state) if x.ndim == 0]
    total["optimizer_state"] += sum(x.dtype.itemsize for x in scalars)
    return total

  # The plan lays each FP8 values leaf out as the param's master (its ZeRO
  # sharding) and a scale whose groups follow a leading partitioned dim
  # along that dim.
  masters = plan.opt_state.master_params
  for field in ("mu", "nu"):
    stored = optax.tree.get(plan.opt_state, field)
    values = jax.tree.map(lambda s: s.values, stored, is_leaf=is_scaled)
    scales = jax.tree.map(lambda s: s.scale, stored, is_leaf=is_scaled)
    for (path, v), m, s, lay in zip(
      jax.tree_util.tree_flatten_with_path(values)[0],
      jax.tree.leaves(masters),
      jax.tree.leaves(scales),
      jax.tree.leaves(plan.layouts, is_leaf=is_layout),
      strict=True,
    ):
      where = jax.tree_util.keystr(path)
      assert v.shape == m.shape and v.sharding.spec == m.sharding.spec, where
      shard = list(v.shape)
      shard[lay.dim] //= n
      assert v.sharding.shard_shape(v.shape) == tuple(shard), where
      if lay.dim < v.ndim - 1:
        assert s.sharding.spec[lay.dim] == "data", where
  head = optax.tree.get(plan.opt_state, "mu")["head"]["kernel"]
  assert head.scale.sharding.shard_shape(head.scale.shape) == (2, 10)
  state = jax.eval_shape(lambda p: TrainState.create(params=p, tx=tx), params)
  table = memory.memory_table(plan, state)
  table1 = memory.memory_table(plan1, state)
  for part, want in expected(plan, n).items():
    assert table[part] == want, part
  for part, want in expected(plan1, 1).items():
    assert table1[part] == want, part
  shrink = table1["optimizer_state"] / table["optimizer_state"]
  assert shrink > n / 2, (table1, table)
  assert table1["master_weights"] / table["master_weights"] > 0.75 * n


# A tiny model for the train-step tests: bfloat16 params, float32 masters.
STEP_FORMATS = {"mu": FP8(group_size=4), "nu": BFloat16("stochastic", seed=7)}


def step_loss(params, batch, model_state, key):
  del model_state, key
  p = jax.tree.map(lambda a: a.astype(jnp.float32), params)
  return jnp.mean((jnp.tanh(batch["x"] @ p["w"]) + p["b"] - batch["y"]) ** 2)


def step_setup(tx):
  """Params, two batches and the state at step 0, committed to a device as
  a restored checkpoint is (so that one compiled step serves both)."""
  rng = np.random.default_rng(7)
  params = {
    "w": jnp.asarray(rng.standard_normal((4, 6)), jnp.bfloat16),
    "b": jnp.asarray(rng.standard_normal(6), jnp.bfloat16),
  }
  batches = [
    {
      "x": jnp.asarray(rng.standard_normal((8, 4)), jnp.float32),
      "y": jnp.asarray(rng.standard_normal((8, 6)), jnp.float32),
    }
    for _ in range(2)
  ]
  state = TrainState.create(params=params, tx=tx)
  return params, batches, jax.device_put(state, jax.devices()[0])


def test_accumulated_steps_and_checkpoint_round_trip(tmp_path):
  """make_train_step(accum_steps=2) with FP8 and stochastic bfloat16 state:
  its first step against the whole batch's gradient, then a checkpoint
  round trip and one more step (one compiled step serves all)."""
  tx = jmp_train.mixed_precision(optax.adam(1e-2), state_formats=STEP_FORMATS)
  step = make_train_step(step_loss, tx, accum_steps=2)
  params, (batch, batch2), state = step_setup(tx)
  before = jax.eval_shape(lambda: state)
  state, metrics = step(state, batch)
  chex.assert_trees_all_equal_dtypes(state, before)
  stored = {x.dtype for x in jax.tree.leaves(state.opt_state)}
  assert stored >= {np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.bfloat16)}
  # The reference: the whole batch's float32 gradient and loss. Adam's first
  # step moves each master by lr * g / (|g| + eps), whatever the stored
  # format (the moments are stored after the update).
  p32 = jax.tree.map(lambda p: np.asarray(p, np.float32), params)
  loss, g = jax.jit(jax.value_and_grad(step_loss))(p32, batch, None, None)
  assert np.isfinite(float(metrics["loss"]))
  np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-6)
  for k in p32:
    g64 = np.asarray(g[k], np.float64)
    want = p32[k] - 1e-2 * g64 / (np.abs(g64) + 1e-8)
    np.testing.assert_allclose(
      state.opt_state.master_params[k], want, atol=1e-6
    )
  assert np.any(np.asarray(state.opt_state.inner_state[0].mu["w"].values) != 0)

  with Checkpointer(tmp_path) as ckpt:
    ckpt.save_state(state)
    ckpt.wait()
    restored = ckpt.restore_state(jax.eval_shape(lambda: state))
  assert_same_bits(restored, state)
  # One more step is the step without the round trip: stochastic rounding
  # draws its bits from the seed and the step, the same after a resume...
  resumed, _ = step(restored, batch2)
  straight, _ = step(jax.tree.map(jnp.copy, state), batch2)
  assert_same_bits(resumed, straight)
  # ... and other bits at another step (for the same values: mu, rounded to
  # nearest, and the masters are the same).
  steps = state.opt_state.steps + 5
  later = state.replace(opt_state=state.opt_state._replace(steps=steps))
  other, _ = step(jax.device_put(later, jax.devices()[0]), batch2)
  opt, other_opt = straight.opt_state, other.opt_state
  assert_same_bits(other_opt.master_params, opt.master_params)
  assert_same_bits(other_opt.inner_state[0].mu, opt.inner_state[0].mu)
  nu, other_nu = opt.inner_state[0].nu, other_opt.inner_state[0].nu
  assert any(np.any(bits(nu[k]) != bits(other_nu[k])) for k in nu)


# -- which fields one format stores; masked states; NaN; unchanged leaves ----


def test_one_format_stores_moments_not_param_copies_or_gradients():
  # MultiSteps' acc_grads are gradients, schedule-free's z is the iterate:
  # one format stores the moments only, and finding none is an error.
  tx = jmp_train.mixed_precision(
    optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
    state_formats=BFloat16(),
  )
  state = jax.eval_shape(tx.init, PARAMS).inner_state
  assert {x.dtype for x in jax.tree.leaves(state.acc_grads)} == {
    np.dtype(jnp.float32)
  }
  adam = state.inner_opt_state[0]
  assert {x.dtype for x in jax.tree.leaves((adam.mu, adam.nu))} == {
    np.dtype(jnp.bfloat16)
  }
  tx = jmp_train.mixed_precision(
    optax.contrib.schedule_free_adamw(1e-2), state_formats=BFloat16()
  )
  state = jax.eval_shape(tx.init, PARAMS).inner_state
  z = optax.tree.get(state, "z")
  assert {x.dtype for x in jax.tree.leaves(z)} == {np.dtype(jnp.float32)}
  tx = jmp_train.mixed_precision(optax.sgd(1e-2), state_formats=BFloat16())
  with pytest.raises(ValueError, match=r"moments .* has none"):
    tx.init(PARAMS)


@pytest.mark.parametrize("masking", ["masked", "multi_transform"])
def test_masked_optimizers_store_the_fields_they_have(masking):
  if masking == "masked":
    inner = optax.masked(optax.adam(1e-2), {"w": True, "b": False})
  else:
    inner = optax.multi_transform(
      {"a": optax.adam(1e-2), "s": optax.sgd(1e-2)}, {"w": "a", "b": "s"}
    )
  for formats in ({"mu": FP8(), "nu": BFloat16()}, BFloat16()):
    tx = jmp_train.mixed_precision(inner, state_formats=formats)
    state = tx.init(PARAMS)
    mu, nu = optax.tree.get(state, "mu"), optax.tree.get(state, "nu")
    assert isinstance(mu["b"], optax.MaskedNode)
    assert nu["w"].dtype == jnp.bfloat16
    kind = jmp_train.state_format.Scaled if formats != BFloat16() else jax.Array
    assert isinstance(mu["w"], kind)


def test_nan_keeps_its_own_value_nan_and_the_others_their_precision():
  x = jnp.array([1.0, jnp.nan, -2.0, 0.5], jnp.float32)
  for fmt in (
    FP8(group_size=4),
    FP8(group_size=4, expand_range=True),
    Float16(),
  ):
    y = np.asarray(expand(fmt, compress(fmt, x)))
    assert np.isnan(y[1]), fmt
    np.testing.assert_allclose(y[[0, 2, 3]], [1.0, -2.0, 0.5], rtol=2**-3)


@pytest.mark.parametrize(
  "formats",
  [
    {"mu": FP8(group_size=2, expand_range=True), "nu": FP8()},
    # Stored back without a check (state_storage.compress_state): a
    # bfloat16 value rounds to itself, stochastically too.
    {"mu": BFloat16(), "nu": BFloat16("stochastic", seed=2)},
  ],
  ids=["fp8", "bfloat16"],
)
def test_a_leaf_the_update_leaves_unchanged_keeps_its_stored_bits(formats):
  # MultiSteps' mini-steps do not change Adam's moments; storing their
  # expansion again would move an FP8 scale or exponent by an ulp.
  tx = jmp_train.mixed_precision(
    optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
    state_formats=formats,
  )
  grads = jax.tree.map(
    lambda p: jnp.linspace(0.1, 3.0, p.size).reshape(p.shape).astype(p.dtype),
    PARAMS,
  )  # noqa: E501
  update = jax.jit(tx.update)
  state = tx.init(PARAMS)
  for _ in range(2):  # a mini-step, then Adam's update
    _, state = update(grads, state, PARAMS)
  moments = (
    optax.tree.get(state.inner_state, "mu"),
    optax.tree.get(state.inner_state, "nu"),
  )
  _, state = update(grads, state, PARAMS)  # a mini-step
  after = (
    optax.tree.get(state.inner_state, "mu"),
    optax.tree.get(state.inner_state, "nu"),
  )
  for a, b in zip(
    jax.tree.leaves(moments), jax.tree.leaves(after), strict=True
  ):
    np.testing.assert_array_equal(bits(a), bits(b))


def test_adjust_precision_refuses_a_state_stored_below_float32():
  params = {"w": jnp.ones((2, 4), jnp.bfloat16)}
  tx = jmp_train.get_preset("bf16-sr-lean").mixed_precision(optax.adam(1e-2))
  with pytest.raises(
    ValueError, match=r"inner_state/0/mu/w is stored as bfloat16"
  ):
    jmp_train.adjust_precision(params, tx.init(params), "bf16-true")


def test_contract_init_abstract_no_recompile_types_kept():
  formats = {"mu": FP8(group_size=2), "nu": BFloat16("stochastic", seed=3)}
  tx = jmp_train.mixed_precision(
    optax.adam(1e-2),
    param_update=jmp_train.ParamRemainders(),
    state_formats=formats,
    loss_scale=jmp_train.dynamic_loss_scale(),
  )
  abstract = jax.tree.map(
    lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), PARAMS
  )
  types = jax.tree.map(jax.typeof, jax.eval_shape(tx.init, abstract))
  update = jax.jit(tx.update)
  state = jax.jit(tx.init)(PARAMS)
  grads = jax.tree.map(jnp.ones_like, PARAMS)
  for _ in range(3):
    _, state = update(grads, state, PARAMS)
    assert jax.tree.map(jax.typeof, state) == types
  assert update._cache_size() == 1


@pytest.mark.parametrize("n", [8, 6])
def test_zero1_step_with_stored_formats_follows_the_one_device_step(n):
  # Gradients are summed in another order on n devices, so an FP8 rounding
  # can flip: one FP8 ulp (2**-3 of a moment) moves an Adam update by at
  # most that fraction of the learning rate. On 6 devices b is padded to
  # 12 (2 per device), which makes 3 groups of 4 for mu and one of 128 for
  # nu: 6 divides neither count, so those groups are replicated.
  lr = 1e-3
  tx = jmp_train.mixed_precision(
    optax.adam(lr),
    param_update=jmp_train.ParamRemainders(),
    state_formats={"mu": FP8(group_size=4), "nu": FP8(expand_range=True)},
  )
  rng = np.random.default_rng(0)
  params = {
    "w1": jnp.asarray(rng.normal(size=(12, 32)), jnp.bfloat16),
    "w2": jnp.asarray(rng.normal(size=(32, 5)) / 6, jnp.bfloat16),
    "b": jnp.zeros(10, jnp.bfloat16),  # 10: padded to 16 on 8 devices
  }
  mesh = jax.make_mesh(
    (n,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n]
  )

  def loss_fn(params, batch, model_state, key):
    h = jnp.tanh(batch @ params["w1"].astype(jnp.float32))
    out = h @ params["w2"].astype(jnp.float32) + params["b"][:5]
    return jnp.mean(jnp.square(out - 1.0))

  plan = zero1.make_plan(tx, params, mesh)
  one = TrainState.create(params=params, tx=tx)
  eight = TrainState.create(params=params, tx=tx, plan=plan)
  step1 = make_train_step(loss_fn, tx)
  step8 = make_train_step(loss_fn, tx, plan=plan)
  for _ in range(2):
    batch = jnp.asarray(rng.normal(size=(24, 12)), jnp.float32)
    one, m1 = step1(one, batch)
    eight, m8 = step8(eight, batch)
    np.testing.assert_allclose(m8["loss"], m1["loss"], rtol=1e-4)
  for leaf, planned in zip(
    jax.tree.leaves(eight.opt_state),
    jax.tree.leaves(plan.opt_state),
    strict=True,
  ):
    assert leaf.dtype == planned.dtype
    assert leaf.sharding.is_equivalent_to(planned.sharding, leaf.ndim)
  dim = plan.layouts["w1"].dim  # 1 on 8 devices (32 columns), 0 on 6
  spec = optax.tree.get(eight.opt_state, "mu")["w1"].values.sharding.spec
  assert spec[dim] == "data"
  for a, b in zip(
    jax.tree.leaves(eight.params), jax.tree.leaves(one.params), strict=True
  ):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    # 2 steps of at most lr / 8 apart, plus one bf16 ulp of the param.
    ulp = 2.0 ** (np.floor(np.log2(np.abs(b) + 1e-30)) - 7)
    bound = 2 * lr / 8 + ulp + 1e-7
    np.testing.assert_array_less(np.abs(a - b), bound)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_a_float16_moment_stored_in_bfloat16_is_checked_for_change(rounding):
  # bfloat16 storage of a float16 moment does not store back to its bits:
  # 65504 (float16's largest) stores as bfloat16 65536, which reads back as
  # float16 inf. So the unchanged-moment check stays for it: a mini-step
  # keeps the stored 65536 instead of storing inf.
  tx = jmp_train.mixed_precision(
    optax.MultiSteps(
      optax.adam(1e-3, mu_dtype=jnp.float16), every_k_schedule=2
    ),
    state_formats={"mu": BFloat16(rounding, seed=1)},
  )
  # 65504 rounds up to 65536 with probability 7/8 stochastically: of 16,
  # some do (the bits are fixed by the seed).
  params = {"w": jnp.zeros(18, jnp.float32)}
  grads = {"w": jnp.array([655040.0] * 16 + [1.0, 2.0], jnp.float32)}
  update = jax.jit(tx.update)
  state = tx.init(params)
  for _ in range(2):  # a mini-step, then Adam's update: mu = 0.1 g
    _, state = update(grads, state, params)
  before = optax.tree.get(state.inner_state, "mu")["w"]
  assert (np.asarray(before[:16], np.float32) == 65536.0).any()
  _, state = update(grads, state, params)  # a mini-step
  after = optax.tree.get(state.inner_state, "mu")["w"]
  np.testing.assert_array_equal(bits(after), bits(before))
