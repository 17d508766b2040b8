"""The six sections of a training run: ``model``, ``data``, ``parallel``, ``optim``,
``train`` and ``distributed``, frozen dataclasses with their defaults, each checking
its own keys in ``__post_init__``, and the constants they are checked against.

The supernet and tuner sections are in ``config_supernet_tuner``; the whole
``Config`` and its loading in ``config_load``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from mindpipe_jax.atomic_write import control_character_reason
from mindpipe_jax.config_values import _check, _check_numbers, _positive

MESH_AXES = ("data", "fsdp", "tensor", "pipe", "subnet", "expert")
STAGE_REMAT_POLICIES = ("none", "dots", "full")  # the pipeline runtime's (tickplan.REMAT_POLICIES)
# Simulated CPU devices: XLA:CPU compiles a trivial sharded program over 256 / 512 /
# 1024 / 2048 devices in about 3 / 7 / 15 / 54 s (2 cores) and refuses 4096 ("Multiprocess
# computations aren't implemented"); a training step takes minutes well before that.
MAX_SIMULATED_DEVICES = 1024
TOKEN_FILE_EXTENSIONS = (".npy", ".bin")  # data.path with one of these selects data.source="tokens"


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
    # Compute dtype; float16 compiles on GPUs only (refused on CPU: train/step_checks.py).
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
        _check(0.0 <= self.val_fraction < 1.0,
               f"data.val_fraction={self.val_fraction} must be in [0, 1) (0: no validation split, for a "
               f"run with train.eval_every=0)")
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
    # up to 2p - 1); "in-order", "forward-ahead", "fill" (W's only into bubbles), "slack"
    # (each W where its device would wait for a busier one anyway) as in
    # mindpipe_jax/parallel/pipeline/schedules/fused.py.
    fuse_ticks: Literal["auto", "table", "in-order", "forward-ahead", "fill", "slack"] = "auto"
    # Zero-bubble schedules (zb-h1, zbv, dualpipev) split a backward into B and W so
    # that W can wait; only the last microbatches' W's fill a bubble (the drain). -1
    # splits every backward (the paper's table); k >= 0 splits only the last k
    # microbatches' and runs the others' as one fused backward: better where B + W
    # cost more than the fused vjp (benchmarks/split_cost.py measures it); k = pipe is a
    # good start.
    split_last: int = -1
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
        _check(self.split_last >= -1, f"parallel.split_last={self.split_last} must be -1 (split every "
               f"backward) or >= 0 (split only the last that many microbatches')")
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

    @property
    def grad_sync_mode(self) -> str:
        """``grad_sync`` with "auto" resolved: chunk-wise for AFAPAB, at the end otherwise."""
        if self.grad_sync != "auto":
            return self.grad_sync
        return "chunk" if self.schedule == "afapab" else "end"


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
        # Adam divides by sqrt(v) + eps: with eps <= 0 a weight whose gradient is exactly
        # zero (an embedding row no batch has used) gets 0/0 = NaN on the first step.
        _check(self.eps > 0, f"optim.eps={self.eps} must be > 0 (e.g. 1e-8): Adam divides by "
                             f"sqrt(v) + eps, and a weight with a zero gradient would become NaN")


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
        odd = control_character_reason(self.out_dir)
        _check(odd is None, f"train.out_dir {self.out_dir!r} {odd}; give a directory name without them")
        if self.out_dir.startswith("~"):  # a TOML string is no shell word: "~/runs" made a "~" directory
            object.__setattr__(self, "out_dir", os.path.expanduser(self.out_dir))


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
