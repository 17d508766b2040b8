"""Quiet the reads and writes a failed checkpoint restore or save abandons.

Orbax reads (restores) and writes (saves) every array at once, in asyncio tasks over
TensorStore. When one fails (a truncated or damaged file; a full disk) orbax raises and
closes its event loop, while the others go on: TensorStore's threads then finish them
into the closed loop, and the suspended coroutines and failed tasks are finalized later.
Each reports its exception on stderr, before and after the one-line error: pages of
tracebacks, some printed while the interpreter exits (seen: ``mindpipe train`` whose
first checkpoint does not fit on the disk, 10 to 46 of them). Here those reports, and
only those, are dropped, and the failure waits until they have stopped.
"""

from __future__ import annotations

import gc
import inspect
import logging
import sys
import time
import traceback

QUIET_S = 0.3  # no report for this long: the abandoned reads or writes have ended
SETTLE_MAX_S = 3.0

_installed = False
_last_dropped = 0.0


def is_abandoned_io(unraisable) -> bool:
    """The report of an abandoned read or write: the coroutine of an orbax read or write
    finalized while suspended (it raises again on closing), or TensorStore finishing one
    into the closed loop ("Event loop is closed" from ``call_soon_threadsafe``, with no object)."""
    obj, err = unraisable.object, unraisable.exc_value
    if inspect.iscoroutine(obj):
        return "orbax" in obj.cr_code.co_filename
    if obj is not None or not isinstance(err, RuntimeError) or str(err) != "Event loop is closed":
        return False
    return any(frame.f_code.co_name == "call_soon_threadsafe"
               for frame, _ in traceback.walk_tb(unraisable.exc_traceback))


def _from_orbax(tb) -> bool:
    return any("orbax" in frame.f_code.co_filename for frame, _ in traceback.walk_tb(tb))


def is_abandoned_task(record: logging.LogRecord) -> bool:
    """asyncio's record of a failed orbax read or write task (or their gathering future) that
    nothing awaits any more: "... exception was never retrieved", logged when collected."""
    return (record.getMessage().split("\n", 1)[0].endswith("exception was never retrieved")
            and record.exc_info is not None and _from_orbax(record.exc_info[2]))


def _dropped() -> None:
    global _last_dropped
    _last_dropped = time.monotonic()


def _keep_record(record: logging.LogRecord) -> bool:
    if is_abandoned_task(record):
        _dropped()
        return False
    return True


def drop_their_reports() -> None:
    """From now on, for the rest of the process, drop the reports of abandoned reads and
    writes (``is_abandoned_io``, ``is_abandoned_task``); any other unraisable goes to the hook
    that was there, any other asyncio record is logged. Installed once."""
    global _installed
    if _installed:
        return
    shown = sys.unraisablehook
    sys.unraisablehook = lambda u: _dropped() if is_abandoned_io(u) else shown(u)
    logging.getLogger("asyncio").addFilter(_keep_record)
    _installed = True


def settle() -> None:
    """After a failed restore or save: finalize what of it is garbage now, then wait (at
    most ``SETTLE_MAX_S``) until no abandoned read or write has reported for ``QUIET_S``, so
    that none reports as the process exits, when the hooks above may be gone."""
    gc.collect()
    start = time.monotonic()
    while time.monotonic() - max(start, _last_dropped) < QUIET_S and time.monotonic() - start < SETTLE_MAX_S:
        time.sleep(0.05)
