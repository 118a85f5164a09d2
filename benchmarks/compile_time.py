"""Compile time of a train step with and without jmp_train's wrappers.

The same GPT (examples/gpt_model.py) and AdamW. Each jmp_train step has a
hand-written twin with the same numerics, written the way jmp's README and
`optax.apply_if_finite` users write it (cast the params, scale the loss,
unscale, `all_finite`, and `lax.cond` around the update):

- plain:          the unwrapped float32 model, `jax.grad`, `optax.adamw`
  (no skipping: the floor).
- hand-fp32:      plain, with the update skipped on non-finite gradients.
- ours-fp32:      `linen.wrap(model, "f32")` + `mixed_precision(adamw)`.
- hand-bf16:      params cast to bfloat16 in the loss, skipping as above.
- ours-bf16:      the bf16-mixed preset (float32 norms).
- hand-fp16:      params cast to float16, dynamic loss scaling by hand.
- ours-fp16:      the fp16-mixed preset.

Each is traced and lowered from a fresh function (no cache hit) from
`--depths` Python stack depths spread over one of CPython's frame-stack
chunks (`timing.seconds_by_depth`: from a single depth, trace time swings by
tens of percent with where the chunk boundaries fall), and compiled `--rounds`
times in rotated order; the figures are the medians, tracing and lowering
(Python) and XLA compilation reported separately.

  python benchmarks/compile_time.py [--layers 4 --d-model 256] [--json out.json]
"""

import argparse
import pathlib
import platform
import statistics
import sys
import time

# The shared GPT model lives with the examples.
sys.path.insert(
  0, str(pathlib.Path(__file__).resolve().parents[1] / "examples")
)

import gpt_model
import jax
import jax.numpy as jnp
import md
import optax
import timing

import jmp_train

# The steps, in the order `variants` builds them and the table shows them.
STEPS = (
  "plain",
  "hand-fp32",
  "ours-fp32",
  "hand-bf16",
  "ours-bf16",
  "hand-fp16",
  "ours-fp16",
)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--d-model", type=int, default=256)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--seq", type=int, default=128)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument(
    "--only", default=None, help="comma-separated steps (default: all seven)"
  )
  p.add_argument(
    "--depths",
    type=timing.depths_arg,
    default=timing.DEPTHS,
    help=f"stack depths to trace from, 1 to {timing.DEPTHS}"
    f" (default {timing.DEPTHS}: one per padding frame in a chunk)",
  )
  p.add_argument("--json", default=None)
  args = p.parse_args(argv)
  if args.only is not None:
    only = [name for name in args.only.split(",") if name]
    unknown = [name for name in only if name not in STEPS]
    if unknown or not only:
      p.error(
        f"--only {args.only!r}: {', '.join(unknown) or 'no step'}; the steps"
        f" are {', '.join(STEPS)}"
      )
  return args


def _loss(model, params, tokens):
  logits = model.apply({"params": params}, tokens[:, :-1]).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(
    logits, tokens[:, 1:]
  ).mean()


def make_step(model, tx, scaled):
  """A fresh jitted train step (new function object: no trace cache hit)."""

  def step(params, opt_state, tokens):
    scale = jmp_train.current_loss_scale(opt_state) if scaled else 1.0
    grads = jax.grad(lambda p: _loss(model, p, tokens) * scale)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return jax.jit(step, donate_argnums=(0, 1))


def make_hand_step(model, tx, dtype, skip=True):
  """The hand-written twin: cast, scale, unscale, all_finite, cond."""
  policy = jmp_train.Policy(jnp.float32, dtype, jnp.float32)

  def step(params, state, tokens):
    opt_state, scaler = state

    def loss_fn(p):
      return scaler.scale(_loss(model, policy.cast_to_compute(p), tokens))

    grads = scaler.unscale(jax.grad(loss_fn)(params))
    finite = jmp_train.all_finite(grads) if skip else True
    new_params, opt_state = (
      jax.lax.cond(
        finite,
        lambda: _apply(tx, grads, opt_state, params),
        lambda: (params, opt_state),
      )
      if skip
      else _apply(tx, grads, opt_state, params)
    )
    return new_params, (opt_state, scaler.adjust(finite) if skip else scaler)

  return jax.jit(step, donate_argnums=(0, 1))


def _apply(tx, grads, opt_state, params):
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


def variants(gpt_cls, args):
  """name -> (model, tx, make the step, initial loss scale or None)."""
  base = gpt_cls(args.layers, args.d_model, args.heads, args.seq)
  out = {
    "plain": (
      base,
      optax.adamw(1e-3),
      lambda m, t: make_hand_step(m, t, jnp.float32, skip=False),
      jmp_train.NoOpLossScale(),
    ),
  }
  for dtype, preset in (
    (jnp.float32, "fp32"),
    (jnp.bfloat16, "bf16-mixed"),
    (jnp.float16, "fp16-mixed"),
  ):
    preset = jmp_train.get_preset(preset)
    short = jnp.dtype(dtype).name.replace("float", "fp").replace("bfp", "bf")
    out[f"hand-{short}"] = (
      base,
      optax.adamw(1e-3),
      lambda m, t, d=dtype: make_hand_step(m, t, d),
      jmp_train.DynamicLossScale(jnp.float32(2**15))
      if dtype == jnp.float16
      else jmp_train.NoOpLossScale(),
    )
    out[f"ours-{short}"] = (
      jmp_train.linen.wrap(base, preset.policy),
      preset.mixed_precision(optax.adamw(1e-3)),
      lambda m, t: make_step(m, t, True),
      None,
    )
  return out


def table(results: dict) -> str:
  """The steps' trace and compile times, and the verdict against the
  hand-written twins."""
  if not results:
    return md.not_measured("benchmarks/compile_time.py")
  (c,) = results.values()
  rows = [
    [
      x["step"],
      f"{x['trace_lower_s']:.3f}",
      f"{x['compile_s']:.3f}",
      f"{x['total_s']:.3f}",
      md.ratio(x["ratio_vs_plain"]),
      f"**{md.ratio(x['ratio_vs_hand'])}**" if x["ratio_vs_hand"] else "",
    ]
    for x in c["rows"]
  ]
  worst = max(x["ratio_vs_hand"] or 0 for x in c["rows"])
  worst_plain = max(x["ratio_vs_plain"] for x in c["rows"])
  return "\n".join(
    [
      f"{c['model']}, AdamW, on {c['device'].split(',')[0]}; trace and"
      f" lower: the median over {c['depths']} stack depths; compile: the"
      f" median of {c['rounds']} rounds in rotated order.",
      "",
      md.table(
        [
          "step",
          "trace + lower s",
          "XLA compile s",
          "total s",
          "vs plain",
          "ours vs hand-written twin",
        ],
        rows,
      ),
      "",
      "Goal: at most 1.2x, read as the wrappers against the same training"
      f" written without them (the last column): worst {md.ratio(worst)},"
      f" {md.verdict(worst <= 1.2)}. Against `plain` the worst row is"
      f" {md.ratio(worst_plain)}.",
    ]
  )


def depth_table(results: dict) -> str:
  """Trace and lower times over the stack depths they were taken from, and
  each wrapped step's ratio to its twin at the same depth."""
  if not results:
    return md.not_measured("benchmarks/compile_time.py")
  (c,) = results.values()
  by_step = {x["step"]: x["trace_lower_by_depth_s"] for x in c["rows"]}
  rows = []
  for step, seconds in by_step.items():
    twin = by_step.get(step.replace("ours-", "hand-"))
    ratios = (
      [o / h for o, h in zip(seconds, twin, strict=True)]
      if step.startswith("ours-") and twin
      else None
    )
    rows.append(
      [
        step,
        f"{min(seconds):.3f}",
        f"{statistics.median(seconds):.3f}",
        f"{max(seconds):.3f}",
        f"{md.ratio(min(ratios))} to {md.ratio(max(ratios))}" if ratios else "",
      ]
    )
  return "\n".join(
    [
      f"Trace and lower seconds from {c['depths']} stack depths spread evenly"
      f" over one of CPython's {timing.CHUNK_SLOTS}-slot frame-stack chunks"
      " (`timing.seconds_by_depth`).",
      "",
      md.table(
        ["step", "min s", "median s", "max s", "ours / twin, same depth"],
        rows,
      ),
    ]
  )


def _lower(shape: tuple, tokens):
  """A fresh step of `shape` (model, tx, make, params, state), traced and
  lowered."""
  model, tx, make, params, state = shape
  return make(model, tx).lower(params, state, tokens)


def main(argv=None):
  args = parse_args(argv)
  tokens = jnp.zeros((args.batch, args.seq + 1), jnp.int32)
  shapes = {}
  chosen = variants(gpt_model.GPT, args)
  if args.only:
    chosen = {k: v for k, v in chosen.items() if k in args.only.split(",")}
  for name, (model, tx, make, scaler) in chosen.items():
    params = jax.eval_shape(
      lambda m=model: m.init(jax.random.key(0), tokens[:, :-1])["params"]
    )
    state = jax.eval_shape(tx.init, params)
    if scaler is not None:
      state = (state, scaler)
    shapes[name] = (model, tx, make, params, state)

  names = list(shapes)
  for name in names:  # the first traces in a process pay for the warm-up
    _lower(shapes[name], tokens)
  trace = timing.seconds_by_depth(
    names, lambda name: _lower(shapes[name], tokens), args.depths
  )
  compile_ = {name: [] for name in names}
  for r in range(args.rounds):
    for name in timing.rotated(names, r):
      lowered = _lower(shapes[name], tokens)
      t0 = time.perf_counter()
      lowered.compile()
      compile_[name].append(time.perf_counter() - t0)

  med = statistics.median
  rows = []
  base_total = med(trace[names[0]]) + med(compile_[names[0]])
  total = {n: med(trace[n]) + med(compile_[n]) for n in names}
  for name in names:
    twin = name.replace("ours-", "hand-")
    rows.append(
      {
        "step": name,
        "trace_lower_s": round(med(trace[name]), 4),
        "compile_s": round(med(compile_[name]), 4),
        "total_s": round(total[name], 4),
        "ratio_vs_plain": round(total[name] / base_total, 4),
        "ratio_vs_hand": round(total[name] / total[twin], 4)
        if name.startswith("ours-") and twin in total
        else None,
        "trace_lower_by_depth_s": [round(t, 4) for t in trace[name]],
      }
    )
  n_params = sum(x.size for x in jax.tree.leaves(shapes[names[0]][3]))
  result = {
    "model": f"GPT {args.layers}x{args.d_model}, seq {args.seq}, "
    f"{n_params / 1e6:.2f}M params",
    "rounds": args.rounds,
    "depths": args.depths,
    "rows": rows,
    "device": f"{jax.devices()[0].device_kind}, {platform.machine()}",
    "jax": jax.__version__,
  }
  print(table({"compile": result}))
  if args.json:
    md.write_json(args.json, result)
  return result


if __name__ == "__main__":
  main()
