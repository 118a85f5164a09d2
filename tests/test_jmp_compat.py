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


def test_jmps_own_objects_are_taken_as_they_are():
  """Code half-way through the switch hands jmp's objects to jmp_train: the
  loss scale follows jmp's own `adjust`, the policy jmp's dtypes."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  import jmp_train

  theirs = jmp.DynamicLossScale(
    jnp.float32(2.0**10), period=2, factor=4, min_loss_scale=jnp.float32(2.0)
  )
  tx = jmp_train.mixed_precision(optax.sgd(0.1), loss_scale=theirs)
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  finite = [1, 1, 0, 1, 0, 0, 0, 0, 0, 1, 1, 1]
  got, want, ref = [], [], theirs
  for ok in finite:
    grads = {"w": jnp.full(2, 1.0 if ok else jnp.inf)}
    _, state = tx.update(grads, state, params)
    got.append(float(jmp_train.current_loss_scale(state)))
    ref = ref.adjust(jnp.asarray(bool(ok)))
    want.append(float(ref.loss_scale))
  assert got == want and min(want) == 2.0 and max(want) > 2.0**10
  for theirs, scale in (
    (jmp.StaticLossScale(128.0), 128.0),
    (jmp.NoOpLossScale(), 1.0),
  ):
    state = jmp_train.mixed_precision(optax.sgd(0.1), loss_scale=theirs).init(
      params
    )
    assert float(jmp_train.current_loss_scale(state)) == scale

  policy = jmp.get_policy("p=f32,c=bf16,o=f16")
  ours = jmp_train.get_policy(policy)
  assert (ours.param_dtype, ours.compute_dtype, ours.output_dtype) == (
    policy.param_dtype,
    policy.compute_dtype,
    policy.output_dtype,
  )
  x = {"x": np.ones(2, np.float32)}
  assert jax.tree.leaves(ours.cast_to_compute(x))[0].dtype == jnp.bfloat16
