"""The ZeRO-1 plan: layouts and shardings of a train state on a mesh."""

from jmp_train._src.zero1 import (
  LeafLayout,
  Plan,
  abstract,
  leaf_layout,
  make_plan,
  place,
  to_logical,
  zero1_shardings,
)

__all__ = [
  "LeafLayout",
  "Plan",
  "abstract",
  "leaf_layout",
  "make_plan",
  "place",
  "to_logical",
  "zero1_shardings",
]
