"""Fused ticks: a schedule table re-timed so one tick carries up to one forward,
one backward (B or BW) and one weight-gradient task per device.

Why. The SPMD runtime moves values between devices with ``ppermute``s at the end
of every tick, so a tick lasts as long as its slowest device. In a plain table a
device runs one task per tick: in 1F1B's steady state one device runs an F while
its neighbour runs a BW, and both pay a BW. Fused, each device runs its F and its
BW in the same tick, so a steady-state tick costs F + BW on every device, which
is what the asynchronous schedule costs anyway.

How. Each device keeps the order of its own tasks (so what it holds alive, and
the schedule's memory bound, is the table's). Ticks are filled greedily: a device
takes its next tasks in order while their part of the tick (F, backward, W) is
free and their inputs are ready; it stops at the first that is not, so nothing
overtakes. An input made on another device must come from an earlier tick (it
arrives with the tick-end transfer); one made on the same device may come from the
same tick only when the task before it in the tick's order (F, then backward,
then W) made it and nothing has to be kept between them: the last global stage's
F, which the runtime runs inside its backward. Every other input is read from a
buffer written at the end of an earlier tick. Progress is guaranteed: the earliest
unplaced task of the table has all its inputs placed and nothing before it on its
device, so each tick places at least one task.

Pure Python, no JAX.
"""

from __future__ import annotations

import dataclasses

from mindpipe_jax.parallel.pipeline.schedules.table import Schedule
from mindpipe_jax.parallel.pipeline.schedules.types import Kind, ScheduleError, Task, _cost_fn

PARTS = ("F", "B", "W")  # a fused tick's parts, in the order a device runs them
PART_OF = {Kind.F: 0, Kind.B: 1, Kind.BW: 1, Kind.W: 2}

Key = tuple[Kind, int, int]  # (kind, microbatch, global stage)


@dataclasses.dataclass(frozen=True)
class FusedSchedule:
    """``cells[t][s]`` is device ``s``'s ``(F, backward, W)`` tasks in fused tick ``t``
    (each ``Task`` or None). ``tick_of`` maps (kind, microbatch, global stage) to its
    fused tick."""

    schedule: Schedule
    cells: tuple[tuple[tuple[Task | None, Task | None, Task | None], ...], ...]
    tick_of: dict[Key, int]

    @property
    def num_ticks(self) -> int:
        return len(self.cells)

    @property
    def num_stages(self) -> int:
        return self.schedule.num_stages

    def where(self) -> dict[Key, tuple[int, int]]:
        """(kind, microbatch, global stage) -> (fused tick, device)."""
        out = {}
        for t, row in enumerate(self.cells):
            for s, cell in enumerate(row):
                for task in cell:
                    if task is not None:
                        out[(task.kind, task.microbatch, self.schedule.global_stage(s, task.chunk))] = (t, s)
        return out

    def peak_live(self) -> list[int]:
        """Per device, the most microbatches between their forward and their backward
        at the end of a fused tick (what the runtime keeps in its slot buffers)."""
        peaks = []
        for s in range(self.num_stages):
            live = peak = 0
            for row in self.cells:
                for task in row[s]:
                    if task is not None and task.kind is not Kind.W:
                        live += 1 if task.kind is Kind.F else -1
                peak = max(peak, live)
            peaks.append(peak)
        return peaks

    def render(self) -> str:
        """One line per device, one column per fused tick (``F3+BW1`` style)."""
        def name(task):
            chunk = chr(97 + task.chunk) if self.schedule.virtual_stages > 1 else ""
            return f"{task.kind}{task.microbatch}{chunk}"

        lines = []
        for s in range(self.num_stages):
            cols = ["+".join(name(x) for x in row[s] if x is not None) or "." for row in self.cells]
            width = max(len(c) for c in cols)
            lines.append(f"stage {s}: " + " ".join(c.ljust(width) for c in cols))
        return "\n".join(lines)


def _inputs(kind: Kind, mb: int, g: int, last: int) -> list[Key]:
    """The tasks whose results ``kind`` of (mb, g) reads; a backward input is made
    by a B or a BW, whichever the schedule has."""
    if kind is Kind.F:
        return [(Kind.F, mb, g - 1)] if g > 0 else []
    if kind is Kind.W:
        return [(Kind.B, mb, g)]
    return [(Kind.F, mb, g)] + ([(Kind.B, mb, g + 1)] if g < last else [])


FUSE_MODES = ("auto", "table", "in-order", "forward-ahead", "fill", "slack")


def fuse(schedule: Schedule, mode: str = "auto", cost=None) -> FusedSchedule:
    """Re-time ``schedule`` into fused ticks (see the module docstring).

    ``mode``: ``"table"`` keeps one task per tick (the table as it is);
    ``"in-order"`` fills ticks keeping each device's order; ``"forward-ahead"``
    lets a device's forwards run ahead of its backwards while it holds fewer than
    ``2·peak − 1`` microbatches (``peak``: the table's peak live activations on
    that device), which is what fusing 1F1B needs (stage 0 holds 2p − 1 at most)
    and otherwise keeps each kind in table order; ``"fill"`` is forward-ahead with
    the weight gradients deferred: a device runs a W only in a tick where its F or its
    backward part is empty (a bubble), or when it holds more pending W's than the
    table does at its peak; ``"slack"`` is forward-ahead for F and backward tasks,
    then places each device's next W into the tick's slack under ``cost`` (see
    ``_place_weight_grads``); ``"auto"`` takes whichever of the others the
    tick-synchronous replay (``replay_time``) finds fastest under ``cost`` (default:
    ``DEFAULT_COST``; pass measured costs where known: the best mode depends on them),
    the one holding fewer microbatches on a tie. Without ``cost``, ``"auto"`` takes
    the mode whose worst slowdown against the best mode over ``COST_PROFILES`` is
    smallest: a plain table is best only when F, B and W cost exactly the same, and
    measured costs rarely do (a 2-process ZB-H1 on this CPU ran 1.4x faster "fill"
    than as its table, benchmarks/pipeline_2proc.py).
    """
    if mode not in FUSE_MODES:
        raise ScheduleError(f"fuse mode {mode!r} is not one of {', '.join(FUSE_MODES)}")
    if mode == "auto":
        options = [fuse(schedule, m, cost) for m in FUSE_MODES[1:] if m not in W_MODES or _has_w(schedule)]
        if cost is not None:
            return min(options, key=lambda f: (round(replay_time(f, cost), 9), max(f.peak_live())))
        return min(options, key=lambda f: (round(worst_slowdown(f, options), 9), max(f.peak_live())))
    p, last = schedule.num_stages, schedule.num_global_stages - 1
    order = [[task for _, task in schedule.tasks_of(s)] for s in range(p)]
    if mode == "table":
        cells = tuple(tuple(_cell(task) for task in row) for row in schedule.table)
        return FusedSchedule(schedule, cells, _tick_of(schedule, cells))
    if mode == "in-order":
        queues = [[list(tasks)] for tasks in order]
        cap = [None] * p
    else:
        kinds = ((Kind.F,), (Kind.B, Kind.BW, Kind.W)) if mode == "forward-ahead" else \
            ((Kind.F,), (Kind.B, Kind.BW), (Kind.W,))  # "fill", "slack": the W's their own queue
        queues = [[[t for t in tasks if t.kind in ks] for ks in kinds] for tasks in order]
        cap = [2 * n - 1 for n in schedule.peak_live_activations()]
    pending_cap = schedule.peak_pending_weight_grads()
    done: dict[Key, tuple[int, int, int]] = {}  # key -> (tick, device, part)
    live, pending = [0] * p, [0] * p
    cells = []

    def place(row, t, s, task, g):
        row[s][PART_OF[task.kind]] = task
        done[(Kind.B if task.kind is Kind.BW else task.kind, task.microbatch, g)] = (t, s, PART_OF[task.kind])
        live[s] += {Kind.F: 1, Kind.B: -1, Kind.BW: -1}.get(task.kind, 0)
        pending[s] += {Kind.B: 1, Kind.W: -1}.get(task.kind, 0)

    while any(q for qs in queues for q in qs):
        t = len(cells)
        row = [[None, None, None] for _ in range(p)]
        for s in range(p):
            for queue in queues[s][:2] if mode == "slack" else queues[s]:
                while queue:
                    task = queue[0]
                    part = PART_OF[task.kind]
                    g = schedule.global_stage(s, task.chunk)
                    if row[s][part] is not None or not _ready(task.kind, task.microbatch, g, last, s, t, part,
                                                              done):
                        break
                    if task.kind is Kind.F and cap[s] is not None and live[s] >= cap[s]:
                        break
                    if (mode == "fill" and task.kind is Kind.W and row[s][0] is not None
                            and row[s][1] is not None and pending[s] <= pending_cap[s]):
                        break  # no bubble in this tick to fill, and the backlog is within the table's
                    place(row, t, s, task, g)
                    queue.pop(0)
        if mode == "slack":
            _place_weight_grads(schedule, row, t, [qs[2] for qs in queues], done, pending, pending_cap,
                                _cost_fn(cost), place)
        if not any(any(c) for c in row):  # cannot happen for a valid table (see module docstring)
            raise AssertionError(f"fusing {schedule.name} made no progress at fused tick {t}")
        cells.append(tuple(tuple(c) for c in row))
    cells = tuple(cells)
    return FusedSchedule(schedule, cells, _tick_of(schedule, cells))


W_MODES = ("fill", "slack")  # modes that differ from forward-ahead only in where the W's go


def _place_weight_grads(schedule, row, t, w_queues, done, pending, pending_cap, cost_of, place) -> None:
    """The ``"slack"`` mode's W part of tick ``t``, after every device's F and backward.

    A tick lasts as long as its busiest device, so a W costs nothing where the device's
    F + backward + W fit in that time: its slack. First the W's that must run: on a
    device with nothing else in the tick (a bubble), or holding more pending W's than
    the table does at its peak (the memory bound). Those can lengthen the tick and so
    give the others slack; then, until none is placed, every device whose next W is
    ready and fits in the slack runs it. Each device keeps its W's in table order."""
    p, last = schedule.num_stages, schedule.num_global_stages - 1
    load = [sum(cost_of(s, task) for task in row[s] if task is not None) for s in range(p)]
    ready = {}
    for s in range(p):
        if w_queues[s]:
            task = w_queues[s][0]
            g = schedule.global_stage(s, task.chunk)
            if _ready(task.kind, task.microbatch, g, last, s, t, PART_OF[task.kind], done):
                ready[s] = (task, g)

    def run(s):
        task, g = ready.pop(s)
        place(row, t, s, task, g)
        load[s] += cost_of(s, task)
        w_queues[s].pop(0)

    for s in list(ready):
        if (row[s][0] is None and row[s][1] is None) or pending[s] > pending_cap[s]:
            run(s)
    placed = True
    while placed:
        placed = False
        for s in list(ready):
            if load[s] + cost_of(s, ready[s][0]) <= max(load) * (1 + 1e-12):
                run(s)
                placed = True


def _has_w(schedule: Schedule) -> bool:
    return any(task is not None and task.kind is Kind.W for row in schedule.table for task in row)


def _cell(task: Task | None) -> tuple[Task | None, Task | None, Task | None]:
    cell = [None, None, None]
    if task is not None:
        cell[PART_OF[task.kind]] = task
    return tuple(cell)


def _tick_of(schedule: Schedule, cells) -> dict[Key, int]:
    return {(task.kind, task.microbatch, schedule.global_stage(s, task.chunk)): t
            for t, row in enumerate(cells) for s, cell in enumerate(row) for task in cell if task is not None}


# Task costs a layer plausibly has (F = 1): the textbook F = B = W, a backward twice the
# forward split evenly or not, and measured CPU ratios (benchmarks/pipeline.py).
COST_PROFILES = ({"F": 1.0, "B": 1.0, "W": 1.0}, {"F": 1.0, "B": 2.0, "W": 1.0},
                 {"F": 1.0, "B": 1.5, "W": 1.5}, {"F": 1.0, "B": 1.0, "W": 2.0},
                 {"F": 1.0, "B": 2.0, "W": 2.0}, {"F": 1.3, "B": 1.5, "W": 1.4})


def worst_slowdown(fused: FusedSchedule, options) -> float:
    """The largest ratio, over ``COST_PROFILES``, of ``fused``'s replay time to the best of
    ``options`` (other fusings of the same schedule) under the same costs."""
    worst = 0.0
    for profile in COST_PROFILES:
        cost = {**profile, "BW": profile["B"] + profile["W"]}
        best = min(replay_time(f, cost) for f in options)
        worst = max(worst, replay_time(fused, cost) / best)
    return worst


def replay_time(fused: FusedSchedule, cost=None) -> float:
    """Step time of ``fused`` as the SPMD runtime runs it, with free transfers: each
    device runs its tick's tasks one after the other, then the two ring transfers
    (to s + 1, then to s − 1), each of which waits for the sending neighbour (the
    simulator's neighbour mode, ``mindpipe_jax.sim``, adds link costs)."""
    cost_of = _cost_fn(cost)
    p = fused.num_stages
    clock = [0.0] * p
    for row in fused.cells:
        ready = [clock[s] + sum(cost_of(s, task) for task in row[s] if task is not None) for s in range(p)]
        for shift in (1, -1):
            ready = [max(ready[s], ready[(s - shift) % p]) for s in range(p)]
        clock = ready
    return max(clock, default=0.0)


def _ready(kind: Kind, mb: int, g: int, last: int, s: int, t: int, part: int, done: dict) -> bool:
    for dep in _inputs(kind, mb, g, last):
        if dep not in done:
            return False
        dep_tick, dep_device, dep_part = done[dep]
        if dep_tick < t:
            continue
        # Same tick: only the last stage's F (a no-op the backward re-runs) feeds its own backward.
        if not (dep_device == s and dep_part < part and dep[0] is Kind.F and dep[2] == last):
            return False
    return True
