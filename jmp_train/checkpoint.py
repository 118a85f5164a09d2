"""Orbax checkpoints of the train state, with or without master weights."""

from jmp_train._src.checkpoint import Checkpointer

__all__ = [
  "Checkpointer",
]
