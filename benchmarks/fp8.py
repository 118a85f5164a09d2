"""FP8 measurements per recipe: matmul time against bf16, and accuracy.

The jmp_train.fp8 recipes at their defaults, by the names the examples'
`--fp8` flag takes: "delayed" `DelayedScaling()`, "current"
`CurrentScaling()`, "current-pow2" `CurrentScaling(power_of_two_scales=True)`
and "blockwise" `BlockwiseScaling()`; "off" is no FP8.

1. `--matmul`: forward + backward of one `nn.Dense` (n x n input, n x n
   bfloat16 kernel) with its matmul in bfloat16, and in FP8 with each recipe
   (`jmp_train.fp8.Fp8DotGeneral`), timed side by side: every round times
   each once, in an order rotated each round; a recipe's speed-up is the
   median over rounds of the round's bf16 time over its own. Speed needs a
   GPU with FP8 tensor cores (H100); on CPU FP8 is emulated and slower.
2. `--accuracy`: the digits example's test accuracy per preset (bf16-mixed,
   fp16-mixed) and model (MLP, CNN), without FP8 and with each recipe.
3. `--gpt`: the GPT example's final validation loss, bf16-mixed without FP8
   and with each recipe, for each of `--seeds` (the runs of one seed draw
   the same batches and initial params); the goal is on the mean over
   seeds of each recipe's difference. Arguments this script does not know
   go to the example.

  python benchmarks/fp8.py --matmul --sizes 4096,8192,16384   # on a GPU
  python benchmarks/fp8.py --accuracy                          # CPU is fine
  python benchmarks/fp8.py --gpt --steps 400 --seeds 0,1,2     # CPU is fine
"""

import argparse
import functools
import json
import pathlib
import statistics
import sys
import tempfile
import time

# The examples are modules beside the others in examples/.
sys.path.insert(
  0, str(pathlib.Path(__file__).resolve().parents[1] / "examples")
)

import digits
import flax.linen as nn
import gpt
import jax
import jax.numpy as jnp
import md

from jmp_train import fp8

RECIPES = ("delayed", "current", "current-pow2", "blockwise")
GPT_PRESET = "bf16-mixed"
# Goals: digits accuracy within 1 point of the same preset without FP8; the
# GPT's final validation loss within 0.02 of bf16-mixed's; the matmul
# (issue 4) at least 1.3x bf16 at the largest size.
GOAL_ACCURACY = 0.01
GOAL_LOSS = 0.02
GOAL_SPEEDUP = 1.3


def parse_args(argv=None):
  # No abbreviations: `--seed` and `--preset` are the GPT example's.
  p = argparse.ArgumentParser(
    description=__doc__.split("\n")[0], allow_abbrev=False
  )
  p.add_argument("--matmul", action="store_true")
  p.add_argument("--accuracy", action="store_true")
  p.add_argument("--gpt", action="store_true")
  p.add_argument("--recipes", default=",".join(RECIPES))
  p.add_argument("--sizes", default="4096,8192,16384", help="matmul n")
  p.add_argument("--rounds", type=int, default=20)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--epochs", type=int, default=30, help="digits epochs")
  p.add_argument("--seeds", default="0", help="GPT seeds, comma-separated")
  p.add_argument("--models", default="mlp,cnn", help="digits models")
  p.add_argument("--presets", default="bf16-mixed,fp16-mixed", help="digits")
  p.add_argument("--json", default=None, help="also write results here")
  args, example_args = p.parse_known_args(argv)
  if example_args and not args.gpt:
    p.error(f"unrecognized arguments: {' '.join(example_args)}")
  if "--seed" in example_args:
    p.error("--seed: give the GPT's seeds as --seeds (e.g. --seeds 0,1,2)")
  args.example_args = example_args
  args.recipes = args.recipes.split(",")
  args.seeds = [int(s) for s in args.seeds.split(",")]
  for name in args.recipes:
    if name not in RECIPES:
      p.error(f"--recipes: unknown recipe {name!r}; known: {RECIPES}")
  return args


# 1. Matmul time.


def dense_steps(n, recipes):
  """Jitted forward+backward of a bf16 Dense and of its FP8 twins.

  The backward pass pulls back a random cotangent: with `sum(y)` as the loss
  the cotangent is all ones and XLA folds both backward matmuls into row and
  column sums, timing one matmul instead of three. It also pulls back to the
  FP8 state, as a train step does: the amaxes are that state's "gradient".
  """
  kx, kg = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (n, n), jnp.bfloat16)
  g = jax.random.normal(kg, (n, n), jnp.bfloat16)
  steps = {}
  for name in ("bf16", *recipes):
    dot = None
    if name != "bf16":
      dot = functools.partial(
        fp8.Fp8DotGeneral, recipe=digits.FP8_RECIPES[name]
      )
    layer = nn.Dense(
      n,
      use_bias=False,
      dtype=jnp.bfloat16,
      param_dtype=jnp.bfloat16,
      dot_general_cls=dot,
    )
    variables = layer.init(kx, x)
    meta = variables.get(fp8.COLLECTION, {})

    def fwd_bwd(params, meta, x, g, layer=layer):
      def f(params, meta, x):
        return layer.apply({"params": params, fp8.COLLECTION: meta}, x)

      y, pull = jax.vjp(f, params, meta, x)
      return y, pull(g)

    steps[name] = (jax.jit(fwd_bwd), (variables["params"], meta, x, g))
  return steps


def time_matmuls(sizes, recipes, rounds, warmup):
  rows = []
  for n in sizes:
    steps = dense_steps(n, recipes)
    for step, args in steps.values():
      for _ in range(warmup):
        jax.block_until_ready(step(*args))
    names = list(steps)
    times = {name: [] for name in names}
    for i in range(rounds):
      k = i % len(names)
      for name in names[k:] + names[:k]:  # rotate, so drift hits all alike
        step, args = steps[name]
        start = time.perf_counter()
        jax.block_until_ready(step(*args))
        times[name].append(time.perf_counter() - start)
    rows.append(
      {
        "n": n,
        "flops": 3 * 2 * n**3,  # forward + two backward matmuls
        "ms": {k: 1e3 * statistics.median(v) for k, v in times.items()},
        "speedup_over_bf16": {
          name: statistics.median(
            b / t for b, t in zip(times["bf16"], times[name], strict=True)
          )
          for name in recipes
        },
      }
    )
  return rows


def _earlier_rows(m: dict) -> list[dict]:
  """Rows saved before the recipes, rewritten as `time_matmuls` writes them.

  Those had one FP8 column (`fp8_ms`), measured with delayed scaling, the
  only recipe then, and a speed-up that was the ratio of the medians.
  """
  return [
    {
      "n": x["n"],
      "flops": 3 * 2 * x["n"] ** 3,
      "ms": {"bf16": x["bf16_ms"], "delayed": x["fp8_ms"]},
      "speedup_over_bf16": {"delayed": x["speedup_fp8_over_bf16"]},
    }
    for x in m["matmul"]
  ]


def matmul_table(results: dict) -> str:
  """bf16 and each recipe's matmul time per size, and the verdicts."""
  found = [r for r in results.values() if "matmul" in r]
  if not found:
    return md.not_measured("benchmarks/fp8.py --matmul")
  m = found[0]
  earlier = "ms" not in m["matmul"][0]
  rows = _earlier_rows(m) if earlier else m["matmul"]
  recipes = list(rows[0]["speedup_over_bf16"])
  table = []
  for x in rows:
    for name in ("bf16", *recipes):
      speedup = x["speedup_over_bf16"].get(name)
      table.append(
        [
          x["n"],
          name,
          f"{x['ms'][name]:.3f}",
          f"{x['flops'] / x['ms'][name] / 1e9:.3g}",
          "" if speedup is None else f"{speedup:.2f}x",
        ]
      )
  big = max(rows, key=lambda x: x["n"])
  verdicts = [
    f"{name} {big['speedup_over_bf16'][name]:.2f}x"
    f" {md.verdict(big['speedup_over_bf16'][name] >= GOAL_SPEEDUP)}"
    for name in recipes
  ]
  if earlier:
    how = (
      "saved before this benchmark measured each recipe: delayed scaling"
      " alone, time the median of alternating rounds, speed-up the ratio of"
      " the medians"
    )
  else:
    how = (
      f"{m['rounds']} rounds in rotated order; time: the median; speed-up:"
      " the median of the rounds' bf16 time over the recipe's"
    )
  return "\n".join(
    [
      f"On {m['device']} ({how}):",
      "",
      md.table(["n", "matmul", "ms", "TFLOP/s", "speed-up"], table),
      "",
      f"Goal (issue 4): FP8 >= {GOAL_SPEEDUP}x bf16 at the largest size,"
      f" n = {big['n']}: {'; '.join(verdicts)}.",
    ]
  )


# 2. Digits accuracy.


def digits_accuracy(args):
  rows = []
  with tempfile.TemporaryDirectory() as out:
    for model in args.models.split(","):
      for preset in args.presets.split(","):
        accuracy = {}
        for name in ("off", *args.recipes):
          summary = digits.main(
            [
              *("--model", model, "--preset", preset, "--fp8", name),
              *("--epochs", str(args.epochs), "--out", out),
            ]
          )
          accuracy[name] = summary["test_accuracy"]
        rows.append({"model": model, "preset": preset, "accuracy": accuracy})
  seed = summary["config"]["seed"]  # the example's default
  return {"epochs": args.epochs, "seed": seed, "rows": rows}


def _digits_table(d: dict) -> tuple[str, dict]:
  """The digits table, and each recipe's largest gap to no FP8."""
  recipes = [k for k in d["rows"][0]["accuracy"] if k != "off"]
  gaps = {name: 0.0 for name in recipes}
  table = []
  for r in d["rows"]:
    acc = r["accuracy"]
    cells = [r["model"], r["preset"], f"{acc['off']:.4f}"]
    for name in recipes:
      diff = acc[name] - acc["off"]
      gaps[name] = max(gaps[name], abs(diff))
      cells.append(f"{acc[name]:.4f} ({100 * diff:+.2f} pt)")
    table.append(cells)
  text = "\n".join(
    [
      f"`python examples/digits.py --model MODEL --preset PRESET --fp8"
      f" RECIPE --epochs {d['epochs']}` (seed {d['seed']}, 360 test images:"
      " one image is 0.28 pt); test accuracy, and the difference to the"
      " same preset without FP8:",
      "",
      md.table(["model", "preset", "no FP8", *recipes], table),
    ]
  )
  return text, gaps


# 3. The GPT example's validation loss.


def gpt_loss(args):
  runs = []
  with tempfile.TemporaryDirectory() as out:
    for seed in args.seeds:
      for name in ("off", *args.recipes):
        (run,) = gpt.main(
          [
            *("--preset", GPT_PRESET, "--fp8", name, "--seed", str(seed)),
            *("--out", f"{out}/{name}", *args.example_args),
          ]
        )
        keep = ("final_val_loss", "skipped_steps", "seconds")
        runs.append({"fp8": name, "seed": seed, **{k: run[k] for k in keep}})
  # What every run shares (each run's --fp8 and --seed are in its row).
  config = {
    k: v for k, v in run["config"].items() if k not in ("fp8", "seed", "out")
  }
  # The example's --preset, if given, overrides GPT_PRESET.
  return {"preset": run["preset"], "config": config, "runs": runs}


def _gpt_table(g: dict) -> tuple[str, dict]:
  """The GPT table, and each recipe's mean validation loss minus no FP8's."""
  cfg = g["config"]
  seeds = list(dict.fromkeys(x["seed"] for x in g["runs"]))
  loss = {(x["fp8"], x["seed"]): x["final_val_loss"] for x in g["runs"]}
  names = list(dict.fromkeys(x["fp8"] for x in g["runs"]))
  base = names[0]
  diff = {k: v - loss[base, k[1]] for k, v in loss.items()}
  means, table = {}, []
  for name in names:
    skipped = sum(x["skipped_steps"] for x in g["runs"] if x["fp8"] == name)
    if name == base:
      cells = [f"{loss[name, s]:.4f}" for s in seeds]
      table.append([name, *cells, "baseline", "", skipped])
      continue
    means[name] = statistics.mean(diff[name, s] for s in seeds)
    cells = [f"{loss[name, s]:.4f} ({diff[name, s]:+.4f})" for s in seeds]
    verdict = md.verdict(abs(means[name]) <= GOAL_LOSS)
    table.append([name, *cells, f"{means[name]:+.4f}", verdict, skipped])
  worst = max((k for k in diff if k[0] != base), key=lambda k: abs(diff[k]))
  header = ["fp8", *(f"seed {s}" for s in seeds), "mean difference"]
  # No seconds: on a CPU FP8 is emulated, so its time says nothing.
  header += ["verdict", "skipped steps"]
  text = "\n".join(
    [
      f"`python examples/gpt.py --preset {g['preset']} --fp8 RECIPE --seed"
      f" SEED --steps {cfg['steps']}`: {cfg['layers']} layers, d_model"
      f" {cfg['d_model']}, {cfg['steps']} steps of {cfg['batch_size']} x"
      f" {cfg['seq_len']} characters; the runs of one seed share their"
      " batches and initial params. Final validation loss (and its"
      f" difference to {g['preset']}'s without FP8, same seed); goal: the"
      f" mean difference within {GOAL_LOSS}.",
      "",
      md.table(header, table),
      "",
      f"Largest difference of one run: {diff[worst]:+.4f} ({worst[0]}, seed"
      f" {worst[1]}).",
    ]
  )
  return text, means


def accuracy_table(results: dict) -> str:
  """Digits accuracy and GPT loss per recipe, and a verdict per recipe."""
  d = next((r["accuracy"] for r in results.values() if "accuracy" in r), None)
  g = next((r["gpt"] for r in results.values() if "gpt" in r), None)
  if d is None and g is None:
    return md.not_measured("benchmarks/fp8.py --accuracy and --gpt")
  parts, gaps, diffs = [], {}, {}
  if d is None:
    parts.append(md.not_measured("benchmarks/fp8.py --accuracy"))
  else:
    text, gaps = _digits_table(d)
    parts.append(text)
  if g is None:
    parts.append(md.not_measured("benchmarks/fp8.py --gpt"))
  else:
    text, diffs = _gpt_table(g)
    parts.append(text)
  rows = []
  for name in dict.fromkeys([*gaps, *diffs]):
    checks = []
    row = [name]
    if name in gaps:
      checks.append(gaps[name] <= GOAL_ACCURACY)
      row.append(f"{100 * gaps[name]:.2f} pt")
    else:
      row.append("not measured")
    if name in diffs:
      checks.append(abs(diffs[name]) <= GOAL_LOSS)
      row.append(f"{diffs[name]:+.4f}")
    else:
      row.append("not measured")
    rows.append([*row, md.verdict(all(checks))])
  header = ["recipe", "digits: largest gap", "GPT: mean val loss vs no FP8"]
  met = [r[0] for r in rows if r[-1] == md.verdict(True)]
  parts += [
    f"Per recipe (goals: digits within {100 * GOAL_ACCURACY:.0f} point of"
    f" the same preset without FP8; GPT: the mean over seeds within"
    f" {GOAL_LOSS} of {g['preset'] if g else GPT_PRESET}):",
    md.table([*header, "verdict"], rows),
    f"Goal met by {len(met)} of {len(rows)} recipes"
    + (f" ({', '.join(met)})." if met else "."),
  ]
  return "\n\n".join(parts)


def main(argv=None):
  args = parse_args(argv)
  if not (args.matmul or args.accuracy or args.gpt):
    args.accuracy = True  # a measurement any machine can make
  result = {"device": str(jax.devices()[0].device_kind)}
  if args.matmul:
    sizes = [int(s) for s in args.sizes.split(",")]
    result["rounds"] = args.rounds
    result["matmul"] = time_matmuls(
      sizes, args.recipes, args.rounds, args.warmup
    )
    print(matmul_table({"fp8-matmul": result}))
  if args.accuracy:
    result["accuracy"] = digits_accuracy(args)
  if args.gpt:
    result["gpt"] = gpt_loss(args)
  if args.accuracy or args.gpt:
    print(accuracy_table({"fp8": result}))
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
  return result


if __name__ == "__main__":
  main()
