"""The online tuner's step-time models: the ``StepModel`` protocol and
``MeasuredThroughput``, which knows only what the run measured (``tuner/epara.py``;
``tuner/costmodel.py``'s ``CostModel`` is the other)."""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Protocol

import numpy as np

from mindpipe_jax.tuner.space import Candidate


class StepModel(Protocol):
    def step_time(self, candidate: Candidate) -> float: ...

    def observe(self, candidate: Candidate, seconds: float) -> None: ...


class MeasuredThroughput:
    """Step times measured in this run; unseen candidates by linear scaling.

    A measured candidate's time is the median of its last ``window`` observations.
    An unseen one is predicted from the nearest measured candidate (same mesh and
    microbatches if any, then closest rows per device) as ``a + (t_ref - a) x r / r_ref``
    with ``r`` rows per device and ``a`` a fixed per-step overhead: the intercept of a
    least-squares line through every measured (rows per device, time) point once two
    sizes were seen, else ``overhead_prior`` x t_ref. The prior matters: with ``a = 0``
    a larger batch could never look faster per sample and would never be tried.
    """

    def __init__(self, overhead_prior: float = 0.1, window: int = 8):
        self.overhead_prior = overhead_prior
        self.window = window
        self._seen: dict[Candidate, list[float]] = {}

    def observe(self, candidate: Candidate, seconds: float) -> None:
        if math.isfinite(seconds) and seconds > 0:
            times = self._seen.setdefault(candidate, [])
            times.append(seconds)
            del times[:-self.window]

    def measured(self, candidate: Candidate) -> float | None:
        times = self._seen.get(candidate)
        return statistics.median(times) if times else None

    def _overhead(self, ref_time: float) -> float:
        points = [(c.per_device_batch, statistics.median(t)) for c, t in self._seen.items()]
        if len({r for r, _ in points}) < 2:
            return self.overhead_prior * ref_time
        slope, intercept = np.polyfit(*zip(*points, strict=True), 1)
        return float(min(max(intercept, 0.0), 0.9 * ref_time)) if slope > 0 else 0.0

    def step_time(self, candidate: Candidate) -> float:
        known = self.measured(candidate)
        if known is not None or not self._seen:
            return math.nan if known is None else known
        r = candidate.per_device_batch
        same = lambda c: dataclasses.replace(c, global_batch=0)  # noqa: E731
        pool = [c for c in self._seen if same(c) == same(candidate)] or list(self._seen)
        ref = min(pool, key=lambda c: abs(math.log(c.per_device_batch / r)))
        t_ref, r_ref = self.measured(ref), ref.per_device_batch
        a = self._overhead(t_ref)
        return a + (t_ref - a) * r / r_ref
