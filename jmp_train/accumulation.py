"""Gradient accumulation in float32 (transitional face)."""

from jmp_train._src.accumulation import accumulate_gradients

__all__ = ["accumulate_gradients"]
