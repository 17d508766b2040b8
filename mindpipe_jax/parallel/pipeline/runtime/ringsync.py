"""A chunk's data-parallel gradient sync spread over the pipeline's ticks.

AFAPAB's point is that a chunk's gradient all-reduce over the batch axes runs
while the rest of the step still computes. One ``pmean`` issued after the
chunk's last backward leaves the overlap to the compiler's scheduler (XLA:CPU
moves it to the end of the step). Here it is in the program itself. The
chunk's gradients, flattened into one fp32 vector cut into ``buckets`` of ``d``
pieces (``d`` = data × fsdp devices), are reduced by a ring reduce-scatter:
``d - 1`` steps per bucket, each sending one piece to the next device on the
ring; the runtime runs one step per tick of its loop, beside that tick's compute
and pipeline transfers. Then, one bucket per tick, an all-gather of the reduced
pieces makes the result whole again — an all-gather rather than more ring steps
because its result is the same on every batch device in JAX's type system
(``to="invarying"``), as the ``shard_map`` output needs; a ring's is not.

The result is the mean over the batch devices, summed in ring order: equal to
``lax.pmean`` up to fp32 rounding, and the same on every run.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax


class RingSync:
    """Mean of a flat fp32 vector ``[n]`` over ``axes`` (``d`` devices): ``start``,
    then ``scatter_step`` for k in ``range(scatter_steps)``, then ``gather_step``
    for b in ``range(buckets)``, then ``finish``. Each step is one collective of
    one piece (at most ``bucket_bytes / d``)."""

    def __init__(self, n: int, axes: tuple[str, ...], d: int, bucket_bytes: int | None = None):
        self.n, self.axes, self.d = n, axes, d
        per_bucket = n if not bucket_bytes else max(d, bucket_bytes // 4)
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
        got = lax.ppermute(sent, self.axes, self.ring)
        at = (me - j - 1) % self.d
        pieces = lax.dynamic_update_index_in_dim(
            pieces, lax.dynamic_index_in_dim(pieces, at, 0, keepdims=False) + got, at, 0)
        return {**state, "parts": lax.dynamic_update_index_in_dim(state["parts"], pieces, bucket, 0)}

    def gather_step(self, state, b):
        """All-gather of bucket ``b``'s reduced pieces (device i holds piece i + 1)."""
        me = lax.axis_index(self.axes)
        pieces = lax.dynamic_index_in_dim(state["parts"], b, 0, keepdims=False)
        mine = lax.dynamic_index_in_dim(pieces, (me + 1) % self.d, 0, keepdims=False)
        whole = jnp.roll(lax.all_gather(mine, self.axes, to="invarying"), 1, axis=0)
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


def flatten(tree):
    """A pytree of arrays -> (one fp32 vector, a function mapping such a vector back)."""
    leaves, treedef = jax.tree.flatten(tree)
    shapes = [(x.shape, x.dtype) for x in leaves]
    flat = jnp.concatenate([x.reshape(-1).astype(jnp.float32) for x in leaves])

    def unflatten(vec):
        out, at = [], 0
        for shape, dtype in shapes:
            size = math.prod(shape)
            out.append(vec[at:at + size].reshape(shape).astype(dtype))
            at += size
        return jax.tree.unflatten(treedef, out)

    return flat, unflatten
