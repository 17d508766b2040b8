"""A Mixture-of-Experts GPT: the reference GPT with each block's MLP replaced by
``n_experts`` expert MLPs and a top-k router (Switch / GShard style).

Same parameter groups as ``GPT`` (``embed``, ``blocks``, ``head``) and the same
``loss(inputs, targets, dropout_key=None)``, so the train step, the optimizer and
checkpoints treat it like the GPT.

Routing, per *dispatch group* (by default one group per batch shard, so a device
routes only its own tokens and the result does not depend on how the other
devices' tokens were routed):

* router logits ``x @ router`` in fp32, softmax over experts, the top_k experts
  per token, their gates renormalized to sum to 1;
* every expert holds ``capacity = ceil(capacity_factor * S * top_k / n_experts)``
  tokens of a group of S tokens. Slots are handed out first to every token's first
  choice (in token order), then to the second choices, ... (GShard's priority:
  a second choice never pushes out someone's first). An assignment past capacity
  is dropped: it adds nothing to the output, the residual carries the token;
* dispatch and combine are one-hot einsums ``[group, token, expert, slot]``:
  dense, so the backward pass has no scatter-add (deterministic on every backend);
* load balancing (Switch Transformer): ``n_experts * sum_i f_i * P_i`` over the
  whole batch (f_i the fraction of tokens whose first choice is i, P_i the mean
  router probability of i), averaged over layers and added to the loss with
  weight ``model.moe_aux_weight``.

Expert parallelism (``parallel.expert > 1``): the batch is split over ``data`` x
``fsdp`` x ``expert`` (the rules table's ``batch``), so attention runs data-parallel
on the expert devices too, and the expert weights ``[experts, embed, mlp]`` are
split over ``expert``. Inside the MoE layer a ``shard_map`` manual over the batch
axes (``tensor`` stays automatic) dispatches each device's tokens into per-expert
buffers, ``all_to_all`` over ``expert`` sends each buffer to the device holding its
expert, the local experts run, and a second ``all_to_all`` brings the outputs back.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

from mindpipe_jax.config import ModelConfig
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.models.gpt import (
    DTYPES,
    Attention,
    Embed,
    Head,
    LayerNorm,
    _dropout,
    _param,
    matmul_params,
    scan_blocks,
)
from mindpipe_jax.parallel.rules import constrain, spec_for

EXPERT_AXIS = "expert"


def capacity(tokens: int, n_experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert for a dispatch group of ``tokens`` tokens. Never more than
    ``tokens``: a token picks an expert at most once, so more slots stay empty."""
    return min(tokens, math.ceil(capacity_factor * tokens * top_k / n_experts))


def route(top_idx, gates, n_experts: int, cap: int):
    """One-hot dispatch and combine tensors ``[group, token, expert, slot]`` and the
    ``[group, token, k]`` mask of assignments that found a slot.

    ``top_idx``/``gates``: ``[group, token, k]`` chosen experts (distinct per token)
    and their gates. Slot numbers are a running count per expert over the
    assignments in priority order: all first choices in token order, then all
    second choices, ...
    """
    g, s, k = top_idx.shape
    chosen = jax.nn.one_hot(top_idx, n_experts, dtype=jnp.int32)  # [g, s, k, e]
    in_priority = chosen.transpose(0, 2, 1, 3).reshape(g, k * s, n_experts)
    position = (jnp.cumsum(in_priority, axis=1) - 1).reshape(g, k, s, n_experts).transpose(0, 2, 1, 3)
    position = (position * chosen).sum(-1)  # [g, s, k]: this assignment's slot in its expert
    kept = position < cap
    # An index equal to cap one-hots to all zeros: a dropped assignment has no slot.
    slot = jax.nn.one_hot(jnp.where(kept, position, cap), cap, dtype=gates.dtype)
    expert = chosen.astype(gates.dtype)
    dispatch = jnp.einsum("gske,gskc->gsec", expert, slot)
    combine = jnp.einsum("gsk,gske,gskc->gsec", gates, expert, slot)
    return dispatch, combine, kept


def load_balancing_loss(probs, first_choice, stats_axes=()):
    """Switch Transformer's ``E * sum_i f_i * P_i`` over all tokens of the batch.

    ``probs``: ``[..., E]`` router probabilities; ``first_choice``: ``[...]`` top-1
    expert ids. Inside a ``shard_map`` the per-device means are averaged over
    ``stats_axes`` (equal shards: the mean of means is the batch mean), so the value
    is the same on any mesh. f is a count (no gradient); the gradient flows to the
    router through P.
    """
    n_experts = probs.shape[-1]
    flat_probs = probs.reshape(-1, n_experts)
    f = jax.nn.one_hot(first_choice.reshape(-1), n_experts, dtype=probs.dtype).mean(0)
    p = flat_probs.mean(0)
    if stats_axes:
        f, p = lax.pmean(f, stats_axes), lax.pmean(p, stats_axes)
    return n_experts * jnp.sum(f * p)


def moe_ffn(router, w_in, w_out, x, *, top_k: int, capacity_factor: float, groups: int, dtype,
            expert_axis: str | None = None, stats_axes=()):
    """The MoE feed-forward on ``x`` ``[batch, length, d]`` → (output like x, aux loss).

    Rows are cut into ``groups`` dispatch groups of equal size. With ``expert_axis``
    (inside a ``shard_map`` manual over it) ``w_in``/``w_out`` hold this device's
    experts only and the expert buffers travel by ``all_to_all``.
    """
    b, t, d = x.shape
    n_experts = router.shape[1]
    # Weights made varying where the tokens are, in their own dtype, before any cast to
    # ``dtype``: the gradient's sum over those devices (this cast's transpose) is then
    # in float32. Left invariant, JAX sums after the cast, in bfloat16: less precise, and
    # inside a shard_map with automatic axes left XLA's CPU compiler aborts on it.
    router, w_in, w_out = (_vary_like(w, x) for w in (router, w_in, w_out))
    if b % groups:
        raise ConfigError(f"MoE: {b} batch rows cannot form {groups} equal dispatch groups")
    xg = x.reshape(groups, b * t // groups, d)
    logits = jnp.einsum("gsd,de->gse", xg.astype(jnp.float32), router.astype(jnp.float32))
    probs = jax.nn.softmax(logits, axis=-1)
    _, top_idx = lax.top_k(probs, top_k)
    # Gates read through a one-hot product rather than top_k's gather: its backward
    # is a dense multiply, no scatter.
    top_p = jnp.einsum("gse,gske->gsk", probs, jax.nn.one_hot(top_idx, n_experts, dtype=probs.dtype))
    gates = top_p / top_p.sum(-1, keepdims=True)
    cap = capacity(xg.shape[1], n_experts, top_k, capacity_factor)
    dispatch, combine, _ = route(top_idx, gates, n_experts, cap)

    buffers = jnp.einsum("gsec,gsd->egcd", dispatch.astype(dtype), xg.astype(dtype))
    if expert_axis:  # [E, g, C, d] → [E/ep, ep*g, C, d]: my experts' slots from every peer
        buffers = lax.all_to_all(buffers, expert_axis, 0, 1, tiled=True)
    h = jax.nn.gelu(jnp.einsum("egcd,edf->egcf", buffers, w_in.astype(dtype)))
    out = jnp.einsum("egcf,efd->egcd", h, w_out.astype(dtype))
    if expert_axis:  # and back: [E/ep, ep*g, C, d] → [E, g, C, d]
        out = lax.all_to_all(out, expert_axis, 1, 0, tiled=True)
    y = jnp.einsum("gsec,egcd->gsd", combine.astype(dtype), out)
    aux = load_balancing_loss(probs, top_idx[..., 0], stats_axes)
    return y.reshape(b, t, d).astype(x.dtype), aux


def _vary_like(w, x):
    """``w`` cast to vary over every manual axis ``x`` varies over (no data moves)."""
    missing = tuple(sorted(set(jax.typeof(x).manual_axis_type.varying)
                           - set(jax.typeof(w).manual_axis_type.varying)))
    return lax.pcast(w, missing, to="varying") if missing else w


def _batch_axes(mesh) -> tuple[str, ...]:
    """The mesh axes the rules table splits the batch over; none without a mesh or
    inside a manual region (the deterministic step's shard_map), where the rows
    this code sees are already local."""
    if mesh.empty or getattr(mesh, "manual_axes", ()):
        return ()
    entry = spec_for(("batch",), "compute", mesh)[0]
    return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


class MoEFFN(nnx.Module):
    """Router + ``n_experts`` stacked expert MLPs (gelu, no biases).

    No biases, as in Switch/T5: a per-expert bias would be a ``[experts, mlp]``
    array, which the weight-decay rule (rank >= 2 after the layer axis) would decay
    like a matrix.
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dispatch_groups: int | None = None):
        pd = DTYPES[cfg.param_dtype]
        d, f, e = cfg.d_model, cfg.ff_dim, cfg.n_experts
        # Every device routes its own tokens over all experts: the router is whole
        # on each device (its expert dimension has no logical name to shard by).
        self.router = _param(rngs, (d, e), ("embed", None), 0.02, pd)
        self.w_in = _param(rngs, (e, d, f), ("experts", "embed", "mlp"), 0.02, pd)
        self.w_out = _param(rngs, (e, f, d), ("experts", "mlp", "embed"),
                            0.02 / math.sqrt(2 * cfg.n_layers), pd)
        self.top_k = cfg.top_k
        self.capacity_factor = cfg.capacity_factor
        self.dispatch_groups = dispatch_groups
        self.dtype = DTYPES[cfg.dtype]

    def __call__(self, x):
        weights = (self.router[...], self.w_in[...], self.w_out[...])
        kw = dict(top_k=self.top_k, capacity_factor=self.capacity_factor, dtype=self.dtype)
        mesh = jax.sharding.get_abstract_mesh()
        axes = _batch_axes(mesh)
        if not axes:
            # Inside a region manual over ``expert`` (the pipeline's): this device holds
            # its experts only, and its rows go to theirs by all_to_all.
            manual_ep = EXPERT_AXIS in getattr(mesh, "manual_axes", ()) and mesh.shape[EXPERT_AXIS] > 1
            return moe_ffn(*weights, x, groups=self.dispatch_groups or 1,
                           expert_axis=EXPERT_AXIS if manual_ep else None, **kw)
        shards = math.prod(mesh.shape[a] for a in axes)
        groups = self.dispatch_groups or shards
        if groups % shards:
            raise ConfigError(f"MoE: dispatch_groups={groups} must be a multiple of the "
                              f"{shards} batch shards ({' x '.join(axes)})")
        ep = mesh.shape.get(EXPERT_AXIS, 1)
        if ep > 1 and EXPERT_AXIS not in axes:
            raise ConfigError("MoE: the rules table must split the batch over 'expert' for "
                              "expert parallelism")
        expert_spec = P(EXPERT_AXIS) if EXPERT_AXIS in axes else P()

        def local(router, w_in, w_out, xs):
            return moe_ffn(router, w_in, w_out, xs, groups=groups // shards,
                           expert_axis=EXPERT_AXIS if ep > 1 else None, stats_axes=axes, **kw)

        # Manual over the batch axes only: tensor (the experts' mlp dimension) stays
        # with the compiler, as in the dense blocks.
        run = jax.shard_map(local, in_specs=(P(), expert_spec, expert_spec, P(axes)),
                            out_specs=(P(axes), P()), axis_names=set(axes))
        return run(*weights, x)


class MoEBlock(nnx.Module):
    """Pre-norm residual block: x + attn(ln(x)), then x + moe(ln(x)); returns (x, aux)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dispatch_groups: int | None = None):
        pd = DTYPES[cfg.param_dtype]
        self.ln1 = LayerNorm(cfg.d_model, pd)
        self.attn = Attention(cfg, rngs)
        self.ln2 = LayerNorm(cfg.d_model, pd)
        self.moe = MoEFFN(cfg, rngs, dispatch_groups)
        self.dropout = cfg.dropout

    def __call__(self, x, key=None):
        k1, k2 = jax.random.split(key) if key is not None else (None, None)
        x = x + _dropout(self.attn(self.ln1(x)), self.dropout, k1)
        x = constrain(x, ("batch", "length", "embed"))
        y, aux = self.moe(self.ln2(x))
        x = x + _dropout(y, self.dropout, k2)
        return constrain(x, ("batch", "length", "embed")), aux


class MoEGPT(nnx.Module):
    """embed → scan over stacked MoE blocks → head; loss = CE + moe_aux_weight * aux.

    ``dispatch_groups`` (None = one per batch shard of the mesh the model runs on,
    1 without a mesh) fixes how many groups the batch's rows are routed in: a
    single-device run with the same number of groups computes the same function
    as a sharded one (capacity is counted per group).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dispatch_groups: int | None = None):
        if cfg.n_experts < 1:
            raise ConfigError(f"MoEGPT needs model.n_experts >= 1, got {cfg.n_experts}")
        self.config = cfg
        self.embed = Embed(cfg, rngs)

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(rngs):
            return MoEBlock(cfg, rngs, dispatch_groups)

        self.blocks = make_blocks(rngs)
        self.head = Head(cfg, rngs)

    def pipeline_parts(self):
        """The pipeline contract (``parallel/pipeline/contract.py``): each block returns
        (hidden, its load-balancing loss), which the loss weighs by ``moe_aux_weight``.
        In a pipeline the routing statistics are those of each microbatch's rows on
        each batch device (one microbatch at a time, as the stages see them)."""
        from mindpipe_jax.parallel.pipeline.contract import PipelineParts

        return PipelineParts("blocks", lambda m, tokens: m.embed(tokens), lambda m, h, t: m.head.loss(h, t),
                             aux_weight=self.config.moe_aux_weight)

    def run_blocks(self, h, key=None):
        """(hidden states after the blocks, load-balancing loss averaged over layers)."""
        h, aux = scan_blocks(self.blocks, h, key, self.config)
        return h, aux.mean()

    def __call__(self, tokens, dropout_key=None):
        k_embed, k_blocks = jax.random.split(dropout_key) if dropout_key is not None else (None, None)
        return self.head(self.run_blocks(self.embed(tokens, k_embed), k_blocks)[0])

    def loss(self, inputs, targets, dropout_key=None):
        k_embed, k_blocks = jax.random.split(dropout_key) if dropout_key is not None else (None, None)
        h, aux = self.run_blocks(self.embed(inputs, k_embed), k_blocks)
        return self.head.loss(h, targets) + self.config.moe_aux_weight * aux


def active_matmul_params(cfg: ModelConfig) -> int:
    """Matmul parameters one token goes through: attention, the router, top_k expert
    MLPs and the LM head (what the dense GPT counts, with top_k MLPs per block)."""
    d, f, layers = cfg.d_model, cfg.ff_dim, cfg.n_layers
    dense_mlps = layers * 2 * d * f
    return matmul_params(cfg) - dense_mlps + layers * (cfg.top_k * 2 * d * f + d * cfg.n_experts)


def flops_per_token(cfg: ModelConfig) -> float:
    """Training FLOPs per token from the active parameters (6·N + attention, as for
    the GPT). The one-hot dispatch/combine einsums and capacity padding are not
    counted: they are routing overhead, not model FLOPs (MFU's convention)."""
    return 6.0 * active_matmul_params(cfg) + 12.0 * cfg.n_layers * cfg.seq_len * cfg.d_model
