"""Execute any schedule table inside ``jax.shard_map`` (manual over ``pipe`` and the
batch axes): ``pipeline_grads``.

Every device runs the same program: a ``lax.scan`` over the schedule's fused
ticks (``tickplan``: up to one forward, one backward and one weight-gradient task
per device and tick). A tick (``ticks.py``) runs each part's branch for this
device (``stage.py``), adds the weight-gradient contributions under ``cond``s on
the table, and moves activations and gradients one device along the ring with
``ppermute``s that every device executes, outside every branch. With an automatic
mesh axis > 1 (tensor), the parts run in lockstep (``spmd.needs_lockstep``); expert
is a manual batch axis whose devices hold their own experts (``experts.py``), and with it
> 1 a tick's parts and transfers are chained in one order (``spmd.branch_collectives``).

Memory. What a microbatch leaves behind between its forward and its backward is
kept in slot buffers as deep as the fused schedule keeps microbatches alive on a
device, not ``m``, one per remat policy (``stage.py``); only the task's own slot
enters a branch.

The model enters through three functions (the pipeline model contract, see
``contract.py``): ``embed(embed_params, tokens) -> h``, ``layer(layer_params, h)
-> h`` scanned over a chunk's slice of the stacked blocks (``StageLayout`` says
which layers each chunk runs; uneven stages are padded and the padding skipped
by ``lax.cond``), and ``head_loss(head_params, h, targets) -> mean loss``.
Gradients of the first (embed) and last (head) stages are formed on the devices
that own them and summed over ``pipe`` once, at the end, outside every branch.
Chunk gradients are averaged over the batch axes after the last tick, or, with
``grad_sync="chunk"``, behind the ticks that follow each chunk's last backward
(``tickloop.py``), each device sending only its own shards (``ringsync.py``).
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from mindpipe_jax.errors import ConfigError
from mindpipe_jax.parallel import overlap
from mindpipe_jax.parallel.mesh import manual_axis_names
from mindpipe_jax.parallel.ordered_sum import ordered_sum
from mindpipe_jax.parallel.pipeline.runtime import experts, fsdp, ringsync
from mindpipe_jax.parallel.pipeline.runtime.layout import StageLayout
from mindpipe_jax.parallel.pipeline.runtime.spmd import (
    AXIS,
    BATCH,
    MANUAL,
    StageFns,
    _take,
    _vary,
    branch_collectives,
    needs_lockstep,
)
from mindpipe_jax.parallel.pipeline.runtime.stage import StageTasks
from mindpipe_jax.parallel.pipeline.runtime.tickloop import owned_shards, run_ticks_with_sync
from mindpipe_jax.parallel.pipeline.runtime.tickplan import make_plan
from mindpipe_jax.parallel.pipeline.runtime.ticks import arrival_ranks, make_tick
from mindpipe_jax.parallel.pipeline.schedules import Schedule
from mindpipe_jax.parallel.pipeline.schedules.sync import sync_points

WIRE_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}
FSDP_GATHERS = ("step", "chunk")


def _is_spec(s) -> bool:
    return isinstance(s, P) or hasattr(s, "spec")


def _auto_spec(spec, auto: dict[str, int], stacked: bool) -> P:
    """A parameter's storage spec (``PartitionSpec`` or sharding) over the automatic axes
    only (the manual ones are the pipeline's ``shard_map``'s); ``stacked``: a stack leaf
    ``[L, *rest]`` as a chunk gradient leaf ``[width, *rest]`` (the layer axis not sharded)."""
    entries = tuple(getattr(spec, "spec", spec))
    if stacked:
        entries = (None, *entries[1:])
    keep = []
    for entry in entries:
        axes = tuple(a for a in (entry if isinstance(entry, tuple) else (entry,)) if a in auto)
        keep.append(axes[0] if len(axes) == 1 else (axes or None))
    return P(*keep)


def _in_lockstep(body, lockstep: bool):
    """``body``, telling the stage code it traces whether the stages run in lockstep
    (``overlap.stages_in_lockstep``: a collective matmul needs it)."""
    def run(*args):
        with overlap.stages_in_lockstep(lockstep):
            return body(*args)
    return run


def _ordered_results(acc, dims, ends, embed_p, chunks, head_p, *, groups: int, levels: int, per_group: int,
                     n_batch: int):
    """``pipeline_grads(deterministic=True)``'s results from its pairwise accumulators:
    each accumulator's top row (the device's units summed as a balanced tree), summed
    over the batch devices in device order (``ordered_sum``), then each device's
    storage piece. The same shapes as the other paths'. Every unit's gradient already
    carries 1 / per_group (the loss seed); the scales are powers of two, so exact."""
    v = jax.tree.leaves(chunks)[0].shape[0]

    def tops(x, n):  # [n · levels, ...] -> each accumulator's top row, [n, ...]
        x = x.reshape(n, levels, *x.shape[1:]) if n * levels > 1 else x[None, None]
        return x[:, -1]

    def batch_mean(tree):
        return jax.tree.map(lambda x: x / n_batch, ordered_sum(tree, BATCH))

    loss = ordered_sum(lax.psum(tops(acc["loss"], groups), AXIS), BATCH) / (per_group * n_batch)
    out = {}
    for name, params in (("embed", embed_p), ("head", head_p)):
        # One owner per leaf (zeros elsewhere): the sum over pipe is exact in any order.
        g = batch_mean(lax.psum(jax.tree.map(lambda x: tops(x, groups), acc[name]), AXIS))
        splits = jax.tree.map(lambda e: fsdp.EndSplit(e.dim + 1, e.axes), ends[name])
        g = fsdp.local_piece(g, splits)  # with the group axis leading
        out[name] = jax.tree.map(lambda x, p: (x if groups > 1 else x[0]).astype(p.dtype), g, params)
    blocks = batch_mean(jax.tree.map(lambda x: tops(x, groups * v), acc["blocks"]))  # [G · v, width, ...]
    blocks = fsdp.local_shard(blocks, dims["blocks"], offset=2)
    d_blocks = jax.tree.map(lambda g, x: g.reshape(groups, v, *g.shape[1:]).astype(x.dtype)[None], blocks,
                            chunks)
    if groups == 1:  # [1, v, width, ...]
        d_blocks = jax.tree.map(lambda g: g[:, 0], d_blocks)
        loss = loss[0]
    # Nothing downstream fuses into the sums: their bits are the promise. (One barrier
    # per leaf: a barrier's outputs vary over every axis any of its operands does.)
    return jax.tree.map(lax.optimization_barrier, (loss, out["embed"], d_blocks, out["head"]))


# XLA:GPU as jax 0.11.2 ships it segfaults in its SPMD partitioner (Shardy) when it
# compiles the chunk ring's steps inside the tick loop, on every variant and workaround
# tried (benchmarks/results/2026-12-04-h200-hlo-checks-2.txt, bisected with
# benchmarks/gpu/compile_variants.py); XLA:CPU compiles the same program. A crash cannot
# be caught, so the ring is refused there before tracing. Earlier jax releases were not
# compiled for a GPU; compile_variants.py sets this to None to try a release again.
CHUNK_RING_CRASHES_XLA_GPU_FROM: tuple[int, int] | None = (0, 11)


def chunk_ring_compiles_on(platform: str) -> bool:
    """Whether this JAX's XLA for ``platform`` compiles ``grad_sync="chunk"``'s ring (above)."""
    if platform not in ("gpu", "cuda", "rocm") or CHUNK_RING_CRASHES_XLA_GPU_FROM is None:
        return True
    version = tuple(int(x) for x in jax.__version__.split(".")[:2])
    return version < CHUNK_RING_CRASHES_XLA_GPU_FROM


def refuse_chunk_ring_where_xla_crashes(platform: str) -> None:
    if not chunk_ring_compiles_on(platform):
        raise ConfigError(
            f"parallel.grad_sync='chunk' runs a gradient ring inside the pipeline's tick loop, which "
            f"XLA:{platform.upper()} of jax {jax.__version__} crashes compiling (seen on jax 0.11.2 "
            f"for 8 GPUs); use parallel.grad_sync='overlap' (each chunk's sync issued as it "
            f"finishes) or 'end'")


def pipeline_grads(fns: StageFns, schedule: Schedule, mesh, *, remat=True,
                   layout: StageLayout | None = None, active_layers: int | None = None,
                   nan_bubbles: bool = False,
                   grad_sync: str = "end", sync_bucket_bytes: int | None = None,
                   grad_sync_dtype: str = "fp32", lockstep: bool | None = None, fuse_mode: str = "auto",
                   fuse_cost=None, param_specs=None, fsdp_gather: str = "step", split_backward: bool = True,
                   gradient_groups: int = 1, deterministic: bool = False, merge_first: bool | None = None,
                   merge_last: bool | None = None):
    """Build ``f(embed_p, blocks_p, head_p, inputs, targets, block_context=None) -> (loss, grads)``.

    ``blocks_p`` leaves have a leading layer axis ``L``, split into stages by
    ``layout`` (default: evenly, L divisible by p·v); inputs
    and targets are ``[m, microbatch, length]``. Returns the mean loss over the m
    microbatches and the gradients of all three parameter groups, with the same
    structure and layer order as the inputs.
    ``remat``: one policy per global stage ("none", "dots" or "full", see the
    ``stage.py``), one name for all, or a bool (True = "full" everywhere,
    False = "none" everywhere).
    ``active_layers``: only the stack's first ``active_layers`` layers run (a shallow
    subnet, ``supernet/pipelined_sliced.py``): each stage skips its layers past it
    (``cond`` on a count that depends only on the stage, so every device of the stage
    takes the same branch; in lockstep they are computed and dropped) and their
    gradients are zero. Each stage keeps its layers: nothing moves between stages. A
    split backward skips them in B and in W alike (``bwsplit.ChunkSplit``'s count), as
    it skips the padding of uneven stages.
    ``nan_bubbles`` fills every buffer slot with NaN before use: a test mode that
    proves idle slots never reach the results.
    ``grad_sync``: when each chunk's gradient is averaged over the batch axes.
    ``"end"`` (Megatron-style): all of them after the last tick. ``"chunk"``
    (AFAPAB): after each chunk's last backward (``sync.sync_points``) its
    gradient's sync starts and runs one ring step per tick beside the ticks still
    to come (``ringsync.py``); what the remaining ticks cannot hide, and a chunk
    that finishes at the last tick, is synced after them. Embedding and head
    gradients (small, owned by one stage each) are synced at the end.
    ``"overlap"`` (Megatron's ``--overlap-grad-reduce``): at the same points, each
    finished chunk's gradient is averaged at once, one collective per leaf issued
    before the remaining ticks (an asynchronous collective runs behind them), with no
    ring (``tickloop._early_means``).
    ``sync_bucket_bytes`` cuts a chunk's ring into buckets of at most that size
    (None: one bucket), i.e. at most bucket/d bytes per tick and device.
    ``grad_sync_dtype``: the gradients' dtype on the wire of every batch-axis sync
    (``"fp32"``, or ``"bf16"``: half the bytes, sums still in fp32, see ``ringsync``).
    A chunk's ring sends each device's own shards of leaves sharded over an automatic
    axis (tensor: read from ``param_specs``; ``ringsync.LocalRing``).
    ``lockstep``: run every tick's work on every device (see ``needs_lockstep``);
    None decides from the mesh. ``merge_first``, ``merge_last``: the first / the last
    stage shares the middle stages' branches (``make_plan``); None: in lockstep (False
    there runs them apart, what ``benchmarks/pipeline_lockstep.py`` compares).
    ``fuse_mode``, ``fuse_cost``: how the table is re-timed
    into fused ticks (``schedules.fused.fuse``; "table" runs one task per tick; "auto"
    picks the fastest under ``fuse_cost``, e.g. measured F/B/W/BW times).
    ``param_specs``: ``{"embed", "blocks", "head"}`` trees of the parameters' storage
    ``PartitionSpec``s (or shardings); a weight stored sharded over ``fsdp`` stays so
    going in, is gathered once per step inside, and its gradient leaves reduce-scattered
    (``fsdp.py``); MoE experts stay split over ``expert`` (``experts.py``). None: all whole.
    ``fsdp_gather``: when those weights are gathered: ``"step"``, once per step on each
    stage (the gathered stage stays for the step); ``"chunk"``, for each task's use of
    its chunk, the chunk's gradient reduce-scattered after each task (``fsdp.py``).
    ``split_backward=False``: B and W tasks each form the whole vjp and keep their half,
    instead of splitting the backward's equations (``bwsplit``), for stage code whose
    split jaxprs cannot be replayed: the collective matmul's rings (``parallel/overlap.py``)
    retype their values inside nested ``shard_map``s in ways a re-evaluated jaxpr does not
    reproduce.
    ``block_context``: per-microbatch inputs of the layers that are not weights (a
    supernet's subnet rows, ``supernet/pipelined.py``; the GPT's dropout keys,
    ``dropout_keys.py``): a dict of leaves ``[L, m, ...]``; a task's layers get
    ``{**their weights, **the rows of its microbatch}`` (``blocks_p`` then a dict with
    other keys), on uneven stages too (a padded slot's rows are layer 0's, its layer
    skipped or its output dropped). No gradient is formed for them.
    ``gradient_groups`` = G > 1: the m microbatches are G consecutive groups (e.g. one
    subnet each) whose gradients and losses are kept apart, not summed: ``loss`` is
    ``[G]`` (each group's mean) and every gradient leaf gets a leading ``[G]`` axis, each
    group's the mean over its own microbatches. It costs G accumulators per device;
    with ``grad_sync="end"``, fp32, even stages and fsdp weights gathered once per step
    only. (The SPara step through a pipeline keeps its subnets apart with it, and the
    train step's noise statistics its two halves.)
    ``deterministic``: the gradients' and the loss's bits do not depend on how many
    batch devices (``data`` x ``fsdp``) there are, only on the units: each device's
    microbatches are its contiguous units of the global batch (the caller cuts the rows
    so, as ``train/step.py``'s ``unit_microbatches`` does), every unit's gradient is computed by the same
    task program on any layout, and they are added in one balanced tree over the
    units' global order: on each device over its microbatches as they finish
    (``ticks._pairwise_add``: log2(m)+1 accumulators instead of one), then over the
    devices in order (``ordered_sum``: every device's sum gathered unreduced). Needs a
    power-of-two microbatch count (per gradient group), ``grad_sync="end"``, fp32, fsdp
    weights gathered once per step and a schedule whose weight gradients reach each
    accumulator in an order that keeps the tree (``ticks.arrival_ranks``: in order, as
    1F1B and the zero-bubble ones add them, or reversed, as GPipe does).
    """
    if fsdp_gather not in FSDP_GATHERS:
        raise ValueError(f"fsdp_gather {fsdp_gather!r} is not one of {', '.join(FSDP_GATHERS)}")
    n_batch = math.prod(mesh.shape[a] for a in BATCH)
    if grad_sync_dtype not in WIRE_DTYPES:
        raise ValueError(f"grad_sync_dtype {grad_sync_dtype!r} is not one of {', '.join(WIRE_DTYPES)}")
    wire = WIRE_DTYPES[grad_sync_dtype]
    manual = manual_axis_names(mesh, MANUAL)
    auto = {a: n for a, n in mesh.shape.items() if a not in manual}
    experts.check_supported(mesh, deterministic)

    def on_shards(fn, tree, specs):
        """A narrow wire's mean reshapes the gradients: on each device's own shards
        (``ringsync.on_shards``); fp32's ``pmean`` needs no reshape."""
        return fn(tree) if wire == jnp.float32 else ringsync.on_shards(fn, tree, specs, auto)
    if lockstep is None:
        lockstep = needs_lockstep(mesh)
    # In lockstep every device runs every branch of a tick: the first stage shares the
    # middle stages' branches (position EITHER), so its layers are not run a second time.
    # So do the last stage's (its forward runs its layers and the loss), so a tick runs a
    # kind's layers once whatever stages its tasks are at.
    plan = make_plan(schedule, remat, fuse_mode, split_backward=split_backward, fuse_cost=fuse_cost,
                     merge_first=lockstep if merge_first is None else merge_first,
                     merge_last=lockstep if merge_last is None else merge_last)
    points = sync_points(plan.fused, grad_sync)
    if grad_sync == "chunk" and n_batch > 1 and any(sp.after_tick + 1 < plan.num_ticks for sp in points):
        refuse_chunk_ring_where_xla_crashes(mesh.devices.flat[0].platform)
    p, v, m = schedule.num_stages, schedule.virtual_stages, schedule.num_microbatches
    groups = gradient_groups
    if groups > 1 and (m % groups or grad_sync != "end" or (layout is not None and not layout.uniform)
                       or wire != jnp.float32 or (fsdp_gather == "chunk" and mesh.shape[fsdp.FSDP] > 1)):
        raise ValueError(f"gradient_groups={groups} needs m={m} divisible by it, grad_sync='end' (got "
                         f"{grad_sync!r}), fp32 sync, even stages and fsdp weights gathered once per step")
    levels, ranks = 1, None
    if deterministic:
        per_group = m // groups
        if per_group & (per_group - 1) or grad_sync != "end" or wire != jnp.float32 or \
                (fsdp_gather == "chunk" and mesh.shape[fsdp.FSDP] > 1):
            raise ValueError(f"deterministic=True needs a power-of-two microbatch count per gradient group "
                             f"(got {per_group}), grad_sync='end' (got {grad_sync!r}), fp32 sync and fsdp "
                             f"weights gathered once per step")
        levels = per_group.bit_length()
        ranks = arrival_ranks(plan, groups)
        if ranks is None:
            raise ValueError(f"deterministic=True: schedule {schedule.name!r} adds some accumulator's "
                             f"microbatches in an order that changes their balanced tree")
    if layout is not None and (layout.p, layout.v) != (p, v):
        raise ValueError(f"layout is for p={layout.p}, v={layout.v}; the schedule has p={p}, v={v}")
    if layout is not None:  # the layers follow the schedule's placement (e.g. a V)
        layout = dataclasses.replace(layout, placement=schedule.placement)
    # XLA:CPU starts independent ops in any order per device: with collectives inside
    # the ticks (lockstep, or an expert axis's all_to_all), a ring step beside them could
    # pair up wrongly. GPUs run one fixed order, so there the ring stays free to overlap
    # the tick.
    serialize_ring = (lockstep or branch_collectives(mesh)) and mesh.devices.flat[0].platform == "cpu"

    def per_chunk(dims) -> bool:  # the weights gathered per task (fsdp_gather="chunk")
        return fsdp_gather == "chunk" and mesh.shape[fsdp.FSDP] > 1 and \
            any(d >= 0 for d in jax.tree.leaves(dims))

    def grouped(splits):
        """Ends' splits of a gradient with a leading group axis."""
        return jax.tree.map(lambda e: fsdp.EndSplit(e.dim + 1, e.axes) if e.axes else e, splits)

    def body(dims, ends, auto_specs, counts, width, embed_p, blocks_p, head_p, inputs, targets, context):
        stage_idx = lax.axis_index(AXIS)
        # Sharded over fsdp (the ends perhaps over pipe too) in storage: gathered once
        # per step here (fsdp.py).
        embed_p, head_p = fsdp.gather_ends(embed_p, ends["embed"]), fsdp.gather_ends(head_p, ends["head"])
        sharded = per_chunk(dims["blocks"])
        if not sharded:
            blocks_p = fsdp.gather(blocks_p, dims["blocks"], offset=3)  # [1, v, width, *rest]
        # Per-device copies: vjps w.r.t. invariant values would insert a psum inside
        # a branch (a hang) and double-count; varying values keep gradients local.
        embed_p, head_p = _vary(embed_p), _vary(head_p)
        chunks = _vary(jax.tree.map(lambda x: x[0], blocks_p))  # [v, L_chunk, ...] on this device
        stage = {"embed": embed_p, "chunks": chunks, "head": head_p}
        if context is not None:  # [v, L_chunk, m, ...] on this device
            stage["context"] = _vary(jax.tree.map(lambda x: x[0], context))
        gather_scatter = None
        if sharded:  # the chunks stay fsdp shards; each task's chunk is gathered in its tick
            stage["chunk_example"] = _vary(fsdp.gathered_zeros(_take(chunks, 0), dims["blocks"], offset=1))
            gather_scatter = (lambda c: fsdp.gather(_take(chunks, c), dims["blocks"], offset=1),
                              lambda g: fsdp.sum_scatter(g, dims["blocks"], offset=1))
        inputs, targets = _vary(inputs), _vary(targets)
        fill = jnp.nan if nan_bubbles else 0.0
        tasks = StageTasks(fns, plan, stage, (inputs, targets),
                           counts, width, stage_idx, lockstep=lockstep, fill=fill,
                           num_microbatches=m // groups)  # the loss seed: 1 / microbatches per group
        h = tasks.h_shape
        x_buf = _vary(jnp.full((plan.x_slots, *h.shape), fill, h.dtype))
        g_buf = _vary(jnp.full((plan.g_slots, *h.shape), fill, h.dtype))
        def zeros(tree, lead=()):  # the accumulators: one per gradient group (G > 1)
            return jax.tree.map(lambda x: jnp.zeros((*lead, *x.shape), jnp.float32), tree)
        rows = groups * levels  # accumulators per part (levels > 1: pairwise, ticks._pairwise_add)
        lead = (rows,) if rows > 1 else ()
        blocks_acc = jax.tree.map(lambda x: jnp.zeros((rows * v, *x.shape[1:]), jnp.float32), chunks)
        acc = _vary({"embed": zeros(embed_p, lead), "head": zeros(head_p, lead), "blocks": blocks_acc,
                     "loss": jnp.zeros(lead, jnp.float32)})
        res_buf = _vary(tasks.residual_buffers())
        stash_buf = _vary(tasks.stash_buffers())
        tick = make_tick(plan, tasks, stage_idx, lockstep=lockstep, per_chunk=gather_scatter, groups=groups,
                         levels=levels, ranks=ranks, ordered=branch_collectives(mesh))

        def mean_of_chunk(grads):
            """A chunk's gradient averaged over the batch axes, each device keeping its fsdp
            shard. Gathered per task, it is a shard of the sum over fsdp already."""
            if sharded:
                return fsdp.mean_of_scattered(grads, dims["blocks"], BATCH, wire, experts=dims["experts"])
            return fsdp.mean_scatter(grads, dims["blocks"], BATCH, offset=1, wire_dtype=wire,
                                     experts=dims["experts"])
        carry = (acc, x_buf, g_buf, res_buf, stash_buf)
        if deterministic:
            acc = lax.scan(tick, carry, jnp.arange(plan.num_ticks))[0][0]
            return _ordered_results(acc, dims, ends, embed_p, chunks, head_p, groups=groups, levels=levels,
                                    per_group=m // groups, n_batch=n_batch)
        if groups > 1:  # every group's gradients averaged after the last tick (grad_sync="end")
            acc = lax.scan(tick, carry, jnp.arange(plan.num_ticks))[0][0]
            loss = lax.pmean(lax.psum(acc["loss"], AXIS), BATCH) / (m // groups)
            # Every split dimension one further along: the group axis leads.
            means = {name: fsdp.sum_over_pipe_then_mean(acc[name], grouped(ends[name]), BATCH)
                     for name in ("embed", "head")}
            out = {name: jax.tree.map(lambda g, x: g.astype(x.dtype), means[name], params)
                   for name, params in (("embed", embed_p), ("head", head_p))}
            # [groups · v, width, *rest]: fsdp (where stored split) at 2 + its dim in rest.
            blocks = fsdp.mean_scatter(acc["blocks"], dims["blocks"], BATCH, offset=2,
                                       experts=dims["experts"])
            d_blocks = jax.tree.map(lambda g, x: g.reshape(groups, v, *g.shape[1:]).astype(x.dtype)[None],
                                    blocks, chunks)
            return loss, out["embed"], d_blocks, out["head"]
        # A chunk's gradient leaves are [width, *rest].
        carry, synced = run_ticks_with_sync(
            tick, carry, plan.num_ticks, points, n_batch=n_batch, bucket_bytes=sync_bucket_bytes,
            serialize_ring=serialize_ring, specs=auto_specs["blocks"], auto=auto, wire_dtype=wire,
            mean=lambda g: on_shards(mean_of_chunk, g, auto_specs["blocks"]),
            owned=owned_shards(dims["blocks"], dims["experts"], fsdp_size=mesh.shape[fsdp.FSDP],
                               chunked=per_chunk(dims["blocks"]), wire_dtype=wire,
                               local=lambda fn, g: on_shards(fn, g, auto_specs["blocks"])),
            ring=grad_sync != "overlap")
        # Embed/head gradients live on their owners only (zeros elsewhere): summed over
        # pipe once (reduce-scattered where they are stored split over it). Shards hold
        # equal row counts, so the global mean over the batch axes is the mean of the
        # shard means.
        acc = carry[0]
        loss = lax.pmean(lax.psum(acc["loss"], AXIS), BATCH) / m
        for name, params in (("embed", embed_p), ("head", head_p)):
            mean = on_shards(lambda t, name=name: fsdp.sum_over_pipe_then_mean(t, ends[name], BATCH, wire),
                             acc[name], auto_specs[name])
            synced[name] = jax.tree.map(lambda g, x: g.astype(x.dtype), mean, params)
        d_blocks = jax.tree.map(lambda x, *cs: jnp.stack(cs).astype(x.dtype)[None], chunks,
                                *(synced[c] for c in range(v)))
        return loss, synced["embed"], d_blocks, synced["head"]

    def run(embed_p, blocks_p, head_p, inputs, targets, block_context=None):
        num_layers = jax.tree.leaves(blocks_p)[0].shape[0]
        stage_layout = layout or StageLayout.even(num_layers, p, v, schedule.placement)
        staged = stage_layout.to_stages(blocks_p)
        # How many of its layers each chunk runs (None: all of them, the plain scan).
        skips = active_layers is not None and active_layers < num_layers
        counts = None if stage_layout.uniform and not skips else \
            jnp.asarray(stage_layout.counts_array(active_layers if skips else None))
        if block_context is not None and set(block_context) & set(blocks_p):
            raise ValueError("block_context needs keys other than blocks_p's")
        context = None if block_context is None else stage_layout.to_stages(block_context)
        rows = P(None, BATCH)
        specs = param_specs if mesh.shape.get(fsdp.FSDP, 1) > 1 else None
        # A stack leaf [L, *rest] is staged as [p, v, width, *rest]: its dims count in rest.
        shape, in_rest = dict(mesh.shape), lambda d: d - 1 if d >= 0 else d
        dims = {"blocks": jax.tree.map(in_rest, fsdp.dims_of(specs and specs["blocks"], blocks_p)),
                "experts": experts.stack_dims(param_specs, embed_p, blocks_p, head_p, shape)}
        ends = {name: fsdp.end_splits(param_specs and param_specs[name], tree, shape)
                for name, tree in (("embed", embed_p), ("head", head_p))}
        spec_e = jax.tree.map(fsdp.EndSplit.spec, ends["embed"])
        spec_h = jax.tree.map(fsdp.EndSplit.spec, ends["head"])
        # [p, (G,) v, width, *rest]: fsdp and expert at their dims in rest
        stack_spec = partial(experts.stack_specs, dims["blocks"], dims["experts"])
        spec_b = stack_spec((AXIS, None, None))
        out_e, out_b, out_h = spec_e, spec_b, spec_h
        if groups > 1:  # the gradients have a group axis: [G, ...] ends, [p, G, v, width, ...] blocks
            out_e, out_h = (jax.tree.map(fsdp.EndSplit.spec, grouped(ends[n])) for n in ("embed", "head"))
            out_b = stack_spec((AXIS, None, None, None))
        # Each group's sharding over the automatic axes (tensor, expert), which the
        # gradient syncs need to work on each device's own shards.
        auto_specs = {name: None if param_specs is None else jax.tree.map(
            lambda s, stacked=name == "blocks": _auto_spec(s, auto, stacked), param_specs[name],
            is_leaf=_is_spec) for name in ("embed", "blocks", "head")}
        fn = jax.shard_map(_in_lockstep(partial(body, dims, ends, auto_specs, counts, stage_layout.width),
                                        lockstep), mesh=mesh,
                           axis_names=manual,
                           in_specs=(spec_e, spec_b, spec_h, rows, rows,
                                     jax.tree.map(lambda _: P(AXIS), context)),
                           out_specs=(P(), out_e, out_b, out_h))
        loss, d_embed, d_blocks, d_head = fn(embed_p, staged, head_p, inputs, targets, context)
        if groups > 1:  # [p, G, v, width, ...]: each group's layers back in order
            by_group = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), d_blocks)
            d_blocks = jax.vmap(stage_layout.from_stages)(by_group)
        else:
            d_blocks = stage_layout.from_stages(d_blocks)
        return loss, {"embed": d_embed, "blocks": d_blocks, "head": d_head}

    return run
