"""jmp_train: mixed-precision training for JAX, Flax and optax.

A drop-in superset of jmp's public API (`import jmp_train as jmp`), plus an
optax transformation with loss scaling, step skipping and FP32 master weights
(`mixed_precision`), Flax linen and NNX wrapping (`jmp_train.linen.wrap`,
`jmp_train.nnx.wrap`), a train state and step builder for one device, data
parallelism and ZeRO-1 (`jmp_train.train`, `jmp_train.zero1`), FP8
(`jmp_train.fp8`), checkpoints, monitoring inside jit, stochastic rounding and
named presets, and per-operation autocast for any JAX function
(`autocast`). The implementation lives in `jmp_train._src`.
"""

from jmp_train import (
  accumulation,
  checkpoint,
  distributed,
  fp8,
  linen,
  memory,
  monitor,
  nnx,
  presets,
  schedule,
  state_format,
  train,
  zero1,
)
from jmp_train._src.accumulation import (
  accumulate_gradients,
)
from jmp_train._src.autocast import autocast
from jmp_train._src.autocast_lists import AutocastLists
from jmp_train._src.loss_scale import (
  MAX_LOSS_SCALE,
  MIN_LOSS_SCALE,
  DynamicLossScale,
  LossScale,
  NoOpLossScale,
  StaticLossScale,
  all_finite,
  dynamic_loss_scale,
  select_tree,
)
from jmp_train._src.param_update import (
  KahanSummation,
  MasterWeights,
  ParamRemainders,
  RoundToNearest,
  StochasticRounding,
)
from jmp_train._src.policy import (
  Policy,
  cast_floating,
  cast_to_full,
  cast_to_half,
  dtype_to_names,
  get_policy,
  half_dtype,
)
from jmp_train._src.presets import (
  PRESETS,
  Preset,
  get_preset,
)
from jmp_train._src.rounding import (
  cast_stochastic,
)
from jmp_train._src.schedule import (
  PrecisionSchedule,
  adjust_nnx_precision,
  adjust_precision,
)
from jmp_train._src.transform import (
  MixedPrecisionState,
  current_loss_scale,
  mixed_precision,
  train_metrics,
)

__version__ = "0.1.0"

__all__ = [
  "AutocastLists",
  "KahanSummation",
  "MasterWeights",
  "ParamRemainders",
  "RoundToNearest",
  "StochasticRounding",
  "DynamicLossScale",
  "LossScale",
  "MAX_LOSS_SCALE",
  "MIN_LOSS_SCALE",
  "MixedPrecisionState",
  "NoOpLossScale",
  "Policy",
  "PrecisionSchedule",
  "Preset",
  "PRESETS",
  "StaticLossScale",
  "accumulate_gradients",
  "accumulation",
  "autocast",
  "adjust_nnx_precision",
  "adjust_precision",
  "all_finite",
  "cast_floating",
  "cast_stochastic",
  "cast_to_full",
  "cast_to_half",
  "checkpoint",
  "current_loss_scale",
  "distributed",
  "dtype_to_names",
  "dynamic_loss_scale",
  "fp8",
  "get_policy",
  "get_preset",
  "half_dtype",
  "linen",
  "memory",
  "mixed_precision",
  "monitor",
  "nnx",
  "presets",
  "schedule",
  "select_tree",
  "state_format",
  "train",
  "train_metrics",
  "zero1",
]
