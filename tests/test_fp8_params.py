"""FP8 params: weights stored as E4M3 values and a power-of-two scale.

References: the cast against NumPy and ml_dtypes; the optimizer against a
plain optax run on float32 params; the FP8-param matmul against the FP8
matmul of a float32 kernel holding the same values (same power-of-two
scale, so the same FP8 operands); all-gather bytes read from the lowered
module; memory against a count of bytes.
"""

import functools
import re

import _models
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import jmp_train as jmp
from jmp_train import checkpoint, fp8, memory, train, zero1

E4M3 = ml_dtypes.float8_e4m3fn


def _reference_cast(w):
  """float64 NumPy: the largest power of two 2**k with amax * 2**k <= 448
  (k <= 126; 1 for zero), values rounded to nearest even in E4M3."""
  w = np.asarray(w, np.float64)
  amax = np.max(np.abs(w))
  k = 0 if amax == 0 else min(int(np.floor(np.log2(448.0 / amax))), 126)
  values = np.clip(w * 2.0**k, -448, 448).astype(E4M3)
  return values, -k


@pytest.mark.parametrize("amax", [3.0, 448.0, 1e-30, 2.0**-20, 0.0, 5e30])
def test_cast_matches_numpy(amax):
  rng = np.random.default_rng(0)
  w = rng.normal(size=(5, 7)).astype(np.float32)
  w = w / np.max(np.abs(w)) * np.float32(amax)
  p = fp8.cast_param(jnp.asarray(w))
  values, exponent = _reference_cast(w)
  assert int(p.exponent) == exponent
  np.testing.assert_array_equal(
    np.asarray(p.data), values.view(np.uint8), strict=True
  )
  # Dequantized exactly: values * 2**exponent in float64.
  np.testing.assert_array_equal(
    np.asarray(p.dequantize(), np.float64),
    values.astype(np.float64) * 2.0**exponent,
  )
  assert p.grad_dtype == np.float32 and p.shape == (5, 7)


def test_cast_keeps_non_finite_values_non_finite():
  p = fp8.cast_param(jnp.array([1.0, jnp.inf, -2.0, jnp.nan]))
  assert int(p.exponent) == 0  # amax not finite: scale 1
  got = np.asarray(p.values).astype(np.float32)
  np.testing.assert_array_equal(np.isnan(got), [False, True, False, True])
  np.testing.assert_array_equal(got[[0, 2]], [1.0, -2.0])


def test_optimizer_keeps_the_master_and_recasts_exactly():
  rng = np.random.default_rng(1)
  w0 = fp8.cast_param(jnp.asarray(rng.normal(size=(6, 4)), jnp.float32))
  params = {"w": w0, "b": jnp.ones(4, jnp.bfloat16)}
  inner = optax.adam(0.05)
  tx = jmp.mixed_precision(inner, loss_scale=8.0)
  state = tx.init(params)
  # The plain optax run: float32 params from the dequantized FP8 kernel.
  ref = {"w": w0.dequantize(), "b": jnp.ones(4, jnp.float32)}
  ref_state = inner.init(ref)
  for i in range(5):
    g = {k: jnp.asarray(rng.normal(size=np.shape(v)), jnp.float32)
         for k, v in ref.items()}  # fmt: skip
    if i == 2:
      g["w"] = g["w"].at[0, 0].set(jnp.inf)
    # What the step passes: the scaled gradient, the kernel's in its slot
    # dtype (float32: the weight it was cast from was float32).
    scaled = {
      "w": fp8.Fp8Param(
        data=(8.0 * g["w"]).astype(w0.grad_dtype),
        exponent=jnp.zeros([], jnp.int32),
        grad_dtype=w0.grad_dtype,
      ),
      "b": (8.0 * g["b"]).astype(jnp.bfloat16),
    }
    before = (params, state)
    updates, state = tx.update(scaled, state, params)
    params = optax.apply_updates(params, updates)
    if i == 2:  # skipped: params and masters keep their bits
      for a, b in zip(
        jax.tree.leaves(before[0]), jax.tree.leaves(params), strict=True
      ):
        np.testing.assert_array_equal(a, b, strict=True)
      np.testing.assert_array_equal(
        before[1].master_params["w"], state.master_params["w"]
      )
      continue
    g["b"] = jnp.asarray(jnp.asarray(8.0 * g["b"], jnp.bfloat16), jnp.float32)
    g["b"] = g["b"] / 8.0
    u, ref_state = inner.update(g, ref_state, ref)
    ref = optax.apply_updates(ref, u)
    # The master follows the float32 run (to fusion's last-ulp roundings)
    # and the stored kernel is that master cast, bit for bit.
    master = state.master_params["w"]
    np.testing.assert_allclose(master, ref["w"], rtol=1e-5, atol=1e-7)
    values, exponent = _reference_cast(master)
    assert isinstance(params["w"], fp8.Fp8Param)
    np.testing.assert_array_equal(params["w"].data, values.view(np.uint8))
    assert int(params["w"].exponent) == exponent
  assert int(state.skipped_steps) == 1


def test_a_gradient_without_its_slot_is_refused():
  w = fp8.cast_param(jnp.ones((3, 2)))
  params = {"w": w}
  tx = jmp.mixed_precision(optax.sgd(0.1))
  state = tx.init(params)
  # jax.grad over the integer bits gives float0: no gradient came back.
  grads = jax.grad(lambda p: 0.0, allow_int=True)(params)
  with pytest.raises(TypeError, match="with_grad_slots"):
    tx.update(grads, state, params)
  # Through an FP8 matmul whose input is differentiated, the kernel's
  # gradient would be dropped: refused where it is computed.
  dn = (((1,), (0,)), ((), ()))

  def f(x):
    y = fp8.fp8_dot_general(x, w, dn, scale=jnp.ones(3), amax=jnp.zeros(3))
    return jnp.sum(y)

  with pytest.raises(ValueError, match="no gradient slot"):
    jax.grad(f)(jnp.ones((2, 3)))


class _Mlp(nn.Module):
  """Written the way Flax users write it: explicit float32 dtype fields, a
  DenseGeneral, and a head kept out of FP8 by name."""

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(24, dtype=jnp.float32, param_dtype=jnp.float32)(x)
    x = nn.DenseGeneral((2, 8), dtype=jnp.float32)(nn.gelu(x))
    x = x.reshape(x.shape[:-2] + (-1,))
    return nn.Dense(5, name="head")(x)


def _wrapped(fp8_params, policy="p=f32,c=bf16,o=f32"):
  recipe = fp8.CurrentScaling(power_of_two_scales=True)
  return jmp.linen.wrap(
    _Mlp(),
    policy,
    fp8=recipe,
    fp8_exclude=("head",),
    fp8_params=fp8_params,
  )


def test_linen_fp8_params_match_the_fp8_matmul_of_the_same_values():
  x = jax.random.normal(jax.random.key(1), (4, 12))
  model = _wrapped(True)
  variables = jax.jit(model.init)(jax.random.key(0), x)  # one compile
  params = variables["params"]
  kinds = jax.tree.map(
    lambda p: type(p).__name__ if fp8.is_fp8_param(p) else p.dtype.name,
    params,
    is_leaf=fp8.is_fp8_param,
  )
  assert kinds["Dense_0"]["kernel"] == "Fp8Param"
  assert kinds["DenseGeneral_0"]["kernel"] == "Fp8Param"
  assert kinds["head"]["kernel"] == "float32"  # excluded from FP8
  # The same model with float32 kernels holding the FP8 values exactly.
  plain = jax.tree.map(
    lambda p: p.dequantize() if fp8.is_fp8_param(p) else p,
    params,
    is_leaf=fp8.is_fp8_param,
  )
  reference = _wrapped(False)

  def loss(model, params, fp8_meta):
    y = model.apply({"params": params, "fp8_meta": fp8_meta}, x)
    return jnp.sum(jnp.tanh(y))

  args = (variables["fp8_meta"],)
  # Jitted, each a compile rather than an op-by-op dispatch of every cast.
  got, (g, g_meta) = jax.jit(
    jax.value_and_grad(functools.partial(loss, model), (0, 1), allow_int=True)
  )(fp8.with_grad_slots(params), *args)
  want, (g_ref, g_meta_ref) = jax.jit(
    jax.value_and_grad(functools.partial(loss, reference), (0, 1))
  )(plain, *args)
  assert got == want
  g = fp8.grads_of(g)
  # The float32 kernel's gradient leaves the matmul in the compute dtype
  # (bfloat16); the FP8 param's in the dtype it was cast from (float32).
  for a, b in (
    (g["Dense_0"]["kernel"].data, g_ref["Dense_0"]["kernel"]),
    (g["DenseGeneral_0"]["kernel"].data, g_ref["DenseGeneral_0"]["kernel"]),
  ):
    assert a.dtype == jnp.float32
    np.testing.assert_array_equal(
      a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    )
  np.testing.assert_array_equal(g["head"]["kernel"], g_ref["head"]["kernel"])
  # The amaxes (the weight's from its FP8 values) are the same too.
  for a, b in zip(
    jax.tree.leaves(g_meta), jax.tree.leaves(g_meta_ref), strict=True
  ):
    np.testing.assert_array_equal(a, b)


def test_wrap_refuses_fp8_params_it_cannot_honour():
  with pytest.raises(ValueError, match="fp8 is None"):
    jmp.linen.wrap(_Mlp(), "p=f32,c=bf16,o=f32", fp8_params=True)
  with pytest.raises(ValueError, match="blockwise"):
    jmp.linen.wrap(_Mlp(), "f32", fp8="blockwise", fp8_params=True)
  with pytest.raises(ValueError, match="statistics"):
    recipe = fp8.CurrentScaling(statistics=True)
    jmp.linen.wrap(_Mlp(), "f32", fp8=recipe, fp8_params=True)
  with pytest.raises(TypeError, match="fp8_params"):
    jmp.linen.wrap(_Mlp(), "f32", fp8=True, fp8_params="yes")


def _gathered_bytes(lowered):
  """Bytes of each stablehlo.all_gather result in the lowered module (the
  CPU compiler widens bf16 later; the program asks for these)."""
  sizes = {"ui8": 1, "bf16": 2, "f32": 4, "i32": 4}
  found = re.findall(
    r'"stablehlo.all_gather".*?-> tensor<([\dx]+)x(\w+)>', lowered, re.S
  )
  return sorted((int(np.prod(list(map(int, s.split("x"))))), sizes[t])
                for s, t in found)  # fmt: skip


def test_zero1_step_gathers_fp8_bytes_and_trains_like_bf16_params():
  x = jax.random.normal(jax.random.key(1), (16, 12))
  labels = jax.random.randint(jax.random.key(2), (16,), 0, 5)
  mesh = _models.mesh()
  runs = {}
  for fp8_params in (False, True):
    model = _wrapped(fp8_params, "p=bf16,c=bf16,o=f32")
    variables = jax.jit(model.init)(jax.random.key(0), x[:2])
    tx = jmp.mixed_precision(optax.adam(1e-2))
    plan = zero1.make_plan(tx, variables["params"], mesh)
    state = train.TrainState.create(
      params=variables["params"], tx=tx, fp8=variables["fp8_meta"], plan=plan
    )

    def loss_fn(params, batch, model_state, key, model=model):
      logits = model.apply({"params": params, **model_state}, batch[0])
      return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch[1]
      ).mean()

    step = train.make_train_step(loss_fn, tx, plan=plan, accum_steps=2)
    lowered = step.lower(state, (x, labels)).as_text()
    table = memory.memory_table(
      None,
      jax.eval_shape(
        lambda p, tx=tx: train.TrainState.create(params=p, tx=tx),
        variables["params"],
      ),
    )
    losses = []
    for i in range(12):
      batch = (x * jnp.inf, labels) if i == 5 else (x, labels)
      # The step donates the state: keep host copies.
      before = jax.tree.map(np.asarray, (state.params, state.opt_state))
      state, metrics = step(state, batch)
      if i == 5:  # skipped: params, masters and moments keep their bits
        after = jax.tree.map(np.asarray, (state.params, state.opt_state))
        for a, b in zip(
          jax.tree.leaves(before[0]), jax.tree.leaves(after[0]), strict=True
        ):
          np.testing.assert_array_equal(a, b)
        kept = lambda s: (s.master_params, s.inner_state)  # noqa: E731
        for a, b in zip(
          jax.tree.leaves(kept(before[1])),
          jax.tree.leaves(kept(after[1])),
          strict=True,
        ):
          np.testing.assert_array_equal(a, b)
        continue
      losses.append(float(metrics["loss"]))
    runs[fp8_params] = (_gathered_bytes(lowered), table, losses, state, plan)

  (bf16_gather, bf16_table, bf16_losses, *_) = runs[False]
  (fp8_gather, fp8_table, fp8_losses, state, plan) = runs[True]
  kernels = [12 * 24, 24 * 16]  # the two FP8 kernels' sizes
  for n in kernels:
    assert (n, 2) in bf16_gather and (n, 1) in fp8_gather
  assert sorted(s for s in bf16_gather if s[0] not in kernels) == sorted(
    s for s in fp8_gather if s[0] not in kernels
  )
  # Params: 1 byte instead of 2 per kernel value, plus a 4-byte exponent.
  saved = sum(kernels) - 4 * len(kernels)
  assert bf16_table["params"] - fp8_table["params"] == saved
  # Trained to FP8 tolerance of the bf16-param run.
  assert fp8_losses[-1] < 0.5 * fp8_losses[0]
  np.testing.assert_allclose(fp8_losses, bf16_losses, rtol=0.05)
  # The stored kernel is its master cast again.
  logical = zero1.to_logical(plan, state)
  master = logical.opt_state.master_params["Dense_0"]["kernel"]
  values, exponent = _reference_cast(master)
  kernel = state.params["Dense_0"]["kernel"]
  np.testing.assert_array_equal(kernel.data, values.view(np.uint8))
  assert int(kernel.exponent) == exponent


def test_checkpoint_round_trip_with_and_without_masters(tmp_path):
  w = fp8.cast_param(jax.random.normal(jax.random.key(0), (8, 4)))
  params = {"w": w, "b": jnp.ones(4, jnp.bfloat16)}
  tx = jmp.mixed_precision(optax.adam(1e-3))
  state = tx.init(params)
  for masters in (True, False):
    ckpt = checkpoint.Checkpointer(
      tmp_path / str(masters), use_master_weights_in_ckpt=masters
    )
    ckpt.save(1, params, state)
    _, params2, state2 = ckpt.restore(params, tx=tx)
    ckpt.close()
    assert isinstance(params2["w"], fp8.Fp8Param)
    for a, b in zip(
      jax.tree.leaves(params), jax.tree.leaves(params2), strict=True
    ):
      np.testing.assert_array_equal(a, b, strict=True)
    # Without masters the master is rebuilt as the dequantized weight.
    np.testing.assert_array_equal(
      state2.master_params["w"], w.dequantize(), strict=True
    )


def test_adjust_precision_refuses_fp8_params():
  params = {"w": fp8.cast_param(jnp.ones((2, 2)))}
  state = jmp.mixed_precision(optax.sgd(0.1)).init(params)
  with pytest.raises(ValueError, match="Fp8Param"):
    jmp.adjust_precision(params, state, "bf16-mixed")
