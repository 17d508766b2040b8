"""EPara's cost model: a candidate's step time from FLOPs, an α–β network and the
pipeline simulator, corrected by what real trials measured.

Three inputs, each measured rather than assumed:

* ``ModelCosts`` — FLOPs per sequence of one block (forward; backward with each
  remat policy) and of the embedding + head, read by ``cost_analysis`` from
  programs compiled for one block (``parallel.pipeline.profile``: the whole
  model's compiled step counts a ``scan`` body once, so it cannot give these),
  plus the parameter and hidden-state sizes.
* ``Hardware`` — the FLOP rate each device reaches while all of them compute at
  once and while it computes alone (simulated CPU devices share the host's
  cores, so a pipeline's idle devices speed up the busy ones; on a GPU the two
  rates are equal), the α–β link of
  an all-reduce across the devices, and the fixed cost of launching a step and
  of one loop iteration (an accumulated microbatch or a pipeline tick).
  ``Hardware.calibrate`` measures them with micro-benchmarks.
* the schedule — with ``pipe > 1`` the tick-synchronous runtime is replayed by the
  simulator (``mode="neighbour"``) at the solo rate, which adds the bubbles; the
  compute time is the larger of that critical path and all devices' work at the
  all-busy rate (what shared cores can deliver at best).

A candidate's prediction is ``a·compute + b·comm + c0 + c1·iterations`` with the
breakdown's four features; ``a = b = 1`` and ``c0``, ``c1`` from the calibration
until trials are observed, after which ``observe`` refits the four coefficients
by ridge regression towards those priors (so one trial cannot swing the model
far, and many trials make it the trials' least-squares fit).

Communication per step and device, for ``r`` ranks of an axis (``Collective``):
tensor — 4 all-reduces of a microbatch's hidden state per layer per microbatch
(2 forward, 2 backward, Megatron) and 2 for the head; pipe — 2 ``ppermute`` of a
hidden state per tick; data — an all-reduce of the device's gradient shard;
fsdp — an all-gather of the parameters and a reduce-scatter of the gradient;
expert — 4 all-to-alls of the routed tokens per layer per microbatch.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Sequence

import numpy as np

from mindpipe_jax.config import Config
from mindpipe_jax.sim.network import Collective, Link
from mindpipe_jax.tuner.space import Candidate

FEATURES = ("compute_s", "comm_s", "launch", "iterations")


@dataclasses.dataclass(frozen=True)
class ModelCosts:
    """FLOPs per sequence (row) and sizes of the reference model."""

    n_layers: int
    layer_fwd: float
    layer_bwd: dict  # remat policy -> backward FLOPs of one block (recompute included)
    rest_fwd: float  # embedding + head + loss
    rest_bwd: float
    param_bytes: float
    hidden_bytes_per_row: float  # one sequence's hidden state (what tensor/pipe collectives move)
    expert_tokens_factor: float = 0.0  # routed copies per token (top_k x capacity) for MoE, else 0

    def layer_total(self, remat: str) -> float:
        return self.layer_fwd + self.layer_bwd[remat]

    def step_flops(self, rows: int, remat: str = "none") -> float:
        return rows * (self.n_layers * self.layer_total(remat) + self.rest_fwd + self.rest_bwd)

    @classmethod
    def measure(cls, cfg: Config, rows: int = 2, model=None) -> ModelCosts:
        """Compile one block, the embedding and the head for ``rows`` sequences on one
        device and read their FLOPs (per row). ``model``: a user's factory ``rngs ->
        nnx.Module`` measured instead of ``cfg.model`` (its stack's unit, prologue and
        epilogue, as the pipeline splits it)."""
        from mindpipe_jax.parallel.pipeline.plan.profile import measure_layer_costs


        m = cfg.model
        experts = m.n_experts
        # The profiler measures the dense GPT's block; an MoE block is measured as its
        # dense twin with the layer FLOPs scaled by the active-parameter ratio (top_k
        # expert MLPs + router; dispatch einsums are routing overhead the trials see).
        dense = dataclasses.replace(m, n_experts=0) if experts else m
        prof = measure_layer_costs(dense, microbatch=rows, repeats=1, dots=True, model=model)
        if model is not None:
            experts = 0  # measured as it is
        f = {k: v / rows for k, v in prof.flops.items()}
        if experts:
            from mindpipe_jax.models import gpt, moe

            ratio = moe.flops_per_token(m) / gpt.flops_per_token(dense)
            f = {k: v * ratio if k.startswith("layer_") else v for k, v in f.items()}
        bwd = {"none": f["layer_BW"], "dots": f.get("layer_BW_dots", f["layer_BW"]),
               "full": f["layer_BW"] + f["layer_F"]}
        params = sum(layer.param_bytes for layer in prof.layers) + prof.embed.param_bytes \
            + prof.head.param_bytes
        if experts:  # the dense twin has one MLP per block; the MoE block has n_experts and a router
            params += 4.0 * m.n_layers * ((experts - 1) * 2 * m.d_model * m.ff_dim + m.d_model * experts)
        factor = m.top_k * m.capacity_factor if experts else 0.0
        return cls(len(prof.layers), f["layer_F"], bwd, f["embed_F"] + f["head_F"],
                   f["embed_BW"] + f["head_BW"], params, prof.layers[0].activation_bytes / rows, factor)


def _median_seconds(fn, *args, repeats: int = 5) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Per-device FLOP rate (all devices busy), the collective link, launch costs."""

    flop_rate: float
    link: Link
    solo_rate: float  # one device computing alone (CPU devices then get the idle cores)
    launch_s: float  # one step's fixed cost (dispatch, optimizer, host sync)
    iteration_s: float  # one loop iteration's fixed cost (microbatch or pipeline tick)
    memory_bytes: float = math.inf
    note: str = ""

    @classmethod
    def calibrate(cls, devices=None, *, memory_bytes: float = math.inf, repeats: int = 5) -> Hardware:
        """Measure the four numbers on ``devices`` (all of them at once)."""
        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        from mindpipe_jax.sim.comm import fit_collective

        devices = list(jax.devices() if devices is None else devices)
        n = len(devices)
        mesh = jax.sharding.Mesh(np.asarray(devices), ("all",))
        shard = NamedSharding(mesh, P("all"))
        size, depth = 128, 8
        x = jax.device_put(jnp.ones((n * 8, size, size), jnp.float32), shard)

        @jax.jit
        def matmuls(x):
            def body(_, h):
                return jnp.tanh(h @ h) * 0.5
            return jax.lax.fori_loop(0, depth, body, x)

        per_device_flops = 8 * depth * 2 * size ** 3
        rate = per_device_flops / _median_seconds(matmuls, x, repeats=repeats)
        alone = jax.device_put(jnp.ones((8, size, size), jnp.float32), devices[0])
        solo = per_device_flops / _median_seconds(matmuls, alone, repeats=repeats)

        sizes, times = [], []
        for elems in (1 << 10, 1 << 18):
            buf = jax.device_put(jnp.ones((n, elems), jnp.float32), shard)
            allreduce = jax.jit(jax.shard_map(lambda b: jax.lax.psum(b, "all"), mesh=mesh,
                                              in_specs=P("all"), out_specs=P("all")))
            sizes.append(4.0 * elems)
            times.append(_median_seconds(allreduce, buf, repeats=repeats))
        link = fit_collective("all-reduce", n, sizes, times) if n > 1 else Link()

        tiny = jax.device_put(jnp.ones((n, 8), jnp.float32), shard)
        launch = _median_seconds(jax.jit(lambda b: b * 2.0 + 1.0), tiny, repeats=repeats)
        loops = 64

        @jax.jit
        def loop(b):
            return jax.lax.fori_loop(0, loops, lambda _, h: jnp.sin(h) + 1.0, b)

        iteration = max(0.0, (_median_seconds(loop, tiny, repeats=repeats) - launch) / loops)
        kind = devices[0].device_kind
        note = (f"{n} x {kind}: {rate / 1e9:.2f} GFLOP/s per device with all busy, {solo / 1e9:.2f} "
                f"alone, all-reduce link "
                f"α={link.latency_s * 1e6:.0f} µs bw={link.bandwidth_Bps / 1e9:.2f} GB/s, launch "
                f"{launch * 1e3:.2f} ms, loop iteration {iteration * 1e6:.0f} µs")
        return cls(rate, link, max(solo, rate), launch, iteration, memory_bytes, note)


@dataclasses.dataclass(frozen=True)
class Breakdown:
    """A candidate's predicted step, by feature (seconds unless said)."""

    compute_s: float  # critical path of compute, pipeline bubbles included
    comm_s: dict  # axis -> seconds
    iterations: int  # loop iterations (accumulated microbatches or pipeline ticks)
    step_s: float  # the corrected total
    bubble_fraction: float = 0.0

    @property
    def comm_total(self) -> float:
        return sum(self.comm_s.values())


class CostModel:
    """Predicts candidates' step times; ``observe`` folds in measured trials.

    Implements the step-model protocol the online tuner uses:
    ``step_time(candidate) -> seconds`` and ``observe(candidate, seconds)``."""

    def __init__(self, costs: ModelCosts, hardware: Hardware, seq_len: int, ridge: float = 0.1):
        self.costs, self.hw, self.seq_len = costs, hardware, seq_len
        self.prior = np.array([1.0, 1.0, hardware.launch_s, hardware.iteration_s])
        self.coef = self.prior.copy()
        self.ridge = ridge
        self.observed: list[tuple[Candidate, float]] = []

    # ---------------------------------------------------------------- features
    def _compute(self, c: Candidate) -> tuple[float, float, int]:
        """(critical-path seconds at the calibrated rate, bubble fraction, iterations)."""
        k = self.costs
        shards = c.batch_shards
        rows_mb = c.global_batch / (shards * c.microbatches)
        rate = self.hw.flop_rate
        if c.pipe == 1:
            flops = k.step_flops(c.global_batch // shards, c.remat) / c.tensor
            return flops / rate, 0.0, c.microbatches
        from mindpipe_jax.parallel.pipeline import get_schedule
        from mindpipe_jax.sim import even_assignment
        from mindpipe_jax.sim.costs import StageCosts
        from mindpipe_jax.sim.engine import simulate

        sched = get_schedule(c.schedule, c.pipe, c.microbatches, c.virtual_stages)
        stages = sched.num_global_stages
        per_stage = [0] * stages
        for g in even_assignment(k.n_layers, stages):
            per_stage[g] += 1
        scale = rows_mb / c.tensor / rate
        F = [n * k.layer_fwd * scale for n in per_stage]
        BW = [n * k.layer_bwd[c.remat] * scale for n in per_stage]
        # embedding on the first global stage, head + loss on the last (their split is
        # not measured separately; half each is close for a small vocabulary)
        F[0] += 0.5 * k.rest_fwd * scale
        F[-1] += 0.5 * k.rest_fwd * scale
        BW[0] += 0.5 * k.rest_bwd * scale
        BW[-1] += 0.5 * k.rest_bwd * scale
        stage_costs = StageCosts(F=F, B=[b / 2 for b in BW], W=[b / 2 for b in BW], BW=BW)
        sim = simulate(sched, stage_costs, mode="neighbour")
        busy = sum(sim.busy) / len(sim.busy)
        bubble = 1.0 - busy / sim.step_time if sim.step_time > 0 else 0.0
        critical = sim.step_time * rate / self.hw.solo_rate
        pooled = busy  # every device's work at the all-busy rate, run side by side
        return max(critical, pooled), bubble, sched.num_ticks

    def _comm(self, c: Candidate) -> dict:
        k, link = self.costs, self.hw.link
        shards = c.batch_shards
        rows_mb = c.global_batch / (shards * c.microbatches)
        hidden = rows_mb * k.hidden_bytes_per_row
        layers_here = k.n_layers / c.pipe
        out = {}
        if c.tensor > 1:
            count = c.microbatches * (4 * layers_here + 2)
            out["tensor"] = count * Collective(c.tensor, link).time(hidden)
        if c.pipe > 1:
            from mindpipe_jax.parallel.pipeline import get_schedule
            ticks = get_schedule(c.schedule, c.pipe, c.microbatches, c.virtual_stages).num_ticks
            out["pipe"] = 2 * ticks * link.time(hidden / c.tensor)
        grad = k.param_bytes / (c.tensor * c.pipe * c.expert)
        if c.data > 1:
            out["data"] = Collective(c.data, link).time(grad / c.fsdp)
        if c.fsdp > 1:
            out["fsdp"] = (Collective(c.fsdp, link, "all-gather").time(grad)
                           + Collective(c.fsdp, link, "reduce-scatter").time(grad))
        if c.expert > 1 and k.expert_tokens_factor:
            routed = hidden * k.expert_tokens_factor
            count = c.microbatches * 4 * layers_here
            out["expert"] = count * Collective(c.expert, link, "all-gather").time(routed)
        return out

    def features(self, c: Candidate) -> np.ndarray:
        compute, _, iters = self._compute(c)
        return np.array([compute, sum(self._comm(c).values()), 1.0, float(iters)])

    # ------------------------------------------------------------- prediction
    def breakdown(self, c: Candidate) -> Breakdown:
        compute, bubble, iters = self._compute(c)
        comm = self._comm(c)
        x = np.array([compute, sum(comm.values()), 1.0, float(iters)])
        return Breakdown(compute, comm, iters, float(max(x @ self.coef, 1e-9)), bubble)

    def step_time(self, c: Candidate) -> float:
        return self.breakdown(c).step_s

    def observe(self, c: Candidate, seconds: float) -> None:
        """Add a measured step time and refit the coefficients by ridge regression
        towards the prior. Compute and comm coefficients are multipliers (prior 1);
        the fixed costs are measured in units of the mean observed step, so trials
        can teach the model an overhead the micro-benchmarks did not see (on
        simulated CPU devices a step's hundreds of small kernels cost more than
        one trivial launch). All coefficients stay >= 0."""
        if not (seconds > 0 and math.isfinite(seconds)):
            return
        self.observed.append((c, float(seconds)))
        X = np.stack([self.features(cand) for cand, _ in self.observed])
        y = np.array([s for _, s in self.observed])
        ybar = float(np.mean(y))
        scale = np.array([1.0, 1.0, ybar, ybar / 10])  # a fixed cost of ~ybar, an iteration ~ybar/10
        u0 = self.prior / scale
        Z = X * scale
        lam = self.ridge * ybar ** 2
        A = np.vstack([Z, math.sqrt(lam) * np.eye(len(FEATURES))])
        b = np.concatenate([y, math.sqrt(lam) * u0])
        u, *_ = np.linalg.lstsq(A, b, rcond=None)
        self.coef = np.maximum(u, 0.0) * scale

    def rank(self, candidates: Sequence[Candidate]) -> list[tuple[Candidate, Breakdown]]:
        """Candidates by predicted step time per sample (fastest first)."""
        scored = [(c, self.breakdown(c)) for c in candidates]
        return sorted(scored, key=lambda cb: cb[1].step_s / cb[0].global_batch)


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman rank correlation (average ranks for ties)."""
    def ranks(x):
        x = np.asarray(x, float)
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x), dtype=float)
        for value in np.unique(x):  # ties share their mean rank
            tie = x == value
            r[tie] = r[tie].mean()
        return r
    ra, rb = ranks(a), ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return 0.0
    return float(np.corrcoef(ra, rb)[0, 1])
