"""Bytes per device of a GPT-2 train step: params, gradients, masters, state.

Needs only shapes, so nothing is allocated; `--check` compiles the step and
compares the table with XLA's `memory_analysis()`. The mesh is made of
virtual CPU devices (JAX's `jax_num_cpu_devices`, set before JAX starts),
whatever accelerator the machine has.

  python benchmarks/memory_table.py --model gpt2-small --preset bf16-true \\
      --mesh data=8 --check
"""

import argparse
import math
import pathlib
import sys

# The shared GPT model lives with the examples.
sys.path.insert(
  0, str(pathlib.Path(__file__).resolve().parents[1] / "examples")
)

import gpt_model
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_train
from jmp_train import memory, train, zero1


def parse_mesh(text: str) -> dict[str, int]:
  """`data=4,model=2` as `{"data": 4, "model": 2}`."""
  axes = {}
  for part in text.split(","):
    name, _, size = part.partition("=")
    if not size.isdigit() or not name or int(size) < 1:
      raise SystemExit(f"--mesh wants name=size[,name=size], got {text!r}")
    axes[name] = int(size)
  return axes


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument(
    "--model", default="gpt2-small", choices=sorted(gpt_model.CONFIGS)
  )
  p.add_argument(
    "--preset", default="bf16-true", choices=list(jmp_train.PRESETS)
  )
  p.add_argument(
    "--mesh", default="data=8", help="axes, e.g. data=4,model=2 ('data' is "
    "the data-parallel axis; params are replicated over the others)"
  )  # fmt: skip
  p.add_argument("--zero-stage", type=int, default=1, choices=(0, 1))
  p.add_argument("--accum-steps", type=int, default=1)
  p.add_argument("--batch", type=int, default=8, help="global batch")
  p.add_argument("--check", action="store_true", help="compile and compare")
  args = p.parse_args(argv)
  args.axes = parse_mesh(args.mesh)
  if "data" not in args.axes:
    raise SystemExit(f"--mesh needs a 'data' axis, got {args.mesh!r}")
  if args.accum_steps < 1:
    raise SystemExit(f"--accum-steps must be 1 or more, got {args.accum_steps}")
  rows = args.axes["data"] * args.accum_steps
  if args.check and args.batch % rows:
    raise SystemExit(
      f"--check compiles a step over --batch {args.batch} rows, which must "
      f"split over data={args.axes['data']} x --accum-steps "
      f"{args.accum_steps}: give a multiple of {rows}"
    )
  param_dtype = jmp_train.get_preset(args.preset).policy.param_dtype
  others = [a for a in args.axes if a != "data" and args.axes[a] > 1]
  if args.check and others and param_dtype == jnp.bfloat16:
    # README, Limits: XLA:CPU aborts compiling such a step (not an error).
    raise SystemExit(
      f"--check with bfloat16 params ({args.preset}) on a mesh with a "
      f"model axis ({', '.join(others)}) aborts the XLA:CPU compiler: drop "
      "--check for the table, or use a preset with float32 params"
    )
  return args


def main(argv=None) -> dict:
  args = parse_args(argv)
  n_dev = math.prod(args.axes.values())
  # Before JAX computes anything: enough virtual CPU devices for the mesh.
  jax.config.update("jax_num_cpu_devices", n_dev)
  devices = jax.devices("cpu")
  if len(devices) < n_dev:
    raise SystemExit(f"The mesh needs {n_dev} devices; {len(devices)} exist.")
  mesh = jax.sharding.Mesh(
    np.array(devices[:n_dev]).reshape(tuple(args.axes.values())),
    tuple(args.axes),
    axis_types=(jax.sharding.AxisType.Auto,) * len(args.axes),
  )

  preset = jmp_train.get_preset(args.preset)
  cfg = gpt_model.CONFIGS[args.model]
  params = gpt_model.init_shapes(
    gpt_model.GPT(**cfg), preset.policy.param_dtype
  )
  n_params = sum(math.prod(p.shape) for p in jax.tree.leaves(params))
  tx = preset.mixed_precision(optax.adamw(1e-4))
  plan = zero1.make_plan(tx, params, mesh, zero_stage=args.zero_stage)
  state = jax.eval_shape(
    lambda p: train.TrainState.create(params=p, tx=tx), params
  )
  table = memory.memory_table(plan, state, accum_steps=args.accum_steps)
  print(
    f"{args.model}: {n_params / 1e6:.1f}M params, preset {args.preset}, "
    f"mesh {args.mesh}, ZeRO stage {args.zero_stage}; bytes per device"
  )
  for key, value in table.items():
    print(
      f"  {key:16s} {value / 2**20:12.2f} MiB  {value / n_params:7.3f} B/param"
    )
  result = {"table": table, "n_params": n_params}
  if not args.check:
    return result

  model = jmp_train.linen.wrap(gpt_model.GPT(**cfg), preset.policy)

  def loss_fn(params, tokens, model_state, key):
    logits = model.apply({"params": params, **model_state}, tokens[:, :-1])
    return gpt_model.cross_entropy(logits, tokens[:, 1:])

  step = train.make_train_step(
    loss_fn, tx, plan=plan, accum_steps=args.accum_steps
  )
  batch = jax.ShapeDtypeStruct((args.batch, cfg["seq_len"] + 1), jnp.int32)
  compiled = memory.compiled_memory(step, zero1.abstract(plan, state), batch)
  batch_shard = plan.batch_sharding.shard_shape(batch.shape)
  batch_bytes = math.prod(batch_shard) * batch.dtype.itemsize
  # The step's arguments: the whole train state and this device's rows.
  expected = table["total"] - table["gradients"] + batch_bytes
  print("compiled step, memory_analysis() per device:")
  for key, value in compiled.items():
    print(f"  {key:16s} {value / 2**20:12.2f} MiB")
  verdict = "match" if compiled["argument"] == expected else "DIFFER"
  print(
    f"  arguments {compiled['argument']} B vs table total - gradients + "
    f"batch {expected} B: {verdict}"
  )
  return {**result, "compiled": compiled, "expected_argument": expected}


if __name__ == "__main__":
  main()
