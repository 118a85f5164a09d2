"""Mixed precision for flax.nnx models: `wrap(model, policy)`."""

from jmp_train._src.nnx import DEFAULT_FLOAT32_MODULES, wrap

__all__ = [
  "DEFAULT_FLOAT32_MODULES",
  "wrap",
]
