"""Schedule pictures: ``draw_schedule`` (a pipeline schedule table as a timeline)
and ``schedule_summary`` (the same information as text, what ``mindpipe schedule``
prints). Re-exported by ``mindpipe_jax.viz``, whose docstring describes them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from mindpipe_jax.parallel.pipeline.schedules import (
    DEFAULT_COST,
    Kind,
    Schedule,
    analytic,
    fb_pair_timeline,
    fb_pairs,
)
from mindpipe_jax.viz_common import (
    _IDLE_FACE,
    _IDLE_HATCH,
    _KIND_NAMES,
    _NAMES,
    _shade,
    check_picture_path,
    require_matplotlib,
    save_figure,
)


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
    # One collection of boxes per stage: a Rectangle each took matplotlib ~0.7 ms,
    # minutes for the largest tables (p=64, m=2000: 384k boxes).
    boxes: list[list[tuple[float, float]]] = [[] for _ in range(p)]
    faces: list[list[tuple[float, float, float]]] = [[] for _ in range(p)]
    for t, row in enumerate(schedule.table):
        for s, task in enumerate(row):
            if task is None:
                continue
            start, end = spans[t][s]
            face = _shade(task.kind, task.chunk, v)
            kinds_used[(task.kind, task.chunk)] = None
            boxes[s].append((start, end - start))
            faces[s].append(face)
            label = str(task.microbatch) + (chr(ord("a") + task.chunk) if v > 1 else "")
            if (end - start) * inch_per_unit >= char_in * len(label) + 0.03:
                ax.text((start + end) / 2, s, label, ha="center", va="center",
                        fontsize=fontsize, color=_ink(face), zorder=3)
    for s in range(p):
        ax.broken_barh(boxes[s], (s - 0.4, 0.8), facecolors=faces[s], edgecolor="white",
                       linewidth=0.8, zorder=2)

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

    return save_figure(fig, path)
