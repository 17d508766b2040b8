"""Errors a user can cause, and the ways a run can stop that are not bugs.

* ``ConfigError`` — a user mistake (a bad config key, a mesh that does not fit
  the devices, a missing data path, a foreign or damaged checkpoint). Raised
  before any file is written, with a one-line message naming the bad value and
  what would be valid. The CLI prints that line and exits with status 2.
* ``DiskFullError`` (a ``ConfigError``, exit 2) — the disk filled up during a
  checkpoint save: the half-written step is removed, the last committed one is
  untouched, and the line names the directory, the bytes needed and those free.
* ``NonFiniteError`` — training met a non-finite loss or gradient norm with
  ``train.nonfinite="stop"``. The last good checkpoint is left as it was. Exit 3.
* ``EXIT_DISTRIBUTED`` (4) — the processes of a multi-host run could not start
  or lost one another. That is reported where it is found (a watchdog during
  start-up, ``DistributedError`` before it, the CLI after a failed collective) and the
  process exits at once:
  JAX's exit path would otherwise wait for the missing process and abort.

Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

EXIT_CONFIG = 2
EXIT_NONFINITE = 3
EXIT_DISTRIBUTED = 4


def _one_line(message: str) -> str:
    return " ".join(str(message).split())


class ConfigError(ValueError):
    """A user mistake: the message is one line naming the value and what is valid."""

    def __init__(self, message: str):
        super().__init__(_one_line(message))


class DiskFullError(ConfigError):
    """No room for a checkpoint in ``directory``: about ``needed`` bytes, ``free`` free.
    The half-written step is gone; ``last_checkpoint`` (None if none) is untouched."""

    def __init__(self, message: str, *, directory, needed: int, free: int, last_checkpoint=None):
        super().__init__(message)
        self.directory = directory
        self.needed = needed
        self.free = free
        self.last_checkpoint = last_checkpoint


class DistributedError(RuntimeError):
    """The processes of a multi-host run cannot start (e.g. the coordinator's port is
    taken): one line; the CLI exits with ``EXIT_DISTRIBUTED``."""

    def __init__(self, message: str):
        super().__init__(_one_line(message))


class NonFiniteError(RuntimeError):
    """A step produced a non-finite loss or gradient norm and ``train.nonfinite`` is "stop".

    ``step`` is the 1-based step that went wrong, ``group`` the first parameter
    whose gradient was not finite (``"loss"`` when only the loss was), and
    ``last_checkpoint`` the newest complete checkpoint (None if there is none).
    """

    def __init__(self, message: str, *, step: int, group: str, last_checkpoint=None):
        super().__init__(_one_line(message))
        self.step = step
        self.group = group
        self.last_checkpoint = last_checkpoint
