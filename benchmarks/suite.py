"""Runs every benchmark and writes BENCHMARKS.md from their results.

  python benchmarks/suite.py            # all (89 min on the 2 cores of 2026-11-25)
  python benchmarks/suite.py --quick    # tiny configs: checks the pipeline
  python benchmarks/suite.py --render   # rewrite the page from saved JSON
  python benchmarks/suite.py --only overhead-64,compile

Each benchmark runs in its own process (a clean JAX) and writes JSON to
--json-dir (benchmarks/results/, committed: the data behind the page). The
page is benchmarks/page.md, the hand-written prose, with each
`<!-- table: script.function -->` line replaced by that function of
benchmarks/script.py applied to the script's results (job name -> JSON):
every table, figure and verdict on the page is computed from the saved
numbers. `--render` with the committed results reproduces BENCHMARKS.md byte
for byte (a test checks it).

On a machine whose first device is a GPU the suite runs the GPU jobs instead
and saves that machine as environment-gpu.json; the page shows both
machines' results:

  python benchmarks/suite.py            # CPU machine
  python benchmarks/suite.py            # then on a GPU machine
  python benchmarks/suite.py --render   # the page from both
"""

import argparse
import datetime
import importlib
import importlib.util
import json
import os
import pathlib
import platform
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = ROOT / "benchmarks" / "page.md"
TABLE = re.compile(r"^<!-- table: (\w+)\.(\w+) -->$", re.MULTILINE)

# The presets whose GPT-2 small step memory is measured, one job each.
MEMORY_PRESETS = (
  "fp32",
  "bf16-mixed",
  "bf16-true",
  "bf16-lean",
  "bf16-sr-lean",
)
# Job name (its JSON's name) -> a script in benchmarks/ and its arguments.
CPU_JOBS = {
  "overhead-64": "overhead.py --batch 64 --steps 40",
  "overhead-256": "overhead.py --batch 256 --steps 40",
  "overhead-1024": "overhead.py --batch 1024 --steps 40",
  "overhead-update": "overhead.py --update-only --steps 40",
  "overhead-study": "overhead.py --study --batch 256 --steps 40",
  "overhead-masters": "overhead.py --bf16-params --batch 256 --steps 40",
  "overhead-masters-update": "overhead.py --bf16-params --update-only --steps 40",
  "overhead-kernels": "overhead.py --kernels",
  "overhead-kernels-update": "overhead.py --kernels --update-only",
  "overhead-profile": "overhead.py --batch 64 --profile-steps 10 --profile"
  " benchmarks/results/traces/cpu-step",
  # Compiled for an H100 here, not run (DEVICELESS: skipped without the
  # CUDA plugin).
  "overhead-kernels-h100": "overhead.py --kernels --target h100 --batch 16384",
  "overhead-kernels-h100-update": "overhead.py --kernels --target h100"
  " --update-only",
  "gpt2-kernels-h100": "gpt2.py --kernels --target h100"
  " --presets bf16-mixed,fp16-mixed,bf16-lean,bf16-sr-lean",
  "loss-head-h100": "loss_head.py --target h100",
  # What the GPU jobs gpt2-memory-* should measure (XLA's allocation).
  **{
    f"gpt2-memory-h100-{name}": f"gpt2_memory.py --target h100 --preset {name}"
    for name in MEMORY_PRESETS
  },
  "host-cost": "host_cost.py",
  "host-cost-deep": "host_cost.py --layers 74 --steps-per-round 30 --rounds 40",
  "zero1": "zero1.py",
  "compile": "compile_time.py",
  "fp8": "fp8.py --accuracy",
  "fp8-gpt": "fp8.py --gpt --steps 400 --seeds 0,1,2",
  "fp8-gather": "fp8.py --gather",
  "autocast": "autocast.py --steps 400",
  "gpt": "gpt_compare.py --chart docs/gpt-compare.png",
  "multihost": "multihost.py",
  "lean-memory": "lean_state.py memory",
  "lean-gpt": "lean_state.py gpt --steps 400 --chart docs/lean-state.png",
  "lean-digits": "lean_state.py digits --epochs 30",
  "loss-head": "loss_head.py",
  "rounding-memory": "rounding_memory.py --batch 1"
  " --max-draw 1048576,4194304,2147483648",
  "lean-speed": "lean_state.py speed",  # last: timings want a quiet machine
}
# Jobs that compile for a GPU without one: they need JAX's CUDA plugin
# (`pip install "jax[cuda12]"`, jax's version), and a whole run skips them,
# with a line, where it is missing.
DEVICELESS = {
  "overhead-kernels-h100",
  "overhead-kernels-h100-update",
  "gpt2-kernels-h100",
  "loss-head-h100",
  *(f"gpt2-memory-h100-{name}" for name in MEMORY_PRESETS),
}
# CUDA 12's: the H100 target (deviceless.TARGETS) names CUDA 12.9.
CUDA_PLUGINS = ("jax_cuda12_plugin",)
GPU_JOBS = {
  # Seven steps, each warmed up: it ran past 150 s on the H200 at 17:24 UTC
  # on 2026-11-27 after warming up five, and took 177 s alone (given
  # `--job-timeout 360`), so it needs a timeout of more than 180 s.
  "gpt2": "gpt2.py",
  "gpt2-b32": "gpt2.py --no-plain --presets bf16-mixed --batch 32 --rounds 3",
  # bf16-mixed and fp16-mixed as the H200 ran them on 2026-11-26, on the code
  # that sums the finite check's gradients in a few concatenations (the
  # library's since; its JSON holds the H200's run of 19:36 UTC on
  # 2026-11-27, on that evening's code).
  "gpt2-check": "gpt2.py --no-plain --autocast '' --presets bf16-mixed,fp16-mixed"
  " --rounds 3 --tag 'grouped finite check'",
  # The same, on the code of the afternoon of 2026-11-27: cross_entropy
  # writes its backward pass out (the whole logits read in one pass, not
  # scattered into) and reads its log-sum-exp in one pass, and the MLP's
  # GELU is recomputed in the backward pass.
  # After the timing, one round of each step traced: where its device time
  # goes, by class of kernel and by layer (benchmarks/device_time.py).
  "gpt2-xent": "gpt2.py --no-plain --autocast '' --presets bf16-mixed,fp16-mixed"
  " --rounds 3 --tag 'loss written out, one-pass LSE, GELU remat'"
  " --profile benchmarks/results/traces/gpt2",
  "gpt2-fused": "gpt2.py --loss fused --no-plain --autocast ''"
  " --presets bf16-mixed,fp16-mixed",
  # cuDNN's LayerNorm kernels in place of XLA's fusions (item 2's passes).
  "gpt2-cudnn-ln": "gpt2.py --no-plain --autocast '' --presets bf16-mixed"
  " --xla-flags=--xla_gpu_enable_cudnn_layer_norm=true",
  # cuBLAS for every matmul (XLA's Triton GEMMs off), traced. On the H200
  # of 2026-11-27 autotuning left one Triton GEMM in the step, the qkv
  # weight gradient's, split in two along K; in bf16-mixed's step the sum of
  # its halves fused with the finite check's row sums into a kernel that
  # writes the float32 gradient transposed, 66 us in each of the 12 layers.
  # With cuBLAS there (compiled for an H100 here) the check reads the GEMM's
  # output as it is. The traces' device time, steadier than the wall time
  # from one run to the next, says what that is worth.
  "gpt2-cublas": "gpt2.py --no-plain --autocast '' --presets bf16-mixed"
  " --xla-flags=--xla_gpu_enable_triton_gemm=false"
  " --profile benchmarks/results/traces/gpt2-cublas",
  # The fused loss with both flags: the candidate fastest run, ready for a
  # session that has no time to combine what the runs above find.
  "gpt2-fused-flags": "gpt2.py --loss fused --no-plain --autocast ''"
  " --presets bf16-mixed,fp16-mixed"
  " --xla-flags='--xla_gpu_enable_cudnn_layer_norm=true"
  " --xla_gpu_enable_triton_gemm=false'",
  "gpt2-torch": "gpt2.py --torch --profile benchmarks/results/traces/gpt2-torch",
  # Both frameworks as a training loop that reads its metrics every 30
  # steps runs them. In the traces of 2026-11-27 (5 steps per wait) the
  # device ran bf16-mixed's round back to back at 32.16 ms a step, and the
  # round took 7 ms more: 3.7 ms from the first call to its first kernel
  # (the host's work on the call, the hand-written step's alike, before the
  # CUDA graph starts), and the wait after the last. PyTorch's twin lost
  # 0.3 to 0.8 ms a step so.
  # With nvidia-smi's SM clock sampled every 100 ms: on the H200 at 15:00
  # UTC on 2026-11-27 these rounds held the chip at its 700 W limit at 1635
  # to 1785 MHz, where warm-up and compiles ran at 1980
  # (benchmarks/gpu_clock.py).
  "gpt2-steady": "gpt2.py --no-plain --autocast '' --presets"
  " bf16-mixed,fp16-mixed --steps-per-round 30 --rounds 5 --clocks 100",
  "gpt2-torch-steady": "gpt2.py --torch --steps-per-round 30 --rounds 5"
  " --clocks 100",
  # bf16-mixed at 30 and at 5 steps per wait with the clock sampled: run on
  # the H200 at 15:00 UTC on 2026-11-27 with nvidia-smi by hand, before
  # --clocks; the clock moved with how often the rounds waited (1694 and
  # 1753 MHz on average).
  **{
    f"gpt2-clocks-{n}": "gpt2.py --no-plain --autocast '' --presets"
    f" bf16-mixed --steps-per-round {n} --rounds {150 // n} --clocks 100"
    " --tag 'clock sampled'"
    for n in (30, 5)
  },
  # gpt2-cublas at 30 steps per wait, traced: where cuBLAS's step traced at
  # 45.4% back to back in a round of 5, the H200 at 16:39 UTC on 2026-11-27
  # traced this round of 30 at 43.4%, as long as its timed steps.
  "gpt2-cublas-steady": "gpt2.py --no-plain --autocast '' --presets"
  " bf16-mixed,fp16-mixed --steps-per-round 30 --rounds 5"
  " --xla-flags=--xla_gpu_enable_triton_gemm=false --clocks 100"
  " --profile benchmarks/results/traces/gpt2-cublas-steady",
  # A scout: gpt2-steady's bf16-mixed with every change not yet timed on a
  # chip at once, traced, so that its kernels say what each was worth:
  # cuBLAS for every matmul (the finite check's 66 us kernels, above), the
  # two-pass log-sum-exp (0.15 ms faster in loss-head-gpu, one run) and the
  # GELU through the logistic function (fewer instructions compiled for an
  # H100 in kernels that ran at 2.3 to 2.5 TB/s).
  "gpt2-tuned": "gpt2.py --no-plain --autocast '' --presets bf16-mixed"
  " --steps-per-round 30 --rounds 5 --lse two-pass --gelu logistic"
  " --xla-flags=--xla_gpu_enable_triton_gemm=false"
  " --profile benchmarks/results/traces/gpt2-tuned",
  # gpt2-cublas-steady's bf16-mixed with the attention's q, k and v
  # projection as one `Dense` (`--qkv dense`, gpt_model.QKVS). In the
  # H200's traces of 16:39 UTC on 2026-11-27 the packed projection's bias,
  # of rank 3, was not one XLA gives cuBLASLt's epilogue: it wrote the bias
  # out whole for the GEMM to add (`fwd attn/qkv/add`, 0.55 ms a step). XLA
  # adds a vector bias in the epilogue; compiled for an H100 here, with one,
  # the step moves 1.8 GB less. On the H200 at 18:06 UTC on 2026-11-27 the kernel was gone
  # and the device busy 0.28 ms (hand-bf16) and 0.54 ms (bf16-mixed) less a
  # step than gpt2-cublas-steady's in the same call; at 19:36 UTC 0.77 and
  # 0.59 ms less, and bf16-mixed's timed step 2.0% shorter.
  # `--qkv split` (three projections, no slices around the attention) has
  # no job: with XLA's dot merger kept from merging the three back
  # (`--xla_gpu_dot_merger_threshold_mb=0`) the H200 had not compiled its
  # first step after 170 s, nor after 300 s in a second call. Compiled here
  # for `--target h200` with the H200's jax and jax-cuda12-plugin (0.11.2)
  # it takes 9 to 11 s and moves what "dense" moves, in 204 more kernels
  # (72 more GEMMs and four more param leaves a layer, less the slices and
  # the gradients' packing).
  "gpt2-qkv-dense": "gpt2.py --no-plain --autocast '' --presets"
  " bf16-mixed --steps-per-round 30 --rounds 5 --qkv dense"
  " --xla-flags=--xla_gpu_enable_triton_gemm=false --clocks 100"
  " --profile benchmarks/results/traces/gpt2-qkv-dense",
  # gpt2-qkv-dense with the MLP's GELU where XLA:GPU computes it in fc's
  # GEMM epilogue (`--gelu epilogue`, gpt_model.gelu_epilogue: no remat, a
  # backward pass that shares no tanh with the forward one). Compiled for
  # the H200 here (jax 0.11.2), cuBLASLt's BIAS_GELU_AUX epilogue replaces
  # each layer's GELU kernel: 12 kernels fewer and 1.2 GB less moved a step
  # (the matmul's output no longer read back to write the GELU), the same
  # temporaries. Run in the same call as gpt2-qkv-dense, whose rows are
  # these without it.
  "gpt2-gelu-epilogue": "gpt2.py --no-plain --autocast '' --presets"
  " bf16-mixed --steps-per-round 30 --rounds 5 --qkv dense --gelu epilogue"
  " --xla-flags=--xla_gpu_enable_triton_gemm=false --clocks 100"
  " --profile benchmarks/results/traces/gpt2-gelu-epilogue",
  # gpt2-gelu-epilogue's step with the loss's log-sum-exp read in vectors:
  # each row of logits cut in 24 parts of 2096 values (`--lse-slices 24`,
  # gpt_model.logsumexp_one_pass) where the default cuts 128 of 393. On the
  # H200 at 19:36 UTC on 2026-11-27 that kernel (`fwd cross_entropy/reduce`)
  # took 1.07 ms a step at 1.56 TB/s, the slowest per byte of the step's
  # large kernels; compiled for the H200 here (jax 0.11.2), its PTX reads
  # the bfloat16 logits one value at a time, and in parts of 2096 four at a
  # time (benchmarks/ptx_loads.py). Traced, so that each kernel's time says
  # what each of the two changes was worth against gpt2-qkv-dense's trace
  # of the same call. On the H200 at 22:19 UTC on 2026-11-27 bf16-mixed ran
  # at 45.0% and 45.1% MFU in two calls, its device busy 0.90 ms a step less
  # than gpt2-qkv-dense's (0.72 of it the epilogue's).
  "gpt2-candidate": "gpt2.py --no-plain --autocast '' --presets"
  " bf16-mixed --steps-per-round 30 --rounds 5 --qkv dense --gelu epilogue"
  " --lse-slices 24 --xla-flags=--xla_gpu_enable_triton_gemm=false"
  " --clocks 100 --profile benchmarks/results/traces/gpt2-candidate",
  # gpt2-candidate with the rows cut in 12 parts of 4192 (of the one-pass
  # cuts, the loss layer alone was fastest so on the H200 at 22:19 UTC on
  # 2026-11-27: 7.38 ms against 7.58 for 24 parts and 8.00 for the
  # default's 128), untraced.
  "gpt2-candidate-lse12": "gpt2.py --no-plain --autocast '' --presets"
  " bf16-mixed --steps-per-round 30 --rounds 5 --qkv dense --gelu epilogue"
  " --lse-slices 12 --xla-flags=--xla_gpu_enable_triton_gemm=false"
  " --clocks 100",
  # The loss layer alone, with the one-pass log-sum-exp's rows cut in 128
  # parts (the default, first), 96, 24 and 12.
  "loss-head-gpu": "loss_head.py --lse-slices 96,24,12",
  # One size: on the H200 of 2026-11-27 two recipes took 33 s each to warm
  # up at n = 4096 (the chip's autotuning, it seems: they compile in 3 s for
  # an H100 here), and three sizes ran past the 150 s a job gets. 8192 is
  # where the H100 of 2026-11-22 measured FP8 at 1.25x of bf16. Alone it
  # still took 196 s on the H200 at 16:39 UTC on 2026-11-27 (warm-ups of 71
  # and 74 s), so it needs `--job-timeout 240`.
  "fp8-matmul": "fp8.py --matmul --sizes 8192 --rounds 10",
  # One process per preset: the device's peak is that preset's alone. The
  # chip's compiled step is kept beside the traces: on 2026-11-27 the H200's
  # bf16-mixed step held 1.5 GiB more temporaries than the same step
  # compiled for an H100 here, and only its HLO can say where.
  **{
    f"gpt2-memory-{name}": f"gpt2_memory.py --preset {name}"
    f" --hlo benchmarks/results/traces/gpt2-memory/{name}.hlo.txt.gz"
    for name in MEMORY_PRESETS
  },
  "overhead-gpu": "overhead.py --batch 16384 --steps 100",
  "overhead-gpu-kernels": "overhead.py --kernels --batch 16384",
  "overhead-gpu-kernels-update": "overhead.py --kernels --update-only",
  "overhead-gpu-update": "overhead.py --update-only --steps 100",
  # As a training loop that reads its metrics every 10 steps runs.
  "overhead-gpu-rounds": "overhead.py --batch 16384 --steps 30"
  " --steps-per-round 10",
  # Where the time goes: traces (kept beside the JSON, not committed).
  "overhead-gpu-profile": "overhead.py --batch 16384 --profile"
  " benchmarks/results/traces/gpu-step",
  "overhead-gpu-profile-update": "overhead.py --update-only --profile"
  " benchmarks/results/traces/gpu-update",
  "overhead-gpu-study": "overhead.py --study --batch 16384 --steps 100",
  "host-cost-gpu": "host_cost.py",
  "host-cost-gpu-deep": "host_cost.py --layers 74 --steps-per-round 30"
  " --rounds 40",
  "overhead-gpu-masters": "overhead.py --bf16-params --batch 16384 --steps 100",
  "overhead-gpu-masters-update": (
    "overhead.py --bf16-params --update-only --steps 100"
  ),
}
# Tiny configurations that check the pipeline (their figures mean nothing).
MLP = "--dims 16,32,4 --steps 3 --warmup 1"
CPU_QUICK = {
  "overhead-64": f"overhead.py {MLP} --batch 8",
  "overhead-update": f"overhead.py {MLP} --update-only",
  "overhead-study": f"overhead.py {MLP} --study",
  "overhead-masters-update": f"overhead.py {MLP} --bf16-params --update-only",
  "overhead-kernels": f"overhead.py {MLP} --kernels",
  "host-cost": "host_cost.py --layers 2 --steps-per-round 3 --rounds 2"
  " --warmup 1",
  "zero1": "zero1.py --layers 1 --d-model 32 --vocab 64 --seq 8 --batch 8"
  " --rounds 2",
  "compile": "compile_time.py --layers 1 --d-model 32 --seq 16 --rounds 1"
  " --depths 2",
  "fp8": "fp8.py --accuracy --epochs 1 --models mlp --presets bf16-mixed",
  "fp8-gpt": "fp8.py --gpt --steps 6 --layers 1 --d-model 32 --seq-len 16"
  " --eval-every 3 --text-bytes 100000",
  "fp8-gather": "fp8.py --gather --layers 1 --d-model 32 --seq-len 16"
  " --batch-size 8",
  "gpt": "gpt_compare.py --steps 6 --layers 1 --d-model 32 --seq-len 16"
  " --eval-every 3 --text-bytes 100000",
  "autocast": "autocast.py --steps 6 --layers 1 --d-model 32 --seq-len 16"
  " --eval-every 3 --text-bytes 100000 --rounds 1 --calls 2 --depths 2",
  "multihost": "multihost.py --layers 1 --d-model 32 --seq-len 16 --batch 8"
  " --steps 2 --warmup 1 --rounds 1",
  "lean-memory": "lean_state.py memory --presets bf16-true,bf16-remainders"
  " --layers 1 --d-model 32 --vocab 64 --seq 8",
  "lean-gpt": "lean_state.py gpt --presets bf16-true,bf16-sr-coat --steps 6"
  " --layers 1 --d-model 32 --seq-len 16 --eval-every 3 --text-bytes 100000",
  "lean-digits": "lean_state.py digits --presets bf16-true,bf16-sr-coat"
  " --epochs 1 --max-steps 3",
  "rounding-memory": "rounding_memory.py --layers 1 --d-model 32 --heads 4"
  " --vocab 64 --seq 8 --batch 2 --max-draw 64",
  "loss-head": "loss_head.py --batch 2 --seq 128 --d-model 64 --vocab 4096"
  " --chunks 16,64",
  "lean-speed": "lean_state.py speed --presets bf16-true,bf16-lean,bf16-sr-coat"
  " --layers 1 --d-model 32 --heads 4 --vocab 64 --seq 8 --calls 3 --rounds 2",
}
GPU_QUICK = {
  "gpt2": "gpt2.py --tiny --rounds 1 --profile benchmarks/results/traces/gpt2",
  "gpt2-torch": "gpt2.py --torch --tiny --rounds 1"
  " --profile benchmarks/results/traces/gpt2-torch",
  "loss-head-gpu": "loss_head.py --batch 2 --seq 128 --d-model 64"
  " --vocab 4096 --chunks 16,64 --lse-slices 16,4 --rounds 2",
  "gpt2-memory-bf16-mixed": "gpt2_memory.py --tiny --preset bf16-mixed",
  "fp8-matmul": "fp8.py --matmul --sizes 256",
  "overhead-gpu": "overhead.py --batch 256 --steps 3",
  "overhead-gpu-profile": "overhead.py --batch 256 --profile-steps 3"
  " --profile benchmarks/results/traces/gpu-quick",
}


def jobs(quick: bool, gpu: bool) -> dict[str, list[str]]:
  """Job name -> the script's path and arguments (without --json)."""
  chosen = {
    (False, False): CPU_JOBS,
    (False, True): GPU_JOBS,
    (True, False): CPU_QUICK,
    (True, True): GPU_QUICK,
  }[quick, gpu]
  return jobs_of(chosen)


def jobs_of(table: dict[str, str]) -> dict[str, list[str]]:
  """A job table's lines as each script's path and arguments."""
  return {
    name: [f"benchmarks/{line.split()[0]}", *shlex.split(line)[1:]]
    for name, line in table.items()
  }


def script_of(name: str) -> str | None:
  """The benchmark script (module name) that writes job `name`'s JSON."""
  for table in (CPU_JOBS, GPU_JOBS, CPU_QUICK, GPU_QUICK):
    if name in table:
      return table[name].split()[0].removesuffix(".py")
  return None


def run_job(
  name: str,
  argv: list[str],
  json_dir: pathlib.Path,
  timeout: float | None = None,
) -> float:
  """Runs one job in its own process; its seconds, or RuntimeError when it
  fails or runs past `timeout` seconds (then it is killed)."""
  cmd = [sys.executable, *argv, "--json", str(json_dir / f"{name}.json")]
  print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
  t0 = time.perf_counter()
  # A process group of its own, so that a kill reaches the job's children
  # too (torch.compile's workers, XLA's ptxas).
  job = subprocess.Popen(cmd, cwd=ROOT, env=os.environ, start_new_session=True)
  try:
    returncode = job.wait(timeout=timeout)
  except subprocess.TimeoutExpired:
    _kill(job)
    raise RuntimeError(f"{name} timed out after {timeout:g}s") from None
  except (
    BaseException
  ):  # Ctrl-C, SIGTERM: the job, in its own group, would live on
    _kill(job)
    raise
  if returncode:
    raise RuntimeError(f"{name} failed (exit {returncode})")
  return time.perf_counter() - t0


def _drop_torn(path: pathlib.Path) -> None:
  """Removes a job's JSON that a kill left half written (it would stop the
  page from rendering); whole results stay."""
  try:
    json.loads(path.read_text())
  except FileNotFoundError:
    pass
  except ValueError:  # JSONDecodeError, UnicodeDecodeError
    path.unlink()
    print(f"== {path.name}: half written when its job stopped, removed")


def _exit_on_sigterm(signum, frame):
  """A SIGTERM (a time limit's `timeout`) as SystemExit, so that the running
  job, in a process group of its own, is killed with the suite."""
  raise SystemExit(128 + signum)


def _kill(job: subprocess.Popen) -> None:
  """Kills `job`'s process group and waits for the job."""
  try:
    os.killpg(job.pid, signal.SIGKILL)
  except ProcessLookupError:  # already gone
    pass
  job.wait()


def _cpu_name() -> str:
  try:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def environment(gpu_kind: str | None) -> dict:
  import flax
  import jax
  import optax

  cores = len(os.sched_getaffinity(0))
  return {
    "date": datetime.date.today().isoformat(),
    "cpu": f"{cores} x {_cpu_name()}",
    "gpu": gpu_kind,
    "jax": jax.__version__,
    "flax": flax.__version__,
    "optax": optax.__version__,
    "python": platform.python_version(),
  }


def machines(env: dict, gpu_env: dict | None) -> str:
  """The page's lines on the machines that made the results."""

  def versions(e):
    return (
      f"jax {e['jax']}, flax {e['flax']}, optax {e['optax']}, Python"
      f" {e['python']}; {e['date']}."
    )

  cpu = f"CPU machine (every section unless it says GPU): {env['cpu']}; {versions(env)}"
  if not gpu_env:
    return (
      cpu + "\n\nGPU machine: none lent to the runs that made these results."
    )
  gpu = f"GPU machine: {gpu_env['gpu']} ({gpu_env['cpu']}); {versions(gpu_env)}"
  if gpu_env.get("note"):
    gpu += f" {gpu_env['note']}"
  return cpu + "\n\n" + gpu


def render(results: dict, env: dict, gpu_env: dict | None, quick: bool) -> str:
  """The whole BENCHMARKS.md: page.md with its tables filled in."""
  by_script: dict[str, dict] = {}
  for name, result in results.items():
    by_script.setdefault(script_of(name), {})[name] = result

  def fill(m: re.Match) -> str:
    module = importlib.import_module(m[1])
    return getattr(module, m[2])(by_script.get(m[1], {}))

  head = (
    "<!-- Generated by `python benchmarks/suite.py` from benchmarks/page.md"
    " (the prose) and benchmarks/results/*.json (the numbers); edit those,"
    " not this file. -->\n\n"
  )
  lines = machines(env, gpu_env)
  if quick:
    lines = (
      "**Quick run (`--quick`): tiny configurations that check the pipeline;"
      " the figures mean nothing.**\n\n" + lines
    )
  page = TABLE.sub(fill, PAGE.read_text())
  page = page.replace("<!-- machines -->", lines)
  return head + page


def cuda_plugin() -> bool:
  """Whether JAX's CUDA plugin is installed (found, not imported)."""
  return any(importlib.util.find_spec(name) for name in CUDA_PLUGINS)


def gpu_kind() -> str | None:
  """The first device's kind if it is a GPU, else None, asked in a child
  process: a JAX that starts its GPU backend here would hold (preallocate)
  most of the GPU's memory while the jobs run."""
  done = subprocess.run(
    [
      sys.executable,
      "-c",
      "import jax; d = jax.devices()[0]; print(d.platform); print(d.device_kind)",
    ],
    capture_output=True,
    text=True,
    check=True,
  )
  platform_name, kind = done.stdout.strip().splitlines()[-2:]
  return kind if platform_name == "gpu" else None


def archive(
  json_dir: pathlib.Path, path: pathlib.Path, since: float | None = None
) -> None:
  """`json_dir` as a .tar.gz at `path`, written beside it and renamed, so a
  run killed while writing leaves the last whole archive. The profiler's
  raw `.xplane.pb` files stay out (their perfetto traces go in): they are
  the bulk of a trace, and a device machine returns files of 16 MiB at
  most. So do the files under `traces/` last written before `since` (a
  `time.time()`): a warm machine keeps an earlier call's traces, and on
  2026-11-27 a third call's archive, carrying the two calls' before it,
  passed 16 MiB and did not come back."""

  def keep(f: tarfile.TarInfo) -> tarfile.TarInfo | None:
    if f.name.endswith(".xplane.pb"):
      return None
    old = since is not None and f.isfile() and f.mtime < since
    return None if old and "traces" in pathlib.PurePath(f.name).parts else f

  tmp = path.with_name(path.name + ".tmp")
  with tarfile.open(tmp, "w:gz") as tar:
    tar.add(json_dir, arcname=json_dir.name, filter=keep)
  tmp.replace(path)


def _run_jobs(args, todo, json_dir, gpu, start, failed) -> None:
  """Runs `todo`'s jobs in order; appends to `failed` the names of those
  that failed, timed out or were not started."""
  # The archive leaves out older traces. A second's margin: a file's mtime
  # comes from a coarser clock than time.time() on some kernels.
  since = time.time() - 1.0
  env_name = "environment-gpu.json" if gpu else "environment.json"
  # Written first, so a run cut short still says which machine it was.
  (json_dir / env_name).write_text(json.dumps(environment(gpu), indent=1))
  for name, job in todo.items():
    if args.deadline and time.monotonic() - start >= args.deadline:
      print(
        f"== {name}: not started, past --deadline {args.deadline:g}s",
        flush=True,
      )
      failed.append(name)
      continue
    if name in DEVICELESS and not cuda_plugin():
      print(
        f"== {name}: skipped, it needs JAX's CUDA plugin"
        ' (pip install "jax[cuda12]", the version of jax)',
        flush=True,
      )
      if args.only:  # asked for by name: not done is a failure
        failed.append(name)
      continue
    try:
      seconds = run_job(name, job, json_dir, args.job_timeout)
      print(f"== {name}: {seconds:.1f}s", flush=True)
    except RuntimeError as e:  # the other jobs still run and render
      print(f"== {e}", flush=True)
      failed.append(name)
      _drop_torn(json_dir / f"{name}.json")
    if args.archive:
      archive(json_dir, pathlib.Path(args.archive), since)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--quick", action="store_true", help="tiny configurations")
  p.add_argument("--render", action="store_true", help="only re-render")
  p.add_argument(
    "--only",
    default=None,
    help="comma-separated job names, run in the order given",
  )
  p.add_argument(
    "--archive",
    default=None,
    metavar="TGZ",
    help="after each job, write the json dir (and the perfetto traces"
    " under it) to this .tar.gz: a run cut short keeps what finished",
  )
  p.add_argument(
    "--job-timeout",
    type=float,
    default=None,
    metavar="SECONDS",
    help="kill a job that runs longer (it counts as failed; the others run)",
  )
  p.add_argument(
    "--deadline",
    type=float,
    default=None,
    metavar="SECONDS",
    help="start no job once the run has taken this long (those left count"
    " as failed): a lent GPU's session ends with what finished",
  )
  p.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"))
  p.add_argument(
    "--json-dir",
    default=str(ROOT / "benchmarks" / "results"),
    help="where each benchmark's JSON goes (the committed results by default)",
  )
  args = p.parse_args(argv)

  if args.archive and not pathlib.Path(args.archive).parent.is_dir():
    p.error(f"--archive {args.archive}: its folder does not exist")
  for flag in ("job_timeout", "deadline"):
    value = getattr(args, flag)
    if value is not None and not value > 0:  # NaN too
      p.error(
        f"--{flag.replace('_', '-')} must be a positive number of"
        f" seconds, got {value}"
      )
  start = time.monotonic()
  gpu = gpu_kind()
  json_dir = pathlib.Path(args.json_dir)
  json_dir.mkdir(parents=True, exist_ok=True)
  todo = jobs(args.quick, gpu is not None)
  if args.only:
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in todo]
    if not names:
      p.error(f"--only {args.only!r} names no job")
    if unknown:
      p.error(
        f"--only names {', '.join(unknown)}, not jobs on this machine"
        f" ({'GPU' if gpu else 'CPU'}{', quick' if args.quick else ''}):"
        f" {', '.join(todo)}"
      )
    todo = {n: todo[n] for n in names}
  failed = []
  if not args.render:
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
      _run_jobs(args, todo, json_dir, gpu, start, failed)
    finally:
      signal.signal(signal.SIGTERM, previous)
  results = {
    path.stem: json.loads(path.read_text())
    for path in sorted(json_dir.glob("*.json"))
  }
  env = results.pop("environment", None) or environment(None)
  gpu_env = results.pop("environment-gpu", None)
  page = render(results, env, gpu_env, args.quick)
  pathlib.Path(args.out).write_text(page)
  print(f"wrote {args.out}")
  if failed:
    raise SystemExit(f"failed: {', '.join(failed)}")
  return results


if __name__ == "__main__":
  main()
