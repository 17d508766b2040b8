"""What every pipeline runtime shares inside ``jax.shard_map``: the manual axes, the
model contract as pure functions, and the per-device value helpers."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

AXIS = "pipe"
# The batch axes are manual too: each data shard runs the schedule on its own rows
# and the gradients are averaged over them once, after the last tick. Leaving them
# to the compiler instead made XLA 0.10's SPMD partitioner abort on pipe × data ×
# tensor meshes; manual batch axes are also where AFAPAB's explicit gradient sync lives.
# ``expert`` is a batch axis outside the MoE layers (the rules table's ``batch``): its
# devices hold their own rows and their own experts (``runtime/experts.py``).
EXPERT = "expert"
BATCH = ("data", "fsdp", EXPERT)
MANUAL = (AXIS, *BATCH)


@dataclasses.dataclass(frozen=True)
class StageFns:
    """The pipeline model contract as three pure functions of (params, inputs)."""

    embed: Callable[[Any, jax.Array], jax.Array]
    layer: Callable[[Any, jax.Array], jax.Array]  # one block: (its params, h) -> h
    head_loss: Callable[[Any, jax.Array, jax.Array], jax.Array]


def needs_lockstep(mesh) -> bool:
    """Whether stage code may hold collectives that a per-device branch would strand.

    Inside the ``shard_map`` only the pipe and batch axes (``expert`` among them) are
    manual; any other axis of size > 1 (tensor) is left to XLA, which inserts whatever collectives
    the model's shardings need, wherever it likes. An all-reduce among one stage's
    tensor group survives a per-device ``lax.switch`` (the group takes the same
    branch), but a resharding collective-permute is one instruction over every
    device of the mesh: inside a branch that only one stage takes it waits for
    devices that never come (XLA aborts). Which kind XLA picks depends on the
    model, so the runtime does not bet on it: with such an axis every device runs
    every task kind some stage runs in that tick (``cond`` on a predicate read
    from the table, the same on all devices) and keeps its own task's outputs.
    The price is compute: a tick costs the sum of its task kinds instead of the
    largest (benchmarks/pipeline_lockstep.py measures it). ``expert`` > 1 does not
    need it (``branch_collectives``): its collectives are the MoE layer's explicit
    ``all_to_all`` among one stage's devices, which take the same branch.
    """
    return any(size > 1 for axis, size in mesh.shape.items() if axis not in MANUAL)


def branch_collectives(mesh) -> bool:
    """Whether a stage's branches hold collectives of their own among the stage's
    devices (``expert`` > 1: the MoE layer's ``all_to_all``). One stage's devices take
    the same branches, but XLA:CPU starts independent ops in any order per device: a
    device that started the tick's ring ``ppermute`` (or another part's branch) before a
    branch's all_to_all waited for a peer that did the opposite (a pipe4 x expert2 run
    hung). The tick then chains its parts and issues its transfers after them
    (``ticks.make_tick(ordered=True)``), the same order on every device."""
    return mesh.shape.get(EXPERT, 1) > 1


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
