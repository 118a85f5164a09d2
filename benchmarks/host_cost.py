"""The fixed cost per step: overhead.py's steps where compute costs nothing.

overhead.py times its steps on a 10.5M-param MLP, where the cost that does
not grow with the model (the host's work per call, launches, small kernels)
hides behind the matmuls. Here the same steps (plain, skip-only, ours,
jmp-style; `overhead.make_steps`) run on the same kind of tree with every
width 8 and a batch of 8, so what is left is that fixed cost:

  step      --steps-per-round steps dispatched back to back, then one wait,
            as a training loop that does not read its metrics every step
            runs (per step: the host's time per call, or the device's when
            it is the slower)
  call      the same params and optimizer state passed through an empty
            jitted function that donates them (`lambda p, s: (p, s)`): no
            kernel runs, so this is the host's handling of the call's
            arguments and results alone (flattening the trees, checking and
            passing each array, rebuilding the results); then the same
            call on plain's state with one part of ours's added (its loss
            scale, its five counters, its masters tree, and that tree with
            the placeholder it had until 2026-11-26), to price each part

Steps and calls are timed in rotations of their own (a call timed right
after a step that did work took longer than beside other calls); within
each, every row side by side in one process, in rotated order, median of
--rounds rounds. --layers sets the tree: 4 layers (8 params, the MLP of
overhead.py) by default; 74 layers give 148 params, GPT-2 small's count.

  python benchmarks/host_cost.py
  python benchmarks/host_cost.py --layers 74
"""

import argparse
import json
import platform

import jax
import jax.numpy as jnp
import md
import numpy as np
import optax
import overhead
import timing

WIDTH = 8  # every layer's width, and the batch: compute that costs nothing


def parse_args(argv=None):
  p = argparse.ArgumentParser()
  count = timing.count_arg
  p.add_argument(
    "--layers", type=count, default=4, help="MLP layers (2 params each)"
  )
  p.add_argument("--update-only", action="store_true")
  p.add_argument("--steps-per-round", type=count, default=100)
  p.add_argument("--rounds", type=count, default=15)
  p.add_argument("--warmup", type=int, default=5)
  p.add_argument("--json", default=None, help="also write results here")
  return p.parse_args(argv)


def _passthrough(params, state, x, y):
  del x, y
  return params, state


def main(argv=None):
  args = parse_args(argv)
  dims = [WIDTH] * args.layers + [2]
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((WIDTH, dims[0])), jnp.float32)
  y = jnp.asarray(rng.integers(0, dims[-1], WIDTH))
  steps = overhead.make_steps(args.update_only)
  plain_init, ours_init = steps["plain"][0], steps["ours"][0]

  def with_part(part):
    """plain's state and one part of ours's (to price each part alone)."""

    def init(params):
      return plain_init(params), part(ours_init(params))

    return init

  # The empty calls: on each step's params and state, then on plain's state
  # with one part of ours's added.
  calls = {name: init for name, (init, _) in steps.items()}
  calls["plain + loss scale"] = with_part(lambda s: s.loss_scaler)
  calls["plain + counters"] = with_part(
    lambda s: (
      s.steps,
      s.skipped_steps,
      s.last_step_finite,
      s.grad_norm,
      s.skip_streak,
    )
  )
  calls["plain + masters"] = with_part(lambda s: s.master_params)
  # The placeholder a param that keeps no master had until 2026-11-26.
  calls["plain + MaskedNode masters"] = with_part(
    lambda s: jax.tree.map(
      lambda m: optax.MaskedNode() if m is None else m,
      s.master_params,
      is_leaf=lambda m: m is None,
    )
  )

  def timed(runs: dict, inits: dict) -> dict:
    """Seconds per call of each of `runs`, side by side, warmed up first."""
    state = {}
    for name, run in runs.items():
      params = overhead.init_mlp(dims, jax.random.key(0))
      state[name] = (params, inits[name](params))
      for _ in range(args.warmup):
        state[name] = run(*state[name], x, y)
      jax.block_until_ready(state[name])

    def one_round(name):
      for _ in range(args.steps_per_round):
        state[name] = runs[name](*state[name], x, y)
      jax.block_until_ready(state[name])

    seconds = timing.seconds_per_step(
      runs, one_round, args.rounds, args.steps_per_round
    )
    return {name: round(t * 1e6, 2) for name, t in seconds.items()}

  # Steps and calls in rotations of their own: a call timed right after a
  # step that did work took longer than the same call beside other calls.
  step_us = timed(
    {name: step for name, (_, step) in steps.items()},
    {name: init for name, (init, _) in steps.items()},
  )
  # A jitted function per tree, as each step is.
  call_us = timed(
    {name: jax.jit(_passthrough, donate_argnums=(0, 1)) for name in calls},
    calls,
  )
  shapes = jax.eval_shape(lambda: overhead.init_mlp(dims, jax.random.key(0)))
  leaves = {
    name: len(jax.tree.leaves(jax.eval_shape(init, shapes)))
    for name, init in calls.items()
  }
  result = {
    "what": "optimizer update only" if args.update_only else "full train step",
    "layers": args.layers,
    "param_leaves": len(jax.tree.leaves(shapes)),
    "state_leaves": leaves,
    "steps_per_round": args.steps_per_round,
    "rounds": args.rounds,
    "step_us": step_us,
    "call_us": call_us,
    "device": f"{jax.devices()[0].device_kind}, {platform.machine()}",
    "jax": jax.__version__,
    "optax": optax.__version__,
  }
  print(json.dumps(result, indent=1))
  print(table({"r": result}))
  if args.json:
    md.write_json(args.json, result)
  return result


def _us(value: float, base: float) -> str:
  return f"{value:.1f} ({value - base:+.1f})"


PARTS = (
  "plain + loss scale",
  "plain + counters",
  "plain + masters",
  "plain + MaskedNode masters",
)


def table(results: dict) -> str:
  """Per machine and tree: each step's time and its empty call's, in us,
  against plain's; then the empty call on plain's state with each part of
  ours's state added."""
  runs = sorted(
    (r for r in results.values() if "call_us" in r),
    key=lambda r: (r["device"], r["what"], r["layers"]),
  )
  if not runs:
    return md.not_measured("benchmarks/host_cost.py")
  rows = []
  for r in runs:
    step, call = r["step_us"], r["call_us"]
    for name in call:
      rows.append(
        [
          r["device"],
          f"{r['what']}, {r['param_leaves']} params",
          name,
          r["state_leaves"][name],
          _us(step[name], step["plain"]) if name in step else "",
          _us(call[name], call["plain"]),
        ]
      )
  header = [
    "machine",
    "what",
    "step",
    "state arrays",
    "us per step (vs plain)",
    "us per empty call (vs plain)",
  ]
  notes = []
  for r in runs:
    step, call = r["step_us"], r["call_us"]
    extra = step["ours"] - step["plain"]
    handling = call["ours"] - call["plain"]
    parts = ", ".join(
      f"{name.removeprefix('plain + ')} {call[name] - call['plain']:+.1f} us"
      for name in PARTS[:3]
    )
    old = call[PARTS[3]] - call["plain"]
    notes.append(
      f"{r['device']}, {r['what']}, {r['param_leaves']} params: ours costs"
      f" {extra:+.1f} us per step over plain"
      f" ({md.ratio(step['ours'] / step['plain'])}); the empty call on its"
      f" params and state {handling:+.1f} us over plain's"
      f" ({md.ratio(call['ours'] / call['plain'])}). Each part of ours's"
      f" state added alone to plain's: {parts} (with an optax.MaskedNode"
      f" per param, the placeholder until 2026-11-26: {old:+.1f} us)."
    )
  return "\n\n".join([md.table(header, rows), *notes])


if __name__ == "__main__":
  main()
