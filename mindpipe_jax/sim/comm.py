"""The data-parallel gradient sync our SPMD runtime issues, replayed by the simulator.

``network.DPSync`` models a chunk's sync as one collective (or slices of one)
on a network lane beside compute, as an asynchronous executor would run it. The
runtime (``runtime.pipeline_grads``) issues something more particular, and this
module lists and replays exactly that:

* ``grad_sync="end"`` (Megatron): after the last tick, one all-reduce (``pmean``)
  of each chunk's gradient over the batch axes (``d`` ranks).
* ``grad_sync="chunk"`` (AFAPAB): at each sync point (``sync.sync_points``)
  that leaves ticks to run, each device's own shards of the chunks that finished
  there are flattened into one vector and reduced by a ring (``ringsync.LocalRing``):
  ``buckets * (d - 1)``
  reduce-scatter steps, each a ``ppermute`` of one piece, then one all-gather of
  ``d`` pieces per bucket, one step beside each following tick. Steps that the
  ticks up to the next sync point cannot take run back to back there; a chunk
  that finishes at the last tick is all-reduced after it.
* ``grad_sync="overlap"`` (Megatron's ``--overlap-grad-reduce``): at the same sync
  points, one all-reduce per leaf of the chunks that finished there, issued between
  two loop segments (blocking with ``overlap=False``, as XLA:CPU runs it; behind the
  following ticks with ``overlap=True``).
* after the loop, in every mode: the loss (a scalar) and the embed and head
  gradients (``psum`` over ``pipe``, then ``pmean`` over the batch axes).

Gradients go on the wire as ``elem_bytes`` bytes per element (``parallel.grad_sync_dtype``:
4 for fp32, 2 for bf16; the loss stays fp32); an element count is what one device
holds (its tensor shard of a tensor-sharded leaf). ``parallel/collectives.py`` reads
the same bytes from a compiled program.

``sync_ops`` lists those collectives with where they run; ``simulate_sync``
replays a schedule tick by tick with per-device clocks — each tick a device runs
its task and its bookkeeping (``tick_overhead``), then the two pipeline
``ppermute``s (engine's ``"neighbour"`` mode) — plus the collectives, in one
of two ways:

* ``overlap=False``: a collective blocks its device (what XLA:CPU does with Gloo:
  measured on this machine, a 77 ms compute and an independent 257 ms ``psum``
  took 328 ms together). It runs after the tick's ppermutes.
* ``overlap=True``: a ring step beside tick ``t`` runs on the device's
  communication stream from the start of the tick (its input, the previous
  step's result, is ready by then) and the tick lasts until both its compute and
  the step are done — the loop body waits for everything in it. A collective
  issued between loop segments (``"overlap"``'s all-reduces at a sync point before
  the last tick) starts on that stream once its device reaches the sync point and
  the stream is free, and the device goes on with the following ticks: nothing
  later in the loop reads its result, so only the step's end waits for it (an
  asynchronous all-reduce, as a GPU with the latency-hiding scheduler issues it).
  Collectives after the loop queue on the same stream and block the step's end.

Cost of a collective over ``r`` ranks on a ``Link`` (α, bw), as
``network.Collective``: a ring step (``ppermute`` of ``n`` bytes) ``α + n/bw``;
an all-gather of ``r`` pieces of ``n/r`` bytes ``(r - 1)(α + n/(r bw))``; an
all-reduce of ``n`` bytes ``2 (r - 1)(α + n/(r bw))``. ``fit_collective`` fits α
and bw to timings of any of them. No contention between the pipeline's
ppermutes and the data-parallel ring is modelled (they use different peers; on
a cluster that shares one NIC per node, give ``dp_link`` the per-GPU share).

Pure Python (numpy only in ``fit_collective``); nothing here imports JAX.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from mindpipe_jax.errors import ConfigError
from mindpipe_jax.parallel.pipeline.schedules import Schedule
from mindpipe_jax.parallel.pipeline.schedules.sync import sync_points
from mindpipe_jax.sim.costs import _Resolved
from mindpipe_jax.sim.engine import Event, SimResult, _crossing_bytes, _per_device, _Trace
from mindpipe_jax.sim.network import Collective, Link, fit_alpha_beta

__all__ = ["CommOp", "RingGeometry", "sync_ops", "simulate_sync", "fit_collective", "op_time",
           "collective_time"]

KINDS = ("ring-step", "all-gather", "all-reduce")


@dataclass(frozen=True)
class RingGeometry:
    """The sizes ``ringsync.RingSync`` uses for a flat vector of ``n`` elements over ``d``
    ranks, ``elem_bytes`` each on the wire (same arithmetic, no JAX)."""

    n: int
    d: int
    bucket_bytes: int | None = None
    elem_bytes: int = 4

    @property
    def per_bucket(self) -> int:
        return self.n if not self.bucket_bytes else max(self.d, self.bucket_bytes // self.elem_bytes)

    @property
    def buckets(self) -> int:
        return max(1, math.ceil(self.n / self.per_bucket))

    @property
    def piece(self) -> int:
        """Elements per piece (one ring step sends one piece)."""
        return math.ceil(math.ceil(self.n / self.buckets) / self.d)

    @property
    def scatter_steps(self) -> int:
        return self.buckets * (self.d - 1)

    @property
    def num_steps(self) -> int:
        return self.scatter_steps + self.buckets

    def step(self, k: int) -> tuple[str, float]:
        """(kind, bytes) of step ``k``: a ring step sends one piece; an all-gather
        assembles ``d`` of them (bytes = the gathered size)."""
        if k < self.scatter_steps:
            return "ring-step", float(self.elem_bytes * self.piece)
        return "all-gather", float(self.elem_bytes * self.piece * self.d)


@dataclass(frozen=True)
class CommOp:
    """One collective the runtime issues. ``beside=True``: it runs in the body of
    tick ``tick`` (one ring step per tick); ``False``: after tick ``tick``'s loop
    segment, before the next tick (``tick = ticks - 1``: after the loop)."""

    kind: str            # "ring-step" | "all-gather" | "all-reduce"
    nbytes: float        # ring-step: bytes sent; all-gather: gathered size; all-reduce: buffer size
    tick: int
    beside: bool
    axis: str = "data"   # "data" (the batch axes) or "pipe"
    chunks: tuple[int, ...] = ()


def collective_time(kind: str, nbytes: float, ranks: int, link: Link) -> float:
    """Seconds for one collective on a free link (see the module docstring)."""
    if ranks <= 1:
        return 0.0
    if kind == "ring-step":
        return link.time(nbytes)
    if kind in ("all-gather", "all-reduce"):
        return Collective(ranks, link, kind).time(nbytes)
    raise ConfigError(f"unknown collective kind {kind!r}; valid: {', '.join(KINDS)}")


def op_time(op: CommOp, ranks: int, link: Link) -> float:
    return collective_time(op.kind, op.nbytes, ranks, link)


def _leaves(x, name: str) -> tuple[int, ...]:
    if isinstance(x, int) and not isinstance(x, bool):
        return (x,)
    if isinstance(x, Sequence) and not isinstance(x, str | bytes) and all(
            isinstance(n, int) and not isinstance(n, bool) for n in x):
        return tuple(x)
    raise ConfigError(f"{name} must be an element count or a sequence of them (one per leaf), got {x!r}")


def sync_ops(schedule: Schedule, chunk_elems: Sequence[int | Sequence[int]], data_ranks: int,
             grad_sync: str = "end", *, bucket_bytes: int | None = None,
             end_elems: int | Sequence[int] = 0, elem_bytes: int = 4) -> list[CommOp]:
    """The collectives ``runtime.pipeline_grads`` issues for one step, in issue order.

    ``chunk_elems[c]``: chunk ``c``'s gradient on a device, as an element count or
    one count per leaf (``elem_bytes`` each on the wire); ``end_elems``: the embed and head
    gradients (synced after the loop over ``pipe`` and the batch axes), likewise.
    A ``pmean`` is one all-reduce per leaf: XLA combines them into one tuple
    all-reduce, but XLA:CPU runs a Gloo all-reduce per buffer of the tuple, each
    paying its own α. A ring flattens its chunks into one vector. Mirrors the
    runtime's loop over sync points: a ring started at one sync point takes one
    step beside each tick up to the next one and finishes back to back there."""
    v, ticks, d = schedule.virtual_stages, schedule.num_ticks, data_ranks
    if isinstance(chunk_elems, str | bytes) or not isinstance(chunk_elems, Sequence) or len(chunk_elems) != v:
        raise ConfigError(f"chunk_elems needs one entry per chunk (v={v}), got {chunk_elems!r}")
    leaves = [_leaves(x, f"chunk_elems[{c}]") for c, x in enumerate(chunk_elems)]
    end_leaves = _leaves(end_elems, "end_elems")
    if isinstance(d, bool) or not isinstance(d, int) or d < 1:
        raise ConfigError(f"data_ranks must be an integer >= 1, got {d!r}")
    points = sync_points(schedule, grad_sync)
    ops: list[CommOp] = []
    t0, pending = 0, None   # pending: (RingGeometry, steps done, chunks)
    for end in sorted({sp.after_tick + 1 for sp in points} | {ticks}):
        if pending is not None:
            ring, done, cs = pending
            n = min(end - t0, ring.num_steps - done)
            for i in range(n):   # one step beside each tick (scatter steps, then gathers)
                kind, nbytes = ring.step(done + i)
                ops.append(CommOp(kind, nbytes, t0 + i, True, chunks=cs))
            done += n
            for k in range(done, ring.num_steps):   # what the ticks could not take
                kind, nbytes = ring.step(k)
                ops.append(CommOp(kind, nbytes, end - 1, False, chunks=cs))
            pending = None
        t0 = end
        here = tuple(sp.chunk for sp in points if sp.after_tick + 1 == end)
        if not here or d == 1:
            continue
        if end < ticks and grad_sync != "overlap":
            ring = RingGeometry(sum(sum(leaves[c]) for c in here), d, bucket_bytes, elem_bytes)
            pending = (ring, 0, here)
        else:
            ops += [CommOp("all-reduce", float(elem_bytes * n), end - 1, False, chunks=(c,))
                    for c in here for n in leaves[c]]
    last = ticks - 1
    for axis, ranks in (("pipe", schedule.num_stages), ("data", d)):   # the loss, embed and head
        if ranks > 1:
            ops += [CommOp("all-reduce", 4.0, last, False, axis=axis)]  # the loss: fp32
            wire = 4 if axis == "pipe" else elem_bytes  # the psum over pipe stays fp32
            ops += [CommOp("all-reduce", float(wire * n), last, False, axis=axis) for n in end_leaves if n]
    return ops


def simulate_sync(schedule: Schedule, costs=None, *, data_ranks: int, dp_link: Link,
                  grad_sync: str = "end", bucket_bytes: int | None = None,
                  chunk_elems: Sequence[int | Sequence[int]] | None = None,
                  end_elems: int | Sequence[int] = 0,
                  pipe_link: Link | None = None, tick_overhead: float | Sequence[float] = 0.0,
                  overlap: bool = False, elem_bytes: int = 4) -> SimResult:
    """Replay ``schedule`` tick by tick with the runtime's gradient sync (see the
    module docstring). ``costs`` as ``engine.simulate``; ``chunk_elems``
    (see ``sync_ops``) default: each chunk's ``param_bytes / 4`` as one leaf (largest over devices: the SPMD
    program gives every device the same shapes). Returns a ``SimResult`` whose
    network events are the pipeline ppermutes (``"exchange"``) and the
    collectives (``"sync"``); ``mode`` is ``"tick-overlap"`` or ``"tick-blocking"``."""
    if not isinstance(schedule, Schedule):
        raise ConfigError(f"simulate_sync needs a Schedule, got {type(schedule).__name__}")
    if not isinstance(dp_link, Link):
        raise ConfigError(f"dp_link must be a Link, got {dp_link!r}")
    pipe_link = Link() if pipe_link is None else pipe_link
    p, v = schedule.num_stages, schedule.virtual_stages
    overhead = _per_device(tick_overhead, "tick_overhead", p)
    cc = _Resolved(costs, schedule)
    if chunk_elems is None:
        chunk_elems = [int(max(cc.params[schedule.global_stage(s, c)] for s in range(p)) // 4)
                       for c in range(v)]
    ops = sync_ops(schedule, chunk_elems, data_ranks, grad_sync, bucket_bytes=bucket_bytes,
                   end_elems=end_elems, elem_bytes=elem_bytes)
    beside: dict[int, list[CommOp]] = {}
    after: dict[int, list[CommOp]] = {}
    for op in ops:
        (beside if op.beside else after).setdefault(op.tick, []).append(op)

    def cost(op: CommOp) -> float:
        return op_time(op, data_ranks, dp_link) if op.axis == "data" else op_time(op, p, pipe_link)

    last = schedule.num_ticks - 1
    between = grad_sync == "overlap"  # its sync points split the loop (a ring's leftovers stay inside)
    crossing = _crossing_bytes(schedule, cc)
    buffer = max(crossing, default=0.0)
    occ = pipe_link.occupancy(buffer)
    trace = _Trace(schedule)
    net = [0.0] * p
    events = trace.events
    clock, lane = [0.0] * p, [0.0] * p
    compute_end = 0.0
    for t, row in enumerate(schedule.table):
        tick_start = list(clock)
        ready = []
        for s, task in enumerate(row):
            d = 0.0 if task is None else trace.compute(cc, t, s, task, clock[s])
            ready.append(clock[s] + d + overhead[s])
        if crossing:
            for shift in (1, -1):   # forward ppermute to s + 1, then backward to s - 1
                arrive = [ready[s] + occ + pipe_link.latency_s for s in range(p)]
                for s in range(p):
                    net[s] += occ
                    events.append(Event(s, "network", "exchange", ready[s], arrive[s], t,
                                        peer=(s + shift) % p, nbytes=buffer))
                ready = [max(ready[s] + occ, arrive[(s - shift) % p]) for s in range(p)]
        compute_end = max(compute_end, *ready)
        for s in range(p):
            for op in beside.get(t, ()):
                dur = cost(op)
                at = max(tick_start[s], lane[s]) if overlap else ready[s]
                lane[s] = at + dur
                ready[s] = max(ready[s], at + dur)
                net[s] += dur
                events.append(Event(s, "network", "sync", at, at + dur, t, chunk=op.chunks[0] if op.chunks
                                    else None, nbytes=op.nbytes))
            for op in after.get(t, ()):
                dur = cost(op)
                at = max(ready[s], lane[s])
                lane[s] = at + dur
                if not (overlap and between and t < last):  # between loop segments: behind the next ticks
                    ready[s] = at + dur
                net[s] += dur
                events.append(Event(s, "network", "sync", at, at + dur, t, chunk=op.chunks[0] if op.chunks
                                    else None, nbytes=op.nbytes))
        clock = ready
    mode = "tick-overlap" if overlap else "tick-blocking"
    return trace.result(mode, max(*clock, *lane, 0.0), compute_end, net)


def fit_collective(kind: str, ranks: int, sizes_bytes: Sequence[float], times_s: Sequence[float]) -> Link:
    """The ``Link`` (α, bw) whose ring-collective cost best fits measured timings of
    ``kind`` over ``ranks`` ranks (``nbytes`` as in ``collective_time``): each such
    collective is ``k`` identical steps of ``α + b/bw`` (``k`` = 1, r - 1 or
    2 (r - 1); ``b`` = n, n/r, n/r), so ``fit_alpha_beta`` on (b, t/k)."""
    if kind not in KINDS:
        raise ConfigError(f"unknown collective kind {kind!r}; valid: {', '.join(KINDS)}")
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 2:
        raise ConfigError(f"fit_collective needs ranks >= 2, got {ranks!r}")
    steps = {"ring-step": 1, "all-gather": ranks - 1, "all-reduce": 2 * (ranks - 1)}[kind]
    per = [n if kind == "ring-step" else n / ranks for n in sizes_bytes]
    return fit_alpha_beta(per, [t / steps for t in times_s])
