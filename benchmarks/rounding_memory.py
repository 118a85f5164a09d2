"""What stochastic rounding's random bits cost the optimizer update to compile.

The update alone (`preset.mixed_precision(optax.adamw(1e-3))`'s `tx.update`
and `optax.apply_updates`, jitted, params and state donated) on GPT-2
small's bfloat16 params, compiled for this machine's first device and not
run: XLA's temporaries (`memory_analysis()`) and the time to lower and
compile, for `bf16-lean` (round to nearest) and `bf16-sr-lean` (stochastic
rounding of the params and of the bfloat16 moments), the latter once per
`--max-draw` (values per grouped draw, `rounding.MAX_DRAW`). One process
sees one device here, so the leaves are whole on it and the bits are drawn
in groups. With `--batch B`, also the whole train step (the model wrapped
with `linen.wrap`, `train.make_train_step`, the loss on the whole logits) at
batch B, where XLA:CPU holds the drawn bits beside the activations.

  python benchmarks/rounding_memory.py
  python benchmarks/rounding_memory.py --max-draw 1048576,4194304 --batch 1
"""

import argparse
import pathlib
import sys
import time

sys.path.insert(
  0, str(pathlib.Path(__file__).resolve().parents[1] / "examples")
)

import gpt_model
import jax
import jax.numpy as jnp
import md
import optax

import jmp_train
from jmp_train import train
from jmp_train._src import rounding


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--layers", type=int, default=12)
  p.add_argument("--d-model", type=int, default=768)
  p.add_argument("--heads", type=int, default=12)
  p.add_argument("--vocab", type=int, default=50304)
  p.add_argument("--seq", type=int, default=1024)
  p.add_argument("--max-draw", default="1048576,4194304")
  p.add_argument("--batch", type=int, default=0, help="0: no train step")
  p.add_argument("--json", default=None, help="also write results here")
  return p.parse_args(argv)


def _compiled(fn, *args):
  """XLA's temporaries (MiB) and the lower + compile time (s) of `fn`."""
  start = time.perf_counter()
  compiled = fn.lower(*args).compile()
  seconds = time.perf_counter() - start
  return compiled.memory_analysis().temp_size_in_bytes / 2**20, seconds


def compile_update(preset_name: str, params) -> tuple[float, float]:
  tx = jmp_train.get_preset(preset_name).mixed_precision(optax.adamw(1e-3))

  def update(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  state = jax.eval_shape(tx.init, params)
  return _compiled(
    jax.jit(update, donate_argnums=(0, 1)), params, state, params
  )


def compile_step(preset_name: str, model, batch: int) -> tuple[float, float]:
  preset = jmp_train.get_preset(preset_name)
  wrapped = jmp_train.linen.wrap(model, preset.policy)
  tx = preset.mixed_precision(optax.adamw(1e-3))

  def loss_fn(params, tokens, model_state, key):
    logits = wrapped.apply({"params": params, **model_state}, tokens[:, :-1])
    return gpt_model.cross_entropy(logits, tokens[:, 1:])

  params = gpt_model.init_shapes(model)  # float32: the policy casts
  state = jax.eval_shape(
    lambda p: train.TrainState.create(params=p, tx=tx), params
  )
  tokens = jax.ShapeDtypeStruct((batch, model.seq_len + 1), jnp.int32)
  return _compiled(train.make_train_step(loss_fn, tx), state, tokens)


def main(argv=None):
  args = parse_args(argv)
  model = gpt_model.GPT(
    args.layers, args.d_model, args.heads, args.seq, args.vocab, tied=True
  )
  params = gpt_model.init_shapes(model, dtype=jnp.bfloat16)
  n = sum(p.size for p in jax.tree.leaves(params))
  compilers = {"update alone": lambda name: compile_update(name, params)}
  if args.batch:
    compilers[f"train step, batch {args.batch}"] = lambda name: compile_step(
      name, model, args.batch
    )
  runs = [("bf16-lean", None)]
  runs += [("bf16-sr-lean", int(v)) for v in args.max_draw.split(",")]
  rows, default = [], rounding.MAX_DRAW
  try:
    for what, compile_one in compilers.items():
      for preset, max_draw in runs:
        rounding.MAX_DRAW = max_draw or default
        temp, seconds = compile_one(preset)
        rows.append(
          {
            "compiled": what,
            "preset": preset,
            "max_draw": max_draw,
            "temp_mib": round(temp, 1),
            "compile_s": round(seconds, 1),
          }
        )
  finally:
    rounding.MAX_DRAW = default
  result = {
    "model": f"GPT {args.layers}x{args.d_model}, vocabulary {args.vocab},"
    f" {n / 1e6:.1f}M bfloat16 params",
    "device": jax.devices()[0].device_kind,
    "jax": jax.__version__,
    "rows": rows,
  }
  print(table({"rounding-memory": result}))
  if args.json:
    md.write_json(args.json, result)
  return result


def table(results: dict) -> str:
  """Per run: XLA's temporaries and compile time of each compiled program."""
  if not results:
    return md.not_measured("benchmarks/rounding_memory.py")
  out = []
  for r in results.values():
    rows = [
      [
        x["compiled"],
        x["preset"],
        f"{x['max_draw']:,}" if x["max_draw"] else "",
        f"{x['temp_mib']:,.0f}",
        f"{x['compile_s']:.1f}",
      ]
      for x in r["rows"]
    ]
    header = ["compiled", "preset", "values per grouped draw", "temp MiB (XLA)"]
    header += ["compile s"]
    out += [
      f"{r['model']}; on {r['device']} (jax {r['jax']}).",
      "",
      md.table(header, rows),
      "",
    ]
  return "\n".join(out).rstrip()


if __name__ == "__main__":
  main()
