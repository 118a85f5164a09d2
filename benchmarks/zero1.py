"""ZeRO-1 measurements on a virtual CPU mesh (or the devices there are).

1. Optimizer-state + master bytes per device for N = 1, 2, 4, 8, from the
   plan's shardings (`jmp_train.memory.memory_table`) and checked against
   the compiled step's `memory_analysis()`, next to the ZeRO paper's
   2 + 2 + 12/N bytes per param (bf16 params and grads, fp32 master and
   Adam).
2. Collective bytes per step for zero_stage=0 and 1, read from the compiled
   HLO (float32 params, so the CPU compiler's widening of bf16 collectives
   does not enter).
3. Step time of zero_stage=1 over zero_stage=0, measured side by side.

The model is the shared GPT (`examples/gpt_model.py`, tied embeddings), the
step `jmp_train.train.make_train_step` with a `jmp_train.zero1` plan.

  python benchmarks/zero1.py [--json out.json]
"""

import argparse
import pathlib
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
import numpy as np
import optax
from jax.sharding import AxisType

import jmp_train
from jmp_train import memory, train, zero1

DEVICES = 8


def _mesh(n):
  return jax.make_mesh(
    (n,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n]
  )


def memory_rows(model, batch_size):
  """Bytes per param per device under the bf16-true preset, N = 1 .. 8."""
  preset = jmp_train.get_preset("bf16-true")
  params = gpt_model.init_shapes(model, dtype=jnp.bfloat16)
  n_params = sum(p.size for p in jax.tree.leaves(params))
  tx = preset.mixed_precision(optax.adam(1e-3))
  loss_fn = gpt_model.step_loss(jmp_train.linen.wrap(model, preset.policy))
  state = jax.eval_shape(
    lambda p: train.TrainState.create(params=p, tx=tx), params
  )
  rows = []
  for n in (1, 2, 4, 8):
    plan = zero1.make_plan(tx, params, _mesh(n))
    table = memory.memory_table(plan, state)
    batch = jax.ShapeDtypeStruct(
      (batch_size, model.seq_len + 1), jnp.int32, sharding=plan.batch_sharding
    )
    step = train.make_train_step(loss_fn, tx, plan=plan)
    compiled = memory.compiled_memory(step, zero1.abstract(plan, state), batch)
    batch_bytes = batch_size // n * (model.seq_len + 1) * 4
    state_bytes = table["master_weights"] + table["optimizer_state"]
    rows.append(
      {
        "N": n,
        "state_bytes_per_param": state_bytes / n_params,
        "formula_state": 12 / n,
        "total_bytes_per_param": table["total"] / n_params,
        "formula_total": 2 + 2 + 12 / n,
        "compiled_arguments_match": compiled["argument"]
        == table["total"] - table["gradients"] + batch_bytes,
      }
    )
  return n_params, rows


def step_pair(model, batch_size, rounds):
  """Collectives and median step time of zero_stage 0 and 1 (float32)."""
  tokens = np.random.default_rng(0).integers(
    0, model.vocab, (batch_size, model.seq_len + 1)
  )
  params = model.init(jax.random.key(0), tokens[:1, :-1])["params"]
  tx = jmp_train.mixed_precision(optax.adam(1e-3))
  loss_fn = gpt_model.step_loss(model)
  steps, states, coll = {}, {}, {}
  for stage in (0, 1):
    plan = zero1.make_plan(tx, params, _mesh(DEVICES), zero_stage=stage)
    step = train.make_train_step(loss_fn, tx, plan=plan)
    state = train.TrainState.create(params=params, tx=tx, plan=plan)
    batch = jax.device_put(jnp.asarray(tokens), plan.batch_sharding)
    text = step.lower(state, batch).compile().as_text()
    coll[stage] = memory.summarize_collectives(
      memory.collective_stats(text, DEVICES)
    )
    state, metrics = step(state, batch)  # compile
    jax.block_until_ready(metrics)
    steps[stage], states[stage] = step, (state, batch)
  times = {0: [], 1: []}
  for _ in range(rounds):
    for stage in (0, 1):
      state, batch = states[stage]
      t0 = time.perf_counter()
      state = jax.block_until_ready(steps[stage](state, batch))[0]
      times[stage].append(time.perf_counter() - t0)
      states[stage] = (state, batch)
  return coll, {k: float(np.median(v)) for k, v in times.items()}


def bytes_table(results: dict) -> str:
  """Bytes per param per device against ZeRO's formula, and the verdict."""
  if not results:
    return md.not_measured("benchmarks/zero1.py")
  (z,) = results.values()
  rows = [
    [
      m["N"],
      f"{m['state_bytes_per_param']:.4f}",
      f"{m['formula_state']:.4f}",
      f"{m['total_bytes_per_param']:.4f}",
      f"{m['formula_total']:.4f}",
      m["compiled_arguments_match"],
    ]
    for m in z["memory"]
  ]
  worst = max(
    abs(m["total_bytes_per_param"] / m["formula_total"] - 1)
    for m in z["memory"]
  )
  header = ["N", "state+master B/param", "ZeRO 12/N", "total B/param"]
  return "\n".join(
    [
      f"{z['model']}, preset bf16-true + Adam, on {z['device']}.",
      "",
      md.table([*header, "ZeRO 2+2+12/N", "compiled args match"], rows),
      "",
      f"Goal (within 1% of 2+2+12/N): largest difference {100 * worst:.2f}%,"
      f" {md.verdict(worst <= 0.01)}.",
    ]
  )


def collectives_table(results: dict) -> str:
  """Collectives per step of stage 0 and 1, and the bytes verdict."""
  if not results:
    return md.not_measured("benchmarks/zero1.py")
  (z,) = results.values()
  rows = []
  for stage in ("0", "1"):
    c = z["collectives"][stage]
    ar = c.get("all-reduce", {})
    rows.append(
      [
        stage,
        c.get("reduce-scatter", {}).get("count", 0),
        c.get("all-gather", {}).get("count", 0),
        f"{ar.get('count', 0)} ({ar.get('max_elements', 0)})",
        f"{c['total_bytes'] / 2**20:.3f} MiB",
      ]
    )
  header = ["stage", "reduce-scatter", "all-gather"]
  header += ["all-reduce (largest operand, elements)", "bytes sent per device"]
  return "\n".join(
    [
      md.table(header, rows),
      "",
      f"ZeRO-1 / plain data parallelism: **{z['bytes_ratio']:.4f}x** the"
      f" bytes (goal <= 1.05x: {md.verdict(z['bytes_ratio'] <= 1.05)}).",
    ]
  )


def time_table(results: dict) -> str:
  """Step time of stage 1 over stage 0."""
  if not results:
    return md.not_measured("benchmarks/zero1.py")
  (z,) = results.values()
  med = z["median_s"]
  return (
    f"zero_stage=1 / zero_stage=0: **{md.ratio(z['time_ratio'])}**"
    f" ({1e3 * med['1']:.1f} ms vs {1e3 * med['0']:.1f} ms, median of"
    f" {z['rounds']} rounds, global batch {z['batch']})."
  )


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--d-model", type=int, default=256)
  ap.add_argument("--heads", type=int, default=4)
  ap.add_argument("--vocab", type=int, default=512)
  ap.add_argument("--seq", type=int, default=64)
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--rounds", type=int, default=20)
  ap.add_argument("--json", default=None)
  args = ap.parse_args(argv)
  if jax.device_count() < DEVICES:
    raise SystemExit(
      f"zero1.py needs {DEVICES} devices, found {jax.device_count()}."
    )
  model = gpt_model.GPT(
    args.layers, args.d_model, args.heads, args.seq, args.vocab, tied=True
  )
  n_params, rows = memory_rows(model, batch_size=DEVICES)
  coll, med = step_pair(model, args.batch, args.rounds)
  result = {
    "model": f"GPT {args.layers}x{args.d_model}, {args.heads} heads, seq"
    f" {args.seq}, vocabulary {args.vocab}, tied; {n_params / 1e6:.2f}M"
    " params",
    "device": f"{DEVICES} x {jax.devices()[0].device_kind}",
    "n_params": n_params,
    "memory": rows,
    "collectives": {str(k): v for k, v in coll.items()},
    "bytes_ratio": coll[1]["total_bytes"] / coll[0]["total_bytes"],
    "time_ratio": med[1] / med[0],
    "median_s": {str(k): v for k, v in med.items()},
    "rounds": args.rounds,
    "batch": args.batch,
  }
  results = {"zero1": result}
  print(bytes_table(results), collectives_table(results), sep="\n\n")
  print("\n" + time_table(results))
  if args.json:
    md.write_json(args.json, result)
  return result


if __name__ == "__main__":
  # Virtual CPU devices for the mesh; JAX makes them when its backend starts.
  jax.config.update("jax_num_cpu_devices", DEVICES)
  main()
