"""GPT-2 small's train-step memory per preset: measured against predicted.

One preset per process, so the device's peak belongs to that preset alone:

- predicted: `jmp_train.memory.memory_table` of the train state (params,
  gradients, master weights, optimizer state), read from shapes;
- compiled: what XLA allocates for the step, `compiled_memory` (arguments,
  temporaries: activations, gradients and workspace);
- measured (GPU): the device's `peak_bytes_in_use` after a few steps.

With `--target h100` the step is compiled for that GPU on a machine without
one (`benchmarks/deviceless.py`) and not run: the prediction and XLA's
allocation, no peak (`compiled_only` in the results).

The model and step are `benchmarks/gpt2.py`'s (`linen.wrap`,
`preset.mixed_precision(optax.adamw)`, `make_train_step`, donated state).

  python benchmarks/gpt2_memory.py --preset bf16-mixed          # a GPU
  python benchmarks/gpt2_memory.py --preset bf16-mixed --tiny   # any machine
  python benchmarks/gpt2_memory.py --preset bf16-mixed --target h100  # no GPU
"""

import argparse
import pathlib
import sys

sys.path.insert(
  0, str(pathlib.Path(__file__).resolve().parents[1] / "examples")
)

import deviceless
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
  deviceless.add_target_argument(p)
  p.add_argument(
    "--hlo",
    default=None,
    metavar="PATH",
    help="also save the compiled step's HLO text, gzipped, at PATH (from a"
    " GPU: the program after autotuning, whose temporaries may differ from a"
    " --target compile's)",
  )
  p.add_argument("--json", default=None)
  return p.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  topo = deviceless.start(args.target)
  cfg = gpt2.config(args.tiny)
  base = gpt2.base_model(cfg, args.target)
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

  def new_state(init):
    variables = init(jax.random.key(0), tokens[:1, :-1])
    return train.TrainState.create(
      params=variables["params"], tx=tx, fp8=variables.get("fp8_meta")
    )

  # Compiled only, the step needs the state's shapes, not its values.
  if topo:
    state = jax.eval_shape(lambda: new_state(model.init))
  else:
    state = new_state(jax.jit(model.init))
  step = train.make_train_step(loss_fn, tx)
  result = {"preset": args.preset, "model": cfg, "batch": args.batch}
  result["predicted"] = memory.memory_table(None, state)
  if topo:
    state, tokens = deviceless.abstract((state, tokens), topo)
    result |= {
      **deviceless.provenance(args.target),
      "compiled_only": True,
      "compiled": memory.compiled_memory(step, state, tokens),
      "peak_bytes_in_use": None,
      "loss": None,
    }
  else:
    compiled = memory.compiled_memory(step, state, tokens)
    for _ in range(args.steps):
      state, metrics = step(state, tokens)
    jax.block_until_ready(state)
    stats = jax.devices()[0].memory_stats() or {}
    result |= {
      "device": jax.devices()[0].device_kind,
      "jax": jax.__version__,
      "compiled_only": False,
      "compiled": compiled,
      "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
      "loss": float(metrics["loss"]),
    }
  if args.hlo:  # compiled above: JAX's cache gives the program back
    md.write_hlo(args.hlo, step.lower(state, tokens).compile().as_text())
  print(table({args.preset: result}))
  if args.json:
    md.write_json(args.json, result)
  return result


def table(results: dict) -> str:
  """Per preset: the predicted state, XLA's allocation and the peak.

  One table per device, jax version and kind of run: the steps run on a GPU
  (a peak, or n/a where the device reports none) apart from those compiled
  for one without it (`--target`: no peak columns).
  """
  if not results:
    return md.not_measured("benchmarks/gpt2_memory.py (it needs a GPU)")
  groups: dict[tuple, list] = {}
  for r in results.values():
    # Results saved before --target existed were all run.
    key = (r["device"], r["jax"], r.get("compiled_only", False))
    groups.setdefault(key, []).append(r)
  return "\n\n".join(
    _group_table(runs, compiled_only)
    for (_, _, compiled_only), runs in groups.items()
  )


def _group_table(runs: list[dict], compiled_only: bool) -> str:
  """`table` for the runs of one device, jax version and kind of run."""
  rows = []
  for r in runs:
    pred, comp, peak = r["predicted"], r["compiled"], r["peak_bytes_in_use"]
    allocated = comp["argument"] + comp["temp"] + comp["output"] - comp["alias"]
    row = [
      r["preset"],
      *(f"{pred[k] / GIB:.2f}" for k in PARTS),
      f"{pred['total'] / GIB:.2f}",
      f"{comp['temp'] / GIB:.2f}",
      f"{allocated / GIB:.2f}",
    ]
    if not compiled_only:
      row += [
        f"{peak / GIB:.2f}" if peak is not None else "n/a",
        md.ratio(peak / allocated) if peak is not None else "n/a",
      ]
    rows.append(row)
  header = ["preset", "params", "grads", "masters", "opt state"]
  header += ["state (table)", "temp (XLA)", "step (XLA)"]
  first = runs[0]
  cfg = first["model"]
  line = (
    f"GPT {cfg['layers']} layers, d_model {cfg['d_model']}, context"
    f" {cfg['seq_len']}, batch {first['batch']}, on {first['device']}"
    f" (jax {first['jax']}); GiB per device. The state columns are"
    " `memory.memory_table`'s prediction; `step (XLA)` is arguments +"
    " temporaries + outputs - aliased (donated) bytes of the compiled step"
  )
  if compiled_only:
    line += " (no peak)."
  else:
    header += ["peak", "peak / step"]
    line += (
      "; `peak` is the device's `peak_bytes_in_use` after the steps, one"
      " process per preset."
    )
  return "\n".join([line, "", md.table(header, rows)])


if __name__ == "__main__":
  main()
