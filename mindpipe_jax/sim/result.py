"""What a replay records and returns: ``Event`` (one interval on one device's lane),
``SimResult`` (step time, utilization, bubble and every event) and ``_Trace``, which
the replays (``sim/modes.py``, ``sim/comm.py``) fill in as they run. Re-exported by
``sim/engine.py`` and ``mindpipe_jax.sim``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from mindpipe_jax.parallel.pipeline.schedules import Schedule, Task, Timeline
from mindpipe_jax.sim.costs import _Resolved


@dataclass(frozen=True)
class Event:
    """One interval on one device's lane, for plotting.

    ``lane`` is ``"compute"`` (kind ``F``/``B``/``W``/``BW``) or ``"network"``
    (kind ``"send"``: a point-to-point transfer to ``peer``, ``end`` = arrival;
    ``"exchange"``: a tick-end ppermute of the tick modes, in neighbour mode one per
    ppermute with its ``peer``, ``end`` = arrival; ``"sync"``: a gradient sync slice).
    """

    device: int
    lane: str
    kind: str
    start: float
    end: float
    tick: int | None = None
    microbatch: int | None = None
    chunk: int | None = None
    global_stage: int | None = None
    peer: int | None = None
    nbytes: float = 0.0

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class SimResult:
    """What ``simulate`` measured. ``utilization[d] = busy[d] / step_time`` (compute
    only: time spent in an exposed sync counts as idle); ``bubble_fraction = 1 -
    sum(busy) / (p * step_time)``. ``start[t][s]`` / ``end[t][s]``: when device ``s``'s
    compute in tick ``t`` began and ended (in neighbour mode ``t`` is a fused tick, whose
    tasks run one after the other: the first's start, the last's end)."""

    schedule: str
    mode: str
    step_time: float
    compute_time: float                  # when the last compute task ends
    busy: tuple[float, ...]              # per device: sum of its task durations
    network_busy: tuple[float, ...]      # per device: time its network lane was occupied
    events: tuple[Event, ...] = field(repr=False)
    start: tuple[tuple[float | None, ...], ...] = field(repr=False)   # [tick][stage]
    end: tuple[tuple[float | None, ...], ...] = field(repr=False)
    # neighbour mode: how the table was re-timed into fused ticks ("auto", "table",
    # "in-order", "forward-ahead", or "given" for a FusedSchedule); None in the other modes
    fuse: str | None = None

    @property
    def num_devices(self) -> int:
        return len(self.busy)

    @property
    def utilization(self) -> tuple[float, ...]:
        return tuple(b / self.step_time if self.step_time > 0 else 0.0 for b in self.busy)

    @property
    def mean_utilization(self) -> float:
        if self.step_time <= 0:
            return 0.0
        return sum(self.busy) / (len(self.busy) * self.step_time)

    @property
    def bubble_fraction(self) -> float:
        return 1.0 - self.mean_utilization if self.step_time > 0 else 0.0

    @property
    def exposed_communication(self) -> float:
        """Step time after the last compute (syncs that nothing hid)."""
        return self.step_time - self.compute_time

    def events_of(self, device: int, lane: str | None = None) -> list[Event]:
        return [e for e in self.events if e.device == device and (lane is None or e.lane == lane)]

    def to_timeline(self) -> Timeline:
        """The compute part as a ``schedules.Timeline`` (makespan = step time)."""
        return Timeline(self.start, self.end, self.step_time, self.busy)

    def summary(self) -> str:
        per = " ".join(f"{u:.2f}" for u in self.utilization)
        mode = self.mode if self.fuse is None else f"{self.mode}, fused {self.fuse}"
        return (f"{self.schedule} ({mode}): step {self.step_time:.6g} s, compute "
                f"{self.compute_time:.6g} s, utilization {self.mean_utilization:.3f} "
                f"(per device {per}), bubble {self.bubble_fraction:.3f}")


class _Trace:
    """What a replay records and returns: per tick and device when its tasks ran,
    per device the time its tasks took, and every event. ``num_ticks``: the
    table's (default) or a fused schedule's."""

    def __init__(self, schedule: Schedule, num_ticks: int | None = None):
        p = schedule.num_stages
        ticks = schedule.num_ticks if num_ticks is None else num_ticks
        self.schedule = schedule
        self.start: list[list[float | None]] = [[None] * p for _ in range(ticks)]
        self.end: list[list[float | None]] = [[None] * p for _ in range(ticks)]
        self.busy = [0.0] * p
        self.events: list[Event] = []

    def compute(self, cc: _Resolved, t: int, s: int, task: Task, at: float) -> float:
        """Record device ``s`` running ``task`` (tick ``t``) from ``at``; returns its duration.
        A fused tick's tasks run one after the other: the tick's start is its first's."""
        g = self.schedule.global_stage(s, task.chunk)
        d = cc.duration(s, task, g)
        if self.start[t][s] is None:
            self.start[t][s] = at
        self.end[t][s] = at + d
        self.busy[s] += d
        self.events.append(Event(s, "compute", task.kind.value, at, at + d, t, task.microbatch,
                                 task.chunk, g))
        return d

    def result(self, mode: str, step_time: float, compute_time: float,
               network_busy: Sequence[float], fuse: str | None = None) -> SimResult:
        return SimResult(self.schedule.name, mode, step_time, compute_time, tuple(self.busy),
                         tuple(network_busy), tuple(self.events), tuple(map(tuple, self.start)),
                         tuple(map(tuple, self.end)), fuse)
