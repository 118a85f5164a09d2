"""ZeRO-1 measurements on a virtual CPU mesh (or the devices there are).

1. Optimizer-state + master bytes per device for N = 1, 2, 4, 8, from the
   step's shardings and checked against the compiled step's
   memory_analysis(), next to the ZeRO paper's 2 + 2 + 12/N bytes per param
   (bf16 params and grads, fp32 master and Adam).
2. Collective bytes per step for zero_stage=0 and 1, read from the compiled
   HLO (float32 params, so the CPU compiler's widening of bf16 collectives
   does not enter).
3. Step time of zero_stage=1 over zero_stage=0, measured side by side.

  python benchmarks/zero1.py [--json out.json]
"""

import argparse
import json
import math
import os
import sys
import time

if "--xla_force_host_platform_device_count" not in os.environ.get(
  "XLA_FLAGS", ""
):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
  )

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

import jmp_train as jmp  # noqa: E402
from jmp_train import memory, sharding  # noqa: E402


def _mesh(n):
  return jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,))


def memory_rows(cfg):
  params = memory.gpt_params(**cfg, dtype=jnp.bfloat16)
  n_params = sum(math.prod(p.shape) for p in jax.tree.leaves(params))
  tx = jmp.get_preset("bf16-true").mixed_precision(optax.adam(1e-3))
  rows = []
  for n in (1, 2, 4, 8):
    step = sharding.make_train_step(memory.gpt_loss, tx, mesh=_mesh(n))
    table = memory.memory_table(step, params)
    batch = jax.ShapeDtypeStruct((8, cfg["seq"] + 1), jnp.int32)
    compiled = memory.compiled_memory(step, params, batch)
    batch_bytes = 8 // n * (cfg["seq"] + 1) * 4
    state = table["master_weights"] + table["optimizer_state"]
    rows.append(
      {
        "N": n,
        "state_bytes_per_param": state / n_params,
        "formula_state": 12 / n,
        "total_bytes_per_param": table["total"] / n_params,
        "formula_total": 2 + 2 + 12 / n,
        "compiled_arguments_match": compiled["argument"]
        == table["params"] + state + batch_bytes,
      }
    )
  return n_params, rows


def step_pair(cfg, batch_size, rounds):
  params = memory.gpt_params(**cfg, dtype=jnp.float32)
  keys = jax.random.split(jax.random.key(0), len(jax.tree.leaves(params)))
  params = jax.tree.unflatten(
    jax.tree.structure(params),
    [
      0.02 * jax.random.normal(k, p.shape)
      for k, p in zip(keys, jax.tree.leaves(params), strict=True)
    ],
  )
  tx = jmp.mixed_precision(optax.adam(1e-3))
  tokens = np.random.default_rng(0).integers(
    0, cfg["vocab"], (batch_size, cfg["seq"] + 1)
  )
  steps, states, coll = {}, {}, {}
  for stage in (0, 1):
    step = sharding.make_train_step(
      memory.gpt_loss, tx, mesh=_mesh(8), zero_stage=stage
    )
    p, s = step.init(params)
    text = step.lower(params, jnp.asarray(tokens)).compile().as_text()
    coll[stage] = memory.summarize_collectives(memory.collective_stats(text, 8))
    batch = jax.device_put(jnp.asarray(tokens), step.batch_sharding())
    p, s, m = step(p, s, batch)  # compile
    jax.block_until_ready(m)
    steps[stage], states[stage] = step, (p, s, batch)
  times = {0: [], 1: []}
  for _ in range(rounds):
    for stage in (0, 1):
      p, s, batch = states[stage]
      t0 = time.perf_counter()
      p, s, m = steps[stage](p, s, batch)
      jax.block_until_ready((p, s, m))
      times[stage].append(time.perf_counter() - t0)
      states[stage] = (p, s, batch)
  med = {k: float(np.median(v)) for k, v in times.items()}
  return coll, med


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--d-model", type=int, default=256)
  ap.add_argument("--vocab", type=int, default=512)
  ap.add_argument("--seq", type=int, default=64)
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--rounds", type=int, default=20)
  ap.add_argument("--json", default=None)
  args = ap.parse_args(argv)
  cfg = dict(
    layers=args.layers, d_model=args.d_model, vocab=args.vocab, seq=args.seq
  )
  print(f"devices: {jax.device_count()} x {jax.devices()[0].device_kind}")
  n_params, rows = memory_rows(cfg)
  print(f"GPT {cfg}: {n_params / 1e6:.2f}M params, preset bf16-true + Adam")
  print(
    "| N | state+master B/param | 12/N | total B/param | 2+2+12/N | compiled args match |"
  )
  print("|---|---|---|---|---|---|")
  for r in rows:
    print(
      f"| {r['N']} | {r['state_bytes_per_param']:.4f} | {r['formula_state']:.4f} "
      f"| {r['total_bytes_per_param']:.4f} | {r['formula_total']:.4f} "
      f"| {r['compiled_arguments_match']} |"
    )
  coll, med = step_pair(cfg, args.batch, args.rounds)
  print(
    "\n| stage | reduce-scatter | all-gather | all-reduce (largest operand elems) | bytes sent/device |"
  )
  print("|---|---|---|---|---|")
  for stage in (0, 1):
    c = coll[stage]

    def get(kind, c=c):
      return c.get(kind, {}).get("count", 0)

    ar = c.get("all-reduce", {})
    print(
      f"| {stage} | {get('reduce-scatter')} | {get('all-gather')} | "
      f"{ar.get('count', 0)} ({ar.get('max_elements', 0)}) | "
      f"{c['total_bytes'] / 2**20:.3f} MiB |"
    )
  ratio_bytes = coll[1]["total_bytes"] / coll[0]["total_bytes"]
  ratio_time = med[1] / med[0]
  print(f"\ncollective bytes zero1/zero0: {ratio_bytes:.4f}")
  print(
    f"step time zero1/zero0: {ratio_time:.3f} "
    f"({med[1] * 1e3:.1f} ms vs {med[0] * 1e3:.1f} ms, median of {args.rounds})"
  )
  result = {
    "n_params": n_params,
    "memory": rows,
    "collectives": {str(k): v for k, v in coll.items()},
    "bytes_ratio": ratio_bytes,
    "time_ratio": ratio_time,
    "median_s": med,
  }
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)
  return result


if __name__ == "__main__":
  main(sys.argv[1:])
