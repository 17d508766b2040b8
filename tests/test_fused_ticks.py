"""Fused ticks: the re-timed tables keep every rule, run faster as the runtime runs
them, and the compiled tick loop copies no accumulator or buffer."""

import re

import jax
import numpy as np
import pytest
from pipeline_oracle import assert_matches, microbatches, reference, tiny_gpt

from mindpipe_jax.config import ParallelConfig
from mindpipe_jax.parallel.mesh import make_mesh
from mindpipe_jax.parallel.pipeline import DEFAULT_COST, Kind, get_schedule
from mindpipe_jax.parallel.pipeline.contract import stage_fns
from mindpipe_jax.parallel.pipeline.runtime import make_plan, pipeline_grads
from mindpipe_jax.parallel.pipeline.schedules.fused import (
    COST_PROFILES,
    FUSE_MODES,
    PART_OF,
    fuse,
    replay_time,
    worst_slowdown,
)

NAMES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("afapab", 2), ("zbv", 2),
         ("dualpipev", 2)]


def _inputs(kind, mb, g, last):
    if kind is Kind.F:
        return [(Kind.F, mb, g - 1)] if g > 0 else []
    if kind is Kind.W:
        return [("B", mb, g)]
    return [(Kind.F, mb, g)] + ([("B", mb, g + 1)] if g < last else [])


@pytest.mark.parametrize("mode", FUSE_MODES)
@pytest.mark.parametrize("name,v", NAMES)
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16)])
def test_fused_tables_run_every_task_once_after_its_inputs(name, v, p, m, mode):
    sched = get_schedule(name, p, m, v)
    fused = fuse(sched, mode)
    last = sched.num_global_stages - 1
    seen = {}
    for t, row in enumerate(fused.cells):
        for s, cell in enumerate(row):
            for part, task in enumerate(cell):
                if task is None:
                    continue
                assert PART_OF[task.kind] == part
                g = sched.global_stage(s, task.chunk)
                key = ("B" if task.kind in (Kind.B, Kind.BW) else task.kind, task.microbatch, g)
                assert key not in seen, (t, s, task)
                seen[key] = (t, s, part)
    want = {("B" if task.kind in (Kind.B, Kind.BW) else task.kind, task.microbatch,
             sched.global_stage(s, task.chunk))
            for row in sched.table for s, task in enumerate(row) if task is not None}
    assert set(seen) == want
    for (kind, mb, g), (t, s, part) in seen.items():
        for dep in _inputs(Kind(kind) if kind != "B" else Kind.B, mb, g, last):
            dt, ds, dpart = seen[dep]
            # from an earlier tick, or the last stage's F (a no-op) feeding its own backward
            assert dt < t or (dt == t and ds == s and dpart < part and dep[0] is Kind.F and g == last), \
                (kind, mb, g, dep)


@pytest.mark.parametrize("name,v", NAMES)
def test_auto_fusion_is_robust_to_the_task_costs(name, v):
    # Without costs, 'auto' takes the fusing whose worst slowdown against the best one over
    # plausible cost ratios is smallest: within 15% of the best under every profile, and
    # never worse in the worst case than running the table as it is.
    for p, m in [(4, 16), (8, 32)]:
        sched = get_schedule(name, p, m, v)
        options = [fuse(sched, mode) for mode in FUSE_MODES[1:]]
        auto = fuse(sched)
        assert worst_slowdown(auto, options) <= 1.15
        assert worst_slowdown(auto, options) <= worst_slowdown(fuse(sched, "table"), options) + 1e-12
        for profile in COST_PROFILES:  # given costs, 'auto' is the fastest under them
            cost = {**profile, "BW": profile["B"] + profile["W"]}
            best = min(replay_time(fuse(sched, mode, cost), cost) for mode in FUSE_MODES[1:])
            assert replay_time(fuse(sched, "auto", cost), cost) == pytest.approx(best)


def test_fused_1f1b_reaches_its_asynchronous_bound_and_holds_at_most_2p_minus_1():
    for p, m in [(4, 16), (8, 32)]:
        sched = get_schedule("1f1b", p, m)
        fused = fuse(sched)
        work = sum(DEFAULT_COST[t.kind] for row in sched.table for t in row if t is not None) / p
        # The asynchronous 1F1B step is (m + p - 1)(F + BW): utilization m / (m + p - 1).
        assert work / replay_time(fused) == pytest.approx(m / (m + p - 1), rel=1e-9)
        assert work / replay_time(fuse(sched, "table")) < m / (m + p - 1) - 0.1
        assert max(fused.peak_live()) <= 2 * p - 1
        assert max(make_plan(sched, "none").res_slots.values()) <= 2 * p - 1


def test_fill_defers_w_into_bubbles_and_auto_follows_measured_costs():
    # Costs measured on this CPU for one GPT block (ms): B is twice F, so the table's
    # uniform ticks waste time; "fill" runs F and B together and W where a part is idle.
    cost = {"F": 3.3, "B": 6.2, "W": 4.3, "BW": 8.5}
    sched = get_schedule("zb-h1", 8, 32)
    times = {mode: replay_time(fuse(sched, mode), cost) for mode in FUSE_MODES[1:]}
    assert times["fill"] < 0.9 * times["table"]
    assert replay_time(fuse(sched, "auto", cost), cost) == min(times.values())
    fill, ahead = fuse(sched, "fill"), fuse(sched, "forward-ahead")

    def mean_w_tick(f):
        ticks = [t for (kind, _, _), t in f.tick_of.items() if kind is Kind.W]
        return sum(ticks) / len(ticks)
    assert mean_w_tick(fill) > mean_w_tick(ahead)  # the W's wait for bubbles
    assert max(fill.peak_live()) <= 2 * 8 - 1


@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
def test_slack_runs_w_where_the_tick_waits_anyway(name):
    # Measured CPU costs of one GPT block (benchmarks/pipeline.py, 2026-12-01, ms). In a
    # V schedule's fused ticks "fill" defers a W to a bubble even where its device would
    # wait for a slower neighbour; "slack" runs it there, at no cost to the tick.
    cost = {"F": 3.95, "B": 6.42, "W": 4.46, "BW": 9.33}
    sched = get_schedule(name, 8, 32, 2)
    fill, slack = fuse(sched, "fill"), fuse(sched, "slack", cost)
    assert replay_time(slack, cost) < 0.97 * replay_time(fill, cost)
    # ... holding no more activations than fill, and no more pending W's (stash slots)
    # than the table itself (fill may hold fewer: DualPipeV's fill runs each W at once)
    assert max(slack.peak_live()) <= max(fill.peak_live())
    assert (max(make_plan(sched, "none", "slack", fuse_cost=cost).stash_slots.values())
            <= max(make_plan(sched, "none", "table").stash_slots.values()))
    # Under F = B = W (the table's own assumption) ZB-V's fused step reaches 0.90.
    even = {"F": 1.0, "B": 1.0, "W": 1.0, "BW": 2.0}
    work = sum(even[str(t.kind)] for row in sched.table for t in row if t is not None) / 8
    if name == "zbv":
        assert work / replay_time(fuse(sched, "slack", even), even) >= 0.90


def test_fuse_mode_is_checked():
    with pytest.raises(ValueError, match="fuse mode 'eager' is not one of auto, table"):
        fuse(get_schedule("1f1b", 2, 4), "eager")


@pytest.mark.parametrize("name,p,m,v,remat,mode", [("zbv", 2, 4, 2, False, "auto"),
                                                   ("dualpipev", 2, 4, 2, True, "auto"),
                                                   ("1f1b", 4, 8, 1, "dots", "auto"),
                                                   ("zb-h1", 4, 8, 1, False, "fill"),
                                                   ("zbv", 4, 8, 2, "dots", "slack")])
def test_fused_and_v_schedules_equal_unpipelined(name, p, m, v, remat, mode):
    model, params = tiny_gpt(p * v)
    inputs, targets = microbatches(p * m + 1, m)
    ref_loss, ref_grads = reference(model, params, inputs, targets)
    mesh = make_mesh(ParallelConfig(pipe=p, data=-1, tensor=1))
    run = pipeline_grads(stage_fns(model), get_schedule(name, p, m, v), mesh, remat=remat, nan_bubbles=True,
                         fuse_mode=mode)
    with jax.set_mesh(mesh):
        loss, grads = jax.jit(run)(params["embed"], params["blocks"], params["head"], inputs, targets)
    assert_matches(loss, grads, ref_loss, ref_grads)


@pytest.mark.parametrize("name,p,m,v,remat,k,lockstep", [("zb-h1", 4, 8, 1, False, 3, False),
                                                        ("zbv", 2, 4, 2, "dots", 1, False),
                                                        ("dualpipev", 2, 4, 2, "full", 2, False),
                                                        ("zb-h1", 4, 8, 1, "dots", 2, True)])
def test_split_only_last_equals_unpipelined(name, p, m, v, remat, k, lockstep):
    """A zero-bubble table that splits only its last k microbatches' backwards: on each
    split stage the earlier microbatches' BW runs the unsplit backward on the split's
    residuals (``ChunkSplit.fused``), the tail's B stashes for its W; stash slots only for
    the tail. Gradients equal plain value_and_grad, NaN in every buffer a bubble leaves."""
    schedule = get_schedule(name, p, m, v, split_last=k)
    plan = make_plan(schedule, remat)
    assert plan.split and any(key[0] == Kind.BW for key in plan.parts[1].keys)
    whole = make_plan(get_schedule(name, p, m, v), remat)
    assert max(plan.stash_slots.values()) <= max(whole.stash_slots.values())
    if lockstep:
        _lockstep_equals_unpipelined(schedule, remat, seed=p * m + 3)
        return
    model, params = tiny_gpt(p * v)
    inputs, targets = microbatches(p * m + 3, m)
    ref_loss, ref_grads = reference(model, params, inputs, targets)
    mesh = make_mesh(ParallelConfig(pipe=p, data=-1, tensor=1))
    run = pipeline_grads(stage_fns(model), schedule, mesh, remat=remat, nan_bubbles=True)
    with jax.set_mesh(mesh):
        loss, grads = jax.jit(run)(params["embed"], params["blocks"], params["head"], inputs, targets)
    assert_matches(loss, grads, ref_loss, ref_grads)


@pytest.mark.parametrize("name,p,m,v,remat", [("1f1b", 4, 8, 1, "full"), ("zb-h1", 4, 8, 1, False),
                                              ("interleaved", 2, 4, 2, "dots")])
def test_lockstep_first_stage_shares_the_middle_branches_and_equals_unpipelined(name, p, m, v, remat):
    """Stages in lockstep (tensor > 1 forces it; forced here on pipe x data) run every branch
    of a tick on every device. With middle stages the first stage's tasks take the middle
    stages' branches (its embedding under a select), so a steady 1F1B tick on p=4 runs one
    forward and two backwards (that branch and the last stage's) instead of two and three.
    Gradients equal plain value_and_grad, with NaN in every buffer a bubble leaves unwritten."""
    from mindpipe_jax.parallel.pipeline.runtime.tickplan import EITHER, FIRST

    schedule = get_schedule(name, p, m, v)
    merged, apart = make_plan(schedule, remat, merge_first=True), make_plan(schedule, remat)
    assert all(pos != FIRST for part in merged.parts for _, pos, _ in part.keys)
    assert any(pos == EITHER for part in merged.parts for _, pos, _ in part.keys)
    assert _branch_runs(merged) < _branch_runs(apart)  # fewer branch runs per step on every device
    _lockstep_equals_unpipelined(schedule, remat, seed=p * m + 1, merge_last=False)


def _branch_runs(plan) -> int:
    """Branch runs per step on every device in lockstep."""
    return sum(int(part.active().sum()) for part in plan.parts)


def _lockstep_equals_unpipelined(schedule, remat, seed, **options):
    """The pipeline forced into lockstep on pipe x data, NaN in every buffer a bubble leaves
    unwritten, against plain value_and_grad."""
    p, v, m = schedule.num_stages, schedule.virtual_stages, schedule.num_microbatches
    model, params = tiny_gpt(p * v)
    inputs, targets = microbatches(seed, m)
    ref_loss, ref_grads = reference(model, params, inputs, targets)
    mesh = make_mesh(ParallelConfig(pipe=p, data=-1, tensor=1))
    run = pipeline_grads(stage_fns(model), schedule, mesh, remat=remat, nan_bubbles=True, lockstep=True,
                         **options)
    with jax.set_mesh(mesh):
        loss, grads = jax.jit(run)(params["embed"], params["blocks"], params["head"], inputs, targets)
    assert_matches(loss, grads, ref_loss, ref_grads)


@pytest.mark.parametrize("name,p,m,v,remat,split", [
    ("1f1b", 4, 8, 1, "none", True),  # every last-stage backward in its forward's tick (inline)
    ("1f1b", 2, 4, 1, "full", True),  # no middle stage: the first and the last share
    ("zb-h1", 4, 8, 1, "dots", True),  # split: the loss's gradient kept for a later B
    ("zb-h1", 2, 4, 1, False, False),  # B inline, its unsplit W later reads what the F stored
    ("interleaved", 2, 4, 2, "none", True),
    ("zbv", 2, 4, 2, "none", True)])  # split B inline, the V's turn on the device
def test_lockstep_last_stage_shares_the_branches_and_equals_unpipelined(name, p, m, v, remat, split):
    """In lockstep the last stage's tasks take the other stages' branches too: its forward
    runs its layers and the loss (the head's gradient and the loss's gradient at its
    output, kept for its backward), so a tick runs each kind's layers once, whatever
    stages its tasks are at. Gradients equal plain value_and_grad, with NaN in every
    buffer a bubble leaves unwritten (a slot read before the F that fills it, or a
    forwarded value dropped, shows)."""
    from mindpipe_jax.parallel.pipeline.runtime.tickplan import EITHER

    schedule = get_schedule(name, p, m, v)
    both = make_plan(schedule, remat, split_backward=split, merge_first=True, merge_last=True)
    first = make_plan(schedule, remat, split_backward=split, merge_first=True)
    assert all(pos == EITHER for part in both.parts for _, pos, _ in part.keys)
    assert _branch_runs(both) < _branch_runs(first)
    if name == "1f1b":
        assert both.parts[1].inline.any()
    _lockstep_equals_unpipelined(schedule, remat, seed=p * m + 3, split_backward=split)


@pytest.mark.parametrize("name,p,m,remat", [
    ("1f1b", 2, 4, ("full", "dots")),  # the last stage keeps "dots", every backward inline
    ("zb-h1", 2, 4, ("none", "dots")),  # its split B inline: "split-dots" stored nowhere
    ("zb-h1", 4, 8, ("full", "none", "dots", "dots"))])
def test_lockstep_with_a_remat_per_stage_equals_unpipelined(name, p, m, remat):
    """In lockstep (tensor > 1 runs so) a stage list such as ``mindpipe plan`` prints
    crashed tracing when the last stage's policy kept residuals no other stage kept (a
    merged last stage whose backwards all run in its F's tick stores none, so the F
    branches disagreed on the buffers they pass on: a pytree error, or a KeyError).
    Gradients equal plain value_and_grad, NaN in every buffer a bubble leaves unwritten."""
    schedule = get_schedule(name, p, m)
    _lockstep_equals_unpipelined(schedule, remat, seed=p * m + 5)


def _loop_body_copies(hlo: str) -> list[str]:
    """The shapes copied in the body of the while loop that holds the ring transfers."""
    comps, cur = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            cur = head.group(1)
            comps[cur] = []
        elif cur:
            comps[cur].append(line)
    bodies = set(re.findall(r"while\(.*?body=%?([\w.\-]+)", hlo))
    ticking = [b for b in bodies if any("collective-permute" in ln for ln in comps.get(b, []))]
    assert ticking, "no while loop with ring transfers found"
    return [re.search(r"= (\S+) copy\(", ln).group(1) for b in ticking for ln in comps[b]
            if re.search(r"= \S+ copy\(", ln)]


@pytest.mark.xla_default_emitters  # a property of the program XLA compiles for users
@pytest.mark.parametrize("name,v,remat,tensor", [("1f1b", 1, False, 1), ("zb-h1", 1, "dots", 1),
                                                ("interleaved", 2, True, 1), ("1f1b", 1, False, 2)])
def test_tick_loop_copies_no_accumulator_or_buffer(name, v, remat, tensor):
    # Before: the accumulators went through the switch and XLA copied each of them
    # (and, with several reads of a buffer feeding different branches, whole slot
    # buffers) every tick. Now no array of an accumulator's or a buffer's shape is
    # copied inside the tick loop; with tensor = 2 the stages run in lockstep (every
    # residual buffer was copied twice a tick there while the F read no slot of its own).
    p, m = 4, 8
    model, params = tiny_gpt(p * v * 2)
    inputs, targets = microbatches(0, m)
    mesh = make_mesh(ParallelConfig(pipe=p, data=-1, tensor=tensor))
    sched = get_schedule(name, p, m, v)
    run = pipeline_grads(stage_fns(model), sched, mesh, remat=remat)
    with jax.set_mesh(mesh):
        hlo = jax.jit(run).lower(params["embed"], params["blocks"], params["head"],
                                 inputs, targets).compile().as_text()
    plan = make_plan(sched, remat, merge_first=tensor > 1, merge_last=tensor > 1)
    chunk_shapes = {tuple(x.shape[1:]) for x in jax.tree.leaves(params["blocks"])}
    acc_shapes = {(v, 2, *shape) for shape in chunk_shapes}  # [v chunks, 2 layers each, ...]
    acc_shapes |= {tuple(x.shape) for x in jax.tree.leaves((params["embed"], params["head"]))}
    # residual buffers hold a spare slot beyond the plan's (where an F keeping nothing writes)
    buffer_rows = {plan.x_slots, plan.g_slots, *(n + 1 for n in plan.res_slots.values()),
                   *plan.stash_slots.values()}
    copied = _loop_body_copies(hlo)
    for text in copied:
        dims = tuple(int(d) for d in re.match(r"\w+\[([\d,]*)\]", text).group(1).split(",") if d)
        assert dims not in acc_shapes, f"accumulator-shaped copy {text} in the tick loop"
        big = np.prod(dims) >= np.prod(inputs.shape[1:]) * 32  # at least one activation slot
        assert not (big and dims and dims[0] in buffer_rows and dims[0] > 1), \
            f"buffer-shaped copy {text} in the tick loop"
