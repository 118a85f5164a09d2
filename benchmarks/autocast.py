"""Per-operation autocast against per-module linen.wrap on the GPT example.

Two measurements, side by side in one process:
- quality: `examples/gpt.py` trained twice on the same batches, once with
  `linen.wrap` and once with `--autocast`; the final validation losses;
- cost: the example's loss and gradient (`jax.jit(jax.value_and_grad)`),
  its trace (`lower`: the median of traces from `--depths` stack depths,
  `timing.seconds_by_depth`) and `compile` times and its step time, both
  ways, the step timed in alternating rounds (the median).

  python benchmarks/autocast.py --steps 400
  python benchmarks/autocast.py --steps 6 --layers 1 --d-model 32   # smoke
"""

import argparse
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(
  0, str(pathlib.Path(__file__).resolve().parents[1] / "examples")
)

import gpt
import jax
import jax.numpy as jnp
import md
import timing
from gpt_model import GPT, cross_entropy

import jmp_train

GOAL = 0.01  # |val loss (autocast) - val loss (linen.wrap)|


def _steps(args):
  """A function making each mode's loss-and-gradient function anew (so that
  no trace cache answers), and their arguments."""
  model = GPT(args.layers, args.d_model, args.heads, args.seq_len)
  tokens = jnp.zeros((args.batch_size, args.seq_len + 1), jnp.int32)
  params = model.init(jax.random.key(0), tokens[:1, :-1])["params"]
  wrapped = jmp_train.linen.wrap(model, args.preset_policy)
  modes = {
    "linen.wrap": wrapped.apply,
    "autocast": jmp_train.autocast(model.apply, args.preset_policy),
  }

  def grad_fn(apply):
    def loss(params, batch):
      return cross_entropy(
        apply({"params": params}, batch[:, :-1]), batch[:, 1:]
      )

    return jax.value_and_grad(loss)

  return lambda: {k: grad_fn(v) for k, v in modes.items()}, (params, tokens)


def cost(args) -> dict:
  make_fns, fn_args = _steps(args)
  names = list(make_fns())
  # One trace and compile each first, not counted: the first in a process
  # also pay for JAX's, Flax's and XLA's own warm-up. Then the traces from
  # `--depths` stack depths (`timing.seconds_by_depth`), and one compile each.
  for fn in make_fns().values():
    jax.jit(fn).lower(*fn_args).compile()
  traces = timing.seconds_by_depth(
    names, lambda name: jax.jit(make_fns()[name]).lower(*fn_args), args.depths
  )
  out, compiled = {}, {}
  for name, fn in make_fns().items():
    lowered = jax.jit(fn).lower(*fn_args)
    start = time.perf_counter()
    compiled[name] = lowered.compile()
    out[name] = {
      "trace_s": statistics.median(traces[name]),
      "trace_range_s": [min(traces[name]), max(traces[name])],
      "compile_s": time.perf_counter() - start,
    }
    jax.block_until_ready(compiled[name](*fn_args))
  times = {name: [] for name in names}
  for _ in range(args.rounds):
    for name, step in compiled.items():
      start = time.perf_counter()
      for _ in range(args.calls):
        result = step(*fn_args)
      jax.block_until_ready(result)
      times[name].append((time.perf_counter() - start) / args.calls)
  for name in names:
    out[name]["step_ms"] = 1e3 * statistics.median(times[name])
  return out


def quality(args, example_args) -> dict:
  runs = {}
  with tempfile.TemporaryDirectory() as tmp:
    for name, flags in (("linen.wrap", []), ("autocast", ["--autocast"])):
      (run,) = gpt.main(
        ["--preset", args.preset, "--out", tmp, *flags, *example_args]
      )
      runs[name] = {k: v for k, v in run.items() if k != "history"}
  return runs


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--preset", default="bf16-mixed")
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--calls", type=int, default=10)
  p.add_argument(
    "--depths",
    type=timing.depths_arg,
    default=timing.DEPTHS,
    help=f"stack depths to trace from, 1 to {timing.DEPTHS}",
  )
  p.add_argument("--json", default=None)
  args, example_args = p.parse_known_args(argv)
  config = gpt.parse_args(example_args)
  for k in ("layers", "d_model", "heads", "seq_len", "batch_size"):
    setattr(args, k, getattr(config, k))
  args.preset_policy = jmp_train.get_preset(args.preset).policy
  result = {
    "preset": args.preset,
    "config": {k: getattr(config, k) for k in ("layers", "d_model", "heads")}
    | {"seq_len": config.seq_len, "batch_size": config.batch_size},
    "cost": cost(args),
    "runs": quality(args, example_args),
  }
  print(table({"autocast": result}))
  if args.json:
    md.write_json(args.json, result)
  return result


def table(results: dict) -> str:
  """Validation losses, trace, compile and step times of the two modes."""
  if not results:
    return md.not_measured("benchmarks/autocast.py")
  (result,) = results.values()
  runs, cost_ = result["runs"], result["cost"]
  base = cost_["linen.wrap"]
  rows = []
  for name in ("linen.wrap", "autocast"):
    c = cost_[name]
    rows.append(
      [
        name,
        f"{runs[name]['final_val_loss']:.4f}",
        f"{c['trace_s']:.2f} ({md.ratio(c['trace_s'] / base['trace_s'])})",
        f"{c['compile_s']:.2f} ({md.ratio(c['compile_s'] / base['compile_s'])})",
        f"{c['step_ms']:.1f} ({md.ratio(c['step_ms'] / base['step_ms'])})",
      ]
    )
  gap = (
    runs["autocast"]["final_val_loss"] - runs["linen.wrap"]["final_val_loss"]
  )
  cfg, steps = result["config"], runs["autocast"]["steps"]
  header = ["mode", "final val loss", "trace s", "compile s", "step ms"]
  return "\n".join(
    [
      f"`python benchmarks/autocast.py --steps {steps}`: the GPT example"
      f" ({cfg['layers']} layers, d_model {cfg['d_model']}, batch"
      f" {cfg['batch_size']} x {cfg['seq_len']}), preset {result['preset']};"
      " times of `jax.jit(jax.value_and_grad(loss))`, ratios to linen.wrap.",
      "",
      md.table(header, rows),
      "",
      f"Validation loss, autocast minus linen.wrap after {steps} steps:"
      f" {gap:+.4f}; goal within {GOAL}: {md.verdict(abs(gap) <= GOAL)}.",
    ]
  )


if __name__ == "__main__":
  main()
