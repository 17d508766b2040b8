"""The offline tuner: enumerate → predict → compile the most promising → measure
the top few → rank by entropyput.

``tune`` ranks every valid candidate of the space by predicted entropyput
(samples/s × statistical efficiency of its batch). Then, ``measure`` times, it
takes the next candidate not yet measured (the best predicted, after one trial of
each global batch still in contention: ``trial_order``), compiles it on abstract
shapes (an infeasible one — over the memory budget, or refused by the compiler —
is skipped with its reason; while its batch has no trial yet, the same layout with
more remat is tried next: ``lighter_twins``), runs it for a few real steps and feeds the time
back into the cost model, which re-predicts every row before the next pick.
The measured candidates are then timed again in ``rounds - 1`` interleaved
rounds (median of all), so that the choice does not rest on one noisy trial. At
most ``max_compile`` candidates are compiled; what is left of that budget checks
the memory of the next best rows. Every row is returned with what is known
about it. The chosen configuration is the best *measured* one: a
prediction only decides what is worth measuring.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import jax

from mindpipe_jax.config import Config
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.models.bridge import nnx_model
from mindpipe_jax.train.memory_fit import room_now
from mindpipe_jax.train.step_checks import check_user_model_keys
from mindpipe_jax.tuner.aot import Feasibility, FeasibilityCache, memory_floor, mib
from mindpipe_jax.tuner.costmodel import Breakdown, CostModel, Hardware, ModelCosts
from mindpipe_jax.tuner.facts import facts_of
from mindpipe_jax.tuner.noise import efficiency
from mindpipe_jax.tuner.space import REMATS, Candidate, SpaceReport, enumerate_space
from mindpipe_jax.tuner.trial import Trial


@dataclasses.dataclass
class Row:
    candidate: Candidate
    predicted: Breakdown
    efficiency: float
    feasibility: Feasibility | None = None  # None = not compiled (ranked too low)
    measured_s: float | None = None

    @property
    def predicted_entropyput(self) -> float:
        return self.candidate.global_batch / self.predicted.step_s * self.efficiency

    @property
    def measured_entropyput(self) -> float | None:
        if self.measured_s is None:
            return None
        return self.candidate.global_batch / self.measured_s * self.efficiency

    def to_dict(self) -> dict:
        f = self.feasibility
        return {"candidate": self.candidate.to_dict(), "label": self.candidate.label(),
                "predicted_s": self.predicted.step_s, "compute_s": self.predicted.compute_s,
                "comm_s": self.predicted.comm_s, "bubble": self.predicted.bubble_fraction,
                "measured_s": self.measured_s, "efficiency": self.efficiency,
                "predicted_entropyput": self.predicted_entropyput,
                "measured_entropyput": self.measured_entropyput,
                "fits": None if f is None else f.fits, "peak_bytes": None if f is None else f.peak_bytes,
                "reason": "" if f is None else f.reason}


@dataclasses.dataclass
class TuneResult:
    rows: list[Row]  # ranked: measured first (by measured entropyput), then by prediction
    space: SpaceReport
    hardware: Hardware
    b_noise: float | None
    b0: int
    cache_hits: int = 0
    cache_misses: int = 0

    @property
    def best(self) -> Row:
        return self.rows[0]

    def unmeasured_ahead(self, margin: float = 1.1) -> Row | None:
        """The best-predicted row not measured (nor known infeasible), if its predicted
        entropyput beats the chosen row's measured one by more than ``margin``: the choice
        rests on measurements, so a better prediction is only worth a trial."""
        best = self.best
        if best.measured_s is None:
            return None
        top = next((r for r in self.rows if r.measured_s is None
                    and (r.feasibility is None or r.feasibility.fits)), None)
        if top is None or top.predicted_entropyput <= margin * best.measured_entropyput:
            return None
        return top

    def table(self, limit: int = 15) -> str:
        """A readable ranked table (MiB, ms, samples/s)."""
        head = (f"{'#':>2}  {'configuration':44s} {'pred ms':>8} {'meas ms':>8} {'MiB/dev':>8} "
                f"{'eff':>5} {'entropyput':>10}  note")
        lines = [head, "-" * len(head)]
        for i, r in enumerate(self.rows[:limit], 1):
            f = r.feasibility
            mem = f"{f.peak_bytes / 2**20:8.1f}" if f is not None and f.peak_bytes else f"{'-':>8}"
            meas = f"{r.measured_s * 1e3:8.1f}" if r.measured_s is not None else f"{'-':>8}"
            ent = r.measured_entropyput if r.measured_s is not None else r.predicted_entropyput
            note = "measured" if r.measured_s is not None else ("predicted" if f is None or f.fits else
                                                                  f"infeasible: {f.reason[:50]}")
            lines.append(f"{i:>2}  {r.candidate.label():44s} {r.predicted.step_s * 1e3:8.1f} {meas} "
                         f"{mem} {r.efficiency:5.2f} {ent:10.1f}  {note}")
        return "\n".join(lines)


def trial_order(rows: Sequence[Row], explore: float) -> list[Row]:
    """The rows not yet measured (and not known infeasible) in the order trials take them.

    Greedy by predicted entropyput, except that a global batch no trial has run yet
    comes first while its best row predicts at least ``explore`` x the best entropyput
    known (a measured one or a prediction). Why: the efficiency of a batch is known from
    the noise scale, but how its step time grows with the batch is the cost model's
    weakest part (a per-row cost and a fixed per-step cost that trials at one batch
    cannot tell apart; in the memory-bound benchmark the calibrated model put B64 at
    1.3-1.7x its measured time). One trial per contending batch lets the refit learn that
    before the batch is decided."""
    live = [r for r in rows if r.measured_s is None and (r.feasibility is None or r.feasibility.fits)]
    live.sort(key=lambda r: -r.predicted_entropyput)
    if not live or explore <= 0:
        return live
    known = [r.measured_entropyput for r in rows if r.measured_s is not None]
    top = max(known + [live[0].predicted_entropyput])
    tried = {r.candidate.global_batch for r in rows if r.measured_s is not None}
    best_of: dict[int, float] = {}
    for r in live:
        best_of.setdefault(r.candidate.global_batch, r.predicted_entropyput)
    contenders = {b for b, e in best_of.items() if b not in tried and e >= explore * top}
    return ([r for r in live if r.candidate.global_batch in contenders]
            + [r for r in live if r.candidate.global_batch not in contenders])


def lighter_twins(row: Row, rows: Sequence[Row]) -> list[Row]:
    """The rows that differ from ``row`` only by a policy further along ``REMATS``
    (none, dots, full: less kept between forward and backward), the nearest first:
    what a user retries with when a layout runs out of memory."""
    by_candidate = {r.candidate: r for r in rows}
    order = REMATS[REMATS.index(row.candidate.remat) + 1:] if row.candidate.remat in REMATS else ()
    twins = (by_candidate.get(dataclasses.replace(row.candidate, remat=r)) for r in order)
    return [t for t in twins if t is not None]


def _room_for(row, trials: dict, devices, log) -> bool:
    """Whether ``row``'s trial fits in what its devices have free now. The measured trials
    are kept (state, batch, program) for the interleaved re-timing rounds, and each
    candidate was judged against the budget alone: on a host or an accelerator where one
    state is a large share of it, the kept ones together could leave too little for the
    next, an out-of-memory kill mid-search. They are released first (their first round's
    times stand); a candidate that still cannot fit is marked so and skipped."""
    need = row.feasibility.peak_bytes
    room = room_now(devices[:row.candidate.devices])
    if need <= room:
        return True
    if trials:
        labels = ", ".join(t.candidate.label() for t in trials.values())
        trials.clear()  # their arrays go with them
        log(f"released the kept trials of {labels} to make room for {row.candidate.label()} "
            f"({need / 2**20:.1f} MiB per device, {room / 2**20:.1f} MiB free): they keep their first "
            f"round's times")
        room = room_now(devices[:row.candidate.devices])
        if need <= room:
            return True
    row.feasibility = dataclasses.replace(row.feasibility, fits=False, reason=(
        f"needs {need / 2**20:.1f} MiB per device, {room / 2**20:.1f} MiB free when its trial was due"))
    log(f"infeasible: {row.candidate.label()}: {row.feasibility.reason}")
    return False


def tune(cfg: Config, *, num_devices: int | None = None, budget_bytes: float = math.inf,
         global_batches: Sequence[int] | None = None,
         axes: Sequence[str] | None = None,
         microbatches: Sequence[int] = (1, 2, 4), schedules: Sequence[str] = ("1f1b", "interleaved"),
         virtual_stages: Sequence[int] = (1, 2), remats: Sequence[str] = ("none", "full"),
         max_compile: int = 8, measure: int = 3, trial_steps: int = 5, rounds: int = 3,
         explore: float = 0.5, b_noise: float | None = None,
         b0: int | None = None, model=None, cache_path: str | None = None, hardware: Hardware | None = None,
         costs: ModelCosts | None = None, log: Callable[[str], None] = print) -> TuneResult:
    """Search the space of ``cfg``'s model on ``num_devices`` devices (default: all).
    ``axes`` default: data, fsdp, tensor, pipe, and expert for an MoE model.
    ``explore``: see ``trial_order`` (0 measures strictly by prediction)."""
    devices = jax.devices()
    n = num_devices or len(devices)
    if n > len(devices):
        raise ConfigError(f"tune: num_devices={n} but only {len(devices)} devices are present")
    if max_compile < 1 or measure < 0:
        raise ConfigError(f"tune: max_compile={max_compile} must be >= 1 and measure={measure} >= 0")
    if not 0 <= explore <= 1:
        raise ConfigError(f"tune: explore={explore} must be between 0 and 1")
    devices = devices[:n]
    model = nnx_model(model, cfg.model.seq_len)  # a Linen module: its factory, as train builds it
    if axes is None:
        axes = ("data", "fsdp", "tensor", "pipe") + (("expert",) if cfg.model.n_experts else ())
    batches = tuple(global_batches or (cfg.train.global_batch,))
    b0 = b0 or min(batches)
    if b_noise is None and set(batches) != {b0}:
        raise ConfigError(f"tune: comparing global batches {list(batches)} needs the gradient noise scale "
                          f"(b_noise=...; tuner.probe.estimate_b_noise measures it)")
    facts = facts_of(model, cfg)  # a user's model: layouts judged on it, not on cfg.model
    if facts is not None:
        check_user_model_keys(cfg.model, facts.spec)
    space = enumerate_space(cfg, n, axes=axes, global_batches=batches, microbatches=microbatches,
                            schedules=schedules, virtual_stages=virtual_stages, remats=remats, facts=facts)
    if not space.valid:
        kinds = list(space.reasons())
        # One reason for every candidate (a setting no layout can run) is given whole.
        reasons = space.rejected[0][1] if len(kinds) == 1 else "; ".join(kinds[:3])
        raise ConfigError(f"tune: no valid configuration of this model on {n} devices ({reasons})")
    log(f"space: {len(space.valid)} valid, {len(space.rejected)} rejected")
    # The machine's calibration is measured once and cached: next to the feasibility
    # cache when there is one (a run directory), else in ~/.cache/mindpipe_jax.
    hardware = hardware or Hardware.calibrate(devices, memory_bytes=budget_bytes,
                                              cache_dir=Path(cache_path).parent if cache_path else None)
    costs = costs or ModelCosts.measure(cfg, model=None if facts is None else facts.factory())
    # A model the pipeline cannot cut: with the model given, the space already rejected its
    # pipeline layouts (tuner/facts.py); this guards costs passed in without the model.
    if costs.unsplit is not None:
        cut = [c for c in space.valid if c.pipe > 1]
        space.valid = [c for c in space.valid if c.pipe == 1]
        space.rejected += [(c, f"the model cannot be pipelined: {costs.unsplit}") for c in cut]
        if cut:
            log(f"rejected {len(cut)} pipeline layouts: the model cannot be pipelined ({costs.unsplit})")
        if not space.valid:
            raise ConfigError(f"tune: no valid configuration of this model on {n} devices (the model cannot "
                              f"be pipelined: {costs.unsplit})")
    # The runtime re-times a pipeline's table into fused ticks (parallel.fuse_ticks):
    # the model counts the ticks it runs.
    model_cost = CostModel(costs, hardware, cfg.model.seq_len, fuse_mode=cfg.parallel.fuse_ticks)
    log(f"hardware: {hardware.note}")
    rows = [Row(c, b, efficiency(c.global_batch, b_noise, b0)) for c, b in model_cost.rank(space.valid)]
    rows.sort(key=lambda r: -r.predicted_entropyput)

    cache = FeasibilityCache(cache_path)
    compiled = 0
    # Exploring a batch needs one trial at it, of any layout: when the row picked for that
    # does not fit, its lighter-remat twins are tried next (the nearest feasible stand-in,
    # same mesh and schedule), not the next best prediction, which is usually a near twin
    # that does not fit either and spends the compile budget (the memory-bound benchmark of
    # 2026-12-03: four B64 layouts without remat compiled and refused, no B64 trial).
    retry: list[Row] = []

    def check(row: Row) -> bool:
        """Judge ``row``'s memory; whether that took a compile (a floor past the budget
        refuses it without one: ``memory_floor``)."""
        floor = memory_floor(row.candidate, costs.hidden_bytes_per_row, costs.param_bytes)
        if floor > budget_bytes:
            row.feasibility = Feasibility(row.candidate, False, floor_bytes=floor, reason=(
                f"needs at least {mib(floor)} MiB per device (a microbatch's hidden state and its "
                f"gradient, and the parameters), budget {mib(budget_bytes)} MiB"))
            return False
        row.feasibility = cache.check(cfg, row.candidate, budget_bytes, model, devices, facts)
        return True

    def untested(r: Row) -> bool:
        return r.measured_s is None and (r.feasibility is None or r.feasibility.fits)

    def next_feasible() -> Row | None:
        """The next row to measure (``trial_order``, twins first) that compiles within the budget."""
        nonlocal compiled
        while True:
            row = next((r for r in [*retry, *trial_order(rows, explore)] if untested(r)), None)
            if row is None or row.feasibility is not None:
                return row
            if compiled >= max_compile:
                return None
            compiled += check(row)
            if row.feasibility.fits:
                return row
            log(f"infeasible: {row.candidate.label()}: {row.feasibility.reason}")
            tried = {r.candidate.global_batch for r in rows if r.measured_s is not None}
            if row.candidate.global_batch not in tried:
                retry[:0] = [t for t in lighter_twins(row, rows) if untested(t)]

    # Measure one candidate at a time, each the next in ``trial_order`` after the
    # trials so far (a trial can reorder the rest: it recalibrates the model).
    trials: dict[int, Trial] = {}
    while sum(r.measured_s is not None for r in rows) < measure:
        row = next_feasible()
        if row is None:
            break
        if not _room_for(row, trials, devices, log):
            continue
        trial = trials[id(row)] = Trial(cfg, row.candidate, model=model, devices=devices)
        trial.run(trial_steps)
        row.measured_s = trial.median
        del trial  # held by ``trials`` alone: releasing them frees its arrays (``_room_for``)
        # The table shows the median over all rounds (below), not this first one.
        log(f"measured {row.candidate.label()}: {row.measured_s * 1e3:.1f} ms in round 1 of {rounds} "
            f"(predicted {row.predicted.step_s * 1e3:.1f} ms)")
        model_cost.observe(row.candidate, row.measured_s)
        for other in rows:
            other.predicted = model_cost.breakdown(other.candidate)
    # The measured candidates again, in interleaved rounds: a single trial on a shared
    # machine can be off by half, and the choice must not be a lucky moment.
    for _ in range(rounds - 1):
        for trial in trials.values():
            trial.run(trial_steps)
    for row in rows:
        if id(row) in trials:
            row.measured_s = trials[id(row)].median
    # The rest of the compile budget checks the memory of the next best rows (rows
    # never compiled are shown as predicted only).
    for row in sorted(rows, key=lambda r: -r.predicted_entropyput):
        if compiled >= max_compile:
            break
        if row.feasibility is None:
            compiled += check(row)
    # Predictions after the trials (the model has seen them), for every row.
    for row in rows:
        row.predicted = model_cost.breakdown(row.candidate)
    measured = sorted((r for r in rows if r.measured_s is not None), key=lambda r: -r.measured_entropyput)
    rest = sorted((r for r in rows if r.measured_s is None and (r.feasibility is None or r.feasibility.fits)),
                  key=lambda r: -r.predicted_entropyput)
    refused = [r for r in rows if r.feasibility is not None and not r.feasibility.fits]
    return TuneResult(measured + rest + refused, space, hardware, b_noise, b0, cache.hits, cache.misses)
