"""vPipe partitioner: measured layer costs -> layers per stage and remat per stage.

Two steps, usable apart:

``measure_layer_costs(model_cfg, microbatch=..., model=factory)`` builds the model (the
caller's factory: the configured GPT or MoE GPT, or a user's) and times, on every local
device at once (as the pipeline runs them), one block's forward (F), its backward
split into B (input gradient only), W (weight gradient only) and the fused BW,
and the same for the embedding and the head (+ loss); it reads FLOPs from the
programs (``cost_analysis``) and sizes the hidden state, the residuals
a forward keeps for its backward (the leaves of the ``jax.vjp`` closure that are
not the weights themselves, i.e. what the runtime's residual buffer holds per
microbatch) and the parameters. The GPT's blocks are identical, so one block is
measured and its costs are replicated over ``n_layers``. A model whose layers
differ can be described directly: ``ProfiledModel(layers=[LayerCost(...), ...],
embed=..., head=..., residual_bytes=[...])``.

``partition(profile, p=..., v=..., m=..., schedule=..., memory_budget_bytes=...)``
cuts the layers into ``p * v`` contiguous global stages (placed as the schedule
places them: Megatron's order, global stage ``g = c * p + s`` is chunk ``c`` of device
``s``, or a V's, stages ``s`` and ``2p − 1 − s`` on device ``s``), embed counted on global
stage 0 and head on the last, so that the slowest stage is as fast as possible
(an exact dynamic program over all contiguous splits, not a heuristic), then
picks a remat policy per stage so each device fits the memory budget at the
least recompute. It returns a ``PipelinePlan``: ``plan.layout()`` is the
``StageLayout`` the runtime executes, ``plan.table()`` the per-stage table that
``mindpipe plan`` prints.

The code lives in four modules: this one (checks, choosing the split and the
remat together, predictions), ``search`` (the exact split search),
``memory`` (a stage's time and bytes under each remat policy, the memory model
in full, the per-device remat choice and the SPMD runtime's buffers) and
``result`` (``PipelinePlan`` and its table); the names callers use are
re-exported here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from mindpipe_jax.errors import ConfigError
from mindpipe_jax.parallel.pipeline.plan.lockstep import lockstep_ticks_seconds
from mindpipe_jax.parallel.pipeline.plan.memory import (
    MB,
    PARAM_COPIES,
    REMAT_POLICIES,
    StageModel,
    choose_remat,
    device_of,
    device_peak,
    fit_spmd_budget,
    memory_per_device,
    slot_tick_seconds,
    spmd_memory,
    stages_of,
)
from mindpipe_jax.parallel.pipeline.plan.profile import ProfiledModel, measure_layer_costs
from mindpipe_jax.parallel.pipeline.plan.result import PipelinePlan
from mindpipe_jax.parallel.pipeline.plan.search import lex_less, split_dp
from mindpipe_jax.parallel.pipeline.plan.shares import ParamShare
from mindpipe_jax.parallel.pipeline.schedules import Kind, Schedule, get_schedule, interleaved_placement
from mindpipe_jax.parallel.pipeline.schedules.fused import FUSE_MODES
from mindpipe_jax.sim import Link, SimResult, StageCosts, simulate

__all__ = ["ProfiledModel", "PipelinePlan", "measure_layer_costs", "partition", "REMAT_POLICIES",
           "PARAM_COPIES", "MB"]


def _check_int(name: str, value, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"partition: {name} must be an integer >= {low}, got {value!r}")
    return value


def partition(profile: ProfiledModel, *, p: int, v: int = 1, m: int, schedule: str | Schedule = "1f1b",
              memory_budget_bytes: float | None = None, remat_options: Sequence[str] = ("none", "full"),
              param_copies: float = PARAM_COPIES, link: Link | float | None = None,
              fit_spmd: bool = True,
              measure_memory: Callable[[tuple[str, ...], tuple[int, ...], str], float] | None = None,
              fuse_modes: Sequence[str] = ("auto", "table"), lockstep: bool = False,
              param_share: ParamShare | None = None) -> PipelinePlan:
    """Assign contiguous layers to the ``p * v`` global stages and a remat policy to
    each stage; see ``memory`` for the cost and memory model.

    Time: a stage's work is F + its backward (BW, or B + W for a schedule that splits
    the backward) + the recompute of its remat policy, embed on global stage 0 and
    head on the last. The split minimises the slowest stage exactly (dynamic program
    over all contiguous splits); among equally fast splits it takes the least total
    work, then the most even. Stages hold >= 1 layer unless there are fewer layers
    than stages.

    Memory: ``memory_budget_bytes`` per device (None = unlimited). Each stage takes
    the fastest of ``remat_options`` ("none", "full", "dots") that lets its device
    fit; recompute goes into the stage's B (or BW). With ``v == 1`` the split and the
    policies are chosen together, exactly (a stage's cost in the program is its
    fastest fitting policy), so the plan may also move layers off a device rather
    than recompute. With ``v > 1`` a device's chunks share its memory and a split
    cannot be scored stage by stage: a few candidate splits (each optimal for a
    simpler stage cost, see ``_interleaved_split``) get their exact per-device
    policies (each chunk its own, tried exhaustively up to 1024 combinations,
    else one for the whole device) and the best is kept, which is a heuristic.
    Nothing fits -> ``ConfigError`` naming the stage (device), the memory it needs
    and the budget. ``link``: transfer cost for the simulation (None = free).

    With ``fit_spmd`` (the default) the SPMD runtime then gets the same budget
    checked against its own buffers (``memory.fit_spmd_budget``), which can move a stage to a
    policy that keeps less; ``fit_spmd=False`` keeps the per-device optimum (what
    a runtime with per-device buffers would run). ``measure_memory(remat, counts,
    fuse_mode)``, when given, replaces the model in that check with a measurement (the
    bytes per device of the compiled step for those policies, layer counts and fused
    ticks — the ahead-of-time check the tuner uses), and ``spmd_memory_bytes`` is then
    measured. Fused ticks can hold more microbatches than the table (fused 1F1B: 2p − 1
    on stage 0, not p), so each of ``fuse_modes`` gets its own fit, and the plan keeps
    the one whose fused-tick replay (the simulator's neighbour mode, with the recompute
    each fit needs) is fastest: under a tight budget one task per tick with light remat
    can beat fused ticks that need "full" (``fuse_ticks``, ``parallel.fuse_ticks``).
    ``lockstep``: the run's stages go in lockstep (tensor > 1), whose buffers
    differ: the SPMD figure models them (``memory.spmd_memory``). ``param_share``: the
    share of the parameters a device holds on the run's mesh (``shares.param_share``:
    ``fsdp``, ``tensor`` or ``expert`` splits, the gathered buffers); None = the
    profile's whole bytes, one device per stage.

    The SPMD runtime also moves residual slots on every device in every tick, a cost
    no stage's own time shows (``memory.slot_tick_seconds``, zero unless the profile
    prices ``slot_move_s_per_byte``, as ``measure_layer_costs`` does): the fused-tick
    replays pay it per tick, and the stages keeping residuals move to a leaner policy
    (all of a policy's stages at once: they share its buffer) while that makes the
    replayed step faster.
    """
    if not isinstance(profile, ProfiledModel):
        raise ConfigError(f"partition needs a ProfiledModel, got {type(profile).__name__}")
    p, v, m = _check_int("p", p), _check_int("v", v), _check_int("m", m)
    if isinstance(schedule, Schedule):
        sched = schedule
        if (sched.num_stages, sched.virtual_stages, sched.num_microbatches) != (p, v, m):
            raise ConfigError(f"partition: the schedule is for p={sched.num_stages}, "
                              f"v={sched.virtual_stages}, m={sched.num_microbatches}, "
                              f"not p={p}, v={v}, m={m}")
    elif isinstance(schedule, str):
        sched = get_schedule(schedule, p, m, v)
    else:
        raise ConfigError(f"partition: schedule must be a name or a Schedule, got {schedule!r}")
    options = tuple(remat_options) if not isinstance(remat_options, str) else (remat_options,)
    bad = [o for o in options if o not in REMAT_POLICIES]
    if not options or bad:
        raise ConfigError(f"partition: remat_options {list(options)} must be a non-empty subset of "
                          f"{list(REMAT_POLICIES)}")
    if "dots" in options and not profile.has_dots:
        raise ConfigError("partition: remat 'dots' needs a profile with dots_residual_bytes and "
                          "dots_recompute_s (measure_layer_costs(..., dots=True))")
    options = tuple(o for o in REMAT_POLICIES if o in options)   # usually fastest first: none, dots, full
    fuse_modes = (fuse_modes,) if isinstance(fuse_modes, str) else tuple(fuse_modes)
    if not fuse_modes or any(f not in FUSE_MODES for f in fuse_modes):
        raise ConfigError(f"partition: fuse_modes {list(fuse_modes)} must be a non-empty subset of "
                          f"{list(FUSE_MODES)}")
    budget = None
    if memory_budget_bytes is not None:
        ok = isinstance(memory_budget_bytes, int | float) and not isinstance(memory_budget_bytes, bool)
        if not ok or not 0 < memory_budget_bytes < math.inf:
            raise ConfigError(f"partition: memory_budget_bytes must be a number > 0 or None, "
                              f"got {memory_budget_bytes!r}")
        budget = float(memory_budget_bytes)
    if not (isinstance(param_copies, int | float) and param_copies >= 0):
        raise ConfigError(f"partition: param_copies must be a number >= 0, got {param_copies!r}")

    G, L = p * v, profile.num_layers
    split = any(t is not None and t.kind in (Kind.B, Kind.W) for row in sched.table for t in row)
    model = StageModel(profile, G, split, param_share)
    inflight = sched.peak_in_flight()

    def device_memory(g: int, fig: dict[str, float]) -> float:
        return model.param_memory([fig], param_copies) + inflight[device_of(sched, g)] * fig["per_mb"] \
            + fig["transient"]

    def fastest_fitting(g: int, i: int, j: int) -> tuple[str, dict[str, float]] | None:
        best = None
        for policy in options:  # ties go to the earlier policy: none, dots, full
            fig = model.stage(g, i, j, policy)
            if (budget is None or device_memory(g, fig) <= budget) and (
                    best is None or fig["time"] < best[1]["time"]):
                best = policy, fig
        return best

    if v == 1:
        def cost(g, i, j):
            best = fastest_fitting(g, i, j)
            return math.inf if best is None else best[1]["time"]

        bounds = split_dp(L, G, cost)
        if bounds is None:   # no split fits: name a stage of the fastest split
            _raise_no_fit(model, sched, options, budget, param_copies, inflight)
        spans = [range(bounds[g], bounds[g + 1]) for g in range(G)]
        chosen = choose_remat(model, sched, spans, options, budget, param_copies, inflight)
    else:
        spans, chosen = _interleaved_split(model, sched, options, budget, param_copies, inflight)

    def stage_costs(fig_list, spans=spans) -> StageCosts:
        base = StageCosts.from_layers(list(profile.layers), [g for g in range(G) for _ in spans[g]], G,
                                      embed=profile.embed, head=profile.head)
        rec = [f["recompute"] for f in fig_list]
        return dataclasses.replace(base, B=[b + r for b, r in zip(base.B, rec, strict=True)],
                                   BW=[b + r for b, r in zip(base.BW, rec, strict=True)])

    def predict(costs: StageCosts, tick_slots: float) -> dict[str, SimResult]:
        return {mode: simulate(sched, costs, link=link, mode=mode,
                               tick_overhead=tick_slots if mode == "lockstep" else 0.0)
                for mode in ("async", "lockstep")}

    def as_run(policies, mode: str, spans=spans) -> SimResult:
        """The fused-tick replay of these policies, every tick paying its slot moves."""
        fig_list = [model.stage(g, spans[g].start, spans[g].stop, policies[g]) for g in range(G)]
        return simulate(sched, stage_costs(fig_list, spans), link=link, mode="neighbour", fuse=mode,
                        tick_overhead=slot_tick_seconds(model, sched, spans, policies, mode, lockstep))

    def run_seconds(policies, mode: str, spans=spans) -> float:
        """The step as this layout runs: the per-device replay, or in lockstep every device
        running every branch of each tick (plan/lockstep.py): what tick mode and remat are
        chosen on."""
        if not lockstep:
            return as_run(policies, mode, spans).step_time
        from mindpipe_jax.parallel.pipeline.runtime.tickplan import make_plan

        fig_list = [model.stage(g, spans[g].start, spans[g].stop, policies[g]) for g in range(G)]
        ticks = make_plan(sched, tuple(policies), mode, merge_first=True, merge_last=True)
        return lockstep_ticks_seconds(ticks, stage_costs(fig_list, spans)) \
            + ticks.num_ticks * slot_tick_seconds(model, sched, spans, policies, mode, lockstep)

    fits = []
    for mode in dict.fromkeys(fuse_modes):
        try:
            fit = fit_spmd_budget(model, sched, spans, chosen, options, budget if fit_spmd else None,
                                  param_copies, measure_memory, fuse_mode=mode, lockstep=lockstep)
        except ConfigError:
            if mode == fuse_modes[-1] and not fits:
                raise
            continue
        fits.append((run_seconds(fit[0], mode), len(fits), mode, fit))
    _, _, fuse_mode, (chosen, spmd) = min(fits)
    lighter = _lighten(chosen, options, lambda policies: run_seconds(policies, fuse_mode),
                       keeping=range(G if lockstep else G - 1))
    if lighter != chosen:  # leaner policies keep less: the budget still holds; re-size the figure
        chosen = lighter
        spmd = (float(measure_memory(tuple(chosen), tuple(len(r) for r in spans), fuse_mode))
                if measure_memory is not None
                else spmd_memory(model, sched, spans, chosen, param_copies, fuse_mode, lockstep)[0])
    figs = [model.stage(g, spans[g].start, spans[g].stop, chosen[g]) for g in range(G)]
    memory = memory_per_device(model, sched, figs, param_copies)
    costs = stage_costs(figs)
    tick_slots = slot_tick_seconds(model, sched, spans, chosen, fuse_mode, lockstep)
    sims = predict(costs, tick_slots)
    # As the SPMD runtime runs it: the table re-timed into the chosen fused ticks.
    sims["as run"] = as_run(chosen, fuse_mode)
    step_times = {k: sim.step_time for k, sim in sims.items()}
    utilization = {k: sim.mean_utilization for k, sim in sims.items()}
    if lockstep:  # every device runs every branch of a tick (plan/lockstep.py)
        step_times["lockstep run"] = run_seconds(chosen, fuse_mode)
        busy = sum(sims["as run"].busy) / p
        utilization["lockstep run"] = busy / step_times["lockstep run"] if step_times["lockstep run"] else 0.0
    even = _even_split(model, sched, profile, G, param_copies, link)
    # The even split as this layout runs it too (slot moves priced): the plan's "as run"
    # step is what it was chosen on, so the comparison must be on the same footing (its
    # slowest stage alone leaves out the residual slot moves that "none" pays every tick).
    even_spans = [range(sum(even["counts"][:g]), sum(even["counts"][:g + 1])) for g in range(G)]
    even["step_time_run_s"] = run_seconds(("none",) * G, fuse_mode, even_spans)
    return PipelinePlan(
        schedule=sched.name, p=p, v=v, m=m, counts=tuple(len(r) for r in spans), layers=tuple(spans),
        device=tuple(device_of(sched, g) for g in range(G)), remat=tuple(chosen),
        forward_s=tuple(f["F"] for f in figs), backward_s=tuple(f["back"] for f in figs),
        recompute_s=tuple(f["recompute"] for f in figs), tick_slot_s=tick_slots,
        stage_time_s=tuple(f["time"] for f in figs),
        memory_bytes=tuple(sum(x) for x in zip(*memory, strict=True)),
        memory_params_bytes=memory[0], memory_activations_bytes=memory[1], memory_transient_bytes=memory[2],
        in_flight=tuple(inflight), memory_budget_bytes=budget, spmd_memory_bytes=spmd,
        spmd_memory_compiled=measure_memory is not None,
        step_time_s=step_times, utilization=utilization,
        even_split=even, costs=costs, simulations=sims, fuse_ticks=fuse_mode,
        note=_joined(profile.note, model.share.describe()),
        placement=None if sched.placement == interleaved_placement(p, v) else sched.placement)


def _lighten(chosen: list[str], options, step_time: Callable[[list[str]], float], keeping) -> list[str]:
    """Move every keeping stage of a policy to a leaner one of ``options`` (none -> dots
    -> full) while that makes ``step_time`` shorter: the recompute a stage's own time
    shows can be cheaper than the residual slots every device moves in every tick
    (``memory.slot_tick_seconds``), which no stage's time shows."""
    chosen = list(chosen)
    keeping = list(keeping)
    best_time = step_time(chosen)
    while True:
        trials = []
        for policy in dict.fromkeys(chosen[g] for g in keeping):
            for leaner in REMAT_POLICIES[REMAT_POLICIES.index(policy) + 1:]:
                if leaner in options:
                    trials.append([leaner if g in keeping and c == policy else c
                                   for g, c in enumerate(chosen)])
        timed = [(step_time(t), i, t) for i, t in enumerate(trials)]
        if not timed or min(timed)[0] >= best_time * (1 - 1e-9):
            return chosen
        best_time, _, chosen = min(timed)


def split_last_candidates(p: int, m: int) -> list[int]:
    """The ``split_last`` values ``choose_split_last`` tries by default: none split (0),
    powers of two below ``m``, ``p`` and ``2p`` (the drain's length in a flat and a V
    schedule), and every backward split (-1, the table as generated)."""
    ks = {0, p, 2 * p} | {1 << i for i in range(max(m, 1).bit_length())}
    return sorted(k for k in ks if k < m) + [-1]


def choose_split_last(profile: ProfiledModel, *, p: int, v: int | None = None, m: int, schedule: str,
                      candidates: Sequence[int] | None = None, **kwargs) -> PipelinePlan:
    """``partition`` under each ``split_last`` of ``candidates`` (default
    ``split_last_candidates(p, m)``) and the plan that runs fastest as the SPMD runtime
    runs it (the fused ticks' neighbour replay, ``step_time_s["as run"]``; in lockstep,
    ``step_time_s["lockstep run"]``), with every
    candidate's replay in ``split_last_tried``; ties go to the earlier candidate (fewer
    splits). A zero-bubble schedule splits every backward so that W's can wait, but only
    the drain's W's fill a bubble: where B + W cost more than the fused backward (the
    profile's B, W and fused BW say so), splitting only the last few microbatches' is
    faster. A schedule without a split (1F1B, interleaved, ...) is planned as it is.
    ``kwargs`` go to ``partition``."""
    from mindpipe_jax.parallel.pipeline.schedules import ScheduleError

    if not isinstance(schedule, str):
        raise ConfigError(f"choose_split_last: schedule must be a name, got {schedule!r}")
    base = get_schedule(schedule, p, m, v)
    v = base.virtual_stages
    if not base.has_split():
        return partition(profile, p=p, v=v, m=m, schedule=base, **kwargs)
    ks = split_last_candidates(p, m) if candidates is None else list(dict.fromkeys(candidates))
    if not ks:
        raise ConfigError("choose_split_last: candidates is empty; give split_last values (-1 = all)")
    plans: dict[int, PipelinePlan] = {}
    failure = None
    for k in ks:
        try:
            sched = get_schedule(schedule, p, m, v, k)
        except ScheduleError as e:
            raise ConfigError(f"choose_split_last: split_last={k!r}: {e}") from None
        try:
            plans[k] = partition(profile, p=p, v=v, m=m, schedule=sched, **kwargs)
        except ConfigError as e:  # this split does not fit the budget; another may
            failure = failure or e
    if not plans:
        raise failure
    # In lockstep (tensor > 1) the step is the lockstep run's, not the per-device replay's.
    tried = {k: plan.step_time_s.get("lockstep run", plan.step_time_s["as run"]) for k, plan in plans.items()}
    best = min(tried, key=lambda k: (tried[k], ks.index(k)))
    return dataclasses.replace(plans[best], split_last=best, split_last_tried=tried)


def _interleaved_split(model: StageModel, sched: Schedule, options, budget, param_copies, inflight):
    """v > 1: a device's chunks share its memory, so a split cannot be scored stage by
    stage. Candidate splits, each optimal for its own stage cost: time under each
    policy in ``options`` applied everywhere, and the fastest policy fitting a 1/v
    share of the budget with the chunk's own in-flight count. Each candidate gets
    its exact per-device remat (``choose_remat``); the best (slowest stage, total
    work, evenness) wins. The first candidate's error is raised if none fits."""
    p, v, G, L = sched.num_stages, sched.virtual_stages, sched.num_global_stages, model.L
    per_chunk = [[0] * v for _ in range(p)]   # peak in-flight microbatches of one chunk
    for s in range(p):
        for c in range(v):
            per_chunk[s][c] = round(device_peak(sched, s, [float(k == c) for k in range(v)]))

    def share_cost(g, i, j):
        s = device_of(sched, g)
        c = stages_of(sched, s).index(g)
        best = math.inf
        for policy in options:
            fig = model.stage(g, i, j, policy)
            need = model.param_memory([fig], param_copies) + per_chunk[s][c] * fig["per_mb"] \
                + fig["transient"]
            if budget is None or need <= budget / v:
                best = min(best, fig["time"])
        return best

    costs = [(lambda g, i, j, pol=pol: model.stage(g, i, j, pol)["time"]) for pol in options]
    if budget is not None:
        costs.append(share_cost)
    best, best_key, first_error, seen = None, None, None, set()
    for cost in costs:
        bounds = split_dp(L, G, cost)
        if bounds is None or tuple(bounds) in seen:
            continue
        seen.add(tuple(bounds))
        spans = [range(bounds[g], bounds[g + 1]) for g in range(G)]
        try:
            chosen = choose_remat(model, sched, spans, options, budget, param_copies, inflight)
        except ConfigError as err:
            first_error = first_error or err
            continue
        times = [model.stage(g, spans[g].start, spans[g].stop, chosen[g])["time"] for g in range(G)]
        key = (max(times), sum(times), sum(t * t for t in times))
        if best_key is None or lex_less(key[:2], best_key[:2]) or (
                not lex_less(best_key[:2], key[:2]) and key[2] < best_key[2]):
            best, best_key = (spans, chosen), key
    if best is None:
        assert first_error is not None
        raise first_error
    return best


def _raise_no_fit(model: StageModel, sched: Schedule, options, budget, param_copies, inflight):
    """No split fits (v == 1): report the device of the fastest split that does not."""
    G = sched.num_global_stages
    bounds = split_dp(model.L, G, lambda g, i, j: model.stage(g, i, j, "none")["time"])
    assert bounds is not None
    spans = [range(bounds[g], bounds[g + 1]) for g in range(G)]
    choose_remat(model, sched, spans, options, budget, param_copies, inflight)
    raise AssertionError("unreachable: the fastest split fits but the search found no split")


def _even_split(model: StageModel, sched: Schedule, profile: ProfiledModel, G: int, param_copies: float,
                link) -> dict[str, Any]:
    """An even split without remat, for comparison."""
    from mindpipe_jax.sim import even_assignment

    stage_of = even_assignment(profile.num_layers, G)
    counts = [stage_of.count(g) for g in range(G)]
    starts = [sum(counts[:g]) for g in range(G)]
    spans = [range(starts[g], starts[g] + counts[g]) for g in range(G)]
    figs = [model.stage(g, spans[g].start, spans[g].stop, "none") for g in range(G)]
    costs = StageCosts.from_layers(list(profile.layers), stage_of, G, embed=profile.embed, head=profile.head)
    sims = {mode: simulate(sched, costs, link=link, mode=mode) for mode in ("async", "lockstep")}
    memory = memory_per_device(model, sched, figs, param_copies)
    return {"counts": tuple(counts), "slowest_stage_s": max(f["time"] for f in figs),
            "utilization_async": sims["async"].mean_utilization,
            "utilization_lockstep": sims["lockstep"].mean_utilization,
            "step_time_async_s": sims["async"].step_time, "step_time_lockstep_s": sims["lockstep"].step_time,
            "peak_memory_bytes": max(sum(x) for x in zip(*memory, strict=True))}


def _joined(*parts: str) -> str:
    return "; ".join(x for x in parts if x)
