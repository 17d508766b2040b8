"""TensorBoard scalars written in the caller's thread.

tensorboardX's ``SummaryWriter`` hands events to a writer thread through a queue of ten.
When that thread fails (a full disk: ENOSPC) it dies with a traceback on stderr, and the
next writes fill the queue and block for good: the run hung at its next log step
(seen: ``mindpipe train`` on a 40 kB disk, the main thread in ``Queue.put`` forever).
Here each logged step is one event, written and flushed where it is logged: a failed
write is an ``OSError`` in the loop (the CLI's one line), and a run cannot hang on it.
A step's few scalars are a few hundred bytes: writing them at once costs nothing a
training step would notice.
"""

from __future__ import annotations

import time
from pathlib import Path


class ScalarEvents:
    """One event file in ``log_dir`` (created if missing); ``purge_step``: the first step
    this attempt writes, where TensorBoard hides what an earlier attempt logged at or
    after it (a START session log, as ``SummaryWriter(purge_step=...)`` writes)."""

    def __init__(self, log_dir: Path, *, purge_step: int, filename_suffix: str = ""):
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog

        log_dir.mkdir(parents=True, exist_ok=True)
        self._dir = log_dir
        self._events = EventsWriter(str(log_dir / "events"), filename_suffix)  # + its version record
        self._write(Event(step=purge_step, wall_time=time.time(),
                          session_log=SessionLog(status=SessionLog.START)))

    def add_scalars(self, step: int, values: dict[str, float]) -> None:
        """``values`` (finite numbers) at ``step``, on the disk when this returns."""
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.proto.summary_pb2 import Summary

        summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(v)) for tag, v in values.items()])
        self._write(Event(step=int(step), wall_time=time.time(), summary=summary))

    def _write(self, event) -> None:
        try:
            self._events.write_event(event)
            self._events.flush()
        except OSError as err:  # a full disk: the error names where the run was writing
            err.filename = err.filename or str(self._dir)
            raise

    def close(self) -> None:
        self._events.close()
