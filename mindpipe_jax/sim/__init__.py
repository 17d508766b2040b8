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
* ``when="buckets"`` (Megatron-LM ``--overlap-grad-reduce``): the chunk's gradient
  is cut into buckets (``slice_bytes``), and each bucket's collective is queued as
  soon as its last gradient is ready *during* the chunk's last weight-gradient task
  (the last microbatch's backward), taken to produce the gradient at an even rate,
  the chunk's last layers first. So it hides behind the rest of that backward and
  behind everything after it.

With the distributed optimizer (``kind="reduce-scatter"``) the updated parameters
are all-gathered (``param_gather``): ``"after"`` the device's reduce-scatters
(exposed), or ``"forward"`` (Megatron's ``--overlap-param-gather``, async mode):
from the start of the step, each chunk's first forward waiting for its chunk's
all-gather.

``contention="priority"``: sends and syncs share the lane but a send never waits
for a sync: it preempts the running slice, whose end moves by the send's
occupancy (NCCL interleaves a bucket's ring chunks with the pipeline's sends
rather than holding a send for a whole bucket). Then the compute timeline is the
one without syncs, each lane is a work-conserving server whose sync requests all
arrive by the device's compute end, and so a sync that starts earlier can never
end later: ``"buckets"`` and ``"overlap"`` are never slower than ``"end"`` (also
with ``contention=False``). With ``contention=True`` a running slice can hold a
send on the critical path for a whole slice, so that guarantee does not hold.

Modes
-----
``mode="async"`` (an MPMD executor): each device runs its tasks in table order; a
task starts when its device is free and its inputs have arrived (producer's end,
plus the transfer when the producer is another device).

``mode="lockstep"`` (a tick-synchronous SPMD runtime seen as a global barrier per
tick): all tasks of tick ``t`` start together, the tick's compute lasts as long as
its slowest task, then every device joins one exchange (a forward and a backward
transfer in opposite directions on full-duplex links, assumed to overlap) of a
buffer sized for the largest activation crossing devices — paid every tick but
the last, whether or not the buffer carries anything. With ``contention=True``
the exchange is a send on every lane at once: it starts when every device's lane
is free (waiting for running sync slices, overtaking the queued ones). Without
any cross-device boundary (p = 1) there is no exchange. A sync of a chunk
finished in tick ``t`` is queued after tick ``t``'s exchange.

``mode="neighbour"`` (our SPMD runtime as it executes, ``runtime/``: a ``lax.scan``
over *fused* ticks, see ``schedules.fused``): the table is first re-timed exactly as
the runtime re-times it (``fuse=None`` = ``"auto"``, chosen under ``DEFAULT_COST`` as
``runtime.tickplan.make_plan`` does; ``fuse="table"`` keeps one task per tick, the
replay of the table itself; a ``FusedSchedule`` may be passed instead of the
table). In a fused tick a device runs up to one F, one backward (B or BW) and one W,
one after the other, so its tick's compute is the sum of their costs; then it
runs the tick's ppermutes, one after the other, on every device in every tick:
one per (kind of value, ring direction) the schedule uses, activations first,
then gradients — ``[s + 1, s - 1]`` for the 1F1B family, ``[s + 1, s - 1, s + 1,
s - 1]`` for a V placement on p > 2 devices (both kinds go both ways there); a
hand-off within a device ("self", the turn of the V) runs none. There is no
global barrier. Each device keeps its own clock; in a ppermute it sends the
buffer (occupying its lane for ``n / bw``) and leaves once its message has left
the lane and its neighbour's has arrived (``α`` after leaving the neighbour's
lane). So a device waits only for its ring neighbours, and a slow task delays a
device ``k`` hops away ``k`` ppermutes later. Every tick, the last included, pays
all its ppermutes (the scan body is the same each tick). For p = 2 both neighbours
are the other device, and with one task per tick the two tick modes differ only
in how the transfers are counted (lockstep: one overlapped exchange, none after
the last tick; neighbour: two in a row, every tick). Syncs are queued as in
lockstep, after the tick's ppermutes. A value goes one hop per ppermute, in the
direction its consumer lies: under a V placement (ZB-V, DualPipeV: device ``s``
holds stages ``s`` and ``2p - 1 - s``) chunk b's activations and chunk a's
gradients go to ``s - 1``, and the turn of the V (stage ``p - 1`` to ``p``, both on
device ``p - 1``) takes no ppermute; a placement with consecutive stages on devices
that are not ring neighbours is refused. With free transfers and a 1F1B-family
placement the replay equals ``schedules.fused.replay_time``; under a V placement
(four ppermutes) a delay may travel two hops per tick, which ``replay_time`` (two
shifts) does not count, so the replay may be longer.

V placements in every mode: a hand-off between two stages of one device costs no
link time and no exchange buffer (``_crossing_bytes`` counts only boundaries
between devices); a send goes to the device that ``schedule.owner`` names.

``tick_overhead`` (tick modes only): seconds every device spends in every tick
besides its task — the runtime reads and writes its buffer slots and runs the
idle branch even when the table is idle; a lockstep tick lasts ``max`` over
devices of task + overhead.

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

The code lives in these modules, all re-exported here: ``costs`` (``StageCosts``,
``LayerCost``), ``network`` (``Link``, ``Collective``, ``DPSync``,
``fit_alpha_beta``), ``engine`` (``simulate``: its arguments checked, the replay of
its mode run), ``modes`` (the three replays; neighbour mode replays
``schedules.fused`` ticks), ``lanes`` (the network lanes and the syncs queued on
them) and ``result`` (``Event``, ``SimResult``); ``predict_utilization`` and
``even_assignment`` are defined here.
"""

from __future__ import annotations

from collections.abc import Sequence

from mindpipe_jax.errors import ConfigError
from mindpipe_jax.parallel.pipeline.schedules import Schedule, get_schedule
from mindpipe_jax.sim.costs import LayerCost, Number, PerStage, StageCosts  # noqa: F401
from mindpipe_jax.sim.engine import Event, SimResult, simulate
from mindpipe_jax.sim.network import (
    COLLECTIVES,  # noqa: F401  (public names of the old single module stay importable)
    Collective,
    DPSync,
    Link,
    fit_alpha_beta,
)

__all__ = [
    "StageCosts", "LayerCost", "Link", "Collective", "DPSync", "Event", "SimResult",
    "simulate", "fit_alpha_beta", "predict_utilization", "even_assignment",
]


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
                        *, schedule: str | Schedule = "1f1b", p: int = 8, m: int = 32, v: int | None = None,
                        num_layers: int | None = None, embed: LayerCost | None = None,
                        head: LayerCost | None = None, link: Link | float | None = None,
                        dp_sync: DPSync | None = None, mode: str = "async",
                        contention: bool | str = True, fuse: str | None = None) -> SimResult:
    """Simulate a model given per-layer costs, e.g. a GPT-class model at p = 8, m = 32.

    ``layers``: one ``LayerCost`` per layer (or one for all, with ``num_layers`` or
    ``stage_of_layer`` giving the count). ``stage_of_layer``: global stage of each
    layer (default ``even_assignment``). ``embed`` is added to global stage 0 and
    ``head`` to the last. ``schedule``: a ``Schedule`` (then ``p``, ``m``, ``v`` come
    from it) or a registered name built with ``p``, ``m``, ``v`` (``None``: 1, or 2 for
    the V schedules ``zbv`` and ``dualpipev``). ``mode``, ``link``, ``dp_sync``,
    ``contention`` and ``fuse`` as ``simulate`` (mode "neighbour" replays the fused ticks
    the runtime runs; ``fuse="table"`` one task per tick). Returns the ``SimResult``;
    ``.mean_utilization`` is the predicted utilization."""
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
    return simulate(sched, costs, link=link, dp_sync=dp_sync, mode=mode, contention=contention, fuse=fuse)
