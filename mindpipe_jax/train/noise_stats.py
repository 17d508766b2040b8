"""What the train step measures for the gradient noise scale (``tuner/noise.py``):
the squared norms of the microbatch and step gradients, plain and, for an
Adam-family optimizer, preconditioned by Adam's ``1/(sqrt(v_hat) + eps)`` (Pollux's
noise scale for adaptive optimizers)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def abs_sq(x):
    return (x.conj() * x).real if jnp.iscomplexobj(x) else x * x


def _weighted_sum(tree, weights=None):
    """sum over all elements of ``tree`` (x ``weights`` squared), in fp32."""
    if weights is None:
        return sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(tree))
    return sum(jnp.sum(x.astype(jnp.float32) * jnp.square(w.astype(jnp.float32)))
               for x, w in zip(jax.tree.leaves(tree), jax.tree.leaves(weights), strict=True))


def _stack_mean_sq(stack, weights=None):
    """mean over the leading axis of ``stack`` (k gradients stacked) of each one's
    squared norm (x ``weights`` squared, broadcast over k), in fp32. Never forms the
    elementwise mean: a stack sharded over the batch devices is reduced where it lies
    (each device squares only its own gradients, then a sum of scalars)."""
    leaves = jax.tree.leaves(stack)
    k = leaves[0].shape[0]
    if weights is None:
        return sum(jnp.sum(abs_sq(x.astype(jnp.float32))) for x in leaves) / k
    return sum(jnp.sum(abs_sq(x.astype(jnp.float32)) * jnp.square(w.astype(jnp.float32))[None])
               for x, w in zip(leaves, jax.tree.leaves(weights), strict=True)) / k


def _adam_state(opt_state):
    """The one ``ScaleByAdamState`` in ``opt_state``; None when there is none (SGD-like: no
    preconditioner) or more than one (ambiguous)."""
    found = optax.tree_utils.tree_get_all_with_path(opt_state, "ScaleByAdamState")
    return found[0][1] if len(found) == 1 else None


def _bias_correction(adam, b2: float):
    # optax stores the incremented count: the bias correction this update used.
    return 1 - jnp.asarray(b2, jnp.float32) ** adam.count.astype(jnp.float32)


def adam_preconditioner(opt_state, b2: float, eps: float):
    """The diagonal preconditioner 1/(sqrt(v_hat) + eps) an Adam-family optimizer
    (optax ``scale_by_adam``: adam, adamw, nadam, lamb's moments) divides its update by,
    from the optimizer state after its update (so v_hat includes this step's gradient,
    exactly what this step's update used); a tree like the parameters. ``b2``/``eps``
    are the optimizer's (the state does not hold them). None when ``opt_state`` has no
    ``ScaleByAdamState`` (SGD-like: no preconditioner) or more than one (ambiguous)."""
    adam = _adam_state(opt_state)
    if adam is None:
        return None
    correction = _bias_correction(adam, b2)
    return jax.tree.map(lambda v: 1 / (jnp.sqrt(v.astype(jnp.float32) / correction) + eps), adam.nu)


# The preconditioned statistics count once this step's gradient is at most this share
# of Adam's v_hat ((1 - b2) / (1 - b2^count); about 1/count while b2^count ~ 1, so ~10
# steps for any b2 near 1). Earlier, v_hat is mostly this very gradient (all of it at
# count 1: P G_B = ±1 per element, and P g_b blows up wherever the microbatches nearly
# cancel), so P is not the fixed matrix the estimator assumes: seen on the tiny GPT,
# step 1 gave |P G|^2 = -2e9 against ~5e4 once settled.
PRECOND_SETTLED_SHARE = 0.1


# A flat vector is summed as rows of this many elements, then the row sums: a two-level
# sum, so a large model's total rounds about as a pairwise sum would, not as one long
# running sum.
_ROW = 1024


def _flat(leaves, lead: bool):
    """The leaves as one fp32 vector (``[k, n]`` with ``lead``: their shared leading axis
    kept), zero-padded to whole ``_ROW``s."""
    parts = [x.astype(jnp.float32).reshape((x.shape[0], -1) if lead else (-1,)) for x in leaves]
    pad = -sum(p.shape[-1] for p in parts) % _ROW
    if pad:
        parts.append(jnp.zeros((*parts[0].shape[:-1], pad), jnp.float32))
    return jnp.concatenate(parts, axis=-1)


def _total(x):
    """The sum of all elements of a ``_flat`` vector or stack, by rows first."""
    return jnp.sum(jnp.sum(x.reshape(*x.shape[:-1], -1, _ROW), axis=-1))


def _per_leaf(micro, grads, precond, stacked: bool):
    """The three sums leaf by leaf, each reduced where its leaf lies (any sharding)."""
    def mean_sq(weights=None):
        return _stack_mean_sq(micro, weights) if stacked else _weighted_sum(micro, weights)

    out = {"micro_grad_sq": mean_sq()}
    if precond is not None:
        out["precond_micro_grad_sq"] = mean_sq(precond)
        out["precond_grad_sq"] = _weighted_sum(jax.tree.map(abs_sq, grads), precond)
    return out


def _fused(micro, grads, adam, optim, stacked: bool):
    """The three sums over all leaves concatenated: a handful of operations whatever the
    leaf count, where leaf by leaf costs ~7 per leaf (three reductions, XLA:CPU's
    reduce-window under each, the preconditioner). On the online benchmark's tiny GPT
    (18 leaves, 8 CPU devices, batch 32) that standalone was 9.0 ms against 3.3 ms
    fused. Only for leaves whole on every device (besides a stack's leading axis):
    concatenating sharded leaves would gather them."""
    m = _flat(jax.tree.leaves(micro), lead=stacked)
    k = m.shape[0] if stacked else 1
    m_sq = abs_sq(m) if stacked else m  # unstacked, micro already holds squares
    out = {"micro_grad_sq": _total(m_sq) / k}
    if adam is not None:
        v_hat = _flat(jax.tree.leaves(adam.nu), lead=False) / _bias_correction(adam, optim.b2)
        w_sq = jnp.square(1 / (jnp.sqrt(v_hat) + optim.eps))
        out["precond_micro_grad_sq"] = _total(m_sq * w_sq) / k
        out["precond_grad_sq"] = _total(abs_sq(_flat(jax.tree.leaves(grads), lead=False)) * w_sq)
    return out


def noise_statistics(micro, grads, opt_state, optim, *, stacked: bool = False, fused: bool = False) -> dict:
    """The step's inputs to the gradient noise scale (tuner/noise.py):
    ``micro_grad_sq`` = mean over microbatches of |g_b|^2 and, when the optimizer is
    Adam-family, the same two norms of the preconditioned gradients P g (Pollux's
    noise scale for adaptive optimizers): ``precond_micro_grad_sq`` = mean |P g_b|^2
    and ``precond_grad_sq`` = |P G_B|^2, NaN until v_hat has settled
    (``PRECOND_SETTLED_SHARE``).

    ``micro``: the elementwise mean over microbatches of g_b^2 (a tree like the
    gradient: what sequential accumulation can keep in one buffer), or with
    ``stacked`` the microbatch gradients themselves stacked on a leading axis (a
    pipeline's two halves of the step, kept apart by the runtime's gradient groups; or
    the virtual shards of deterministic mode, sharded over the batch devices: reducing
    them where they lie costs each device one pass over its own shards, where the
    elementwise mean of the gathered stack cost every device a pass over all of them:
    on the online benchmark's step at batch 8 that made the step 3-5x as long as
    without statistics, 1.2-1.3x when reduced where they lie).

    ``fused``: the caller knows every leaf of ``micro`` (but a stack's leading axis),
    ``grads`` and the optimizer's moments is whole on each device; the sums are then
    taken over the leaves concatenated (``_fused``), otherwise leaf by leaf."""
    adam = _adam_state(opt_state)
    if fused:
        out = _fused(micro, grads, adam, optim, stacked)
    else:
        precond = adam_preconditioner(opt_state, optim.b2, optim.eps) if adam is not None else None
        out = _per_leaf(micro, grads, precond, stacked)
    if adam is not None:
        settled = (1 - optim.b2) / _bias_correction(adam, optim.b2) <= PRECOND_SETTLED_SHARE
        for name in ("precond_micro_grad_sq", "precond_grad_sq"):
            out[name] = jnp.where(settled, out[name], jnp.nan)
    return out
