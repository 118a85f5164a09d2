"""Named mixed-precision presets (`fp32`, `bf16-mixed`, ...)."""

from jmp_train._src.presets import PRESETS, Preset, get_preset

__all__ = [
  "get_preset",
  "Preset",
  "PRESETS",
]
