"""Token data: sources split into train/validation, and deterministic batch loaders.

``load_tokens(cfg.data, cfg.model.vocab_size)`` returns a ``TokenSplits`` (train and
validation token arrays, byte-level or pre-tokenised). ``Loader`` turns the train
split into endless shuffled, checkpointable, per-process batches; ``eval_batches``
gives a fixed list of validation batches; ``resolve_data`` reads the ``data`` argument
of the entry points. Batches are NumPy arrays the trainer
places on devices; this package never uses JAX (grain imports it, but importing
initialises no backend, so device settings made afterwards still apply).
"""

from mindpipe_jax.data.loader import Loader, eval_batches
from mindpipe_jax.data.resolve import resolve_data
from mindpipe_jax.data.sources import TokenSplits, array_tokens, load_tokens

__all__ = ["Loader", "TokenSplits", "array_tokens", "eval_batches", "load_tokens", "resolve_data"]
