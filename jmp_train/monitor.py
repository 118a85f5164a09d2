"""Monitoring inside jit: non-finite gradients, zeros, loss-scale alarms, FP8."""

from jmp_train._src.monitor import (
  fp8_statistics,
  loss_scale_alarms,
  nonfinite_counts,
  nonfinite_report,
  num_zeros,
  warn_loss_scale,
)

__all__ = [
  "fp8_statistics",
  "loss_scale_alarms",
  "nonfinite_counts",
  "nonfinite_report",
  "num_zeros",
  "warn_loss_scale",
]
