"""Dropout through the pipeline: each layer of each microbatch gets the key it would get
unpipelined.

The reference GPT draws dropout from a per-call key: ``model.loss(..., dropout_key=k)``
splits ``k`` into the embedding's key and the blocks' key, and the blocks' key into one
key per layer. The train step gives every unit of the batch (one microbatch of one batch
device: ``train/step.py``'s ``unit_microbatches``) the key ``fold_in(step_key, unit)``, as
its deterministic path gives each virtual shard. A pipeline stage sees one microbatch
at a time and none of that, so the keys travel as per-microbatch block inputs
(``pipeline_grads(block_context=...)``): ``dropout_rows`` derives, for every (layer,
microbatch, batch device), the layer's key and the unit's embedding key; the stage's
layer picks its device's row (``lax.axis_index``) and calls the block with its key, and
the first layer applies the embedding's dropout to its input (the pipeline's embedding
runs without a key). The masks are therefore those of the unpipelined model run on each
unit with the unit's key: in deterministic mode the pipeline's gradient equals the
unpipelined deterministic step's (``tests/test_pipeline_dropout.py``). A backward that
re-runs the forward (remat) reads the same rows, so it draws the same masks.

Keys travel as their raw ``uint32`` words cut into 16-bit halves held in ``float32``
(exact), as the supernet's rows do: block inputs share the weights' path through the
runtime, which is made for floating-point arrays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from mindpipe_jax.parallel.pipeline.runtime.spmd import BATCH

ROWS = "dropout_rows"  # the key under which a unit's parameters hold its rows


def _to_halves(words):
    """``uint32[..., n]`` -> ``float32[..., 2n]``: each word as two exact 16-bit halves."""
    words = words.astype(jnp.uint32)
    halves = jnp.stack([words >> 16, words & 0xFFFF], axis=-1)
    return halves.reshape(*words.shape[:-1], -1).astype(jnp.float32)


def _from_halves(halves):
    h = halves.astype(jnp.uint32).reshape(*halves.shape[:-1], -1, 2)
    return (h[..., 0] << 16) | h[..., 1]


def dropout_rows(key, num_layers: int, microbatches: int, batch_devices: int) -> dict:
    """Block inputs ``[num_layers, microbatches, ...]`` holding, for batch device ``d``'s
    microbatch ``j`` (unit ``d * microbatches + j``), the keys ``model.loss`` derives from
    ``fold_in(key, unit)``: ``"layer"``, each layer's; ``"input"``, the embedding's, read by
    the first layer only (``"first"``)."""
    units = jnp.arange(batch_devices)[:, None] * microbatches + jnp.arange(microbatches)[None, :]

    def keys_of(unit):
        k_embed, k_blocks = jax.random.split(jax.random.fold_in(key, unit))
        return jax.random.key_data(k_embed), jax.random.key_data(jax.random.split(k_blocks, num_layers))

    k_in, k_layers = jax.vmap(jax.vmap(keys_of))(units)  # [D, m, w], [D, m, L, w]
    k_in = jnp.broadcast_to(jnp.swapaxes(k_in, 0, 1)[None], (num_layers, *jnp.swapaxes(k_in, 0, 1).shape))
    k_layers = jnp.transpose(k_layers, (2, 1, 0, 3))  # [L, m, D, w]
    first = (jnp.arange(num_layers) == 0).astype(jnp.float32)[:, None] * jnp.ones((1, microbatches))
    return {ROWS: {"input": _to_halves(k_in), "layer": _to_halves(k_layers), "first": first}}


def dropout(x, rate: float, key):
    """The reference GPT's dropout (``models/gpt.py``), the same expression: its bits."""
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def call_with_keys(block, h, rows):
    """``block(h, key)`` on this microbatch's rows: this batch device's layer key, and on
    the first layer the embedding's dropout of ``h`` first. ``block.dropout`` is the rate
    (the reference blocks keep it). Keys are of the default PRNG, as the step's."""
    d = lax.axis_index(BATCH)
    key = jax.random.wrap_key_data(_from_halves(rows["layer"][d]))
    k_in = jax.random.wrap_key_data(_from_halves(rows["input"][d]))
    h = jnp.where(rows["first"] > 0, dropout(h, block.dropout, k_in), h)
    return block(h, key)
