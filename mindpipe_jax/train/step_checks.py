"""What the train step needs of a config and a mesh: one-line ``ConfigError``s for
batch divisibility, deterministic mode (also through a pipeline), MoE on the expert
axis and a pipeline's depth, checked before anything is compiled. Separate from
``step.py`` (the step functions themselves), which re-exports them."""

from __future__ import annotations

import inspect
import math

import jax
import jax.numpy as jnp
from flax import nnx

from mindpipe_jax.config import Config, ModelConfig
from mindpipe_jax.config_values import _shown
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.models import GPT, MoEGPT
from mindpipe_jax.parallel.mesh import unused_axes
from mindpipe_jax.parallel.pipeline.runtime.experts import NOT_SPLIT, expert_dim
from mindpipe_jax.train.state import buffers, user_code_error

BATCH_AXES = ("data", "fsdp", "expert")


# model.* keys that change how the reference GPT computes (models/gpt.py), and nothing
# else: a model passed in computes with its own layers. Its sizes (model.d_model,
# model.n_layers, ...) are not refused: a config file shared with GPT runs sets them
# (examples/configs/tiny.toml, the README's Python API), and they only size the GPT.
_GPT_COMPUTE = {
    "dtype": "its layers compute in their own dtypes",
    "param_dtype": "its layers create their own parameters",
    "remat": "its layers decide (nnx.remat); through a pipeline, parallel.stage_remat remats its stages",
    "dropout": "its own dropout layers apply",
    "attention": "its own attention runs",
    "collective_matmul": "its own matmuls run (the GPT's overlap its tensor-parallel projections)",
    "top_k": "its own router picks the experts of a token",
    "capacity_factor": "its own layers decide how many tokens an expert takes",
    "moe_aux_weight": "its own loss adds what it adds",
}


def check_user_model_keys(model_cfg, spec=None) -> None:
    """A model passed in (``mp.train(model)``, ``--model``): refuse the reference GPT's
    compute settings set away from their defaults, which would silently do nothing.
    ``spec``: the model built (``train.state.ModelSpec``); a GPT or MoE GPT, or a
    subclass, is let through: a factory of the caller's may build it from this very
    ``model_cfg``. None: a ``--model`` reference, which cannot see the command's config."""
    if spec is not None and issubclass(spec.graphdef.nodes[0].type, (GPT, MoEGPT)):
        return
    default = ModelConfig()
    for key, why in _GPT_COMPUTE.items():
        value = getattr(model_cfg, key)
        if value != getattr(default, key):
            raise ConfigError(f"model.{key}={_shown(value)} has no effect on a model passed in (--model, "
                              f"mp.train(model), train_supernet(model)): model.* builds the reference GPT, "
                              f"and {why}; drop model.{key}")
    if spec is not None:
        _check_declared_experts(model_cfg.n_experts, spec)


def expert_dims(spec) -> dict[str, int]:
    """Per parameter path of ``spec``, the size of the dimension stored over the
    ``expert`` mesh axis (the rules table's ``experts`` / ``expert`` logical names):
    how many experts that weight holds. Parameters without one are left out."""
    flat = jax.tree_util.tree_flatten_with_path(spec.abstract_params)[0]
    return {jax.tree_util.keystr(path, simple=True, separator="/"): leaf.shape[dim]
            for path, leaf in flat if (dim := expert_dim(leaf.sharding)) != NOT_SPLIT}


def _check_declared_experts(declared: int, spec) -> None:
    """A model passed in declares its experts in ``model.n_experts`` (what lets
    ``parallel.expert`` split them, and EPara try that axis): the count must be the one
    its parameters hold on the ``experts`` logical axis, so a wrong or stray
    declaration is refused instead of sizing nothing."""
    if not declared:
        return
    name = spec.graphdef.nodes[0].type.__name__
    sizes = expert_dims(spec)
    if not sizes:
        raise ConfigError(f"model.n_experts={declared}, but model {name} has no parameter on the 'experts' "
                          f"logical axis (what parallel.expert splits); name that axis of its expert "
                          f"weights 'experts', or drop model.n_experts")
    for path, size in sizes.items():
        if size != declared:
            raise ConfigError(f"model.n_experts={declared}, but parameter {path} of model {name} holds "
                              f"{size} expert{'s' * (size != 1)} on its 'experts' axis; set "
                              f"model.n_experts={size}")


def check_platform(model_cfg, platform: str) -> None:
    """What the model's settings need of the devices' platform ("cpu", "gpu", "tpu")."""
    if model_cfg.attention == "cudnn" and platform != "gpu":
        raise ConfigError(f"model.attention=cudnn runs on NVIDIA GPUs; this mesh's devices are "
                          f"{platform}: use model.attention=xla")
    if model_cfg.dtype == "float16" and platform == "cpu":
        # Refused here, not left to XLA: the attention's backward is a batched float16
        # matmul accumulating in float32, which XLA's CPU backend cannot lower (a traceback
        # from inside the compiler, after the run directory was made).
        raise ConfigError("model.dtype=float16 does not compile on CPU devices (XLA's CPU matmuls take no "
                          "float16 inputs with float32 accumulation); use model.dtype=bfloat16 or float32")


def check_step_config(cfg: Config, mesh) -> None:
    """Batch divisibility for the mesh; deterministic-mode requirements."""
    tr = cfg.train
    n_batch = math.prod(mesh.shape[a] for a in BATCH_AXES)
    stages = mesh.shape["pipe"] * cfg.parallel.virtual_stages
    layers = cfg.parallel.stage_layers
    # The sum of stage_layers and the divisibility of the depth are checked against the
    # model that was built (check_pipeline_depth), not model.n_layers.
    if layers and (len(layers) != stages or min(layers) < 0):
        raise ConfigError(
            f"parallel.stage_layers={list(layers)} must be {stages} counts >= 0 (pipe x virtual_stages)")
    remat = cfg.parallel.stage_remat
    if not isinstance(remat, str) and len(remat) != stages:
        raise ConfigError(f"parallel.stage_remat={list(remat)} must list {stages} policies (pipe x "
                          f"virtual_stages), one per global stage, or be one policy for all")
    if mesh.shape["subnet"] > 1:
        # Refuse rather than silently replicate the work over an axis the step ignores.
        raise ConfigError(
            f"parallel subnet={mesh.shape['subnet']}: the train step does not use this axis (it "
            f"belongs to `mindpipe supernet` / mp.train_supernet); set it to 1")
    _check_moe(cfg, mesh)
    # The tuner's space check passes a shape-only mesh stand-in.
    platform = mesh.devices.flat[0].platform if hasattr(mesh, "devices") else jax.default_backend()
    check_platform(cfg.model, platform)
    if cfg.parallel.repartition_after and mesh.shape["pipe"] == 1:
        raise ConfigError(f"parallel.repartition_after={cfg.parallel.repartition_after} moves layers "
                          f"between pipeline stages; it needs parallel.pipe > 1")
    if mesh.shape["pipe"] > 1:
        if tr.grad_accum != 1:
            raise ConfigError(f"train.grad_accum={tr.grad_accum}: with parallel.pipe>1 the pipeline's "
                              f"parallel.microbatches already accumulate; set train.grad_accum=1")
    micro = tr.grad_accum * cfg.parallel.microbatches
    if tr.global_batch % (n_batch * micro):
        raise ConfigError(
            f"train.global_batch={tr.global_batch} must be divisible by data x fsdp x expert x "
            f"grad_accum x microbatches = {mesh.shape['data']} x {mesh.shape['fsdp']} x "
            f"{mesh.shape['expert']} x {tr.grad_accum} x {cfg.parallel.microbatches} = {n_batch * micro}")
    if tr.deterministic:
        if tr.global_batch % tr.virtual_shards or tr.virtual_shards % n_batch:
            raise ConfigError(
                f"deterministic mode needs train.global_batch={tr.global_batch} divisible by "
                f"train.virtual_shards={tr.virtual_shards}, and virtual_shards divisible by "
                f"data x fsdp x expert = {n_batch}")
        if n_batch & (n_batch - 1):
            raise ConfigError(f"deterministic mode needs data x fsdp x expert = {n_batch} to be a "
                              f"power of two")
        others = {a: mesh.shape[a] for a in ("tensor", "subnet", "expert") if mesh.shape[a] > 1}
        if others:
            raise ConfigError(f"deterministic mode splits only the batch (data, fsdp) and the pipeline's "
                              f"stages; {unused_axes(others)}")
        if mesh.shape["pipe"] > 1:
            check_deterministic_pipeline(cfg.parallel, tr.virtual_shards, n_batch, mesh.shape["fsdp"])
        if tr.grad_accum != 1:
            raise ConfigError(f"deterministic mode already accumulates over train.virtual_shards; "
                              f"set train.grad_accum=1 (got {tr.grad_accum})")
        if mesh.shape["pipe"] == 1 and cfg.parallel.microbatches != 1:
            # Without a pipeline, microbatches are plain accumulation, which the shards replace.
            raise ConfigError(f"deterministic mode already accumulates over train.virtual_shards; without a "
                              f"pipeline set parallel.microbatches=1 (got {cfg.parallel.microbatches})")


def check_deterministic_pipeline(par, virtual_shards: int, n_batch: int, fsdp: int) -> None:
    """Deterministic mode through a pipeline: each virtual shard is one microbatch of one
    batch device (``pipeline_grads(deterministic=True)``); a ConfigError otherwise."""
    if par.microbatches * n_batch != virtual_shards:
        raise ConfigError(f"deterministic mode through a pipeline runs each virtual shard as one microbatch: "
                          f"parallel.microbatches={par.microbatches} x fsdp x data ({n_batch}) must equal "
                          f"train.virtual_shards={virtual_shards}; set parallel.microbatches="
                          f"{max(virtual_shards // n_batch, 1)} (or train.virtual_shards="
                          f"{par.microbatches * n_batch})")
    if par.grad_sync_mode != "end" or par.grad_sync_dtype != "fp32":
        raise ConfigError(f"deterministic mode through a pipeline sums the gradients after the last tick in "
                          f"fp32; got parallel.grad_sync={par.grad_sync!r}, grad_sync_dtype="
                          f"{par.grad_sync_dtype!r}: set grad_sync='end' and grad_sync_dtype='fp32'")
    if par.fsdp_gather != "step" and fsdp > 1:
        raise ConfigError(f"deterministic mode through a pipeline gathers fsdp weights once per step; got "
                          f"parallel.fsdp_gather={par.fsdp_gather!r}: set it to 'step'")


def _check_moe(cfg: Config, mesh) -> None:
    """The expert axis needs an MoE model whose experts it divides; in a pipeline each
    stage's experts split over its expert devices (``runtime/experts.py``)."""
    experts, ep = cfg.model.n_experts, mesh.shape["expert"]
    if ep > 1 and experts == 0:
        raise ConfigError(f"parallel.expert={ep} splits the experts of a Mixture-of-Experts model, but "
                          f"model.n_experts=0 (dense GPT); set model.n_experts to a multiple of {ep} "
                          f"(a model passed in: the count on its 'experts' logical axis) or "
                          f"parallel.expert=1")
    if experts and experts % ep:
        raise ConfigError(f"model.n_experts={experts} must be divisible by parallel.expert={ep}")
    if experts and cfg.model.collective_matmul and mesh.shape["tensor"] > 1:
        raise ConfigError(f"model.collective_matmul=true is not built for MoE blocks "
                          f"(model.n_experts={experts}); set model.collective_matmul=false")


def check_pipeline_depth(units: int, cfg: Config, stages: int, model: str | None = None,
                         group: int = 1) -> None:
    """The depth of the model that was built against the stages. ``model``: the name of a
    user's model (its stack's depth, not ``model.n_layers``, counts); None for the
    built-in one, whose depth is ``model.n_layers``."""
    layers = cfg.parallel.stage_layers
    depth = (f"model.n_layers={units}" if model is None else
             f"the layer stack of model {model} has {units} units"
             + (f" (groups of {group} layers)" if group > 1 else ""))
    if layers and sum(layers) != units:
        raise ConfigError(f"parallel.stage_layers={list(layers)} sums to {sum(layers)}, but {depth}; "
                          f"list {stages} counts summing to {units}")
    if not layers and units % stages:
        v = cfg.parallel.virtual_stages
        split = f"parallel.pipe x parallel.virtual_stages = {stages // v} x {v} = {stages}"
        rule = f" must be divisible by {split}" if model is None else f", not a multiple of {split}"
        raise ConfigError(f"{depth}{rule}; change the depth or list the units per stage in "
                          f"parallel.stage_layers")


def _buffer_leaves(model) -> dict:
    """The ids of each buffer's leaves (``state.is_buffer``), by path: a write replaces them."""
    return {path: [id(x) for x in jax.tree.leaves(var.get_value())]
            for path, var in buffers(nnx.state(model))}


def check_model_outputs(spec, seq_len: int, vocab_size: int, mesh=None) -> None:
    """What the model gives the step, traced abstractly once on a [1, seq_len] batch: a
    scalar from ``loss(inputs, targets)``, or logits [1, seq_len, C] with C >= vocab_size
    from ``__call__`` (token ids go up to vocab_size - 1; fewer classes give a NaN loss at
    the first step). A model with neither must be a pipeline-contract model. A forward that
    writes a buffer (``state.is_buffer``: held constant by the step) is refused.

    Traced without a mesh; a forward that needs one (its own ``jax.shard_map``) is traced
    again under ``mesh``, on one row per batch shard so its specs divide the batch."""
    from mindpipe_jax.parallel.pipeline.contract import pipeline_parts

    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), spec.abstract_params)
    probe = nnx.eval_shape(lambda: spec.merge(abstract))
    name = type(probe).__name__
    if not spec.has_loss and not callable(probe):
        if pipeline_parts(probe) is None:
            raise ConfigError(f"model {name} has neither __call__(tokens) -> logits nor loss(tokens, "
                              f"targets) -> scalar; give it one of them (or a pipeline_parts() method)")
        return
    tokens = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
    # Called as the step calls it: loss(inputs, targets), else model(tokens) -> logits. A
    # signature that needs more (Hugging Face's attention_mask) is refused by name.
    called = f"{name}.loss(inputs, targets)" if spec.has_loss else f"{name}(tokens)"
    try:
        inspect.signature(probe.loss if spec.has_loss else probe).bind(
            *((tokens, tokens) if spec.has_loss else (tokens,)),
            **({"dropout_key": None} if spec.loss_takes_key else {}))
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{called} cannot be called so ({err}); mindpipe_jax calls a model's "
                          f"loss(inputs, targets) when it has one, else model(tokens) for logits: give "
                          f"its other parameters defaults (e.g. attention_mask=None), or give it a "
                          f"loss(inputs, targets) method") from None
    written: list = []

    def out(params, t):
        model = spec.merge(params)
        before = _buffer_leaves(model)
        if spec.has_loss:
            extra = {"dropout_key": jax.random.key(0)} if spec.loss_takes_key else {}
            got = model.loss(t, t, **extra)
        else:
            got = model(t)
        after = _buffer_leaves(model)
        written.extend(path for path in after if after[path] != before.get(path))
        return got

    rows = 1
    try:
        got = jax.eval_shape(out, abstract, tokens)
    except ConfigError:
        raise
    except Exception as err:  # a mistake in the user's forward: one line, its place in their file
        if mesh is None or "context mesh cannot be empty" not in str(err):
            raise user_code_error(err, f"running the model, {called} on a [1, {seq_len}] batch,") from None
        rows = math.prod(mesh.shape[a] for a in BATCH_AXES)
        written.clear()
        try:
            with jax.set_mesh(mesh):
                got = jax.eval_shape(out, abstract, jax.ShapeDtypeStruct((rows, seq_len), jnp.int32))
        except ConfigError:
            raise
        except Exception as err:
            raise user_code_error(err, f"running the model, {called} on a [{rows}, {seq_len}] batch "
                                       f"under the mesh,") from None
    if written:
        kinds = {path: type(var).__name__ for path, var in buffers(spec.rest)}
        names = ", ".join(f"{'/'.join(map(str, p))} ({kinds.get(p, 'Variable')})" for p in written[:6])
        raise ConfigError(f"the model writes its buffers as it runs: {names}; mindpipe_jax holds "
                          f"nnx.Variable buffers constant through training, so every write would be lost: "
                          f"make a trained array nnx.Param, and keep a count or statistic outside the model")
    _check_vocab_axes(probe, name, vocab_size)
    shown = getattr(got, "shape", None)
    if spec.has_loss:
        if not (hasattr(got, "shape") and got.shape == () and jnp.issubdtype(got.dtype, jnp.floating)):
            what = f"an array of shape {tuple(shown)} ({got.dtype})" if shown is not None else \
                f"{type(got).__name__} {jax.tree.structure(got)}"
            raise ConfigError(f"{name}.loss(inputs, targets) returned {what}; the step differentiates a "
                              f"scalar float loss (log other values outside the loss)")
        return
    if shown is None or len(shown) != 3 or tuple(shown[:2]) != (rows, seq_len):
        what = f"shape {tuple(shown)}" if shown is not None else \
            f"{type(got).__name__} {jax.tree.structure(got)}"
        raise ConfigError(f"{name}(tokens) on tokens of shape ({rows}, {seq_len}) returned {what}; without "
                          f"a loss method the model must return logits of shape ({rows}, {seq_len}, classes)")
    if not jnp.issubdtype(got.dtype, jnp.floating):  # its cast has no gradient: nothing would learn
        raise ConfigError(f"{name}(tokens) returns logits of dtype {got.dtype}; they must be floating point "
                          f"(the loss has no gradient through an integer or boolean output)")
    if shown[-1] < vocab_size:
        raise ConfigError(f"{name}(tokens) returns {shown[-1]} classes per position, fewer than "
                          f"model.vocab_size={vocab_size} (the data's token ids go up to {vocab_size - 1}); "
                          f"give its output layer vocab_size classes, or set model.vocab_size to the "
                          f"data's vocabulary")


def _check_vocab_axes(probe, name: str, vocab_size: int) -> None:
    """Refuse a parameter whose axis is named "vocab" (the rules table's name for the
    vocabulary) with fewer rows than the data's token ids need. A model with its own
    ``loss`` shows no logits to count, and an embedding lookup past its table gives NaN
    (``jnp.take`` fills) at the first step, which reads as a learning-rate problem."""
    from mindpipe_jax.parallel.rules import _logical_names

    for path, var in nnx.to_flat_state(nnx.state(probe, nnx.Param)):
        names = _logical_names(var) or ()
        for axis, logical in enumerate(names):
            size = var.get_value().shape[axis]
            if logical == "vocab" and size < vocab_size:
                where = "/".join(map(str, path))
                raise ConfigError(f"{name}'s {where} has {size} rows on its 'vocab' axis, fewer than "
                                  f"model.vocab_size={vocab_size} (the data's token ids go up to "
                                  f"{vocab_size - 1}): build the model with a vocabulary of at least "
                                  f"{vocab_size}, or set model.vocab_size={size} with data of that "
                                  f"vocabulary (data.source=synthetic or a tokens file)")


def check_loss_key_through_pipeline(spec, seq_len: int, pipe: int) -> None:
    """Refuse a model whose ``loss(..., dropout_key=)`` draws from its key (dropout) under a
    pipeline: the runtime runs its layers as units and passes them no key, so it would
    train without its randomness, silently. (The reference GPT's ``model.dropout`` goes
    through the pipeline: ``parallel/pipeline/dropout_keys.py``.) Traced once, abstractly:
    does the loss's value depend on the key?"""
    from mindpipe_jax.parallel.pipeline.autosplit import live_inputs

    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), spec.abstract_params)
    tokens = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
    key_data = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))

    def loss(params, t, data):
        return spec.merge(params).loss(t, t, dropout_key=jax.random.wrap_key_data(data))

    with jax.set_mesh(None):
        closed = jax.make_jaxpr(loss)(abstract, tokens, key_data)
    if closed.jaxpr.invars[-1] in live_inputs(closed.jaxpr):
        name = type(nnx.eval_shape(lambda: spec.merge(abstract))).__name__
        raise ConfigError(f"{name}.loss draws random numbers from its dropout_key (dropout); through a "
                          f"pipeline (parallel.pipe={pipe}) no key reaches the model's layers, so it would "
                          f"train without them: train it without parallel.pipe, or without the "
                          f"randomness (the reference GPT's model.dropout does run through a pipeline)")


def check_step_model(step_model, tuner_on: bool) -> None:
    """``step_model`` is the online tuner's: refused without one (it would be ignored),
    and when it lacks the two methods the tuner calls (found only at its first decision)."""
    if step_model is None:
        return
    if not tuner_on:
        raise ConfigError("step_model= is read only by the online tuner, which this run does not have: "
                          "set tuner.enabled=true, or drop step_model")
    missing = [name for name in ("step_time", "observe") if not callable(getattr(step_model, name, None))]
    if missing:
        raise ConfigError(f"step_model {type(step_model).__name__} has no method {missing[0]}(); it needs "
                          f"step_time(candidate) -> seconds and observe(candidate, seconds) "
                          f"(mindpipe_jax.tuner.measured.StepModel)")
