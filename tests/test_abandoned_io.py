"""The filter that keeps a failed restore's abandoned reads (and a failed save's writes)
off stderr drops only those reports (the restore itself: test_bad_input's checkpoint cut
short, from a process; the save: test_run_dir's full disks)."""

from __future__ import annotations

import gc
import logging
import sys

from mindpipe_jax.train import abandoned_io


class _RaisesOnCollection:
    def __del__(self):
        raise RuntimeError("Event loop is closed")  # the text, but not from a closed loop


def test_other_unraisables_and_asyncio_records_still_reach_their_hooks(monkeypatch, caplog):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))
    monkeypatch.setattr(abandoned_io, "_installed", False)
    asyncio_log = logging.getLogger("asyncio")
    monkeypatch.setattr(asyncio_log, "filters", list(asyncio_log.filters))
    abandoned_io.drop_their_reports()
    assert sys.unraisablehook is not seen.append

    _RaisesOnCollection()
    gc.collect()
    assert [str(e) for e in seen] == ["Event loop is closed"]

    try:
        raise ValueError("a task of the user's")
    except ValueError:
        exc_info = sys.exc_info()
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio_log.error("Task exception was never retrieved", exc_info=exc_info)
    assert "Task exception was never retrieved" in caplog.text
