"""Reference Flax NNX models. Weights carry logical axis names only."""

from flax import nnx

from mindpipe_jax.config import ModelConfig
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.models import gpt, moe
from mindpipe_jax.models.gpt import GPT
from mindpipe_jax.models.moe import MoEGPT

__all__ = ["GPT", "MoEGPT", "build_model", "flops_per_token"]


def build_model(cfg_model: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
    """The model a config describes: ``MoEGPT`` when ``n_experts > 0``, else ``GPT``."""
    _check_model_config(cfg_model, "build_model")
    if cfg_model.n_experts > 0:
        return MoEGPT(cfg_model, rngs=rngs)
    return GPT(cfg_model, rngs=rngs)


def flops_per_token(cfg_model: ModelConfig) -> float:
    """Training FLOPs per token of ``build_model(cfg_model)`` (active parameters for MoE)."""
    _check_model_config(cfg_model, "flops_per_token")
    return (moe if cfg_model.n_experts > 0 else gpt).flops_per_token(cfg_model)


def _check_model_config(cfg_model, where: str) -> None:
    if not isinstance(cfg_model, ModelConfig):
        raise ConfigError(f"{where} takes a ModelConfig (a Config's .model), got {type(cfg_model).__name__}")
