"""A small transformer-like model and data shared by the mesh tests."""

import jax
import jax.numpy as jnp
import numpy as np

from jmp_train import memory

# Odd sizes on purpose: vocab 37 and the 10-wide head bias need ZeRO padding.
CONFIG = dict(layers=1, d_model=16, vocab=37, seq=8)


def init_params(dtype=jnp.float32, seed=0):
  shapes = memory.gpt_params(**CONFIG)
  shapes["head_bias"] = jax.ShapeDtypeStruct((10,), jnp.float32)
  leaves, treedef = jax.tree.flatten(shapes)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  values = [
    (0.3 * jax.random.normal(k, s.shape)).astype(dtype)
    for k, s in zip(keys, leaves, strict=True)
  ]
  return jax.tree.unflatten(treedef, values)


def loss_fn(params, batch):
  loss = memory.gpt_loss(params, batch["tokens"], heads=2)
  # `poison` is 0 except where a test injects inf; it reaches the gradient of
  # ln_f's bias only, through the device whose rows hold it.
  poison = jnp.mean(batch["poison"])
  # The key bias has an exactly zero gradient in attention (softmax ignores
  # a shift); Adam would turn its rounding noise into full-size steps, so an
  # L2 term gives it (and the otherwise unused head bias) a real gradient.
  qkv_bias = params["blocks"][0]["qkv"]["bias"].astype(jnp.float32)
  extra = jnp.sum(params["head_bias"].astype(jnp.float32) ** 2) * 1e-3
  extra += jnp.sum(qkv_bias**2) * 1e-3
  return loss + extra + poison * params["ln_f"]["bias"][0].astype(jnp.float32)


def batches(steps, batch=16, poison_at=(), poison_rows=slice(6, 8), seed=1):
  rng = np.random.default_rng(seed)
  out = []
  for i in range(steps):
    tokens = rng.integers(0, CONFIG["vocab"], (batch, CONFIG["seq"] + 1))
    poison = np.zeros((batch,), np.float32)
    if i in poison_at:
      poison[poison_rows] = np.inf
    out.append({"tokens": jnp.asarray(tokens, jnp.int32), "poison": poison})
  return out


def reference_run(tx, params, data, accum_steps=1):
  """The unsharded run: one device, plain jax.grad and tx.update."""
  import optax

  from jmp_train import accumulation, sharding

  state = tx.init(params)

  @jax.jit
  def step(params, state, batch):
    scale = sharding._loss_scale_or_one(state)
    loss, grads = accumulation.accumulate_gradients(
      loss_fn, params, batch, accum_steps, loss_scale=scale
    )
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  losses = []
  for batch in data:
    params, state, loss = step(params, state, batch)
    losses.append(float(loss))
  return params, state, losses
