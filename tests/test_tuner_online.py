"""EPara's online tuner: decisions from measurements, and switching a run in place.

The switching tests compare against independent paths: a mesh switch against the
bytes before it, the step after a switch against a run restored onto the new mesh
from a checkpoint, and a resumed tuned run against the uninterrupted one.
"""

import dataclasses
import json
import math
import re
import shutil

import jax
import numpy as np
import optax
import pytest
from cli_procs import cli_env, run_train

import mindpipe_jax as mp
from mindpipe_jax.data import TokenSplits
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.train.reconfigure import build_layout, make_feed, scale_updates, switch
from mindpipe_jax.train.state import init_train_state
from mindpipe_jax.tuner.elastic import fit_layout, replan
from mindpipe_jax.tuner.epara import MeasuredThroughput, OnlineTuner, candidate_of
from mindpipe_jax.tuner.noise import NoiseScale, efficiency, lr_gain
from mindpipe_jax.tuner.space import Candidate

TINY = ("model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.seq_len=32",
        "train.global_batch=16", "train.progress=false", "train.tensorboard=false",
        "train.eval_every=0", "optim.warmup_steps=2", "parallel.simulate_cpu_devices=0")


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


class PreferStub:
    """A step model that finds ``fast`` candidates twice as fast as the others, so the
    tuner's choice does not depend on this machine's timing."""

    def __init__(self, fast):
        self.fast = fast
        self.observed = []

    def step_time(self, c):
        return 0.5 if self.fast(c) else 1.0

    def observe(self, c, seconds):
        self.observed.append((c, seconds))


# --- decisions (no training) ---------------------------------------------------------

def _feed(tuner, b_noise, steps, b_small, b_big, g_sq=1.0):
    """Metrics whose noise terms are exactly E|G_b|^2 and E|G_B|^2 for a known B_noise."""
    trace = b_noise * g_sq
    m = {"loss": 1.0, "micro_batch": b_small, "batch": b_big, "micro_grad_sq": g_sq + trace / b_small,
         "grad_norm": math.sqrt(g_sq + trace / b_big)}
    tuner.observe([m] * steps, None, 0)


def test_decision_maximizes_entropyput_and_respects_threshold():
    cfg = mp.Config().replace(*TINY, "train.grad_accum=2", "parallel.data=8", "parallel.tensor=1",
                              "tuner.enabled=true", "tuner.every=10", "tuner.warmup=10",
                              "tuner.batch_sizes=[16, 32, 64, 128]")
    cur = Candidate(data=8, global_batch=16)
    model = MeasuredThroughput()
    tuner = OnlineTuner(cfg, cur, 8, step_model=model)
    assert [c.global_batch for c in tuner.candidates] == [16, 32, 64, 128]
    # Measured: a large fixed overhead, so bigger batches run at nearly the same step time.
    for c in tuner.candidates:
        model.observe(c, 1.0 + 0.01 * c.global_batch)
    _feed(tuner, b_noise=100.0, steps=20, b_small=8, b_big=16)
    assert tuner.b_noise == pytest.approx(100.0)
    assert tuner.decide(9) is None  # not a decision step
    d = tuner.decide(10)
    expect = max(tuner.candidates, key=lambda c: c.global_batch / (1 + 0.01 * c.global_batch)
                 * efficiency(c.global_batch, 100.0, 16))
    assert d is not None and d.after == expect and d.after.global_batch == 128
    e = lambda c: c.global_batch / (1 + 0.01 * c.global_batch) * efficiency(c.global_batch, 100.0, 16)  # noqa: E731
    assert d.gain == pytest.approx(e(d.after) / e(cur) - 1)
    # The default rule (AdamW): the square root of AdaScale's gain (B/b0) x efficiency(B).
    assert d.lr_gain == pytest.approx(math.sqrt(128 / 16 * efficiency(128, 100.0, 16)))
    assert d.lr_gain == pytest.approx(lr_gain("sqrt_adascale", 128, 16, 100.0))
    sgd_rule = OnlineTuner(cfg.replace('tuner.lr_scaling="adascale"'), cur, 8, step_model=model)
    _feed(sgd_rule, b_noise=100.0, steps=20, b_small=8, b_big=16)
    assert sgd_rule.decide(10).lr_gain == pytest.approx(128 / 16 * efficiency(128, 100.0, 16))
    assert d.line().startswith("step 10 | tuner: B 16 -> 128, predicted entropyput +")
    # A threshold above the gain keeps the run as it is.
    high = OnlineTuner(cfg.replace(f"tuner.threshold={d.gain + 0.01}"), cur, 8, step_model=model)
    _feed(high, b_noise=100.0, steps=20, b_small=8, b_big=16)
    assert high.decide(10) is None
    # Little noise: a bigger batch wastes samples and the run stays at 16.
    quiet = OnlineTuner(cfg, cur, 8, step_model=model)
    _feed(quiet, b_noise=2.0, steps=20, b_small=8, b_big=16)
    assert quiet.decide(10) is None


def test_a_switch_must_pay_back_its_compile_before_the_run_ends():
    cfg = mp.Config().replace(*TINY, "train.grad_accum=2", "parallel.data=8", "parallel.tensor=1",
                              "tuner.enabled=true", "tuner.every=10", "tuner.warmup=10", "train.steps=300",
                              "tuner.batch_sizes=[16, 32, 64, 128]")
    cur = Candidate(data=8, global_batch=16)

    def tuner_with(compile_s):
        model = MeasuredThroughput()
        for c in [dataclasses.replace(cur, global_batch=b) for b in (16, 32, 64, 128)]:
            model.observe(c, 1.0 + 0.01 * c.global_batch)
        tuner = OnlineTuner(cfg, cur, 8, step_model=model)
        tuner.restart(0, compile_s)
        _feed(tuner, b_noise=100.0, steps=20, b_small=8, b_big=16)
        return tuner

    d = tuner_with(0.0).decide(10)
    assert d is not None and d.gain > 0.5
    # 290 steps left at 1.16 s: the switch saves remaining x gain / (1 + gain) seconds.
    saves = 290 * 1.16 * d.gain / (1 + d.gain)
    assert f"saves ~{saves:.1f} s of the remaining {290 * 1.16:.1f} s" in d.reason
    paid = tuner_with(0.99 * saves).decide(10)
    assert paid is not None and paid.after == d.after and paid.gain == d.gain
    assert tuner_with(1.01 * saves).decide(10) is None  # a compile that long never pays back
    # A compile that pays back with 290 steps left does not with 10 left.
    assert tuner_with(0.5 * saves).decide(10) is not None
    assert tuner_with(0.5 * saves).decide(290) is None


def test_a_candidate_that_does_not_pay_back_yet_is_compiled_ahead_then_costs_nothing():
    cfg = mp.Config().replace(*TINY, "train.grad_accum=2", "parallel.data=8", "parallel.tensor=1",
                              "tuner.enabled=true", "tuner.every=10", "tuner.warmup=10", "train.steps=300",
                              "tuner.batch_sizes=[16, 32, 64, 128]")
    cur = Candidate(data=8, global_batch=16)
    model = MeasuredThroughput()
    for b in (16, 32, 64, 128):
        model.observe(dataclasses.replace(cur, global_batch=b), 1.0 + 0.01 * b)
    tuner = OnlineTuner(cfg, cur, 8, step_model=model)
    tuner.restart(0, 1e6)  # a compile no switch can pay back
    _feed(tuner, b_noise=100.0, steps=20, b_small=8, b_big=16)
    assert tuner.decide(10) is None
    ahead = tuner.to_prepare()  # the best gain, compiled ahead by the loop
    assert ahead is not None and ahead.global_batch > 16 and tuner.to_prepare() is None  # handed out once
    tuner.prepared(ahead)
    assert tuner.switch_cost(ahead) == 0.0
    d = tuner.decide(20)
    assert d is not None and d.after == ahead and "against ~0.0 s to switch" in d.reason
    assert tuner.to_prepare() is None  # a switch names nothing to compile ahead
    off = OnlineTuner(cfg.replace("tuner.prepare=false"), cur, 8, step_model=model)
    off.restart(0, 1e6)
    _feed(off, b_noise=100.0, steps=20, b_small=8, b_big=16)
    assert off.decide(10) is None and off.to_prepare() is None


def test_a_wrong_prediction_is_checked_soon_and_the_way_back_compiles_nothing():
    cfg = mp.Config().replace(*TINY, "train.grad_accum=2", "parallel.data=8", "parallel.tensor=1",
                              "tuner.enabled=true", "tuner.every=100", "tuner.warmup=100", "tuner.probe=20",
                              "train.steps=1000", "tuner.batch_sizes=[16, 32, 64]")
    b16, b32, b64 = (Candidate(data=8, global_batch=b) for b in (16, 32, 64))
    # The model thinks every batch costs the same step time: B32 and B64 look cheap.
    tuner = OnlineTuner(cfg, b16, 8, step_model=PreferStub(lambda c: True))
    tuner.restart(0, 30.0)  # the first compile took 30 s: the price of a new candidate
    _feed(tuner, b_noise=16.0, steps=20, b_small=8, b_big=16)
    tuner.observe([], 1.0, 100)  # B16 measured at 1.0 s a step
    assert tuner.switch_cost(b16) == 0.0 and tuner.switch_cost(b32) == 30.0
    d = tuner.decide(100)
    assert d is not None and d.after == b64 and "against ~30.0 s to switch" in d.reason
    tuner.accept(d, cfg.replace("train.global_batch=64"), 30.0)
    # 20 steps after the first one (whose time is discarded) the tuner decides again, off the
    # regular period; only once.
    assert [s for s in range(101, 200) if tuner.due(s)] == [121]
    tuner.observe([], 9.0, 101)  # the discarded first step (the compile's)
    tuner.observe([], 6.0, 121)  # measured: 6x B16's time, not the predicted 1x
    back = tuner.decide(121)
    # B16 (measured) is best again, and going back to it costs no compile.
    assert back is not None and back.after == b16 and "against ~0.0 s to switch" in back.reason
    tuner.accept(back, cfg, 0.0)  # the loop reports the kept program: nothing compiled
    assert tuner.switch_cost_s == 30.0  # a kept program's 0 s is not the price of a new one
    assert [s for s in range(122, 300) if tuner.due(s)] == [200]  # B16 had run: no probe


def test_decisions_trust_measurements_and_anchor_the_model_to_them():
    cfg = mp.Config().replace(*TINY, "train.grad_accum=2", "parallel.data=8", "parallel.tensor=1",
                              "tuner.enabled=true", "tuner.batch_sizes=[16, 32]")
    b16, b32 = Candidate(data=8, global_batch=16), Candidate(data=8, global_batch=32)
    # A model that is 2x optimistic about everything and thinks B32 is as fast as B16.
    model = PreferStub(lambda c: True)
    tuner = OnlineTuner(cfg, b16, 8, step_model=model)
    assert tuner.step_time(b32) == 0.5  # nothing measured: the model as it is
    tuner.observe([], 1.0, 5)  # B16 measured at 1.0 s (the model said 0.5)
    assert tuner.step_time(b16) == 1.0 and tuner.step_time(b32) == pytest.approx(1.0)  # 0.5 x 1.0 / 0.5
    # Once B32 has run, its measurement counts, whatever the model says.
    tuner.current = b32
    tuner.observe([], 3.0, 6)
    assert tuner.step_time(b32) == 3.0 and tuner.step_time(b16) == 1.0


def test_without_noise_estimate_only_the_current_batch_is_compared():
    # A pipeline whose chunk-wise gradient sync keeps no two halves of the step apart.
    cfg = mp.Config().replace(*TINY, "parallel.pipe=2", "parallel.data=4", "parallel.tensor=1",
                              "parallel.microbatches=2", "parallel.grad_sync=chunk", "tuner.enabled=true",
                              "tuner.meshes=true", "tuner.every=1", "tuner.warmup=0",
                              "tuner.batch_sizes=[16, 32]")
    cur = Candidate(data=4, pipe=2, microbatches=2, global_batch=16)
    stub = PreferStub(lambda c: c.global_batch == 32 or c.tensor == 2)
    tuner = OnlineTuner(cfg, cur, 8, step_model=stub)
    assert "keeps the step's two halves apart only with" in tuner.note and "batch 16" in tuner.note
    _feed(tuner, b_noise=100.0, steps=20, b_small=8, b_big=16)  # ignored: the step has no such metrics
    d = tuner.decide(1)
    assert d is not None and d.after.global_batch == 16 and d.after.tensor == 2 and d.b_noise is None


def test_settings_the_tuner_cannot_act_on_are_said_when_the_run_starts():
    """Nothing ignored without a word: batch sizes no candidate can run, a run that ends
    before the first decision (the default tuner.warmup=50 on a short run), and a tuner
    left with nothing to compare each get a line (they trained without one)."""
    def notes(*overrides, steps=100, start=0):
        cfg = mp.Config().replace(*TINY, "parallel.data=4", "parallel.tensor=2", "tuner.enabled=true",
                                  f"train.steps={steps}", *overrides)
        return OnlineTuner(cfg, Candidate(data=4, tensor=2, global_batch=16), 8).start_notes(steps, start)

    assert notes() == []
    [line] = notes("tuner.batch_sizes=[3, 16, 32, 6]")
    assert line.startswith("tuner: tuner.batch_sizes 3, 6 left out: the run's layout cannot run them "
                           "(batch 3: train.global_batch=3 must be divisible by data x fsdp"), line
    [line] = notes("tuner.batch_sizes=[3]", "tuner.meshes=true")
    assert "tuner.batch_sizes 3 left out: no layout the tuner may choose can run it" in line
    [line] = notes(steps=6)
    assert line == ("tuner: no decision in this run: the first would follow step 50 (tuner.warmup=50, "
                    "tuner.every=50) and the run ends at step 6; lower tuner.warmup or tuner.every")
    assert notes("tuner.warmup=7", "tuner.every=5", steps=11) == []        # after step 10
    assert len(notes("tuner.warmup=7", "tuner.every=5", steps=10)) == 1   # it would follow step 10
    assert notes("tuner.warmup=0", "tuner.every=5", steps=11, start=5) == []  # resumed: step 10 still comes
    assert len(notes("tuner.warmup=0", "tuner.every=5", steps=11, start=10)) == 1
    [line] = notes("tuner.batch_sizes=[16]")
    assert line.startswith("tuner: nothing to compare: d4 t2 | m1 | remat none | B16 is the only candidate")


def test_a_pipeline_weighs_its_microbatch_count():
    cfg = mp.Config().replace(*TINY, "parallel.pipe=2", "parallel.data=4", "parallel.tensor=1",
                              "parallel.microbatches=2", "tuner.enabled=true", "tuner.meshes=true",
                              "tuner.every=1", "tuner.warmup=0", "tuner.batch_sizes=[16]")
    cur = Candidate(data=4, pipe=2, microbatches=2, global_batch=16)
    four = dataclasses.replace(cur, microbatches=4)
    tuner = OnlineTuner(cfg, cur, 8, step_model=PreferStub(lambda c: c == four))
    pipelines = {c.microbatches for c in tuner.candidates if (c.pipe, c.data, c.tensor) == (2, 4, 1)}
    assert pipelines == {1, 2, 4}  # 8 would leave half a row per microbatch and device: refused
    d = tuner.decide(1)
    assert d is not None and d.after == four
    assert "microbatches 2 -> 4" in d.line()


def test_switches_that_ran_slower_than_predicted_make_unmeasured_layouts_dearer():
    """Seen on a user's Llama (pipe2 x data4, tuner.meshes): the cost model priced every
    layout without a pipeline 2.5-4x too fast relative to the pipeline, and the anchor
    (the current layout's own error) cannot see that; the run went to one such layout,
    measured it slower, went back, then tried the next: 7 switches in 40 steps. Now a
    switch measured slower than its prediction makes the unmeasured layouts that much
    dearer, and the run stays."""
    cfg = mp.Config().replace(*TINY, "parallel.pipe=2", "parallel.data=4", "parallel.tensor=1",
                              "parallel.microbatches=2", "tuner.enabled=true", "tuner.meshes=true",
                              "tuner.every=1", "tuner.warmup=0", "tuner.batch_sizes=[16]",
                              "tuner.amortize=false", "tuner.probe=0", "train.steps=1000")
    cur = Candidate(data=4, pipe=2, microbatches=2, global_batch=16)
    tuner = OnlineTuner(cfg, cur, 8, step_model=PreferStub(lambda c: c.pipe == 1))
    tuner.observe([], 1.0, 1)  # the pipeline measured as the model has it
    first = tuner.decide(1)
    assert first is not None and first.after.pipe == 1 and first.predicted_s == pytest.approx(0.5)
    tuner.accept(first, first.after.apply(cfg), 5.0)
    tuner.observe([{}], 9.0, 2)  # the first step after the switch (its one fetched step): discarded
    tuner.observe([], 2.0, 3)   # 4x the predicted 0.5 s
    back = tuner.decide(3)
    assert back is not None and back.after == cur and "priced x4.00" in back.reason, back
    tuner.accept(back, cfg, 0.0)
    tuner.observe([{}], 9.0, 4)
    tuner.observe([], 1.0, 5)
    others = [c for c in tuner.candidates if c.pipe == 1 and c != first.after]
    assert others and all(tuner.step_time(c) == pytest.approx(2.0) for c in others)  # 0.5 x 1 x 4
    assert tuner.decide(5) is None
    # A prediction found pessimistic does not make the others look faster.
    lucky = OnlineTuner(cfg, cur, 8, step_model=PreferStub(lambda c: c.pipe == 1))
    lucky.observe([], 1.0, 1)
    d = lucky.decide(1)
    lucky.accept(d, d.after.apply(cfg), 5.0)
    lucky.observe([], 0.25, 3)
    assert lucky._distrust() == 1.0


def test_a_layout_the_noise_statistics_split_is_priced_as_the_step_runs_it():
    """With the tuner on, a step without a pipeline computes its gradient as two halves
    (the noise statistics' ``make_grad_fn``): 1.4-1.6x a plain step's time, a pipeline
    1.2x (``benchmarks/noise_stats_cost.py``). The step model is asked about (and fitted
    on) the layout as the step runs it."""
    cfg = mp.Config().replace(*TINY, "parallel.data=8", "parallel.tensor=1", "tuner.enabled=true",
                              "tuner.meshes=true", "tuner.batch_sizes=[16, 32]")
    d8 = Candidate(data=8, global_batch=16)
    stub = PreferStub(lambda c: False)
    tuner = OnlineTuner(cfg, d8, 8, step_model=stub)
    halves = dataclasses.replace(d8, microbatches=2)
    assert tuner._as_run(d8) == halves
    pipe = Candidate(data=4, pipe=2, microbatches=2, global_batch=16)
    assert tuner._as_run(pipe) == pipe and tuner._as_run(halves) == halves
    assert tuner._as_run(Candidate(data=8, global_batch=8)) == Candidate(data=8, global_batch=8)  # no halves
    tuner.observe([], 1.0, 1)
    assert stub.observed == [(halves, 1.0)]
    accumulating = OnlineTuner(cfg.replace("train.grad_accum=2"), d8, 8, step_model=stub)
    assert accumulating._as_run(d8) == d8


def test_measured_throughput_fits_overhead_and_scales_rows():
    m = MeasuredThroughput()
    a, b = Candidate(data=8, global_batch=16), Candidate(data=8, global_batch=64)
    m.observe(a, 1.0)
    # One size seen: the prior overhead (10 %) and the rest linear in rows per device.
    assert m.step_time(dataclasses.replace(a, global_batch=32)) == pytest.approx(0.1 + 0.9 * 2)
    m.observe(b, 2.5)  # rows per device 2 -> 1.0 s, 8 -> 2.5 s: t = 0.5 + 0.25 r, fitted exactly
    # 16 rows per device, from the nearer measurement (8 rows): 0.5 + (2.5 - 0.5) x 16/8.
    assert m.step_time(dataclasses.replace(a, global_batch=128)) == pytest.approx(0.5 + 2.0 * 2)
    # Another mesh with the same rows per device: predicted from the nearest measurement.
    assert m.step_time(Candidate(data=4, tensor=2, global_batch=8)) == pytest.approx(1.0)


def test_scaled_updates_scale_the_learning_rate_and_keep_the_state_shape():
    tx = optax.adamw(1e-2, weight_decay=0.1)
    params = {"w": np.ones((3, 3), np.float32)}
    grads = {"w": np.full((3, 3), 0.5, np.float32)}
    u1, s1 = tx.update(grads, tx.init(params), params)
    u2, s2 = scale_updates(tx, 1.5).update(grads, tx.init(params), params)
    np.testing.assert_allclose(u2["w"], 1.5 * u1["w"], rtol=1e-6)
    assert jax.tree.structure(s1) == jax.tree.structure(s2)
    assert scale_updates(tx, 1.0) is tx  # no gain: exactly the default optimizer


# --- switching in place ------------------------------------------------------------

@pytest.mark.xla_default_emitters  # bitwise across programs
def test_a_tuned_step_takes_its_gain_at_run_time_and_is_compiled_once():
    """The gain is an argument of the tuned step: after ``set_gain`` the same program
    steps exactly as a program compiled with that gain as a constant (``scale_updates``
    on the default step), and switching back to a kept layout compiles nothing."""
    cfg = mp.Config().replace(*TINY, "parallel.data=8", "parallel.tensor=1", "train.steps=4")
    rng = np.random.default_rng(0)
    splits = TokenSplits(rng.integers(0, 256, 40_000).astype(np.uint16),
                         rng.integers(0, 256, 4_000).astype(np.uint16), 256, "random")
    tuned = build_layout(cfg, _gpt, 1.0)
    plain = build_layout(cfg, _gpt)
    step, compile_s = tuned.compile()
    assert compile_s > 0 and tuned.compile() == (step, 0.0)  # kept: asked again, nothing compiled
    feed = make_feed(splits, plain)
    batches = [plain.batches(next(feed.loader)) for _ in range(2)]
    feed.close()

    def fresh():
        return init_train_state(plain.spec, plain.create, plain.tx, plain.mesh, 0, plain.shardings)

    state = fresh()
    for gain, batch in zip((1.0, 1.7), batches, strict=True):
        tuned.set_gain(gain)
        state, _ = step(state, batch)
    ref = fresh()
    for gain, batch in zip((1.0, 1.7), batches, strict=True):
        constant = jax.jit(plain.make_step(tx=scale_updates(plain.tx, gain)), donate_argnums=0)
        with jax.set_mesh(plain.mesh):
            ref, _ = constant(ref, batch)
    assert all(x.tobytes() == y.tobytes() for x, y in zip(leaves(state), leaves(ref), strict=True))
    # A switch back to the kept layout reuses it (and its program) under the new gain.
    feed = make_feed(splits, tuned)
    state, again, feed = switch(state, tuned, feed, cfg, 0.5, factory_for=_gpt, splits=splits, reuse=tuned)
    feed.close()
    assert again is tuned and again.lr_gain == 0.5 and again.compile() == (step, 0.0)


def _gpt(cfg):
    return lambda rngs: mp.GPT(cfg.model, rngs=rngs)


def _started(cfg):
    """(random token splits, ``cfg``'s layout, its feed, its initial state): a run about to step."""
    rng = np.random.default_rng(0)
    splits = TokenSplits(rng.integers(0, 256, 40_000).astype(np.uint16),
                         rng.integers(0, 256, 4_000).astype(np.uint16), 256, "random")
    layout = build_layout(cfg, _gpt)
    feed = make_feed(splits, layout)
    state = init_train_state(layout.spec, layout.create, layout.tx, layout.mesh, 0, layout.shardings)
    return splits, layout, feed, state


def test_mesh_switch_keeps_params_and_optimizer_state_bit_for_bit():
    cfg = mp.Config().replace(*TINY, "parallel.data=8", "parallel.tensor=1", "train.steps=4")
    splits, layout, feed, state = _started(cfg)
    step, _ = layout.compile()
    seen = [next(feed.loader) for _ in range(3)]
    for batch in seen:  # real steps: Adam's moments and count are not their initial values
        state, _ = step(state, layout.batches(batch))
    before = leaves(state)
    path = [("parallel.data=4", "parallel.tensor=2", "train.global_batch=32"),
            ("parallel.data=4", "parallel.fsdp=2", "parallel.tensor=1"),
            ("parallel.data=8", "parallel.fsdp=1", "parallel.tensor=1", "train.global_batch=16")]
    for overrides in path:
        state, layout, feed = switch(state, layout, feed, layout.cfg.replace(*overrides), 1.0,
                                     factory_for=_gpt, splits=splits)
        w = state["params"]["blocks"]["mlp"]["w_in"]
        assert w.sharding == layout.shardings["params"]["blocks"]["mlp"]["w_in"]
        assert jax.tree.structure(state) == jax.tree.structure(layout.abstract_state)
        if overrides == path[0]:
            assert w.sharding.shard_shape(w.shape)[-1] == w.shape[-1] // 2  # split over tensor
            # 3 batches of 16 seen = 48 samples: continue at batch floor(48/32) = 1 of 32,
            # records 32..63, so records 32..47 repeat once (< 32) and none is skipped.
            assert feed.loader.step == 1
            np.testing.assert_array_equal(next(feed.loader)["inputs"][:16], seen[2]["inputs"])
        if overrides == path[1]:
            assert layout.mesh.shape["fsdp"] == 2
            assert w.sharding.shard_shape(w.shape) != w.shape  # split over fsdp in storage
    feed.close()
    after = leaves(state)
    assert len(before) == len(after)
    assert all(np.array_equal(x, y) and x.dtype == y.dtype for x, y in zip(before, after, strict=True))


@pytest.mark.xla_default_emitters  # bitwise across two programs: as users compile them
def test_step_after_mesh_switch_matches_a_fresh_run_on_the_new_mesh(tmp_path):
    common = (*TINY, "train.steps=3", "train.checkpoint_every=2", "train.log_every=1")
    # The tuner, with every mesh shape as a candidate, moves data=8 to data=4 x tensor=2 after
    # step 2 (then saves step 2's checkpoint from the new mesh).
    stub = PreferStub(lambda c: (c.data, c.tensor, c.fsdp) == (4, 2, 1))
    tuned = mp.train(None, None, mp.Config(), *common, "parallel.data=8", "parallel.tensor=1",
                     f"train.out_dir={tmp_path / 'tuned'}", "tuner.enabled=true", "tuner.meshes=true",
                     "tuner.every=2", "tuner.warmup=2", "tuner.amortize=false", step_model=stub)
    switched = [h["tuner"] for h in tuned.history if "tuner" in h]
    assert [(s["step"], s["from"].split(" | ")[0], s["to"].split(" | ")[0]) for s in switched] == \
        [(2, "d8", "d4 t2")]
    assert dict(tuned.mesh.shape)["tensor"] == 2 and stub.observed  # measured times reached the model
    # A new run on data=4 x tensor=2 from step 2's state: restored from the checkpoint, with
    # its own layout and step built at start, not by the switch.
    fresh_dir = tmp_path / "fresh"
    shutil.copytree(tuned.out_dir, fresh_dir)
    shutil.rmtree(fresh_dir / "checkpoints" / "3")
    # With the tuner on and one microbatch, the step accumulates two halves (for its noise
    # statistics, train/step.noise_microbatches): the fresh run does the same.
    fresh = mp.train(None, None, mp.Config(), *common, "parallel.data=4", "parallel.tensor=2",
                     f"train.out_dir={fresh_dir}", "train.resume=true", "train.grad_accum=2")
    assert tuned.history[-1]["loss"] == pytest.approx(fresh.history[-1]["loss"], rel=1e-6)
    for x, y in zip(leaves(tuned.state), leaves(fresh.state), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_microbatch_switch_matches_a_fresh_run_with_that_count(tmp_path):
    common = (*TINY, "train.steps=3", "train.checkpoint_every=2", "train.log_every=1", "parallel.pipe=2",
              "parallel.data=4", "parallel.tensor=1", "parallel.schedule=1f1b")
    stub = PreferStub(lambda c: (c.pipe, c.data, c.tensor, c.microbatches) == (2, 4, 1, 4))
    # (with an online repartition at step 1, before the switch)
    tuned = mp.train(None, None, mp.Config(), *common, "parallel.microbatches=2",
                     f"train.out_dir={tmp_path / 'tuned'}", "tuner.enabled=true", "tuner.meshes=true",
                     "tuner.every=2", "tuner.warmup=2", "tuner.amortize=false",
                     "parallel.repartition_after=1", step_model=stub)
    switched = [h["tuner"] for h in tuned.history if "tuner" in h]
    assert len(switched) == 1 and switched[0]["candidate"]["microbatches"] == 4
    # The tuned layout splits its stages evenly: the checkpoints after the switch must not
    # carry the repartition's split, or a resume would bring it back onto that layout.
    assert [h["step"] for h in tuned.history if "repartition" in h] == [1]
    assert tuned.config.parallel.stage_layers == ()
    from mindpipe_jax.train.checkpoint import read_meta

    step, meta = read_meta(tuned.checkpoint_dir)
    assert step == 3 and "repartition" not in meta
    assert dict(tuned.mesh.shape)["data"] == 4 and dict(tuned.mesh.shape)["pipe"] == 2
    assert tuned.config.parallel.microbatches == 4
    # Step 3 after the switch equals step 3 of a run restored from step 2 with 4 microbatches.
    # With the tuner on, the pipeline keeps the step's two halves apart for the noise
    # statistics (train/step.noise_microbatches): the fresh run does the same (its tuner
    # never decides).
    fresh_dir = tmp_path / "fresh"
    shutil.copytree(tuned.out_dir, fresh_dir)
    shutil.rmtree(fresh_dir / "checkpoints" / "3")
    fresh = mp.train(None, None, mp.Config(), *common, "parallel.microbatches=4",
                     f"train.out_dir={fresh_dir}", "train.resume=true", "tuner.enabled=true",
                     "tuner.every=1000")
    assert tuned.history[-1]["loss"] == pytest.approx(fresh.history[-1]["loss"], rel=1e-6)
    for x, y in zip(leaves(tuned.state), leaves(fresh.state), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)


BATCH_SWITCH = (*TINY, "train.steps=10", "train.grad_accum=2", "train.log_every=2",
                "train.checkpoint_every=6", "tuner.enabled=true", "tuner.every=5", "tuner.warmup=4",
                "tuner.ema=0.5", "tuner.batch_sizes=[16, 32]", "parallel.data=4", "parallel.tensor=2",
                "tuner.amortize=false")


@pytest.fixture(scope="module")
def batch_switch_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tuned") / "run"
    result = mp.train(None, None, mp.Config(), *BATCH_SWITCH, f"train.out_dir={out}",
                      step_model=PreferStub(lambda c: c.global_batch == 32))
    return result


@pytest.mark.xdist_group("batch_switch_run")  # one worker builds the shared run
def test_tuner_switches_batch_end_to_end(batch_switch_run, capsys):
    result = batch_switch_run
    decisions = [h for h in result.history if "tuner" in h]
    # One decision point (step 5; step 10 ends the run): once both batches have run, the
    # tuner would trust their measured times over the stub, and this machine's timing
    # would decide.
    assert len(decisions) == 1 and decisions[0]["step"] == 5
    d = decisions[0]["tuner"]
    assert d["from"].endswith("B16") and d["to"].endswith("B32") and d["b_noise"] > 0
    # The default rule for AdamW: the square root of AdaScale's gain (B/b0) x efficiency(B).
    assert d["lr_gain"] == pytest.approx(math.sqrt(2 * efficiency(32, d["b_noise"], 16)))
    logs = [h for h in result.history if "loss" in h]
    assert {h["batch"] for h in logs if h["step"] <= 4} == {16}
    after = [h for h in logs if h["step"] > 4]
    assert after and all(h["batch"] == 32 and h["tuner/batch"] == 32 and h["micro_batch"] == 16
                         and h["tuner/lr_gain"] == d["lr_gain"] for h in after)
    assert result.config.train.global_batch == 32 and result.step == 10
    # The loader went on with batches of 32: 5 x 16 samples = 2.5 batches of 32, so it
    # continues at batch 2 (a half batch is seen again), then 5 more.
    data = json.loads((result.checkpoint_dir / "10" / "data" / "metadata").read_text())
    assert (data["global_batch"], data["step"]) == (32, 7)
    meta = json.loads((result.checkpoint_dir / "10" / "meta" / "metadata").read_text())
    assert meta["tuner"]["candidate"]["global_batch"] == 32 and meta["tuner"]["lr_gain"] == d["lr_gain"]
    written = [json.loads(x) for x in (result.out_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("tuner" in r for r in written) and "tuner/b_noise" in written[-1]


@pytest.mark.xdist_group("batch_switch_run")  # one worker builds the shared run
def test_resume_after_a_switch_continues_with_the_switched_config(batch_switch_run, tmp_path):
    full = batch_switch_run
    out = tmp_path / "run"
    shutil.copytree(full.out_dir, out)
    shutil.rmtree(out / "checkpoints" / "10")  # resume from step 6, after the switch at step 5
    resumed = mp.train(None, None, mp.Config(), *BATCH_SWITCH, f"train.out_dir={out}",
                       "train.resume=true", step_model=PreferStub(lambda c: c.global_batch == 32))
    assert resumed.config.train.global_batch == 32 and resumed.step == 10
    assert not any("tuner" in h for h in resumed.history)  # already at the best candidate
    # Same batch, data position, learning-rate gain and noise state: the same bits.
    for x, y in zip(leaves(full.state), leaves(resumed.state), strict=True):
        assert x.tobytes() == y.tobytes()
    assert resumed.history[-1]["loss"] == full.history[-1]["loss"]
    assert resumed.history[-1]["tuner/b_noise"] == full.history[-1]["tuner/b_noise"]


def test_a_switch_that_cannot_fit_in_memory_is_refused_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    """Free memory that has shrunk since the run began (another job took it): the B32 the
    stub prefers compiles, its step is found too large beside the run, and the run goes on
    at B16 with that candidate dropped (not compiled again at the next decision). Before,
    the state moved first and the step ran out of memory: on CPUs the kernel's SIGKILL."""
    from mindpipe_jax.train import memory_fit

    checks = []

    def free_bytes():  # the first step's check passes; the switch's finds 1 MiB free
        checks.append(len(checks))
        return float("inf") if len(checks) == 1 else 2.0**20

    monkeypatch.setattr(memory_fit, "host_free_bytes", free_bytes)
    config = [*BATCH_SWITCH, "train.steps=15", f"train.out_dir={tmp_path / 'run'}"]
    result = mp.train(None, None, mp.Config(), *config, step_model=PreferStub(lambda c: c.global_batch == 32))
    out = capsys.readouterr().out
    refusals = [h for h in result.history if "tuner_refused" in h]
    assert [h["step"] for h in refusals] == [5] and refusals[0]["tuner_refused"]["to"].endswith("B32")
    assert len(checks) == 2  # the decision at step 10 no longer weighs B32
    assert re.search(r"step 5 \| tuner: not switching to .*B32: the switch needs [0-9.]+ [KMG]iB more memory "
                     r"than the run holds now .* this host has 1\.0 MiB free", out), out
    assert not any("tuner" in h for h in result.history)
    assert result.config.train.global_batch == 16 and result.step == 15
    assert {h["batch"] for h in result.history if "loss" in h} == {16}
    assert all(math.isfinite(h["loss"]) for h in result.history if "loss" in h)


def test_a_candidate_whose_layout_cannot_be_built_is_refused_with_nothing_moved():
    """A ConfigError building the tuner's choice (here a model of 2 heads split over
    tensor=4) refuses the switch, as memory does, instead of ending the run: the state,
    the layout and the open feed stay as they were."""
    from mindpipe_jax.train.tuned import Switcher, SwitchRefused
    from mindpipe_jax.tuner.epara import Decision

    cfg = mp.Config().replace(*TINY, "parallel.data=8", "parallel.tensor=1")
    splits, layout, feed, state = _started(cfg)
    now = candidate_of(cfg, layout.mesh)
    four = dataclasses.replace(now, data=2, tensor=4)
    switcher = Switcher(_gpt, splits, 0)
    try:
        with pytest.raises(SwitchRefused, match=r"heads=2\) is not divisible by mesh axes tensor=4"):
            switcher(state, layout, feed, Decision(3, now, four, 0.5, None, 1.0, "test"), cfg)
        assert switcher.ran == {} and next(feed.loader)["inputs"].shape == (16, 32)  # the feed is open
        w = state["params"]["blocks"]["mlp"]["w_in"]  # still on the current layout, not donated
        assert not w.is_deleted() and w.sharding == layout.shardings["params"]["blocks"]["mlp"]["w_in"]
    finally:
        feed.close()


def test_a_layout_is_compiled_ahead_once_however_often_it_is_asked_for():
    """The loop says "compiling ... in the background" when a compile starts: asked again
    while it runs (the tuner names it at each decision until it is ready: three lines for
    one compile, seen with tuner.meshes), nothing new starts and nothing is said."""
    from mindpipe_jax.train.prepare import Preparer

    cfg = mp.Config().replace(*TINY, "parallel.data=8", "parallel.tensor=1", "tuner.enabled=true")
    preparer = Preparer(_gpt)
    try:
        assert preparer.submit("b16", cfg, 1.0) is True
        assert preparer.submit("b16", cfg, 1.0) is False
        layout = preparer.take("b16")
        assert layout is not None and layout.compile()[1] == 0.0  # compiled ahead: kept, 0 s now
        assert preparer.submit("b16", cfg, 1.0) is True  # taken: a later request compiles again
    finally:
        preparer.close()


class FlipStub(PreferStub):
    """B32 predicted at 2.2x B16's samples/s the first time it is asked about, 8x after.
    Times the efficiency ratio eff(32)/eff(16) = (B_noise + 16)/(B_noise + 32), in
    [0.5, 0.68) for any B_noise under 18 (this run's is ~1), the first decision finds a
    gain in [0.1, 0.5): positive, below ``tuner.threshold=0.5`` (no switch, B32 compiled
    ahead); the second one a gain >= 3 (a switch)."""

    def __init__(self):
        super().__init__(lambda c: False)
        self.asked = 0

    def step_time(self, c):
        if c.global_batch != 32:
            return 1.0
        self.asked += 1
        return 2 / (2.2 if self.asked == 1 else 8.0)


@pytest.mark.slow
def test_a_switch_to_a_layout_compiled_ahead_compiles_nothing_and_trains_the_same(tmp_path, capsys):
    common = (*TINY, "train.steps=12", "train.grad_accum=2", "train.log_every=2", "train.checkpoint_every=0",
              "tuner.enabled=true", "tuner.every=4", "tuner.warmup=4", "tuner.threshold=0.5", "tuner.ema=0.5",
              "tuner.batch_sizes=[16, 32]", "parallel.data=8", "parallel.tensor=1", "tuner.amortize=false",
              "tuner.probe=0")
    ahead = mp.train(None, None, mp.Config(), *common, f"train.out_dir={tmp_path / 'ahead'}",
                     step_model=FlipStub())
    out = capsys.readouterr().out
    assert re.search(r"step 4 \| tuner: compiling .*B32 in the background", out), out
    decisions = [h for h in ahead.history if "tuner" in h]
    assert [h["step"] for h in decisions] == [8] and decisions[0]["tuner"]["to"].endswith("B32")
    assert re.search(r"step 8 \| tuner: B 16 -> 32, .* \| compiled in 0\.0s", out), out  # the prepared one
    plain = mp.train(None, None, mp.Config(), *common, "tuner.prepare=false",
                     f"train.out_dir={tmp_path / 'plain'}", step_model=FlipStub())
    out = capsys.readouterr().out
    assert "in the background" not in out and not re.search(r"compiled in 0\.0s", out)
    assert [h["step"] for h in plain.history if "tuner" in h] == [8]
    for x, y in zip(leaves(ahead.state), leaves(plain.state), strict=True):
        assert x.tobytes() == y.tobytes()


def test_candidate_of_reads_the_real_mesh():
    cfg = mp.Config().replace(*TINY, "parallel.data=-1", "parallel.tensor=2")
    mesh = mp.make_mesh(cfg.parallel)
    cand = candidate_of(cfg, mesh)
    assert (cand.data, cand.tensor, cand.global_batch, cand.devices) == (4, 2, 16, 8)


# --- elastic: a tuned run requeued on another number of devices --------------------------

def _saved(candidate: Candidate, b_noise: float | None, b0: int = 16, lr: float = 1.0) -> dict:
    noise = NoiseScale(ema=0.5)
    if b_noise is not None:  # two steps of exactly known terms: |G|^2 = 1, tr(Sigma) = b_noise
        for _ in range(2):
            noise.update(1, 1.0 + b_noise, 16, 1.0 + b_noise / 16)
    return {"candidate": candidate.to_dict(), "noise": noise.to_dict(), "b0": b0, "initial_batch": b0,
            "lr_gain": lr, "decisions": 0}


def test_elastic_layout_keeps_the_axes_that_fit_and_data_takes_the_rest():
    c = Candidate(data=8, global_batch=16)
    assert fit_layout(c, 4).axes == {**c.axes, "data": 4}
    assert fit_layout(Candidate(data=4, tensor=2), 4).axes == {**c.axes, "data": 2, "tensor": 2}
    assert fit_layout(Candidate(data=1, fsdp=8), 4).axes == {**c.axes, "data": 1, "fsdp": 4}
    assert fit_layout(Candidate(data=1, tensor=4, pipe=2), 2).axes == {**c.axes, "data": 1, "pipe": 2}
    assert fit_layout(Candidate(data=2, tensor=2), 8).axes == {**c.axes, "data": 4, "tensor": 2}


def test_elastic_batch_is_chosen_by_the_saved_noise_scale():
    cfg = mp.Config().replace(*TINY, "tuner.enabled=true", "parallel.tensor=1")
    before = Candidate(data=8, global_batch=16)
    # Noise-dominated gradients (huge B_noise): every batch is as efficient, so the one that
    # amortizes the per-step overhead wins: the global batch stays (2x the rows per device).
    kept = replan(cfg, _saved(before, 1e6), 4)
    assert kept.after == Candidate(data=4, global_batch=16) and kept.policy == "kept the global batch"
    assert kept.b_noise == pytest.approx(1e6) and kept.lr_gain == pytest.approx(1.0)
    # A small B_noise: a smaller batch is statistically far more efficient, so the rows per
    # device stay and the batch halves; the default rule's gain (sqrt of AdaScale's) follows it.
    rows = replan(cfg, _saved(before, 2.0), 4)
    assert rows.after == Candidate(data=4, global_batch=8) and rows.policy == "kept the rows per device"
    assert rows.lr_gain == pytest.approx(math.sqrt(8 / 16 * efficiency(8, 2.0, 16)))
    # Growing again with noise-dominated gradients: twice the devices at the same rows per
    # device beat the same batch at half the rows (the overhead): the batch doubles.
    grown = replan(cfg, _saved(Candidate(data=4, global_batch=8), 1e6, b0=16), 8)
    assert grown.after == Candidate(data=8, global_batch=16) and grown.policy == "kept the rows per device"
    # Without a noise estimate another batch cannot be judged: the global batch is kept.
    unknown = replan(cfg, _saved(before, None, lr=1.5), 4)
    assert unknown.after.global_batch == 16 and unknown.b_noise is None and unknown.lr_gain == 1.5
    assert "on 8 devices; 4 now: d4" in unknown.line() and "no noise estimate" in unknown.line()
    # Nothing fits (2 heads cannot split over tensor=4 when 4 devices is all there is): one line.
    with pytest.raises(ConfigError, match=r"resuming the tuned run .* on 4 devices: .* does not fit"):
        replan(cfg, _saved(Candidate(tensor=8, global_batch=16), None), 4)


# The default corpus (text with signal: synthetic tokens are uniform, nothing to learn and
# no noise scale to estimate); the tuner observes every step from the first.
ELASTIC = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.seq_len=32",
           "train.global_batch=16", "optim.lr=1e-2",
           "train.grad_accum=2", "train.log_every=1", "train.eval_every=0", "train.progress=false",
           "train.tensorboard=false", "optim.warmup_steps=2", "parallel.tensor=1", "tuner.enabled=true",
           "tuner.ema=0.5", "tuner.warmup=1", "tuner.every=1", "tuner.batch_sizes=[8, 16]"]
LOSS_LINE = re.compile(r"^step +(\d+) \| loss ([0-9.]+)", re.M)


@pytest.mark.slow
def test_elastic_resume_8_to_4_to_8_devices_continues_the_loss(tmp_path, compile_cache):
    """A tuned run (with noise statistics) on 8 devices, requeued on 4, then on 8 again
    (``--resume`` with another ``parallel.simulate_cpu_devices``): each resume re-plans the
    layout (data = the devices) and batch, says so in one line, and the loss goes on from
    where it was (no restart), lower at the end than at the start."""
    out = tmp_path / "run"
    env = cli_env(compile_cache)
    losses: dict[int, float] = {}
    for devices, steps, resume in ((8, 6, []), (4, 12, ["--resume"]), (8, 18, ["--resume"])):
        args = [*ELASTIC, f"parallel.simulate_cpu_devices={devices}", f"train.steps={steps}",
                "train.checkpoint_every=6", f"train.out_dir={out}", *resume]
        rc, output = run_train(args, env=env, cwd=tmp_path, timeout=300)
        assert rc == 0, output[-3000:]
        if resume:
            lines = [ln for ln in output.splitlines() if ln.startswith("elastic resume:")]
            assert len(lines) == 1, output[-3000:]
            assert f"on {32 // devices} devices; {devices} now: d{devices} " in lines[0], lines[0]
            assert "no noise estimate" not in lines[0]  # the saved statistics decided the batch
            print(lines[0])
        assert re.search(rf"^mesh .*'data': {devices}\b", output, re.M), output[-3000:]
        losses.update({int(s): float(x) for s, x in LOSS_LINE.findall(output)})
        meta = json.loads((out / "checkpoints" / str(steps) / "meta" / "metadata").read_text())
        assert meta["tuner"]["candidate"]["data"] == devices
    print(" ".join(f"{s}:{x:.3f}" for s, x in sorted(losses.items())))
    assert sorted(losses) == list(range(1, 19))
    for resumed_at in (6, 12):  # the first steps after a resume continue the last before it
        before = (losses[resumed_at - 1] + losses[resumed_at]) / 2
        after = (losses[resumed_at + 1] + losses[resumed_at + 2]) / 2
        assert after < 1.1 * before, (resumed_at, losses)
    assert losses[18] < 0.9 * losses[1], losses


def test_steps_without_noise_statistics_leave_the_estimate_alone():
    # tuner.noise_every > 1: the steps between return NaN statistics; they are skipped,
    # not mixed into the EMAs (which would turn the estimate NaN for good).
    cfg = mp.Config().replace(*TINY, "train.grad_accum=2", "parallel.data=8", "parallel.tensor=1",
                              "tuner.enabled=true")
    tuner = OnlineTuner(cfg, Candidate(data=8, global_batch=16), 8, step_model=MeasuredThroughput())
    _feed(tuner, b_noise=100.0, steps=20, b_small=8, b_big=16)
    before = dataclasses.asdict(tuner.noise)
    nan = {"loss": 1.0, "micro_batch": 8, "batch": 16, "micro_grad_sq": math.nan, "grad_norm": 1.0,
           "precond_micro_grad_sq": math.nan, "precond_grad_sq": math.nan}
    tuner.observe([nan] * 5, None, 0)
    assert dataclasses.asdict(tuner.noise) == before
    assert tuner.b_noise == pytest.approx(100.0)
