"""SIGTERM and SIGINT as a request to stop after the current step with a checkpoint,
agreed across processes; used by the dense loop and the supernet trainer. Before the
loop begins, Ctrl-C stops the run at once (``StartupInterrupts``)."""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

_interrupted = threading.Event()  # a Ctrl-C came during start-up


class StartupInterrupts:
    """From a run's start until its loop begins, Ctrl-C raises ``KeyboardInterrupt`` (the
    CLI: one line, exit 130) and is never lost: Python raises it wherever the main thread
    happens to be, also where exceptions are ignored (a ``__del__``, a callback from
    C++), so the request is also recorded, and ``raise_if_interrupted`` (called before
    the run writes anything, and when the loop's ``StopSignals`` take over) raises it
    again. Installed only from the main thread over Python's default handler (a
    program's own handler is left alone), and put back on exit. Where Python ignores
    the exception it would print "Exception ignored in ..." with a traceback; that
    report is dropped (``sys.unraisablehook``), as the recorded request stands for it:
    the command's output stays its one line.
    """

    def __init__(self):
        self._previous = None
        self._previous_hook = None

    def __enter__(self):
        _interrupted.clear()
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._previous_hook = sys.unraisablehook
            sys.unraisablehook = self._unraisable
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
            sys.unraisablehook = self._previous_hook
            self._previous_hook = None

    def _unraisable(self, info) -> None:
        if issubclass(info.exc_type, KeyboardInterrupt) and _interrupted.is_set():
            return  # recorded: raise_if_interrupted raises it where it can be handled
        self._previous_hook(info)

    @staticmethod
    def _handle(signum, frame) -> None:
        _interrupted.set()
        raise KeyboardInterrupt


def raise_if_interrupted() -> None:
    """Raise ``KeyboardInterrupt`` if a Ctrl-C came during start-up (see ``StartupInterrupts``)."""
    if _interrupted.is_set():
        raise KeyboardInterrupt


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

    def __init__(self, multi_process: bool = False):
        self.multi = multi_process
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self):
        raise_if_interrupted()  # a start-up Ctrl-C that was swallowed: stop before the loop
        self._install()
        return self

    def _install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            ours = (signal.SIGINT,) if self.multi else (signal.SIGINT, signal.SIGTERM)
            for sig in ours:
                self._previous[sig] = signal.signal(sig, self._handle)

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


class FinalSave(StopSignals):
    """While a run waits for its last save to be written (its loop is over): a first
    SIGINT or SIGTERM is noted (``received``) and the wait goes on, since the save is what
    a stop would have asked for; a second Ctrl-C raises ``KeyboardInterrupt`` at once.
    Without it the start-up handler, back in place once the loop's ``StopSignals`` exit,
    turned a Ctrl-C there into exit 130 with the save half written. Several processes:
    SIGINT only (SIGTERM stays with JAX's preemption service), and nothing is passed on
    to it, since there is no later step to agree on. Main thread only; the handlers are
    put back on exit."""

    def __enter__(self):
        self._install()  # a start-up Ctrl-C was already raised when the loop began
        return self

    def _handle(self, signum, frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # asked twice: stop waiting
        self.received = signal.Signals(signum).name
