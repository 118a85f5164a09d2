"""The ZeRO-1 run test_checkpoint.py checkpoints, and what it runs in a fresh
process: resume a train state, die mid-save, or exit right after a save."""

import os
import sys

# Added to, not replaced, and the platform only defaulted: test_checkpoint.py
# imports this module, and what the test session set must survive that.
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import _models  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

import jmp_train as jmp  # noqa: E402
from jmp_train import checkpoint, train, zero1  # noqa: E402


def make_tx():
  return jmp.mixed_precision(
    optax.adamw(3e-3),
    loss_scale=jmp.dynamic_loss_scale(2.0**10, growth_interval=3),
  )


def make_plan(tx, devices=8):
  mesh = jax.make_mesh(
    (devices,),
    ("data",),
    axis_types=(AxisType.Auto,),
    devices=jax.devices()[:devices],
  )
  return zero1.make_plan(tx, param_template(), mesh)


def loss_fn(params, batch, model_state, key):
  """`_models.loss` plus a term drawn from the step's PRNG key and scaled by
  a running mean kept as model state: a resume that restored either wrong
  would train differently."""
  bias = params["extra_bias"].astype(jnp.float32)
  mean = model_state["batch_stats"]["mean"]
  noise = jax.random.normal(key, bias.shape)
  loss = _models.loss(params, batch) + 1e-2 * mean * jnp.sum(noise * bias)
  tokens = jnp.mean(batch["tokens"].astype(jnp.float32))
  new_state = {"batch_stats": {"mean": 0.9 * mean + 0.1 * tokens}}
  return loss, (new_state, {})


def make_step(tx, plan):
  return train.make_train_step(loss_fn, tx, plan=plan, has_aux=True)


def initial_state(tx, plan=None, params=None):
  if params is None:  # one program (eager init compiles dozens)
    params = jax.jit(_models.init_params, static_argnums=0)(jnp.bfloat16)
  return train.TrainState.create(
    params=params,
    tx=tx,
    model_state={"batch_stats": {"mean": jnp.zeros([], jnp.float32)}},
    key=jax.random.key(42),
    plan=plan,
  )


def state_target(tx):
  """The run's train state as ShapeDtypeStructs (nothing computed)."""
  return jax.eval_shape(lambda: initial_state(tx, params=param_template()))


def snapshot(state, plan):
  """Every leaf of the unpadded state on the host, bf16 as float32 (npz
  has no bfloat16; the conversion is exact), the key as its data."""
  state = zero1.to_logical(plan, state)
  state = state.replace(key=jax.random.key_data(state.key))
  return [
    np.asarray(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x)
    for x in jax.tree.leaves(state)
  ]


def one_device_tx():
  return jmp.mixed_precision(optax.adam(1e-3))


def param_template():
  """The model's bf16 params as ShapeDtypeStructs (init traced, not run)."""
  return jax.eval_shape(lambda: _models.init_params(jnp.bfloat16))


def ramp_params():
  """Params of the model's shapes with distinct values, built on the host
  (running `_models.init_params` compiles a dozen small programs)."""
  return jax.tree.map(
    lambda s: jax.device_put(
      np.linspace(-1, 1, s.size).reshape(s.shape).astype(s.dtype)
    ),
    param_template(),
  )


def main(mode, directory, out):
  if mode == "resume":
    tx = make_tx()
    plan = make_plan(tx)
    step = make_step(tx, plan)
    data = _models.batches(20, poison_at=(4, 13))
    with checkpoint.Checkpointer(directory) as ckpt:
      state = ckpt.restore_state(state_target(tx), plan=plan)
    for batch in data[int(state.step) :]:
      state, _ = step(state, batch)
    np.savez(out, *snapshot(state, plan))
  elif mode == "kill":
    # On one device: the commit that dies here does not depend on the mesh,
    # and a sharded first save costs seconds of slice compilation in orbax.
    tx = one_device_tx()
    params = ramp_params()
    ckpt = checkpoint.Checkpointer(directory)
    ckpt.save(1, params, jax.jit(tx.init)(params))
    ckpt.wait()
    params = jax.tree.map(lambda p: jax.device_put(-np.asarray(p)), params)
    from orbax.checkpoint._src.path import async_path

    async def die(*args, **kwargs):
      os._exit(9)  # killed after writing, before the commit

    async_path.rename = die
    ckpt.save(2, params, jax.jit(tx.init)(params))
    ckpt.wait()
    sys.exit("unreachable: the save should have died")
  elif mode == "exit":
    tx = one_device_tx()
    params = ramp_params()
    ckpt = checkpoint.Checkpointer(directory)
    ckpt.save(1, params, jax.jit(tx.init)(params))
    # No wait() or close(): the interpreter must finish the save on exit.
  else:
    sys.exit(f"unknown mode {mode!r}")


if __name__ == "__main__":
  main(*sys.argv[1:])
