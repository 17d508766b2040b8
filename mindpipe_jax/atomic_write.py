"""Write a file whole or not at all.

A file written in place and cut short (a full disk, a kill) is left half there: an empty
``--json`` output or picture, a tuner cache that no longer parses, a ``metrics.jsonl`` that lost its
records. Here the content goes to a temporary file beside it, which replaces the file in
one rename; a failure removes the temporary file and leaves the old file as it was.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def write_atomically(path: str | Path, content: str | bytes | Callable[[BinaryIO], None]) -> None:
    """``path`` holds ``content`` afterwards (text, bytes, or what a function writes to
    the binary file it is given: a large array without a copy in memory), or (an
    ``OSError``, naming ``path``) what it held before. Readers, other processes too, see
    the old file or the new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        if isinstance(content, str):
            tmp.write_text(content)
        elif isinstance(content, bytes):
            tmp.write_bytes(content)
        else:
            with open(tmp, "wb") as f:
                content(f)
        os.replace(tmp, path)
    except OSError as err:
        if err.filename in (None, str(tmp)):  # the user knows the file, not our temporary one
            err.filename = str(path)
        raise
    finally:
        tmp.unlink(missing_ok=True)
