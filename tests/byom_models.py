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


def attend(q, k, v, *, window=None, soft_cap=None, keep=None):
    """Causal attention; ``k``/``v`` have fewer heads than ``q`` (grouped-query); ``keep``:
    [batch, length] keys to attend to (False: padding)."""
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
    if keep is not None:
        mask = mask & keep[:, None, None, :]
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

    def __call__(self, x, keep=None):
        b, t, _ = x.shape
        h = rms_norm(x, self.attn_norm[...])
        q = (h @ self.wq[...]).reshape(b, t, self.heads, self.head_dim)
        k = (h @ self.wk[...]).reshape(b, t, self.kv_heads, self.head_dim)
        v = (h @ self.wv[...]).reshape(b, t, self.kv_heads, self.head_dim)
        y = attend(rotary(q), rotary(k), v, keep=keep).reshape(b, t, -1)
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


def padded_tokens(seed, rows, length=8, vocab=64):
    """Like ``tokens``, with padding: ids 1..vocab-1, then token 0 from a random place in
    most rows on (every row keeps its first two tokens), targets padded alike."""
    rng = np.random.default_rng(seed)
    t = rng.integers(1, vocab, (rows, length + 1)).astype(np.int32)
    ends = rng.integers(2, length + 2, rows)
    t[np.arange(length + 1)[None, :] >= ends[:, None]] = 0
    return {"inputs": t[:, :-1], "targets": t[:, 1:]}


def reference_grads(model, batch):
    """Loss and gradients of the mean loss, one device, plain ``jax.value_and_grad`` (of
    the ``nnx.Param``s; any other variable, a constant buffer, held as built)."""
    gdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p):
        m = nnx.merge(gdef, p, jax.tree.map(lambda x: x, rest))  # fresh variables in this trace
        inputs, targets = jnp.asarray(batch["inputs"]), jnp.asarray(batch["targets"])
        if hasattr(m, "loss"):
            return m.loss(inputs, targets)
        return optax.softmax_cross_entropy_with_integer_labels(m(inputs), targets).mean()
    loss_value, grads = jax.jit(jax.value_and_grad(loss))(params)
    return loss_value, nnx.to_pure_dict(grads)


class LlamaStyle(nnx.Module):
    """The Llama family as its own code would name it: ``tok_embeddings``, a scanned
    ``layers`` stack, ``norm``, ``output`` — no pipeline method, no reference names."""

    def __init__(self, *, vocab=64, d=32, layers=4, heads=4, kv_heads=2, ff=48, rngs):
        self.tok_embeddings = _param(rngs, (vocab, d), ("vocab", "embed"))

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make(rngs):
            return LlamaBlock(d, heads, kv_heads, ff, rngs)

        self.layers = make(rngs)
        self.norm = _ones((d,), ("norm",))
        self.output = _param(rngs, (d, vocab), ("embed", "vocab"))

    def __call__(self, tokens):
        h = jnp.take(self.tok_embeddings[...], tokens, axis=0)

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(x, layer):
            return layer(x)

        return rms_norm(run(h, self.layers), self.norm[...]) @ self.output[...]


class PaddedLlamaStyle(LlamaStyle):
    """``LlamaStyle`` on padded batches (token 0): its scanned layers mask padded keys with
    a mask made from the tokens before the scan, and its loss skips padded inputs."""

    def logits(self, tokens):
        h = jnp.take(self.tok_embeddings[...], tokens, axis=0)
        keep = tokens != 0

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(x, layer):
            return layer(x, keep)

        return rms_norm(run(h, self.layers), self.norm[...]) @ self.output[...]

    def loss(self, tokens, targets):
        losses = optax.softmax_cross_entropy_with_integer_labels(self.logits(tokens), targets)
        # Mean over all positions, padded ones counting 0: a mean per row, so any split of
        # the batch into microbatches averages to it (a sum over kept tokens divided by
        # their count would differ per microbatch split).
        return (losses * (tokens != 0)).mean()


class GemmaBlock(nnx.Module):
    """Pre- and post-norms, qk-norm, attention soft-cap; ``local`` layers see a window."""

    def __init__(self, d, heads, kv_heads, ff, local: bool, rngs):
        self.heads, self.kv_heads, self.head_dim, self.local = heads, kv_heads, d // heads, local
        hd = self.head_dim
        self.pre_attn_norm = _ones((d,), ("norm",))
        self.q = _param(rngs, (d, heads, hd), ("embed", "heads", None))
        self.kv = _param(rngs, (2, d, kv_heads, hd), (None, "embed", None, None))
        self.q_norm, self.k_norm = _ones((hd,), ("norm",)), _ones((hd,), ("norm",))
        self.o = _param(rngs, (heads, hd, d), ("heads", None, "embed"))
        self.post_attn_norm = _ones((d,), ("norm",))
        self.pre_ffw_norm = _ones((d,), ("norm",))
        self.gating = _param(rngs, (2, d, ff), (None, "embed", "mlp"))
        self.linear = _param(rngs, (ff, d), ("mlp", "embed"))

    def __call__(self, x):
        h = rms_norm(x, self.pre_attn_norm[...])
        q = rms_norm(jnp.einsum("btd,dnh->btnh", h, self.q[...]), self.q_norm[...])
        k, v = jnp.einsum("btd,cdnh->cbtnh", h, self.kv[...])
        k = rms_norm(k, self.k_norm[...])
        y = attend(rotary(q), rotary(k), v, window=4 if self.local else None, soft_cap=50.0)
        x = x + rms_norm(jnp.einsum("btnh,nhd->btd", y, self.o[...]), self.post_attn_norm[...])
        h = rms_norm(x, self.pre_ffw_norm[...])
        gate, up = jnp.einsum("btd,cdf->cbtf", h, self.gating[...])
        return x + (jax.nn.gelu(gate) * up) @ self.linear[...]


class Gemma(nnx.Module):
    """Gemma-shaped: tied embeddings (scaled by sqrt(d) in, projection out), an
    ``nnx.List`` of layers alternating local and global attention, a final logit
    soft-cap. No pipeline method."""

    def __init__(self, *, vocab=64, d=32, layers=4, heads=4, kv_heads=1, ff=64, rngs):
        self.embedder = TokenEmbed(vocab, d, rngs)
        self.layers = nnx.List([GemmaBlock(d, heads, kv_heads, ff, i % 2 == 0, rngs) for i in range(layers)])
        self.final_norm = _ones((d,), ("norm",))
        self.d = d

    def __call__(self, tokens):
        x = self.embedder(tokens) * math.sqrt(self.d)
        for layer in self.layers:
            x = layer(x)
        logits = rms_norm(x, self.final_norm[...]) @ self.embedder.table[...].T
        return 30.0 * jnp.tanh(logits / 30.0)


def linen_transformer(vocab=64, d=32, layers=4, heads=2):
    """A small Linen decoder: logical partitioning annotations, ``nn.scan`` blocks."""
    import flax.linen as nn

    def init(names, std=0.02):
        return nn.with_logical_partitioning(nn.initializers.normal(std), names)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            h = nn.LayerNorm()(x)
            mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
            attention = nn.MultiHeadDotProductAttention(num_heads=heads, qkv_features=d,
                                                        kernel_init=init(("embed", "heads", "kv")),
                                                        out_kernel_init=init(("heads", "kv", "embed")))
            h = attention(h, h, mask=mask)
            x = x + h
            h = nn.Dense(2 * d, kernel_init=init(("embed", "mlp")))(nn.LayerNorm()(x))
            return x + nn.Dense(d, kernel_init=init(("mlp", "embed")))(nn.gelu(h)), None

    class LM(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(vocab, d, embedding_init=init(("vocab", "embed")))(tokens)
            x = x + self.param("pos", init((None, "embed"), 0.01), (tokens.shape[1], d))
            stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=layers,
                            metadata_params={nn.PARTITION_NAME: "layers"})
            x, _ = stack(name="blocks")(x, None)
            return nn.Dense(vocab, kernel_init=init(("embed", "vocab")))(nn.LayerNorm()(x))

    return LM()


def make_llama(rngs):
    """A factory for ``mindpipe train --model tests/byom_models.py:make_llama``."""
    return Llama(heads=4, kv_heads=1, tied=True, rngs=rngs)


class StockBlock(nnx.Module):
    """A GPT-2 block from Flax's stock layers: LayerNorm, MultiHeadAttention with a causal
    mask, an MLP of biased Linear layers; no logical-axis names."""

    def __init__(self, d, heads, rngs):
        self.ln1, self.ln2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=d, decode=False, rngs=rngs)
        self.up, self.down = nnx.Linear(d, 4 * d, rngs=rngs), nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x, mask=None, *, deterministic: bool, scale=None):
        if mask is None:
            mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + self.attn(self.ln1(x), mask=mask, deterministic=deterministic)
        out = x + self.down(jax.nn.gelu(self.up(self.ln2(x))))
        return out if scale is None else out * scale


class StockGPT2(nnx.Module):
    """GPT-2 from Flax's stock layers, its blocks a plain ``nnx.List`` of identical layers
    (period 1) called with static keyword arguments (``deterministic=True``, as Flax code
    passes it), learned positions, an untied biased head; returns logits (no ``loss``).
    ``scales``: per-layer static factors. ``mask``: where the attention mask is made:
    ``"layer"`` in each block, ``"causal"`` once in the loop and passed to every block (a side
    input of the microbatch's shape only), ``"alternating"`` causal and a causal window
    passed to alternate blocks, ``"padding"`` causal and from the tokens' values (token 0 is
    padding: a side input each stage recomputes from the tokens the hidden state carries)."""

    def __init__(self, rngs, vocab=64, d=32, layers=4, heads=2, length=8, scales=None, mask="layer"):
        self.wte, self.wpe = nnx.Embed(vocab, d, rngs=rngs), nnx.Embed(length, d, rngs=rngs)
        self.h = nnx.List([StockBlock(d, heads, rngs) for _ in range(layers)])
        self.ln_f = nnx.LayerNorm(d, rngs=rngs)
        self.lm_head = nnx.Linear(d, vocab, rngs=rngs)
        self.scales = scales or [None] * layers
        self.mask = mask

    def __call__(self, tokens):
        x = self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[1]))[None]
        causal = None if self.mask == "layer" else nnx.make_causal_mask(tokens)
        masks = [causal] * len(self.h)
        if self.mask == "padding":
            masks = [nnx.combine_masks(causal, nnx.make_attention_mask(tokens > 0, tokens > 0))] * len(self.h)
        if self.mask == "alternating":  # even layers causal, odd ones a causal window of 2 (Gemma-like)
            i = jnp.arange(tokens.shape[1])
            window = nnx.combine_masks(causal, (i[:, None] - i[None, :] < 2)[None, None])
            masks = [causal, window] * (len(self.h) // 2)
        for block, scale, mask in zip(self.h, self.scales, masks, strict=True):
            x = block(x, mask, deterministic=True, scale=scale)
        return self.lm_head(self.ln_f(x))


class PlainListNet(nnx.Module):
    """Layers kept as Flax's own error for a list of modules suggests: a plain list marked
    ``nnx.data`` (``holder="data"``), or an ``nnx.Dict`` the loop walks by key
    (``holder="dict"``: no order the pipeline can read, so it is refused with the fix)."""

    def __init__(self, rngs, vocab=64, d=16, layers=4, holder="data"):
        self.embed_in = nnx.Embed(vocab, d, rngs=rngs)
        blocks = [NormLinearBlock(d, rngs, dtype=jnp.float32) for _ in range(layers)]
        by_key = {f"l{i}": b for i, b in enumerate(blocks)}
        self.layers = nnx.data(blocks) if holder == "data" else nnx.Dict(by_key)
        self.unembed = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, tokens):
        h = self.embed_in(tokens)
        for layer in (self.layers if isinstance(self.layers, list) else self.layers.values()):
            h = layer(h)
        return self.unembed(h)


class HFStyleLayer(nnx.Module):
    """A decoder layer called as Hugging Face's Flax ports call theirs: the hidden state by
    keyword, a mask beside it, and a tuple back (hidden, attention probabilities)."""

    def __init__(self, d, heads, rngs):
        self.norm = nnx.RMSNorm(d, rngs=rngs)
        self.qkv, self.out = nnx.Linear(d, 3 * d, rngs=rngs), nnx.Linear(d, d, rngs=rngs)
        self.heads = heads

    def __call__(self, hidden_states, attention_mask, output_attentions=False):
        b, t, d = hidden_states.shape
        q, k, v = jnp.split(self.qkv(self.norm(hidden_states)).reshape(b, t, 3 * self.heads, -1), 3, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1])
        probs = jax.nn.softmax(jnp.where(attention_mask, scores, -1e9), axis=-1)
        mixed = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, d)
        return hidden_states + self.out(mixed), probs


class HFStyle(nnx.Module):
    """Layers (``nnx.List``) called by keyword with a causal mask made once, returning
    ``(hidden, probs)``; the loop keeps the hidden state (``read_probs=False``) or also adds
    the mean attention entropy of every layer to the loss (``True``: what the layers return
    besides the hidden state reaches the loss, which a pipeline cannot pass on)."""

    def __init__(self, rngs, vocab=64, d=16, heads=2, layers=4, read_probs=False):
        self.embed_tokens = nnx.Embed(vocab, d, rngs=rngs)
        self.layers = nnx.List([HFStyleLayer(d, heads, rngs) for _ in range(layers)])
        self.lm_head = nnx.Linear(d, vocab, use_bias=False, rngs=rngs)
        self.read_probs = read_probs

    def loss(self, tokens, targets):
        hidden_states = self.embed_tokens(tokens)
        mask = nnx.make_causal_mask(tokens).astype(bool)
        entropy = 0.0
        for layer in self.layers:
            hidden_states, probs = layer(hidden_states=hidden_states, attention_mask=mask)
            entropy += -jnp.mean(jnp.sum(probs * jnp.log(probs + 1e-9), -1))
        logits = self.lm_head(hidden_states)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
        return loss + (0.01 * entropy if self.read_probs else 0.0)


class NormLinearBlock(nnx.Module):
    """RMSNorm, a linear map and a residual, in ``dtype`` (parameters and activations)."""

    def __init__(self, d, rngs, dtype=jnp.bfloat16):
        self.norm = nnx.RMSNorm(d, rngs=rngs, param_dtype=dtype, dtype=dtype)
        self.lin = nnx.Linear(d, d, rngs=rngs, param_dtype=dtype, dtype=dtype)

    def __call__(self, h):
        return h + jax.nn.gelu(self.lin(self.norm(h)))


class BF16Net(nnx.Module):
    """Parameters and activations in bfloat16 (stock layers' ``param_dtype``/``dtype``), its
    blocks a plain ``nnx.List``."""

    def __init__(self, rngs, vocab=64, d=32, layers=4):
        kw = dict(rngs=rngs, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
        self.embed_tokens = nnx.Embed(vocab, d, **kw)
        self.blocks_list = nnx.List([NormLinearBlock(d, rngs) for _ in range(layers)])
        self.proj = nnx.Linear(d, vocab, **kw)

    def __call__(self, tokens):
        h = self.embed_tokens(tokens)
        for block in self.blocks_list:
            h = block(h)
        return self.proj(h)


class ResidualInTheLoop(nnx.Module):
    """Its loop adds a residual around each layer (``h = h + gelu(layer(h))``): the layers
    alone are not the model, so the pipeline must refuse to run them back to back."""

    def __init__(self, rngs, vocab=256, d=32):
        self.emb = nnx.Embed(vocab, d, rngs=rngs)
        self.layers = nnx.List([nnx.Linear(d, d, rngs=rngs) for _ in range(4)])
        self.out = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, tokens):
        h = self.emb(tokens)
        for layer in self.layers:
            h = h + jax.nn.gelu(layer(h))
        return self.out(h)


class ReversedLoop(ResidualInTheLoop):
    """Calls its layers last to first (a pipeline runs a list in its order; this crashed
    with a TypeError before 2026-12-05)."""

    def __call__(self, tokens):
        h = self.emb(tokens)
        for layer in reversed(self.layers):
            h = layer(h)
        return self.out(h)


class HalfAndMean(nnx.Module):
    def __init__(self, d, rngs):
        self.lin = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, h):
        y = self.lin(h)
        return y.astype(jnp.bfloat16), y.mean()


class TupleInAnotherDtype(ResidualInTheLoop):
    """Its layers return (the hidden state in bf16, a scalar) and the loop casts back to
    float32: none of what a layer returns is the hidden state the next one takes (this
    crashed the stand-in trace with a ValueError before 2026-12-05)."""

    def __init__(self, rngs, vocab=256, d=32):
        super().__init__(rngs, vocab, d)
        self.layers = nnx.List([HalfAndMean(d, rngs) for _ in range(4)])

    def __call__(self, tokens):
        h = self.emb(tokens)
        for layer in self.layers:
            h, _ = layer(h)
            h = h.astype(jnp.float32)
        return self.out(h)


class ReadsBesideTheChain(nnx.Module):
    """Its loss reads more than the last layer's output, which the pipeline's last stage
    alone has: ``reads="input"`` adds the embedded input back before the head, ``"layer1"``
    adds layer 1's output (kept from the loop), ``"tokens"`` masks the loss with the inputs.
    Each trained silently wrong through a pipeline before 2026-12-05 (the masked one to a
    loss of 0), then "input" and "tokens" were refused, "layer1" still is; since 2026-12-05
    (e) the tokens reach the last stage. ``"targets"`` masks it with the targets."""

    def __init__(self, rngs, reads="input", vocab=256, d=32):
        self.emb, self.out = nnx.Embed(vocab, d, rngs=rngs), nnx.Linear(d, vocab, rngs=rngs)
        self.layers = nnx.List([nnx.Linear(d, d, rngs=rngs) for _ in range(4)])
        self.reads = reads

    def loss(self, tokens, targets):
        x0 = h = self.emb(tokens)
        kept = []
        for layer in self.layers:
            h = layer(h)
            kept.append(h)
        h = h + (x0 if self.reads == "input" else kept[1] if self.reads == "layer1" else 0.0)
        losses = optax.softmax_cross_entropy_with_integer_labels(self.out(h), targets)
        if self.reads in ("tokens", "targets"):  # "targets": the fix the refusal offers
            return (losses * ((tokens if self.reads == "tokens" else targets) > 3)).mean()
        return losses.mean()


class Chain(nnx.Module):
    """``emb``, then each of ``layers`` in order, then ``out``: the loop most models here
    share (subclasses build the three)."""

    def __call__(self, tokens):
        h = self.emb(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)


class WholeSequential(nnx.Module):
    """The whole model one ``nnx.Sequential``: embedding, four like blocks, norm, head."""

    def __init__(self, rngs, vocab=256, d=32):
        self.net = nnx.Sequential(nnx.Embed(vocab, d, rngs=rngs),
                                  *[NormLinearBlock(d, rngs, dtype=jnp.float32) for _ in range(4)],
                                  nnx.LayerNorm(d, rngs=rngs), nnx.Linear(d, vocab, rngs=rngs))

    def __call__(self, tokens):
        return self.net(tokens)


class RematInTheLoop(Chain):
    """Each layer call rematerialised in the loop, as memory-bound NNX code does:
    ``how="nnx"`` with ``nnx.remat(lambda m, x: m(x))(layer, h)``, ``"jax"`` with
    ``jax.checkpoint`` around a closure over the layer."""

    def __init__(self, rngs, how="nnx", vocab=64, d=32):
        self.emb, self.out = nnx.Embed(vocab, d, rngs=rngs), nnx.Linear(d, vocab, rngs=rngs)
        self.layers = nnx.List([NormLinearBlock(d, rngs, dtype=jnp.float32) for _ in range(4)])
        self.how = how

    def __call__(self, tokens):
        h = self.emb(tokens)
        for layer in self.layers:
            if self.how == "nnx":
                h = nnx.remat(lambda m, x: m(x))(layer, h)
            else:
                h = jax.checkpoint(lambda x, m=layer: m(x))(h)
        return self.out(h)


class SharedLayers(Chain):
    """Weights shared across depth: ``share="module"`` lists one layer four times (ALBERT),
    ``share="param"`` gives four layers one scale parameter between them."""

    def __init__(self, rngs, share="module", vocab=256, d=32):
        self.emb, self.out = nnx.Embed(vocab, d, rngs=rngs), nnx.Linear(d, vocab, rngs=rngs)
        if share == "module":
            self.layers = nnx.List([nnx.Linear(d, d, rngs=rngs)] * 4)
        else:
            scale = nnx.Param(jnp.ones((d,)))
            self.layers = nnx.List([ScaledLinear(d, scale, rngs) for _ in range(4)])


class Buffer(nnx.Variable):
    """A constant the model keeps beside its parameters, as a non-trainable buffer."""


class Count(nnx.Variable):
    """A counter the model updates as it runs."""


class RotaryLayer(nnx.Module):
    """Rotary position mixing from an ``inv_freq`` table kept as a ``Buffer`` (base
    ``base``), then a residual tanh; ``count``: a ``Count`` it increments every call."""

    def __init__(self, d, rngs, base=10000.0, count=False):
        self.inv_freq = Buffer(1.0 / base ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
        self.proj = nnx.Linear(d, d, rngs=rngs)
        self.calls = Count(jnp.zeros((), jnp.int32)) if count else None

    def __call__(self, x):
        angles = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * self.inv_freq[...][None]
        cos, sin = jnp.cos(angles), jnp.sin(angles)
        x1, x2 = jnp.split(self.proj(x), 2, axis=-1)
        if self.calls is not None:
            self.calls[...] += 1
        return x + jnp.tanh(jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1))


class RematRotaryLayer(RotaryLayer):
    """``RotaryLayer`` whose ``__call__`` is ``nnx.remat``-ed (an NNX transform that must
    see its buffer created in its own trace)."""

    __call__ = nnx.remat(RotaryLayer.__call__)


class WithBuffers(Chain):
    """Layers holding a constant buffer: the same table in every layer (``kind="same"``;
    ``"remat"`` with each layer's call rematerialised), a base growing with depth
    (``"per-layer"``), or a counter each layer increments (``"counter"``)."""

    def __init__(self, rngs, kind="same", vocab=64, d=32, layers=4):
        self.emb, self.out = nnx.Embed(vocab, d, rngs=rngs), nnx.Linear(d, vocab, rngs=rngs)
        kind_of = RematRotaryLayer if kind == "remat" else RotaryLayer
        self.layers = nnx.List([kind_of(d, rngs, base=10000.0 * (i + 1 if kind == "per-layer" else 1),
                                        count=kind == "counter") for i in range(layers)])


class ScannedWithBuffers(nnx.Module):
    """``RotaryLayer``s created stacked (``nnx.vmap``: each holds its ``inv_freq`` buffer
    with a leading layer axis) and run by ``nnx.scan``."""

    def __init__(self, rngs, vocab=64, d=32, layers=4):
        self.emb, self.out = nnx.Embed(vocab, d, rngs=rngs), nnx.Linear(d, vocab, rngs=rngs)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return RotaryLayer(d, rngs)
        self.layers = make(rngs)

    def __call__(self, tokens):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def run(layer, h):
            return layer(h)
        return self.out(run(self.layers, self.emb(tokens)))


class KeywordsOnlyLayer(nnx.Module):
    """``__call__(self, **inputs)``: every argument by keyword, none of them named by the
    signature."""

    def __init__(self, d, rngs):
        self.lin = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, **inputs):
        return inputs["hidden_states"] + jnp.tanh(self.lin(inputs["hidden_states"]))


class KeywordsOnly(nnx.Module):
    def __init__(self, rngs, vocab=64, d=32):
        self.emb, self.out = nnx.Embed(vocab, d, rngs=rngs), nnx.Linear(d, vocab, rngs=rngs)
        self.layers = nnx.List([KeywordsOnlyLayer(d, rngs) for _ in range(4)])

    def __call__(self, tokens):
        h = self.emb(tokens)
        for layer in self.layers:
            h = layer(hidden_states=h)
        return self.out(h)


class StreamLayer(nnx.Module):
    """Takes and returns (hidden, residual), as Mamba's layers (and Hugging Face's ports of
    them) keep the residual stream apart."""

    def __init__(self, d, rngs):
        self.norm, self.mix = nnx.RMSNorm(d, rngs=rngs), nnx.Linear(d, d, rngs=rngs)

    def __call__(self, hidden, residual):
        residual = hidden + residual
        return jnp.tanh(self.mix(self.norm(residual))), residual


class TwoStreams(nnx.Module):
    """Two arrays carried from layer to layer (the hidden state and a residual stream)."""

    def __init__(self, rngs, vocab=64, d=32):
        self.emb, self.out = nnx.Embed(vocab, d, rngs=rngs), nnx.Linear(d, vocab, rngs=rngs)
        self.layers = nnx.List([StreamLayer(d, rngs) for _ in range(4)])

    def __call__(self, tokens):
        h = self.emb(tokens)
        r = jnp.zeros_like(h)
        for layer in self.layers:
            h, r = layer(h, r)
        return self.out(h)


class SowingBlock(nnx.Module):
    """A residual tanh block that sows the mean square of its update (``self.sow``, as
    NNX code collects an auxiliary loss)."""

    def __init__(self, d, rngs, sow=True):
        self.lin, self.sows = nnx.Linear(d, d, rngs=rngs), sow

    def __call__(self, h):
        update = jnp.tanh(self.lin(h))
        if self.sows:
            self.sow(nnx.Intermediate, "aux", jnp.mean(update ** 2))
        return h + update


class SowingHead(nnx.Module):
    def __init__(self, d, vocab, rngs):
        self.lin = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, h):
        logits = self.lin(h)
        self.sow(nnx.Intermediate, "z", jnp.mean(jax.nn.logsumexp(logits, -1) ** 2))
        return logits


class Sowing(Chain):
    """Values sown along the way (``self.sow``) and an auxiliary loss made of them, as NNX
    code writes one: ``aux="none"`` (the layers sow, the loss ignores it), ``"pop"``
    (``nnx.pop`` of the layers' values after the forward), ``"capture"`` (``nnx.capture``,
    Flax 0.12's way), ``"head"`` (captured, but only the head sows: a z-loss)."""

    def __init__(self, rngs, aux="none", vocab=64, d=32):
        self.emb = nnx.Embed(vocab, d, rngs=rngs)
        self.layers = nnx.List([SowingBlock(d, rngs, sow=aux != "head") for _ in range(4)])
        self.out = SowingHead(d, vocab, rngs) if aux == "head" else nnx.Linear(d, vocab, rngs=rngs)
        self.aux = aux

    def loss(self, tokens, targets):
        if self.aux in ("capture", "head"):
            logits, sown = nnx.capture(lambda m, t: m(t), nnx.Intermediate)(self, tokens)
        else:
            logits = self(tokens)
            sown = nnx.pop(self, nnx.Intermediate) if self.aux == "pop" else {}
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
        return ce + 0.01 * sum(jax.tree.leaves(sown), jnp.float32(0.0))


class ScaledLinear(nnx.Module):
    def __init__(self, d, scale, rngs):
        self.lin, self.scale = nnx.Linear(d, d, rngs=rngs), scale

    def __call__(self, h):
        return h + jnp.tanh(self.lin(h)) * self.scale[...]


class LossWithMetrics(nnx.Module):
    """``loss`` returns (loss, metrics), as some training loops expect."""

    def __init__(self, rngs, vocab=256, d=32):
        self.emb, self.out = nnx.Embed(vocab, d, rngs=rngs), nnx.Linear(d, vocab, rngs=rngs)

    def loss(self, inputs, targets):
        logits = self.out(self.emb(inputs))
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean(), {"n": inputs.size}


class FewClasses(nnx.Module):
    """Logits over 100 classes where the data's token ids go up to 255."""

    def __init__(self, rngs, d=32):
        self.emb, self.out = nnx.Embed(256, d, rngs=rngs), nnx.Linear(d, 100, rngs=rngs)

    def __call__(self, tokens):
        return self.out(self.emb(tokens))


class IntegerLogits(nnx.Module):
    """Logits cast to integers: every gradient is zero, and the run "trained" at log(256)."""

    def __init__(self, rngs, d=32):
        self.emb, self.out = nnx.Embed(256, d, rngs=rngs), nnx.Linear(d, 256, rngs=rngs)

    def __call__(self, tokens):
        return self.out(self.emb(tokens)).astype(jnp.int32)


class ShortNames(nnx.Module):
    """A 2-D weight with one logical axis name: its second dimension was left whole."""

    def __init__(self, rngs, d=32):
        self.emb = nnx.Embed(256, d, rngs=rngs)
        init = nnx.initializers.normal(0.02)
        self.w = nnx.Param(init(rngs.params(), (d, 256)), sharding=("embed",))

    def __call__(self, tokens):
        return self.emb(tokens) @ self.w[...]


class NeedsAttentionMask(nnx.Module):
    """``__call__(input_ids, attention_mask)``, as Hugging Face's models take them."""

    def __init__(self, rngs, vocab=256, d=32):
        self.emb, self.out = nnx.Embed(vocab, d, rngs=rngs), nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, input_ids, attention_mask):
        return self.out(self.emb(input_ids) * attention_mask[..., None])


class BrokenForward(nnx.Module):
    """A forward with a bug: a matmul of mismatched widths."""

    def __init__(self, rngs, vocab=256, d=32):
        self.emb, self.out = nnx.Embed(vocab, d, rngs=rngs), nnx.Linear(d + 1, vocab, rngs=rngs)

    def __call__(self, tokens):
        return self.out(self.emb(tokens))


class NoForward(nnx.Module):
    """Parameters, but neither ``__call__`` nor ``loss``."""

    def __init__(self, rngs):
        self.emb = nnx.Embed(256, 32, rngs=rngs)


class CountsInAParam(nnx.Module):
    """A step counter kept as an ``nnx.Param`` of int32 (it is no weight): ``jax.grad``
    refuses integer inputs."""

    def __init__(self, rngs):
        self.emb = nnx.Embed(256, 32, rngs=rngs)
        self.calls = nnx.Param(jnp.zeros((), jnp.int32))

    def __call__(self, tokens):
        return self.emb.attend(self.emb(tokens))


class EmbedIn(nnx.Module):
    """Logits from an embedding table stored in ``dtype`` (float16, complex64: dtypes
    AdamW or the checkpoint cannot take), computed in float32."""

    def __init__(self, rngs, dtype=jnp.float16):
        self.table = nnx.Param((nnx.initializers.normal(0.02)(rngs.params(), (256, 32))).astype(dtype))

    def __call__(self, tokens):
        table = jnp.real(self.table[...]).astype(jnp.float32)
        return table[tokens] @ table.T


def make_broken(rngs):
    """A factory with a bug: ``mindpipe train/tune --model`` must say so in one line."""
    raise ValueError("width 0 is not a width")


class PartsOnly(nnx.Module):
    """Only the pipeline parts: no ``__call__``, no ``loss``."""

    def __init__(self, rngs):
        inner = Llama(heads=4, kv_heads=2, rngs=rngs)
        self.embed, self.blocks, self.head = inner.embed, inner.blocks, inner.head


class WithBatchStats(nnx.Module):
    def __init__(self, rngs):
        self.w = _param(rngs, (4, 4), ("embed", "mlp"))
        self.running_mean = nnx.BatchStat(jnp.zeros((4,)))

    def __call__(self, x):
        return x @ self.w[...]


class OtherNames(nnx.Module):
    """Annotated with another framework's logical names (``tp``, ``fsdp``)."""

    def __init__(self, rngs, vocab=64, d=32):
        self.table = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (vocab, d)),
                               out_sharding=("tp", "fsdp"), eager_sharding=False)

    def __call__(self, tokens):
        return jnp.take(self.table[...], tokens, axis=0) @ self.table[...].T


class TwoOpSupernet(nnx.Module):
    """A user's weight-sharing supernet, written against the ``Supernet`` protocol only:
    each layer picks one of two FFN candidates (relu or tanh) over shared embeddings."""

    def __init__(self, rngs, vocab=64, d=16, layers=2, f=32):
        from mindpipe_jax.supernet import Candidate, Gene, SearchSpace

        genes = tuple(Gene(f"op{i}", ("relu", "tanh"), ordered=False) for i in range(layers))
        self.space = SearchSpace(genes)
        self.layers, self.d, self.f, self.vocab = layers, d, f, vocab
        init = nnx.initializers.normal(0.05)
        self.table = nnx.Param(init(rngs.params(), (vocab, d)))
        self.w_in = Candidate(init(rngs.params(), (layers, 2, d, f)))
        self.w_out = Candidate(init(rngs.params(), (layers, 2, f, d)))
        self.out = nnx.Param(init(rngs.params(), (d, vocab)))

    @property
    def unit_grid(self):
        return (self.layers, 2)

    def units(self, subnet):
        return jnp.asarray(subnet)[:, None] == jnp.arange(2)[None, :]

    def loss(self, inputs, targets, subnet):
        h = jnp.take(self.table[...], inputs, axis=0)
        for i in range(self.layers):
            pick = jax.nn.one_hot(subnet[i], 2, dtype=jnp.float32)
            w_in = jnp.einsum("c,cdf->df", pick, self.w_in[...][i])
            w_out = jnp.einsum("c,cfd->fd", pick, self.w_out[...][i])
            z = h @ w_in
            h = h + jnp.where(subnet[i] == 0, jax.nn.relu(z), jnp.tanh(z)) @ w_out
        return optax.softmax_cross_entropy_with_integer_labels(h @ self.out[...], targets).mean()

    def active_params(self, subnet):
        return 2 * self.vocab * self.d + self.layers * 2 * self.d * self.f


class HalfSupernet(nnx.Module):
    """Has a space and a loss but not the rest of the protocol."""

    def __init__(self, rngs):
        from mindpipe_jax.supernet import Gene, SearchSpace

        self.space = SearchSpace((Gene("op0", ("a", "b"), ordered=False),))
        self.w = nnx.Param(jnp.zeros((2, 2)))

    def loss(self, inputs, targets, subnet):
        return jnp.sum(self.w[...])


class PositionLayer(nnx.Module):
    def __init__(self, d, rngs):
        self.w = _param(rngs, (d, d), ("embed", "mlp"))

    def __call__(self, x, positions):
        return x + jnp.tanh(x @ self.w[...]) * positions[..., None]


class PositionsInLayers(nnx.Module):
    """Its layers take a [rows, length] array besides the hidden state, made once in the
    loop: ``side="positions"`` (of the microbatch's shape only, as a causal mask is),
    ``"embedded"`` (computed from the embedded input: from the tokens and parameters),
    ``"param"`` (from a parameter alone)."""

    def __init__(self, rngs, vocab=64, d=16, layers=4, side="positions"):
        self.table = _param(rngs, (vocab, d), ("vocab", "embed"))
        self.layers = nnx.List([PositionLayer(d, rngs) for _ in range(layers)])
        self.side = side

    def __call__(self, tokens):
        x = jnp.take(self.table[...], tokens, axis=0)
        if self.side == "positions":
            side = jnp.broadcast_to(jnp.arange(tokens.shape[1]) / tokens.shape[1], tokens.shape)
        elif self.side == "param":
            side = jnp.broadcast_to(jnp.tanh(self.table[0, 0]), tokens.shape)
        else:
            side = jnp.tanh(x.mean(-1))
        for layer in self.layers:
            x = layer(x, side)
        return x @ self.table[...].T


class MixerBlock(nnx.Module):
    """A mixer block, no attention: RMSNorm, a causal running mean gated per channel, then
    one of two FFN candidates (relu or tanh); skipped entirely when not kept."""

    def __init__(self, d, f, rngs):
        from mindpipe_jax.supernet import Candidate

        init = nnx.initializers.normal(0.1)
        self.norm = _ones((d,), ("embed",))
        self.gate = _param(rngs, (d,), ("embed",), std=0.5)
        self.w_in = Candidate(init(rngs.params(), (2, d, f)), out_sharding=(None, "embed", "mlp"),
                              eager_sharding=False)
        self.w_out = Candidate(init(rngs.params(), (2, f, d)), out_sharding=(None, "mlp", "embed"),
                               eager_sharding=False)

    def __call__(self, h, keep, op):
        x = rms_norm(h, self.norm[...])
        x = x + jnp.tanh(self.gate[...]) * jnp.cumsum(x, axis=1) / jnp.arange(1, x.shape[1] + 1)[:, None]
        pick = jax.nn.one_hot(op, 2, dtype=x.dtype)
        z = x @ jnp.einsum("c,cdf->df", pick, self.w_in[...])
        y = jnp.where(op == 0, jax.nn.relu(z), jnp.tanh(z)) @ jnp.einsum("c,cfd->fd", pick, self.w_out[...])
        return jnp.where(keep, h + y, h)


class MixerEmbed(nnx.Module):
    def __init__(self, vocab, d, rngs):
        self.table = _param(rngs, (vocab, d), ("vocab", "embed"), std=0.1)

    def __call__(self, tokens):
        return jax.nn.one_hot(tokens, self.table.shape[0], dtype=jnp.float32) @ self.table[...]


class MixerHead(nnx.Module):
    def __init__(self, vocab, d, rngs):
        self.norm = _ones((d,), ("embed",))
        self.out = _param(rngs, (d, vocab), ("embed", "vocab"), std=0.1)

    def __call__(self, h):
        return rms_norm(h, self.norm[...]) @ self.out[...]


class MixerSupernet(nnx.Module):
    """A user's supernet of another family than SuperGPT, written against the pipeline's
    supernet protocol (``embed`` / ``blocks`` / ``head``, ``stage_conditions``,
    ``conditioned_block``, ``head_loss``): attention-free mixer blocks, each of which a
    subnet keeps or skips on its own (not a depth prefix) and runs with a relu or tanh
    FFN; stacked with ``nnx.vmap`` over a "layers" axis, as Flax users stack layers."""

    def __init__(self, rngs, vocab=64, d=16, layers=4, f=32):
        from mindpipe_jax.supernet import Gene, SearchSpace

        genes = []
        for i in range(layers):
            genes += [Gene(f"keep{i}", ("yes", "no"), ordered=False), Gene(f"op{i}", ("relu", "tanh"),
                                                                            ordered=False)]
        self.space = SearchSpace(tuple(genes))
        self.layers, self.d, self.f, self.vocab = layers, d, f, vocab
        self.embed = MixerEmbed(vocab, d, rngs)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stack(rngs):
            return MixerBlock(d, f, rngs)

        self.blocks = stack(rngs)
        self.head = MixerHead(vocab, d, rngs)

    @property
    def unit_grid(self):
        return (self.layers, 2)

    def stage_conditions(self, subnet):
        genes = jnp.asarray(subnet).reshape(self.layers, 2)
        return jnp.stack([genes[:, 0] == 0, genes[:, 1]], axis=1).astype(jnp.float32)  # (keep, op)

    def units(self, subnet):
        c = self.stage_conditions(subnet)
        return (c[:, :1] > 0) & (c[:, 1:].astype(jnp.int32) == jnp.arange(2)[None, :])

    @staticmethod
    def conditioned_block(block, h, condition):
        return block(h, condition[0] > 0, condition[1].astype(jnp.int32))

    @staticmethod
    def head_loss(head, h, targets):
        return optax.softmax_cross_entropy_with_integer_labels(head(h), targets).mean()

    def loss(self, inputs, targets, subnet):
        graphdef, layers = nnx.split(self.blocks)

        def body(h, xs):
            layer, condition = xs
            return self.conditioned_block(nnx.merge(graphdef, layer), h, condition), None

        h, _ = jax.lax.scan(body, self.embed(inputs), (layers, self.stage_conditions(subnet)))
        return self.head_loss(self.head, h, targets)

    def active_params(self, subnet):
        kept = int(np.sum(np.asarray(self.stage_conditions(subnet))[:, 0]))
        return 2 * self.vocab * self.d + self.d + kept * (2 * self.d + 2 * self.d * self.f)


class KeyedDropoutLayer(nnx.Module):
    def __init__(self, d, rngs, rate):
        self.lin = nnx.Linear(d, d, rngs=rngs)
        self.rate = rate

    def __call__(self, h, key=None):
        y = jnp.tanh(self.lin(h))
        if key is not None and self.rate:
            keep = jax.random.bernoulli(key, 1.0 - self.rate, y.shape)
            y = jnp.where(keep, y / (1.0 - self.rate), 0)
        return h + y


class KeyedDropout(nnx.Module):
    """Dropout the way a model without ``rngs=`` streams writes it: ``loss(inputs, targets,
    dropout_key=None)`` splits the key over its layers (``rate=0``: takes the key, draws
    nothing)."""

    def __init__(self, rngs, rate=0.3, vocab=64, d=32, layers=4):
        self.emb, self.out = nnx.Embed(vocab, d, rngs=rngs), nnx.Linear(d, vocab, rngs=rngs)
        self.layers = nnx.List([KeyedDropoutLayer(d, rngs, rate) for _ in range(layers)])

    def loss(self, inputs, targets, dropout_key=None):
        keys = jax.random.split(dropout_key, len(self.layers)) if dropout_key is not None else \
            [None] * len(self.layers)
        h = self.emb(inputs)
        for layer, key in zip(self.layers, keys, strict=True):
            h = layer(h, key)
        return optax.softmax_cross_entropy_with_integer_labels(self.out(h), targets).mean()


class SoftExpertsBlock(nnx.Module):
    """A mixture of expert MLPs weighted by a softmax gate, every token through every
    expert (no dispatch): its expert weights are ``[experts, ...]`` stacks on the
    ``experts`` logical axis, what ``parallel.expert`` splits."""

    def __init__(self, d, hidden, experts, rngs):
        self.norm = _ones((d,), ("embed",))
        self.gate = _param(rngs, (d, experts), ("embed", None))
        self.w_in = _param(rngs, (experts, d, hidden), ("experts", "embed", "mlp"))
        self.w_out = _param(rngs, (experts, hidden, d), ("experts", "mlp", "embed"))

    def __call__(self, h):
        x = rms_norm(h, self.norm[...])
        weight = jax.nn.softmax(x @ self.gate[...], axis=-1)
        inner = jax.nn.gelu(jnp.einsum("bsd,edf->bsef", x, self.w_in[...]))
        out = jnp.einsum("bsef,efd->bsed", inner, self.w_out[...])
        return h + jnp.einsum("bsed,bse->bsd", out, weight)


class SoftExperts(nnx.Module):
    """A user's Mixture-of-Experts model of its own design (not the reference MoE GPT):
    an ``nnx.List`` of ``SoftExpertsBlock`` between a tied embedding and its transpose."""

    def __init__(self, rngs, vocab=64, d=32, experts=4, layers=4):
        self.embed = _param(rngs, (vocab, d), ("vocab", "embed"))
        self.blocks = nnx.List([SoftExpertsBlock(d, 2 * d, experts, rngs) for _ in range(layers)])

    def __call__(self, tokens):
        h = self.embed[...][tokens]
        for block in self.blocks:
            h = block(h)
        return h @ self.embed[...].T
