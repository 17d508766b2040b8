"""An independent oracle for SPara's tests: SuperGPT's subnets as dense GPTs in plain JAX,
and training them one after another with optax (no framework code).

``dense_loss`` is a pre-norm GPT at a subnet's own size, built from slices of the
supernet's weights (``small_weights``); ``sequential_reference`` trains K subnets one
after another, each with its own clipped AdamW step on what it touched. Shared by
``test_supernet_sliced.py`` and ``test_supernet_layouts.py``."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

ACT = {"gelu": jax.nn.gelu, "relu": jax.nn.relu, "silu": jax.nn.silu, "tanh": jnp.tanh}

def _layer_norm(x, scale, bias):
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + 1e-5) * scale + bias


def dense_loss(w, inputs, targets, acts):
    """A pre-norm GPT: embedding, one block per entry of ``w["layers"]``, final norm, head."""
    t = inputs.shape[1]
    # The embedding by a one-hot matmul, as the supernet does (its backward has no scatter):
    # the FLOP comparison below is then like for like.
    x = jax.nn.one_hot(inputs, w["tokens"].shape[0]) @ w["tokens"] + w["positions"][:t]
    causal = jnp.tril(jnp.ones((t, t), bool))
    for lw, act in zip(w["layers"], acts, strict=True):
        y = _layer_norm(x, lw["ln1_scale"], lw["ln1_bias"])
        q, k, v = jnp.einsum("btd,dcnh->cbtnh", y, lw["qkv"]) + lw["qkv_bias"][:, None, None]
        scores = jnp.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(q.shape[-1])
        probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        x = x + jnp.einsum("bnts,bsnh,nhd->btd", probs, v, lw["out"]) + lw["out_bias"]
        y = _layer_norm(x, lw["ln2_scale"], lw["ln2_bias"])
        x = x + ACT[act](y @ lw["w_in"] + lw["b_in"]) @ lw["w_out"] + lw["b_out"]
    logits = _layer_norm(x, w["ln_f_scale"], w["ln_f_bias"]) @ w["lm_head"]
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


# One jitted dense model for every test (compiled once per subnet size and activations).
dense_grad = jax.jit(jax.value_and_grad(dense_loss), static_argnums=3)


def own_size(space, subnet):
    """[(layer, op index, width, heads)] of the blocks the subnet runs."""
    v = space.decode(subnet)
    return [(layer, int(subnet[1 + 3 * layer]), v[f"ffn{layer}"], v[f"heads{layer}"])
            for layer in range(v["depth"])]


# (path in the supernet's params, index of layer l's slice) for each small weight.
def _slices(layer, op, width, heads):
    return {
        "ln1_scale": (("blocks", "ln1", "scale"), (layer,)),
        "ln1_bias": (("blocks", "ln1", "bias"), (layer,)),
        "qkv": (("blocks", "attn", "qkv"), (layer, slice(None), slice(None), slice(0, heads))),
        "qkv_bias": (("blocks", "attn", "qkv_bias"), (layer, slice(None), slice(0, heads))),
        "out": (("blocks", "attn", "out"), (layer, slice(0, heads))),
        "out_bias": (("blocks", "attn", "out_bias"), (layer,)),
        "ln2_scale": (("blocks", "ln2", "scale"), (layer,)),
        "ln2_bias": (("blocks", "ln2", "bias"), (layer,)),
        "w_in": (("blocks", "ffn", "w_in"), (layer, op, slice(None), slice(0, width))),
        "b_in": (("blocks", "ffn", "b_in"), (layer, op, slice(0, width))),
        "w_out": (("blocks", "ffn", "w_out"), (layer, op, slice(0, width))),
        "b_out": (("blocks", "ffn", "b_out"), (layer, op)),
    }


SHARED = {"tokens": ("embed", "tokens"), "positions": ("embed", "positions"),
          "ln_f_scale": ("head", "ln_f", "scale"), "ln_f_bias": ("head", "ln_f", "bias"),
          "lm_head": ("head", "lm_head")}


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def small_weights(params, space, subnet):
    """The dense model's weights: slices of the supernet's, copied (no link back)."""
    w = {name: np.array(_get(params, path)) for name, path in SHARED.items()}
    w["layers"] = [{name: np.array(_get(params, path)[index])
                    for name, (path, index) in _slices(*size).items()} for size in own_size(space, subnet)]
    return w



# The weights SuperGPT decays (its matrices, by their sharding names), listed here by name.
DECAYED = {"qkv", "qkv_bias", "out", "w_in", "w_out", "tokens", "lm_head"}
FFN = ("w_in", "b_in", "w_out", "b_out")  # the operator candidates: one unit per (layer, op)


def sequential_reference(params, subnets, batches, optim, total_steps, space, ops, semantics="sequential"):
    """Train ``subnets`` on each batch with no framework code: each subnet's gradient from
    the dense model of its own size (``dense_grad``) placed into the supernet's shapes and
    clipped on its own (optax); AdamW steps on what was touched: the FFN candidate of each
    layer run (each (layer, op) its own ``scale_by_adam`` state and count) and every other
    weight (one state). Every update of step t uses optax's warmup-cosine learning rate at t.

    ``sequential``: one after another, each subnet's own step at the weights the previous
    ones left. ``sync``: every subnet at the step's weights, one step on the mean of their
    clipped gradients (the candidates any of them ran, and the rest). Returns the params
    and the losses."""
    params = jax.tree.map(np.array, params)
    adam = optax.scale_by_adam(optim.b1, optim.b2, optim.eps)
    clip = optax.clip_by_global_norm(optim.clip_norm)
    schedule = optax.warmup_cosine_decay_schedule(optim.lr, optim.lr, 0, total_steps,
                                                  optim.lr * optim.min_lr_ratio)
    ffn = params["blocks"]["ffn"]

    def unit(tree, layer, op):
        return {name: tree[name][layer, op] for name in FFN}

    def others(tree):
        return {k: v for k, v in tree.items() if k != "blocks"} | {
            "blocks": {k: v for k, v in tree["blocks"].items() if k != "ffn"}}

    unit_states = {(layer, op): adam.init(unit(ffn, layer, op)) for layer in range(ffn["w_in"].shape[0])
                   for op in range(ffn["w_in"].shape[1])}
    shared_state = adam.init(others(params))

    def step_on(p, g, state, lr, names):
        updates, state = adam.update(g, state)
        new = jax.tree.map(lambda w, u, n: w - lr * (u + optim.weight_decay * w * (n in DECAYED)),
                           p, updates, names)
        return jax.tree.map(np.asarray, new), state

    def clipped_grad(subnet, batch):
        """Loss, the clipped gradient in the supernet's shapes, the (layer, op) units run."""
        sizes = own_size(space, subnet)
        small = small_weights(params, space, subnet)
        acts = tuple(ops[op] for _, op, _, _ in sizes)
        loss, g_small = dense_grad(small, batch["inputs"], batch["targets"], acts)
        grads = jax.tree.map(np.zeros_like, params)
        for name, path in SHARED.items():
            _get(grads, path)[...] = g_small[name]
        for size, g_layer in zip(sizes, g_small["layers"], strict=True):
            for name, (path, index) in _slices(*size).items():
                _get(grads, path)[index] = g_layer[name]
        units = {(layer, op) for layer, op, _, _ in sizes}
        return float(loss), clip.update(grads, clip.init(grads))[0], units

    def apply(grads, units, lr):
        nonlocal params, shared_state
        for layer, op in sorted(units):
            new, unit_states[layer, op] = step_on(unit(params["blocks"]["ffn"], layer, op),
                                                  unit(grads["blocks"]["ffn"], layer, op),
                                                  unit_states[layer, op], lr, {n: n for n in FFN})
            for name in FFN:
                params["blocks"]["ffn"][name][layer, op] = new[name]
        names = jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key, others(params))
        new, shared_state = step_on(others(params), others(grads), shared_state, lr, names)
        new["blocks"]["ffn"] = params["blocks"]["ffn"]
        params = new

    losses = []
    for t, batch in enumerate(batches):
        lr = float(schedule(t))
        if semantics == "sequential":
            for subnet in subnets:
                loss, grads, units = clipped_grad(subnet, batch)
                losses.append(loss)
                apply(grads, units, lr)
        elif semantics == "sync":
            each = [clipped_grad(subnet, batch) for subnet in subnets]
            losses += [loss for loss, _, _ in each]
            mean = jax.tree.map(lambda *g: sum(g) / len(g), *[g for _, g, _ in each])
            apply(mean, set().union(*[u for _, _, u in each]), lr)
        else:
            raise ValueError(semantics)
    return params, losses


def lazy_adamw_reference(params, loss_and_grad, candidate, decay, units_of, subnets, batches, optim,
                         total_steps, semantics="sequential"):
    """``sequential_reference`` for any supernet, from its own loss: ``loss_and_grad(params,
    subnet, batch)`` (plain ``jax.value_and_grad`` of the module's loss), each subnet's
    gradient clipped on its own (optax); ``candidate`` / ``decay``: trees of bool like
    ``params`` (a candidate leaf's leading axes are the unit grid; decayed leaves get
    AdamW's weight decay); ``units_of(subnet)``: bool[unit grid], the units it runs. Each
    unit's slices of the candidate leaves have their own ``scale_by_adam`` state and count,
    the other leaves one. Returns the params and the losses."""
    flat, treedef = jax.tree.flatten(jax.tree.map(np.array, params))
    cand, dec = jax.tree.leaves(candidate), jax.tree.leaves(decay)
    unit_idx = [i for i, c in enumerate(cand) if c]
    shared_idx = [i for i, c in enumerate(cand) if not c]
    adam = optax.scale_by_adam(optim.b1, optim.b2, optim.eps)
    clip = optax.clip_by_global_norm(optim.clip_norm)
    schedule = optax.warmup_cosine_decay_schedule(optim.lr, optim.lr, 0, total_steps,
                                                  optim.lr * optim.min_lr_ratio)
    grid = np.asarray(units_of(subnets[0])).shape
    unit_states = {u: adam.init([flat[i][u] for i in unit_idx]) for u in np.ndindex(*grid)}
    shared_state = [adam.init([flat[i] for i in shared_idx])]

    def step_on(weights, grads, state, lr, decays):
        updates, state = adam.update(grads, state)
        return [np.asarray(w - lr * (u + optim.weight_decay * w * d))
                for w, u, d in zip(weights, updates, decays, strict=True)], state

    def clipped(subnet, batch):
        loss, grads = loss_and_grad(jax.tree.unflatten(treedef, flat), subnet, batch)
        grads = clip.update(grads, clip.init(grads))[0]
        units = {tuple(int(i) for i in u) for u in np.argwhere(np.asarray(units_of(subnet)))}
        return float(loss), [np.asarray(g) for g in jax.tree.leaves(grads)], units

    def apply(grads, units, lr):
        for u in sorted(units):
            new, unit_states[u] = step_on([flat[i][u] for i in unit_idx], [grads[i][u] for i in unit_idx],
                                          unit_states[u], lr, [dec[i] for i in unit_idx])
            for i, w in zip(unit_idx, new, strict=True):
                flat[i][u] = w
        new, shared_state[0] = step_on([flat[i] for i in shared_idx], [grads[i] for i in shared_idx],
                                       shared_state[0], lr, [dec[i] for i in shared_idx])
        for i, w in zip(shared_idx, new, strict=True):
            flat[i] = w

    losses = []
    for t, batch in enumerate(batches):
        lr = float(schedule(t))
        if semantics == "sequential":
            for subnet in subnets:
                loss, grads, units = clipped(subnet, batch)
                losses.append(loss)
                apply(grads, units, lr)
        else:  # sync: every subnet at the step's weights, one update from the mean
            each = [clipped(subnet, batch) for subnet in subnets]
            losses += [loss for loss, _, _ in each]
            mean = [sum(g[i] for _, g, _ in each) / len(each) for i in range(len(flat))]
            apply(mean, set().union(*[u for _, _, u in each]), lr)
    return jax.tree.unflatten(treedef, flat), np.asarray(losses)
