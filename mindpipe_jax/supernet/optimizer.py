"""From per-device gradients to new parameters, in one fixed order: reduction and lazy AdamW.

Reduction
---------
``pairwise_sum`` (``parallel/ordered_sum.py``) sums a leading axis in one balanced order. ``reduce_round`` is
a round's exchange inside the step's ``shard_map``: each device holds the
gradients of its W slots summed over its own contiguous virtual shards (the
lower levels of the pairwise tree over the V shards); one ``all_to_all`` gives
each of the N devices every device's partials for the 1/N of the raveled
parameters it owns, and it sums the data devices' partials in device order (the
upper levels of the tree: for power-of-two V and D the same tree on every mesh).
Per-slot norms are sums over ``PARAM_CHUNKS`` fixed chunks in a fixed order, so
they too are the same bits on every mesh; then each slot is clipped on its own.

Optimizer: lazy AdamW
---------------------
Every parameter has AdamW moments; **Candidate** parameters (the searchable
operators) have one step count per unit (``[layers, candidates]``) and are
updated only where a subnet used the unit: an operator no subnet chose keeps
its weights and moments (no weight decay or momentum drift while unsampled).
Shared parameters (embedding, attention, norms, head) are updated every step.
Each subnet's gradient is clipped to ``optim.clip_norm`` on its own (per-subnet
global norm) before it is combined. Inside the step every gradient is one
raveled ``float32[P]`` vector (a few large arrays instead of one per leaf: less
to compile); the optimizer state is kept the same way (``mu``, ``nu``:
``float32[P]``; ``count``: ``int32[units + 1]``, the last for shared params),
and ``adamw`` updates one device's slice of it (ZeRO-1 style).

Separate because this is the arithmetic the bitwise promise rests on: every
operation here is elementwise or a fixed-shape reduction in a fixed order. The
step (``spara.py``), its sequential reference and the search use it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from mindpipe_jax.config import OptimConfig
from mindpipe_jax.parallel.ordered_sum import pairwise_sum
from mindpipe_jax.supernet.plan import AXES
from mindpipe_jax.supernet.spec import PARAM_CHUNKS, SupernetSpec


def global_norm(flat) -> jax.Array:
    return jnp.sqrt(jnp.sum(jnp.square(flat)))


def clip(grads, norm, max_norm: float):
    """optax.clip_by_global_norm's rule (scale by max_norm / norm when above) given the norm; 0 disables.

    ``norm`` is a scalar, or one norm per leading index of every leaf (``[R]`` for ``[R, ...]``).
    """
    if not max_norm:
        return grads
    # One scalar scale, then a multiply: a vector division here rounded differently in
    # different fusions (seen: 1 vs 2 data devices), a multiply by one scalar never does.
    scale = jnp.where(norm < max_norm, 1.0, max_norm / norm)

    def one(g):
        s = scale.astype(g.dtype)
        return g * (s.reshape(s.shape + (1,) * (g.ndim - s.ndim)) if s.ndim else s)
    return jax.tree.map(one, grads)


def reduce_round(losses, grads, *, n_sub: int, n_data: int, virtual_shards: int, clip_norm: float):
    """One round's slots, reduced over the devices in a fixed order (inside ``shard_map`` over AXES).

    ``losses`` ``[W]``, ``grads`` ``[W, Pp]``: this device's slots, summed over its own
    virtual shards. Returns every slot of the round (``R = n_sub·W``, group-major):
    its mean loss ``[R]``, its gradient norm ``[R]`` and its clipped mean gradient on
    this device's chunk of the raveled parameters, ``[R, Pp / N]``.
    """
    w, size = grads.shape
    n_dev, r_slots = n_sub * n_data, n_sub * w
    chunk = size // n_dev  # this device's share of the raveled parameters
    per_fixed = size // PARAM_CHUNKS  # elements per fixed norm chunk
    # One exchange: device n receives chunk n of every device's W slots. Then the
    # upper levels of the tree: each group's data devices, in order.
    grads = lax.all_to_all(jnp.swapaxes(grads.reshape(w, n_dev, chunk), 0, 1), AXES, 0, 0)
    grads = jnp.moveaxis(grads.reshape(n_sub, n_data, w, chunk), 1, 0)  # [D, S, W, chunk]
    grads = lax.optimization_barrier(pairwise_sum(grads)) * (1.0 / virtual_shards)  # [S, W, chunk]
    grads = grads.reshape(r_slots, chunk)  # slot order: group-major
    # Norm: per fixed chunk (same shape on every mesh), then a fixed tree over the chunks.
    parts = lax.map(lambda row: jnp.sum(jnp.square(row)), grads.reshape(-1, per_fixed))
    # One gather brings every device's norm parts and its slots' partial losses
    # (collectives are the fixed cost of a round: fewer of them, fewer waits).
    every = lax.all_gather(jnp.concatenate([parts, losses]), AXES, to="invarying")  # [N, ...]
    parts = every[:, :-w].reshape(n_dev, r_slots, -1)  # [N, R, 64/N]
    parts = jnp.moveaxis(parts, 0, 1).reshape(r_slots, PARAM_CHUNKS)  # columns in device order
    norms = jnp.sqrt(pairwise_sum(jnp.moveaxis(parts, 1, 0)))  # [R]
    losses = jnp.moveaxis(every[:, -w:].reshape(n_sub, n_data, w), 1, 0)  # [D, S, W]
    losses = (pairwise_sum(losses) * (1.0 / virtual_shards)).reshape(r_slots)  # [R], group-major
    return losses, norms, clip(grads, norms, clip_norm)


def adamw(spec: SupernetSpec, p, g, opt: dict, unit_mask, shared: bool, lr, optim: OptimConfig,
          offset=None):
    """One lazy AdamW update of the flat params ``p`` with gradient ``g``.

    ``p``, ``g``, ``opt["mu"]``, ``opt["nu"]`` are raveled vectors, or (``offset``, may
    be traced) the same slice ``[offset, offset + len(p))`` of each; ``opt["count"]``
    is always whole.

    Updates the elements of the units where ``unit_mask`` (``bool[*unit_grid]``)
    is True, and the shared elements if ``shared``; every other element, its
    moments and its unit's count stay exactly as they were. The arithmetic is
    optax's ``adamw`` (moments, bias correction with the incremented count,
    ``mu_hat / (sqrt(nu_hat) + eps)``, decoupled weight decay on matrices).
    """
    sel = jnp.concatenate([jnp.asarray(unit_mask).reshape(-1), jnp.asarray(shared, bool).reshape(1)])
    count = opt["count"] + sel.astype(jnp.int32)
    cf = count.astype(jnp.float32)
    # Per unit: selected, and the two bias corrections; then the same per element.
    per_element = spec.expand(jnp.stack([sel.astype(jnp.float32), 1 - optim.b1 ** cf, 1 - optim.b2 ** cf]))
    decay = jnp.asarray(spec.decay_flat)
    if offset is not None:
        per_element = lax.dynamic_slice_in_dim(per_element, offset, p.shape[0], axis=1)
        decay = lax.dynamic_slice_in_dim(decay, offset, p.shape[0])
    mask, bc1, bc2 = per_element[0] > 0, per_element[1], per_element[2]
    mu = (1 - optim.b1) * g + optim.b1 * opt["mu"]
    nu = (1 - optim.b2) * jnp.square(g) + optim.b2 * opt["nu"]
    update = (mu / bc1) / (jnp.sqrt(nu / bc2) + optim.eps)
    if optim.weight_decay:
        update = update + jnp.where(decay, optim.weight_decay * p, 0)
    new_p = p + (-lr) * update
    return (jnp.where(mask, new_p, p),
            {"mu": jnp.where(mask, mu, opt["mu"]), "nu": jnp.where(mask, nu, opt["nu"]), "count": count})



def adamw_tree(spec: SupernetSpec, params, grads, moments: dict, count, unit_mask, shared: bool, lr,
               optim: OptimConfig):
    """``adamw`` on the parameters' tree: the same formula, element for element, with
    ``moments`` = ``{"mu", "nu"}`` as float32 trees shaped like the parameters. Equal to
    ``adamw`` up to rounding, not bitwise: XLA may turn a division by a broadcast
    per-unit value into a multiplication by its reciprocal (one ulp, seen). For a step
    whose parameters are split over other axes than the raveled vector's (a pipeline's
    stages): every operation stays on each device's own shards.
    Returns ``(params, moments, count)``."""
    n_units = spec.num_units
    sel = jnp.concatenate([jnp.asarray(unit_mask).reshape(-1), jnp.asarray(shared, bool).reshape(1)])
    count = count + sel.astype(jnp.int32)
    cf = count.astype(jnp.float32)
    per_unit = jnp.stack([sel.astype(jnp.float32), 1 - optim.b1 ** cf, 1 - optim.b2 ** cf])  # [3, U + 1]
    grid = spec.unit_grid

    def one(p, g, mu, nu, searchable, decays):
        if searchable:  # [*grid, ...]: the unit's values over its trailing axes
            vals = per_unit[:, :n_units].reshape(3, *grid, *([1] * (p.ndim - len(grid))))
        else:
            vals = per_unit[:, n_units].reshape(3, *([1] * p.ndim))
        mask, bc1, bc2 = vals[0] > 0, vals[1], vals[2]
        p32 = p.astype(jnp.float32)
        g = g.astype(jnp.float32)
        mu_new = (1 - optim.b1) * g + optim.b1 * mu
        nu_new = (1 - optim.b2) * jnp.square(g) + optim.b2 * nu
        update = (mu_new / bc1) / (jnp.sqrt(nu_new / bc2) + optim.eps)
        if optim.weight_decay and decays:
            update = update + optim.weight_decay * p32
        new_p = p32 + (-lr) * update
        return (jnp.where(mask, new_p, p32).astype(p.dtype), jnp.where(mask, mu_new, mu),
                jnp.where(mask, nu_new, nu))

    out = jax.tree.map(one, params, grads, moments["mu"], moments["nu"], spec.searchable, spec.decay)
    first = lambda i: jax.tree.map(lambda t: t[i], out, is_leaf=lambda x: isinstance(x, tuple))  # noqa: E731
    return first(0), {"mu": first(1), "nu": first(2)}, count
