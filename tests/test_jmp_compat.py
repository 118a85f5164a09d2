"""jmp 0.0.4's own test files, run against jmp_train with one import changed.

jmp ships its tests in its wheel (`jmp/_src/policy_test.py`,
`jmp/_src/loss_scale_test.py`). A jmp user switches with one line, `import
jmp_train as jmp`; each file is run here with that line swapped in, and,
as the reference, unchanged against jmp itself. jmp and absl-py are dev
dependencies only.
"""

import pathlib
import types
import unittest

import pytest

jmp = pytest.importorskip("jmp", reason="jmp (a dev dependency) is needed")
pytest.importorskip("absl.testing.parameterized", reason="needs absl-py")

# The line each file imports jmp with, as jmp 0.0.4 ships it.
IMPORTS = {
  "policy_test.py": "from jmp._src import policy as jmp",
  "loss_scale_test.py": "from jmp._src import loss_scale as jmp",
}


def run_jmp_test_file(name: str, against_jmp_train: bool) -> tuple[int, dict]:
  """Runs one of jmp's test files; returns (tests run, {failed id: traceback})."""
  path = pathlib.Path(jmp.__file__).parent / "_src" / name
  if not path.exists():
    pytest.skip(f"jmp {jmp.__version__} does not ship {name}")
  source = path.read_text()
  line = IMPORTS[name]
  assert source.count(line) == 1, f"{name} no longer imports jmp as {line!r}"
  if against_jmp_train:
    source = source.replace(line, "import jmp_train as jmp")
  module = types.ModuleType(f"jmp_compat_{name[:-3]}")
  module.__file__ = str(path)
  exec(compile(source, str(path), "exec"), module.__dict__)
  result = unittest.TestResult()
  unittest.defaultTestLoader.loadTestsFromModule(module).run(result)
  bad = result.failures + result.errors + result.skipped
  return result.testsRun, {test.id(): str(why) for test, why in bad}


# jmp's own reference values overflow in its test code (10 / 2**100 in
# float32); that warning is about the test, not about either library.
@pytest.mark.filterwarnings(
  "ignore:overflow encountered in cast:RuntimeWarning"
)
@pytest.mark.parametrize("name", sorted(IMPORTS))
def test_jmps_own_tests_pass_with_import_jmp_train_as_jmp(name):
  ran_jmp, failed_jmp = run_jmp_test_file(name, against_jmp_train=False)
  assert not failed_jmp and ran_jmp > 20  # the reference: jmp passes them all
  ran, failed = run_jmp_test_file(name, against_jmp_train=True)
  assert not failed, "\n\n".join(f"{k}\n{v}" for k, v in failed.items())
  assert ran == ran_jmp
