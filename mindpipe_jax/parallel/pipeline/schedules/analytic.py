"""Closed-form bubble and memory figures of the generated schedules, to set beside
what a table measures (``mindpipe schedule`` prints both).

``analytic(schedule, cost)`` returns an ``Analytic`` for a table that is exactly
what its registered generator builds (a hand-edited table gets ``None``): the tick
count and unit-tick bubble, the bubble of the as-soon-as-possible replay with
``cost`` where a closed form is known for those durations (else ``None``), and the
peak live activations (F done, backward not) of the busiest device. Each formula
is derived in its generator's docstring and checked by ``tests/test_schedules.py``.

For DualPipeV it adds the DualPipe repository's own figure, which counts an F&B
pair as one unit; ``vshape.fb_pair_timeline`` replays the table that way and
reaches it exactly (see ``vshape.py`` for the representation).

Pure Python; no JAX.
"""

from __future__ import annotations

from dataclasses import dataclass

from mindpipe_jax.parallel.pipeline.schedules.generators import get_schedule
from mindpipe_jax.parallel.pipeline.schedules.table import Schedule
from mindpipe_jax.parallel.pipeline.schedules.types import DEFAULT_COST, Cost, Kind, Task, _cost_fn


@dataclass(frozen=True)
class Analytic:
    formula: str                      # the bubble, in words and symbols
    ticks: int                        # every task one tick
    bubble: float                     # idle slots / all slots in those ticks
    weighted_bubble: float | None     # of the replay with the given durations; None: no closed form
    peak_live: int                    # chunk activations on the busiest device
    memory: str                       # what peak_live is, in words
    paired_bubble: float | None = None  # DualPipeV: F&B pairs run as one unit (the repository's figure)
    paired_formula: str = ""


def _durations(cost: Cost | None) -> dict[Kind, float] | None:
    """Per-kind durations when ``cost`` is the same for every stage, else None."""
    if callable(cost):
        return None
    fn = _cost_fn(cost)
    return {kind: fn(0, Task(0, 0, kind)) for kind in Kind}


def _fraction(idle: float, busy: float) -> float:
    return idle / (idle + busy) if idle + busy > 0 else 0.0


def analytic(schedule: Schedule, cost: Cost | None = DEFAULT_COST) -> Analytic | None:
    """The closed-form figures of ``schedule`` (see the module docstring), or None."""
    name, p, m, v = (schedule.name, schedule.num_stages, schedule.num_microbatches,
                     schedule.virtual_stages)
    try:
        if get_schedule(name, p, m, v) != schedule:
            return None
    except ValueError:          # unknown name, or sizes no generator makes
        return None
    d = _durations(cost)
    make = _FORMULAS.get(name)
    return None if make is None else make(p, m, v, d)


def _one_f_one_b(p, m, v, d, *, gpipe=False):
    ticks = 2 * (m + p - 1)
    bubble = (p - 1) / (m + p - 1)   # whatever the F:BW ratio: every device idles (p - 1)(F + BW)
    live = m if gpipe else min(p, m)
    return Analytic("(p-1)/(m+p-1)", ticks, bubble, bubble if d else None, live,
                    f"{'m' if gpipe else 'min(p, m)'} microbatches on stage 0")


def _zb_h1(p, m, v, d):
    if m < p:
        return None
    ticks = 3 * m + p - 1
    bubble = (p - 1) / ticks
    equal = d is not None and d[Kind.F] == d[Kind.B] == d[Kind.W]
    return Analytic("(p-1)/(3m+p-1) with F = B = W", ticks, bubble, bubble if equal else None,
                    min(p, m), "min(p, m) microbatches on stage 0, as 1F1B")


def _interleaved(p, m, v, d):
    ticks = 2 * (v * m + p - 1)
    return Analytic("(p-1)/(v m+p-1)", ticks, (p - 1) / (v * m + p - 1), None, min(v * p + p - 1, v * m),
                    "min(v p + p - 1, v m) chunks on stage 0 (Megatron warm-up)") if m >= p else None


def _zbv(p, m, v, d):
    ticks = max(6 * m + p - 1, 4 * m + 4 * p - 2)
    weighted = None
    if d is not None:
        F, B, W = d[Kind.F], d[Kind.B], d[Kind.W]
        if F == B == W:
            weighted = (ticks - 6 * m) / ticks
        elif m >= 2 * p - 1 and F <= B <= 2 * W and W <= B:
            weighted = _fraction((p - 1) * B, 2 * m * (F + B + W))
    formula = ("(p-1)/(6m+p-1) in ticks" if 2 * m >= 3 * p - 1 else "1 - 6m/(4m+4p-2) in ticks (m small)") \
        + "; (p-1)B / ((p-1)B + 2m(F+B+W)) for F <= B <= 2W, W <= B, m >= 2p-1"
    return Analytic(formula, ticks, (ticks - 6 * m) / ticks, weighted, min(2 * m, 2 * p),
                    "min(2m, 2p) chunks = min(m, p) microbatches of a full stage, as 1F1B")


def _dualpipev(p, m, v, d):
    ticks = 4 * m + 2 * p - 1   # device s holds 4m + 2p - 1 - s cells: it idles s ticks
    weighted = paired = None
    if d is not None:
        F, B, W, BW = d[Kind.F], d[Kind.B], d[Kind.W], d[Kind.BW]
        if F == B == W and BW == B + W:
            weighted = _fraction((p - 1) * F, 6 * m * F)
        if BW == B + W and F <= B and W <= B:
            # the repository's (PP/2 - 1)(F&B + B - 3W), PP = 2p, its B our BW, F&B = F + BW;
            # with F > B or W > B the paired replay takes longer than that
            paired = _fraction((p - 1) * (F + 2 * BW - 3 * W), 2 * m * (F + B + W))
    return Analytic("(p-1)/(2(4m+2p-1)) in ticks; (p-1)/(6m+p-1) with F = B = W", ticks,
                    (p - 1) / (2 * ticks), weighted, 2 * p + 1,
                    "2p + 1 chunks (the repository's PP + 1)", paired,
                    "(p-1)(F&B + BW - 3W) per device, F&B = F + BW run as one unit, F <= B, W <= B")


_FORMULAS = {
    "gpipe": lambda p, m, v, d: _one_f_one_b(p, m, v, d, gpipe=True),
    "1f1b": _one_f_one_b,
    "zb-h1": _zb_h1,
    "interleaved": _interleaved,
    "zbv": _zbv,
    "dualpipev": _dualpipev,
}
