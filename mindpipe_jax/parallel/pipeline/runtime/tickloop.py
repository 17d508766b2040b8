"""The loop over a step's ticks, with each chunk's data-parallel gradient sync
(``grad_sync="chunk"``, AFAPAB) started as soon as the chunk's gradient is final.

After a chunk's last backward (its sync point, ``schedules.sync``) its gradient
enters a ring (``ringsync.RingSync``) that takes one step per tick beside the
ticks still to come: its reduce-scatter steps, then its all-gathers; what the
remaining ticks cannot hide is run at the next sync point (or after the last
tick), and a chunk that finishes at the last tick is synced after it.

The ticks run as one ``lax.scan`` (``_one_scan``): what happens at a sync point
and which ring step runs beside a tick are tables indexed by the tick, each a
``lax.switch`` on a value that is the same on every device (so the ring's
collectives, inside it, are issued by all of them). The tick body, the largest
part of the program, is then compiled once: as one scan per stretch between sync
points it was compiled once per stretch (an AFAPAB pipe2 x data2 x tensor2 step
with v = 2: 76 s of compiling against 27 s for the same step synced at the end).
Rings whose chunks do not all look alike (weights sharded over ``fsdp``, several
chunks finishing at one tick) keep the scans split at the sync points
(``_split_scans``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from mindpipe_jax.parallel.collectives import runs_tag
from mindpipe_jax.parallel.pipeline.runtime import fsdp
from mindpipe_jax.parallel.pipeline.runtime.fsdp import FSDP
from mindpipe_jax.parallel.pipeline.runtime.ringsync import LocalRing
from mindpipe_jax.parallel.pipeline.runtime.spmd import AXIS, BATCH, _take, _vary


@dataclasses.dataclass(frozen=True)
class OwnedShards:
    """What a chunk's ring carries. Default: every leaf, averaged over the batch axes.

    With weights stored sharded over ``fsdp`` a device keeps only its ``fsdp`` shard of
    their gradients. Ringing the whole gradient over ``data`` x ``fsdp`` and keeping a
    shard sent ``fsdp`` times the bytes of the end-of-step reduce-scatter. Instead, at
    the sync point ``prepare`` (``fsdp.scatter_first``) reduce-scatters those leaves over
    ``fsdp`` (one collective, issued there) and averages the leaves no device shards
    (small: biases, norms) over the batch axes at once; the ring then averages only the
    owned shards (``ring``: a per-leaf mask), over the other batch axes (``data``; and
    ``expert``, 1 wherever a ring runs).
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


def owned_shards(dims, expert_dims, *, fsdp_size: int, chunked: bool, wire_dtype,
                 local) -> OwnedShards | None:
    """What a chunk's ring carries (None: every leaf, over every batch axis). With weights
    sharded over fsdp (``dims``), their shards only; never a leaf split over expert
    (``expert_dims``: its devices hold different experts), which is averaged at the sync
    point over the other batch axes as the end-of-step sync would (``fsdp.mean_scatter``
    with ``experts``). ``chunked``: the sharded leaves were summed over fsdp per task
    already (``fsdp_gather="chunk"``); ``local(fn, tree)`` runs ``fn`` on each device's
    own shards (``ringsync.on_shards``)."""
    split = [e >= 0 for e in jax.tree.leaves(expert_dims)]
    sharded = [d >= 0 and fsdp_size > 1 for d in jax.tree.leaves(dims)]
    if not any(sharded) and not any(split):
        return None

    def first_leaf(g, d, e):
        if e >= 0:  # the whole mean now
            if chunked:
                return fsdp.mean_of_scattered(g, d, BATCH, wire_dtype, experts=e)
            return fsdp.mean_scatter(g, d, BATCH, offset=1, wire_dtype=wire_dtype, experts=e)
        if not any(sharded):  # the ring averages it over every batch axis
            return g
        if chunked:
            return fsdp.mean_of_scattered(g, d, BATCH, wire_dtype, ring_rest=True)
        return fsdp.scatter_first(g, d, BATCH, offset=1, wire_dtype=wire_dtype)

    def first(tree):
        return jax.tree.map(first_leaf, tree, dims, expert_dims)
    if any(sharded):
        ring = tuple(s and not e for s, e in zip(sharded, split, strict=True))
        axes = tuple(a for a in BATCH if a != FSDP)
    else:
        ring, axes = tuple(not e for e in split), BATCH
    return OwnedShards(lambda g: local(first, g), ring, axes)


def _is_spec(x) -> bool:
    return x is None or isinstance(x, P)


def run_ticks_with_sync(tick, carry, num_ticks: int, points, *, n_batch: int, bucket_bytes,
                        serialize_ring: bool, mean=None, specs=None, auto=None, wire_dtype=jnp.float32,
                        owned=None, ring: bool = True):
    """Run ticks ``[0, num_ticks)`` from ``carry``; returns ``(carry, synced)`` with
    ``synced[chunk]`` the chunk's gradient averaged over the batch axes. ``mean``: how
    a chunk's gradient tree is averaged after the ticks (default ``pmean`` over the
    batch axes; ``fsdp.mean_scatter`` keeps each device's shard).
    ``specs``: a chunk gradient's ``PartitionSpec``s over the automatic mesh axes
    ``auto`` (``{axis: size}``), so that the ring sends each device's own shards
    (``ringsync.LocalRing``); None: the leaves whole. ``wire_dtype``: the ring's.
    ``owned``: with weights sharded over ``fsdp``, an ``OwnedShards`` that says what a
    device keeps; the ring then averages only those shards, over ``data``.
    ``ring=False`` (``grad_sync="overlap"``): at a sync point the chunk's gradient is
    averaged at once by ``mean``, one collective per leaf issued there, before the
    remaining ticks (see ``_early_means``)."""
    mean = mean or (lambda tree: jax.tree.map(lambda g: lax.pmean(g, BATCH), tree))
    if not ring:
        return _early_means(tick, carry, num_ticks, points, mean)
    ends = [sp.after_tick + 1 for sp in points]
    if owned is None and len(set(ends)) == len(ends):  # one chunk per sync point
        return _one_scan(tick, carry, num_ticks, points, n_batch=n_batch, bucket_bytes=bucket_bytes,
                         serialize_ring=serialize_ring, mean=mean, specs=specs, auto=auto,
                         wire_dtype=wire_dtype)
    return _split_scans(tick, carry, num_ticks, points, n_batch=n_batch, bucket_bytes=bucket_bytes,
                        serialize_ring=serialize_ring, mean=mean, specs=specs, auto=auto,
                        wire_dtype=wire_dtype, owned=owned or OwnedShards())


def _early_means(tick, carry, num_ticks: int, points, mean):
    """``grad_sync="overlap"``, Megatron's ``--overlap-grad-reduce`` as one SPMD program
    can issue it: a ``lax.scan`` per stretch of ticks between sync points and, at each,
    the finished chunks' gradients averaged by ``mean`` (per leaf), with no data
    dependence on the ticks that follow. Finer than a chunk (a bucket of layers during
    the last backward, as Megatron issues them) is not expressible: the last backward is
    a task inside a per-device branch, and collectives stay outside branches.

    Whether the all-reduce then runs behind the remaining ticks is the compiler's call:
    XLA's all-reduce combiner merges independent all-reduces, and on XLA:CPU it merges
    an early chunk's with the ones after the last loop (an ``optimization_barrier``
    tying them did not survive to the combiner). ``"chunk"``'s ring, stepped inside
    the loop, does not depend on it."""
    t0, synced = 0, {}
    for end in sorted({sp.after_tick + 1 for sp in points} | {num_ticks}):
        if end > t0:
            carry = lax.scan(tick, carry, jnp.arange(t0, end))[0]
            t0 = end
        synced.update({sp.chunk: mean(_take(carry[0]["blocks"], sp.chunk)) for sp in points
                       if sp.after_tick + 1 == end})
    return carry, synced


def _one_scan(tick, carry, num_ticks: int, points, *, n_batch: int, bucket_bytes, serialize_ring: bool,
              mean, specs, auto, wire_dtype):
    """``run_ticks_with_sync`` as one scan over the ticks (see the module docstring).

    A ring at a time, as in ``_split_scans``: ring ``i`` (chunk ``chunks[i]``) starts
    before tick ``starts[i]`` and runs its step ``t - starts[i]`` beside tick ``t``
    until the next ring starts; its remaining steps run then (or after the scan), and
    its result (the ring state's ``out``) waits in ``outs[i]`` until after the scan."""
    ringed = [sp for sp in points if sp.after_tick + 1 < num_ticks] if n_batch > 1 else []
    if not ringed:
        carry = lax.scan(tick, carry, jnp.arange(num_ticks))[0]
        return carry, {sp.chunk: mean(_take(carry[0]["blocks"], sp.chunk)) for sp in points}
    starts = [sp.after_tick + 1 for sp in ringed]
    chunks = [sp.chunk for sp in ringed]
    leaves_of = lambda acc, c: jax.tree.leaves(_take(acc["blocks"], c))  # noqa: E731
    example = leaves_of(carry[0], chunks[0])
    ring = LocalRing(example, None if specs is None else jax.tree.leaves(specs, is_leaf=_is_spec),
                     auto or {}, BATCH, n_batch, bucket_bytes, wire_dtype, (AXIS,))
    state = ring.start(example)  # zeros (the accumulators' start), typed as every ring's state
    if ring.auto:
        state = _vary(state)
    outs = jnp.stack([state["out"]] * len(ringed))

    # Per tick (static): which ring starts before it (-1: none), and the ring step beside
    # it (phase 0: none, 1: reduce-scatter step, 2: all-gather step; its index).
    event = np.full(num_ticks, -1)
    phase = np.zeros(num_ticks, np.int32)
    step_k = np.zeros(num_ticks, np.int32)
    left = []  # steps of ring i still to run when ring i + 1 starts (or after the scan)
    for i, start in enumerate(starts):
        event[start] = i
        stop = starts[i + 1] if i + 1 < len(starts) else num_ticks
        beside = min(stop - start, ring.num_steps)
        for j in range(beside):
            scatter = j < ring.scatter_steps
            phase[start + j] = 1 if scatter else 2
            step_k[start + j] = j if scatter else j - ring.scatter_steps
        left.append(range(beside, ring.num_steps))

    def finish_steps(state, i):  # ring i's steps the ticks did not hide, unrolled
        for k in left[i]:
            state = ring.step(state, k)
        return state

    def at_start(i):  # before tick starts[i]: ring i - 1's rest put aside, ring i's parts
        def run(acc, state, outs, t):
            last = state["out"]
            if i > 0:
                last = finish_steps(state, i - 1)["out"]
                outs = outs.at[i - 1].set(last)
            fresh = ring.start(leaves_of(acc, chunks[i]))["parts"]
            # Written over the carried parts by selects (the first always true, the second
            # never, neither provably so to XLA): an elementwise write in place, and one that
            # consumes what was last read from the parts, so XLA orders those reads first. A
            # branch returning a fresh buffer made XLA copy the parts every tick.
            return jnp.where(t >= 0, fresh, jnp.where(t < 0, last, state["parts"])), outs
        return run
    # A ring on each device's own shards runs in nested shard_maps that do not type their
    # outputs (check_vma=False, see LocalRing): the branches' outputs all become varying over
    # every manual axis, as the carried state is, so that they agree.
    settle = _vary if ring.auto else (lambda tree: tree)
    def settled(fn, runs):
        """``fn`` in a branch that ``runs`` of the loop's ticks take: the count is in the name
        of its collectives, for ``parallel.collectives`` to count them that often."""
        def run(*args):
            with jax.named_scope(runs_tag(runs, num_ticks)):
                return settle(fn(*args))
        return run
    start_fns = [settled(at_start(i), 1) for i in range(len(ringed))]
    not_starting = lambda acc, state, outs, t: (state["parts"], outs)  # noqa: E731
    scatter = settled(lambda s, k: ring.scatter_step(s, k)["parts"], int((phase == 1).sum()))
    gather = settled(lambda s, k: ring.gather_step(s, k)["out"], int((phase == 2).sum()))
    # The ring that starts before tick t + 1 starts at the end of tick t's iteration: it
    # reads the accumulators after the tick's in-place update and before the next one's.
    # (Read before the tick, they were copied every tick to keep that read safe.)
    after = np.concatenate([event[1:], [-1]])  # the ring that starts after tick t (-1: none)
    phase, step_k, after = jnp.asarray(phase), jnp.asarray(step_k), jnp.asarray(after)
    keep = lambda s, k: s["parts"]  # noqa: E731

    def tick_and_ring(c, t):
        inner, state, outs = c
        inner, _ = tick(inner, t)
        if serialize_ring:  # the ring's collectives after the tick's, on every device
            inner, parts = lax.optimization_barrier((inner, state["parts"]))
            state = {**state, "parts": parts}
        # Each of the ring's buffers in a cond whose only output it is, returned as it came
        # or changed in place: a switch passing the whole state through copied it every tick.
        state = {**state, "parts": lax.cond(phase[t] == 1, scatter, keep, state, step_k[t])}
        state = {**state, "out": lax.cond(phase[t] == 2, gather, lambda s, k: s["out"], state, step_k[t])}
        # One cond per ring (at most one is true in a tick): a switch over all of them, its
        # branches writing different buffers, made XLA copy the parts and outs every tick.
        for i, start in enumerate(start_fns):
            parts, outs = lax.cond(after[t] == i, start, not_starting, inner[0], state, outs, t)
            state = {**state, "parts": parts}
        return (inner, state, outs), None

    carry, state, outs = lax.scan(tick_and_ring, (carry, state, outs), jnp.arange(num_ticks))[0]
    outs = outs.at[len(ringed) - 1].set(finish_steps(state, len(ringed) - 1)["out"])
    treedef = jax.tree.structure(_take(carry[0]["blocks"], 0))
    synced = {c: jax.tree.unflatten(treedef, jax.tree.leaves(ring.finish({"out": outs[i]})))
              for i, c in enumerate(chunks)}
    synced.update({sp.chunk: mean(_take(carry[0]["blocks"], sp.chunk)) for sp in points
                   if sp.chunk not in synced})
    return carry, synced


def _split_scans(tick, carry, num_ticks: int, points, *, n_batch: int, bucket_bytes, serialize_ring: bool,
                 mean, specs, auto, wire_dtype, owned):
    """``run_ticks_with_sync`` as one ``lax.scan`` per stretch of ticks between sync points."""

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
