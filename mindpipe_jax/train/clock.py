"""The train loop's clocks: step time measured between host syncs, less what is not
step time (evaluation, checkpoints, reconfiguration)."""

from __future__ import annotations

import contextlib
import time


class Interval:
    """Steps, tokens and wall time since ``reset``, less the time spent ``aside``
    (evaluation, checkpoints, reconfiguration: not step time)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.t0, self.steps, self.tokens = time.perf_counter(), 0, 0

    def add(self, tokens: int) -> None:
        self.steps += 1
        self.tokens += tokens

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def per_step(self) -> float | None:
        return self.elapsed() / self.steps if self.steps else None


@contextlib.contextmanager
def aside(*intervals: Interval):
    """Leave the time spent inside out of each of ``intervals``."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        for interval in intervals:
            interval.t0 += time.perf_counter() - t0
