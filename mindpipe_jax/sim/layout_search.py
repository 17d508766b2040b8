"""The best 3D layout (t, p, d, microbatch, v) of a GPT on a cluster, by simulation.

``search(shape, cluster, gpus, schedule)`` enumerates the valid layouts
(``candidates``) and simulates (``cluster.predict``) those whose memory fits
(``cluster.memory_per_gpu``), in order of a lower bound on their step time
(``cluster.step_lower_bound``: each GPU's compute with the forward and backward
chains around it, and its network lane's sends and syncs, each of which fits in
the step): once that bound reaches the best step time found, no later layout can
beat it, so the search stops there. The answer is the one simulating every
candidate would give.

Valid layouts: ``t`` a power of two inside a node dividing the heads; ``p``
dividing the layers; ``d = gpus / (t p)``; ``microbatch`` dividing ``global_batch
/ d``; ``v`` with ``p v`` dividing the layers; Megatron's schedules take ``v > 1``
only with ``p > 1`` and, interleaved, ``m`` a multiple of ``p`` (Megatron-LM's
rules; ``schedules.get_schedule`` refuses the rest); AFAPAB needs ``p > 1``, as the
runtime's chunk-wise sync does (``parallel.grad_sync`` has no effect at ``pipe=1``).

Pure Python; nothing here imports JAX.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from mindpipe_jax.errors import ConfigError
from mindpipe_jax.sim import cluster as simcluster
from mindpipe_jax.sim.cluster import ClusterSpec, GPTShape, Layout3D, Prediction

__all__ = ["SearchResult", "candidates", "search"]


@dataclass(frozen=True)
class SearchResult:
    best: Prediction | None        # None: no valid layout fits in memory
    candidates: int                # valid layouts
    over_memory: int               # of those reached before the bound stopped the search, over memory
    simulated: int                 # how many were simulated


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def candidates(shape: GPTShape, cluster: ClusterSpec, gpus: int, *, global_batch: int = 512,
               microbatches=(1, 2, 4), vs=(1, 2, 4, 8), base: Layout3D | None = None) -> list[Layout3D]:
    """Every valid layout of ``gpus`` GPUs (module docstring), before the schedule's own
    rules. ``base`` supplies the other fields (bytes per element, buckets)."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ConfigError(f"gpus must be an integer >= 1, got {gpus!r}")
    base = base or Layout3D(t=1, p=1, d=1)
    out = []
    t = 1
    while t <= min(cluster.gpus_per_node, gpus):
        if shape.heads % t == 0:
            for p in _divisors(shape.layers):
                if gpus % (t * p):
                    continue
                d = gpus // (t * p)
                for b in microbatches:
                    if global_batch % (d * b):
                        continue
                    for v in vs:
                        if shape.layers % (p * v) == 0:
                            out.append(replace(base, t=t, p=p, d=d, v=v, microbatch=b,
                                               global_batch=global_batch))
        t *= 2
    return out


def _refused(schedule: str, layout: Layout3D) -> bool:
    """The schedule's own rules: Megatron interleaves only across pipeline stages and
    needs ``m`` a multiple of ``p`` to (Megatron-LM's and ``schedules.interleaved``'s
    rule); the runtime's AFAPAB needs ``pipe > 1`` (its chunk-wise sync is off at pipe=1)."""
    p, v, m = layout.p, layout.v, layout.microbatches
    if schedule == "afapab":
        return p == 1
    return v > 1 and (p == 1 or m % p != 0)


def search(shape: GPTShape, cluster: ClusterSpec, gpus: int, schedule: str, *, tp_overlap: bool = False,
           global_batch: int = 512, microbatches=(1, 2, 4), vs=(1, 2, 4, 8),
           base: Layout3D | None = None) -> SearchResult:
    """The layout with the highest predicted per-GPU FLOP rate that fits in memory."""
    if schedule not in simcluster.SCHEDULES:
        raise ConfigError(f"schedule must be one of {', '.join(map(repr, simcluster.SCHEDULES))}, "
                          f"got {schedule!r}")
    bounded = []
    for layout in candidates(shape, cluster, gpus, global_batch=global_batch, microbatches=microbatches,
                             vs=vs, base=base):
        if _refused(schedule, layout):
            continue
        lb = simcluster.step_lower_bound(shape, cluster, layout, schedule, tp_overlap=tp_overlap)
        bounded.append((lb, layout))
    bounded.sort(key=lambda x: (x[0], x[1].t, x[1].p, x[1].v, x[1].microbatch))
    usable = cluster.usable_fraction * cluster.memory_bytes
    best, over, simulated = None, 0, 0
    for lb, layout in bounded:
        if best is not None and lb >= best.step_s:
            break                       # sorted: no later layout can beat the best either
        sched = simcluster._schedule(schedule, layout)
        if simcluster.memory_per_gpu(shape, layout, schedule, sched) > usable:
            over += 1
            continue
        pred = simcluster.predict(shape, cluster, layout, schedule, tp_overlap=tp_overlap)
        simulated += 1
        if best is None or pred.step_s < best.step_s:
            best = pred
    return SearchResult(best, len(bounded), over, simulated)
