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
