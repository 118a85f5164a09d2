"""Mixed precision for flax.linen models: `wrap(module, policy)`."""

from jmp_train._src.linen import DEFAULT_FLOAT32_MODULES, wrap

__all__ = [
  "DEFAULT_FLOAT32_MODULES",
  "wrap",
]
