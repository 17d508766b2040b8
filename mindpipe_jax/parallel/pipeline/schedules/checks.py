"""The rules every schedule table obeys, checked tick by tick.

``_Ledger`` records when each (kind, microbatch, global stage) ran and answers
"may this task run in this tick?"; the validator (``check_table``) and the generators
(``from_orders``) share it, so a generated table is correct by the rules that
check it. Also the default placement (Megatron's interleaving). Pure Python.
"""

from __future__ import annotations

from collections.abc import Sequence

from mindpipe_jax.parallel.pipeline.schedules.types import BACKWARD_KINDS, Kind, ScheduleError, Task


def interleaved_placement(p: int, v: int) -> tuple[tuple[int, ...], ...]:
    """Megatron's layout: chunk ``c`` of device ``s`` is global stage ``c * p + s``."""
    return tuple(tuple(c * p + s for c in range(v)) for s in range(p))


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


def check_table(name: str, table, placement, p: int, m: int, v: int) -> None:
    """Raise ``ScheduleError`` naming the first tick and stage that breaks a rule
    (the raw fields of a ``Schedule``, so this module need not import it)."""
    ledger = _Ledger(placement, p * v, v > 1)
    for t, row in enumerate(table):
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
        raise ScheduleError(f"{name}: {problem}")

