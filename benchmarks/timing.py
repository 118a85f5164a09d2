"""The timing loop the benchmark scripts share: steps side by side in one
process, in rounds whose order rotates, the median per step."""

import statistics
import time


def seconds_per_step(names, run_round, rounds: int, steps_per_round: int):
  """Median seconds per step of each of `names`: `run_round(name)` runs
  `steps_per_round` of its steps and waits for them, `rounds` times, each
  round in an order rotated by one, so drift spreads evenly."""
  names = list(names)
  times = {name: [] for name in names}
  for r in range(rounds):
    k = r % len(names)
    for name in names[k:] + names[:k]:
      t0 = time.perf_counter()
      run_round(name)
      times[name].append((time.perf_counter() - t0) / steps_per_round)
  return {name: statistics.median(t) for name, t in times.items()}


# CPython (3.11 and 3.12 alike) keeps the frames of running Python functions
# in 16 KiB chunks (2048 slots of 8 bytes) and frees a chunk as soon as the
# frame at its base returns. Code whose calls keep crossing a chunk boundary
# maps and unmaps memory at each crossing, and where the boundaries fall
# depends on how deep in the stack the code runs. Tracing the GPT's gradient
# with `jax.make_jaxpr` took 0.41 to 0.57 s on 2026-11-26, the same function
# called from 24 different depths, and the wrapped model's 0.41 to 0.59 s
# (5,600 mmap calls a trace at the worst depth, counted with perf). A trace
# time from one depth measures where the boundaries fell as much as the code
# traced: `at_stack_depth` spreads the rounds of a measurement over one chunk.
CHUNK_SLOTS = 2048
PAD_SLOTS = 128  # slots a padding frame takes, near enough


def _padding_function():
  """`pad(n, fn)`: `fn()` called under `n` frames of about PAD_SLOTS slots
  each (a frame's size is its count of local names, which this one never
  assigns; they exist only to take room)."""
  names = "".join(f"    _{i} = 0\n" for i in range(PAD_SLOTS - 8))
  namespace = {}
  exec(
    "def pad(n, fn):\n"
    "  if n < 0:\n" + names + "  return fn() if n == 0 else pad(n - 1, fn)\n",
    namespace,
  )
  return namespace["pad"]


_pad = _padding_function()


def at_stack_depth(fn, k: int, count: int):
  """`fn()`, called from the k-th of `count` stack depths spread evenly over
  one frame-stack chunk (k = 0: from here)."""
  frames = CHUNK_SLOTS // PAD_SLOTS
  return _pad((k % count) * frames // count, fn)
