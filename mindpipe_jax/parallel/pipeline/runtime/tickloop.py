"""The loop over a step's ticks, with each chunk's data-parallel gradient sync
(``grad_sync="chunk"``, AFAPAB) started as soon as the chunk's gradient is final.

The ticks run as ``lax.scan``s split at the sync points (``schedules.sync``). After
a chunk's last backward its gradient enters a ring (``ringsync.RingSync``) that
takes one step per tick beside the ticks still to come: its reduce-scatter
steps, then its all-gathers; what the remaining ticks cannot hide, and a chunk
that finishes at the last tick, is synced after them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from mindpipe_jax.parallel.pipeline.runtime.ringsync import LocalRing
from mindpipe_jax.parallel.pipeline.runtime.spmd import AXIS, BATCH, _take


def run_ticks_with_sync(tick, carry, num_ticks: int, points, *, n_batch: int, bucket_bytes,
                        serialize_ring: bool, mean=None, shard=None, specs=None, auto=None,
                        wire_dtype=jnp.float32):
    """Run ticks ``[0, num_ticks)`` from ``carry``; returns ``(carry, synced)`` with
    ``synced[chunk]`` the chunk's gradient averaged over the batch axes. ``mean``: how
    a chunk's gradient tree is averaged after the ticks (default ``pmean`` over the
    batch axes; ``fsdp.mean_scatter`` keeps each device's shard); ``shard``: what a
    device keeps of a gradient the ring averaged in full (default all of it).
    ``specs``: a chunk gradient's ``PartitionSpec``s over the automatic mesh axes
    ``auto`` (``{axis: size}``), so that the ring sends each device's own shards
    (``ringsync.LocalRing``); None: the leaves whole. ``wire_dtype``: the ring's."""
    mean = mean or (lambda tree: jax.tree.map(lambda g: lax.pmean(g, BATCH), tree))
    shard = shard or (lambda tree: tree)

    def run(carry, first, last, ring=None, phase=None, offset=0):
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

    t0, synced, pending = 0, {}, None
    for end in sorted({sp.after_tick + 1 for sp in points} | {num_ticks}):
        if pending is not None:
            ring, state, done, cs = pending
            for phase, first_k, last_k in (("scatter", 0, ring.scatter_steps),
                                           ("gather", ring.scatter_steps, ring.num_steps)):
                n = min(end - t0, last_k - done) if first_k <= done < last_k else 0
                if n > 0:
                    carry, state = run((carry, state), t0, t0 + n, ring, phase, done - first_k)
                    t0, done = t0 + n, done + n
            pending = (ring, state, done, cs)
        carry = run(carry, t0, end)
        t0 = end
        here = [sp.chunk for sp in points if sp.after_tick + 1 == end]
        if pending is not None:  # not finished behind the ticks: finish it now
            ring, state, done, cs = pending
            for k in range(done, ring.num_steps):
                state = ring.step(state, k)
            synced.update(zip(cs, [shard(g) for g in ring.finish(state)], strict=True))
            pending = None
        grads = [_take(carry[0]["blocks"], c) for c in here]
        if end < num_ticks and n_batch > 1:  # ticks remain: hide the sync behind them
            ring = LocalRing(grads, None if specs is None else [specs] * len(grads), auto or {}, BATCH,
                             n_batch, bucket_bytes, wire_dtype, (AXIS,))
            pending = (ring, ring.start(grads), 0, here)
        else:
            synced.update(zip(here, [mean(g) for g in grads], strict=True))
    return carry, synced
