"""Listing and concatenating the files of a byte-level corpus."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

# Between files, so the last line of one never runs into the first of the next.
SEPARATOR = b"\n"


def list_files(root: Path, *, keep_dir: Callable[[str], bool],
               keep_file: Callable[[str], bool]) -> list[tuple[str, int, int]]:
    """``(relative POSIX path, size, mtime_ns)`` of regular files under ``root``.

    Sorted by relative path: ``os.walk`` order depends on the file system, and
    the concatenated corpus must be identical on every machine.
    """
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if keep_dir(d)]
        for name in filenames:
            if not keep_file(name):
                continue
            full = os.path.join(dirpath, name)
            try:
                st = os.stat(full)
            except OSError:  # a dangling symlink or a file removed while walking
                continue
            if not os.path.isfile(full):
                continue
            rel = Path(os.path.relpath(full, root)).as_posix()
            found.append((rel, st.st_size, st.st_mtime_ns))
    found.sort()
    return found


def concat(root: Path, rel_paths: Sequence[str]) -> np.ndarray:
    """The bytes of ``rel_paths`` joined with ``SEPARATOR`` after each, as uint8."""
    chunks = []
    for rel in rel_paths:
        chunks.append((root / rel).read_bytes())
        chunks.append(SEPARATOR)
    return np.frombuffer(b"".join(chunks), dtype=np.uint8)


def concat_length(sizes: Sequence[int]) -> int:
    """Length ``concat`` gives for files of these sizes (for cache validation)."""
    return sum(sizes) + len(SEPARATOR) * len(sizes)
