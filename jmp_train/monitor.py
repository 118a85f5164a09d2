"""Monitoring inside jit: non-finite gradients, zeros, loss-scale alarms."""

from jmp_train._src.monitor import (
  loss_scale_alarms,
  nonfinite_counts,
  nonfinite_report,
  num_zeros,
  warn_loss_scale,
)

__all__ = [
  "loss_scale_alarms",
  "nonfinite_counts",
  "nonfinite_report",
  "num_zeros",
  "warn_loss_scale",
]
