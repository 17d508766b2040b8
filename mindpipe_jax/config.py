"""Typed, frozen configuration: TOML files plus ``key=value`` overrides.

A run is described by one ``Config`` made of sections (``model``, ``data``,
``parallel``, ``optim``, ``train``, ``distributed``). Files are TOML with the same
section names; command-line overrides use dotted keys (``parallel.tensor=2``) and
TOML literals for values. ``dacite`` (strict mode) turns the merged dictionary into
the dataclasses, so unknown keys and wrong types are refused in one place; each
section's ``__post_init__`` checks ranges. Every refusal is a one-line
``ConfigError`` naming the key, the value and what is valid. Numbers are checked
as numbers (a boolean is not one; integers within their range, floats finite), and a
key set away from its default that has no effect under the other settings is
refused rather than ignored (``check_no_effect``; a ``data.path`` given without
``data.source`` selects the source instead).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import os
import stat
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import dacite

from mindpipe_jax.errors import ConfigError

MESH_AXES = ("data", "fsdp", "tensor", "pipe", "subnet", "expert")
STAGE_REMAT_POLICIES = ("none", "dots", "full")  # the pipeline runtime's (tickplan.REMAT_POLICIES)
# Simulated CPU devices: XLA:CPU compiles a trivial sharded program over 256 / 512 /
# 1024 / 2048 devices in about 3 / 7 / 15 / 54 s (2 cores) and refuses 4096 ("Multiprocess
# computations aren't implemented"); a training step takes minutes well before that.
MAX_SIMULATED_DEVICES = 1024
TOKEN_FILE_EXTENSIONS = (".npy", ".bin")  # data.path with one of these selects data.source="tokens"
# Integer keys hold counts and sizes that JAX keeps as 32-bit integers (the step
# counter, shapes); these are wider or narrower: (low, high, why).
_INT32 = (-2**31, 2**31 - 1, "")
_INT_RANGES = {
    "train.seed": (0, 2**32 - 1, "; a JAX key holds 32 bits of seed"),
    "data.seed": (0, 2**32 - 1, "; a 32-bit seed, as train.seed"),
    "supernet.search_max_params": (0, 2**63 - 1, ""),
}


SUPERNET_SEMANTICS = ("sync", "sequential", "operator-causal")
_RENAMED_SEMANTICS = {"causal": "operator-causal"}  # old name -> new, refused naming the new one


def semantics_error(semantics) -> str | None:
    """The one-line reason ``semantics`` is not a SPara semantics (``supernet.semantics``), or None."""
    if semantics in SUPERNET_SEMANTICS:
        return None
    valid = ", ".join(repr(s) for s in SUPERNET_SEMANTICS)
    if semantics in _RENAMED_SEMANTICS:
        return (f"supernet.semantics={semantics!r} is now called {_RENAMED_SEMANTICS[semantics]!r} "
                f"(its shared weights take one averaged update per step; 'sequential' trains the "
                f"subnets one after another); valid: {valid}")
    return f"supernet.semantics={semantics!r} is not valid; valid: {valid}"


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _positive(section: str, **values: int | float) -> None:
    for key, value in values.items():
        _check(value > 0, f"{section}.{key}={value!r} must be > 0")


def _shown(value: Any) -> str:
    """A value as the user typed it: TOML booleans, lists for tuples."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_shown(v) for v in value) + "]"
    return repr(value)


@functools.cache
def _number_fields(cls) -> tuple[tuple[str, type, bool], ...]:
    """(name, int or float, is a list) for each numeric field of a config section."""
    out = []
    for name, tp in typing.get_type_hints(cls).items():
        args = typing.get_args(tp)
        if tp in (int, float):
            out.append((name, tp, False))
        elif typing.get_origin(tp) is tuple and args[1:] == (Ellipsis,) and args[0] in (int, float):
            out.append((name, args[0], True))
    return tuple(out)


def _check_numbers(obj, section: str) -> None:
    """Numbers are numbers (``true`` is not 1), integers fit their range, floats are finite.

    Runs first in each section's ``__post_init__``: dacite accepts a bool where an int
    or float is declared (``bool`` is an ``int``), and Python integers are unbounded.
    """
    for name, tp, is_list in _number_fields(type(obj)):
        value = getattr(obj, name)
        key = f"{section}.{name}"
        if is_list:
            if not isinstance(value, (tuple, list)):
                raise ConfigError(f"config key {key}={_shown(value)} has the wrong type; expected a list "
                                  f"of {tp.__name__}")
            for item in value:
                _check_number(key, item, tp, value, f"a list of {tp.__name__}")
        else:
            _check_number(key, value, tp, value, tp.__name__)


def _check_number(key: str, value: Any, tp: type, whole: Any, expected: str) -> None:
    shown = _shown(whole)
    # numbers.*: NumPy scalars (np.int64 is no int) pass as what they are.
    number = isinstance(value, numbers.Integral if tp is int else numbers.Real)
    if isinstance(value, bool) or not number:
        got = ", not a boolean" if isinstance(value, bool) else ""
        raise ConfigError(f"config key {key}={shown} has the wrong type; expected {expected}{got}")
    if tp is int:
        low, high, why = _INT_RANGES.get(key, _INT32)
        _check(low <= value <= high, f"config key {key}={shown} is out of range; valid: integers from "
                                     f"{low} to {high}{why}")
    else:
        try:
            finite = math.isfinite(value)
        except OverflowError:  # an integer beyond any float
            finite = False
        _check(finite, f"config key {key}={shown} is not a finite number")


@dataclass(frozen=True)
class ModelConfig:
    """The reference GPT (or its MoE variant). ``d_ff`` defaults to 4 × ``d_model`` when 0."""

    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 0
    dropout: float = 0.0
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    remat: Literal["none", "full", "dots"] = "none"
    # Attention kernel: "xla" (scores materialized, runs everywhere) or "cudnn" (fused
    # flash attention on NVIDIA GPUs; needs dtype bfloat16 or float16 and head_dim <= 128).
    attention: Literal["xla", "cudnn"] = "xla"
    # Tensor-parallel overlap (parallel/overlap.py): with parallel.tensor > 1 the
    # attention and MLP projections become collective matmuls, their all-gather /
    # reduce-scatter split into ppermute steps that can run under partial matmuls
    # (seq_len must divide by tensor). False = XLA's blocking all-reduces.
    collective_matmul: bool = False
    # Mixture of Experts (models/moe.py): n_experts > 0 makes each block's MLP
    # n_experts expert MLPs behind a top_k router; 0 = the dense GPT. Each expert
    # takes ceil(capacity_factor * tokens * top_k / n_experts) tokens per dispatch
    # group (batch shard), the rest are dropped; the load-balancing loss is added
    # with weight moe_aux_weight. parallel.expert splits the experts over devices.
    n_experts: int = 0
    top_k: int = 2
    capacity_factor: float = 1.25
    moe_aux_weight: float = 0.01

    def __post_init__(self):
        _check_numbers(self, "model")
        _positive("model", vocab_size=self.vocab_size, seq_len=self.seq_len,
                  d_model=self.d_model, n_layers=self.n_layers, n_heads=self.n_heads)
        _check(self.n_experts >= 0, f"model.n_experts={self.n_experts} must be >= 0 (0 = dense GPT)")
        _check(self.top_k >= 1 and (self.n_experts == 0 or self.top_k <= self.n_experts),
               f"model.top_k={self.top_k} must be >= 1" + (
                   f" and <= model.n_experts={self.n_experts}" if self.n_experts else ""))
        _check(self.capacity_factor > 0, f"model.capacity_factor={self.capacity_factor} must be > 0")
        _check(self.moe_aux_weight >= 0, f"model.moe_aux_weight={self.moe_aux_weight} must be >= 0")
        _check(self.d_ff >= 0, f"model.d_ff={self.d_ff} must be >= 0 (0 means 4*d_model)")
        _check(0.0 <= self.dropout < 1.0, f"model.dropout={self.dropout} must be in [0, 1)")
        _check(self.d_model % self.n_heads == 0,
               f"model.d_model={self.d_model} must be divisible by model.n_heads={self.n_heads}")
        _check(self.attention != "cudnn" or self.dtype in ("bfloat16", "float16"),
               f"model.attention=cudnn needs model.dtype bfloat16 or float16, got {self.dtype}; "
               f"use model.attention=xla for {self.dtype}")

    @property
    def ff_dim(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def source_for_path(path: str) -> str:
    """The ``data.source`` a ``data.path`` selects: ``tokens`` for .npy/.bin files, else ``text``."""
    return "tokens" if str(path).lower().endswith(TOKEN_FILE_EXTENSIONS) else "text"


def _is_bin(path: str) -> bool:
    return str(path).lower().endswith(".bin")


@dataclass(frozen=True)
class DataConfig:
    """Where tokens come from.

    ``source``: ``stdlib`` (the Python standard library's own sources, byte-level,
    present on every machine), ``text`` (a file or directory, byte-level),
    ``tokens`` (``.npy`` or raw ``.bin`` token ids, needs ``vocab_size``), or
    ``synthetic`` (random tokens, for benchmarks).

    Setting ``path`` without ``source`` selects the source from the path: ``tokens``
    for a ``.npy`` or ``.bin`` file, else ``text``. A key the source does not read
    (``path`` with ``stdlib``/``synthetic``, ``vocab_size`` without ``tokens``,
    ``token_dtype`` without a ``.bin`` file, ``seed``/``synthetic_tokens`` without
    ``synthetic``) is refused rather than ignored.
    """

    source: Literal["stdlib", "text", "tokens", "synthetic"] = "stdlib"
    path: str = ""
    vocab_size: int = 0  # for source="tokens"; 0 = take it from the model
    token_dtype: Literal["uint16", "uint32", "int32"] = "uint16"  # raw .bin files
    val_fraction: float = 0.05
    seed: int = 0
    synthetic_tokens: int = 1 << 20

    def __post_init__(self):
        _check_numbers(self, "data")
        _check(0.0 < self.val_fraction < 1.0,
               f"data.val_fraction={self.val_fraction} must be in (0, 1)")
        _check(self.vocab_size >= 0, f"data.vocab_size={self.vocab_size} must be >= 0")
        _check(self.source not in ("text", "tokens") or bool(self.path),
               f"data.path is required for data.source={self.source!r}")
        _positive("data", synthetic_tokens=self.synthetic_tokens)
        # Keys the chosen source does not read: refused, not silently ignored.
        _check(self.source in ("text", "tokens") or not self.path,
               f"data.path={self.path!r} is not read with data.source={self.source!r}; set data.source to "
               f"'text' or 'tokens' (or leave it unset: a data.path selects it), or drop data.path")
        _check(self.vocab_size == 0 or self.source == "tokens",
               f"data.vocab_size={self.vocab_size} applies to data.source='tokens' only "
               f"(data.source={self.source!r}); drop it")
        _check(self.token_dtype == "uint16" or (self.source == "tokens" and _is_bin(self.path)),
               f"data.token_dtype={self.token_dtype!r} applies to raw .bin token files only "
               f"(data.source={self.source!r}, data.path={self.path!r}); drop it")
        default = DataConfig.__dataclass_fields__
        for key, note in (("seed", "; the batch order follows train.seed"), ("synthetic_tokens", "")):
            value = getattr(self, key)
            _check(value == default[key].default or self.source == "synthetic",
                   f"data.{key}={value} applies to data.source='synthetic' only (data.source="
                   f"{self.source!r}{note}); drop it")


@dataclass(frozen=True)
class ParallelConfig:
    """Mesh axis sizes; one of them may be -1 to take the remaining devices.

    ``tensor=0`` (the default) means auto: 2 on a machine of simulated CPU
    devices when another axis is -1 and there is room, so the default run shows
    data × tensor parallelism; otherwise 1, so the default run fits one GPU and
    an explicit layout such as ``data=8`` is taken as written.
    """

    data: int = -1
    fsdp: int = 1
    tensor: int = 0
    pipe: int = 1
    subnet: int = 1
    expert: int = 1
    microbatches: int = 1
    # zbv and dualpipev hold two chunks per device in a V: they need virtual_stages = 2.
    schedule: Literal["gpipe", "1f1b", "interleaved", "zb-h1", "afapab", "zbv", "dualpipev"] = "1f1b"
    virtual_stages: int = 1
    # How the schedule's table is re-timed into fused ticks (up to one F, one backward
    # and one W per device and tick): "auto" picks the fastest under unit task costs;
    # "table" runs one task per tick (the least memory: 1F1B keeps p microbatches, fused
    # up to 2p - 1); "in-order", "forward-ahead", "fill" (W's only into bubbles) as in
    # mindpipe_jax/parallel/pipeline/schedules/fused.py.
    fuse_ticks: Literal["auto", "table", "in-order", "forward-ahead", "fill"] = "auto"
    # Pipeline memory, one policy for every stage or a list with one per global
    # stage (pipe x virtual_stages, e.g. ["full", "dots", "dots", "none"], as
    # `mindpipe plan` prints it): "none" keeps each microbatch's forward residuals
    # until its backward; "dots" keeps only the projection outputs and recomputes
    # attention and elementwise work; "full" keeps only the stage input and
    # recomputes the forward.
    stage_remat: str | tuple[str, ...] = "none"
    # When each model chunk's data-parallel gradient sync runs: "end" after the
    # pipeline flush, "overlap" right after the chunk's last backward as one
    # all-reduce issued before the remaining ticks (Megatron's --overlap-grad-reduce),
    # "chunk" at the same points as a ring spread over the remaining ticks (AFAPAB);
    # "auto" = "chunk" for afapab, else "end".
    grad_sync: Literal["auto", "end", "chunk", "overlap"] = "auto"
    sync_bucket_mb: float = 0.0  # "chunk": ring bucket size in MB (2^20 bytes); 0 = one per chunk
    # The gradients' dtype on the wire of a pipeline's data-parallel sync ("end" and
    # "chunk"): "fp32", or "bf16" for half the bytes (sums still accumulate in fp32).
    grad_sync_dtype: Literal["fp32", "bf16"] = "fp32"
    # A pipeline's weights stored sharded over fsdp are gathered "step": once per step
    # on each stage (the gathered stage and its whole gradient live for the step), or
    # "chunk": for each task's use of its chunk, its gradient reduce-scattered after
    # the task (a gathered chunk at a time and 1/fsdp of the gradient, for collectives
    # in every tick).
    fsdp_gather: Literal["step", "chunk"] = "step"
    # Layers per global stage (pipe x virtual_stages values, in global-stage order);
    # empty = an even split. Uneven splits balance stages that also hold embed/head.
    stage_layers: tuple[int, ...] = ()
    # Online repartition: at this step re-measure layer costs and move layers
    # between stages if the partitioner finds a better split (0 = never).
    repartition_after: int = 0
    simulate_cpu_devices: int = 8  # CPU-only machines: devices to simulate (0 = leave as is)
    # Extra rows of the logical-axis rules table, for models annotated with other names:
    # "name=axis" or "name=axis1,axis2" (shard over those mesh axes) or "name=" (keep
    # whole), e.g. ["tp=tensor", "kv_heads="]. A row for a built-in name replaces it.
    rules: tuple[str, ...] = ()

    def __post_init__(self):
        _check_numbers(self, "parallel")
        from mindpipe_jax.parallel.rules import parse_rules  # the one place that knows the table
        parse_rules(self.rules)
        sizes = self.axis_sizes()
        fills = [a for a, n in sizes.items() if n == -1]
        _check(len(fills) <= 1, f"parallel: only one axis may be -1, got {', '.join(fills)}")
        for axis, n in sizes.items():
            auto = axis == "tensor" and n == 0
            _check(auto or n == -1 or n >= 1, f"parallel.{axis}={n} must be >= 1 or -1 (fill)"
                   + (" or 0 (auto)" if axis == "tensor" else ""))
        _positive("parallel", microbatches=self.microbatches, virtual_stages=self.virtual_stages)
        policies = (self.stage_remat,) if isinstance(self.stage_remat, str) else self.stage_remat
        _check(bool(policies) and all(r in STAGE_REMAT_POLICIES for r in policies),
               f"parallel.stage_remat={self.stage_remat!r} must be one of "
               f"{', '.join(STAGE_REMAT_POLICIES)} or a list of them, one per global stage")
        _check(self.sync_bucket_mb >= 0, f"parallel.sync_bucket_mb={self.sync_bucket_mb} must be >= 0 "
               f"(0 = one bucket per chunk)")
        _check(self.repartition_after >= 0,
               f"parallel.repartition_after={self.repartition_after} must be >= 0 (0 = never)")
        _check(0 <= self.simulate_cpu_devices <= MAX_SIMULATED_DEVICES,
               f"parallel.simulate_cpu_devices={self.simulate_cpu_devices} must be in "
               f"0..{MAX_SIMULATED_DEVICES} (0 = leave the devices as they are); XLA compiles a sharded "
               f"program over {MAX_SIMULATED_DEVICES} CPU devices in ~15 s, over twice as many in minutes")

    def axis_sizes(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in MESH_AXES}


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup, cosine decay to ``lr * min_lr_ratio``, clipping."""

    lr: float = 3e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0  # 0 disables clipping

    def __post_init__(self):
        _check_numbers(self, "optim")
        _positive("optim", lr=self.lr)
        _check(self.warmup_steps >= 0, f"optim.warmup_steps={self.warmup_steps} must be >= 0")
        _check(0.0 <= self.min_lr_ratio <= 1.0,
               f"optim.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        _check(self.weight_decay >= 0, f"optim.weight_decay={self.weight_decay} must be >= 0")
        _check(0.0 <= self.b1 < 1.0 and 0.0 <= self.b2 < 1.0,
               f"optim.b1={self.b1}, optim.b2={self.b2} must be in [0, 1)")
        _check(self.clip_norm >= 0, f"optim.clip_norm={self.clip_norm} must be >= 0")


@dataclass(frozen=True)
class TrainConfig:
    """The loop: steps, batch, evaluation, logging, checkpoints and what to do on a
    non-finite loss. SIGTERM or Ctrl-C stops after the current step with a checkpoint;
    ``resume=true`` continues from the newest complete checkpoint (and refuses a
    directory without one); ``resume="auto"`` continues when there is one and starts
    fresh when there is none, for job scripts that are requeued after a preemption."""

    steps: int = 300
    global_batch: int = 32
    grad_accum: int = 1  # microbatches accumulated per step (not pipeline microbatches)
    seed: int = 0
    eval_every: int = 100
    eval_batches: int = 4
    log_every: int = 10
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    out_dir: str = "runs/default"
    resume: bool | Literal["auto"] = False
    deterministic: bool = False
    virtual_shards: int = 8  # deterministic mode: fixed number of gradient shards
    # A step whose loss or gradient norm is not finite: "stop" ends the run with a
    # one-line error (the last checkpoint stays as it was); "skip" leaves params and
    # optimizer state as they were before that step, counts it and goes on.
    nonfinite: Literal["stop", "skip"] = "stop"
    peak_tflops: float = 0.0  # per device; 0 = look up the device kind
    tensorboard: bool = True
    progress: bool = True

    def __post_init__(self):
        _check_numbers(self, "train")
        _positive("train", steps=self.steps, global_batch=self.global_batch,
                  grad_accum=self.grad_accum, eval_batches=self.eval_batches,
                  log_every=self.log_every, keep_checkpoints=self.keep_checkpoints,
                  virtual_shards=self.virtual_shards)
        _check(self.eval_every >= 0, f"train.eval_every={self.eval_every} must be >= 0 (0 = never)")
        _check(self.checkpoint_every >= 0,
               f"train.checkpoint_every={self.checkpoint_every} must be >= 0 (0 = only at the end)")
        _check(self.peak_tflops >= 0, f"train.peak_tflops={self.peak_tflops} must be >= 0")
        _check(self.virtual_shards & (self.virtual_shards - 1) == 0,
               f"train.virtual_shards={self.virtual_shards} must be a power of two")
        _check(bool(self.out_dir), "train.out_dir must not be empty")


@dataclass(frozen=True)
class DistributedConfig:
    """Multi-host start-up. Empty fields are read from the environment
    (``MINDPIPE_COORDINATOR``/``MINDPIPE_NUM_PROCESSES``/``MINDPIPE_PROCESS_ID``,
    then SLURM's variables)."""

    coordinator: str = ""
    num_processes: int = 0
    process_id: int = -1
    timeout_s: int = 300

    def __post_init__(self):
        _check_numbers(self, "distributed")
        _check(self.num_processes >= 0, f"distributed.num_processes={self.num_processes} must be >= 0")
        _positive("distributed", timeout_s=self.timeout_s)


@dataclass(frozen=True)
class SupernetConfig:
    """SPara (``mindpipe_jax.supernet``): the search space, how subnets are sampled and
    trained together over shared weights, and the search afterwards.

    ``semantics``: ``sync`` (the K subnets of a step read the same weights, their
    gradients are averaged: one update per step), ``sequential`` (equal to training
    them one after another, each with its own update of every weight it touches) or
    ``operator-causal`` (sequential for the operator candidates, while the shared
    layers take one averaged update per step). ``vmap_width``
    subnets are vectorized per device: it changes the bits of a subnet's gradient,
    the device count never does, so keep it fixed to compare runs. The ``subnet``
    mesh axis (``parallel.subnet``) splits the K subnets of a step.

    ``ladder_levels``: subnets run sliced, at their own depth and with FFN widths and
    head counts rounded up to at most this many sizes each (one compiled program per
    shape); 0 runs every subnet masked at the supernet's full size (one program).
    """

    semantics: Literal["sync", "sequential", "operator-causal"] = "sync"
    subnets_per_step: int = 4  # K
    strategy: Literal["uniform", "sandwich"] = "sandwich"
    vmap_width: int = 1
    ladder_levels: int = 4  # sliced execution: sizes per ladder; 0 = masked (full size)
    ops: tuple[str, ...] = ("gelu", "relu", "silu")  # FFN candidates (their activations)
    ffn_ratios: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0)  # hidden widths, fractions of d_ff
    heads: tuple[int, ...] = ()  # attention head counts; empty = 1..model.n_heads
    min_depth: int = 1  # blocks: min_depth..model.n_layers
    search_population: int = 16
    search_generations: int = 4
    search_top_k: int = 5
    search_max_params: int = 0  # only subnets with at most this many parameters; 0 = no limit
    search_eval_batches: int = 2  # validation batches of train.global_batch rows per subnet

    def __post_init__(self):
        _check_numbers(self, "supernet")
        _check(semantics_error(self.semantics) is None, semantics_error(self.semantics))
        _check(self.strategy in ("uniform", "sandwich"),
               f"supernet.strategy={self.strategy!r} is not valid; valid: 'uniform', 'sandwich'")
        _positive("supernet", subnets_per_step=self.subnets_per_step, vmap_width=self.vmap_width,
                  min_depth=self.min_depth, search_population=self.search_population,
                  search_top_k=self.search_top_k, search_eval_batches=self.search_eval_batches)
        _check(self.ladder_levels >= 0,
               f"supernet.ladder_levels={self.ladder_levels} must be >= 0 (sizes each FFN width and head "
               f"count is rounded up to; 0 = masked, every subnet at full size)")
        _check(self.search_generations >= 0,
               f"supernet.search_generations={self.search_generations} must be >= 0")
        _check(self.search_max_params >= 0,
               f"supernet.search_max_params={self.search_max_params} must be >= 0 (0 = no limit)")
        _check(self.strategy != "sandwich" or self.subnets_per_step >= 2,
               f"supernet.subnets_per_step={self.subnets_per_step}: the sandwich strategy needs >= 2 "
               f"(largest + smallest [+ random]); use strategy='uniform' for 1")
        _check(bool(self.ops), "supernet.ops must name at least one FFN candidate")
        _check(bool(self.ffn_ratios) and all(0 < r <= 1 for r in self.ffn_ratios),
               f"supernet.ffn_ratios={list(self.ffn_ratios)} must be non-empty fractions in (0, 1]")
        _check(all(h >= 1 for h in self.heads), f"supernet.heads={list(self.heads)} must be >= 1")


@dataclass(frozen=True)
class TunerConfig:
    """EPara's online tuner (``mindpipe_jax.tuner.epara``): while training, every
    ``every`` steps, estimate the gradient noise scale, predict each candidate's
    entropyput = samples/s x statistical efficiency, and switch the run in place to
    the best candidate when it beats the current one by more than ``threshold``.

    Candidates are the global batches ``batch_sizes`` (empty = min_batch, 2*min_batch,
    4*min_batch, ... up to max_batch; 0 = the initial train.global_batch for
    min_batch and 8x it for max_batch), and with ``meshes`` also every data x fsdp x
    tensor mesh shape of the devices. ``base_batch`` is the b0 efficiency and the
    learning-rate gain are relative to (0 = the initial train.global_batch).
    ``lr_scaling``: how the learning rate follows the batch (tuner/noise.py):
    ``adascale`` = (B/b0) x efficiency(B), ``sqrt`` = sqrt(B/b0), ``linear`` = B/b0,
    ``none`` = 1. ``ema`` smooths the noise estimate per step; ``warmup`` steps pass
    before the first decision. ``amortize``: a switch must also pay back its
    recompile (the last compile time) within the remaining ``train.steps``; false
    switches on the predicted gain alone (demos, tests of switching).
    """

    enabled: bool = False
    every: int = 50
    threshold: float = 0.05
    batch_sizes: tuple[int, ...] = ()
    min_batch: int = 0
    max_batch: int = 0
    base_batch: int = 0
    lr_scaling: Literal["adascale", "sqrt", "linear", "none"] = "adascale"
    ema: float = 0.9
    meshes: bool = False
    warmup: int = 50
    amortize: bool = True

    def __post_init__(self):
        _check_numbers(self, "tuner")
        _positive("tuner", every=self.every)
        _check(self.threshold >= 0, f"tuner.threshold={self.threshold} must be >= 0")
        _check(all(b > 0 for b in self.batch_sizes),
               f"tuner.batch_sizes={list(self.batch_sizes)} must all be > 0")
        for key in ("min_batch", "max_batch", "base_batch", "warmup"):
            value = getattr(self, key)
            _check(value >= 0, f"tuner.{key}={value} must be >= 0"
                   + ("" if key == "warmup" else " (0 = from train.global_batch)"))
        _check(not (self.min_batch and self.max_batch) or self.min_batch <= self.max_batch,
               f"tuner.min_batch={self.min_batch} must be <= tuner.max_batch={self.max_batch}")
        _check(0.0 <= self.ema < 1.0, f"tuner.ema={self.ema} must be in [0, 1)")


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    supernet: SupernetConfig = field(default_factory=SupernetConfig)
    tuner: TunerConfig = field(default_factory=TunerConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, *overrides: str, **sections: Any) -> Config:
        """A copy with ``key=value`` overrides and/or whole sections replaced.

        The keys set here are checked against the result: one that has no effect
        under the other settings is refused (``check_no_effect``)."""
        merged = self.to_dict()
        explicit: dict[str, int] = {}
        for name, section in sections.items():
            merged[name] = dataclasses.asdict(section) if dataclasses.is_dataclass(section) else section
            explicit.update(_set_keys({name: merged[name]}, layer=1))
        return _build(_apply_overrides(merged, overrides, explicit), explicit)


def _parse_value(raw: str) -> Any:
    """A TOML literal (``2``, ``true``, ``"x"``, ``[1, 2]``), else the bare string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _apply_overrides(tree: dict[str, Any], overrides: typing.Iterable[str],
                     explicit: dict[str, int] | None = None) -> dict[str, Any]:
    """Set each ``key=value`` in ``tree``; record the keys set in ``explicit`` (layer 1)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        parts = key.split(".")
        node = tree
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if not isinstance(child, dict):
                where = ".".join(parts[: depth + 1])
                if depth == 0 and part in _SECTIONS:  # a config file set it to a value
                    raise ConfigError(_not_a_table(part, child))
                if part in node:
                    raise ConfigError(f"config key {where!r} is a value, not a section; set it as "
                                      f"{where}=VALUE")
                raise ConfigError(f"unknown config section {where!r}; valid: {', '.join(sorted(node))}")
            node = child
        if parts[-1] not in node and len(parts) > 1:
            raise ConfigError(f"unknown config key {key!r}; valid keys in {'.'.join(parts[:-1])!r}: "
                              f"{', '.join(sorted(node))}")
        node[parts[-1]] = _parse_value(raw.strip())
        if explicit is not None:
            explicit.update(_set_keys({key: node[parts[-1]]}, layer=1))
    return tree


def _set_keys(update: dict[str, Any], layer: int, prefix: str = "") -> dict[str, int]:
    """The dotted keys a TOML table or an override sets (a table: each key in it), with the
    layer that set them: 0 the config file, 1 the overrides."""
    out: dict[str, int] = {}
    for name, value in update.items():
        key = f"{prefix}{name}"
        if isinstance(value, dict):
            out.update(_set_keys(value, layer, key + "."))
        else:
            out[key] = layer
    return out


def _not_a_table(section: str, value: Any) -> str:
    return (f"config section {section!r} must be a table of keys ([{section}] in a TOML file, "
            f"{section}.KEY=VALUE on the command line), got {section} = {_shown(value)}")


def _build(tree: dict[str, Any], explicit: dict[str, int]) -> Config:
    """The validated ``Config`` of a merged tree whose keys in ``explicit`` the user set."""
    _select_data_source(tree, explicit)
    cfg = from_dict(tree)
    check_no_effect(cfg, explicit)
    return cfg


def _select_data_source(tree: dict[str, Any], explicit: dict[str, int]) -> None:
    """A ``data.path`` set without ``data.source`` selects the source from the path
    (``source_for_path``). A source set as late as the path (both on the command line,
    or both in the file) is the user's choice and stays, except the default "stdlib"
    in a file (``mindpipe config > my.toml`` lists every key); a synthetic source
    stays too (and refuses the path)."""
    data = tree.get("data")
    if not isinstance(data, dict) or "data.path" not in explicit:
        return
    path, source = data.get("path"), data.get("source")
    if not isinstance(path, str) or not path or source == "synthetic":
        return
    chosen = explicit.get("data.source", -1)
    if chosen == 0 and source == DataConfig.source:
        chosen = -1
    if chosen < explicit["data.path"]:
        data["source"] = source_for_path(path)


def check_train_keys(cfg: Config) -> None:
    """What ``mindpipe train`` reads no matter the rest, refused when set away from its
    default: the supernet section (``mindpipe supernet`` and ``mindpipe search`` read
    it) and ``train.virtual_shards`` without ``train.deterministic`` (a supernet run
    always uses it, so ``check_no_effect`` cannot refuse it for every command)."""
    default = Config()
    for f in dataclasses.fields(SupernetConfig):
        value = getattr(cfg.supernet, f.name)
        if value != getattr(default.supernet, f.name):
            raise ConfigError(f"supernet.{f.name}={_shown(value)} has no effect on `mindpipe train`; the "
                              f"supernet section is for `mindpipe supernet` and `mindpipe search`: drop it")
    if cfg.train.virtual_shards != default.train.virtual_shards and not cfg.train.deterministic:
        raise ConfigError(f"train.virtual_shards={cfg.train.virtual_shards} has no effect with "
                          f"train.deterministic=false; set train.deterministic=true, or drop "
                          f"train.virtual_shards")


def _pipe_is_one(cfg: Config) -> str | None:
    return "parallel.pipe=1" if cfg.parallel.pipe == 1 else None


def _chunk_sync_off(cfg: Config) -> str | None:
    par = cfg.parallel
    if par.pipe == 1:
        return "parallel.pipe=1"
    sync = par.grad_sync if par.grad_sync != "auto" else ("chunk" if par.schedule == "afapab" else "end")
    if sync == "chunk":
        return None
    return f"parallel.grad_sync={par.grad_sync!r}, parallel.schedule={par.schedule!r} (one sync at the end)"


# (keys, what makes them inert -> a description or None, how to make them count). Only
# keys that no command reads under those settings; what one command ignores (the
# supernet section in `mindpipe train`) its command refuses.
_NO_EFFECT: tuple[tuple[tuple[str, ...], typing.Callable[[Config], str | None], str], ...] = (
    (("model.top_k", "model.capacity_factor", "model.moe_aux_weight"),
     lambda c: "model.n_experts=0 (the dense GPT)" if c.model.n_experts == 0 else None,
     "set model.n_experts > 0"),
    (("model.collective_matmul",), lambda c: "parallel.tensor=1" if c.parallel.tensor == 1 else None,
     "set parallel.tensor > 1 (or 0, auto)"),
    (("parallel.schedule", "parallel.virtual_stages", "parallel.stage_remat", "parallel.stage_layers",
      "parallel.grad_sync", "parallel.grad_sync_dtype", "parallel.repartition_after", "parallel.fuse_ticks"),
     _pipe_is_one,
     "set parallel.pipe > 1"),
    (("parallel.fsdp_gather",),
     lambda c: _pipe_is_one(c) or ("parallel.fsdp=1" if c.parallel.fsdp == 1 else None),
     "it says when a pipeline gathers weights sharded over fsdp: set parallel.pipe > 1 and "
     "parallel.fsdp > 1"),
    (("parallel.sync_bucket_mb",), _chunk_sync_off,
     "it sizes the chunk-wise gradient sync of a pipeline: set parallel.grad_sync='chunk'"),
    (tuple(f"tuner.{f.name}" for f in dataclasses.fields(TunerConfig) if f.name != "enabled"),
     lambda c: None if c.tuner.enabled else "tuner.enabled=false", "set tuner.enabled=true"),
)


def check_no_effect(cfg: Config, explicit: typing.Iterable[str]) -> None:
    """Refuse a key in ``explicit`` (dotted names the user set) whose value differs from
    its default but has no effect under the rest of ``cfg``. Values equal to their
    default pass, so a full config file (``mindpipe config > my.toml``) loads."""
    explicit = set(explicit)
    default = Config()
    for keys, inert, fix in _NO_EFFECT:
        for key in keys:
            section, name = key.split(".")
            value = getattr(getattr(cfg, section), name)
            if key not in explicit or value == getattr(getattr(default, section), name):
                continue
            why = inert(cfg)
            if why is not None:
                raise ConfigError(f"{key}={_shown(value)} has no effect with {why}; {fix}, or drop {key}")


def _deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


_DACITE = dacite.Config(strict=True, cast=[tuple])


def _explain_dacite(err: dacite.DaciteError, data: dict[str, Any]) -> str:
    if isinstance(err, dacite.UnexpectedDataError):
        keys = ", ".join(sorted(err.keys))
        section = _find_section_with(data, err.keys)
        where = f"{section}." if section else ""
        valid = _valid_keys(section)
        return f"unknown config key {where}{keys}; valid keys{(' in ' + section) if section else ''}: {valid}"
    if isinstance(err, dacite.WrongTypeError):
        if err.field_path == "supernet.semantics" and semantics_error(err.value):
            return semantics_error(err.value)  # names a renamed value's new name
        if typing.get_origin(err.field_type) is Literal or _is_bool_or_literal(err.field_type):
            valid = ", ".join(str(v).lower() if isinstance(v, bool) else repr(v)
                              for v in _flat_choices(err.field_type))
            return f"config key {err.field_path}={err.value!r} is not valid; valid: {valid}"
        expected = getattr(err.field_type, "__name__", None) or str(err.field_type).replace("typing.", "")
        return f"config key {err.field_path}={err.value!r} has the wrong type; expected {expected}"
    if isinstance(err, dacite.MissingValueError):
        return f"config key {err.field_path} is missing"
    return str(err)


def _is_bool_or_literal(tp) -> bool:
    args = typing.get_args(tp)
    return bool(args) and all(a is bool or typing.get_origin(a) is Literal for a in args)


def _flat_choices(tp) -> list:
    """The values a ``Literal`` or ``bool | Literal[...]`` field takes."""
    if typing.get_origin(tp) is Literal:
        return list(typing.get_args(tp))
    return [v for a in typing.get_args(tp) for v in ((True, False) if a is bool else typing.get_args(a))]


def _find_section_with(data: dict[str, Any], keys) -> str:
    for name, cls in _SECTIONS.items():
        section = data.get(name)
        if isinstance(section, dict) and set(keys) <= set(section) and not set(keys) <= _field_names(cls):
            return name
    return ""


def _valid_keys(section: str) -> str:
    cls = _SECTIONS.get(section, Config)
    return ", ".join(sorted(_field_names(cls)))


def _field_names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


_SECTIONS: dict[str, type] = typing.get_type_hints(Config)


def from_dict(data: dict[str, Any]) -> Config:
    """Build a validated ``Config`` from a nested dictionary (strict: no unknown keys)."""
    if not isinstance(data, dict):
        raise ConfigError(f"config must be a table of sections, got {type(data).__name__}")
    for name, value in data.items():
        if name in _SECTIONS and not isinstance(value, dict):
            raise ConfigError(_not_a_table(name, value))
    try:
        return dacite.from_dict(Config, data, config=_DACITE)
    except dacite.DaciteError as err:
        raise ConfigError(_explain_dacite(err, data)) from None


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Read a TOML file (optional), apply ``key=value`` overrides, validate."""
    tree: dict[str, Any] = Config().to_dict()
    explicit: dict[str, int] = {}
    if path is not None:
        path = Path(path)
        shown = str(path)
        if not path.is_file():
            kind = path_kind(path)
            raise ConfigError(f"config file {shown!r} does not exist" if kind is None else
                              f"config file {shown!r} is {kind}, not a TOML file")
        try:
            update = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"config file {shown!r} is not valid TOML: {err}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"config file {shown!r} is not UTF-8 text") from None
        except OSError as err:
            raise ConfigError(f"config file {shown!r} cannot be read: {err.strerror or err}") from None
        explicit.update(_set_keys(update, layer=0))
        tree = _deep_merge(tree, update)
    return _build(_apply_overrides(tree, overrides, explicit), explicit)


def path_kind(path: str | Path) -> str | None:
    """What is at ``path`` in words ("a directory", "a FIFO (named pipe)", ...); None if nothing."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as err:  # a parent that is a file, a loop of links, no permission
        return f"not reachable ({err.strerror or err})"
    kinds = ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"),
             (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")
