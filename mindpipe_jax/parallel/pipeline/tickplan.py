"""A schedule table turned into the per-tick integer arrays the runtime indexes.

Pure Python / numpy, no tracing: which ``lax.switch`` branch each device takes
in each tick, which microbatch and chunk, and which buffer slot holds the
task's input, its output gradient, and what arrives at the end of the tick.
Slots come from interval colouring of each (microbatch, chunk)'s lifetime on
its device, so the buffers are as deep as the schedule keeps microbatches
alive (1F1B: at most p), not ``m``. Each remat policy has its own residual
buffer, coloured separately, so a stage that keeps little does not pay for one
that keeps a lot beyond the deepest stage of each policy.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from mindpipe_jax.parallel.pipeline.schedules import Kind, Schedule

KINDS = (Kind.F, Kind.BW, Kind.B, Kind.W)
MID, FIRST, LAST = 0, 1, 2
# What a stage keeps between a microbatch's forward and its backward:
#   "none"  the forward's residuals (recomputes nothing);
#   "dots"  residuals under jax.checkpoint with dots_with_no_batch_dims_saveable
#           (projection outputs kept, attention and elementwise work recomputed);
#   "full"  only the stage input (the backward re-runs the stage's forward).
REMAT_POLICIES = ("none", "dots", "full")


def normalize_remat(remat, num_global_stages: int) -> tuple[str, ...]:
    """``remat`` as one policy per global stage: a bool (True = "full"), a policy
    name for every stage, or a sequence with one name per global stage."""
    if isinstance(remat, bool):
        return ("full" if remat else "none",) * num_global_stages
    if isinstance(remat, str):
        remat = (remat,) * num_global_stages
    policies = tuple(remat)
    if len(policies) != num_global_stages:
        raise ValueError(f"remat has {len(policies)} entries {list(policies)}; the schedule has "
                         f"{num_global_stages} global stages (one policy each)")
    bad = [r for r in policies if r not in REMAT_POLICIES]
    if bad:
        raise ValueError(f"remat policy {bad[0]!r} is not one of {', '.join(REMAT_POLICIES)}")
    return policies


@dataclasses.dataclass(frozen=True)
class Plan:
    """Per-tick arrays ``[ticks, p]`` the devices index with their own stage.

    ``branch`` is 0 for idle, else ``1 + keys.index((kind, position, policy))``:
    only the (kind, position, policy) combinations the table uses become
    ``lax.switch`` branches. The last global stage's forward runs inside its
    backward, so it keeps its input and no residuals whatever its policy (which
    then only decides what that backward's vjp holds while it runs).
    """

    branch: np.ndarray
    microbatch: np.ndarray
    chunk: np.ndarray
    x_slot: np.ndarray  # slot holding this task's stage input (-1: none kept)
    g_slot: np.ndarray  # slot holding this task's output gradient (-1: none)
    res_slot: np.ndarray  # slot of this task's residuals in its policy's buffer (-1: none)
    recv_x: np.ndarray  # slot to store the activation arriving at the end of the tick
    recv_g: np.ndarray  # slot to store the gradient arriving at the end of the tick
    x_slots: int
    g_slots: int
    res_slots: dict[str, int]  # residual policy ("none"/"dots") -> buffer depth
    keys: tuple[tuple[Kind, int, str | None], ...]
    policies: tuple[str, ...]  # per global stage

    def active(self) -> np.ndarray:
        """``[ticks, len(keys)]`` bool: which task kinds some stage runs in each tick."""
        return (self.branch[:, :, None] == np.arange(1, len(self.keys) + 1)).any(axis=1)

    def arrays(self) -> dict[str, jax.Array]:
        names = ("branch", "microbatch", "chunk", "x_slot", "g_slot", "res_slot", "recv_x", "recv_g")
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


def make_plan(schedule: Schedule, remat=True) -> Plan:
    """``remat``: see ``normalize_remat``; it decides what each global stage keeps
    and for how long, so it shapes the buffers as much as the table does."""
    p, ticks = schedule.num_stages, schedule.num_ticks
    last_global = schedule.num_global_stages - 1
    policies = normalize_remat(remat, schedule.num_global_stages)
    where = {}  # (kind, mb, global stage) -> (tick, stage)
    for t, row in enumerate(schedule.table):
        for s, task in enumerate(row):
            if task is not None:
                where[(Kind(task.kind), task.microbatch, schedule.global_stage(s, task.chunk))] = (t, s)

    def backward_tick(mb, g):
        return where.get((Kind.BW, mb, g), where.get((Kind.B, mb, g)))[0]

    def last_use(mb, g):
        return where[(Kind.W, mb, g)][0] if (Kind.W, mb, g) in where else backward_tick(mb, g)

    def keeps_input(g):  # remat "full" re-runs the forward; the last stage runs it in its backward
        return policies[g] == "full" or g == last_global

    # Lifetimes per device. A stage input lives from its arrival (end of the producer's
    # F tick) to its forward, or to its last backward use when the stage keeps it; the
    # first stage reads tokens, not an input. Residuals live from the forward to the
    # last backward use; output gradients from arrival to the last use.
    x_life = [dict() for _ in range(p)]
    g_life = [dict() for _ in range(p)]
    res_life = [{r: {} for r in REMAT_POLICIES} for _ in range(p)]
    for (kind, mb, g), (t, s) in where.items():
        if kind is not Kind.F:
            continue
        if g > 0:
            t_in = where[(Kind.F, mb, g - 1)][0]
            x_life[s][(mb, g)] = (t_in, last_use(mb, g) if keeps_input(g) else t)
        if not keeps_input(g):
            res_life[s][policies[g]][(mb, g)] = (t, last_use(mb, g))
        if g < last_global:
            g_life[s][(mb, g)] = (backward_tick(mb, g + 1), last_use(mb, g))
    x_slot_of, g_slot_of, res_slot_of = [], [], []
    x_slots, g_slots, res_slots = 1, 1, {}
    for s in range(p):
        xs, nx = _colour(x_life[s])
        gs, ng = _colour(g_life[s])
        x_slot_of.append(xs)
        g_slot_of.append(gs)
        x_slots, g_slots = max(x_slots, nx), max(g_slots, ng)
        rs = {}
        for r, life in res_life[s].items():
            if life:
                slots, n = _colour(life)
                rs.update(slots)
                res_slots[r] = max(res_slots.get(r, 0), n)
        res_slot_of.append(rs)

    shape = (ticks, p)
    arr = {n: np.full(shape, -1, np.int32) for n in
           ("microbatch", "chunk", "x_slot", "g_slot", "res_slot", "recv_x", "recv_g")}
    branch = np.zeros(shape, np.int32)
    arr["microbatch"][:] = 0
    arr["chunk"][:] = 0
    keys: list = []
    for (kind, mb, g), (t, s) in sorted(where.items(), key=lambda kv: kv[1]):
        position = FIRST if g == 0 else (LAST if g == last_global else MID)
        key = (kind, position, policies[g])
        if key not in keys:
            keys.append(key)
        branch[t, s] = 1 + keys.index(key)
        arr["microbatch"][t, s] = mb
        arr["chunk"][t, s] = schedule.owner(g)[1]
        arr["x_slot"][t, s] = x_slot_of[s].get((mb, g), -1)
        arr["g_slot"][t, s] = g_slot_of[s].get((mb, g), -1)
        arr["res_slot"][t, s] = res_slot_of[s].get((mb, g), -1)
        if kind is Kind.F and g < last_global:
            dest = schedule.owner(g + 1)[0]
            _expect_neighbour(s, dest, p, "forward")
            arr["recv_x"][t, dest] = x_slot_of[dest][(mb, g + 1)]
        if kind in (Kind.BW, Kind.B) and g > 0:
            dest = schedule.owner(g - 1)[0]
            _expect_neighbour(dest, s, p, "backward")
            arr["recv_g"][t, dest] = g_slot_of[dest][(mb, g - 1)]
    return Plan(branch, arr["microbatch"], arr["chunk"], arr["x_slot"], arr["g_slot"], arr["res_slot"],
                arr["recv_x"], arr["recv_g"], x_slots, g_slots, res_slots, tuple(keys), policies)


def _expect_neighbour(src: int, dst: int, p: int, what: str) -> None:
    if dst != (src + 1) % p:
        raise ValueError(f"{what} transfer from stage {src} to {dst}: this runtime moves values "
                         f"one device along the ring per tick; use a placement where consecutive "
                         f"global stages sit on consecutive devices")
