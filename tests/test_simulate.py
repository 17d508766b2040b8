"""The pipeline simulator: analytic bubbles, transfer and sync costs, calibration.

Pure Python, no devices. Every expected number is derived in a comment next to
its assertion or in ``mindpipe_jax/sim/__init__.py``.
"""

import math
import random

import numpy as np
import pytest

from mindpipe_jax.parallel.pipeline.schedules import (
    DEFAULT_COST,
    Kind,
    Schedule,
    Task,
    from_orders,
    get_schedule,
    gpipe,
    interleaved,
    one_f_one_b,
    zb_h1,
)
from mindpipe_jax.parallel.pipeline.schedules.fused import FUSE_MODES, fuse, replay_time
from mindpipe_jax.sim import (
    Collective,
    DPSync,
    LayerCost,
    Link,
    StageCosts,
    even_assignment,
    fit_alpha_beta,
    predict_utilization,
    simulate,
)

UNIT = StageCosts(F=1, B=1, W=1)     # BW = B + W = 2
SIZES = [(p, m) for p in (2, 4, 8) for m in (p, 2 * p, 4 * p)]


def all_schedules(p, m):
    yield gpipe(p, m)
    yield one_f_one_b(p, m)
    yield zb_h1(p, m)
    for v in (1, 2):
        if m % p == 0:
            yield interleaved(p, m, v)
            yield interleaved(p, m, v, warmup="minimal")


# ------------------------------------------------------------- analytic bubbles
@pytest.mark.parametrize("p,m", SIZES)
def test_1f1b_and_gpipe_async_bubble(p, m):
    for sched in (one_f_one_b(p, m), gpipe(p, m)):
        r = simulate(sched, UNIT)
        assert r.step_time == 3 * (m + p - 1)
        assert r.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
        assert r.busy == (3.0 * m,) * p


@pytest.mark.parametrize("p,m", SIZES)
@pytest.mark.parametrize("v", [1, 2, 3])
def test_interleaved_async_bubble(p, m, v):
    sched = interleaved(p, m, v)
    r = simulate(sched, UNIT)   # F = 1, BW = 2 per chunk
    assert r.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))
    # per-device x per-chunk costs (mapped through the placement) give the same
    nested = StageCosts(F=[[1] * v] * p, B=[[1] * v] * p, W=[[1] * v] * p)
    assert simulate(sched, nested).step_time == r.step_time


@pytest.mark.parametrize("p,m", SIZES)
def test_zb_h1_async_bubble_agrees_with_schedules(p, m):
    sched = zb_h1(p, m)
    r = simulate(sched, UNIT)
    assert r.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1))
    assert r.bubble_fraction == sched.bubble_fraction_weighted({"F": 1, "B": 1, "W": 1})   # exactly


def test_1f1b_utilization_at_p8_m32():
    r = simulate(one_f_one_b(8, 32), UNIT)
    assert r.mean_utilization == pytest.approx(1 - 7 / 39)
    assert r.mean_utilization == pytest.approx(0.82, abs=0.005)
    assert r.utilization == pytest.approx([1 - 7 / 39] * 8)


# --------------------------------------------- agreement with Schedule.timeline
COSTS = [None, {"F": 1, "BW": 2}, {"F": 1, "B": 1, "W": 1}, {"F": 1, "BW": 3}, {"F": 0.7, "B": 1.3},
         lambda stage, task: (1.5 if stage == 1 else 1.0) * (2.0 if task.kind == "BW" else 1.0)]


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 6)])
@pytest.mark.parametrize("lockstep", [False, True])
@pytest.mark.parametrize("transfer", [0.0, 0.25])
def test_reproduces_schedule_timeline(p, m, lockstep, transfer):
    for sched in all_schedules(p, m):
        for cost in COSTS:
            ref = sched.timeline(cost, transfer=transfer, lockstep=lockstep)
            r = simulate(sched, cost, link=transfer, mode="lockstep" if lockstep else "async")
            assert r.to_timeline() == ref, (sched.name, cost)
            assert r.bubble_fraction == ref.bubble_fraction


# ------------------------------------------------------------ lockstep >= async
@pytest.mark.parametrize("p,m", [(2, 2), (4, 8), (8, 8)])
def test_lockstep_never_beats_async(p, m):
    rng = random.Random(p * 100 + m)
    for sched in all_schedules(p, m):
        G = sched.num_global_stages
        costs = [UNIT, StageCosts(F=[rng.uniform(0.5, 2) for _ in range(G)],
                                  B=[rng.uniform(0.5, 2) for _ in range(G)],
                                  W=[rng.uniform(0.2, 1) for _ in range(G)],
                                  activation_bytes=[rng.uniform(0, 1e6) for _ in range(G)],
                                  param_bytes=[rng.uniform(0, 1e7) for _ in range(G)])]
        links = [None, 0.3, Link(1e-3, 1e8)]
        net = Link(1e-3, 1e9)
        syncs = [None, DPSync(4, net, "end"), DPSync(4, net, "overlap", slice_bytes=2e6)]
        for cost in costs:
            for link in links:
                for dp in syncs:
                    for contention in (True, False):
                        a = simulate(sched, cost, link=link, dp_sync=dp, contention=contention)
                        lk = simulate(sched, cost, link=link, dp_sync=dp, mode="lockstep",
                                      contention=contention)
                        assert lk.step_time >= a.step_time - 1e-9, (sched.name, link, dp)
                        assert lk.busy == pytest.approx(a.busy)


def test_lockstep_costs_of_the_schedules_at_p8_m32():
    # GPipe's ticks are all-F or all-BW and ZB-H1's tasks are all unit: no loss;
    # 1F1B and interleaved mix F and BW in one tick and pay the BW
    for name, v, loses in [("gpipe", 1, False), ("zb-h1", 1, False), ("1f1b", 1, True),
                           ("interleaved", 2, True)]:
        sched = get_schedule(name, 8, 32, v)
        a, lk = simulate(sched, UNIT), simulate(sched, UNIT, mode="lockstep")
        if loses:
            assert lk.mean_utilization < a.mean_utilization - 0.1
        else:
            assert lk.step_time == a.step_time


# ------------------------------------------------------------ neighbour mode
@pytest.mark.parametrize("p,m", [(2, 2), (2, 4), (4, 8)])
def test_neighbour_never_slower_than_lockstep_and_equal_at_p2(p, m):
    # A neighbour-synchronised device waits for a subset of the devices a global
    # barrier waits for, so (with free transfers) its clock never runs ahead of
    # lockstep's; with p = 2 the only neighbour is the other device: equal.
    rng = random.Random(p * 10 + m)
    for sched in all_schedules(p, m):
        G = sched.num_global_stages
        cost = StageCosts(F=[rng.uniform(0.5, 2) for _ in range(G)],
                          B=[rng.uniform(0.5, 2) for _ in range(G)],
                          W=[rng.uniform(0.2, 1) for _ in range(G)])
        overhead = [rng.uniform(0, 0.3) for _ in range(p)]
        lk = simulate(sched, cost, mode="lockstep", tick_overhead=overhead)
        nb = simulate(sched, cost, mode="neighbour", tick_overhead=overhead, fuse="table")
        assert nb.busy == pytest.approx(lk.busy)
        if p == 2:
            assert nb.step_time == pytest.approx(lk.step_time), sched.name
        else:
            assert nb.step_time <= lk.step_time + 1e-9, sched.name


def test_tick_overhead_is_paid_by_every_device_every_tick():
    # gpipe(2, 1): ticks F|.., ..|F, ..|BW, BW|..; overheads 0.1 and 0.2:
    # max(1.1, 0.2) + max(0.1, 1.2) + max(0.1, 2.2) + max(2.1, 0.2) = 6.6
    for mode, how in (("lockstep", None), ("neighbour", "table")):
        r = simulate(gpipe(2, 1), UNIT, mode=mode, tick_overhead=[0.1, 0.2], fuse=how)
        assert r.step_time == pytest.approx(6.6)
        assert r.busy == (3.0, 3.0)           # overhead is not task work
    # fused, device 1 runs F and BW in one tick (the last stage's F feeds its own
    # backward): 3 ticks, F|.., ..|F+BW, BW|..: 1.2 + (0.1 + 3.2) + 2.2 = 6.5 (each
    # tick lasts its slowest device's: p = 2, both wait for each other)
    r = simulate(gpipe(2, 1), UNIT, mode="neighbour", tick_overhead=[0.1, 0.2])
    assert r.step_time == pytest.approx(1.2 + 3.2 + 2.2) and r.fuse == "auto"
    assert simulate(gpipe(2, 1), UNIT, mode="lockstep", tick_overhead=0.0).step_time == 6


def test_neighbour_pays_both_ppermutes_in_every_tick():
    # Zero-cost tasks, symmetric devices: each ppermute costs alpha + n / bw, two per
    # tick, in all ticks (the last included): 1f1b(2, 2) has 6 ticks.
    link = Link(latency_s=1e-3, bandwidth_Bps=1e9)
    free = StageCosts(F=0, B=0, W=0, activation_bytes=2e6)
    sched = one_f_one_b(2, 2)
    r = simulate(sched, free, link=link, mode="neighbour", tick_overhead=0.01, fuse="table")
    assert r.step_time == pytest.approx(6 * (0.01 + 2 * (1e-3 + 2e-3)))
    assert sum(e.kind == "exchange" for e in r.events) == 6 * 2 * 2     # ticks x ppermutes x devices
    # lockstep counts one overlapped exchange between ticks: 5 of them
    lk = simulate(sched, free, link=link, mode="lockstep", tick_overhead=0.01)
    assert lk.step_time == pytest.approx(6 * 0.01 + 5 * (1e-3 + 2e-3))
    # without latency the p = 2 devices stay in step: tick = slowest task + 2 n / bw
    rng = random.Random(7)
    for sched in all_schedules(2, 4):
        G = sched.num_global_stages
        cost = StageCosts(F=[rng.uniform(0.5, 2) for _ in range(G)],
                          B=[rng.uniform(0.5, 2) for _ in range(G)],
                          W=[rng.uniform(0.2, 1) for _ in range(G)], activation_bytes=2e6)
        r = simulate(sched, cost, link=Link(0.0, 1e9), mode="neighbour", fuse="table")
        lk = simulate(sched, cost, mode="lockstep")              # free link: compute only
        assert r.step_time == pytest.approx(lk.step_time + sched.num_ticks * 2 * 2e-3)


def test_neighbour_delay_travels_one_hop_per_ppermute():
    # gpipe(4, 1), F of stage 0 takes 10: tick 0 is F0 on device 0 only. Under a
    # global barrier every device leaves tick 0 at 10. Neighbour-synchronised, the
    # forward ppermute holds device 1 (0 -> 1), the backward one devices 1 (2 -> 1)
    # and 3 (0 -> 3, cyclic); device 2 hears of it only in tick 1.
    def cost(stage, task):
        return 10.0 if (stage, task.kind) == (0, Kind.F) else 1.0

    def leaves(r, tick):   # when each device's sends of the tick leave its lane
        return [[e.start for e in r.events if e.kind == "exchange" and e.tick == tick and e.device == s]
                for s in range(4)]

    nb = simulate(gpipe(4, 1), cost, mode="neighbour", fuse="table")
    assert leaves(nb, 0) == [[10, 10], [0, 10], [0, 0], [0, 0]]
    # tick 1 (F0 on device 1 only): device 2 starts it at 0 and is held by device 1's
    # forward message (11); device 0 by device 1's backward one
    assert leaves(nb, 1) == [[10, 10], [11, 11], [0, 11], [10, 10]]
    lk = simulate(gpipe(4, 1), cost, mode="lockstep")
    assert {e.start for e in lk.events if e.kind == "exchange" and e.tick == 0} == {10}
    # the chain F0 -> F0 -> ... is the critical path either way
    assert nb.start[1][1] == lk.start[1][1] == 10


# ------------------------------------------- neighbour mode replays fused ticks
def _random_cost(seed: int, p: int):
    """Per-device, per-kind durations as a ``(stage, task) -> seconds`` function: the form
    both ``simulate`` and ``schedules.fused.replay_time`` take."""
    rng = random.Random(seed)
    table = {(s, k): rng.uniform(0.3, 2.0) for s in range(p) for k in Kind}
    return lambda stage, task: table[(stage, task.kind)]


def _replay_with_shifts(fused, cost, shifts):
    """``replay_time`` with the runtime's ppermutes: each shift, in turn, holds a device
    until the neighbour that sends to it is done."""
    p, clock = fused.num_stages, [0.0] * fused.num_stages
    for row in fused.cells:
        ready = [clock[s] + sum(cost(s, x) for x in row[s] if x is not None) for s in range(p)]
        for k in shifts:
            ready = [max(ready[s], ready[(s - k) % p]) for s in range(p)]
        clock = ready
    return max(clock)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (8, 16), (8, 32)])
def test_fused_replay_with_free_links_equals_replay_time(p, m):
    # the 1F1B family (activations to s + 1, gradients to s - 1): two ppermutes a tick,
    # exactly replay_time's two shifts, for every way of fusing and any costs
    for i, sched in enumerate(all_schedules(p, m)):
        cost = _random_cost(1000 * p + 10 * m + i, p)
        for mode in FUSE_MODES:
            fused = fuse(sched, mode)
            r = simulate(fused, cost, mode="neighbour")
            assert r.step_time == pytest.approx(replay_time(fused, cost), abs=1e-9), (sched.name, mode)
            assert r.fuse == "given"
            # the same through fuse=: the table re-timed inside simulate
            assert simulate(sched, cost, mode="neighbour", fuse=mode).step_time == r.step_time
        # the default is what the runtime runs: "auto", chosen under DEFAULT_COST
        auto = fuse(sched, "auto")
        assert simulate(sched, cost, mode="neighbour").step_time == pytest.approx(replay_time(auto, cost))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (8, 16)])
def test_fused_replay_of_v_schedules_pays_four_ppermutes(p, m):
    # A V placement sends activations and gradients both ways: the runtime runs four
    # ppermutes a tick (p > 2), and a delay can travel two hops in one tick, which
    # replay_time's two shifts do not count: the replay is that, and never shorter.
    for i, sched in enumerate(v_schedules(p, m)):
        cost = _random_cost(77 * p + m + i, p)
        shifts = [1, -1, 1, -1] if p > 2 else [1, 1]
        for mode in FUSE_MODES:
            fused = fuse(sched, mode)
            r = simulate(fused, cost, mode="neighbour")
            assert r.step_time == pytest.approx(_replay_with_shifts(fused, cost, shifts), abs=1e-9)
            assert r.step_time >= replay_time(fused, cost) - 1e-9
            if p == 2:       # both neighbours are the other device: nothing more to wait for
                assert r.step_time == pytest.approx(replay_time(fused, cost), abs=1e-9)


def test_fused_1f1b_utilization_at_p8_m32():
    # F = 1, BW = 2: fused, a steady-state tick costs F + BW = 3 on every device, and the
    # step is (m + p - 1) such ticks: utilization m / (m + p - 1), 1F1B's async bound
    p, m = 8, 32
    for cost in (StageCosts(F=1, B=1, W=1), StageCosts(F=1, B=0.5, W=1.5, BW=2), {"F": 1, "BW": 2}):
        r = simulate(one_f_one_b(p, m), cost, mode="neighbour")
        assert abs(r.mean_utilization - m / (m + p - 1)) < 1e-9
        assert r.step_time == pytest.approx(3 * (m + p - 1))
        assert r.fuse == "auto"
    # one task per tick pays a BW for the F beside it: far below
    table = simulate(one_f_one_b(p, m), UNIT, mode="neighbour", fuse="table")
    assert table.mean_utilization < m / (m + p - 1) - 0.1
    # predict_utilization passes fuse through (16 layers on 8 stages: F = 2, BW = 4)
    layer = LayerCost(F=1, B=1, W=1)
    fused = predict_utilization(layer, num_layers=16, schedule="1f1b", p=p, m=m, mode="neighbour")
    assert abs(fused.mean_utilization - m / (m + p - 1)) < 1e-9
    one = predict_utilization(layer, num_layers=16, schedule="1f1b", p=p, m=m, mode="neighbour", fuse="table")
    assert one.step_time == pytest.approx(table.step_time * 2)


# What the neighbour mode returned before it replayed fused ticks (the table, one task per
# tick, two ppermutes), computed by that code: a "table" replay must give the same.
OLD_NEIGHBOUR = [  # (name, p, m, v, step_time, compute_time)
    ("gpipe", 2, 4, 1, 17.657999999999998, 17.638),
    ("1f1b", 2, 4, 1, 23.63200000000001, 23.612000000000013),
    ("zb-h1", 2, 4, 1, 16.009999999999984, 15.988999999999985),
    ("interleaved", 2, 4, 2, 31.75100000000005, 31.731000000000055),
    ("gpipe", 4, 8, 1, 44.96299999999999, 44.942999999999984),
    ("1f1b", 4, 8, 1, 42.077, 42.056999999999995),
    ("zb-h1", 4, 8, 1, 42.18399999999998, 42.16299999999998),
    ("interleaved", 4, 8, 2, 74.99199999999999, 74.972),
    ("gpipe", 8, 16, 1, 91.52200000000016, 91.50200000000017),
    ("1f1b", 8, 16, 1, 97.85800000000027, 97.83800000000028),
    ("zb-h1", 8, 16, 1, 88.46900000000018, 88.44800000000018),
    ("interleaved", 8, 16, 2, 180.05499999999995, 180.03499999999997),
]


def test_table_replay_equals_the_old_neighbour_numbers():
    # link costs, an overlapped data-parallel sync and tick overhead: every part of the model
    for i, (name, p, m, v, step, compute) in enumerate(OLD_NEIGHBOUR):
        sched = get_schedule(name, p, m, v)
        rng = random.Random(100 + i)
        G = sched.num_global_stages
        cost = StageCosts(F=[round(rng.uniform(0.5, 2), 3) for _ in range(G)],
                          B=[round(rng.uniform(0.5, 2), 3) for _ in range(G)],
                          W=[round(rng.uniform(0.2, 1), 3) for _ in range(G)],
                          activation_bytes=1e6, param_bytes=2e7)
        r = simulate(sched, cost, link=Link(1e-3, 1e8), dp_sync=DPSync(2, Link(1e-3, 1e9), "overlap"),
                     mode="neighbour", tick_overhead=0.01, fuse="table")
        assert r.step_time == pytest.approx(step, rel=1e-12)
        assert r.compute_time == pytest.approx(compute, rel=1e-12)
        assert r.fuse == "table" and len(r.start) == sched.num_ticks


def test_a_fused_tick_runs_its_tasks_one_after_the_other():
    # fused 1F1B(4, 8): every task once, a device's tasks back to back within a tick
    # (F, then backward, then W), the tick's start/end its first task's start and last's end
    sched = one_f_one_b(4, 8)
    fused = fuse(sched, "auto")
    link = Link(1e-3, 1e9)
    r = simulate(sched, StageCosts(F=1, B=1, W=1, activation_bytes=1e6), link=link, mode="neighbour")
    assert len(r.start) == fused.num_ticks < sched.num_ticks
    for s in range(4):
        compute = r.events_of(s, "compute")
        assert len(compute) == len(sched.tasks_of(s))
        assert sum(e.duration for e in compute) == pytest.approx(r.busy[s])
        for t, row in enumerate(fused.cells):
            mine = [e for e in compute if e.tick == t]
            assert [(e.kind, e.microbatch) for e in mine] == [(x.kind.value, x.microbatch) for x in row[s]
                                                              if x is not None]
            for a, b in zip(mine, mine[1:], strict=False):
                assert b.start == a.end
            if mine:
                assert (r.start[t][s], r.end[t][s]) == (mine[0].start, mine[-1].end)
            else:
                assert r.start[t][s] is None
    # two ppermutes per tick and device (to s + 1, then s - 1), every tick
    assert sum(e.kind == "exchange" for e in r.events) == 2 * 4 * fused.num_ticks
    # a fused tick mixing F + BW costs 3 on a device, not max(F, BW) = 2
    assert max(end - start for row_s, row_e in zip(r.start, r.end, strict=True)
               for start, end in zip(row_s, row_e, strict=True) if start is not None) == pytest.approx(3)


def test_fused_sync_starts_after_the_tick_of_the_last_weight_gradient():
    # zb-h1(2, 4): each device's chunk sync is queued after the ppermutes of the fused tick
    # holding its last W (as in the table's replay), so it starts when the device's lane
    # leaves that tick's last ppermute (free links: occupancy 0)
    sched = zb_h1(2, 4)
    costs = StageCosts(F=1, B=1, W=1, param_bytes=1e9)
    for fuse_mode in ("auto", "table", "in-order"):
        r = simulate(sched, costs, dp_sync=DPSync(2, Link(0, 1e9), "overlap"), mode="neighbour",
                     fuse=fuse_mode)
        for s in range(2):
            last_w = max((e for e in r.events_of(s, "compute") if e.kind == "W"), key=lambda e: e.end)
            lane = [e.start for e in r.events_of(s, "network")
                    if e.kind == "exchange" and e.tick == last_w.tick]
            (sync,) = [e for e in r.events_of(s, "network") if e.kind == "sync"]
            assert sync.start == pytest.approx(max(last_w.end, lane[-1]))
            assert sync.start >= last_w.end


def test_fused_auto_follows_the_runtime_default_costs():
    # the runtime fuses under DEFAULT_COST whatever the real costs are; so does the replay
    sched = zb_h1(4, 8)
    skewed = {"F": 3.0, "B": 1.0, "W": 0.2, "BW": 1.2}
    auto = fuse(sched, "auto")
    assert auto.cells == fuse(sched, "auto", DEFAULT_COST).cells
    assert simulate(sched, skewed, mode="neighbour").step_time == pytest.approx(replay_time(auto, skewed))


def test_fuse_is_refused_where_it_means_nothing():
    sched = one_f_one_b(2, 2)
    with pytest.raises(ValueError, match="mode 'neighbour' only"):
        simulate(sched, UNIT, fuse="auto")
    with pytest.raises(ValueError, match="fuse must be one of"):
        simulate(sched, UNIT, mode="neighbour", fuse="eager")
    with pytest.raises(ValueError, match="mode 'neighbour', not 'lockstep'"):
        simulate(fuse(sched, "auto"), UNIT, mode="lockstep")
    with pytest.raises(ValueError, match="already fused"):
        simulate(fuse(sched, "auto"), UNIT, mode="neighbour", fuse="table")


# ------------------------------------------------------------------- transfers
def test_transfer_on_the_critical_path_gpipe_p2_m1():
    # F0 on s0 [0, 1] -> send -> F0 on s1 [1 + tau, 2 + tau] -> BW0 on s1
    # [2 + tau, 4 + tau] -> send -> BW0 on s0 [4 + 2 tau, 6 + 2 tau].
    link = Link(latency_s=0.05, bandwidth_Bps=1e9)
    costs = StageCosts(F=1, B=1, W=1, activation_bytes=[2e8, 0])
    tau = 0.05 + 2e8 / 1e9
    assert link.time(2e8) == pytest.approx(tau)
    r = simulate(gpipe(2, 1), costs, link=link)
    assert r.step_time == pytest.approx(6 + 2 * tau)
    assert r.start[3][0] == pytest.approx(4 + 2 * tau)       # tick 3: BW0 on stage 0
    sends = [e for e in r.events if e.kind == "send"]
    assert [(e.device, e.peer) for e in sends] == [(0, 1), (1, 0)]
    assert sends[0].start == pytest.approx(1) and sends[0].end == pytest.approx(1 + tau)
    assert sends[1].start == pytest.approx(4 + tau) and sends[1].end == pytest.approx(4 + 2 * tau)
    assert r.network_busy == pytest.approx((0.2, 0.2))        # occupancy n / bw, latency excluded
    # lockstep: 4 ticks (F, F, BW, BW) and an exchange after each of the first three
    lk = simulate(gpipe(2, 1), costs, link=link, mode="lockstep")
    assert lk.step_time == pytest.approx(6 + 3 * tau)
    assert sum(e.kind == "exchange" for e in lk.events) == 3 * 2


def test_same_device_hand_off_is_free():
    # a V-shaped placement on 2 devices: global stages 1 and 2 share device 1
    sched = Schedule.from_table([["F0", ".."], ["..", "F0"], ["..", "F0b"], ["F0b", ".."],
                                 ["BW0b", ".."], ["..", "BW0b"], ["..", "BW0"], ["BW0", ".."]],
                                placement=[[0, 3], [1, 2]])
    r = simulate(sched, UNIT, link=0.5)
    # sends: F g0->g1 (device 0 -> 1), F g2->g3 (1 -> 0), BW g3->g2 (0 -> 1), BW g1->g0 (1 -> 0);
    # g1 <-> g2 stay on device 1. Critical path: 4 F + 4 BW = 12, plus 4 transfers of 0.5
    assert r.step_time == pytest.approx(12 + 4 * 0.5)
    assert sum(e.kind == "send" for e in r.events) == 4


def test_contention_serialises_sends_behind_a_sync():
    # p = 2, 2 chunks per device; only global stage 3 (device 1, chunk 1) has
    # gradients. Its 5 s sync starts after its last BW and is still running when
    # device 1's BW0 of global stage 1 must send its gradient back to device 0.
    sched = interleaved(2, 2, 2)
    costs = StageCosts(F=1, B=1, W=1, activation_bytes=1e6, param_bytes=[0, 0, 0, 5e9])
    link = Link(0.0, 1e9)                                      # a send occupies 1 ms

    def run(contention, slice_bytes=None):
        dp = DPSync(2, Link(0.0, 1e9), "overlap", slice_bytes=slice_bytes)   # 2 * 1/2 * 5e9 / 1e9 = 5 s
        r = simulate(sched, costs, link=link, dp_sync=dp, contention=contention)
        (bw,) = [e for e in r.events_of(1, "compute")
                 if (e.kind, e.microbatch, e.global_stage) == ("BW", 0, 1)]
        (send,) = [e for e in r.events_of(1, "network") if e.kind == "send" and e.tick == bw.tick]
        syncs = [e for e in r.events_of(1, "network") if e.kind == "sync"]
        return r, bw, send, syncs

    free, bw, send, syncs = run(False)
    assert send.start == pytest.approx(bw.end)                 # infinite capacity: no wait
    assert syncs[0].duration == pytest.approx(5.0)
    assert syncs[0].start < bw.end < syncs[0].end              # the sync is running then
    shared, bw, send, syncs = run(True)
    assert send.start == pytest.approx(syncs[0].end)           # waits for the whole sync
    # ... then device 0 runs its two last BWs (2 s each) on the critical path
    assert shared.step_time == pytest.approx(syncs[0].end + 0.001 + 2 + 2)
    assert shared.step_time > free.step_time + 2.9
    # slicing the sync (0.1 s slices) bounds the wait to one slice: the send
    # overtakes the slices that have not started
    sliced, bw, send, syncs = run(True, slice_bytes=1e8)
    assert len(syncs) == 50 and sum(e.duration for e in syncs) == pytest.approx(5.0)
    assert 0 <= send.start - bw.end <= 0.1 + 1e-9
    assert free.step_time <= sliced.step_time <= free.step_time + 0.1 + 1e-9 < shared.step_time


# ------------------------------------------------------------ data-parallel sync
def test_ring_collective_costs():
    link = Link(1e-4, 1e9)
    assert Collective(4, link).time(8e8) == pytest.approx(2 * 3 / 4 * 0.8 + 2 * 3 * 1e-4)
    assert Collective(4, link, "reduce-scatter").time(8e8) == pytest.approx(3 / 4 * 0.8 + 3 * 1e-4)
    assert Collective(1, link).time(8e8) == 0.0
    dp = DPSync(4, link, slice_bytes=3e8)
    assert dp.slices(8e8) == [3e8, 3e8, 2e8]
    assert dp.time(8e8) == pytest.approx(2 * 3 / 4 * 0.8 + 3 * 2 * 3 * 1e-4)   # alpha per slice


@pytest.mark.parametrize("mode", ["async", "lockstep"])
def test_sync_at_end_adds_exactly_the_sync_time_p1(mode):
    sched = one_f_one_b(1, 4)
    costs = StageCosts(F=1, B=1, W=1, param_bytes=4e8)
    dp = DPSync(8, Link(1e-3, 1e9), "end")
    sync = 2 * 7 / 8 * 0.4 + 2 * 7 * 1e-3
    base = simulate(sched, costs, mode=mode)
    r = simulate(sched, costs, dp_sync=dp, mode=mode)
    assert base.step_time == 12
    assert r.step_time == pytest.approx(12 + sync)
    assert r.compute_time == 12 and r.exposed_communication == pytest.approx(sync)
    assert r.mean_utilization == pytest.approx(12 / (12 + sync))
    # overlapping a single chunk's sync hides nothing: its last backward ends the step
    assert simulate(sched, costs, dp_sync=DPSync(8, Link(1e-3, 1e9), "overlap"),
                    mode=mode).step_time == pytest.approx(r.step_time)


@pytest.mark.parametrize("mode", ["async", "lockstep"])
def test_overlapped_sync_hides_behind_remaining_backwards(mode):
    # p = 1, v = 2 chunks, m = 4: the device's last task is BW3 of chunk 0 (2 s), and
    # chunk 1's last BW comes right before it, so chunk 1's sync has 2 s to hide in.
    sched = interleaved(1, 4, 2)
    assert sched.table[-1][0] == Task(3, 0, Kind.BW) and sched.table[-2][0] == Task(3, 1, Kind.BW)
    link = Link(0.0, 1e9)
    compute = simulate(sched, UNIT, mode=mode).step_time
    assert compute == 24
    for nbytes, hidden in [(1.5e9, True), (3e9, False)]:   # all-reduce over 2 ranks: n / bw s
        costs = StageCosts(F=1, B=1, W=1, param_bytes=[0, nbytes])
        sync = nbytes / 1e9
        end = simulate(sched, costs, dp_sync=DPSync(2, link, "end"), mode=mode)
        over = simulate(sched, costs, dp_sync=DPSync(2, link, "overlap"), mode=mode)
        assert end.step_time == pytest.approx(compute + sync)
        if hidden:      # shorter than the remaining compute: free
            assert over.step_time == pytest.approx(compute)
        else:           # longer: only the part beyond the last backward shows
            assert over.step_time == pytest.approx(compute + sync - 2)
        assert over.step_time < end.step_time
    # both chunks carry gradients: the last chunk's sync is always exposed,
    # the other's hides when it fits in the last backward (and is queued otherwise)
    costs = StageCosts(F=1, B=1, W=1, param_bytes=[1e9, 1.5e9])
    over = simulate(sched, costs, dp_sync=DPSync(2, link, "overlap"), mode=mode)
    end = simulate(sched, costs, dp_sync=DPSync(2, link, "end"), mode=mode)
    assert over.step_time == pytest.approx(compute + 1.0)
    assert end.step_time == pytest.approx(compute + 2.5)
    assert [e.global_stage for e in over.events if e.kind == "sync"] == [1, 0]


def test_zero_bubble_sync_waits_for_the_last_w():
    sched = zb_h1(2, 4)
    costs = StageCosts(F=1, B=1, W=1, param_bytes=1e9)
    r = simulate(sched, costs, dp_sync=DPSync(2, Link(0, 1e9), "overlap"))
    for s in range(2):
        last_w = max(e.end for e in r.events_of(s, "compute") if e.kind == "W")
        (sync,) = [e for e in r.events_of(s, "network") if e.kind == "sync"]
        assert sync.start == pytest.approx(last_w)


# ------------------------------------- Megatron --overlap-grad-reduce ("buckets")
def test_megatron_overlap_hand_computed_p1():
    # p = 1, m = 2, 1F1B: F0 BW0 F1 BW1 (F = 1, BW = 2), compute ends at 6. The chunk's
    # 4e9 bytes go in four 1e9 buckets; BW1 runs [4, 6], so the buckets are ready at
    # 4.5, 5, 5.5, 6. A reduce-scatter over 2 ranks of 1e9 B on (10 ms, 1 GB/s):
    # 1/2 * 1e9 / 1e9 + 0.01 = 0.51 s; the parameter all-gather (bf16 against fp32
    # gradients: 0.5e9 B a bucket) 0.25 + 0.01 = 0.26 s, after the last reduce-scatter.
    sched = one_f_one_b(1, 2)
    costs = StageCosts(F=1, B=1, W=1, param_bytes=4e9)
    link = Link(0.01, 1e9)
    kw = dict(kind="reduce-scatter", slice_bytes=1e9, param_gather="after", gather_ratio=0.5)
    over = simulate(sched, costs, dp_sync=DPSync(2, link, "buckets", **kw))
    syncs = [t for e in over.events if e.kind == "sync" for t in (e.start, e.end)]
    rs = [4.5, 5.01, 5.01, 5.52, 5.52, 6.03, 6.03, 6.54]
    ag = [t for k in range(4) for t in (6.54 + 0.26 * k, 6.54 + 0.26 * (k + 1))]
    assert syncs == pytest.approx(rs + ag)
    assert over.step_time == pytest.approx(7.58)
    # Without overlap: every reduce-scatter after the compute, then the all-gathers.
    end = simulate(sched, costs, dp_sync=DPSync(2, link, "end", **kw))
    assert end.step_time == pytest.approx(6 + 4 * 0.51 + 4 * 0.26)
    # AFAPAB's chunk-wise placement waits for the whole backward: nothing after it to hide behind.
    assert simulate(sched, costs, dp_sync=DPSync(2, link, "overlap", **kw)).step_time == \
        pytest.approx(end.step_time)


def test_megatron_overlap_param_gather_behind_the_next_forward():
    # p = 2, GPipe m = 1 (F = 1, BW = 2), 1e9 B of gradient per stage, one bucket, 1 GB/s, no
    # latency, 2 ranks: reduce-scatter 0.5 s, all-gather of the bf16 weights 0.25 s. With
    # --overlap-param-gather the all-gathers run from the step's start: device 0's first F
    # waits for it (0.25), device 1's is hidden behind the wait for device 0's activation.
    sched = gpipe(2, 1)
    costs = StageCosts(F=1, B=1, W=1, param_bytes=1e9)
    dp = DPSync(2, Link(0.0, 1e9), "buckets", kind="reduce-scatter", param_gather="forward",
                gather_ratio=0.5)
    r = simulate(sched, costs, dp_sync=dp)
    first_f = {s: min(e.start for e in r.events_of(s, "compute") if e.kind == "F") for s in (0, 1)}
    assert first_f == pytest.approx({0: 0.25, 1: 1.25})
    # device 1's BW [2.25, 4.25] then its reduce-scatter; device 0's BW [4.25, 6.25], then its own
    assert r.step_time == pytest.approx(6.25 + 0.5)
    with pytest.raises(ValueError, match="async"):
        simulate(sched, costs, dp_sync=dp, mode="lockstep")


def test_megatron_overlap_equals_end_with_nothing_to_hide_behind():
    link = Link(1e-3, 1e9)
    # One bucket: it is ready only when the last backward ends, which ends the step.
    sched = one_f_one_b(1, 4)
    costs = StageCosts(F=1, B=1, W=1, param_bytes=4e8)
    for mode in ("async", "lockstep", "neighbour"):
        end = simulate(sched, costs, dp_sync=DPSync(8, link, "end"), mode=mode)
        over = simulate(sched, costs, dp_sync=DPSync(8, link, "buckets"), mode=mode)
        assert over.step_time == pytest.approx(end.step_time) and over.step_time > 12
    # Many buckets, but the gradient appears only at the very end (W takes no time).
    zb = zb_h1(1, 4)
    costs = StageCosts(F=1, B=1, W=0, param_bytes=4e8)
    end = simulate(zb, costs, dp_sync=DPSync(8, link, "end", slice_bytes=5e7))
    over = simulate(zb, costs, dp_sync=DPSync(8, link, "buckets", slice_bytes=5e7))
    assert over.step_time == pytest.approx(end.step_time)
    # No data parallelism: nothing to sync in either mode.
    one = DPSync(1, link, "buckets", slice_bytes=1e8)
    assert simulate(sched, costs, dp_sync=one).step_time == simulate(sched, costs).step_time


@pytest.mark.parametrize("p,m", [(1, 4), (2, 4), (4, 8)])
def test_megatron_overlap_never_slower_than_end(p, m):
    # The argument (sim/__init__): with sends first on the lane ("priority") or no
    # contention, the compute timeline is the one without syncs and every bucket is
    # queued no later than the end-of-step sync would be, on a work-conserving lane.
    rng = random.Random(7 * p + m)
    link = Link(1e-3, 1e9)
    for sched in list(all_schedules(p, m)) + [get_schedule("afapab", p, m, 2)]:
        G = sched.num_global_stages
        costs = StageCosts(F=[rng.uniform(0.5, 2) for _ in range(G)],
                           B=[rng.uniform(0.5, 2) for _ in range(G)],
                           W=[rng.uniform(0.2, 1) for _ in range(G)],
                           activation_bytes=[rng.uniform(0, 1e8) for _ in range(G)],
                           param_bytes=[rng.uniform(0, 3e9) for _ in range(G)])
        for bucket in (None, 2e8):
            for mode, gathers in (("async", ("none", "after", "forward")), ("lockstep", ("none", "after")),
                                  ("neighbour", ("none", "after"))):
                if mode == "neighbour" and sched.name.startswith("interleaved") and p > 2:
                    continue   # consecutive stages on devices that are not neighbours
                for gather in gathers:
                    kw = dict(kind="all-reduce" if gather == "none" else "reduce-scatter", slice_bytes=bucket,
                              param_gather=gather, gather_ratio=0.5)
                    for contention in (False, "priority"):
                        end, over = (simulate(sched, costs, link=link, dp_sync=DPSync(4, link, when, **kw),
                                              mode=mode, contention=contention)
                                     for when in ("end", "buckets"))
                        assert over.step_time <= end.step_time + 1e-9, (sched.name, mode, gather, contention)
                        assert over.busy == end.busy


def test_priority_contention_lets_a_send_through_a_running_sync():
    # test_contention_serialises_sends_behind_a_sync's case: device 1's 5 s sync is
    # running when BW0 of global stage 1 must send 1e6 B (1 ms) back to device 0.
    sched = interleaved(2, 2, 2)
    costs = StageCosts(F=1, B=1, W=1, activation_bytes=1e6, param_bytes=[0, 0, 0, 5e9])
    dp = DPSync(2, Link(0.0, 1e9), "overlap")
    free = simulate(sched, costs, link=Link(0.0, 1e9), dp_sync=dp, contention=False)
    r = simulate(sched, costs, link=Link(0.0, 1e9), dp_sync=dp, contention="priority")
    (bw,) = [e for e in r.events_of(1, "compute") if (e.kind, e.microbatch, e.global_stage) == ("BW", 0, 1)]
    (send,) = [e for e in r.events_of(1, "network") if e.kind == "send" and e.tick == bw.tick]
    (sync,) = [e for e in r.events_of(1, "network") if e.kind == "sync"]
    assert send.start == pytest.approx(bw.end)                      # no wait
    during = [e for e in r.events_of(1, "network") if e.kind == "send" and sync.start <= e.start < sync.end]
    assert len(during) == 2                                         # BW0 and BW1 of global stage 1
    assert sync.duration == pytest.approx(5.0 + 2 * 0.001)          # paused for each send
    assert r.step_time == pytest.approx(max(free.step_time, sync.end))
    with pytest.raises(ValueError, match="contention"):
        simulate(sched, costs, contention="sometimes")


# ----------------------------------------------------------------- calibration
def test_fit_alpha_beta_recovers_noisy_link():
    rng = np.random.default_rng(0)
    alpha, bw = 40e-6, 2.5e8
    sizes = np.repeat(np.logspace(3, 8, 11), 5)
    times = (alpha + sizes / bw) * rng.normal(1.0, 0.03, sizes.shape)   # 3 % relative noise
    fit = fit_alpha_beta(sizes, times)
    assert fit.latency_s == pytest.approx(alpha, rel=0.05)
    assert fit.bandwidth_Bps == pytest.approx(bw, rel=0.05)
    # constant absolute noise: ordinary least squares
    sizes = np.repeat(np.linspace(1e6, 5e7, 10), 4)
    times = alpha * 50 + sizes / bw + rng.normal(0, 2e-5, sizes.shape)
    fit = fit_alpha_beta(sizes, times, relative=False)
    assert fit.latency_s == pytest.approx(alpha * 50, rel=0.05)
    assert fit.bandwidth_Bps == pytest.approx(bw, rel=0.05)


def test_fit_alpha_beta_edge_cases():
    fit = fit_alpha_beta([1e6, 2e6, 4e6], [1e-3, 2e-3, 4e-3])       # no latency at all
    assert fit.latency_s == pytest.approx(0, abs=1e-12) and fit.bandwidth_Bps == pytest.approx(1e9)
    negative = fit_alpha_beta([1e6, 2e6], [0.9e-3, 2.1e-3])          # alpha < 0 is clamped
    assert negative.latency_s == 0.0 and negative.bandwidth_Bps > 0
    with pytest.raises(ValueError, match="two different sizes"):
        fit_alpha_beta([1e6, 1e6], [1e-3, 1e-3])
    with pytest.raises(ValueError, match="grow"):
        fit_alpha_beta([1e6, 2e6, 3e6], [3e-3, 2e-3, 1e-3])
    with pytest.raises(ValueError, match="equal-length"):
        fit_alpha_beta([1, 2, 3], [1, 2])


# ------------------------------------------------------------------ prediction
def test_predict_utilization_sums_layers_into_stages():
    layer = LayerCost(F=1, B=1, W=1, activation_bytes=1e6, param_bytes=1e7)
    # 16 layers on 8 stages, no embed/head: every stage F = 2, BW = 4 -> 1F1B ideal
    r = predict_utilization(layer, num_layers=16, schedule="1f1b", p=8, m=32)
    assert r.mean_utilization == pytest.approx(1 - 7 / 39)
    assert r.step_time == pytest.approx(2 * 3 * 39)
    # a heavy head lands on the last stage and slows everything down
    head = LayerCost(F=2, B=2, W=2)
    slow = predict_utilization(layer, num_layers=16, p=8, m=32, head=head)
    assert slow.busy[-1] == pytest.approx(32 * ((2 + 2) + (4 + 4)))   # (F + BW) x m
    assert slow.mean_utilization < r.mean_utilization
    # ... unless the last stage gets fewer layers
    stages = [0] * 3 + [1] * 2 + [2] * 2 + [3] * 2 + [4] * 2 + [5] * 2 + [6] * 2 + [7] * 1
    balanced = predict_utilization([layer] * 16, stages, p=8, m=32, head=LayerCost(F=0.5, B=0.5, W=0.5))
    assert balanced.mean_utilization > slow.mean_utilization
    # zb-h1 reaches the 0.90 goal with equal costs
    assert predict_utilization(layer, num_layers=16, schedule="zb-h1").mean_utilization > 0.9


def test_stage_costs_from_layers():
    layers = [LayerCost(1, 2, 3, activation_bytes=10 * i, param_bytes=100) for i in range(4)]
    embed = LayerCost(0.5, 0, 0, activation_bytes=7, param_bytes=50)
    head = LayerCost(0.25, 0.25, 0, param_bytes=60)
    costs = StageCosts.from_layers(layers, [0, 0, 2, 2], 3, embed=embed, head=head)
    assert costs.F == [2.5, 0.0, 2.25]
    assert costs.BW == [10.0, 0.0, 10.25]
    assert costs.activation_bytes == [10, 10, 30]       # the empty stage passes its input on
    assert costs.param_bytes == [250, 0, 260]
    with pytest.raises(ValueError, match="non-decreasing"):
        StageCosts.from_layers(layers, [0, 1, 0, 1], 2)
    with pytest.raises(ValueError, match="global stage"):
        StageCosts.from_layers(layers, [0, 1, 2, 3], 2)
    assert even_assignment(10, 4) == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]


# ------------------------------------------------------------ results and input
def test_events_are_consistent():
    sched = interleaved(4, 8, 2)
    costs = StageCosts(F=1, B=1, W=1, activation_bytes=1e6, param_bytes=1e8)
    r = simulate(sched, costs, link=Link(1e-3, 1e9), dp_sync=DPSync(2, Link(1e-3, 1e9), "overlap"))
    for s in range(4):
        compute = r.events_of(s, "compute")
        assert len(compute) == len(sched.tasks_of(s))
        assert sum(e.duration for e in compute) == pytest.approx(r.busy[s])
        for a, b in zip(compute, compute[1:], strict=False):
            assert a.end <= b.start + 1e-12
        syncs = [e for e in r.events_of(s, "network") if e.kind == "sync"]
        assert len(syncs) == 2                                   # one per chunk
        assert max(e.end for e in r.events_of(s)) <= r.step_time + 1e-12
    assert math.isclose(r.bubble_fraction, 1 - r.mean_utilization)
    assert "interleaved (async)" in r.summary()


def test_bad_input_is_refused():
    sched = one_f_one_b(2, 2)
    with pytest.raises(ValueError, match="mode"):
        simulate(sched, UNIT, mode="eager")
    with pytest.raises(ValueError, match="2 values"):
        simulate(sched, StageCosts(F=[1, 1, 1]))
    with pytest.raises(ValueError, match=">= 0"):
        simulate(sched, StageCosts(F=-1))
    with pytest.raises(ValueError, match="bandwidth"):
        Link(0.0, 0.0)
    with pytest.raises(ValueError, match="when"):
        DPSync(2, Link(), when="later")
    with pytest.raises(ValueError, match="reduce-scatter"):
        DPSync(2, Link(), param_gather="after")                   # an all-reduce leaves nothing to gather
    with pytest.raises(ValueError, match="param_gather"):
        DPSync(2, Link(), kind="reduce-scatter", param_gather="later")
    with pytest.raises(ValueError, match="ranks"):
        Collective(0, Link())
    with pytest.raises(ValueError, match="link"):
        simulate(sched, UNIT, link="fast")
    with pytest.raises(ValueError, match="tick_overhead"):
        simulate(sched, UNIT, tick_overhead=0.1)                  # async has no ticks
    with pytest.raises(ValueError, match="one per device"):
        simulate(sched, UNIT, mode="neighbour", tick_overhead=[0.1, 0.1, 0.1])


# ------------------------------------------------ V placement (ZB-V, DualPipeV)
def v_schedules(p, m):
    yield get_schedule("zbv", p, m)
    if m >= 2 * p:
        yield get_schedule("dualpipev", p, m)


@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
def test_v_placement_turn_is_free_and_chunk_b_goes_the_other_way(name):
    p, m = 4, 8
    sched = get_schedule(name, p, m)
    r = simulate(sched, UNIT, link=0.5)
    sends = [e for e in r.events if e.kind == "send"]
    # 2p global stages, 2p - 1 boundaries; one of them (p - 1 -> p, the turn of the V)
    # is inside device p - 1 and sends nothing: 2p - 2 hops each way per microbatch
    assert len(sends) == 2 * m * (2 * p - 2)
    for e in sends:
        kind = sched.table[e.tick][e.device].kind
        chunk_a = e.global_stage < p
        if kind is Kind.F:      # activations: chunk a to s + 1, chunk b to s - 1
            assert e.peer == (e.device + 1 if chunk_a else e.device - 1)
            assert e.global_stage != p - 1                       # the turn is not sent
        else:                   # gradients the other way round
            assert e.peer == (e.device - 1 if chunk_a else e.device + 1)
            assert e.global_stage != p
        assert e.end - e.start == pytest.approx(0.5)
    # a hand-off inside a device waits for nothing: stage p's F starts when stage
    # p - 1's ends on device p - 1 (microbatch 0 has nothing else in its way)
    spans = {(ev.kind, ev.microbatch, ev.global_stage): (ev.start, ev.end)
             for ev in r.events_of(p - 1, "compute")}
    assert spans[("F", 0, p)][0] == spans[("F", 0, p - 1)][1]
    # one device (p = 1) holds both stages: nothing crosses, no exchange in any mode
    one = get_schedule(name, 1, 4)
    for mode in ("async", "lockstep", "neighbour"):
        r1 = simulate(one, UNIT, link=Link(1e-3, 1e6), mode=mode)
        assert not [ev for ev in r1.events if ev.lane == "network"], mode
        assert r1.step_time == pytest.approx(sum(r1.busy))


@pytest.mark.parametrize("p,m", [(2, 4), (3, 6), (4, 8)])
@pytest.mark.parametrize("lockstep", [False, True])
@pytest.mark.parametrize("transfer", [0.0, 0.25])
def test_v_schedules_reproduce_schedule_timeline(p, m, lockstep, transfer):
    for sched in v_schedules(p, m):
        for cost in COSTS:
            ref = sched.timeline(cost, transfer=transfer, lockstep=lockstep)
            got = simulate(sched, cost, link=transfer, mode="lockstep" if lockstep else "async").to_timeline()
            assert got.makespan == pytest.approx(ref.makespan) and got.busy == pytest.approx(ref.busy)
            for mine, theirs in ((got.start, ref.start), (got.end, ref.end)):   # equal up to round-off
                flat = [-1.0 if x is None else x for row in mine for x in row]
                assert flat == pytest.approx([-1.0 if x is None else x for row in theirs for x in row])


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (8, 16)])
def test_v_schedules_in_the_tick_modes(p, m):
    # the orderings the other schedules obey: nothing beats async, and with free
    # transfers a neighbour-synchronised clock never runs ahead of lockstep's
    rng = random.Random(p * 7 + m)
    for sched in v_schedules(p, m):
        G = sched.num_global_stages
        cost = StageCosts(F=[rng.uniform(0.5, 2) for _ in range(G)],
                          B=[rng.uniform(0.5, 2) for _ in range(G)],
                          W=[rng.uniform(0.2, 1) for _ in range(G)],
                          activation_bytes=[rng.uniform(0, 1e6) for _ in range(G)])
        for link in (None, Link(1e-3, 1e8)):
            a = simulate(sched, cost, link=link)
            lk = simulate(sched, cost, link=link, mode="lockstep")
            nb = simulate(sched, cost, link=link, mode="neighbour", fuse="table")
            assert lk.step_time >= a.step_time - 1e-9 and lk.busy == pytest.approx(a.busy)
            assert nb.busy == pytest.approx(a.busy) and nb.step_time >= a.step_time - 1e-9
            if link is None:
                assert nb.step_time <= lk.step_time + 1e-9, sched.name
            # one ppermute per (kind of value, direction), as the runtime runs them: both
            # kinds go both ways under a V (4 per tick); with p = 2 both ways are one
            per_tick = 4 if p > 2 else 2
            assert sum(e.kind == "exchange" for e in nb.events) == per_tick * p * sched.num_ticks


def test_neighbour_mode_refuses_a_placement_that_skips_devices():
    # global stage 1 on device 2: two hops from stage 0's device 0
    orders = [[Task(0, 0, "F"), Task(0, 0, "BW")] for _ in range(4)]
    sched = from_orders(orders, num_microbatches=1, placement=[[0], [2], [1], [3]])
    with pytest.raises(ValueError, match="global stage 0 is on device 0 and 1 on device 2"):
        simulate(sched, UNIT, mode="neighbour")
    # async and lockstep take any hop: 4 F + 4 BW, 3 hops each way
    assert simulate(sched, UNIT, link=0.5).step_time == pytest.approx(12 + 6 * 0.5)


# ZB-V's steady state (step 4 of its order: F a, B a, W a, F b, B b, W b while chunk
# a still has forwards to run) starts on device s after its 5p - 3s - 1 warm-up tasks
# and lasts m - 2p + s + 1 rounds of 6 (schedules/vshape.py). Zero steady-state bubble:
# no device waits between two of those tasks.
ZBV_STEADY_COSTS = [StageCosts(F=1, B=1, W=1), StageCosts(F=1, B=1.5, W=1), StageCosts(F=1.5, B=1, W=1),
                    StageCosts(F=1, B=2, W=2), StageCosts(F=1, B=1, W=0.5), StageCosts(F=2, B=1.5, W=2)]


def _steady_gaps(r, p, m):
    gaps = []
    for s in range(p):
        tasks = r.events_of(s, "compute")
        lo = 5 * p - 3 * s - 1
        hi = lo + 6 * (m - 2 * p + s + 1)
        gaps += [b.start - a.end for a, b in zip(tasks[lo:hi], tasks[lo + 1:hi], strict=False)]
    return gaps


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("costs", ZBV_STEADY_COSTS)
def test_zbv_async_has_zero_steady_state_bubble_when_w_plus_2b_covers_2f(p, costs):
    F, B, W = costs.F, costs.B, costs.W
    assert W + 2 * B >= 2 * F and W + 2 * F >= 2 * B          # the paper's condition
    m = 4 * p
    r = simulate(get_schedule("zbv", p, m), costs)
    gaps = _steady_gaps(r, p, m)
    assert len(gaps) == sum(6 * (m - 2 * p + s + 1) - 1 for s in range(p))
    assert max(gaps) <= 1e-9                                  # tolerance: float round-off only
    # and so one more microbatch costs each device exactly its work, 2 (F + B + W)
    more = simulate(get_schedule("zbv", p, m + 1), costs)
    assert more.step_time - r.step_time == pytest.approx(2 * (F + B + W), abs=1e-9)


def test_zbv_steady_state_waits_when_the_condition_fails():
    # B > F + W/2 (W + 2F < 2B): a device waits inside the steady state
    p, m = 4, 16
    r = simulate(get_schedule("zbv", p, m), StageCosts(F=1, B=3, W=1))
    assert max(_steady_gaps(r, p, m)) > 0.5


def test_predict_utilization_of_the_v_schedules():
    # 16 layers on 2p = 16 global stages, one per chunk, F = B = W = 1 per chunk:
    # both V schedules idle p - 1 per device over 2m (F + B + W) of work, 7 / 199 at p = 8, m = 32
    layer = LayerCost(F=1, B=1, W=1)
    for name in ("zbv", "dualpipev"):
        r = predict_utilization(layer, num_layers=16, schedule=name, p=8, m=32)
        assert r.mean_utilization == pytest.approx(1 - 7 / 199)
    # embed and head both land on device 0 (global stages 0 and 2p - 1)
    heavy = predict_utilization(layer, num_layers=16, schedule="zbv", p=8, m=32,
                                embed=LayerCost(F=1, B=0, W=0), head=LayerCost(F=1, B=1, W=1))
    assert heavy.busy[0] == pytest.approx(max(heavy.busy)) and heavy.busy[0] > heavy.busy[1]
