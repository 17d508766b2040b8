"""Measured costs of a model's layers, the partitioner's input.

``measure_layer_costs(model_cfg, microbatch=..., model=factory)`` builds the model (the
configured GPT, or a user's: the caller passes its factory, so ``parallel/`` never imports
``models/``) and times one block's forward (F), its backward split into B (input
gradient only), W (weight gradient only) and the fused BW, and the same for the
embedding and the head (+ loss); it reads FLOPs from the programs
(``cost_analysis``) and sizes the hidden state, the residuals a forward keeps for
its backward and the parameters. The GPT's blocks are identical, so one block is
measured and its costs are replicated over ``n_layers``. A model whose layers
differ is described directly: ``ProfiledModel(layers=[LayerCost(...), ...], ...)``.

Every program is timed as the pipeline runs it (``_time_on_every_device``): on every
local device at once, each on its own copy of the inputs, several runs inside one
program (as tasks run inside the tick loop, with no launch of their own). Accelerators
with their own compute and memory run a program as fast that way as alone; simulated
CPU devices share the host's cores, and a program runs several times slower with all
of them busy (a d64 GPT block's forward ~4x on 8 devices over 2 cores). The slot moves
the plan adds to those times are measured the same way, so the two are on one footing
(timing the layers on one device alone and the slot moves on all made the plan price
remat "none" at 1.9x "full" where the step measured 1.46x; now 1.20-1.26x against
1.45-1.60x, each step within 17% of its measured time: ``benchmarks/pipeline_remat.py``).
What this footing leaves out: where devices share cores, a schedule's idle devices free
them for the busy ones, so a pipeline with bubbles runs faster than priced.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from mindpipe_jax.errors import ConfigError
from mindpipe_jax.sim import LayerCost

_ZERO = LayerCost(0.0, 0.0, 0.0)


def _per_layer(value, n: int, name: str) -> tuple[float, ...] | None:
    if value is None:
        return None
    if isinstance(value, int | float) and not isinstance(value, bool):
        values = (float(value),) * n
    else:
        values = tuple(float(x) for x in value)
    if len(values) != n:
        raise ConfigError(f"ProfiledModel.{name}: {len(values)} values for {n} layers")
    if any(not math.isfinite(x) or x < 0 for x in values):
        raise ConfigError(f"ProfiledModel.{name} must be finite and >= 0, got {values}")
    return values


@dataclass(frozen=True)
class ProfiledModel:
    """Per-layer costs of a model (seconds and bytes, per microbatch).

    ``layers``: one ``LayerCost`` per block (F, B, W, BW durations, output
    activation bytes, parameter bytes). ``embed``/``head``: the same for the
    embedding (its output is the first hidden state) and the head with its loss.
    ``residual_bytes``: per layer, what its forward keeps for its backward (one
    number for all layers or one per layer); ``embed_residual_bytes``,
    ``head_residual_bytes`` likewise. ``dots_residual_bytes`` and
    ``dots_recompute_s`` (per layer) describe remat "dots" and are needed only
    to offer that policy. ``slot_move_s_per_byte``: what moving one byte of a residual
    slot costs (a streaming read + write of a slot-sized buffer on every local device at
    once, per byte moved; 0 = free): the SPMD runtime moves ``memory.SLOT_MOVES`` slots
    of each residual buffer on every device in every tick, which the plan prices
    (``memory.slot_tick_seconds``). ``flops``: forward/backward FLOPs of the measured
    parts (information only). ``note``: where the numbers came from."""

    layers: Sequence[LayerCost]
    embed: LayerCost = _ZERO
    head: LayerCost = _ZERO
    residual_bytes: float | Sequence[float] = 0.0
    embed_residual_bytes: float = 0.0
    head_residual_bytes: float = 0.0
    dots_residual_bytes: float | Sequence[float] | None = None
    dots_recompute_s: float | Sequence[float] | None = None
    slot_move_s_per_byte: float = 0.0
    flops: dict[str, float] = field(default_factory=dict)
    microbatch: int = 0
    note: str = "injected costs"

    def __post_init__(self):
        layers = tuple(self.layers)
        if not layers or not all(isinstance(x, LayerCost) for x in layers):
            raise ConfigError("ProfiledModel.layers must be a non-empty sequence of LayerCost")
        for name in ("embed", "head"):
            if not isinstance(getattr(self, name), LayerCost):
                raise ConfigError(f"ProfiledModel.{name} must be a LayerCost")
        n = len(layers)
        object.__setattr__(self, "layers", layers)
        object.__setattr__(self, "residual_bytes", _per_layer(self.residual_bytes, n, "residual_bytes"))
        for name in ("dots_residual_bytes", "dots_recompute_s"):
            object.__setattr__(self, name, _per_layer(getattr(self, name), n, name))
        if (self.dots_residual_bytes is None) != (self.dots_recompute_s is None):
            raise ConfigError("ProfiledModel: give both dots_residual_bytes and dots_recompute_s, or neither")
        for name in ("embed_residual_bytes", "head_residual_bytes", "slot_move_s_per_byte"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
                raise ConfigError(f"ProfiledModel.{name} must be a number >= 0, got {value!r}")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def has_dots(self) -> bool:
        return self.dots_residual_bytes is not None


def _median_time(fn: Callable, *args, repeats: int) -> float:
    """Median seconds per call over ``repeats`` samples, after a warm-up (compile).
    A sample runs the call enough times back to back to last about 2 ms, so
    sub-millisecond programs are not timed at the clock's resolution."""
    import jax

    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    once = time.perf_counter() - start
    number = max(1, min(200, int(2e-3 / max(once, 1e-6))))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(number):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / number)
    return statistics.median(samples)


# Runs of a measured program inside one timed call: the pipeline runs its tasks inside
# one program's tick loop, so a task pays no launch of its own; timed one launch per
# run, 8 simulated CPU devices over 2 cores added ~1.2 ms of launch and rendezvous to
# a 1.1-1.4 ms block forward (the plan then put a 25-28 ms pipe2 x data4 step at 53 ms).
INNER_RUNS = 8


def _time_on_every_device(fn, *args, repeats: int) -> tuple[float, float]:
    """(seconds per run, FLOPs per run) of ``fn(*args)`` run on every local device at
    once, each device on its own whole copy of ``args``, the way the pipeline's devices
    all run their stage's tasks in the same tick: ``INNER_RUNS`` runs in a loop inside
    one program per timed call (``_median_time``), the time divided by them. The FLOPs
    are one run's on one device (``cost_analysis`` of ``fn`` alone)."""
    import jax

    flops = _flops(jax.jit(fn).lower(*args))
    program, args = runs_on_every_device(fn, *args)
    return _median_time(program, *args, repeats=repeats) / INNER_RUNS, flops


def runs_on_every_device(fn, *args):
    """``(compiled program, its args)``: ``INNER_RUNS`` runs of ``fn(*args)`` in a loop,
    on every local device at once, each on its own whole copy of ``args`` (the returned
    ``args``, replicated over the local devices). What ``_time_on_every_device`` times."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    def runs(*inputs):
        def once(_, outs):
            # The outputs are the loop's state: each run writes them whole, as a task
            # writes its outputs into the runtime's buffers. Each run's inputs are shifted
            # by a tiny multiple of one element of the last run's outputs: a true data
            # dependency, without which XLA hoists the runs out of the loop (an
            # optimization barrier does not stop it). The shift is a pass over the inputs,
            # as the runtime's per-layer slice of a stage's weights is.
            floats = [o for o in jax.tree.leaves(outs) if jnp.issubdtype(o.dtype, jnp.inexact) and o.size]
            shift = 1e-30 * jnp.ravel(floats[0])[0].astype(jnp.float32) if floats else jnp.float32(0)
            return fn(*jax.tree.map(
                lambda v: v + shift.astype(v.dtype) if jnp.issubdtype(v.dtype, jnp.inexact) else v, inputs))

        shapes = jax.eval_shape(fn, *inputs)
        zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
        return jax.lax.fori_loop(0, INNER_RUNS, once, zeros)

    mesh = jax.sharding.Mesh(np.asarray(jax.local_devices()), ("all",))
    args = jax.device_put(args, NamedSharding(mesh, P()))
    # Every input is replicated, so each device computes the whole of fn on its copy.
    program = jax.jit(jax.shard_map(runs, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
    return program.lower(*args).compile(), args


def _flops(program) -> float:
    """XLA's FLOP count of a lowered or compiled program."""
    analysis = program.cost_analysis()
    if isinstance(analysis, Sequence):  # older JAX: one dict per computation
        analysis = analysis[0] if analysis else {}
    return float((analysis or {}).get("flops", 0.0))


def _nbytes(tree) -> float:
    import jax

    return float(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def residual_bytes(fn, params, x) -> float:
    """Bytes the runtime's residual buffer keeps per microbatch for ``fn(params, x)``:
    the vjp closure's leaves that are not the parameters themselves."""
    from mindpipe_jax.parallel.pipeline.runtime.residuals import ResidualStore

    avals = ResidualStore(fn, params, x).buffer_avals
    return float(sum(math.prod(a.shape) * a.dtype.itemsize for a in avals))


def slot_move_seconds_per_byte(nbytes: float, *, repeats: int = 5) -> float:
    """Seconds per byte moved when every local device streams a buffer of ``nbytes``
    (at least 256 KiB) through its memory at once (read + write, two moves per byte, as
    ``tuner.calibrate`` counts its memory rate): what the runtime's residual slot reads
    and writes cost per byte, on the footing the layer times are measured on (every
    device busy: the runtime moves slots on every device in every tick, idle or not)."""
    import jax.numpy as jnp

    elems = max(int(nbytes) // 4, 1 << 16)
    # At least 5 samples whatever the caller's repeats: one costs milliseconds, and a
    # single sample on a loaded host can be several times the rate's typical value.
    seconds, _ = _time_on_every_device(lambda x: x * 1.0001 + 0.5, jnp.ones((elems,), jnp.float32),
                                       repeats=max(repeats, 5))
    return seconds / (2 * 4 * elems)


def _measure_part(fn, params, x, cotangent, *, repeats: int, input_grad: bool,
                  extra: dict[str, Callable] | None = None) -> dict[str, float]:
    """Forward, B (w.r.t. ``x``), W (w.r.t. ``params``) and BW of ``fn(params, x)``,
    plus one backward per ``extra`` function of the same signature. Backward times
    are of the backward alone: one compiled forward returns every ``jax.vjp``
    closure (its residuals), which are then passed into compiled backwards."""
    import jax

    out: dict[str, float] = {}
    out["F"], out["flops_F"] = _time_on_every_device(fn, params, x, repeats=repeats)

    def closures(w, h):
        made = {"W": jax.vjp(lambda ww: fn(ww, h), w)[1]}
        if input_grad:
            made["B"] = jax.vjp(lambda hh: fn(w, hh), h)[1]
            made["BW"] = jax.vjp(fn, w, h)[1]
        for name, other in (extra or {}).items():
            made[name] = jax.vjp(other, w, h)[1]
        return made

    for kind, vjp_fn in jax.jit(closures)(params, x).items():
        out[kind], out[f"flops_{kind}"] = _time_on_every_device(lambda f, ct: f(ct), vjp_fn, cotangent,
                                                                repeats=repeats)
    if not input_grad:
        out["B"], out["BW"], out["flops_B"], out["flops_BW"] = 0.0, out["W"], 0.0, out["flops_W"]
    return out


def measure_layer_costs(model_cfg, *, microbatch: int, model, repeats: int = 5,
                        dots: bool = True, tensor: int = 1) -> ProfiledModel:
    """Measure ``model`` (a factory ``rngs -> nnx.Module``, e.g. ``lambda rngs:
    models.build_model(model_cfg, rngs)`` for the configured GPT or MoE GPT): its
    prologue, one unit of its stack and its epilogue, found as the pipeline finds them
    (``contract.PipelineModel``), on every local device at once at ``microbatch``
    sequences of ``model_cfg.seq_len`` tokens (ids below ``model_cfg.vocab_size``).

    Every time is the median of ``repeats`` samples after a warm-up run, each
    program ``jax.jit``-compiled and waited for with ``block_until_ready``. One
    block is measured and replicated over ``n_layers`` (the GPT's blocks are
    identical). ``dots=True`` also measures remat "dots" (residual bytes under
    ``dots_with_no_batch_dims_saveable`` and the recompute it adds to the backward).
    ``tensor`` > 1: the residuals are what one device keeps when ``tensor`` devices split
    each layer, read from the compiled layout (``residual_share.residual_sizer``); the
    times stay the whole layer's, each device running a whole copy.
    """
    import jax

    for name, value in (("microbatch", microbatch), ("repeats", repeats)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"measure_layer_costs: {name} must be an integer >= 1, got {value!r}")
    # One device whatever the caller's context: under an ambient mesh (e.g. train's
    # repartition) the model's sharding constraints would compile a sharded program.
    with jax.set_mesh(None):
        return _measure(model_cfg, microbatch, repeats, dots, model, tensor)


def _measure(model_cfg, microbatch: int, repeats: int, dots: bool, factory, tensor: int) -> ProfiledModel:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from mindpipe_jax.parallel.pipeline.contract import PipelineModel
    from mindpipe_jax.parallel.pipeline.parts import merged
    from mindpipe_jax.parallel.pipeline.plan.residual_share import residual_sizer

    with nnx.use_eager_sharding(False):
        model = factory(nnx.Rngs(0))
    graphdef, state, rest = nnx.split(model, nnx.Param, ...)
    params = jax.device_put(nnx.to_pure_dict(state), jax.devices()[0])
    rng = np.random.default_rng(0)
    shape = (microbatch, model_cfg.seq_len)
    tokens = jnp.asarray(rng.integers(0, model_cfg.vocab_size, shape), jnp.int32)
    targets = jnp.asarray(rng.integers(0, model_cfg.vocab_size, shape), jnp.int32)
    split = PipelineModel(model, params, partial(merged, graphdef, rest=rest), tokens)
    fns = split.fns
    embed_p, stack, head_p = split.split(params)
    params = {"embed": embed_p, "head": head_p}
    block = jax.tree.map(lambda x: x[0], stack)
    hidden = fns.embed(params["embed"], tokens)
    d_hidden = jnp.asarray(rng.standard_normal(hidden.shape) * 1e-3, hidden.dtype)

    def head(w, h):
        return fns.head_loss(w, h, targets)

    saved = jax.checkpoint(fns.layer, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    lay = _measure_part(fns.layer, block, hidden, d_hidden, repeats=repeats, input_grad=True,
                        extra={"BW_dots": saved} if dots else None)
    emb = _measure_part(fns.embed, params["embed"], tokens, d_hidden, repeats=repeats, input_grad=False)
    hd = _measure_part(head, params["head"], hidden, jnp.ones((), jnp.float32), repeats=repeats,
                       input_grad=True)
    act = float(hidden.size * hidden.dtype.itemsize)
    layer = LayerCost(lay["F"], lay["B"], lay["W"], lay["BW"], act, _nbytes(block))
    embed = LayerCost(emb["F"], 0.0, emb["W"], emb["W"], act, _nbytes(params["embed"]))
    # A parameter both ends use (a tied embedding) is stored once: counted with the embedding.
    head_only = {k: v for k, v in params["head"].items() if k not in params["embed"]}
    head_cost = LayerCost(hd["F"], hd["B"], hd["W"], hd["BW"], 0.0, _nbytes(head_only))
    flops = {f"{part}_{k[6:]}": v for part, d in (("layer", lay), ("embed", emb), ("head", hd))
             for k, v in d.items() if k.startswith("flops_")}
    extra: dict[str, Any] = {}
    size, per_device = residual_sizer(split, state, tensor)
    if dots:
        extra = {"dots_residual_bytes": size(saved, block, hidden, "blocks"),
                 "dots_recompute_s": max(0.0, lay["BW_dots"] - lay["BW"])}
    n = split.num_units
    res_layer = size(fns.layer, block, hidden, "blocks")
    device = jax.devices()[0]
    where = device.platform + ("" if device.device_kind == device.platform else f" ({device.device_kind})")
    experts = f", {model_cfg.n_experts} experts, top-{model_cfg.top_k}" if model_cfg.n_experts else ""
    what = (f"{type(model).__name__}(d_model={model_cfg.d_model}, heads={model_cfg.n_heads}, "
            f"seq_len={model_cfg.seq_len}, vocab={model_cfg.vocab_size}, {model_cfg.dtype}{experts})"
            if type(model).__name__ in ("GPT", "MoEGPT") and split.num_units == model_cfg.n_layers
            else f"{type(model).__name__} (seq_len={model_cfg.seq_len})")
    note = (f"measured on {where}: one unit of {what} at microbatch {microbatch}, median of {repeats}; "
            f"units are identical, so its costs are replicated over {n} units")
    if tensor > 1:
        note += (f"; residuals per device over tensor={tensor} (the compiled layout), times the whole "
                 f"layer's" if per_device else
                 f"; residuals and times the whole layer's (an upper bound over tensor={tensor})")
    return ProfiledModel(
        layers=(layer,) * n, embed=embed, head=head_cost,
        residual_bytes=res_layer, slot_move_s_per_byte=slot_move_seconds_per_byte(res_layer, repeats=repeats),
        embed_residual_bytes=size(fns.embed, params["embed"], tokens, "embed"),
        head_residual_bytes=size(head, params["head"], hidden, "head"),
        flops=flops, microbatch=microbatch, note=note, **extra)


# -------------------------------------------------------------------------- plan
