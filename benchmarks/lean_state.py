"""Optimizer state below float32: bytes per param, quality and update speed.

Every configuration is a preset (`PRESETS` below) through
`preset.mixed_precision(optax.adamw(...))`; the first, bf16-true (bfloat16
params, float32 masters, float32 Adam moments), is the baseline the others
are compared with. Four parts, one process each:

1. `memory`: bytes per param per device at N = 1 and 8 (virtual CPU
   devices, a `jmp_train.zero1` plan) on the shared GPT, from
   `jmp_train.memory.memory_table` (shapes only), checked against the
   compiled step's argument bytes (`memory_analysis()`), beside Megatron's
   and ZeRO's formulas and the bytes each format is written to take.
2. `gpt`: `examples/gpt.py --compare` over the presets (the same batches for
   each); the final validation losses against bf16-true's. Arguments this
   script does not know go to the example; `--chart` copies its chart.
3. `digits`: `examples/digits.py --preset NAME` for each preset (arguments
   this script does not know go to the example); final test accuracy.
4. `speed`: the optimizer update alone (`tx.update` and
   `optax.apply_updates`, jitted, params and state donated) on a GPT-sized
   tree of bfloat16 params; the median of `--calls` calls per round, rounds
   in rotated order.

  python benchmarks/lean_state.py memory
  python benchmarks/lean_state.py gpt --steps 400 --chart docs/lean-state.png
  python benchmarks/lean_state.py digits --epochs 30
  python benchmarks/lean_state.py speed
"""

import argparse
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping

# The examples and the shared GPT model are modules in examples/.
sys.path.insert(
  0, str(pathlib.Path(__file__).resolve().parents[1] / "examples")
)

import digits
import gpt
import gpt_model
import jax
import jax.numpy as jnp
import md
import optax
import timing
from jax.sharding import AxisType

import jmp_train
from jmp_train import memory, state_format, train, zero1

# The configurations, baseline first.
PRESETS = (
  "bf16-true,bf16-remainders,bf16-lean,bf16-kahan-lean,bf16-sr-lean,"
  "bf16-fp8-adam,bf16-sr-fp8-adam,bf16-sr-coat"
)
DEVICES = 8
MOMENTS = ("mu", "nu")  # Adam's state fields that hold one value per param
# Quality goals (final validation loss above bf16-true's), by moment format.
GOAL_LOSS = 0.01
GOAL_LOSS_FP8 = 0.02
# Megatron-LM's bytes per param with its distributed optimizer over N:
# float32 gradients and bfloat16 params, then float32 master + Adam over N.
MEGATRON = (4 + 2, 12)
LEAN_TOTAL = 8  # the target, bytes per param at N = 1
REMAINDERS_TOTAL = 14  # bf16-remainders: 2 + 2 (grads) + 2 + 8


# What each configuration stores, in the words and byte counts of
# jmp_train.state_format's table and jmp_train.param_update's docstrings.


def _format_name(fmt) -> str:
  if fmt is None or isinstance(fmt, state_format.Float32):
    return "float32"
  if isinstance(fmt, state_format.BFloat16):
    return "bf16" + (" SR" if fmt.rounding == "stochastic" else "")
  if isinstance(fmt, state_format.Float16):
    return "fp16/tensor"
  expand = ", expanded" if fmt.expand_range else ""
  return f"{fmt.dtype}/{fmt.group_size}{expand}"


def _format_bytes(fmt) -> float:
  """Bytes per value by the written rule (FP8: full groups)."""
  if fmt is None or isinstance(fmt, state_format.Float32):
    return 4
  if isinstance(fmt, (state_format.BFloat16, state_format.Float16)):
    return 2
  return 1 + (8 if fmt.expand_range else 4) / fmt.group_size


_MASTER = {  # param_update -> (what it keeps beside a bf16 param, bytes)
  jmp_train.MasterWeights: ("float32 master", 4),
  jmp_train.ParamRemainders: ("int16 remainder", 2),
  jmp_train.KahanSummation: ("bf16 Kahan", 2),
  jmp_train.StochasticRounding: ("none (SR)", 0),
  jmp_train.RoundToNearest: ("none (RTN)", 0),
}


def describe(name: str) -> dict:
  """What preset `name` keeps per param, and the bytes that should take."""
  preset = jmp_train.get_preset(name)
  formats = preset.state_formats
  fmt = {
    m: formats.get(m) if isinstance(formats, Mapping) else formats
    for m in MOMENTS
  }
  master, master_bytes = _MASTER[type(preset.param_update)]
  return {
    "preset": name,
    "master": master,
    "moments": ", ".join(f"{m} {_format_name(fmt[m])}" for m in MOMENTS),
    "fp8_moments": any(isinstance(f, state_format.FP8) for f in fmt.values()),
    "written_state_bytes": master_bytes
    + sum(_format_bytes(f) for f in fmt.values()),
  }


def _part(results: dict, part: str) -> dict | None:
  found = [r for r in results.values() if r.get("part") == part]
  return found[0] if found else None


# 1. Bytes per param.


def _mesh(n):
  return jax.make_mesh(
    (n,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n]
  )


def measure_memory(args, presets):
  model = gpt_model.GPT(
    args.layers, args.d_model, args.heads, args.seq, args.vocab, tied=True
  )
  params = gpt_model.init_shapes(model, dtype=jnp.bfloat16)
  n_params = sum(p.size for p in jax.tree.leaves(params))
  rows = []
  for name in presets:
    preset = jmp_train.get_preset(name)
    tx = preset.mixed_precision(optax.adamw(1e-3))
    loss_fn = gpt_model.step_loss(jmp_train.linen.wrap(model, preset.policy))
    state = jax.eval_shape(
      lambda p, tx=tx: train.TrainState.create(params=p, tx=tx), params
    )
    for n in (1, DEVICES):
      plan = zero1.make_plan(tx, params, _mesh(n))
      table = memory.memory_table(plan, state)
      batch = jax.ShapeDtypeStruct(
        (DEVICES, model.seq_len + 1), jnp.int32, sharding=plan.batch_sharding
      )
      step = train.make_train_step(loss_fn, tx, plan=plan)
      compiled = memory.compiled_memory(
        step, zero1.abstract(plan, state), batch
      )
      batch_bytes = DEVICES // n * (model.seq_len + 1) * 4
      rows.append(
        {
          "preset": name,
          "N": n,
          **table,
          "compiled_state_arguments": compiled["argument"] - batch_bytes,
        }
      )
  return {
    "part": "memory",
    "model": f"GPT {args.layers}x{args.d_model}, {args.heads} heads, seq"
    f" {args.seq}, vocabulary {args.vocab}, tied; {n_params / 1e6:.2f}M"
    " params",
    "device": f"{DEVICES} x {jax.devices()[0].device_kind}",
    "n_params": n_params,
    "configurations": [describe(name) for name in presets],
    "rows": rows,
  }


BYTES = ("params", "gradients", "master_weights", "optimizer_state", "total")
BYTES += ("compiled_state_arguments",)


def memory_table(results: dict) -> str:
  """Bytes per param per device, checked and set beside the formulas."""
  m = _part(results, "memory")
  if m is None:
    return md.not_measured("benchmarks/lean_state.py memory")
  n_params = m["n_params"]
  written = {c["preset"]: c for c in m["configurations"]}
  rows, at_n1 = [], {}
  for r in m["rows"]:
    per = {k: r[k] / n_params for k in BYTES}
    k = written[r["preset"]]["written_state_bytes"]
    table_args = r["total"] - r["gradients"]
    if r["N"] == 1:
      at_n1[r["preset"]] = per["total"]
    rows.append(
      [
        r["preset"],
        r["N"],
        f"{per['params']:.2f}",
        f"{per['gradients']:.2f}",
        f"{per['master_weights']:.3f}",
        f"{per['optimizer_state']:.3f}",
        f"**{per['total']:.3f}**",
        f"{per['compiled_state_arguments']:.3f}",
        r["compiled_state_arguments"] == table_args,
        f"{2 + 2 + k / r['N']:.3f}",
        f"{MEGATRON[0] + MEGATRON[1] / r['N']:.1f}",
      ]
    )
  header = ["preset", "N", "params", "grads", "masters", "optimizer state"]
  header += ["total", "compiled args - batch", "= total - grads"]
  header += ["ZeRO 2+2+K/N", f"Megatron {MEGATRON[0]}+{MEGATRON[1]}/N"]
  kinds = md.table(
    ["preset", "beside the bf16 param", "Adam moments", "K (B/param)"],
    [
      [c["preset"], c["master"], c["moments"]]
      + [f"{c['written_state_bytes']:.4g}"]
      for c in m["configurations"]
    ],
  )
  lean = [p for p, b in at_n1.items() if round(b, 2) <= LEAN_TOTAL]
  remainders = at_n1.get("bf16-remainders")
  verdicts = [
    f"At most {LEAN_TOTAL} B/param at N = 1 (totals to two decimals):"
    f" {', '.join(lean) if lean else 'none'}"
    f" ({md.verdict(bool(lean))})."
  ]
  if remainders is not None:
    verdicts.append(
      f"bf16-remainders at {REMAINDERS_TOTAL} B/param: {remainders:.3f},"
      f" {md.verdict(round(remainders, 2) == REMAINDERS_TOTAL)}."
    )
  return "\n".join(
    [
      f"{m['model']}, on {m['device']}. What each configuration keeps, and"
      " K, the bytes per param its masters and moments take by the rule each"
      " format is written with (FP8: one scale per full group; a leaf whose"
      " last axis is shorter than a group has more scales):",
      "",
      kinds,
      "",
      "Bytes per param per device (`memory_table`, bfloat16 gradients);"
      " `compiled args - batch` is the compiled step's argument bytes"
      " without the batch, which must equal the table's total less the"
      " gradients:",
      "",
      md.table(header, rows),
      "",
      *verdicts,
    ]
  )


# 2. Quality: the GPT example, and the digits example.


def measure_gpt(args, presets, example_args):
  with tempfile.TemporaryDirectory() as out:
    runs = gpt.main(
      ["--compare", ",".join(presets), "--out", out, *example_args]
    )
    if args.chart:
      shutil.copy(pathlib.Path(out) / "gpt-compare" / "curves.png", args.chart)
  return {
    "part": "gpt",
    "configurations": [describe(name) for name in presets],
    "runs": [{k: v for k, v in r.items() if k != "history"} for r in runs],
  }


def quality_table(results: dict) -> str:
  """Each preset's final validation loss against bf16-true's, with goals."""
  g = _part(results, "gpt")
  if g is None:
    return md.not_measured("benchmarks/lean_state.py gpt")
  runs = g["runs"]
  fp8 = {c["preset"]: c["fp8_moments"] for c in g["configurations"]}
  cfg = runs[0]["config"]
  base = runs[0]
  rows = []
  for x in runs:
    diff = x["final_val_loss"] - base["final_val_loss"]
    goal = GOAL_LOSS_FP8 if fp8[x["preset"]] else GOAL_LOSS
    verdict = "baseline" if x is base else md.verdict(abs(diff) <= goal)
    rows.append(
      [
        x["preset"],
        f"{x['final_val_loss']:.4f}",
        f"{diff:+.4f}",
        f"within {goal:.2f}",
        verdict,
        x["skipped_steps"],
        f"{x['seconds']:.1f}",
      ]
    )
  header = ["preset", "final val loss", f"vs {base['preset']}", "goal"]
  header += ["verdict", "skipped steps", "seconds"]
  met = sum(r[4] == md.verdict(True) for r in rows)
  return "\n".join(
    [
      f"`python examples/gpt.py --compare {','.join(x['preset'] for x in runs)}"
      f" --steps {cfg['steps']}`: {cfg['layers']} layers, d_model"
      f" {cfg['d_model']}, {cfg['steps']} steps of {cfg['batch_size']} x"
      f" {cfg['seq_len']} characters, AdamW. Goal: a final validation loss"
      f" within {GOAL_LOSS} of {base['preset']}'s with bf16 or float32"
      f" moments, within {GOAL_LOSS_FP8} with FP8 moments.",
      "",
      md.table(header, rows),
      "",
      f"{met} of {len(rows) - 1} configurations meet their goal.",
    ]
  )


def measure_digits(presets, example_args):
  rows = []
  with tempfile.TemporaryDirectory() as out:
    for name in presets:
      summary = digits.main(["--preset", name, "--out", out, *example_args])
      rows.append(
        {
          k: summary[k]
          for k in ("preset", "model", "steps", "seconds", "test_accuracy")
        }
        | {k: summary["config"][k] for k in ("epochs", "seed")}
      )
  return {"part": "digits", "rows": rows}


def digits_table(results: dict) -> str:
  """Each preset's digits test accuracy beside bf16-true's."""
  d = _part(results, "digits")
  if d is None:
    return md.not_measured("benchmarks/lean_state.py digits")
  rows = d["rows"]
  base = rows[0]
  table = md.table(
    ["preset", "test accuracy", f"vs {base['preset']}", "seconds"],
    [
      [
        r["preset"],
        f"{r['test_accuracy']:.4f}",
        f"{100 * (r['test_accuracy'] - base['test_accuracy']):+.2f} pt",
        f"{r['seconds']:.1f}",
      ]
      for r in rows
    ],
  )
  return "\n".join(
    [
      f"`python examples/digits.py --preset NAME --epochs {base['epochs']}`"
      f" ({base['model']}, {base['steps']} steps, seed {base['seed']}, 360"
      " test images:"
      " one image is 0.28 pt):",
      "",
      table,
    ]
  )


# 3. Speed of the update alone.


def measure_speed(args, presets):
  model = gpt_model.GPT(
    args.layers, args.d_model, args.heads, args.seq, args.vocab, tied=True
  )
  shapes = gpt_model.init_shapes(model)
  n_params = sum(p.size for p in jax.tree.leaves(shapes))
  leaves, treedef = jax.tree.flatten(shapes)
  keys = jax.random.split(jax.random.key(0), 2 * len(leaves))

  def normal(key, s, std):
    return (std * jax.random.normal(key, s.shape)).astype(jnp.bfloat16)

  params = [
    normal(k, s, 0.02) for k, s in zip(keys[: len(leaves)], leaves, strict=True)
  ]
  grads = [
    normal(k, s, 1e-3) for k, s in zip(keys[len(leaves) :], leaves, strict=True)
  ]
  params = jax.tree.unflatten(treedef, params)
  grads = jax.tree.unflatten(treedef, grads)

  def make_update(tx):
    def update(params, opt_state, grads):
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    return jax.jit(update, donate_argnums=(0, 1))

  steps, states = {}, {}
  for name in presets:
    tx = jmp_train.get_preset(name).mixed_precision(optax.adamw(1e-3))
    steps[name] = make_update(tx)
    state = (jax.tree.map(jnp.copy, params), tx.init(params))
    for _ in range(args.warmup):
      state = steps[name](*state, grads)
    states[name] = jax.block_until_ready(state)

  medians = {name: [] for name in presets}
  for i in range(args.rounds):
    for name in timing.rotated(list(presets), i):
      times = []
      for _ in range(args.calls):
        t0 = time.perf_counter()
        states[name] = jax.block_until_ready(steps[name](*states[name], grads))
        times.append(time.perf_counter() - t0)
      medians[name].append(statistics.median(times))
  return {
    "part": "speed",
    "model": f"GPT {args.layers}x{args.d_model}, {args.heads} heads, seq"
    f" {args.seq}, vocabulary {args.vocab}, tied; {n_params / 1e6:.2f}M"
    " bfloat16 params",
    "device": f"{jax.devices()[0].device_kind}",
    "n_params": n_params,
    "calls": args.calls,
    "rounds": args.rounds,
    "median_s": medians,
  }


def speed_table(results: dict) -> str:
  """Update time per configuration, and its ratio to the first one's."""
  s = _part(results, "speed")
  if s is None:
    return md.not_measured("benchmarks/lean_state.py speed")
  med = s["median_s"]
  names = list(med)
  base = names[0]
  rows = []
  for name in names:
    ratios = [t / b for t, b in zip(med[name], med[base], strict=True)]
    rows.append(
      [
        name,
        f"{1e3 * statistics.median(med[name]):.1f}",
        f"**{md.ratio(statistics.median(med[name]) / statistics.median(med[base]))}**",
        f"{md.ratio(min(ratios))} - {md.ratio(max(ratios))}",
      ]
    )
  return "\n".join(
    [
      f"{s['model']}, on {s['device']}: `tx.update` + `optax.apply_updates`,"
      f" jitted, params and state donated; median of {s['calls']} calls per"
      f" round, {s['rounds']} rounds in rotated order (time: median of the"
      " rounds' medians).",
      "",
      md.table(
        ["preset", "update ms", f"vs {base}", "range over rounds"], rows
      ),
    ]
  )


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parts = p.add_subparsers(dest="part", required=True)
  common = argparse.ArgumentParser(add_help=False)
  common.add_argument("--presets", default=PRESETS)
  common.add_argument("--json", default=None, help="also write results here")

  def with_shape(name, layers, d_model, heads, vocab, seq):
    """A part's parser with the GPT's shape flags and their defaults."""
    part = parts.add_parser(name, parents=[common])
    part.add_argument("--layers", type=int, default=layers)
    part.add_argument("--d-model", type=int, default=d_model)
    part.add_argument("--heads", type=int, default=heads)
    part.add_argument("--vocab", type=int, default=vocab)
    part.add_argument("--seq", type=int, default=seq)
    return part

  with_shape("memory", layers=2, d_model=256, heads=4, vocab=256, seq=64)
  quality = parts.add_parser("gpt", parents=[common])
  quality.add_argument("--chart", default=None, help="copy the chart here")
  parts.add_parser("digits", parents=[common])
  # About 10M params.
  speed = with_shape("speed", layers=6, d_model=384, heads=6, vocab=256, seq=64)
  speed.add_argument("--calls", type=int, default=20)
  speed.add_argument("--rounds", type=int, default=3)
  speed.add_argument("--warmup", type=int, default=2)
  args, example_args = p.parse_known_args(argv)
  if example_args and args.part not in ("gpt", "digits"):
    p.error(f"unrecognized arguments: {' '.join(example_args)}")
  return args, example_args


def main(argv=None):
  args, example_args = parse_args(argv)
  presets = args.presets.split(",")
  for name in presets:
    jmp_train.get_preset(name)  # an unknown name fails here, listing them
  if args.part == "memory":
    if jax.device_count() < DEVICES:
      raise SystemExit(
        f"lean_state.py memory needs {DEVICES} devices, found"
        f" {jax.device_count()}."
      )
    result, table = measure_memory(args, presets), memory_table
  elif args.part == "gpt":
    result, table = measure_gpt(args, presets, example_args), quality_table
  elif args.part == "digits":
    result, table = measure_digits(presets, example_args), digits_table
  else:
    result, table = measure_speed(args, presets), speed_table
  print(table({args.part: result}))
  if args.json:
    md.write_json(args.json, result)
  return result


if __name__ == "__main__":
  # Virtual CPU devices for the memory part's mesh; JAX makes them when its
  # backend starts (the other parts use the first device only).
  jax.config.update("jax_num_cpu_devices", DEVICES)
  main()
