"""Where the test suite's time goes: each test's wall time and JAX's compiles.

    JMP_TRAIN_COMPILE_REPORT=/tmp/report make test
    python tests/compile_report.py /tmp/report

With the variable set, conftest.py registers a `Recorder` in every pytest
process: a listener on JAX's compile events (`jax.monitoring`) that charges
tracing, lowering and XLA's compile to the test running, and writes one JSON
file per process (per xdist worker). The processes some tests start (the
examples, the multi-process runs) count in their test's wall time only.
Run as a script, it sums the files: totals, compiles by duration, the files
and the tests that take longest.
"""

import collections
import json
import os
import pathlib
import sys
import time

import jax
import pytest

# JAX's duration events, by the name of the column they add to.
EVENTS = {
  "/jax/core/compile/jaxpr_trace_duration": "trace_s",
  "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
  "/jax/core/compile/backend_compile_duration": "compile_s",
}
# Bounds of the compile-duration bins, in seconds.
BINS = (0.0, 0.2, 1.0, 4.0, float("inf"))


def _row():
  return {"wall_s": 0.0, "trace_s": 0.0, "lower_s": 0.0, "compile_s": 0.0} | {
    "compiles": []
  }


class Recorder:
  """The pytest plugin: per test, wall seconds and compile events."""

  def __init__(self, directory):
    self.directory = pathlib.Path(directory)
    self.current = None  # compiles outside any test are not charged
    self.tests = collections.defaultdict(_row)
    jax.monitoring.register_event_duration_secs_listener(self._event)

  def _event(self, event, duration, **_):
    column = EVENTS.get(event)
    if column is None or self.current is None:
      return
    row = self.tests[self.current]
    row[column] += duration
    if column == "compile_s":
      row["compiles"].append(duration)

  @pytest.hookimpl(hookwrapper=True)
  def pytest_runtest_protocol(self, item, nextitem):
    self.current = item.nodeid
    start = time.perf_counter()
    yield
    self.tests[item.nodeid]["wall_s"] += time.perf_counter() - start
    self.current = None

  def close(self):
    jax.monitoring.unregister_event_duration_listener(self._event)

  def pytest_unconfigure(self, config):
    self.close()

  def pytest_sessionfinish(self, session):
    if not self.tests:  # the xdist controller runs no test
      return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    self.directory.mkdir(parents=True, exist_ok=True)
    path = self.directory / f"{worker}.json"
    path.write_text(json.dumps(self.tests))


def load(directory) -> dict:
  """Every process's tests, merged."""
  tests = {}
  for path in sorted(pathlib.Path(directory).glob("*.json")):
    tests.update(json.loads(path.read_text()))
  return tests


def summarize(tests: dict) -> dict:
  """Totals, compiles by duration bin, and per-file sums."""
  columns = ("wall_s", "trace_s", "lower_s", "compile_s")
  total = {c: sum(t[c] for t in tests.values()) for c in columns}
  compiles = [d for t in tests.values() for d in t["compiles"]]
  total["compiles"] = len(compiles)
  bins = []
  for low, high in zip(BINS, BINS[1:], strict=False):
    inside = [d for d in compiles if low <= d < high]
    bins.append({"from_s": low, "to_s": high, "n": len(inside)})
    bins[-1]["seconds"] = sum(inside)
  files = collections.defaultdict(lambda: dict.fromkeys(columns, 0.0))
  for nodeid, t in tests.items():
    for c in columns:
      files[nodeid.split("::")[0]][c] += t[c]
  return {"total": total, "bins": bins, "files": dict(files)}


def _span(low, high):
  return (
    f"{low:g} s or more" if high == float("inf") else f"{low:g} to {high:g} s"
  )


def _seconds(row):
  trace_lower = row["trace_s"] + row["lower_s"]
  return f"{row['wall_s']:.1f} | {row['compile_s']:.1f} | {trace_lower:.1f}"


def report(tests: dict, top: int = 25) -> str:
  """The summary as markdown."""
  s = summarize(tests)
  t = s["total"]
  out = [
    f"{len(tests)} tests: {t['wall_s']:.1f} s in tests, {t['compile_s']:.1f} s"
    f" of it in {t['compiles']} XLA compiles, {t['trace_s'] + t['lower_s']:.1f}"
    " s tracing and lowering.",
    "",
    "| compile took | compiles | seconds |",
    "|---|---|---|",
  ]
  for b in s["bins"]:
    out.append(
      f"| {_span(b['from_s'], b['to_s'])} | {b['n']} | {b['seconds']:.1f} |"
    )
  out += [
    "",
    "| file | wall s | compile s | trace+lower s |",
    "|---|---|---|---|",
  ]
  by_wall = sorted(s["files"].items(), key=lambda kv: -kv[1]["wall_s"])
  out += [f"| {name} | {_seconds(row)} |" for name, row in by_wall]
  out += [
    "",
    "| test | wall s | compile s | trace+lower s | compiles of 1 s or more |",
  ]
  out.append("|---|---|---|---|---|")
  for nodeid, row in sorted(tests.items(), key=lambda kv: -kv[1]["wall_s"])[
    :top
  ]:
    big = ", ".join(
      f"{d:.1f}" for d in sorted(row["compiles"], reverse=True) if d >= 1
    )
    out.append(f"| {nodeid} | {_seconds(row)} | {big} |")
  return "\n".join(out)


if __name__ == "__main__":
  print(report(load(sys.argv[1])))
