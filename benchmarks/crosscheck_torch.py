"""Cross-check: our hysteresis=1 scale trajectory against torch.amp.GradScaler.

Not part of the test suite (torch is not a dependency): run it where torch is
installed. It drives the real GradScaler (CPU) through scripted overflow
sequences (an inf injected into a gradient) and compares the scale after every
step with ours, for several growth/backoff/interval settings.

  pip install torch   # e.g. torch==2.13.0, CPU build
  python benchmarks/crosscheck_torch.py
"""

import numpy as np
import torch

import jmp_train


def torch_trajectory(found_inf, init, growth, backoff, interval):
  param = torch.nn.Parameter(torch.zeros(4))
  opt = torch.optim.SGD([param], lr=0.0)
  scaler = torch.amp.GradScaler(
    "cpu",
    init_scale=init,
    growth_factor=growth,
    backoff_factor=backoff,
    growth_interval=interval,
  )
  scales = []
  for inf in found_inf:
    opt.zero_grad()
    loss = scaler.scale(param.sum())
    loss.backward()
    if inf:
      param.grad[0] = float("inf")
    scaler.step(opt)
    scaler.update()
    scales.append(scaler.get_scale())
  return np.array(scales, np.float32)


def our_trajectory(found_inf, init, growth, backoff, interval):
  scaler = jmp_train.dynamic_loss_scale(
    init_scale=init,
    growth_factor=growth,
    backoff_factor=backoff,
    growth_interval=interval,
    min_scale=2.0**-126,
  )
  scales = []
  for inf in found_inf:
    scaler = scaler.adjust(np.bool_(not inf))
    scales.append(float(scaler.loss_scale))
  return np.array(scales, np.float32)


def main():
  rng = np.random.default_rng(0)
  sequences = {f"random p={p}": rng.random(300) < p for p in (0.02, 0.1, 0.3)}
  sequences["bursts"] = np.array(([False] * 9 + [True] * 3) * 25)
  settings = [
    (2.0**16, 2.0, 0.5, 2000),
    (2.0**16, 2.0, 0.5, 5),
    (2.0**10, 4.0, 0.25, 3),
  ]
  print("| sequence | init, growth, backoff, interval | steps | equal |")
  print("|---|---|---|---|")
  all_equal = True
  for name, seq in sequences.items():
    for init, growth, backoff, interval in settings:
      want = torch_trajectory(seq, init, growth, backoff, interval)
      got = our_trajectory(seq, init, growth, backoff, interval)
      equal = bool(np.array_equal(got, want))
      all_equal &= equal
      print(
        f"| {name} | 2^{int(np.log2(init))}, {growth}, {backoff}, "
        f"{interval} | {len(seq)} | {'yes' if equal else 'NO'} |"
      )
  print(f"\nall trajectories equal: {all_equal} (torch {torch.__version__})")
  return all_equal


if __name__ == "__main__":
  raise SystemExit(0 if main() else 1)
