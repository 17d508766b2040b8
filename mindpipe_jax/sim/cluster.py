"""A GPT-class model on a GPU cluster, in the simulator's terms: analytic costs
per layer, links per mesh axis, and the predicted step time, per-GPU FLOP rate
and memory of a 3D-parallel (tensor × pipe × data) layout.

Costs of one transformer layer on one GPU of a tensor-parallel group of ``t``
(Megatron-LM's layout: attention heads and MLP columns split over ``t``,
activations replicated, full activation recompute):

* forward FLOPs per microbatch of ``b`` sequences: ``(24 b s h² + 4 b s² h) / t``
  (QKV, scores, weighted values, output projection, two MLP matmuls); the
  backward is twice the forward and the recompute another forward, so a fused
  backward task costs three forwards of compute;
* seconds = FLOPs / (peak × ``efficiency``): one assumed achievable fraction of
  the peak for all of a layer's kernels, whatever ``t`` and ``b``;
* tensor-parallel all-reduces of the ``b s h`` activation (2 bytes) over ``t`` GPUs
  on the node's NVLink: two in the forward, two in the backward and two in the
  recompute. ``tp_overlap=False`` adds them to the task (XLA/Megatron's blocking
  all-reduces). ``tp_overlap=True`` models collective matmuls
  (``parallel/overlap.py``): each all-reduce runs as ``t`` ring steps under the
  matmuls, so only one step in ``t`` is exposed, plus whatever the layer's
  compute cannot cover;
* the logits (``2 b s h V / t``) are on the last stage, the embedding lookup is free.

Gradient bytes. Each GPU syncs its own shard of each gradient (``params / t``
elements of its layers), ``Layout3D.grad_bytes`` bytes per element on the wire:
a figure the caller passes, by default what the runtime sends (4: fp32,
``parallel.grad_sync_dtype="fp32"``; 2 for bf16). ``program_bytes.
measure_grad_bytes_per_element`` reads it from a compiled pipeline program
(data-axis bytes sent per step over the gradient elements), so a prediction can
describe the program that runs.

Links, α–β (``Link``): NVLink for the tensor axis; the pipeline's
point-to-point sends (``b s h / t``, 2 bytes, per GPU, Megatron's scatter/gather)
and the data-parallel gradient sync (rings over ``d`` GPUs) go between nodes
through a NIC shared by ``nic_sharing`` GPUs, so each GPU gets ``nic_Bps /
nic_sharing``. Sends and syncs share that lane with sends first
(``contention="priority"``: a send preempts a running bucket, which resumes after
it, as NCCL interleaves a collective's chunks with the pipeline's sends).

The replay is ``engine.simulate(mode="async")`` (an MPMD executor, as
Megatron-LM runs). The schedules (``predict``'s ``schedule``):

* ``"megatron"``: interleaved 1F1B (1F1B for ``v = 1``), every gradient all-reduced
  after the flush (``DPSync(when="end")``), optimizer state replicated;
* ``"megatron-overlap"``: the same schedule with Megatron-LM's distributed optimizer,
  ``--overlap-grad-reduce`` and ``--overlap-param-gather``: each chunk's gradient in
  buckets of ``max(40M, 1M × d)`` elements (Megatron-core's default bucket size),
  each bucket reduce-scattered as soon as its last gradient is ready in the chunk's
  last backward (``DPSync(when="buckets", kind="reduce-scatter")``); the updated
  bf16 parameters (``param_bytes`` per element) all-gathered behind the next step's
  forward (``param_gather="forward"``: a chunk's first forward waits for its
  chunk's all-gather, which runs on the lane from the step's start);
* ``"afapab"``: all forwards, then all backwards chunk by chunk in reverse; each
  chunk's gradient all-reduced (the runtime's ring: reduce-scatter + all-gather)
  from its last backward on, beside the remaining compute
  (``DPSync(when="overlap")``), in slices of ``bucket_bytes``; optimizer state
  replicated, as the runtime's ``grad_sync="chunk"`` runs without fsdp.

Memory per GPU (``memory_per_gpu``), checked against ``usable_fraction`` of the
GPU's memory:

* per parameter of the GPU's shard (its ``layers / p`` layers over ``t``, plus the
  ``V h / t`` embedding on an end stage): Megatron with the distributed optimizer
  ``6 + 12 / d`` bytes (bf16 weights, fp32 gradient buffer, fp32 master weights
  and Adam moments sharded over ``d``); Megatron without it ``18``; AFAPAB as the
  runtime keeps it ``16`` (fp32 weights, gradients and both moments);
* stored stage inputs (full recompute): the schedule's peak live microbatch-chunks
  × ``b s h`` × 2 bytes (AFAPAB holds all ``m v`` of them);
* one layer's recompute + backward working set, Korthikanti et al.'s
  ``s b h (10 + 24 / t + 5 a s / (h t))`` bytes, and on the last stage the fp32
  logits and their gradient, ``8 b s V / t``.

The FLOP rate is Megatron-LM's: ``96 B s l h² (1 + s/(6h) + V/(16 l h))`` per
step (which counts the recomputed forward) over GPUs × step time.

Pure Python; nothing here imports JAX.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from mindpipe_jax.errors import ConfigError
from mindpipe_jax.parallel.pipeline.schedules import Schedule, get_schedule
from mindpipe_jax.sim import even_assignment
from mindpipe_jax.sim.costs import LayerCost, StageCosts
from mindpipe_jax.sim.engine import SimResult, simulate
from mindpipe_jax.sim.network import Collective, DPSync, Link

__all__ = ["GPTShape", "ClusterSpec", "Layout3D", "Prediction", "layer_cost", "predict", "memory_per_gpu",
           "megatron_bucket_elems", "step_lower_bound", "SCHEDULES", "GPT3_2_7B", "GPT3_6_7B", "GPT3_13B",
           "V100_CLOUD", "H100_400G"]


@dataclass(frozen=True)
class GPTShape:
    """A decoder-only transformer: ``layers`` blocks of width ``hidden``."""

    name: str
    layers: int
    hidden: int
    heads: int
    seq_len: int = 2048
    vocab: int = 51200

    @property
    def layer_params(self) -> int:
        return 12 * self.hidden ** 2 + 13 * self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + (self.vocab + self.seq_len) * self.hidden

    def layer_flops(self, b: int) -> float:
        """Forward FLOPs of one layer for ``b`` sequences."""
        s, h = self.seq_len, self.hidden
        return 24.0 * b * s * h * h + 4.0 * b * s * s * h

    def logit_flops(self, b: int) -> float:
        return 2.0 * b * self.seq_len * self.hidden * self.vocab

    def step_flops(self, batch: int) -> float:
        """Megatron-LM's count for a step of ``batch`` sequences with full recompute."""
        s, h, n, V = self.seq_len, self.hidden, self.layers, self.vocab
        return 96.0 * batch * s * n * h * h * (1 + s / (6 * h) + V / (16 * n * h))


GPT3_2_7B = GPTShape("GPT-3 2.7B", layers=32, hidden=2560, heads=32)
GPT3_6_7B = GPTShape("GPT-3 6.7B", layers=32, hidden=4096, heads=32)
GPT3_13B = GPTShape("GPT-3 13B", layers=40, hidden=5120, heads=40)


@dataclass(frozen=True)
class ClusterSpec:
    """GPU nodes: NVLink inside a node, one shared NIC between nodes."""

    name: str = "V100 cloud"
    gpus_per_node: int = 8
    peak_flops: float = 125e12          # fp16 tensor cores
    efficiency: float = 0.40            # assumed achievable fraction of peak for a layer's kernels
    memory_bytes: float = 32 * 2**30
    nvlink_Bps: float = 130e9           # NCCL all-reduce bus bandwidth inside a node
    nvlink_latency_s: float = 10e-6
    nic_Bps: float = 25e9 / 8           # 25 Gbit/s per node
    nic_latency_s: float = 50e-6
    nic_sharing: int = 8                # GPUs whose inter-node traffic shares the NIC at once
    usable_fraction: float = 0.90       # of memory_bytes: the rest for the CUDA context, NCCL, fragmentation

    @property
    def flop_rate(self) -> float:
        return self.peak_flops * self.efficiency

    @property
    def intra(self) -> Link:
        return Link(self.nvlink_latency_s, self.nvlink_Bps)

    @property
    def inter(self) -> Link:
        """One GPU's share of the node's NIC."""
        return Link(self.nic_latency_s, self.nic_Bps / self.nic_sharing)


V100_CLOUD = ClusterSpec()
# H100 SXM nodes whose 8 GPUs share one 400 Gbit/s link between nodes (the V100 cloud's
# arrangement, 16x the bandwidth); bf16 dense peak, NCCL's all-reduce bus bandwidth on NVLink 4.
H100_400G = ClusterSpec(name="H100 400G", peak_flops=989e12, efficiency=0.40, memory_bytes=80 * 2**30,
                        nvlink_Bps=360e9, nvlink_latency_s=8e-6, nic_Bps=400e9 / 8, nic_latency_s=20e-6)


@dataclass(frozen=True)
class Layout3D:
    """Tensor ``t`` (inside a node) × pipe ``p`` × data ``d``; ``v`` chunks per
    pipeline device; ``microbatch`` sequences per microbatch."""

    t: int
    p: int
    d: int
    v: int = 2
    microbatch: int = 1
    global_batch: int = 512
    grad_bytes: float = 4.0             # bytes per gradient element on the wire, per element of the
    #                                     GPU's own shard: 4 = fp32 (the runtime's default), 2 = bf16;
    #                                     program_bytes.measure_grad_bytes_per_element measures it
    act_bytes: int = 2                  # bytes per activation element (bf16 / fp16)
    bucket_bytes: float = 25e6          # AFAPAB's sync slices (PyTorch DDP's default bucket)
    param_bytes: float = 2.0            # bytes per weight all-gathered by Megatron's distributed optimizer
    bucket_elems: float | None = None   # Megatron's bucket; None = max(40M, 1M x d), Megatron-core's default

    @property
    def gpus(self) -> int:
        return self.t * self.p * self.d

    @property
    def microbatches(self) -> int:
        return self.global_batch // (self.d * self.microbatch)


@dataclass(frozen=True)
class Prediction:
    schedule: str
    layout: Layout3D
    step_s: float
    tflops_per_gpu: float
    compute_s: float                    # when the last compute task ends
    dp_sync_s: float                    # one GPU's gradient all-reduce on a free link
    tp_exposed_s: float                 # tensor-parallel comm inside the tasks, per GPU and step
    memory_bytes: float                 # parameters + optimizer + activations, per GPU (memory_per_gpu)
    sim: SimResult = field(repr=False)
    fits: bool = True                   # memory_bytes <= the GPU's usable memory


def _tp_allreduce(shape: GPTShape, cluster: ClusterSpec, layout: Layout3D) -> float:
    n = layout.microbatch * shape.seq_len * shape.hidden * layout.act_bytes
    return Collective(layout.t, cluster.intra).time(n)


def layer_cost(shape: GPTShape, cluster: ClusterSpec, layout: Layout3D, *,
               tp_overlap: bool = False) -> tuple[LayerCost, float]:
    """One layer's ``LayerCost`` on one GPU and the tensor-parallel seconds its
    F + BW expose (see the module docstring)."""
    t, b = layout.t, layout.microbatch
    fwd = shape.layer_flops(b) / t / cluster.flop_rate
    ar = _tp_allreduce(shape, cluster, layout)

    def exposed(count: int, compute: float) -> float:
        comm = count * ar
        if not tp_overlap or t == 1:
            return comm
        return comm / t + max(0.0, comm * (t - 1) / t - compute)

    f_tp, bw_tp = exposed(2, fwd), exposed(4, 3 * fwd)
    F, BW = fwd + f_tp, 3 * fwd + bw_tp
    params = shape.layer_params / t
    act = b * shape.seq_len * shape.hidden * layout.act_bytes / t
    return (LayerCost(F=F, B=BW / 2, W=BW / 2, BW=BW, activation_bytes=act,
                      param_bytes=params * layout.grad_bytes), f_tp + bw_tp)


SCHEDULES = ("megatron", "megatron-overlap", "afapab")


@functools.lru_cache(maxsize=512)
def _table(kind: str, p: int, m: int, v: int) -> Schedule:
    return get_schedule(kind, p, m, v)   # a layout search builds the same tables many times


def _schedule(name: str, layout: Layout3D) -> Schedule:
    p, m, v = layout.p, layout.microbatches, layout.v
    if name in ("megatron", "megatron-overlap"):
        return _table("interleaved" if v > 1 else "1f1b", p, m, v)
    if name == "afapab":
        return _table("afapab", p, m, v)
    raise ConfigError(f"schedule must be one of {', '.join(map(repr, SCHEDULES))}, got {name!r}")


def megatron_bucket_elems(layout: Layout3D) -> float:
    """Megatron's bucket (elements): ``layout.bucket_elems`` or Megatron-core's default
    ``max(40M, 1M x d)`` (larger data-parallel groups get larger buckets so the
    collectives are not latency-bound)."""
    return layout.bucket_elems if layout.bucket_elems is not None else max(40e6, 1e6 * layout.d)


def _dp_sync(schedule: str, cluster: ClusterSpec, layout: Layout3D) -> DPSync | None:
    if layout.d == 1:
        return None
    link = cluster.inter
    if schedule == "megatron":
        return DPSync(layout.d, link, "end", slice_bytes=layout.bucket_bytes)
    if schedule == "megatron-overlap":
        return DPSync(layout.d, link, "buckets", kind="reduce-scatter",
                      slice_bytes=megatron_bucket_elems(layout) * layout.grad_bytes, param_gather="forward",
                      gather_ratio=layout.param_bytes / layout.grad_bytes)
    return DPSync(layout.d, link, "overlap", slice_bytes=layout.bucket_bytes)


def _stage_params(shape: GPTShape, layout: Layout3D) -> float:
    """Parameters on the busiest GPU: its layers' shards and the embedding of an end stage."""
    layers = shape.layers / layout.p * shape.layer_params
    return (layers + (shape.vocab + shape.seq_len) * shape.hidden) / layout.t


def memory_per_gpu(shape: GPTShape, layout: Layout3D, schedule: str, sched: Schedule) -> float:
    """Bytes one GPU holds at its peak (module docstring): weights, gradients and
    optimizer state, stored stage inputs, one layer's working set and the logits."""
    t, b, s, h = layout.t, layout.microbatch, shape.seq_len, shape.hidden
    per_param = {"megatron": 18.0, "megatron-overlap": 6.0 + 12.0 / layout.d, "afapab": 16.0}[schedule]
    stored = max(sched.peak_live_activations()) * b * s * h * layout.act_bytes
    working = s * b * h * (10 + 24 / t + 5 * shape.heads * s / (h * t))
    logits = 8.0 * b * s * shape.vocab / t
    return per_param * _stage_params(shape, layout) + stored + working + logits


def _costs(shape: GPTShape, cluster: ClusterSpec, layout: Layout3D, G: int, tp_overlap: bool):
    layer, tp_layer = layer_cost(shape, cluster, layout, tp_overlap=tp_overlap)
    b, t = layout.microbatch, layout.t
    logit = shape.logit_flops(b) / t / cluster.flop_rate
    emb_params = shape.vocab * shape.hidden / t * layout.grad_bytes
    head = LayerCost(F=logit, B=logit, W=logit, BW=2 * logit, param_bytes=emb_params)
    positions = shape.seq_len * shape.hidden * layout.grad_bytes
    embed = LayerCost(0.0, 0.0, 0.0, param_bytes=emb_params + positions)
    costs = StageCosts.from_layers(layer, even_assignment(shape.layers, G), G, embed=embed, head=head)
    return costs, tp_layer


def _check(shape: GPTShape, cluster: ClusterSpec, layout: Layout3D) -> None:
    if layout.global_batch % (layout.d * layout.microbatch):
        raise ConfigError(f"global batch {layout.global_batch} is not a multiple of d x microbatch")
    if layout.t > cluster.gpus_per_node:
        raise ConfigError(f"tensor parallelism t={layout.t} must fit in a node "
                          f"({cluster.gpus_per_node} GPUs)")
    if shape.heads % layout.t:
        raise ConfigError(f"tensor parallelism t={layout.t} must divide the {shape.heads} attention heads")
    if shape.layers % (layout.p * layout.v):
        raise ConfigError(f"{shape.layers} layers do not split evenly into p x v = {layout.p * layout.v} "
                          f"stages")


def step_lower_bound(shape: GPTShape, cluster: ClusterSpec, layout: Layout3D, schedule: str, *,
                     tp_overlap: bool = False) -> float:
    """Seconds no step of this layout can go below: for each GPU, its compute (its tasks'
    durations, tensor-parallel time included) plus the chain of forwards and transfers
    its first task waits for, the chain of backwards and transfers that must follow its
    last, and the sync that can only start after its last; and each GPU's network lane
    (its pipeline sends and its data-parallel sync on a free link), all of which fits
    inside the step. The layout search prunes with it."""
    _check(shape, cluster, layout)
    if schedule not in SCHEDULES:
        raise ConfigError(f"schedule must be one of {', '.join(map(repr, SCHEDULES))}, got {schedule!r}")
    p, m, G = layout.p, layout.microbatches, layout.p * layout.v
    costs, _ = _costs(shape, cluster, layout, G, tp_overlap)
    sync = _dp_sync(schedule, cluster, layout)
    link = cluster.inter
    compute = network = 0.0
    for s in range(p):
        # a device holds global stages s, s + p, ... (interleaved and AFAPAB alike)
        mine = range(s, G, p)
        # In 1F1B, interleaved and AFAPAB alike a device's first task is the F of its
        # chunk 0 (global stage s) and its last the BW of it: before the first, the forwards
        # of stages 0..s-1 of that microbatch run one after another elsewhere; after the
        # last, the backwards of stages s-1..0 (tests check the bound against simulations)
        # the s hops of each chain cross devices: a transfer each way
        hops = sum(2 * link.time(costs.activation_bytes[g]) for g in range(s))
        busy = m * sum(costs.F[g] + costs.BW[g] for g in mine)
        # after its last BW (chunk 0's) the device's lane still carries, at least: every
        # sync ("end"), chunk 0's ("overlap"), chunk 0's last bucket ("buckets")
        tail = 0.0
        if sync is not None:
            if sync.when == "end":
                tail = sum(sync.time(costs.param_bytes[g]) for g in mine)
            elif sync.when == "overlap":
                tail = sync.time(costs.param_bytes[s])
            elif (last := sync.slices(costs.param_bytes[s])):
                tail = sync.collective.time(last[-1])
        before = sum(costs.F[:s]) + hops / 2
        if sync is not None and sync.param_gather == "forward":   # its first F waits for chunk 0's gather
            before = max(before, sync.gather_time(costs.param_bytes[s]))
        compute = max(compute, before + busy + sum(costs.BW[:s]) + hops / 2 + tail)
        sends = sum(link.occupancy(costs.activation_bytes[g]) for g in mine if g < G - 1 and p > 1) \
            + sum(link.occupancy(costs.activation_bytes[g - 1]) for g in mine if g > 0 and p > 1)
        syncs = 0.0 if sync is None else sum(sync.time(costs.param_bytes[g]) for g in mine)
        network = max(network, m * sends + syncs)
    return max(compute, network)


def predict(shape: GPTShape, cluster: ClusterSpec, layout: Layout3D, schedule: str, *,
            tp_overlap: bool = False, contention: bool | str = "priority") -> Prediction:
    """Simulate one training step of ``shape`` on ``layout`` (``schedule``: one of
    ``SCHEDULES``, see the module docstring) and return its step time, FLOP rate and
    memory. ``contention`` as ``engine.simulate`` (default: sends before syncs)."""
    _check(shape, cluster, layout)
    sched = _schedule(schedule, layout)
    G = sched.num_global_stages
    costs, tp_layer = _costs(shape, cluster, layout, G, tp_overlap)
    sync = _dp_sync(schedule, cluster, layout)
    sim = simulate(sched, costs, link=cluster.inter, dp_sync=sync, mode="async", contention=contention)
    device_grad = max(sum(costs.param_bytes[sched.global_stage(s, c)] for c in range(layout.v))
                      for s in range(layout.p))
    dp_s = 0.0 if sync is None else sync.time(device_grad)
    memory = memory_per_gpu(shape, layout, schedule, sched)
    flops = shape.step_flops(layout.global_batch)
    return Prediction(schedule, layout, sim.step_time, flops / layout.gpus / sim.step_time / 1e12,
                      sim.compute_time, dp_s, tp_layer * shape.layers / layout.p * layout.microbatches,
                      memory, sim, memory <= cluster.usable_fraction * cluster.memory_bytes)
