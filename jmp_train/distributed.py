"""Many processes (hosts): joining a run, and a launcher for one machine.

`python -m jmp_train.launch -n 2 --cpu-devices 4 script.py ...` runs
`script.py` as 2 processes of one JAX run with 4 CPU devices each
(`launch` below).
"""

from jmp_train._src.distributed import (
  check_same_on_every_process,
  cluster_in_environment,
  initialize,
  process_prefix,
)
from jmp_train._src.launch import launch

__all__ = [
  "check_same_on_every_process",
  "cluster_in_environment",
  "initialize",
  "launch",
  "process_prefix",
]
