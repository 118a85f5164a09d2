"""Mixed precision for flax.nnx models: `wrap(model, policy)`, and FP8
matmuls with `wrap(..., fp8=...)`, `Fp8Meta` and `update_fp8`."""

from jmp_train._src.fp8_nnx import Fp8Meta, update_fp8
from jmp_train._src.nnx import DEFAULT_FLOAT32_MODULES, wrap

__all__ = [
  "DEFAULT_FLOAT32_MODULES",
  "Fp8Meta",
  "update_fp8",
  "wrap",
]
