"""When each chunk's data-parallel gradient sync can start: derived from the table.

A device's gradient for model chunk ``c`` is final once the last backward task
(BW, or W when the backward is split) of ``c`` has run on every stage; from then
on the all-reduce over the batch axes (``data`` × ``fsdp``) of that chunk's
gradient depends on nothing the rest of the step computes, so it can run behind
the remaining ticks. ``sync_points`` lists, per chunk, the tick after which that
holds, optionally cut into buckets of at most ``bucket_bytes`` (each its own
collective, as PyTorch DDP and Megatron bucket their all-reduces).

Every device runs the same program, so a chunk's sync is issued after the last
stage to finish it (the runtime splits its loop over ticks there, see
``runtime.pipeline_grads(grad_sync="chunk")``); in AFAPAB (all forwards, then all
backwards chunk by chunk in reverse) chunk ``v - 1`` finishes first, with
``(v - 1) m`` backward ticks still to come on every device, and chunk 0 last.
With Megatron-style ``"end"`` every sync waits for the last tick.

Pure Python; no JAX.
"""

from __future__ import annotations

import dataclasses

from mindpipe_jax.parallel.pipeline.schedules.table import Schedule
from mindpipe_jax.parallel.pipeline.schedules.types import Kind, Task

GRAD_SYNC_MODES = ("end", "chunk", "overlap")


@dataclasses.dataclass(frozen=True)
class SyncPoint:
    after_tick: int  # the collective is issued once ticks [0, after_tick] have run
    chunk: int       # which model chunk's gradients (every device's chunk ``chunk``)


def _tasks(schedule) -> list[tuple[int, Task]]:
    """``(tick, task)`` of a ``Schedule`` or of a ``FusedSchedule`` (several tasks a cell)."""
    cells = getattr(schedule, "cells", None)
    if cells is None:
        return [(t, task) for t, row in enumerate(schedule.table) for task in row if task is not None]
    return [(t, task) for t, row in enumerate(cells) for cell in row for task in cell if task is not None]


def last_backward_ticks(schedule: Schedule) -> list[int]:
    """Per chunk, the last tick at which any stage runs a BW or W task of it (of a
    ``Schedule`` or of its fused ticks, ``schedules.fused.FusedSchedule``)."""
    last = [-1] * getattr(schedule, "schedule", schedule).virtual_stages
    for t, task in _tasks(schedule):
        if task.kind in (Kind.BW, Kind.W):
            last[task.chunk] = max(last[task.chunk], t)
    return last


def sync_points(schedule: Schedule, mode: str = "chunk") -> tuple[SyncPoint, ...]:
    """The sync of each chunk in issue order: ``"chunk"`` and ``"overlap"`` right after
    the chunk's last backward anywhere, ``"end"`` all after the last tick."""
    if mode not in GRAD_SYNC_MODES:
        raise ValueError(f"grad_sync mode {mode!r} is not one of {', '.join(GRAD_SYNC_MODES)}")
    end = schedule.num_ticks - 1
    last = last_backward_ticks(schedule)
    points = [SyncPoint(end if mode == "end" else last[c], c) for c in range(len(last))]
    return tuple(sorted(points, key=lambda sp: (sp.after_tick, sp.chunk)))


def buckets(sizes: list[int], bucket_bytes: int | None) -> list[list[int]]:
    """Leaf indices grouped, in order, into buckets of at most ``bucket_bytes`` (a leaf
    bigger than that is a bucket of its own); ``None`` or 0: one bucket."""
    if not bucket_bytes:
        return [list(range(len(sizes)))]
    out: list[list[int]] = []
    used = 0
    for i, size in enumerate(sizes):
        if out and used + size <= bucket_bytes:
            out[-1].append(i)
            used += size
        else:
            out.append([i])
            used = size
    return out
