"""Compiling for a GPU on a machine without one.

XLA compiles for a GPU it is told about (a `GpuTargetConfig`: the chip's
limits, compute capability, cuDNN and CUDA versions) as it would for one it
finds, less the autotuning that needs the chip: `jax.jit(f).lower(...)` on
arguments placed on that target's devices, then `.compile()`, gives the
compiled HLO, kernels and buffer sizes XLA would run there, with cuBLAS for
its matmuls (`CHIP_GEMMS`, below). The numbers a target needs are its
chip's published ones (`TARGETS`: the H100 SXM and the H200); the CUDA and
cuDNN versions are those of the `jax[cuda12]` wheels this was written with.
It needs JAX's CUDA plugin installed (`pip install "jax[cuda12]"`, the same
version as jax), and no GPU.

  topology = deviceless.topology("h100")
  x = deviceless.abstract(jnp.zeros((8, 8)), topology)
  hlo = jax.jit(f).lower(x).compile().as_text()
"""

import importlib.metadata
import os
import platform
import re

import jax
from jax.experimental import topologies


def _hopper(name: str, memory_bandwidth: int, device_memory_size: int) -> str:
  """An H100 SXM's or H200's target: one GH100 chip (132 SMs, 50 MB of L2,
  a boost clock of 1.98 GHz), with its own memory."""
  return f"""
gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {memory_bandwidth}
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: {device_memory_size}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 minor: 0 }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
runtime_version {{ major: 12 minor: 9 }}
device_description_str: "{name}"
"""


# The H100 SXM: 80 GB of HBM3 at 3.35 TB/s. The H200: 141 GB of HBM3e
# (143,771 MiB as nvidia-smi counts it) at 4.8 TB/s, the GPU of every GPU
# run in BENCHMARKS.md since 2026-11-26; its name is the one JAX gives it
# (`device_kind`, as those runs recorded it).
TARGETS = {
  "h100": _hopper("NVIDIA H100 80GB HBM3", 3_352_320_000_000, 84_929_347_584),
  "h200": _hopper("NVIDIA H200", 4_800_000_000_000, 143_771 * 2**20),
}


# The choice of the chip's autotuning that decides most of what a compile
# here allocates. On a GPU, XLA times its own Triton GEMM fusions against
# cuBLAS for each matmul and keeps the faster; here there is nothing to time,
# and it keeps Triton's. On the H200 of 2026-11-27 (jax 0.11.2) autotuning
# gave all but one of GPT-2 small's bf16-mixed matmuls to cuBLAS (in
# fp16-mixed's step it kept more of XLA's). Compiled here with cuBLAS for
# every matmul, bf16-mixed's step allocates 8,442,357,328 bytes of
# temporaries against the chip's 8,442,363,472 (6 KB apart); with Triton's
# GEMMs, 1.5 GiB less. So a compile for a target uses cuBLAS's, unless
# XLA_FLAGS already sets the flag. Checked against a chip for that one step.
GEMM_FLAG = "--xla_gpu_enable_triton_gemm"
CHIP_GEMMS = f"{GEMM_FLAG}=false"


def add_target_argument(parser, condition: str = "") -> None:
  """A script's `--target` flag: one of TARGETS to compile for on this
  machine, without running (None, the default: the machine's own device).
  `condition` opens its help, as "with --kernels: "."""
  parser.add_argument(
    "--target",
    choices=sorted(TARGETS),
    default=None,
    help=f"{condition}compile for this GPU on a machine without one, not"
    " run (benchmarks/deviceless.py; needs JAX's CUDA plugin)",
  )


def name(target: str) -> str:
  """The device a target describes (its `device_description_str`)."""
  return re.search(r'device_description_str: "([^"]+)"', TARGETS[target])[1]


def machine(target: str | None) -> str:
  """What a compile-only run describes: `target`'s GPU, compiled here and
  not run, or (None) this machine's first device; with the architecture."""
  if target:
    gpu = [f for f in os.environ.get("XLA_FLAGS", "").split() if _gpu_flag(f)]
    how = f"; XLA_FLAGS {' '.join(gpu)}" if gpu else ""
    where = f"{name(target)} (compiled here{how}, not run)"
  else:
    where = jax.devices()[0].device_kind
  return f"{where}, {platform.machine()}"


def _gpu_flag(flag: str) -> bool:
  """Whether `flag` (one word of XLA_FLAGS) sets an XLA:GPU option: those
  change what a compile for a target gives; the others (dumps, paths) are
  not recorded."""
  return flag.startswith("--xla_gpu_")


def provenance(target: str | None) -> dict:
  """What a compile-only result records of where it was made: `machine`,
  jax's version and, with a target, the CUDA plugin's."""
  return {
    "device": machine(target),
    "jax": jax.__version__,
    **({"cuda_plugin": plugin()} if target else {}),
  }


def plugin() -> str:
  """The installed CUDA plugin and its version, for the record."""
  try:
    return (
      f"jax-cuda12-plugin {importlib.metadata.version('jax-cuda12-plugin')}"
    )
  except importlib.metadata.PackageNotFoundError:
    return "none"


def start(target: str | None):
  """What a script with `--target` calls first, before JAX starts a backend
  (and after any change to XLA_FLAGS): for a target, JAX is told to look for
  no GPU (the one compiled for is not here), XLA_FLAGS gets `CHIP_GEMMS`
  unless it sets that flag already, and `topology(target)` is returned, so
  a missing plugin is refused before any work (XLA_FLAGS then as it was);
  None for none. XLA reads XLA_FLAGS once per process: called after a
  compile, the flag would be recorded (`machine`) but not used, hence first.
  """
  if target is None:
    return None
  jax.config.update("jax_platforms", "cpu")
  flags = os.environ.get("XLA_FLAGS")
  words = (flags or "").split()
  if not any(w.split("=")[0] == GEMM_FLAG for w in words):
    os.environ["XLA_FLAGS"] = " ".join([*words, CHIP_GEMMS])
  try:
    return topology(target)
  except Exception:
    if flags is None:
      os.environ.pop("XLA_FLAGS", None)
    else:
      os.environ["XLA_FLAGS"] = flags
    raise


def topology(target: str):
  """One GPU of `target` (a key of TARGETS), for compiling without it.

  Raises:
    ValueError: for a target not in TARGETS.
    RuntimeError: where JAX's CUDA plugin is not installed.
  """
  if target not in TARGETS:
    raise ValueError(f"target must be one of {sorted(TARGETS)}, got {target!r}")
  try:
    return topologies.get_topology_desc(
      platform="cuda", target_config=TARGETS[target], topology="1x1x1"
    )
  except Exception as e:  # what the missing plugin raises varies by version
    raise RuntimeError(
      f"compiling for {target} without a GPU needs JAX's CUDA plugin: pip"
      f' install "jax[cuda12]=={jax.__version__}" ({type(e).__name__}: {e})'
    ) from e


def abstract(tree, topo):
  """`tree`'s arrays as `jax.ShapeDtypeStruct`s replicated on `topo`'s GPU."""
  mesh = topologies.make_mesh(topo, (1,), ("x",))
  where = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return jax.tree.map(
    lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=where), tree
  )
