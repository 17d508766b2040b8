"""The partitioner's stage and memory model: a global stage's time and bytes under
each remat policy (``StageModel``), a device's peak of in-flight microbatches
(``device_peak``), the fastest per-device remat that fits a budget
(``choose_remat``) and the SPMD runtime's buffers (``spmd_memory``,
``fit_spmd_budget``).

The memory model, per device ``s`` (all bytes, per device)::

    params_state = param_copies x params of its layers (+ embed on stage 0, + head
                   on the last; weights, gradients and Adam's two moments: 4 copies)
    in_flight    = k_s x per_microbatch  (k_s = the schedule's peak number of
                   microbatches forwarded whose last backward task has not run:
                   Schedule.peak_in_flight(), which is peak_live_activations() for
                   every schedule without a B/W split; under ZB-H1 a microbatch's
                   residuals stay until its deferred W)
    per_microbatch: remat "none": stage input + the stage's forward residuals
                    remat "full": stage input only
                    remat "dots": stage input + the matmul outputs kept by
                                  ``dots_with_no_batch_dims_saveable``
                    the last stage keeps only its input whatever the policy (its
                    forward runs inside its backward): "none" rebuilds all its
                    residuals there (transient), the others its "dots" share
    transient    = what a recomputing backward rebuilds while it runs: the runtime
                   differentiates every re-run forward with the "dots" checkpoint per
                   layer, so one layer's residuals that "dots" does not keep, plus,
                   under "full", the stage's kept matmul outputs

and remat adds its recompute to the stage's backward: "full" re-runs the stage's
forward (+F, + the "dots" recompute when the profile has it), "dots" the measured
difference between the policy's backward and the plain one. With ``v > 1`` a
device's peak is found by walking its task list with each chunk's own
per-microbatch size.

What stages keep beyond their input also costs time in the SPMD runtime, on every
device in every tick, busy or idle: each tick reads and writes ``SLOT_MOVES`` slots
of every residual buffer (``SLOT_MOVES_TWO_READS`` of a B/W stash buffer, and of a
residual buffer in lockstep; ``runtime/ticks.py``), a slot being as wide as the
widest stage using the buffer (``slot_tick_seconds``, at the profile's
``slot_move_s_per_byte``). The partitioner replays the fused ticks with that
per-tick cost and keeps a leaner policy where it makes the step faster
(``partition``): what makes "none" slower than "dots" or "full" in a pipeline on a
host whose memory is slow against its compute (``benchmarks/pipeline_remat.py``).

The SPMD runtime runs one program on every device, so each policy's residual
buffer is as deep as the deepest stage using it needs. ``plan.spmd_memory_bytes``
is that figure, from the runtime's own slot plan (``tickplan.make_plan``); when a
budget is given, the plan is also made to fit it: while the SPMD figure is over,
the stage that sets the biggest buffer's depth moves to the next policy that
keeps less (none -> dots -> full). Embed and head parameters are modelled on the
devices that use them (as an MPMD runtime would hold them); the SPMD runtime
replicates them, which the SPMD figure counts.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from mindpipe_jax.errors import ConfigError
from mindpipe_jax.parallel.pipeline.plan.profile import ProfiledModel
from mindpipe_jax.parallel.pipeline.plan.shares import CHUNK_GATHERED_COPIES, GATHERED_COPIES, ParamShare
from mindpipe_jax.parallel.pipeline.schedules import Kind, Schedule

REMAT_POLICIES = ("none", "dots", "full")
PARAM_COPIES = 4.0   # weights + gradients + Adam's first and second moments
MB = float(2 ** 20)  # what the plan's table and the messages call a megabyte


def _mb(nbytes: float) -> str:
    """``nbytes`` in MB for a message: one decimal, or two significant digits below 0.1
    (a budget of 0.01 MB read "0.0 MB")."""
    return f"{nbytes / MB:.1f}" if nbytes >= 0.1 * MB else f"{nbytes / MB:.2g}"
# Slots a pipeline tick moves per residual buffer (``runtime/ticks.py``): the backward's
# row read and written out, and the F's slot (or the spare) written back. Two rows read
# and one written back: a B/W stash buffer (the B's and the W's rows), and a residual
# buffer in lockstep (the F's and the backward's), or where an unsplit W reads it too.
SLOT_MOVES = 3
SLOT_MOVES_TWO_READS = 5


class StageModel:
    """Prefix sums over the profile, and one stage's figures for a remat policy."""

    def __init__(self, prof: ProfiledModel, G: int, split: bool, share: ParamShare | None = None):
        self.prof, self.G, self.split = prof, G, split
        self.share = share or ParamShare()
        L = prof.num_layers
        self.L = L

        def prefix(values):
            out = [0.0]
            for x in values:
                out.append(out[-1] + x)
            return out

        ls = prof.layers
        self.F = prefix(x.F for x in ls)
        self.back = prefix((x.B + x.W) if split else x.fused for x in ls)
        self.params = prefix(x.param_bytes for x in ls)
        self.res = prefix(prof.residual_bytes)
        self.dres = prefix(prof.dots_residual_bytes or (0.0,) * L)
        # What a per-layer "dots" checkpoint rebuilds of each layer in its backward.
        self.rest = [r - d for r, d in zip(prof.residual_bytes, prof.dots_residual_bytes or
                                           prof.residual_bytes, strict=True)]
        self.drec = prefix(prof.dots_recompute_s or (0.0,) * L)
        self.act_in = [prof.embed.activation_bytes] + [x.activation_bytes for x in ls]  # input of layer i

    def _sum(self, arr, i, j):
        return arr[j] - arr[i]

    def stage(self, g: int, i: int, j: int, policy: str, as_middle: bool = False) -> dict[str, float]:
        """Figures of global stage ``g`` holding layers ``[i, j)`` under ``policy``
        (``as_middle``: the last stage's layers kept as a middle stage keeps them, as the
        lockstep runtime's merged last stage does; its head is then not counted)."""
        prof, first, last = self.prof, g == 0, g == self.G - 1 and not as_middle
        e, h = prof.embed, prof.head
        fwd = self._sum(self.F, i, j) + first * e.F + last * h.F
        eb = (e.B + e.W) if self.split else e.fused
        hb = (h.B + h.W) if self.split else h.fused
        back = self._sum(self.back, i, j) + first * eb + last * hb
        res = self._sum(self.res, i, j) + first * prof.embed_residual_bytes + last * prof.head_residual_bytes
        act = self.act_in[i]
        kept = self._sum(self.dres, i, j) if prof.has_dots else res
        one_layer = max(self.rest[i:j], default=0.0)
        if last:  # its forward runs inside its backward: it keeps its input, recomputes no F
            if policy == "none":
                recompute, per_mb, transient = 0.0, act, res
            else:
                recompute, per_mb, transient = self._sum(self.drec, i, j), act, kept + one_layer
        elif policy == "none":
            recompute, per_mb, transient = 0.0, act + res, 0.0
        elif policy == "full":   # re-run the stage's forward (embed included) under "dots"
            recompute = self._sum(self.F, i, j) + first * e.F + self._sum(self.drec, i, j)
            per_mb, transient = act, kept + one_layer
        else:                    # dots: matmul outputs kept, the rest recomputed layer by layer
            recompute = self._sum(self.drec, i, j)
            per_mb, transient = act + kept + first * prof.embed_residual_bytes \
                + last * prof.head_residual_bytes, one_layer
        params = self.param_fig(self._sum(self.params, i, j), first * e.param_bytes + last * h.param_bytes)
        return {"F": fwd, "back": back, "recompute": recompute, "time": fwd + back + recompute,
                **params, "per_mb": per_mb, "transient": transient}

    def param_fig(self, blocks: float, ends: float) -> dict[str, float]:
        """A stage's parameter figures for ``blocks`` bytes of layers and ``ends`` of
        embed / head (whole): what a device stores, and what the step gathers."""
        share = self.share
        return {"params": share.blocks_stored * blocks + share.ends_stored * ends,
                "gathered": share.blocks_used * blocks * share.gathers_blocks(),
                "gathered_ends": share.ends_used * ends * share.gathers_ends()}

    def param_memory(self, figs: Sequence[dict[str, float]], param_copies: float) -> float:
        """Bytes one device keeps for the parameters of its stages ``figs``: the stored
        copies (weights, gradients, Adam's moments) and, where the step gathers what
        storage splits over ``fsdp``, the gathered weights and an accumulator of their
        size: for all its stages at once, or its largest chunk in each part of a tick
        under ``fsdp_gather="chunk"`` (``shares``)."""
        blocks = [f["gathered"] for f in figs]
        gathered = (CHUNK_GATHERED_COPIES * max(blocks, default=0.0) if self.share.fsdp_gather == "chunk"
                    else GATHERED_COPIES * sum(blocks))
        return param_copies * sum(f["params"] for f in figs) + gathered \
            + GATHERED_COPIES * sum(f["gathered_ends"] for f in figs)


def stages_of(schedule: Schedule, s: int) -> tuple[int, ...]:
    """The global stages device ``s`` holds, by chunk (``schedule.placement``: Megatron's
    ``c·p + s``, or a V's ``s`` and ``2p − 1 − s``)."""
    return tuple(schedule.placement[s])


def device_of(schedule: Schedule, g: int) -> int:
    """The device that holds global stage ``g``."""
    return next(s for s, row in enumerate(schedule.placement) if g in row)


def device_peak(schedule: Schedule, s: int, per_mb_by_chunk: Sequence[float]) -> float:
    """Peak in-flight bytes on device ``s``: +per_mb[c] at a chunk's F, - at its last
    backward task (BW, or W when the schedule splits the backward)."""
    level = peak = 0.0
    for _, task in schedule.tasks_of(s):
        if task.kind is Kind.F:
            level += per_mb_by_chunk[task.chunk]
        elif task.kind in (Kind.BW, Kind.W):
            level -= per_mb_by_chunk[task.chunk]
        peak = max(peak, level)
    return peak


def memory_per_device(model: StageModel, sched: Schedule, figs, param_copies: float):
    """Per device: (params+optimizer, in-flight activations, transient) bytes."""
    p = sched.num_stages
    params, acts, trans = [], [], []
    for s in range(p):
        gs = stages_of(sched, s)
        params.append(model.param_memory([figs[g] for g in gs], param_copies))
        acts.append(device_peak(sched, s, [figs[g]["per_mb"] for g in gs]))
        trans.append(max(figs[g]["transient"] for g in gs))
    return tuple(params), tuple(acts), tuple(trans)


def choose_remat(model: StageModel, sched: Schedule, spans, options, budget, param_copies,
                  inflight) -> list[str]:
    """Per global stage, the fastest policy that lets its device fit."""
    p, v, G = sched.num_stages, sched.virtual_stages, sched.num_global_stages
    chosen = ["none"] * G
    for s in range(p):
        gs = stages_of(sched, s)
        if len(options) ** v <= 1024:
            combos = list(itertools.product(options, repeat=v))
        else:
            combos = [(o,) * v for o in options]
        best, best_key, least = None, None, None
        for combo in combos:
            figs = [model.stage(g, spans[g].start, spans[g].stop, o) for g, o in zip(gs, combo, strict=True)]
            mem = model.param_memory(figs, param_copies) \
                + device_peak(sched, s, [f["per_mb"] for f in figs]) + max(f["transient"] for f in figs)
            if least is None or mem < least[0]:
                least = (mem, combo)
            if budget is not None and mem > budget:
                continue
            key = (max(f["time"] for f in figs), sum(f["recompute"] for f in figs))
            if best_key is None or key < best_key:
                best, best_key = combo, key
        if best is None:
            assert least is not None
            raise ConfigError(
                f"memory budget {_mb(budget)} MB per device is too small: "
                f"{'stage' if v == 1 else 'device'} {s} ({describe_stages(spans, gs, G, v > 1)}) "
                f"needs at least "
                f"{least[0] / MB:.1f} MB with remat {'/'.join(least[1])} ({inflight[s]} microbatches in "
                f"flight); tried remat {', '.join(options)}"
                f"{' on every split' if v == 1 else ' on the candidate splits'}; raise the budget, "
                f"add stages or use fewer microbatches in flight")
        for g, o in zip(gs, best, strict=True):
            chosen[g] = o
    return chosen


def describe_stages(spans, gs, G, name_stages: bool = False) -> str:
    parts = []
    for g in gs:
        r = spans[g]
        if len(r) > 1:
            text = f"layers {r.start}-{r.stop - 1}"
        else:
            text = f"layer {r.start}" if len(r) else "no layers"
        text += " + embed" if g == 0 else ""
        text += " + head" if g == G - 1 else ""
        parts.append(f"global stage {g}: {text}" if name_stages else text)
    return "; ".join(parts)


def spmd_memory(model: StageModel, sched: Schedule, spans, chosen, param_copies: float,
                fuse_mode: str = "auto", lockstep: bool = False):
    """(bytes per device, {policy: buffer bytes, and which stage sets its depth}) as
    the SPMD runtime lays them out: one program, so every buffer is as deep as its
    deepest stage and as wide as its widest; all parameters of a device's stages
    plus embed and head (replicated); the largest transient of any stage.
    ``lockstep``: the stages run in lockstep (tensor > 1,
    ``runtime.spmd.needs_lockstep``), where the runtime merges the first and last
    stages' tasks into the middle stages' branches: the last stage's forward then
    keeps its layers' residuals like a middle stage, and the loss's gradient waits in
    a ``g`` slot (``tickplan.make_plan(merge_first, merge_last)``)."""
    p, G = sched.num_stages, sched.num_global_stages
    plan, rows, keeping = _slot_rows(model, sched, spans, chosen, fuse_mode, lockstep)
    figs = [model.stage(g, spans[g].start, spans[g].stop, chosen[g]) for g in range(G)]
    slots = {**plan.res_slots, **plan.stash_slots}
    # A residual buffer's n slots, its spare and the rows each tick reads out of it; a
    # stash buffer's n slots and the two rows each tick reads (the B's and the W's).
    from mindpipe_jax.parallel.pipeline.runtime.tickplan import residual_readers

    reads = len(residual_readers(plan, lockstep))
    buffers = {r: (n + 1 + reads) * rows[r] for r, n in plan.res_slots.items()}
    buffers.update({r: (n + 2) * rows[r] for r, n in plan.stash_slots.items()})
    owner = {}
    inflight = sched.peak_in_flight()
    for r in slots:
        policy = r.removeprefix("split-").removeprefix("stash-")
        stages = [g for g in keeping if chosen[g] == policy] or list(range(G))
        owner[r] = max(stages, key=lambda g: (inflight[device_of(sched, g)], -g))
    act = max(model.act_in)
    # Every device holds the embedding and head (stored split over pipe, gathered in
    # the step) beside its own stages' layers: one SPMD program.
    e, h = model.prof.embed, model.prof.head
    ends = model.param_fig(0.0, e.param_bytes + h.param_bytes)
    layers = [model.param_fig(model._sum(model.params, r.start, r.stop), 0.0) for r in spans]
    params = max(model.param_memory([layers[g] for g in stages_of(sched, s)] + [ends], param_copies)
                 for s in range(p))
    total = params + (plan.x_slots + plan.g_slots) * act + sum(buffers.values()) \
        + max(f["transient"] for f in figs) + uneven_split_overhead(model, spans)
    return total, {r: (buffers[r], owner[r]) for r in buffers}


def uneven_split_overhead(model: StageModel, spans) -> float:
    """What uneven stages cost a device beyond the even split's figures, measured: about
    the whole layer stack twice (at the compute share: fsdp gathered, tensor still split).
    On pipe2 x data4 and x fsdp4 (d_model 128, 4 layers) [1, 3] instead of [2, 2] adds
    6-8 MB of temporaries to the 3.15 MB stack. Most of it is the padded staging: an even
    split's ``[p, v, width, ...]`` stack is a reshape of the stored ``[L, ...]`` one (a view
    of the step's argument, and its gradient of the output), an uneven one is taken by index
    (``runtime.layout.StageLayout.to_stages`` / ``from_stages``), so the weights and their
    gradients each get a staged copy of ``width`` layers per device: 1.5 stacks for [1, 3]
    with nothing else in the program (4.3 MB for a 2.9 MB stack). The padded accumulator
    adds a layer, the rest is XLA's. Moving only the layers that change device (a
    ``ppermute`` per distance) kept the staged copies and did not lower the peak.
    An even V placement, also taken by index, shows no such cost (zbv plans 1.1-1.5x its
    compiled step without it)."""
    if len({len(r) for r in spans}) <= 1:
        return 0.0
    return GATHERED_COPIES * model.share.blocks_used * model._sum(model.params, 0, model.L)


def _slot_rows(model: StageModel, sched: Schedule, spans, chosen, fuse_mode: str, lockstep: bool):
    """(the runtime's slot plan, bytes of one slot of each residual and stash buffer,
    the global stages whose forward keeps residuals)."""
    from mindpipe_jax.parallel.pipeline.runtime.tickplan import make_plan

    G = sched.num_global_stages
    plan = make_plan(sched, tuple(chosen), fuse_mode, merge_first=lockstep, merge_last=lockstep)
    kept = [model.stage(g, spans[g].start, spans[g].stop, chosen[g], as_middle=lockstep) for g in range(G)]
    keeping = [g for g in range(G) if g != G - 1 or lockstep]  # stages whose forward keeps residuals
    width = max(len(r) for r in spans) or 1
    # Per-microbatch bytes beyond the stage input, per layer slot of the padded stage.
    # A split backward's residual buffer ("split-<policy>") holds the same residuals.
    residual = {r: max(((kept[g]["per_mb"] - model.act_in[spans[g].start]) / max(len(spans[g]), 1)
                        for g in keeping if chosen[g] == r.removeprefix("split-")), default=0.0)
                for r in plan.res_slots}
    # What a split backward's B stashes for its W, per layer: the cotangents at the
    # weight-consuming matmuls and the inputs they multiply; estimated (not measured) by
    # the "dots" residuals, which are those matmuls' outputs (without a dots profile, by
    # the plain residuals: an upper bound).
    stash = max(model.prof.dots_residual_bytes or model.prof.residual_bytes, default=0.0)
    residual.update({r: stash for r in plan.stash_slots})
    return plan, {r: width * b for r, b in residual.items()}, keeping


def slot_tick_seconds(model: StageModel, sched: Schedule, spans, chosen, fuse_mode: str = "auto",
                      lockstep: bool = False) -> float:
    """Seconds every device spends per tick moving residual and stash slots in the SPMD
    runtime under these policies: ``SLOT_MOVES`` slots of a buffer one part reads,
    ``SLOT_MOVES_TWO_READS`` of one two parts read, at the profile's
    ``slot_move_s_per_byte`` (0 when the profile does not price it)."""
    rate = model.prof.slot_move_s_per_byte
    if rate <= 0:
        return 0.0
    from mindpipe_jax.parallel.pipeline.runtime.tickplan import residual_readers

    plan, rows, _ = _slot_rows(model, sched, spans, chosen, fuse_mode, lockstep)
    residual = SLOT_MOVES if len(residual_readers(plan, lockstep)) == 1 else SLOT_MOVES_TWO_READS
    moves = {r: SLOT_MOVES_TWO_READS if r in plan.stash_slots else residual for r in rows}
    return rate * sum(moves[r] * b for r, b in rows.items())


def fit_spmd_budget(model: StageModel, sched: Schedule, spans, chosen, options, budget, param_copies,
              measure: Callable[[tuple[str, ...], tuple[int, ...], str], float] | None = None,
              fuse_mode: str = "auto", lockstep: bool = False):
    """Make the SPMD runtime fit the budget: while it does not, move the stage whose
    next leaner policy in ``options`` saves the most modelled bytes per second of
    recompute added. "Fits" is judged by ``measure(remat, counts, fuse_mode)`` (e.g. the
    compiled program's temp bytes) when given, else by the model (``spmd_memory``),
    for the runtime re-timing the table with ``fuse_mode`` (``schedules.fused``).
    Returns (policies, the figure that was judged)."""
    chosen = list(chosen)
    counts = tuple(len(r) for r in spans)
    less = {"none": ("dots", "full"), "dots": ("full",)}
    while True:
        modelled, _ = spmd_memory(model, sched, spans, chosen, param_copies, fuse_mode, lockstep)
        total = float(measure(tuple(chosen), counts, fuse_mode)) if measure is not None else modelled
        if budget is None or total <= budget:
            return chosen, total
        # A move: stage g, with every stage of the same policy holding at least as many
        # microbatches in flight, goes to its next leaner policy (moving only the
        # stage that sets a buffer's depth may save nothing while the next sets it).
        inflight = sched.peak_in_flight()
        best = None
        for g in range(len(spans)):
            nxt = next((o for o in less.get(chosen[g], ()) if o in options), None)
            if nxt is None:
                continue
            group = [k for k in range(len(spans)) if chosen[k] == chosen[g]
                     and inflight[device_of(sched, k)] >= inflight[device_of(sched, g)]]
            trial = chosen.copy()
            for k in group:
                trial[k] = nxt
            saved = modelled - spmd_memory(model, sched, spans, trial, param_copies, fuse_mode, lockstep)[0]
            if saved <= 0:
                continue
            added = sum(model.stage(k, spans[k].start, spans[k].stop, nxt)["time"]
                        - model.stage(k, spans[k].start, spans[k].stop, chosen[k])["time"] for k in group)
            key = max(added, 0.0) / saved
            if best is None or key < best[0]:
                best = (key, group, nxt)
        if best is None:
            raise ConfigError(
                f"memory budget {_mb(budget)} MB per device is too small for the SPMD runtime: "
                f"remat {'/'.join(chosen)} needs {total / MB:.1f} MB ({'compiled' if measure else 'model'}"
                f"; each policy's buffer as deep as its deepest stage); raise the budget, allow remat "
                f"{', '.join(REMAT_POLICIES)}, add stages or use fewer microbatches")
        for k in best[1]:
            chosen[k] = best[2]
