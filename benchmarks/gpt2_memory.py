"""GPT-2 small's train-step memory per preset: measured against predicted.

One preset per process, so the device's peak belongs to that preset alone:

- predicted: `jmp_train.memory.memory_table` of the train state (params,
  gradients, master weights, optimizer state), read from shapes;
- compiled: what XLA allocates for the step, `compiled_memory` (arguments,
  temporaries: activations, gradients and workspace);
- measured (GPU): the device's `peak_bytes_in_use` after a few steps.

The model and step are `benchmarks/gpt2.py`'s (`linen.wrap`,
`preset.mixed_precision(optax.adamw)`, `make_train_step`, donated state).

  python benchmarks/gpt2_memory.py --preset bf16-mixed          # a GPU
  python benchmarks/gpt2_memory.py --preset bf16-mixed --tiny   # any machine
"""

import argparse
import json
import pathlib
import sys

sys.path.insert(
  0, str(pathlib.Path(__file__).resolve().parents[1] / "examples")
)

import gpt2
import gpt_model
import jax
import jax.numpy as jnp
import md
import numpy as np
import optax

import jmp_train
from jmp_train import memory, train

GIB = 2**30
PARTS = ("params", "gradients", "master_weights", "optimizer_state")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument(
    "--preset", default="bf16-mixed", choices=list(jmp_train.PRESETS)
  )
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--steps", type=int, default=3)
  p.add_argument("--tiny", action="store_true", help="a small model (CPU)")
  p.add_argument("--json", default=None)
  return p.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  cfg = gpt2.config(args.tiny)
  base = gpt_model.GPT(**cfg, tied=True, fused_attention=True)
  preset = jmp_train.get_preset(args.preset)
  model = jmp_train.linen.wrap(base, preset.policy, fp8=preset.fp8)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(
    rng.integers(0, cfg["vocab"], (args.batch, cfg["seq_len"] + 1)), jnp.int32
  )

  def loss_fn(params, batch, model_state, key):
    logits = model.apply({"params": params, **model_state}, batch[:, :-1])
    return gpt_model.cross_entropy(logits, batch[:, 1:])

  tx = preset.mixed_precision(optax.adamw(1e-4))
  variables = jax.jit(model.init)(jax.random.key(0), tokens[:1, :-1])
  state = train.TrainState.create(
    params=variables["params"], tx=tx, fp8=variables.get("fp8_meta")
  )
  del variables
  step = train.make_train_step(loss_fn, tx)
  predicted = memory.memory_table(None, state)
  compiled = memory.compiled_memory(step, state, tokens)
  for _ in range(args.steps):
    state, metrics = step(state, tokens)
  jax.block_until_ready(state)
  stats = jax.devices()[0].memory_stats() or {}
  result = {
    "preset": args.preset,
    "model": cfg,
    "batch": args.batch,
    "device": jax.devices()[0].device_kind,
    "jax": jax.__version__,
    "predicted": predicted,
    "compiled": compiled,
    "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
    "loss": float(metrics["loss"]),
  }
  print(table({args.preset: result}))
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
  return result


def table(results: dict) -> str:
  """Per preset: the predicted state, XLA's allocation and the peak."""
  if not results:
    return md.not_measured("benchmarks/gpt2_memory.py (it needs a GPU)")
  runs = list(results.values())
  rows = []
  for r in runs:
    pred, comp, peak = r["predicted"], r["compiled"], r["peak_bytes_in_use"]
    allocated = comp["argument"] + comp["temp"] + comp["output"] - comp["alias"]
    rows.append(
      [
        r["preset"],
        *(f"{pred[k] / GIB:.2f}" for k in PARTS),
        f"{pred['total'] / GIB:.2f}",
        f"{comp['temp'] / GIB:.2f}",
        f"{allocated / GIB:.2f}",
        f"{peak / GIB:.2f}" if peak is not None else "n/a",
        md.ratio(peak / allocated) if peak is not None else "n/a",
      ]
    )
  header = ["preset", "params", "grads", "masters", "opt state"]
  header += ["state (table)", "temp (XLA)", "step (XLA)", "peak", "peak / step"]
  first = runs[0]
  cfg = first["model"]
  return "\n".join(
    [
      f"GPT {cfg['layers']} layers, d_model {cfg['d_model']}, context"
      f" {cfg['seq_len']}, batch {first['batch']}, on {first['device']}"
      f" (jax {first['jax']}); GiB per device. The state columns are"
      " `memory.memory_table`'s prediction; `step (XLA)` is arguments +"
      " temporaries + outputs - aliased (donated) bytes of the compiled step;"
      " `peak` is the device's `peak_bytes_in_use` after the steps, one"
      " process per preset.",
      "",
      md.table(header, rows),
    ]
  )


if __name__ == "__main__":
  main()
