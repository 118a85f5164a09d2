"""Step-time overhead of mixed_precision(optax.adam) vs plain optax.adam.

Three jitted train steps on one MLP (~10.5M params, float32 params), timed
side by side in one process, in rotated order, median of --steps rounds:

  plain     grads of the loss, optax.adam, apply_updates
  skip-only plain, with the adam update under lax.cond(all_finite(grads)):
            the least any exact skip of non-finite steps costs
  ours      grads of the scaled loss, mixed_precision(adam, dynamic scaling)
  jmp-style grads of the scaled loss, unscale, all_finite, adjust, adam,
            select_tree on params and optimizer state (jmp's README recipe)

With --bf16-params the params are bfloat16 with float32 master weights, and
two steps run instead: hand-masters (optax.adam on float32 masters kept by
hand, params their cast; no loss scale, no skip) and ours
(mixed_precision(adam): masters, dynamic scaling, the skip, and updates that
optax.apply_updates turns into cast(master) bit for bit).

With --update-only the forward/backward pass is left out (fixed gradients),
which isolates the transformation's own cost. --study adds plain-adam variants
that locate the cost of skipping: the update under a cond on a predicate read
from one tiny gradient (tiny-cond), and a select of the new or old state by
all_finite (select-skip, jmp's way, without loss scaling).

  python benchmarks/overhead.py                 # full train step
  python benchmarks/overhead.py --update-only   # optimizer update alone
  python benchmarks/overhead.py --update-only --bf16-params
"""

import argparse
import functools
import gzip
import json
import math
import pathlib
import platform
import re
import statistics
import time

import deviceless
import jax
import jax.numpy as jnp
import md
import numpy as np
import optax
import timing

import jmp_train


def parse_args(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--dims", default="1024,2048,2048,2048,10")
  p.add_argument("--batch", type=int, default=256)
  p.add_argument(
    "--steps", type=timing.count_arg, default=30, help="timed rounds"
  )
  p.add_argument("--warmup", type=int, default=5)
  p.add_argument("--update-only", action="store_true")
  p.add_argument(
    "--study", action="store_true", help="add tiny-cond, select-skip"
  )
  p.add_argument(
    "--bf16-params", action="store_true", help="masters: hand vs ours"
  )
  p.add_argument(
    "--kernels",
    action="store_true",
    help="count each compiled step's kernels instead of timing it",
  )
  deviceless.add_target_argument(p, "with --kernels: ")
  p.add_argument(
    "--steps-per-round",
    type=timing.count_arg,
    default=1,
    help="steps dispatched before each wait (1: wait after every step)",
  )
  p.add_argument(
    "--profile",
    default=None,
    metavar="DIR",
    help="trace --profile-steps steps of each step with jax.profiler into"
    " DIR/<step> and summarize where the time goes, instead of timing",
  )
  p.add_argument("--profile-steps", type=timing.count_arg, default=20)
  p.add_argument("--json", default=None, help="also write results here")
  args = p.parse_args(argv)
  if args.profile and args.kernels:
    p.error("--profile and --kernels each replace the timing: pass one")
  if args.target and not args.kernels:
    p.error(f"--target {args.target} compiles without running: add --kernels")
  if args.profile and args.profile_steps % args.steps_per_round:
    p.error(
      f"--profile-steps {args.profile_steps} must be a multiple of"
      f" --steps-per-round {args.steps_per_round}"
    )
  return args


def init_mlp(dims, key):
  params = []
  for d_in, d_out in zip(dims[:-1], dims[1:], strict=True):
    key, sub = jax.random.split(key)
    params.append(
      {
        "w": jax.random.normal(sub, (d_in, d_out)) / np.sqrt(d_in),
        "b": jnp.zeros(d_out),
      }
    )
  return params


def loss_fn(params, x, y):
  for layer in params[:-1]:
    x = jax.nn.relu(x @ layer["w"] + layer["b"])
  logits = x @ params[-1]["w"] + params[-1]["b"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def shared_steps(update_only):
  """What every variant shares: adam, the gradients, and our step."""
  adam = optax.adam(1e-3)
  ours_tx = jmp_train.mixed_precision(
    optax.adam(1e-3), loss_scale=jmp_train.dynamic_loss_scale()
  )

  def grads_of(params, x, y, scale):
    if update_only:
      return jax.tree.map(lambda p: x[0, 0] * scale * jnp.ones_like(p), params)
    return jax.grad(lambda p: loss_fn(p, x, y) * scale)(params)

  def ours(params, state, x, y):
    grads = grads_of(params, x, y, jmp_train.current_loss_scale(state))
    updates, state = ours_tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return adam, grads_of, (ours_tx.init, ours)


def jitted(steps):
  return {
    k: (init, jax.jit(fn, donate_argnums=(0, 1)))
    for k, (init, fn) in steps.items()
  }


def make_master_steps(update_only):
  """bf16 params with float32 masters: by hand, and mixed_precision's."""
  adam, grads_of, ours = shared_steps(update_only)

  def hand_init(params):
    masters = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    return masters, adam.init(masters)

  def hand(params, state, x, y):
    masters, opt_state = state
    grads = grads_of(params, x, y, 1.0)
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    updates, opt_state = adam.update(grads, opt_state, masters)
    masters = optax.apply_updates(masters, updates)
    params = jax.tree.map(lambda m, p: m.astype(p.dtype), masters, params)
    return params, (masters, opt_state)

  return jitted({"hand-masters": (hand_init, hand), "ours": ours})


def make_steps(update_only, study=False):
  adam, grads_of, ours = shared_steps(update_only)

  def plain(params, state, x, y):
    grads = grads_of(params, x, y, 1.0)
    updates, state = adam.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  def adam_under_cond(predicate):
    """Plain adam, applied only where `predicate(grads)` holds."""

    def step(params, state, x, y):
      grads = grads_of(params, x, y, 1.0)
      updates, state = jax.lax.cond(
        predicate(grads),
        lambda: adam.update(grads, state, params),
        lambda: (jax.tree.map(jnp.zeros_like, grads), state),
      )
      return optax.apply_updates(params, updates), state

    return step

  skip_only = adam_under_cond(jmp_train.all_finite)
  # 10 numbers, known early in the backward pass.
  tiny_cond = adam_under_cond(
    lambda grads: jmp_train.all_finite(grads[-1]["b"])
  )

  def select_skip(params, state, x, y):
    grads = grads_of(params, x, y, 1.0)
    finite = jmp_train.all_finite(grads)
    updates, new_state = adam.update(grads, state, params)
    new_params = optax.apply_updates(params, updates)
    return (
      jmp_train.select_tree(finite, new_params, params),
      jmp_train.select_tree(finite, new_state, state),
    )

  def jmp_style(params, state, x, y):
    opt_state, loss_scale = state
    grads = loss_scale.unscale(grads_of(params, x, y, loss_scale.loss_scale))
    finite = jmp_train.all_finite(grads)
    loss_scale = loss_scale.adjust(finite)
    updates, new_opt_state = adam.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    params = jmp_train.select_tree(finite, new_params, params)
    opt_state = jmp_train.select_tree(finite, new_opt_state, opt_state)
    return params, (opt_state, loss_scale)

  steps = {
    "plain": (adam.init, plain),
    "skip-only": (adam.init, skip_only),
    "ours": ours,
    "jmp-style": (
      lambda p: (adam.init(p), jmp_train.dynamic_loss_scale()),
      jmp_style,
    ),
  }
  if study:
    steps["tiny-cond"] = (adam.init, tiny_cond)
    steps["select-skip"] = (adam.init, select_skip)
  return jitted(steps)


# -- the page's tables (benchmarks/suite.py) ----------------------------------


def _on_gpu(r: dict) -> bool:
  return not r["device"].startswith("cpu")


def _per_wait(r: dict) -> str:
  """How often a run's host waited, for its label ("" after every step)."""
  k = r.get("steps_per_round", 1)
  return f", {k} steps per wait" if k > 1 else ""


def _label(r: dict) -> str:
  """A row's label: what was timed, and how often the host waited."""
  label = (
    "optimizer update only"
    if r["what"].startswith("optimizer")
    else f"full step, batch {r['batch']}"
  )
  return label + _per_wait(r)


def _rows(results: dict, gpu: bool, base: str) -> list[dict]:
  """The results against `base` on one machine: full steps by batch, then
  the update alone."""
  return sorted(
    (
      r
      for r in results.values()
      if _on_gpu(r) == gpu and f"ratio_vs_{base}" in r
    ),
    key=lambda r: (
      r["what"].startswith("optimizer"),
      r["batch"],
      r.get("steps_per_round", 1),
      "tiny-cond" in r["median_ms"],  # the --study rows after the others
    ),
  )


def _versus_plain(r: dict) -> list[str]:
  m, q = r["median_ms"], r["ratio_vs_plain"]
  f = "{:.3f}" if _on_gpu(r) else "{:.1f}"
  return [
    f.format(m["plain"]),
    f"{f.format(m['skip-only'])} ({md.ratio(q['skip-only'])})",
    f"**{f.format(m['ours'])} ({md.ratio(q['ours'])})**",
    f"{f.format(m['jmp-style'])} ({md.ratio(q['jmp-style'])})",
  ]


def table(results: dict) -> str:
  """CPU: ours, skip-only and jmp-style against plain optax, the `--study`
  row, and the verdict at the largest batch."""
  rows = _rows(results, gpu=False, base="plain")
  main = [r for r in rows if "tiny-cond" not in r["median_ms"]]
  if not main:
    return md.not_measured("benchmarks/overhead.py on CPU")
  out = [
    f"Model: an MLP of {main[0]['params']:,} float32 params (CPU).",
    "",
    md.table(
      [
        "step (median ms, ratio vs plain)",
        "plain",
        "skip-only",
        "**ours**",
        "jmp-style",
        "ours / skip-only",
      ],
      [
        [_label(r), *_versus_plain(r)]
        + [
          md.ratio(
            r["ratio_vs_plain"]["ours"] / r["ratio_vs_plain"]["skip-only"]
          )
        ]
        for r in main
      ],
    ),
    "",
  ]
  for s in (r for r in rows if "tiny-cond" in r["median_ms"]):
    names = list(s["median_ms"])
    out += [
      f"`--study` (batch {s['batch']}): where the cost of skipping sits.",
      "",
      md.table(
        names,
        [
          [
            f"{s['median_ms'][n]:.1f} ms ({md.ratio(s['ratio_vs_plain'][n])})"
            for n in names
          ]
        ],
      ),
      "",
    ]
  full = [r for r in main if not r["what"].startswith("optimizer")]
  update = [r for r in main if r["what"].startswith("optimizer")]
  if full:
    big = full[-1]
    q = big["ratio_vs_plain"]["ours"]
    worst = max(
      r["ratio_vs_plain"]["ours"] / r["ratio_vs_plain"]["skip-only"]
      for r in full
    )
    line = (
      "Goal (issue 2): ours at most 1.02x the plain step. At the largest"
      f" batch ({big['batch']}): {md.ratio(q)}, goal {md.verdict(q <= 1.02)}."
      f" Ours is at most {md.ratio(worst)} of skip-only in the full steps"
    )
    if update:
      line += (
        f", and {md.ratio(update[0]['ratio_vs_plain']['ours'])} of plain adam"
        " in the update alone"
      )
    out.append(line + ".")
  return "\n".join(out).rstrip()


def masters_table(results: dict) -> str:
  """bf16 params with float32 masters: ours against masters kept by hand,
  on every machine with results."""
  rows = [
    [
      _label(r),
      "GPU" if gpu else "CPU",
      f"{r['median_ms']['hand-masters']:.3f}",
      f"**{r['median_ms']['ours']:.3f}"
      f" ({md.ratio(r['ratio_vs_hand-masters']['ours'])})**",
    ]
    for gpu in (False, True)
    for r in _rows(results, gpu, base="hand-masters")
  ]
  if not rows:
    return md.not_measured("benchmarks/overhead.py --bf16-params")
  return md.table(
    [
      "step (median ms, ratio vs hand-masters)",
      "machine",
      "hand-masters",
      "**ours**",
    ],
    rows,
  )


def gpu_table(results: dict) -> str:
  """The CPU table's steps on a GPU, the `--study` rows in one column, and
  the verdict for the full step."""
  rows = _rows(results, gpu=True, base="plain")
  full = [
    r
    for r in rows
    if r["what"].startswith("full") and "tiny-cond" not in r["median_ms"]
  ]
  if not full:
    return md.not_measured("benchmarks/overhead.py on a GPU")
  first = full[0]
  # Rows from more than one GPU session: each names its device.
  devices = sorted({r["device"].split(",")[0] for r in rows})
  body = []
  for r in rows:
    m, q = r["median_ms"], r["ratio_vs_plain"]
    label, study = _label(r), ""
    if len(devices) > 1:
      label += f", {r['device'].split(',')[0]}"
    if "tiny-cond" in m:
      label += " (`--study`)"
      study = ", ".join(
        f"{n} {m[n]:.3f} ({md.ratio(q[n])})"
        for n in ("tiny-cond", "select-skip")
      )
    body.append([label, *_versus_plain(r), study])
  # The sentence reads the rows of the first full step's device.
  same = [r for r in rows if r["device"] == first["device"]]
  same_full = [r for r in same if r["what"].startswith("full")]
  skips = [
    abs(r["ratio_vs_plain"][n] - 1)
    for r in same_full
    for n in ("skip-only", "tiny-cond", "select-skip")
    if n in r["ratio_vs_plain"]
  ]
  skip_rows = "skip-only"
  if any("tiny-cond" in r["median_ms"] for r in same_full):
    skip_rows += ", and tiny-cond and select-skip with `--study`"
  q = first["ratio_vs_plain"]["ours"]
  extra_us = 1e3 * (first["median_ms"]["ours"] - first["median_ms"]["plain"])
  update = [r for r in same if r["what"].startswith("optimizer")]
  start = (
    f"On {first['device'].split(',')[0]}, the" if len(devices) > 1 else "The"
  )
  line = (
    f"{start} skip alone ({skip_rows}) stays within {100 * max(skips):.1f}% of"
    f" plain; ours is {md.ratio(q)} of plain in the full step, about"
    f" {extra_us:.0f} us per step"
  )
  if update:
    line += f", and {md.ratio(update[0]['ratio_vs_plain']['ours'])} in the update alone"
  verdicts = "; ".join(
    f"{md.ratio(r['ratio_vs_plain']['ours'])}"
    + (
      f" with {r['steps_per_round']} steps per wait"
      if r.get("steps_per_round", 1) > 1
      else " waiting after every step"
    )
    + (f" on {r['device'].split(',')[0]}" if len(devices) > 1 else "")
    + f", {md.verdict(r['ratio_vs_plain']['ours'] <= 1.02)}"
    for r in full
  )
  return "\n".join(
    [
      f"{' and '.join(devices)}, `benchmarks/overhead.py --batch"
      f" {first['batch']} --steps {first['rounds']}` (and `--update-only`,"
      " `--study`).",
      "",
      md.table(
        [
          "step (median ms, ratio vs plain)",
          "plain",
          "skip-only",
          "**ours**",
          "jmp-style",
          "study rows",
        ],
        body,
      ),
      "",
      line + ".",
      "",
      f"Goal (issue 2), GPU, this MLP, ours at most 1.02x of plain: {verdicts}.",
    ]
  )


# Instructions that launch no kernel of their own.
_NO_KERNEL = {
  "parameter",
  "get-tuple-element",
  "tuple",
  "constant",
  "bitcast",
  "after-all",
  "async-done",
  "async-update",
  "opt-barrier",
  "partition-id",
  "replica-id",
}
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\s([a-z][\w\-]*)\(")
_CALLED = re.compile(
  r"(?:true_computation|false_computation|body|condition|to_apply|calls)"
  r"=%?([\w.\-]+)|branch_computations=\{([^}]*)\}"
)
# Instructions whose called computations hold the kernels (XLA:GPU puts runs
# of kernels in command buffers, `call(...), to_apply=%command_buffer`).
HOLDERS = ("conditional", "while", "call", "async-start")
# XLA:CPU compiles a call with this attribute into one kernel.
_SMALL_CALL = 'xla_cpu_small_call="true"'


# Bits per element of each HLO element type.
_BITS = {
  "pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "f4e2m1fn": 4,
  "s8": 8, "u8": 8, "f8e3m4": 8, "f8e4m3": 8, "f8e4m3fn": 8, "f8e4m3fnuz": 8,
  "f8e4m3b11fnuz": 8, "f8e5m2": 8, "f8e5m2fnuz": 8, "f8e8m0fnu": 8,
  "s16": 16, "u16": 16, "f16": 16, "bf16": 16,
  "s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64,
  "c64": 64, "c128": 128,
}  # fmt: skip
_SHAPE = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")


def _shape_bytes(text: str) -> int:
  """Bytes of the arrays a shape (or a tuple of them) in HLO text names.

  Raises:
    ValueError: for an element type not in `_BITS`.
  """
  total = 0
  for dtype, dims in _SHAPE.findall(text):
    if dtype not in _BITS:
      raise ValueError(f"unknown HLO element type {dtype!r} in {text!r}")
    elements = math.prod(int(d) for d in dims.split(",") if d)
    total += -(-elements * _BITS[dtype] // 8)
  return total


def _operands(line: str, op: str) -> list[str]:
  """The instruction names inside `op(...)` on an HLO line, each once; an
  element of a tuple-shaped one as `name#k` where the text names it so (the
  HLO of XLA:GPU's dumps since jax 0.11, `%gemm#1`, where `as_text()` has a
  get-tuple-element)."""
  start = line.index(f" {op}(") + len(op) + 2
  depth, end = 1, start
  while depth:
    depth += {"(": 1, ")": -1}.get(line[end], 0)
    end += 1
  names = re.findall(r"%([\w.\-]+(?:#\d+)?)", line[start : end - 1])
  return list(dict.fromkeys(names))


def kernel_list(hlo_text: str) -> list[tuple[str, int]]:
  """The kernels a compiled module runs per call, as (opcode, bytes): every
  instruction of the entry computation but the bookkeeping ones (a fusion
  is one kernel), and of a conditional its largest branch (the step that
  updates), of a while loop its condition and body once, of a call or an
  async start what it calls; a call XLA:CPU marks small
  (`xla_cpu_small_call`: it hoists small while loops into such calls, every
  scatter's loop with its elemental emitters) runs as one kernel. A
  kernel's bytes are its operands' sizes and
  its result's summed: what it moves if it reads each operand once, exact
  for elementwise kernels, an upper bound for those that read a slice; of a
  cuBLAS or cuDNN call's result, less its scratch (`_scratch_bytes`)."""
  return [(op, moved) for op, moved, _ in kernel_lines(hlo_text)[0]]


def kernel_lines(hlo_text: str) -> tuple[list[tuple[str, int, str]], dict]:
  """`kernel_list`'s kernels as (opcode, bytes, HLO line), and the module's
  computations by name (each a list of its lines)."""
  comps, name = {}, None
  for line in hlo_text.splitlines():
    head = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
    if head:
      name = "ENTRY" if head[1] else head[2]
      comps[name] = []
    elif line.startswith("}"):
      name = None
    elif name is not None:
      comps[name].append(line)

  def walk(comp: str) -> list[tuple[str, int, str]]:
    found, sizes = [], {}
    for line in comps.get(comp, []):
      m = _INSTR.match(line)
      if not m:
        continue
      op = m[1]
      lhs, rhs = line.split("=", 1)
      name = lhs.split()[-1].lstrip("%")
      result = rhs[: rhs.index(f" {op}(")]
      sizes[name] = _shape_bytes(result)
      if result.strip().startswith("("):  # each element, for `name#k`
        for k, (dtype, dims) in enumerate(_SHAPE.findall(result)):
          sizes[f"{name}#{k}"] = _shape_bytes(f"{dtype}[{dims}]")
      if op in _NO_KERNEL:
        continue
      if op in HOLDERS and _SMALL_CALL not in line:
        parts = [walk(c) for c in called_computations(line)]
        if op == "conditional":
          parts = [max(parts, key=len)] if parts else []
        for part in parts:
          found += part
        continue
      moved = sum(sizes.get(o, 0) for o in _operands(line, op))
      scratch = _scratch_bytes(op, result, line)
      found.append((op, moved + sizes[name] - scratch, line))
    return found

  return walk("ENTRY"), comps


# XLA:GPU's calls into cuBLAS and cuDNN return their workspace as the last
# element of their result, a flat s8 or u8 array sized by the algorithm
# chosen: 4 MiB a cuBLASLt GEMM compiled for a target here, 32 MiB after the
# H200's autotuning. It is neither an operand nor a result of the
# computation, and how much of it a call touches the HLO does not say.
# Counted, the H200's compiled GPT-2 step moved 4.9 GB more than the same
# step compiled here for the H200; without it the two agree to 0.1 MB.
_LIBRARY_CALL = re.compile(r'custom_call_target="__(?:cublas|cudnn)')


def _scratch_bytes(op: str, result: str, line: str) -> int:
  """The workspace a cuBLAS or cuDNN custom call's `result` (its shape, as
  HLO text) holds: the tuple's last array where it is a flat s8 or u8 one;
  0 for any other instruction."""
  if op != "custom-call" or not _LIBRARY_CALL.search(line):
    return 0
  if not result.strip().startswith("("):
    return 0
  dtype, dims = _SHAPE.findall(result)[-1]
  return int(dims) if dtype in ("s8", "u8") and dims.isdigit() else 0


def called_computations(line: str) -> list[str]:
  """The computations an HLO instruction calls, by name: a fusion's, the
  `to_apply` of a call or reduce, a loop's body and condition, a
  conditional's branches."""
  called = []
  for a, b in _CALLED.findall(line):
    called += [a] if a else [c.strip().lstrip("%") for c in b.split(",")]
  return called


def instructions(comps: dict) -> dict[str, tuple[str, str]]:
  """Every instruction of `kernel_lines`'s computations: name -> (opcode,
  HLO line)."""
  found = {}
  for lines in comps.values():
    for line in lines:
      m = _INSTR.match(line)
      if m:
        found[line.split("=", 1)[0].split()[-1].lstrip("%")] = (m[1], line)
  return found


def count_reductions(hlo_text: str) -> int:
  """How many of `kernel_list`'s kernels reduce: a `reduce`, or a fusion
  whose fused computation holds one."""
  return _reductions(*kernel_lines(hlo_text))


def _reductions(kernels: list[tuple[str, int, str]], comps: dict) -> int:
  count = 0
  for op, _, line in kernels:
    called = re.search(r"calls=%?([\w.\-]+)", line) if op == "fusion" else None
    body = comps.get(called[1], []) if called else []
    count += op == "reduce" or any(" reduce(" in x for x in body)
  return count


def _by_op(kernels: list[tuple[str, int]]) -> dict[str, int]:
  """How many of `kernel_list`'s kernels each opcode has."""
  total: dict[str, int] = {}
  for op, _ in kernels:
    total[op] = total.get(op, 0) + 1
  return total


def kernel_summary(hlo_text: str) -> dict:
  """A compiled module's kernels (`kernel_list`): how many, by opcode, the
  MB they move, how many reduce (`count_reductions`), and how many
  conditionals the module still branches on (XLA's conditional simplifier
  may turn a skip's `lax.cond` into selects)."""
  kernels, comps = kernel_lines(hlo_text)
  found = [(op, moved) for op, moved, _ in kernels]
  return {
    "total": len(found),
    "by_op": _by_op(found),
    "mbytes": round(sum(b for _, b in found) / 1e6, 1),
    "reductions": _reductions(kernels, comps),
    "conditionals": len(re.findall(r"\sconditional\(", hlo_text)),
  }


def count_kernels(hlo_text: str) -> dict[str, int]:
  """The kernels a compiled module runs per call, by opcode (`kernel_list`)."""
  return _by_op(kernel_list(hlo_text))


def _subject(args) -> str:
  """What a `--kernels` or `--profile` run measured."""
  return "optimizer update" if args.update_only else "train step"


def kernels_main(args, steps, params, x, y, place=None) -> dict:
  """Each step's kernels (`kernel_list` of its compiled HLO: their count by
  opcode and the bytes they move). Steps are compiled, not run, so they
  share `params`; with `place` (arguments placed on a GPU target that is not
  here, `deviceless.abstract`) each state is its shape, placed likewise."""
  kernels = {}
  for name, (init, step) in steps.items():
    state = place(jax.eval_shape(init, params)) if place else init(params)
    hlo = step.lower(params, state, x, y).compile().as_text()
    kernels[name] = kernel_summary(hlo)
    print(f"{name}: {kernels[name]['total']} kernels {kernels[name]['by_op']}")
  return {
    "what": f"kernels per {_subject(args)}",
    "param_dtype": jnp.dtype(jax.tree.leaves(params)[0].dtype).name,
    "leaves": len(jax.tree.leaves(params)),
    "batch": args.batch,
    "kernels": kernels,
    **deviceless.provenance(args.target),
  }


def kernels_table(results: dict) -> str:
  """Kernels per compiled step and machine, against plain optax's."""
  runs = [r for r in results.values() if "kernels" in r]
  if not runs:
    return md.not_measured("benchmarks/overhead.py --kernels")
  rows = []
  for r in runs:
    k = r["kernels"]
    base = k.get("plain", k.get("hand-masters"))["total"]
    for name, v in k.items():
      top = sorted(v["by_op"].items(), key=lambda kv: -kv[1])[:4]
      rows.append(
        [
          r["device"],
          r["what"] + (f", batch {r['batch']}" if "step" in r["what"] else ""),
          name,
          v["total"],
          f"{v['total'] - base:+d}",
          v.get("mbytes", ""),
          ", ".join(f"{op} {n}" for op, n in top),
        ]
      )
  header = [
    "machine",
    "what",
    "step",
    "kernels",
    "vs plain",
    "MB moved",
    "most launched",
  ]
  notes = [
    f"{r['device']}, {r['what']}: conditionals left in the compiled step: "
    + ", ".join(f"{n} {v['conditionals']}" for n, v in r["kernels"].items())
    + "."
    for r in runs
    if all("conditionals" in v for v in r["kernels"].values())
  ]
  return "\n\n".join([md.table(header, rows), *notes])


def run_round(step, state, x, y, args):
  """`args.steps_per_round` steps dispatched back to back, then a wait: 1
  waits after every step, more lets the host run ahead as a training loop
  that does not read its metrics every step does."""
  for _ in range(args.steps_per_round):
    state = step(*state, x, y)
  return jax.block_until_ready(state)


# -- where the time goes: jax.profiler traces (--profile) ----------------------

# Copies and fills on a GPU's streams: device work, but not kernels.
_TRANSFERS = ("Memcpy", "Memset")


def read_trace(directory) -> list[dict]:
  """The events of the newest perfetto trace `jax.profiler.trace(directory,
  create_perfetto_trace=True)` wrote."""
  files = sorted(pathlib.Path(directory).glob("**/perfetto_trace.json.gz"))
  if not files:
    raise FileNotFoundError(f"no perfetto_trace.json.gz under {directory}")
  with gzip.open(files[-1]) as f:
    data = json.load(f)
  return data["traceEvents"] if isinstance(data, dict) else data


def _busy_us(spans: list[tuple[int, int]]) -> float:
  """The length of the union of the [start, end) intervals (ns), in us."""
  busy, end = 0, float("-inf")
  for a, b in sorted(spans):
    if b > end:
      busy += b - max(a, end)
      end = b
  return busy / 1000


def interval(e: dict) -> tuple[int, int]:
  """A span's [start, end) in whole nanoseconds, so ends compare exactly
  (1.1 + 2.2 > 3.3 in floats)."""
  return round(e["ts"] * 1000), round((e["ts"] + e["dur"]) * 1000)


def innermost(spans: list[dict]) -> list[dict]:
  """The spans that hold no other span of their line: a conditional's or a
  loop's span, which holds the kernels it ran, is not a kernel itself. A
  span held must lie wholly inside, last a while and not be the same
  interval: spans that only overlap or coincide, or one of no length at
  another's start, are all kept."""
  by_line: dict[tuple, list[tuple]] = {}
  for e in spans:
    by_line.setdefault((e["pid"], e["tid"]), []).append((interval(e), e))
  kept = []
  for line in by_line.values():
    line.sort(key=lambda ie: (ie[0][0], -ie[0][1]))
    for i, ((start, end), e) in enumerate(line):
      holds = False
      for (a, b), _ in line[i + 1 :]:
        if a >= end:
          break
        if a < b <= end and (a, b) != (start, end):
          holds = True
          break
      if not holds:
        kept.append(e)
  return kept


def _kind(e: dict) -> str:
  """A span's kernel kind: its HLO name, or else its own name, without the
  number (`multiply_fusion.7`, `loop_add_fusion_3`)."""
  op = e.get("args", {}).get("hlo_op")
  return re.sub(r"\.\d+$", "", op) if op else re.sub(r"[._]\d+$", "", e["name"])


def _lines(events: list[dict]) -> tuple[dict, dict]:
  """A trace's process names by pid and line (thread) names by (pid, tid)."""
  process, thread = {}, {}
  for e in events:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      process[e["pid"]] = e["args"]["name"]
    if e.get("ph") == "M" and e.get("name") == "thread_name":
      thread[(e["pid"], e["tid"])] = e["args"]["name"]
  return process, thread


def lines_seen(process: dict, thread: dict) -> str:
  """A trace's process and line names, for an error that says what it has."""
  return (
    f"processes {sorted(process.values())}, lines"
    f" {sorted(set(thread.values()))}"
  )


def device_work(events: list[dict], device: bool) -> tuple[list, dict, dict]:
  """The device's work in a trace: its kernels and transfers (`is_transfer`),
  the innermost spans only; and the trace's process and line names.

  With `device` (a GPU's trace) the spans on the stream lines (`Stream
  #...`) of the `/device:...` processes, the lines derived from them ("XLA
  Ops", ...) left out. Without it (XLA:CPU, which has no device process)
  the thunks XLA:CPU runs, the spans with an `hlo_op`. A span that holds
  others on its line (a conditional's) is not counted; the kernels it ran
  are.
  """
  process, thread = _lines(events)
  spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
  if device:
    pids = {p for p, n in process.items() if n.startswith("/device:")}
    work = [
      e
      for e in spans
      if e["pid"] in pids
      and thread.get((e["pid"], e["tid"]), "").startswith("Stream")
    ]
  else:
    work = [e for e in spans if "hlo_op" in e.get("args", {})]
  return innermost(work), process, thread


def busy_us(work: list[dict]) -> float:
  """How long any of the spans `work` ran (their union), in us."""
  return _busy_us([interval(e) for e in work])


def is_transfer(e: dict) -> bool:
  """A copy or fill on a GPU's stream: device work, but not a kernel."""
  return e["name"].startswith(_TRANSFERS)


def trace_summary(events: list[dict], steps: int, device: bool) -> dict:
  """Per step: the kernels' time, their number and their union with the
  transfers (the device's busy time), the host's dispatch time, and the time
  by kernel kind.

  The kernels are `device_work`'s spans, the memory copies and fills among
  them counted apart. Kinds drop the number of the name, so the kinds of
  two compiled steps can be compared. Dispatch is the median of the host's
  `PjitFunction(...)` spans: the jitted call, from Python until the work is
  enqueued. A trace without kernels or dispatch spans is refused, with the
  process and line names it has.
  """
  work, process, thread = device_work(events, device)
  spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
  kernels = [e for e in work if not is_transfer(e)]
  dispatch = [e["dur"] for e in spans if e["name"].startswith("PjitFunction(")]
  if not kernels or not dispatch:
    missing = "device kernels" if not kernels else "PjitFunction spans"
    raise ValueError(
      f"the trace has no {missing}; it has {lines_seen(process, thread)}"
    )
  by_kind: dict[str, float] = {}
  for e in work:
    kind = _kind(e)
    by_kind[kind] = by_kind.get(kind, 0.0) + e["dur"] / steps
  return {
    "kernels_per_step": len(kernels) / steps,
    "transfers_per_step": (len(work) - len(kernels)) / steps,
    "kernel_us_per_step": sum(e["dur"] for e in kernels) / steps,
    "busy_us_per_step": busy_us(work) / steps,
    "dispatch_us_per_call": statistics.median(dispatch),
    "by_kind_us": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
    "lines": sorted(
      {thread.get((e["pid"], e["tid"]), str(e["tid"])) for e in work}
    ),
  }


def profile_main(args, steps, make_params, x, y) -> dict:
  """Each step warmed up and timed without the profiler, then
  `args.profile_steps` of its steps traced (in rounds of
  `args.steps_per_round`) into DIR/<step>, and summarized."""
  root = pathlib.Path(args.profile)
  on_device = jax.devices()[0].platform != "cpu"
  rounds = args.profile_steps // args.steps_per_round
  n = rounds * args.steps_per_round
  profiles = {}
  for name, (init, step) in steps.items():
    params = make_params()
    state = (params, init(params))
    for _ in range(args.warmup):
      state = step(*state, x, y)
    jax.block_until_ready(state)

    def timed(state, step=step):
      t0 = time.perf_counter()
      for _ in range(rounds):
        state = run_round(step, state, x, y, args)
      return state, 1e6 * (time.perf_counter() - t0) / n

    state, unprofiled = timed(state)
    with jax.profiler.trace(str(root / name), create_perfetto_trace=True):
      state, wall = timed(state)
    summary = trace_summary(read_trace(root / name), n, device=on_device)
    summary.update(
      wall_us_per_step=wall, unprofiled_us_per_step=unprofiled, steps=n
    )
    profiles[name] = summary
    print(
      f"{name}: wall {wall:.0f} us/step ({unprofiled:.0f} unprofiled),"
      f" kernels {summary['kernels_per_step']:.1f}, busy"
      f" {summary['busy_us_per_step']:.0f} us, dispatch"
      f" {summary['dispatch_us_per_call']:.0f} us",
      flush=True,
    )
  return {
    "what": f"profile of the {_subject(args)}",
    "batch": args.batch,
    "steps_per_round": args.steps_per_round,
    "profiles": profiles,
    "trace_dir": str(root),
    **deviceless.provenance(None),
  }


def _extra_kinds(ours: dict, base: dict, name: str, top: int = 6) -> str:
  """The kernel kinds where ours spends the most time over `base`, and
  those where it spends the most less."""
  kinds = set(ours["by_kind_us"]) | set(base["by_kind_us"])
  diff = {
    k: ours["by_kind_us"].get(k, 0.0) - base["by_kind_us"].get(k, 0.0)
    for k in kinds
  }
  more = sorted((kv for kv in diff.items() if kv[1] > 0), key=lambda kv: -kv[1])
  less = sorted((kv for kv in diff.items() if kv[1] < 0), key=lambda kv: kv[1])
  ratios = ", ".join(
    f"{what} {md.ratio(ours[key] / base[key])}"
    for what, key in (
      ("unprofiled", "unprofiled_us_per_step"),
      ("traced", "wall_us_per_step"),
      ("kernel time", "kernel_us_per_step"),
    )
  )
  text = f"ours / {name}: {ratios}. Ours over {name}, us per step: " + (
    ", ".join(f"`{k}` +{d:.0f}" for k, d in more[:top]) or "nothing"
  )
  if less:
    text += "; less: " + ", ".join(f"`{k}` {d:.0f}" for k, d in less[:3])
  return text + "."


def profile_table(results: dict) -> str:
  """Per machine and step: wall time, dispatch, device busy time and kernels
  per step, then the kernel kinds where ours spends more than plain and
  than skip-only."""
  runs = [r for r in results.values() if "profiles" in r]
  if not runs:
    return md.not_measured("benchmarks/overhead.py --profile")
  rows, notes = [], []
  for r in runs:
    prof = r["profiles"]
    label = f"{r['device'].split(',')[0]}, {r['what'].split(' of the ')[1]}"
    if r["what"].endswith("train step"):
      label += f", batch {r['batch']}"
    label += _per_wait(r)
    for name, p in prof.items():
      rows.append(
        [
          label,
          name,
          f"{p['unprofiled_us_per_step']:.0f}",
          f"{p['wall_us_per_step']:.0f}",
          f"{p['dispatch_us_per_call']:.0f}",
          f"{p['busy_us_per_step']:.0f}",
          f"{p['kernel_us_per_step']:.0f}",
          f"{p['kernels_per_step']:.0f}"
          + (
            f" (+{p['transfers_per_step']:.0f} copies)"
            if p["transfers_per_step"]
            else ""
          ),
        ]
      )
    for base in ("plain", "skip-only"):
      if "ours" in prof and base in prof:
        notes.append(f"{label}: {_extra_kinds(prof['ours'], prof[base], base)}")
  table = md.table(
    [
      "machine, what",
      "step",
      "us/step unprofiled",
      "us/step traced",
      "dispatch us/call",
      "device busy us/step",
      "kernel time us/step",
      "kernels/step",
    ],
    rows,
  )
  return "\n\n".join([table, *notes])


def timing_main(args, steps, base, make_params, x, y) -> dict:
  """Each step warmed up, then timed side by side (`timing.seconds_per_step`:
  `args.steps` rounds of `args.steps_per_round` steps, rotated order)."""
  state = {}
  for name, (init, step) in steps.items():
    params = make_params()
    state[name] = (params, init(params))
    for _ in range(args.warmup):
      state[name] = step(*state[name], x, y)
    jax.block_until_ready(state[name])

  def one_round(name):
    state[name] = run_round(steps[name][1], state[name], x, y, args)

  median = timing.seconds_per_step(
    steps, one_round, args.steps, args.steps_per_round
  )
  shapes = jax.eval_shape(make_params)  # counted, not allocated again
  result = {
    "what": "optimizer update only" if args.update_only else "full train step",
    "params": sum(int(p.size) for p in jax.tree.leaves(shapes)),
    "param_dtype": jnp.dtype(jax.tree.leaves(shapes)[0].dtype).name,
    "batch": args.batch,
    "rounds": args.steps,
    "steps_per_round": args.steps_per_round,
    "median_ms": {k: round(v * 1e3, 3) for k, v in median.items()},
    f"ratio_vs_{base}": {
      k: round(v / median[base], 4) for k, v in median.items()
    },
    "skipped_steps_ours": int(
      jmp_train.train_metrics(state["ours"][1])["skipped_steps"]
    ),
    "device": f"{jax.devices()[0].device_kind}, {jax.device_count()} device(s), "
    f"{platform.machine()}",
    "jax": jax.__version__,
    "optax": optax.__version__,
  }
  print(json.dumps(result, indent=1))
  print(f"\n| step | median ms | ratio vs {base} |\n|---|---|---|")
  for name, sec in median.items():
    print(f"| {name} | {sec * 1e3:.2f} | {sec / median[base]:.3f}x |")
  return result


def main(argv=None):
  args = parse_args(argv)
  topo = deviceless.start(args.target)
  dims = [int(d) for d in args.dims.split(",")]
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((args.batch, dims[0])), jnp.float32)
  y = jnp.asarray(rng.integers(0, dims[-1], args.batch))
  if args.bf16_params:
    steps, base = make_master_steps(args.update_only), "hand-masters"
  else:
    steps, base = make_steps(args.update_only, args.study), "plain"
  dtype = jnp.bfloat16 if args.bf16_params else jnp.float32

  def make_params():  # a fresh tree each time: the steps donate theirs
    mlp = init_mlp(dims, jax.random.key(0))
    return jax.tree.map(lambda p: p.astype(dtype), mlp)

  if args.profile:
    result = profile_main(args, steps, make_params, x, y)
    print(profile_table({"p": result}))
  elif args.kernels:
    if topo:  # arguments placed on the target's GPU, as shapes
      place = functools.partial(deviceless.abstract, topo=topo)
      params, x, y = place(jax.eval_shape(make_params)), place(x), place(y)
    else:
      params, place = make_params(), None
    result = kernels_main(args, steps, params, x, y, place)
    print(kernels_table({"k": result}))
  else:
    result = timing_main(args, steps, base, make_params, x, y)
  if args.json:
    md.write_json(args.json, result)
  return result


if __name__ == "__main__":
  main()
