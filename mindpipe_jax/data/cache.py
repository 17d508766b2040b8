"""An on-disk cache of built token arrays, best effort.

Building the stdlib corpus reads ~1,800 files; a cached ``.npy`` pair loads as a
memory map in milliseconds. The cache is an optimisation only: when the directory
cannot be created or written (read-only home, full disk) the caller keeps its
in-memory arrays, and a damaged entry is rebuilt rather than trusted.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from mindpipe_jax.atomic_write import write_atomically


def cache_dir() -> Path:
    """``$MINDPIPE_CACHE``, else ``~/.cache/mindpipe_jax``."""
    env = os.environ.get("MINDPIPE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "mindpipe_jax"


def _entry(key: str, part: str) -> Path:
    return cache_dir() / f"{key}.{part}.npy"


def load(key: str, parts: dict[str, int]) -> dict[str, np.ndarray] | None:
    """The cached arrays for ``key`` as read-only memory maps, or None.

    ``parts`` maps each array name to its expected length, so a truncated or stale
    entry counts as a miss instead of silently feeding wrong data.
    """
    out = {}
    for part, length in parts.items():
        try:
            arr = np.load(_entry(key, part), mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError):
            return None
        if arr.ndim != 1 or len(arr) != length:
            return None
        out[part] = arr
    return out


def store(key: str, arrays: dict[str, np.ndarray]) -> bool:
    """Write ``arrays`` under ``key``; False (and nothing half-written) on failure."""
    try:
        cache_dir().mkdir(parents=True, exist_ok=True)
        for part, arr in arrays.items():
            # Readers (other processes of a multi-host job sharing the directory) see
            # either no file or a complete one, never a partial one.
            write_atomically(_entry(key, part), lambda f, arr=arr: np.save(f, arr, allow_pickle=False))
    except OSError:
        return False
    return True
