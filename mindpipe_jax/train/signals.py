"""SIGTERM and SIGINT as a request to stop after the current step with a checkpoint,
agreed across processes; used by the dense loop and the supernet trainer."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any


class StopSignals:
    """SIGTERM and SIGINT ask the loop to stop after the current step with a checkpoint.

    One process: a Python handler sets a flag the loop reads after each step.
    Several processes must stop after the *same* step, or their collective save
    would deadlock: JAX's preemption service (started by ``jax.distributed``)
    catches SIGTERM on any process and agrees on a step, which
    ``reached_preemption_sync_point`` reports; Ctrl-C is handed to it as SIGTERM.
    A second Ctrl-C raises ``KeyboardInterrupt`` at once. Handlers are installed
    only from the main thread and put back on exit.
    """

    def __init__(self, multi_process: bool):
        self.multi = multi_process
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            ours = (signal.SIGINT,) if self.multi else (signal.SIGINT, signal.SIGTERM)
            for sig in ours:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)

    def _handle(self, signum, frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # asked twice: stop now, without a checkpoint
        self.received = self.received or signal.Signals(signum).name
        if self.multi:
            os.kill(os.getpid(), signal.SIGTERM)  # JAX's notifier tells the other processes

    def reached(self, step: int) -> str | None:
        """The signal's name if the loop should stop after ``step``."""
        if not self.multi:
            return self.received
        from jax.experimental import multihost_utils
        try:
            if multihost_utils.reached_preemption_sync_point(step):
                return self.received or "SIGTERM"
        except RuntimeError:  # the preemption service is switched off
            pass
        return None
