"""tests/compile_report.py: what it charges to a test, and its sums."""

import json
import types

import compile_report
import jax
import jax.numpy as jnp
import pytest

MAIN = types.SimpleNamespace()  # pytest's config in the process that starts
WORKER = types.SimpleNamespace(workerinput={})  # in an xdist worker


def _in_test(recorder, nodeid, fn):
  """Runs `fn` as the test `nodeid`, through the recorder's hook."""
  hook = recorder.pytest_runtest_protocol(
    types.SimpleNamespace(nodeid=nodeid), None
  )
  next(hook)
  fn()
  with pytest.raises(StopIteration):
    hook.send(None)


def test_recorder_charges_a_tests_compiles_and_cache_loads_to_it(tmp_path):
  x = jnp.ones((7, 13))

  def program():  # compiled nowhere else; a new function object each call
    def body(x):
      return jnp.sin(x) * 1.2345 + 6.789

    return body

  def compile_then_load():
    jax.jit(program())(x)
    jax.jit(program())(x)  # traced again; the persistent cache has it

  recorder = compile_report.Recorder(tmp_path, MAIN)
  old = jax.config.jax_persistent_cache_min_compile_time_secs
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  try:
    _in_test(recorder, "tests/test_x.py::test_a", compile_then_load)
    jax.jit(lambda x: x - 9.876)(x)  # between tests: not charged
  finally:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", old)
    recorder.close()
  recorder.current = "tests/test_x.py::test_a"  # after close, not heard
  jax.jit(lambda x: x * 5.4321)(x)
  recorder.pytest_sessionfinish(None)
  tests = compile_report.load(tmp_path)
  assert list(tests) == ["tests/test_x.py::test_a"]
  row = tests["tests/test_x.py::test_a"]
  assert (
    len(row["compiles"]) == 1 and row["compile_s"] == row["compiles"][0] > 0
  )
  assert len(row["cache_loads"]) == 1
  assert row["trace_s"] > 0 and row["lower_s"] > 0
  # JAX times its events with another clock than the test's wall time.
  spent = row["compile_s"] + row["trace_s"] + row["lower_s"]
  assert row["wall_s"] > spent - 0.01


def test_the_starting_process_clears_an_earlier_run_and_workers_do_not(
  tmp_path,
):
  (tmp_path / "gw5.json").write_text("{}")
  compile_report.Recorder(tmp_path, WORKER).close()
  assert (tmp_path / "gw5.json").exists()
  recorder = compile_report.Recorder(tmp_path / "x", MAIN)
  recorder.close()
  recorder.pytest_sessionfinish(None)  # it ran no test: writes nothing
  assert not (tmp_path / "x").exists()
  compile_report.Recorder(tmp_path, MAIN).close()
  assert not list(tmp_path.glob("*.json"))


def test_load_refuses_a_test_in_two_files(tmp_path):
  for name in ("gw0", "main"):
    (tmp_path / f"{name}.json").write_text(
      json.dumps({"t.py::a": _test(1, 0, 0)})
    )
  with pytest.raises(ValueError, match="t.py::a appears twice"):
    compile_report.load(tmp_path)


def _test(wall, trace, lower, compiles=(), cache_loads=()):
  return {
    "wall_s": wall,
    "trace_s": trace,
    "lower_s": lower,
    "compile_s": sum(compiles),
    "compiles": list(compiles),
    "cache_loads": list(cache_loads),
  }


def test_sums_bins_and_files_follow_the_rows():
  # Seconds exact in binary: the sums below are exact.
  tests = {
    "tests/test_a.py::one": _test(10.0, 1.0, 0.5, [0.125, 0.5, 5.0], [0.25]),
    "tests/test_a.py::two": _test(3.0, 0.25, 0.25, [2.0]),
    "tests/test_b.py::three[x]": _test(1.0, 0.0, 0.0),
  }
  s = compile_report.summarize(tests)
  assert s["total"] == {
    "wall_s": 14.0,
    "trace_s": 1.25,
    "lower_s": 0.75,
    "compile_s": 7.625,
    "compiles": 4,
    "cache_loads": 1,
    "cache_load_s": 0.25,
  }
  # Bins [0, 0.2), [0.2, 1), [1, 4), [4, inf): one compile each.
  assert [b["n"] for b in s["bins"]] == [1, 1, 1, 1]
  assert [b["seconds"] for b in s["bins"]] == [0.125, 0.5, 2.0, 5.0]
  assert s["files"]["tests/test_a.py"]["wall_s"] == 13.0
  assert s["files"]["tests/test_a.py"]["compile_s"] == 7.625
  assert s["files"]["tests/test_b.py"]["compile_s"] == 0.0
  text = compile_report.report(tests, top=2)
  assert (
    "| 4 s or more | 1 | 5.0 |" in text and "| 0 to 0.2 s | 1 | 0.1 |" in text
  )
  assert "3 tests: 14.0 s in tests, 7.6 s of it in 4 XLA compiles" in text
  assert "1 programs loaded from the persistent cache in 0.2 s" in text
  assert "| tests/test_a.py::one | 10.0 | 5.6 | 1.5 | 5.0 |" in text
  assert "| tests/test_a.py::two | 3.0 | 2.0 | 0.5 | 2.0 |" in text
  assert "three[x]" not in text.split("| test |")[1]  # only the top 2
