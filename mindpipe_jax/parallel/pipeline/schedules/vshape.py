"""V-shaped schedules: ZB-V and DualPipeV, two model chunks per device.

The model is cut into ``2p`` global stages and device ``s`` holds stages ``s``
(chunk ``a``, going down the devices) and ``2p - 1 - s`` (chunk ``b``, coming back
up): ``v_placement(p)``. A microbatch's forward visits devices 0, 1, ..., p - 1,
p - 1, ..., 1, 0, so the first stage and the loss both live on device 0, the turn
of the V (stage ``p - 1`` to ``p``) stays on device ``p - 1``, and chunk ``b``'s
activations travel from device ``s`` to ``s - 1``, the other way round the ring.

ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", the V schedule). Device ``s``
runs, with B (input gradient) and W (weight gradient) split:

1. ``2(p - s) - 1`` forwards of chunk a;
2. ``s`` times: F of chunk b, F of chunk a;
3. ``p - s`` times: F, B, W of chunk b;
4. the steady state, one F, B and W of each chunk per microbatch:
   F a, B a, W a, F b, B b, W b (the F a is left out once every microbatch has
   had it);
5. ``s`` times B a, B b; then ``p - s`` times B a, W a; then the W's still owed,
   chunk b's first.

Every task is one tick, so ticks = max(6m + p - 1, 4m + 4p - 2): for
m >= (3p - 1) / 2 each device idles exactly p - 1 ticks (s before its first task,
p - 1 - s after its last), the fill of the first microbatch that no schedule
avoids; nothing else. Peak live activations (F done, B not): min(2m, 2p) chunks,
i.e. min(m, p) microbatches of a full stage, 1F1B's. With durations F <= B <= 2W,
W <= B and m >= 2p - 1 the replay lasts (p - 1) B + 2m (F + B + W) (device p - 1
waits (p - 1)(B - F) for its first gradient, then never idles); with
W + 2B >= 2F and W + 2F >= 2B the steady state (step 4) runs without a gap on
every device. ``analytic.py`` has the figures; the tests check them.

DualPipeV (DeepSeek-V3's DualPipe cut in half, the "cut-in-half" schedule in the
DualPipe repository). DualPipe overlaps the forward of one chunk with the backward
of the other ("F&B"). A cell here holds one task, so an F&B is two entries in a
row of a device's order: the F, then the fused backward (BW) of the other chunk.
``from_orders`` packs them like any two tasks: the F runs once its input is there
and the BW follows once its gradient is, in the next tick unless the gradient is
late. Nothing overlaps: a pair costs F + BW. Device ``s`` runs:

1. ``2(p - s - 1)`` F a; then ``s + 1`` times F a, F b;
2. ``p - s - 1`` times B b, W b, F b (backward split, W right away);
3. ``m - 2p + s + 1`` times the two F&B's (F a & BW b), (F b & BW a);
4. ``p - s - 1`` times BW b, then (F b & BW a);
5. ``s + 1`` times a backward of b, then of a; the last ``s + 1`` of these are
   split, their W's deferred (oldest first);
6. ``p - s - 1`` times a deferred W, then B a (split, W deferred); then the
   ``s + 1`` deferred W's left.

It needs m >= 2p (the steady state has ``m - 2p + s + 1 >= 1`` rounds on device 0).
``fb_pairs`` finds the F&B pairs in a table and ``fb_pair_timeline`` replays it
with each pair run as one unit, as DualPipe runs it: the pair starts once both its
inputs are there. With F <= B and W <= B that replay gives exactly the
repository's bubble, (PP/2 - 1)(F&B + B - 3W) per device with PP = 2p stages, B
its full backward (our BW) and F&B = F + BW; the table, whose cells run one by one
(as the simulator and a runtime run them), does better: with F = B = W each device
idles (p - 1) F instead of 2 (p - 1) F. In tick units (every cell one tick, a BW
too) the repository's terms would read F&B = 2, B = W = 1 and its formula 0, but a
tick charges a split backward (B, W) two ticks and a fused one one, where the
formula takes B + W = BW: the table has 4m + 2p - 1 ticks, device s idle s of them.
See ``analytic.py``.

Pure Python; no JAX. Both generators register themselves (``"zbv"``,
``"dualpipev"``); their chunk count is fixed at 2.
"""

from __future__ import annotations

from collections import deque

from mindpipe_jax.parallel.pipeline.schedules.checks import _inputs
from mindpipe_jax.parallel.pipeline.schedules.generators import _check_sizes, from_orders, register_schedule
from mindpipe_jax.parallel.pipeline.schedules.table import Schedule
from mindpipe_jax.parallel.pipeline.schedules.types import Cost, Kind, ScheduleError, Task, Timeline, _cost_fn

A, B_ = 0, 1   # chunk a (global stage s) and chunk b (global stage 2p - 1 - s)


def v_placement(p: int) -> tuple[tuple[int, int], ...]:
    """Device ``s`` holds global stages ``s`` (chunk 0) and ``2p - 1 - s`` (chunk 1)."""
    return tuple((s, 2 * p - 1 - s) for s in range(p))


class _Order:
    """One device's task list, with a per-(kind, chunk) microbatch counter."""

    def __init__(self, m: int):
        self.m = m
        self.tasks: list[Task] = []
        self.next: dict[tuple[Kind, int], int] = {}
        self.deferred: deque[Task] = deque()

    def add(self, kind: Kind, chunk: int) -> int:
        key = (Kind.B if kind is Kind.BW else kind, chunk)   # a chunk's backwards, fused or not, in turn
        mb = self.next.get(key, 0)
        self.next[key] = mb + 1
        if mb < self.m:                 # ZB-V runs its phases for max(m, 2p - 1) microbatches
            self.tasks.append(Task(mb, chunk, kind))
        return mb

    def count(self, kind: Kind, chunk: int) -> int:
        return self.next.get((kind, chunk), 0)

    def backward(self, chunk: int, split: bool) -> None:
        """A fused BW, or a B whose W waits in ``deferred``."""
        if not split:
            self.add(Kind.BW, chunk)
            return
        mb = self.add(Kind.B, chunk)
        self.deferred.append(Task(mb, chunk, Kind.W))

    def deferred_w(self) -> None:
        self.tasks.append(self.deferred.popleft())


def zbv_orders(p: int, m: int) -> list[list[Task]]:
    """Each device's task list for ZB-V (the phases in the module docstring)."""
    n = max(m, 2 * p - 1)   # the warm-up is sized for 2p - 1 microbatches; extra ones are dropped
    orders = []
    for s in range(p):
        o = _Order(m)
        for _ in range(2 * (p - s) - 1):
            o.add(Kind.F, A)
        for _ in range(s):
            o.add(Kind.F, B_)
            o.add(Kind.F, A)
        for _ in range(p - s):
            for kind in (Kind.F, Kind.B, Kind.W):
                o.add(kind, B_)
        while o.count(Kind.F, B_) < n:
            if o.count(Kind.F, A) < n:
                o.add(Kind.F, A)
            for chunk, kinds in ((A, (Kind.B, Kind.W)), (B_, (Kind.F, Kind.B, Kind.W))):
                for kind in kinds:
                    o.add(kind, chunk)
        for _ in range(s):
            o.add(Kind.B, A)
            o.add(Kind.B, B_)
        for _ in range(p - s):
            o.add(Kind.B, A)
            o.add(Kind.W, A)
        for chunk in (B_, A):
            while o.count(Kind.W, chunk) < n:
                o.add(Kind.W, chunk)
        orders.append(o.tasks)
    return orders


def zbv(p: int, m: int) -> Schedule:
    """ZB-V for ``p`` devices and ``m`` microbatches (any m >= 1); see the module docstring."""
    _check_sizes(p, m)
    return from_orders(zbv_orders(p, m), num_microbatches=m, virtual_stages=2, placement=v_placement(p),
                       name="zbv")


def dualpipev_orders(p: int, m: int) -> list[list[Task]]:
    """Each device's task list for DualPipeV (the phases in the module docstring)."""
    orders = []
    for s in range(p):
        o = _Order(m)
        for _ in range(2 * (p - s - 1)):
            o.add(Kind.F, A)
        for _ in range(s + 1):
            o.add(Kind.F, A)
            o.add(Kind.F, B_)
        for _ in range(p - s - 1):
            o.backward(B_, split=True)
            o.deferred_w()
            o.add(Kind.F, B_)
        for _ in range(m - 2 * p + s + 1):
            o.add(Kind.F, A)
            o.backward(B_, split=False)     # F&B: F a with BW b
            o.add(Kind.F, B_)
            o.backward(A, split=False)      # F&B: F b with BW a
        for _ in range(p - s - 1):
            o.backward(B_, split=False)
            o.add(Kind.F, B_)
            o.backward(A, split=False)      # F&B: F b with BW a
        for i in range(2 * (s + 1)):        # b, a, b, a, ...: the second half split
            o.backward(B_ if i % 2 == 0 else A, split=i >= s + 1)
        for _ in range(p - s - 1):
            o.deferred_w()
            o.backward(A, split=True)
        while o.deferred:
            o.deferred_w()
        orders.append(o.tasks)
    return orders


def dualpipev(p: int, m: int) -> Schedule:
    """DualPipeV for ``p`` devices (2p stages) and ``m >= 2p`` microbatches; see the module docstring."""
    _check_sizes(p, m)
    if m < 2 * p:
        raise ScheduleError(f"dualpipev needs at least 2p microbatches: m={m} with p={p} stages "
                            f"(use m >= {2 * p})")
    return from_orders(dualpipev_orders(p, m), num_microbatches=m, virtual_stages=2,
                       placement=v_placement(p), name="dualpipev")


# ---------------------------------------------------------------- F&B pairs
def fb_pairs(schedule: Schedule) -> list[list[tuple[int, int]]]:
    """Per device, ``(tick of the F, tick of the BW)`` of every F&B pair of a DualPipeV
    table: an F followed next on its device by a BW of the other chunk (in a
    ``dualpipev`` table exactly the overlapped steps 3 and 4)."""
    if schedule.name != "dualpipev":
        raise ScheduleError(f"F&B pairs are DualPipeV's; schedule {schedule.name!r} has none")
    pairs = []
    for s in range(schedule.num_stages):
        tasks = schedule.tasks_of(s)
        pairs.append([(t0, t1) for (t0, a), (t1, b) in zip(tasks, tasks[1:], strict=False)
                      if a.kind is Kind.F and b.kind is Kind.BW and a.chunk != b.chunk])
    return pairs


def fb_pair_timeline(schedule: Schedule, cost: Cost | None = None) -> Timeline:
    """Replay a DualPipeV table as DualPipe runs it: each device in table order, each
    F&B pair as one unit that starts once the inputs of both its halves are there
    (then its F, then its BW, back to back); other tasks as ``Schedule.timeline``
    runs them (free transfers)."""
    dur = _cost_fn(cost)
    p, G = schedule.num_stages, schedule.num_global_stages
    units = []   # per device: lists of (tick, task), one or two per unit
    for s, pairs in enumerate(fb_pairs(schedule)):
        firsts = {t0 for t0, _ in pairs}
        tasks, row, i = schedule.tasks_of(s), [], 0
        while i < len(tasks):
            step = 2 if tasks[i][0] in firsts else 1
            row.append(tasks[i:i + step])
            i += step
        units.append(row)
    start = [[None] * p for _ in range(schedule.num_ticks)]
    end = [[None] * p for _ in range(schedule.num_ticks)]
    done: dict[tuple[Kind, int, int], float] = {}
    free, busy, pos = [0.0] * p, [0.0] * p, [0] * p

    def key(kind: Kind, mb: int, g: int) -> tuple[Kind, int, int]:
        return (Kind.B if kind is Kind.BW else kind, mb, g)

    while any(pos[s] < len(units[s]) for s in range(p)):
        moved = False
        for s in range(p):
            if pos[s] == len(units[s]):
                continue
            unit = units[s][pos[s]]
            needs = [key(*k) for _, task in unit
                     for k in _inputs(task, schedule.global_stage(s, task.chunk), G)]
            if any(k not in done for k in needs):
                continue
            clock = max([free[s]] + [done[k] for k in needs])
            for t, task in unit:
                d = dur(s, task)
                start[t][s], end[t][s] = clock, clock + d
                clock += d
                busy[s] += d
                done[key(task.kind, task.microbatch, schedule.global_stage(s, task.chunk))] = clock
            free[s], pos[s], moved = clock, pos[s] + 1, True
        if not moved:
            raise ScheduleError(f"{schedule.name}: with F&B pairs run as one unit the devices wait "
                                f"on each other (next units at {pos})")
    return Timeline(tuple(map(tuple, start)), tuple(map(tuple, end)), max(free, default=0.0), tuple(busy))


# ------------------------------------------------------------------- registry
def _two_chunks(fn, name: str):
    def make(p: int, m: int, v: int = 2) -> Schedule:
        if v != 2:
            # Named both ways: a config (train, tune) and `mindpipe schedule` reach this.
            raise ScheduleError(f"schedule {name!r} places exactly 2 chunks per stage in a V "
                                f"(virtual_stages=2), got {v}; set it to 2 "
                                f"(parallel.virtual_stages=2, --virtual 2)")
        return fn(p, m)
    make.__doc__ = fn.__doc__
    make.virtual_stages = 2   # get_schedule's default v for this name
    return make


register_schedule("zbv", _two_chunks(zbv, "zbv"))
register_schedule("dualpipev", _two_chunks(dualpipev, "dualpipev"))
