"""What the benchmark scripts share to write their results: the JSON file
(`write_json`) and the markdown helpers of their tables (`md.table`)."""

import gzip
import json
import pathlib


def _whole(path: pathlib.Path, write) -> None:
  """`write(tmp)` to a file beside `path`, then that file renamed over it:
  a run killed while writing (a GPU job's time limit) keeps the whole file
  `path` had."""
  tmp = path.with_name(path.name + ".tmp")
  write(tmp)
  tmp.replace(path)


def write_json(path, result: dict) -> None:
  """`result` as JSON at `path` (a str or path), whole or not at all."""
  _whole(
    pathlib.Path(path), lambda t: t.write_text(json.dumps(result, indent=1))
  )


def write_hlo(path, hlo: str) -> None:
  """A compiled program's HLO text, gzipped, at `path` (its folder made if
  missing), whole or not at all: what a GPU compiled after autotuning (which
  GEMMs went to cuBLAS, their workspaces, the fusions), for a session
  without the chip to read."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  _whole(path, lambda t: t.write_bytes(gzip.compress(hlo.encode())))


def table(header: list[str], rows: list[list]) -> str:
  """A markdown table: a header row, the separator, one line per row."""
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return "\n".join(lines)


def ratio(value: float) -> str:
  """A ratio as the page writes it: `1.027x`."""
  return f"{value:.3f}x"


def verdict(ok: bool) -> str:
  """A goal's verdict, computed from the numbers."""
  return "**met**" if ok else "**not met**"


def not_measured(what: str) -> str:
  """The line a table writes in place of results that were not saved."""
  return f"Not measured: no saved results for {what}."
