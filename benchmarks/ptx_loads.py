"""How XLA:GPU's own kernels read memory: each kernel's global loads and
stores by width, from the PTX an XLA dump holds, beside the bytes it moves.

A kernel that reads bfloat16 one value at a time (`ld.global.b16`) issues
four load instructions where one that reads four at once (`ld.global.v4.b16`)
issues one; on the H200 the log-sum-exp of GPT-2's logits, read so, moved
1.6 TB/s where its other large kernels moved 3 to 4. The PTX says which
kernels read so without a chip: compile for a target on a machine without
one (`benchmarks/deviceless.py`) with the dump on,

  gpt2.py --kernels --target h200 ... \\
    --xla-flags="--xla_dump_to=DIR --xla_dump_emitter_re=.*"

(jax 0.11 writes the PTX only with `--xla_dump_emitter_re`; 0.10 with
`--xla_dump_to` alone), then

  python benchmarks/ptx_loads.py DIR [--module jit_step] [--top 25]

For each module of DIR whose name holds `--module`, its XLA fusions (each a
kernel on the GPU; fusions of the same body share one kernel, named after
one of them, as `device_time` matches them), grouped so: where the HLO's
metadata puts them (`device_time.label`, merged over the group), how many
launches a call makes, the megabytes they move per call (their operands and
results, `overhead.kernel_lines`: an upper bound where a kernel reads a
slice or gathers), and the global load and store instructions of their
kernel's PTX by width (`b16` one 16-bit value, `v4.b16` four, `v2.b32` two
32-bit ones), as the code reads, not as often as it runs. A kernel XLA did
not write as PTX of its own (a library call, a Triton GEMM) is not listed.
"""

import argparse
import collections
import pathlib
import re

import device_time
import md
import overhead

# A PTX global load or store and its modifiers: `ld.global.nc.v4.b16`.
_ACCESS = re.compile(r"\b(ld|st)\.global((?:\.[\w:]+)+)")
_ENTRY = re.compile(r"\.entry\s+([\w$]+)\s*\(")
_HLO_SUFFIX = ".sm_9.0a_gpu_after_optimizations.txt"


def accesses(ptx: str) -> dict[str, collections.Counter]:
  """Each kernel (`.entry`) of a PTX text: its global loads and stores as a
  Counter of (`ld` or `st`, width), the width as PTX spells it: a type
  (`b16`), after its vector size where it has one (`v4.b16`)."""
  found = {}
  entries = list(_ENTRY.finditer(ptx))
  ends = [m.start() for m in entries[1:]] + [len(ptx)] * bool(entries)
  for entry, end in zip(entries, ends, strict=True):
    count = collections.Counter()
    for kind, modifiers in _ACCESS.findall(ptx[entry.start() : end]):
      parts = modifiers.strip(".").split(".")
      vector = [p for p in parts if re.fullmatch(r"v\d+", p)]
      dtype = parts[-1]
      count[kind, ".".join([*vector, dtype])] += 1
    found[entry[1]] = count
  return found


def _widths(count: collections.Counter, kind: str) -> str:
  """`accesses`'s loads (`ld`) or stores (`st`) of one kernel, as text:
  `13 b16`, `2 b32, 1 v4.b16`; `none` for none."""
  items = sorted((w, n) for (k, w), n in count.items() if k == kind)
  return ", ".join(f"{n} {w}" for w, n in items) or "none"


def kernels(hlo_text: str, ptx: dict[str, collections.Counter]) -> list[dict]:
  """The fusions of a compiled module grouped by the kernel XLA:GPU
  compiled for them (`device_time._body_key`), each group whose kernel is
  in `ptx` (`accesses` of the module's PTX) as a dict: its label, kernel
  name, launches and megabytes moved per call, loads and stores (text,
  `_widths`); most megabytes first."""
  found, comps = overhead.kernel_lines(hlo_text)
  groups = {}
  for op, size, line in found:
    if op != "fusion":
      continue
    name = line.split("=", 1)[0].split()[-1].lstrip("%")
    key = device_time._body_key(line, comps) or name
    groups.setdefault(key, []).append((name, line, size))
  rows = []
  for members in groups.values():
    names = [device_time.kernel_name(n) for n, _, _ in members]
    kernel = next((n for n in names if n in ptx), None)
    if kernel is None:
      continue
    rows.append(
      {
        "label": device_time.merged_label(
          [device_time.label(n, line) for n, line, _ in members]
        ),
        "kernel": kernel,
        "launches": len(members),
        "mbytes": sum(size for _, _, size in members) / 1e6,
        "loads": _widths(ptx[kernel], "ld"),
        "stores": _widths(ptx[kernel], "st"),
      }
    )
  return sorted(rows, key=lambda r: -r["mbytes"])


def read_dump(folder, module: str) -> dict[str, list[dict]]:
  """`kernels` of each module in an XLA dump `folder` whose name holds
  `module`, by the module's file prefix (`module_0711.jit_step`)."""
  folder = pathlib.Path(folder)
  out = {}
  for hlo in sorted(folder.glob(f"*{_HLO_SUFFIX}")):
    prefix = hlo.name[: -len(_HLO_SUFFIX)]
    if module not in prefix:
      continue
    ptx = {}
    for f in sorted(folder.glob(f"{prefix}.*.ptx")):
      ptx |= accesses(f.read_text())
    out[prefix] = kernels(hlo.read_text(), ptx)
  return out


def table(rows: list[dict], top: int) -> str:
  """`kernels`'s first `top` rows as a markdown table."""
  cells = [
    [
      r["label"],
      r["launches"],
      f"{r['mbytes']:,.0f}",
      r["loads"],
      r["stores"],
      r["kernel"],
    ]
    for r in rows[:top]
  ]
  header = ["where", "launches", "MB moved", "global loads (PTX)"]
  return md.table(header + ["stores", "kernel"], cells)


def main(argv=None) -> dict[str, list[dict]]:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("dump", help="the folder of --xla_dump_to")
  p.add_argument(
    "--module",
    default="jit_step",
    help="the modules whose file names hold this (default: jit_step)",
  )
  p.add_argument("--top", type=int, default=25)
  args = p.parse_args(argv)
  found = read_dump(args.dump, args.module)
  if not found:
    p.error(
      f"no module of {args.dump} holds {args.module!r} (looked for"
      f" *{_HLO_SUFFIX})"
    )
  for prefix, rows in found.items():
    if not rows:
      print(f"{prefix}: no PTX of XLA's own kernels in the dump")
      continue
    print(f"{prefix}:\n\n{table(rows, args.top)}\n")
  return found


if __name__ == "__main__":
  main()
