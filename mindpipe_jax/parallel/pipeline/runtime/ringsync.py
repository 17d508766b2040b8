"""A chunk's data-parallel gradient sync spread over the pipeline's ticks.

AFAPAB's point is that a chunk's gradient all-reduce over the batch axes runs
while the rest of the step still computes. One ``pmean`` issued after the
chunk's last backward leaves the overlap to the compiler's scheduler (XLA:CPU
moves it to the end of the step). Here it is in the program itself. The
chunk's gradients, flattened into one fp32 vector cut into ``buckets`` of ``d``
pieces (``d`` = data × fsdp devices; ``data`` alone for weights stored sharded
over ``fsdp``, whose shards are reduce-scattered first: ``tickloop.OwnedShards``),
are reduced by a ring reduce-scatter: ``d - 1`` steps per bucket, each sending one
piece to the next device on the ring; the runtime runs one step per tick of its
loop, beside that tick's compute and pipeline transfers. Then, one bucket per
tick, an all-gather of the reduced pieces makes the result whole again — an
all-gather rather than more ring steps because its result is the same on every
batch device in JAX's type system (``to="invarying"``), as the ``shard_map``
output needs; a ring's is not.

The result is the mean over the batch devices, summed in ring order: equal to
``lax.pmean`` up to fp32 rounding, and the same on every run.

What goes on the wire: ``wire_dtype`` (fp32, or bf16 for half the bytes). A ring
step sends its partial sum cast to that dtype and the receiver adds it into its
fp32 piece, so sums accumulate in fp32; the all-gather sends the reduced pieces
in that dtype. XLA:CPU widens bf16 collectives to fp32 (a bf16 ``ppermute``,
``all_gather`` or ``all_to_all`` compiled to an f32 one), so the values travel as
their bits (``uint16``), which no pass widens (``to_wire``/``from_wire``).

What each device sends is its own: inside the pipeline's ``shard_map`` only
``pipe`` and the batch axes are manual, so a gradient leaf sharded over an
automatic axis (``tensor``, ``expert``) looks whole there. Concatenating such
leaves into one vector made XLA all-gather every tensor shard first (the
concatenation has no sharding made of its operands'), so every tensor rank sent
the whole chunk, ``t`` times what the end-of-step ``pmean`` of the sharded
leaves sends. ``LocalRing`` runs the ring's steps in a ``shard_map`` nested
inside the pipeline's, manual over those automatic axes: each device flattens
only its own shards of the leaves, and the ring's state is kept between ticks
as one block per device along them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P


def to_wire(x, wire_dtype):
    """``x`` as sent: cast to ``wire_dtype``; a narrow float as its bits (see the module
    docstring), so that every backend sends ``wire_dtype``'s bytes."""
    wire = jnp.dtype(wire_dtype)
    x = x.astype(wire)
    return lax.bitcast_convert_type(x, jnp.uint16) if wire.itemsize == 2 else x


def from_wire(y, wire_dtype):
    """What ``to_wire`` sent, as fp32 (the receiver accumulates in fp32)."""
    wire = jnp.dtype(wire_dtype)
    y = lax.bitcast_convert_type(y, wire) if wire.itemsize == 2 else y
    return y.astype(jnp.float32)


class RingSync:
    """Mean of a flat fp32 vector ``[n]`` over ``axes`` (``d`` devices): ``start``,
    then ``scatter_step`` for k in ``range(scatter_steps)``, then ``gather_step``
    for b in ``range(buckets)``, then ``finish``. Each step is one collective of
    one piece (at most ``bucket_bytes / d``)."""

    def __init__(self, n: int, axes: tuple[str, ...], d: int, bucket_bytes: int | None = None,
                 wire_dtype=jnp.float32):
        self.n, self.axes, self.d = n, axes, d
        self.wire = jnp.dtype(wire_dtype)
        # A bucket is bytes on the wire: bf16 fits twice the elements of fp32.
        per_bucket = n if not bucket_bytes else max(d, bucket_bytes // self.wire.itemsize)
        self.buckets = max(1, math.ceil(n / per_bucket))
        self.piece = math.ceil(math.ceil(n / self.buckets) / d)
        self.scatter_steps = self.buckets * (d - 1)
        self.ring = [(i, (i + 1) % d) for i in range(d)]

    def start(self, flat: jax.Array, other_axes: tuple[str, ...] = ()):
        """``other_axes``: manual axes the values differ over besides ``axes`` (the
        all-gathered result is the same over ``axes`` only)."""
        padded = jnp.zeros(self.buckets * self.d * self.piece, jnp.float32).at[:self.n].set(flat)
        out = jnp.zeros((self.buckets, self.d, self.piece), jnp.float32)
        if other_axes:
            out = lax.pcast(out, tuple(other_axes), to="varying")
        return {"parts": padded.reshape(self.buckets, self.d, self.piece), "out": out}

    def scatter_step(self, state, k):
        """Reduce-scatter step ``k`` (traced): step ``j`` of bucket ``k // (d-1)``;
        device ``i`` sends piece ``i - j`` and adds what arrives into piece ``i - j - 1``.
        After ``d - 1`` steps device ``i`` holds piece ``i + 1`` summed over all."""
        me = lax.axis_index(self.axes)
        bucket, j = k // (self.d - 1), k % (self.d - 1)
        pieces = lax.dynamic_index_in_dim(state["parts"], bucket, 0, keepdims=False)
        sent = lax.dynamic_index_in_dim(pieces, (me - j) % self.d, 0, keepdims=False)
        got = from_wire(lax.ppermute(to_wire(sent, self.wire), self.axes, self.ring), self.wire)
        at = (me - j - 1) % self.d
        pieces = lax.dynamic_update_index_in_dim(
            pieces, lax.dynamic_index_in_dim(pieces, at, 0, keepdims=False) + got, at, 0)
        return {**state, "parts": lax.dynamic_update_index_in_dim(state["parts"], pieces, bucket, 0)}

    def gather_step(self, state, b):
        """All-gather of bucket ``b``'s reduced pieces (device i holds piece i + 1)."""
        me = lax.axis_index(self.axes)
        pieces = lax.dynamic_index_in_dim(state["parts"], b, 0, keepdims=False)
        mine = lax.dynamic_index_in_dim(pieces, (me + 1) % self.d, 0, keepdims=False)
        gathered = from_wire(lax.all_gather(to_wire(mine, self.wire), self.axes, to="invarying"), self.wire)
        whole = jnp.roll(gathered, 1, axis=0)
        return {**state, "out": lax.dynamic_update_index_in_dim(state["out"], whole, b, 0)}

    @property
    def num_steps(self) -> int:
        return self.scatter_steps + self.buckets

    def step(self, state, k: int):
        """Step ``k`` (static) of the whole sequence."""
        if k < self.scatter_steps:
            return self.scatter_step(state, k)
        return self.gather_step(state, k - self.scatter_steps)

    def finish(self, state) -> jax.Array:
        return state["out"].reshape(-1)[:self.n] / self.d


def _local_shape(shape, spec, sizes: dict[str, int]) -> tuple[int, ...]:
    """A leaf's shape on one device, given its ``PartitionSpec`` over the axes in ``sizes``."""
    out = list(shape)
    for dim, entry in enumerate(tuple(spec or ())):
        for axis in entry if isinstance(entry, tuple) else (entry,):
            if axis in sizes:
                out[dim] //= sizes[axis]
    return tuple(out)


def _is_spec(x) -> bool:
    return x is None or isinstance(x, P)


def _named_axes(specs) -> set[str]:
    return {a for s in specs for e in s for a in (e if isinstance(e, tuple) else (e,)) if a is not None}


def on_shards(fn, tree, specs, auto: dict[str, int]):
    """``fn(tree)``, a tree of the same structure and shardings, run on each device's own
    shards along the automatic axes (``auto``: ``{axis: size}``) that ``specs`` (a
    matching tree of ``PartitionSpec``s, or None: all whole) names: a ``shard_map``
    nested in the pipeline's, as ``LocalRing``'s steps. A reshape of a leaf sharded
    along an automatic axis made XLA gather it first; inside, a reshape is local."""
    leaves, treedef = jax.tree.flatten(tree)
    spec_leaves = tuple(s or P() for s in ([None] * len(leaves) if specs is None
                                           else jax.tree.leaves(specs, is_leaf=_is_spec)))
    axes = {a for a in _named_axes(spec_leaves) if auto.get(a, 1) > 1}
    if not axes:
        return fn(tree)
    local = lambda *xs: tuple(jax.tree.leaves(fn(jax.tree.unflatten(treedef, list(xs)))))  # noqa: E731
    out = jax.shard_map(local, in_specs=spec_leaves, out_specs=spec_leaves, axis_names=axes,
                        check_vma=False)(*leaves)
    return jax.tree.unflatten(treedef, list(out))


class LocalRing:
    """A ``RingSync`` of a gradient tree in which each device sends only its own shards.

    ``tree``: the gradient leaves as the pipeline's ``shard_map`` sees them (whole
    along the automatic axes); ``specs``: a matching tree of ``PartitionSpec``s
    naming the automatic axes each leaf is sharded over (None: every leaf whole on
    every device); ``auto``: ``{axis: size}`` of the automatic mesh axes.
    ``start``/``scatter_step``/``gather_step``/``step``/``finish`` as ``RingSync``'s,
    each run on every device's own shards (a ``shard_map`` manual over the automatic
    axes the leaves are sharded over, nested in the pipeline's); between them the
    ring's state is one block per device along those axes (leading dimension).
    A leaf whole along an automatic axis is sent in full by each device along it,
    as ``pmean`` sends it; the copies stay equal (the same sums of the same values),
    which is what lets the nested ``shard_map`` hand them back as replicated
    (``check_vma=False``: JAX's types cannot say a value is equal across the devices
    that computed it redundantly).
    """

    def __init__(self, tree, specs, auto: dict[str, int], axes: tuple[str, ...], d: int,
                 bucket_bytes: int | None = None, wire_dtype=jnp.float32, other_axes: tuple[str, ...] = ()):
        leaves, self.treedef = jax.tree.flatten(tree)
        spec_leaves = [None] * len(leaves) if specs is None else jax.tree.leaves(specs, is_leaf=_is_spec)
        if len(spec_leaves) != len(leaves):
            raise ValueError(f"{len(spec_leaves)} sharding specs for {len(leaves)} gradient leaves")
        self.specs = tuple(s or P() for s in spec_leaves)
        named = _named_axes(self.specs)
        self.auto = tuple(a for a, n in auto.items() if n > 1 and a in named)
        sizes = {a: auto[a] for a in self.auto}
        self.layout = [(_local_shape(x.shape, s, sizes), x.dtype)
                       for x, s in zip(leaves, self.specs, strict=True)]
        n = sum(math.prod(shape) for shape, _ in self.layout)
        self.ring = RingSync(n, axes, d, bucket_bytes, wire_dtype)
        self.other = other_axes
        self.scatter_steps, self.num_steps = self.ring.scatter_steps, self.ring.num_steps

    def _local(self, fn, in_specs, out_specs):
        """``fn`` on each device's own shards (itself where no leaf is sharded)."""
        if not self.auto:
            return fn
        return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, axis_names=set(self.auto),
                             check_vma=False)

    def _block(self):
        return P(self.auto) if self.auto else None

    def _pack(self, state):  # one device's state -> its block of the carried state
        return jax.tree.map(lambda x: x[None], state) if self.auto else state

    def _unpack(self, state):
        return jax.tree.map(lambda x: x[0], state) if self.auto else state

    def start(self, tree):
        def local(*leaves):
            flat = jnp.concatenate([x.reshape(-1).astype(jnp.float32) for x in leaves])
            return self._pack(self.ring.start(flat, self.other))
        return self._local(local, self.specs, self._block())(*self.treedef.flatten_up_to(tree))

    def _stepper(self, step):
        def run(state, k):
            local = lambda s, i: self._pack(step(self._unpack(s), i))  # noqa: E731
            return self._local(local, (self._block(), P()), self._block())(state, k)
        return run

    def scatter_step(self, state, k):
        return self._stepper(self.ring.scatter_step)(state, k)

    def gather_step(self, state, b):
        return self._stepper(self.ring.gather_step)(state, b)

    def step(self, state, k: int):
        return self.scatter_step(state, k) if k < self.scatter_steps else \
            self.gather_step(state, k - self.scatter_steps)

    def finish(self, state):
        def local(state):
            vec, out, at = self.ring.finish(self._unpack(state)), [], 0
            for shape, dtype in self.layout:
                size = math.prod(shape)
                out.append(vec[at:at + size].reshape(shape).astype(dtype))
                at += size
            return tuple(out)
        leaves = self._local(local, self._block(), self.specs)(state)
        return jax.tree.unflatten(self.treedef, list(leaves))


def reduce_scatter(g, axis: str, dim: int, wire_dtype=jnp.float32):
    """``lax.psum_scatter(g, axis, scatter_dimension=dim, tiled=True)`` with ``wire_dtype``
    values on the wire: fp32 is ``psum_scatter`` itself; a narrower dtype goes as an
    ``all_to_all`` of the pieces (each device sends piece ``j`` to device ``j``, the same
    bytes as a ring reduce-scatter), summed in fp32 by their owner."""
    if jnp.dtype(wire_dtype) == jnp.float32:
        return lax.psum_scatter(g, axis, scatter_dimension=dim, tiled=True)
    n = lax.axis_size(axis)
    split = g.reshape(*g.shape[:dim], n, g.shape[dim] // n, *g.shape[dim + 1:])
    got = from_wire(lax.all_to_all(to_wire(split, wire_dtype), axis, split_axis=dim, concat_axis=dim),
                    wire_dtype)
    return got.sum(axis=dim).astype(g.dtype)


def mean(g, axes: tuple[str, ...], wire_dtype=jnp.float32):
    """``lax.pmean(g, axes)`` with ``wire_dtype`` values on the wire: fp32 is ``pmean``
    itself; a narrower dtype is a reduce-scatter (``reduce_scatter``, fp32 sums) over
    each axis then all-gathers of the reduced pieces: ``2 (n - 1) / n`` of the
    gradient's bytes in that dtype per device, as a ring all-reduce."""
    if jnp.dtype(wire_dtype) == jnp.float32:
        return lax.pmean(g, axes)
    big = tuple(a for a in axes if lax.axis_size(a) > 1)
    n = math.prod(lax.axis_size(a) for a in big)
    x = g.reshape(-1).astype(jnp.float32)
    x = jnp.pad(x, (0, -x.size % n))
    for axis in big:
        x = reduce_scatter(x, axis, 0, wire_dtype)
    for axis in reversed(big):
        x = from_wire(lax.all_gather(to_wire(x, wire_dtype), axis, tiled=True, to="invarying"), wire_dtype)
    out = (x[:g.size] / n).reshape(g.shape).astype(g.dtype)
    small = tuple(a for a in axes if a not in big)
    return lax.pmean(out, small) if small else out  # invariant over size-1 axes too, as pmean's
