"""The reference decoder-only transformer (GPT-2 shape, pre-norm) in Flax NNX.

It follows the pipeline model contract: ``embed`` (tokens → hidden), ``blocks``
(N identical blocks created stacked with a leading ``layers`` axis, so they scan
and split into pipeline stages) and ``head`` (hidden → logits / loss). Weights
carry logical axis names only; ``parallel/rules.py`` decides how they shard, so
tensor parallelism needs no model code.

Dropout draws from an explicit key passed to the call (``dropout_key``) rather
than from stateful ``Rngs``: the train step stays a pure function of
(state, batch, step) and a resumed run draws the same masks.

``model.collective_matmul`` (with a ``tensor`` mesh axis > 1) runs each block
sequence-parallel inside: the block takes and returns the same replicated
hidden states, but in between its rows are split over ``tensor`` and its four
projections are collective matmuls (``parallel/overlap.py`` says why). Same
weights, same logical names, same result up to summation order.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from mindpipe_jax.config import ModelConfig
from mindpipe_jax.parallel import overlap
from mindpipe_jax.parallel.rules import constrain

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _annotated(value, names) -> nnx.Param:
    # Logical names are metadata for the rules table, not mesh axes: turn off
    # Flax's eager sharding so the model can be built with or without a mesh.
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


def _param(rngs: nnx.Rngs, shape, names, std: float, dtype) -> nnx.Param:
    init = nnx.initializers.normal(std) if std > 0 else nnx.initializers.zeros_init()
    return _annotated(init(rngs.params(), shape, dtype), names)


def _ones(shape, names, dtype) -> nnx.Param:
    return _annotated(jnp.ones(shape, dtype), names)


def _zeros(shape, names, dtype) -> nnx.Param:
    return _annotated(jnp.zeros(shape, dtype), names)


def _dropout(x, rate: float, key):
    if rate == 0.0 or key is None:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


class LayerNorm(nnx.Module):
    def __init__(self, dim: int, param_dtype):
        self.scale = _ones((dim,), ("norm",), param_dtype)
        self.bias = _zeros((dim,), ("norm",), param_dtype)

    def __call__(self, x):
        # Statistics in fp32 whatever the compute dtype: bf16 variance underflows.
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + 1e-5)
        return (y * self.scale[...] + self.bias[...]).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        pd = DTYPES[cfg.param_dtype]
        d, n, h = cfg.d_model, cfg.n_heads, cfg.head_dim
        out_std = 0.02 / math.sqrt(2 * cfg.n_layers)
        self.qkv = _param(rngs, (d, 3, n, h), ("embed", None, "heads", "kv"), 0.02, pd)
        self.qkv_bias = _zeros((3, n, h), (None, "heads", "kv"), pd)
        self.out = _param(rngs, (n, h, d), ("heads", "kv", "embed"), out_std, pd)
        self.out_bias = _zeros((d,), ("embed",), pd)
        self.dtype = DTYPES[cfg.dtype]
        self.attention = cfg.attention

    def _attend(self, q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=self.attention)

    def __call__(self, x):
        dt = self.dtype
        qkv = jnp.einsum("btd,dcnh->cbtnh", x, self.qkv[...].astype(dt))
        qkv = qkv + self.qkv_bias[...].astype(dt)[:, None, None]
        q, k, v = (constrain(t, ("batch", "length", "heads", "kv")) for t in qkv)
        y = self._attend(q, k, v)
        y = constrain(y, ("batch", "length", "heads", "kv"))
        return jnp.einsum("btnh,nhd->btd", y, self.out[...].astype(dt)) + self.out_bias[...].astype(dt)

    def overlapped(self, xs):
        """The same attention on rows split over ``tensor``, returning rows split over
        ``tensor``: qkv is an all-gather matmul, the output projection a matmul
        reduce-scatter (column- and row-parallel, as the rules split the weights)."""
        dt = self.dtype
        qkv = overlap.all_gather_matmul("btd,dcnh->btcnh", xs, self.qkv[...].astype(dt),
                                        ("embed", None, "heads", "kv"),
                                        ("batch", "length", None, "heads", "kv"))
        qkv = qkv + self.qkv_bias[...].astype(dt)
        q, k, v = (constrain(qkv[:, :, i], ("batch", "length", "heads", "kv")) for i in range(3))
        y = self._attend(q, k, v)
        y = constrain(y, ("batch", "length", "heads", "kv"))
        out = overlap.matmul_reduce_scatter("btnh,nhd->btd", y, self.out[...].astype(dt),
                                            ("batch", "length", "heads", "kv"), ("heads", "kv", "embed"))
        return out + self.out_bias[...].astype(dt)


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        pd = DTYPES[cfg.param_dtype]
        d, f = cfg.d_model, cfg.ff_dim
        self.w_in = _param(rngs, (d, f), ("embed", "mlp"), 0.02, pd)
        self.b_in = _zeros((f,), ("mlp",), pd)
        self.w_out = _param(rngs, (f, d), ("mlp", "embed"), 0.02 / math.sqrt(2 * cfg.n_layers), pd)
        self.b_out = _zeros((d,), ("embed",), pd)
        self.dtype = DTYPES[cfg.dtype]

    def __call__(self, x):
        dt = self.dtype
        h = jax.nn.gelu(x @ self.w_in[...].astype(dt) + self.b_in[...].astype(dt))
        h = constrain(h, ("batch", "length", "mlp"))
        return h @ self.w_out[...].astype(dt) + self.b_out[...].astype(dt)

    def overlapped(self, xs):
        """The same MLP on rows split over ``tensor`` (see ``Attention.overlapped``)."""
        dt = self.dtype
        h = overlap.all_gather_matmul("btd,df->btf", xs, self.w_in[...].astype(dt),
                                      ("embed", "mlp"), ("batch", "length", "mlp"))
        h = jax.nn.gelu(h + self.b_in[...].astype(dt))
        h = constrain(h, ("batch", "length", "mlp"))
        out = overlap.matmul_reduce_scatter("btf,fd->btd", h, self.w_out[...].astype(dt),
                                            ("batch", "length", "mlp"), ("mlp", "embed"))
        return out + self.b_out[...].astype(dt)


class Block(nnx.Module):
    """Pre-norm residual block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        pd = DTYPES[cfg.param_dtype]
        self.ln1 = LayerNorm(cfg.d_model, pd)
        self.attn = Attention(cfg, rngs)
        self.ln2 = LayerNorm(cfg.d_model, pd)
        self.mlp = MLP(cfg, rngs)
        self.dropout = cfg.dropout
        self.collective_matmul = cfg.collective_matmul

    def __call__(self, x, key=None):
        if self.collective_matmul and overlap.tensor_size() > 1:
            overlap.refuse_in_pipeline()
            return self._overlapped(x, key)
        k1, k2 = jax.random.split(key) if key is not None else (None, None)
        x = x + _dropout(self.attn(self.ln1(x)), self.dropout, k1)
        x = constrain(x, ("batch", "length", "embed"))
        x = x + _dropout(self.mlp(self.ln2(x)), self.dropout, k2)
        return constrain(x, ("batch", "length", "embed"))

    def _overlapped(self, x, key):
        """The block with its rows split over ``tensor`` between the projections.

        Layer norms, residual adds and dropout act on this device's rows only; the
        one transfer not hidden behind a matmul is ``gather_rows`` at the end (in
        the backward, its transpose at the start). Dropout masks are drawn for the
        whole array, so they are the same as with the option off.
        """
        k1, k2 = jax.random.split(key) if key is not None else (None, None)
        xs = overlap.scatter_rows(x)  # a local slice: x is replicated over tensor
        xs = xs + _dropout(self.attn.overlapped(self.ln1(xs)), self.dropout, k1)
        xs = xs + _dropout(self.mlp.overlapped(self.ln2(xs)), self.dropout, k2)
        return constrain(overlap.gather_rows(xs), ("batch", "length", "embed"))


class Embed(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        pd = DTYPES[cfg.param_dtype]
        self.tokens = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), 0.02, pd)
        self.positions = _param(rngs, (cfg.seq_len, cfg.d_model), (None, "embed"), 0.01, pd)
        self.dtype = DTYPES[cfg.dtype]
        self.dropout = cfg.dropout

    def __call__(self, tokens, key=None):
        # The table in its compute layout inside the differentiated function, so its
        # gradient (a scatter-add of batch-split rows) is summed in that layout and then
        # sliced to storage. Left free, XLA 0.10 planned the scatter straight into fsdp
        # storage shards and logged an "involuntary full rematerialization" whenever fsdp
        # met another batch axis (the compiled collectives are the same either way).
        table = constrain(self.tokens[...], ("vocab", "embed"))
        h = jnp.take(table, tokens, axis=0) + self.positions[: tokens.shape[1]]
        h = _dropout(h.astype(self.dtype), self.dropout, key)
        return constrain(h, ("batch", "length", "embed"))


class Head(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        pd = DTYPES[cfg.param_dtype]
        self.ln_f = LayerNorm(cfg.d_model, pd)
        self.lm_head = _param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), 0.02, pd)
        self.dtype = DTYPES[cfg.dtype]

    def __call__(self, h):
        logits = self.ln_f(h) @ self.lm_head[...].astype(self.dtype)
        return constrain(logits, ("batch", "length", "vocab"))

    def loss(self, h, targets):
        """Mean next-token cross-entropy in fp32 (nats per token)."""
        logits = self(h).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


# model.remat's policies for a block (the GPT's and the reference supernet's).
BLOCK_REMAT = {
    "full": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class GPT(nnx.Module):
    """embed → scan over stacked blocks → head."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.embed = Embed(cfg, rngs)

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(rngs):
            return Block(cfg, rngs)

        self.blocks = make_blocks(rngs)
        self.head = Head(cfg, rngs)

    def run_blocks(self, h, key=None):
        """Apply the stacked blocks in order with ``lax.scan`` (one compiled block)."""
        h, _ = scan_blocks(self.blocks, h, key, self.config)
        return h

    def __call__(self, tokens, dropout_key=None):
        k_embed, k_blocks = jax.random.split(dropout_key) if dropout_key is not None else (None, None)
        return self.head(self.run_blocks(self.embed(tokens, k_embed), k_blocks))

    def loss(self, inputs, targets, dropout_key=None):
        k_embed, k_blocks = jax.random.split(dropout_key) if dropout_key is not None else (None, None)
        h = self.run_blocks(self.embed(inputs, k_embed), k_blocks)
        return self.head.loss(h, targets)


def scan_blocks(blocks, h, key, cfg: ModelConfig):
    """Run ``nnx.vmap``-stacked blocks in order with ``lax.scan`` (one compiled block),
    each under ``cfg.remat``. A block returns the new hidden state, or (hidden state,
    a per-layer output); returns (hidden state, the stacked per-layer outputs or None)."""
    graphdef, layers = nnx.split(blocks)
    keys = jax.random.split(key, cfg.n_layers) if key is not None else None

    def body(x, xs):
        layer_state, layer_key = xs
        out = nnx.merge(graphdef, layer_state)(x, layer_key)
        return out if isinstance(out, tuple) else (out, None)

    if cfg.remat != "none":
        body = jax.checkpoint(body, policy=BLOCK_REMAT[cfg.remat], prevent_cse=False)
    return jax.lax.scan(body, h, (layers, keys))


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters that take part in a matmul per token (no embedding lookups, norms, biases)."""
    d, f, layers = cfg.d_model, cfg.ff_dim, cfg.n_layers
    per_block = 3 * d * d + d * d + 2 * d * f
    return layers * per_block + d * cfg.vocab_size


def flops_per_token(cfg: ModelConfig) -> float:
    """Training FLOPs per token: 6·N (forward + backward matmuls) + 12·L·T·d for
    attention scores and values (PaLM's convention, counted without the causal
    half-saving so MFU is comparable with published figures)."""
    return 6.0 * matmul_params(cfg) + 12.0 * cfg.n_layers * cfg.seq_len * cfg.d_model
