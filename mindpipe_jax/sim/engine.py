"""The simulator's engine: ``simulate``, which checks its arguments, resolves the
costs and replays a schedule table in the async, lockstep or neighbour mode
(neighbour: of the fused ticks the SPMD runtime runs, ``schedules.fused``).
The model and the modes are described in ``sim/__init__.py``.

The pieces live beside it and are re-exported here: ``sim/result.py`` (what a
replay returns: ``Event``, ``SimResult``), ``sim/lanes.py`` (the per-device network
lanes and the syncs queued on them) and ``sim/modes.py`` (the three replays).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from mindpipe_jax.errors import ConfigError
from mindpipe_jax.parallel.pipeline.schedules import Schedule
from mindpipe_jax.parallel.pipeline.schedules.fused import FUSE_MODES, FusedSchedule
from mindpipe_jax.parallel.pipeline.schedules.fused import fuse as fuse_ticks
from mindpipe_jax.sim.costs import StageCosts, _is_number, _number, _Resolved
from mindpipe_jax.sim.modes import (
    _check_ring_neighbours,
    _crossing_bytes,  # noqa: F401  (sim/comm.py imports it from here)
    _run_async,
    _run_lockstep,
    _run_neighbour,
)
from mindpipe_jax.sim.network import DPSync, Link
from mindpipe_jax.sim.result import (
    Event,  # noqa: F401  (what moved stays importable from here)
    SimResult,
    _Trace,  # noqa: F401  (sim/comm.py imports it from here)
)

MODES = ("async", "lockstep", "neighbour")
CONTENTION = (True, False, "priority")


def simulate(schedule: Schedule | FusedSchedule, costs: StageCosts | Mapping | Callable | None = None, *,
             link: Link | float | None = None, dp_sync: DPSync | None = None, mode: str = "async",
             contention: bool | str = True, tick_overhead: float | Sequence[float] = 0.0,
             fuse: str | None = None) -> SimResult:
    """Replay ``schedule`` with ``costs`` on ``link`` (see the module docstring).

    ``costs``: ``StageCosts`` (per-stage durations and bytes), a mapping kind ->
    seconds (as ``Schedule.timeline``: missing kinds from ``DEFAULT_COST``) or a
    function ``(stage, task) -> seconds``; ``None`` is ``StageCosts()`` (F = B = W
    = 1, BW = 2). ``link``: a ``Link``, a float (every transfer takes that many
    seconds) or ``None`` (free). ``dp_sync``: gradient sync over data ranks, or
    ``None``. ``mode``: ``"async"``, ``"lockstep"`` or ``"neighbour"``. ``contention``:
    sends share the sender's network lane with each other and with its syncs
    (``False``: infinite link capacity; syncs still run one at a time per device).
    ``tick_overhead``: seconds every device spends in every tick besides its task
    (a tick-synchronous runtime's per-tick bookkeeping; one number or one per
    device); the tick modes only.

    ``fuse`` (neighbour mode only): how the table is re-timed into fused ticks
    before the replay, as the SPMD runtime does (``schedules.fused.fuse``). ``None``
    means ``"auto"``, the runtime's default, chosen exactly as the runtime chooses it
    (under ``DEFAULT_COST``, whatever ``costs`` says); ``"table"`` replays one task
    per tick (the table as it is), ``"in-order"`` and ``"forward-ahead"`` force a
    mode. ``schedule`` may also be a ``FusedSchedule`` (neighbour mode, ``fuse``
    None): it is replayed as given."""
    fused = None
    if isinstance(schedule, FusedSchedule):
        if mode != "neighbour":
            raise ConfigError(f"a FusedSchedule is what the SPMD runtime runs: simulate it in mode "
                              f"'neighbour', not {mode!r} (or pass its .schedule)")
        if fuse is not None:
            raise ConfigError(f"simulate got a FusedSchedule and fuse={fuse!r}: the schedule is already "
                              f"fused; pass fuse=None, or its .schedule with a fuse mode")
        fused, schedule = schedule, schedule.schedule
    if not isinstance(schedule, Schedule):
        raise ConfigError(f"simulate needs a Schedule, got {type(schedule).__name__}")
    if mode not in MODES:
        raise ConfigError(f"simulate mode must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
    if fuse is not None and mode != "neighbour":
        raise ConfigError(f"fuse={fuse!r} re-times the table as the SPMD runtime does: it applies to "
                          f"mode 'neighbour' only, not {mode!r}")
    if fuse is not None and fuse not in FUSE_MODES:
        raise ConfigError(f"fuse must be one of {', '.join(map(repr, FUSE_MODES))} or None, got {fuse!r}")
    overhead = _per_device(tick_overhead, "tick_overhead", schedule.num_stages)
    if mode == "async" and any(overhead):
        raise ConfigError("tick_overhead is a cost of tick-synchronous runtimes: use mode 'lockstep' "
                          "or 'neighbour' (mode 'async' has no ticks)")
    if link is None:
        link = Link()
    elif _is_number(link):
        link = Link.fixed(_number(link, "link (seconds per transfer)"))
    elif not isinstance(link, Link):
        raise ConfigError(f"link must be a Link, a number of seconds or None, got {link!r}")
    if dp_sync is not None and not isinstance(dp_sync, DPSync):
        raise ConfigError(f"dp_sync must be a DPSync or None, got {dp_sync!r}")
    if contention not in CONTENTION:
        raise ConfigError(f"contention must be one of {', '.join(map(repr, CONTENTION))}, got {contention!r}")
    if dp_sync is not None and dp_sync.param_gather == "forward" and mode != "async":
        raise ConfigError(f"DPSync(param_gather='forward') holds each chunk's first forward until its "
                          f"all-gather arrives, which mode 'async' models; mode {mode!r} does not (use "
                          f"param_gather='after' or 'none')")
    cc = _Resolved(costs, schedule)
    if mode == "async":
        return _run_async(schedule, cc, link, dp_sync, contention)
    if mode == "lockstep":
        return _run_lockstep(schedule, cc, link, dp_sync, contention, overhead)
    _check_ring_neighbours(schedule)
    how = "given" if fused is not None else (fuse or "auto")
    if fused is None:
        fused = fuse_ticks(schedule, how)  # as runtime.tickplan.make_plan calls it: default costs
    return _run_neighbour(fused, cc, link, dp_sync, contention, overhead, how)


def _per_device(value, name: str, p: int) -> list[float]:
    if _is_number(value):
        return [_number(value, name)] * p
    if isinstance(value, str | bytes) or not isinstance(value, Sequence) or len(value) != p:
        raise ConfigError(f"{name} must be a number or {p} numbers (one per device), got {value!r}")
    return [_number(x, f"{name}[{s}]") for s, x in enumerate(value)]
