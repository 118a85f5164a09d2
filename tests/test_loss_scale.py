"""Loss scales against scripted references (torch.amp, Megatron-LM) and jmp."""

import jax
import jax.numpy as jnp
import numpy as np
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
  # The one difference: torch has no floor, ours stops at min_scale. Compare
  # up to the first step where torch's scale goes below it.
  below = np.flatnonzero(want_scales < 2.0**-126)
  n = below[0] if below.size else len(found_inf)
  assert n >= 40
  np.testing.assert_array_equal(scales[:n], want_scales[:n])
  np.testing.assert_array_equal(counters, want_counters)
  assert scales.min() >= 2.0**-126


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


def test_scale_never_becomes_inf_and_floor_holds():
  big = np.float32(2.0**127)
  ls = jmp.DynamicLossScale(big, period=1, factor=2)
  scales, counters = run_ours(ls, np.ones(5, bool), jit=True)
  np.testing.assert_array_equal(scales, np.full(5, big))
  np.testing.assert_array_equal(counters, 0)
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


@pytest.mark.parametrize(
  "kwargs,error,fragment",
  [
    (dict(growth_factor=1.0), ValueError, "must be > 1, got 1.0"),
    (dict(growth_factor=0.5), ValueError, "must be > 1, got 0.5"),
    (dict(backoff_factor=1.0), ValueError, "(0, 1), got 1.0"),
    (dict(backoff_factor=1.5), ValueError, "(0, 1), got 1.5"),
    (
      dict(backoff_factor=0.0),
      ValueError,
      "backoff_factor must be finite and > 0",
    ),
    (dict(backoff_factor=-0.5), ValueError, "got -0.5"),
    (
      dict(growth_interval=0),
      ValueError,
      "growth_interval) must be an integer >= 1, got 0",
    ),
    (dict(growth_interval=2.5), ValueError, "got 2.5"),
    (
      dict(hysteresis=0),
      ValueError,
      "hysteresis must be an integer >= 1, got 0",
    ),
    (
      dict(min_scale=2.0**20),
      ValueError,
      "min_scale (1048576.0) must be <= init_scale",
    ),
    (
      dict(init_scale=0.0),
      ValueError,
      "init_scale must be finite and > 0, got 0.0",
    ),
    (dict(init_scale=-4.0), ValueError, "got -4.0"),
    (dict(init_scale=float("inf")), ValueError, "got inf"),
    (dict(min_scale=0.0), ValueError, "min_scale must be finite and > 0"),
    (dict(max_scale=2.0**10), ValueError, "must be <= max_loss_scale"),
    (
      dict(init_scale="big"),
      TypeError,
      "init_scale must be a positive number, got 'big'",
    ),
    (dict(init_scale=True), TypeError, "got True"),
  ],
)
def test_invalid_settings_raise_clear_errors(kwargs, error, fragment):
  with pytest.raises(error) as err:
    jmp.dynamic_loss_scale(**kwargs)
  assert fragment in str(err.value)


def test_non_float_loss_scales_are_rejected():
  with pytest.raises(TypeError, match="floating array.*int32"):
    jmp.DynamicLossScale(jnp.asarray(1, jnp.int32))
  with pytest.raises(TypeError, match="positive number"):
    jmp.StaticLossScale("1024")
  with pytest.raises(ValueError, match="loss_scale must be finite and > 0"):
    jmp.StaticLossScale(0)
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
