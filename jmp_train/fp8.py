"""FP8 matmuls for Flax: delayed, current and blockwise scaling.

The recipes and their scale rules (`DelayedScaling`, `CurrentScaling`,
`BlockwiseScaling`), the per-matmul state and its update (`Fp8DotState`,
`update`), weights stored in FP8 (`Fp8Param`, `cast_params`,
`with_grad_slots`, `grads_of`), the FP8 matmuls (`fp8_dot_general`,
`block_dot_general`) and the Flax modules (`Fp8DotGeneral`, `Einsum`). The state lives in the "fp8_meta"
collection, beside the params; a train step differentiates the loss with
respect to it and calls `update` once per step.
"""

from jmp_train._src.fp8 import (
  COLLECTION,
  TENSORS,
  Fp8DotState,
  combined_amax,
  init_state,
  is_fp8_state,
  rescale_output_grads,
  roll_amax_history,
  scales,
  step_state,
  update,
)
from jmp_train._src.fp8_block import block_dot_general
from jmp_train._src.fp8_check import (
  CUBLAS_FP8_TARGET,
  Matmul,
  check_fp8,
  compiled_matmuls,
  fp8_layers,
  matmuls,
)
from jmp_train._src.fp8_dot import fp8_dot_general
from jmp_train._src.fp8_linen import Einsum, Fp8DotGeneral
from jmp_train._src.fp8_param import (
  Fp8Param,
  Fp8ParamWithGrad,
  cast_param,
  cast_params,
  grads_of,
  is_fp8_param,
  with_grad_slots,
)
from jmp_train._src.fp8_recipe import (
  AMAX_COMPUTE_ALGOS,
  DEFAULT_RECIPE,
  E4M3,
  E5M2,
  FORMATS,
  FP8_MAX,
  OPERANDS_NAME,
  OUTPUT_NAME,
  REMAT_NAMES,
  BlockwiseScaling,
  CurrentScaling,
  DelayedScaling,
  Recipe,
  current_scale,
  delayed_scale,
)

# Earlier names, kept: the delayed recipe and its scale rule.
Fp8Recipe = DelayedScaling
compute_scale = delayed_scale

__all__ = [
  "AMAX_COMPUTE_ALGOS",
  "COLLECTION",
  "CUBLAS_FP8_TARGET",
  "DEFAULT_RECIPE",
  "E4M3",
  "E5M2",
  "FORMATS",
  "FP8_MAX",
  "OPERANDS_NAME",
  "OUTPUT_NAME",
  "REMAT_NAMES",
  "TENSORS",
  "BlockwiseScaling",
  "CurrentScaling",
  "DelayedScaling",
  "Einsum",
  "Fp8DotGeneral",
  "Fp8DotState",
  "Fp8Param",
  "Fp8ParamWithGrad",
  "Fp8Recipe",
  "Matmul",
  "Recipe",
  "block_dot_general",
  "cast_param",
  "cast_params",
  "check_fp8",
  "combined_amax",
  "compiled_matmuls",
  "compute_scale",
  "current_scale",
  "delayed_scale",
  "fp8_layers",
  "fp8_dot_general",
  "grads_of",
  "init_state",
  "is_fp8_param",
  "is_fp8_state",
  "matmuls",
  "rescale_output_grads",
  "roll_amax_history",
  "scales",
  "step_state",
  "update",
  "with_grad_slots",
]
