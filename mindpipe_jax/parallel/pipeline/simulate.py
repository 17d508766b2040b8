"""Event-driven simulation of a pipeline schedule on a device/network spec.

``simulate(schedule, costs, link=..., dp_sync=..., mode=...)`` replays a
``Schedule`` table (``[tick][stage] -> Task | None``, see ``schedules.py``) with
per-stage task durations, point-to-point transfer costs and data-parallel
gradient synchronisation, and returns the step time, per-device utilization, the
bubble fraction and every event (compute, transfer, sync) for plotting. Pure
Python (numpy only for ``fit_alpha_beta``); nothing here imports JAX.

The model
---------
Resources. Every device has two lanes: a *compute* lane that runs its tasks one at
a time, in the table's order, and a *network* lane (its NIC / communication
stream) that runs concurrently with compute.

Costs. ``StageCosts`` gives, per global stage ``g`` (the model is cut into
``p * v`` global stages; ``schedule.placement`` says which device holds which),
the durations of ``F``, ``B`` (input gradient), ``W`` (weight gradient) and ``BW``
(fused backward, ``B + W`` unless given), the bytes of stage ``g``'s output
activation and the bytes of its parameters (= its gradient).

Transfers (the α–β model, ``Link``). ``F`` of ``g`` sends ``activation_bytes[g]``
to the device of ``g + 1``; ``B``/``BW`` of ``g`` sends the same number of bytes of
``g - 1``'s output gradient (``activation_bytes[g - 1]``) back to the device of
``g - 1``. A hand-off within one device costs nothing. A message of ``n`` bytes
occupies the *sender's* network lane for ``n / bandwidth`` seconds and arrives
``latency`` (α) seconds after it leaves the lane: ``Link.time(n) = α + n / bw``
on a free lane. Links are full duplex: receiving is free. With
``contention=False`` sends never wait for the lane (infinite link capacity).

Gradient sync (``DPSync``). Each (device, chunk) all-reduces its stage's
``param_bytes`` over the ``data`` ranks: a ring all-reduce of ``n`` bytes over
``r`` ranks costs ``2 (r - 1) / r * n / bw + 2 (r - 1) α`` (``Collective``). A
sync occupies the device's network lane for that whole time, so the syncs of one
device run one after another in request order. With ``contention=True`` sends and
syncs share the lane: a running sync is never interrupted, so a send issued
during it waits for its end, but a send overtakes syncs that have not started
(the pipeline's transfers are on the critical path). ``slice_bytes`` cuts each
sync into slices (each paying its own α), which bounds a send's wait to one
slice. Placement of the sync:

* ``when="end"`` (Megatron): a device starts its syncs when its own compute is
  done (async) or after the last tick (lockstep: the tick loop is one program).
* ``when="overlap"`` (AFAPAB / Fold3D): a chunk's sync starts right after that
  chunk's last weight-gradient task (its last ``BW`` or ``W``) and runs on the
  network lane while the device computes its remaining tasks.

Modes
-----
``mode="async"`` (an MPMD executor): each device runs its tasks in table order; a
task starts when its device is free and its inputs have arrived (producer's end,
plus the transfer when the producer is another device).

``mode="lockstep"`` (our SPMD runtime: a ``lax.scan`` over ticks with a
``ppermute`` at the end of each tick): all tasks of tick ``t`` start together, the
tick's compute lasts as long as its slowest task, then every device joins one
exchange (the runtime's forward and backward ``ppermute``s, in opposite
directions on full-duplex links, so they overlap) of a buffer sized for the
largest activation crossing devices — paid every tick but the last, whether or
not the buffer carries anything. With ``contention=True`` the exchange is a send
on every lane at once: it starts when every device's lane is free (waiting for
running sync slices, overtaking the queued ones). Without any
cross-device boundary (p = 1) there is no exchange. A sync of a chunk finished in
tick ``t`` is queued after tick ``t``'s exchange.

Why a loop over ticks is an event simulation: the table orders every producer
before its consumers and each device's tasks in time; each lane only serves its
own device, whose requests (sends and syncs) are issued at its task ends, i.e.
in time order, and queued sync slices are started lazily, just before the next
send that would otherwise overtake them. So visiting the cells tick by tick and
keeping each resource's "free at" time processes the events in an order
consistent with time, and gives the same start and end times as a priority-queue
simulation would.

Relation to ``Schedule.timeline``: ``simulate(schedule, cost, link=transfer,
mode=...)`` with a kind -> duration mapping (or a ``(stage, task) -> seconds``
function) and a float ``transfer`` reproduces ``timeline`` start/end/makespan/busy
exactly (``SimResult.to_timeline()``), the one difference being that a lockstep
replay with p = 1 pays no per-tick transfer here (there is no neighbour).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from mindpipe_jax.errors import ConfigError
from mindpipe_jax.parallel.pipeline.schedules import (
    DEFAULT_COST,
    Kind,
    Schedule,
    Task,
    Timeline,
    get_schedule,
)

__all__ = [
    "StageCosts", "LayerCost", "Link", "Collective", "DPSync", "Event", "SimResult",
    "simulate", "fit_alpha_beta", "predict_utilization", "even_assignment",
]

Number = int | float
PerStage = Number | Sequence[Number] | Sequence[Sequence[Number]]


# ------------------------------------------------------------------ helpers
def _number(value, name: str, *, positive: bool = False, allow_inf: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if math.isnan(value) or (math.isinf(value) and not allow_inf) or value < 0 or (positive and value == 0):
        raise ConfigError(f"{name} must be {'> 0' if positive else '>= 0'}"
                          f"{'' if allow_inf else ' and finite'}, got {value!r}")
    return value


def _is_number(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _per_global(value: PerStage, name: str, schedule: Schedule) -> list[float]:
    """A number, one value per global stage, or ``p`` rows of ``v`` (device ×
    chunk, mapped through the schedule's placement) -> one value per global stage."""
    p, v, G = schedule.num_stages, schedule.virtual_stages, schedule.num_global_stages
    if _is_number(value):
        return [_number(value, name)] * G
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise ConfigError(f"{name} must be a number or a sequence, got {value!r}")
    rows = list(value)
    if len(rows) == p and rows and all(isinstance(r, Sequence) and not isinstance(r, str | bytes)
                                       for r in rows):
        if any(len(r) != v for r in rows):
            raise ConfigError(f"{name}: {p} rows (devices) must each hold {v} values (chunks), "
                              f"got lengths {[len(r) for r in rows]}")
        out = [0.0] * G
        for s, row in enumerate(rows):
            for c, x in enumerate(row):
                out[schedule.global_stage(s, c)] = _number(x, f"{name}[{s}][{c}]")
        return out
    if len(rows) == G and all(_is_number(x) for x in rows):
        return [_number(x, f"{name}[{g}]") for g, x in enumerate(rows)]
    raise ConfigError(f"{name}: expected a number, {G} values (one per global stage) or {p} rows of {v} "
                      f"(device x chunk) for p={p}, v={v}; got {len(rows)} entries")


# -------------------------------------------------------------------- costs
@dataclass(frozen=True)
class StageCosts:
    """Per-stage task durations (seconds) and sizes (bytes).

    Each field is a number (the same for every stage), a sequence of ``p * v``
    values indexed by *global* stage, or ``p`` rows of ``v`` values indexed
    ``[device][chunk]`` (mapped through the schedule's placement).

    ``F``, ``B``, ``W``: forward, input-gradient and weight-gradient durations.
    ``BW``: fused backward; ``None`` means ``B + W``.
    ``activation_bytes[g]``: size of global stage ``g``'s output, which its ``F``
    sends to ``g + 1`` and which ``g + 1``'s backward sends back (same shape).
    ``param_bytes[g]``: parameters (= gradient) of global stage ``g``, all-reduced
    by a ``DPSync``.
    """

    F: PerStage = 1.0
    B: PerStage = 1.0
    W: PerStage = 1.0
    BW: PerStage | None = None
    activation_bytes: PerStage = 0.0
    param_bytes: PerStage = 0.0

    @classmethod
    def from_layers(cls, layers: LayerCost | Sequence[LayerCost], stage_of_layer: Sequence[int],
                    num_stages: int, *, embed: LayerCost | None = None,
                    head: LayerCost | None = None) -> StageCosts:
        """Sum per-layer costs into ``num_stages`` global stages.

        ``stage_of_layer[i]`` is the global stage of layer ``i`` (non-decreasing:
        stages are contiguous runs of layers; a stage may hold none). ``layers`` is
        one ``LayerCost`` for every layer or one per layer. ``embed`` is added to
        global stage 0 and ``head`` to the last one. A stage's activation bytes are
        those of its last layer's output (an empty stage passes its input through).
        """
        stage_of_layer = list(stage_of_layer)
        n = len(stage_of_layer)
        if isinstance(layers, LayerCost):
            layers = [layers] * n
        layers = list(layers)
        if len(layers) != n:
            raise ConfigError(f"{len(layers)} layer costs for {n} layers in stage_of_layer")
        if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
            raise ConfigError(f"num_stages must be an integer >= 1, got {num_stages!r}")
        for i, g in enumerate(stage_of_layer):
            if isinstance(g, bool) or not isinstance(g, int) or not 0 <= g < num_stages:
                raise ConfigError(f"stage_of_layer[{i}] = {g!r} is not a global stage 0..{num_stages - 1}")
            if i and g < stage_of_layer[i - 1]:
                raise ConfigError(f"stage_of_layer must be non-decreasing (stages are contiguous runs "
                                  f"of layers): layer {i} on stage {g} after stage {stage_of_layer[i - 1]}")
        zero = LayerCost(0.0, 0.0, 0.0)
        F, B, W, BW, P = ([0.0] * num_stages for _ in range(5))
        act: list[float | None] = [None] * num_stages
        parts = [(0, embed or zero)] + list(zip(stage_of_layer, layers, strict=True)) \
            + [(num_stages - 1, head or zero)]
        for g, layer in parts:
            F[g] += layer.F
            B[g] += layer.B
            W[g] += layer.W
            BW[g] += layer.fused
            P[g] += layer.param_bytes
        for g, layer in zip(stage_of_layer, layers, strict=True):
            act[g] = layer.activation_bytes
        carry = (embed or zero).activation_bytes
        for g in range(num_stages):   # an empty stage forwards what it received
            carry = carry if act[g] is None else act[g]
            act[g] = carry
        return cls(F=F, B=B, W=W, BW=BW, activation_bytes=act, param_bytes=P)


@dataclass(frozen=True)
class LayerCost:
    """One layer's (or the embed's / head's) measured costs: durations of F, B, W
    (and BW, default ``B + W``), output activation bytes and parameter bytes."""

    F: float
    B: float
    W: float
    BW: float | None = None
    activation_bytes: float = 0.0
    param_bytes: float = 0.0

    def __post_init__(self):
        for name in ("F", "B", "W", "activation_bytes", "param_bytes"):
            _number(getattr(self, name), f"LayerCost.{name}")
        if self.BW is not None:
            _number(self.BW, "LayerCost.BW")

    @property
    def fused(self) -> float:
        return self.B + self.W if self.BW is None else self.BW


class _Resolved:
    """Costs resolved against one schedule: ``duration(stage, task, g)``,
    ``activation(g)``, ``params(g)``."""

    def __init__(self, costs, schedule: Schedule):
        G = schedule.num_global_stages
        self.act = [0.0] * G
        self.params = [0.0] * G
        if costs is None:
            costs = StageCosts()
        if isinstance(costs, StageCosts):
            table = {kind: _per_global(getattr(costs, kind.value), kind.value, schedule)
                     for kind in (Kind.F, Kind.B, Kind.W)}
            table[Kind.BW] = ([b + w for b, w in zip(table[Kind.B], table[Kind.W], strict=True)]
                              if costs.BW is None else _per_global(costs.BW, "BW", schedule))
            self.act = _per_global(costs.activation_bytes, "activation_bytes", schedule)
            self.params = _per_global(costs.param_bytes, "param_bytes", schedule)
            self._fn = lambda stage, task, g: table[task.kind][g]
        elif isinstance(costs, Mapping):
            # Schedule.timeline's reading: missing kinds from DEFAULT_COST, BW = B + W
            # when both are given.
            try:
                kinds = {Kind(k): _number(c, f"cost[{k!r}]") for k, c in costs.items()}
            except ValueError as err:
                raise ConfigError(f"cost keys must be task kinds F, B, W, BW: {err}") from None
            if Kind.BW not in kinds and Kind.B in kinds and Kind.W in kinds:
                kinds[Kind.BW] = kinds[Kind.B] + kinds[Kind.W]
            for kind, c in DEFAULT_COST.items():
                kinds.setdefault(kind, float(c))
            self._fn = lambda stage, task, g: kinds[task.kind]
        elif callable(costs):
            self._fn = lambda stage, task, g: float(costs(stage, task))
        else:
            raise ConfigError(f"costs must be StageCosts, a kind -> seconds mapping or a function "
                              f"(stage, task) -> seconds, got {type(costs).__name__}")

    def duration(self, stage: int, task: Task, g: int) -> float:
        return self._fn(stage, task, g)


# ------------------------------------------------------------------ network
@dataclass(frozen=True)
class Link:
    """α–β model of a point-to-point link: ``time(n) = latency_s + n / bandwidth_Bps``.

    The sender's lane is busy for ``n / bandwidth_Bps`` (``occupancy``); the
    message arrives ``latency_s`` after it leaves the lane."""

    latency_s: float = 0.0
    bandwidth_Bps: float = math.inf

    def __post_init__(self):
        _number(self.latency_s, "Link.latency_s")
        _number(self.bandwidth_Bps, "Link.bandwidth_Bps", positive=True, allow_inf=True)

    @classmethod
    def fixed(cls, seconds: float) -> Link:
        """Every transfer takes ``seconds`` whatever its size and occupies no lane."""
        return cls(latency_s=seconds)

    def occupancy(self, nbytes: float) -> float:
        return nbytes / self.bandwidth_Bps if nbytes else 0.0

    def time(self, nbytes: float) -> float:
        return self.latency_s + self.occupancy(nbytes)


COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather")


@dataclass(frozen=True)
class Collective:
    """Ring collective over ``ranks`` devices on ``link``:

    * all-reduce: ``2 (r - 1) / r * n / bw + 2 (r - 1) α``
    * reduce-scatter, all-gather: ``(r - 1) / r * n / bw + (r - 1) α``

    (``n`` = bytes of the full buffer on each rank; free for ``r = 1``)."""

    ranks: int
    link: Link
    kind: str = "all-reduce"

    def __post_init__(self):
        if isinstance(self.ranks, bool) or not isinstance(self.ranks, int) or self.ranks < 1:
            raise ConfigError(f"Collective.ranks must be an integer >= 1, got {self.ranks!r}")
        if self.kind not in COLLECTIVES:
            raise ConfigError(f"Collective.kind must be one of {', '.join(COLLECTIVES)}, got {self.kind!r}")
        if not isinstance(self.link, Link):
            raise ConfigError(f"Collective.link must be a Link, got {self.link!r}")

    def time(self, nbytes: float) -> float:
        r = self.ranks
        if r == 1:
            return 0.0
        steps = 2 * (r - 1) if self.kind == "all-reduce" else r - 1
        return steps * (nbytes / r / self.link.bandwidth_Bps) + steps * self.link.latency_s


@dataclass(frozen=True)
class DPSync:
    """Data-parallel gradient sync of every (device, chunk)'s ``param_bytes``.

    ``when="end"``: after the device's compute (Megatron); ``"overlap"``: right
    after each chunk's last weight-gradient task, concurrent with the remaining
    compute (AFAPAB). ``slice_bytes`` cuts each chunk's sync into slices of at
    most that many bytes (each pays its own α; with ``contention`` a send waits
    at most for the slice in progress)."""

    ranks: int
    link: Link
    when: str = "end"
    kind: str = "all-reduce"
    slice_bytes: float | None = None

    def __post_init__(self):
        if self.when not in ("end", "overlap"):
            raise ConfigError(f"DPSync.when must be 'end' or 'overlap', got {self.when!r}")
        if self.slice_bytes is not None:
            _number(self.slice_bytes, "DPSync.slice_bytes", positive=True)
        Collective(self.ranks, self.link, self.kind)   # validates ranks, link and kind

    @property
    def collective(self) -> Collective:
        return Collective(self.ranks, self.link, self.kind)

    def slices(self, nbytes: float) -> list[float]:
        """The slice sizes one chunk's ``nbytes`` is synced in."""
        if nbytes <= 0:
            return []
        if self.slice_bytes is None or nbytes <= self.slice_bytes:
            return [nbytes]
        full, rest = divmod(nbytes, self.slice_bytes)
        return [self.slice_bytes] * int(full) + ([rest] if rest > 0 else [])

    def time(self, nbytes: float) -> float:
        """Seconds to sync ``nbytes`` on a free lane (all slices back to back)."""
        return sum(self.collective.time(n) for n in self.slices(nbytes))


# ------------------------------------------------------------------ results
@dataclass(frozen=True)
class Event:
    """One interval on one device's lane, for plotting.

    ``lane`` is ``"compute"`` (kind ``F``/``B``/``W``/``BW``) or ``"network"``
    (kind ``"send"``: a point-to-point transfer to ``peer``, ``end`` = arrival;
    ``"exchange"``: a lockstep tick-end ppermute; ``"sync"``: a gradient sync slice).
    """

    device: int
    lane: str
    kind: str
    start: float
    end: float
    tick: int | None = None
    microbatch: int | None = None
    chunk: int | None = None
    global_stage: int | None = None
    peer: int | None = None
    nbytes: float = 0.0

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class SimResult:
    """What ``simulate`` measured. ``utilization[d] = busy[d] / step_time`` (compute
    only: time spent in an exposed sync counts as idle); ``bubble_fraction = 1 -
    sum(busy) / (p * step_time)``."""

    schedule: str
    mode: str
    step_time: float
    compute_time: float                  # when the last compute task ends
    busy: tuple[float, ...]              # per device: sum of its task durations
    network_busy: tuple[float, ...]      # per device: time its network lane was occupied
    events: tuple[Event, ...] = field(repr=False)
    start: tuple[tuple[float | None, ...], ...] = field(repr=False)   # [tick][stage]
    end: tuple[tuple[float | None, ...], ...] = field(repr=False)

    @property
    def num_devices(self) -> int:
        return len(self.busy)

    @property
    def utilization(self) -> tuple[float, ...]:
        return tuple(b / self.step_time if self.step_time > 0 else 0.0 for b in self.busy)

    @property
    def mean_utilization(self) -> float:
        if self.step_time <= 0:
            return 0.0
        return sum(self.busy) / (len(self.busy) * self.step_time)

    @property
    def bubble_fraction(self) -> float:
        return 1.0 - self.mean_utilization if self.step_time > 0 else 0.0

    @property
    def exposed_communication(self) -> float:
        """Step time after the last compute (syncs that nothing hid)."""
        return self.step_time - self.compute_time

    def events_of(self, device: int, lane: str | None = None) -> list[Event]:
        return [e for e in self.events if e.device == device and (lane is None or e.lane == lane)]

    def to_timeline(self) -> Timeline:
        """The compute part as a ``schedules.Timeline`` (makespan = step time)."""
        return Timeline(self.start, self.end, self.step_time, self.busy)

    def summary(self) -> str:
        per = " ".join(f"{u:.2f}" for u in self.utilization)
        return (f"{self.schedule} ({self.mode}): step {self.step_time:.6g} s, compute "
                f"{self.compute_time:.6g} s, utilization {self.mean_utilization:.3f} "
                f"(per device {per}), bubble {self.bubble_fraction:.3f}")


# ---------------------------------------------------------------- simulator
def _inputs(kind: Kind, mb: int, g: int, num_global: int) -> list[tuple[str, int, int]]:
    """What a task consumes, keyed (``"F"`` | ``"B"``, mb, global stage); a ``B``
    key is produced by a ``B`` or a ``BW``."""
    if kind is Kind.F:
        return [("F", mb, g - 1)] if g > 0 else []
    if kind is Kind.W:
        return [("B", mb, g)]
    return [("F", mb, g)] + ([("B", mb, g + 1)] if g < num_global - 1 else [])


class _Lanes:
    """Per-device network lanes. Sync slices wait in a per-device queue and are
    started lazily: ``claim(s, at)`` first runs every queued slice that can start
    before ``at`` (a running slice is never interrupted), then hands the lane to
    the caller, so a send overtakes the slices that have not started yet."""

    def __init__(self, p: int, events: list[Event]):
        self.free = [0.0] * p
        self.busy = [0.0] * p
        self.events = events
        self.pending: list[deque] = [deque() for _ in range(p)]
        self.last = 0.0

    def request_sync(self, s: int, chunk: int, g: int, nbytes: float, at: float, dp: DPSync) -> None:
        coll = dp.collective
        for n in dp.slices(nbytes):
            self.pending[s].append((at, n, coll.time(n), chunk, g))

    def drain(self, s: int, before: float = math.inf) -> None:
        queue = self.pending[s]
        while queue:
            at, n, d, chunk, g = queue[0]
            start = max(at, self.free[s])
            if start >= before:
                break
            queue.popleft()
            self.free[s] = start + d
            self.busy[s] += d
            self.last = max(self.last, start + d)
            self.events.append(Event(s, "network", "sync", start, start + d, chunk=chunk,
                                     global_stage=g, nbytes=n))

    def claim(self, s: int, at: float) -> float:
        """When a send issued at ``at`` gets device ``s``'s lane."""
        self.drain(s, before=at)
        return max(at, self.free[s])

    def finish(self) -> None:
        for s in range(len(self.pending)):
            self.drain(s)


def simulate(schedule: Schedule, costs: StageCosts | Mapping | Callable | None = None, *,
             link: Link | float | None = None, dp_sync: DPSync | None = None, mode: str = "async",
             contention: bool = True) -> SimResult:
    """Replay ``schedule`` with ``costs`` on ``link`` (see the module docstring).

    ``costs``: ``StageCosts`` (per-stage durations and bytes), a mapping kind ->
    seconds (as ``Schedule.timeline``: missing kinds from ``DEFAULT_COST``) or a
    function ``(stage, task) -> seconds``; ``None`` is ``StageCosts()`` (F = B = W
    = 1, BW = 2). ``link``: a ``Link``, a float (every transfer takes that many
    seconds) or ``None`` (free). ``dp_sync``: gradient sync over data ranks, or
    ``None``. ``mode``: ``"async"`` or ``"lockstep"``. ``contention``: sends share
    the sender's network lane with each other and with its syncs (``False``:
    infinite link capacity; syncs still run one at a time per device)."""
    if not isinstance(schedule, Schedule):
        raise ConfigError(f"simulate needs a Schedule, got {type(schedule).__name__}")
    if mode not in ("async", "lockstep"):
        raise ConfigError(f"simulate mode must be 'async' or 'lockstep', got {mode!r}")
    if link is None:
        link = Link()
    elif _is_number(link):
        link = Link.fixed(_number(link, "link (seconds per transfer)"))
    elif not isinstance(link, Link):
        raise ConfigError(f"link must be a Link, a number of seconds or None, got {link!r}")
    if dp_sync is not None and not isinstance(dp_sync, DPSync):
        raise ConfigError(f"dp_sync must be a DPSync or None, got {dp_sync!r}")
    cc = _Resolved(costs, schedule)
    run = _run_lockstep if mode == "lockstep" else _run_async
    return run(schedule, cc, link, dp_sync, contention)


def _last_grad_ticks(schedule: Schedule) -> dict[tuple[int, int], int]:
    """(device, chunk) -> tick of the chunk's last weight-gradient task (BW or W)."""
    last: dict[tuple[int, int], int] = {}
    for t, row in enumerate(schedule.table):
        for s, task in enumerate(row):
            if task is not None and task.kind in (Kind.BW, Kind.W):
                last[(s, task.chunk)] = t
    return last


def _consumer(schedule: Schedule, task: Task, g: int) -> tuple[int, int] | None:
    """(device, global stage whose output is sent) of the task's cross-stage output."""
    G = schedule.num_global_stages
    if task.kind is Kind.F and g < G - 1:
        return schedule.owner(g + 1)[0], g
    if task.kind in (Kind.B, Kind.BW) and g > 0:
        return schedule.owner(g - 1)[0], g - 1
    return None


def _run_async(schedule: Schedule, cc: _Resolved, link: Link, dp: DPSync | None,
               contention: bool) -> SimResult:
    p, ticks, G = schedule.num_stages, schedule.num_ticks, schedule.num_global_stages
    start = [[None] * p for _ in range(ticks)]
    end = [[None] * p for _ in range(ticks)]
    busy = [0.0] * p
    free = [0.0] * p
    events: list[Event] = []
    lanes = _Lanes(p, events)
    last_grad = _last_grad_ticks(schedule) if dp is not None else {}
    done: dict[tuple[str, int, int], tuple[float, int]] = {}   # key -> (end, device)
    arrival: dict[tuple[str, int, int], float] = {}           # key -> arrival at its consumer
    for t, row in enumerate(schedule.table):
        for s, task in enumerate(row):
            if task is None:
                continue
            g = schedule.global_stage(s, task.chunk)
            ready = free[s]
            for key in _inputs(task.kind, task.microbatch, g, G):
                finish, where = done[key]
                ready = max(ready, finish if where == s else arrival[key])
            d = cc.duration(s, task, g)
            stop = ready + d
            start[t][s], end[t][s] = ready, stop
            free[s] = stop
            busy[s] += d
            events.append(Event(s, "compute", task.kind.value, ready, stop, t, task.microbatch,
                                task.chunk, g))
            if task.kind is Kind.W:
                key = ("W", task.microbatch, g)
            else:
                key = ("F" if task.kind is Kind.F else "B", task.microbatch, g)
            done[key] = (stop, s)
            out = _consumer(schedule, task, g)
            if out is not None and out[0] != s:
                dest, boundary = out
                nbytes = cc.act[boundary]
                occ = link.occupancy(nbytes)
                leave = lanes.claim(s, stop) if contention else stop
                if contention:
                    lanes.free[s] = leave + occ
                lanes.busy[s] += occ
                arrival[key] = leave + occ + link.latency_s
                events.append(Event(s, "network", "send", leave, arrival[key], t, task.microbatch,
                                    task.chunk, g, dest, nbytes))
            if dp is not None and dp.when == "overlap" and last_grad.get((s, task.chunk)) == t:
                lanes.request_sync(s, task.chunk, g, cc.params[g], stop, dp)
    compute = max(free, default=0.0)
    if dp is not None and dp.when == "end":
        for (s, c), _ in sorted(last_grad.items(), key=lambda item: item[1]):
            g = schedule.global_stage(s, c)
            lanes.request_sync(s, c, g, cc.params[g], free[s], dp)
    lanes.finish()
    return SimResult(schedule.name, "async", max(compute, lanes.last), compute, tuple(busy),
                     tuple(lanes.busy), tuple(events), tuple(map(tuple, start)), tuple(map(tuple, end)))


def _run_lockstep(schedule: Schedule, cc: _Resolved, link: Link, dp: DPSync | None,
                  contention: bool) -> SimResult:
    p, ticks, G = schedule.num_stages, schedule.num_ticks, schedule.num_global_stages
    start = [[None] * p for _ in range(ticks)]
    end = [[None] * p for _ in range(ticks)]
    busy = [0.0] * p
    events: list[Event] = []
    lanes = _Lanes(p, events)
    last_grad = _last_grad_ticks(schedule) if dp is not None else {}
    finished_in: dict[int, list[tuple[int, int]]] = {}
    for (s, c), t in last_grad.items():
        finished_in.setdefault(t, []).append((s, c))
    owner = [schedule.owner(g)[0] for g in range(G)]
    crossing = [cc.act[g] for g in range(G - 1) if owner[g] != owner[g + 1]]
    buffer = max(crossing, default=0.0)
    occ = link.occupancy(buffer)
    clock = 0.0
    for t, row in enumerate(schedule.table):
        longest = 0.0
        for s, task in enumerate(row):
            if task is None:
                continue
            g = schedule.global_stage(s, task.chunk)
            d = cc.duration(s, task, g)
            start[t][s], end[t][s] = clock, clock + d
            busy[s] += d
            longest = max(longest, d)
            events.append(Event(s, "compute", task.kind.value, clock, clock + d, t, task.microbatch,
                                task.chunk, g))
        compute_end = clock + longest
        clock = compute_end
        if t < ticks - 1 and crossing:
            leave = max(lanes.claim(s, compute_end) for s in range(p)) if contention else compute_end
            arrive = leave + occ + link.latency_s
            for s in range(p):
                if contention:
                    lanes.free[s] = leave + occ
                lanes.busy[s] += occ
                events.append(Event(s, "network", "exchange", leave, arrive, t, nbytes=buffer))
            clock = arrive
        if dp is not None and dp.when == "overlap":
            for s, c in finished_in.get(t, ()):
                g = schedule.global_stage(s, c)
                lanes.request_sync(s, c, g, cc.params[g], compute_end, dp)
    compute = clock
    if dp is not None and dp.when == "end":
        for (s, c), _ in sorted(last_grad.items(), key=lambda item: item[1]):
            g = schedule.global_stage(s, c)
            lanes.request_sync(s, c, g, cc.params[g], compute, dp)
    lanes.finish()
    return SimResult(schedule.name, "lockstep", max(compute, lanes.last), compute, tuple(busy),
                     tuple(lanes.busy), tuple(events), tuple(map(tuple, start)), tuple(map(tuple, end)))


# -------------------------------------------------------------- calibration
def fit_alpha_beta(sizes_bytes: Sequence[float], times_s: Sequence[float], *,
                   relative: bool = True) -> Link:
    """Fit ``time = α + size / bandwidth`` to measured transfers; returns a ``Link``.

    Least squares on the linear model ``t = α + β n`` (β = 1 / bandwidth).
    ``relative=True`` (default) minimises the sum of squared *relative* residuals
    ``((α + β n_i - t_i) / t_i)^2`` — right for timings whose noise grows with the
    time, and for sizes spanning orders of magnitude, where plain least squares
    lets the largest transfers decide α. ``relative=False``: ordinary least
    squares (constant absolute noise). A negative α (latency below the noise) is
    clamped to 0 and β refitted through the origin. Needs at least two distinct
    sizes and times that grow with size."""
    import numpy as np

    n = np.asarray(sizes_bytes, dtype=float)
    t = np.asarray(times_s, dtype=float)
    if n.ndim != 1 or n.shape != t.shape:
        raise ConfigError(f"fit_alpha_beta needs two equal-length 1-d sequences, got shapes "
                          f"{n.shape} and {t.shape}")
    if not (np.all(np.isfinite(n)) and np.all(np.isfinite(t))) or np.any(n < 0) or np.any(t <= 0):
        raise ConfigError("fit_alpha_beta needs finite sizes >= 0 and times > 0")
    if np.unique(n).size < 2:
        raise ConfigError("fit_alpha_beta needs transfers of at least two different sizes")
    w = 1.0 / t if relative else np.ones_like(t)
    design = np.stack([np.ones_like(n), n], axis=1) * w[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(design, t * w, rcond=None)
    if alpha < 0:
        alpha = 0.0
        beta = float(np.sum(w * w * n * t) / np.sum(w * w * n * n))
    if not beta > 0:
        raise ConfigError("fit_alpha_beta: the times do not grow with the size, so no bandwidth fits")
    return Link(latency_s=float(alpha), bandwidth_Bps=float(1.0 / beta))


# -------------------------------------------------------------- prediction
def even_assignment(num_layers: int, num_stages: int) -> list[int]:
    """``stage_of_layer`` putting ``num_layers`` layers on ``num_stages`` global
    stages as evenly as possible (the first stages get the extra layers)."""
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 0:
        raise ConfigError(f"num_layers must be an integer >= 0, got {num_layers!r}")
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ConfigError(f"num_stages must be an integer >= 1, got {num_stages!r}")
    base, extra = divmod(num_layers, num_stages)
    return [g for g in range(num_stages) for _ in range(base + (g < extra))]


def predict_utilization(layers: LayerCost | Sequence[LayerCost], stage_of_layer: Sequence[int] | None = None,
                        *, schedule: str | Schedule = "1f1b", p: int = 8, m: int = 32, v: int = 1,
                        num_layers: int | None = None, embed: LayerCost | None = None,
                        head: LayerCost | None = None, link: Link | float | None = None,
                        dp_sync: DPSync | None = None, mode: str = "async",
                        contention: bool = True) -> SimResult:
    """Simulate a model given per-layer costs, e.g. a GPT-class model at p = 8, m = 32.

    ``layers``: one ``LayerCost`` per layer (or one for all, with ``num_layers`` or
    ``stage_of_layer`` giving the count). ``stage_of_layer``: global stage of each
    layer (default ``even_assignment``). ``embed`` is added to global stage 0 and
    ``head`` to the last. ``schedule``: a ``Schedule`` (then ``p``, ``m``, ``v`` come
    from it) or a registered name built with ``p``, ``m``, ``v``. Returns the
    ``SimResult``; ``.mean_utilization`` is the predicted utilization."""
    sched = schedule if isinstance(schedule, Schedule) else get_schedule(schedule, p, m, v)
    stages = sched.num_global_stages
    if stage_of_layer is None:
        if isinstance(layers, LayerCost):
            if num_layers is None:
                raise ConfigError("predict_utilization: one LayerCost for all layers needs num_layers "
                                  "or stage_of_layer")
            count = num_layers
        else:
            count = len(layers)
        stage_of_layer = even_assignment(count, stages)
    costs = StageCosts.from_layers(layers, stage_of_layer, stages, embed=embed, head=head)
    return simulate(sched, costs, link=link, dp_sync=dp_sync, mode=mode, contention=contention)
