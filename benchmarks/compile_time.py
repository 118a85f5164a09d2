"""Compile time of a train step with and without jmp_train's wrappers.

The same GPT (examples/gpt.py's model) and AdamW, four steps:

- plain:       the unwrapped model, `jax.grad`, `optax.adamw`.
- wrapped-fp32: `linen.wrap(model, "fp32")` + `mixed_precision(adamw)`: the
  wrappers' own cost, with no dtype change.
- bf16-mixed:  the bf16-mixed preset (casts everywhere, float32 norms).
- fp16-mixed:  the fp16-mixed preset (casts plus dynamic loss scaling).

Each is traced, lowered and compiled from a fresh function (no cache hit),
`--rounds` times in rotated order; the figure is the median. Tracing and
lowering (Python) and XLA compilation are reported separately.

  python benchmarks/compile_time.py [--layers 4 --d-model 256] [--json out.json]
"""

import argparse
import json
import pathlib
import platform
import runpy
import statistics
import time

import jax
import jax.numpy as jnp
import optax

import jmp_train

ROOT = pathlib.Path(__file__).resolve().parents[1]


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--d-model", type=int, default=256)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--seq", type=int, default=128)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--json", default=None)
  return p.parse_args(argv)


def make_step(model, tx, scaled):
  """A fresh jitted train step (new function object: no trace cache hit)."""

  def step(params, opt_state, tokens):
    scale = jmp_train.current_loss_scale(opt_state) if scaled else 1.0

    def loss_fn(p):
      logits = model.apply({"params": p}, tokens[:, :-1]).astype(jnp.float32)
      loss = optax.softmax_cross_entropy_with_integer_labels(
        logits, tokens[:, 1:]
      ).mean()
      return loss * scale

    grads = jax.grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return jax.jit(step, donate_argnums=(0, 1))


def variants(gpt_cls, args):
  base = gpt_cls(args.layers, args.d_model, args.heads, args.seq)
  adamw = optax.adamw(1e-3)
  out = {"plain": (base, adamw)}
  for name, preset in (
    ("wrapped-fp32", "fp32"),
    ("bf16-mixed", "bf16-mixed"),
    ("fp16-mixed", "fp16-mixed"),
  ):
    preset = jmp_train.get_preset(preset)
    out[name] = (
      jmp_train.linen.wrap(base, preset.policy),
      preset.mixed_precision(optax.adamw(1e-3)),
    )
  return out


def main(argv=None):
  args = parse_args(argv)
  gpt = runpy.run_path(str(ROOT / "examples" / "gpt.py"), run_name="bench")
  tokens = jnp.zeros((args.batch, args.seq + 1), jnp.int32)
  shapes = {}
  for name, (model, tx) in variants(gpt["GPT"], args).items():
    params = jax.eval_shape(
      lambda m=model: m.init(jax.random.key(0), tokens[:, :-1])["params"]
    )
    state = jax.eval_shape(tx.init, params)
    shapes[name] = (model, tx, params, state)

  trace, compile_ = {n: [] for n in shapes}, {n: [] for n in shapes}
  names = list(shapes)
  for r in range(args.rounds):
    order = names[r % len(names) :] + names[: r % len(names)]
    for name in order:
      model, tx, params, state = shapes[name]
      t0 = time.perf_counter()
      lowered = make_step(model, tx, name != "plain").lower(
        params, state, tokens
      )
      t1 = time.perf_counter()
      lowered.compile()
      t2 = time.perf_counter()
      trace[name].append(t1 - t0)
      compile_[name].append(t2 - t1)

  med = lambda xs: statistics.median(xs)  # noqa: E731
  rows = []
  base_total = med(trace["plain"]) + med(compile_["plain"])
  for name in names:
    total = med(trace[name]) + med(compile_[name])
    rows.append(
      {
        "step": name,
        "trace_lower_s": round(med(trace[name]), 4),
        "compile_s": round(med(compile_[name]), 4),
        "total_s": round(total, 4),
        "ratio_vs_plain": round(total / base_total, 4),
      }
    )
  n_params = sum(x.size for x in jax.tree.leaves(shapes["plain"][2]))
  result = {
    "model": f"GPT {args.layers}x{args.d_model}, seq {args.seq}, "
    f"{n_params / 1e6:.2f}M params",
    "rounds": args.rounds,
    "rows": rows,
    "device": f"{jax.devices()[0].device_kind}, {platform.machine()}",
    "jax": jax.__version__,
  }
  print(f"{result['model']}, median of {args.rounds} on {result['device']}")
  print("| step | trace+lower s | compile s | total s | ratio vs plain |")
  print("|---|---|---|---|---|")
  for r in rows:
    print(
      f"| {r['step']} | {r['trace_lower_s']:.3f} | {r['compile_s']:.3f} | "
      f"{r['total_s']:.3f} | {r['ratio_vs_plain']:.3f}x |"
    )
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
  return result


if __name__ == "__main__":
  main()
