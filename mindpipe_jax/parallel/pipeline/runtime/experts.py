"""Expert parallelism inside the pipeline (``parallel.expert > 1`` with ``pipe > 1``).

The pipeline's ``shard_map`` is manual over ``expert`` as over the other batch axes
(``spmd.BATCH``): outside the MoE layers an expert device is one more data shard, with
its own rows. A weight whose storage spec names ``expert`` (an MoE block's
``[experts, ...]`` stack) enters split on that dimension, so a device holds only its
experts; the MoE layer sends each expert's tokens to the device holding it with
``all_to_all`` (``models/moe.py``), whose transpose brings the tokens' cotangents back.

So a device's gradient of its own experts is already summed over the rows of every
expert device of its group. The global mean is then the mean over the other batch
axes divided by the expert count, where a weight every expert device holds whole
(attention, the router) is averaged over all batch axes as before
(``fsdp.mean_scatter``'s ``experts``).
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from mindpipe_jax.parallel.pipeline.runtime import fsdp
from mindpipe_jax.parallel.pipeline.runtime.spmd import EXPERT

NOT_SPLIT = -1  # not None: None is an empty subtree to jax.tree.map


def expert_dim(spec) -> int:
    """The dimension a storage ``PartitionSpec`` splits over ``expert``, or ``NOT_SPLIT``."""
    for i, entry in enumerate(tuple(getattr(spec, "spec", spec) or ())):
        if EXPERT in (entry if isinstance(entry, tuple) else (entry,)):
            return i
    return NOT_SPLIT


def dims_of(specs, tree, mesh_shape):
    """Per leaf of ``tree``: its ``expert`` dimension read from ``specs`` (storage
    shardings or specs); ``NOT_SPLIT`` everywhere when the axis is 1 or no specs."""
    if specs is None or mesh_shape.get(EXPERT, 1) == 1:
        return jax.tree.map(lambda _: NOT_SPLIT, tree)
    return jax.tree.map(lambda s, _: expert_dim(s), specs, tree,
                        is_leaf=lambda s: isinstance(s, P) or hasattr(s, "spec"))


def any_split(dims) -> bool:
    return any(d >= 0 for d in jax.tree.leaves(dims))


def with_expert(spec: P, dim: int, lead: int) -> P:
    """``spec`` (a ``shard_map`` spec) with ``expert`` at ``dim`` (counted after ``lead``
    leading entries)."""
    if dim < 0:
        return spec
    entries = list(spec) + [None] * max(0, lead + dim + 1 - len(spec))
    if entries[lead + dim] is not None:
        raise ValueError(f"dimension {dim} is split over both {entries[lead + dim]!r} and 'expert'")
    entries[lead + dim] = EXPERT
    return P(*entries)


def check_supported(mesh, deterministic: bool) -> None:
    """Expert gradients are not in the deterministic mode's ordered sums. (With
    ``grad_sync="chunk"`` they are averaged at their chunk's sync point, beside the ring
    that averages the rest: ``tickloop.owned_shards``.)"""
    if mesh.shape.get(EXPERT, 1) > 1 and deterministic:
        raise ValueError(f"expert parallelism inside the pipeline (expert={mesh.shape[EXPERT]}) "
                         f"needs deterministic=False")


def stack_dims(param_specs, embed_p, blocks_p, head_p, mesh_shape):
    """The stack leaves' ``expert`` dimensions (``dims_of``) counted after their layer axis;
    the embedding and head must have none."""
    for name, tree in (("embed", embed_p), ("head", head_p)):
        if any_split(dims_of(param_specs and param_specs[name], tree, mesh_shape)):
            raise ValueError(f"the {name} parameters are split over 'expert': only the blocks' may be")
    return jax.tree.map(lambda d: d - 1 if d >= 0 else d,
                        dims_of(param_specs and param_specs["blocks"], blocks_p, mesh_shape))


def stack_specs(fsdp_dims, expert_dims, lead):
    """The staged stack's ``shard_map`` specs: ``lead``, then ``fsdp`` and ``expert`` at their
    dimensions (counted after ``lead``)."""
    return jax.tree.map(lambda d, e: with_expert(fsdp.in_spec(d, lead), e, len(lead)), fsdp_dims, expert_dims)
