"""vPipe partitioner: measured layer costs -> layers per stage and remat per stage.

Two steps, usable apart:

``measure_layer_costs(model_cfg, microbatch=...)`` builds the reference GPT and
times, on the current default device, one block's forward (F), its backward
split into B (input gradient only), W (weight gradient only) and the fused BW,
and the same for the embedding and the head (+ loss); it reads FLOPs from the
compiled programs (``cost_analysis``) and sizes the hidden state, the residuals
a forward keeps for its backward (the leaves of the ``jax.vjp`` closure that are
not the weights themselves, i.e. what the runtime's residual buffer holds per
microbatch) and the parameters. The GPT's blocks are identical, so one block is
measured and its costs are replicated over ``n_layers``. A model whose layers
differ can be described directly: ``ProfiledModel(layers=[LayerCost(...), ...],
embed=..., head=..., residual_bytes=[...])``.

``partition(profile, p=..., v=..., m=..., schedule=..., memory_budget_bytes=...)``
cuts the layers into ``p * v`` contiguous global stages (Megatron order: global
stage ``g = c * p + s`` is chunk ``c`` of device ``s``), embed counted on global
stage 0 and head on the last, so that the slowest stage is as fast as possible
(an exact dynamic program over all contiguous splits, not a heuristic), then
picks a remat policy per stage so each device fits the memory budget at the
least recompute. It returns a ``PipelinePlan``: ``plan.layout()`` is the
``StageLayout`` the runtime executes, ``plan.table()`` the per-stage table that
``mindpipe plan`` prints.

The memory model, per device ``s`` (all bytes, per device)::

    params_state = param_copies x params of its layers (+ embed on stage 0, + head
                   on the last; weights, gradients and Adam's two moments: 4 copies)
    in_flight    = k_s x per_microbatch  (k_s = the schedule's peak number of
                   microbatches forwarded whose last backward task has not run:
                   Schedule.peak_in_flight(), which is peak_live_activations() for
                   every schedule without a B/W split; under ZB-H1 a microbatch's
                   residuals stay until its deferred W)
    per_microbatch: remat "none": stage input + the stage's forward residuals
                    remat "full": stage input only
                    remat "dots": stage input + the matmul outputs kept by
                                  ``dots_with_no_batch_dims_saveable``
                    the last stage keeps only its input whatever the policy (its
                    forward runs inside its backward): "none" rebuilds all its
                    residuals there (transient), the others its "dots" share
    transient    = what a recomputing backward rebuilds while it runs: the runtime
                   differentiates every re-run forward with the "dots" checkpoint per
                   layer, so one layer's residuals that "dots" does not keep, plus,
                   under "full", the stage's kept matmul outputs

and remat adds its recompute to the stage's backward: "full" re-runs the stage's
forward (+F, + the "dots" recompute when the profile has it), "dots" the measured
difference between the policy's backward and the plain one. With ``v > 1`` a
device's peak is found by walking its task list with each chunk's own
per-microbatch size.

The SPMD runtime runs one program on every device, so each policy's residual
buffer is as deep as the deepest stage using it needs. ``plan.spmd_memory_bytes``
is that figure, from the runtime's own slot plan (``tickplan.make_plan``); when a
budget is given, the plan is also made to fit it: while the SPMD figure is over,
the stage that sets the biggest buffer's depth moves to the next policy that
keeps less (none -> dots -> full). Embed and head parameters are modelled on the
devices that use them (as an MPMD runtime would hold them); the SPMD runtime
replicates them, which the SPMD figure counts.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mindpipe_jax.errors import ConfigError
from mindpipe_jax.parallel.pipeline.profile import ProfiledModel, measure_layer_costs
from mindpipe_jax.parallel.pipeline.schedules import Kind, Schedule, get_schedule, interleaved_placement
from mindpipe_jax.parallel.pipeline.simulate import LayerCost, Link, SimResult, StageCosts, simulate

__all__ = ["ProfiledModel", "PipelinePlan", "measure_layer_costs", "partition", "REMAT_POLICIES",
           "PARAM_COPIES", "MB"]

REMAT_POLICIES = ("none", "dots", "full")
PARAM_COPIES = 4.0   # weights + gradients + Adam's first and second moments
MB = float(2 ** 20)  # what the table calls a megabyte
_ZERO = LayerCost(0.0, 0.0, 0.0)
_REL = 1e-9          # relative tolerance for "as fast as the optimum"


# ----------------------------------------------------------------------- profile
@dataclass(frozen=True)
class PipelinePlan:
    """Layers, remat and predictions per stage. Per global stage ``g`` (tuples of
    ``p * v``): ``counts``, ``layers`` (a ``range``), ``device``, ``remat``,
    ``forward_s``/``backward_s``/``recompute_s`` and ``stage_time_s`` (their sum:
    the stage's work per microbatch). Per device (tuples of ``p``):
    ``memory_bytes`` = ``memory_params_bytes`` + ``memory_activations_bytes`` +
    ``memory_transient_bytes`` (see the module docstring) and ``in_flight``.
    Predictions from ``simulate.simulate`` with these stage costs and ``link``:
    ``step_time_s`` and ``utilization`` for ``"async"`` (an MPMD executor) and
    ``"lockstep"`` (the SPMD runtime's tick loop). ``remat`` is what
    ``pipeline_grads(remat=plan.remat)`` and ``parallel.stage_remat`` take;
    ``spmd_memory_bytes`` the per-device figure of the SPMD runtime (module
    docstring). ``even_split``: the same figures for an even split without remat."""

    schedule: str
    p: int
    v: int
    m: int
    counts: tuple[int, ...]
    layers: tuple[range, ...]
    device: tuple[int, ...]
    remat: tuple[str, ...]
    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    recompute_s: tuple[float, ...]
    stage_time_s: tuple[float, ...]
    memory_bytes: tuple[float, ...]
    memory_params_bytes: tuple[float, ...]
    memory_activations_bytes: tuple[float, ...]
    memory_transient_bytes: tuple[float, ...]
    in_flight: tuple[int, ...]
    memory_budget_bytes: float | None
    spmd_memory_bytes: float
    step_time_s: dict[str, float]
    utilization: dict[str, float]
    even_split: dict[str, Any]
    costs: StageCosts = field(repr=False)
    simulations: dict[str, SimResult] = field(repr=False, default_factory=dict)
    note: str = ""

    @property
    def num_layers(self) -> int:
        return sum(self.counts)

    @property
    def slowest_stage_s(self) -> float:
        return max(self.stage_time_s)

    def layout(self):
        """The ``StageLayout`` for ``pipeline_grads(..., layout=plan.layout())``."""
        from mindpipe_jax.parallel.pipeline.layout import StageLayout

        return StageLayout(self.counts, self.p, self.v)

    def table(self) -> str:
        """The per-stage table ``mindpipe plan`` prints."""
        G = self.p * self.v
        last = G - 1

        def span(g: int) -> str:
            r = self.layers[g]
            parts = (["embed"] if g == 0 else []) + \
                ([f"{r.start}" if len(r) == 1 else f"{r.start}-{r.stop - 1}"] if len(r) else []) + \
                (["head"] if g == last else [])
            return " + ".join(parts) if parts else "(none)"

        head = ["stage", "device", "layers", "n", "F ms", "bwd ms", "recomp ms", "time ms", "remat",
                "in flight", "memory MB"]
        rows = []
        for g in range(G):
            s = self.device[g]
            dev = str(s) if self.v == 1 else f"{s}.{g // self.p}"
            rows.append([str(g), dev, span(g), str(self.counts[g]),
                         f"{1e3 * self.forward_s[g]:.3f}", f"{1e3 * self.backward_s[g]:.3f}",
                         f"{1e3 * self.recompute_s[g]:.3f}", f"{1e3 * self.stage_time_s[g]:.3f}",
                         self.remat[g], str(self.in_flight[s]), f"{self.memory_bytes[s] / MB:.1f}"])
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
        left = {2, 8}

        def line(cells):
            return "  ".join(c.ljust(w) if i in left else c.rjust(w)
                             for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

        budget = ("none" if self.memory_budget_bytes is None
                  else f"{self.memory_budget_bytes / MB:.1f} MB per device")
        out = [f"vPipe plan: {self.schedule}  p={self.p} v={self.v} m={self.m}, {self.num_layers} layers, "
               f"memory budget {budget}"]
        if self.note:
            out.append(f"costs: {self.note}")
        out += ["", line(head), line(["-" * w for w in widths])] + [line(r) for r in rows]
        if self.v > 1:
            out.append("(device s.c = chunk c of device s; in flight and memory are the device's)")
        ms = 1e3
        out += ["",
                f"slowest stage {ms * self.slowest_stage_s:.3f} ms; memory = params+grads+Adam "
                f"({PARAM_COPIES:g} copies) + in-flight microbatches + one rebuilt microbatch under remat",
                f"predicted step: async {ms * self.step_time_s['async']:.3f} ms (utilization "
                f"{self.utilization['async']:.3f}), lockstep {ms * self.step_time_s['lockstep']:.3f} ms "
                f"(utilization {self.utilization['lockstep']:.3f})"]
        even = self.even_split
        out.append(f"even split {list(even['counts'])}, no remat: slowest stage "
                   f"{ms * even['slowest_stage_s']:.3f} ms, async utilization "
                   f"{even['utilization_async']:.3f}, lockstep {even['utilization_lockstep']:.3f}; "
                   f"peak memory {even['peak_memory_bytes'] / MB:.1f} MB")
        out.append(f"SPMD runtime: {self.spmd_memory_bytes / MB:.1f} MB per device (every device holds "
                   f"each remat policy's buffer as deep as its deepest stage needs, and embed + head)")
        remat = "[" + ", ".join(f'"{r}"' for r in self.remat) + "]"
        out.append(f"run it: pipeline_grads(..., remat={tuple(self.remat)}, "
                   f"layout=StageLayout({self.counts}, {self.p}, {self.v})); "
                   f"train: parallel.stage_layers={list(self.counts)} "
                   f"parallel.stage_remat='{remat}'")
        return "\n".join(out)


# -------------------------------------------------------------------- partition
class _Model:
    """Prefix sums over the profile, and one stage's figures for a remat policy."""

    def __init__(self, prof: ProfiledModel, G: int, split: bool):
        self.prof, self.G, self.split = prof, G, split
        L = prof.num_layers
        self.L = L

        def prefix(values):
            out = [0.0]
            for x in values:
                out.append(out[-1] + x)
            return out

        ls = prof.layers
        self.F = prefix(x.F for x in ls)
        self.back = prefix((x.B + x.W) if split else x.fused for x in ls)
        self.params = prefix(x.param_bytes for x in ls)
        self.res = prefix(prof.residual_bytes)
        self.dres = prefix(prof.dots_residual_bytes or (0.0,) * L)
        # What a per-layer "dots" checkpoint rebuilds of each layer in its backward.
        self.rest = [r - d for r, d in zip(prof.residual_bytes, prof.dots_residual_bytes or
                                           prof.residual_bytes, strict=True)]
        self.drec = prefix(prof.dots_recompute_s or (0.0,) * L)
        self.act_in = [prof.embed.activation_bytes] + [x.activation_bytes for x in ls]  # input of layer i

    def _sum(self, arr, i, j):
        return arr[j] - arr[i]

    def stage(self, g: int, i: int, j: int, policy: str) -> dict[str, float]:
        """Figures of global stage ``g`` holding layers ``[i, j)`` under ``policy``."""
        prof, first, last = self.prof, g == 0, g == self.G - 1
        e, h = prof.embed, prof.head
        fwd = self._sum(self.F, i, j) + first * e.F + last * h.F
        eb = (e.B + e.W) if self.split else e.fused
        hb = (h.B + h.W) if self.split else h.fused
        back = self._sum(self.back, i, j) + first * eb + last * hb
        res = self._sum(self.res, i, j) + first * prof.embed_residual_bytes + last * prof.head_residual_bytes
        act = self.act_in[i]
        kept = self._sum(self.dres, i, j) if prof.has_dots else res
        one_layer = max(self.rest[i:j], default=0.0)
        if last:  # its forward runs inside its backward: it keeps its input, recomputes no F
            if policy == "none":
                recompute, per_mb, transient = 0.0, act, res
            else:
                recompute, per_mb, transient = self._sum(self.drec, i, j), act, kept + one_layer
        elif policy == "none":
            recompute, per_mb, transient = 0.0, act + res, 0.0
        elif policy == "full":   # re-run the stage's forward (embed included) under "dots"
            recompute = self._sum(self.F, i, j) + first * e.F + self._sum(self.drec, i, j)
            per_mb, transient = act, kept + one_layer
        else:                    # dots: matmul outputs kept, the rest recomputed layer by layer
            recompute = self._sum(self.drec, i, j)
            per_mb, transient = act + kept + first * prof.embed_residual_bytes \
                + last * prof.head_residual_bytes, one_layer
        params = self._sum(self.params, i, j) + first * e.param_bytes + last * h.param_bytes
        return {"F": fwd, "back": back, "recompute": recompute, "time": fwd + back + recompute,
                "params": params, "per_mb": per_mb, "transient": transient}


def _less(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Lexicographic ``a < b`` with the first entries equal within a relative tolerance."""
    if abs(a[0] - b[0]) > _REL * max(abs(a[0]), abs(b[0]), 1e-30):
        return a[0] < b[0]
    return a[1] < b[1] * (1 - 1e-12)


def _split_dp(L: int, G: int, cost: Callable[[int, int, int], float]) -> list[int] | None:
    """Boundaries ``b[0]=0 <= ... <= b[G]=L`` minimising the largest ``cost(g, i, j)``
    (exact), then, among splits within a relative ``1e-9`` of that optimum, the sum of
    costs and then the sum of their squares (the most even of the fastest splits).
    Every stage gets >= 1 layer when L >= G. ``None`` if every split costs inf."""
    lo = 1 if L >= G else 0
    inf = math.inf
    cache: dict[tuple[int, int, int], float] = {}

    def c(g, i, j):
        key = (g, i, j)
        if key not in cache:
            cache[key] = cost(g, i, j)
        return cache[key]

    # Pass 1: the optimal bottleneck. best[k][j]: first j layers on k stages.
    best = [[inf] * (L + 1) for _ in range(G + 1)]
    best[0][0] = 0.0
    for k in range(1, G + 1):
        for j in range(L + 1):
            for i in range(0, j - lo + 1):
                if best[k - 1][i] < inf:
                    value = max(best[k - 1][i], c(k - 1, i, j))
                    if value < best[k][j]:
                        best[k][j] = value
    target = best[G][L]
    if target == inf:
        return None
    limit = target * (1 + _REL) + 1e-300
    # Pass 2: among splits whose every stage is <= the optimum, (sum, sum of squares).
    score: list[list[tuple[float, float] | None]] = [[None] * (L + 1) for _ in range(G + 1)]
    back = [[-1] * (L + 1) for _ in range(G + 1)]
    score[0][0] = (0.0, 0.0)
    for k in range(1, G + 1):
        for j in range(L + 1):
            for i in range(0, j - lo + 1):
                prev = score[k - 1][i]
                t = c(k - 1, i, j)
                if prev is None or t > limit:
                    continue
                cand = (prev[0] + t, prev[1] + t * t)
                if score[k][j] is None or _less(cand, score[k][j]):
                    score[k][j], back[k][j] = cand, i
    bounds = [L]
    for k in range(G, 0, -1):
        bounds.append(back[k][bounds[-1]])
    return bounds[::-1]


def _device_peak(schedule: Schedule, s: int, per_mb_by_chunk: Sequence[float]) -> float:
    """Peak in-flight bytes on device ``s``: +per_mb[c] at a chunk's F, - at its last
    backward task (BW, or W when the schedule splits the backward)."""
    level = peak = 0.0
    for _, task in schedule.tasks_of(s):
        if task.kind is Kind.F:
            level += per_mb_by_chunk[task.chunk]
        elif task.kind in (Kind.BW, Kind.W):
            level -= per_mb_by_chunk[task.chunk]
        peak = max(peak, level)
    return peak


def _check_int(name: str, value, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"partition: {name} must be an integer >= {low}, got {value!r}")
    return value


def partition(profile: ProfiledModel, *, p: int, v: int = 1, m: int, schedule: str | Schedule = "1f1b",
              memory_budget_bytes: float | None = None, remat_options: Sequence[str] = ("none", "full"),
              param_copies: float = PARAM_COPIES, link: Link | float | None = None,
              fit_spmd: bool = True,
              measure_memory: Callable[[tuple[str, ...], tuple[int, ...]], float] | None = None
              ) -> PipelinePlan:
    """Assign contiguous layers to the ``p * v`` global stages and a remat policy to
    each stage; see the module docstring for the cost and memory model.

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
    checked against its own buffers (``_fit_spmd``), which can move a stage to a
    policy that keeps less; ``fit_spmd=False`` keeps the per-device optimum (what
    a runtime with per-device buffers would run). ``measure_memory(remat, counts)``,
    when given, replaces the model in that check with a measurement (the bytes per
    device of the compiled step for those policies and layer counts — the
    ahead-of-time check the tuner uses), and ``spmd_memory_bytes`` is then measured.
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
    if sched.placement != interleaved_placement(p, v):
        raise ConfigError("partition: the schedule's placement is not Megatron's (global stage c*p + s "
                          "on device s), which StageLayout assumes")
    options = tuple(remat_options) if not isinstance(remat_options, str) else (remat_options,)
    bad = [o for o in options if o not in REMAT_POLICIES]
    if not options or bad:
        raise ConfigError(f"partition: remat_options {list(options)} must be a non-empty subset of "
                          f"{list(REMAT_POLICIES)}")
    if "dots" in options and not profile.has_dots:
        raise ConfigError("partition: remat 'dots' needs a profile with dots_residual_bytes and "
                          "dots_recompute_s (measure_layer_costs(..., dots=True))")
    options = tuple(o for o in REMAT_POLICIES if o in options)   # usually fastest first: none, dots, full
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
    model = _Model(profile, G, split)
    inflight = sched.peak_in_flight()

    def device_memory(g: int, fig: dict[str, float]) -> float:
        return param_copies * fig["params"] + inflight[g % p] * fig["per_mb"] + fig["transient"]

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

        bounds = _split_dp(L, G, cost)
        if bounds is None:   # no split fits: name a stage of the fastest split
            _raise_no_fit(model, sched, options, budget, param_copies, inflight)
        spans = [range(bounds[g], bounds[g + 1]) for g in range(G)]
        chosen = _choose_remat(model, sched, spans, options, budget, param_copies, inflight)
    else:
        spans, chosen = _interleaved_split(model, sched, options, budget, param_copies, inflight)

    def stage_costs(fig_list) -> StageCosts:
        base = StageCosts.from_layers(list(profile.layers), [g for g in range(G) for _ in spans[g]], G,
                                      embed=profile.embed, head=profile.head)
        rec = [f["recompute"] for f in fig_list]
        return dataclasses.replace(base, B=[b + r for b, r in zip(base.B, rec, strict=True)],
                                   BW=[b + r for b, r in zip(base.BW, rec, strict=True)])

    def predict(costs: StageCosts) -> dict[str, SimResult]:
        return {mode: simulate(sched, costs, link=link, mode=mode) for mode in ("async", "lockstep")}

    chosen, spmd = _fit_spmd(model, sched, spans, chosen, options, budget if fit_spmd else None,
                             param_copies, measure_memory)
    figs = [model.stage(g, spans[g].start, spans[g].stop, chosen[g]) for g in range(G)]
    memory = _memory(sched, spans, figs, param_copies)
    costs = stage_costs(figs)
    sims = predict(costs)
    even = _even_split(model, sched, profile, G, param_copies, link)
    return PipelinePlan(
        schedule=sched.name, p=p, v=v, m=m, counts=tuple(len(r) for r in spans), layers=tuple(spans),
        device=tuple(g % p for g in range(G)), remat=tuple(chosen),
        forward_s=tuple(f["F"] for f in figs), backward_s=tuple(f["back"] for f in figs),
        recompute_s=tuple(f["recompute"] for f in figs), stage_time_s=tuple(f["time"] for f in figs),
        memory_bytes=tuple(sum(x) for x in zip(*memory, strict=True)),
        memory_params_bytes=memory[0], memory_activations_bytes=memory[1], memory_transient_bytes=memory[2],
        in_flight=tuple(inflight), memory_budget_bytes=budget, spmd_memory_bytes=spmd,
        step_time_s={k: s.step_time for k, s in sims.items()},
        utilization={k: s.mean_utilization for k, s in sims.items()},
        even_split=even, costs=costs, simulations=sims, note=profile.note)


def _spmd_memory(model: _Model, sched: Schedule, spans, chosen, param_copies: float):
    """(bytes per device, {policy: buffer bytes, and which stage sets its depth}) as
    the SPMD runtime lays them out: one program, so every buffer is as deep as its
    deepest stage and as wide as its widest; all parameters of a device's stages
    plus embed and head (replicated); the largest transient of any stage."""
    from mindpipe_jax.parallel.pipeline.tickplan import make_plan

    p, G = sched.num_stages, sched.num_global_stages
    plan = make_plan(sched, tuple(chosen))
    figs = [model.stage(g, spans[g].start, spans[g].stop, chosen[g]) for g in range(G)]
    width = max(len(r) for r in spans) or 1
    # Per-microbatch bytes beyond the stage input, per layer slot of the padded stage.
    residual = {r: max((f["per_mb"] - model.act_in[spans[g].start]) / max(len(spans[g]), 1)
                       for g, f in enumerate(figs) if chosen[g] == r and g != G - 1)
                for r in plan.res_slots}
    # n slots, plus the slot each tick reads into the branch and the one it writes back.
    buffers = {r: (n + 2) * width * residual[r] for r, n in plan.res_slots.items()}
    owner = {}
    inflight = sched.peak_in_flight()
    for r in plan.res_slots:
        stages = [g for g in range(G - 1) if chosen[g] == r]
        owner[r] = max(stages, key=lambda g: (inflight[g % p], -g))
    act = max(model.act_in)
    e, h = model.prof.embed, model.prof.head
    params = max(sum(model._sum(model.params, spans[g].start, spans[g].stop) for g in range(s, G, p))
                 for s in range(p)) + e.param_bytes + h.param_bytes
    total = param_copies * params + (plan.x_slots + plan.g_slots) * act + sum(buffers.values()) \
        + max(f["transient"] for f in figs)
    return total, {r: (buffers[r], owner[r]) for r in buffers}


def _fit_spmd(model: _Model, sched: Schedule, spans, chosen, options, budget, param_copies,
              measure: Callable[[tuple[str, ...], tuple[int, ...]], float] | None = None):
    """Make the SPMD runtime fit the budget: while it does not, move the stage whose
    next leaner policy in ``options`` saves the most modelled bytes per second of
    recompute added. "Fits" is judged by ``measure(remat, counts)`` (e.g. the compiled
    program's temp bytes) when given, else by the model (``_spmd_memory``).
    Returns (policies, the figure that was judged)."""
    chosen = list(chosen)
    counts = tuple(len(r) for r in spans)
    less = {"none": ("dots", "full"), "dots": ("full",)}
    while True:
        modelled, _ = _spmd_memory(model, sched, spans, chosen, param_copies)
        total = float(measure(tuple(chosen), counts)) if measure is not None else modelled
        if budget is None or total <= budget:
            return chosen, total
        # A move: stage g, with every stage of the same policy holding at least as many
        # microbatches in flight, goes to its next leaner policy (moving only the
        # stage that sets a buffer's depth may save nothing while the next sets it).
        inflight = sched.peak_in_flight()
        p = sched.num_stages
        best = None
        for g in range(len(spans)):
            nxt = next((o for o in less.get(chosen[g], ()) if o in options), None)
            if nxt is None:
                continue
            group = [k for k in range(len(spans)) if chosen[k] == chosen[g]
                     and inflight[k % p] >= inflight[g % p]]
            trial = chosen.copy()
            for k in group:
                trial[k] = nxt
            saved = modelled - _spmd_memory(model, sched, spans, trial, param_copies)[0]
            if saved <= 0:
                continue
            added = sum(model.stage(k, spans[k].start, spans[k].stop, nxt)["time"]
                        - model.stage(k, spans[k].start, spans[k].stop, chosen[k])["time"] for k in group)
            key = max(added, 0.0) / saved
            if best is None or key < best[0]:
                best = (key, group, nxt)
        if best is None:
            raise ConfigError(
                f"memory budget {budget / MB:.1f} MB per device is too small for the SPMD runtime: "
                f"remat {'/'.join(chosen)} needs {total / MB:.1f} MB ({'compiled' if measure else 'model'}"
                f"; each policy's buffer as deep as its deepest stage); raise the budget, allow remat "
                f"{', '.join(REMAT_POLICIES)}, add stages or use fewer microbatches")
        for k in best[1]:
            chosen[k] = best[2]


def _memory(sched: Schedule, spans, figs, param_copies: float):
    """Per device: (params+optimizer, in-flight activations, transient) bytes."""
    p, v = sched.num_stages, sched.virtual_stages
    params, acts, trans = [], [], []
    for s in range(p):
        gs = [c * p + s for c in range(v)]
        params.append(param_copies * sum(figs[g]["params"] for g in gs))
        acts.append(_device_peak(sched, s, [figs[g]["per_mb"] for g in gs]))
        trans.append(max(figs[g]["transient"] for g in gs))
    return tuple(params), tuple(acts), tuple(trans)


def _choose_remat(model: _Model, sched: Schedule, spans, options, budget, param_copies,
                  inflight) -> list[str]:
    """Per global stage, the fastest policy that lets its device fit."""
    p, v, G = sched.num_stages, sched.virtual_stages, sched.num_global_stages
    chosen = ["none"] * G
    for s in range(p):
        gs = [c * p + s for c in range(v)]
        if len(options) ** v <= 1024:
            combos = list(itertools.product(options, repeat=v))
        else:
            combos = [(o,) * v for o in options]
        best, best_key, least = None, None, None
        for combo in combos:
            figs = [model.stage(g, spans[g].start, spans[g].stop, o) for g, o in zip(gs, combo, strict=True)]
            mem = param_copies * sum(f["params"] for f in figs) \
                + _device_peak(sched, s, [f["per_mb"] for f in figs]) + max(f["transient"] for f in figs)
            if least is None or mem < least[0]:
                least = (mem, combo)
            if budget is not None and mem > budget:
                continue
            key = (max(f["time"] for f in figs), sum(f["recompute"] for f in figs))
            if best_key is None or key < best_key:
                best, best_key = combo, key
        if best is None:
            assert least is not None
            raise ConfigError(
                f"memory budget {budget / MB:.1f} MB per device is too small: "
                f"{'stage' if v == 1 else 'device'} {s} ({_describe(spans, gs, G, v > 1)}) needs at least "
                f"{least[0] / MB:.1f} MB with remat {'/'.join(least[1])} ({inflight[s]} microbatches in "
                f"flight); tried remat {', '.join(options)}"
                f"{' on every split' if v == 1 else ' on the candidate splits'}; raise the budget, "
                f"add stages or use fewer microbatches in flight")
        for g, o in zip(gs, best, strict=True):
            chosen[g] = o
    return chosen


def _interleaved_split(model: _Model, sched: Schedule, options, budget, param_copies, inflight):
    """v > 1: a device's chunks share its memory, so a split cannot be scored stage by
    stage. Candidate splits, each optimal for its own stage cost: time under each
    policy in ``options`` applied everywhere, and the fastest policy fitting a 1/v
    share of the budget with the chunk's own in-flight count. Each candidate gets
    its exact per-device remat (``_choose_remat``); the best (slowest stage, total
    work, evenness) wins. The first candidate's error is raised if none fits."""
    p, v, G, L = sched.num_stages, sched.virtual_stages, sched.num_global_stages, model.L
    per_chunk = [[0] * v for _ in range(p)]   # peak in-flight microbatches of one chunk
    for s in range(p):
        for c in range(v):
            per_chunk[s][c] = round(_device_peak(sched, s, [float(k == c) for k in range(v)]))

    def share_cost(g, i, j):
        s, c = g % p, g // p
        best = math.inf
        for policy in options:
            fig = model.stage(g, i, j, policy)
            need = param_copies * fig["params"] + per_chunk[s][c] * fig["per_mb"] + fig["transient"]
            if budget is None or need <= budget / v:
                best = min(best, fig["time"])
        return best

    costs = [(lambda g, i, j, pol=pol: model.stage(g, i, j, pol)["time"]) for pol in options]
    if budget is not None:
        costs.append(share_cost)
    best, best_key, first_error, seen = None, None, None, set()
    for cost in costs:
        bounds = _split_dp(L, G, cost)
        if bounds is None or tuple(bounds) in seen:
            continue
        seen.add(tuple(bounds))
        spans = [range(bounds[g], bounds[g + 1]) for g in range(G)]
        try:
            chosen = _choose_remat(model, sched, spans, options, budget, param_copies, inflight)
        except ConfigError as err:
            first_error = first_error or err
            continue
        times = [model.stage(g, spans[g].start, spans[g].stop, chosen[g])["time"] for g in range(G)]
        key = (max(times), sum(times), sum(t * t for t in times))
        if best_key is None or _less(key[:2], best_key[:2]) or (
                not _less(best_key[:2], key[:2]) and key[2] < best_key[2]):
            best, best_key = (spans, chosen), key
    if best is None:
        assert first_error is not None
        raise first_error
    return best


def _describe(spans, gs, G, name_stages: bool = False) -> str:
    parts = []
    for g in gs:
        r = spans[g]
        if len(r) > 1:
            text = f"layers {r.start}-{r.stop - 1}"
        else:
            text = f"layer {r.start}" if len(r) else "no layers"
        text += " + embed" if g == 0 else ""
        text += " + head" if g == G - 1 else ""
        parts.append(f"global stage {g}: {text}" if name_stages else text)
    return "; ".join(parts)


def _raise_no_fit(model: _Model, sched: Schedule, options, budget, param_copies, inflight):
    """No split fits (v == 1): report the device of the fastest split that does not."""
    G = sched.num_global_stages
    bounds = _split_dp(model.L, G, lambda g, i, j: model.stage(g, i, j, "none")["time"])
    assert bounds is not None
    spans = [range(bounds[g], bounds[g + 1]) for g in range(G)]
    _choose_remat(model, sched, spans, options, budget, param_copies, inflight)
    raise AssertionError("unreachable: the fastest split fits but the search found no split")


def _even_split(model: _Model, sched: Schedule, profile: ProfiledModel, G: int, param_copies: float,
                link) -> dict[str, Any]:
    """An even split without remat, for comparison."""
    from mindpipe_jax.parallel.pipeline.simulate import even_assignment

    stage_of = even_assignment(profile.num_layers, G)
    counts = [stage_of.count(g) for g in range(G)]
    starts = [sum(counts[:g]) for g in range(G)]
    spans = [range(starts[g], starts[g] + counts[g]) for g in range(G)]
    figs = [model.stage(g, spans[g].start, spans[g].stop, "none") for g in range(G)]
    costs = StageCosts.from_layers(list(profile.layers), stage_of, G, embed=profile.embed, head=profile.head)
    sims = {mode: simulate(sched, costs, link=link, mode=mode) for mode in ("async", "lockstep")}
    memory = _memory(sched, spans, figs, param_copies)
    return {"counts": tuple(counts), "slowest_stage_s": max(f["time"] for f in figs),
            "utilization_async": sims["async"].mean_utilization,
            "utilization_lockstep": sims["lockstep"].mean_utilization,
            "step_time_async_s": sims["async"].step_time, "step_time_lockstep_s": sims["lockstep"].step_time,
            "peak_memory_bytes": max(sum(x) for x in zip(*memory, strict=True))}
