"""How XLA:GPU's own kernels read memory: each kernel's global loads and
stores by width, from the PTX an XLA dump holds, beside the bytes it moves.

A kernel that reads bfloat16 one value at a time (`ld.global.b16`) issues
four load instructions where one that reads four at once (`ld.global.v4.b16`)
issues one; on the H200 the log-sum-exp of GPT-2's logits, read so, moved
1.56 TB/s, where the slices of q, k and v, read in vectors, moved 3.99 (the
GELU's kernels, also read in vectors, 2.1 to 2.4: their arithmetic). The
PTX says which kernels read so without a chip: compile for a target on a
machine without one (`benchmarks/deviceless.py`) with the dump on,

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
32-bit ones), as the code reads, not as often as it runs; its atomic
reductions to global memory (`red`, `atom`) count with the stores. An
entry's PTX runs to the next `.entry` or `.func`: what a device function
it calls reads is not counted (XLA's fusion kernels inline theirs). A kernel
XLA did not write as PTX of its own (a library call, a Triton GEMM) is not
listed.
"""

import argparse
import collections
import pathlib
import re

import device_time
import md
import overhead
import timing

# A PTX global load, store or atomic and its modifiers:
# `ld.global.nc.v4.b16`, `red.global.add.f32`.
_ACCESS = re.compile(r"\b(ld|st|red|atom)\.global((?:\.[\w:]+)+)")
_ENTRY = re.compile(r"\.entry\s+([\w$]+)\s*\(")
_FUNCTION = re.compile(r"\.(?:entry|func)\s")
# The optimized HLO of a module as XLA:GPU dumps it: `<module>.sm_9.0a_gpu_
# after_optimizations.txt` for a Hopper target.
_HLO = re.compile(r"^(.+)\.sm_[\w.]+_gpu_after_optimizations\.txt$")


def accesses(ptx: str) -> dict[str, collections.Counter]:
  """Each kernel (`.entry`) of a PTX text: its global loads and stores as a
  Counter of (`ld` or `st`, width), the width as PTX spells it: a type
  (`b16`), after its vector size where it has one (`v4.b16`)."""
  found = {}
  starts = [m.start() for m in _FUNCTION.finditer(ptx)] + [len(ptx)]
  for entry in _ENTRY.finditer(ptx):
    end = min(x for x in starts if x > entry.start())
    count = collections.Counter()
    for kind, modifiers in _ACCESS.findall(ptx[entry.start() : end]):
      parts = modifiers.strip(".").split(".")
      vector = [p for p in parts if re.fullmatch(r"v\d+", p)]
      width = ".".join([*vector, parts[-1]])
      if kind in ("red", "atom"):  # with the stores, as what it does
        kind, width = "st", f"{kind}.{parts[-2]}.{parts[-1]}"
      count[kind, width] += 1
    found[entry[1]] = count
  return found


def _widths(count: collections.Counter, kind: str) -> str:
  """`accesses`'s loads (`ld`) or stores (`st`) of one kernel, as text:
  `13 b16`, `2 b32, 1 v4.b16`; `none` for none."""
  items = sorted((w, n) for (k, w), n in count.items() if k == kind)
  return ", ".join(f"{n} {w}" for w, n in items) or "none"


def kernels(hlo_text: str, ptx: dict[str, collections.Counter]) -> list[dict]:
  """The fusions of a compiled module grouped by the kernel XLA:GPU
  compiled for them (`device_time.body_key`), each group whose kernel is
  in `ptx` (`accesses` of the module's PTX) as a dict: its label, kernel
  name, launches and megabytes moved per call, loads and stores (text,
  `_widths`); most megabytes first."""
  found, comps = overhead.kernel_lines(hlo_text)
  groups = {}
  for op, size, line in found:
    if op != "fusion":
      continue
    name = line.split("=", 1)[0].split()[-1].lstrip("%")
    key = device_time.body_key(line, comps) or name
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
  for hlo in sorted(folder.iterdir()):
    name = _HLO.match(hlo.name)
    if not name or module not in name[1]:
      continue
    prefix = name[1]
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
  header = ["where", "launches", "MB moved", "global loads (PTX)", "stores"]
  return md.table([*header, "kernel"], cells)


def main(argv=None) -> dict[str, list[dict]]:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("dump", help="the folder of --xla_dump_to")
  p.add_argument(
    "--module",
    default="jit_step",
    help="the modules whose file names hold this (default: jit_step)",
  )
  p.add_argument(
    "--top", type=timing.count_arg, default=25, help="rows per module"
  )
  args = p.parse_args(argv)
  if not pathlib.Path(args.dump).is_dir():
    p.error(f"{args.dump} is not a folder (the one of --xla_dump_to)")
  found = read_dump(args.dump, args.module)
  if not found:
    p.error(
      f"no module of {args.dump} holds {args.module!r} (looked for"
      " <module>.sm_*_gpu_after_optimizations.txt)"
    )
  for prefix, rows in found.items():
    if not rows:
      print(
        f"{prefix}: no PTX of XLA's own kernels in the dump (jax 0.11 writes"
        " it only with --xla_dump_emitter_re=.* beside --xla_dump_to)"
      )
      continue
    print(f"{prefix}:\n\n{table(rows, args.top)}\n")
  return found


if __name__ == "__main__":
  main()
