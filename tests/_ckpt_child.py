"""Run in a fresh process by test_checkpoint.py: resume, or die mid-save."""

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


def main(mode, directory, out):
  step = make_step()
  params0 = _models.init_params(jnp.bfloat16)
  data = _models.batches(20, poison_at=(4, 13))
  if mode == "resume":
    ckpt = checkpoint.Checkpointer(directory)
    n, params, state = ckpt.restore(params0, train_step=step)
    for batch in data[n:]:
      params, state, _ = step(params, state, batch)
    leaves = jax.tree.leaves((params, step.to_logical(state)))
    np.savez(out, *[np.asarray(x.astype(jnp.float32)) for x in leaves])
  elif mode == "kill":
    params, state = step.init(params0)
    ckpt = checkpoint.Checkpointer(directory)
    ckpt.save(1, params, state, train_step=step)
    ckpt.wait()
    params, state, _ = step(params, state, data[0])
    from orbax.checkpoint._src.path import async_path

    async def die(*args, **kwargs):
      os._exit(9)  # killed after writing, before the commit

    async_path.rename = die
    ckpt.save(2, params, state, train_step=step)
    ckpt.wait()
    sys.exit("unreachable: the save should have died")


if __name__ == "__main__":
  main(*sys.argv[1:])
