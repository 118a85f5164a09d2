"""Storage formats for optimizer state (`mixed_precision(state_formats=...)`)."""

from jmp_train._src.state_format import (
  FP8,
  BFloat16,
  Float16,
  Float32,
  Scaled,
  StateFormat,
  compress,
  expand,
)

__all__ = [
  "BFloat16",
  "FP8",
  "Float16",
  "Float32",
  "Scaled",
  "StateFormat",
  "compress",
  "expand",
]
