"""The reference supernet: the GPT of ``models/gpt.py`` with searchable blocks.

Same embedding, head, layer norms and attention parameters as the dense GPT
(those classes are reused; the embedding lookup and the loss use one-hot
products so that the backward has no scatter), and the same pipeline-shaped layout: ``embed``,
``blocks`` stacked with ``nnx.vmap`` (leading ``layers`` axis, run by
``lax.scan``), ``head``. Each block declares three genes and the model one:

===========  =======================================================  ===========
gene         what it chooses                                          kind
===========  =======================================================  ===========
``depth``    how many blocks run (the rest are skipped: identity)     ordered
``op{l}``    which FFN candidate of block ``l`` (own weights and      unordered
             activation, e.g. gelu / relu / silu)
``ffn{l}``   hidden width of that FFN (a prefix of its ``d_ff``)      ordered
``heads{l}`` attention heads of block ``l`` (a prefix of ``n_heads``) ordered
===========  =======================================================  ===========

A subnet vector is ``[depth, op0, ffn0, heads0, op1, ffn1, heads1, ...]``.

The FFN candidates are :class:`~mindpipe_jax.supernet.space.Candidate`
variables stacked ``[layers, candidates, ...]``: the unit grid is
``(n_layers, n_ops)`` and a subnet uses unit ``(l, c)`` when block ``l`` runs
and chose candidate ``c``. Attention, layer norms, embedding and head are
shared by every subnet (elastic heads only mask the attention's output).

Two ways to run a subnet. ``loss`` (the *masked* path) computes every subnet at the
supernet's full size, one program for all of them. ``sliced_loss`` (the *sliced*
path, see ``sliced.py``) computes it from slices of the shared weights: its first
``depth`` blocks, the first FFN units and heads of each, so a small subnet costs
what it is. The ``shape`` (static: one program per shape) fixes the sizes; widths
and heads below them are still masked, so one program serves every subnet that fits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mindpipe_jax.config import ModelConfig
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.models.gpt import BLOCK_REMAT, DTYPES, Attention, Embed, Head, LayerNorm
from mindpipe_jax.parallel.rules import constrain
from mindpipe_jax.supernet.space import (
    Candidate,
    Gene,
    SearchSpace,
    choice_value,
    onehot,
    prefix_mask,
    select,
)

ACTIVATIONS = {
    "gelu": jax.nn.gelu,
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "relu2": lambda z: jnp.square(jax.nn.relu(z)),
    "tanh": jnp.tanh,
}

GENES_PER_LAYER = 3  # op, ffn width, heads


def _candidate(rngs: nnx.Rngs, shape, names, std: float, dtype) -> Candidate:
    init = nnx.initializers.normal(std) if std > 0 else nnx.initializers.zeros_init()
    return Candidate(init(rngs.params(), shape, dtype), out_sharding=names, eager_sharding=False)


class ChoiceFFN(nnx.Module):
    """``len(ops)`` FFN candidates of the same shape, one chosen per subnet, elastic hidden width."""

    def __init__(self, cfg: ModelConfig, ops: Sequence[str], rngs: nnx.Rngs):
        pd = DTYPES[cfg.param_dtype]
        c, d, f = len(ops), cfg.d_model, cfg.ff_dim
        out_std = 0.02 / math.sqrt(2 * cfg.n_layers)
        # The candidate axis has no logical name: candidates are replicated.
        self.w_in = _candidate(rngs, (c, d, f), (None, "embed", "mlp"), 0.02, pd)
        self.b_in = _candidate(rngs, (c, f), (None, "mlp"), 0.0, pd)
        self.w_out = _candidate(rngs, (c, f, d), (None, "mlp", "embed"), out_std, pd)
        self.b_out = _candidate(rngs, (c, d), (None, "embed"), 0.0, pd)
        self.ops = tuple(ops)
        self.dtype = DTYPES[cfg.dtype]

    def __call__(self, x, op, width):
        """``op``: candidate index; ``width``: active hidden units (both may be traced)."""
        dt = self.dtype
        hot = onehot(op, len(self.ops))
        w_in, b_in, w_out, b_out = (select(hot, p[...]).astype(dt)
                                    for p in (self.w_in, self.b_in, self.w_out, self.b_out))
        z = x @ w_in + b_in
        # Each candidate's own activation, chosen by where (exact, and its backward too).
        h = ACTIVATIONS[self.ops[0]](z)
        for c in range(1, len(self.ops)):
            h = jnp.where(op == c, ACTIVATIONS[self.ops[c]](z), h)
        h = jnp.where(prefix_mask(width, h.shape[-1]), h, 0)
        h = constrain(h, ("batch", "length", "mlp"))
        return h @ w_out + b_out


class ElasticAttention(Attention):
    """The dense GPT's attention (same parameters) with a prefix of its heads active."""

    def __call__(self, x, heads=None):
        dt = self.dtype
        qkv = jnp.einsum("btd,dcnh->cbtnh", x, self.qkv[...].astype(dt))
        qkv = qkv + self.qkv_bias[...].astype(dt)[:, None, None]
        q, k, v = (constrain(t, ("batch", "length", "heads", "kv")) for t in qkv)
        y = self._attend(q, k, v)
        if heads is not None:
            y = jnp.where(prefix_mask(heads, y.shape[2])[:, None], y, 0)
        y = constrain(y, ("batch", "length", "heads", "kv"))
        return jnp.einsum("btnh,nhd->btd", y, self.out[...].astype(dt)) + self.out_bias[...].astype(dt)


class OneHotEmbed(Embed):
    """The dense GPT's embedding (same parameters), looked up by a one-hot matmul.

    ``jnp.take``'s backward is a scatter-add with repeated token ids, whose
    summation order is not fixed on GPUs; a one-hot contraction's backward is a
    matmul. It costs ``vocab × d_model`` multiply-adds per token, as the LM head.
    """

    def __call__(self, tokens, key=None):
        hot = jax.nn.one_hot(tokens, self.tokens.shape[0], dtype=self.dtype)
        h = hot @ self.tokens[...].astype(self.dtype) + self.positions[: tokens.shape[1]].astype(self.dtype)
        return constrain(h, ("batch", "length", "embed"))


class SuperBlock(nnx.Module):
    """Pre-norm block: elastic-head attention, then a choice of FFN; skipped when inactive."""

    def __init__(self, cfg: ModelConfig, ops: Sequence[str], rngs: nnx.Rngs):
        pd = DTYPES[cfg.param_dtype]
        self.ln1 = LayerNorm(cfg.d_model, pd)
        self.attn = ElasticAttention(cfg, rngs)
        self.ln2 = LayerNorm(cfg.d_model, pd)
        self.ffn = ChoiceFFN(cfg, ops, rngs)

    def __call__(self, x, active, op, width, heads):
        y = x + self.attn(self.ln1(x), heads)
        y = constrain(y, ("batch", "length", "embed"))
        y = y + self.ffn(self.ln2(y), op, width)
        y = constrain(y, ("batch", "length", "embed"))
        return jnp.where(active, y, x)  # a skipped block is exactly the identity


class SuperGPT(nnx.Module):
    """embed → scan over stacked searchable blocks → head; ``loss(inputs, targets, subnet)``.

    ``ops``: activation names of the FFN candidates (one candidate each);
    ``ffn_widths``: hidden sizes to choose from (each <= ``cfg.ff_dim``);
    ``heads``: head counts to choose from (each <= ``cfg.n_heads``);
    ``depths``: block counts to choose from (each in 1..``cfg.n_layers``).
    """

    def __init__(self, cfg: ModelConfig, *, ops: Sequence[str] = ("gelu", "relu", "silu"),
                 ffn_widths: Sequence[int] = (), heads: Sequence[int] = (), depths: Sequence[int] = (),
                 rngs: nnx.Rngs):
        if cfg.dropout:
            raise ConfigError(f"model.dropout={cfg.dropout}: the supernet does not apply dropout; "
                              f"set model.dropout=0")
        ops = tuple(ops)
        bad = [o for o in ops if o not in ACTIVATIONS]
        if not ops or bad:
            raise ConfigError(f"supernet.ops={list(ops)}: {'unknown ' + str(bad) if bad else 'empty'}; "
                              f"valid: {', '.join(ACTIVATIONS)}")
        ffn_widths = tuple(sorted(set(ffn_widths))) or (cfg.ff_dim,)
        heads = tuple(sorted(set(heads))) or tuple(range(1, cfg.n_heads + 1))
        depths = tuple(sorted(set(depths))) or (cfg.n_layers,)
        _check_range("FFN widths", ffn_widths, 1, cfg.ff_dim, "model.ff_dim")
        _check_range("head counts", heads, 1, cfg.n_heads, "model.n_heads")
        _check_range("depths", depths, 1, cfg.n_layers, "model.n_layers")
        self.config = cfg
        self.ops, self.ffn_widths, self.head_choices, self.depths = ops, ffn_widths, heads, depths
        genes = [Gene("depth", depths)]
        layer_genes = []
        for layer in range(cfg.n_layers):
            genes += [Gene(f"op{layer}", ops, ordered=False), Gene(f"ffn{layer}", ffn_widths),
                      Gene(f"heads{layer}", heads)]
            layer_genes.append((f"op{layer}", f"ffn{layer}", f"heads{layer}"))
        self.space = SearchSpace(tuple(genes), depth_gene="depth", layer_genes=tuple(layer_genes))
        self.embed = OneHotEmbed(cfg, rngs)

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(rngs):
            return SuperBlock(cfg, ops, rngs)

        self.blocks = make_blocks(rngs)
        self.head = Head(cfg, rngs)

    # --- the unit grid --------------------------------------------------------------------------

    @property
    def unit_grid(self) -> tuple[int, int]:
        """Leading axes of every Candidate parameter: (layers, FFN candidates)."""
        return (self.config.n_layers, len(self.ops))

    def units(self, subnet):
        """``bool[layers, candidates]``: the FFN candidates this subnet reads (jnp; may be traced)."""
        layers, n_ops = self.unit_grid
        depth = choice_value(self.space.genes[0], subnet[0])
        ops = jnp.asarray(subnet)[1:].reshape(layers, GENES_PER_LAYER)[:, 0]
        active = jnp.arange(layers) < depth
        return active[:, None] & (ops[:, None] == jnp.arange(n_ops)[None, :])

    def active_params(self, subnet) -> int:
        """Parameters the subnet's forward pass uses (embedding, head, and its blocks' active parts)."""
        cfg = self.config
        values = self.space.decode(np.asarray(subnet))
        d, hd = cfg.d_model, cfg.head_dim
        total = cfg.vocab_size * d + cfg.seq_len * d + 2 * d + d * cfg.vocab_size  # embed, ln_f, head
        for layer in range(values["depth"]):
            n, f = values[f"heads{layer}"], values[f"ffn{layer}"]
            total += 4 * d  # two layer norms
            total += d * 3 * n * hd + 3 * n * hd + n * hd * d + d  # attention (active heads)
            total += d * f + f + f * d + d  # the chosen FFN's active width
        return total

    # --- forward ----------------------------------------------------------------------------------

    def run_blocks(self, h, subnet):
        cfg = self.config
        graphdef, layers = nnx.split(self.blocks)
        genes = jnp.asarray(subnet)[1:].reshape(cfg.n_layers, GENES_PER_LAYER)
        depth = choice_value(self.space.genes[0], subnet[0])
        widths = choice_value(Gene("w", self.ffn_widths), genes[:, 1])
        heads = choice_value(Gene("h", self.head_choices), genes[:, 2])
        active = jnp.arange(cfg.n_layers) < depth

        def body(x, xs):
            layer_state, act, op, width, n_heads = xs
            return nnx.merge(graphdef, layer_state)(x, act, op, width, n_heads), None

        if cfg.remat != "none":
            body = jax.checkpoint(body, policy=BLOCK_REMAT[cfg.remat], prevent_cse=False)
        h, _ = jax.lax.scan(body, h, (layers, active, genes[:, 0], widths, heads))
        return h

    def __call__(self, tokens, subnet):
        return self.head(self.run_blocks(self.embed(tokens), subnet))

    def loss(self, inputs, targets, subnet):
        """Mean next-token cross-entropy of the subnet (fp32, nats per token)."""
        return self.head_loss(self.head, self.run_blocks(self.embed(inputs), subnet), targets)

    @staticmethod
    def head_loss(head, h, targets):
        """The head's mean cross-entropy on hidden states ``h``.

        The target's log-probability is picked by a one-hot product, not an index
        (whose backward would be a scatter): the whole backward is scatter-free.
        """
        logits = head(h).astype(jnp.float32)
        hot = jax.nn.one_hot(targets, logits.shape[-1], dtype=jnp.float32)
        return -jnp.mean(jnp.sum(hot * jax.nn.log_softmax(logits), axis=-1))

    # --- through a pipeline (``pipelined.py``) ------------------------------------------------------

    def stage_conditions(self, subnet):
        """``float32[n_layers, 4]``: what each block needs to know of ``subnet`` (runs,
        FFN candidate, FFN width, heads), as numbers that travel with the block's weights
        through a pipeline (small integers: exact in float32). May be traced."""
        cfg = self.config
        genes = jnp.asarray(subnet)[1:].reshape(cfg.n_layers, GENES_PER_LAYER)
        depth = choice_value(self.space.genes[0], subnet[0])
        widths = choice_value(Gene("w", self.ffn_widths), genes[:, 1])
        heads = choice_value(Gene("h", self.head_choices), genes[:, 2])
        active = jnp.arange(cfg.n_layers) < depth
        return jnp.stack([active, genes[:, 0], widths, heads], axis=1).astype(jnp.float32)

    @staticmethod
    def conditioned_block(block, h, condition):
        """One block on ``h`` as ``condition`` (a row of ``stage_conditions``) says."""
        c = condition.astype(jnp.int32)
        return block(h, c[0] > 0, c[1], c[2], c[3])


    # --- sliced execution --------------------------------------------------------------------------

    def own_shape(self, subnet) -> tuple[tuple[int, int], ...]:
        """``((ffn width, heads), ...)`` of each block the subnet runs (host NumPy): its own size."""
        values = self.space.decode(np.asarray(subnet))
        return tuple((values[f"ffn{layer}"], values[f"heads{layer}"]) for layer in range(values["depth"]))

    def ladders(self, levels: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The FFN widths and head counts a subnet is rounded up to: at most ``levels`` of each."""
        return ladder(self.ffn_widths, levels), ladder(self.head_choices, levels)

    def sliced_shape(self, subnet, levels: int) -> tuple[tuple[int, int], ...]:
        """The shape the sliced path runs ``subnet`` at: its depth, and in every block the
        largest width and head count of its blocks, each rounded up to its ladder.

        One size for all blocks (not one per block) keeps the number of shapes at
        ``len(depths) x len(width ladder) x len(head ladder)``; per-block sizes would
        make it exponential in the depth.
        """
        own = self.own_shape(subnet)
        widths, heads = self.ladders(levels)
        size = (round_up(max(w for w, _ in own), widths), round_up(max(h for _, h in own), heads))
        return (size,) * len(own)

    @staticmethod
    def slice_blocks(blocks: dict, size: tuple[int, int]) -> dict:
        """The stacked blocks' parameters (a pure dict, leading layer axis) cut to one
        ``(ffn width, heads)`` size: what a subnet of that size reads of them (the
        pipeline's sliced path, ``pipelined_sliced.py``)."""
        return slice_pure_block(blocks, *size, lead=1)

    def sliced_loss(self, inputs, targets, subnet, shape, unroll: bool = False):
        """The subnet's mean loss computed from slices of the weights (``shape``: static,
        ``((width, heads), ...)`` per block run; ``subnet`` may be traced).

        Blocks of one size (every ladder shape) run as a scan over the first ``depth``
        stacked blocks, as the masked path does; blocks of different sizes (a subnet's own
        shape) one after another in Python. ``unroll``: unroll the scan (XLA's cost
        analysis counts a loop body once: unroll to count FLOPs). A slice's gradient is
        the full parameter's gradient restricted to it, so autodiff through this function
        gives gradients of the supernet's parameters, zero outside the slices.
        """
        cfg = self.config
        graphdef, layers = nnx.split(self.blocks)
        genes = jnp.asarray(subnet)[1:].reshape(cfg.n_layers, GENES_PER_LAYER)
        widths = choice_value(Gene("w", self.ffn_widths), genes[:, 1])
        heads = choice_value(Gene("h", self.head_choices), genes[:, 2])

        def block(x, layer_state, op, width, n_heads):
            return nnx.merge(graphdef, layer_state)(x, True, op, width, n_heads)

        if cfg.remat != "none":
            block = jax.checkpoint(block, policy=BLOCK_REMAT[cfg.remat], prevent_cse=False)
        h = self.embed(inputs)
        depth = len(shape)
        # One size: scan the first `depth` blocks, sliced together. (The scan also keeps the
        # bits independent of the mesh: the same blocks unrolled in Python, inside SPara's
        # loop over a device's shards, rounded differently on 1 and 2 data devices.)
        if len(set(shape)) == 1:
            stacked = _slice_block(jax.tree.map(lambda x: x[:depth], layers), *shape[0], lead=1)

            def body(x, xs):
                return block(x, *xs), None

            xs = (stacked, genes[:depth, 0], widths[:depth], heads[:depth])
            h, _ = jax.lax.scan(body, h, xs, unroll=depth if unroll else 1)
        else:
            for layer, (width, n_heads) in enumerate(shape):
                one = jax.tree.map(lambda x, i=layer: x[i], layers)
                layer_state = _slice_block(one, width, n_heads, lead=0)
                h = block(h, layer_state, genes[layer, 0], widths[layer], heads[layer])
        logits = self.head(h).astype(jnp.float32)
        hot = jax.nn.one_hot(targets, logits.shape[-1], dtype=jnp.float32)
        return -jnp.mean(jnp.sum(hot * jax.nn.log_softmax(logits), axis=-1))


def _slice_block(state, width: int, n_heads: int, lead: int):
    """A block's state (``lead`` leading layer axes) cut to ``width`` FFN units and
    ``n_heads`` heads: a fresh state, the input is not changed."""
    nnx.replace_by_pure_dict(state, slice_pure_block(nnx.to_pure_dict(state), width, n_heads, lead))
    return state


def slice_pure_block(pure: dict, width: int, n_heads: int, lead: int) -> dict:
    """A block's parameters as a pure dict (``lead`` leading layer axes) cut to ``width``
    FFN units and ``n_heads`` heads: a new dict, the input is not changed."""
    attn, ffn, ax = dict(pure["attn"]), dict(pure["ffn"]), (slice(None),) * lead
    attn["qkv"] = attn["qkv"][(*ax, slice(None), slice(None), slice(0, n_heads))]
    attn["qkv_bias"] = attn["qkv_bias"][(*ax, slice(None), slice(0, n_heads))]
    attn["out"] = attn["out"][(*ax, slice(0, n_heads))]
    ffn["w_in"], ffn["b_in"] = ffn["w_in"][..., :width], ffn["b_in"][..., :width]
    ffn["w_out"] = ffn["w_out"][(*ax, slice(None), slice(0, width))]
    return {**pure, "attn": attn, "ffn": ffn}


def ladder(choices, levels: int) -> tuple[int, ...]:
    """At most ``levels`` of the sorted ``choices``, always the largest: the ``i``-th of
    ``levels`` is the choice at ``ceil(i·n/levels) - 1`` (evenly spread; all of them when
    ``n <= levels``)."""
    choices = tuple(sorted(set(choices)))
    n = len(choices)
    if levels < 1:
        raise ConfigError(f"supernet.ladder_levels={levels}: the sliced path needs >= 1 level")
    if n <= levels:
        return choices
    return tuple(choices[-(-i * n // levels) - 1] for i in range(1, levels + 1))


def round_up(value: int, sizes) -> int:
    """The smallest of ``sizes`` that is >= ``value``."""
    return min(s for s in sizes if s >= value)


def _check_range(what: str, values, lo: int, hi: int, limit: str) -> None:
    bad = [v for v in values if not lo <= v <= hi]
    if bad:
        raise ConfigError(f"supernet {what} {list(values)}: {bad} outside {lo}..{hi} ({limit}={hi})")
