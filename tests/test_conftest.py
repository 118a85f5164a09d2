"""conftest.py: the test session's devices and XLA:CPU code generation reach
JAX's backend, whatever the modules collected before it started did."""

import os

import jax
import jax.numpy as jnp


def _flag(name: str) -> str | None:
  """The value XLA_FLAGS gives `name` last (as XLA reads it: a bare boolean
  flag is true), or None."""
  value = None
  for flag in os.environ["XLA_FLAGS"].split():
    if flag == name:
      value = "true"
    elif flag.startswith(f"{name}="):
      value = flag.split("=", 1)[1]
  return value


def test_the_backend_compiles_as_xla_flags_says():
  assert len(jax.devices()) == 8
  # conftest.py's defaults, unless the caller's XLA_FLAGS named the flag.
  emitters = _flag("--xla_cpu_use_fusion_emitters")
  assert emitters in ("true", "false")
  assert _flag("--xla_backend_optimization_level") is not None
  # A scatter-add shows which emitters compiled it: the elemental ones need
  # every scatter expanded into a loop, the fusion emitters keep it. XLA
  # reads XLA_FLAGS whole, so one flag that arrived shows they all did. (A
  # helper that replaced XLA_FLAGS during collection once left the whole
  # suite at XLA's defaults whatever the flags said.)
  hlo = (
    jax.jit(lambda x, i: x.at[i].add(1.0))
    .lower(jnp.zeros(8), jnp.arange(4))
    .compile()
    .as_text()
  )
  assert (" scatter(" in hlo) == (emitters == "true"), emitters
