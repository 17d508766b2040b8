"""A GPT-class model on a GPU cluster, in the simulator's terms: analytic costs
per layer, links per mesh axis, and the predicted step time and per-GPU FLOP rate
of a 3D-parallel (tensor × pipe × data) layout.

Costs of one transformer layer on one GPU of a tensor-parallel group of ``t``
(Megatron-LM's layout: attention heads and MLP columns split over ``t``,
activations replicated, full activation recompute):

* forward FLOPs per microbatch of ``b`` sequences: ``(24 b s h² + 4 b s² h) / t``
  (QKV, scores, weighted values, output projection, two MLP matmuls); the
  backward is twice the forward and the recompute another forward, so a fused
  backward task costs three forwards of compute;
* seconds = FLOPs / (peak × ``efficiency``): one assumed achievable fraction of
  the peak for all of a layer's kernels;
* tensor-parallel all-reduces of the ``b s h`` activation (fp16) over ``t`` GPUs
  on the node's NVLink: two in the forward, two in the backward and two in the
  recompute. ``tp_overlap=False`` adds them to the task (XLA/Megatron's blocking
  all-reduces). ``tp_overlap=True`` models collective matmuls
  (``parallel/overlap.py``): each all-reduce runs as ``t`` ring steps under the
  matmuls, so only one step in ``t`` is exposed, plus whatever the layer's
  compute cannot cover;
* the logits (``2 b s h V / t``) are on the last stage, the embedding lookup is free.

Links, α–β (``Link``): NVLink for the tensor axis; the pipeline's
point-to-point sends (``b s h / t`` fp16 per GPU, Megatron's scatter/gather) and
the data-parallel gradient all-reduce (a ring over ``d`` GPUs, fp16 gradients)
go between nodes through a NIC shared by ``nic_sharing`` GPUs, so each GPU gets
``nic_Bps / nic_sharing``. Sends and syncs share that lane (``contention``).

The replay is ``engine.simulate(mode="async")`` (an MPMD executor, as
Megatron-LM runs): Megatron's baseline is interleaved 1F1B with every gradient
all-reduced after the flush (``DPSync(when="end")``); AFAPAB runs all forwards,
then all backwards chunk by chunk in reverse, each chunk's sync starting after
its last backward on a communication stream (``DPSync(when="overlap")``), in
buckets.

The FLOP rate is Megatron-LM's: ``96 B s l h² (1 + s/(6h) + V/(16 l h))`` per
step (which counts the recomputed forward) over GPUs × step time.

Pure Python; nothing here imports JAX.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mindpipe_jax.errors import ConfigError
from mindpipe_jax.parallel.pipeline.schedules import Schedule, get_schedule
from mindpipe_jax.sim import even_assignment
from mindpipe_jax.sim.costs import LayerCost, StageCosts
from mindpipe_jax.sim.engine import SimResult, simulate
from mindpipe_jax.sim.network import Collective, DPSync, Link

__all__ = ["GPTShape", "ClusterSpec", "Layout3D", "Prediction", "layer_cost", "predict", "GPT3_2_7B",
           "GPT3_6_7B", "V100_CLOUD"]


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
    grad_bytes: int = 2                 # bytes per gradient element on the wire (fp16)
    act_bytes: int = 2                  # bytes per activation element (fp16)
    bucket_bytes: float = 25e6          # data-parallel sync bucket (PyTorch DDP's default)

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
    memory_bytes: float                 # parameters + optimizer + stored stage inputs, per GPU
    sim: SimResult = field(repr=False)


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


def _schedule(name: str, layout: Layout3D) -> Schedule:
    p, m, v = layout.p, layout.microbatches, layout.v
    if name == "megatron":
        return get_schedule("interleaved" if v > 1 else "1f1b", p, m, v)
    if name == "afapab":
        return get_schedule("afapab", p, m, v)
    raise ConfigError(f"schedule must be 'megatron' or 'afapab', got {name!r}")


def predict(shape: GPTShape, cluster: ClusterSpec, layout: Layout3D, schedule: str, *,
            tp_overlap: bool = False) -> Prediction:
    """Simulate one training step of ``shape`` on ``layout`` (``schedule``:
    ``"megatron"`` or ``"afapab"``) and return its step time and FLOP rate."""
    if layout.global_batch % (layout.d * layout.microbatch):
        raise ConfigError(f"global batch {layout.global_batch} is not a multiple of d x microbatch")
    if layout.t > cluster.gpus_per_node:
        raise ConfigError(f"tensor parallelism t={layout.t} must fit in a node "
                          f"({cluster.gpus_per_node} GPUs)")
    sched = _schedule(schedule, layout)
    G = sched.num_global_stages
    if shape.layers % G:
        raise ConfigError(f"{shape.layers} layers do not split evenly into p x v = {G} stages")
    layer, tp_layer = layer_cost(shape, cluster, layout, tp_overlap=tp_overlap)
    b, t = layout.microbatch, layout.t
    logit = shape.logit_flops(b) / t / cluster.flop_rate
    emb_params = shape.vocab * shape.hidden / t * layout.grad_bytes
    head = LayerCost(F=logit, B=logit, W=logit, BW=2 * logit, param_bytes=emb_params)
    positions = shape.seq_len * shape.hidden * layout.grad_bytes
    embed = LayerCost(0.0, 0.0, 0.0, param_bytes=emb_params + positions)
    costs = StageCosts.from_layers(layer, even_assignment(shape.layers, G), G, embed=embed, head=head)
    sync = None
    if layout.d > 1:
        sync = DPSync(ranks=layout.d, link=cluster.inter, when="end" if schedule == "megatron" else "overlap",
                      slice_bytes=layout.bucket_bytes)
    sim = simulate(sched, costs, link=cluster.inter, dp_sync=sync, mode="async", contention=True)
    device_grad = max(sum(costs.param_bytes[sched.global_stage(s, c)] for c in range(layout.v))
                      for s in range(layout.p))
    dp_s = 0.0 if sync is None else sync.time(device_grad)
    per_gpu_params = shape.params / (t * layout.p)
    stored = max(sched.peak_live_activations()) * b * shape.seq_len * shape.hidden * layout.act_bytes
    memory = 16.0 * per_gpu_params + stored   # fp16 weights and grads, fp32 master, Adam m and v
    flops = shape.step_flops(layout.global_batch)
    return Prediction(schedule, layout, sim.step_time, flops / layout.gpus / sim.step_time / 1e12,
                      sim.compute_time, dp_s, tp_layer * shape.layers / layout.p * layout.microbatches,
                      memory, sim)

