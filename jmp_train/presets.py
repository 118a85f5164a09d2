"""Named precision recipes: a policy, a loss scale and a master-weights choice.

| preset           | params  | compute | output  | loss scale | FP32 master | FP8 matmuls | apex |
|------------------|---------|---------|---------|------------|-------------|-------------|------|
| `fp32`           | float32 | float32 | float32 | none       | n/a         | no          | O0   |
| `bf16-mixed`     | float32 | bfloat16| float32 | none       | n/a         | no          | -    |
| `fp16-mixed`     | float32 | float16 | float32 | dynamic    | n/a         | no          | O1   |
| `bf16-true`      | bfloat16| bfloat16| float32 | none       | yes         | no          | -    |
| `fp16-true`      | float16 | float16 | float32 | dynamic    | yes         | no          | O2   |
| `bf16-fp8-mixed` | float32 | bfloat16| float32 | none       | n/a         | hybrid      | -    |
| `fp16-fp8-mixed` | float32 | float16 | float32 | dynamic    | n/a         | hybrid      | -    |

The fp8 presets are NeMo's `bf16_with_fp8_mixed` / `fp16_with_fp8_mixed`:
the mixed policy plus Transformer Engine's default delayed-scaling recipe
(`Fp8Recipe()`: hybrid E4M3/E5M2, margin 0, 1024-step history, "max"). Pass
`preset.fp8` to `jmp_train.linen.wrap(..., fp8=preset.fp8)`.

Apex O3 (pure float16, no master weights, no scaling) is `fp16-true` with
`master_weights=False` and a static scale of 1: we do not name it, since it
loses small updates (see README).
"""

from __future__ import annotations

import dataclasses

import optax

from jmp_train import fp8 as fp8_lib
from jmp_train import loss_scale as ls_lib
from jmp_train import policy as policy_lib
from jmp_train import transform


@dataclasses.dataclass(frozen=True, eq=False)
class Preset:
  """A named recipe: use `policy` for the model, `mixed_precision` for optax.

  Presets are singletons compared by identity (a loss scale holds arrays).

  Attributes:
    name: the preset's name.
    policy: the `Policy` to wrap the model with.
    loss_scale: the loss scale `mixed_precision` starts from.
    master_weights: whether float params below float32 keep float32 masters.
    fp8: the FP8 recipe for the model's matmuls, or None.

  Example:
    >>> import optax
    >>> preset = get_preset("bf16-true")
    >>> print(preset.policy)
    params=bfloat16,compute=bfloat16,output=float32
    >>> tx = preset.mixed_precision(optax.adamw(1e-3))
  """

  name: str
  policy: policy_lib.Policy
  loss_scale: ls_lib.LossScale
  master_weights: bool
  fp8: fp8_lib.Fp8Recipe | None = None

  def mixed_precision(
    self, inner: optax.GradientTransformation
  ) -> optax.GradientTransformationExtraArgs:
    """`inner` wrapped by `mixed_precision` with this preset's settings."""
    return transform.mixed_precision(
      inner, loss_scale=self.loss_scale, master_weights=self.master_weights
    )


def _presets() -> dict[str, Preset]:
  get = policy_lib.get_policy
  none, dynamic = ls_lib.NoOpLossScale(), ls_lib.dynamic_loss_scale()
  recipe = fp8_lib.Fp8Recipe()
  return {
    p.name: p
    for p in (
      Preset("fp32", get("float32"), none, False),
      Preset("bf16-mixed", get("p=f32,c=bf16,o=f32"), none, False),
      Preset("fp16-mixed", get("p=f32,c=f16,o=f32"), dynamic, False),
      Preset("bf16-true", get("p=bf16,c=bf16,o=f32"), none, True),
      Preset("fp16-true", get("p=f16,c=f16,o=f32"), dynamic, True),
      Preset("bf16-fp8-mixed", get("p=f32,c=bf16,o=f32"), none, False, recipe),
      Preset(
        "fp16-fp8-mixed", get("p=f32,c=f16,o=f32"), dynamic, False, recipe
      ),
    )
  }


PRESETS: dict[str, Preset] = _presets()


def get_preset(name: str) -> Preset:
  """Returns the preset called `name` (see the module docstring's table).

  Raises:
    ValueError: for an unknown name, listing the known ones.
  """
  try:
    return PRESETS[name]
  except (KeyError, TypeError):
    raise ValueError(
      f"Unknown preset {name!r}: known presets are {', '.join(PRESETS)}."
    ) from None
