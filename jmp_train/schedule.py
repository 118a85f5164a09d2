"""Switching precision mid-run without losing optimizer state."""

from jmp_train._src.schedule import (
  PrecisionSchedule,
  adjust_nnx_precision,
  adjust_precision,
)

__all__ = [
  "adjust_nnx_precision",
  "adjust_precision",
  "PrecisionSchedule",
]
