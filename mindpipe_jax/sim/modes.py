"""The three replays ``simulate`` dispatches to, one per mode: ``_run_async`` (an
MPMD executor), ``_run_lockstep`` (a global barrier per tick) and ``_run_neighbour``
(the fused ticks the SPMD runtime runs, ``schedules.fused``, with its ring ppermutes),
and what they share (a task's inputs and consumer, the exchange buffer, the tick
modes' start). The modes are described in ``sim/__init__.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

from mindpipe_jax.errors import ConfigError
from mindpipe_jax.parallel.pipeline.schedules import Kind, Schedule, Task
from mindpipe_jax.parallel.pipeline.schedules.fused import FusedSchedule
from mindpipe_jax.sim.costs import _Resolved
from mindpipe_jax.sim.lanes import (
    _by_finish,
    _finished_in,
    _Lanes,
    _last_grad_ticks,
    _request_buckets,
    _request_gathers_after,
    _request_syncs,
)
from mindpipe_jax.sim.network import DPSync, Link
from mindpipe_jax.sim.result import Event, SimResult, _Trace


def _inputs(kind: Kind, mb: int, g: int, num_global: int) -> list[tuple[str, int, int]]:
    """What a task consumes, keyed (``"F"`` | ``"B"``, mb, global stage); a ``B``
    key is produced by a ``B`` or a ``BW``."""
    if kind is Kind.F:
        return [("F", mb, g - 1)] if g > 0 else []
    if kind is Kind.W:
        return [("B", mb, g)]
    return [("F", mb, g)] + ([("B", mb, g + 1)] if g < num_global - 1 else [])


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
