"""The timing loops the benchmark scripts share: steps side by side in one
process, in rounds whose order rotates, the median per step; and trace times
taken from Python stack depths spread over one of CPython's frame-stack
chunks."""

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def rotated(names: list, k: int) -> list:
  """`names` rotated left by `k` (modulo their count): round k's order, so
  that drift over the rounds hits every name alike."""
  k %= len(names)
  return names[k:] + names[:k]


def seconds_per_step(names, run_round, rounds: int, steps_per_round: int):
  """Median seconds per step of each of `names`: `run_round(name)` runs
  `steps_per_round` of its steps and waits for them, `rounds` times, each
  round in an order rotated by one, so drift spreads evenly."""
  names = list(names)
  times = {name: [] for name in names}
  for r in range(rounds):
    for name in rotated(names, r):
      t0 = time.perf_counter()
      run_round(name)
      times[name].append((time.perf_counter() - t0) / steps_per_round)
  return {name: statistics.median(t) for name, t in times.items()}


# CPython (3.11 and 3.12 alike) keeps the frames of running Python functions
# in 16 KiB chunks (2048 slots of 8 bytes) and frees a chunk as soon as the
# frame at its base returns. Code whose calls keep crossing a chunk boundary
# maps and unmaps memory at each crossing, and where the boundaries fall
# depends on how deep in the stack the code runs. On 2026-11-26 the wrapped
# GPT's loss gradient, traced by `jax.make_jaxpr` from a script's top level,
# made about 5,800 more mmap calls per trace than the bare model's, and the
# same trace took tens of percent longer from one depth than from another
# (BENCHMARKS.md, "Compile time"). A trace time from one depth measures where
# the boundaries fell as much as the code traced: `seconds_by_depth` times
# the code from depths spread over one chunk.
CHUNK_SLOTS = 2048
PAD_SLOTS = 128  # slots of the frame stack a padding frame takes
DEPTHS = CHUNK_SLOTS // PAD_SLOTS  # padding frames in one chunk
# A frame holds its local names (`n`, `fn` and the padding names), its value
# stack (4 slots in the padding function) and a fixed header (9 slots in
# CPython 3.11, 3.12 and 3.13).
_PAD_NAMES = PAD_SLOTS - 2 - 4 - 9


def count_arg(text: str) -> int:
  """An argparse type: a count of at least 1 (rounds, steps, layers)."""
  count = int(text)
  if count < 1:
    raise argparse.ArgumentTypeError(f"must be >= 1, got {count}")
  return count


def depths_arg(text: str) -> int:
  """An argparse type: a count of stack depths for `seconds_by_depth`."""
  depths = int(text)
  if not 1 <= depths <= DEPTHS:
    raise argparse.ArgumentTypeError(
      f"--depths must be 1 to {DEPTHS}, got {depths}"
    )
  return depths


def _padding_function() -> Callable:
  """`pad(n, fn)`: `fn()` called from `n` frames of PAD_SLOTS slots each
  deeper than `pad(0, fn)` calls it (the frames' local names are never
  assigned; they exist only to take room)."""
  names = "".join(f"    _{i} = 0\n" for i in range(_PAD_NAMES))
  namespace = {}
  exec(
    "def pad(n, fn):\n"
    "  if n < 0:\n" + names + "  return fn() if n == 0 else pad(n - 1, fn)\n",
    namespace,
  )
  return namespace["pad"]


_pad = _padding_function()


def at_stack_depth(fn: Callable[[], T], frames: int) -> T:
  """`fn()`, called `frames` padding frames deeper than with `frames=0` (0
  to DEPTHS - 1: up to nearly one frame-stack chunk deeper)."""
  if not 0 <= frames < DEPTHS:
    raise ValueError(f"frames must be in [0, {DEPTHS}), got {frames!r}")
  return _pad(frames, fn)


def seconds_by_depth(
  names, run: Callable[[str], object], depths: int = DEPTHS
) -> dict[str, list[float]]:
  """Seconds `run(name)` takes for each of `names`, called from each of
  `depths` stack depths spread over one frame-stack chunk (`k * DEPTHS //
  depths` padding frames deep, k = 0 .. depths - 1: evenly where `depths`
  divides DEPTHS), the names in an order rotated at each depth: {name:
  [seconds at each depth]}."""
  if not 1 <= depths <= DEPTHS:
    raise ValueError(f"depths must be in [1, {DEPTHS}], got {depths!r}")
  names = list(names)
  if not names:
    raise ValueError("seconds_by_depth needs at least one name, got none")
  seconds = {name: [] for name in names}
  for k in range(depths):
    frames = k * DEPTHS // depths
    for name in rotated(names, k):
      t0 = time.perf_counter()
      at_stack_depth(functools.partial(run, name), frames)
      seconds[name].append(time.perf_counter() - t0)
  return seconds
