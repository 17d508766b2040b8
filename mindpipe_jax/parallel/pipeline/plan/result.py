"""The partitioner's result: ``PipelinePlan``, its figures per stage and per device,
the ``StageLayout`` it runs as and the table ``mindpipe plan`` prints."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mindpipe_jax.parallel.pipeline.plan.memory import MB, PARAM_COPIES
from mindpipe_jax.sim import SimResult, StageCosts


@dataclass(frozen=True)
class PipelinePlan:
    """Layers, remat and predictions per stage. Per global stage ``g`` (tuples of
    ``p * v``): ``counts``, ``layers`` (a ``range``), ``device``, ``remat``,
    ``forward_s``/``backward_s``/``recompute_s`` and ``stage_time_s`` (their sum:
    the stage's work per microbatch); ``tick_slot_s``: what every device spends per
    tick moving residual slots in the SPMD runtime (``memory.slot_tick_seconds``), in
    the "lockstep" and "as run" predictions. Per device (tuples of ``p``):
    ``memory_bytes`` = ``memory_params_bytes`` + ``memory_activations_bytes`` +
    ``memory_transient_bytes`` (the model is in ``memory``) and ``in_flight``.
    Predictions from ``simulate.simulate`` with these stage costs and ``link``:
    ``step_time_s`` and ``utilization`` for ``"async"`` (an MPMD executor) and
    ``"lockstep"`` (the SPMD runtime's tick loop). ``remat`` is what
    ``pipeline_grads(remat=plan.remat)`` and ``parallel.stage_remat`` take;
    ``spmd_memory_bytes`` the per-device figure of the SPMD runtime (see
    ``memory``). ``even_split``: the same figures for an even split without remat (and
    ``step_time_run_s``: its step as this layout runs it, slot moves priced)."""

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
    fuse_ticks: str = "auto"  # how the runtime re-times the table (schedules.fused) under this plan
    # Which global stages each device holds, by chunk, where not Megatron's c*p + s (a V)
    placement: tuple[tuple[int, ...], ...] | None = None
    split_last: int = -1  # parallel.split_last of the table planned (-1: as generated)
    spmd_memory_compiled: bool = False  # spmd_memory_bytes measured (partition's measure_memory)
    # choose_split_last: each split_last tried -> its step as run (seconds)
    split_last_tried: dict[int, float] = field(default_factory=dict)
    tick_slot_s: float = 0.0

    @property
    def num_layers(self) -> int:
        return sum(self.counts)

    @property
    def slowest_stage_s(self) -> float:
        return max(self.stage_time_s)

    def layout(self):
        """The ``StageLayout`` for ``pipeline_grads(..., layout=plan.layout())``."""
        from mindpipe_jax.parallel.pipeline.runtime.layout import StageLayout

        return StageLayout(self.counts, self.p, self.v, self.placement)

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
            chunk = g // self.p if self.placement is None else self.placement[s].index(g)
            dev = str(s) if self.v == 1 else f"{s}.{chunk}"
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
        share = " of the share above, + what the step gathers" if "parameters per device" in self.note else ""
        out += ["",
                f"slowest stage {ms * self.slowest_stage_s:.3f} ms; memory = params+grads+Adam "
                f"({PARAM_COPIES:g} copies{share}) + in-flight microbatches + one rebuilt microbatch "
                f"under remat",
                f"predicted step: async {ms * self.step_time_s['async']:.3f} ms (utilization "
                f"{self.utilization['async']:.3f}), lockstep {ms * self.step_time_s['lockstep']:.3f} ms "
                f"(utilization {self.utilization['lockstep']:.3f})"]
        if "as run" in self.step_time_s:
            slots = (f", each tick {ms * self.tick_slot_s:.3f} ms of residual slot moves on every device"
                     if self.tick_slot_s else "")
            out.append(f"as the SPMD runtime runs it (fused ticks, {self.fuse_ticks}; neighbour "
                       f"replay{slots}): {ms * self.step_time_s['as run']:.3f} ms (utilization "
                       f"{self.utilization['as run']:.3f})")
            if "lockstep run" in self.step_time_s:
                out.append(f"in lockstep, as this layout runs (tensor > 1: every device runs every branch "
                           f"of a fused tick, plan/lockstep.py): "
                           f"{ms * self.step_time_s['lockstep run']:.3f} ms "
                           f"(utilization {self.utilization['lockstep run']:.3f}); the tick mode and remat "
                           f"were chosen on it, the split on the slowest stage")
        if self.split_last_tried:
            order = sorted(self.split_last_tried, key=lambda k: (k == -1, k))  # "all" last
            tried = ", ".join(f"{'all' if k == -1 else k} {ms * self.split_last_tried[k]:.3f} ms"
                              for k in order)
            out.append(f"split_last (backwards split into B and W: only the last k microbatches'), step as "
                       f"run: {tried} -> {'all' if self.split_last == -1 else self.split_last}")
        even = self.even_split
        # its step as run, beside the plan's (the figure remat and tick mode were chosen on)
        ran = (f", step as run {ms * even['step_time_run_s']:.3f} ms (the plan's "
               f"{ms * self.step_time_s.get('lockstep run', self.step_time_s['as run']):.3f} ms)"
               if "step_time_run_s" in even and "as run" in self.step_time_s else "")
        out.append(f"even split {list(even['counts'])}, no remat: slowest stage "
                   f"{ms * even['slowest_stage_s']:.3f} ms{ran}, async utilization "
                   f"{even['utilization_async']:.3f}, lockstep {even['utilization_lockstep']:.3f}; "
                   f"peak memory {even['peak_memory_bytes'] / MB:.1f} MB")
        if self.spmd_memory_compiled:
            out.append(f"SPMD runtime: {self.spmd_memory_bytes / MB:.1f} MB per device (compiled: the train "
                       f"step's peak, arguments + temporaries + outputs - donated, XLA's memory analysis)")
        else:
            out.append(f"SPMD runtime: {self.spmd_memory_bytes / MB:.1f} MB per device (every device holds "
                       f"each remat policy's buffer as deep as its deepest stage needs, and embed + head)")
        remat = "[" + ", ".join(f'"{r}"' for r in self.remat) + "]"
        fuse = "" if self.fuse_ticks == "auto" else f", fuse_mode={self.fuse_ticks!r}"
        fuse_key = "" if self.fuse_ticks == "auto" else f" parallel.fuse_ticks={self.fuse_ticks}"
        out.append(f"run it: pipeline_grads(..., remat={tuple(self.remat)}, "
                   f"layout=StageLayout({self.counts}, {self.p}, {self.v}){fuse}); "
                   f"train: parallel.stage_layers={list(self.counts)} "
                   f"parallel.stage_remat='{remat}'{fuse_key}"
                   + (f" parallel.split_last={self.split_last}" if self.split_last != -1 else ""))
        return "\n".join(out)
