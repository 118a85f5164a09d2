"""Shared test setup: 8 virtual CPU devices, jit/no-jit variants, jaxpr probes."""

import os
import shutil
import tempfile

# XLA:CPU's code generation for the suite's programs: LLVM at -O0 and the
# elemental emitters instead of the MLIR fusion emitters. The suite's
# thousands of small programs compile about four times faster (README.md,
# "The two commands", has the compile report's figures); their kernels run
# slower, but the whole suite takes under half the time. XLA's HLO optimizations still run,
# though scatters become loops and kernels are fused differently; float
# results may differ in the last bits (the order of a sum, a fused
# multiply-add), as they do between backends.
# A flag XLA_FLAGS already names keeps the caller's value, so the suite runs
# at XLA's defaults with XLA_FLAGS="--xla_backend_optimization_level=3
# --xla_cpu_use_fusion_emitters=true". Only for XLA:CPU: on another platform
# the first flag would set that compiler's LLVM level too.
CODEGEN_FLAGS = {
  "--xla_backend_optimization_level": "0",
  "--xla_cpu_use_fusion_emitters": "false",
}
_flags = os.environ.get("XLA_FLAGS", "")
_named = {f.split("=", 1)[0] for f in _flags.split()}
if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
  for _name, _value in CODEGEN_FLAGS.items():
    if _name not in _named:
      _flags += f" {_name}={_value}"
# Must happen before jax initialises its backend.
os.environ["XLA_FLAGS"] = (
  _flags + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache per test session, shared by the xdist
# workers and the child processes some tests start (they compile the same
# steps); keyed by XLA on the program, flags and versions, so a hit is exact.
os.environ.setdefault(
  "JAX_COMPILATION_CACHE_DIR",
  os.path.join(tempfile.gettempdir(), f"jmp_train_tests_{os.getpid()}"),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_configure(config):
  """With JMP_TRAIN_COMPILE_REPORT=DIR, records where the time goes.

  Per test: wall time, tracing, lowering and XLA compiles
  (tests/compile_report.py sums them).
  """
  directory = os.environ.get("JMP_TRAIN_COMPILE_REPORT")
  if directory:
    import compile_report

    config.pluginmanager.register(compile_report.Recorder(directory, config))


def pytest_sessionfinish(session):
  """The session's own compilation cache goes away with it (not a user's)."""
  if hasattr(session.config, "workerinput"):
    return  # an xdist worker: the controller cleans up
  path = os.environ["JAX_COMPILATION_CACHE_DIR"]
  if path.endswith(f"jmp_train_tests_{os.getpid()}"):
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(params=["jit", "nojit"])
def variant(request):
  """Runs a test once under jax.jit and once eagerly."""
  return jax.jit if request.param == "jit" else (lambda f: f)


def _subjaxprs(eqn):
  for param in eqn.params.values():
    for p in param if isinstance(param, (list, tuple)) else [param]:
      if hasattr(p, "jaxpr") and hasattr(p.jaxpr, "eqns"):
        yield p.jaxpr
      elif hasattr(p, "eqns"):
        yield p


def equations(fn, *args):
  """Every equation of fn's jaxpr, nested jaxprs included, in program order."""

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      yield eqn
      for sub in _subjaxprs(eqn):
        yield from walk(sub)

  return list(walk(jax.make_jaxpr(fn)(*args).jaxpr))


def primitive_operand_dtypes(fn, *args, primitive="dot_general"):
  """Operand dtypes of every `primitive` in fn's jaxpr, nested jaxprs included."""
  return [
    tuple(v.aval.dtype.name for v in eqn.invars)
    for eqn in equations(fn, *args)
    if eqn.primitive.name == primitive
  ]


@pytest.fixture
def operand_dtypes():
  return primitive_operand_dtypes
