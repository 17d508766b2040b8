"""The ``data`` argument of ``mindpipe_jax.train`` and ``train_supernet`` (and of
``search_checkpoint``) as the splits it names: one reading for every entry point."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from mindpipe_jax.config import Config, DataConfig, refuse_override_as
from mindpipe_jax.data.sources import TokenSplits, array_tokens, load_tokens
from mindpipe_jax.errors import ConfigError


def resolve_data(data, cfg: Config) -> TokenSplits:
    """``data``: None (``cfg.data``), a path (a ``.npy``/``.bin`` token file, else text),
    a ``DataConfig``, ``TokenSplits``, or token ids in memory (a 1-D integer NumPy or JAX
    array, or a list), split by ``data.val_fraction`` as a token file is."""
    vocab = cfg.model.vocab_size
    if data is None:
        return load_tokens(cfg.data, vocab)
    if isinstance(data, TokenSplits):
        if data.vocab_size > vocab:
            raise ConfigError(f"data vocab_size {data.vocab_size} exceeds model.vocab_size {vocab}")
        return data
    if isinstance(data, DataConfig):
        return load_tokens(data, vocab)
    if isinstance(data, (str, Path)):
        refuse_override_as("data", data)
        source = "tokens" if str(data).endswith((".npy", ".bin")) else "text"
        return load_tokens(dataclasses.replace(cfg.data, source=source, path=str(data)), vocab)
    if isinstance(data, (list, tuple)) or hasattr(data, "__array__"):  # NumPy or JAX, without importing JAX
        return array_tokens(data, cfg.data, vocab)
    raise ConfigError(f"data must be None, a path, a DataConfig, TokenSplits or an array of token ids, got "
                      f"{type(data).__name__}")
