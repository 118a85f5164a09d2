"""`python -m jmp_train.launch -n N [--cpu-devices K] [--timeout S] script.py
[flags]`: runs a script as N processes of one JAX run on this machine, the
coordinator on 127.0.0.1 (`jmp_train.distributed.launch`). The script calls
`jmp_train.distributed.initialize()` first."""

import sys

from jmp_train._src.launch import main

if __name__ == "__main__":
  sys.exit(main())
