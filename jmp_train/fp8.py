"""FP8 matmuls with Transformer Engine's delayed scaling, for Flax.

The recipe, scale rule and state (`Fp8Recipe`, `Fp8DotState`, `update`), the
FP8 matmul (`fp8_dot_general`) and the Flax modules (`Fp8DotGeneral`,
`Einsum`). The state lives in the "fp8_meta" collection, beside the params;
a train step differentiates the loss with respect to it and calls `update`
once per step.
"""

from jmp_train._src.fp8 import (
  AMAX_COMPUTE_ALGOS,
  COLLECTION,
  E4M3,
  E5M2,
  FORMATS,
  FP8_MAX,
  TENSORS,
  Fp8DotState,
  Fp8Recipe,
  combined_amax,
  compute_scale,
  init_state,
  is_fp8_state,
  roll_amax_history,
  scales,
  step_state,
  update,
)
from jmp_train._src.fp8_dot import fp8_dot_general
from jmp_train._src.fp8_linen import Einsum, Fp8DotGeneral

__all__ = [
  "AMAX_COMPUTE_ALGOS",
  "COLLECTION",
  "E4M3",
  "E5M2",
  "FORMATS",
  "FP8_MAX",
  "TENSORS",
  "Einsum",
  "Fp8DotGeneral",
  "Fp8DotState",
  "Fp8Recipe",
  "combined_amax",
  "compute_scale",
  "fp8_dot_general",
  "init_state",
  "is_fp8_state",
  "roll_amax_history",
  "scales",
  "step_state",
  "update",
]
