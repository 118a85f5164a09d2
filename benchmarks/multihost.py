"""Many processes: the GPT example's ZeRO-1 step on 2 processes x 4 CPU
devices against 1 process x 8.

Both sides train the model of `examples/gpt.py` (`examples/gpt_model.py`,
the example's default size) with the bf16-mixed preset and AdamW, stepped
by `jmp_train.train.make_train_step` with a ZeRO-1 plan over every device
(8 either way) on the same global batch. The 2-process side is this script
started twice by `jmp_train.distributed.launch` (JAX's multi-controller
runtime, coordinator on 127.0.0.1, gloo collectives between the processes);
each process builds its rows of the batch with
`jmp_train.train.global_batch`. The 1-process side is this script in a
fresh process with 8 virtual CPU devices. The sides run one after another,
in alternating order, `--rounds` times; each times `--steps` steps (median).

Collective bytes per step are counted in each side's compiled step
(`jmp_train.memory.collective_stats`, ring bytes per device); they depend on
the mesh, not on how its devices are split between processes.

  python benchmarks/multihost.py [--json out.json]
"""

import argparse
import json
import pathlib
import sys
import tempfile
import time

# The shared GPT model lives with the examples.
sys.path.insert(
  0, str(pathlib.Path(__file__).resolve().parents[1] / "examples")
)

import gpt_model
import jax
import md
import numpy as np
import optax

import jmp_train
from jmp_train import distributed, memory, train, zero1

DEVICES = 8  # on both sides: 1 x 8 and 2 x 4
SIDES = {"1x8": (1, 8), "2x4": (2, 4)}  # processes, CPU devices each


def worker(args) -> None:
  """One side's measurement, in each of its processes; process 0 writes
  `args.worker` (JSON)."""
  distributed.initialize()
  preset = jmp_train.get_preset(args.preset)
  model = jmp_train.linen.wrap(
    gpt_model.GPT(args.layers, args.d_model, args.heads, args.seq_len),
    preset.policy,
  )
  # The same global batch and params on every process, from one seed.
  tokens = np.random.default_rng(0).integers(
    0, gpt_model.VOCAB, (args.batch, args.seq_len + 1), dtype=np.int32
  )
  params = jax.jit(model.init)(jax.random.key(0), tokens[:1, :-1])["params"]
  tx = preset.mixed_precision(optax.adamw(1e-3, b2=0.95, weight_decay=0.1))
  devices = jax.devices()
  mesh = jax.make_mesh(
    (len(devices),),
    ("data",),
    axis_types=(jax.sharding.AxisType.Auto,),
    devices=devices,
  )
  plan = zero1.make_plan(tx, params, mesh)

  def loss_fn(params, batch, model_state, key):
    logits = model.apply({"params": params}, batch[:, :-1])
    return gpt_model.cross_entropy(logits, batch[:, 1:])

  step = train.make_train_step(loss_fn, tx, plan=plan)
  state = train.TrainState.create(params=params, tx=tx, plan=plan)
  rows = args.batch // jax.process_count()
  me = jax.process_index()
  batch = train.global_batch(tokens[me * rows : (me + 1) * rows], plan)
  t0 = time.perf_counter()
  compiled = step.lower(state, batch).compile()
  compile_s = time.perf_counter() - t0
  collectives = memory.summarize_collectives(
    memory.collective_stats(compiled.as_text(), len(devices))
  )
  losses, times = [], []
  for i in range(args.warmup + args.steps):
    t0 = time.perf_counter()
    state, metrics = jax.block_until_ready(step(state, batch))
    if i >= args.warmup:
      times.append(time.perf_counter() - t0)
    losses.append(float(metrics["loss"]))
  if me == 0:
    result = {
      "processes": jax.process_count(),
      "devices": len(devices),
      "compile_s": compile_s,
      "step_s": times,
      "median_s": float(np.median(times)),
      "losses": losses,
      "collectives": collectives,
      "n_params": sum(p.size for p in jax.tree.leaves(params)),
    }
    md.write_json(args.worker, result)


def run_side(name, model_flags, out, timeout_s):
  """One side in fresh processes; returns what its process 0 wrote."""
  processes, cpu_devices = SIDES[name]
  argv = [__file__, "--worker", str(out), *model_flags]
  # One process: `initialize()` leaves it alone (no distributed runtime).
  code = distributed.launch(
    argv, processes, cpu_devices=cpu_devices, timeout_s=timeout_s
  )
  if code:
    raise SystemExit(f"the {name} side failed (exit code {code}).")
  return json.loads(pathlib.Path(out).read_text())


def table(results: dict) -> str:
  """Step-time ratio, ms per step and collective bytes of both sides."""
  if not results:
    return md.not_measured("benchmarks/multihost.py")
  (r,) = results.values()
  one, two = r["sides"]["1x8"], r["sides"]["2x4"]
  rows = []
  for name, side in (("1 process x 8 devices", one), ("2 processes x 4", two)):
    c = side["collectives"]
    counts = ", ".join(
      f"{c[k]['count']} {k}"
      for k in ("reduce-scatter", "all-gather", "all-reduce")
      if k in c
    )
    rows.append(
      [
        name,
        f"{1e3 * side['median_s']:.1f}",
        f"{c['total_bytes'] / 2**20:.3f} MiB",
        counts,
      ]
    )
  header = ["run", "ms per step", "collective bytes sent per device"]
  header += ["collectives per step"]
  same = r["bytes_equal"]
  ops = sum(
    v["count"] for k, v in two["collectives"].items() if k != "total_bytes"
  )
  extra_ms = 1e3 * (two["median_s"] - one["median_s"])
  return "\n".join(
    [
      f"{r['model']}, preset {r['preset']}, ZeRO-1 over {DEVICES} CPU"
      f" devices, global batch {r['batch']} x {r['seq_len']}; median of"
      f" {r['steps']} steps, {r['rounds']} round"
      f"{'s' if r['rounds'] != 1 else ''} in alternating order.",
      "",
      md.table(header, rows),
      "",
      f"2 processes x 4 / 1 process x 8: **{md.ratio(r['ratio'])}** the step"
      " time (median of the rounds' ratios: "
      + ", ".join(md.ratio(x) for x in r["round_ratios"])
      + f"): {extra_ms:.1f} ms more per step, {extra_ms / ops:.2f} ms per"
      f" collective op ({ops} per step).",
      "",
      "Collective bytes per step the same for both process counts:"
      f" {md.verdict(same)}"
      + (
        "."
        if same
        else f" ({one['collectives']['total_bytes']:.0f} B vs"
        f" {two['collectives']['total_bytes']:.0f} B)."
      ),
    ]
  )


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--layers", type=int, default=2)
  ap.add_argument("--d-model", type=int, default=128)
  ap.add_argument("--heads", type=int, default=4)
  ap.add_argument("--seq-len", type=int, default=64)
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--preset", default="bf16-mixed")
  ap.add_argument("--steps", type=int, default=10, help="timed steps")
  ap.add_argument("--warmup", type=int, default=2, help="untimed steps")
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--timeout", type=float, default=300, help="s per side")
  ap.add_argument("--json", default=None)
  ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.worker:
    return worker(args)
  model_flags = [
    *("--layers", str(args.layers), "--d-model", str(args.d_model)),
    *("--heads", str(args.heads), "--seq-len", str(args.seq_len)),
    *("--batch", str(args.batch), "--preset", args.preset),
    *("--steps", str(args.steps), "--warmup", str(args.warmup)),
  ]
  runs = {name: [] for name in SIDES}
  with tempfile.TemporaryDirectory() as tmp:
    for r in range(args.rounds):
      order = list(SIDES) if r % 2 == 0 else list(SIDES)[::-1]
      for name in order:
        out = pathlib.Path(tmp) / f"{name}-{r}.json"
        runs[name].append(run_side(name, model_flags, out, args.timeout))
  round_ratios = [
    two["median_s"] / one["median_s"]
    for one, two in zip(runs["1x8"], runs["2x4"], strict=True)
  ]
  sides = {}
  for name, rs in runs.items():
    sides[name] = {
      "processes": rs[0]["processes"],
      "devices": rs[0]["devices"],
      "median_s": float(np.median([x["median_s"] for x in rs])),
      "round_median_s": [x["median_s"] for x in rs],
      "compile_s": [x["compile_s"] for x in rs],
      "first_losses": rs[0]["losses"][:3],
      "collectives": rs[0]["collectives"],
    }
  one, two = sides["1x8"], sides["2x4"]
  result = {
    "model": f"GPT {args.layers}x{args.d_model}, {args.heads} heads, seq"
    f" {args.seq_len}, vocabulary {gpt_model.VOCAB}; "
    f"{runs['1x8'][0]['n_params'] / 1e6:.2f}M params",
    "preset": args.preset,
    "batch": args.batch,
    "seq_len": args.seq_len,
    "steps": args.steps,
    "rounds": args.rounds,
    "sides": sides,
    "round_ratios": round_ratios,
    "ratio": float(np.median(round_ratios)),
    "bytes_equal": one["collectives"] == two["collectives"],
  }
  print(table({"multihost": result}))
  if args.json:
    md.write_json(args.json, result)
  return result


if __name__ == "__main__":
  main()
