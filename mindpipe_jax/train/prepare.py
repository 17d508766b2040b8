"""Compiling a tuned run's next layout while it trains (``tuner.prepare``).

A switch to a candidate the run has not run costs a compile (3-5 s for the online
benchmark's tiny GPT on 2 cores, the whole step time of ~100 steps). When the
tuner names a candidate it is likely to switch to later (``OnlineTuner.to_prepare``),
``Preparer`` builds that layout and compiles its step in one background thread;
training goes on meanwhile (XLA compiles outside Python's lock). The switch then
takes the compiled layout (``take``) and compiles nothing.

Only building and compiling happen in the thread: no program runs there, so the
training thread stays the only one dispatching computations (two threads
dispatching multi-device programs can queue them in different orders on different
devices, and their collectives then wait on each other).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any

from mindpipe_jax.config import Config
from mindpipe_jax.train.reconfigure import Layout, build_layout


class Preparer:
    """Layouts compiled ahead, by candidate (any hashable key). ``factory_for`` as for
    ``build_layout``."""

    def __init__(self, factory_for: Callable[[Config], Any]):
        self.factory_for = factory_for
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mindpipe-prepare")
        self._jobs: dict[Any, concurrent.futures.Future] = {}
        self._reported: set = set()
        self._busy_since_check = False

    def submit(self, key, cfg: Config, lr_gain: float) -> bool:
        """Start building and compiling ``cfg``'s layout (tuned, with ``lr_gain``) for
        ``key``; False where one was started for it already (it may still be compiling)."""
        if key in self._jobs:
            return False
        self._jobs[key] = self._pool.submit(self._build, cfg, lr_gain)
        self._busy_since_check = True
        return True

    def _build(self, cfg: Config, lr_gain: float) -> Layout:
        layout = build_layout(cfg, self.factory_for, lr_gain)
        layout.compile()  # kept by the layout: its ``compile()`` then returns it in 0 s
        return layout

    def finished(self) -> list:
        """The keys whose compile succeeded since the last call."""
        done = []
        for key, job in self._jobs.items():
            if key not in self._reported and job.done():
                self._reported.add(key)
                if job.exception() is None:
                    done.append(key)
        return done

    def busy(self) -> bool:
        """Whether a compile ran at any time since the last call (its CPU use slows the
        steps measured meanwhile)."""
        busy = self._busy_since_check or any(not job.done() for job in self._jobs.values())
        self._busy_since_check = any(not job.done() for job in self._jobs.values())
        return busy

    def take(self, key) -> Layout | None:
        """The layout compiled for ``key`` (waiting for its compile if it is still
        running), or None if none was started or it failed (the caller then builds it
        itself and meets the error there)."""
        job = self._jobs.pop(key, None)
        self._reported.discard(key)
        if job is None or job.exception() is not None:
            return None
        return job.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._jobs.clear()
