"""The simulator's engine: replays of a schedule table in the async, lockstep and
neighbour modes (neighbour: of the fused ticks the SPMD runtime runs, ``schedules.fused``),
the per-device network lanes, and what a replay returns (``Event``, ``SimResult``).
The model and the modes are described in ``sim/__init__.py``.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from mindpipe_jax.errors import ConfigError
from mindpipe_jax.parallel.pipeline.schedules import Kind, Schedule, Task, Timeline
from mindpipe_jax.parallel.pipeline.schedules.fused import FUSE_MODES, FusedSchedule
from mindpipe_jax.parallel.pipeline.schedules.fused import fuse as fuse_ticks
from mindpipe_jax.sim.costs import StageCosts, _is_number, _number, _Resolved
from mindpipe_jax.sim.network import DPSync, Link


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


# ---------------------------------------------------------------- simulator
def _inputs(kind: Kind, mb: int, g: int, num_global: int) -> list[tuple[str, int, int]]:
    """What a task consumes, keyed (``"F"`` | ``"B"``, mb, global stage); a ``B``
    key is produced by a ``B`` or a ``BW``."""
    if kind is Kind.F:
        return [("F", mb, g - 1)] if g > 0 else []
    if kind is Kind.W:
        return [("B", mb, g)]
    return [("F", mb, g)] + ([("B", mb, g + 1)] if g < num_global - 1 else [])


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


MODES = ("async", "lockstep", "neighbour")
CONTENTION = (True, False, "priority")


def simulate(schedule: Schedule | FusedSchedule, costs: StageCosts | Mapping | Callable | None = None, *,
             link: Link | float | None = None, dp_sync: DPSync | None = None, mode: str = "async",
             contention: bool | str = True, tick_overhead: float | Sequence[float] = 0.0,
             fuse: str | None = None) -> SimResult:
    """Replay ``schedule`` with ``costs`` on ``link`` (see the module docstring).

    ``costs``: ``StageCosts`` (per-stage durations and bytes), a mapping kind ->
    seconds (as ``Schedule.timeline``: missing kinds from ``DEFAULT_COST``) or a
    function ``(stage, task) -> seconds``; ``None`` is ``StageCosts()`` (F = B = W
    = 1, BW = 2). ``link``: a ``Link``, a float (every transfer takes that many
    seconds) or ``None`` (free). ``dp_sync``: gradient sync over data ranks, or
    ``None``. ``mode``: ``"async"``, ``"lockstep"`` or ``"neighbour"``. ``contention``:
    sends share the sender's network lane with each other and with its syncs
    (``False``: infinite link capacity; syncs still run one at a time per device).
    ``tick_overhead``: seconds every device spends in every tick besides its task
    (a tick-synchronous runtime's per-tick bookkeeping; one number or one per
    device); the tick modes only.

    ``fuse`` (neighbour mode only): how the table is re-timed into fused ticks
    before the replay, as the SPMD runtime does (``schedules.fused.fuse``). ``None``
    means ``"auto"``, the runtime's default, chosen exactly as the runtime chooses it
    (under ``DEFAULT_COST``, whatever ``costs`` says); ``"table"`` replays one task
    per tick (the table as it is), ``"in-order"`` and ``"forward-ahead"`` force a
    mode. ``schedule`` may also be a ``FusedSchedule`` (neighbour mode, ``fuse``
    None): it is replayed as given."""
    fused = None
    if isinstance(schedule, FusedSchedule):
        if mode != "neighbour":
            raise ConfigError(f"a FusedSchedule is what the SPMD runtime runs: simulate it in mode "
                              f"'neighbour', not {mode!r} (or pass its .schedule)")
        if fuse is not None:
            raise ConfigError(f"simulate got a FusedSchedule and fuse={fuse!r}: the schedule is already "
                              f"fused; pass fuse=None, or its .schedule with a fuse mode")
        fused, schedule = schedule, schedule.schedule
    if not isinstance(schedule, Schedule):
        raise ConfigError(f"simulate needs a Schedule, got {type(schedule).__name__}")
    if mode not in MODES:
        raise ConfigError(f"simulate mode must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
    if fuse is not None and mode != "neighbour":
        raise ConfigError(f"fuse={fuse!r} re-times the table as the SPMD runtime does: it applies to "
                          f"mode 'neighbour' only, not {mode!r}")
    if fuse is not None and fuse not in FUSE_MODES:
        raise ConfigError(f"fuse must be one of {', '.join(map(repr, FUSE_MODES))} or None, got {fuse!r}")
    overhead = _per_device(tick_overhead, "tick_overhead", schedule.num_stages)
    if mode == "async" and any(overhead):
        raise ConfigError("tick_overhead is a cost of tick-synchronous runtimes: use mode 'lockstep' "
                          "or 'neighbour' (mode 'async' has no ticks)")
    if link is None:
        link = Link()
    elif _is_number(link):
        link = Link.fixed(_number(link, "link (seconds per transfer)"))
    elif not isinstance(link, Link):
        raise ConfigError(f"link must be a Link, a number of seconds or None, got {link!r}")
    if dp_sync is not None and not isinstance(dp_sync, DPSync):
        raise ConfigError(f"dp_sync must be a DPSync or None, got {dp_sync!r}")
    if contention not in CONTENTION:
        raise ConfigError(f"contention must be one of {', '.join(map(repr, CONTENTION))}, got {contention!r}")
    if dp_sync is not None and dp_sync.param_gather == "forward" and mode != "async":
        raise ConfigError(f"DPSync(param_gather='forward') holds each chunk's first forward until its "
                          f"all-gather arrives, which mode 'async' models; mode {mode!r} does not (use "
                          f"param_gather='after' or 'none')")
    cc = _Resolved(costs, schedule)
    if mode == "async":
        return _run_async(schedule, cc, link, dp_sync, contention)
    if mode == "lockstep":
        return _run_lockstep(schedule, cc, link, dp_sync, contention, overhead)
    _check_ring_neighbours(schedule)
    how = "given" if fused is not None else (fuse or "auto")
    if fused is None:
        fused = fuse_ticks(schedule, how)  # as runtime.tickplan.make_plan calls it: default costs
    return _run_neighbour(fused, cc, link, dp_sync, contention, overhead, how)


def _per_device(value, name: str, p: int) -> list[float]:
    if _is_number(value):
        return [_number(value, name)] * p
    if isinstance(value, str | bytes) or not isinstance(value, Sequence) or len(value) != p:
        raise ConfigError(f"{name} must be a number or {p} numbers (one per device), got {value!r}")
    return [_number(x, f"{name}[{s}]") for s, x in enumerate(value)]


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


def _crossing_bytes(schedule: Schedule, cc: _Resolved) -> list[float]:
    """The activation bytes of every global stage whose output goes to another device:
    a tick mode's exchange buffer is sized for the largest (none: no exchange)."""
    G = schedule.num_global_stages
    owner = [schedule.owner(g)[0] for g in range(G)]
    return [cc.act[g] for g in range(G - 1) if owner[g] != owner[g + 1]]


def _tick_start(schedule: Schedule, cc: _Resolved, link: Link, dp: DPSync | None, fused=None,
                contention: bool | str = True):
    """What both tick modes start from: the trace, the network lanes, each chunk's
    last weight-gradient tick (and, per tick, the chunks finished in it), whether
    any activation crosses devices, and the exchange buffer (the largest that does:
    every exchange sends one of that size) with its lane occupancy. ``fused``: the
    ``FusedSchedule`` whose ticks are replayed (default: the table's)."""
    trace = _Trace(schedule, None if fused is None else fused.num_ticks)
    lanes = _Lanes(schedule.num_stages, trace.events, priority=contention == "priority")
    last_grad = _last_grad_ticks(schedule, None if fused is None else fused.cells) if dp is not None else {}
    crossing = _crossing_bytes(schedule, cc)
    buffer = max(crossing, default=0.0)
    return trace, lanes, last_grad, _finished_in(last_grad), bool(crossing), buffer, link.occupancy(buffer)


def _consumer(schedule: Schedule, task: Task, g: int) -> tuple[int, int] | None:
    """(device, global stage whose output is sent) of the task's cross-stage output."""
    G = schedule.num_global_stages
    if task.kind is Kind.F and g < G - 1:
        return schedule.owner(g + 1)[0], g
    if task.kind in (Kind.B, Kind.BW) and g > 0:
        return schedule.owner(g - 1)[0], g - 1
    return None


def _run_async(schedule: Schedule, cc: _Resolved, link: Link, dp: DPSync | None,
               contention: bool | str) -> SimResult:
    p, G = schedule.num_stages, schedule.num_global_stages
    trace = _Trace(schedule)
    free = [0.0] * p
    events = trace.events
    lanes = _Lanes(p, events, priority=contention == "priority")
    last_grad = _last_grad_ticks(schedule) if dp is not None else {}
    buckets = dp is not None and dp.when == "buckets"
    gather_first = dp is not None and dp.param_gather == "forward"
    gathered: set[tuple[int, int]] = set()
    if gather_first:   # the previous step's all-gathers, chunk by chunk in the order each device uses them
        for s in range(p):
            firsts = [task.chunk for row in schedule.table
                      if (task := row[s]) is not None and task.kind is Kind.F]
            for c in dict.fromkeys(firsts):
                g = schedule.global_stage(s, c)
                lanes.request_gather(s, c, g, cc.params[g], 0.0, dp, tag=("gather", c))
    done: dict[tuple[str, int, int], tuple[float, int]] = {}   # key -> (end, device)
    arrival: dict[tuple[str, int, int], float] = {}           # key -> arrival at its consumer
    for t, row in enumerate(schedule.table):
        for s, task in enumerate(row):
            if task is None:
                continue
            g = schedule.global_stage(s, task.chunk)
            ready = free[s]
            for key in _inputs(task.kind, task.microbatch, g, G):
                finish, where = done[key]
                ready = max(ready, finish if where == s else arrival[key])
            if gather_first and task.kind is Kind.F and (s, task.chunk) not in gathered:
                # --overlap-param-gather: the chunk's parameters must have arrived
                gathered.add((s, task.chunk))
                ready = max(ready, lanes.done_through(s, ("gather", task.chunk)))
            stop = ready + trace.compute(cc, t, s, task, ready)
            free[s] = stop
            if buckets and last_grad.get((s, task.chunk)) == t and task.kind in (Kind.BW, Kind.W):
                # before this task's own send claims the lane: its buckets were ready during it
                _request_buckets(lanes, schedule, cc, [(s, task.chunk)],
                                 {(s, task.chunk): (ready, stop - ready)}, dp)
            if task.kind is Kind.W:
                key = ("W", task.microbatch, g)
            else:
                key = ("F" if task.kind is Kind.F else "B", task.microbatch, g)
            done[key] = (stop, s)
            out = _consumer(schedule, task, g)
            if out is not None and out[0] != s:
                dest, boundary = out
                nbytes = cc.act[boundary]
                occ = link.occupancy(nbytes)
                leave = lanes.claim(s, stop) if contention else stop
                if contention:
                    lanes.occupy(s, leave, occ)
                lanes.busy[s] += occ
                arrival[key] = leave + occ + link.latency_s
                events.append(Event(s, "network", "send", leave, arrival[key], t, task.microbatch,
                                    task.chunk, g, dest, nbytes))
            if dp is not None and dp.when == "overlap" and last_grad.get((s, task.chunk)) == t:
                lanes.request_sync(s, task.chunk, g, cc.params[g], stop, dp)
    compute = max(free, default=0.0)
    if dp is not None and dp.when == "end":
        _request_syncs(lanes, schedule, cc, _by_finish(last_grad), free, dp)
    if dp is not None:
        _request_gathers_after(lanes, schedule, cc, last_grad, free, dp)
    lanes.finish()
    return trace.result("async", max(compute, lanes.last), compute, lanes.busy)


def _run_lockstep(schedule: Schedule, cc: _Resolved, link: Link, dp: DPSync | None,
                  contention: bool | str, overhead: Sequence[float]) -> SimResult:
    p, ticks = schedule.num_stages, schedule.num_ticks
    trace, lanes, last_grad, finished_in, crossing, buffer, occ = _tick_start(schedule, cc, link, dp,
                                                                              contention=contention)
    events = trace.events
    clock = 0.0
    # (device, chunk) -> its last W/BW's start and duration
    grad_task: dict[tuple[int, int], tuple[float, float]] = {}
    for t, row in enumerate(schedule.table):
        longest = max(overhead, default=0.0)
        for s, task in enumerate(row):
            if task is None:
                continue
            d = trace.compute(cc, t, s, task, clock)
            if task.kind in (Kind.BW, Kind.W):
                grad_task[(s, task.chunk)] = (clock, d)
            longest = max(longest, d + overhead[s])
        compute_end = clock + longest
        clock = compute_end
        if dp is not None and dp.when == "buckets":
            _request_buckets(lanes, schedule, cc, finished_in.get(t, ()), grad_task, dp)
        if t < ticks - 1 and crossing:
            leave = max(lanes.claim(s, compute_end) for s in range(p)) if contention else compute_end
            arrive = leave + occ + link.latency_s
            for s in range(p):
                if contention:
                    lanes.occupy(s, leave, occ)
                lanes.busy[s] += occ
                events.append(Event(s, "network", "exchange", leave, arrive, t, nbytes=buffer))
            clock = arrive
        if dp is not None and dp.when == "overlap":
            _request_syncs(lanes, schedule, cc, finished_in.get(t, ()), [compute_end] * p, dp)
    compute = clock
    if dp is not None and dp.when == "end":
        _request_syncs(lanes, schedule, cc, _by_finish(last_grad), [compute] * p, dp)
    if dp is not None:
        _request_gathers_after(lanes, schedule, cc, last_grad, [compute] * p, dp)
    lanes.finish()
    return trace.result("lockstep", max(compute, lanes.last), compute, lanes.busy)


def _check_ring_neighbours(schedule: Schedule) -> None:
    """Neighbour mode moves a value one device along the ring per ppermute, in either
    direction (a V placement sends chunk b's activations to ``s - 1``): refuse a
    placement whose consecutive global stages sit further apart."""
    p = schedule.num_stages
    for g in range(schedule.num_global_stages - 1):
        a, b = schedule.owner(g)[0], schedule.owner(g + 1)[0]
        if a != b and (b - a) % p not in (1, p - 1):
            raise ConfigError(f"mode 'neighbour' moves values one device along the ring per ppermute, but "
                              f"global stage {g} is on device {a} and {g + 1} on device {b}; use mode "
                              f"'async' or 'lockstep', or a placement with consecutive stages on the same "
                              f"or adjacent devices")


_SHIFTS = (("next", 1), ("prev", -1), ("self", 0))


def _direction(src: int, dst: int, p: int) -> str:
    """The runtime's name for a hop (``tickplan._direction``): the first of next
    (s + 1), prev (s - 1), self (the same device) that reaches ``dst`` from ``src``."""
    return next(d for d, k in _SHIFTS if dst == (src + k) % p)


def _ppermutes(schedule: Schedule) -> list[int]:
    """The ring shifts of the ppermutes every tick runs, in the runtime's order
    (``runtime.ticks``): activations first, then gradients, each with one ppermute
    per direction some value of that kind goes (next before prev); a hand-off within
    a device (self) is none. A 1F1B-like placement: [+1, -1]; a V placement on
    p > 2 devices sends both kinds both ways: [+1, -1, +1, -1]."""
    p = schedule.num_stages
    ways: dict[str, set[str]] = {"x": set(), "g": set()}
    for g in range(schedule.num_global_stages - 1):
        a, b = schedule.owner(g)[0], schedule.owner(g + 1)[0]
        ways["x"].add(_direction(a, b, p))
        ways["g"].add(_direction(b, a, p))
    return [k for what in ("x", "g") for d, k in _SHIFTS[:2] if d in ways[what]]


def _run_neighbour(fused: FusedSchedule, cc: _Resolved, link: Link, dp: DPSync | None,
                   contention: bool | str, overhead: Sequence[float], how: str) -> SimResult:
    """The SPMD runtime as it executes: every device keeps its own clock. In fused
    tick ``t`` it runs its tasks of the tick one after the other (F, then its
    backward, then its W; the tick's compute is their sum) and its bookkeeping, then
    the tick's ppermutes one after the other (``_ppermutes``), sending to and
    receiving from a ring neighbour; it leaves a ppermute once its own message has
    left its lane and its neighbour's has arrived. Nothing waits for devices further
    away, so a delay travels one hop per ppermute instead of stopping every device
    at once. Every ppermute carries one buffer, whether or not it holds a value."""
    schedule = fused.schedule
    p = schedule.num_stages
    # Every device sends one buffer, sized for the largest activation that crosses
    # devices, in each ppermute of every tick, whether or not it carries anything
    # (the scan body is the same each tick, the last one included).
    trace, lanes, last_grad, finished_in, crossing, buffer, occ = _tick_start(schedule, cc, link, dp, fused,
                                                                              contention)
    shifts = _ppermutes(schedule) if crossing else []
    events = trace.events
    clock = [0.0] * p
    # (device, chunk) -> its last W/BW's start and duration
    grad_task: dict[tuple[int, int], tuple[float, float]] = {}
    for t, row in enumerate(fused.cells):
        ready = []
        for s, cell in enumerate(row):
            at = clock[s]
            for task in cell:
                if task is not None:
                    d = trace.compute(cc, t, s, task, at)
                    if task.kind in (Kind.BW, Kind.W):
                        grad_task[(s, task.chunk)] = (at, d)
                    at += d
            ready.append(at + overhead[s])
        compute_end = list(ready)
        if dp is not None and dp.when == "buckets":
            _request_buckets(lanes, schedule, cc, finished_in.get(t, ()), grad_task, dp)
        for shift in shifts:
            leave = [lanes.claim(s, ready[s]) if contention else ready[s] for s in range(p)]
            arrive = [leave[s] + occ + link.latency_s for s in range(p)]
            for s in range(p):
                if contention:
                    lanes.occupy(s, leave[s], occ)
                lanes.busy[s] += occ
                events.append(Event(s, "network", "exchange", leave[s], arrive[s], t,
                                    peer=(s + shift) % p, nbytes=buffer))
            ready = [max(leave[s] + occ, arrive[(s - shift) % p]) for s in range(p)]
        clock = ready
        if dp is not None and dp.when == "overlap":
            _request_syncs(lanes, schedule, cc, finished_in.get(t, ()), compute_end, dp)
    if dp is not None and dp.when == "end":
        _request_syncs(lanes, schedule, cc, _by_finish(last_grad), clock, dp)
    if dp is not None:
        _request_gathers_after(lanes, schedule, cc, last_grad, clock, dp)
    compute = max(clock, default=0.0)
    lanes.finish()
    return trace.result("neighbour", max(compute, lanes.last), compute, lanes.busy, how)
