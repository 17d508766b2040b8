"""Models written the way users elsewhere write them, not around mindpipe_jax.

Nothing here imports the framework. Each family exercises something the reference
GPT does not:

* ``Llama`` — RMSNorm, rotary positions, grouped-query attention (fewer kv heads
  than heads, and than the tensor axis), SwiGLU, optionally tied input/output
  embeddings. Projections are flat ``[d, heads * head_dim]`` matrices annotated
  ``("embed", "heads")``, so splitting them into heads reshapes a sharded
  dimension: the resharding XLA then inserts is what crashed pipe x tensor.
* ``Gemma`` — qk-norm, a logit soft-cap, alternating local (sliding window) and
  global attention layers, tied embeddings; the stack is a list of groups of
  unlike layers.
* ``linen_transformer`` — a small Linen model, for the NNX bridge.

``reference_grads`` is the oracle: plain ``jax.value_and_grad`` on one device.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx


def _param(rngs, shape, names, std=0.02):
    return nnx.Param(nnx.initializers.normal(std)(rngs.params(), shape, jnp.float32),
                     out_sharding=names, eager_sharding=False)


def _ones(shape, names):
    return nnx.Param(jnp.ones(shape, jnp.float32), out_sharding=names, eager_sharding=False)


def rms_norm(x, scale, eps=1e-6):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * scale


def rotary(x):
    """Rotary position embedding on [batch, length, heads, head_dim]."""
    t, half = x.shape[1], x.shape[-1] // 2
    freq = 1.0 / (10000 ** (jnp.arange(half) / half))
    angle = jnp.arange(t)[:, None] * freq[None]
    cos, sin = jnp.cos(angle)[None, :, None], jnp.sin(angle)[None, :, None]
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], -1)


def attend(q, k, v, *, window=None, soft_cap=None):
    """Causal attention; ``k``/``v`` have fewer heads than ``q`` (grouped-query)."""
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    t = q.shape[1]
    i, j = jnp.arange(t)[:, None], jnp.arange(t)[None]
    mask = j <= i
    if window is not None:
        mask = mask & (i - j < window)
    s = jnp.where(mask, s, -1e9)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)


class LlamaBlock(nnx.Module):
    def __init__(self, d, heads, kv_heads, ff, rngs):
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, d // heads
        hd = self.head_dim
        self.attn_norm = _ones((d,), ("norm",))
        self.wq = _param(rngs, (d, heads * hd), ("embed", "heads"))
        self.wk = _param(rngs, (d, kv_heads * hd), ("embed", "heads"))
        self.wv = _param(rngs, (d, kv_heads * hd), ("embed", "heads"))
        self.wo = _param(rngs, (heads * hd, d), ("heads", "embed"))
        self.mlp_norm = _ones((d,), ("norm",))
        self.w_gate = _param(rngs, (d, ff), ("embed", "mlp"))
        self.w_up = _param(rngs, (d, ff), ("embed", "mlp"))
        self.w_down = _param(rngs, (ff, d), ("mlp", "embed"))

    def __call__(self, x):
        b, t, _ = x.shape
        h = rms_norm(x, self.attn_norm[...])
        q = (h @ self.wq[...]).reshape(b, t, self.heads, self.head_dim)
        k = (h @ self.wk[...]).reshape(b, t, self.kv_heads, self.head_dim)
        v = (h @ self.wv[...]).reshape(b, t, self.kv_heads, self.head_dim)
        y = attend(rotary(q), rotary(k), v).reshape(b, t, -1)
        x = x + y @ self.wo[...]
        h = rms_norm(x, self.mlp_norm[...])
        return x + (jax.nn.silu(h @ self.w_gate[...]) * (h @ self.w_up[...])) @ self.w_down[...]


class TokenEmbed(nnx.Module):
    def __init__(self, vocab, d, rngs):
        self.table = _param(rngs, (vocab, d), ("vocab", "embed"))

    def __call__(self, tokens):
        return jnp.take(self.table[...], tokens, axis=0)


class LlamaHead(nnx.Module):
    """Final norm and output projection; with ``tied`` the projection is the input
    embedding's table (a shared module, one parameter)."""

    def __init__(self, vocab, d, rngs, tied_to=None):
        self.norm = _ones((d,), ("norm",))
        self.tied_to = tied_to
        if tied_to is None:
            self.proj = _param(rngs, (d, vocab), ("embed", "vocab"))

    def __call__(self, h):
        h = rms_norm(h, self.norm[...])
        if self.tied_to is not None:
            return h @ self.tied_to.table[...].T
        return h @ self.proj[...]

    def loss(self, h, targets):
        return optax.softmax_cross_entropy_with_integer_labels(self(h), targets).mean()


class Llama(nnx.Module):
    def __init__(self, *, vocab=64, d=32, layers=4, heads=4, kv_heads=1, ff=48, tied=False, rngs):
        self.embed = TokenEmbed(vocab, d, rngs)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make(rngs):
            return LlamaBlock(d, heads, kv_heads, ff, rngs)

        self.blocks = make(rngs)
        self.head = LlamaHead(vocab, d, rngs, tied_to=self.embed if tied else None)

    def __call__(self, tokens):
        gdef, layers = nnx.split(self.blocks)
        h = jax.lax.scan(lambda x, lp: (nnx.merge(gdef, lp)(x), None), self.embed(tokens), layers)[0]
        return self.head(h)

    def loss(self, inputs, targets):
        return optax.softmax_cross_entropy_with_integer_labels(self(inputs), targets).mean()


def tokens(seed, rows, length=8, vocab=64):
    t = np.random.default_rng(seed).integers(0, vocab, (rows, length + 1)).astype(np.int32)
    return {"inputs": t[:, :-1], "targets": t[:, 1:]}


def reference_grads(model, batch):
    """Loss and gradients of the mean loss, one device, plain ``jax.value_and_grad``."""
    gdef, params = nnx.split(model, nnx.Param)

    def loss(p):
        return nnx.merge(gdef, p).loss(jnp.asarray(batch["inputs"]), jnp.asarray(batch["targets"]))
    loss_value, grads = jax.jit(jax.value_and_grad(loss))(params)
    return loss_value, nnx.to_pure_dict(grads)
