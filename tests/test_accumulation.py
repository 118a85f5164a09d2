"""FP32 gradient accumulation, alone and inside the ZeRO-1 step."""

import _models
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jmp_train as jmp


def test_accumulated_grads_equal_big_batch_grads():
  # The reference is plain jax.grad of the mean loss over the whole batch:
  # equal micro-batches make the mean of their mean losses that same mean.
  params = _models.init_params(jnp.float32)
  batch = _models.batches(1, batch=16)[0]
  ref_loss, ref = jax.jit(jax.value_and_grad(_models.loss))(params, batch)
  accumulate = jax.jit(jmp.accumulate_gradients, static_argnums=(0, 3))
  # 4: a scan over 3 micro-batches after the first (accum_steps=1 is checked
  # against plain jax.grad in test_complex_params_get_their_gradients).
  loss, grads = accumulate(_models.loss, params, batch, 4, loss_scale=8.0)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True):
    # Gradients of the scaled loss: 8 x, exactly a power of two.
    np.testing.assert_allclose(g / 8.0, r, rtol=2e-5, atol=1e-7)


def test_buffer_is_float32_for_bf16_params():
  params = _models.init_params(jnp.bfloat16)
  batch = _models.batches(1, batch=8)[0]

  def grads(k):
    return jax.eval_shape(
      lambda p, b: jmp.accumulate_gradients(_models.loss, p, b, k),
      params,
      batch,
    )[1]

  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads(4)))
  # Without accumulation the gradients keep the params' dtype.
  assert all(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(grads(1)))


def test_float32_buffer_beats_a_bf16_buffer():
  # 256 micro-batch gradients of bf16(1.1) each: a bf16 running sum loses
  # the low bits once it grows (its mean comes out 1.03); float32 keeps them.
  def loss_fn(p, x):
    return jnp.mean(x) * p["w"].astype(jnp.float32)

  params = {"w": jnp.ones((), jnp.bfloat16)}
  x = jnp.bfloat16(1.1)
  batch = jnp.full((256,), x, jnp.float32)
  _, grads = jmp.accumulate_gradients(loss_fn, params, batch, 256)
  np.testing.assert_allclose(np.float64(grads["w"]), np.float64(x), rtol=1e-7)
  bf16_sum = jnp.bfloat16(0)
  for _ in range(256):
    bf16_sum = bf16_sum + x
  assert abs(float(bf16_sum) / 256 - float(x)) > 0.05  # what we avoid


def test_bf16_buffer_rounds_each_add_as_the_rule_says():
  # The same 256 micro-batches into accum_dtype=bfloat16: the rule written
  # in NumPy (ml_dtypes rounds to nearest even, as XLA converts).
  # Both params' gradients are mean(x): a bfloat16 and a float32 param's.
  def loss_fn(p, x):
    return jnp.mean(x) * (p["w"].astype(jnp.float32) + p["b"])

  bf16 = ml_dtypes.bfloat16
  x = np.float32(np.array(1.1, bf16))
  params = {"w": jnp.ones((), jnp.bfloat16), "b": jnp.ones((), jnp.float32)}
  batch = jnp.full((256,), x, jnp.float32)
  _, grads = jmp.accumulate_gradients(
    loss_fn, params, batch, 256, accum_dtype=jnp.bfloat16
  )
  buffer = np.array(x, bf16)
  for _ in range(255):
    buffer = np.array(np.float32(buffer) + x, bf16)
  mean = np.array(np.float32(buffer) / 256, bf16)
  for g in (grads["w"], grads["b"]):
    assert g.dtype == jnp.bfloat16
    np.testing.assert_array_equal(g, mean)
  assert abs(float(mean) - float(x)) > 0.05  # the rounding it documents


def test_rejects_bad_accum_steps_and_batches():
  params = {"w": jnp.ones(2)}
  with pytest.raises(
    ValueError, match="accum_steps must be an int >= 1, got 0"
  ):
    jmp.accumulate_gradients(lambda p, b: 0.0, params, jnp.ones(4), 0)
  with pytest.raises(ValueError, match="divisible by accum_steps=3"):
    jmp.accumulate_gradients(lambda p, b: jnp.sum(b), params, jnp.ones(4), 3)
  with pytest.raises(
    ValueError,
    match="accum_dtype must be jnp.float32 or jnp.bfloat16, got 'float16'",
  ):
    jmp.accumulate_gradients(
      lambda p, b: jnp.sum(b), params, jnp.ones(4), 2, accum_dtype="float16"
    )


def test_rejects_integer_losses_and_bad_loss_scales():
  params, batch = {"w": jnp.ones(2)}, jnp.ones((4, 2))
  int_loss = lambda p, b: jnp.sum(b @ p["w"]).astype(jnp.int32)  # noqa: E731
  for k in (1, 2):  # its gradient would be silently zero
    with pytest.raises(TypeError, match=r"real floating-point scalar.*int32"):
      jmp.accumulate_gradients(int_loss, params, batch, k)
  loss = lambda p, b: jnp.mean(b @ p["w"])  # noqa: E731
  for bad in ("x", None, jnp.ones(2), True):
    with pytest.raises(TypeError, match="loss_scale must be a real scalar"):
      jmp.accumulate_gradients(loss, params, batch, 2, loss_scale=bad)


def test_complex_params_get_their_gradients():
  # Complex params are trained as optax trains them: their gradients (JAX's
  # convention) are accumulated, not replaced by zeros like integers'.
  rng = np.random.default_rng(0)
  z = jnp.asarray(rng.standard_normal(3) + 1j * rng.standard_normal(3))
  params = {"z": z.astype(jnp.complex64), "n": jnp.int32(2)}
  batch = jnp.asarray(rng.standard_normal((8, 3)), jnp.float32)

  def loss(p, b):
    return jnp.mean(jnp.abs(b @ p["z"]) ** 2) * p["n"]

  ref = jax.grad(loss, allow_int=True)(params, batch)["z"]  # plain JAX
  for k, dtype in ((1, jnp.float32), (4, jnp.float32), (4, jnp.bfloat16)):
    # No bfloat16 complex: a bfloat16 buffer keeps complex64 for them.
    _, grads = jmp.accumulate_gradients(
      loss, params, batch, k, accum_dtype=dtype
    )
    assert grads["z"].dtype == jnp.complex64
    np.testing.assert_allclose(grads["z"], ref, rtol=1e-5)
    assert int(grads["n"]) == 0
