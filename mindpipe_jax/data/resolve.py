"""The ``data`` argument of ``mindpipe_jax.train`` and ``train_supernet`` (and of
``search_checkpoint``) as the splits it names: one reading for every entry point."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from mindpipe_jax.config import Config, DataConfig, refuse_override_as
from mindpipe_jax.data.sources import TokenSplits, array_tokens, load_tokens
from mindpipe_jax.errors import ConfigError


def resolve_data(data, cfg: Config, *, saved_config: bool = False) -> TokenSplits:
    """``data``: None (``cfg.data``), a path (a ``.npy``/``.bin`` token file, else text),
    a ``DataConfig``, ``TokenSplits``, or token ids in memory (a 1-D integer NumPy or JAX
    array, or a list), split by ``data.val_fraction`` as a token file is. A ``cfg`` that
    names another source too is refused, unless it is ``saved_config``, an earlier run's
    (``search_checkpoint``: searching on other data than the run trained on)."""
    vocab = cfg.model.vocab_size
    if data is None:
        return load_tokens(cfg.data, vocab)
    if isinstance(data, (str, Path)):
        refuse_override_as("data", data)
    elif not isinstance(data, (TokenSplits, DataConfig, list, tuple)) and not hasattr(data, "__array__"):
        # NumPy or JAX arrays have __array__: recognised without importing JAX
        raise ConfigError(f"data must be None, a path, a DataConfig, TokenSplits or an array of token ids, "
                          f"got {type(data).__name__}")
    if not saved_config:
        _refuse_a_second_source(data, cfg.data)
    if isinstance(data, TokenSplits):
        if data.vocab_size > vocab:
            raise ConfigError(f"data vocab_size {data.vocab_size} exceeds model.vocab_size {vocab}")
        return data
    if isinstance(data, DataConfig):
        return load_tokens(data, vocab)
    if isinstance(data, (str, Path)):
        source = "tokens" if str(data).endswith((".npy", ".bin")) else "text"
        return load_tokens(dataclasses.replace(cfg.data, source=source, path=str(data)), vocab)
    return array_tokens(data, cfg.data, vocab)


def _refuse_a_second_source(data, named: DataConfig) -> None:
    """The ``data`` argument replaces the config's source: a config naming another one
    (``data.source``/``data.path`` set away from the default) would be silently ignored,
    a run on data its config does not describe. Naming the same one twice is fine."""
    default = DataConfig()
    keys = [f"data.{key}={getattr(named, key)!r}" for key in ("source", "path")
            if getattr(named, key) != getattr(default, key)]
    if not keys:
        return
    if isinstance(data, DataConfig) and (data.source, data.path) == (named.source, named.path):
        return
    if isinstance(data, (str, Path)) and named.path and Path(named.path) == Path(data):
        return
    if isinstance(data, (str, Path)):
        given = f"the path {str(data)!r}"
    elif isinstance(data, (DataConfig, TokenSplits)):
        given = f"a {type(data).__name__}"
    else:
        given = "token ids in memory"
    raise ConfigError(f"data is given twice: as the argument ({given}) and in the config "
                      f"({', '.join(keys)}); pass one of them (data=None reads the config's)")
