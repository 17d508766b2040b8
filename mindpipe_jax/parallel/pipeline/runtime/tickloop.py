"""The loop over a step's ticks, with each chunk's data-parallel gradient sync
(``grad_sync="chunk"``, AFAPAB) started as soon as the chunk's gradient is final.

The ticks run as ``lax.scan``s split at the sync points (``schedules.sync``). After
a chunk's last backward its gradient enters a ring (``ringsync.RingSync``) that
takes one step per tick beside the ticks still to come: its reduce-scatter
steps, then its all-gathers; what the remaining ticks cannot hide, and a chunk
that finishes at the last tick, is synced after them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from mindpipe_jax.parallel.pipeline.runtime.fsdp import FSDP
from mindpipe_jax.parallel.pipeline.runtime.ringsync import LocalRing
from mindpipe_jax.parallel.pipeline.runtime.spmd import AXIS, BATCH, _take


@dataclasses.dataclass(frozen=True)
class OwnedShards:
    """What a chunk's ring carries. Default: every leaf, averaged over the batch axes.

    With weights stored sharded over ``fsdp`` a device keeps only its ``fsdp`` shard of
    their gradients. Ringing the whole gradient over ``data`` x ``fsdp`` and keeping a
    shard sent ``fsdp`` times the bytes of the end-of-step reduce-scatter. Instead, at
    the sync point ``prepare`` (``fsdp.scatter_first``) reduce-scatters those leaves over
    ``fsdp`` (one collective, issued there) and averages the leaves no device shards
    (small: biases, norms) over the batch axes at once; the ring then averages only the
    owned shards (``ring``: a per-leaf mask), over ``data``.
    """

    prepare: object = None            # chunk tree -> chunk tree, at the sync point
    ring: tuple[bool, ...] | None = None  # per leaf: still to be averaged by the ring
    ring_axes: tuple[str, ...] = BATCH

    @property
    def other_axes(self) -> tuple[str, ...]:  # manual axes the ring's values vary over besides its own
        return (AXIS,) if self.ring_axes == BATCH else (AXIS, FSDP)

    def ring_size(self, n_batch: int) -> int:
        return n_batch if self.ring_axes == BATCH else n_batch // lax.axis_size(FSDP)

    def _mask(self, tree) -> list[bool]:
        if self.ring is not None:
            return list(self.ring)
        return [True] * len(jax.tree.leaves(tree, is_leaf=_is_spec))

    def ring_leaves(self, trees) -> list:
        """The leaves of every chunk's tree the ring averages, in one list."""
        return [x for t in trees for x, r in zip(jax.tree.leaves(t, is_leaf=_is_spec), self._mask(t),
                                                 strict=True) if r]

    def merge(self, trees, ringed) -> list:
        """Each chunk's tree with the ring's results in place of the leaves it averaged."""
        ringed, out = iter(ringed), []
        for t in trees:
            leaves, treedef = jax.tree.flatten(t)
            out.append(jax.tree.unflatten(treedef, [next(ringed) if r else x
                                                    for x, r in zip(leaves, self._mask(t), strict=True)]))
        return out

    def __post_init__(self):
        if self.prepare is None:
            object.__setattr__(self, "prepare", lambda tree: tree)


def _is_spec(x) -> bool:
    return x is None or isinstance(x, P)


def run_ticks_with_sync(tick, carry, num_ticks: int, points, *, n_batch: int, bucket_bytes,
                        serialize_ring: bool, mean=None, specs=None, auto=None, wire_dtype=jnp.float32,
                        owned=None):
    """Run ticks ``[0, num_ticks)`` from ``carry``; returns ``(carry, synced)`` with
    ``synced[chunk]`` the chunk's gradient averaged over the batch axes. ``mean``: how
    a chunk's gradient tree is averaged after the ticks (default ``pmean`` over the
    batch axes; ``fsdp.mean_scatter`` keeps each device's shard).
    ``specs``: a chunk gradient's ``PartitionSpec``s over the automatic mesh axes
    ``auto`` (``{axis: size}``), so that the ring sends each device's own shards
    (``ringsync.LocalRing``); None: the leaves whole. ``wire_dtype``: the ring's.
    ``owned``: with weights sharded over ``fsdp``, an ``OwnedShards`` that says what a
    device keeps; the ring then averages only those shards, over ``data``."""
    mean = mean or (lambda tree: jax.tree.map(lambda g: lax.pmean(g, BATCH), tree))
    owned = owned or OwnedShards()

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
            ring, state, done, cs, pre = pending
            for phase, first_k, last_k in (("scatter", 0, ring.scatter_steps),
                                           ("gather", ring.scatter_steps, ring.num_steps)):
                n = min(end - t0, last_k - done) if first_k <= done < last_k else 0
                if n > 0:
                    carry, state = run((carry, state), t0, t0 + n, ring, phase, done - first_k)
                    t0, done = t0 + n, done + n
            pending = (ring, state, done, cs, pre)
        carry = run(carry, t0, end)
        t0 = end
        here = [sp.chunk for sp in points if sp.after_tick + 1 == end]
        if pending is not None:  # not finished behind the ticks: finish it now
            ring, state, done, cs, pre = pending
            for k in range(done, ring.num_steps):
                state = ring.step(state, k)
            synced.update(zip(cs, owned.merge(pre, ring.finish(state)), strict=True))
            pending = None
        grads = [_take(carry[0]["blocks"], c) for c in here]
        if end < num_ticks and n_batch > 1:  # ticks remain: hide the sync behind them
            pre = [owned.prepare(g) for g in grads]  # what needs no ring is synced here
            leaves = owned.ring_leaves(pre)
            if owned.ring_size(n_batch) > 1 and leaves:
                ring = LocalRing(leaves, None if specs is None else owned.ring_leaves([specs] * len(grads)),
                                 auto or {}, owned.ring_axes, owned.ring_size(n_batch), bucket_bytes,
                                 wire_dtype, owned.other_axes)
                pending = (ring, ring.start(leaves), 0, here, pre)
            else:  # one device along the ring's axes (fsdp alone): the reduce-scatter was all of
                # it; the pmean over that one device only types the result as the same on it
                ringed = [lax.pmean(x, owned.ring_axes) for x in leaves]
                synced.update(zip(here, owned.merge(pre, ringed), strict=True))
        else:
            synced.update(zip(here, [mean(g) for g in grads], strict=True))
    return carry, synced
