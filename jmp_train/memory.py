"""Bytes per device of a train step: the memory table, the compiled step's
memory_analysis() and the collectives of its HLO."""

from jmp_train._src.memory import (
  Collective,
  collective_stats,
  compiled_memory,
  memory_table,
  summarize_collectives,
)

__all__ = [
  "Collective",
  "collective_stats",
  "compiled_memory",
  "memory_table",
  "summarize_collectives",
]
