"""The other pictures: ``draw_plan`` (a vPipe partition plan: time per stage and
memory per device), ``draw_lanes`` (simulated steps, compute and communication
lanes per device) and ``draw_landscape`` (EPara's entropyput landscape and an online
run's batch and learning rate). Re-exported by ``mindpipe_jax.viz``.
"""

from __future__ import annotations

import os
from pathlib import Path

from mindpipe_jax.errors import ConfigError
from mindpipe_jax.parallel.pipeline.schedules import Kind
from mindpipe_jax.viz_common import (
    _NAMES,
    KIND_COLORS,
    _rgb,
    _shade,
    check_picture_path,
    require_matplotlib,
    save_figure,
)


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
    return save_figure(fig, path)


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
    return save_figure(fig, path)


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
    return save_figure(fig, path)
