"""Written rules in NumPy that several test files check the library against."""

import numpy as np


def bf16_stochastic(x: np.ndarray, bits: np.ndarray) -> np.ndarray:
  """float32 `x` rounded to bfloat16 with 16 random bits a value (the rule
  README.md writes): add them below bfloat16's bits and cut. Returns the
  bfloat16 bits as uint16."""
  wide = x.astype(np.float32).view(np.uint32).astype(np.uint64) + bits
  return ((wide & 0xFFFF0000) >> 16).astype(np.uint16)
