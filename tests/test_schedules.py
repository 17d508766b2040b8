"""Pipeline schedules as data: generators, the validator, bubble and memory figures.

Pure Python, no devices: every number asserted here is derived in the docstrings
of ``mindpipe_jax/parallel/pipeline/schedules/__init__.py``.
"""

import pytest

from mindpipe_jax.parallel.pipeline.schedules import (
    SCHEDULES,
    Kind,
    Schedule,
    ScheduleError,
    Task,
    analytic,
    fb_pair_timeline,
    fb_pairs,
    from_orders,
    get_schedule,
    gpipe,
    interleaved,
    one_f_one_b,
    register_schedule,
    split_only_last,
    v_placement,
    validate,
    zb_h1,
    zbv,
)

SIZES = [(p, m) for p in (2, 4, 8) for m in (p, 2 * p, 4 * p)]
FBW = {"F": 1, "B": 1, "W": 1}          # ZB's equal-cost setting
F_BW = {"F": 1, "BW": 2}                # backward twice the forward


def all_schedules(p, m):
    yield gpipe(p, m)
    yield one_f_one_b(p, m)
    yield zb_h1(p, m)
    for v in (1, 2):
        yield interleaved(p, m, v)
        yield interleaved(p, m, v, warmup="minimal")


@pytest.mark.parametrize("p,m", SIZES)
def test_generated_schedules_validate(p, m):
    for sched in all_schedules(p, m):
        report = validate(sched)
        assert report.ticks == sched.num_ticks
        assert len(report.peak_live_activations) == p
        # one F and one BW (or B and W) per (microbatch, global stage), nothing else
        tasks = [t for row in sched.table for t in row if t is not None]
        per_pair = 3 if sched.name == "zb-h1" else 2
        assert len(tasks) == per_pair * m * p * sched.virtual_stages


@pytest.mark.parametrize("p", [1, 2, 3, 5])
def test_odd_and_small_sizes_validate(p):
    for m in range(1, 2 * p + 2):
        for make in (gpipe, one_f_one_b, zb_h1):
            validate(make(p, m))
        assert one_f_one_b(p, m).num_ticks == 2 * (m + p - 1)
        if m % p == 0:
            assert interleaved(p, m, 3).num_ticks == 2 * (3 * m + p - 1)


@pytest.mark.parametrize("p,m", SIZES)
def test_gpipe_and_1f1b_bubble_is_exact(p, m):
    for sched in (gpipe(p, m), one_f_one_b(p, m)):
        assert sched.num_ticks == 2 * (m + p - 1)
        assert sched.bubble_fraction() == (p - 1) / (m + p - 1)
        # the formula does not depend on the F:B cost ratio for these two
        assert sched.bubble_fraction_weighted(F_BW) == pytest.approx((p - 1) / (m + p - 1))
        assert sched.bubble_fraction_weighted({"F": 1, "BW": 3}) == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p,m", SIZES + [(4, 1), (4, 2), (8, 3)])
def test_1f1b_memory_is_flat_in_m_and_gpipe_is_not(p, m):
    assert one_f_one_b(p, m).peak_live_activations() == [min(p - s, m) for s in range(p)]
    assert gpipe(p, m).peak_live_activations() == [m] * p
    assert one_f_one_b(p, m).peak_pending_weight_grads() == [0] * p


@pytest.mark.parametrize("p,m", SIZES)
@pytest.mark.parametrize("v", [1, 2])
@pytest.mark.parametrize("warmup", ["megatron", "minimal"])
def test_interleaved_bubble(p, m, v, warmup):
    sched = interleaved(p, m, v, warmup=warmup)
    # derived: every chunk task is one tick, the bubble is 2(p - 1) ticks per device
    assert sched.num_ticks == 2 * (v * m + p - 1)
    assert sched.bubble_fraction() == (p - 1) / (v * m + p - 1)
    # Megatron's formula (bubble time (p-1)(tF+tB)/v against m(tF+tB)) with real costs
    assert sched.bubble_fraction_weighted(F_BW) == pytest.approx((p - 1) / (v * m + p - 1))
    lead = [(2 if warmup == "megatron" else 1) * (p - s - 1) + (v - 1) * p for s in range(p)]
    assert sched.peak_live_activations() == [min(n + 1, v * m) for n in lead]


def test_interleaved_beats_1f1b_and_needs_m_divisible_by_p():
    assert interleaved(4, 8, 2).bubble_fraction() < one_f_one_b(4, 8).bubble_fraction()
    with pytest.raises(ValueError, match=r"divisible.*m=6, p=4"):
        interleaved(4, 6, 2)
    with pytest.raises(ScheduleError, match="warmup"):
        interleaved(4, 8, 2, warmup="eager")


@pytest.mark.parametrize("p,m", SIZES)
def test_zb_h1_bubble_and_memory(p, m):
    zb, ref = zb_h1(p, m), one_f_one_b(p, m)
    assert zb.num_ticks == 3 * m + p - 1
    bubble = zb.bubble_fraction_weighted(FBW)
    assert bubble == pytest.approx((p - 1) / (3 * m + p - 1))
    assert bubble < (p - 1) / (3 * m) + 1e-12
    assert bubble <= ref.bubble_fraction_weighted(F_BW) / 2 + 1e-12
    assert zb.peak_live_activations() == ref.peak_live_activations()
    assert zb.peak_pending_weight_grads() == [s + 1 for s in range(p)]
    assert zb.peak_in_flight() == [p] * p


@pytest.mark.parametrize("name,v,p,m", [("zb-h1", 1, 4, 8), ("zb-h1", 1, 8, 32), ("zbv", 2, 4, 16),
                                         ("dualpipev", 2, 4, 8)])
@pytest.mark.parametrize("k", [0, 1, 4])
def test_split_only_last_keeps_each_devices_order_and_splits_the_tail(name, v, p, m, k):
    full = get_schedule(name, p, m, v)
    tail = get_schedule(name, p, m, v, split_last=k)
    assert tail == split_only_last(full, k)  # validated on construction

    def order(sched, s):
        return [t for row in sched.table if (t := row[s]) is not None]
    for s in range(p):
        expect = [Task(t.microbatch, t.chunk, Kind.BW) if t.kind is Kind.B and t.microbatch < m - k else t
                  for t in order(full, s) if not (t.kind is Kind.W and t.microbatch < m - k)]
        assert order(tail, s) == expect
    split = {t.microbatch for row in tail.table for t in row if t is not None and t.kind is Kind.B}
    assert split == ({x for row in full.table for t in row if t is not None and t.kind is Kind.B
                      for x in [t.microbatch]} & set(range(m - k, m)))
    # no more live activations or pending W's than the table it came from
    assert max(tail.peak_live_activations()) <= max(full.peak_live_activations())
    assert max(tail.peak_pending_weight_grads()) <= max(full.peak_pending_weight_grads())


def test_split_only_last_edges_and_what_it_is_for():
    assert split_only_last(zb_h1(4, 8), 8) == zb_h1(4, 8) == get_schedule("zb-h1", 4, 8, split_last=-1)
    assert split_only_last(zb_h1(4, 8), 0).table == one_f_one_b(4, 8).table  # nothing split: 1F1B
    # No B/W to keep split: refused, not a no-op (a plan printing it handed `mindpipe train`
    # a parallel.split_last it refuses).
    for unsplit in (one_f_one_b(4, 8), get_schedule("interleaved", 4, 8, 2)):
        with pytest.raises(ScheduleError, match=f"split_last=2: schedule '{unsplit.name}' does not split"):
            split_only_last(unsplit, 2)
    for bad in (-1, 1.5, True):
        with pytest.raises(ScheduleError, match="split_last must be an integer >= 0"):
            split_only_last(zb_h1(4, 8), bad)
    # Where B + W cost more than the fused backward (this CPU: 1.15-1.31x), splitting only
    # the last p microbatches beats both the paper's table and 1F1B in the replay.
    cost = {"F": 1, "B": 1.4, "W": 0.9, "BW": 2}
    p, m = 8, 32
    tail = split_only_last(zb_h1(p, m), p).timeline(cost).makespan
    assert tail < 0.98 * zb_h1(p, m).timeline(cost).makespan
    assert tail < 0.98 * one_f_one_b(p, m).timeline(cost).makespan


@pytest.mark.parametrize("p,m", [(4, 8), (8, 32)])
def test_lockstep_replay_charges_the_slowest_task_of_each_tick(p, m):
    # a tick-synchronous runtime pays max(F, BW) for a tick mixing them: 1F1B's
    # steady state loses, ZB-H1 with equal F/B/W costs does not
    ref, zb = one_f_one_b(p, m), zb_h1(p, m)
    assert ref.bubble_fraction_weighted(F_BW, lockstep=True) > ref.bubble_fraction_weighted(F_BW) + 0.1
    assert zb.bubble_fraction_weighted(FBW, lockstep=True) == pytest.approx(zb.bubble_fraction_weighted(FBW))
    # unit costs in lockstep are exactly the tick count
    unit = {k: 1 for k in Kind}
    assert ref.timeline(unit, lockstep=True).makespan == ref.num_ticks


def test_timeline_transfer_and_per_stage_costs():
    sched = one_f_one_b(4, 8)
    base = sched.timeline(F_BW)
    assert base.makespan == pytest.approx(3 * (8 + 4 - 1))
    assert sched.timeline(F_BW, transfer=0.5).makespan > base.makespan
    # a slow last stage (e.g. the loss head) stretches the whole pipeline
    slow = sched.timeline(lambda stage, task: (2.0 if stage == 3 else 1.0) * (2 if task.kind == "BW" else 1))
    assert slow.makespan > base.makespan
    assert slow.utilization[3] == max(slow.utilization)


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)])
def test_render_parse_round_trip(name, v):
    sched = get_schedule(name, 4, 8, v)
    text = sched.render()
    assert text.splitlines()[0].startswith(f"# {name}: p=4 m=8 v={v}")
    assert len(text.splitlines()) == 1 + 4
    again = Schedule.parse(text, name=name, num_microbatches=8, virtual_stages=v)
    assert again == sched
    if v > 1:
        assert "F0b" in text and "BW0a" in text
    assert str(sched) == text


def test_render_shows_bubbles():
    assert one_f_one_b(2, 2).render(header=False).splitlines() == [
        "s0: F0  F1  ..  BW0 ..  BW1",
        "s1: ..  F0  BW0 F1  BW1 ..",
    ]


def test_get_schedule_registry():
    assert get_schedule("1f1b", 4, 8) == one_f_one_b(4, 8)
    assert get_schedule("interleaved", 4, 8, 2) == interleaved(4, 8, 2)
    with pytest.raises(ValueError) as err:
        get_schedule("zb-v2", 4, 8)
    msg = str(err.value)
    assert "'zb-v2'" in msg and all(name in msg for name in ("gpipe", "1f1b", "interleaved", "zb-h1"))
    assert "\n" not in msg
    with pytest.raises(ScheduleError, match="virtual_stages=1"):
        get_schedule("gpipe", 4, 8, 2)
    with pytest.raises(ScheduleError, match="microbatches"):
        get_schedule("1f1b", 4, 0)


def test_a_table_too_large_to_build_is_refused_at_once(capsys):
    """A schedule's table is built and checked task by task in Python: a size far past any
    pipeline (p=100000, m=100000 ran for minutes and gigabytes) is refused before it starts,
    the V schedules' two chunks per stage counted."""
    import time

    from mindpipe_jax.cli import main
    start = time.perf_counter()
    huge = r"p=512 x v=2 x m=1024 = 1,048,576 stage-microbatches .*at most 262,144"
    with pytest.raises(ScheduleError, match=huge):
        get_schedule("zbv", 512, 1024)
    assert main(["schedule", "--schedule", "1f1b", "--stages", "100000", "--microbatches", "100000"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "10,000,000,000 stage-microbatches" in err
    assert time.perf_counter() - start < 10
    assert get_schedule("1f1b", 64, 4096).num_microbatches == 4096  # at the limit: built


def test_register_schedule_is_open():
    register_schedule("gpipe-again", lambda p, m, v=1: gpipe(p, m))
    try:
        assert get_schedule("gpipe-again", 2, 4).num_ticks == 10
    finally:
        SCHEDULES.pop("gpipe-again")


# ------------------------------------------------------------ the validator
def rejects(text, match, **kwargs):
    with pytest.raises(ScheduleError) as err:
        Schedule.parse(text, **kwargs)
    msg = str(err.value)
    assert "\n" not in msg
    assert match in msg, msg
    return msg


def test_a_hand_written_table_is_accepted():
    sched = Schedule.parse("""
        s0: F0 F1 .. BW0 .. BW1
        s1: .. F0 BW0 F1 BW1 ..
    """)
    assert (sched.num_stages, sched.num_microbatches, sched.virtual_stages) == (2, 2, 1)
    assert sched.table == one_f_one_b(2, 2).table
    assert sched.tasks_of(1) == [(1, Task(0, 0, "F")), (2, Task(0, 0, "BW")),
                                 (3, Task(1, 0, "F")), (4, Task(1, 0, "BW"))]


def test_rejects_backward_before_forward():
    rejects("s0: BW0 F0", "tick 0, stage 0: BW0 (microbatch 0, global stage 0) runs before its F")


def test_rejects_missing_w():
    rejects("""
        s0: F0 .. .. B0 W0
        s1: .. F0 B0 .. ..
    """, "microbatch 0, global stage 1: B at tick 2 but no W")


def test_rejects_w_without_b_and_w_after_bw():
    rejects("s0: F0 W0 B0", "tick 1, stage 0: W0 (microbatch 0, global stage 0) runs before its B")
    rejects("s0: F0 BW0 W0", "already computed it")


def test_rejects_two_tasks_in_one_tick():
    rejects_table = [[["F0", "F1"]]]
    with pytest.raises(ScheduleError, match="tick 0, stage 0: 2 tasks in one tick"):
        Schedule.from_table(rejects_table)
    with pytest.raises(ScheduleError, match="tick 1, stage 0: two tasks in one tick"):
        Schedule.from_tasks([(0, 0, 0, 0, "F"), (1, 0, 0, 0, "BW"), (1, 0, 1, 0, "F")],
                            num_stages=1, num_microbatches=2)


def test_rejects_using_an_activation_in_the_tick_it_is_made():
    rejects("""
        s0: F0 .. BW0
        s1: F0 BW0 ..
    """, "tick 0, stage 1: F0 (microbatch 0, global stage 1) needs the activation from F of global "
         "stage 0, made in tick 0 and usable from tick 1")


def test_rejects_using_a_gradient_in_the_tick_it_is_made():
    rejects("""
        s0: F0 .. BW0
        s1: .. F0 BW0
    """, "tick 2, stage 0: BW0 (microbatch 0, global stage 0) needs the gradient from the backward of "
         "global stage 1, made in tick 2 and usable from tick 3")


def test_rejects_a_task_on_the_wrong_device():
    # global stage 1 lives on stage 1; putting its forward on stage 0 is refused
    with pytest.raises(ScheduleError, match=r"tick 1, stage 0: F0 of global stage 1 is on the wrong device"):
        Schedule.from_tasks([(0, 0, 0, 0, "F"), (1, 0, 0, 1, "F")], num_stages=2, num_microbatches=1)
    # a chunk the stage does not have
    rejects("s0: F0a F0b\ns1: .. ..", "uses chunk 1, but each stage holds 1 chunk(s)", virtual_stages=1)


def test_rejects_duplicates_missing_work_and_bad_cells():
    rejects("s0: F0 F0 BW0", "repeats the F already run at tick 0")
    rejects("s0: F0 BW0 BW0", "repeats the backward already run as BW at tick 1")
    rejects("s0: F0 BW0", "microbatch 1, global stage 0: no F", num_microbatches=2)
    rejects("s0: F0 ..\ns1: .. F0", "microbatch 0, global stage 0: no backward (B or BW)")
    rejects("s0: F0 BW0 F2 BW2", "uses microbatch 2, but there are 2", num_microbatches=2)
    rejects("s0: F0 X0", "cannot read task 'X0'")
    with pytest.raises(ScheduleError, match="tick 1: expected 2 cells"):
        Schedule.from_table([["F0", None], ["BW0"]])
    with pytest.raises(ScheduleError, match="task kind 'Q'"):
        Task(0, 0, "Q")


def test_direct_construction_is_validated_too():
    good = one_f_one_b(2, 2)
    broken = list(map(list, good.table))
    broken[1][1], broken[2][1] = broken[2][1], broken[1][1]   # stage 1: BW0 before F0
    with pytest.raises(ScheduleError, match="tick 1, stage 1: BW0"):
        Schedule("broken", 2, 2, 1, broken)


def test_custom_placement_v_shape():
    # a V-shaped layout (ZB-V style): device 0 holds global stages 0 and 3, device 1 holds 1 and 2
    v_shape = ((0, 3), (1, 2))
    text = """
        s0: F0a .. .. F0b BW0b .. .. BW0a
        s1: .. F0a F0b .. .. BW0b BW0a ..
    """
    sched = Schedule.parse(text, placement=v_shape)
    assert sched.owner(3) == (0, 1) and sched.global_stage(1, 1) == 2
    assert sched.peak_live_activations() == [2, 2]
    # under Megatron's layout (chunk 1 is global stage 2 on device 0, 3 on device 1) it is wrong
    rejects(text, "tick 2, stage 1: F0b (microbatch 0, global stage 3) needs the activation from F of "
                  "global stage 2, which has not run")
    # and an order list with that placement produces the same table
    orders = [[Task(0, 0, "F"), Task(0, 1, "F"), Task(0, 1, "BW"), Task(0, 0, "BW")],
              [Task(0, 0, "F"), Task(0, 1, "F"), Task(0, 1, "BW"), Task(0, 0, "BW")]]
    built = from_orders(orders, num_microbatches=1, virtual_stages=2, placement=v_shape)
    assert built.table == sched.table
    with pytest.raises(ScheduleError, match="placement must hold each global stage"):
        Schedule.parse(text, placement=((0, 1), (1, 2)))


def test_from_orders_reports_a_deadlock():
    with pytest.raises(ScheduleError, match="deadlock at tick 0"):
        from_orders([[Task(0, 0, "BW"), Task(0, 0, "F")]], num_microbatches=1)


def test_schedules_are_hashable_data():
    a, b = zb_h1(4, 8), zb_h1(4, 8)
    assert a == b and hash(a) == hash(b)
    assert {a: 1}[b] == 1
    assert Task(3, 1, "W") == Task(3, 1, Kind.W) and str(Task(3, 1, "W")) == "W3b"


# ------------------------------------------------------- V schedules: ZB-V and DualPipeV
# Every figure below is derived in the docstrings of schedules/vshape.py and
# schedules/analytic.py. Memory is counted in chunk activations: a chunk holds half
# a stage, so 1F1B's p live microbatches are 2p chunks.
def v_sizes(low):
    """(p, m) with p = 1, 2, 3, 4, 8 and m from ``low(p)`` on: p, 2p, 4p where they are
    allowed and numbers that are not multiples of p."""
    return [(p, m) for p in (1, 2, 3, 4, 8)
            for m in sorted({p, 2 * p, 4 * p, 2 * p + 1, 3 * p - 1, 5} - {0}) if m >= low(p)]


def _work_by_kind(sched):
    tasks = [t for row in sched.table for t in row if t is not None]
    return {kind: sum(t.kind is kind for t in tasks) for kind in Kind}


@pytest.mark.parametrize("p,m", v_sizes(lambda p: 1))
def test_zbv_validates_with_v_placement_and_its_analytic_ticks(p, m):
    sched = get_schedule("zbv", p, m)
    report = validate(sched)
    assert sched.virtual_stages == 2 and sched.placement == v_placement(p)
    assert sched.owner(p - 1)[0] == sched.owner(p)[0] == p - 1   # the turn of the V stays on a device
    # one F, B and W per (microbatch, global stage)
    assert _work_by_kind(sched) == {Kind.F: 2 * p * m, Kind.B: 2 * p * m, Kind.W: 2 * p * m, Kind.BW: 0}
    ticks = max(6 * m + p - 1, 4 * m + 4 * p - 2)
    assert report.ticks == ticks
    assert sched.bubble_fraction() == pytest.approx((ticks - 6 * m) / ticks)
    if 2 * m >= 3 * p - 1:   # each device idles p - 1 ticks: s before, p - 1 - s after
        assert sched.bubble_fraction() == pytest.approx((p - 1) / (6 * m + p - 1))
        for s in range(p):
            first, last = sched.tasks_of(s)[0][0], sched.tasks_of(s)[-1][0]
            assert (first, ticks - 1 - last) == (s, p - 1 - s)
    figures = analytic(sched, FBW)
    assert (figures.ticks, figures.peak_live) == (ticks, min(2 * m, 2 * p))
    assert figures.bubble == pytest.approx(sched.bubble_fraction())
    assert figures.weighted_bubble == pytest.approx(sched.bubble_fraction_weighted(FBW))


@pytest.mark.parametrize("p,m", v_sizes(lambda p: 1))
def test_zbv_live_activations_are_1f1bs(p, m):
    sched = get_schedule("zbv", p, m)
    one_f_one_b_chunks = 2 * max(one_f_one_b(p, m).peak_live_activations())   # min(p, m) microbatches
    assert max(sched.peak_live_activations()) == min(2 * m, 2 * p) == one_f_one_b_chunks
    assert all(n <= 2 * p for n in sched.peak_live_activations())
    assert max(sched.peak_pending_weight_grads()) <= 2 * p - 1


ZBV_COSTS = [{"F": 1, "B": 1, "W": 1}, {"F": 2, "B": 2, "W": 2}, {"F": 1, "B": 2, "W": 1},
             {"F": 1, "B": 1, "W": 0.5}, {"F": 1, "B": 1.5, "W": 1}, {"F": 0.8, "B": 1.6, "W": 0.9}]


@pytest.mark.parametrize("p,m", v_sizes(lambda p: 2 * p - 1))
@pytest.mark.parametrize("cost", ZBV_COSTS)
def test_zbv_weighted_bubble_is_the_analytic_one(p, m, cost):
    """F <= B <= 2W, W <= B: device p - 1 waits (p - 1)(B - F) for its first gradient
    and never again, and ends last: makespan (p - 1) B + 2m (F + B + W)."""
    sched = get_schedule("zbv", p, m)
    F, B, W = cost["F"], cost["B"], cost["W"]
    timeline = sched.timeline(cost)
    assert timeline.makespan == pytest.approx((p - 1) * B + 2 * m * (F + B + W))
    expected = (p - 1) * B / ((p - 1) * B + 2 * m * (F + B + W))
    assert timeline.bubble_fraction == pytest.approx(expected)
    assert analytic(sched, cost).weighted_bubble == pytest.approx(expected)


def test_zbv_weighted_bubble_has_no_closed_form_outside_its_range():
    sched = get_schedule("zbv", 4, 16)
    assert analytic(sched, {"F": 1, "B": 3, "W": 1}).weighted_bubble is None     # B > 2W
    assert analytic(sched, {"F": 2, "B": 1, "W": 1}).weighted_bubble is None     # B < F
    assert analytic(sched, lambda stage, task: 1.0).weighted_bubble is None      # per-stage costs


@pytest.mark.parametrize("p,m", v_sizes(lambda p: 2 * p))
def test_dualpipev_validates_and_its_tick_figures(p, m):
    sched = get_schedule("dualpipev", p, m)
    report = validate(sched)
    assert sched.virtual_stages == 2 and sched.placement == v_placement(p)
    work = _work_by_kind(sched)
    assert work[Kind.F] == 2 * p * m and work[Kind.BW] + work[Kind.B] == 2 * p * m
    assert work[Kind.W] == work[Kind.B] == sum(2 * p - s - 1 for s in range(p))   # split backwards
    # device s holds 4m + 2p - 1 - s cells (2p - s - 1 of its backwards are split) and idles s ticks
    assert report.ticks == 4 * m + 2 * p - 1
    assert [report.ticks - len(sched.tasks_of(s)) for s in range(p)] == list(range(p))
    assert sched.bubble_fraction() == pytest.approx((p - 1) / (2 * (4 * m + 2 * p - 1)))
    assert sched.peak_live_activations() == [2 * p + 1] * p          # the repository's PP + 1, PP = 2p
    assert sched.peak_pending_weight_grads() == [s + 1 for s in range(p)]


@pytest.mark.parametrize("p,m", v_sizes(lambda p: 2 * p))
def test_dualpipev_fb_pairs_are_consecutive_f_and_bw_of_the_other_chunk(p, m):
    sched = get_schedule("dualpipev", p, m)
    for s, pairs in enumerate(fb_pairs(sched)):
        # steady state: 2 per round, m - 2p + s + 1 rounds; drain: one per round, p - s - 1 rounds
        assert len(pairs) == 2 * (m - 2 * p + s + 1) + (p - s - 1)
        for t0, t1 in pairs:
            f, bw = sched.table[t0][s], sched.table[t1][s]
            assert (f.kind, bw.kind) == (Kind.F, Kind.BW) and f.chunk != bw.chunk
            assert t1 == t0 + 1                          # in the table the two cells sit in a row
    with pytest.raises(ScheduleError, match="DualPipeV"):
        fb_pairs(get_schedule("zbv", p, m))


DPV_COSTS = [{"F": 1, "B": 1, "W": 1}, {"F": 1, "B": 2, "W": 1}, {"F": 1, "B": 1, "W": 0.5},
             {"F": 1.1, "B": 1.3, "W": 1.3}, {"F": 0.6, "B": 1.7, "W": 1.2}]   # F <= B, W <= B


@pytest.mark.parametrize("p,m", v_sizes(lambda p: 2 * p))
@pytest.mark.parametrize("cost", DPV_COSTS)
def test_dualpipev_pairs_run_as_one_unit_give_the_repositorys_bubble(p, m, cost):
    """(PP/2 - 1)(F&B + B - 3W) per device with PP = 2p stages, the repository's B our
    BW = B + W and F&B = F + BW; the table's cells run one by one do better."""
    sched = get_schedule("dualpipev", p, m)
    F, B, W = cost["F"], cost["B"], cost["W"]
    BW = B + W
    idle = (p - 1) * (F + BW + BW - 3 * W)
    paired = fb_pair_timeline(sched, cost)
    assert paired.makespan == pytest.approx(idle + 2 * m * (F + B + W))
    assert [paired.makespan - b for b in paired.busy] == pytest.approx([idle] * p)
    assert analytic(sched, cost).paired_bubble == pytest.approx(paired.bubble_fraction)
    assert sched.timeline(cost).makespan <= paired.makespan + 1e-9


@pytest.mark.parametrize("p,m", v_sizes(lambda p: 2 * p))
def test_dualpipev_weighted_bubble_with_equal_costs(p, m):
    # F = B = W = c, cells one by one: every device idles (p - 1) c, as ZB-V
    for c in (1.0, 2.5):
        cost = {"F": c, "B": c, "W": c}
        sched = get_schedule("dualpipev", p, m)
        timeline = sched.timeline(cost)
        assert [timeline.makespan - b for b in timeline.busy] == pytest.approx([(p - 1) * c] * p)
        assert timeline.bubble_fraction == pytest.approx((p - 1) / (6 * m + p - 1))
        assert analytic(sched, cost).weighted_bubble == pytest.approx(timeline.bubble_fraction)
    assert analytic(get_schedule("dualpipev", p, m), {"F": 1, "B": 2, "W": 1}).weighted_bubble is None
    # F > B: the paired replay takes longer than the repository's formula, which is then not given
    assert analytic(get_schedule("dualpipev", p, m), {"F": 1.3, "B": 1.1, "W": 0.7}).paired_bubble is None


def test_v_schedules_registry_and_bad_input():
    # the chunk count is fixed at 2: get_schedule's default, and the only value taken
    assert get_schedule("zbv", 4, 8) == get_schedule("zbv", 4, 8, 2) == zbv(4, 8)
    assert get_schedule("dualpipev", 4, 8).virtual_stages == 2
    assert get_schedule("1f1b", 4, 8).virtual_stages == 1 == get_schedule("interleaved", 4, 8).virtual_stages
    # odd p and m that is not a multiple of p are fine
    assert validate(get_schedule("zbv", 3, 7)).ticks == 6 * 7 + 3 - 1
    assert validate(get_schedule("dualpipev", 3, 7)).ticks == 4 * 7 + 2 * 3 - 1
    for args, words in [(("zbv", 4, 8, 3), "'zbv' places exactly 2 chunks per stage in a V "
                                           "(virtual_stages=2), got 3"),
                        (("dualpipev", 4, 8, 1), "(virtual_stages=2), got 1"),
                        (("dualpipev", 4, 7), "dualpipev needs at least 2p microbatches: m=7 with p=4 stages "
                                              "(use m >= 8)"),
                        (("dualpipev", 3, 1), "m=1 with p=3 stages (use m >= 6)"),
                        (("zbv", 0, 8), "pipeline stages (p) must be an integer >= 1, got 0"),
                        (("zbv", 4, 0), "microbatches (m) must be an integer >= 1, got 0")]:
        with pytest.raises(ScheduleError) as err:
            get_schedule(*args)
        assert words in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
def test_v_schedules_render_parse_round_trip(name):
    sched = get_schedule(name, 4, 9)
    again = Schedule.parse(sched.render(), name=name, num_microbatches=9, placement=v_placement(4))
    assert again == sched
    assert "F0b" in sched.render()


def test_analytic_figures_of_the_other_schedules_match_their_tables():
    for p, m in SIZES:
        for sched in (gpipe(p, m), one_f_one_b(p, m), zb_h1(p, m), interleaved(p, m, 2),
                      interleaved(p, m, 1)):
            figures = analytic(sched, F_BW)
            assert figures.ticks == sched.num_ticks, sched.name
            assert figures.bubble == pytest.approx(sched.bubble_fraction())
            assert figures.peak_live == max(sched.peak_live_activations())
            if figures.weighted_bubble is not None:
                assert figures.weighted_bubble == pytest.approx(sched.bubble_fraction_weighted(F_BW))
    zb = zb_h1(4, 8)
    assert analytic(zb, FBW).weighted_bubble == pytest.approx(zb.bubble_fraction_weighted(FBW))
    # a table that is not what its name's generator builds has no closed form
    assert analytic(interleaved(4, 8, 2, warmup="minimal")) is None
    assert analytic(Schedule.parse("s0: F0 BW0", name="zbv")) is None
