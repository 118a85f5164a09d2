"""Loss scales against scripted references (torch.amp, Megatron-LM) and jmp."""

import dataclasses
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jmp_train as jmp


class TorchGradScalerRef:
  """torch.amp.GradScaler's update rule (aten `_amp_update_scale_` kernel).

  The scale is a float32 tensor; the factors are doubles, so products are
  taken in float64 and rounded to float32.
  """

  def __init__(self, init, growth_factor, backoff_factor, growth_interval):
    self.scale = np.float32(init)
    self.growth_tracker = 0
    self.g, self.b, self.interval = (
      growth_factor,
      backoff_factor,
      growth_interval,
    )

  def update(self, found_inf):
    if found_inf:
      self.scale = np.float32(np.float64(self.scale) * self.b)
      self.growth_tracker = 0
    else:
      successful = self.growth_tracker + 1
      if successful == self.interval:
        with np.errstate(over="ignore"):
          new_scale = np.float32(np.float64(self.scale) * self.g)
        if np.isfinite(new_scale):
          self.scale = new_scale
        self.growth_tracker = 0
      else:
        self.growth_tracker = successful


class MegatronScalerRef:
  """Megatron-LM's DynamicGradScaler.update (float32 tensors throughout)."""

  def __init__(
    self,
    init,
    min_scale,
    growth_factor,
    backoff_factor,
    growth_interval,
    hysteresis,
    max_scale=None,
  ):
    self.scale = np.float32(init)
    self.min, self.max = np.float32(min_scale), max_scale
    self.g, self.b = np.float32(growth_factor), np.float32(backoff_factor)
    self.interval, self.hysteresis = growth_interval, hysteresis
    self.growth_tracker, self.hysteresis_tracker = 0, hysteresis

  def update(self, found_inf):
    if found_inf:
      self.growth_tracker = 0
      self.hysteresis_tracker -= 1
      if self.hysteresis_tracker <= 0:
        self.scale = max(np.float32(self.scale * self.b), self.min)
    else:
      self.growth_tracker += 1
      if self.growth_tracker == self.interval:
        self.growth_tracker = 0
        self.hysteresis_tracker = self.hysteresis
        grown = np.float32(self.scale * self.g)
        if self.max is not None:  # our extension: a ceiling
          grown = min(grown, np.float32(self.max))
        self.scale = grown


def run_ours(scaler, finite_seq, jit):
  """Scale and counter after each step; lax.scan under jit, a loop if not."""
  finite_seq = jnp.asarray(finite_seq)
  if jit:

    def step(s, f):
      s = s.adjust(f)
      return s, (s.loss_scale, s.counter)

    _, (scales, counters) = jax.jit(lambda s, fs: jax.lax.scan(step, s, fs))(
      scaler, finite_seq
    )
    return np.asarray(scales), np.asarray(counters)
  scales, counters = [], []
  for f in finite_seq:
    scaler = scaler.adjust(f)
    scales.append(np.asarray(scaler.loss_scale))
    counters.append(int(scaler.counter))
  return np.array(scales), np.array(counters)


def overflow_sequences():
  rng = np.random.default_rng(42)
  seqs = {f"random_p{p}": rng.random(400) < p for p in (0.02, 0.1, 0.3, 0.7)}
  seqs["bursts"] = np.array(([False] * 9 + [True] * 3) * 30)
  seqs["alternating"] = np.array([True, False] * 150)
  seqs["all_overflow"] = np.ones(80, bool)
  return seqs


SEQS = overflow_sequences()


@pytest.mark.parametrize("name", sorted(SEQS))
@pytest.mark.parametrize("jit", [True, False])
@pytest.mark.parametrize(
  "growth,backoff,interval", [(2.0, 0.5, 3), (2.0, 0.5, 1), (4.0, 0.25, 5)]
)
def test_hysteresis_1_matches_torch_grad_scaler(
  name, jit, growth, backoff, interval
):
  found_inf = SEQS[name] if jit else SEQS[name][:60]
  # torch has no floor; a tiny min_scale keeps ours off the floor here.
  ours = jmp.dynamic_loss_scale(
    init_scale=2.0**16,
    growth_factor=growth,
    backoff_factor=backoff,
    growth_interval=interval,
    min_scale=2.0**-126,
  )
  ref = TorchGradScalerRef(2.0**16, growth, backoff, interval)
  want_scales, want_counters = [], []
  for inf in found_inf:
    ref.update(inf)
    want_scales.append(ref.scale)
    want_counters.append(ref.growth_tracker)
  scales, counters = run_ours(ours, ~found_inf, jit)
  want_scales = np.array(want_scales, np.float32)
  # The differences: torch has no floor and grows up to float32's largest
  # power of two (2**127); ours stays in [2**-126, 2**126]. Compare up to
  # the first step where torch's scale leaves that range.
  outside = np.flatnonzero((want_scales < 2.0**-126) | (want_scales > 2.0**126))
  n = outside[0] if outside.size else len(found_inf)
  assert n >= 40
  np.testing.assert_array_equal(scales[:n], want_scales[:n])
  np.testing.assert_array_equal(counters, want_counters)
  assert scales.min() >= 2.0**-126 and scales.max() <= 2.0**126


@pytest.mark.parametrize("name", sorted(SEQS))
@pytest.mark.parametrize("hysteresis", [2, 3])
@pytest.mark.parametrize(
  "growth,backoff,interval,min_scale,max_scale",
  [
    (2.0, 0.5, 4, 1.0, None),  # Megatron's defaults, shorter interval
    (1.5, 0.7, 3, 3.0, None),  # non-dyadic factors, float32 maths
    (2.0, 0.5, 2, 1.0, 2.0**18),  # our ceiling
  ],
)
def test_hysteresis_matches_megatron(
  name, hysteresis, growth, backoff, interval, min_scale, max_scale
):
  found_inf = SEQS[name]
  ours = jmp.dynamic_loss_scale(
    init_scale=2.0**16,
    growth_factor=growth,
    backoff_factor=backoff,
    growth_interval=interval,
    hysteresis=hysteresis,
    min_scale=min_scale,
    max_scale=max_scale,
  )
  ref = MegatronScalerRef(
    2.0**16, min_scale, growth, backoff, interval, hysteresis, max_scale
  )
  want = []
  for inf in found_inf:
    ref.update(inf)
    want.append(ref.scale)
  scales, _ = run_ours(ours, ~found_inf, jit=True)
  np.testing.assert_array_equal(scales, np.array(want, np.float32))
  assert scales.min() >= min_scale
  if max_scale is not None:
    assert scales.max() <= max_scale


def test_consecutive_hysteresis_counts_only_consecutive_overflows():
  # Budget 2: isolated overflows never back off; two in a row do.
  ours = jmp.dynamic_loss_scale(
    init_scale=1024.0,
    growth_interval=1000,
    hysteresis=2,
    consecutive_hysteresis=True,
  )
  found_inf = np.array([1, 0, 1, 0, 1, 1, 0, 1, 1, 1], bool)
  scales, _ = run_ours(ours, ~found_inf, jit=True)
  np.testing.assert_array_equal(
    scales, [1024, 1024, 1024, 1024, 1024, 512, 512, 512, 256, 128]
  )
  # Megatron-style (non-consecutive): the budget only refills on growth.
  plain = jmp.dynamic_loss_scale(
    init_scale=1024.0, growth_interval=1000, hysteresis=2
  )
  scales, _ = run_ours(plain, ~found_inf, jit=True)
  np.testing.assert_array_equal(
    scales, [1024, 1024, 512, 512, 256, 128, 128, 64, 32, 16]
  )


def test_growth_stops_at_2_126_and_floor_holds():
  # 2**126 is the largest scale whose reciprocal is a normal float32; jmp and
  # torch grow on to 2**127, whose reciprocal XLA flushes to 0.
  ls = jmp.DynamicLossScale(np.float32(2.0**125), period=1, factor=2)
  scales, counters = run_ours(ls, np.ones(5, bool), jit=True)
  np.testing.assert_array_equal(scales, np.full(5, np.float32(2.0**126)))
  np.testing.assert_array_equal(counters, 0)
  capped = jmp.DynamicLossScale(1.0, period=1, factor=3, max_loss_scale=5.0)
  scales, _ = run_ours(capped, np.ones(3, bool), jit=False)
  np.testing.assert_array_equal(scales, [3, 5, 5])
  floor = jmp.dynamic_loss_scale(init_scale=8.0, min_scale=2.0)
  scales, _ = run_ours(floor, np.zeros(6, bool), jit=False)
  np.testing.assert_array_equal(scales, [4, 2, 2, 2, 2, 2])


def test_settings_survive_flattening_jit_and_scan():
  ls = jmp.DynamicLossScale(
    jnp.float32(10.0),
    period=5,
    factor=3,
    min_loss_scale=0.3125,
    backoff_factor=0.25,
    max_loss_scale=1e4,
    hysteresis=2,
    consecutive_hysteresis=True,
  )
  leaves, treedef = jax.tree.flatten(ls)
  assert len(leaves) == 3
  back = jax.tree.unflatten(treedef, leaves)
  for field in (
    "period",
    "factor",
    "min_loss_scale",
    "backoff_factor",
    "max_loss_scale",
    "hysteresis",
    "consecutive_hysteresis",
  ):
    assert getattr(back, field) == getattr(ls, field)
  # jmp 0.0.4 resets min_loss_scale to 1 here (its PR #44 was never merged).
  adjust = jax.jit(lambda s: s.adjust(jnp.bool_(False)))
  for _ in range(20):
    ls = adjust(ls)
  assert float(ls.loss_scale) == 0.3125
  assert ls.min_loss_scale == 0.3125 and ls.max_loss_scale == 1e4
  _, scales = jax.lax.scan(
    lambda s, f: (s.adjust(f), s.loss_scale), ls, jnp.zeros(3, bool)
  )
  np.testing.assert_array_equal(scales, 0.3125)


# jmp's own loss_scale tests, run against ours.
@pytest.mark.parametrize("period,factor", [(20, 2), (30, 3)])
def test_jmp_adjust_increases_on_finite(period, factor):
  ls = jmp.DynamicLossScale(jnp.float32(10), jnp.int32(0), period, factor)
  for i in range(1, period):
    ls = ls.adjust(jnp.bool_(True))
    assert ls.loss_scale == 10 and ls.counter == i
  ls = ls.adjust(jnp.bool_(True))
  assert ls.loss_scale == 10 * factor and ls.counter == 0
  assert (ls.period, ls.factor) == (period, factor)


@pytest.mark.parametrize(
  "period,factor,min_loss_scale", [(20, 2, 1.0), (20, 2, 0.3125), (30, 3, 0.37)]
)
def test_jmp_adjust_reduces_to_min(period, factor, min_loss_scale):
  init = np.float32(10)
  ls = jmp.DynamicLossScale(
    jnp.asarray(init), jnp.int32(0), period, factor, jnp.asarray(min_loss_scale)
  )
  for i in range(100):
    ls = ls.adjust(jnp.bool_(False))
    np.testing.assert_allclose(
      ls.loss_scale,
      max(min_loss_scale, float(init) / factor ** (i + 1)),
      rtol=1e-5,
    )
    assert ls.counter == 0


def test_jmp_readme_loss_scaling_train_step():
  # jmp's README "Loss scaling" section with `import jmp_train as jmp`.
  def my_loss_fn(params, loss_scale, x):
    loss = jnp.mean((x @ params["w"]) ** 2)
    return loss_scale.scale(loss)

  @jax.jit
  def train_step(params, loss_scale, x):
    grads = jax.grad(my_loss_fn)(params, loss_scale, x)
    grads = loss_scale.unscale(grads)
    grads_finite = jmp.all_finite(grads)
    loss_scale = loss_scale.adjust(grads_finite)
    new_params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    params = jmp.select_tree(grads_finite, new_params, params)
    return params, loss_scale

  params = {"w": jnp.full((3,), 0.5)}
  loss_scale = jmp.DynamicLossScale(jmp.half_dtype()(2**15))
  x = jnp.ones((2, 3))
  params, loss_scale = train_step(params, loss_scale, x)
  np.testing.assert_allclose(params["w"], 0.5 - 0.1 * 2 * 1.5, rtol=1e-6)
  bad = jnp.full((2, 3), jnp.inf)
  params2, loss_scale2 = train_step(params, loss_scale, bad)
  np.testing.assert_array_equal(params2["w"], params["w"])
  assert float(loss_scale2.loss_scale) == 2**14

  noop = jmp.NoOpLossScale()
  loss, grads = jnp.float32(1.0), {"g": jnp.ones(2)}
  assert loss is noop.scale(loss) and grads is noop.unscale(grads)
  assert noop is noop.adjust(jnp.bool_(True)) and noop.loss_scale == 1
  static = jmp.StaticLossScale(2**15)
  assert jax.tree.leaves(static) == [] and jax.tree.leaves(noop) == []


@pytest.mark.parametrize("scale", [2.0**15, 2.0**-3, 3.0, 1000.0, 0.7])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_scale_and_unscale_match_float64_numpy(scale, dtype, variant):
  rng = np.random.default_rng(1)
  g = (rng.standard_normal(1000) * 100).astype(dtype)
  g64 = np.asarray(g, np.float64)
  tree = {"g": jnp.asarray(g), "step": jnp.int32(7)}
  dynamic = jmp.DynamicLossScale(scale, min_loss_scale=min(scale, 1.0))
  for ls in (jmp.StaticLossScale(scale), dynamic):
    out = variant(ls.unscale)(tree)
    assert out["g"].dtype == jnp.float32
    assert out["step"].dtype == jnp.int32 and int(out["step"]) == 7
    got = np.asarray(out["g"])
    if np.log2(scale) == int(np.log2(scale)):
      # Power-of-two scales (all that dynamic scaling produces): exact.
      np.testing.assert_array_equal(got, (g64 / scale).astype(np.float32))
    else:
      # The written rule: multiply by float32(1 / scale), as torch does;
      # within an ulp or so of the exact float64 quotient.
      inv = np.float32(1.0) / np.float32(scale)
      np.testing.assert_array_equal(got, g64.astype(np.float32) * inv)
      np.testing.assert_allclose(got, g64 / scale, rtol=2.5e-7)
    scaled = variant(ls.scale)(tree)
    np.testing.assert_array_equal(
      np.asarray(scaled["g"]),
      (g64 * np.float64(np.float32(scale))).astype(np.float32),
    )


RANGE = "must lie in [2**-126, 2**126]"


@pytest.mark.parametrize(
  "kwargs,error,fragment",
  [
    (dict(growth_factor=1.0), ValueError, "must be > 1 in float32, got 1.0"),
    (dict(growth_factor=0.5), ValueError, "must be > 1 in float32, got 0.5"),
    (dict(backoff_factor=1.0), ValueError, "(0, 1) in float32, got 1.0"),
    (dict(backoff_factor=1.5), ValueError, "(0, 1) in float32, got 1.5"),
    (dict(backoff_factor=0.0), ValueError, "backoff_factor must be in (0, 1)"),
    (dict(backoff_factor=-0.5), ValueError, "got -0.5"),
    (
      dict(growth_interval=0),
      ValueError,
      "growth_interval must be an integer in [1, 2**31 - 1]",
    ),
    (dict(growth_interval=2.5), ValueError, "got 2.5"),
    (
      dict(hysteresis=0),
      ValueError,
      "hysteresis must be an integer in [1, 2**31 - 1]",
    ),
    (
      dict(min_scale=2.0**20),
      ValueError,
      "init_scale (32768.0) must be >= min_scale (1048576.0)",
    ),
    (dict(init_scale=0.0), ValueError, f"init_scale {RANGE}"),
    (dict(init_scale=-4.0), ValueError, "got -4.0"),
    (dict(init_scale=float("inf")), ValueError, "got inf"),
    (dict(min_scale=-1.0), ValueError, "or be 0 (the floor is then 2**-126)"),
    (dict(max_scale=2.0**10), ValueError, "must be <= max_scale (1024.0)"),
    (
      dict(init_scale="big"),
      TypeError,
      "init_scale must be a real number, got 'big'",
    ),
    (dict(init_scale=True), TypeError, "got True"),
  ],
)
def test_invalid_settings_raise_clear_errors(kwargs, error, fragment):
  with pytest.raises(error) as err:
    jmp.dynamic_loss_scale(**kwargs)
  assert fragment in str(err.value)


# Settings accepted before and then silently wrong (or, for hysteresis, a
# crash naming no argument); now each error names the argument and the
# value. adjust multiplies in float32, where 1 + 1e-9 rounds to 1 (the scale
# would never grow) and 1 - 1e-9 to 1 (it would never back off); an int32
# counter cannot count to 2**31; "no" is truthy.
@pytest.mark.parametrize(
  "kwargs,error,fragment",
  [
    (dict(growth_factor=1 + 1e-9), ValueError, "growth_factor must be > 1"),
    (dict(backoff_factor=1 - 1e-9), ValueError, "backoff_factor must be in"),
    (dict(growth_interval=2**31), ValueError, "got 2147483648"),
    (dict(hysteresis=2**40), ValueError, "hysteresis must be an integer in"),
    (
      dict(consecutive_hysteresis="no"),
      TypeError,
      "consecutive_hysteresis must be True or False, got 'no'",
    ),
    (dict(consecutive_hysteresis=1), TypeError, "True or False, got 1"),
    (dict(consecutive_hysteresis=None), TypeError, "True or False, got None"),
    (dict(max_scale=2.0**127), ValueError, f"max_scale {RANGE}"),
  ],
)
def test_settings_that_would_be_silently_wrong_are_refused(
  kwargs, error, fragment
):
  with pytest.raises(error) as err:
    jmp.dynamic_loss_scale(**kwargs)
  assert fragment in str(err.value)


@pytest.mark.parametrize(
  "kwargs,error,fragment",
  [
    (dict(counter=-1), ValueError, "counter must lie in [0, 9]"),
    (dict(counter=10), ValueError, "got 10"),
    (dict(counter=jnp.float32(0)), TypeError, "counter must be an integer"),
    (dict(counter=jnp.zeros(2, jnp.int32)), ValueError, "must be a scalar"),
    (
      dict(hysteresis=2, hysteresis_tracker=3),
      ValueError,
      "hysteresis_tracker must lie in [0, 2]",
    ),
    (
      dict(hysteresis_tracker=jnp.int32(1)),
      ValueError,
      "only tracked with hysteresis > 1",
    ),
  ],
)
def test_bad_counters_are_refused(kwargs, error, fragment):
  with pytest.raises(error) as err:
    jmp.DynamicLossScale(jnp.float32(4.0), period=10, **kwargs)
  assert fragment in str(err.value)


def test_integer_scales_convert_with_jmps_warning():
  # jmp warns and then crashes in adjust (jmp #47); ours warns and converts.
  with pytest.warns(UserWarning, match="Expected floating type for loss_scale"):
    ls = jmp.DynamicLossScale(jnp.asarray(2**10, jnp.int32), period=1)
  assert ls.loss_scale.dtype == jnp.float32
  assert float(ls.adjust(jnp.bool_(True)).loss_scale) == 2.0**11
  with pytest.warns(UserWarning, match="for min_loss_scale, got int32"):
    ls = jmp.DynamicLossScale(4.0, min_loss_scale=jnp.asarray(2, jnp.int32))
  assert ls.min_loss_scale == 2.0 and type(ls.min_loss_scale) is float
  for _ in range(3):
    ls = ls.adjust(jnp.bool_(False))
  assert float(ls.loss_scale) == 2.0


def test_other_bad_loss_scale_inputs():
  with pytest.raises(TypeError, match="loss_scale must be a real number"):
    jmp.StaticLossScale("1024")
  with pytest.raises(TypeError, match="must be a float, got True"):
    jmp.DynamicLossScale(True)
  with pytest.raises(ValueError, match="boolean scalar"):
    jmp.dynamic_loss_scale().adjust(jnp.ones(3, bool))
  # Float16 scales (jmp's README) become float32: no overflow at 2**16.
  ls = jmp.DynamicLossScale(jnp.float16(2**15), period=1)
  assert ls.loss_scale.dtype == jnp.float32
  assert float(ls.adjust(jnp.bool_(True)).loss_scale) == 2.0**16


@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan])
def test_all_finite(bad, variant):
  f = variant(jmp.all_finite)
  assert bool(jmp.all_finite(None)) and bool(jmp.all_finite({}))
  assert not bool(f({"a": jnp.array(bad)}))
  assert not bool(f({"a": jnp.ones([3]), "b": jnp.array([0.0, bad])}))
  assert not bool(
    f({"a": jnp.array([1.0, bad], jnp.bfloat16), "i": jnp.int32(1)})
  )
  assert bool(f({"a": jnp.ones([]), "i": jnp.arange(3)}))


def test_all_finite_is_one_global_predicate_over_shards():
  mesh = jax.make_mesh(
    (8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,)
  )
  sharding = NamedSharding(mesh, P("data"))
  host = np.ones(64, np.float32)
  host[61] = np.inf  # lives on the last device only
  x = jax.device_put(host, sharding)
  assert len(x.addressable_shards) == 8
  assert not bool(jax.jit(jmp.all_finite)({"x": x, "y": jnp.ones(3)}))
  assert bool(
    jax.jit(jmp.all_finite)({"x": jax.device_put(np.ones(64), sharding)})
  )


def test_select_tree(variant):
  a = {"a": jnp.ones([]), "b": jnp.zeros([2]), "i": jnp.int32(1)}
  b = {"a": jnp.zeros([]), "b": jnp.ones([2]), "i": jnp.int32(2)}
  sel = variant(jmp.select_tree)
  assert jax.tree.map(lambda x, y: bool((x == y).all()), sel(True, a, b), a)
  out = sel(jnp.bool_(False), a, b)
  for k in b:
    np.testing.assert_array_equal(out[k], b[k])
  assert jmp.select_tree(jnp.bool_(True), None, None) is None
  with pytest.raises(ValueError, match="expected boolean scalar"):
    jmp.select_tree(jnp.ones([1]), None, None)
  with pytest.raises(ValueError, match="one structure"):
    jmp.select_tree(jnp.bool_(True), {"a": 1.0}, {"b": 1.0})


# Scales float32 cannot carry. Each was accepted before, and then every step
# skipped forever (inf, NaN), the scale reached 0 (subnormal or negative
# scales, a floor of 1e-40) or unscaling flushed every gradient to 0 (above
# 2**126, 1/scale is subnormal). jmp's idiom passes JAX arrays, so concrete
# arrays are checked like Python numbers.
@pytest.mark.parametrize(
  "build,error,fragment",
  [
    (lambda: jmp.DynamicLossScale(jnp.float32(np.inf)), ValueError, "inf"),
    (lambda: jmp.DynamicLossScale(jnp.float32(np.nan)), ValueError, "nan"),
    (lambda: jmp.DynamicLossScale(jnp.float32(-4.0)), ValueError, "-4.0"),
    (
      lambda: jmp.DynamicLossScale(jnp.float32(2.0**127)),
      ValueError,
      "loss_scale must lie in [2**-126, 2**126]",
    ),
    (
      lambda: jmp.DynamicLossScale(jnp.float32(1e-40), min_loss_scale=2**-126),
      ValueError,
      "loss_scale must lie in [2**-126, 2**126]",
    ),
    (
      lambda: jmp.StaticLossScale(1e39),
      ValueError,
      "loss_scale must lie in [2**-126, 2**126]",
    ),
    (lambda: jmp.StaticLossScale(2.0**127), ValueError, "got 1.7014"),
    (lambda: jmp.StaticLossScale(1e-46), ValueError, "got 1e-46"),
    (
      lambda: jmp.mixed_precision(optax.sgd(0.1), loss_scale=1e-46),
      ValueError,
      "loss_scale must lie in [2**-126, 2**126] (about 1.2e-38 to 8.5e37",
    ),
    (
      lambda: jmp.dynamic_loss_scale(init_scale=1e-40, min_scale=1e-40),
      ValueError,
      "min_scale must lie in [2**-126, 2**126] (about 1.2e-38",
    ),
    (
      lambda: jmp.DynamicLossScale(jnp.float32(0.5), min_loss_scale=1.0),
      ValueError,
      "loss_scale (0.5) must be >= min_loss_scale (1.0)",
    ),
    (
      lambda: jmp.DynamicLossScale(jnp.float32(8.0), max_loss_scale=4.0),
      ValueError,
      "loss_scale (8.0) must be <= max_loss_scale (4.0)",
    ),
    (
      lambda: jmp.DynamicLossScale(jnp.full(2, 2.0**15)),
      ValueError,
      "loss_scale must be a scalar, got an array of shape (2,)",
    ),
    (
      lambda: jax.eval_shape(lambda x: jmp.DynamicLossScale(x), jnp.ones(3)),
      ValueError,
      "loss_scale must be a scalar, got a traced array of shape (3,)",
    ),
  ],
)
def test_scales_float32_cannot_carry_are_refused(build, error, fragment):
  with pytest.raises(error) as err:
    build()
  assert fragment in str(err.value)


def _reference_trajectory(
  init, finite_seq, *, period, factor, backoff, min_scale, max_scale, hysteresis
):
  """The DynamicLossScale docstring's rule in float64 NumPy (not our code)."""
  ceiling = min(np.inf if max_scale is None else max_scale, 2.0**126)
  floor = max(min_scale, 2.0**-126)
  scale, counter, tracker = np.float64(init), 0, hysteresis
  scales = []
  for finite in finite_seq:
    if finite:
      counter += 1
      if counter == period:
        counter, tracker = 0, hysteresis
        scale = min(scale * factor, ceiling)
    else:
      counter, tracker = 0, max(tracker - 1, 0)
      if tracker == 0:
        scale = max(scale * backoff, floor)
    scales.append(scale)
  return np.array(scales)


@pytest.mark.parametrize(
  "period,hysteresis,min_scale", [(1, 1, 0.0), (3, 2, 2.0**-100)]
)
def test_extreme_factors_stay_in_range_and_follow_the_rule(
  period, hysteresis, min_scale
):
  # Bursts of 12 finite steps then 12 overflows: with factors 2**20 and
  # 2**-20 every burst drives the scale into the ceiling or the floor.
  rng = np.random.default_rng(3)
  finite = np.concatenate(
    [np.repeat(rng.random(40) < 0.5, 12), rng.random(520) < 0.5]
  )
  ls = jmp.DynamicLossScale(
    jnp.float32(2.0**15),
    period=period,
    factor=2.0**20,
    min_loss_scale=min_scale,
    backoff_factor=2.0**-20,
    hysteresis=hysteresis,
  )
  scales, _ = run_ours(ls, finite, jit=True)
  want = _reference_trajectory(
    2.0**15,
    finite,
    period=period,
    factor=2.0**20,
    backoff=2.0**-20,
    min_scale=min_scale,
    max_scale=None,
    hysteresis=hysteresis,
  )
  np.testing.assert_array_equal(scales.astype(np.float64), want)
  # Both bounds are reached, and never crossed.
  assert scales.min() == max(min_scale, 2.0**-126)
  assert scales.max() == 2.0**126
  # Growth from the top stays there, and unscaling by it keeps gradients:
  # 1/2**126 is a normal float32 that XLA does not flush (jmp and torch grow
  # on to 2**127, whose reciprocal XLA flushes: every gradient becomes 0).
  top = ls
  for _ in range(7 * period):
    top = top.adjust(jnp.bool_(True))
  assert float(top.loss_scale) == 2.0**126
  inv = np.float32(1.0) / np.float32(top.loss_scale)
  assert inv >= np.finfo(np.float32).tiny  # normal
  grads = jnp.array([1.0, 3.0 * 2.0**100], jnp.float32)
  got = np.asarray(jax.jit(lambda s, g: s.unscale(g))(top, grads))
  np.testing.assert_array_equal(got, np.array([1.0, 3.0 * 2.0**100]) / 2.0**126)
  assert (got != 0).all()


def test_min_loss_scale_zero_floors_at_2_126_never_0(variant):
  # jmp accepts min_loss_scale=0; the scale must still never reach 0.
  ls = jmp.DynamicLossScale(jnp.float32(2.0**-120), min_loss_scale=0.0)
  assert ls.min_loss_scale == 0.0
  adjust = variant(lambda s: s.adjust(jnp.bool_(False)))
  scales = []
  for _ in range(8):
    ls = adjust(ls)
    scales.append(float(ls.loss_scale))
  assert (
    scales
    == [2.0**-121, 2.0**-122, 2.0**-123, 2.0**-124, 2.0**-125] + [2.0**-126] * 3
  )
  assert ls.min_loss_scale == 0.0


def test_static_zero_builds_like_jmp_but_refuses_to_scale(variant):
  ls = jmp.StaticLossScale(0)
  assert jax.tree.leaves(ls) == [] and ls.loss_scale == 0.0
  for method in (ls.scale, ls.unscale):
    with pytest.raises(ValueError, match="a zero scale zeroes every gradient"):
      variant(method)({"g": jnp.ones(2)})


def test_hysteresis_1_flattens_to_jmps_two_leaves():
  scale, counter = jnp.float32(4.0), jnp.zeros([], jnp.int32)
  ls = jmp.DynamicLossScale(scale, counter, 10, 2, min_loss_scale=0.0)
  leaves, treedef = jax.tree.flatten(ls)
  assert leaves == [scale, counter] and ls.hysteresis_tracker is None
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree.leaves_with_path(ls)]
  assert paths == [".loss_scale", ".counter"]
  back = jax.tree.unflatten(treedef, leaves)
  assert back.min_loss_scale == 0.0 and back.period == 10
  three = jmp.dynamic_loss_scale(hysteresis=3)
  assert [
    jax.tree_util.keystr(p) for p, _ in jax.tree.leaves_with_path(three)
  ] == [
    ".loss_scale",
    ".counter",
    ".hysteresis_tracker",
  ]
  assert int(three.hysteresis_tracker) == 3


def test_each_loss_scale_flattens_its_own_settings():
  # An instance keeps its tree's aux data from its first flattening (each jit
  # call flattens the loss scale): a replaced, adjusted or rebuilt one
  # carries its own settings, never a cached copy of another's.
  ls = jmp.dynamic_loss_scale(hysteresis=2)
  treedef = jax.tree.structure(ls)  # cached from here
  faster = dataclasses.replace(ls, factor=4.0)
  assert jax.tree.structure(faster) != treedef
  back = jax.tree.unflatten(jax.tree.structure(faster), jax.tree.leaves(ls))
  assert back.factor == 4.0 and back.hysteresis == 2
  one = dataclasses.replace(ls, hysteresis=1, hysteresis_tracker=None)
  assert jax.tree.structure(one).num_leaves == 2
  assert jax.tree.structure(ls.adjust(jnp.bool_(False))) == treedef
  through = jax.jit(lambda s: s)(faster)
  assert through.factor == 4.0
  assert jax.tree.structure(through) == jax.tree.structure(faster)
  # A pickle carries the fields only, and flattens as the original.
  back = pickle.loads(pickle.dumps(through))
  assert set(vars(back)) == {f.name for f in dataclasses.fields(ls)}
  assert jax.tree.structure(back) == jax.tree.structure(through)
  settings = [
    f.name
    for f in dataclasses.fields(ls)
    if f.name not in ("loss_scale", "counter", "hysteresis_tracker")
  ]
  assert [getattr(through, k) for k in settings] == [
    getattr(faster, k) for k in settings
  ]


def test_unflatten_does_not_validate_or_convert():
  # JAX rebuilds states from tracers, shardings and placeholders: those go in
  # as they are; only a user's constructor call is checked.
  ls = jmp.dynamic_loss_scale(hysteresis=2)
  treedef = jax.tree.structure(ls)
  odd = [np.float32(-1.0), np.float64(0.5), "budget"]
  back = jax.tree.unflatten(treedef, odd)
  assert [back.loss_scale, back.counter, back.hysteresis_tracker] == odd
  assert back.loss_scale is odd[0]


def test_placeholders_pass_through_and_replace_validates():
  # JAX rebuilds loss scales from ShapeDtypeStructs, Nones and shardings
  # (eval_shape, tree.map, jit's sharding trees): the settings ride along.
  ls = jmp.dynamic_loss_scale(hysteresis=2, max_scale=2.0**20)
  shapes = jax.eval_shape(lambda: ls)
  assert shapes.loss_scale == jax.ShapeDtypeStruct((), jnp.float32)
  assert (shapes.period, shapes.max_loss_scale) == (2000, 2.0**20)
  assert jax.tree.map(lambda _: None, ls).hysteresis_tracker is None
  mesh = jax.make_mesh(
    (8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,)
  )
  shardings = jax.tree.map(lambda _: NamedSharding(mesh, P()), ls)
  step = jax.jit(
    lambda s: s.adjust(jnp.bool_(False)),
    in_shardings=(shardings,),
    out_shardings=shardings,
  )
  out = step(ls)
  assert int(out.hysteresis_tracker) == 1 and out.max_loss_scale == 2.0**20
  assert out.loss_scale.sharding == shardings.loss_scale
  # A user's dataclasses.replace is a constructor call: checked, also
  # inside jit (traced leaves are checked for shape and dtype).
  with pytest.raises(ValueError, match="period must be an integer in"):
    dataclasses.replace(out, period=0)
  with pytest.raises(ValueError, match="counter must lie in"):
    dataclasses.replace(jmp.DynamicLossScale(4.0, 5), period=5)
  faster = jax.jit(lambda s: dataclasses.replace(s, factor=4.0))(out)
  assert faster.factor == 4.0 and faster.hysteresis_tracker.dtype == jnp.int32
  assert float(faster.adjust(jnp.bool_(False)).loss_scale) == 2.0**14


def test_float_period_and_array_settings_like_jmp():
  # jmp's tests pass period=5.0 and min_loss_scale as a JAX array.
  ls = jmp.DynamicLossScale(
    jnp.float32(10.0), jnp.int32(0), 5.0, 2.0, jnp.asarray(0.3125)
  )
  assert ls.period == 5 and type(ls.period) is int
  assert ls.min_loss_scale == 0.3125 and type(ls.min_loss_scale) is float
  for _ in range(5):
    ls = ls.adjust(jnp.bool_(True))
  assert float(ls.loss_scale) == 20.0 and int(ls.counter) == 0


def test_select_tree_raises_jmps_assertion_error():
  for error in (AssertionError, ValueError):
    with pytest.raises(error, match="expected boolean scalar"):
      jmp.select_tree(jnp.ones([1]), None, None)


def test_complex_leaves_are_scaled_and_checked(variant):
  # jmp multiplies every leaf; skipping complex gradients left them scaled.
  rng = np.random.default_rng(5)
  z = (rng.standard_normal(6) + 1j * rng.standard_normal(6)) * 2.0**10
  tree = {"z": jnp.asarray(z, jnp.complex64), "i": jnp.int32(3)}
  for ls in (jmp.StaticLossScale(2.0**10), jmp.dynamic_loss_scale(2.0**10)):
    out = variant(ls.unscale)(tree)
    assert out["z"].dtype == jnp.complex64 and int(out["i"]) == 3
    want = z.astype(np.complex64) / np.complex64(2.0**10)  # exact: 2**-10
    np.testing.assert_array_equal(np.asarray(out["z"]), want)
    back = variant(ls.scale)(out)
    np.testing.assert_array_equal(np.asarray(back["z"]), z.astype(np.complex64))
  bad = tree["z"].at[2].set(complex(1.0, np.nan))
  assert not bool(variant(jmp.all_finite)({"z": bad}))
  assert bool(variant(jmp.all_finite)(tree))


def test_python_float_leaves_are_scaled_and_checked():
  # jmp multiplies every leaf, Python numbers included (`ls.scale(1.0)` is
  # the scale, a logging idiom); integers pass through here, as documented.
  for ls in (jmp.StaticLossScale(8.0), jmp.dynamic_loss_scale(8.0)):
    assert float(ls.scale(2.0)) == 16.0
    out = ls.unscale({"l": 16.0, "n": 3, "c": 4j})
    assert (
      float(out["l"]) == 2.0 and out["n"] == 3 and complex(out["c"]) == 0.5j
    )
  assert not bool(jmp.all_finite([1.0, float("inf")]))
  assert not bool(jmp.all_finite({"a": jnp.ones(2), "b": float("nan")}))
  assert bool(jmp.all_finite([1.0, 2, jnp.ones(2)]))
