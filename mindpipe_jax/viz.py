"""Pictures of what the library plans, for a person who would rather look than read.

``draw_schedule`` draws a pipeline schedule table as a timeline: one row per
stage (stage 0 on top), time left to right, one box per task coloured by kind
(F blue, B orange, BW red, W green; with ``v > 1`` chunks, a later chunk is a
darker shade of its kind), the microbatch number in each box that has room for it,
and idle time (the bubble) as light grey hatching. ``schedule_summary`` is the
same information as text (what ``mindpipe schedule`` prints).

matplotlib is imported only inside the drawing functions (it is in the ``plots``
and ``dev`` extras), and only through its object-oriented API with the Agg
canvas: no pyplot, no global backend switch, so drawing from a notebook or a
headless test leaves the caller's matplotlib state alone.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from mindpipe_jax.errors import ConfigError
from mindpipe_jax.parallel.pipeline.schedules import (
    DEFAULT_COST,
    Kind,
    Schedule,
    analytic,
    fb_pair_timeline,
    fb_pairs,
)

__all__ = ["draw_schedule", "draw_plan", "draw_lanes", "draw_landscape", "schedule_summary",
           "check_picture_path",
           "require_matplotlib",
           "PICTURE_FORMATS", "KIND_COLORS"]

# File types a picture can be written as (matplotlib picks the writer from the suffix).
PICTURE_FORMATS = (".png", ".svg", ".pdf")

# One colour per kind of task (Tableau 10: readable, distinct for colour-blind eyes
# by lightness as well as hue).
KIND_COLORS: Mapping[Kind, str] = {
    Kind.F: "#4c78a8",   # forward: blue
    Kind.B: "#f58518",   # input gradient: orange
    Kind.BW: "#e45756",  # fused backward: red
    Kind.W: "#54a24b",   # weight gradient: green
}
_KIND_NAMES = {Kind.F: "F  forward", Kind.B: "B  input grad", Kind.BW: "BW  backward (B+W)",
               Kind.W: "W  weight grad"}
_IDLE_FACE, _IDLE_HATCH = "#f4f4f4", "#cfcfcf"
_NAMES = {"1f1b": "1F1B", "gpipe": "GPipe", "zb-h1": "ZB-H1", "zbv": "ZB-V", "dualpipev": "DualPipeV"}

_MATPLOTLIB_MISSING = "matplotlib is needed for pictures: pip install 'mindpipe-jax[plots]'"


def require_matplotlib():
    """Import matplotlib lazily; a missing install is a user-fixable ConfigError."""
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch, Rectangle
    except ImportError:
        raise ConfigError(_MATPLOTLIB_MISSING) from None
    return Figure, FigureCanvasAgg, Rectangle, Patch


def check_picture_path(out_path: str | os.PathLike) -> Path:
    """Refuse, before anything is computed or written, a picture path whose suffix
    is not one of ``PICTURE_FORMATS`` or whose directory does not exist."""
    path = Path(out_path)
    if path.suffix.lower() not in PICTURE_FORMATS:
        got = repr(path.suffix) if path.suffix else "no suffix"
        raise ConfigError(f"picture file {str(path)!r} must end in one of "
                          f"{', '.join(PICTURE_FORMATS)} (got {got})")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise ConfigError(f"cannot write picture {str(path)!r}: directory {str(parent)!r} does not exist")
    if path.is_dir():
        raise ConfigError(f"cannot write picture {str(path)!r}: it is a directory")
    return path


# --------------------------------------------------------------------------- text
def _cost_text(cost: Mapping | None, kinds: set[Kind] | None = None) -> str:
    """``F=1, BW=2``: the durations of ``kinds`` (default: every kind given)."""
    table = {Kind(k): float(v) for k, v in (cost or DEFAULT_COST).items()}
    if Kind.BW not in table and Kind.B in table and Kind.W in table:
        table[Kind.BW] = table[Kind.B] + table[Kind.W]
    for kind, c in DEFAULT_COST.items():
        table.setdefault(kind, c)
    return ", ".join(f"{k.value}={table[k]:g}" for k in Kind if kinds is None or k in kinds)


def schedule_summary(schedule: Schedule) -> str:
    """The ASCII timeline (``Schedule.render``), the tick count, the bubble fraction
    counted in unit ticks and replayed with ``DEFAULT_COST`` durations, and the
    peak live activations per stage (plus pending weight gradients when the
    backward is split); for a generated schedule with a closed form, the analytic
    bubble and memory beside them (``schedules.analytic``), and for DualPipeV its
    F&B pairs replayed as one unit next to the DualPipe repository's figure."""
    p = schedule.num_stages
    unit = schedule.bubble_fraction()
    weighted = schedule.timeline(DEFAULT_COST)
    live = schedule.peak_live_activations()
    kinds = {t.kind for row in schedule.table for t in row if t is not None}
    lines = [schedule.render(), "",
             f"ticks:                 {schedule.num_ticks} "
             f"({p} stages x {schedule.num_ticks} ticks = {p * schedule.num_ticks} slots, "
             f"{sum(t is None for row in schedule.table for t in row)} idle)",
             f"bubble fraction:       {unit:.3f} ({unit:.1%}) counting every task as one tick",
             f"bubble (weighted):     {weighted.bubble_fraction:.3f} ({weighted.bubble_fraction:.1%}) "
             f"with durations {_cost_text(DEFAULT_COST, kinds)}, makespan {weighted.makespan:g}",
             "peak live activations: " + "  ".join(f"s{s}={n}" for s, n in enumerate(live))
             + f"  (max {max(live)}; F done, backward not yet)"]
    pending = schedule.peak_pending_weight_grads()
    if any(pending):
        lines.append("peak pending W:        " + "  ".join(f"s{s}={n}" for s, n in enumerate(pending))
                     + "  (B done, W not yet)")
    figures = analytic(schedule, DEFAULT_COST)
    if figures is not None:
        weighted_text = ("no closed form for these durations" if figures.weighted_bubble is None
                         else f"{figures.weighted_bubble:.3f} weighted")
        lines += [f"analytic bubble:       {figures.bubble:.3f} in ticks, {weighted_text}  "
                  f"({figures.formula})",
                  f"analytic live:         {figures.peak_live}  ({figures.memory})"]
        if figures.paired_bubble is not None:
            paired = fb_pair_timeline(schedule, DEFAULT_COST).bubble_fraction
            lines.append(f"F&B pairs as one unit: {paired:.3f} replayed, {figures.paired_bubble:.3f} "
                         f"analytic ({figures.paired_formula}: the DualPipe repository's figure)")
    return "\n".join(lines)


# ------------------------------------------------------------------------ picture
def _rgb(color: str) -> tuple[float, float, float]:
    color = color.lstrip("#")
    return tuple(int(color[i:i + 2], 16) / 255 for i in (0, 2, 4))  # type: ignore[return-value]


def _shade(kind: Kind, chunk: int, v: int) -> tuple[float, float, float]:
    """The kind's colour; with several chunks, chunk 0 is lightest and the last
    chunk the full colour, so a chunk reads as a lightness step within its hue."""
    r, g, b = _rgb(KIND_COLORS[kind])
    if v <= 1:
        return r, g, b
    mix = 0.55 * (1 - chunk / (v - 1))   # fraction of white blended in
    return tuple(c + (1 - c) * mix for c in (r, g, b))  # type: ignore[return-value]


def _ink(rgb: tuple[float, float, float]) -> str:
    """Black or white text, whichever reads better on ``rgb``."""
    r, g, b = rgb
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.6 else "white"


def draw_schedule(schedule: Schedule, out_path: str | os.PathLike, *,
                  cost: Mapping | None = None, title: str | None = None) -> Path:
    """Draw ``schedule`` as a timeline and write it to ``out_path`` (.png, .svg or .pdf).

    Without ``cost`` every task is one tick wide (the tick model the SPMD runtime
    executes). With ``cost`` (a mapping kind -> duration, e.g. ``DEFAULT_COST``
    where a fused BW is twice an F) the boxes sit where ``schedule.timeline(cost)``
    puts them (as-soon-as-possible replay), so a BW box is wider and the bubble is
    the weighted one. Returns the path written.
    """
    path = check_picture_path(out_path)
    Figure, FigureCanvasAgg, Rectangle, Patch = require_matplotlib()

    p, m, v = schedule.num_stages, schedule.num_microbatches, schedule.virtual_stages
    if cost is None:
        spans = [[None if task is None else (float(t), float(t + 1)) for task in row]
                 for t, row in enumerate(schedule.table)]
        makespan, bubble = float(schedule.num_ticks), schedule.bubble_fraction()
        xlabel, how = "tick", "every task one tick"
    else:
        timeline = schedule.timeline(cost)
        spans = [[None if task is None else (timeline.start[t][s], timeline.end[t][s])
                  for s, task in enumerate(row)] for t, row in enumerate(schedule.table)]
        makespan, bubble = timeline.makespan, timeline.bubble_fraction
        kinds = {t.kind for row in schedule.table for t in row if t is not None}
        xlabel = f"time (durations {_cost_text(cost, kinds)}, as-soon-as-possible replay)"
        how = f"weighted, makespan {makespan:g}"
    live = schedule.peak_live_activations()

    # Size: about a quarter inch per unit of time, within sane bounds.
    plot_w = min(max(0.26 * makespan, 6.0), 22.0)
    fig_w, fig_h = plot_w + 2.4, 0.55 * p + 2.1
    fig = Figure(figsize=(fig_w, fig_h), dpi=150, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()

    # The bubble: every row starts as hatched idle time; tasks are drawn over it.
    for s in range(p):
        ax.add_patch(Rectangle((0, s - 0.4), makespan, 0.8, facecolor=_IDLE_FACE,
                               edgecolor=_IDLE_HATCH, hatch="////", linewidth=0, zorder=1))

    # Room for a label: inches per unit of time vs. roughly 0.075 in per character.
    inch_per_unit = plot_w / makespan if makespan else 0.0
    fontsize = 7 if inch_per_unit >= 0.2 else 6
    char_in = 0.0085 * fontsize * 1.25
    kinds_used: dict[tuple[Kind, int], None] = {}
    for t, row in enumerate(schedule.table):
        for s, task in enumerate(row):
            if task is None:
                continue
            start, end = spans[t][s]
            face = _shade(task.kind, task.chunk, v)
            kinds_used[(task.kind, task.chunk)] = None
            ax.add_patch(Rectangle((start, s - 0.4), end - start, 0.8, facecolor=face,
                                   edgecolor="white", linewidth=0.8, zorder=2))
            label = str(task.microbatch) + (chr(ord("a") + task.chunk) if v > 1 else "")
            if (end - start) * inch_per_unit >= char_in * len(label) + 0.03:
                ax.text((start + end) / 2, s, label, ha="center", va="center",
                        fontsize=fontsize, color=_ink(face), zorder=3)

    # DualPipeV's F&B pairs (a forward and the other chunk's backward that DualPipe
    # overlaps): one black border around both boxes, as in DualPipe's own pictures.
    pairs = fb_pairs(schedule) if schedule.name == "dualpipev" else []
    for s, device_pairs in enumerate(pairs):
        for t0, t1 in device_pairs:
            start, end = spans[t0][s][0], spans[t1][s][1]
            ax.add_patch(Rectangle((start, s - 0.43), end - start, 0.86, facecolor="none",
                                   edgecolor="black", linewidth=0.9, zorder=4))

    ax.set_xlim(0, makespan)
    ax.set_ylim(p - 0.5, -0.5)   # stage 0 on top
    if v > 1:   # name the global stages each device holds (interleaved: s, s + p; V: s, 2p - 1 - s)
        ax.set_yticks(range(p), [f"stage {s} ({', '.join(map(str, schedule.placement[s]))})"
                                 for s in range(p)])
    else:
        ax.set_yticks(range(p), [f"stage {s}" for s in range(p)])
    ax.set_xlabel(xlabel)
    if cost is None and makespan <= 60:
        ax.set_xticks(range(0, int(makespan) + 1, 1 if makespan <= 30 else 2))
        ax.tick_params(axis="x", labelsize=7)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.tick_params(axis="y", length=0)

    # Peak live activations, at the right end of each row.
    right = ax.secondary_yaxis("right")
    right.set_yticks(range(p), [f"{n} live" for n in live])
    right.tick_params(length=0, labelsize=8)
    right.spines["right"].set_visible(False)
    right.set_ylabel("peak live activations", fontsize=8)

    name = _NAMES.get(schedule.name, schedule.name)
    ax.set_title(title or f"{name}   p={p}  m={m}  v={v}   ·   {schedule.num_ticks} ticks   ·   "
                          f"bubble {bubble:.1%} ({how})", fontsize=11, loc="left")

    handles = []
    for kind in Kind:
        chunks = sorted(c for (k, c) in kinds_used if k is kind)
        for c in chunks:
            suffix = f", chunk {chr(ord('a') + c)}" if v > 1 else ""
            handles.append(Patch(facecolor=_shade(kind, c, v), edgecolor="white",
                                 label=_KIND_NAMES[kind] + suffix))
    handles.append(Patch(facecolor=_IDLE_FACE, edgecolor=_IDLE_HATCH, hatch="////", label="idle (bubble)"))
    if any(pairs):
        handles.append(Patch(facecolor="none", edgecolor="black", label="F&B pair (overlapped in DualPipe)"))
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 5),
               fontsize=8, frameon=False, handlelength=1.6)

    fig.savefig(path)
    return path


# --------------------------------------------------------------------- plan picture
def draw_plan(plan, out_path: str | os.PathLike, *, title: str | None = None) -> Path:
    """Draw a ``partition.PipelinePlan`` and write it to ``out_path`` (.png, .svg, .pdf).

    Left: per global stage, the predicted time of one microbatch through it, as
    stacked bars (forward, backward, remat recompute), the layers it holds and its
    remat policy above the bar, and the slowest stage as a dashed line. Right: per
    device, the predicted memory (parameters with gradients and optimizer state,
    microbatches in flight, one microbatch rebuilt by remat) against the memory
    budget (red dashed line). Returns the path written.
    """
    path = check_picture_path(out_path)
    Figure, FigureCanvasAgg, Rectangle, Patch = require_matplotlib()
    from matplotlib.lines import Line2D

    G, p = plan.p * plan.v, plan.p
    mb = 2.0 ** 20
    fig = Figure(figsize=(min(max(6.0 + 0.55 * (G + p), 9.0), 22.0), 4.8), dpi=150, layout="constrained")
    FigureCanvasAgg(fig)
    ax_t, ax_m = fig.subplots(1, 2, width_ratios=[max(G, 2), max(p, 2)])

    # Time per global stage.
    xs = range(G)
    fwd = [1e3 * t for t in plan.forward_s]
    bwd = [1e3 * t for t in plan.backward_s]
    rec = [1e3 * t for t in plan.recompute_s]
    ax_t.bar(xs, fwd, 0.7, color=KIND_COLORS[Kind.F], edgecolor="white", label="forward")
    ax_t.bar(xs, bwd, 0.7, bottom=fwd, color=KIND_COLORS[Kind.BW], edgecolor="white", label="backward")
    if any(rec):
        ax_t.bar(xs, rec, 0.7, bottom=[a + b for a, b in zip(fwd, bwd, strict=True)], color="#b279a2",
                 edgecolor="white", hatch="xx", label="remat recompute")
    slowest = 1e3 * max(plan.stage_time_s)
    ax_t.axhline(slowest, color="#333333", linestyle="--", linewidth=1)
    for g in xs:
        r = plan.layers[g]
        text = (f"L{r.start}" if len(r) == 1 else f"L{r.start}-{r.stop - 1}") if len(r) else "no layers"
        extras = [e for e, on in (("embed", g == 0), ("head", g == G - 1)) if on]
        label = "\n".join([text + (" +" + "+".join(extras) if extras else ""), f"remat {plan.remat[g]}"])
        ax_t.text(g, 1e3 * plan.stage_time_s[g] + 0.02 * slowest, label, ha="center", va="bottom", fontsize=7)
    ax_t.set_ylim(0, slowest * 1.28)
    names = [f"{g}" if plan.v == 1 else f"{g}\n(dev {g % p})" for g in xs]
    ax_t.set_xticks(list(xs), names, fontsize=8)
    ax_t.set_xlabel("global stage")
    ax_t.set_ylabel("time per microbatch (ms)")
    ax_t.set_title(f"stage time (slowest {slowest:.3g} ms)", fontsize=10, loc="left")
    ax_t.legend(fontsize=7, frameon=False, loc="upper left", ncol=3)

    # Memory per device.
    xd = range(p)
    par = [b / mb for b in plan.memory_params_bytes]
    act = [b / mb for b in plan.memory_activations_bytes]
    tra = [b / mb for b in plan.memory_transient_bytes]
    ax_m.bar(xd, par, 0.6, color="#9d9d9d", edgecolor="white", label="params+grads+optimizer")
    ax_m.bar(xd, act, 0.6, bottom=par, color="#72b7b2", edgecolor="white", label="in-flight microbatches")
    if any(tra):
        ax_m.bar(xd, tra, 0.6, bottom=[a + b for a, b in zip(par, act, strict=True)], color="#eeca3b",
                 edgecolor="white", label="one microbatch rebuilt by remat")
    total = [b / mb for b in plan.memory_bytes]
    top = max(total)
    handles, _ = ax_m.get_legend_handles_labels()
    if plan.memory_budget_bytes is not None:
        budget = plan.memory_budget_bytes / mb
        ax_m.axhline(budget, color="#d62728", linestyle="--", linewidth=1.2)
        handles.append(Line2D([], [], color="#d62728", linestyle="--", label=f"budget {budget:.4g} MB"))
        top = max(top, budget)
    for s in xd:
        ax_m.text(s, total[s] + 0.02 * top, f"{total[s]:.3g} MB\n{plan.in_flight[s]} in flight",
                  ha="center", va="bottom", fontsize=7)
    ax_m.set_ylim(0, top * 1.3)
    ax_m.set_xticks(list(xd), [f"{s}" for s in xd], fontsize=8)
    ax_m.set_xlabel("device (pipe rank)")
    ax_m.set_ylabel("memory (MB, 1 MB = 2^20 bytes)")
    ax_m.set_title("predicted memory per device", fontsize=10, loc="left")
    ax_m.legend(handles=handles, fontsize=7, frameon=False, loc="upper right")
    for ax in (ax_t, ax_m):
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)

    name = _NAMES.get(plan.schedule, plan.schedule)
    fig.suptitle(title or f"vPipe plan: {name}  p={plan.p} v={plan.v} m={plan.m}, layers per stage "
                          f"{list(plan.counts)}   ·   predicted utilization {plan.utilization['async']:.2f} "
                          f"(async), {plan.utilization['lockstep']:.2f} (lockstep)", fontsize=10)
    fig.savefig(path)
    return path


# ------------------------------------------------------- simulated compute/communication lanes
_SYNC_COLOR, _SEND_COLOR = "#8e6bbf", "#a0a0a0"


def draw_lanes(results, out_path: str | os.PathLike, *, titles=None, time_scale: float = 1.0,
               time_label: str = "time (s)") -> Path:
    """Draw simulated steps (``simulate.SimResult``, one panel each, on one time
    axis) with two lanes per device: compute (tasks coloured as in
    ``draw_schedule``) and communication (pipeline sends grey, gradient syncs
    purple, a later chunk darker). ``time_scale`` multiplies event times (e.g.
    1e3 with ``time_label="time (ms)"``). Returns the path written."""
    path = check_picture_path(out_path)
    Figure, FigureCanvasAgg, Rectangle, Patch = require_matplotlib()
    results = list(results)
    if not results:
        raise ConfigError("draw_lanes needs at least one simulation result")
    titles = list(titles) if titles is not None else [r.summary() for r in results]
    span = time_scale * max(r.step_time for r in results) or 1.0
    rows = [2 * r.num_devices for r in results]
    fig = Figure(figsize=(12.0, 0.9 + 0.32 * sum(rows) + 0.5 * len(results)), dpi=150, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(results), 1, sharex=True, squeeze=False, height_ratios=rows)[:, 0]
    used: dict[tuple, None] = {}
    for ax, res, title in zip(axes, results, titles, strict=True):
        v = 1 + max((e.chunk or 0 for e in res.events), default=0)
        for e in res.events:
            if e.lane == "compute":
                face, y, h = _shade(Kind(e.kind), e.chunk or 0, v), 2 * e.device, 0.8
                used[("compute", e.kind, e.chunk or 0)] = None
            else:
                sync = e.kind == "sync"
                base = _SYNC_COLOR if sync else _SEND_COLOR
                r, g, b = _rgb(base)
                mix = 0.5 * (1 - (e.chunk or 0) / (v - 1)) if sync and v > 1 else 0.0
                face = tuple(c + (1 - c) * mix for c in (r, g, b))
                y, h = 2 * e.device + 1, 0.5
                used[("network", "sync" if sync else "send", e.chunk or 0 if sync else 0)] = None
            ax.add_patch(Rectangle((time_scale * e.start, y - h / 2), time_scale * e.duration, h,
                                   facecolor=face, edgecolor="none", zorder=2))
        n = res.num_devices
        ax.set_ylim(2 * n - 0.5, -0.5)
        ax.set_yticks(range(2 * n), [f"dev {d} {lane}" for d in range(n) for lane in ("compute", "comm")],
                      fontsize=7)
        ax.axvline(time_scale * res.compute_time, color="black", linewidth=0.6, linestyle=":", zorder=3)
        ax.set_title(title, fontsize=9, loc="left")
        ax.tick_params(axis="y", length=0)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    axes[-1].set_xlim(0, span)
    axes[-1].set_xlabel(time_label + "   (dotted line: end of compute)")
    handles = []
    for lane, kind, chunk in sorted(used):
        v_all = 1 + max(c for (_, _, c) in used)
        if lane == "compute":
            face, label = _shade(Kind(kind), chunk, v_all), f"{kind} chunk {chunk}"
        else:
            r, g, b = _rgb(_SYNC_COLOR if kind == "sync" else _SEND_COLOR)
            mix = 0.5 * (1 - chunk / (v_all - 1)) if kind == "sync" and v_all > 1 else 0.0
            face = tuple(c + (1 - c) * mix for c in (r, g, b))
            label = f"gradient sync chunk {chunk}" if kind == "sync" else "pipeline send"
        handles.append(Patch(facecolor=face, label=label))
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 6), fontsize=8,
               frameon=False)
    fig.savefig(path)
    return path


# ------------------------------------------------------------------ tuner landscape
def draw_landscape(result, out_path: str | os.PathLike, *, trajectory=None, top_meshes: int = 4,
                   title: str | None = None) -> Path:
    """Draw EPara's view of the space and write it to ``out_path``.

    Left: entropyput (samples/s x statistical efficiency) against the global batch,
    one line per layout (the ``top_meshes`` layouts whose best point is highest),
    measured points filled, predicted ones hollow. Right (with ``trajectory``, a
    run's history: dicts with ``step`` and ``tuner/batch``, ``lr``): the batch size
    and the learning rate an online run went through. ``result`` is a
    ``tuner.tune.TuneResult``. Returns the path written.
    """
    path = check_picture_path(out_path)
    Figure, FigureCanvasAgg, _, _ = require_matplotlib()
    fig = Figure(figsize=(11.0 if trajectory else 6.5, 4.4), dpi=150, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2 if trajectory else 1)
    ax = axes[0] if trajectory else axes

    def layout_of(c) -> str:
        return " | ".join(part for part in c.label().split(" | ") if not part.startswith("B"))

    lines: dict[str, list] = {}
    for row in result.rows:
        if row.feasibility is not None and not row.feasibility.fits:
            continue
        lines.setdefault(layout_of(row.candidate), []).append(row)

    def best_of(rows) -> float:
        return max(r.measured_entropyput or r.predicted_entropyput for r in rows)

    palette = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2"]
    ranked = sorted(lines.items(), key=lambda kv: -best_of(kv[1]))[:top_meshes]
    for (name, rows), color in zip(ranked, palette, strict=False):
        rows = sorted(rows, key=lambda r: r.candidate.global_batch)
        xs = [r.candidate.global_batch for r in rows]
        ys = [r.measured_entropyput or r.predicted_entropyput for r in rows]
        ax.plot(xs, ys, color=color, linewidth=1.4, label=name)
        for r, x, y in zip(rows, xs, ys, strict=True):
            filled = r.measured_s is not None
            ax.plot([x], [y], "o", color=color, markerfacecolor=color if filled else "white", markersize=6)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("global batch (sequences)")
    ax.set_ylabel("entropyput (samples/s x efficiency)")
    noise = "unknown" if result.b_noise is None else f"{result.b_noise:.0f}"
    ax.set_title(f"layouts (filled = measured), B_noise {noise}, b0 {result.b0}", fontsize=9, loc="left")
    ax.legend(fontsize=7, frameon=False)
    if trajectory:
        tr = axes[1]
        points = [h for h in trajectory if "tuner/batch" in h]
        steps = [h["step"] for h in points]
        tr.step(steps, [h["tuner/batch"] for h in points], where="post", color="#4c78a8",
                label="global batch")
        tr.set_xlabel("step")
        tr.set_ylabel("global batch", color="#4c78a8")
        lr_points = [h for h in trajectory if "lr" in h]
        if lr_points:
            twin = tr.twinx()
            twin.plot([h["step"] for h in lr_points], [h["lr"] for h in lr_points], color="#e45756",
                      linewidth=1.2)
            twin.set_ylabel("learning rate", color="#e45756")
        tr.set_title("online run: batch and learning rate", fontsize=9, loc="left")
    fig.suptitle(title or "EPara: entropyput landscape", fontsize=10)
    fig.savefig(path)
    return path
