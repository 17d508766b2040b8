"""The per-device network lanes of a replay (``_Lanes``: sends and gradient-sync
slices sharing one lane, with or without contention or priority) and the requests
queued on them: each chunk's gradient sync when its last weight-gradient task is
done (at the end, overlapped, or in buckets) and the parameter all-gathers of the
distributed optimizer. Used by the replays in ``sim/modes.py``; the model is
described in ``sim/__init__.py``.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Iterable, Sequence

from mindpipe_jax.parallel.pipeline.schedules import Kind, Schedule
from mindpipe_jax.sim.costs import _is_number, _Resolved
from mindpipe_jax.sim.network import DPSync
from mindpipe_jax.sim.result import Event


class _Lanes:
    """Per-device network lanes. Sync slices wait in a per-device queue and are
    started lazily: ``claim(s, at)`` first runs every queued slice that can start
    before ``at`` (a running slice is never interrupted), then hands the lane to
    the caller, so a send overtakes the slices that have not started yet."""

    def __init__(self, p: int, events: list[Event], priority: bool = False):
        self.priority = priority              # contention="priority": sends preempt running slices
        self.send_free = [0.0] * p            # when the device's last send has left its lane
        self.running: list[int | None] = [None] * p   # index in events of the last slice started
        self.running_tag: list[object] = [None] * p
        self.free = [0.0] * p
        self.busy = [0.0] * p
        self.events = events
        self.pending: list[deque] = [deque() for _ in range(p)]
        self.last = 0.0
        self.tag_end: dict[tuple[int, object], float] = {}   # (device, tag) -> end of its last slice

    def request_sync(self, s: int, chunk: int, g: int, nbytes: float, at: float | Sequence[float],
                     dp: DPSync) -> None:
        """Queue the slices of one chunk's sync on device ``s``'s lane, from ``at`` (one
        time, or one per slice: ``when="buckets"``)."""
        coll = dp.collective
        sizes = dp.slices(nbytes)
        ats = [at] * len(sizes) if _is_number(at) else list(at)
        for when, n in zip(ats, sizes, strict=True):
            self.pending[s].append((when, n, coll.time(n), chunk, g, None))

    def request_gather(self, s: int, chunk: int, g: int, nbytes: float, at: float, dp: DPSync,
                       tag=None) -> None:
        """Queue the parameter all-gather of one chunk (``dp.param_gather``), in its slices."""
        coll = dp.gather
        for n in dp.slices(nbytes):
            m = n * dp.gather_ratio
            self.pending[s].append((at, m, coll.time(m), chunk, g, tag))

    def drain(self, s: int, before: float = math.inf) -> None:
        queue = self.pending[s]
        while queue:
            at, n, d, chunk, g, _ = queue[0]
            start = max(at, self.free[s])
            if start >= before:
                break
            self._run(s, start)

    def _run(self, s: int, start: float) -> float:
        at, n, d, chunk, g, tag = self.pending[s].popleft()
        if tag is not None:
            self.tag_end[(s, tag)] = start + d
        self.free[s] = start + d
        self.busy[s] += d
        self.last = max(self.last, start + d)
        self.running[s], self.running_tag[s] = len(self.events), tag
        self.events.append(Event(s, "network", "sync", start, start + d, chunk=chunk,
                                 global_stage=g, nbytes=n))
        return start + d

    def done_through(self, s: int, tag) -> float:
        """Run device ``s``'s queue up to and including the last slice tagged ``tag``
        (everything before it on the lane goes first: the lane is FIFO); returns when
        that slice ends (0 if there is none)."""
        queue = self.pending[s]
        while any(item[5] == tag for item in queue):
            self._run(s, max(queue[0][0], self.free[s]))
        return self.tag_end.get((s, tag), 0.0)

    def claim(self, s: int, at: float) -> float:
        """When a send issued at ``at`` gets device ``s``'s lane: after a running slice,
        or (``priority``) at once unless another send is still leaving."""
        self.drain(s, before=at)
        return max(at, self.send_free[s] if self.priority else self.free[s])

    def occupy(self, s: int, leave: float, occ: float) -> None:
        """A send holds device ``s``'s lane from ``leave`` for ``occ``. With ``priority``
        a slice running then is paused for ``occ``: its end (and the lane's) moves by
        ``occ``, as the slice's bytes wait behind the send's."""
        self.send_free[s] = leave + occ
        if not self.priority:
            self.free[s] = leave + occ
            return
        i = self.running[s]
        if i is not None and self.events[i].end > leave:
            ev = self.events[i]
            self.events[i] = dataclasses.replace(ev, end=ev.end + occ)
            self.last = max(self.last, ev.end + occ)
            if self.running_tag[s] is not None:
                self.tag_end[(s, self.running_tag[s])] = ev.end + occ
        self.free[s] = max(self.free[s], leave) + occ

    def finish(self) -> None:
        for s in range(len(self.pending)):
            self.drain(s)


def _table_cells(schedule: Schedule):
    """The table as rows of per-device task tuples, the shape of fused ticks' cells."""
    return [[() if task is None else (task,) for task in row] for row in schedule.table]


def _last_grad_ticks(schedule: Schedule, cells=None) -> dict[tuple[int, int], int]:
    """(device, chunk) -> tick of the chunk's last weight-gradient task (BW or W).
    ``cells``: ``[tick][device]`` -> tasks (a fused schedule's); default the table's."""
    last: dict[tuple[int, int], int] = {}
    for t, row in enumerate(_table_cells(schedule) if cells is None else cells):
        for s, cell in enumerate(row):
            for task in cell:
                if task is not None and task.kind in (Kind.BW, Kind.W):
                    last[(s, task.chunk)] = t
    return last


def _finished_in(last_grad: dict[tuple[int, int], int]) -> dict[int, list[tuple[int, int]]]:
    """tick -> the (device, chunk)s whose last weight-gradient task runs in it."""
    finished_in: dict[int, list[tuple[int, int]]] = {}
    for (s, c), t in last_grad.items():
        finished_in.setdefault(t, []).append((s, c))
    return finished_in


def _request_syncs(lanes: _Lanes, schedule: Schedule, cc: _Resolved, chunks: Iterable[tuple[int, int]],
                   at: Sequence[float], dp: DPSync) -> None:
    """Queue the gradient sync of each (device, chunk) in ``chunks``, device ``s``'s from ``at[s]``."""
    for s, c in chunks:
        g = schedule.global_stage(s, c)
        lanes.request_sync(s, c, g, cc.params[g], at[s], dp)


def _bucket_times(dp: DPSync, nbytes: float, start: float, duration: float) -> list[float]:
    """``when="buckets"``: when each bucket of a chunk's ``nbytes`` is ready, its last
    weight-gradient task running from ``start`` for ``duration`` and producing the
    gradient at an even rate (``DPSync``)."""
    times, done = [], 0.0
    for n in dp.slices(nbytes):
        done += n
        times.append(start + duration * min(1.0, done / nbytes))
    return times


def _request_buckets(lanes: _Lanes, schedule: Schedule, cc: _Resolved, chunks: Iterable[tuple[int, int]],
                     grad_task: dict[tuple[int, int], tuple[float, float]], dp: DPSync) -> None:
    """Queue the buckets of each (device, chunk) in ``chunks`` from when they are ready
    in the chunk's last weight-gradient task (``grad_task[(s, c)]``: its start, duration)."""
    for s, c in chunks:
        g = schedule.global_stage(s, c)
        start, duration = grad_task[(s, c)]
        lanes.request_sync(s, c, g, cc.params[g], _bucket_times(dp, cc.params[g], start, duration), dp)


def _request_gathers_after(lanes: _Lanes, schedule: Schedule, cc: _Resolved,
                           last_grad: dict[tuple[int, int], int], at: Sequence[float], dp: DPSync) -> None:
    """``param_gather="after"``: every chunk's parameter all-gather, queued behind the
    device's reduce-scatters (its lane is FIFO), from its compute's end ``at[s]``."""
    if dp.param_gather != "after":
        return
    for s, c in _by_finish(last_grad):
        g = schedule.global_stage(s, c)
        lanes.request_gather(s, c, g, cc.params[g], at[s], dp)


def _by_finish(last_grad: dict[tuple[int, int], int]) -> list[tuple[int, int]]:
    """``dp.when == "end"``: the (device, chunk)s in the order their gradients became final."""
    return sorted(last_grad, key=last_grad.get)
