"""Where a step's device time goes: a profiler trace read against the
compiled HLO of the program that ran.

Each kernel of the trace gets a class (`CLASSES`: matmul, attention,
reduction, elementwise, copy, other) and a label: where in the model its HLO
metadata (`op_name`) puts it, in the forward pass (`fwd`), the backward pass
(`bwd`) or neither (`step`: the loss's outer part, the optimizer update), so
that a step's time reads per kind of work and per layer.

A kernel is found in the HLO by the instruction the trace names (`hlo_op`:
XLA:CPU's thunks, a GPU's kernels launched one by one), else by its own
name, which is what a GPU's trace shows inside a CUDA graph, where `hlo_op`
names the graph: XLA:GPU names a fusion's kernel after the fusion, every
character but letters, digits and `_` as `_` (`loop_add_fusion_3` for
`%loop_add_fusion.3`), and compiles fusions of the same body once, the
kernel named after the first. So a kernel's name says which body, not which
of the fusions that share it ran: such fusions share one label, merged from
theirs (`merged_label`), and their class, which the body decides. A kernel
a library launched inside a graph (cuBLAS, cuDNN) has a library name: it is
classed by that name and labelled as a library kernel.

PyTorch's side (`torch_summary`) has no HLO: its kernels are classed by
their names, which say what they are (Inductor's `triton_poi_` pointwise,
`triton_red_` and `triton_per_` reductions, cuBLAS's and flash attention's
kernels), and labelled by them.
"""

import os
import re

import overhead

CLASSES = ("matmul", "attention", "reduction", "elementwise", "copy", "other")

# Library kernels by name, the attention's first: cuDNN's flash attention
# kernels may name the tensor-core instructions a GEMM's name has too.
# cuBLAS 12.8 and later name Hopper's GEMMs `nvjet_...`.
_GEMM = r"gemm|xmma|cutlass|cublas|matmul|splitk|nvjet|gemv|conv(?!ert)"
_LIBRARY = (
  ("attention", re.compile(r"fmha|sdpa|flash|attention", re.I)),
  ("matmul", re.compile(_GEMM, re.I)),
  ("reduction", re.compile(r"cudnn\$norm", re.I)),
  ("copy", re.compile(r"memcpy|memset", re.I)),
)
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_FUSION_KIND = re.compile(r"kind=(k\w+)")
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
# Path parts of an op_name that say how, not where: the wrappers' frames,
# remat's, and functions named with a leading underscore (jit(_where)).
_HOW = re.compile(
  r"^(_|checkpoint$|remat$|rematted_computation$|module$"
  r"|jmp_train_policy_override$)"
)
_TRANSFORMED = re.compile(r"\w+\((.*)\)")


def _holds(comps: dict, comp: str, pattern: re.Pattern, seen=None) -> bool:
  """Whether computation `comp`, or one it calls, has a line `pattern`
  matches."""
  seen = set() if seen is None else seen
  if comp in seen:
    return False
  seen.add(comp)
  for line in comps.get(comp, []):
    if pattern.search(line):
      return True
    for called in overhead.called_computations(line):
      if _holds(comps, called, pattern, seen):
        return True
  return False


_DOT = re.compile(
  r"\s(dot|convolution|scaled-dot)\(|custom_call_target=\"__cublas"
)
_REDUCE = re.compile(r"\s(reduce|reduce-window)\(")
_ATTENTION = re.compile(r'custom_call_target="[^"]*(fmha|flash)', re.I)
_BODIES = (("matmul", _DOT), ("attention", _ATTENTION), ("reduction", _REDUCE))


def hlo_class(op: str, line: str, comps: dict) -> str:
  """The `CLASSES` entry of one instruction of a compiled module. A fusion,
  and a call, loop or conditional (XLA:CPU runs a small call as one thunk),
  by what the computations it calls hold."""
  if op in ("dot", "convolution", "scaled-dot"):
    return "matmul"
  if op == "custom-call":
    target = _TARGET.search(line)
    for cls, pattern in _LIBRARY:
      if target and pattern.search(target[1]):
        return cls
    return "other"
  if op in ("reduce", "reduce-window"):
    return "reduction"
  if op.startswith("copy"):
    return "copy"
  if op == "fusion" or op in overhead.HOLDERS:
    called = overhead.called_computations(line)
    for cls, pattern in _BODIES:
      if any(_holds(comps, c, pattern) for c in called):
        return cls
    kind = _FUSION_KIND.search(line)
    return "other" if kind and kind[1] == "kCustom" else "elementwise"
  if op.startswith(("all-", "collective", "reduce-scatter", "send", "recv")):
    return "other"
  return "elementwise"


def label(name: str, line: str) -> str:
  """Where an instruction's `op_name` puts it: `fwd`, `bwd` or `step`, then
  the last three parts of its path, each transformation's scope kept without
  the transformation (`jvp(cross_entropy)`: `cross_entropy`), wrappers'
  frames left out and layer numbers as `*` (`bwd block*/attn/dot_general`);
  without metadata, its name less the number."""
  m = _OP_NAME.search(line)
  if not m:
    return re.sub(r"[._]\d+$", "", name)
  path = m[1]
  where = "bwd" if "transpose(" in path else "fwd" if "jvp(" in path else "step"
  parts = []
  for part in path.split("/")[1:]:  # not the step's own jit(...)
    while t := _TRANSFORMED.fullmatch(part):  # jvp(cross_entropy): its scope
      part = t[1]
    part = re.sub(r"block\d+", "block*", part)
    if not part or _HOW.search(part) or (parts and parts[-1] == part):
      continue
    if parts and part.startswith(parts[-1] + "."):  # block*, block*._fc_gelu
      parts[-1] = part
    else:
      parts.append(part)
  return " ".join([where, "/".join(parts[-3:])]).rstrip()


def merged_label(labels: list[str]) -> str:
  """One label for the fusions that share a kernel: theirs where they agree.
  Else the passes they are in, then: the path where they differ in the pass
  alone; where their paths differ in one part alone, that part as what its
  values start with up to a `_` or `.`, and `*` (`block*/LayerNorm_*/rsqrt`);
  otherwise the parts their paths end with alike and how many places
  (`.../rsqrt (3 places)`). A label without metadata (a name alone) has no
  pass."""
  unique = sorted(set(labels))
  if len(unique) == 1:
    return unique[0]
  split = [x.split(" ", 1) if " " in x else ["", x] for x in unique]
  where = "|".join(sorted({w for w, _ in split} - {""}))
  paths = [p.split("/") for _, p in split]
  columns = list(zip(*paths, strict=False))
  differ = [i for i, c in enumerate(columns) if len(set(c)) > 1]
  if len({len(p) for p in paths}) == 1 and len(differ) <= 1:
    parts = list(paths[0])
    if differ:
      start = os.path.commonprefix(columns[differ[0]])
      cut = max(start.rfind("_"), start.rfind(".")) + 1
      parts[differ[0]] = start[:cut] + "*"
    return f"{where} {'/'.join(parts)}".strip()
  tail = []
  for column in zip(*(reversed(p) for p in paths), strict=False):
    if len(set(column)) > 1:
      break
    tail.insert(0, column[0])
  if any(tail):
    return f"{where} .../{'/'.join(tail)} ({len(unique)} places)".strip()
  return ", ".join(filter(None, [where, f"{len(unique)} places"]))


_DEFINES = re.compile(r"\s*(?:ROOT\s+)?%([\w.\-]+)\s*=")


def _canonical(lines: list[str]) -> list[str]:
  """A computation's lines, metadata left out, each value named by its place
  (`%v0`, `%v1`, ...) and the computations they call as `%c` (their own
  lines follow in `body_key`)."""
  lines = [re.sub(r",\s*metadata=\{[^}]*\}", "", x) for x in lines]
  place = {}
  for x in lines:
    if m := _DEFINES.match(x):
      place[m[1]] = f"%v{len(place)}"
  for x in lines:
    for called in overhead.called_computations(x):
      place.setdefault(called, "%c")
  out = [
    re.sub(r"%([\w.\-]+)", lambda m: place.get(m[1], m[0]), x) for x in lines
  ]
  return [x.strip() for x in out]


def body_key(line: str, comps: dict) -> tuple[str, str] | None:
  """What XLA:GPU's kernel reuse compares of a fusion, as near as its text
  says: the result's shape and the fused computations (`_canonical`), so
  that two bodies match where they compute the same from the same operands.
  None for an instruction that is not a fusion, or whose computations are
  not all in `comps`."""
  called = overhead.called_computations(line)
  if " fusion(" not in line or not called:
    return None
  text, todo, seen = [], called, set()
  while todo:
    comp = todo.pop(0)
    if comp in seen:
      continue
    if comp not in comps:
      return None
    seen.add(comp)
    todo += [c for x in comps[comp] for c in overhead.called_computations(x)]
    text += _canonical(comps[comp])
  return line.split("=", 1)[1].split(" fusion(")[0], "\n".join(text)


def kernel_name(name: str) -> str:
  """The name XLA:GPU gives an instruction's kernel: every character but
  ASCII letters, digits, `_` and `$` as `_`."""
  return re.sub(r"[^A-Za-z0-9_$]", "_", name)


def hlo_index(hlo_text: str) -> tuple[dict, dict, dict]:
  """Each instruction of a compiled module, as (class, label), in three
  maps: by its HLO name (a trace's `hlo_op`), by its kernel's name
  (`kernel_name`; fusions of the same body, XLA:GPU's one kernel, share
  `merged_label` of theirs), and the instructions that hold others (calls,
  loops, conditionals) by their HLO names apart: XLA:CPU runs a small call
  as one thunk that names it, where a GPU's trace names a CUDA graph's call
  as each of its kernels' `hlo_op` (`summary` finds those by their own
  names)."""
  _, comps = overhead.kernel_lines(hlo_text)
  by_hlo, holders, shared = {}, {}, {}
  for name, (op, line) in overhead.instructions(comps).items():
    found = (hlo_class(op, line, comps), label(name, line))
    if op in overhead.HOLDERS:
      holders[name] = found
      continue
    by_hlo[name] = found
    shared.setdefault(body_key(line, comps) or name, []).append(name)
  by_kernel = {}
  for names in shared.values():
    merged = merged_label([by_hlo[n][1] for n in names])
    for n in names:
      by_kernel.setdefault(kernel_name(n), (by_hlo[n][0], merged))
  return by_hlo, by_kernel, holders


def kernel_bytes(hlo_text: str) -> dict[str, int]:
  """The bytes each kernel of a compiled module moves per launch: its
  instruction's operands and result (`overhead.kernel_list`'s count, an
  upper bound where a kernel reads a slice), by the instruction's name (an
  XLA:CPU trace's) and by its kernel's (`kernel_name`, a GPU trace's
  inside a CUDA graph). Fusions that share a body, and so one kernel on a
  GPU, move the same bytes per launch: what the launches of the one name
  move is its bytes times their number."""
  moved = {}
  for _, size, line in overhead.kernel_lines(hlo_text)[0]:
    if m := _DEFINES.match(line):
      moved.setdefault(kernel_name(m[1]), size)
      moved[m[1]] = size
  return moved


def _add_speed(kernels: list[dict], moved: dict[str, int]) -> None:
  """Gives each of `_totals`'s kernels by name that `moved` (`kernel_bytes`)
  has the megabytes its launches move per step and the speed they moved
  them at (TB/s)."""
  for k in kernels:
    if k["name"] in moved and k["us"] > 0:
      per_step = moved[k["name"]] * k["per_step"]
      k["mbytes"] = per_step / 1e6
      k["tb_per_s"] = per_step / k["us"] / 1e6


def _in_hlo(e: dict, by_hlo: dict, by_kernel: dict, holders: dict):
  """A trace span's (class, label) from `hlo_index`'s maps: by the
  instruction it names (`hlo_op`), by its own name as a kernel's, by the
  call that holds it; None where the HLO does not have it."""
  op = e.get("args", {}).get("hlo_op")
  if op in by_hlo:
    return by_hlo[op]
  if e["name"] in by_kernel:
    return by_kernel[e["name"]]
  return holders.get(op)


def _by_name(e: dict) -> tuple[str, str]:
  """A span the HLO does not have: a copy or fill, or a library's kernel
  by its name."""
  if overhead.is_transfer(e):
    return "copy", "memcpy and memset"
  for cls, pattern in _LIBRARY:
    if pattern.search(e["name"]):
      return cls, f"{cls} (library kernels)"
  return "other", re.sub(r"[._]\d+$", "", e["name"])


def span_us(work: list[dict]) -> float:
  """From the first of the spans `work` to start to the last to end, in us:
  the device's time for the steps of a round once the first is under way,
  without the host's wait before it and after the last. Where the host
  stays ahead of the device, as a training loop that reads its metrics
  seldom runs, a step's share of it is the step's time; the gaps in it
  (span less busy time) are the device's own idle time between kernels."""
  ends = [overhead.interval(e) for e in work]
  return (max(b for _, b in ends) - min(a for a, _ in ends)) / 1000


# How many kernels, by name, a summary keeps (`kernels`): the traces are not
# committed, and a kernel's name is what ties a time to the compiled HLO.
TOP_KERNELS = 40


def _totals(timed: list, work: list[dict], steps: int, top: int) -> dict:
  """`summary`'s figures from each span's (own microseconds, class, label,
  kernel name) in `timed`: per step by class and by label (the `top`
  longest labels, the rest summed as `other labels`), the `TOP_KERNELS`
  longest kernels by name (launches and microseconds per step, class and
  label), the spans' number and summed time, the union of `work`'s spans
  (the busy time) and the time from the first's start to the last's end
  (`span_us`)."""
  by_class = dict.fromkeys(CLASSES, 0.0)
  by_label: dict[str, float] = {}
  by_name: dict[str, dict] = {}
  for us, cls, where, name in timed:
    by_class[cls] += us / steps
    by_label[where] = by_label.get(where, 0.0) + us / steps
    k = by_name.setdefault(
      name, {"name": name, "per_step": 0.0, "us": 0.0, "class": cls}
    )
    k["per_step"] += 1 / steps
    k["us"] += us / steps
    # A library's kernel may run for several instructions.
    k["label"] = where if k.get("label", where) == where else "(several)"
  ranked = sorted(by_label.items(), key=lambda kv: -kv[1])
  labels = dict(ranked[:top])
  if len(ranked) > top:
    labels["other labels"] = sum(us for _, us in ranked[top:])
  kernels = sorted(by_name.values(), key=lambda k: -k["us"])[:TOP_KERNELS]
  return {
    "steps": steps,
    "kernels_per_step": len(work) / steps,
    "kernel_us_per_step": sum(t[0] for t in timed) / steps,
    "busy_us_per_step": overhead.busy_us(work) / steps,
    "span_us_per_step": span_us(work) / steps,
    "by_class_us": by_class,
    "by_label_us": labels,
    "kernels": kernels,
  }


def summary(
  events: list[dict], hlo_text: str, steps: int, device: bool, top: int = 12
) -> dict:
  """Per step: the device's time by class and by label (the `top` labels
  that took longest, the rest summed as `other labels`), its busy time (the
  union of its spans), and its kernels' number and summed time, copies and
  fills among them (so the classes add up to it). `found_in_hlo` is the
  share of them found in the HLO by name (not a library's kernels, copies
  or fills). Of its longest kernels by name (`kernels`), XLA's own have the
  bytes they move per step and the speed they ran at (`kernel_bytes`).
  `hlo_text` is the compiled module the trace ran; `device` as
  `overhead.device_work`'s.

  Raises:
    ValueError: for a trace without device work.
  """
  work, process, thread = overhead.device_work(events, device)
  if not work:
    seen = overhead.lines_seen(process, thread)
    raise ValueError(f"the trace has no device kernels; it has {seen}")
  by_hlo, by_kernel, holders = hlo_index(hlo_text)
  if device:  # a GPU's call holds a CUDA graph's kernels: found by name
    holders = {}
  found = [_in_hlo(e, by_hlo, by_kernel, holders) for e in work]
  timed = [
    (e["dur"], *(f or _by_name(e)), e["name"])
    for e, f in zip(work, found, strict=True)
  ]
  in_hlo = sum(f is not None for f in found) / len(work)
  totals = _totals(timed, work, steps, top)
  _add_speed(totals["kernels"], kernel_bytes(hlo_text))
  return {**totals, "found_in_hlo": in_hlo}


# PyTorch's kernels by name, in order: Inductor's Triton kernels by their
# prefix first (their names go on with the ops they fused:
# `triton_poi_fused_native_layer_norm_backward_7` is pointwise;
# `triton_for_`, foreach), then the libraries' (cuBLAS, flash attention, the
# fused optimizer's), or on a CPU the aten op's.
_TORCH = (
  ("elementwise", re.compile(r"^triton_(poi|for)_")),
  ("reduction", re.compile(r"^triton_(red|per)_")),
  ("matmul", re.compile(r"^triton_tem_")),
  ("attention", re.compile(r"fmha|sdpa|flash|attention", re.I)),
  ("matmul", re.compile(_GEMM + r"|aten::(mm|addmm|bmm|matmul)$", re.I)),
  (
    "reduction",
    re.compile(
      r"reduce|norm|softmax|non_finite|aten::(sum|mean|amax|max|min)$", re.I
    ),
  ),
  ("copy", re.compile(r"memcpy|memset|aten::(copy_|_to_copy|clone)$", re.I)),
  ("elementwise", re.compile(r"elementwise|multi_tensor|adam|aten::", re.I)),
)
# The kinds of span torch.profiler's trace gives a GPU's kernels and copies.
_TORCH_DEVICE = ("kernel", "gpu_memcpy", "gpu_memset")


def torch_class(name: str) -> str:
  """The `CLASSES` entry of a PyTorch kernel (or aten op) by its name."""
  for cls, pattern in _TORCH:
    if pattern.search(name):
      return cls
  return "other"


def self_times(spans: list[dict]) -> list[tuple[dict, float]]:
  """Each span with its own time: its length less that of the spans it holds
  directly on its line (an aten op's calls to others). A span holds another
  that lies inside it; of two with the same interval, the first listed
  holds the second (one thread runs one op at a time: a call and what it
  called). Spans that overlap only in part each keep their whole length."""
  out = []
  by_line: dict[tuple, list[dict]] = {}
  for e in spans:
    by_line.setdefault((e["pid"], e["tid"]), []).append(e)
  for line in by_line.values():
    line.sort(key=lambda e: (e["ts"], -e["dur"]))
    held: list[list] = []  # [span, own time, end], the outermost first
    for e in line:
      start, end = overhead.interval(e)
      while held and held[-1][2] <= start:
        out.append(tuple(held.pop()[:2]))
      if held and end <= held[-1][2]:
        held[-1][1] -= e["dur"]  # inside the span below it
      held.append([e, e["dur"], end])
    out += [tuple(x[:2]) for x in reversed(held)]
  return out


def torch_summary(
  events: list[dict], steps: int, device: bool, top: int = 12
) -> dict:
  """`summary`'s figures for a torch.profiler trace (its Chrome trace's
  events). With `device` the kernels and copies on the GPU; without, the
  aten ops, each for its own time (`self_times`: a CPU's stand-in, ops
  rather than kernels). Labels are the names without their trailing
  numbers; `found_in_hlo` is None.

  Raises:
    ValueError: for a trace without kernels (or, on a CPU, ops).
  """
  kinds = _TORCH_DEVICE if device else ("cpu_op",)
  work = [e for e in events if e.get("ph") == "X" and e.get("cat") in kinds]
  if not work:
    seen = sorted({str(e.get("cat")) for e in events})
    raise ValueError(f"the trace has no kernels; its kinds of event: {seen}")
  # A GPU's kernels do not nest: two that overlap ran side by side.
  own = [(e, e["dur"]) for e in work] if device else self_times(work)
  timed = [
    (
      us,
      "copy" if e.get("cat") in _TORCH_DEVICE[1:] else torch_class(e["name"]),
      re.sub(r"(_\d+)+$", "", e["name"]),
      e["name"],
    )
    for e, us in own
  ]
  return {**_totals(timed, work, steps, top), "found_in_hlo": None}
