"""Execute any schedule table inside ``jax.shard_map`` (manual over ``pipe`` only).

Every device runs the same program: a ``lax.scan`` over the table's ticks. In a
tick each device looks up its own cell of the table and ``lax.switch``es to that
task's branch — forward, fused backward, input-gradient or weight-gradient, for
the first, a middle or the last global stage — or to the idle branch, which
computes nothing. After the switch, and never inside a branch (a collective in
one branch only would hang the others), every device executes the same two
``ppermute``s: activations one device down the ring, gradients one device up.
With an automatic mesh axis > 1 (tensor, expert) the ticks run in lockstep
instead (``needs_lockstep``): the model's own collectives may sit in the stage
code, so every device runs every task kind of the tick and keeps its own.

Memory. What a microbatch leaves behind between its forward and its backward is
kept in slot buffers whose size is the schedule's peak number of live
microbatches on a device, not ``m``: slots are assigned in Python by interval
colouring of each (microbatch, chunk)'s lifetime, so any schedule works. Each
global stage has its own remat policy (``tickplan.REMAT_POLICIES``): "none"
keeps the forward's residuals (``residuals.py``) and recomputes nothing; "dots"
keeps the residuals of the stage's forward under ``jax.checkpoint`` with
``dots_with_no_batch_dims_saveable`` (the projection outputs; attention and
elementwise work are recomputed); "full" keeps only the stage input (one
``[microbatch, length, d_model]`` activation per slot) and re-runs the stage's
forward in its backward. Every device runs the same program, so each policy's
buffer is as deep as the deepest stage using that policy needs: a plan that
puts "full" on the early stages (many microbatches in flight under 1F1B) and
"none" on the late ones (few) keeps little and recomputes little. Only the
task's own slot enters the switch.
The last stage's forward is folded into its backward (the loss and its gradient
are one vjp), so its F tick computes nothing.

The model enters through three functions (the pipeline model contract, see
``contract.py``): ``embed(embed_params, tokens) -> h``, ``layer(layer_params, h)
-> h`` scanned over a chunk's slice of the stacked blocks (``StageLayout`` says
which layers each chunk runs; uneven stages are padded and the padding skipped
by ``lax.cond``), and ``head_loss(head_params, h, targets) -> mean loss``.
Gradients of the first (embed) and last (head) stages are formed on the devices
that own them and summed over ``pipe`` once, at the end, outside every branch.

Known cost: with a split backward (ZB-H1) both the B and the W task form the
whole vjp of the stage and keep half of it; XLA drops the unused weight half of
a B but a W still costs about a full backward (see benchmarks/pipeline.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from mindpipe_jax.parallel.pipeline.gradsync import sync_points
from mindpipe_jax.parallel.pipeline.layout import StageLayout
from mindpipe_jax.parallel.pipeline.residuals import ResidualStore
from mindpipe_jax.parallel.pipeline.ringsync import RingSync, flatten
from mindpipe_jax.parallel.pipeline.schedules import Kind, Schedule
from mindpipe_jax.parallel.pipeline.tickplan import FIRST, LAST, REMAT_POLICIES, Plan, make_plan

__all__ = ["AXIS", "BATCH", "MANUAL", "REMAT_POLICIES", "StageFns", "StageLayout", "Plan", "make_plan",
           "pipeline_grads"]

AXIS = "pipe"
# The batch axes are manual too: each data shard runs the schedule on its own rows
# and the gradients are averaged over them once, after the last tick. Leaving them
# to the compiler instead made XLA 0.10's SPMD partitioner abort on pipe × data ×
# tensor meshes; manual batch axes are also where AFAPAB's explicit gradient sync lives.
BATCH = ("data", "fsdp")
MANUAL = (AXIS, *BATCH)


@dataclasses.dataclass(frozen=True)
class StageFns:
    """The pipeline model contract as three pure functions of (params, inputs)."""

    embed: Callable[[Any, jax.Array], jax.Array]
    layer: Callable[[Any, jax.Array], jax.Array]  # one block: (its params, h) -> h
    head_loss: Callable[[Any, jax.Array, jax.Array], jax.Array]


# ----------------------------------------------------------------------------
# Execution inside shard_map.
# ----------------------------------------------------------------------------


def needs_lockstep(mesh) -> bool:
    """Whether stage code may hold collectives that a per-device branch would strand.

    Inside the ``shard_map`` only the pipe and batch axes are manual; any other axis
    of size > 1 (tensor, expert) is left to XLA, which inserts whatever collectives
    the model's shardings need, wherever it likes. An all-reduce among one stage's
    tensor group survives a per-device ``lax.switch`` (the group takes the same
    branch), but a resharding collective-permute is one instruction over every
    device of the mesh: inside a branch that only one stage takes it waits for
    devices that never come (XLA aborts). Which kind XLA picks depends on the
    model, so the runtime does not bet on it: with such an axis every device runs
    every task kind some stage runs in that tick (``cond`` on a predicate read
    from the table, the same on all devices) and keeps its own task's outputs.
    The price is compute: a tick costs the sum of its task kinds instead of the
    largest (benchmarks/pipeline_lockstep.py measures it).
    """
    return any(size > 1 for axis, size in mesh.shape.items() if axis not in MANUAL)


def _vary(tree):
    """Mark values as varying over every manual axis (loop carries and branch outputs
    must agree; and a vjp w.r.t. an invariant value would insert a psum in a branch)."""
    def one(x):
        missing = tuple(a for a in MANUAL if a not in jax.typeof(x).manual_axis_type.varying)
        return lax.pcast(x, missing, to="varying") if missing else x
    return jax.tree.map(one, tree)


def _zeros_like(tree, dtype=None):
    return jax.tree.map(lambda x: jnp.zeros(x.shape, dtype or x.dtype), tree)


def _add_at(tree, index, update):
    return jax.tree.map(
        lambda a, u: lax.dynamic_update_index_in_dim(
            a, lax.dynamic_index_in_dim(a, index, 0, keepdims=False) + u.astype(a.dtype), index, 0),
        tree, update)


def _take(tree, index):
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, index, 0, keepdims=False), tree)


def _put(buf, index, value):
    return lax.dynamic_update_index_in_dim(buf, value.astype(buf.dtype), index, 0)


def pipeline_grads(fns: StageFns, schedule: Schedule, mesh, *, remat=True,
                   layout: StageLayout | None = None, nan_bubbles: bool = False,
                   grad_sync: str = "end", sync_bucket_bytes: int | None = None,
                   lockstep: bool | None = None):
    """Build ``f(embed_p, blocks_p, head_p, inputs, targets) -> (loss, grads)``.

    ``blocks_p`` leaves have a leading layer axis ``L``, split into stages by
    ``layout`` (default: evenly, L divisible by p·v); inputs
    and targets are ``[m, microbatch, length]``. Returns the mean loss over the m
    microbatches and the gradients of all three parameter groups, with the same
    structure and layer order as the inputs.
    ``remat``: one policy per global stage ("none", "dots" or "full", see the
    module docstring), one name for all, or a bool (True = "full" everywhere,
    False = "none" everywhere).
    ``nan_bubbles`` fills every buffer slot with NaN before use: a test mode that
    proves idle slots never reach the results.
    ``grad_sync``: when each chunk's gradient is averaged over the batch axes.
    ``"end"`` (Megatron-style): all of them after the last tick. ``"chunk"``
    (AFAPAB): after each chunk's last backward (``gradsync.sync_points``) its
    gradient's sync starts and runs one ring step per tick beside the ticks still
    to come (``ringsync.py``); what the remaining ticks cannot hide, and a chunk
    that finishes at the last tick, is synced after them. Embedding and head
    gradients (small, owned by one stage each) are synced at the end.
    ``sync_bucket_bytes`` cuts a chunk's ring into buckets of at most that size
    (None: one bucket), i.e. at most bucket/d bytes per tick and device.
    ``lockstep``: run every tick's work on every device (see ``needs_lockstep``);
    None decides from the mesh.
    """
    points = sync_points(schedule, grad_sync)
    n_batch = math.prod(mesh.shape[a] for a in BATCH)
    plan = make_plan(schedule, remat)
    p, v, m = schedule.num_stages, schedule.virtual_stages, schedule.num_microbatches
    ticks = schedule.num_ticks
    if layout is not None and (layout.p, layout.v) != (p, v):
        raise ValueError(f"layout is for p={layout.p}, v={layout.v}; the schedule has p={p}, v={v}")

    counts = None if layout is None or layout.uniform else jnp.asarray(layout.counts_array())

    if lockstep is None:
        lockstep = needs_lockstep(mesh)
    # XLA:CPU starts independent ops in any order per device: with collectives inside
    # the ticks (lockstep), a ring step beside them could pair up wrongly. GPUs run one
    # fixed order, so there the ring stays free to overlap the tick.
    serialize_ring = lockstep and mesh.devices.flat[0].platform == "cpu"

    def layers_runner(layer):
        def run_layers(c, x):
            """A chunk's layers; with uneven stages ``c`` carries the real layer count."""
            if counts is None:
                return lax.scan(lambda h, lp: (layer(lp, h), None), x, c)[0]

            def one(h, xs):
                lp, i = xs
                if lockstep:  # the layer count differs per stage: compute, then keep or drop
                    return jnp.where(i < c["n"], layer(lp, h), h), None
                return lax.cond(i < c["n"], layer, lambda _, hh: hh, lp, h), None
            return lax.scan(one, x, (c["w"], jnp.arange(layout.width)))[0]
        return run_layers

    run_layers = layers_runner(fns.layer)
    # What a stage under each residual policy differentiates (per layer, so the
    # policy applies inside the scan over the chunk's layers).
    residual_fns = {"none": run_layers,
                    "dots": layers_runner(jax.checkpoint(
                        fns.layer, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable))}

    def body(embed_p, blocks_p, head_p, inputs, targets):
        stage_idx = lax.axis_index(AXIS)
        # Per-device copies: vjps w.r.t. invariant values would insert a psum inside
        # a branch (a hang) and double-count; varying values keep gradients local.
        embed_p, head_p = _vary(embed_p), _vary(head_p)
        chunks = _vary(jax.tree.map(lambda x: x[0], blocks_p))  # [v, L_chunk, ...] on this device
        inputs, targets = _vary(inputs), _vary(targets)
        h_shape = jax.eval_shape(fns.embed, embed_p, inputs[0])
        fill = jnp.nan if nan_bubbles else 0.0
        x_buf = _vary(jnp.full((plan.x_slots, *h_shape.shape), fill, h_shape.dtype))
        g_buf = _vary(jnp.full((plan.g_slots, *h_shape.shape), fill, h_shape.dtype))
        zero_h = _vary(jnp.zeros(h_shape.shape, h_shape.dtype))
        acc = {"embed": _zeros_like(embed_p, jnp.float32), "blocks": _zeros_like(chunks, jnp.float32),
               "head": _zeros_like(head_p, jnp.float32), "loss": jnp.zeros((), jnp.float32)}
        acc = _vary(acc)
        seed = _vary(jnp.asarray(1.0 / m, jnp.float32))

        def chunk_params(chunk):
            if counts is None:
                return _take(chunks, chunk)
            return {"w": _take(chunks, chunk), "n": counts[stage_idx, chunk]}

        def weights(d_c):  # drop the (float0) cotangent of the layer count
            return d_c if counts is None else d_c["w"]

        stores = {r: ResidualStore(residual_fns[r], chunk_params(0), zero_h) for r in plan.res_slots}
        res_buf = _vary({r: stores[r].empty(n, fill) for r, n in plan.res_slots.items()})

        # A backward that re-runs a stage's forward differentiates it with the "dots"
        # checkpoint per layer: the vjp then holds one layer's full residuals at a
        # time instead of the whole chunk's (measured: 32 -> 20 MB per device for
        # 1F1B p=4 with two GPT blocks per stage) for the price of re-running the
        # attention and elementwise work, a few percent of a layer's FLOPs.
        recompute_layers = residual_fns["dots"]

        def stage_fwd(c_params, x, layers=run_layers):
            return layers(c_params, x)

        def first_fwd(e_params, c_params, tokens, layers=run_layers):
            return layers(c_params, fns.embed(e_params, tokens))

        def last_loss(c_params, h_params, x, tgt, layers):
            return fns.head_loss(h_params, layers(c_params, x), tgt)

        def forward(op, c_params, tokens, pos, policy):
            """F of a first or middle stage: the activation to send on, residuals kept."""
            x, res = op["x"], op["res"]
            if policy == "full":  # the stage input stays in its slot until the backward
                return (first_fwd(embed_p, c_params, tokens) if pos == FIRST
                        else stage_fwd(c_params, x)), res
            h = fns.embed(embed_p, tokens) if pos == FIRST else x
            y, kept = stores[policy].forward(c_params, h)
            return y, {**res, policy: kept}

        def backward(op, c_params, tokens, pos, policy):
            """(embed grad or None, chunk grad, input grad) of a first or middle stage."""
            x, dy = op["x"], op["dy"]
            if policy == "full":
                if pos == FIRST:
                    _, vjp = jax.vjp(partial(first_fwd, layers=recompute_layers), embed_p, c_params, tokens)
                    d_e, d_c, _ = vjp(dy)
                    return d_e, d_c, zero_h
                d_c, d_x = jax.vjp(partial(stage_fwd, layers=recompute_layers), c_params, x)[1](dy)
                return None, d_c, d_x
            d_c, d_x = stores[policy].backward(c_params, op["res"][policy], dy)
            if pos == FIRST:  # re-running the embedding lookup is cheaper than keeping it
                _, vjp = jax.vjp(fns.embed, embed_p, tokens)
                return vjp(d_x.astype(zero_h.dtype))[0], d_c, zero_h
            return None, d_c, d_x

        def branches():
            def idle(op):
                return op["acc"], zero_h, zero_h, op["res"]

            def make(kind, pos, policy):
                def run(op):
                    acc, task, x, res = op["acc"], op["task"], op["x"], op["res"]
                    c_params = chunk_params(task["chunk"])
                    tokens = _take(inputs, task["microbatch"])
                    tgt = _take(targets, task["microbatch"])
                    want_w = kind in (Kind.BW, Kind.W)
                    want_x = kind in (Kind.BW, Kind.B)
                    if kind is Kind.F:
                        if pos == LAST:  # the last stage's forward runs inside its backward
                            return acc, zero_h, zero_h, res
                        send_f, res = forward(op, c_params, tokens, pos, policy)
                        return acc, send_f, zero_h, res
                    if pos == LAST:
                        # The last stage's forward runs here, inside its vjp: its policy
                        # only decides whether that vjp holds plain or "dots" residuals.
                        layers = run_layers if policy == "none" else recompute_layers
                        fn = lambda c, h, xx: last_loss(c, h, xx, tgt, layers)  # noqa: E731
                        loss, vjp = jax.vjp(fn, c_params, head_p, x)
                        d_c, d_h, d_x = vjp(seed)
                        if want_x:  # B or BW: counted once per microbatch
                            acc = {**acc, "loss": acc["loss"] + loss.astype(jnp.float32)}
                        if want_w:
                            acc = {**acc, "head": jax.tree.map(jnp.add, acc["head"], d_h),
                                   "blocks": _add_at(acc["blocks"], task["chunk"], weights(d_c))}
                        return acc, zero_h, (d_x if want_x else zero_h), res
                    d_e, d_c, d_x = backward(op, c_params, tokens, pos, policy)
                    if want_w:
                        acc = {**acc, "blocks": _add_at(acc["blocks"], task["chunk"], weights(d_c))}
                        if d_e is not None:
                            acc = {**acc, "embed": jax.tree.map(jnp.add, acc["embed"], d_e)}
                    return acc, zero_h, (d_x if want_x and pos != FIRST else zero_h), res

                return lambda op: _vary(run(op))

            return [lambda op: _vary(idle(op))] + [make(*key) for key in plan.keys]

        table = plan.arrays()
        fwd_perm = [(i, (i + 1) % p) for i in range(p)]
        bwd_perm = [(i, (i - 1) % p) for i in range(p)]
        branch_fns = branches()
        active = jnp.asarray(plan.active())  # [ticks, keys]: the same on every device

        def run_lockstep(branch, t, operand):
            """Every device runs every task kind that some stage runs in tick ``t`` (the
            predicate comes from the table, not the device, so all devices take the same
            side of each ``cond``) and keeps the outputs of its own."""
            out = branch_fns[0](operand)
            for k, fn in enumerate(branch_fns[1:], start=1):
                # Each cond takes the previous one's outputs, so every device runs them in
                # the same order: XLA:CPU starts independent ops in any order per device,
                # and two conds with collectives started in different orders deadlock.
                def run(prev, fn=fn, k=k):
                    return jax.tree.map(lambda n, o: jnp.where(branch == k, n, o), fn(operand), prev)
                out = lax.cond(active[t, k - 1], run, lambda prev: prev, out)
            return out

        def tick(carry, t):
            acc, x_buf_c, g_buf_c, res_c = carry
            task = {k: table[k][t, stage_idx] for k in table}
            task["x_slot"] = jnp.maximum(task["x_slot"], 0)
            # Only this task's slot goes into the switch (not whole buffers, which every
            # branch would otherwise copy); a forward's new residuals are written back
            # after it, every other branch hands the slot back unchanged.
            # Residual slots: the task's own policy's slot; the other buffers lend their
            # slot 0, handed back unchanged.
            res_at = {r: jnp.clip(task["res_slot"], 0, n - 1) for r, n in plan.res_slots.items()}
            operand = {"acc": acc, "task": task, "x": _take(x_buf_c, task["x_slot"]),
                       "dy": _take(g_buf_c, jnp.maximum(task["g_slot"], 0)),
                       "res": {r: ResidualStore.read(res_c[r], res_at[r]) for r in res_c}}
            if lockstep:
                acc, send_f, send_b, res_slot = run_lockstep(task["branch"], t, operand)
            else:
                acc, send_f, send_b, res_slot = lax.switch(task["branch"], branch_fns, operand)
            res_c = {r: ResidualStore.write(res_c[r], res_at[r], res_slot[r]) for r in res_c}
            # Every device takes part in both transfers every tick (outside the branches).
            recv_f = lax.ppermute(send_f, AXIS, fwd_perm)
            recv_b = lax.ppermute(send_b, AXIS, bwd_perm)
            rx, rg = task["recv_x"], task["recv_g"]
            x_new = jnp.where(rx >= 0, recv_f, _take(x_buf_c, jnp.maximum(rx, 0)))
            g_new = jnp.where(rg >= 0, recv_b, _take(g_buf_c, jnp.maximum(rg, 0)))
            x_buf_c = _put(x_buf_c, jnp.maximum(rx, 0), x_new)
            g_buf_c = _put(g_buf_c, jnp.maximum(rg, 0), g_new)
            return (acc, x_buf_c, g_buf_c, res_c), None

        # Embed/head gradients live on their owners only (zeros elsewhere): one psum
        # over pipe. Shards hold equal row counts, so the global mean over the batch
        # axes is the mean of the shard means.
        def run_ticks(carry, first, last, ring=None, phase=None, offset=0):
            """Ticks [first, last); with a ring, one of its steps beside each tick."""
            if last <= first:
                return carry
            if ring is None:
                return lax.scan(tick, carry, jnp.arange(first, last))[0]
            step = ring.scatter_step if phase == "scatter" else ring.gather_step

            def tick_and_step(c, t):
                inner, state = c
                inner, _ = tick(inner, t)
                if serialize_ring:  # the ring's collectives after the tick's, on every device
                    # (its pieces only: they vary over every manual axis as the tick's values
                    # do, and a barrier types all its outputs with the union of its inputs')
                    inner, parts = lax.optimization_barrier((inner, state["parts"]))
                    state = {**state, "parts": parts}
                return (inner, step(state, t - first + offset)), None
            return lax.scan(tick_and_step, carry, jnp.arange(first, last))[0]

        carry, t0, synced, pending = (acc, x_buf, g_buf, res_buf), 0, {}, None
        for end in sorted({sp.after_tick + 1 for sp in points} | {ticks}):
            if pending is not None:
                # The previous chunks' ring runs beside the next ticks, one step each:
                # its reduce-scatter steps, then its all-gathers.
                ring, state, done, unflatten, cs = pending
                for phase, first_k, last_k in (("scatter", 0, ring.scatter_steps),
                                               ("gather", ring.scatter_steps, ring.num_steps)):
                    n = min(end - t0, last_k - done) if first_k <= done < last_k else 0
                    if n > 0:
                        carry, state = run_ticks((carry, state), t0, t0 + n, ring, phase, done - first_k)
                        t0, done = t0 + n, done + n
                pending = (ring, state, done, unflatten, cs)
            carry = run_ticks(carry, t0, end)
            t0 = end
            here = [sp.chunk for sp in points if sp.after_tick + 1 == end]
            if pending is not None:  # not finished behind the ticks: finish it now
                ring, state, done, unflatten, cs = pending
                for k in range(done, ring.num_steps):
                    state = ring.step(state, k)
                synced.update(zip(cs, unflatten(ring.finish(state)), strict=True))
                pending = None
            grads = [_take(carry[0]["blocks"], c) for c in here]
            if end < ticks and n_batch > 1:  # ticks remain: hide the sync behind them
                flat, unflatten = flatten(grads)
                ring = RingSync(flat.size, BATCH, n_batch, sync_bucket_bytes)
                pending = (ring, ring.start(flat, (AXIS,)), 0, unflatten, here)
            else:
                synced.update(zip(here, [jax.tree.map(lambda g: lax.pmean(g, BATCH), g) for g in grads],
                                  strict=True))
        acc = carry[0]
        loss = lax.pmean(lax.psum(acc["loss"], AXIS), BATCH) / m
        owned = lambda g, x: lax.pmean(lax.psum(g, AXIS), BATCH).astype(x.dtype)  # noqa: E731
        synced["embed"] = jax.tree.map(owned, acc["embed"], embed_p)
        synced["head"] = jax.tree.map(owned, acc["head"], head_p)
        d_blocks = jax.tree.map(lambda x, *cs: jnp.stack(cs).astype(x.dtype)[None], chunks,
                                *(synced[c] for c in range(v)))
        return loss, synced["embed"], d_blocks, synced["head"]

    def run(embed_p, blocks_p, head_p, inputs, targets):
        num_layers = jax.tree.leaves(blocks_p)[0].shape[0]
        stage_layout = layout or StageLayout.even(num_layers, p, v)
        staged = stage_layout.to_stages(blocks_p)
        rows = P(None, BATCH)
        fn = jax.shard_map(body, mesh=mesh, axis_names=set(MANUAL),
                           in_specs=(P(), P(AXIS), P(), rows, rows),
                           out_specs=(P(), P(), P(AXIS), P()))
        loss, d_embed, d_blocks, d_head = fn(embed_p, staged, head_p, inputs, targets)
        return loss, {"embed": d_embed, "blocks": stage_layout.from_stages(d_blocks), "head": d_head}

    return run
