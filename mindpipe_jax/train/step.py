"""Pure step functions: ``(state, batch) -> (state, metrics)`` and the eval loss.

Built once per run and jitted once by the loop with explicit shardings and a
donated state. Two ways to compute the gradient:

* default — the batch is split over ``data`` × ``fsdp`` and XLA reduces the
  gradient (fast; bits depend on the device count, ~1e-7 relative);
* deterministic — the global batch is cut into a fixed number of virtual shards,
  each shard's gradient computed with ``lax.map`` (whose per-shard program does
  not depend on how many shards a device holds), and the shard gradients summed
  in one fixed pairwise tree. Every shard's gradient is all-gathered unreduced
  and every device sums the whole ``[virtual_shards, ...]`` stack, so from the
  gather on the program is the same on 1, 2, 4 or 8 devices: not only the
  association but also what XLA fuses into the optimizer update (the CPU
  backend contracts mul+add into FMAs per fused expression), and the clipping
  norm is taken over replicated gradients, never fsdp shards. The parameters
  are bitwise identical too. The cost: each device holds ``virtual_shards``
  gradient copies at the gather. Through a pipeline each virtual shard is one
  microbatch of one batch device (``unit_microbatches``) and the runtime sums
  them in the same tree (``pipeline_grads(deterministic=True)``).
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from mindpipe_jax.config import Config
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.parallel.mesh import manual_axis_names
from mindpipe_jax.parallel.ordered_sum import pairwise_sum
from mindpipe_jax.parallel.pipeline.contract import model_loss as contract_loss
from mindpipe_jax.parallel.pipeline.dropout_keys import dropout_rows
from mindpipe_jax.train.noise_stats import abs_sq, adam_preconditioner, noise_statistics  # noqa: F401 (re-exported)
from mindpipe_jax.train.state import ModelSpec, lr_schedule
from mindpipe_jax.train.step_checks import (  # noqa: F401 (re-exported: the step's config checks)
    BATCH_AXES,
    check_deterministic_pipeline,
    check_loss_key_through_pipeline,
    check_pipeline_depth,
    check_step_config,
)

# The batch splits over these (the rules table's "batch"): expert devices run the
# dense layers data-parallel; expert=1 for every model but an MoE one.


def model_loss(spec: ModelSpec, params, batch, key):
    """Mean loss of the model on a batch: ``model.loss`` if it has one, else token CE."""
    model = spec.merge(params)
    if spec.has_loss and spec.loss_takes_key:
        return model.loss(batch["inputs"], batch["targets"], dropout_key=key)
    if not spec.has_loss and not callable(model):  # only the pipeline contract: its parts in order
        return pipeline_model(spec, batch["inputs"].shape[-1]).sequential_loss(
            params, batch["inputs"], batch["targets"])
    return contract_loss(model, batch["inputs"], batch["targets"])


def _to_compute(spec: ModelSpec, params):
    # Storage → compute layout: all-gathers FSDP shards once per step, not per use.
    return jax.tree.map(jax.lax.with_sharding_constraint, params, spec.compute)


def resolved_grad_sync(par, platform: str) -> str:
    """``parallel.grad_sync`` as the pipeline runs it on ``platform``: "auto" is chunk-wise
    for AFAPAB, except where this JAX's XLA crashes compiling the chunk ring
    (``runtime.grads.chunk_ring_compiles_on``), there Megatron's overlapped sync."""
    from mindpipe_jax.parallel.pipeline.runtime.grads import chunk_ring_compiles_on

    sync = par.grad_sync_mode
    if par.grad_sync == "auto" and sync == "chunk" and not chunk_ring_compiles_on(platform):
        warnings.warn(f"parallel.grad_sync='auto' runs 'overlap' instead of 'chunk' on {platform} with jax "
                      f"{jax.__version__}, whose XLA crashes compiling the chunk ring", stacklevel=2)
        return "overlap"
    return sync


def _split_microbatches(batch, m: int):
    # Row k·m + j goes to microbatch j, so each device keeps its own rows.
    return jax.tree.map(lambda x: jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1), batch)


def unit_microbatches(batch, m: int, devices: int):
    """The global batch as ``devices · m`` contiguous units, device ``d``'s microbatch
    ``j`` its unit ``d · m + j`` (``pipeline_grads(deterministic=True)``): the same rows
    form a unit on any device count, and each device's units are its own rows."""
    def one(x):
        units = x.reshape(devices, m, x.shape[0] // (devices * m), *x.shape[1:])
        return jnp.swapaxes(units, 0, 1).reshape(m, x.shape[0] // m, *x.shape[1:])
    return jax.tree.map(one, batch)


def _accumulated_grad(spec: ModelSpec, params, batch, key, accum: int, stats: bool = False):
    """Loss and gradient averaged over ``accum`` sequential microbatches (fp32 sum).

    With ``stats`` (and ``accum >= 2``) also the elementwise mean over microbatches
    of each microbatch gradient squared (fp32, a tree like the gradient): the
    small-batch half of the gradient noise scale (tuner/noise.py). Kept per element
    rather than summed so the step can weight it by the optimizer's preconditioner
    after the update (``noise_statistics``); it costs one gradient-sized buffer and
    one more pass over each microbatch's gradient, so it is computed only when asked.
    """
    grad_fn = jax.value_and_grad(lambda p, b, k: model_loss(spec, p, b, k))
    if accum == 1:
        return (*grad_fn(params, batch, key), None)

    micro = _split_microbatches(batch, accum)
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)

    def body(carry, xs):
        loss_sum, grad_sum, sq_sum = carry
        mb, j = xs
        loss, grads = grad_fn(params, mb, jax.random.fold_in(key, j))
        grad_sum = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grad_sum, grads)
        if stats:
            sq_sum = jax.tree.map(lambda a, g: a + abs_sq(g.astype(jnp.float32)), sq_sum, grads)
        return (loss_sum + loss, grad_sum, sq_sum), None

    init = (jnp.zeros((), jnp.float32), zeros, zeros if stats else None)
    (loss, grads, sq), _ = lax.scan(body, init, (micro, jnp.arange(accum)))
    grads = jax.tree.map(lambda g, p: (g / accum).astype(p.dtype), grads, params)
    return loss / accum, grads, (jax.tree.map(lambda x: x / accum, sq) if stats else None)


def _deterministic_grad(spec: ModelSpec, params, batch, key, mesh, shards: int, stats: bool = False):
    """Loss, gradient and (with ``stats``) the virtual shards' own gradients stacked
    ``[shards, ...]`` and left sharded over the batch devices (each device keeps the
    ones it computed): the noise statistics reduce them where they lie
    (``noise_statistics(..., stacked=True)``), so their last bits depend on the device
    count; the update's never do (it uses only the gathered sum)."""
    grad_fn = jax.value_and_grad(lambda p, b, k: model_loss(spec, p, b, k))
    n_dev = math.prod(mesh.shape[a] for a in BATCH_AXES)

    def per_device(p, local, base_key):
        # Per-device gradients, not the psum shard_map would add for invariant params.
        p = jax.tree.map(lambda x: lax.pcast(x, BATCH_AXES, to="varying"), p)
        first = lax.axis_index(BATCH_AXES) * (shards // n_dev)
        idx = first + jnp.arange(shards // n_dev)
        losses, grads = lax.map(
            lambda xs: grad_fn(p, xs[0], jax.random.fold_in(base_key, xs[1])), (local, idx))
        # Gather unreduced, then sum the same [shards, ...] tree on every device count.
        # (A per-device partial sum first left a different expression to fuse into the
        # optimizer update on 1 device than on several, and FMA contraction then
        # rounded the Adam moments differently.)
        gathered = jax.tree.map(
            lambda x: lax.all_gather(x, BATCH_AXES, tiled=True, to="invarying"), (losses, grads))
        loss, total = pairwise_sum(gathered)
        out = (loss / shards, jax.tree.map(lambda g: g / shards, total))
        # The per-device shard gradients, not the gathered stack: squaring the stack here
        # cost every device a pass over all shards' gradients (2-4x the step's time on the
        # online benchmark), where each device now squares only its own.
        return (*out, grads) if stats else out

    vbatch = jax.tree.map(lambda x: x.reshape(shards, x.shape[0] // shards, *x.shape[1:]), batch)
    fn = jax.shard_map(per_device, mesh=mesh, axis_names=manual_axis_names(mesh, BATCH_AXES),
                       in_specs=(P(), P(BATCH_AXES), P()),
                       out_specs=(P(), P(), P(BATCH_AXES)) if stats else (P(), P()))
    return fn(params, vbatch, key)


def pipeline_model(spec: ModelSpec, seq_len: int):
    """The model as the vPipe runtime runs it (``contract.PipelineModel``)."""
    from mindpipe_jax.parallel.pipeline.contract import PipelineModel

    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), spec.abstract_params)
    tokens = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
    return PipelineModel(spec.merge(shapes), shapes, spec.merge, tokens)


def _pipeline_grad_fn(spec: ModelSpec, cfg: Config, mesh, groups: int = 1):
    """Loss and gradients through the vPipe runtime on the ``pipe`` axis. ``groups`` > 1:
    the microbatches in that many consecutive groups, each group's loss and gradient
    kept apart (a leading ``[groups]`` axis: the noise statistics' halves)."""
    from mindpipe_jax.parallel.pipeline import get_schedule
    from mindpipe_jax.parallel.pipeline.runtime import experts, pipeline_grads
    from mindpipe_jax.parallel.pipeline.runtime.layout import StageLayout

    with jax.set_mesh(None):  # traced for its structure: no ambient mesh binds the model's constraints
        model = pipeline_model(spec, cfg.model.seq_len)
    par = cfg.parallel
    schedule = get_schedule(par.schedule, mesh.shape["pipe"], par.microbatches, par.virtual_stages,
                            par.split_last)
    builtin = model.name in ("GPT", "MoEGPT") and model.num_units == cfg.model.n_layers
    if spec.has_loss and spec.loss_takes_key and not builtin:
        check_loss_key_through_pipeline(spec, cfg.model.seq_len, mesh.shape["pipe"])
    check_pipeline_depth(model.num_units, cfg, schedule.num_global_stages, None if builtin else model.name,
                         model.group)
    layout = StageLayout(tuple(par.stage_layers), schedule.num_stages, schedule.virtual_stages) \
        if par.stage_layers else None
    sync = resolved_grad_sync(par, mesh.devices.flat[0].platform)
    # Weights stored sharded over fsdp (the embedding and head over pipe too:
    # train/pipeline_storage.py) stay so inside the pipeline, gathered once per step
    # (or per chunk use: parallel.fsdp_gather), gradients reduce-scattered; an nnx.List
    # of layers (or of period-k groups) is stacked in the step, so its blocks enter gathered.
    e_specs, h_specs = model.ends(spec.storage)
    specs = {"embed": e_specs, "blocks": None if model.stacks_in_step else model.split(spec.storage)[1],
             "head": h_specs}
    if not builtin and specs["blocks"] is not None and mesh.shape["expert"] > 1 and \
            any(experts.expert_dim(s) >= 0 for s in jax.tree.leaves(specs["blocks"])):
        # Inside a stage such weights arrive as the device's own experts: only layers that
        # send tokens to them (the built-in MoE block's all_to_all) compute the right thing.
        raise ConfigError(f"model {model.name}: its layers hold weights split over 'expert', which a "
                          f"pipeline stage hands each device as its own experts; only the built-in MoE "
                          f"GPT routes tokens to them there: set parallel.expert=1 or parallel.pipe=1")
    run = pipeline_grads(model.fns, schedule, mesh, remat=par.stage_remat, layout=layout, grad_sync=sync,
                         sync_bucket_bytes=int(par.sync_bucket_mb * 2**20) or None,
                         grad_sync_dtype=par.grad_sync_dtype, param_specs=specs,
                         fuse_mode=par.fuse_ticks, fsdp_gather=par.fsdp_gather,
                         split_backward=not (cfg.model.collective_matmul and mesh.shape["tensor"] > 1),
                         gradient_groups=groups, deterministic=cfg.train.deterministic)

    n_batch = math.prod(mesh.shape[a] for a in BATCH_AXES)  # the pipeline's batch devices
    # The reference GPT's dropout: each unit (one microbatch of one batch device) draws the
    # masks model.loss draws with the key fold_in(key, unit), as the deterministic path does.
    dropout = cfg.model.dropout > 0 and builtin

    def grad_fn(params, batch, key=None):
        if cfg.train.deterministic:  # the same units on any number of batch devices
            micro = unit_microbatches(batch, par.microbatches, n_batch)
        else:
            micro = _split_microbatches(batch, par.microbatches)
        embed_p, stack, head_p = model.split(params)
        rows = dropout_rows(key, model.num_units, par.microbatches, n_batch) if dropout else None
        loss, grads = run(embed_p, stack, head_p, micro["inputs"], micro["targets"], rows)
        if groups > 1:
            return loss, jax.vmap(lambda e, b, h: model.merge_grads(params, e, b, h))(
                grads["embed"], grads["blocks"], grads["head"])
        return loss, model.merge_grads(params, grads["embed"], grads["blocks"], grads["head"])

    return grad_fn


def _norm_and_first_nonfinite(grads):
    """Global gradient norm, and the index (``jax.tree.leaves`` order) of the first
    gradient leaf whose sum of squares is not finite, or -1.

    One sum of squares per leaf serves both, as in ``optax.global_norm``: a leaf
    holding a NaN/Inf, or large enough to overflow the norm, is what makes the
    norm non-finite, so this costs no extra pass over the gradients.
    """
    sums = [jnp.sum(abs_sq(g)) for g in jax.tree.leaves(grads)]
    bad = ~jnp.isfinite(jnp.stack(sums))
    first = jnp.where(bad.any(), jnp.argmax(bad), -1).astype(jnp.int32)
    return jnp.sqrt(sum(sums)), first  # summed in leaf order, as optax.global_norm does


def nonfinite_leaf_names(abstract_params) -> list[str]:
    """Dotted names of the parameter leaves, in the order ``nonfinite_leaf`` counts them."""
    flat = jax.tree_util.tree_flatten_with_path(abstract_params)[0]
    return [".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path) for path, _ in flat]


def noise_microbatches(cfg: Config, mesh) -> int:
    """How many separately computed gradients of one step the noise statistics can
    compare with the step's own (0 = none): the accumulated microbatches, or the
    virtual shards in deterministic mode. A pipeline accumulates its microbatches
    inside the runtime (per stage, interleaved with other microbatches' work); there
    the runtime keeps the two halves of the step's microbatches apart (its gradient
    groups) when it can: an even microbatch count, the gradient synced after the last
    tick in fp32, even stages, fsdp weights gathered once per step. Otherwise 0."""
    par = cfg.parallel
    if mesh.shape["pipe"] > 1:
        halves = (par.microbatches % 2 == 0 and par.grad_sync_mode == "end" and par.grad_sync_dtype == "fp32"
                  and not par.stage_layers and (par.fsdp_gather == "step" or mesh.shape["fsdp"] == 1))
        return 2 if halves else 0
    if cfg.train.deterministic:
        return cfg.train.virtual_shards
    accum = cfg.train.grad_accum * cfg.parallel.microbatches
    if accum >= 2:
        return accum
    # One microbatch: the statistics' step accumulates two halves instead (the same
    # gradient up to rounding, the same FLOPs), so any model with a loss gets an
    # estimate. Each half must still split evenly over the batch devices.
    n_batch = math.prod(mesh.shape[a] for a in BATCH_AXES)
    return 2 if cfg.train.global_batch % (2 * n_batch) == 0 else 0


def make_grad_fn(spec: ModelSpec, cfg: Config, mesh, stats: bool = False):
    """``(params in storage layout, batch, key) -> (loss, grads, micro or None)``
    (``micro``, with ``stats``: the elementwise mean over microbatches of the gradient
    squared, or in deterministic mode the virtual shards' gradients stacked and
    sharded over the batch devices, or in a pipeline its two halves' gradients stacked;
    ``noise_statistics`` takes either):
    the gradient exactly as the train step computes it (pipeline, deterministic
    shards or plain/accumulated), before clipping and the optimizer."""
    tr = cfg.train
    pipelined = mesh.shape["pipe"] > 1
    halves = pipelined and stats  # the statistics' two half-step gradients (noise_microbatches)
    pipeline_grad = _pipeline_grad_fn(spec, cfg, mesh, groups=2 if halves else 1) if pipelined else None
    # Without a pipeline, parallel.microbatches is plain gradient accumulation; the noise
    # statistics need at least two (noise_microbatches).
    accum = tr.grad_accum * (1 if pipelined else cfg.parallel.microbatches)
    if stats and not pipelined:
        accum = max(accum, 2)

    def grad_fn(params, batch, key):
        params = _to_compute(spec, params)
        if pipelined:
            loss, grads = pipeline_grad(params, batch, key)
            if not halves:
                return loss, grads, None
            # The step's loss and gradient: the mean of its halves (equal microbatch counts).
            return loss.mean(), jax.tree.map(lambda g: g.mean(0), grads), grads
        if tr.deterministic:
            loss, grads, *rest = _deterministic_grad(spec, params, batch, key, mesh,
                                                     tr.virtual_shards, stats)
            return loss, grads, (rest[0] if stats else None)
        return _accumulated_grad(spec, params, batch, key, accum, stats)

    return grad_fn


def make_train_step(spec: ModelSpec, tx, cfg: Config, mesh, total_steps: int,
                    noise_stats: bool | None = None):
    """The train step. With ``noise_stats`` (default: ``tuner.enabled``) and at least
    two microbatches (``noise_microbatches``), its metrics also hold ``micro_grad_sq``
    (mean over microbatches of |g_microbatch|^2, fp32), ``micro_batch`` (rows per
    microbatch, b) and ``batch`` (rows per step, B), and for an Adam-family optimizer
    the preconditioned norms (``noise_statistics``): what the gradient noise scale
    needs (tuner/noise.py). Without them the step is exactly the default one.
    With a pipeline (pipe > 1) the statistics compare the step's two halves, where the
    runtime can keep them apart (``noise_microbatches``); elsewhere there are none and
    the tuner makes no noise estimate."""
    schedule = lr_schedule(cfg.optim, total_steps)
    tr = cfg.train
    skip_nonfinite = tr.nonfinite == "skip"
    n_micro = noise_microbatches(cfg, mesh)
    stats = bool(cfg.tuner.enabled if noise_stats is None else noise_stats) and n_micro >= 2

    grad_fn = make_grad_fn(spec, cfg, mesh, stats)
    # The statistics sum all leaves at once where gradients and moments are whole on
    # every device (noise_statistics' ``fused``), leaf by leaf where they are sharded.
    fused = all(s.is_fully_replicated for s in jax.tree.leaves((spec.storage, spec.compute)))

    def train_step(state, batch):
        key = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"])
        loss, grads, micro_sq = grad_fn(state["params"], batch, key)
        # Back to storage layout: a reduce-scatter for FSDP instead of a full all-reduce.
        # Deterministic grads are already replicated: keep them so, so the clipping norm
        # is one unsharded reduction rather than fsdp partial sums + an all-reduce.
        layout = spec.compute if tr.deterministic else spec.storage
        grads = jax.tree.map(jax.lax.with_sharding_constraint, grads, layout)
        grad_norm, first_bad = _norm_and_first_nonfinite(grads)
        updates, opt = tx.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        if skip_nonfinite:
            # Inside the compiled step: a bad step selects the old params and optimizer
            # state (the step counter still advances, so the data and LR schedule move on).
            ok = jnp.isfinite(loss) & (first_bad < 0)
            keep = lambda new, old: jnp.where(ok, new, old)  # noqa: E731
            params = jax.tree.map(keep, params, state["params"])
            opt = jax.tree.map(keep, opt, state["opt"])
        new_state = {"step": state["step"] + 1, "params": params, "opt": opt, "rng": state["rng"]}
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(state["step"]),
                   "nonfinite_leaf": first_bad}
        if stats:
            rows = jax.tree.leaves(batch)[0].shape[0]
            stacked = tr.deterministic or mesh.shape["pipe"] > 1  # micro: gradients stacked
            if not stacked:  # (a stack stays where it was computed)
                micro_sq = jax.tree.map(jax.lax.with_sharding_constraint, micro_sq, layout)
            metrics.update(_noise_statistics_every(
                lambda: noise_statistics(micro_sq, grads, opt, cfg.optim, stacked=stacked, fused=fused),
                state["step"], cfg.tuner.noise_every), micro_batch=jnp.int32(rows // n_micro),
                batch=jnp.int32(rows))
        return new_state, metrics

    return train_step


def _noise_statistics_every(compute, step, every: int) -> dict:
    """``compute()`` on steps ``0, every, 2 every, ...``, NaN on the others (the tuner's
    estimate skips non-finite statistics). The predicate is the replicated step counter,
    so every device takes the same branch (the statistics' sums may all-reduce)."""
    if every == 1:
        return compute()
    shapes = jax.eval_shape(compute)
    return lax.cond(step % every == 0, compute,
                    lambda: jax.tree.map(lambda s: jnp.full(s.shape, jnp.nan, s.dtype), shapes))


def make_eval_step(spec: ModelSpec):
    def eval_step(params, batch):
        return model_loss(spec, _to_compute(spec, params), batch, None)

    return eval_step
