"""Pipeline schedules as data: generators, the validator, bubble and memory figures.

Pure Python, no devices: every number asserted here is derived in the docstrings
of ``mindpipe_jax/parallel/pipeline/schedules.py``.
"""

import pytest

from mindpipe_jax.parallel.pipeline.schedules import (
    SCHEDULES,
    Kind,
    Schedule,
    ScheduleError,
    Task,
    from_orders,
    get_schedule,
    gpipe,
    interleaved,
    one_f_one_b,
    register_schedule,
    validate,
    zb_h1,
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
