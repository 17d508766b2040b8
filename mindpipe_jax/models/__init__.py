"""Reference Flax NNX models. Weights carry logical axis names only."""

from mindpipe_jax.models.gpt import GPT, flops_per_token

__all__ = ["GPT", "flops_per_token"]
