"""A schedule table turned into the per-tick integer arrays the runtime indexes.

Pure Python / numpy, no tracing: which ``lax.switch`` branch each device takes
in each tick, which microbatch and chunk, and which buffer slot holds the
task's input, its output gradient, and what arrives at the end of the tick.
Slots come from interval colouring of each (microbatch, chunk)'s lifetime on
its device, so the buffers are as deep as the schedule keeps microbatches
alive (1F1B: at most p), not ``m``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from mindpipe_jax.parallel.pipeline.schedules import Kind, Schedule

KINDS = (Kind.F, Kind.BW, Kind.B, Kind.W)
MID, FIRST, LAST = 0, 1, 2


def branch_index(kind: Kind, position: int) -> int:
    """0 is idle; then one branch per (kind, position)."""
    return 1 + KINDS.index(kind) * 3 + position


@dataclasses.dataclass(frozen=True)
class Plan:
    """Per-tick arrays ``[ticks, p]`` the devices index with their own stage."""

    branch: np.ndarray
    microbatch: np.ndarray
    chunk: np.ndarray
    x_slot: np.ndarray  # slot holding this task's stage input (-1: none needed)
    g_slot: np.ndarray  # slot holding this task's output gradient (-1: none)
    recv_x: np.ndarray  # slot to store the activation arriving at the end of the tick
    recv_g: np.ndarray  # slot to store the gradient arriving at the end of the tick
    x_slots: int
    g_slots: int

    def arrays(self) -> dict[str, jax.Array]:
        names = ("branch", "microbatch", "chunk", "x_slot", "g_slot", "recv_x", "recv_g")
        return {n: jnp.asarray(getattr(self, n), jnp.int32) for n in names}


def _colour(intervals: dict) -> tuple[dict, int]:
    """Interval colouring: a slot is reused once its previous tenant's last use
    has happened (a new value is written at the end of a tick, after reads)."""
    free_at: list[int] = []
    slots = {}
    for key, (start, end) in sorted(intervals.items(), key=lambda kv: kv[1]):
        for slot, free in enumerate(free_at):
            if free <= start:
                free_at[slot] = end
                break
        else:
            slot = len(free_at)
            free_at.append(end)
        slots[key] = slot
    return slots, len(free_at)


def make_plan(schedule: Schedule) -> Plan:
    p, ticks = schedule.num_stages, schedule.num_ticks
    last_global = schedule.num_global_stages - 1
    where = {}  # (kind, mb, global stage) -> (tick, stage)
    for t, row in enumerate(schedule.table):
        for s, task in enumerate(row):
            if task is not None:
                where[(Kind(task.kind), task.microbatch, schedule.global_stage(s, task.chunk))] = (t, s)

    def backward_tick(mb, g):
        return where.get((Kind.BW, mb, g), where.get((Kind.B, mb, g)))[0]

    def last_use(mb, g):
        return where[(Kind.W, mb, g)][0] if (Kind.W, mb, g) in where else backward_tick(mb, g)

    # Lifetimes per device: stage inputs from arrival (end of the producer's F tick)
    # to the last backward use; output gradients from arrival to the last use.
    x_life = [dict() for _ in range(p)]
    g_life = [dict() for _ in range(p)]
    for (kind, mb, g), (t, s) in where.items():
        if kind is not Kind.F:
            continue
        # Stage inputs arrive at the end of the producer's F tick; the first stage's
        # slot (residuals only) is taken by its own F.
        t_in = where[(Kind.F, mb, g - 1)][0] if g > 0 else t
        x_life[s][(mb, g)] = (t_in, last_use(mb, g))
        if g < last_global:
            t_back = backward_tick(mb, g + 1)
            g_life[s][(mb, g)] = (t_back, last_use(mb, g))
    x_slot_of, g_slot_of, x_slots, g_slots = [], [], 1, 1
    for s in range(p):
        xs, nx = _colour(x_life[s])
        gs, ng = _colour(g_life[s])
        x_slot_of.append(xs)
        g_slot_of.append(gs)
        x_slots, g_slots = max(x_slots, nx), max(g_slots, ng)

    shape = (ticks, p)
    arr = {n: np.full(shape, -1, np.int32) for n in
           ("microbatch", "chunk", "x_slot", "g_slot", "recv_x", "recv_g")}
    branch = np.zeros(shape, np.int32)
    arr["microbatch"][:] = 0
    arr["chunk"][:] = 0
    for (kind, mb, g), (t, s) in where.items():
        position = FIRST if g == 0 else (LAST if g == last_global else MID)
        branch[t, s] = branch_index(kind, position)
        arr["microbatch"][t, s] = mb
        arr["chunk"][t, s] = schedule.owner(g)[1]
        arr["x_slot"][t, s] = x_slot_of[s].get((mb, g), -1)
        arr["g_slot"][t, s] = g_slot_of[s].get((mb, g), -1)
        if kind is Kind.F and g < last_global:
            dest = schedule.owner(g + 1)[0]
            _expect_neighbour(s, dest, p, "forward")
            arr["recv_x"][t, dest] = x_slot_of[dest][(mb, g + 1)]
        if kind in (Kind.BW, Kind.B) and g > 0:
            dest = schedule.owner(g - 1)[0]
            _expect_neighbour(dest, s, p, "backward")
            arr["recv_g"][t, dest] = g_slot_of[dest][(mb, g - 1)]
    return Plan(branch, arr["microbatch"], arr["chunk"], arr["x_slot"], arr["g_slot"],
                arr["recv_x"], arr["recv_g"], x_slots, g_slots)


def _expect_neighbour(src: int, dst: int, p: int, what: str) -> None:
    if dst != (src + 1) % p:
        raise ValueError(f"{what} transfer from stage {src} to {dst}: this runtime moves values "
                         f"one device along the ring per tick; use a placement where consecutive "
                         f"global stages sit on consecutive devices")
