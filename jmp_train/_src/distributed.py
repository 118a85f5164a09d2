"""Many processes: starting JAX's multi-controller runtime, checks that
values meant to be the same on every process are, and a local launcher.

JAX runs one process per host; every process runs the same program on
global arrays, and a decision (skip a step, grow the loss scale) is made in
the graph, so every process makes it alike. What can still go wrong is on
the host side: a value built per process (params from a per-process seed, a
batch that is this process's rows but not a global array), a device of
another process, a file every process writes. This module holds the checks
for those, used by the train step, the plan and the checkpointer.

`launch(argv, num_processes)` starts `python argv...` N times on this
machine, bound to 127.0.0.1, for trying multi-process code without a
cluster; `initialize()` in each process joins them.
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jmp_train._src import leaves

# Set by `launch` for its processes (JAX reads the coordinator's two).
_NUM_PROCESSES = "JMP_TRAIN_NUM_PROCESSES"
_PROCESS_ID = "JMP_TRAIN_PROCESS_ID"
_TIMEOUT = "JMP_TRAIN_INIT_TIMEOUT_S"


def cluster_in_environment(environ: Mapping[str, str] | None = None) -> str:
  """The multi-process launcher this process runs under, from its
  environment: "jmp_train.launch", "explicit" (JAX_COORDINATOR_ADDRESS),
  "slurm", "open-mpi", "kubernetes", "cloud-tpu", or "" for none (one
  process).

  Slurm and Open MPI count only with more than one task; a plain shell
  inside a Slurm allocation is one process.
  """
  env = os.environ if environ is None else environ

  def count(name: str) -> int:
    try:
      return int(env.get(name, "1"))
    except ValueError:
      return 1

  if _PROCESS_ID in env:
    return "jmp_train.launch"
  if env.get("JAX_COORDINATOR_ADDRESS"):
    return "explicit"
  if "SLURM_STEP_ID" in env and count("SLURM_NTASKS") > 1:
    return "slurm"
  if count("OMPI_COMM_WORLD_SIZE") > 1:
    return "open-mpi"
  if "JOB_COMPLETION_INDEX" in env and "KUBERNETES_SERVICE_HOST" in env:
    return "kubernetes"
  if env.get("MEGASCALE_COORDINATOR_ADDRESS") or (
    "," in env.get("TPU_WORKER_HOSTNAMES", "")
  ):
    return "cloud-tpu"
  return ""


def initialize(*, force: bool = False) -> bool:
  """Joins the other processes of this run, if there are any.

  Calls `jax.distributed.initialize` when the environment names a
  multi-process launcher (`cluster_in_environment`): `launch`'s
  processes join on 127.0.0.1; under Slurm (`srun`), Open MPI, a Kubernetes
  JobSet or a Cloud TPU slice, JAX detects the coordinator, process count
  and process id itself. In a lone process it does nothing, so one script
  runs alike on a laptop and on a cluster. Call it first, before anything
  creates an array.

  Args:
    force: call `jax.distributed.initialize()` even when no launcher is
      recognised (e.g. a Cloud TPU VM whose workers JAX finds through the
      metadata server).

  Returns:
    Whether JAX's distributed runtime is running (`jax.process_count()`
    may then exceed 1).
  """
  force = leaves.check_bool(force, "force")
  if jax.distributed.is_initialized():
    return True
  found = cluster_in_environment()
  if found == "jmp_train.launch":
    address = os.environ["JAX_COORDINATOR_ADDRESS"]
    jax.distributed.initialize(
      coordinator_address=address,
      coordinator_bind_address=address,
      num_processes=int(os.environ[_NUM_PROCESSES]),
      process_id=int(os.environ[_PROCESS_ID]),
      initialization_timeout=int(os.environ.get(_TIMEOUT, "300")),
    )
  elif found or force:
    jax.distributed.initialize()
  else:
    return False
  return True


def process_prefix() -> str:
  """ "process i of n: " in a multi-process run, else "" (for messages)."""
  if jax.process_count() == 1:
    return ""
  return f"process {jax.process_index()} of {jax.process_count()}: "


def spans_processes(mesh: jax.sharding.Mesh) -> bool:
  """Whether `mesh` holds devices of other processes than this one."""
  here = jax.process_index()
  return any(d.process_index != here for d in mesh.devices.flat)


def is_process_local(x: Any) -> bool:
  """A concrete leaf this process holds whole: a NumPy value, a scalar or a
  fully addressable `jax.Array` (not an abstract leaf, not a global array
  with shards on other processes)."""
  if isinstance(x, jax.ShapeDtypeStruct) or x is None:
    return False
  if isinstance(x, jax.Array):
    return x.is_fully_addressable
  return True


def _digest(x: Any) -> np.ndarray:
  """Two uint32 words of a hash of a leaf's dtype, shape and bytes."""
  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(
    x.dtype, jax.dtypes.prng_key
  ):
    x = jax.random.key_data(x)
  a = np.asarray(x)
  h = hashlib.blake2b(digest_size=8)
  h.update(f"{a.dtype.str}{a.shape}".encode())
  h.update(np.ascontiguousarray(a).tobytes())
  return np.frombuffer(h.digest(), np.uint32)


def check_same_on_every_process(tree: Any, what: str) -> None:
  """Raises the same ValueError on every process if a process-local leaf of
  `tree` differs between processes (one all-gather of 8 bytes per leaf).

  A value every process builds for itself, such as params from
  `model.init(key)`, is meant to be replicated; a per-process seed would
  silently give each process other "replicated" contents. Global arrays
  are skipped: JAX keeps those consistent. Every process must call this
  with the same tree structure (it is a collective).
  """
  if jax.process_count() == 1:
    return
  from jax.experimental import multihost_utils

  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  digests = np.zeros((max(len(flat), 1), 2), np.uint32)
  for i, (_, x) in enumerate(flat):
    if is_process_local(x):
      digests[i] = _digest(x)
  gathered = np.asarray(multihost_utils.process_allgather(digests))
  differ = [
    i for i in range(len(flat)) if (gathered[:, i] != gathered[0, i]).any()
  ]
  if differ:
    paths = [leaves.keystr(flat[i][0]) for i in differ[:5]]
    procs = sorted(
      {
        int(p)
        for i in differ
        for p in np.nonzero((gathered[:, i] != gathered[0, i]).any(axis=1))[0]
      }
    )
    raise ValueError(
      f"{what} differs between processes: leaves {paths} (of {len(differ)} "
      f"that differ) on processes {procs} are not what process 0 holds. "
      "Every process must pass the same values (build them from the same "
      "seed, or make them global arrays), since they are used as one "
      "replicated value."
    )


def check_global_batch(batch: Any) -> None:
  """Refuses batch leaves that cannot be the global batch of a mesh that
  spans processes: NumPy values and process-local arrays (JAX would take
  each as the whole batch and keep only this process's rows of it)."""
  for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
    if is_process_local(x):
      kind = (
        "a process-local jax.Array"
        if isinstance(x, jax.Array)
        else f"a {type(x).__name__}"
      )
      raise ValueError(
        f"{process_prefix()}batch leaf {leaves.keystr(path)!r} is {kind} "
        f"of shape {np.shape(x)}; with {jax.process_count()} processes the "
        "step needs global arrays. Build the batch from this process's "
        "rows with jmp_train.train.global_batch(local_rows, plan)."
      )


def replicated_global(tree: Any) -> Any:
  """Process-local leaves made global arrays, replicated over one device of
  each process (for orbax, which saves global arrays only when there are
  several processes); other leaves unchanged. Check first that they are the
  same on every process (`check_same_on_every_process`)."""
  if jax.process_count() == 1:
    return tree
  firsts = {}
  for d in jax.devices():
    firsts.setdefault(d.process_index, d)
  mesh = jax.sharding.Mesh(
    np.array([firsts[p] for p in sorted(firsts)]), ("processes",)
  )
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  here = firsts[jax.process_index()]

  def make(x):
    if not (isinstance(x, jax.Array) and x.is_fully_addressable):
      return x
    local = jax.device_put(x, here)
    return jax.make_array_from_single_device_arrays(x.shape, sharding, [local])

  return jax.tree.map(make, tree)


def local_device() -> jax.Device:
  """This process's first device: where a leaf with no sharding goes."""
  return jax.local_devices()[0]


# -- The local launcher ------------------------------------------------------


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

  Each process finds its place in the run with `initialize()`. When one
  exits with an error the others are stopped, so a crash never leaves a
  peer waiting in a collective; past `timeout_s` all are stopped.

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
    0 if every process exited with 0; else the first failure's exit code
    (124 on timeout).
  """
  num_processes = leaves.check_int(num_processes, "num_processes", 1)
  if cpu_devices is not None:
    cpu_devices = leaves.check_int(cpu_devices, "cpu_devices", 1)
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
      _NUM_PROCESSES: str(num_processes),
      "PYTHONUNBUFFERED": "1",
    }
  )
  if timeout_s is not None:
    base[_TIMEOUT] = str(max(10, int(timeout_s)))
  if cpu_devices is not None:
    flags = base.get("XLA_FLAGS", "").split()
    flags = [
      f for f in flags if "xla_force_host_platform_device_count" not in f
    ]
    flags.append(f"--xla_force_host_platform_device_count={cpu_devices}")
    base["XLA_FLAGS"] = " ".join(flags)
    base["JAX_PLATFORMS"] = "cpu"
    base.pop("JAX_NUM_CPU_DEVICES", None)
  procs, pumps, files = [], [], []
  for i in range(num_processes):
    child_env = {**base, _PROCESS_ID: str(i)}
    if log_dir is not None:
      os.makedirs(log_dir, exist_ok=True)
      out = open(os.path.join(log_dir, f"process-{i}.log"), "wb")  # noqa: SIM115
      files.append(out)
      p = subprocess.Popen(
        [sys.executable, *argv],
        env=child_env,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
      )
    else:
      p = subprocess.Popen(
        [sys.executable, *argv],
        env=child_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
      )
      t = threading.Thread(
        target=_pump, args=(p.stdout, sys.stdout, f"[{i}] "), daemon=True
      )
      t.start()
      pumps.append(t)
    procs.append(p)
  deadline = None if timeout_s is None else time.monotonic() + timeout_s
  code = 0
  try:
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
  return code


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
  return launch(
    args.argv,
    args.processes,
    cpu_devices=args.cpu_devices,
    timeout_s=args.timeout,
  )
