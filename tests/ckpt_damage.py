"""Damage to a saved checkpoint that the restore must report: one changed byte of array data."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np


def flip_a_restored_byte(state: Path) -> None:
    """Change one byte of the largest data file of the orbax item ``state`` (in place), one
    that changes what is restored. One changed byte moves exactly one uint32 word of the
    checkpoint's checksum by a nonzero amount, so it cannot cancel out (several could).
    The store compresses its chunks (zstd): the byte decodes as other numbers, which only
    the checksum sees, or the decoder refuses. A data file also holds bytes no chunk is
    read from (the file's middle was one in some runs, and the resume went through): the
    byte changed is the first of the middle, one third and two thirds that does change
    the restore."""
    data_file = max((f for f in state.rglob("*") if f.is_file() and f.parent.name == "d"),
                    key=lambda f: f.stat().st_size)
    data = data_file.read_bytes()
    original = _restored_bytes(state)
    for at in (len(data) // 2, len(data) // 3, 2 * len(data) // 3):
        data_file.write_bytes(data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1:])
        try:
            if _restored_bytes(state) != original:
                return
        except Exception:  # the decoder refuses it: damage the restore reports too
            return
    data_file.write_bytes(data)
    raise AssertionError(f"no probed byte of {data_file} changes what is restored")


def _restored_bytes(state: Path) -> list[bytes]:
    import orbax.checkpoint as ocp

    return [np.asarray(x).tobytes() for x in jax.tree.leaves(ocp.StandardCheckpointer().restore(state))]
