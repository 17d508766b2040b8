"""Write a file whole or not at all.

A file written in place and cut short (a full disk, a kill) is left half there: an empty
``--json`` output or picture, a tuner cache that no longer parses, a ``metrics.jsonl`` that lost its
records. Here the content goes to a temporary file beside it, which replaces the file in
one rename; a failure removes the temporary file and leaves the old file as it was.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from mindpipe_jax.errors import ConfigError

# Write failures the command line reports itself, with their remedy (cli._write_failure).
ROOM_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


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


def unwritable_reason(directory: str | Path) -> str | None:
    """Why this process cannot create files in ``directory`` (an existing directory), or
    None when it can: checked before the work whose output would be lost."""
    if os.access(directory, os.W_OK | os.X_OK):
        return None
    if os.statvfs(directory).f_flag & os.ST_RDONLY:
        return "is on a read-only filesystem"
    return "is not writable by this user"


def control_character_reason(path: str) -> str | None:
    """Why ``path`` would not print on one line (a newline, tab or other control
    character, legal in a POSIX name but almost always a quoting slip), or None."""
    bad = sorted({c for c in path if ord(c) < 32 or ord(c) == 127})
    if not bad:
        return None
    return f"holds the control character{'s' if len(bad) > 1 else ''} {', '.join(repr(c) for c in bad)}"


def check_output_file(path: str | os.PathLike, what: str) -> Path:
    """Refuse, before the work whose output it will hold, a file the user named (``what``
    says which: "picture", "--json") whose directory does not exist or cannot be
    written, or which is a directory."""
    path = Path(path)
    odd = control_character_reason(str(path))
    if odd is not None:
        raise ConfigError(f"cannot write {what} {str(path)!r}: the name {odd}")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise ConfigError(f"cannot write {what} {str(path)!r}: directory {str(parent)!r} does not exist")
    if path.is_dir():
        raise ConfigError(f"cannot write {what} {str(path)!r}: it is a directory; give a file name")
    why = unwritable_reason(parent)
    if why is not None:
        raise ConfigError(f"cannot write {what} {str(path)!r}: directory {str(parent)!r} {why}")
    return path


def write_output(path: str | Path, content: str | bytes, what: str) -> None:
    """``write_atomically`` for a file the user named (``what`` says which: "picture",
    "--json"): a failure the directory checks could not foresee (a pseudo-filesystem,
    permissions changed meanwhile) is one line naming the file, not a traceback. A full
    disk or read-only filesystem stays an ``OSError`` the command line words itself."""
    try:
        write_atomically(path, content)
    except OSError as err:
        if err.errno in ROOM_ERRNOS:
            raise
        reason = err.strerror or str(err)
        raise ConfigError(f"cannot write {what} {str(path)!r}: {reason[:1].lower()}{reason[1:]}") from None
