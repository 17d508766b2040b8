"""mindpipe_jax: train Flax NNX models across data, fsdp, tensor, pipe, subnet and expert axes.

The curated public API::

    import mindpipe_jax as mp
    cfg = mp.load_config("examples/configs/default.toml", ["train.steps=100"])
    result = mp.train(config=cfg)
    supernet = mp.train_supernet(config=cfg.replace("parallel.subnet=4", "parallel.data=2"))
"""

# The `mindpipe` command: a Ctrl-C during the imports below is one line and exit 130.
import mindpipe_jax._interrupt  # noqa: F401  (first: see its docstring)

# api imports train/ (binding the subpackage to the name `train`) before this binds the function.
from mindpipe_jax.api import train  # the loop with EPara's online tuner plugged in
from mindpipe_jax.config import (
    Config,
    DataConfig,
    DistributedConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    SupernetConfig,
    TrainConfig,
    TunerConfig,
    load_config,
)
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.models import GPT, MoEGPT, build_model, flops_per_token
from mindpipe_jax.models.bridge import from_linen
from mindpipe_jax.parallel.mesh import make_mesh, setup_runtime
from mindpipe_jax.parallel.pipeline.contract import PipelineParts
from mindpipe_jax.parallel.rules import RULES, check_sharded_as_rules, constrain, spec_for, use_rules
from mindpipe_jax.supernet import SuperGPT, SupernetResult, search_checkpoint, train_supernet
from mindpipe_jax.train.checkpoint import Checkpointer
from mindpipe_jax.train.loop import TrainResult

__all__ = [
    "Config", "DataConfig", "DistributedConfig", "ModelConfig", "OptimConfig", "ParallelConfig",
    "TrainConfig", "load_config", "ConfigError", "GPT", "MoEGPT", "build_model", "flops_per_token",
    "make_mesh",
    "setup_runtime", "RULES", "check_sharded_as_rules", "constrain", "spec_for", "Checkpointer",
    "TrainResult", "train", "use_rules", "PipelineParts", "from_linen",
    "SupernetConfig", "SuperGPT", "SupernetResult", "train_supernet", "search_checkpoint", "TunerConfig",
]
