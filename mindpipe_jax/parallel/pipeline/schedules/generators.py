"""Schedule generators (GPipe, 1F1B, interleaved 1F1B, ZB-H1, AFAPAB), ``from_orders`` for
new ones, and the name -> generator registry (the V schedules, ZB-V and DualPipeV,
live in ``vshape.py`` and register themselves).

Each generator gives every device its ordered task list; ``from_orders`` packs
the lists into ticks by the same rules the validator checks. Pure Python.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mindpipe_jax.parallel.pipeline.schedules.checks import _Ledger, interleaved_placement
from mindpipe_jax.parallel.pipeline.schedules.table import Schedule
from mindpipe_jax.parallel.pipeline.schedules.types import Kind, ScheduleError, Task


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


def afapab(p: int, m: int, v: int = 2) -> Schedule:
    """AFAPAB (All-Forward, All-Parallel, All-Backward; Fold3D, TPDS 2023): the model is
    cut into ``p * v`` chunks placed round-robin (global stage ``c * p + s`` on device
    ``s``); every device runs the forwards of all microbatches chunk by chunk
    (chunk 0 first), then all the backwards chunk by chunk in reverse (chunk
    ``v - 1`` first, microbatches in reverse). A chunk's last backward therefore
    comes ``(v - 1 - c)`` chunk-rounds before the end of the step, and the
    data-parallel gradient sync of that chunk can run behind the backwards still
    to come (``sync.sync_points``). Live activations: every microbatch of every
    chunk (``v m`` on a device), as in GPipe; pair it with stage remat.
    Ticks: ``2(v m + p - 1)`` when ``m >= p``."""
    _check_sizes(p, m, v)
    forwards = [Task(i, c, Kind.F) for c in range(v) for i in range(m)]
    backwards = [Task(i, c, Kind.BW) for c in reversed(range(v)) for i in reversed(range(m))]
    return from_orders([forwards + backwards for _ in range(p)], num_microbatches=m, virtual_stages=v,
                       name="afapab")


def split_only_last(schedule: Schedule, k: int) -> Schedule:
    """``schedule`` with only the last ``k`` microbatches' backwards split into B and W.

    A zero-bubble table splits every backward so that its W's can wait, but only the W's
    of the last microbatches fill a bubble (the drain, where the input-gradient chain
    runs ahead); in the steady state a W runs soon after its B anyway. Where the split
    halves cost more than the fused vjp (``benchmarks/split_cost.py``: timed as separate
    programs on this CPU, 1.1-1.3x at equal FLOPs; inside the 2-process tick loop, no
    more), splitting only the tail keeps the drain filled and the steady state at the
    fused cost. Each earlier microbatch's B becomes a BW in its place and its W is
    dropped; every device keeps its order and the table is packed again (``from_orders``).
    ``k >= m`` gives the table unchanged; ``k = 0`` splits nothing (ZB-H1 becomes 1F1B).
    A table without a split (1F1B, GPipe, interleaved, AFAPAB) is refused: ``k`` would
    change nothing, and a plan printing it would hand ``mindpipe train`` a key it refuses."""
    m = schedule.num_microbatches
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ScheduleError(f"split_last must be an integer >= 0 (how many of the last microbatches split "
                            f"their backward into B and W), got {k!r}")
    if not schedule.has_split():
        raise ScheduleError(f"split_last={k}: schedule {schedule.name!r} does not split its backwards into "
                            f"B and W, so there is nothing to keep split; it applies to the zero-bubble "
                            f"schedules (zb-h1, zbv, dualpipev)")
    if k >= m:
        return schedule
    orders: list[list[Task]] = [[] for _ in range(schedule.num_stages)]
    for row in schedule.table:
        for s, task in enumerate(row):
            if task is None:
                continue
            if task.microbatch < m - k and task.kind is Kind.W:
                continue
            if task.microbatch < m - k and task.kind is Kind.B:
                task = Task(task.microbatch, task.chunk, Kind.BW)
            orders[s].append(task)
    return from_orders(orders, num_microbatches=m, virtual_stages=schedule.virtual_stages,
                       placement=schedule.placement, name=schedule.name)


# ------------------------------------------------------------------- registry
# p x v x m above which get_schedule refuses: a 1F1B table at p=256, m=1024 takes ~15 s
# to build and check on one core, p=512, m=4096 over two minutes and 3 GB.
MAX_STAGE_MICROBATCHES = 2**18

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
    "afapab": afapab,
}


def register_schedule(name: str, generator: Generator) -> None:
    """Make ``get_schedule(name, p, m, v)`` call ``generator(p, m, v)``."""
    SCHEDULES[name] = generator


def get_schedule(name: str, p: int, m: int, v: int | None = None, split_last: int | None = None) -> Schedule:
    """The named schedule for p stages, m microbatches and v chunks per stage;
    ``v=None``: 1, or the fixed chunk count of a schedule that has one (a generator
    with a ``virtual_stages`` attribute: 2 for the V schedules). ``split_last``: split
    only the last that many microbatches' backwards (``split_only_last``); None or -1
    (``parallel.split_last``'s default): as the generator makes it."""
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown pipeline schedule {name!r}; valid: {', '.join(sorted(SCHEDULES))}")
    generator = SCHEDULES[name]
    v = getattr(generator, "virtual_stages", 1) if v is None else v
    if p * v * m > MAX_STAGE_MICROBATCHES:
        raise ScheduleError(f"schedule {name!r} with p={p} x v={v} x m={m} = {p * v * m:,} "
                            f"stage-microbatches is more than a table is built for (at most "
                            f"{MAX_STAGE_MICROBATCHES:,}: its tasks are built and checked one by one in "
                            f"Python, minutes beyond that); use fewer microbatches or stages")
    schedule = generator(p, m, v)
    return schedule if split_last in (None, -1) else split_only_last(schedule, split_last)
