"""Many processes: joining JAX's multi-controller runtime, and checks that
values meant to be the same on every process are.

JAX runs one process per host; every process runs the same program on
global arrays, and a decision (skip a step, grow the loss scale) is made in
the graph, so every process makes it alike. What can still go wrong is on
the host side: a value built per process (params from a per-process seed, a
batch that is this process's rows but not a global array), a device of
another process, a file every process writes. This module holds the checks
for those, used by the train step, the plan and the checkpointer.

`initialize()` joins a run that a launcher started (`jmp_train.launch`
on one machine, srun, ...).
"""

from __future__ import annotations

import collections
import hashlib
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jmp_train._src import leaves

# Set by `launch.launch` for its processes (JAX reads the coordinator's).
NUM_PROCESSES_VAR = "JMP_TRAIN_NUM_PROCESSES"
PROCESS_ID_VAR = "JMP_TRAIN_PROCESS_ID"
INIT_TIMEOUT_VAR = "JMP_TRAIN_INIT_TIMEOUT_S"


def check_joined() -> None:
  """Refuses to go on in a process that `launch` started as one of several
  but that never joined them (`initialize()` was not called): it would
  train alone, as a separate run, beside the others."""
  count = os.environ.get(NUM_PROCESSES_VAR, "1")
  if PROCESS_ID_VAR not in os.environ or count == "1":
    return
  if not jax.distributed.is_initialized():
    raise RuntimeError(
      f"jmp_train.launch started this process as process "
      f"{os.environ[PROCESS_ID_VAR]} of {count}, but it never joined the "
      "others, so it would train alone as a separate run: call "
      "jmp_train.distributed.initialize() at the start of the script, "
      "before anything else uses JAX."
    )


def cluster_in_environment(environ: Mapping[str, str] | None = None) -> str:
  """The multi-process launcher this process runs under, from its
  environment: "jmp_train.launch", "explicit" (JAX_COORDINATOR_ADDRESS,
  with JAX_NUM_PROCESSES and JAX_PROCESS_ID), "slurm", "open-mpi" (Open MPI
  4's ORTE, which JAX reads), "kubernetes", "cloud-tpu", or "" for none
  (one process).

  Slurm and Open MPI count only with more than one task; a plain shell
  inside a Slurm allocation is one process.
  """
  env = os.environ if environ is None else environ

  def count(name: str) -> int:
    try:
      return int(env.get(name, "1"))
    except ValueError:
      return 1

  if PROCESS_ID_VAR in env:
    return "jmp_train.launch"
  if env.get("JAX_COORDINATOR_ADDRESS"):
    return "explicit"
  if "SLURM_STEP_ID" in env and count("SLURM_NTASKS") > 1:
    return "slurm"
  if "OMPI_MCA_orte_hnp_uri" in env and count("OMPI_COMM_WORLD_SIZE") > 1:
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
  and process id itself. In a lone process (`launch -n 1` included) it does
  nothing, so one script runs alike on a laptop and on a cluster. Call it first, before anything
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
  if not (found or force):
    return False
  kwargs = {}
  if found in ("jmp_train.launch", "explicit"):
    names = {
      "jmp_train.launch": (NUM_PROCESSES_VAR, PROCESS_ID_VAR),
      "explicit": ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID"),
    }[found]
    missing = [n for n in names if n not in os.environ]
    if missing:
      raise RuntimeError(
        f"JAX_COORDINATOR_ADDRESS is set ({found}), but {missing} are not: "
        "set the process count and this process's id too."
      )
    kwargs = {
      "num_processes": int(os.environ[names[0]]),
      "process_id": int(os.environ[names[1]]),
    }
    if found == "jmp_train.launch":
      address = os.environ["JAX_COORDINATOR_ADDRESS"]
      kwargs.update(
        coordinator_address=address,
        coordinator_bind_address=address,
        initialization_timeout=int(os.environ.get(INIT_TIMEOUT_VAR, "300")),
      )
      # Not inherited by processes this one starts (they are not the run's).
      for name in (
        "JAX_COORDINATOR_ADDRESS",
        NUM_PROCESSES_VAR,
        PROCESS_ID_VAR,
        INIT_TIMEOUT_VAR,
      ):
        os.environ.pop(name, None)
      if kwargs["num_processes"] == 1:
        return False  # `launch -n 1`: as if started without the launcher
  try:
    jax.distributed.initialize(**kwargs)
  except Exception as e:
    raise RuntimeError(
      f"jax.distributed.initialize() failed under {found or 'force=True'} "
      f"({type(e).__name__}: {e}). JAX needs a coordinator address, the "
      "process count and this process's id, from the launcher or from "
      "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID."
    ) from e
  return True


def process_prefix() -> str:
  """The prefix `process i of n: ` in a multi-process run, else ""."""
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
  if isinstance(x, jax.Array) and leaves.is_prng_key(x):
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
  are not hashed (their shards live on their own processes). Every
  process of the run must call this (it is a collective over all
  processes); a different tree structure raises on every process.
  """
  if jax.process_count() == 1:
    return
  from jax.experimental import multihost_utils

  # Every process sees every device and its process: unequal counts would
  # make the gathers below fail with a reshape error, so say so first.
  counts = collections.Counter(d.process_index for d in jax.devices())
  if len(set(counts.values())) > 1:
    raise ValueError(
      f"{what}: the processes have different numbers of devices "
      f"({dict(sorted(counts.items()))}, process: devices): give every "
      "process the same (launch --cpu-devices N on CPU; one GPU per process "
      "or the same number on each)."
    )
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  # First the structure (a fixed-size gather): a different leaf count would
  # make the digests' gather a collective mismatch, not an error.
  header = np.zeros((1, 2), np.uint32)
  header[0] = np.frombuffer(
    hashlib.blake2b(str(treedef).encode(), digest_size=8).digest(), np.uint32
  )
  headers = np.asarray(multihost_utils.process_allgather(header))
  if (headers != headers[0]).any():
    raise ValueError(
      f"{what} has another tree structure on some processes than on process "
      "0: every process must pass the same structure (the same program)."
    )
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
  """Process-local `jax.Array` leaves made global arrays, replicated over
  one device of each process (for orbax, which saves no process-local
  jax.Array when there are several processes); other leaves (NumPy ones,
  which orbax saves from process 0) unchanged. Check first that they are
  the same on every process (`check_same_on_every_process`)."""
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
