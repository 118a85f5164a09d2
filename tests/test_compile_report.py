"""tests/compile_report.py: what it charges to a test, and its sums."""

import types

import compile_report
import jax
import jax.numpy as jnp
import pytest


def test_recorder_charges_a_tests_compiles_to_that_test(tmp_path):
  x = jnp.ones((7, 13))
  recorder = compile_report.Recorder(tmp_path)
  try:
    item = types.SimpleNamespace(nodeid="tests/test_x.py::test_a")
    hook = recorder.pytest_runtest_protocol(item, None)
    next(hook)
    # A program compiled nowhere else: traced, lowered and compiled once.
    jax.jit(lambda x: jnp.sin(x) * 1.2345 + 6.789)(x)
    with pytest.raises(StopIteration):
      hook.send(None)
    jax.jit(lambda x: x - 9.876)(
      jnp.ones((5, 11))
    )  # between tests: not charged
  finally:
    recorder.close()
  recorder.current = item.nodeid  # after close, not heard even so
  jax.jit(lambda x: x * 5.4321)(x)
  recorder.pytest_sessionfinish(None)
  tests = compile_report.load(tmp_path)
  assert list(tests) == ["tests/test_x.py::test_a"]
  row = tests["tests/test_x.py::test_a"]
  assert (
    len(row["compiles"]) == 1 and row["compile_s"] == row["compiles"][0] > 0
  )
  assert row["trace_s"] > 0 and row["lower_s"] > 0
  spent = row["compile_s"] + row["trace_s"] + row["lower_s"]
  assert row["wall_s"] >= spent


def test_a_process_that_ran_no_test_writes_nothing(tmp_path):
  recorder = compile_report.Recorder(tmp_path / "out")
  recorder.close()
  recorder.pytest_sessionfinish(None)
  assert not (tmp_path / "out").exists()


def _test(wall, trace, lower, compiles):
  return dict(wall_s=wall, trace_s=trace, lower_s=lower, compiles=compiles) | {
    "compile_s": sum(compiles)
  }


def test_sums_bins_and_files_follow_the_rows():
  tests = {
    "tests/test_a.py::one": _test(10.0, 1.0, 0.5, [0.1, 0.5, 5.0]),
    "tests/test_a.py::two": _test(3.0, 0.25, 0.25, [2.0]),
    "tests/test_b.py::three[x]": _test(1.0, 0.0, 0.0, []),
  }
  s = compile_report.summarize(tests)
  assert s["total"] == {
    "wall_s": 14.0,
    "trace_s": 1.25,
    "lower_s": 0.75,
    "compile_s": 7.6,
    "compiles": 4,
  }
  # Bins [0, 0.2), [0.2, 1), [1, 4), [4, inf): one compile each.
  assert [b["n"] for b in s["bins"]] == [1, 1, 1, 1]
  assert [b["seconds"] for b in s["bins"]] == [0.1, 0.5, 2.0, 5.0]
  assert s["files"]["tests/test_a.py"]["wall_s"] == 13.0
  assert s["files"]["tests/test_a.py"]["compile_s"] == 7.6
  assert s["files"]["tests/test_b.py"]["compile_s"] == 0.0
  text = compile_report.report(tests, top=2)
  assert (
    "| 4 s or more | 1 | 5.0 |" in text and "| 0 to 0.2 s | 1 | 0.1 |" in text
  )
  assert "3 tests: 14.0 s in tests, 7.6 s of it in 4 XLA compiles" in text
  assert "| tests/test_a.py::one | 10.0 | 5.6 | 1.5 | 5.0 |" in text
  assert "| tests/test_a.py::two | 3.0 | 2.0 | 0.5 | 2.0 |" in text
  assert "three[x]" not in text.split("| test |")[1]  # only the top 2
