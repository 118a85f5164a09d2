"""jmp_train: mixed-precision training for JAX, Flax and optax.

A drop-in superset of jmp's public API (`import jmp_train as jmp`), plus an
optax transformation with loss scaling, step skipping and FP32 master weights,
Flax linen and NNX wrapping (`jmp_train.linen.wrap`, `jmp_train.nnx.wrap`),
monitoring inside jit (`jmp_train.monitor`), FP8 delayed scaling
(`jmp_train.fp8`), stochastic rounding and named presets.
"""

from jmp_train import fp8 as fp8
from jmp_train import linen as linen
from jmp_train import monitor as monitor
from jmp_train import nnx as nnx
from jmp_train.loss_scale import DynamicLossScale as DynamicLossScale
from jmp_train.loss_scale import LossScale as LossScale
from jmp_train.loss_scale import NoOpLossScale as NoOpLossScale
from jmp_train.loss_scale import StaticLossScale as StaticLossScale
from jmp_train.loss_scale import all_finite as all_finite
from jmp_train.loss_scale import dynamic_loss_scale as dynamic_loss_scale
from jmp_train.loss_scale import select_tree as select_tree
from jmp_train.policy import Policy as Policy
from jmp_train.policy import cast_floating as cast_floating
from jmp_train.policy import cast_to_full as cast_to_full
from jmp_train.policy import cast_to_half as cast_to_half
from jmp_train.policy import dtype_to_names as dtype_to_names
from jmp_train.policy import get_policy as get_policy
from jmp_train.policy import half_dtype as half_dtype
from jmp_train.presets import PRESETS as PRESETS
from jmp_train.presets import Preset as Preset
from jmp_train.presets import get_preset as get_preset
from jmp_train.rounding import cast_stochastic as cast_stochastic
from jmp_train.schedule import PrecisionSchedule as PrecisionSchedule
from jmp_train.schedule import adjust_nnx_precision as adjust_nnx_precision
from jmp_train.schedule import adjust_precision as adjust_precision
from jmp_train.transform import MixedPrecisionState as MixedPrecisionState
from jmp_train.transform import current_loss_scale as current_loss_scale
from jmp_train.transform import mixed_precision as mixed_precision
from jmp_train.transform import train_metrics as train_metrics

__version__ = "0.1.0"
