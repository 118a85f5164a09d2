"""Where a step's device time goes: a profiler trace read against the
compiled HLO of the program that ran.

Each kernel of the trace gets a class (`CLASSES`: matmul, attention,
reduction, elementwise, copy, other) and a label: where in the model its HLO
metadata (`op_name`) puts it, in the forward pass (`fwd`), the backward pass
(`bwd`) or neither (`step`: the loss's outer part, the optimizer update), so
that a step's time reads per kind of work and per layer.

A kernel is found in the HLO by the instruction the trace names (`hlo_op`:
XLA:CPU's thunks, a GPU's kernels launched one by one), else by its own
name: XLA names a fusion's kernel after the fusion (`loop_add_fusion_3` for
`%loop_add_fusion.3`), which is what a GPU's trace shows inside a CUDA graph,
where `hlo_op` names the graph. A kernel a library launched inside a graph
(cuBLAS, cuDNN) has a library name: it is classed by that name and labelled
as a library kernel.

PyTorch's side (`torch_summary`) has no HLO: its kernels are classed by
their names, which say what they are (Inductor's `triton_poi_` pointwise,
`triton_red_` and `triton_per_` reductions, cuBLAS's and flash attention's
kernels), and labelled by them.
"""

import re

import overhead

CLASSES = ("matmul", "attention", "reduction", "elementwise", "copy", "other")

# Library kernels by name, the attention's first: cuDNN's flash attention
# kernels may name the tensor-core instructions a GEMM's name has too.
_LIBRARY = (
  ("attention", re.compile(r"fmha|sdpa|flash|attention", re.I)),
  ("matmul", re.compile(r"gemm|xmma|cutlass|cublas|matmul|splitk", re.I)),
  ("copy", re.compile(r"memcpy|memset", re.I)),
)
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
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
    for called in _CALLS.findall(line):
      if _holds(comps, called, pattern, seen):
        return True
  return False


_DOT = re.compile(r"\s(dot|convolution|scaled-dot)\(")
_REDUCE = re.compile(r"\s(reduce|reduce-window)\(")
_ATTENTION = re.compile(r'custom_call_target="[^"]*(fmha|flash)', re.I)


def hlo_class(op: str, line: str, comps: dict) -> str:
  """The `CLASSES` entry of one instruction of a compiled module."""
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
  if op == "fusion":
    body = _CALLS.search(line)[1]
    if _holds(comps, body, _DOT):
      return "matmul"
    if _holds(comps, body, _ATTENTION):
      return "attention"
    if _holds(comps, body, _REDUCE):
      return "reduction"
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
  return f"{where} {'/'.join(parts[-3:])}"


def hlo_index(hlo_text: str) -> dict[str, tuple[str, str]]:
  """Each instruction of a compiled module, under its HLO name and the name
  XLA gives its kernel (the number after `_`), as (class, label)."""
  _, comps = overhead.kernel_lines(hlo_text)
  index = {}
  for name, (op, line) in overhead.instructions(comps).items():
    found = (hlo_class(op, line, comps), label(name, line))
    index[name] = found
    index.setdefault(re.sub(r"\.(\d+)$", r"_\1", name), found)
  return index


def locate(e: dict, index: dict) -> tuple[str, str]:
  """A trace span's (class, label): by the instruction it names, by its own
  name, else by a library's kernel name."""
  op = e.get("args", {}).get("hlo_op")
  if op in index:
    return index[op]
  if e["name"] in index:
    return index[e["name"]]
  if overhead.is_transfer(e):
    return "copy", "memcpy and memset"
  for cls, pattern in _LIBRARY:
    if pattern.search(e["name"]):
      return cls, f"{cls} (library kernels)"
  return "other", re.sub(r"[._]\d+$", "", e["name"])


def _longest(by_label: dict[str, float], top: int) -> dict[str, float]:
  """The `top` labels that took longest, longest first, and the rest summed
  as `other labels`."""
  ranked = sorted(by_label.items(), key=lambda kv: -kv[1])
  labels = dict(ranked[:top])
  if len(ranked) > top:
    labels["other labels"] = sum(us for _, us in ranked[top:])
  return labels


def summary(
  events: list[dict], hlo_text: str, steps: int, device: bool, top: int = 12
) -> dict:
  """Per step: the device's time by class and by label (the `top` labels
  that took longest, the rest summed as `other labels`), its busy time (the
  union of its spans) and how many kernels it ran. `hlo_text` is the
  compiled module the trace ran; `device` as `overhead.device_work`'s.

  Raises:
    ValueError: for a trace without device work.
  """
  work, process, thread = overhead.device_work(events, device)
  if not work:
    seen = overhead.lines_seen(process, thread)
    raise ValueError(f"the trace has no device kernels; it has {seen}")
  index = hlo_index(hlo_text)
  by_class = dict.fromkeys(CLASSES, 0.0)
  by_label: dict[str, float] = {}
  named = 0
  for e in work:
    cls, where = locate(e, index)
    by_class[cls] += e["dur"] / steps
    by_label[where] = by_label.get(where, 0.0) + e["dur"] / steps
    named += e.get("args", {}).get("hlo_op") in index or e["name"] in index
  labels = _longest(by_label, top)
  return {
    "steps": steps,
    "kernels_per_step": len(work) / steps,
    "found_in_hlo": named / len(work),
    "kernel_us_per_step": sum(e["dur"] for e in work) / steps,
    "busy_us_per_step": overhead.busy_us(work) / steps,
    "by_class_us": by_class,
    "by_label_us": labels,
  }


# PyTorch's kernels by name, in order: a CUDA kernel's (Inductor's Triton
# kernels, cuBLAS, flash attention, the fused optimizer's), or on a CPU the
# aten op's.
_TORCH = (
  ("attention", re.compile(r"fmha|sdpa|flash|attention", re.I)),
  (
    "matmul",
    re.compile(
      r"gemm|xmma|cutlass|cublas|triton_tem_|aten::(mm|addmm|bmm|matmul)$",
      re.I,
    ),
  ),
  (
    "reduction",
    re.compile(
      r"triton_(red|per)_|reduce|norm|softmax|non_finite"
      r"|aten::(sum|mean|amax|max|min)$",
      re.I,
    ),
  ),
  ("copy", re.compile(r"memcpy|memset|aten::(copy_|_to_copy|clone)$", re.I)),
  (
    "elementwise",
    re.compile(r"triton_poi_|elementwise|multi_tensor|adam|aten::", re.I),
  ),
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
  directly on its line (an aten op's calls to others). Spans that hold none,
  as a GPU's kernels, keep their whole length."""
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
  by_class = dict.fromkeys(CLASSES, 0.0)
  by_label: dict[str, float] = {}
  own = self_times(work)
  for e, us in own:
    name = e["name"]
    cls = "copy" if e.get("cat") in _TORCH_DEVICE[1:] else torch_class(name)
    by_class[cls] += us / steps
    where = re.sub(r"(_\d+)+$", "", name)
    by_label[where] = by_label.get(where, 0.0) + us / steps
  return {
    "steps": steps,
    "kernels_per_step": len(work) / steps,
    "found_in_hlo": None,
    "kernel_us_per_step": sum(us for _, us in own) / steps,
    "busy_us_per_step": overhead.busy_us(work) / steps,
    "by_class_us": by_class,
    "by_label_us": _longest(by_label, top),
  }
