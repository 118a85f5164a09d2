"""The small GPT and data the mesh tests share, and a reference run.

The model is examples/gpt_model.py's GPT (Flax linen, as its users write it)
at a tiny size with odd dimensions on purpose: vocab 37 and the 10-wide extra
bias need ZeRO padding on 8 devices.
"""

import gpt_model
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType

import jmp_train

MODEL = gpt_model.GPT(layers=1, d_model=16, heads=2, seq_len=8, vocab=37)


def mesh(shape=(8,), names=("data",)):
  """A GSPMD-style mesh (Auto axes) from jax.make_mesh."""
  return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))


def tx():
  """The mesh tests' optimizer: clipped AdamW under a dynamic loss scale."""
  return jmp_train.mixed_precision(
    optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3)),
    loss_scale=jmp_train.dynamic_loss_scale(2.0**10, growth_interval=4),
  )


def init_params(dtype=jnp.float32, seed=0):
  tokens = jnp.zeros((1, MODEL.seq_len), jnp.int32)
  # One compiled init (eagerly, XLA:CPU compiles each initializer alone).
  params = jax.jit(MODEL.init)(jax.random.key(seed), tokens)["params"]
  params = dict(params, extra_bias=0.3 * jnp.ones((10,), jnp.float32))
  scale = lambda x: (x + 0.05).astype(dtype)  # noqa: E731 (no zero biases)
  return jax.tree.map(scale, params)


def loss(params, batch):
  """The mean next-token loss plus terms the tests rely on."""
  model_params = {k: v for k, v in params.items() if k != "extra_bias"}
  tokens = batch["tokens"]
  logits = MODEL.apply({"params": model_params}, tokens[:, :-1])
  loss = gpt_model.cross_entropy(logits, tokens[:, 1:])
  # `poison` is 0 except where a test injects inf; it reaches the gradient of
  # ln_f's bias only, through the device whose rows hold it.
  poison = jnp.mean(batch["poison"])
  # The key bias has an exactly zero gradient in attention (softmax ignores
  # a shift); Adam would turn its rounding noise into full-size steps, so an
  # L2 term gives it (and the otherwise unused extra bias) a real gradient.
  qkv_bias = params["block0"]["attn"]["qkv"]["bias"].astype(jnp.float32)
  extra = jnp.sum(params["extra_bias"].astype(jnp.float32) ** 2) * 1e-3
  extra += jnp.sum(qkv_bias**2) * 1e-3
  ln_bias = params["ln_f"]["bias"][0].astype(jnp.float32)
  return loss + extra + poison * ln_bias


def loss_fn(params, batch, model_state, key):
  """`loss` in the train step's signature (no model state, no key)."""
  del model_state, key
  return loss(params, batch)


def batches(steps, batch=16, poison_at=(), poison_rows=slice(6, 8), seed=1):
  rng = np.random.default_rng(seed)
  out = []
  for i in range(steps):
    tokens = rng.integers(0, MODEL.vocab, (batch, MODEL.seq_len + 1))
    poison = np.zeros((batch,), np.float32)
    if i in poison_at:
      poison[poison_rows] = np.inf
    out.append({"tokens": jnp.asarray(tokens, jnp.int32), "poison": poison})
  return out


def reference_run(tx, params, data):
  """The unsharded run: one device, `jax.grad` of the whole batch's loss
  times the loss scale, `tx.update`, `optax.apply_updates`. Written without
  the step builder or the accumulation code: it is what they must equal."""
  state = tx.init(params)

  @jax.jit
  def step(params, state, batch):
    scale = jmp_train.current_loss_scale(state)
    value, grads = jax.value_and_grad(lambda p: loss(p, batch) * scale)(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, value / scale

  losses = []
  for batch in data:
    params, state, value = step(params, state, batch)
    losses.append(float(value))
  return params, state, losses
