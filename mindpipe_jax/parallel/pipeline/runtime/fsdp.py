"""FSDP inside the pipeline: parameters stay sharded over ``fsdp`` going in, are
gathered once per step on each stage, and their gradients leave reduce-scattered.

The pipeline's ``shard_map`` is manual over ``fsdp`` (a batch axis). Entering it
with a parameter replicated over ``fsdp`` (``P('pipe')``) made XLA gather every
weight before the step and hand back gradients averaged over ``fsdp`` in full,
every device holding the whole stage's gradient. Given the parameters' storage
specs, the runtime instead takes each weight's ``fsdp``-sharded dimension in
the ``shard_map`` specs, all-gathers it inside (once per step: MaxText's
``pipeline_fsdp_ag_once``; the gathered stage is the documented extra buffer,
one stage's parameters per device) and reduce-scatters the gradient over
``fsdp`` (then averages over ``data``), so a device's gradient is its shard:
``1 / (pipe · fsdp)`` of the stack.

Only a dimension whose storage spec names ``fsdp`` first (``'fsdp'`` or
``('fsdp', ...)``) is sharded this way; any other leaf is gathered as before.

The embedding and head (``EndSplit``) may be stored split over ``pipe`` too, on
that same dimension (``('fsdp', 'pipe')``, or ``'pipe'`` alone when ``fsdp`` is
1; ``train/pipeline_storage.py`` decides): one SPMD program gives every device the
same shapes, so the first and last stage cannot keep them alone; split over
``pipe`` each device keeps ``1 / (pipe · fsdp)`` of them and of their optimizer
state, gathers them once per step, and their gradient (non-zero on its owners
only) leaves reduce-scattered over ``pipe`` instead of ``psum``-ed.

Per chunk use (``pipeline_grads(fsdp_gather="chunk")``, MaxText's gather per pipeline
iteration rather than ``pipeline_fsdp_ag_once``): the stage's chunks stay sharded
through the tick loop; each part of a tick (forward, backward, weight gradient)
all-gathers the one chunk its task runs just before it and reduce-scatters (in fp32)
that task's weight gradient just after, so the chunk accumulators are ``fsdp`` shards
too (``ticks.py``). A device then holds a part's gathered chunk or two instead of its
whole gathered stage, and ``1 / fsdp`` of the stage's gradient instead of all of it,
for an all-gather per task that runs a chunk and a reduce-scatter per task that makes
a weight gradient (``benchmarks/fsdp_gather.py`` measures both).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from mindpipe_jax.parallel.pipeline.runtime import ringsync
from mindpipe_jax.parallel.pipeline.runtime.spmd import EXPERT

FSDP = "fsdp"
PIPE = "pipe"


NOT_SHARDED = -1  # not None: None is an empty subtree to jax.tree.map


def fsdp_dim(spec) -> int:
    """The dimension a storage ``PartitionSpec`` shards over ``fsdp`` first, or ``NOT_SHARDED``."""
    if spec is None:
        return NOT_SHARDED
    for i, entry in enumerate(tuple(spec)):
        axes = entry if isinstance(entry, tuple) else (entry,)
        if axes and axes[0] == FSDP:
            return i
    return NOT_SHARDED


def dims_of(specs, tree):
    """Per leaf of ``tree``, its ``fsdp`` dimension read from ``specs`` (a matching tree of
    ``PartitionSpec`` or ``NamedSharding``); ``NOT_SHARDED`` everywhere when ``specs`` is None."""
    if specs is None:
        return jax.tree.map(lambda _: NOT_SHARDED, tree)
    as_spec = lambda s: getattr(s, "spec", s)  # noqa: E731
    return jax.tree.map(lambda s, _: fsdp_dim(as_spec(s)), specs, tree,
                        is_leaf=lambda s: isinstance(s, P) or hasattr(s, "spec"))


def in_spec(dim: int, lead=()):
    """The ``shard_map`` spec of a leaf: ``lead`` (e.g. ``('pipe', None, None)`` for the
    staged stack) then ``fsdp`` at ``dim`` (counted after ``lead``)."""
    if dim < 0:
        return P(*lead)
    return P(*lead, *([None] * dim), FSDP)


def gather(tree, dims, offset: int = 0):
    """All-gather each leaf over ``fsdp`` along its dimension (+ ``offset``)."""
    return jax.tree.map(lambda x, d: x if d < 0 else lax.all_gather(x, FSDP, axis=d + offset, tiled=True),
                        tree, dims)


def gathered_zeros(tree, dims, offset: int = 0):
    """Zeros shaped as ``gather(tree, dims, offset)`` returns (the whole leaves), for
    tracing a chunk's functions before any gather runs."""
    n = lax.axis_size(FSDP)

    def one(x, d):
        shape = list(x.shape)
        if d >= 0:
            shape[d + offset] *= n
        return jnp.zeros(shape, x.dtype)
    return jax.tree.map(one, tree, dims)


def sum_scatter(tree, dims, offset: int = 0):
    """Each leaf sharded over ``fsdp`` summed over it and reduce-scattered (a device keeps
    its shard of the sum); a leaf not sharded as it is (``mean_of_scattered`` averages
    it over every batch axis at the end)."""
    return jax.tree.map(lambda g, d: g if d < 0 else
                        lax.psum_scatter(g, FSDP, scatter_dimension=d + offset, tiled=True), tree, dims)


def _per_expert(one, batch, experts, tree, dims):
    """``one(g, d, batch)`` over the leaves; a leaf split over ``expert`` (``experts``:
    its dimension, ``runtime/experts.py``) holds the sum over its expert group's rows
    already: averaged over the other batch axes and divided by the expert count."""
    if experts is None:
        return jax.tree.map(lambda g, d: one(g, d, batch), tree, dims)
    rest = tuple(a for a in batch if a != EXPERT)

    def leaf(g, d, e):
        return one(g, d, batch) if e < 0 else one(g, d, rest) / lax.axis_size(EXPERT)
    return jax.tree.map(leaf, tree, dims, experts)


def mean_of_scattered(tree, dims, batch, wire_dtype=jnp.float32, ring_rest: bool = False, experts=None):
    """The mean over the batch axes of what ``sum_scatter`` accumulated: a sharded leaf (a
    shard of the sum over ``fsdp``) divided by the ``fsdp`` size and averaged over the
    other batch axes (``ring_rest``: left for a ring to average), any other leaf averaged
    over all of them."""
    def one(g, d, batch):
        if d < 0:
            return ringsync.mean(g, batch, wire_dtype)
        others = tuple(a for a in batch if a != FSDP)
        g = g / lax.axis_size(FSDP)
        return g if ring_rest or not others else ringsync.mean(g, others, wire_dtype)
    return _per_expert(one, batch, experts, tree, dims)


def mean_scatter(tree, dims, batch, offset: int = 0, wire_dtype=jnp.float32, experts=None):
    """The mean over the batch axes, reduce-scattered over ``fsdp`` where a leaf is sharded:
    each device keeps its shard of the mean. ``wire_dtype``: the values' dtype on the
    wire (sums in fp32, ``ringsync.mean``)."""
    def one(g, d, batch):
        if d < 0:
            return ringsync.mean(g, batch, wire_dtype)
        others = tuple(a for a in batch if a != FSDP)
        g = ringsync.reduce_scatter(g, FSDP, d + offset, wire_dtype) / lax.axis_size(FSDP)
        return ringsync.mean(g, others, wire_dtype) if others else g
    return _per_expert(one, batch, experts, tree, dims)


def scatter_first(tree, dims, batch, offset: int = 0, wire_dtype=jnp.float32):
    """The first half of ``mean_scatter``, for a sync that runs the rest as a ring over the
    other batch axes: a leaf sharded over ``fsdp`` is reduce-scattered over it (its mean
    over ``fsdp``, still to be averaged over the others); any other leaf is averaged over
    all of ``batch`` at once."""
    def one(g, d):
        if d < 0:
            return ringsync.mean(g, batch, wire_dtype)
        return ringsync.reduce_scatter(g, FSDP, d + offset, wire_dtype) / lax.axis_size(FSDP)
    return jax.tree.map(one, tree, dims)


def local_shard(tree, dims, offset: int = 0):
    """This device's ``fsdp`` shard of each (already averaged, replicated) leaf."""
    def one(g, d):
        if d < 0:
            return g
        n = lax.axis_size(FSDP)
        size = g.shape[d + offset] // n
        return lax.dynamic_slice_in_dim(g, lax.axis_index(FSDP) * size, size, axis=d + offset)
    return jax.tree.map(one, tree, dims)


@dataclasses.dataclass(frozen=True)
class EndSplit:
    """How an embedding or head leaf enters the pipeline: split along ``dim`` over
    ``axes`` (``fsdp`` and/or ``pipe``, major first, as its storage spec lists
    them), or whole (``axes == ()``). A leaf of ``jax.tree`` (not a pytree)."""

    dim: int
    axes: tuple[str, ...]

    @property
    def over_pipe(self) -> bool:
        return PIPE in self.axes

    def spec(self) -> P:
        if not self.axes:
            return P()
        return P(*([None] * self.dim), self.axes[0] if len(self.axes) == 1 else self.axes)


def end_splits(specs, tree, mesh_shape):
    """Per leaf of an embedding or head ``tree``: its ``EndSplit`` read from its storage
    spec's ``fsdp`` entry (``specs``: a matching tree of specs or shardings, or None).
    ``fsdp`` counts only when its size is > 1 (as ``dims_of``'s callers decide);
    ``pipe`` whenever the storage lists it."""
    def one(spec, _):
        entries = tuple(getattr(spec, "spec", spec)) if spec is not None else ()
        dim = fsdp_dim(P(*entries)) if entries else NOT_SHARDED
        if dim < 0:
            return EndSplit(0, ())
        entry = entries[dim] if isinstance(entries[dim], tuple) else (entries[dim],)
        axes = tuple(a for a in entry if a == PIPE or (a == FSDP and mesh_shape.get(FSDP, 1) > 1))
        return EndSplit(dim, axes)
    if specs is None:
        return jax.tree.map(lambda _: EndSplit(0, ()), tree)
    return jax.tree.map(one, specs, tree, is_leaf=lambda s: isinstance(s, P) or hasattr(s, "spec"))


def gather_ends(tree, splits):
    """Each leaf whole on every device: all-gathered over its split's axes, minor first."""
    def one(x, split):
        for axis in reversed(split.axes):
            x = lax.all_gather(x, axis, axis=split.dim, tiled=True)
        return x
    return jax.tree.map(one, tree, splits)


def local_piece(tree, splits):
    """This device's piece of each whole embedding or head leaf, as its ``EndSplit``
    stores it (device ``(f, s)`` keeps piece ``f · pipe + s``: what
    ``sum_over_pipe_then_mean``'s reduce-scatters leave)."""
    def one(g, split):
        if not split.axes:
            return g
        index, count = 0, 1
        for axis in split.axes:  # major first
            index, count = index * lax.axis_size(axis) + lax.axis_index(axis), count * lax.axis_size(axis)
        size = g.shape[split.dim] // count
        return lax.dynamic_slice_in_dim(g, index * size, size, axis=split.dim)
    return jax.tree.map(one, tree, splits)


def sum_over_pipe_then_mean(tree, splits, batch, wire_dtype=jnp.float32):
    """An embedding's or head's gradient (its owners' contributions, zeros elsewhere):
    summed over ``pipe`` and averaged over the batch axes, each device keeping its
    piece as the leaf is stored. A leaf split over ``pipe`` is reduce-scattered over
    its axes (major first, so device ``(f, s)`` keeps piece ``f · pipe + s``) instead
    of ``psum``-ed whole."""
    def one(g, split):
        if not split.over_pipe:
            g = lax.psum(g, PIPE)
            if FSDP in split.axes:
                return mean_scatter(g, split.dim, batch, wire_dtype=wire_dtype)
            return ringsync.mean(g, batch, wire_dtype)
        for axis in split.axes:
            g = ringsync.reduce_scatter(g, axis, split.dim, wire_dtype)
        if FSDP in split.axes:
            g = g / lax.axis_size(FSDP)
        others = tuple(a for a in batch if a not in split.axes)
        return ringsync.mean(g, others, wire_dtype) if others else g
    return jax.tree.map(one, tree, splits)
