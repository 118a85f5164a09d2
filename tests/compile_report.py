"""Where the test suite's time goes: each test's wall time and JAX's compiles.

    JMP_TRAIN_COMPILE_REPORT=/tmp/report make test
    .venv/bin/python tests/compile_report.py /tmp/report

With the variable set, conftest.py registers a `Recorder` in every pytest
process: a listener on JAX's compile events (`jax.monitoring`) that charges
tracing, lowering and XLA's compiles to the test running, and writes one JSON
file per process (per xdist worker). A program the persistent compilation
cache already holds is loaded, not compiled, and is counted apart. The
processes some tests start (the examples, the multi-process runs) count in
their test's wall time only. Run as a script, it sums the files: totals,
compiles by duration, the files and the tests that take longest.
"""

import collections
import itertools
import json
import os
import pathlib
import sys
import time

import jax
import pytest

TRACE = "/jax/core/compile/jaxpr_trace_duration"
LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
# Timed around compiling or loading from the persistent cache; a load also
# records CACHE_LOAD just before it.
COMPILE = "/jax/core/compile/backend_compile_duration"
CACHE_LOAD = "/jax/compilation_cache/cache_retrieval_time_sec"
# Bounds of the compile-duration bins, in seconds.
BINS = (0.0, 0.2, 1.0, 4.0, float("inf"))


def _row():
  return {
    "wall_s": 0.0,
    "trace_s": 0.0,
    "lower_s": 0.0,
    "compile_s": 0.0,
    "compiles": [],
    "cache_loads": [],
  }


class Recorder:
  """The pytest plugin: per test, its wall seconds and compile events."""

  def __init__(self, directory, config):
    """Listens to JAX's compile events until `close`.

    Args:
      directory: where each process writes its JSON file.
      config: pytest's config. The process that starts the run (not an xdist
        worker) deletes the JSON files a previous run left in `directory`.
    """
    self.directory = pathlib.Path(directory)
    if not hasattr(config, "workerinput"):
      for path in self.directory.glob("*.json"):
        path.unlink()
    self.current = None  # compiles outside any test are not charged
    self.loading = False  # the next COMPILE event is a cache load
    self.tests = collections.defaultdict(_row)
    jax.monitoring.register_event_duration_secs_listener(self._event)

  def _event(self, event, duration, **_):
    loaded = event == COMPILE and self.loading
    if event in (CACHE_LOAD, COMPILE):
      self.loading = event == CACHE_LOAD
    if self.current is None:
      return
    row = self.tests[self.current]
    if event == TRACE:
      row["trace_s"] += duration
    elif event == LOWER:
      row["lower_s"] += duration
    elif loaded:
      row["cache_loads"].append(duration)
    elif event == COMPILE:
      row["compile_s"] += duration
      row["compiles"].append(duration)

  def close(self):
    jax.monitoring.unregister_event_duration_listener(self._event)

  @pytest.hookimpl(wrapper=True)
  def pytest_runtest_protocol(self, item, nextitem):
    self.current = item.nodeid
    start = time.perf_counter()
    try:
      return (yield)
    finally:
      self.tests[item.nodeid]["wall_s"] += time.perf_counter() - start
      self.current = None

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
  """Every process's tests, merged.

  Args:
    directory: the folder the run's `Recorder`s wrote.

  Returns:
    A row per test id (wall, trace, lowering and compile seconds, each
    compile's and each cache load's seconds).

  Raises:
    ValueError: a test appears in two files (files of two runs).
  """
  tests = {}
  for path in sorted(pathlib.Path(directory).glob("*.json")):
    for nodeid, row in json.loads(path.read_text()).items():
      if nodeid in tests:
        raise ValueError(f"{nodeid} appears twice in {directory}")
      tests[nodeid] = row
  return tests


def summarize(tests: dict) -> dict:
  """Totals, compiles by duration bin, and per-file sums.

  Args:
    tests: `load`'s rows.

  Returns:
    `total` (the columns summed, the number of compiles and of cache loads,
    and the seconds of the loads), `bins` (per duration bin, how many
    compiles and their seconds) and `files` (the columns per test file).
  """
  columns = ("wall_s", "trace_s", "lower_s", "compile_s")
  total = {c: sum(t[c] for t in tests.values()) for c in columns}
  compiles = [d for t in tests.values() for d in t["compiles"]]
  loads = [d for t in tests.values() for d in t["cache_loads"]]
  total |= {"compiles": len(compiles), "cache_loads": len(loads)}
  total["cache_load_s"] = sum(loads)
  bins = [
    {
      "from_s": low,
      "to_s": high,
      "n": sum(low <= d < high for d in compiles),
      "seconds": sum(d for d in compiles if low <= d < high),
    }
    for low, high in itertools.pairwise(BINS)
  ]
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
  """`summarize`'s sums and the `top` slowest tests, as markdown."""
  s = summarize(tests)
  t = s["total"]
  out = [
    f"{len(tests)} tests: {t['wall_s']:.1f} s in tests, {t['compile_s']:.1f} s"
    f" of it in {t['compiles']} XLA compiles, {t['trace_s'] + t['lower_s']:.1f}"
    f" s tracing and lowering; {t['cache_loads']} programs loaded from the"
    f" persistent cache in {t['cache_load_s']:.1f} s.",
    "",
    "| compile took | compiles | seconds |",
    "|---|---|---|",
  ]
  for b in s["bins"]:
    span = _span(b["from_s"], b["to_s"])
    out.append(f"| {span} | {b['n']} | {b['seconds']:.1f} |")
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
    "|---|---|---|---|---|",
  ]
  slowest = sorted(tests.items(), key=lambda kv: -kv[1]["wall_s"])[:top]
  for nodeid, row in slowest:
    big = sorted((d for d in row["compiles"] if d >= 1), reverse=True)
    out.append(
      f"| {nodeid} | {_seconds(row)} | {', '.join(f'{d:.1f}' for d in big)} |"
    )
  return "\n".join(out)


if __name__ == "__main__":
  if len(sys.argv) != 2:
    sys.exit("usage: python tests/compile_report.py DIRECTORY")
  print(report(load(sys.argv[1])))
