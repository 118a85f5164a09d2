"""The environment of a child process that sets its own CPU device count."""

import os


def child_env() -> dict[str, str]:
  """`os.environ` without the test session's device count in XLA_FLAGS.

  The child configures its devices as a user's script does
  (`jax_num_cpu_devices`); the rest of XLA_FLAGS (conftest.py's code
  generation flags) stays, so the child compiles as the session and
  `jmp_train.distributed.launch`'s children do, and their results can be
  compared.
  """
  flags = os.environ.get("XLA_FLAGS", "").split()
  kept = [f for f in flags if "xla_force_host_platform_device_count" not in f]
  return dict(os.environ, XLA_FLAGS=" ".join(kept))
