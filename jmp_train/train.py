"""The train state and the step builder: one device, data parallel, ZeRO-1."""

from jmp_train._src.train import TrainState, global_batch, make_train_step

__all__ = ["TrainState", "global_batch", "make_train_step"]
