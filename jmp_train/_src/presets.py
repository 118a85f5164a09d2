"""Named precision recipes: a policy, a loss scale and a param-update rule.

| preset           | params  | compute | output  | loss scale | FP32 master | FP8 matmuls | apex |
|------------------|---------|---------|---------|------------|-------------|-------------|------|
| `fp32`           | float32 | float32 | float32 | none       | n/a         | no          | O0   |
| `bf16-mixed`     | float32 | bfloat16| float32 | none       | n/a         | no          | -    |
| `fp16-mixed`     | float32 | float16 | float32 | dynamic    | n/a         | no          | O1   |
| `bf16-true`      | bfloat16| bfloat16| float32 | none       | yes         | no          | -    |
| `fp16-true`      | float16 | float16 | float32 | dynamic    | yes         | no          | O2   |
| `bf16-fp8-mixed` | float32 | bfloat16| float32 | none       | n/a         | hybrid      | -    |
| `fp16-fp8-mixed` | float32 | float16 | float32 | dynamic    | n/a         | hybrid      | -    |

The presets above use `MasterWeights()`, the `mixed_precision` default (where
params are float32, "n/a", there is nothing to keep), and float32 optimizer
state. The lean presets below keep bf16 params and compute (as `bf16-true`)
with less beside them; bytes per param with Adam on one device, gradients
(bf16) included:

| preset             | param_update          | mu          | nu                | B/param |
|--------------------|-----------------------|-------------|-------------------|---------|
| `bf16-true`        | `MasterWeights()`     | float32     | float32           | 16      |
| `bf16-remainders`  | `ParamRemainders()`   | float32     | float32           | 14      |
| `bf16-lean`        | `ParamRemainders()`   | bfloat16    | bfloat16          | 10      |
| `bf16-kahan-lean`  | `KahanSummation()`    | bfloat16    | bfloat16          | 10      |
| `bf16-fp8-adam`    | `ParamRemainders()`   | FP8 (E4M3)  | bfloat16          | 9.03    |
| `bf16-sr-lean`     | `StochasticRounding()`| bfloat16    | bfloat16          | 8       |
| `bf16-sr-fp8-adam` | `StochasticRounding()`| FP8 (E4M3)  | bfloat16          | 7.03    |
| `bf16-sr-coat`     | `StochasticRounding()`| FP8 (E4M3)  | FP8, range expanded| 6.09   |

FP8 states have one float32 scale per 128 values (and one exponent with range
expansion). ZeRO-1 divides everything but the params and gradients by N.

The fp8 presets are NeMo's `bf16_with_fp8_mixed` / `fp16_with_fp8_mixed`
precisions with current scaling (`CurrentScaling()`: hybrid E4M3/E5M2, each
tensor's scale from its own amax) in place of NeMo's delayed recipe (README,
"Presets", says why). Pass `preset.fp8` to
`jmp_train.linen.wrap(..., fp8=preset.fp8)` or `jmp_train.nnx.wrap`.

A preset is a frozen dataclass: adjust one with `dataclasses.replace`, e.g.
`dataclasses.replace(preset, param_update=StochasticRounding(seed=0))`, or
give its dynamic loss scale another growth interval with
`dataclasses.replace(preset.loss_scale, period=100)`. Apex O3 (pure float16,
no master weights, no scaling) is `fp16-true` with `RoundToNearest()` and a
static scale of 1: we do not name it, since it loses small updates (see
README).
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import optax

from jmp_train._src import fp8_recipe, state_storage, transform
from jmp_train._src import loss_scale as ls_lib
from jmp_train._src import param_update as param_update_lib
from jmp_train._src import policy as policy_lib
from jmp_train._src import state_format as sf


@dataclasses.dataclass(frozen=True)
class Preset:
  """A named recipe: use `policy` for the model, `mixed_precision` for optax.

  Presets are values: `dataclasses.replace(preset, loss_scale=...)` makes an
  adjusted copy (checked like a new one), and two presets are equal when
  all their fields are. `get_preset` returns the same object for a name.

  Attributes:
    name: the preset's name.
    policy: the `Policy` to wrap the model with.
    loss_scale: the loss scale `mixed_precision` starts from: a loss-scale
      object, or None or a positive number as `mixed_precision` takes them
      (stored as `NoOpLossScale()` / `StaticLossScale`).
    param_update: how params stored below float32 are updated
      (`MasterWeights()`, `ParamRemainders()`, `KahanSummation()`,
      `RoundToNearest()` or `StochasticRounding(seed)`).
    fp8: the FP8 recipe for the model's matmuls, or None.
    state_formats: how the optimizer state is stored (`mixed_precision`'s
      `state_formats`: None, one format for the moments, or a mapping by
      field name, kept read-only).

  Raises:
    TypeError: for a field of the wrong kind, naming it.
    ValueError: for a zero static loss scale.

  Example:
    >>> import dataclasses, optax, jmp_train
    >>> preset = get_preset("bf16-true")
    >>> print(preset.policy)
    params=bfloat16,compute=bfloat16,output=float32
    >>> tx = preset.mixed_precision(optax.adamw(1e-3))
    >>> fp16 = get_preset("fp16-mixed")
    >>> fast = dataclasses.replace(
    ...     fp16, loss_scale=dataclasses.replace(fp16.loss_scale, period=100))
    >>> fast.loss_scale.period, fast == fp16
    (100, False)
  """

  name: str
  policy: policy_lib.Policy
  loss_scale: ls_lib.LossScale
  param_update: param_update_lib.ParamUpdate = param_update_lib.MasterWeights()
  fp8: fp8_recipe.Recipe | None = None
  state_formats: Any = None

  def __post_init__(self):
    # A plain value (not a pytree): this runs when a preset is built or
    # replaced, never on unflatten.
    if not isinstance(self.name, str):
      raise TypeError(f"Preset name must be a str, got {self.name!r}.")
    if not isinstance(self.policy, (policy_lib.Policy, str)):
      raise TypeError(
        "Preset policy must be a jmp_train.Policy or its string (e.g. "
        f"'p=bf16,c=bf16,o=f32'), got {self.policy!r}."
      )
    # What wrap(...) takes, a Preset takes: strings and recipe names too.
    object.__setattr__(self, "policy", policy_lib.get_policy(self.policy))
    scale = transform.as_loss_scale(self.loss_scale)
    object.__setattr__(self, "loss_scale", scale)
    param_update_lib.check(self.param_update, "Preset param_update")
    fp8 = fp8_recipe.check_recipe(self.fp8, "Preset fp8")
    object.__setattr__(self, "fp8", fp8)
    formats = state_storage.check_formats(
      self.state_formats, "Preset state_formats"
    )
    if isinstance(formats, dict):
      # A preset is a shared value: its dict must not change under it.
      formats = types.MappingProxyType(formats)
    object.__setattr__(self, "state_formats", formats)

  # Equal presets have equal fields, so hashing all but the loss scale (which
  # may hold arrays) keeps presets usable as dict keys and static arguments.
  def __hash__(self) -> int:
    formats = self.state_formats
    if isinstance(formats, types.MappingProxyType):
      formats = tuple(sorted(formats.items()))
    return hash((self.name, self.policy, self.param_update, self.fp8, formats))

  def mixed_precision(
    self, inner: optax.GradientTransformation
  ) -> optax.GradientTransformationExtraArgs:
    """`inner` wrapped by `mixed_precision` with this preset's settings."""
    return transform.mixed_precision(
      inner,
      loss_scale=self.loss_scale,
      param_update=self.param_update,
      state_formats=self.state_formats,
    )


def _presets() -> dict[str, Preset]:
  get = policy_lib.get_policy
  none, dynamic = ls_lib.NoOpLossScale(), ls_lib.dynamic_loss_scale()
  fp8 = fp8_recipe.DEFAULT_RECIPE
  bf16 = get("p=bf16,c=bf16,o=f32")
  remainders = param_update_lib.ParamRemainders()
  sr = param_update_lib.StochasticRounding(seed=0)
  kahan = param_update_lib.KahanSummation()
  bf16_moments = sf.BFloat16()
  fp8_mu = {"mu": sf.FP8(), "nu": sf.BFloat16()}
  fp8_both = {"mu": sf.FP8(), "nu": sf.FP8(expand_range=True)}
  return {
    p.name: p
    for p in (
      Preset("fp32", get("float32"), none),
      Preset("bf16-mixed", get("p=f32,c=bf16,o=f32"), none),
      Preset("fp16-mixed", get("p=f32,c=f16,o=f32"), dynamic),
      Preset("bf16-true", get("p=bf16,c=bf16,o=f32"), none),
      Preset("fp16-true", get("p=f16,c=f16,o=f32"), dynamic),
      Preset("bf16-fp8-mixed", get("p=f32,c=bf16,o=f32"), none, fp8=fp8),
      Preset("fp16-fp8-mixed", get("p=f32,c=f16,o=f32"), dynamic, fp8=fp8),
      Preset("bf16-remainders", bf16, none, remainders),
      Preset("bf16-lean", bf16, none, remainders, state_formats=bf16_moments),
      Preset("bf16-kahan-lean", bf16, none, kahan, state_formats=bf16_moments),
      Preset("bf16-sr-lean", bf16, none, sr, state_formats=bf16_moments),
      Preset("bf16-fp8-adam", bf16, none, remainders, state_formats=fp8_mu),
      Preset("bf16-sr-fp8-adam", bf16, none, sr, state_formats=fp8_mu),
      Preset("bf16-sr-coat", bf16, none, sr, state_formats=fp8_both),
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
