"""EPara's online tuner: decisions from measurements, and switching a run in place.

The switching tests compare against independent paths: a mesh switch against the
bytes before it, the step after a switch against a run restored onto the new mesh
from a checkpoint, and a resumed tuned run against the uninterrupted one.
"""

import dataclasses
import json
import math
import shutil

import jax
import numpy as np
import optax
import pytest

import mindpipe_jax as mp
from mindpipe_jax.data import TokenSplits
from mindpipe_jax.train.reconfigure import build_layout, make_feed, scale_updates, switch
from mindpipe_jax.train.state import init_train_state
from mindpipe_jax.tuner.epara import MeasuredThroughput, OnlineTuner, candidate_of
from mindpipe_jax.tuner.noise import efficiency, lr_gain
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
    assert d.lr_gain == pytest.approx(lr_gain("adascale", 128, 16, 100.0))
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
    cfg = mp.Config().replace(*TINY, "parallel.pipe=2", "parallel.data=4", "parallel.tensor=1",
                              "parallel.microbatches=2", "tuner.enabled=true", "tuner.meshes=true",
                              "tuner.every=1", "tuner.warmup=0", "tuner.batch_sizes=[16, 32]")
    cur = Candidate(data=4, pipe=2, microbatches=2, global_batch=16)
    stub = PreferStub(lambda c: c.global_batch == 32 or c.tensor == 2)
    tuner = OnlineTuner(cfg, cur, 8, step_model=stub)
    assert "pipeline accumulates" in tuner.note and "batch 16" in tuner.note
    _feed(tuner, b_noise=100.0, steps=20, b_small=8, b_big=16)  # ignored: the step has no such metrics
    d = tuner.decide(1)
    assert d is not None and d.after.global_batch == 16 and d.after.tensor == 2 and d.b_noise is None


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

def _gpt(cfg):
    return lambda rngs: mp.GPT(cfg.model, rngs=rngs)


def test_mesh_switch_keeps_params_and_optimizer_state_bit_for_bit():
    cfg = mp.Config().replace(*TINY, "parallel.data=8", "parallel.tensor=1", "train.steps=4")
    rng = np.random.default_rng(0)
    splits = TokenSplits(rng.integers(0, 256, 40_000).astype(np.uint16),
                         rng.integers(0, 256, 4_000).astype(np.uint16), 256, "random")
    layout = build_layout(cfg, _gpt)
    feed = make_feed(splits, layout)
    state = init_train_state(layout.spec, layout.create, layout.tx, layout.mesh, 0, layout.shardings)
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
    tuned = mp.train(None, None, mp.Config(), *common, "parallel.microbatches=2",
                     f"train.out_dir={tmp_path / 'tuned'}", "tuner.enabled=true", "tuner.meshes=true",
                     "tuner.every=2", "tuner.warmup=2", "tuner.amortize=false", step_model=stub)
    switched = [h["tuner"] for h in tuned.history if "tuner" in h]
    assert len(switched) == 1 and switched[0]["candidate"]["microbatches"] == 4
    assert dict(tuned.mesh.shape)["data"] == 4 and dict(tuned.mesh.shape)["pipe"] == 2
    assert tuned.config.parallel.microbatches == 4
    # Step 3 after the switch equals step 3 of a run restored from step 2 with 4 microbatches.
    fresh_dir = tmp_path / "fresh"
    shutil.copytree(tuned.out_dir, fresh_dir)
    shutil.rmtree(fresh_dir / "checkpoints" / "3")
    fresh = mp.train(None, None, mp.Config(), *common, "parallel.microbatches=4",
                     f"train.out_dir={fresh_dir}", "train.resume=true")
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
    assert d["lr_gain"] == pytest.approx(2 * efficiency(32, d["b_noise"], 16))  # AdaScale
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


def test_candidate_of_reads_the_real_mesh():
    cfg = mp.Config().replace(*TINY, "parallel.data=-1", "parallel.tensor=2")
    mesh = mp.make_mesh(cfg.parallel)
    cand = candidate_of(cfg, mesh)
    assert (cand.data, cand.tensor, cand.global_batch, cand.devices) == (4, 2, 16, 8)
