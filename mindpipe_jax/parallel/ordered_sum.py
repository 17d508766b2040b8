"""Sums whose bits do not depend on how many devices share the work.

A floating-point sum's last bits depend on its association. Deterministic modes
(the train step's virtual shards, SPara, the pipeline's ``deterministic=True``)
cut a batch into a fixed number of equal units, compute each unit's gradient with
a program that does not depend on the layout, and add the units in one balanced
tree over their global order: ``pairwise_sum`` for a stack held on one device,
``ordered_sum`` for per-device partial sums (each the tree's lower levels over
that device's contiguous units), gathered unreduced and summed in device order
(the upper levels). For power-of-two unit and device counts the two give the same
tree on every mesh. ``ordered_sum`` costs each device every device's partial sum
at once (the bits are the point, not the bytes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["ordered_sum", "pairwise_sum"]


def pairwise_sum(stacked):
    """Sum the leading axis of every leaf in one fixed balanced order (any length:
    adjacent pairs, an odd last element carried up a level)."""
    def one(x):
        while x.shape[0] > 1:
            n = x.shape[0]
            pairs = x[0:n - n % 2:2] + x[1:n - n % 2:2]
            x = jnp.concatenate([pairs, x[n - 1:]]) if n % 2 else pairs
        return x[0]
    return jax.tree.map(one, stacked)


def ordered_sum(tree, axes):
    """Inside ``shard_map``, manual over ``axes``: the sum over those devices of each
    device's ``tree``, added in device order as ``pairwise_sum`` would (the same on
    every device, invariant over ``axes``). One device: the tree as it is."""
    if not axes:
        return tree
    gathered = jax.tree.map(lambda x: lax.all_gather(x, axes, to="invarying"), tree)
    return pairwise_sum(gathered)
