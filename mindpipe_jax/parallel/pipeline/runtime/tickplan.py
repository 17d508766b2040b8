"""A schedule turned into the per-tick integer arrays the runtime indexes.

Pure Python / numpy, no tracing. The table is first re-timed into fused ticks
(``schedules.fused``): in one tick a device runs up to one forward, one backward
(B or BW) and one weight-gradient task, each its own *part*. For every part the
plan says which branch each device takes in each tick, which microbatch and
chunk, and which buffer slot holds the task's input, its output gradient and its
kept residuals; and, per direction of the ring (``next``: to device s + 1,
``prev``: to s − 1, ``self``: the same device, the turn of a V placement), where
each device sends what it made and in which slot an arriving value is stored.

Slots come from interval colouring of each (microbatch, global stage)'s lifetime
on its device, in fused ticks. Within a tick every read happens before any write
(values arrive and residuals are stored at the end of the tick), so a slot read
for the last time in tick t can take a value written at the end of tick t. The
buffers are as deep as the fused schedule keeps microbatches alive (1F1B fused
forward-ahead: at most 2p − 1 on stage 0; unfused: p), not ``m``. Each remat policy
has its own residual buffer, coloured separately.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from mindpipe_jax.parallel.pipeline.schedules import Kind, Schedule
from mindpipe_jax.parallel.pipeline.schedules.fused import PART_OF, PARTS, FusedSchedule, fuse

MID, FIRST, LAST = 0, 1, 2
# The branch position of stages whose tasks share one branch (``make_plan(merge_first=True)``:
# the first and the middle ones; ``merge_last=True``: the last and the middle ones): the
# first stage's embedding under a select on the device's own task, the last stage's loss
# in its forward. Stages in lockstep run every branch of a tick on every device: branches
# that differ only by the embedding or the head would run the stage's layers twice.
EITHER = 3
# What a stage keeps between a microbatch's forward and its backward:
#   "none"  the forward's residuals (recomputes nothing);
#   "dots"  residuals under jax.checkpoint with dots_with_no_batch_dims_saveable
#           (projection outputs kept, attention and elementwise work recomputed);
#   "full"  only the stage input (the backward re-runs the stage's forward).
REMAT_POLICIES = ("none", "dots", "full")
DIRECTIONS = ("next", "prev", "self")
_SHIFT = {"next": 1, "prev": -1, "self": 0}
_FIELDS = ("branch", "microbatch", "chunk", "x_slot", "g_slot", "res_slot", "stash_slot", "position",
           "inline", "head_now")


def split_mode(policy: str, position: int) -> str:
    """What a stage whose backward is split into B and W (``bwsplit``) keeps. Its F
    keeps residuals in buffer ``"split-" + policy`` ("full": only its input); its B
    stashes what the W reads in buffer ``"stash-" + mode``. The last stage runs its
    forward inside its B, so it splits the layers it just ran: plain residuals under
    "none", per-layer "dots" otherwise."""
    if position == LAST:
        return "none" if policy == "none" else "dots"
    return policy


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
class PartPlan:
    """One part of the fused ticks (F, backward or W): ``[ticks, p]`` arrays.

    ``branch`` is 0 for idle, else ``1 + keys.index((kind, position, policy))``:
    only the combinations the table uses become branches. ``position``: each task's
    own stage position (``FIRST``, ``MID``, ``LAST``; a key's may be ``EITHER``).
    Slots are -1 where the task keeps nothing there. With the last stage merged
    (``Plan.merge_last``): an F cell's ``g_slot`` is where the last stage's forward
    keeps the loss's gradient for its backward; a backward cell's ``inline`` is 1 where
    it reads the forward of the same tick and device (its residuals and that gradient
    straight from the F part's outputs, never stored); ``head_now`` (F part, the same
    in a whole row) is 1 in a tick where some device runs the last stage's forward."""

    branch: np.ndarray
    position: np.ndarray
    microbatch: np.ndarray
    chunk: np.ndarray
    inline: np.ndarray
    head_now: np.ndarray
    x_slot: np.ndarray  # slot holding the task's stage input
    g_slot: np.ndarray  # slot holding the task's output gradient
    res_slot: np.ndarray  # slot of the task's residuals in its buffer
    stash_slot: np.ndarray  # slot of what a split backward's B leaves for its W
    keys: tuple[tuple[Kind, int, str], ...]  # (kind, position, buffer mode: policy or "split-" + policy)

    def active(self) -> np.ndarray:
        """``[ticks, len(keys)]`` bool: which task kinds some device runs in each tick."""
        return (self.branch[:, :, None] == np.arange(1, len(self.keys) + 1)).any(axis=1)

    def arrays(self) -> dict[str, jax.Array]:
        return {n: jnp.asarray(getattr(self, n), jnp.int32) for n in _FIELDS}


@dataclasses.dataclass(frozen=True)
class Plan:
    """The fused schedule as arrays. ``parts``: F, backward, W (``PARTS``).
    ``send[what][dir]`` (what: "x" activations, "g" gradients): ``[ticks, p]`` bool,
    the device sends its part's output in that direction; ``recv[what][dir]``:
    ``[ticks, p]`` slot storing what arrives from that direction (-1: nothing).
    Only directions the schedule uses appear. The last global stage's forward runs
    inside its backward, so it keeps its input and no residuals whatever its policy
    (which then only decides what that backward's vjp holds while it runs), except
    with ``merge_last``, where it keeps what a middle stage keeps."""

    fused: FusedSchedule
    parts: tuple[PartPlan, PartPlan, PartPlan]
    send: dict[str, dict[str, np.ndarray]]
    recv: dict[str, dict[str, np.ndarray]]
    x_slots: int
    g_slots: int
    res_slots: dict[str, int]  # residual buffer ("none", "dots", "split-none", "split-dots") -> depth
    policies: tuple[str, ...]  # per global stage
    stash_slots: dict[str, int] = dataclasses.field(default_factory=dict)  # "stash-<mode>" -> depth
    split: frozenset = frozenset()  # global stages whose backward is split into B and W
    merge_last: bool = False  # the last stage's F runs its layers and the loss (``make_plan``)

    @property
    def num_ticks(self) -> int:
        return self.fused.num_ticks

    @property
    def keys(self) -> tuple[tuple[Kind, int, str], ...]:
        return tuple(k for part in self.parts for k in part.keys)


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


def make_plan(schedule: Schedule, remat=True, fuse_mode: str = "auto", split_backward: bool = True,
              fuse_cost=None, merge_first: bool = False, merge_last: bool = False) -> Plan:
    """``remat``: see ``normalize_remat``; it decides what each global stage keeps
    and for how long, so it shapes the buffers as much as the table does.
    ``fuse_mode``, ``fuse_cost``: how the table is re-timed (``schedules.fused.fuse``).
    ``split_backward``: B and W tasks split the backward's equations (``bwsplit``);
    False: each forms the whole vjp and keeps its half (the collective matmul's rings need this).
    ``merge_first``: the first stage's tasks share the middle stages' branches (position
    ``EITHER``; for stages in lockstep, where it saves a run of the layers per part).
    ``merge_last``: so do the last stage's: its F runs its layers, keeps their residuals
    as a middle stage does, and forms the loss, the head's gradient and the loss's
    gradient at its output (kept in a ``g`` slot), so its backward is a middle stage's.
    Where the fused table puts that F and its backward in one tick, the backward reads
    them from the F (``inline``) and nothing is stored."""
    fused = fuse(schedule, fuse_mode, fuse_cost)
    p, ticks = schedule.num_stages, fused.num_ticks
    last_global = schedule.num_global_stages - 1
    policies = normalize_remat(remat, schedule.num_global_stages)
    where = fused.where()  # (kind, mb, global stage) -> (tick, device)

    def backward_tick(mb, g):
        return where.get((Kind.BW, mb, g), where.get((Kind.B, mb, g)))[0]

    def last_use(mb, g):
        return where[(Kind.W, mb, g)][0] if (Kind.W, mb, g) in where else backward_tick(mb, g)

    def keeps_input(g):  # remat "full" re-runs the forward; the last stage runs it in its backward
        return policies[g] == "full" or (g == last_global and not merge_last)

    def inline(mb, g):  # a merged last stage's backward in the tick of its F reads the F's outputs
        return merge_last and g == last_global and where[(Kind.F, mb, g)][0] == backward_tick(mb, g)

    def read_later(mb, g):  # is the F's output read after its own tick? (else it is not stored)
        return where[(Kind.F, mb, g)][0] < input_use(mb, g)

    def split_position(g):  # what a split backward of stage g keeps (``split_mode``)
        return LAST if g == last_global and not merge_last else MID

    # A split stage's W reads only what its B stashed: its input, output gradient and
    # residuals are free after the B.
    split = frozenset(g for (kind, _, g) in where if kind is Kind.B and split_backward)

    def input_use(mb, g):
        return backward_tick(mb, g) if g in split else last_use(mb, g)

    def res_key(g):
        return ("split-" if g in split else "") + policies[g]

    # Lifetimes per device. A stage input lives from its arrival (end of the producer's
    # F tick) to its forward, or to its last backward use when the stage keeps it; the
    # first stage reads tokens, not an input. Residuals live from the forward to the
    # last backward use; output gradients from arrival to the last use.
    x_life = [dict() for _ in range(p)]
    g_life = [dict() for _ in range(p)]
    res_life = [{} for _ in range(p)]
    stash_life = [{} for _ in range(p)]
    for (kind, mb, g), (t, s) in where.items():
        if kind is Kind.B:
            name = "stash-" + split_mode(policies[g], split_position(g))
            stash_life[s].setdefault(name, {})[(mb, g)] = (t, where[(Kind.W, mb, g)][0])
        if kind is not Kind.F:
            continue
        if g > 0:
            t_in = where[(Kind.F, mb, g - 1)][0]
            x_life[s][(mb, g)] = (t_in, input_use(mb, g) if keeps_input(g) else t)
        if not keeps_input(g) and read_later(mb, g):
            res_life[s].setdefault(res_key(g), {})[(mb, g)] = (t, input_use(mb, g))
        if g < last_global:
            g_life[s][(mb, g)] = (backward_tick(mb, g + 1), input_use(mb, g))
        elif merge_last and read_later(mb, g):  # the loss's gradient, from the F to its last reader
            g_life[s][(mb, g)] = (t, input_use(mb, g))
    x_slot_of, g_slot_of, res_slot_of, stash_slot_of = [], [], [], []
    x_slots, g_slots, res_slots, stash_slots = 1, 1, {}, {}
    for s in range(p):
        xs, nx = _colour(x_life[s])
        gs, ng = _colour(g_life[s])
        x_slot_of.append(xs)
        g_slot_of.append(gs)
        x_slots, g_slots = max(x_slots, nx), max(g_slots, ng)
        res_slot_of.append(_colour_each(res_life[s], res_slots))
        stash_slot_of.append(_colour_each(stash_life[s], stash_slots))

    shape = (ticks, p)
    zero_fields = ("branch", "microbatch", "chunk", "position", "inline", "head_now")
    arrays = [{n: np.zeros(shape, np.int32) if n in zero_fields else np.full(shape, -1, np.int32)
               for n in _FIELDS} for _ in PARTS]
    keys: list[list] = [[] for _ in PARTS]
    send = {w: {d: np.zeros(shape, bool) for d in DIRECTIONS} for w in ("x", "g")}
    recv = {w: {d: np.full(shape, -1, np.int32) for d in DIRECTIONS} for w in ("x", "g")}
    for (kind, mb, g), (t, s) in sorted(where.items(), key=lambda kv: kv[1]):
        position = FIRST if g == 0 else (LAST if g == last_global else MID)
        merged = {FIRST: merge_first, LAST: merge_last, MID: merge_first or merge_last}[position]
        branch_at = EITHER if merged else position
        part, key = PART_OF[kind], (kind, branch_at, res_key(g))
        if key not in keys[part]:
            keys[part].append(key)
        arr = arrays[part]
        arr["branch"][t, s] = 1 + keys[part].index(key)
        arr["position"][t, s] = position
        arr["microbatch"][t, s] = mb
        arr["chunk"][t, s] = schedule.owner(g)[1]
        arr["x_slot"][t, s] = x_slot_of[s].get((mb, g), -1)
        # An F reads no output gradient; a merged last stage's F writes the loss's.
        if kind is not Kind.F or (merge_last and g == last_global):
            arr["g_slot"][t, s] = g_slot_of[s].get((mb, g), -1)
        if kind in (Kind.B, Kind.BW) and inline(mb, g):
            arr["inline"][t, s] = 1
        if kind is Kind.F and merge_last and g == last_global:
            arr["head_now"][t, :] = 1
        arr["res_slot"][t, s] = res_slot_of[s].get((mb, g), -1)
        arr["stash_slot"][t, s] = stash_slot_of[s].get((mb, g), -1)
        if kind is Kind.F and g < last_global:
            dest = schedule.owner(g + 1)[0]
            d = _direction(s, dest, p, "forward")
            send["x"][d][t, s] = True
            recv["x"][d][t, dest] = x_slot_of[dest][(mb, g + 1)]
        if kind in (Kind.BW, Kind.B) and g > 0:
            dest = schedule.owner(g - 1)[0]
            d = _direction(s, dest, p, "backward")
            send["g"][d][t, s] = True
            recv["g"][d][t, dest] = g_slot_of[dest][(mb, g - 1)]
    # Every F branch that keeps residuals hands them on in its mode's buffer, also where
    # no microbatch's stay past the tick (a merged last stage whose backwards all run
    # inline): a part's branches pass the same buffers through, so the mode gets one
    # (its spare slot only, depth 0).
    for _, pos, mode in keys[PART_OF[Kind.F]]:
        if pos != LAST and mode not in ("full", "split-full"):
            res_slots.setdefault(mode, 0)
    parts = tuple(PartPlan(**arrays[i], keys=tuple(keys[i])) for i in range(len(PARTS)))
    used = {w: {d: a for d, a in send[w].items() if a.any()} for w in send}
    return Plan(fused, parts, used, {w: {d: recv[w][d] for d in used[w]} for w in recv},
                x_slots, g_slots, res_slots, policies, stash_slots, split, merge_last)


def residual_readers(plan: Plan, lockstep: bool) -> tuple[int, ...]:
    """The parts (0 F, 1 backward, 2 W) whose slot of every residual buffer a tick reads
    (``ticks.make_tick``): the backward; the F in lockstep (handed only the backward's
    one-row read there, its conds consume the row through selects, XLA fuses a copy of
    the read into each consumer and the backward's is then not ordered before the
    write: whole buffers copied every tick; a two-row gather every consumer shares
    avoids it); the W where an unsplit W reads a policy's residuals. Elsewhere the F is
    handed the backward's read."""
    w_reads = any(mode in plan.res_slots and not mode.startswith("split-")
                  for _, _, mode in plan.parts[2].keys)
    return ((0,) if lockstep else ()) + (1,) + ((2,) if w_reads else ())


def _colour_each(lives: dict[str, dict], depth: dict[str, int]) -> dict:
    """Colour each named buffer's lifetimes; ``depth`` keeps the deepest per name.
    Keys (mb, global stage) are unique per device, so one dict holds every slot."""
    slot_of = {}
    for name, life in lives.items():
        if life:
            slots, n = _colour(life)
            slot_of.update(slots)
            depth[name] = max(depth.get(name, 0), n)
    return slot_of


def _direction(src: int, dst: int, p: int, what: str) -> str:
    """The ring direction from ``src`` to ``dst``: this runtime moves values one device
    along the ring per tick, either way, or keeps them on the device."""
    for d in DIRECTIONS:
        if dst == (src + _SHIFT[d]) % p:
            return d
    raise ValueError(f"{what} transfer from stage {src} to {dst}: this runtime moves values "
                     f"at most one device along the ring per tick; use a placement where consecutive "
                     f"global stages sit on the same or neighbouring devices")


def shift(direction: str, p: int) -> list[tuple[int, int]]:
    """The ``ppermute`` pairs of one ring direction."""
    return [(i, (i + _SHIFT[direction]) % p) for i in range(p)]
