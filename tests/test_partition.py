"""vPipe partitioner: optimal contiguous splits, remat under a memory budget, the plan's
layout through the runtime, and ``mindpipe plan``. Costs are injected except in the
one command-line test, which measures a tiny GPT for real."""

from __future__ import annotations

import dataclasses
import itertools
import random
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pipeline_oracle import assert_matches, microbatches, reference, tiny_gpt

from mindpipe_jax.cli import main
from mindpipe_jax.config import ParallelConfig
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.parallel.mesh import make_mesh
from mindpipe_jax.parallel.pipeline import get_schedule
from mindpipe_jax.parallel.pipeline.contract import stage_fns
from mindpipe_jax.parallel.pipeline.plan import memory as partmem
from mindpipe_jax.parallel.pipeline.plan import partition as partition_mod
from mindpipe_jax.parallel.pipeline.plan import profile as profile_mod
from mindpipe_jax.parallel.pipeline.plan.partition import (
    MB,
    PARAM_COPIES,
    REMAT_POLICIES,
    ProfiledModel,
    partition,
)
from mindpipe_jax.parallel.pipeline.runtime import StageLayout, pipeline_grads
from mindpipe_jax.sim import LayerCost

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def uniform(L, *, F=1.0, B=1.0, W=1.0, embed=None, head=None, act=1e6, params=1e6, residual=8e6):
    layer = LayerCost(F, B, W, activation_bytes=act, param_bytes=params)
    return ProfiledModel(layers=[layer] * L, embed=embed or LayerCost(0.0, 0.0, 0.0, activation_bytes=act),
                         head=head or LayerCost(0.0, 0.0, 0.0), residual_bytes=residual)


# --- the split is optimal ---------------------------------------------------------------------


def _splits(L, G):
    """Every contiguous split of L layers into G stages (>= 1 layer each when L >= G)."""
    if L >= G:
        cuts = itertools.combinations(range(1, L), G - 1)
    else:
        cuts = itertools.combinations_with_replacement(range(L + 1), G - 1)
    for c in cuts:
        bounds = (0, *c, L)
        yield [range(bounds[g], bounds[g + 1]) for g in range(G)]


def _stage_time(prof, spans, g):
    G = len(spans)
    t = sum(prof.layers[i].F + prof.layers[i].fused for i in spans[g])
    if g == 0:
        t += prof.embed.F + prof.embed.fused
    if g == G - 1:
        t += prof.head.F + prof.head.fused
    return t


def _random_profile(rng, L):
    layers = [LayerCost(rng.uniform(0.5, 3), rng.uniform(0.5, 3), rng.uniform(0.5, 3),
                        activation_bytes=1e6, param_bytes=rng.uniform(1e6, 4e6)) for _ in range(L)]
    embed = LayerCost(rng.uniform(0, 6), 0.0, rng.uniform(0, 3), activation_bytes=1e6, param_bytes=2e6)
    head = LayerCost(rng.uniform(0, 6), rng.uniform(0, 3), rng.uniform(0, 3), param_bytes=2e6)
    return ProfiledModel(layers=layers, embed=embed, head=head, head_residual_bytes=3e6,
                         residual_bytes=[rng.uniform(2e6, 9e6) for _ in range(L)])


@pytest.mark.parametrize("seed", range(6))
def test_split_is_optimal_against_brute_force(seed):
    rng = random.Random(seed)
    for L in range(1, 8):
        for p in range(1, 5):
            prof = _random_profile(rng, L)
            plan = partition(prof, p=p, m=4)
            best = min(max(_stage_time(prof, spans, g) for g in range(p)) for spans in _splits(L, p))
            assert plan.slowest_stage_s == pytest.approx(best, rel=1e-9), (L, p, plan.counts)
            assert sum(plan.counts) == L and (L < p or min(plan.counts) >= 1)
            times = [_stage_time(prof, plan.layers, g) for g in range(p)]
            assert plan.stage_time_s == pytest.approx(times)


def _fits(prof, spans, g, p, inflight, policy, budget):
    """The memory model, written out independently of partition.py (v = 1)."""
    r, G = spans[g], len(spans)
    params = sum(prof.layers[i].param_bytes for i in r) + (g == 0) * prof.embed.param_bytes \
        + (g == G - 1) * prof.head.param_bytes
    res = sum(prof.residual_bytes[i] for i in r) + (g == G - 1) * prof.head_residual_bytes
    act_in = prof.layers[r.start - 1].activation_bytes if r.start else prof.embed.activation_bytes
    per_mb, transient = (act_in + res, 0.0) if policy == "none" else (act_in, res)
    return PARAM_COPIES * params + inflight[g] * per_mb + transient <= budget


@pytest.mark.parametrize("seed", range(4))
def test_split_and_remat_are_optimal_under_a_budget(seed):
    """v = 1: the slowest stage, each stage at its fastest fitting policy, over all splits."""
    rng = random.Random(100 + seed)
    for L, p in [(5, 2), (6, 3), (7, 4), (3, 4)]:
        prof = _random_profile(rng, L)
        inflight = get_schedule("1f1b", p, 8).peak_in_flight()
        budget = rng.uniform(30, 90) * MB
        best = None
        for spans in _splits(L, p):
            worst = 0.0
            for g in range(p):
                r = spans[g]
                recompute = sum(prof.layers[i].F for i in r) + (g == 0) * prof.embed.F
                options = [t for pol, t in (("none", 0.0), ("full", recompute))
                           if _fits(prof, spans, g, p, inflight, pol, budget)]
                worst = max(worst, _stage_time(prof, spans, g) + min(options, default=float("inf")))
            best = worst if best is None else min(best, worst)
        if best == float("inf"):
            with pytest.raises(ConfigError, match="too small"):
                partition(prof, p=p, m=8, memory_budget_bytes=budget, fit_spmd=False)
            continue
        plan = partition(prof, p=p, m=8, memory_budget_bytes=budget, fit_spmd=False)
        assert plan.slowest_stage_s == pytest.approx(best, rel=1e-9)
        assert max(plan.memory_bytes) <= budget
        # The SPMD runtime's buffers are as deep as their deepest stage: fitting them
        # may cost more remat, never less, and the figure it reports fits.
        try:
            spmd = partition(prof, p=p, m=8, memory_budget_bytes=budget)
        except ConfigError as err:
            assert "SPMD runtime" in str(err)
            continue
        assert spmd.spmd_memory_bytes <= budget
        assert spmd.slowest_stage_s >= plan.slowest_stage_s - 1e-12
        assert all(REMAT_POLICIES.index(a) >= REMAT_POLICIES.index(b)
                   for a, b in zip(spmd.remat, plan.remat, strict=True))


def test_embed_and_head_stages_get_fewer_layers():
    # A layer costs 3 (F+B+W); embed and head each cost 6: (1, 3, 3, 1) balances every stage at 9.
    heavy = LayerCost(3.0, 0.0, 3.0, activation_bytes=1e6, param_bytes=1e6)
    prof = uniform(8, embed=heavy, head=LayerCost(3.0, 1.5, 1.5, param_bytes=1e6))
    plan = partition(prof, p=4, m=8)
    assert plan.counts == (1, 3, 3, 1)
    assert plan.stage_time_s == pytest.approx((9.0,) * 4)
    assert plan.layers == (range(0, 1), range(1, 4), range(4, 7), range(7, 8))
    assert plan.even_split["counts"] == (2, 2, 2, 2) and plan.even_split["slowest_stage_s"] == 12.0
    assert plan.utilization["async"] > plan.even_split["utilization_async"]
    assert plan.utilization["lockstep"] > plan.even_split["utilization_lockstep"]
    layout = plan.layout()
    assert isinstance(layout, StageLayout) and (layout.counts, layout.p, layout.v) == ((1, 3, 3, 1), 4, 1)
    table = plan.table()
    for text in ("embed + 0", "1-3", "4-6", "7 + head", "remat", "memory MB", "predicted step",
                 "utilization", "StageLayout((1, 3, 3, 1), 4, 1)"):
        assert text in table, text


def test_empty_stages_only_with_fewer_layers_than_stages():
    heavy = LayerCost(50.0, 0.0, 50.0, activation_bytes=1e6)
    # Embed far heavier than every layer together: with L >= p·v each stage still gets one.
    assert min(partition(uniform(4, embed=heavy), p=4, m=4).counts) == 1
    plan = partition(uniform(3, embed=heavy), p=4, m=4)
    assert plan.counts[0] == 0 and sum(plan.counts) == 3
    assert "embed" in plan.table()


def test_interleaved_plan_uses_megatron_order():
    prof = uniform(8, embed=LayerCost(3.0, 0.0, 3.0, activation_bytes=1e6),
                   head=LayerCost(3.0, 1.5, 1.5))
    plan = partition(prof, p=2, v=2, m=4, schedule="interleaved")
    assert plan.counts == (1, 3, 3, 1) and plan.device == (0, 1, 0, 1)
    assert plan.layout().counts_array().tolist() == [[1, 3], [3, 1]]   # [device][chunk]
    assert len(plan.memory_bytes) == 2 and plan.in_flight == tuple(get_schedule("interleaved", 2, 4, 2)
                                                                   .peak_in_flight())


# --- remat under a memory budget --------------------------------------------------------------


def test_budget_forces_remat_on_stage_0_first_under_1f1b():
    prof = uniform(8)   # 1F1B p=4: 4, 3, 2, 1 microbatches in flight
    free = partition(prof, p=4, m=8)
    assert free.remat == ("none",) * 4
    assert free.in_flight == (4, 3, 2, 1)
    mem = free.memory_bytes
    assert mem[0] > mem[1] > mem[2] > mem[3]

    # Per-device buffers (fit_spmd=False): only the stage that does not fit recomputes.
    budget = (mem[0] + mem[1]) / 2
    plan = partition(prof, p=4, m=8, memory_budget_bytes=budget, fit_spmd=False)
    assert plan.counts == (2, 2, 2, 2)
    assert plan.remat == ("full", "none", "none", "none")
    assert max(plan.memory_bytes) <= budget
    assert plan.recompute_s == (2.0, 0.0, 0.0, 0.0)   # "full" re-runs the two layers' forwards
    assert plan.stage_time_s[0] == free.stage_time_s[0] + 2.0
    assert plan.step_time_s["lockstep"] > free.step_time_s["lockstep"]
    tighter = partition(prof, p=4, m=8, memory_budget_bytes=(mem[1] + mem[2]) / 2, fit_spmd=False)
    assert tighter.remat == ("full", "full", "none", "none")

    # The SPMD runtime: the "none" buffer is as deep as stage 1 needs on every device,
    # so the same budget moves more stages to "full"; what it reports fits.
    spmd = partition(prof, p=4, m=8, memory_budget_bytes=budget)
    assert spmd.spmd_memory_bytes <= budget
    assert spmd.remat[0] == "full" and spmd.remat.count("full") >= 1
    assert free.spmd_memory_bytes > budget
    table = spmd.table()
    assert "SPMD runtime:" in table
    assert "parallel.stage_remat='[" + ", ".join(f'"{r}"' for r in spmd.remat) + "]'" in table


def test_impossible_budget_names_the_stage_and_the_memory():
    with pytest.raises(ConfigError, match=r"memory budget 1\.0 MB per device is too small: stage \d .*"
                                          r"needs at least [\d.]+ MB"):
        partition(uniform(8), p=4, m=8, memory_budget_bytes=1 * MB)
    with pytest.raises(ConfigError, match="device 0"):
        partition(uniform(8), p=2, v=2, m=4, schedule="interleaved", memory_budget_bytes=1 * MB)


def test_dots_policy_between_none_and_full():
    prof = ProfiledModel(layers=[LayerCost(1.0, 1.0, 1.0, activation_bytes=1e6, param_bytes=1e6)] * 8,
                         residual_bytes=8e6, dots_residual_bytes=3e6, dots_recompute_s=0.25)
    mem = partition(prof, p=4, m=8).memory_bytes
    budget = (mem[0] + mem[1]) / 2
    plan = partition(prof, p=4, m=8, memory_budget_bytes=budget, remat_options=("none", "dots", "full"),
                     fit_spmd=False)
    assert plan.remat == ("dots", "none", "none", "none") and plan.recompute_s[0] == 0.5
    # SPMD: the cheap "dots" moves down the stages before anything pays for "full". (The
    # SPMD buffers are as deep as fused 1F1B keeps stage 0, 2p - 1, so the budget is one
    # that "dots" on every stage meets.)
    all_dots = partmem.spmd_memory(partmem.StageModel(prof, 4, False), get_schedule("1f1b", 4, 8),
                                   [range(2 * g, 2 * g + 2) for g in range(4)], ["dots"] * 4, PARAM_COPIES)[0]
    spmd = partition(prof, p=4, m=8, memory_budget_bytes=all_dots, remat_options=("none", "dots", "full"))
    assert spmd.spmd_memory_bytes <= all_dots and "full" not in spmd.remat and "dots" in spmd.remat
    with pytest.raises(ConfigError, match="dots"):
        partition(uniform(8), p=4, m=8, remat_options=("none", "dots"))


@pytest.mark.parametrize("kwargs, words", [
    (dict(p=0, m=4), "p must be"), (dict(p=2, m=4, memory_budget_bytes=-1), "memory_budget_bytes"),
    (dict(p=2, m=4, remat_options=("fast",)), "remat_options"), (dict(p=2, m=4, schedule="nope"), "unknown"),
])
def test_bad_arguments_raise_config_error(kwargs, words):
    with pytest.raises(ConfigError, match=words):
        partition(uniform(4), **kwargs)


# --- the plan's layout runs through the runtime ----------------------------------------------


def test_plan_layout_gives_unpipelined_gradients():
    # A heavy head pushes layers to stage 0: an uneven (3, 1) split on p=2.
    prof = uniform(4, head=LayerCost(1.0, 2.0, 2.0))
    free = partition(prof, p=2, m=4)
    # A budget between the two devices' needs: remat on stage 0 only, run as planned.
    plan = partition(prof, p=2, m=4, memory_budget_bytes=sum(free.memory_bytes) / 2, fit_spmd=False)
    # (Moving a layer off stage 0 beats recomputing three: the split changes too.)
    assert plan.counts != free.counts and "full" in plan.remat and "none" in plan.remat, plan
    p, m = plan.p, plan.m
    model, params = tiny_gpt(4)
    inputs, targets = microbatches(0, m)
    ref_loss, ref_grads = reference(model, params, inputs, targets)
    mesh = make_mesh(ParallelConfig(pipe=p, data=-1, tensor=1))
    run = pipeline_grads(stage_fns(model), get_schedule(plan.schedule, p, m), mesh,
                         remat=plan.remat, layout=plan.layout(), nan_bubbles=True)
    with jax.set_mesh(mesh):
        loss, grads = jax.jit(run)(params["embed"], params["blocks"], params["head"], inputs, targets)
    assert_matches(loss, grads, ref_loss, ref_grads)


def test_a_v_schedule_is_planned_on_its_own_placement_and_runs_as_planned():
    """ZB-V puts global stages s and 2p - 1 - s on device s: device 0 holds the embedding
    and the head, and its memory counts both of its stages. A heavy head moves layers
    off the last global stage, and the plan's uneven layout runs through the runtime to
    the unpipelined gradients."""
    embed = LayerCost(0.0, 0.0, 0.0, activation_bytes=1e6, param_bytes=3e6)
    prof = uniform(6, head=LayerCost(2.0, 2.0, 2.0, param_bytes=5e6), embed=embed)
    plan = partition(prof, p=2, v=2, m=4, schedule="zbv")
    assert plan.device == (0, 1, 1, 0) and plan.placement == ((0, 3), (1, 2))
    assert plan.counts[3] < max(plan.counts) and sum(plan.counts) == 6, plan.counts
    per_layer = 1e6
    assert plan.memory_params_bytes[0] == pytest.approx(
        PARAM_COPIES * ((plan.counts[0] + plan.counts[3]) * per_layer + 3e6 + 5e6))
    assert plan.memory_params_bytes[1] == pytest.approx(
        PARAM_COPIES * (plan.counts[1] + plan.counts[2]) * per_layer)
    assert "0.1" in plan.table()  # device 0's second chunk: global stage 3
    model, params = tiny_gpt(6)
    inputs, targets = microbatches(0, 4)
    ref_loss, ref_grads = reference(model, params, inputs, targets)
    mesh = make_mesh(ParallelConfig(pipe=2, data=-1, tensor=1))
    run = pipeline_grads(stage_fns(model), get_schedule("zbv", 2, 4), mesh, layout=plan.layout(),
                         nan_bubbles=True)
    with jax.set_mesh(mesh):
        loss, grads = jax.jit(run)(params["embed"], params["blocks"], params["head"], inputs, targets)
    assert_matches(loss, grads, ref_loss, ref_grads)


# --- residual slot moves: paid by every device in every tick ---------------------------------


def test_slot_moves_are_paid_every_tick_and_can_make_remat_the_faster_plan():
    """The SPMD runtime reads and writes SLOT_MOVES slots of every residual buffer on every
    device in every tick (runtime/ticks.py): the plan prices that per tick in its "as run"
    replay, and keeps "full" where recompute costs less than the slots "none" moves."""
    from mindpipe_jax.parallel.pipeline.plan.memory import SLOT_MOVES
    from mindpipe_jax.sim import simulate

    base = uniform(8, residual=8e6)            # 2 layers per stage: a 16 MB residual row
    free = partition(base, p=4, m=8, remat_options=("none", "full"))
    assert free.remat == ("none",) * 4 and free.tick_slot_s == 0

    per_tick = 1e-2                            # seconds of slot moves per tick under "none"
    cheap = dataclasses.replace(base, slot_move_s_per_byte=per_tick / (SLOT_MOVES * 16e6))
    plan = partition(cheap, p=4, m=8, remat_options=("none", "full"))
    assert plan.remat == ("none",) * 4
    assert plan.tick_slot_s == pytest.approx(per_tick)
    replay = simulate(get_schedule("1f1b", 4, 8), plan.costs, mode="neighbour", fuse=plan.fuse_ticks,
                      tick_overhead=per_tick)
    assert plan.step_time_s["as run"] == pytest.approx(replay.step_time)
    assert plan.step_time_s["as run"] > free.step_time_s["as run"] + 10 * per_tick  # >= 10 ticks
    assert "of residual slot moves on every device" in plan.table()

    # At 5 s per tick the stages that keep residuals recompute instead (+2 s of forward
    # per microbatch); the last stage keeps none under "none" (its forward runs inside
    # its backward) and stays.
    costly = dataclasses.replace(base, slot_move_s_per_byte=5.0 / (SLOT_MOVES * 16e6))
    plan = partition(costly, p=4, m=8, remat_options=("none", "full"))
    assert plan.remat == ("full", "full", "full", "none") and plan.tick_slot_s == 0
    forced = partition(costly, p=4, m=8, remat_options=("none",))
    assert forced.tick_slot_s == pytest.approx(5.0)
    assert plan.step_time_s["as run"] < forced.step_time_s["as run"]
    # the per-stage times, which no tick cost enters, say "none" is the faster policy
    assert max(forced.stage_time_s) < max(plan.stage_time_s)
    # The even split without remat is set beside the plan on the plan's footing, its step as
    # run with the slot moves paid (its slowest stage alone made it look the faster one).
    assert forced.counts == plan.even_split["counts"] == free.counts == (2, 2, 2, 2)
    assert plan.even_split["step_time_run_s"] == pytest.approx(forced.step_time_s["as run"])
    assert free.even_split["step_time_run_s"] == pytest.approx(free.step_time_s["as run"])
    ms = 1e3
    assert (f"step as run {ms * forced.step_time_s['as run']:.3f} ms (the plan's "
            f"{ms * plan.step_time_s['as run']:.3f} ms)") in plan.table()


# --- mindpipe plan (the one real measurement) -------------------------------------------------

TINY = ["model.d_model=32", "model.n_layers=4", "model.n_heads=2", "model.seq_len=16", "model.vocab_size=64",
        "train.global_batch=8", "parallel.pipe=2", "parallel.microbatches=4"]


def test_plan_command_measures_prints_and_draws(tmp_path, capsys, monkeypatch):
    measured = []
    real = partition_mod.measure_layer_costs

    def spy(*args, **kwargs):
        # Under a caller's mesh (as train's repartition calls it) it still measures whole,
        # unsharded copies.
        with jax.set_mesh(make_mesh(ParallelConfig(pipe=2, data=2, tensor=2))):
            measured.append(real(*args, **kwargs))
        return measured[-1]

    timed_on = []
    real_time = profile_mod._median_time

    def time_spy(fn, *args, repeats):
        timed_on.append([leaf.sharding for leaf in jax.tree.leaves(args)])
        return real_time(fn, *args, repeats=repeats)

    monkeypatch.setattr(partition_mod, "measure_layer_costs", spy)
    monkeypatch.setattr(profile_mod, "_median_time", time_spy)
    out = tmp_path / "plan.png"
    assert main(["plan", *TINY, "--repeats", "1", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    for words in ("vPipe plan: 1f1b  p=2 v=1 m=4, 4 layers", "stage", "layers", "time ms", "memory MB",
                  "remat", "predicted step", "utilization", f"wrote {out}",
                  "in lockstep, as this layout runs (tensor > 1"):  # TINY trains on tensor 2 here
        assert words in text, words
    assert out.read_bytes()[:8] == PNG_MAGIC

    prof, = measured
    # On the 8 devices this config trains on (pipe 2 x tensor 2 x data 2), a batch device
    # runs 8 / (4 microbatches x 2 data) = 1 sequence per microbatch.
    assert prof.microbatch == 1 and prof.num_layers == 4 and len(set(prof.layers)) == 1
    layer = prof.layers[0]
    assert min(layer.F, layer.B, layer.W, layer.BW) > 0
    assert layer.activation_bytes == 1 * 16 * 32 * 4
    assert prof.residual_bytes[0] > layer.activation_bytes   # a block keeps more than its input
    assert prof.embed.B == 0 and prof.embed.W > 0 and prof.head.BW > 0
    tokens, d = 1 * 16, 32
    matmuls = 2 * tokens * (4 * d * d + 2 * d * 4 * d)   # qkv, out, mlp in/out: unsharded, one device
    assert matmuls < prof.flops["layer_F"] < 1.5 * matmuls
    assert prof.flops["layer_BW"] > 1.5 * prof.flops["layer_F"]
    assert 3 * 32 * 32 * 4 < layer.param_bytes < 20 * 32 * 32 * 4
    # a memory rate between 1 MB/s and 10 TB/s: measured, not left at "free", and in
    # seconds per byte (seconds per call would be ~1e-3). Eight simulated devices
    # share 2 cores here, and under the parallel suite the rate has been seen at 0.08 GB/s.
    assert 1e-13 < prof.slot_move_s_per_byte < 1e-6
    # Every program (F, B, W, BW of each part, the slot stream) is timed as the pipeline
    # runs: every local device busy with its own whole copy, so the layer times and the
    # slot-move rate they are added to share one footing. Before 2026-12-06 the layer
    # programs ran on one device alone (on 8 simulated devices over 2 cores ~4x faster
    # than in the step, and the slot moves priced ~2-3x too high beside them).
    everywhere = set(jax.local_devices())
    assert len(timed_on) >= 9
    for shardings in timed_on:
        assert all(sh.device_set == everywhere and sh.is_fully_replicated for sh in shardings)


def _reachable(hlo: str, root: str) -> set[str]:
    """Names of the computations ``root`` calls, directly or not, in compiled HLO text."""
    comps = {}
    for block in re.split(r"\n(?=%|ENTRY )", hlo):
        head = re.match(r"(?:ENTRY )?%([\w.\-]+) ", block)
        if head:
            comps[head.group(1)] = block
    seen, todo = set(), [root]
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        todo += [ref for ref in re.findall(r"%([\w.\-]+)", comps[name]) if ref in comps]
    return {name: comps[name] for name in seen}


def test_the_profile_times_each_run_inside_its_loop():
    """The profile times INNER_RUNS runs of a program in one loop (a task in the tick loop
    pays no launch of its own). Each run must do the work: XLA hoists a loop-invariant
    computation out of a loop (it did, with an optimization barrier tying the inputs to
    the loop state, and the runs then timed ~1/8 of a forward), so the matmul has to sit
    in the loop's body and nowhere outside it."""
    w, x = jnp.full((64, 64), 0.01), jnp.ones((16, 64))
    program, args = profile_mod.runs_on_every_device(lambda w, x: jnp.tanh(x @ w), w, x)
    assert all(a.sharding.device_set == set(jax.local_devices()) for a in args)
    hlo = program.as_text()
    entry = re.search(r"ENTRY %([\w.\-]+) ", hlo).group(1)
    body = re.search(r"while\(.*body=%([\w.\-]+)", hlo).group(1)
    in_loop = _reachable(hlo, body)
    outside = {k: v for k, v in _reachable(hlo, entry).items() if k not in in_loop}
    assert any(" dot(" in text for text in in_loop.values())
    assert not any(" dot(" in text for text in outside.values())
    np.testing.assert_allclose(np.asarray(program(*args)), np.full((16, 64), np.tanh(0.64)), rtol=1e-5)


@pytest.mark.parametrize("argv, words", [
    (["plan"], "parallel.pipe > 1"),
    (["plan", "parallel.pipe=2", "--budget-mb", "-5"], "--budget-mb"),
    (["plan", "parallel.pipe=2", "--budget-mb", "lots"], "--budget-mb"),
    (["plan", "parallel.pipe=2", "--remat", "fast"], "--remat"),
    (["plan", "parallel.pipe=2", "parallel.microbatches=3"], "divisible"),
    (["plan", "parallel.pipe=2", "parallel.schedule=interleaved", "parallel.virtual_stages=2",
      "parallel.microbatches=3"], "divisible"),
    (["plan", "parallel.pipe=2", "--out", "plan.jpg"], "must end in one of"),
    (["plan", "parallel.pipe=2", "--repeats", "0"], "--repeats"),
    (["plan", "parallel.pipe=2", "model.nope=1"], "unknown config key"),
    # It plans a `mindpipe train` run: the supernet section sized nothing, silently.
    (["plan", "parallel.pipe=2", "supernet.subnets_per_step=8"],
     "supernet.subnets_per_step=8 has no effect on `mindpipe plan`"),
    # What the plan chooses: a given split or remat was silently replaced by the plan's.
    (["plan", "parallel.pipe=2", "model.n_layers=4", "parallel.stage_layers=[1, 3]"],
     "parallel.stage_layers=[1, 3] is what mindpipe plan chooses"),
    (["plan", "parallel.pipe=2", "parallel.stage_remat=full"],
     "parallel.stage_remat='full' is what mindpipe plan"),
])
def test_plan_command_bad_input_exits_2(argv, words, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)

    def refuse(*args, **kwargs):
        raise AssertionError("measured despite bad input")

    monkeypatch.setattr(partition_mod, "measure_layer_costs", refuse)
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip()
    assert err.startswith("mindpipe: error:") and "\n" not in err and words in err, err
    assert list(tmp_path.iterdir()) == []


def test_measured_memory_decides_the_fit():
    # A measurement that finds 60% more than the model: the plan keeps moving stages to
    # leaner policies until the measurement fits, and reports the measured figure.
    prof = ProfiledModel(layers=[LayerCost(1.0, 1.0, 1.0, activation_bytes=1e6, param_bytes=1e6)] * 8,
                         residual_bytes=8e6, dots_residual_bytes=3e6, dots_recompute_s=0.25)
    opts = ("none", "dots", "full")
    modelled = partition(prof, p=4, m=8, remat_options=opts)
    budget = 0.5 * modelled.spmd_memory_bytes
    calls = []

    def measure(remat, counts, fuse_mode="auto"):
        calls.append((remat, counts))
        return 1.6 * partmem.spmd_memory(
            partmem.StageModel(prof, 4, False), get_schedule("1f1b", 4, 8),
            [range(sum(counts[:g]), sum(counts[:g + 1])) for g in range(4)], list(remat), PARAM_COPIES,
            fuse_mode)[0]

    by_model = partition(prof, p=4, m=8, remat_options=opts, memory_budget_bytes=budget)
    measured = partition(prof, p=4, m=8, remat_options=opts, memory_budget_bytes=budget,
                         measure_memory=measure)
    # the model's plan does not fit
    assert measure(by_model.remat, by_model.counts, by_model.fuse_ticks) > budget
    assert calls and measured.spmd_memory_bytes <= budget
    assert measured.spmd_memory_bytes == pytest.approx(measure(measured.remat, measured.counts,
                                                               measured.fuse_ticks))
    leaner = sum(map(REMAT_POLICIES.index, measured.remat))
    assert leaner > sum(map(REMAT_POLICIES.index, by_model.remat))


def test_a_tight_budget_trades_fused_ticks_for_lighter_remat():
    # Fused 1F1B keeps up to 2p - 1 microbatches on stage 0, one task per tick p. Under a
    # budget where fused ticks need "full" on three stages but the table fits "dots"
    # everywhere, the plan runs the table with "dots" (less recompute, faster replay) and
    # says so in its config line.
    prof = ProfiledModel(layers=[LayerCost(1.0, 1.0, 1.0, activation_bytes=1e6, param_bytes=1e6)] * 8,
                         residual_bytes=8e6, dots_residual_bytes=3e6, dots_recompute_s=0.25)
    opts = ("none", "dots", "full")
    fused_only = partition(prof, p=4, m=8, remat_options=opts, memory_budget_bytes=60e6, fuse_modes=("auto",))
    plan = partition(prof, p=4, m=8, remat_options=opts, memory_budget_bytes=60e6)
    assert "full" in fused_only.remat and fused_only.fuse_ticks == "auto"
    assert plan.fuse_ticks == "table" and "full" not in plan.remat
    assert plan.spmd_memory_bytes <= 60e6 and sum(plan.recompute_s) < sum(fused_only.recompute_s)
    assert "parallel.fuse_ticks=table" in plan.table()
    with pytest.raises(ConfigError, match="fuse_modes \\['eager'\\] must be"):
        partition(prof, p=4, m=8, fuse_modes=("eager",))


def test_lockstep_buffers_are_those_of_the_merged_plan():
    """In lockstep (tensor > 1) the runtime merges the last stage's tasks into
    the middle stages' branches (``make_plan(merge_first, merge_last)``): its forward
    keeps what a middle stage keeps, its split backward stashes what a middle stage's
    does, and the loss's gradient waits in a g slot. The SPMD figure follows that plan:
    under zb-h1 with remat "full" the last stage's "dots" stash (the unmerged last
    stage's kind) is gone; under GPipe the loss's gradients add g slots."""
    from mindpipe_jax.parallel.pipeline.runtime.tickplan import make_plan

    prof = ProfiledModel(layers=[LayerCost(1.0, 1.0, 1.0, activation_bytes=1e6, param_bytes=1e6)] * 8,
                         residual_bytes=8e6, dots_residual_bytes=3e6, dots_recompute_s=0.25)
    spans = [range(2 * g, 2 * g + 2) for g in range(4)]

    def figure(name, policy, lockstep):
        model = partmem.StageModel(prof, 4, name == "zb-h1")
        return partmem.spmd_memory(model, get_schedule(name, 4, 8), spans, [policy] * 4, PARAM_COPIES,
                                   lockstep=lockstep)

    (apart, apart_parts), (merged, merged_parts) = (figure("zb-h1", "full", lock) for lock in (False, True))
    plans = [make_plan(get_schedule("zb-h1", 4, 8), ("full",) * 4, merge_first=lock, merge_last=lock)
             for lock in (False, True)]
    assert set(apart_parts) == set(plans[0].stash_slots) == {"stash-full", "stash-dots"}
    assert set(merged_parts) == set(plans[1].stash_slots) == {"stash-full"}
    assert merged < apart
    (g_apart, _), (g_merged, _) = (figure("gpipe", "full", lock) for lock in (False, True))
    g_slots = [make_plan(get_schedule("gpipe", 4, 8), ("full",) * 4, merge_first=lock,
                         merge_last=lock).g_slots for lock in (False, True)]
    assert g_slots[1] > g_slots[0]
    assert g_merged - g_apart == pytest.approx((g_slots[1] - g_slots[0]) * prof.layers[0].activation_bytes)
    # The plan's budget fit reads the lockstep figure: a budget the merged zb-h1 plan meets
    # with "full" everywhere, which the per-device figure would call too small.
    budget = (merged + apart) / 2
    opts = ("none", "dots", "full")
    with pytest.raises(ConfigError, match="too small"):
        partition(prof, p=4, m=8, schedule="zb-h1", remat_options=opts, memory_budget_bytes=budget,
                  fuse_modes=("auto",))
    fitted = partition(prof, p=4, m=8, schedule="zb-h1", remat_options=opts, memory_budget_bytes=budget,
                       fuse_modes=("auto",), lockstep=True)
    assert fitted.spmd_memory_bytes <= budget


def test_a_lockstep_plan_prices_every_branch_of_a_tick():
    """In lockstep every device runs every branch some device takes in a fused tick
    (``plan/lockstep.py``, which the tuner's cost model uses too): the plan reports that
    step beside the per-device replay. Fused 1F1B loses little to it (a steady tick is
    F + BW on every device either way: 82.5 against 81 here); ZB-H1, whose ticks mix F,
    B and W parts across stages, more than doubles (155 against 67.5). A layout not in
    lockstep reports none."""
    from mindpipe_jax.parallel.pipeline.plan.lockstep import lockstep_ticks_seconds
    from mindpipe_jax.parallel.pipeline.runtime.tickplan import make_plan

    prof = ProfiledModel(layers=[LayerCost(1.0, 1.0, 1.0, activation_bytes=1e6, param_bytes=1e6)] * 8,
                         embed=LayerCost(0.5, 0.0, 0.5), head=LayerCost(0.5, 0.5, 0.5), residual_bytes=8e6)
    for name, ratio in (("1f1b", 1.0), ("zb-h1", 2.0)):
        plan = partition(prof, p=4, m=8, schedule=name, fuse_modes=("auto",), lockstep=True)
        ticks = make_plan(get_schedule(name, 4, 8), plan.remat, plan.fuse_ticks, merge_first=True,
                          merge_last=True)
        assert plan.step_time_s["lockstep run"] == pytest.approx(
            lockstep_ticks_seconds(ticks, plan.costs) + ticks.num_ticks * plan.tick_slot_s)
        assert plan.step_time_s["lockstep run"] > ratio * plan.step_time_s["as run"], name
        assert 0 < plan.utilization["lockstep run"] < plan.utilization["as run"]
        assert "in lockstep, as this layout runs" in plan.table()
    apart = partition(prof, p=4, m=8, schedule="1f1b", fuse_modes=("auto",))
    assert "lockstep run" not in apart.step_time_s and "in lockstep" not in apart.table()


# --- which backwards to split (parallel.split_last) ---------------------------------------------


def _as_run(plan, k):
    """The step of ``plan``'s stages under zb-h1 with ``split_last=k``, replayed as the runtime runs it."""
    from mindpipe_jax.sim import simulate

    sched = get_schedule("zb-h1", plan.p, plan.m, 1, k)
    return simulate(sched, plan.costs, mode="neighbour", fuse=plan.fuse_ticks).step_time


@pytest.mark.parametrize("fused, expect_all", [(2.0, True), (1.4, False)])
def test_split_last_is_the_fastest_as_run(fused, expect_all):
    # B = W = 1: a free split (fused backward 2) lets every W wait for a bubble, so splitting every
    # backward wins; a fused backward of 1.4 makes each split cost 0.6 more, so few splits win.
    layer = LayerCost(1.0, 1.0, 1.0, BW=fused, activation_bytes=1e6, param_bytes=1e6)
    prof = ProfiledModel(layers=[layer] * 8, embed=LayerCost(0.0, 0.0, 0.0, activation_bytes=1e6),
                         head=LayerCost(0.0, 0.0, 0.0), residual_bytes=8e6)
    plan = partition_mod.choose_split_last(prof, p=4, m=16, schedule="zb-h1")
    tried = plan.split_last_tried
    assert list(tried) == partition_mod.split_last_candidates(4, 16) == [0, 1, 2, 4, 8, -1]
    assert plan.split_last == min(tried, key=tried.get)
    assert (plan.split_last == -1) is expect_all
    assert plan.step_time_s["as run"] == min(tried.values()) < max(tried.values())
    for k, seconds in tried.items():  # each figure is that table's own plan, replayed
        alone = partition(prof, p=4, m=16, schedule=get_schedule("zb-h1", 4, 16, 1, k))
        assert seconds == alone.step_time_s["as run"], k
    assert plan.step_time_s["as run"] == pytest.approx(_as_run(plan, plan.split_last), rel=1e-12)
    text = plan.table()
    assert "split_last" in text and (("parallel.split_last=" in text) is not expect_all)


def test_split_last_choice_leaves_unsplit_schedules_alone_and_plans_v_placements():
    prof = uniform(8)
    plan = partition_mod.choose_split_last(prof, p=4, m=8, schedule="1f1b")
    assert plan.split_last_tried == {} and plan.split_last == -1 and plan.schedule == "1f1b"
    zbv = partition_mod.choose_split_last(prof, p=4, m=8, schedule="zbv")  # a V placement too
    assert zbv.placement is not None and zbv.split_last in zbv.split_last_tried
    with pytest.raises(ConfigError, match="split_last=-3"):
        partition_mod.choose_split_last(prof, p=4, m=8, schedule="zb-h1", candidates=[2, -3])


def test_plan_command_picks_split_last(capsys, monkeypatch):
    layer = LayerCost(1e-3, 1e-3, 1e-3, BW=1.4e-3, activation_bytes=1e6, param_bytes=1e6)
    prof = ProfiledModel(layers=[layer] * 4, embed=LayerCost(0.0, 0.0, 0.0, activation_bytes=1e6),
                         head=LayerCost(0.0, 0.0, 0.0), residual_bytes=8e6)
    monkeypatch.setattr(partition_mod, "measure_layer_costs", lambda *a, **k: prof)
    argv = ["plan", *TINY, "parallel.schedule=zb-h1", "parallel.microbatches=8", "train.global_batch=16",
            "--remat", "none,full"]
    assert main([*argv, "--split-last", "auto"]) == 0
    text = capsys.readouterr().out
    line, = (x for x in text.splitlines() if x.startswith("split_last"))
    assert "-> 0" in line or "-> 1" in line, line
    assert "parallel.split_last=" in text
    assert main([*argv, "--split-last", "2"]) == 0
    text = capsys.readouterr().out
    assert "parallel.split_last=2" in text and not any(x.startswith("split_last") for x in text.splitlines())


@pytest.mark.parametrize("argv, words", [
    (["--split-last", "some"], "--split-last"),
    (["--split-last", "-2"], "--split-last"),
    # 1F1B (the default) has no B/W split to keep: the plan printed parallel.split_last=2,
    # which `mindpipe train` refuses.
    (["--split-last", "2"], "split_last=2: schedule '1f1b' does not split its backwards"),
    (["--split-last", "auto"], "parallel.schedule='1f1b' splits none"),
])
def test_plan_command_bad_split_last_exits_2(argv, words, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)

    def refuse(*args, **kwargs):
        raise AssertionError("measured despite bad input")

    monkeypatch.setattr(partition_mod, "measure_layer_costs", refuse)
    assert main(["plan", "parallel.pipe=2", "parallel.microbatches=4", *argv]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert captured.out == "" and "\n" not in err and words in err, err
    assert list(tmp_path.iterdir()) == []


def test_the_configured_moe_model_is_measured_not_the_dense_gpt():
    """``mindpipe plan`` with model.n_experts > 0 measured the dense GPT's block (its costs
    and parameter bytes) until 2026-12-05: the MoE block, its experts and router, is what
    the pipeline runs."""
    import numpy as np
    from flax import nnx

    from mindpipe_jax.config import ModelConfig
    from mindpipe_jax.models.moe import MoEGPT

    cfg = ModelConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2, n_experts=4, top_k=2)
    prof = partition_mod.measure_layer_costs(cfg, microbatch=2, repeats=1, dots=False,
                                            model=lambda rngs: MoEGPT(cfg, rngs=rngs))
    assert "MoEGPT" in prof.note and "4 experts" in prof.note, prof.note
    blocks = nnx.to_pure_dict(nnx.state(MoEGPT(cfg, rngs=nnx.Rngs(0)).blocks, nnx.Param))
    per_block = sum(np.asarray(x).nbytes for x in jax.tree.leaves(blocks)) / cfg.n_layers
    assert prof.layers[0].param_bytes == per_block


@pytest.mark.parametrize("seed,p", [(7, 2), (7, 4), (18, 4)])
def test_a_lockstep_layout_chooses_its_tick_mode_and_remat_on_the_lockstep_run(seed, p):
    """tensor > 1 runs every branch of a fused tick on every device (plan/lockstep.py): the
    tick mode and remat are chosen on that run's time, not on the per-device replay's.
    Before: on these profiles ZB-H1 took "table" (fastest replayed per device), whose
    lockstep run is 1.8-2x that of the best mode."""
    rng = np.random.default_rng(seed)
    prof = dataclasses.replace(_random_profile(rng, 8), slot_move_s_per_byte=rng.choice([0.0, 1e-8, 1e-7]))
    modes = ("fill", "slack", "table", "in-order")
    common = dict(p=p, m=8, schedule="zb-h1", lockstep=True, remat_options=("none", "full"))
    alone = {mode: partition(prof, fuse_modes=(mode,), **common).step_time_s["lockstep run"]
             for mode in modes}
    plan = partition(prof, fuse_modes=modes, **common)
    assert plan.step_time_s["lockstep run"] <= min(alone.values()) * (1 + 1e-9), (plan.fuse_ticks, alone)
