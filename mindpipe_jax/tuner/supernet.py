"""EPara for a supernet job: pick (parallel.subnet, parallel.data, K, vmap width, batch) for SPara.

A ``SupernetCandidate`` is one way to run ``mindpipe supernet`` on N devices: S subnet
groups x D data devices (S·D = N), K = ``supernet.subnets_per_step``, W =
``supernet.vmap_width`` and the global batch. ``enumerate_supernet_space`` turns each
into config overrides and keeps the one-line ``ConfigError`` the real run would raise:
``Config.replace`` validation (e.g. the sandwich strategy's K >= 2), the axis sizes of
``parallel.mesh.resolve_axis_sizes`` and ``supernet.plan.check_layout`` (other axes set,
S·D not dividing the optimizer's chunks, K not divisible by S·W, the virtual shards).

The objective: progress of the search per second
------------------------------------------------
    progress/s = (L_0 - L_N) / (N x t_step)

L is the search-validation loss: the mean validation loss, with inherited weights, of a
fixed panel of subnets (``supernet_trial.Panel``: largest, smallest and a few drawn with
a fixed seed), the quantity the search ranks subnets by. A trial trains N steps from the
run's initial parameters (the same for every candidate: they depend on the seed only)
with the real learning-rate schedule of ``train.steps``; t_step is the median of the
trial's timed steps (after untimed warm-up steps that compile).

Why measured loss drop and not samples/s x a noise-scale efficiency: K changes *what* a
step averages (gradients of K different subnets on the same rows), not only how many
rows it sees, and the project's gradient noise scale (tuner/noise.py) is estimated from
microbatch gradients of one model; SPara's step reports per-subnet norms only, so there
is no honest B_noise for "K subnets x B rows". Measuring the drop needs no such model.
Layout alone (S, D at fixed K, W, B) never changes the trajectory (SPara's parameters are
bitwise the same on every split of the devices), so among those the objective is step
time; W changes the bits, not the statistics. The price: the drop is measured at the
start of training, so the objective rewards what helps early; a target far into a long
run may favour larger K or batches than the pick. Trials are cheap next to their compile
(a tiny SuperGPT step is ~20-50 ms on 2 cores), so N defaults to 40 steps.

Which candidates are measured (``measure`` of them; each costs a compile): the config's
own first (the table then shows the pick against it), then one candidate per statistical
class (K, B) in turn, each class's layouts by fewest sequential rounds per step K/(S·W)
(rounds are what a device runs one after another; more subnets per round use more of
the devices at once). With real trials the measured candidates are then timed again in
interleaved passes (``rounds``) and t_step is the median over all passes, since trials
run one after another on a shared machine meet different loads. The pick is the
measured candidate with the highest progress/s.

A class's loss drop is measured once: a later candidate of the same (K, B) trains the
same trajectory (the same bits on another split of the devices; up to bits with another
W), so it is only timed (``time_only``: its compile, the warm-up and ``timing_steps``
steps, no trial steps to the panel and no panel evaluation) and borrows the drop of
its class's trial, which the table names.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import types
from collections.abc import Callable, Sequence

from mindpipe_jax.config import Config, check_supernet_keys
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.supernet.plan import check_layout
from mindpipe_jax.train.memory_fit import DoesNotFit

TUNED = ("subnet", "data")  # the axes the candidates split the devices between


@dataclasses.dataclass(frozen=True, order=True)
class SupernetCandidate:
    subnet: int
    data: int
    subnets_per_step: int
    vmap_width: int
    global_batch: int

    @property
    def devices(self) -> int:
        return self.subnet * self.data

    @property
    def rounds(self) -> int:
        """Rounds each device runs one after another per step (``sync``: K/(S·W))."""
        return -(-self.subnets_per_step // (self.subnet * self.vmap_width))

    @property
    def statistics(self) -> tuple[int, int]:
        """What decides the training trajectory (up to the bits W changes): (K, batch)."""
        return self.subnets_per_step, self.global_batch

    def overrides(self) -> list[str]:
        return [f"parallel.subnet={self.subnet}", f"parallel.data={self.data}",
                f"supernet.subnets_per_step={self.subnets_per_step}",
                f"supernet.vmap_width={self.vmap_width}", f"train.global_batch={self.global_batch}"]

    def apply(self, cfg: Config) -> Config:
        return cfg.replace(*self.overrides())

    def label(self) -> str:
        return (f"s{self.subnet} d{self.data} | K{self.subnets_per_step} W{self.vmap_width} | "
                f"B{self.global_batch}")

    @classmethod
    def from_config(cls, cfg: Config, num_devices: int) -> SupernetCandidate:
        """The candidate ``cfg`` describes (``-1`` axes resolved for ``num_devices``)."""
        from mindpipe_jax.parallel.mesh import resolve_axis_sizes
        from mindpipe_jax.tuner.supernet_trial import runnable

        sizes = resolve_axis_sizes(runnable(cfg).parallel, num_devices)
        return cls(sizes["subnet"], sizes["data"], cfg.supernet.subnets_per_step, cfg.supernet.vmap_width,
                   cfg.train.global_batch)


def check_supernet_candidate(cfg: Config, cand: SupernetCandidate, num_devices: int) -> str | None:
    """None if ``cand`` runs, else the one-line reason ``train_supernet`` would give."""
    from mindpipe_jax.parallel.mesh import resolve_axis_sizes
    from mindpipe_jax.tuner.supernet_trial import runnable

    try:
        run = runnable(cand.apply(cfg))
        sizes = resolve_axis_sizes(run.parallel, num_devices)
        # check_layout reads only the mesh's axis sizes: a stand-in avoids building a mesh.
        check_layout(types.SimpleNamespace(shape=sizes), subnets_per_step=run.supernet.subnets_per_step,
                     vmap_width=run.supernet.vmap_width, virtual_shards=run.train.virtual_shards,
                     global_batch=run.train.global_batch)
    except ConfigError as err:
        return str(err)
    return None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def default_choices(cfg: Config) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(K, W, batch) choices when none are given: K/2, K, 2K; W 1, 2 and the config's; the batch."""
    k, w = cfg.supernet.subnets_per_step, cfg.supernet.vmap_width
    ks = tuple(sorted({x for x in (k // 2, k, 2 * k) if x >= 1}))
    return ks, tuple(sorted({1, 2, w})), (cfg.train.global_batch,)


def enumerate_supernet_space(cfg: Config, num_devices: int, *, ks: Sequence[int] | None = None,
                             widths: Sequence[int] | None = None, batches: Sequence[int] | None = None
                             ) -> tuple[list[SupernetCandidate], list[tuple[SupernetCandidate, str]]]:
    """Every (S, D, K, W, batch) with S·D = ``num_devices`` (over the config's other axes):
    (valid, [(rejected, reason)])."""
    dk, dw, db = default_choices(cfg)
    # Every axis but subnet and data keeps the devices the config gives it: fsdp and tensor
    # (which SPara uses too) as chosen, and an axis SPara refuses so that the config is
    # refused for what SPara needs rather than for a product of axes.
    others = math.prod(n for a, n in cfg.parallel.axis_sizes().items() if a not in TUNED and n > 1)
    groups = num_devices // others if num_devices % others == 0 else num_devices
    valid, rejected = [], []
    for s in _divisors(groups):
        for k in ks or dk:
            for w in widths or dw:
                for b in batches or db:
                    cand = SupernetCandidate(s, groups // s, k, w, b)
                    why = check_supernet_candidate(cfg, cand, num_devices)
                    (valid.append(cand) if why is None else rejected.append((cand, why)))
    return valid, rejected


def measurement_order(valid: Sequence[SupernetCandidate], first: SupernetCandidate | None
                      ) -> list[SupernetCandidate]:
    """``first`` (the config's own, if valid), then one per (K, batch) class in turn, each
    class's candidates by fewest rounds per step, then more data devices."""
    classes: dict[tuple, list[SupernetCandidate]] = {}
    for c in sorted(valid, key=lambda c: (c.rounds, -c.data, c.vmap_width)):
        if c != first:
            classes.setdefault(c.statistics, []).append(c)
    order = [first] if first in valid else []
    # The config's own class last in each pass: its statistics are already measured.
    keys = sorted(classes, key=lambda key: (first is not None and key == first.statistics, key))
    while any(classes.values()):
        for key in keys:
            if classes[key]:
                order.append(classes[key].pop(0))
    return order


@dataclasses.dataclass(frozen=True)
class Measurement:
    """A trial: ``steps`` steps trained from the initial parameters, the median step time,
    and the search-validation loss before and after."""

    step_s: float
    loss_start: float
    loss_end: float
    steps: int
    step_times: tuple[float, ...] = ()  # every timed step (step_s is their median)
    loss_from: str | None = None  # the (K, B) class's trial whose drop this borrows; None: its own

    @property
    def progress_per_s(self) -> float:
        """The objective: search-validation loss drop per second of training."""
        return (self.loss_start - self.loss_end) / (self.steps * self.step_s)


@dataclasses.dataclass
class SupernetRow:
    candidate: SupernetCandidate
    measurement: Measurement | None = None
    reason: str | None = None  # rejected: why

    def to_dict(self) -> dict:
        m = self.measurement
        measured = None if m is None else {**dataclasses.asdict(m), "progress_per_s": m.progress_per_s}
        return {"candidate": dataclasses.asdict(self.candidate), "overrides": self.candidate.overrides(),
                "reason": self.reason, "measurement": measured}


@dataclasses.dataclass
class SupernetTuneResult:
    rows: list[SupernetRow]  # measured (best first), valid not measured, rejected
    current: SupernetCandidate | None  # the config's own candidate when it is valid

    @property
    def best(self) -> SupernetRow:
        return self.rows[0]

    def table(self, rejected_limit: int = 12) -> str:
        head = (f"{'#':>2}  {'candidate':28s} {'ms/step':>8} {'loss start':>10} {'loss end':>9} "
                f"{'progress/s':>10}  note")
        lines = [head, "-" * len(head)]
        shown_rejected = 0
        for i, r in enumerate(self.rows, 1):
            m = r.measurement
            note = "the config's own" if r.candidate == self.current else ""
            if m is not None:
                if m.loss_from is not None:
                    note = "; ".join(x for x in (note, f"loss drop of {m.loss_from} (same K, batch)") if x)
                lines.append(f"{i:>2}  {r.candidate.label():28s} {m.step_s * 1e3:8.1f} {m.loss_start:10.4f} "
                             f"{m.loss_end:9.4f} {m.progress_per_s:10.4f}  {note}".rstrip())
            elif r.reason is None:
                lines.append(f"{i:>2}  {r.candidate.label():28s} {'-':>8} {'-':>10} {'-':>9} {'-':>10}  "
                             f"not measured {note}".rstrip())
            elif shown_rejected < rejected_limit:
                shown_rejected += 1
                lines.append(f"{i:>2}  {r.candidate.label():28s} rejected: {r.reason}")
        hidden = sum(r.reason is not None for r in self.rows) - shown_rejected
        if hidden:
            lines.append(f"    ... and {hidden} more rejected")
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps({"objective": "search-validation loss drop per second of training",
                           "current": None if self.current is None else dataclasses.asdict(self.current),
                           "rows": [r.to_dict() for r in self.rows]}, indent=1)


MeasureFn = Callable[[SupernetCandidate], Measurement]


def tune_supernet(cfg: Config, num_devices: int, *, measure_fn: MeasureFn, measure: int = 4,
                  ks: Sequence[int] | None = None, widths: Sequence[int] | None = None,
                  batches: Sequence[int] | None = None, rounds: int = 2, log=None) -> SupernetTuneResult:
    """Enumerate, measure the ``measure`` most promising valid candidates with ``measure_fn``
    (``make_measure`` runs real SPara steps), rank them by progress/s.

    ``rounds``: where ``measure_fn`` has ``retime(candidate) -> [seconds]`` (more timed
    steps of the trial's run, as ``make_measure``'s has), the measured candidates are
    timed again in ``rounds - 1`` interleaved passes and step_s becomes the median of all
    their timed steps: trials taken one after another on a shared machine met different
    loads (a benchmark's trials of the same work differed 2.6x), and a pass over all of
    them lets the drift hit each alike. The loss drop stays the trial's."""
    check_supernet_keys(cfg)  # what a supernet run would not read, as train_supernet refuses it
    if measure < 1:
        raise ConfigError(f"the supernet tuner must measure at least 1 candidate, got {measure}")
    if rounds < 1:
        raise ConfigError(f"the supernet tuner needs rounds >= 1, got {rounds}")
    valid, rejected = enumerate_supernet_space(cfg, num_devices, ks=ks, widths=widths, batches=batches)
    try:
        current = SupernetCandidate.from_config(cfg, num_devices)
    except ConfigError:
        current = None
    if current is not None and current not in valid:  # said: the table compares without it
        why = ("is rejected (its row says why)" if any(c == current for c, _ in rejected) else
               "is not among the candidates: list its K, W and batch in --subnets-per-step, "
               "--vmap-widths and --batches to compare against it")
        if log is not None:
            log(f"the config's own layout {current.label()} {why}")
        current = None
    if not valid:
        first = rejected[0] if rejected else None
        raise ConfigError("no candidate layout runs this supernet job" +
                          (f"; e.g. {first[0].label()}: {first[1]}" if first else ""))
    order = measurement_order(valid, current)
    try:
        measured, too_large = _measure(order, measure, measure_fn, rounds, log)
    finally:
        close = getattr(measure_fn, "close", None)  # the trials' runs are not needed past here
        if close is not None:
            close()
    if not measured:
        first = too_large[0]
        raise ConfigError(f"no candidate layout of this supernet job fits in memory; e.g. "
                          f"{first.candidate.label()}: {first.reason}")
    tried = {r.candidate for r in measured + too_large}
    rest = [SupernetRow(c) for c in order if c not in tried]
    refused = too_large + [SupernetRow(c, reason=why) for c, why in rejected]
    return SupernetTuneResult(measured + rest + refused, current)


def _measure(order, count: int, measure_fn: MeasureFn, rounds: int,
             log) -> tuple[list[SupernetRow], list[SupernetRow]]:
    """The trials of the first ``count`` candidates of ``order`` whose step fits in memory
    (one trial per (K, batch) class where ``measure_fn`` can ``time_only``; the class's
    other candidates timed and given its loss drop), the interleaved re-timing passes:
    (measured rows, best progress/s first; rows of those refused as too large, the next in
    ``order`` measured in their place). A trial whose step could not fit was the kernel's
    SIGKILL of the whole tuner."""
    measured, too_large, trials = [], [], {}
    time_only = getattr(measure_fn, "time_only", None)
    for cand in order:
        if len(measured) == count:
            break
        trial = trials.get(cand.statistics)
        try:
            m = _trial(cand, trial, measure_fn, time_only, log)
        except DoesNotFit as err:
            too_large.append(SupernetRow(cand, reason=f"does not fit in memory: {err.problem}"))
            if log is not None:
                log(f"skipped {cand.label()}: {err.problem}")
            continue
        trials.setdefault(cand.statistics, (cand, m))
        measured.append(SupernetRow(cand, m))
    retime = getattr(measure_fn, "retime", None)
    for _ in range(rounds - 1 if retime is not None else 0):
        for row in measured:
            m = row.measurement
            times = (*m.step_times, *retime(row.candidate))
            row.measurement = dataclasses.replace(m, step_s=statistics.median(times), step_times=times)
    if retime is not None and rounds > 1 and log is not None:
        log("re-timed in interleaved passes: " + ", ".join(
            f"{r.candidate.label()} {r.measurement.step_s * 1e3:.1f} ms" for r in measured))
    measured.sort(key=lambda r: -r.measurement.progress_per_s)
    return measured, too_large


def _trial(cand, trial, measure_fn: MeasureFn, time_only, log) -> Measurement:
    """``cand``'s measurement: timed only, with the loss drop of ``trial`` (its class's
    measured candidate and measurement) where there is one, else a full trial."""
    if trial is not None and time_only is not None:
        times = tuple(time_only(cand))
        m = dataclasses.replace(trial[1], step_s=statistics.median(times), step_times=times,
                                loss_from=trial[0].label())
        if log is not None:
            log(f"timed {cand.label()}: {m.step_s * 1e3:.1f} ms/step over {len(times)} steps; loss drop "
                f"of {m.loss_from} (same K and batch), progress {m.progress_per_s:.4f}/s")
        return m
    m = measure_fn(cand)
    if log is not None:
        log(f"measured {cand.label()}: {m.step_s * 1e3:.1f} ms/step, loss {m.loss_start:.4f} -> "
            f"{m.loss_end:.4f} in {m.steps} steps, progress {m.progress_per_s:.4f}/s")
    return m


class RealMeasure:
    """The real measurement (``make_measure``): a ``SparaRun`` of the candidate, ``warmup``
    untimed steps then ``trial_steps - warmup`` timed ones, the panel loss before (once:
    every candidate starts from the same parameters) and after. The panel is built on the
    first candidate measured and scores every later one on the same validation rows.

    ``time_only`` times a candidate whose class's drop is known: ``warmup`` untimed steps
    then ``timing_steps`` timed ones (at most the trial's timed steps), no panel.

    With ``keep`` the runs stay alive for ``retime`` (``timing_steps`` more timed steps;
    the loss drop is taken before them); ``close()`` releases them."""

    def __init__(self, cfg: Config, *, trial_steps: int = 40, warmup: int = 5, splits=None, model=None,
                 panel_random: int = 6, keep: bool = True, timing_steps: int = 10):
        if not 0 <= warmup < trial_steps:
            raise ConfigError(f"trial steps ({trial_steps}) must exceed the warm-up steps ({warmup})")
        if timing_steps < 1:
            raise ConfigError(f"the supernet tuner's timing steps must be >= 1, got {timing_steps}")
        self.timing_steps = min(timing_steps, trial_steps - warmup)
        self.cfg, self.trial_steps, self.warmup, self.model = cfg, trial_steps, warmup, model
        self.splits, self.panel_random, self.keep = splits, panel_random, keep
        self.panel, self.start, self.runs = None, None, {}

    def _run(self, cand: SupernetCandidate):
        from mindpipe_jax.data import load_tokens
        from mindpipe_jax.tuner.supernet_trial import SparaRun, runnable

        run_cfg = runnable(cand.apply(self.cfg))
        if self.splits is None:
            self.splits = load_tokens(run_cfg.data, run_cfg.model.vocab_size)
        return SparaRun(run_cfg, splits=self.splits, model=self.model, check_memory=True)

    def _done(self, cand: SupernetCandidate, run) -> None:
        if self.keep:
            self.runs[cand] = run
        else:
            run.close()

    def __call__(self, cand: SupernetCandidate) -> Measurement:
        from mindpipe_jax.tuner.supernet_trial import Panel

        run = self._run(cand)
        try:
            if self.panel is None:
                self.panel = Panel(run, random=self.panel_random)
                self.start = self.panel(run.params)
            run.run(self.warmup)
            times = tuple(run.run(self.trial_steps - self.warmup))
            m = Measurement(statistics.median(times), self.start, self.panel(run.params), self.trial_steps,
                            times)
        except BaseException:
            run.close()
            raise
        self._done(cand, run)
        return m

    def time_only(self, cand: SupernetCandidate) -> list[float]:
        run = self._run(cand)
        try:
            run.run(self.warmup)
            times = run.run(self.timing_steps)
        except BaseException:
            run.close()
            raise
        self._done(cand, run)
        return list(times)

    def retime(self, cand: SupernetCandidate) -> list[float]:
        return self.runs[cand].run(self.timing_steps)

    def close(self) -> None:
        for run in self.runs.values():
            run.close()
        self.runs.clear()


def make_measure(cfg: Config, **kwargs) -> RealMeasure:
    """``RealMeasure(cfg, **kwargs)``: real SPara trials for ``tune_supernet``."""
    return RealMeasure(cfg, **kwargs)
