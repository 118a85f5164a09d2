"""Per-device memory and communication accounting for a train step.

`memory_table(step, params)` counts, per device, the bytes of params,
gradients, master weights and optimizer state from the shardings a
`make_train_step` step gives them (like NeMo RL's memory tables), and
`compiled_memory(step, params, batch)` reads what XLA allocates for the
compiled step (`memory_analysis()`), to check the table against.
`collective_stats(hlo_text)` counts the collectives in an HLO module and the
bytes each device sends for them.

CLI (shapes only, nothing is allocated; `--check` compiles the step on
virtual CPU devices and compares)::

  python -m jmp_train.memory --model gpt2-small --preset bf16-true \\
      --mesh data=8 --zero-stage 1 --check
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_train import transform


def _device_bytes(x: Any, sharding: Any) -> int:
  """Bytes of the largest shard of `x` under `sharding`."""
  shape = sharding.shard_shape(tuple(x.shape)) if sharding else x.shape
  return math.prod(shape) * np.dtype(x.dtype).itemsize


def _tree_bytes(tree: Any, shardings: Any) -> int:
  leaves = jax.tree.leaves(tree)
  sh = jax.tree.leaves(shardings)
  return sum(_device_bytes(x, s) for x, s in zip(leaves, sh, strict=True))


def memory_table(step: Any, params: Any) -> dict[str, int]:
  """Bytes per device of each part of the training state under `step`.

  Args:
    step: a `TrainStep` from `make_train_step`.
    params: the params or their `jax.ShapeDtypeStruct`s.

  Returns:
    A dict with `params`, `gradients` (one copy of the gradients in the
    params' dtypes, the buffer the backward pass fills; with `accum_steps >
    1` the float32 accumulation buffer instead), `master_weights`,
    `optimizer_state` (everything else in the state) and `total`.
  """
  plan = step.plan(params)
  state = plan.opt_state_padded
  shardings = plan.opt_state_shardings
  master = sum(
    _tree_bytes(s.master_params, sh.master_params)
    for s, sh in zip(
      transform._mixed_precision_states(state),
      transform._mixed_precision_states(shardings),
      strict=True,
    )
  )
  total_state = _tree_bytes(state, shardings)

  def grad_leaf(p):
    dtype = p.dtype
    if step.accum_steps > 1 and jnp.issubdtype(dtype, jnp.floating):
      dtype = jnp.promote_types(dtype, jnp.float32)
    return jax.ShapeDtypeStruct(p.shape, dtype)

  grads = jax.tree.map(grad_leaf, params)
  table = {
    "params": _tree_bytes(params, plan.param_shardings),
    "gradients": _tree_bytes(grads, plan.param_shardings),
    "master_weights": master,
    "optimizer_state": total_state - master,
  }
  table["total"] = sum(table.values())
  return table


def compiled_memory(step: Any, params: Any, batch: Any) -> dict[str, int]:
  """What XLA allocates per device for the compiled step.

  Returns `argument` (params + optimizer state + batch), `output`, `temp`
  (activations, gradients, workspace) and `alias` bytes from
  `memory_analysis()`.
  """
  compiled = step.lower(params, batch).compile()
  analysis = compiled.memory_analysis()
  return {
    "argument": int(analysis.argument_size_in_bytes),
    "output": int(analysis.output_size_in_bytes),
    "temp": int(analysis.temp_size_in_bytes),
    "alias": int(analysis.alias_size_in_bytes),
  }


class Collective(NamedTuple):
  """One collective op of an HLO module.

  `bytes` is the data each device sends with a ring algorithm: an all-reduce
  of S bytes over g devices sends 2 S (g-1)/g, a reduce-scatter of S input
  bytes or an all-gather of S output bytes sends S (g-1)/g.
  """

  kind: str
  shape_bytes: int
  group_size: int
  bytes: float
  max_elements: int  # the largest operand's element count (1: scalars)


_OP = re.compile(
  r"= (?P<type>.+?) (?P<kind>all-reduce|reduce-scatter|all-gather|"
  r"all-to-all|collective-permute)(?:-start)?\((?P<args>[^)]*)\)(?P<rest>.*)$"
)
_SHAPE = re.compile(
  r"(pred|bf16|f16|f32|f64|s8|s16|s32|s64|u8|u32|f8\w*)\[([\d,]*)\]"
)
_ITEMSIZE = {"pred": 1, "bf16": 2, "f16": 2, "f32": 4, "f64": 8, "s8": 1,
             "s16": 2, "s32": 4, "s64": 8, "u8": 1, "u32": 4}  # fmt: skip


def _shape_bytes(text: str) -> int:
  total = 0
  for dtype, dims in _SHAPE.findall(text):
    size = math.prod(int(d) for d in dims.split(",") if d)
    total += size * _ITEMSIZE.get(dtype, 1)
  return total


def _max_elements(text: str) -> int:
  return max(
    (
      math.prod(int(d) for d in dims.split(",") if d)
      for _, dims in _SHAPE.findall(text)
    ),
    default=0,
  )


def _group_size(rest: str, num_devices: int) -> int:
  m = re.search(r"replica_groups=\{\{([\d,]+)\}", rest)
  if m:
    return len(m.group(1).split(","))
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]", rest)
  if m:
    return int(m.group(2))
  return num_devices


def collective_stats(hlo_text: str, num_devices: int) -> list[Collective]:
  """The collectives of an HLO module's text (`compiled.as_text()`)."""
  found = []
  for line in hlo_text.splitlines():
    m = _OP.search(line)
    if not m:
      continue
    kind = m.group("kind")
    g = _group_size(m.group("rest"), num_devices)
    out_bytes = _shape_bytes(m.group("type"))
    if kind == "reduce-scatter":
      size = out_bytes * g  # the input
      sent = size * (g - 1) / g
    elif kind == "all-reduce":
      size = out_bytes
      sent = 2 * size * (g - 1) / g
    else:
      size = out_bytes
      sent = size * (g - 1) / g
    found.append(
      Collective(kind, size, g, sent, _max_elements(m.group("type")))
    )
  return found


def summarize_collectives(found: list[Collective]) -> dict[str, dict]:
  """Count and bytes sent per collective kind, plus `total_bytes`."""
  out: dict[str, Any] = {}
  for c in found:
    entry = out.setdefault(
      c.kind, {"count": 0, "bytes": 0.0, "largest": 0, "max_elements": 0}
    )
    entry["count"] += 1
    entry["bytes"] += c.bytes
    entry["largest"] = max(entry["largest"], c.shape_bytes)
    entry["max_elements"] = max(entry["max_elements"], c.max_elements)
  out["total_bytes"] = sum(c.bytes for c in found)
  return out


# --- CLI: built-in model shapes ------------------------------------------

GPT_CONFIGS = {
  "gpt2-small": dict(layers=12, d_model=768, vocab=50257, seq=1024),
  "gpt2-medium": dict(layers=24, d_model=1024, vocab=50257, seq=1024),
  "tiny-gpt": dict(layers=2, d_model=64, vocab=96, seq=64),
}


def gpt_params(layers, d_model, vocab, seq, dtype=jnp.float32) -> dict:
  """GPT-2 parameter shapes (pre-norm, tied embeddings) as ShapeDtypeStructs."""
  s = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
  d = d_model
  block = {
    "ln1": {"scale": s(d), "bias": s(d)},
    "qkv": {"kernel": s(d, 3 * d), "bias": s(3 * d)},
    "proj": {"kernel": s(d, d), "bias": s(d)},
    "ln2": {"scale": s(d), "bias": s(d)},
    "fc": {"kernel": s(d, 4 * d), "bias": s(4 * d)},
    "out": {"kernel": s(4 * d, d), "bias": s(d)},
  }
  return {
    "wte": s(vocab, d),
    "wpe": s(seq, d),
    "blocks": [block] * layers,
    "ln_f": {"scale": s(d), "bias": s(d)},
  }


def gpt_loss(params: dict, tokens: jax.Array, heads: int = 4) -> jax.Array:
  """Next-token cross-entropy of the GPT above (for compiling the step)."""

  def norm(x, p):
    x32 = x.astype(jnp.float32)
    mu = x32.mean(-1, keepdims=True)
    var = ((x32 - mu) ** 2).mean(-1, keepdims=True)
    y = (x32 - mu) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]
    return y.astype(x.dtype)

  def dense(x, p):
    return x @ p["kernel"].astype(x.dtype) + p["bias"].astype(x.dtype)

  wte = params["wte"]
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  t = inputs.shape[1]
  x = wte[inputs] + params["wpe"][:t]
  mask = jnp.tril(jnp.ones((t, t), bool))
  for blk in params["blocks"]:
    h = norm(x, blk["ln1"])
    q, k, v = jnp.split(dense(h, blk["qkv"]), 3, axis=-1)
    split = lambda a: a.reshape(*a.shape[:2], heads, -1)  # noqa: E731
    q, k, v = split(q), split(k), split(v)
    att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    att = jnp.where(mask, att.astype(jnp.float32), -jnp.inf)
    att = jax.nn.softmax(att, axis=-1).astype(v.dtype)
    y = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(x.shape)
    x = x + dense(y, blk["proj"])
    h = norm(x, blk["ln2"])
    x = x + dense(jax.nn.gelu(dense(h, blk["fc"])), blk["out"])
  logits = norm(x, params["ln_f"]) @ wte.T.astype(x.dtype)
  logp = jax.nn.log_softmax(logits.astype(jnp.float32))
  return -jnp.take_along_axis(logp, targets[..., None], -1).mean()


def _parse_mesh(text: str) -> dict[str, int]:
  axes = {}
  for part in text.split(","):
    name, _, size = part.partition("=")
    if not size.isdigit() or not name:
      raise SystemExit(f"--mesh wants name=size[,name=size], got {text!r}")
    axes[name] = int(size)
  return axes


def main(argv: list[str] | None = None) -> dict:
  ap = argparse.ArgumentParser(
    prog="python -m jmp_train.memory", description=__doc__.split("\n")[0]
  )
  ap.add_argument("--model", default="gpt2-small", choices=sorted(GPT_CONFIGS))
  ap.add_argument("--preset", default="bf16-true")
  ap.add_argument("--mesh", default="data=8", help="e.g. data=4,model=2")
  ap.add_argument("--zero-stage", type=int, default=1, choices=(0, 1))
  ap.add_argument("--accum-steps", type=int, default=1)
  ap.add_argument("--batch", type=int, default=8, help="global batch")
  ap.add_argument("--check", action="store_true", help="compile and compare")
  args = ap.parse_args(argv)
  axes = _parse_mesh(args.mesh)
  n_dev = math.prod(axes.values())
  if args.check and "--xla_force_host_platform_device_count" not in (
    os.environ.get("XLA_FLAGS", "")
  ):
    # Before the backend starts: enough virtual CPU devices for the mesh.
    os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "")
      + f" --xla_force_host_platform_device_count={n_dev}"
    )
  from jmp_train import presets, sharding

  preset = presets.get_preset(args.preset)
  cfg = GPT_CONFIGS[args.model]
  params = gpt_params(**cfg, dtype=preset.policy.param_dtype)
  n_params = sum(math.prod(p.shape) for p in jax.tree.leaves(params))
  tx = preset.mixed_precision(optax.adamw(1e-4))
  devices = np.array(jax.devices()[:n_dev])
  if devices.size < n_dev:
    raise SystemExit(f"The mesh needs {n_dev} devices; {devices.size} exist.")
  mesh = jax.sharding.Mesh(
    devices.reshape(tuple(axes.values())),
    tuple(axes),
    axis_types=(jax.sharding.AxisType.Auto,) * len(axes),
  )
  step = sharding.make_train_step(
    gpt_loss,
    tx,
    mesh=mesh,
    zero_stage=args.zero_stage,
    accum_steps=args.accum_steps,
  )
  table = memory_table(step, params)
  print(
    f"{args.model}: {n_params / 1e6:.1f}M params, preset {args.preset}, "
    f"mesh {args.mesh}, ZeRO stage {args.zero_stage}; bytes per device"
  )
  for key, value in table.items():
    print(
      f"  {key:16s} {value / 2**20:12.2f} MiB  {value / n_params:7.3f} B/param"
    )
  result = {"table": table, "n_params": n_params}
  if args.check:
    batch = jax.ShapeDtypeStruct((args.batch, cfg["seq"] + 1), jnp.int32)
    compiled = compiled_memory(step, params, batch)
    batch_bytes = _device_bytes(batch, step.batch_sharding())
    expected = table["params"] + table["master_weights"]
    expected += table["optimizer_state"] + batch_bytes
    print("compiled step, memory_analysis() per device:")
    for key, value in compiled.items():
      print(f"  {key:16s} {value / 2**20:12.2f} MiB")
    print(
      f"  arguments {compiled['argument']} B vs table params+master+state+"
      f"batch {expected} B: {'match' if compiled['argument'] == expected else 'DIFFER'}"
    )
    result["compiled"] = compiled
    result["expected_argument"] = expected
  return result


if __name__ == "__main__":
  main(sys.argv[1:])
