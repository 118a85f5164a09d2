"""ZeRO-1 (being replaced by `jmp_train.zero1` and `jmp_train.train`)."""

from jmp_train._src.sharding import (
  LeafLayout,
  TrainStep,
  leaf_layout,
  make_train_step,
  zero1_shardings,
)

__all__ = [
  "LeafLayout",
  "TrainStep",
  "leaf_layout",
  "make_train_step",
  "zero1_shardings",
]
