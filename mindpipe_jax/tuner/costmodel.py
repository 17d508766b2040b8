"""EPara's cost model: a candidate's step time from the compiled pieces' FLOPs and
bytes, a per-machine calibration, per-axis collective fits and the pipeline
simulator replaying the fused ticks the runtime runs; corrected by trials.

Inputs, each measured rather than assumed:

* ``ModelCosts`` — for each *piece* of the model (one block's forward; its
  backward under each remat policy; embedding + head + loss, forward and
  backward; the optimizer update of all parameters), compiled on one device:
  FLOPs and bytes accessed (``cost_analysis``), per sequence (row) and per call
  (weights), and the number of kernels the compiled program launches. Each remat
  policy is compiled as such: the forward writing the residuals the policy keeps
  (a step without remat stores every residual; "full" only the inputs) and the
  backward from them. Pieces,
  not the candidate's whole step: a compiled step counts a ``scan`` body (the
  stacked blocks, the pipeline's tick loop) once and a ``cond`` at its dearest
  branch, so its totals miss most of the work (4 blocks counted as 1 here).
* ``Hardware`` — the machine's ``calibrate.Calibration`` (cached per machine):
  matmul rate and memory bandwidth per device with all devices busy and with one
  alone, the fixed cost of a kernel, of a launch and of a loop iteration, and α–β
  fits of all-reduce / all-gather / reduce-scatter / ppermute per axis size.

Compute: each piece costs a roofline *per piece* —
``max(FLOPs / matmul rate, bytes / memory bandwidth) + kernels × kernel cost`` —
the max over the two op classes of one compiled piece (not per HLO op), plus
the sum of its kernels' fixed costs. Pieces are summed as the step runs them:
per microbatch, every block's forward and backward, and the embedding/head;
tensor parallelism divides FLOPs and bytes (not kernels) by ``tensor``. Without
a pipeline a step's compute is that sum at the all-busy rates. With ``pipe > 1``
the schedule is re-timed into fused ticks as the runtime does
(``schedules.fused.fuse``, mode ``"auto"`` unless the config says otherwise) and
the fused ticks are replayed one after another, each as long as its slowest
device, with the devices that have work in a tick sharing the machine
(``CostModel._shared_cores_ticks``): the busy rates are what each device gets when
all compute, so in a tick where a fraction ``a`` of the stages works each of their
devices runs ``1 / a`` times as fast, up to its solo rates (simulated CPU devices
idle in a bubble free the host's cores for the busy ones; on a GPU the two rates
agree). ``shared_cores=False`` keeps the model before it (the larger of the
neighbour replay at solo rates and the devices' mean work at busy rates), which
``benchmarks/costmodel.py`` prints beside it. With ``tensor``
> 1 the stages run in lockstep instead: each fused tick costs every
active branch's work on every device (``CostModel._lockstep_compute``). Either way
each fused tick also moves residual slots (``CostModel._slot_traffic``: the runtime
reads the backward's slot of every residual buffer and writes one back,
``SLOT_MOVES`` slots of the policy's residual bytes per sequence at the all-busy memory
rate), what makes remat "none" the slowest policy in a pipeline on the CPU. The loop runs
one iteration per *fused* tick (not per table tick), and each fused tick pays
its ppermutes.

Communication per step and device (``Calibration.collective_time`` of the axis
size, or the ``Link``'s ring model when no calibration is given): tensor — 4
all-reduces of a microbatch's hidden state per block per microbatch (2 forward,
2 backward, Megatron; 2 more under remat "full") and 2 for the head, in a lockstep
pipeline per active branch per fused tick instead (``_tensor_all_reduces``); pipe — 2
ppermutes of a hidden state per fused tick (4 for a V placement on p > 2);
data — an all-reduce of the device's gradient shard; fsdp — an all-gather of
the parameters and a reduce-scatter of the gradient; expert — 4 all-gathers of
the routed tokens per block per microbatch.

A candidate's prediction is ``coef · (compute, comm, update, 1, ticks)``:
``update`` is the optimizer's piece over the device's parameter shard, ``ticks``
the pipeline's fused ticks (0 without a pipeline); the priors are 1, 1, 1, the
calibrated launch and the calibrated loop iteration.
A supernet job's candidate (``SupernetCandidate``: SPara's step) is priced in the
same five terms from its own compiled pieces (``tuner/supernet_costs.py``, given as
``CostModel(supernet=...)``), so one calibration and one fit serve both.
``observe`` refits the five coefficients by ridge regression towards those
priors from measured trials, so a few fitted layouts teach it what the
micro-benchmarks cannot see (the runtime's per-tick bookkeeping, a step's host
work). How hard the fit is pulled to the priors is chosen by leave-one-out over
the trials (``tuner/costfit.py``): a fit that predicts its own held-out trials
worse than the calibration does is not taken.
``benchmarks/costmodel.py`` measures how it predicts layouts it has not run.

The pieces live beside this module and are re-exported here: ``tuner/pieces.py``
(``Piece``, ``ModelCosts``: the model's compiled pieces, measured) and
``tuner/hardware.py`` (``Hardware``: the machine's rates); this module holds the
prediction (``CostModel``, ``Breakdown``) and ``spearman``, the rank correlation
predictions are judged by.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from mindpipe_jax.parallel.pipeline.plan.memory import SLOT_MOVES, SLOT_MOVES_TWO_READS
from mindpipe_jax.tuner.costfit import fit, leave_one_out_ridge
from mindpipe_jax.tuner.hardware import Hardware
from mindpipe_jax.tuner.pieces import (
    ModelCosts,
    Piece,  # noqa: F401  (what moved stays importable from here)
    count_kernels,  # noqa: F401
)
from mindpipe_jax.tuner.space import V_SCHEDULES, Candidate

FEATURES = ("compute_s", "comm_s", "update_s", "launch", "pipeline_ticks")


@dataclasses.dataclass(frozen=True)
class Breakdown:
    """A candidate's predicted step, by feature (seconds unless said)."""

    compute_s: float  # critical path of compute, pipeline bubbles included
    comm_s: dict  # axis -> seconds
    iterations: int  # loop iterations (accumulated microbatches or fused pipeline ticks)
    step_s: float  # the corrected total
    bubble_fraction: float = 0.0
    update_s: float = 0.0

    @property
    def comm_total(self) -> float:
        return sum(self.comm_s.values())


class CostModel:
    """Predicts candidates' step times; ``observe`` folds in measured trials.

    Implements the step-model protocol the online tuner uses:
    ``step_time(candidate) -> seconds`` and ``observe(candidate, seconds)``.
    ``fuse_mode``: how the runtime re-times a pipeline's table (``parallel.fuse_ticks``).
    ``pipeline_tensor_split``: whether ``tensor`` divides a pipeline stage's work. It
    does: inside the pipeline's ``shard_map`` the stage code's weights stay sharded
    over ``tensor`` (the compiled t2 p4 step's MLP dots are [rows, d_ff / 2]). What
    costs is that with ``tensor`` > 1 the stages run in *lockstep*
    (``runtime.spmd.needs_lockstep``): every device runs every task kind some device
    runs in the tick (``_lockstep_compute``); False models the stage work unsplit
    and per-device branches (the model before lockstep was counted)."""

    def __init__(self, costs: ModelCosts | None, hardware: Hardware, seq_len: int, ridge: float | None = None,
                 fuse_mode: str = "auto", pipeline_tensor_split: bool = True, supernet=None,
                 shared_cores: bool = True, slot_traffic: bool = True):
        self.costs, self.hw, self.seq_len = costs, hardware, seq_len
        self.shared_cores, self.slot_traffic = shared_cores, slot_traffic
        self.supernet = supernet  # a SupernetCosts: prices SupernetCandidates (tuner/supernet_costs.py)
        self.fuse_mode = fuse_mode
        self.pipeline_tensor_split = pipeline_tensor_split
        self.prior = np.array([1.0, 1.0, 1.0, hardware.launch_s, hardware.iteration_s])
        self.coef = self.prior.copy()
        self.ridge = ridge  # None: chosen by leave-one-out (``observe``)
        self.ridge_used: float | None = None  # the ridge of the current fit
        self.observed: list[tuple[Candidate, float]] = []
        self._cache: dict[Candidate, tuple] = {}
        self._plans: dict = {}

    # ---------------------------------------------------------------- features
    def fused_schedule(self, c: Candidate):
        """The fused ticks the runtime runs for ``c`` (``pipe > 1``)."""
        from mindpipe_jax.parallel.pipeline import get_schedule
        from mindpipe_jax.parallel.pipeline.schedules.fused import fuse

        return fuse(get_schedule(c.schedule, c.pipe, c.microbatches, c.virtual_stages), self.fuse_mode)

    def _stage_costs(self, c: Candidate, rows_mb: float, solo: bool):
        from mindpipe_jax.sim import even_assignment
        from mindpipe_jax.sim.costs import StageCosts

        k, hw = self.costs, self.hw
        stages = c.pipe * c.virtual_stages
        per_stage = [0] * stages
        for g in even_assignment(k.n_layers, stages):
            per_stage[g] += 1
        split = c.tensor if self.pipeline_tensor_split else 1
        f1 = hw.piece_time(k.piece(f"layer_F:{c.remat}"), rows_mb, split=split, solo=solo)
        b1 = hw.piece_time(k.piece(f"layer_BW:{c.remat}"), rows_mb, split=split, solo=solo)
        rf = hw.piece_time(k.piece("rest_F"), rows_mb, split=split, solo=solo)
        rb = hw.piece_time(k.piece("rest_BW"), rows_mb, split=split, solo=solo)
        F = [n * f1 for n in per_stage]
        BW = [n * b1 for n in per_stage]
        # embedding on the first global stage, head + loss on the last (their split is
        # not measured separately; half each is close for a small vocabulary)
        F[0] += 0.5 * rf
        F[-1] += 0.5 * rf
        BW[0] += 0.5 * rb
        BW[-1] += 0.5 * rb
        return StageCosts(F=F, B=[b / 2 for b in BW], W=[b / 2 for b in BW], BW=BW)

    def _compute(self, c: Candidate) -> tuple[float, float, int]:
        """(compute seconds, bubble fraction, loop iterations)."""
        k, hw = self.costs, self.hw
        rows_mb = c.global_batch / (c.batch_shards * c.microbatches)
        if c.pipe == 1:
            per_mb = (k.n_layers * (hw.piece_time(k.piece(f"layer_F:{c.remat}"), rows_mb, split=c.tensor)
                                    + hw.piece_time(k.piece(f"layer_BW:{c.remat}"), rows_mb, split=c.tensor))
                      + hw.piece_time(k.piece("rest_F"), rows_mb, split=c.tensor)
                      + hw.piece_time(k.piece("rest_BW"), rows_mb, split=c.tensor))
            return c.microbatches * per_mb, 0.0, c.microbatches
        if self._lockstep(c):
            compute, bubble, ticks = self._lockstep_compute(c, rows_mb)
            return compute + ticks * self._slot_traffic(c, rows_mb), bubble, ticks
        step, bubble, ticks = self._tick_compute(c, rows_mb)
        return step + ticks * self._slot_traffic(c, rows_mb), bubble, ticks

    def _slot_traffic(self, c: Candidate, rows_mb: float) -> float:
        """Seconds a fused tick spends moving residual slots: the runtime reads, every
        tick, the slot of each residual buffer that its backward reads and writes one
        back (the F's, or a spare), whatever the tasks: ``SLOT_MOVES`` slot moves; in
        lockstep it reads the F's slot too, ``SLOT_MOVES_TWO_READS`` (``plan.memory``,
        ``runtime/ticks.py``; ``benchmarks/pipeline_remat.py`` measures it). A slot holds
        one microbatch's residuals of a chunk's layers under the policy ("full": none
        here, its stage input lives in another, tiny buffer). Streamed at the all-busy
        memory rate; 0 without a calibration or a measured residual size."""
        per_row = (self.costs.residual_bytes_per_row or {}).get(c.remat, 0.0)
        cal = self.hw.calibration
        if not self.slot_traffic or cal is None or per_row <= 0:
            return 0.0
        layers_per_chunk = self.costs.n_layers / (c.pipe * c.virtual_stages)
        moves = SLOT_MOVES_TWO_READS if self._lockstep(c) else SLOT_MOVES
        return moves * rows_mb * layers_per_chunk * per_row / cal.mem_busy

    def _tick_compute(self, c: Candidate, rows_mb: float) -> tuple[float, float, int]:
        """A pipeline in per-device branches: (compute, bubble fraction, fused ticks)."""
        from mindpipe_jax.sim.engine import simulate

        fused = self.fused_schedule(c)
        solo_costs = self._stage_costs(c, rows_mb, solo=True)
        busy_costs = self._stage_costs(c, rows_mb, solo=False)
        busy = simulate(fused, busy_costs, mode="neighbour")
        pooled = sum(busy.busy) / len(busy.busy)  # every device's work at the all-busy rate
        if self.shared_cores:
            step = self._shared_cores_ticks(fused, solo_costs, busy_costs)
        else:
            step = max(simulate(fused, solo_costs, mode="neighbour").step_time, pooled)
        bubble = 1.0 - pooled / step if step > 0 else 0.0
        return step, bubble, fused.num_ticks

    @staticmethod
    def _shared_cores_ticks(fused, solo, busy) -> float:
        """The fused ticks one after another, each as long as its slowest device, with
        the devices that have work in a tick sharing the machine: the all-busy rates
        are what each device gets when every device computes, so with a fraction ``a``
        of the stages busy each of their devices runs ``1 / a`` times as fast, up to
        the rate of a device alone (on a GPU busy and solo rates agree and this is the
        plain lockstep replay). Every stage has the same number of devices (its data,
        fsdp and tensor replicas), so ``a`` is the fraction of stages with a task."""
        from mindpipe_jax.parallel.pipeline.schedules import Kind

        sched = fused.schedule

        def work(costs, s, cell) -> float:
            return sum({Kind.F: costs.F, Kind.B: costs.B, Kind.W: costs.W, Kind.BW: costs.BW}[task.kind]
                       [sched.global_stage(s, task.chunk)] for task in cell if task is not None)

        total = 0.0
        for row in fused.cells:
            active = [s for s, cell in enumerate(row) if any(task is not None for task in cell)]
            share = len(active) / len(row)
            total += max((max(work(busy, s, row[s]) * share, work(solo, s, row[s])) for s in active),
                         default=0.0)
        return total

    def _lockstep_compute(self, c: Candidate, rows_mb: float) -> tuple[float, float, int]:
        """A pipeline in lockstep: every device runs every branch some device takes in a
        fused tick (``parallel/pipeline/plan/lockstep.py``), at the all-busy rates (no device idles, so none
        frees a core)."""
        from mindpipe_jax.parallel.pipeline.plan.lockstep import lockstep_ticks_seconds

        plan = self._lockstep_plan(c)
        sc = self._stage_costs(c, rows_mb, solo=False)
        total = lockstep_ticks_seconds(plan, sc)
        useful = c.microbatches * (sum(sc.F) + sum(sc.BW)) / c.pipe  # a device's mean share
        bubble = 1.0 - useful / total if total > 0 else 0.0
        return total, max(bubble, 0.0), plan.num_ticks

    def _lockstep(self, c: Candidate) -> bool:
        """Whether ``c``'s pipeline runs its stages in lockstep (tensor > 1;
        ``runtime.spmd.needs_lockstep``), as this model counts it."""
        return c.pipe > 1 and self.pipeline_tensor_split and c.tensor > 1

    def _lockstep_plan(self, c: Candidate):
        """The tick plan as the runtime makes it in lockstep (``pipeline_grads``' defaults)."""
        from mindpipe_jax.parallel.pipeline import get_schedule
        from mindpipe_jax.parallel.pipeline.runtime.tickplan import make_plan

        if c not in self._plans:
            self._plans[c] = make_plan(get_schedule(c.schedule, c.pipe, c.microbatches, c.virtual_stages),
                                       c.remat, self.fuse_mode, merge_first=True, merge_last=True)
        return self._plans[c]

    def _tensor_all_reduces(self, c: Candidate) -> float:
        """All-reduces over ``tensor`` one device runs per step (Megatron: 2 per block in
        a forward, 2 in a backward, 2 more when remat "full" re-runs the forward; 1 for
        the head each way). In a lockstep pipeline every device runs every branch some
        device takes in a tick, collectives included, so they are counted per active
        branch per fused tick (a branch's stage as wide as the widest), not per
        microbatch: t2 p4 m4 compiles to 80 in the tick loop against 24 per microbatch."""
        from mindpipe_jax.parallel.pipeline.runtime.tickplan import LAST
        from mindpipe_jax.parallel.pipeline.schedules import Kind

        k = self.costs
        back = 4 if c.remat == "full" else 2
        if not self._lockstep(c):
            return c.microbatches * ((2 + back) * k.n_layers / c.pipe + 2)
        plan = self._lockstep_plan(c)
        width = math.ceil(k.n_layers / (c.pipe * c.virtual_stages))

        def count(kind, pos) -> float:
            head = 0.0 if pos == LAST and not plan.merge_last else 1.0  # MID has none; EITHER may
            if kind is Kind.F:
                return 2 * width + head
            if kind is Kind.W:
                return 0.0
            return back * width + head

        return sum(float((part.active() @ np.array([count(kind, pos) for kind, pos, _ in part.keys])).sum())
                   for part in plan.parts if part.keys)

    def _update(self, c: Candidate) -> float:
        """The optimizer over this device's parameter shard (all-busy rates)."""
        shards = c.tensor * c.pipe * c.fsdp * c.expert
        return self.hw.piece_time(self.costs.piece("update"), 0.0, split=shards)

    def _comm(self, c: Candidate) -> dict:
        k, hw = self.costs, self.hw
        rows_mb = c.global_batch / (c.batch_shards * c.microbatches)
        hidden = rows_mb * k.hidden_bytes_per_row
        layers_here = k.n_layers / c.pipe
        out = {}
        if c.tensor > 1:
            out["tensor"] = self._tensor_all_reduces(c) * hw.collective("all-reduce", c.tensor, hidden)
        if c.pipe > 1:
            ticks = self.fused_schedule(c).num_ticks
            sends = 4 if (c.schedule in V_SCHEDULES and c.pipe > 2) else 2
            out["pipe"] = sends * ticks * hw.collective("ppermute", c.pipe, hidden / c.tensor)
        grad = k.param_bytes / (c.tensor * c.pipe * c.expert)
        if c.data > 1:
            out["data"] = hw.collective("all-reduce", c.data, grad / c.fsdp)
        if c.fsdp > 1:
            out["fsdp"] = (hw.collective("all-gather", c.fsdp, grad)
                           + hw.collective("reduce-scatter", c.fsdp, grad))
        if c.expert > 1 and k.expert_tokens_factor:
            routed = hidden * k.expert_tokens_factor
            count = c.microbatches * 4 * layers_here
            out["expert"] = count * hw.collective("all-gather", c.expert, routed)
        return out

    def _parts(self, c) -> tuple:
        if c not in self._cache:
            if not isinstance(c, Candidate):  # a supernet job's SupernetCandidate
                if self.supernet is None:
                    raise ValueError(f"{c.label()}: a supernet candidate needs CostModel(supernet="
                                     f"SupernetCosts.measure(cfg))")
                self._cache[c] = self.supernet.parts(c, self.hw)
            else:
                compute, bubble, iters = self._compute(c)
                self._cache[c] = (compute, bubble, iters, self._comm(c), self._update(c))
        return self._cache[c]

    def features(self, c: Candidate) -> np.ndarray:
        """``FEATURES`` of ``c``. The loop-iteration term counts the pipeline's fused
        ticks only: a tick runs the runtime's bookkeeping (buffer slots, a branch
        per part) besides its tasks, while an accumulated microbatch's cost is its
        pieces' kernels, already in the compute term."""
        compute, _, iters, comm, update = self._parts(c)
        ticks = float(iters) if getattr(c, "pipe", 1) > 1 else 0.0
        return np.array([compute, sum(comm.values()), update, 1.0, ticks])

    # ------------------------------------------------------------- prediction
    def breakdown(self, c: Candidate) -> Breakdown:
        compute, bubble, iters, comm, update = self._parts(c)
        step = float(max(self.features(c) @ self.coef, 1e-9))
        return Breakdown(compute, dict(comm), iters, step, bubble, update)

    def step_time(self, c: Candidate) -> float:
        return self.breakdown(c).step_s

    def observe(self, c: Candidate, seconds: float) -> None:
        """Add a measured step time and refit the coefficients (``tuner/costfit.py``:
        relative errors, a ridge pull towards the priors of ``self.ridge``, or when
        that is None the one leave-one-out over the trials picks)."""
        if not (seconds > 0 and math.isfinite(seconds)):
            return
        self.observed.append((c, float(seconds)))
        X = np.stack([self.features(cand) for cand, _ in self.observed])
        y = np.array([s for _, s in self.observed])
        ridge = self.ridge if self.ridge is not None else leave_one_out_ridge(X, y, self.prior)
        self.ridge_used = ridge
        self.coef = fit(X, y, self.prior, ridge)

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
