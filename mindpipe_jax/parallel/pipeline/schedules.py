"""Pipeline schedules as plain data: a table of who does what in every tick.

A schedule for ``p`` devices (pipeline *stages*), ``m`` microbatches and ``v``
model chunks per device is a table indexed ``[tick][stage]`` whose cells are a
``Task(microbatch, chunk, kind)`` or ``None`` (an idle bubble). The model is cut
into ``p * v`` *global stages*; ``Schedule.placement[stage][chunk]`` names the
global stage a device's chunk holds. The default is Megatron's interleaving:
device ``s`` holds global stages ``s, s + p, s + 2p, ...`` (chunk ``c`` is global
stage ``c * p + s``); a V-shape (ZB-V) or any other layout is one ``placement``
away, and nothing else here assumes the default.

Kinds of task
    ``F``  forward of one chunk for one microbatch (saves residuals).
    ``BW`` fused backward: input gradient *and* weight gradient, in one task. The
           schedules that do not split the backward (GPipe, 1F1B, interleaved) use it.
    ``B``  input gradient only (the critical path); its ``W`` comes later.
    ``W``  weight gradient only, deferred into bubbles (zero-bubble schedules).
    Each (microbatch, global stage) gets exactly one ``F``, then either one ``BW``
    or one ``B`` followed by one ``W``.

Tick model (what the SPMD runtime executes)
    Every task, whatever its kind, occupies exactly one tick on its device, and a
    device runs at most one task per tick. At the end of every tick all devices
    exchange activations and gradients (one ``ppermute``), so a value made in tick
    ``t`` is usable from tick ``t + 1`` on, on any device:

    * ``F`` of (mb, g) needs ``F`` of (mb, g - 1) in an earlier tick (g > 0);
    * ``B``/``BW`` of (mb, g) needs its own ``F`` in an earlier tick and, unless
      ``g`` is the last global stage (where the loss head seeds the gradient),
      ``B``/``BW`` of (mb, g + 1) in an earlier tick;
    * ``W`` of (mb, g) needs ``B`` of (mb, g) in an earlier tick (same device).

Bubble arithmetic
    ``bubble_fraction()`` counts slots: idle cells / (ticks * p). Every task counts
    as one tick, so a fused ``BW`` weighs the same as an ``F``. For GPipe and 1F1B
    that is harmless: their bubble is (p - 1) / (m + p - 1) whatever the F:B cost
    ratio, and the unit-tick count gives exactly that. For other ratios, and for
    schedules whose point is the cost mix (ZB-H1), ``bubble_fraction_weighted(cost)``
    replays the table with per-kind durations. Two replays are offered:

    * as soon as possible (default): each device keeps the table's order, each task
      starts when its device is free and its inputs exist. This is what an
      asynchronous (MPMD-like) executor would reach, and what the papers quote.
    * ``lockstep=True``: every tick lasts as long as its slowest task, which is what
      a tick-synchronous SPMD runtime pays (a tick mixing an ``F`` on one device and a
      ``BW`` on another costs a ``BW``).

Nothing here imports JAX: the tables are checked, measured and drawn with plain
Python, and the runtime only reads them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from mindpipe_jax.errors import ConfigError

__all__ = [
    "Kind", "Task", "Schedule", "ScheduleError", "ScheduleReport", "Timeline",
    "validate", "from_orders", "interleaved_placement", "gpipe", "one_f_one_b", "interleaved", "zb_h1",
    "SCHEDULES", "register_schedule", "get_schedule", "DEFAULT_COST",
]


class ScheduleError(ConfigError):
    """A schedule table that breaks a rule; the message is one line naming the
    tick, stage and task at fault (a ``ValueError``, like every ``ConfigError``)."""


class Kind(StrEnum):
    """What a task computes; compares equal to its one- or two-letter name."""

    F = "F"    # forward
    B = "B"    # input gradient only (weight gradient deferred to a W)
    W = "W"    # weight gradient only
    BW = "BW"  # fused backward: input and weight gradient


BACKWARD_KINDS = frozenset({Kind.B, Kind.BW})

# Relative durations used when none are given: a backward is about twice a
# forward, split evenly between its input and weight halves.
DEFAULT_COST: Mapping[Kind, float] = {Kind.F: 1.0, Kind.B: 1.0, Kind.W: 1.0, Kind.BW: 2.0}

_TOKEN = re.compile(r"^(BW|F|B|W)(\d+)([a-z]?)$")
_IDLE = re.compile(r"^(\.+|-+|_+)$")


@dataclass(frozen=True)
class Task:
    """One unit of work for one device: ``kind`` of ``microbatch`` on its ``chunk``
    (the device's ``chunk``-th model piece, 0 <= chunk < v)."""

    microbatch: int
    chunk: int
    kind: Kind

    def __post_init__(self):
        try:
            object.__setattr__(self, "kind", Kind(self.kind))
        except ValueError:
            raise ScheduleError(f"task kind {self.kind!r} is not one of "
                                f"{', '.join(k.value for k in Kind)}") from None
        for name in ("microbatch", "chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ScheduleError(f"task {name} must be an integer >= 0, got {value!r}")

    def token(self, with_chunk: bool = False) -> str:
        """``F3``, ``BW0``, ... and with the chunk as a letter (a = 0): ``F3b``."""
        suffix = chr(ord("a") + self.chunk) if with_chunk else ""
        return f"{self.kind.value}{self.microbatch}{suffix}"

    def __str__(self) -> str:
        return self.token(with_chunk=self.chunk > 0)

    @classmethod
    def parse(cls, token: str) -> Task | None:
        """The inverse of ``token``: ``"F3"``, ``"B2b"`` (chunk 1); ``".."`` is idle."""
        token = token.strip()
        if _IDLE.match(token):
            return None
        found = _TOKEN.match(token)
        if not found:
            raise ScheduleError(f"cannot read task {token!r}: expected e.g. F3, B3, W3, BW3, "
                                f"F3b (chunk 1) or '..' for idle")
        kind, mb, chunk = found.groups()
        return cls(int(mb), ord(chunk) - ord("a") if chunk else 0, Kind(kind))


@dataclass(frozen=True)
class ScheduleReport:
    """What ``validate`` measured on a correct table."""

    name: str
    ticks: int
    bubble_fraction: float                    # idle slots / all slots (unit ticks)
    peak_live_activations: tuple[int, ...]    # per stage: F done, B/BW not yet
    peak_pending_weight_grads: tuple[int, ...]  # per stage: B done, W not yet


@dataclass(frozen=True)
class Timeline:
    """A replay of a schedule with durations: ``start[tick][stage]`` and
    ``end[tick][stage]`` (``None`` where the table is idle)."""

    start: tuple[tuple[float | None, ...], ...]
    end: tuple[tuple[float | None, ...], ...]
    makespan: float
    busy: tuple[float, ...]   # per stage: the sum of its task durations

    @property
    def bubble_fraction(self) -> float:
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)

    @property
    def utilization(self) -> tuple[float, ...]:
        return tuple(b / self.makespan if self.makespan > 0 else 0.0 for b in self.busy)


Cost = Mapping[str, float] | Callable[[int, Task], float]


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
        _check(self)

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


# ----------------------------------------------------------------- validation
def _normalize_table(table, p: int) -> tuple[tuple[Task | None, ...], ...]:
    if isinstance(table, str | bytes) or not isinstance(table, Sequence):
        raise ScheduleError("a schedule table is a sequence of ticks, each a sequence of per-stage cells")
    rows = []
    for t, row in enumerate(table):
        if isinstance(row, str | bytes) or not isinstance(row, Sequence) or len(row) != p:
            n = len(row) if isinstance(row, Sequence) else type(row).__name__
            raise ScheduleError(f"tick {t}: expected {p} cells (one per stage), got {n}")
        cells = []
        for s, cell in enumerate(row):
            if isinstance(cell, str):
                cell = Task.parse(cell)
            elif isinstance(cell, list | tuple):
                if len(cell) > 1:
                    raise ScheduleError(f"tick {t}, stage {s}: {len(cell)} tasks in one tick "
                                        f"({', '.join(map(str, cell))}); a stage runs one task per tick")
                cell = cell[0] if cell else None
                if isinstance(cell, str):
                    cell = Task.parse(cell)
            if cell is not None and not isinstance(cell, Task):
                raise ScheduleError(f"tick {t}, stage {s}: a cell is a Task or None, got {cell!r}")
            cells.append(cell)
        rows.append(tuple(cells))
    return tuple(rows)


def _inputs(task: Task, g: int, num_global: int) -> list[tuple[Kind, int, int]]:
    """What ``task`` (on global stage ``g``) consumes, as (kind, mb, global stage);
    a backward input is keyed ``B`` and may be met by a ``BW`` too."""
    mb = task.microbatch
    if task.kind is Kind.F:
        return [(Kind.F, mb, g - 1)] if g > 0 else []
    if task.kind is Kind.W:
        return [(Kind.B, mb, g)]
    deps = [(Kind.F, mb, g)]
    if g < num_global - 1:
        deps.append((Kind.B, mb, g + 1))
    return deps


class _Ledger:
    """When each (kind, microbatch, global stage) ran; answers "may this task run
    in this tick?" with the broken rule, or None. Shared by the validator and the
    generators, so a generated table is correct by the same rules that check it."""

    def __init__(self, placement: tuple[tuple[int, ...], ...], num_global: int, with_chunk: bool):
        self.placement = placement
        self.num_global = num_global
        self.with_chunk = with_chunk
        self.f: dict[tuple[int, int], int] = {}
        self.b: dict[tuple[int, int], tuple[int, Kind]] = {}
        self.w: dict[tuple[int, int], int] = {}

    def describe(self, t: int, s: int, task: Task) -> str:
        g = self.placement[s][task.chunk]
        return (f"tick {t}, stage {s}: {task.token(self.with_chunk)} "
                f"(microbatch {task.microbatch}, global stage {g})")

    def duplicate(self, s: int, task: Task) -> str | None:
        key = (task.microbatch, self.placement[s][task.chunk])
        if task.kind is Kind.F and key in self.f:
            return f"repeats the F already run at tick {self.f[key]}"
        if task.kind in BACKWARD_KINDS and key in self.b:
            tick, kind = self.b[key]
            return f"repeats the backward already run as {kind.value} at tick {tick}"
        if task.kind is Kind.W and key in self.w:
            return f"repeats the W already run at tick {self.w[key]}"
        return None

    def blocker(self, t: int, s: int, task: Task) -> str | None:
        mb, g = task.microbatch, self.placement[s][task.chunk]
        if task.kind is Kind.F:
            if g == 0:
                return None
            return self._after(self.f.get((mb, g - 1)), t, f"the activation from F of global stage {g - 1}")
        if task.kind is Kind.W:
            done = self.b.get((mb, g))
            if done is None:
                return "runs before its B"
            if done[1] is Kind.BW:
                return f"has no deferred weight gradient: BW at tick {done[0]} already computed it"
            return self._after(done[0], t, "its B")
        problem = self._after(self.f.get((mb, g)), t, "its own F", before="runs before its F")
        if problem or g == self.num_global - 1:
            return problem
        done = self.b.get((mb, g + 1))
        return self._after(None if done is None else done[0], t,
                           f"the gradient from the backward of global stage {g + 1}")

    @staticmethod
    def _after(tick: int | None, t: int, what: str, before: str | None = None) -> str | None:
        if tick is None:
            return before or f"needs {what}, which has not run"
        if tick >= t:
            return f"needs {what}, made in tick {tick} and usable from tick {tick + 1}"
        return None

    def record(self, t: int, s: int, task: Task) -> None:
        key = (task.microbatch, self.placement[s][task.chunk])
        if task.kind is Kind.F:
            self.f[key] = t
        elif task.kind is Kind.W:
            self.w[key] = t
        else:
            self.b[key] = (t, task.kind)

    def missing(self, m: int) -> str | None:
        for mb in range(m):
            for g in range(self.num_global):
                key = (mb, g)
                where = f"microbatch {mb}, global stage {g}"
                if key not in self.f:
                    return f"{where}: no F"
                if key not in self.b:
                    return f"{where}: no backward (B or BW)"
                tick, kind = self.b[key]
                if kind is Kind.B and key not in self.w:
                    return f"{where}: B at tick {tick} but no W, so the weight gradient is never computed"
        return None


def _check(schedule: Schedule) -> None:
    p, m, v = schedule.num_stages, schedule.num_microbatches, schedule.virtual_stages
    ledger = _Ledger(schedule.placement, p * v, v > 1)
    for t, row in enumerate(schedule.table):
        for s, task in enumerate(row):
            if task is None:
                continue
            if task.chunk >= v:
                raise ScheduleError(f"tick {t}, stage {s}: {task} uses chunk {task.chunk}, "
                                    f"but each stage holds {v} chunk(s)")
            if task.microbatch >= m:
                raise ScheduleError(f"tick {t}, stage {s}: {task} uses microbatch {task.microbatch}, "
                                    f"but there are {m}")
            problem = ledger.duplicate(s, task)
            if problem:
                raise ScheduleError(f"{ledger.describe(t, s, task)} {problem}")
            ledger.record(t, s, task)
        # Dependencies after the whole tick is recorded, so that using a value made
        # in the same tick is reported as such rather than as "not run".
        for s, task in enumerate(row):
            problem = task and ledger.blocker(t, s, task)
            if problem:
                raise ScheduleError(f"{ledger.describe(t, s, task)} {problem}")
    problem = ledger.missing(m)
    if problem:
        raise ScheduleError(f"{schedule.name}: {problem}")


def validate(schedule: Schedule) -> ScheduleReport:
    """Check every rule (raising ``ScheduleError`` with the tick, stage and task
    at fault) and report ticks, bubble and peak live activations per stage."""
    _check(schedule)
    return schedule.report()


def _cost_fn(cost: Cost | None) -> Callable[[int, Task], float]:
    if callable(cost):
        return cost
    table = {Kind(k): float(c) for k, c in (cost or {}).items()}
    if Kind.BW not in table and Kind.B in table and Kind.W in table:
        table[Kind.BW] = table[Kind.B] + table[Kind.W]
    for kind, c in DEFAULT_COST.items():
        table.setdefault(kind, c)
    return lambda stage, task: table[task.kind]


# ----------------------------------------------------------------- generators
def interleaved_placement(p: int, v: int) -> tuple[tuple[int, ...], ...]:
    """Megatron's layout: chunk ``c`` of device ``s`` is global stage ``c * p + s``."""
    return tuple(tuple(c * p + s for c in range(v)) for s in range(p))


def from_orders(orders: Sequence[Sequence[Task]], *, num_microbatches: int, virtual_stages: int = 1,
                placement: Sequence[Sequence[int]] | None = None, name: str = "custom") -> Schedule:
    """A schedule from each device's ordered task list (``orders[stage]``): tick by
    tick, a device runs its next task as soon as the rules allow and idles
    otherwise. The table is therefore correct by construction (and validated again
    by ``Schedule``). New schedules (ZB-V, ...) need only their per-device orders
    and, for a layout other than Megatron's, a placement."""
    p, m, v = len(orders), num_microbatches, virtual_stages
    _check_sizes(p, m, v)
    placement = interleaved_placement(p, v) if placement is None else tuple(map(tuple, placement))
    ledger = _Ledger(placement, p * v, v > 1)
    pos = [0] * p
    left = sum(map(len, orders))
    rows = []
    while left:
        t = len(rows)
        row: list[Task | None] = [None] * p
        for s in range(p):
            if pos[s] < len(orders[s]) and ledger.blocker(t, s, orders[s][pos[s]]) is None:
                row[s] = orders[s][pos[s]]
        if not any(row):
            stuck = ", ".join(f"stage {s}: {orders[s][pos[s]]}" for s in range(p) if pos[s] < len(orders[s]))
            raise ScheduleError(f"{name}: the task orders deadlock at tick {t} (next: {stuck})")
        for s, task in enumerate(row):
            if task is not None:
                ledger.record(t, s, task)
                pos[s] += 1
                left -= 1
        rows.append(tuple(row))
    return Schedule(name, p, m, v, tuple(rows), placement)


def _check_sizes(p: int, m: int, v: int = 1) -> None:
    for label, value in (("stages (p)", p), ("microbatches (m)", m), ("virtual stages (v)", v)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"pipeline {label} must be an integer >= 1, got {value!r}")


def gpipe(p: int, m: int) -> Schedule:
    """All forwards, then all fused backwards in reverse microbatch order (the
    order autodiff through a scan produces). Ticks: 2(m + p - 1); live
    activations: m on every stage."""
    _check_sizes(p, m)
    orders = [[Task(i, 0, Kind.F) for i in range(m)] + [Task(i, 0, Kind.BW) for i in reversed(range(m))]
              for _ in range(p)]
    return from_orders(orders, num_microbatches=m, virtual_stages=1, name="gpipe")


def one_f_one_b(p: int, m: int) -> Schedule:
    """PipeDream-flush: stage s runs p - s - 1 warm-up forwards, then alternates one
    forward and one backward, then drains the backwards. In step x it runs F of
    microbatch x and BW of microbatch x - (p - 1 - s), when those exist.
    Ticks: 2(m + p - 1); live activations: min(p - s, m) on stage s."""
    _check_sizes(p, m)
    orders = []
    for s in range(p):
        lag, order = p - 1 - s, []
        for x in range(m + lag):
            if x < m:
                order.append(Task(x, 0, Kind.F))
            if x >= lag:
                order.append(Task(x - lag, 0, Kind.BW))
        orders.append(order)
    return from_orders(orders, num_microbatches=m, virtual_stages=1, name="1f1b")


def interleaved(p: int, m: int, v: int = 2, *, warmup: str = "megatron") -> Schedule:
    """Megatron's interleaved 1F1B: each device holds v chunks (global stages
    s, s + p, ...). Microbatches go through in groups of p: a device runs the
    group's forwards on chunk 0, then chunk 1, ..., and the backwards on the chunks
    in reverse. After the warm-up forwards, one forward and one backward alternate.
    Needs m divisible by p. Ticks: 2(v m + p - 1), i.e. a bubble of exactly
    (p - 1) / (v m + p - 1), with either warm-up:

    * ``"megatron"``: 2(p - s - 1) + (v - 1) p warm-up forwards, as Megatron-LM does.
      The extra p - s - 1 forwards are slack that absorbs transfer latency in an
      asynchronous executor; peak live activations on stage 0: v p + p - 1.
    * ``"minimal"``: (p - s - 1) + (v - 1) p. Same tick count in this tick model and
      p - 1 fewer live activations on stage 0 (v p), but an ASAP replay with a
      transfer latency shows more bubble than Megatron's."""
    _check_sizes(p, m, v)
    if warmup not in ("megatron", "minimal"):
        raise ScheduleError(f"interleaved warmup must be 'megatron' or 'minimal', got {warmup!r}")
    if m % p:
        raise ScheduleError(f"interleaved schedule needs the microbatch count divisible by the "
                            f"stage count: m={m}, p={p} (try m={m + p - m % p})")
    total = m * v

    def unit(k: int, backward: bool) -> Task:
        group, within = divmod(k, p * v)
        chunk = within // p
        return Task(group * p + within % p, v - 1 - chunk if backward else chunk,
                    Kind.BW if backward else Kind.F)

    orders = []
    for s in range(p):
        lead = (2 if warmup == "megatron" else 1) * (p - s - 1) + (v - 1) * p
        lead = min(lead, total)
        order = [unit(k, False) for k in range(lead)]
        for k in range(total - lead):
            order += [unit(lead + k, False), unit(k, True)]
        order += [unit(k, True) for k in range(total - lead, total)]
        orders.append(order)
    return from_orders(orders, num_microbatches=m, virtual_stages=v, name="interleaved")


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): the backward is
    split into B (input gradient, on the critical path) and W (weight gradient,
    deferred). In step x stage s runs F of microbatch x, B of x - (p - 1 - s) and
    W of x - (p - 1), when those exist: the F/B pattern (and hence the live
    activations, min(p - s, m)) is 1F1B's, while the W's trail behind and fill
    the drain at the end. Ticks (one per task): 3m + p - 1 for m >= p, so with
    F = B = W in cost the bubble is (p - 1) / (3m + p - 1), about a third of
    1F1B's. Peak pending W's on stage s: s + 1. (For m < p the dependency chain,
    not the order, sets the length: 2(m + p - 1) + 1 ticks.)"""
    _check_sizes(p, m)
    orders = []
    for s in range(p):
        lag_b, lag_w, order = p - 1 - s, p - 1, []
        for x in range(m + lag_w):
            if x < m:
                order.append(Task(x, 0, Kind.F))
            if 0 <= x - lag_b < m:
                order.append(Task(x - lag_b, 0, Kind.B))
            if x >= lag_w:
                order.append(Task(x - lag_w, 0, Kind.W))
        orders.append(order)
    return from_orders(orders, num_microbatches=m, virtual_stages=1, name="zb-h1")


# ------------------------------------------------------------------- registry
Generator = Callable[[int, int, int], Schedule]


def _flat(fn: Callable[[int, int], Schedule], name: str) -> Generator:
    def make(p: int, m: int, v: int = 1) -> Schedule:
        if v != 1:
            raise ScheduleError(f"schedule {name!r} has one chunk per stage (virtual_stages=1), got {v}; "
                                f"use 'interleaved' for v > 1")
        return fn(p, m)
    make.__doc__ = fn.__doc__
    return make


# name -> generator(p, m, v). Open: add entries here or via register_schedule.
SCHEDULES: dict[str, Generator] = {
    "gpipe": _flat(gpipe, "gpipe"),
    "1f1b": _flat(one_f_one_b, "1f1b"),
    "interleaved": interleaved,
    "zb-h1": _flat(zb_h1, "zb-h1"),
}


def register_schedule(name: str, generator: Generator) -> None:
    """Make ``get_schedule(name, p, m, v)`` call ``generator(p, m, v)``."""
    SCHEDULES[name] = generator


def get_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The named schedule for p stages, m microbatches and v chunks per stage."""
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown pipeline schedule {name!r}; valid: {', '.join(sorted(SCHEDULES))}")
    return SCHEDULES[name](p, m, v)
