"""Stochastic rounding: unbiased casts, and bf16 updates without masters."""

import _numpy_rules
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import jmp_train
from jmp_train._src import rounding

N = 20_000  # roundings per value


def _neighbours(x, dtype):
  """The two values of `dtype` around float32 `x`, from ml_dtypes' tables."""
  info = ml_dtypes.finfo(dtype)
  near = np.float32(x).astype(dtype)
  up = np.nextafter(near, np.array(np.inf, dtype)).astype(np.float64)
  down = np.nextafter(near, np.array(-np.inf, dtype)).astype(np.float64)
  near = float(near)
  lo, hi = (near, up) if near <= x else (down, near)
  assert lo <= x <= hi and hi - lo > 0, (x, info)
  return lo, hi


@pytest.mark.parametrize(
  "dtype, values",
  [
    (jnp.bfloat16, [1.0 + 2.0**-10, -3.3, 1e-3, 7.77e30, 3.3e-38]),
    (jnp.float16, [1.0 + 2.0**-13, -3.3, 1e-3, 6.5e4 - 3, 3e-7]),
  ],
)
def test_rounding_is_unbiased_with_bernoulli_variance(dtype, values):
  x = jnp.asarray(np.repeat(np.float32(values)[None], N, axis=0))
  y = np.asarray(
    jax.jit(jmp_train.cast_stochastic, static_argnums=1)(
      x, dtype, jax.random.key(0)
    )
  ).astype(np.float64)
  assert y.dtype == np.float64
  for j, v in enumerate(np.float32(values).astype(np.float64)):
    lo, hi = _neighbours(v, dtype)
    column = y[:, j]
    assert set(np.unique(column)) <= {lo, hi}
    p = (v - lo) / (hi - lo)
    # Mean: within 5 standard errors of x.
    sigma = np.sqrt(p * (1 - p) / N) * (hi - lo)
    assert abs(column.mean() - v) <= 5 * sigma + 1e-12 * abs(v), (
      v,
      column.mean(),
    )
    # Variance (x - lo)(hi - x), within 10%.
    want = (v - lo) * (hi - v)
    np.testing.assert_allclose(column.var(), want, rtol=0.1)


def test_round_to_nearest_is_biased_where_stochastic_rounding_is_not():
  x = jnp.full((N,), 1.0 + 2.0**-10, jnp.float32)  # 1/8 of a bf16 ulp
  nearest = np.asarray(x.astype(jnp.bfloat16), np.float64).mean()
  stochastic = np.asarray(
    jmp_train.cast_stochastic(x, jnp.bfloat16, jax.random.key(1)), np.float64
  ).mean()
  assert nearest == 1.0
  assert abs(stochastic - (1.0 + 2.0**-10)) < 2e-4


def test_special_values_and_other_leaves_pass_as_a_plain_cast_would():
  x = jnp.asarray([np.inf, -np.inf, np.nan, 0.0, -0.0, 1.5, 1e6], jnp.float32)
  subnormal = jnp.asarray([1.1e-39, -3e-40], jnp.float32)
  np.testing.assert_array_equal(
    jmp_train.cast_stochastic(subnormal, jnp.bfloat16, jax.random.key(0)),
    subnormal.astype(jnp.bfloat16),
  )
  tree = {
    "x": x,
    "i": jnp.arange(3),
    "b": jnp.ones(2, bool),
    "f8": jnp.ones(2, jnp.float8_e4m3fn),
    "h": jnp.asarray([1.0], jnp.bfloat16),
  }
  out = jax.jit(jmp_train.cast_stochastic, static_argnums=1)(
    tree, jnp.float16, jax.random.key(0)
  )
  # Exact values stay; 1e6 is beyond float16's max and rounds as a cast does,
  # like float32 subnormals (flushed to zero by CPU and GPU arithmetic).
  np.testing.assert_array_equal(out["x"], x.astype(jnp.float16))
  assert np.signbit(np.asarray(out["x"][4]))
  for k in ("i", "b", "f8"):
    assert out[k].dtype == tree[k].dtype
    np.testing.assert_array_equal(out[k], tree[k])
  eager = jmp_train.cast_stochastic(tree["i"], jnp.float16, jax.random.key(0))
  assert eager is tree["i"]
  assert out["h"].dtype == jnp.float16
  with pytest.raises(
    ValueError, match="bfloat16 or float16, got dtype .*float32"
  ):
    jmp_train.cast_stochastic(x, jnp.float32, jax.random.key(0))


# ---------------------------------------------------------------------------
# mixed_precision(..., param_update=StochasticRounding(seed))


def _run(steps, *, stochastic, seed=0, start=None):
  """SGD with a constant gradient whose updates are 1/16 of a bf16 ulp."""
  params = {"w": jnp.ones((4096,), jnp.bfloat16), "n": jnp.arange(2)}
  if stochastic:
    rule = jmp_train.StochasticRounding(seed=seed)
  else:
    rule = jmp_train.RoundToNearest()
  tx = jmp_train.mixed_precision(optax.sgd(2.0**-11), param_update=rule)
  grads = {"w": jnp.ones((4096,), jnp.bfloat16), "n": jnp.zeros(2, jnp.int32)}

  @jax.jit
  def step(params, state):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params, state = start or (params, tx.init(params))
  history = []
  for _ in range(steps):
    params, state = step(params, state)
    history.append((params, state))
  return history


def test_stochastic_rounding_keeps_small_updates_that_nearest_loses():
  steps = 32
  nearest = _run(steps, stochastic=False)[-1][0]
  stochastic = _run(steps, stochastic=True)[-1][0]
  want = 1.0 - steps * 2.0**-11  # the float32 run
  assert (np.asarray(nearest["w"], np.float32) == 1.0).all()  # all lost
  mean = np.asarray(stochastic["w"], np.float64).mean()
  assert abs(mean - want) < 3e-4, mean
  np.testing.assert_array_equal(stochastic["n"], [0, 1])


def test_stochastic_rounding_is_reproducible_from_the_step():
  first = _run(6, stochastic=True)
  again = _run(6, stochastic=True)
  resumed = _run(3, stochastic=True, start=first[2])
  other_seed = _run(6, stochastic=True, seed=1)
  final = np.asarray(first[-1][0]["w"])
  np.testing.assert_array_equal(np.asarray(again[-1][0]["w"]), final)
  np.testing.assert_array_equal(np.asarray(resumed[-1][0]["w"]), final)
  assert not np.array_equal(np.asarray(other_seed[-1][0]["w"]), final)


def test_stochastic_rounding_takes_its_seed_and_nothing_else():
  # The seed lives in the rule, so "stochastic rounding with master weights"
  # cannot be written; a bad seed is refused where it is given.
  assert jmp_train.StochasticRounding(np.int64(3)).seed == 3
  assert type(jmp_train.StochasticRounding(np.int64(3)).seed) is int
  for bad in (1.5, -1, True, "0", jnp.int32(2)):
    with pytest.raises(ValueError, match="StochasticRounding seed must be an"):
      jmp_train.StochasticRounding(seed=bad)
  with pytest.raises(TypeError, match=r"an instance: StochasticRounding\(\)"):
    jmp_train.mixed_precision(
      optax.sgd(1.0), param_update=jmp_train.StochasticRounding
    )
  with pytest.raises(TypeError, match="stochastic_rounding"):  # old keyword
    jmp_train.mixed_precision(optax.sgd(1.0), stochastic_rounding=True)


def test_bfloat16_beyond_its_largest_value_rounds_as_a_cast_does():
  # Between bfloat16's largest value and float32's, the upper neighbour is
  # inf: the values round to nearest, never up to inf at random.
  big = float(ml_dtypes.finfo(jnp.bfloat16).max)
  x = jnp.asarray([big * 1.001, -big * 1.003, 3.3995e38] * 1000, jnp.float32)
  y = jmp_train.cast_stochastic(x, jnp.bfloat16, jax.random.key(0))
  np.testing.assert_array_equal(y, x.astype(jnp.bfloat16))


def test_seeds_beyond_what_jax_takes_are_refused_by_name():
  with pytest.raises(ValueError, match=r"StochasticRounding seed .*2\*\*63"):
    jmp_train.StochasticRounding(seed=2**63)
  with pytest.raises(ValueError, match=r"BFloat16 seed .*2\*\*63"):
    jmp_train.state_format.BFloat16("stochastic", seed=2**64)


def test_the_readme_stream_rule_reproduces_the_transformation():
  """README: at update `steps` the bfloat16 params take
  jax.random.bits(fold_in(fold_in(key(seed), 0), steps), (n,), uint16), n
  their values, cut in leaf order; applied by hand in NumPy, it gives the
  params the transformation gives."""
  seed = 7
  params = {
    "a": jnp.full((4096,), 1.0, jnp.bfloat16),
    "b": jnp.full((64, 64), -2.0, jnp.bfloat16),
  }
  grads = {"a": jnp.full((4096,), 1e-3), "b": jnp.full((64, 64), 2e-3)}
  tx = jmp_train.mixed_precision(
    optax.sgd(1.0), param_update=jmp_train.StochasticRounding(seed=seed)
  )
  state, got = tx.init(params), params
  want = {k: np.asarray(v).view(np.uint16) for k, v in params.items()}
  for steps in range(2):
    updates, state = tx.update(grads, state, got)
    got = optax.apply_updates(got, updates)
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), 0), steps)
    bits = np.split(np.asarray(jax.random.bits(key, (8192,), jnp.uint16)), 2)
    for name, b in zip(sorted(params), bits, strict=True):
      x = want[name].astype(np.uint32) << 16  # bfloat16 bits to float32's
      x = x.view(np.float32) - np.asarray(grads[name], np.float32)
      want[name] = _numpy_rules.bf16_stochastic(x, b.reshape(x.shape))
    for name in params:
      np.testing.assert_array_equal(
        np.asarray(got[name]).view(np.uint16), want[name]
      )
  # Stochastic: both directions were taken.
  assert len(np.unique(np.asarray(got["a"], np.float32))) > 1


@pytest.mark.parametrize("one_word", [2**32, 1])
@pytest.mark.parametrize("grouped", [True, False])
def test_stream_bits_are_jax_random_bits_cut_in_order(
  grouped, one_word, monkeypatch
):
  # Few draws (consecutive arrays up to MAX_DRAW values, 40 here; a larger
  # array alone) or one per array, counters in one word or (ONE_WORD = 1)
  # in two-word products on every axis: JAX's bits of the whole stream.
  monkeypatch.setattr(rounding, "MAX_DRAW", 40)
  monkeypatch.setattr(rounding, "ONE_WORD", one_word)
  key = rounding.stream_key(3, rounding.STATE_STREAM, 5)
  shapes = [(3, 2), (), (7,), (0,), (5, 3, 4), (41,), (2, 3), (4, 2)]
  sizes = [int(np.prod(s)) for s in shapes]
  want = np.split(
    np.asarray(jax.random.bits(key, (sum(sizes),), jnp.uint16)),
    np.cumsum(sizes)[:-1],
  )
  draw = jax.jit(lambda k: rounding.stream_bits(k, shapes, grouped))
  for g, w, shape in zip(draw(key), want, shapes, strict=True):
    assert g.shape == shape and g.dtype == jnp.uint16
    np.testing.assert_array_equal(np.asarray(g).ravel(), w)
  program = str(jax.make_jaxpr(draw)(key))
  # Grouped: 6 + 1 + 7 + 0 values, (5, 3, 4) alone, (41,) alone, 6 + 8.
  draws = program.count("= threefry2x32 ")
  assert draws == (4 if grouped else len(shapes)), draws


def test_two_word_arithmetic_against_python_ints():
  # The 64-bit counters' products and sums, in uint32 words, against
  # Python's exact integers (mod 2**64).
  rng = np.random.default_rng(0)
  a = rng.integers(0, 2**32, 2000, dtype=np.uint64)
  a[:4] = [0, 1, 2**32 - 1, 2**31]
  for b in [
    0,
    1,
    3,
    2**16 + 1,
    2**32 - 1,
    2**32,
    2**32 + 7,
    2**63 + 5,
    2**64 - 1,
  ]:
    hi, lo = rounding.mul_wide(jnp.asarray(a.astype(np.uint32)), b)
    got = (np.asarray(hi).astype(object) << 32) + np.asarray(lo).astype(object)
    want = [(int(x) * b) % 2**64 for x in a]
    assert got.tolist() == want, b
  x, y = (rng.integers(0, 2**63, 500, dtype=np.uint64) * 2 + 1 for _ in "xy")
  words = [
    jnp.asarray(w.astype(np.uint32))
    for v in (x, y)
    for w in (v >> 32, v & 0xFFFFFFFF)
  ]
  hi, lo = rounding.add_wide(*words)
  got = (np.asarray(hi).astype(object) << 32) + np.asarray(lo).astype(object)
  assert got.tolist() == [
    (int(p) + int(q)) % 2**64 for p, q in zip(x, y, strict=True)
  ]


def test_stream_bits_of_an_array_beyond_two_to_the_32_values():
  # A stacked layer's bf16 param can pass 2**32 values: its counters take
  # two words (shapes only here; the arithmetic is tested above). A stack
  # of one layer puts a stride of 2**32 on an axis of one value.
  key = rounding.stream_key(0, rounding.PARAM_STREAM, 0)
  for shape in [(80, 8192, 28672), (1, 2**16, 2**16)]:
    for grouped in (True, False):
      (out,) = jax.eval_shape(
        lambda k, g=grouped, s=shape: rounding.stream_bits(k, [s], g), key
      )
      assert out.shape == shape and out.dtype == jnp.uint16


def test_stream_bits_count_past_two_to_the_32():
  # Where the values before an array pass 2**32 (a 7B model's bf16 params),
  # its counters carry into the high word: NumPy's uint64 counters, drawn
  # by JAX's threefry primitive. (The first array's draw is dead code.)
  from jax.extend.random import threefry2x32_p

  key = rounding.stream_key(0, rounding.PARAM_STREAM, 0)
  first = (2**16, 2**16 - 1)  # 2**32 - 2**16 values
  got = jax.jit(
    lambda k: rounding.stream_bits(k, [first, (7, 10**4)], False)[1]
  )(key)
  start = 2**32 - 2**16
  count = np.arange(start, start + 7 * 10**4, dtype=np.uint64)
  assert count[0] < 2**32 <= count[-1]
  hi, lo = (
    jnp.asarray(c.astype(np.uint32)) for c in (count >> 32, count & 0xFFFFFFFF)
  )
  words = jax.random.key_data(key)
  x1, x2 = threefry2x32_p.bind(words[0], words[1], hi, lo)
  np.testing.assert_array_equal(
    np.asarray(got).ravel(), np.asarray(x1 ^ x2).astype(np.uint16)
  )


def test_each_kind_of_param_takes_its_own_bits():
  # Integer and float32 params draw nothing; the bfloat16 ones share the
  # stream in leaf order, skipping the others; a float16 one draws from its
  # leaf's key (README), with cast_stochastic's rule.
  seed, rng = 5, np.random.default_rng(2)
  params = {
    "a": jnp.arange(4),
    "b": jnp.asarray(rng.standard_normal(64), jnp.float32),
    "c": jnp.asarray(1 + rng.random(64) / 8, jnp.bfloat16),
    "d": jnp.asarray(1 + rng.random(256) / 8, jnp.float16),
    "e": jnp.asarray(rng.standard_normal((8, 16)), jnp.bfloat16),
  }
  grads = jax.tree.map(
    lambda p: jnp.full(p.shape, 3e-4, p.dtype) if p.dtype != jnp.int32 else p,
    params,
  )
  tx = jmp_train.mixed_precision(
    optax.sgd(1.0), param_update=jmp_train.StochasticRounding(seed=seed)
  )
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  new = optax.apply_updates(params, updates)
  np.testing.assert_array_equal(new["a"], params["a"])
  np.testing.assert_array_equal(new["b"], params["b"] - grads["b"])
  base = jax.random.fold_in(jax.random.key(seed), 0)
  key = jax.random.fold_in(base, 0)  # update 0
  bits = np.asarray(jax.random.bits(key, (64 + 128,), jnp.uint16))
  for name, b in (("c", bits[:64]), ("e", bits[64:])):
    x = np.asarray(params[name], np.float32) - np.asarray(
      grads[name], np.float32
    )
    want = _numpy_rules.bf16_stochastic(x, b.reshape(x.shape))
    np.testing.assert_array_equal(np.asarray(new[name]).view(np.uint16), want)
  wide = params["d"].astype(jnp.float32) - grads["d"].astype(jnp.float32)
  want = jmp_train.cast_stochastic(
    wide, jnp.float16, jax.random.fold_in(key, 3)
  )
  np.testing.assert_array_equal(
    np.asarray(new["d"]).view(np.uint16), np.asarray(want).view(np.uint16)
  )
  assert not np.array_equal(new["d"], params["d"].astype(jnp.float16))
