"""``Schedule``: a validated table ``[tick][stage] -> Task | None`` with its geometry,
bubble and memory figures, replays with durations (``timeline``) and ASCII drawing.

Pure Python, no JAX. The tick model and the bubble arithmetic are described in
``schedules.py``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from mindpipe_jax.parallel.pipeline.schedules.checks import (
    _inputs,
    _normalize_table,
    check_table,
    interleaved_placement,
)
from mindpipe_jax.parallel.pipeline.schedules.types import (
    BACKWARD_KINDS,
    Cost,
    Kind,
    ScheduleError,
    ScheduleReport,
    Task,
    Timeline,
    _cost_fn,
)


@dataclass(frozen=True)
class Schedule:
    """A validated table ``[tick][stage] -> Task | None``.

    Constructing one checks every rule (see the module docstring) and raises
    ``ScheduleError`` naming the first broken one, so a ``Schedule`` in hand is
    always executable. Cells may also be given as tokens (``"F3"``, ``"B0b"``,
    ``".."``) and rows as lists; they are stored as tuples of ``Task``/``None``.
    """

    name: str
    num_stages: int          # p: devices along the pipe axis
    num_microbatches: int    # m
    virtual_stages: int      # v: model chunks per device
    table: tuple[tuple[Task | None, ...], ...]
    # placement[stage][chunk] = global model stage; None = interleaved (c * p + s).
    placement: tuple[tuple[int, ...], ...] | None = field(default=None)

    def __post_init__(self):
        for name in ("num_stages", "num_microbatches", "virtual_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ScheduleError(f"{name} must be an integer >= 1, got {value!r}")
        p, v = self.num_stages, self.virtual_stages
        if self.placement is None:
            placement = interleaved_placement(p, v)
        else:
            placement = tuple(tuple(row) for row in self.placement)
            if len(placement) != p or any(len(row) != v for row in placement):
                raise ScheduleError(f"placement must be {p} rows (stages) of {v} global stages (chunks)")
            flat = sorted(g for row in placement for g in row)
            if flat != list(range(p * v)):
                raise ScheduleError(f"placement must hold each global stage 0..{p * v - 1} exactly "
                                    f"once, got {placement}")
        object.__setattr__(self, "placement", placement)
        object.__setattr__(self, "table", _normalize_table(self.table, p))
        self._check()

    def _check(self) -> None:
        check_table(self.name, self.table, self.placement, self.num_stages, self.num_microbatches,
                    self.virtual_stages)

    # ----------------------------------------------------------- construction
    @classmethod
    def from_table(cls, table: Sequence[Sequence[object]], *, name: str = "custom",
                   num_microbatches: int | None = None, virtual_stages: int | None = None,
                   placement: Sequence[Sequence[int]] | None = None) -> Schedule:
        """A schedule from a user table ``[tick][stage]`` of ``Task``, ``None``,
        tokens (``"F3"``, ``".."``) or one-element lists; ``m`` and ``v`` default to
        what the table uses. Validated like every generated schedule."""
        rows = [list(row) for row in table]
        if not rows:
            raise ScheduleError("a schedule table needs at least one tick")
        p = len(rows[0])
        cells = _normalize_table(rows, p)
        tasks = [task for row in cells for task in row if task is not None]
        m = num_microbatches or 1 + max((t.microbatch for t in tasks), default=0)
        if virtual_stages is None:
            virtual_stages = len(placement[0]) if placement else 1 + max((t.chunk for t in tasks), default=0)
        return cls(name, p, m, virtual_stages, cells,
                   None if placement is None else tuple(tuple(r) for r in placement))

    @classmethod
    def from_tasks(cls, events: Iterable[tuple[int, int, int, int, str]], *, num_stages: int,
                   num_microbatches: int, virtual_stages: int = 1, name: str = "custom",
                   placement: Sequence[Sequence[int]] | None = None) -> Schedule:
        """A schedule from a list of ``(tick, stage, microbatch, global_stage, kind)``,
        the form a solver or a hand-written plan most often produces. The device
        must hold ``global_stage`` under ``placement``; two tasks in one
        (tick, stage) slot are refused."""
        p, v = num_stages, virtual_stages
        if placement is None:
            placement = interleaved_placement(p, v)
        chunk_of = {(s, g): c for s, row in enumerate(placement) for c, g in enumerate(row)}
        events = list(events)
        ticks = 1 + max((e[0] for e in events), default=0)
        cells: list[list[Task | None]] = [[None] * p for _ in range(ticks)]
        for tick, stage, mb, g, kind in events:
            if not 0 <= stage < p or tick < 0:
                raise ScheduleError(f"tick {tick}, stage {stage}: no such slot (stages are 0..{p - 1})")
            if (stage, g) not in chunk_of:
                owner = next((s for (s, gg) in chunk_of if gg == g), None)
                where = f"it lives on stage {owner}" if owner is not None else "no such global stage"
                raise ScheduleError(f"tick {tick}, stage {stage}: {kind}{mb} of global stage {g} is on "
                                    f"the wrong device ({where})")
            task = Task(mb, chunk_of[(stage, g)], kind)
            if cells[tick][stage] is not None:
                raise ScheduleError(f"tick {tick}, stage {stage}: two tasks in one tick "
                                    f"({cells[tick][stage]} and {task}); a stage runs one task per tick")
            cells[tick][stage] = task
        return cls(name, p, num_microbatches, v, tuple(tuple(r) for r in cells),
                   tuple(tuple(r) for r in placement))

    @classmethod
    def parse(cls, text: str, **kwargs) -> Schedule:
        """Read a timeline drawn by ``render`` (rows = stages, columns = ticks; an
        optional ``s0:`` label per row; lines starting with ``#`` are ignored).
        Keyword arguments go to ``from_table``."""
        rows = []
        for line in text.strip().splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            tokens = line.split()
            if re.fullmatch(r"s\d+:?", tokens[0]):
                tokens = tokens[1:]
            rows.append(tokens)
        if not rows or len({len(r) for r in rows}) != 1:
            raise ScheduleError(f"every stage row needs the same number of ticks, "
                                f"got {[len(r) for r in rows]}")
        return cls.from_table([list(col) for col in zip(*rows, strict=True)], **kwargs)

    # -------------------------------------------------------------- geometry
    @property
    def num_ticks(self) -> int:
        return len(self.table)

    @property
    def num_global_stages(self) -> int:
        return self.num_stages * self.virtual_stages

    def global_stage(self, stage: int, chunk: int) -> int:
        """The model stage that ``chunk`` on device ``stage`` holds."""
        return self.placement[stage][chunk]

    def owner(self, global_stage: int) -> tuple[int, int]:
        """``(stage, chunk)`` holding ``global_stage``."""
        for s, row in enumerate(self.placement):
            for c, g in enumerate(row):
                if g == global_stage:
                    return s, c
        raise ScheduleError(f"no global stage {global_stage} (there are {self.num_global_stages})")

    def tasks_of(self, stage: int) -> list[tuple[int, Task]]:
        """``(tick, task)`` for every task of one device, in tick order."""
        return [(t, row[stage]) for t, row in enumerate(self.table) if row[stage] is not None]

    def has_split(self) -> bool:
        """Whether any backward is split into B and W (zero-bubble tables), not fused (BW)."""
        return any(task is not None and task.kind is Kind.W for row in self.table for task in row)

    # --------------------------------------------------------------- figures
    def bubble_fraction(self) -> float:
        """Idle slots / (ticks * p), every task counting one tick."""
        idle = sum(task is None for row in self.table for task in row)
        return idle / (self.num_ticks * self.num_stages)

    def timeline(self, cost: Cost | None = None, *, transfer: float = 0.0,
                 lockstep: bool = False) -> Timeline:
        """Replay the table with task durations.

        ``cost`` is a mapping kind -> duration (missing kinds from ``DEFAULT_COST``;
        a missing ``BW`` is ``B + W`` when both are given) or a function
        ``(stage, task) -> duration`` for per-stage costs. ``transfer`` is added to
        every hand-off between different devices. Default replay: as soon as
        possible, each device in table order. ``lockstep=True``: tick ``t`` starts
        when the slowest task of tick ``t - 1`` (plus ``transfer``) is done."""
        dur = _cost_fn(cost)
        p, ticks = self.num_stages, self.num_ticks
        start = [[None] * p for _ in range(ticks)]
        end = [[None] * p for _ in range(ticks)]
        busy = [0.0] * p
        if lockstep:
            clock = 0.0
            for t, row in enumerate(self.table):
                longest = 0.0
                for s, task in enumerate(row):
                    if task is not None:
                        d = dur(s, task)
                        start[t][s], end[t][s] = clock, clock + d
                        busy[s] += d
                        longest = max(longest, d)
                clock += longest + (transfer if t < ticks - 1 else 0.0)
            makespan = clock
        else:
            done: dict[tuple[Kind, int, int], tuple[float, int]] = {}   # (kind, mb, g) -> (end, stage)
            free = [0.0] * p
            for t, row in enumerate(self.table):
                for s, task in enumerate(row):
                    if task is None:
                        continue
                    ready = free[s]
                    for key in _inputs(task, self.global_stage(s, task.chunk), self.num_global_stages):
                        finish, where = done[key] if key in done else done[(Kind.BW,) + key[1:]]
                        ready = max(ready, finish + (transfer if where != s else 0.0))
                    d = dur(s, task)
                    start[t][s], end[t][s] = ready, ready + d
                    free[s] = ready + d
                    busy[s] += d
                    done[(task.kind, task.microbatch, self.global_stage(s, task.chunk))] = (ready + d, s)
            makespan = max(free, default=0.0)
        return Timeline(tuple(map(tuple, start)), tuple(map(tuple, end)), makespan, tuple(busy))

    def bubble_fraction_weighted(self, cost: Cost | None = None, *, transfer: float = 0.0,
                                 lockstep: bool = False) -> float:
        """1 - busy / (p * makespan) of ``timeline(cost, ...)``."""
        return self.timeline(cost, transfer=transfer, lockstep=lockstep).bubble_fraction

    def _peaks(self, up: frozenset, down: frozenset) -> list[int]:
        peaks = []
        for s in range(self.num_stages):
            level = peak = 0
            for _, task in self.tasks_of(s):
                level += (task.kind in up) - (task.kind in down)
                peak = max(peak, level)
            peaks.append(peak)
        return peaks

    def peak_live_activations(self) -> list[int]:
        """Per stage: the most (microbatch, chunk) pairs whose F has run and whose
        B/BW has not, i.e. the residual slots the runtime must hold."""
        return self._peaks(frozenset({Kind.F}), BACKWARD_KINDS)

    def peak_pending_weight_grads(self) -> list[int]:
        """Per stage: the most pairs whose B has run and whose W has not (the inputs
        and output gradients a deferred W needs); 0 without a B/W split."""
        return self._peaks(frozenset({Kind.B}), frozenset({Kind.W}))

    def peak_in_flight(self) -> list[int]:
        """Per stage: the most pairs started (F) and not finished (BW or W): the
        slot count if a runtime keeps each microbatch's residuals until its W."""
        return self._peaks(frozenset({Kind.F}), frozenset({Kind.BW, Kind.W}))

    def report(self) -> ScheduleReport:
        return ScheduleReport(self.name, self.num_ticks, self.bubble_fraction(),
                              tuple(self.peak_live_activations()), tuple(self.peak_pending_weight_grads()))

    # --------------------------------------------------------------- drawing
    def render(self, header: bool = True) -> str:
        """An ASCII timeline: one row per stage, one column per tick; ``F3`` is the
        forward of microbatch 3, ``..`` an idle tick, and with v > 1 a letter names
        the chunk (``F3a`` chunk 0, ``F3b`` chunk 1). ``Schedule.parse`` reads it back."""
        with_chunk = self.virtual_stages > 1
        cells = [[".." if task is None else task.token(with_chunk) for task in row] for row in self.table]
        width = max((len(c) for row in cells for c in row), default=2)
        label = len(f"s{self.num_stages - 1}:")
        lines = []
        if header:
            lines.append(f"# {self.name}: p={self.num_stages} m={self.num_microbatches} "
                         f"v={self.virtual_stages}, {self.num_ticks} ticks, "
                         f"bubble {self.bubble_fraction():.1%}")
        for s in range(self.num_stages):
            row = " ".join(cells[t][s].ljust(width) for t in range(self.num_ticks))
            lines.append(f"{f's{s}:'.ljust(label)} {row}".rstrip())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render()


def validate(schedule: Schedule) -> ScheduleReport:
    """Check every rule (raising ``ScheduleError`` with the tick, stage and task
    at fault) and report ticks, bubble and peak live activations per stage."""
    schedule._check()
    return schedule.report()

