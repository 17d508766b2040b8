"""Pipeline schedules as plain data: a table of who does what in every tick.

A schedule for ``p`` devices (pipeline *stages*), ``m`` microbatches and ``v``
model chunks per device is a table indexed ``[tick][stage]`` whose cells are a
``Task(microbatch, chunk, kind)`` or ``None`` (an idle bubble). The model is cut
into ``p * v`` *global stages*; ``Schedule.placement[stage][chunk]`` names the
global stage a device's chunk holds. The default is Megatron's interleaving:
device ``s`` holds global stages ``s, s + p, s + 2p, ...`` (chunk ``c`` is global
stage ``c * p + s``); a V-shape (ZB-V) or any other layout is one ``placement``
away, and nothing else here assumes the default.

Kinds of task
    ``F``  forward of one chunk for one microbatch (saves residuals).
    ``BW`` fused backward: input gradient *and* weight gradient, in one task. The
           schedules that do not split the backward (GPipe, 1F1B, interleaved) use it.
    ``B``  input gradient only (the critical path); its ``W`` comes later.
    ``W``  weight gradient only, deferred into bubbles (zero-bubble schedules).
    Each (microbatch, global stage) gets exactly one ``F``, then either one ``BW``
    or one ``B`` followed by one ``W``.

Tick model (what the SPMD runtime executes)
    Every task, whatever its kind, occupies exactly one tick on its device, and a
    device runs at most one task per tick. At the end of every tick all devices
    exchange activations and gradients (one ``ppermute``), so a value made in tick
    ``t`` is usable from tick ``t + 1`` on, on any device:

    * ``F`` of (mb, g) needs ``F`` of (mb, g - 1) in an earlier tick (g > 0);
    * ``B``/``BW`` of (mb, g) needs its own ``F`` in an earlier tick and, unless
      ``g`` is the last global stage (where the loss head seeds the gradient),
      ``B``/``BW`` of (mb, g + 1) in an earlier tick;
    * ``W`` of (mb, g) needs ``B`` of (mb, g) in an earlier tick (same device).

Bubble arithmetic
    ``bubble_fraction()`` counts slots: idle cells / (ticks * p). Every task counts
    as one tick, so a fused ``BW`` weighs the same as an ``F``. For GPipe and 1F1B
    that is harmless: their bubble is (p - 1) / (m + p - 1) whatever the F:B cost
    ratio, and the unit-tick count gives exactly that. For other ratios, and for
    schedules whose point is the cost mix (ZB-H1), ``bubble_fraction_weighted(cost)``
    replays the table with per-kind durations. Two replays are offered:

    * as soon as possible (default): each device keeps the table's order, each task
      starts when its device is free and its inputs exist. This is what an
      asynchronous (MPMD-like) executor would reach, and what the papers quote.
    * ``lockstep=True``: every tick lasts as long as its slowest task, which is what
      a tick-synchronous SPMD runtime pays (a tick mixing an ``F`` on one device and a
      ``BW`` on another costs a ``BW``).

Nothing here imports JAX: the tables are checked, measured and drawn with plain
Python, and the runtime only reads them.

The code lives in six modules, all re-exported here: ``types`` (``Kind``,
``Task``, ``ScheduleError``, ``ScheduleReport``, ``Timeline``), ``checks``
(the rules, shared by the validator and the generators), ``table``
(``Schedule`` and ``validate``), ``generators`` (the generators and the registry),
``vshape`` (the V-shaped ZB-V and DualPipeV, two chunks per device) and
``analytic`` (the closed-form figures set beside what a table measures).
"""

from __future__ import annotations

from mindpipe_jax.parallel.pipeline.schedules.analytic import Analytic, analytic
from mindpipe_jax.parallel.pipeline.schedules.checks import interleaved_placement
from mindpipe_jax.parallel.pipeline.schedules.generators import (
    SCHEDULES,
    Generator,  # noqa: F401  (public names of the old single module stay importable)
    afapab,
    from_orders,
    get_schedule,
    gpipe,
    interleaved,
    one_f_one_b,
    register_schedule,
    split_only_last,
    zb_h1,
)
from mindpipe_jax.parallel.pipeline.schedules.table import Schedule, validate
from mindpipe_jax.parallel.pipeline.schedules.types import (
    BACKWARD_KINDS,  # noqa: F401
    DEFAULT_COST,
    Cost,  # noqa: F401
    Kind,
    ScheduleError,
    ScheduleReport,
    Task,
    Timeline,
)
from mindpipe_jax.parallel.pipeline.schedules.vshape import (  # registers "zbv" and "dualpipev"
    dualpipev,
    fb_pair_timeline,
    fb_pairs,
    v_placement,
    zbv,
)

__all__ = [
    "Kind", "Task", "Schedule", "ScheduleError", "ScheduleReport", "Timeline",
    "validate", "from_orders", "interleaved_placement", "gpipe", "one_f_one_b", "interleaved", "zb_h1",
    "afapab", "SCHEDULES", "register_schedule", "get_schedule", "split_only_last", "DEFAULT_COST",
    "zbv", "dualpipev", "v_placement", "fb_pairs", "fb_pair_timeline", "Analytic", "analytic",
]
