"""Run in a fresh process by test_checkpoint.py: resume, die mid-save, or
exit right after a save."""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import _models  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jmp_train import checkpoint, sharding  # noqa: E402


def make_step():
  import optax
  from jax.sharding import AxisType

  import jmp_train as jmp

  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  tx = jmp.mixed_precision(
    optax.adamw(3e-3),
    loss_scale=jmp.dynamic_loss_scale(2.0**10, growth_interval=3),
  )
  return sharding.make_train_step(_models.loss_fn, tx, mesh=mesh)


def one_device_tx():
  import optax

  import jmp_train as jmp

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
    step = make_step()
    data = _models.batches(20, poison_at=(4, 13))
    ckpt = checkpoint.Checkpointer(directory)
    n, params, state = ckpt.restore(param_template(), train_step=step)
    for batch in data[n:]:
      params, state, _ = step(params, state, batch)
    leaves = jax.tree.leaves((params, step.to_logical(state)))
    np.savez(out, *[np.asarray(x.astype(jnp.float32)) for x in leaves])
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
