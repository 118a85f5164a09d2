"""The local launcher: N processes of one JAX run on this machine.

`launch(argv, num_processes)` starts `python argv...` N times, the
coordinator bound to 127.0.0.1 on a free port, for trying multi-process
code without a cluster; `distributed.initialize()` in each process joins
them. `python -m jmp_train.launch` is its command line.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence

from jmp_train._src import distributed, leaves


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _pump(stream, sink, prefix: str) -> None:
  for line in iter(stream.readline, b""):
    sink.write(prefix + line.decode(errors="replace"))
    sink.flush()
  stream.close()


def launch(
  argv: Sequence[str],
  num_processes: int,
  *,
  cpu_devices: int | None = None,
  timeout_s: float | None = None,
  log_dir: str | os.PathLike | None = None,
  env: Mapping[str, str] | None = None,
) -> int:
  """Runs `python argv...` as `num_processes` processes of one JAX run on
  this machine, the coordinator bound to 127.0.0.1 on a free port.

  Each process finds its place in the run with
  `jmp_train.distributed.initialize()`. When one exits with an error the
  others are stopped, so a crash never leaves a peer waiting in a
  collective; past `timeout_s` all are stopped, and so they are when this
  function is interrupted (the command line also stops them on SIGTERM and
  SIGHUP).

  Args:
    argv: the Python arguments: a script and its flags, or `-m module ...`.
    num_processes: how many processes (>= 1).
    cpu_devices: virtual CPU devices per process (sets `JAX_PLATFORMS=cpu`
      and `--xla_force_host_platform_device_count`); None leaves the
      platform alone (one GPU per process is the user's to arrange, e.g.
      with `CUDA_VISIBLE_DEVICES`).
    timeout_s: stop every process after this many seconds (None: no limit).
    log_dir: write each process's output to `log_dir/process-<i>.log`
      instead of this process's stdout (where lines start with "[i] ").
    env: extra environment variables for every process.

  Returns:
    0 if every process exited with 0; else a failed process's exit code
    (128 + k for one killed by signal k; 124 on timeout).
  """
  num_processes = leaves.check_int(num_processes, "num_processes", 1)
  if cpu_devices is not None:
    cpu_devices = leaves.check_int(cpu_devices, "cpu_devices", 1)
  if timeout_s is not None and not (
    isinstance(timeout_s, (int, float))
    and not isinstance(timeout_s, bool)
    and math.isfinite(timeout_s)
    and timeout_s > 0
  ):
    raise ValueError(
      f"timeout_s must be a positive number of seconds or None, got "
      f"{timeout_s!r}."
    )
  if isinstance(argv, str) or not argv:
    raise ValueError(
      f"argv must be a non-empty list of arguments for python (a script and "
      f"its flags, or '-m', module, ...), got {argv!r}."
    )
  address = f"127.0.0.1:{_free_port()}"
  base = {**os.environ, **(env or {})}
  base.update(
    {
      "JAX_COORDINATOR_ADDRESS": address,
      distributed.NUM_PROCESSES_VAR: str(num_processes),
      "PYTHONUNBUFFERED": "1",
    }
  )
  if timeout_s is not None:
    base[distributed.INIT_TIMEOUT_VAR] = str(max(10, int(timeout_s)))
  if cpu_devices is not None:
    flags = base.get("XLA_FLAGS", "").split()
    flags = [
      f for f in flags if "xla_force_host_platform_device_count" not in f
    ]
    flags.append(f"--xla_force_host_platform_device_count={cpu_devices}")
    base["XLA_FLAGS"] = " ".join(flags)
    base["JAX_PLATFORMS"] = "cpu"
    base.pop("JAX_NUM_CPU_DEVICES", None)
  deadline = None if timeout_s is None else time.monotonic() + timeout_s
  procs, pumps, files = [], [], []
  code = 0
  try:
    for i in range(num_processes):
      child_env = {**base, distributed.PROCESS_ID_VAR: str(i)}
      if log_dir is not None:
        os.makedirs(log_dir, exist_ok=True)
        out = open(os.path.join(log_dir, f"process-{i}.log"), "wb")  # noqa: SIM115
        files.append(out)
      else:
        out = subprocess.PIPE
      p = subprocess.Popen(
        [sys.executable, *argv],
        env=child_env,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
      )
      procs.append(p)
      if log_dir is None:
        t = threading.Thread(
          target=_pump, args=(p.stdout, sys.stdout, f"[{i}] "), daemon=True
        )
        t.start()
        pumps.append(t)
    while [p.poll() for p in procs].count(None):
      failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
      if failed:
        code = failed[0]
        break
      if deadline is not None and time.monotonic() > deadline:
        code = 124
        print(
          f"jmp_train.launch: stopping {num_processes} processes after "
          f"{timeout_s} s",
          file=sys.stderr,
        )
        break
      time.sleep(0.05)
    else:
      code = next((p.returncode for p in procs if p.returncode), 0)
  finally:
    _stop(procs)
    for t in pumps:
      t.join(timeout=5)
    for f in files:
      f.close()
  # A process killed by signal k exits -k: report it as a shell does.
  return 128 - code if code < 0 else code


def _stop(procs: list[subprocess.Popen]) -> None:
  """Stops the processes still running: SIGTERM, then SIGKILL after 5 s."""
  for p in procs:
    if p.poll() is None:
      os.killpg(p.pid, signal.SIGTERM)
  end = time.monotonic() + 5
  for p in procs:
    try:
      p.wait(timeout=max(0.0, end - time.monotonic()))
    except subprocess.TimeoutExpired:
      os.killpg(p.pid, signal.SIGKILL)
      p.wait()


def main(argv: Sequence[str] | None = None) -> int:
  """`python -m jmp_train.launch -n N [--cpu-devices K] script.py ...`"""
  import argparse

  p = argparse.ArgumentParser(
    prog="python -m jmp_train.launch",
    description="Run a script as N processes of one JAX run on this machine "
    "(coordinator on 127.0.0.1); the script calls "
    "jmp_train.distributed.initialize().",
  )
  p.add_argument("-n", "--processes", type=int, required=True)
  p.add_argument(
    "--cpu-devices",
    type=int,
    default=None,
    help="virtual CPU devices per process (JAX on the CPU)",
  )
  p.add_argument("--timeout", type=float, default=None, help="seconds")
  p.add_argument("argv", nargs=argparse.REMAINDER, help="script and flags")
  args = p.parse_args(argv)
  if not args.argv:
    p.error("give the script to run (and its flags)")

  def stop(signum, frame):
    raise SystemExit(128 + signum)  # `launch` stops its processes on the way

  # The processes run in sessions of their own (a signal to the launcher's
  # group does not reach them): stopping the launcher stops them.
  for signum in (signal.SIGTERM, signal.SIGHUP):
    signal.signal(signum, stop)
  return launch(
    args.argv,
    args.processes,
    cpu_devices=args.cpu_devices,
    timeout_s=args.timeout,
  )
