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
   and with each recipe, and with each of `--params-recipes` plus
   `--fp8-params` (row "RECIPE+params": the FP8 layers' kernels stored in
   FP8), for each of `--seeds` (the runs of one seed draw the same batches
   and initial params); the goal is on the mean over seeds of each row's
   difference. `--reuse JSON` keeps the runs a previous `--gpt` JSON
   recorded with the same settings and trains only the others. Arguments
   this script does not know go to the example.
4. `--gather`: what ZeRO-1 all-gathers with FP8 params. The GPT example's
   model and optimizer with bf16 params (preset bf16-true: float32 masters)
   and FP8 matmuls (current scaling, head excluded), stepped by
   `jmp_train.train.make_train_step` under a ZeRO-1 plan on 8 (virtual CPU)
   devices, with `fp8_params` off and on. Each step is lowered and its
   all-gathers counted in the lowered module (StableHLO: the CPU compiler
   widens bf16 collectives to f32 after lowering, so the compiled module
   would double the bf16 bytes), split into the FP8 layers' kernels and the
   other params; the params' bytes per device come from
   `jmp_train.memory.memory_table`. The example's size flags apply.

  python benchmarks/fp8.py --matmul --sizes 4096,8192,16384   # on a GPU
  python benchmarks/fp8.py --accuracy                          # CPU is fine
  python benchmarks/fp8.py --gpt --steps 400 --seeds 0,1,2     # CPU is fine
  python benchmarks/fp8.py --gather                            # CPU is fine
"""

import argparse
import collections
import functools
import json
import pathlib
import re
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
import gpt_model
import jax
import jax.numpy as jnp
import md
import numpy as np
import optax
import timing
from jax.sharding import AxisType

import jmp_train
from jmp_train import fp8, memory, train, zero1

RECIPES = ("delayed", "current", "current-pow2", "blockwise")
# Recipes FP8 params take: one power-of-two scale per kernel, not per block.
PARAMS_RECIPES = ("delayed", "current", "current-pow2")
GPT_PRESET = "bf16-mixed"
# --gather: bf16 params with float32 masters, so what ZeRO-1 gathers of an
# FP8 layer's kernel is bf16 without FP8 params and FP8 with them.
GATHER_PRESET = "bf16-true"
GATHER_RECIPE = "current"
GATHER_DEVICES = 8
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
  p.add_argument("--gather", action="store_true")
  p.add_argument("--recipes", default=",".join(RECIPES))
  p.add_argument(
    "--params-recipes",
    default="current",
    help="GPT rows trained with --fp8-params too (comma-separated; '' none)",
  )
  p.add_argument(
    "--reuse",
    default=None,
    help="a --gpt JSON: keep its runs made with the same settings",
  )
  p.add_argument("--sizes", default="4096,8192,16384", help="matmul n")
  p.add_argument("--rounds", type=int, default=20)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--epochs", type=int, default=30, help="digits epochs")
  p.add_argument("--seeds", default="0", help="GPT seeds, comma-separated")
  p.add_argument("--models", default="mlp,cnn", help="digits models")
  p.add_argument("--presets", default="bf16-mixed,fp16-mixed", help="digits")
  p.add_argument("--json", default=None, help="also write results here")
  args, example_args = p.parse_known_args(argv)
  if example_args and not (args.gpt or args.gather):
    p.error(f"unrecognized arguments: {' '.join(example_args)}")
  if "--seed" in example_args:
    p.error("--seed: give the GPT's seeds as --seeds (e.g. --seeds 0,1,2)")
  args.example_args = example_args
  args.recipes = [name for name in args.recipes.split(",") if name]
  args.params_recipes = [n for n in args.params_recipes.split(",") if n]
  args.seeds = [int(s) for s in args.seeds.split(",")]
  for name in args.recipes:
    if name not in RECIPES:
      p.error(f"--recipes: unknown recipe {name!r}; known: {RECIPES}")
  for name in args.params_recipes:
    if name not in PARAMS_RECIPES:
      p.error(
        f"--params-recipes: {name!r} is not a recipe FP8 params take"
        f" (one power-of-two scale per kernel); known: {PARAMS_RECIPES}"
      )
  if args.reuse and not args.gpt:
    p.error(f"--reuse {args.reuse}: it keeps --gpt runs; give --gpt too")
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


def time_matmuls(sizes, recipes, rounds, warmup, done=lambda rows: None):
  """A row per size, in order; `done(rows)` after each size, so that a run
  stopped by a time limit can keep the sizes it finished."""
  rows = []
  for n in sizes:
    steps = dense_steps(n, recipes)
    for name, (step, args) in steps.items():
      print(f"n={n} {name}: warming up", flush=True)
      start = time.perf_counter()
      for _ in range(warmup):
        jax.block_until_ready(step(*args))
      # What a run cut short by a timeout got to (the H200's of 2026-11-27
      # printed nothing in 150 s): the compile (and on a GPU autotuning) is
      # in the first warm-up.
      print(
        f"n={n} {name}: warm in {time.perf_counter() - start:.1f} s", flush=True
      )
    names = list(steps)
    times = {name: [] for name in names}
    for i in range(rounds):
      for name in timing.rotated(names, i):
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
    done(rows)
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
  missing = [n for n in m.get("sizes", []) if n not in {x["n"] for x in rows}]
  speedups = {name: big["speedup_over_bf16"][name] for name in recipes}
  if missing:  # a run stopped by a time limit: no verdict on part of it
    measured = "; ".join(f"{k} {x:.2f}x" for k, x in speedups.items())
    goal = (
      f"not judged, the run stopped before n = {', '.join(map(str, missing))}"
      f" (at n = {big['n']}: {measured}); its JSON replaced the last whole"
      " run's."
    )
  else:
    verdicts = "; ".join(
      f"{k} {x:.2f}x {md.verdict(x >= GOAL_SPEEDUP)}"
      for k, x in speedups.items()
    )
    goal = (
      f"FP8 >= {GOAL_SPEEDUP}x bf16 at the largest size, n = {big['n']}:"
      f" {verdicts}."
    )
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
      f"Goal (issue 4): {goal}",
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


def gpt_rows(args) -> dict[str, list[str]]:
  """The GPT runs of one seed: row name -> the example's FP8 flags."""
  rows = {name: ["--fp8", name] for name in ("off", *args.recipes)}
  for name in args.params_recipes:
    rows[f"{name}+params"] = ["--fp8", name, "--fp8-params"]
  return rows


def gpt_loss(args):
  # What every run shares (each run's FP8 flags and --seed are in its row);
  # the example's --preset, if given, overrides GPT_PRESET.
  example = vars(gpt.parse_args(["--preset", GPT_PRESET, *args.example_args]))
  per_run = ("fp8", "fp8_params", "seed", "out", "presets")
  config = {k: v for k, v in example.items() if k not in per_run}
  preset = config["preset"]
  earlier = {}
  if args.reuse:
    g = json.loads(pathlib.Path(args.reuse).read_text())["gpt"]
    if (g["preset"], g["config"]) != (preset, config):
      raise SystemExit(
        f"--reuse {args.reuse}: its runs were made with preset "
        f"{g['preset']!r} and {g['config']}, these would be made with "
        f"{preset!r} and {config}; reuse only runs of the same settings."
      )
    earlier = {(x["fp8"], x["seed"]): x for x in g["runs"]}
  runs, reused = [], []
  with tempfile.TemporaryDirectory() as out:
    for seed in args.seeds:
      for name, flags in gpt_rows(args).items():
        if (name, seed) in earlier:
          runs.append(earlier[name, seed])
          reused.append([name, seed])
          continue
        (run,) = gpt.main(
          [
            *("--preset", GPT_PRESET, *flags, "--seed", str(seed)),
            *("--out", f"{out}/{name}", *args.example_args),
          ]
        )
        keep = ("final_val_loss", "skipped_steps", "seconds")
        runs.append({"fp8": name, "seed": seed, **{k: run[k] for k in keep}})
  result = {"preset": preset, "config": config, "runs": runs}
  if reused:
    result["reused"] = reused
  return result


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
  params_rows = [name for name in names if name.endswith("+params")]
  params = (
    f" Rows `RECIPE+params` ({', '.join(params_rows)}) add `--fp8-params`:"
    " the FP8 layers' kernels stored in FP8, with float32 masters."
    if params_rows
    else ""
  )
  reused = ""
  if g.get("reused"):
    kept = ", ".join(dict.fromkeys(name for name, _ in g["reused"]))
    reused = (
      f"\n\n{len(g['reused'])} of these {len(g['runs'])} runs ({kept}) were"
      " recorded by an earlier run of this job with the same settings and"
      " kept (`--reuse`); the others were trained for this table."
    )
  text = "\n".join(
    [
      f"`python examples/gpt.py --preset {g['preset']} --fp8 RECIPE --seed"
      f" SEED --steps {cfg['steps']}`: {cfg['layers']} layers, d_model"
      f" {cfg['d_model']}, {cfg['steps']} steps of {cfg['batch_size']} x"
      f" {cfg['seq_len']} characters; the runs of one seed share their"
      " batches and initial params. Final validation loss (and its"
      f" difference to {g['preset']}'s without FP8, same seed); goal: the"
      f" mean difference within {GOAL_LOSS}.{params}",
      "",
      md.table(header, table),
      "",
      f"Largest difference of one run: {diff[worst]:+.4f} ({worst[0]}, seed"
      f" {worst[1]}).{reused}",
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


# 4. ZeRO-1's all-gathers with FP8 params.

# A lowered all-gather: `"stablehlo.all_gather"(%x) <{all_gather_dim = 0,
# ..., replica_groups = dense<...> : tensor<1x8xi64>, ...}> :
# (tensor<8x64xui8>) -> tensor<64x64xui8>`.
_ALL_GATHER = re.compile(
  r'"stablehlo\.all_gather".*?replica_groups = dense<.*?> :'
  r" tensor<\d+x(?P<group>\d+)xi64>.*?\}> :"
  r" \((?P<operand>tensor<[^>]*>)\) -> (?P<result>tensor<[^>]*>)"
)
_ELEMENT_BYTES = {
  **dict.fromkeys(("i1", "i8", "ui8", "f8E4M3FN", "f8E5M2"), 1),
  **dict.fromkeys(("i16", "ui16", "bf16", "f16"), 2),
  **dict.fromkeys(("i32", "ui32", "f32"), 4),
  **dict.fromkeys(("i64", "ui64", "f64"), 8),
}


def _tensor(text: str) -> tuple[tuple[int, ...], str]:
  """`tensor<8x64xui8>` -> ((8, 64), "ui8")."""
  *dims, element = text.removeprefix("tensor<").removesuffix(">").split("x")
  return tuple(int(d) for d in dims), element


def lowered_all_gathers(text: str) -> list[dict]:
  """The all-gathers of a lowered module's text (`lowered.as_text()`).

  Each with its operand's shape, its result's shape and element type, and
  the bytes each device sends in a ring, S (g - 1) / g for a result of S
  bytes over g devices (as `jmp_train.memory.collective_stats` counts them
  in compiled HLO).
  """
  found = []
  for m in _ALL_GATHER.finditer(text):
    operand, _ = _tensor(m["operand"])
    result, element = _tensor(m["result"])
    g = int(m["group"])
    size = _ELEMENT_BYTES[element] * int(np.prod(result, dtype=np.int64))
    found.append(
      {
        "operand": operand,
        "result": result,
        "element": element,
        "bytes": size * (g - 1) / g,
      }
    )
  return found


def gather_case(cfg, fp8_params: bool, compiled: bool = True) -> dict:
  """The GPT example's model and optimizer under ZeRO-1, its step lowered.

  `cfg` is the example's parsed arguments (the model's size, the batch).
  Returns the lowered module's all-gathers, the compiled module's all-gather
  bytes (None unless `compiled`), `memory.memory_table` of the state, and
  the FP8 params' sizes by path. Nothing is allocated: shapes only.
  """
  preset = jmp_train.get_preset(GATHER_PRESET)
  model = jmp_train.linen.wrap(
    gpt_model.GPT(cfg.layers, cfg.d_model, cfg.heads, cfg.seq_len),
    preset.policy,
    fp8=gpt.FP8_RECIPES[GATHER_RECIPE],
    fp8_exclude=("head",),
    fp8_params=fp8_params,
  )
  variables = jax.eval_shape(
    model.init, jax.random.key(0), jnp.zeros((1, cfg.seq_len), jnp.int32)
  )
  # The example's optimizer; its learning-rate schedule moves no bytes.
  tx = preset.mixed_precision(
    optax.chain(
      optax.clip_by_global_norm(1.0),
      optax.adamw(cfg.lr, b2=0.95, weight_decay=0.1),
    )
  )
  mesh = jax.make_mesh(
    (GATHER_DEVICES,),
    ("data",),
    axis_types=(AxisType.Auto,),
    devices=jax.devices()[:GATHER_DEVICES],
  )
  plan = zero1.make_plan(tx, variables["params"], mesh)
  state = jax.eval_shape(
    lambda v: train.TrainState.create(
      params=v["params"], tx=tx, fp8=v["fp8_meta"]
    ),
    variables,
  )

  def loss_fn(params, batch, model_state, key):
    logits = model.apply({"params": params, **model_state}, batch[:, :-1])
    return gpt_model.cross_entropy(logits, batch[:, 1:])

  step = train.make_train_step(loss_fn, tx, plan=plan)
  batch = jax.ShapeDtypeStruct(
    (cfg.batch_size, cfg.seq_len + 1), jnp.int32, sharding=plan.batch_sharding
  )
  lowered = step.lower(zero1.abstract(plan, state), batch)
  compiled_bytes = None
  if compiled:
    found = memory.collective_stats(lowered.compile().as_text(), GATHER_DEVICES)
    compiled_bytes = memory.summarize_collectives(found)["all-gather"]["bytes"]
  sizes = {
    jax.tree_util.keystr(path, simple=True, separator="/"): (
      fp8.is_fp8_param(x),
      int(np.prod(x.shape)),
    )
    for path, x in jax.tree_util.tree_leaves_with_path(
      variables["params"], is_leaf=fp8.is_fp8_param
    )
  }
  return {
    "all_gathers": lowered_all_gathers(lowered.as_text()),
    "compiled_all_gather_bytes": compiled_bytes,
    "memory": memory.memory_table(plan, state),
    "n_params": sum(n for _, n in sizes.values()),
    "fp8_params": {path: n for path, (is_fp8, n) in sizes.items() if is_fp8},
  }


def gather_bytes(cfg, compiled: bool = True) -> dict:
  """All-gather bytes and params bytes per device, bf16 vs FP8 kernels, for
  the example's arguments `cfg` (`gpt.parse_args`)."""
  if jax.device_count() < GATHER_DEVICES:
    raise SystemExit(
      f"--gather needs {GATHER_DEVICES} devices, JAX has {jax.device_count()}"
      " (run the script itself: it asks JAX for virtual CPU devices)."
    )
  bf16 = gather_case(cfg, False, compiled)
  fp8_case = gather_case(cfg, True, compiled)
  # The FP8 kernels are the FP8 case's uint8 all-gathers. The same leaves
  # are gathered in bf16 without FP8 params, with the same shapes: match
  # those by shape (a bf16 leaf of a kernel's shape sends as many bytes).
  kernels = collections.Counter(
    (x["operand"], x["result"])
    for x in fp8_case["all_gathers"]
    if x["element"] == "ui8"
  )
  rows = []
  for case, fp8_params in ((bf16, False), (fp8_case, True)):
    left = collections.Counter(kernels)
    split = {"kernel": [], "other": []}
    for x in case["all_gathers"]:
      key = (x["operand"], x["result"])
      if left[key]:
        left[key] -= 1
        split["kernel"].append(x)
      else:
        split["other"].append(x)
    if left.total():
      raise RuntimeError(f"kernel all-gathers not found: {dict(left)}")
    rows.append(
      {
        "fp8_params": fp8_params,
        **{
          f"{part}_{what}": value
          for part, ops in split.items()
          for what, value in (
            ("ops", len(ops)),
            ("bytes", sum(x["bytes"] for x in ops)),
            ("elements", sorted({x["element"] for x in ops})),
          )
        },
        "compiled_bytes": case["compiled_all_gather_bytes"],
        "memory": case["memory"],
      }
    )
  return {
    "model": (
      f"{cfg.layers}x{cfg.d_model}, {cfg.heads} heads, context"
      f" {cfg.seq_len}, batch {cfg.batch_size}"
    ),
    "preset": GATHER_PRESET,
    "recipe": GATHER_RECIPE,
    "devices": GATHER_DEVICES,
    "n_params": bf16["n_params"],
    "fp8_params": fp8_case["fp8_params"],
    "rows": rows,
  }


def gather_table(results: dict) -> str:
  """All-gather and params bytes per device, bf16 vs FP8 kernels."""
  r = next((r["gather"] for r in results.values() if "gather" in r), None)
  if r is None:
    return md.not_measured("benchmarks/fp8.py --gather")
  bf16, ours = r["rows"]
  table = []
  for row in r["rows"]:
    mem, compiled = row["memory"], row["compiled_bytes"]
    table.append(
      [
        "FP8 (`fp8_params=True`)" if row["fp8_params"] else "bf16",
        f"{row['kernel_ops']} ({', '.join(row['kernel_elements'])})",
        f"{row['kernel_bytes']:,.0f}",
        f"{row['other_ops']} ({', '.join(row['other_elements'])})",
        f"{row['other_bytes']:,.0f}",
        f"{row['kernel_bytes'] + row['other_bytes']:,.0f}",
        "not compiled" if compiled is None else f"{compiled:,.0f}",
        f"{mem['params']:,}",
        f"{mem['total']:,}",
      ]
    )
  header = ["FP8 layers' kernels stored in", "their all-gathers", "bytes"]
  header += ["other all-gathers", "bytes", "all-gather bytes"]
  header += ["compiled (CPU)", "params B/device", "state B/device"]
  kernels = ours["kernel_bytes"] / bf16["kernel_bytes"]
  total = (ours["kernel_bytes"] + ours["other_bytes"]) / (
    bf16["kernel_bytes"] + bf16["other_bytes"]
  )
  params = ours["memory"]["params"] / bf16["memory"]["params"]
  in_kernels = sum(r["fp8_params"].values())
  return "\n".join(
    [
      f"The GPT of `examples/gpt.py` ({r['model']}; {r['n_params']:,}"
      f" params, {in_kernels:,} of them in the kernels of its"
      f" {len(r['fp8_params'])} FP8 layers), preset {r['preset']} (bfloat16"
      f" params, float32 masters), `--fp8 {r['recipe']}`, ZeRO-1 over"
      f" {r['devices']} virtual CPU devices. Bytes each device sends per step"
      " in the all-gathers of the lowered step (ring: S(g-1)/g of a result"
      " of S bytes); `compiled (CPU)`: the same count in the compiled step,"
      " where the CPU compiler has widened bf16 to f32. Params and"
      " whole-state bytes per device from `jmp_train.memory.memory_table`.",
      "",
      md.table(header, table),
      "",
      f"FP8 layers' kernels, FP8 params / bf16 params: **{md.ratio(kernels)}**"
      f" the all-gather bytes (goal: at most half,"
      f" {md.verdict(kernels <= 0.5)}); all params' all-gather bytes"
      f" {md.ratio(total)}; params bytes per device {md.ratio(params)}.",
    ]
  )


def main(argv=None):
  args = parse_args(argv)
  if not (args.matmul or args.accuracy or args.gpt or args.gather):
    args.accuracy = True  # a measurement any machine can make
  result = {"device": str(jax.devices()[0].device_kind)}
  if args.matmul:
    sizes = [int(s) for s in args.sizes.split(",")]
    result["rounds"] = args.rounds
    result["sizes"] = sizes

    def done(rows):  # written per size: the H200's job of 2026-11-27 ran
      result["matmul"] = rows  # past its 150 s limit and left nothing
      if args.json:
        md.write_json(args.json, result)

    time_matmuls(sizes, args.recipes, args.rounds, args.warmup, done)
    print(matmul_table({"fp8-matmul": result}))
  if args.accuracy:
    result["accuracy"] = digits_accuracy(args)
  if args.gpt:
    result["gpt"] = gpt_loss(args)
  if args.accuracy or args.gpt:
    print(accuracy_table({"fp8": result}))
  if args.gather:
    result["gather"] = gather_bytes(gpt.parse_args(args.example_args))
    print(gather_table({"fp8-gather": result}))
  if args.json:
    md.write_json(args.json, result)
  return result


if __name__ == "__main__":
  if parse_args().gather:
    # ZeRO-1's mesh: virtual CPU devices, made when JAX's backend starts.
    jax.config.update("jax_num_cpu_devices", GATHER_DEVICES)
  main()
