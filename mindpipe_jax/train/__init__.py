"""Training: state creation, the pure step, the loop, checkpoints and metrics."""

from mindpipe_jax.train.loop import TrainResult, train

__all__ = ["TrainResult", "train"]
