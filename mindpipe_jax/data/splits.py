"""Train/validation splits that depend only on the data, never on order or seed.

Splitting by file keeps a whole document on one side, so validation loss measures
generalisation to unseen files rather than to unseen halves of seen files. The side
a file lands on comes from a CRC of its relative path: ``zlib.crc32`` is the same
on every machine and run (Python's ``hash()`` is salted per process), and adding or
removing one file never moves another.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np

from mindpipe_jax.errors import ConfigError

_BUCKETS = 10_000
# Smallest split worth having: one input token and its target.
MIN_SPLIT_TOKENS = 2


def is_val_file(rel_path: str, val_fraction: float) -> bool:
    """Whether the file at ``rel_path`` (POSIX separators) belongs to validation."""
    # surrogateescape: undecodable file names still hash, and hash the same everywhere.
    digest = zlib.crc32(rel_path.encode("utf-8", "surrogateescape"))
    return digest % _BUCKETS < val_fraction * _BUCKETS


def val_start(num_tokens: int, val_fraction: float) -> int:
    """Index where a positional split's validation part (the last fraction) starts."""
    return num_tokens - int(num_tokens * val_fraction)


def split_by_position(tokens: np.ndarray, val_fraction: float, what: str) -> tuple[np.ndarray, np.ndarray]:
    """``(train, val)`` views of ``tokens``: validation is the last ``val_fraction``."""
    cut = val_start(len(tokens), val_fraction)
    train, val = tokens[:cut], tokens[cut:]
    check_split_sizes(what, len(train), len(val), val_fraction)
    return train, val


def check_split_sizes(what: str, n_train: int, n_val: int, val_fraction: float) -> None:
    """Refuse data too short to give both splits at least one (input, target) pair
    (only the training split with ``val_fraction`` 0: no validation split is asked for)."""
    if n_train >= MIN_SPLIT_TOKENS and (n_val >= MIN_SPLIT_TOKENS or val_fraction == 0):
        return
    total = n_train + n_val
    if val_fraction == 0:
        raise ConfigError(f"{what} has {total} token{'s' * (total != 1)}, too few to train on; it needs at "
                          f"least {MIN_SPLIT_TOKENS}")
    # The shortest input whose last val_fraction still holds MIN_SPLIT_TOKENS tokens.
    needed = max(2 * MIN_SPLIT_TOKENS, int(np.ceil(MIN_SPLIT_TOKENS / val_fraction)))
    raise ConfigError(
        f"{what} has {total} tokens, too few to split into train ({n_train}) and validation "
        f"({n_val}) with data.val_fraction={val_fraction}; it needs at least {needed} tokens"
    )


def partition_files(rel_paths: Sequence[str], val_fraction: float) -> tuple[list[int], list[int]]:
    """Indices of ``rel_paths`` for train and for validation (order kept)."""
    train, val = [], []
    for i, rel in enumerate(rel_paths):
        (val if is_val_file(rel, val_fraction) else train).append(i)
    return train, val
