"""EPara's offline tuner: the configuration space, feasibility by ahead-of-time
compilation, the cost model (its features, its refit, its ranking against real
trials on 8 simulated devices) and ``mindpipe tune``."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import numpy as np
import pytest

from mindpipe_jax.cli import main
from mindpipe_jax.config import Config
from mindpipe_jax.parallel.mesh import make_mesh
from mindpipe_jax.sim.network import Link
from mindpipe_jax.tuner.aot import FeasibilityCache, compile_candidate, memory_floor
from mindpipe_jax.tuner.costmodel import CostModel, Hardware, ModelCosts, spearman
from mindpipe_jax.tuner.space import Candidate, check_candidate, enumerate_space
from mindpipe_jax.tuner.trial import Trial

TINY = Config().replace("model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.seq_len=16",
                        "train.global_batch=16", "train.progress=false", "train.tensorboard=false")


# ------------------------------------------------------------------ the space
def test_space_rejects_with_the_rule_that_fails():
    cfg = TINY.replace("model.n_layers=3")
    report = enumerate_space(cfg, 8, global_batches=(8, 16), microbatches=(1, 2))
    reasons = [why for _, why in report.rejected]
    assert any("n_heads=2 is not divisible by tensor=4" in r for r in reasons)
    assert any("n_layers=3 must be divisible by parallel.pipe" in r for r in reasons)
    assert any("global_batch=8 must be divisible" in r for r in reasons)
    # Every valid candidate uses all 8 devices and passes the same check again.
    assert report.valid and all(c.devices == 8 and check_candidate(cfg, c, 8) is None for c in report.valid)
    # No candidate is listed twice, and valid + rejected cover what was generated.
    assert len(set(report.valid)) == len(report.valid)


def test_candidate_round_trips_through_a_config():
    cfg = TINY.replace("model.n_layers=4")
    assert "only apply with pipe > 1" in check_candidate(cfg, Candidate(data=8, schedule="gpipe"))
    cand = Candidate(data=2, tensor=2, pipe=2, microbatches=4, remat="full", global_batch=32)
    run = cand.apply(cfg)
    assert Candidate.from_config(run, 8) == cand
    assert dict(make_mesh(run.parallel).shape) == {**cand.axes}


def test_moe_space_holds_pipelines_with_and_without_an_expert_axis():
    """An MoE job's space: pipelines run it (each stage routing over all its experts, or
    over its expert devices' since 2026-12-05), so pipe > 1 is valid with expert 1 or 2;
    experts that do not divide are refused by name."""
    cfg = TINY.replace("model.n_layers=4", "model.n_experts=4")
    assert check_candidate(cfg, Candidate(data=4, pipe=2, microbatches=2, global_batch=32), 8) is None
    with_ep = Candidate(data=2, pipe=2, expert=2, microbatches=2, global_batch=32)
    assert check_candidate(cfg, with_ep, 8) is None
    why = check_candidate(cfg.replace("model.n_experts=6"), Candidate(pipe=2, expert=4, microbatches=2,
                                                                      global_batch=32), 8)
    assert why and "model.n_experts=6 must be divisible by parallel.expert=4" in why
    report = enumerate_space(cfg, 8, axes=("data", "pipe", "expert"), global_batches=(32,), microbatches=(2,))
    assert any(c.pipe > 1 for c in report.valid)
    assert any(c.pipe > 1 and c.expert > 1 for c in report.valid)


def test_bad_space_choices_are_one_line_errors():
    from mindpipe_jax.errors import ConfigError
    with pytest.raises(ConfigError, match="tuner axis 'tensr' is not a mesh axis"):
        enumerate_space(TINY, 8, axes=("data", "tensr"))
    with pytest.raises(ConfigError, match="tuner remat 'some'"):
        enumerate_space(TINY, 8, remats=("some",))


# ------------------------------------------------------- AOT feasibility
def test_compile_judges_memory_and_the_cache_reuses_it(tmp_path):
    full = Candidate(data=2, pipe=4, microbatches=4, remat="full", global_batch=16)
    none = Candidate(data=2, pipe=4, microbatches=4, remat="none", global_batch=16)
    cfg = TINY.replace("model.n_layers=4")
    f_full = compile_candidate(cfg, full, math.inf)
    f_none = compile_candidate(cfg, none, math.inf)
    assert f_full.fits and f_none.fits
    assert 0 < f_full.temp_bytes < f_none.temp_bytes  # remat keeps fewer residuals
    # A budget between the two admits exactly the leaner one, with the reason given.
    budget = (f_full.peak_bytes + f_none.peak_bytes) / 2
    cache = FeasibilityCache(tmp_path / "aot.json")
    assert cache.check(cfg, full, budget).fits
    refused = cache.check(cfg, none, budget)
    assert not refused.fits and "MiB per device, budget" in refused.reason
    assert (cache.hits, cache.misses) == (0, 2)
    again = FeasibilityCache(tmp_path / "aot.json")  # persisted: no compile the second time
    assert again.check(cfg, none, math.inf).peak_bytes == refused.peak_bytes and again.hits == 1
    # An invalid candidate is refused without compiling.
    bad = compile_candidate(cfg, Candidate(tensor=8, global_batch=16), math.inf)
    assert not bad.fits and "n_heads=2 is not divisible by tensor=8" in bad.reason


@pytest.mark.parametrize("moe", [False, True])
def test_the_memory_floor_is_below_what_every_layout_compiles_to(moe):
    """The floor that refuses a layout without compiling (``memory_floor``) must never
    refuse one that fits: it is below the compiled peak of data, tensor, fsdp, pipeline
    and accumulation layouts, with and without remat, of a dense and an MoE model."""
    cfg = TINY.replace("model.n_layers=4", "model.d_model=64", "model.seq_len=32",
                       *(["model.n_experts=4"] if moe else []))
    costs = ModelCosts.measure(cfg)
    # The embedding's output per sequence, fp32 (an MoE model's also carries its router loss terms).
    assert 32 * 64 * 4 <= costs.hidden_bytes_per_row < 1.1 * 32 * 64 * 4
    layouts = [Candidate(data=8, global_batch=64), Candidate(data=4, tensor=2, global_batch=64),
               Candidate(fsdp=8, global_batch=64, remat="full"),
               Candidate(data=8, microbatches=4, global_batch=64),
               Candidate(data=2, pipe=4, microbatches=4, global_batch=64, remat="full"),
               Candidate(data=2, pipe=2, tensor=2, microbatches=2, global_batch=32)]
    if moe:
        layouts.append(Candidate(data=2, expert=4, global_batch=64))
    for cand in layouts:
        compiled = compile_candidate(cfg, cand, math.inf)
        assert compiled.fits, compiled.reason
        floor = memory_floor(cand, costs.hidden_bytes_per_row, costs.param_bytes)
        assert 0 < floor <= compiled.peak_bytes, (cand.label(), floor, compiled.peak_bytes)


# ------------------------------------------------------------- cost model
def _synthetic_model() -> CostModel:
    costs = ModelCosts(n_layers=4, layer_fwd=1e6, layer_bwd={"none": 2e6, "dots": 2.2e6, "full": 3e6},
                       rest_fwd=5e5, rest_bwd=1e6, param_bytes=4e6, hidden_bytes_per_row=1e4)
    hw = Hardware(flop_rate=1e9, link=Link(1e-5, 1e9), solo_rate=1e9, launch_s=1e-3, iteration_s=1e-4)
    return CostModel(costs, hw, seq_len=16)


def test_cost_model_features_follow_the_configuration():
    cm = _synthetic_model()
    small = cm.breakdown(Candidate(data=8, global_batch=8))
    big = cm.breakdown(Candidate(data=8, global_batch=64))
    assert big.compute_s == pytest.approx(8 * small.compute_s)
    full = cm.breakdown(Candidate(data=8, global_batch=64, remat="full"))
    assert full.compute_s > big.compute_s
    tp = cm.breakdown(Candidate(data=4, tensor=2, global_batch=64))
    assert "tensor" in tp.comm_s and tp.compute_s == pytest.approx(big.compute_s)
    # Pipeline bubbles: more microbatches fill them.
    m1 = cm.breakdown(Candidate(data=2, pipe=4, microbatches=1, global_batch=64))
    m8 = cm.breakdown(Candidate(data=2, pipe=4, microbatches=8, global_batch=64))
    assert m1.bubble_fraction > 0.5 > m8.bubble_fraction and m8.compute_s < m1.compute_s
    fsdp = cm.breakdown(Candidate(fsdp=8, global_batch=64))
    # The step gathers the weights once (compute layout) and reduce-scatters the
    # gradient: on a ring that moves exactly what one all-reduce moves.
    assert fsdp.comm_s["fsdp"] == pytest.approx(big.comm_s["data"])


def test_observed_trials_pull_the_model_to_the_measurements():
    cm = _synthetic_model()
    cands = [Candidate(data=8, global_batch=b, microbatches=m) for b in (8, 16, 32, 64) for m in (1, 2, 4)]
    # "Measured" times from a machine 3x slower with a 20 ms fixed cost per step.
    truth = {c: 3 * cm.features(c)[0] + cm.features(c)[1] + 0.02 for c in cands}
    before = np.mean([abs(cm.step_time(c) / truth[c] - 1) for c in cands])
    for c in cands:
        cm.observe(c, truth[c])
    after = np.mean([abs(cm.step_time(c) / truth[c] - 1) for c in cands])
    assert before > 0.5 and after < 0.1, (before, after)
    assert cm.ridge_used is not None and np.isfinite(cm.ridge_used)  # a fit, chosen over the priors


def test_a_fit_on_a_few_noisy_trials_does_not_chase_the_noise():
    """Trials that are the calibration's prediction times 20% noise carry nothing to learn:
    the leave-one-out ridge keeps the fit near the priors, where the old fixed ridge
    (0.1) chased the noise and predicted unseen layouts worse. Over 8 draws of the noise
    (7 fitted layouts of mixed kinds, 8 held out), the mean held-out median |error|."""
    fit = [Candidate(data=8, global_batch=16), Candidate(data=8, global_batch=64),
           Candidate(data=4, tensor=2, global_batch=16), Candidate(fsdp=8, global_batch=64),
           Candidate(data=2, pipe=4, microbatches=4, global_batch=16),
           Candidate(data=4, pipe=2, microbatches=2, global_batch=64),
           Candidate(data=8, global_batch=16, microbatches=4)]
    held = [Candidate(data=8, global_batch=32, microbatches=m) for m in (1, 2)] + [
        Candidate(data=4, tensor=2, global_batch=32), Candidate(fsdp=8, global_batch=32),
        Candidate(data=2, pipe=4, microbatches=8, global_batch=32),
        Candidate(data=4, pipe=2, microbatches=4, global_batch=32),
        Candidate(data=8, global_batch=32, remat="full"), Candidate(data=2, fsdp=4, global_batch=32)]
    calibration, chosen, fixed = [], [], []
    for seed in range(8):
        rng = np.random.default_rng(seed)
        base = _synthetic_model()
        truth = {c: base.step_time(c) * (1 + 0.2 * rng.standard_normal()) for c in fit + held}

        def held_out_error(model, truth=truth):
            return np.median([abs(model.step_time(c) / truth[c] - 1) for c in held])

        calibration.append(held_out_error(base))
        for ridge, errors in ((None, chosen), (0.1, fixed)):
            model = _synthetic_model()
            model.ridge = ridge
            for c in fit:
                model.observe(c, truth[c])
            errors.append(held_out_error(model))
    calibration, chosen, fixed = np.mean(calibration), np.mean(chosen), np.mean(fixed)
    assert chosen < 0.8 * fixed and chosen < 1.15 * calibration, (calibration, chosen, fixed)


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 1, 2], [5, 5, 9]) == pytest.approx(1.0)


def _tune_on_a_synthetic_machine(monkeypatch, truth, fits=lambda c: True, checked=None, live=None,
                                 logged=None, ran=None, **kw):
    """``tune`` end to end with trials timed by ``truth(candidate)`` (seconds) and a
    candidate feasible where ``fits(candidate)`` (``checked``: a list that collects the
    candidates compiled; ``live``: a ``weakref.WeakSet`` that holds the trials alive;
    ``logged``: a list of the log lines; ``ran``: of the candidates each trial round ran):
    the search's own logic, without compiling anything."""
    from mindpipe_jax.tuner import tune as tune_module
    from mindpipe_jax.tuner.aot import Feasibility

    class SyntheticTrial:
        def __init__(self, cfg, cand, **_):
            self.candidate, self.times = cand, []
            if live is not None:
                live.add(self)

        def run(self, steps, record=True):
            self.times += [truth(self.candidate)] * steps
            if ran is not None:
                ran.append(self.candidate)

        @property
        def median(self):
            return float(np.median(self.times))

    class AllFit:
        hits = misses = 0

        def __init__(self, path=None):
            pass

        def check(self, cfg, cand, budget_bytes, model=None, devices=None, facts=None):
            if checked is not None:
                checked.append(cand)
            if fits(cand):
                return Feasibility(cand, True, peak_bytes=1.0)
            return Feasibility(cand, False, peak_bytes=2.0, reason="over the synthetic budget")

    monkeypatch.setattr(tune_module, "Trial", SyntheticTrial)
    monkeypatch.setattr(tune_module, "FeasibilityCache", AllFit)
    cm = _synthetic_model()
    return tune_module.tune(TINY, hardware=cm.hw, costs=cm.costs,
                            log=(lambda line: None) if logged is None else logged.append, **kw)


def test_kept_trials_are_released_when_the_next_would_not_fit_beside_them(monkeypatch):
    """Each trial is kept for the re-timing rounds; one candidate's peak (1 byte per device
    here) is judged against the budget alone. With room for two at a time, the third
    trial finds the two kept ones released first (their first round stands, they are not
    re-timed), and a trial that cannot fit even then is marked infeasible, not run."""
    import weakref

    from mindpipe_jax.tuner import tune as tune_module

    live = weakref.WeakSet()
    monkeypatch.setattr(tune_module, "room_now", lambda devices: 2.5 - len(live))
    logged = []
    kw = dict(b_noise=40.0, b0=8, global_batches=(8,), axes=("data", "fsdp", "tensor"), microbatches=(1,),
              remats=("none",), rounds=3)
    ran = []
    result = _tune_on_a_synthetic_machine(monkeypatch, lambda c: 0.01 * c.data + 0.001, live=live,
                                          logged=logged, ran=ran, measure=3, **kw)
    measured = [r for r in result.rows if r.measured_s is not None]
    assert len(measured) == 3
    released = [ln for ln in logged if ln.startswith("released the kept trials of ")]
    assert len(released) == 1 and "to make room for" in released[0], logged
    first, second, third = dict.fromkeys(ran)  # in the order they were measured
    assert released[0].startswith(f"released the kept trials of {first.label()}, {second.label()} to make "
                                  f"room for {third.label()}")
    assert ran == [first, second, third, third, third]  # only the kept one re-timed
    # Less room than one trial: nothing measured, every candidate due marked as such.
    monkeypatch.setattr(tune_module, "room_now", lambda devices: 0.5)
    starved = _tune_on_a_synthetic_machine(monkeypatch, lambda c: 0.01, measure=2, **kw)
    assert not any(r.measured_s for r in starved.rows)
    assert any("MiB free when its trial was due" in (r.feasibility.reason if r.feasibility else "")
               for r in starved.rows)


def test_the_tuner_tries_every_batch_in_contention_before_it_decides(monkeypatch):
    """A machine where the calibration is right at B8 and 2.2x too slow at B64 (bigger
    matmuls run faster, as on this CPU): trials at B8 alone confirm the model, so a search
    that only measures its best prediction keeps B8. One trial of B64 (predicted at 0.59x
    B8's entropyput, within ``explore=0.5``) finds it is the best."""
    prior = _synthetic_model()

    def truth(c):
        return prior.step_time(c) * (1.0 if c.global_batch == 8 else 0.45)

    kw = dict(b_noise=40.0, b0=8, global_batches=(8, 64), axes=("data", "tensor"), microbatches=(1,),
              remats=("none",), measure=2)
    greedy = _tune_on_a_synthetic_machine(monkeypatch, truth, explore=0.0, **kw)
    assert {r.candidate.global_batch for r in greedy.rows if r.measured_s} == {8}
    assert greedy.best.candidate.global_batch == 8
    exploring = _tune_on_a_synthetic_machine(monkeypatch, truth, explore=0.5, **kw)
    assert [r.candidate.global_batch for r in exploring.rows if r.measured_s] == [64, 8]
    assert exploring.best.candidate.global_batch == 64
    # A batch predicted far below the best is not worth a trial.
    narrow = _tune_on_a_synthetic_machine(monkeypatch, truth, explore=0.9, **kw)
    assert {r.candidate.global_batch for r in narrow.rows if r.measured_s} == {8}


def test_exploring_a_batch_whose_best_layout_does_not_fit_tries_it_with_more_remat(monkeypatch):
    """As in the test above, B64 runs 2.2x faster than predicted; here nothing fits at B64
    without remat "full" (the memory-bound benchmark's situation). The prediction ranks
    "full" far below "none" (it recomputes the forward), so after the best B64 layout is
    refused the next best predictions are its near twins, refused too. The search tries the
    refused layout's "full" twin next: one refusal, then a B64 trial, which wins."""
    prior = _synthetic_model()

    def truth(c):
        return prior.step_time(c) * (1.0 if c.global_batch == 8 else 0.45)

    def fits(c):
        return c.global_batch == 8 or c.remat == "full"

    checked = []
    result = _tune_on_a_synthetic_machine(
        monkeypatch, truth, fits=fits, checked=checked, b_noise=40.0, b0=8, global_batches=(8, 64),
        axes=("data", "tensor"), microbatches=(1,), remats=("none", "full"), measure=2, max_compile=4)
    b64 = [c for c in checked if c.global_batch == 64]
    assert [c.remat for c in b64[:2]] == ["none", "full"]
    assert b64[1] == dataclasses.replace(b64[0], remat="full")
    measured = [r.candidate for r in result.rows if r.measured_s]
    assert b64[1] in measured
    assert result.best.candidate == b64[1]


@pytest.mark.slow
def test_cost_model_ranks_layouts_it_has_not_run_after_two_trials(tmp_path):
    """What the offline tuner relies on: the calibrated model, refitted on two trials (one
    data-parallel layout, one pipeline), ranks four layouts it has not run on 8 simulated
    devices, in the order measured. Their step times differ by >= 1.3x (B8, a tensor
    layout at B64, B128, a pipeline at B128; measured 98 / 347 / 521 / 1533 ms on an idle
    machine), each the median of 3 interleaved rounds, so a burst of load on this shared
    machine hits all of them. Without the trials the model under-predicts these
    pipelines 2-3x (a tick's bookkeeping is not in the micro-benchmarks) and puts the
    pipeline at B128 before data parallelism at B128 (599.9 vs 600.7 ms predicted): the
    calibration alone ranked the old six-layout set right in some runs (Spearman 0.77)
    and not in others (0.54), so that is not what this asserts."""
    cfg = TINY.replace("model.d_model=64", "model.n_layers=4", "model.n_heads=4", "model.seq_len=32")
    costs = ModelCosts.measure(cfg)
    # Calibrated here, cached under tmp_path: not in the user's cache, where a calibration
    # measured under the test suite's load would mislead every later tune and benchmark.
    cm = CostModel(costs, Hardware.calibrate(cache_dir=tmp_path), cfg.model.seq_len)
    seen = [Candidate(data=8, global_batch=32), Candidate(data=2, pipe=4, microbatches=4, global_batch=32)]
    held_out = [Candidate(data=8, global_batch=8), Candidate(data=4, tensor=2, global_batch=64),
                Candidate(data=8, global_batch=128),
                Candidate(data=2, pipe=4, microbatches=8, global_batch=128)]
    trials = [Trial(cfg, c, warmup=1) for c in seen + held_out]
    for _ in range(3):
        for trial in trials:
            trial.run(3)
    for c, trial in zip(seen, trials, strict=False):
        cm.observe(c, trial.median)
    predicted = [cm.step_time(c) for c in held_out]
    measured = [trial.median for trial in trials[len(seen):]]
    rho = spearman(predicted, measured)
    print("\n".join(f"{c.label():40s} predicted {p * 1e3:7.1f} ms measured {m * 1e3:7.1f} ms"
                    for c, p, m in zip(held_out, predicted, measured, strict=True)) + f"\nspearman {rho:.2f}")
    assert rho == pytest.approx(1.0), rho


# ---------------------------------------------------------------- the CLI
def test_mindpipe_tune_prints_a_ranked_table_and_draws_it(tmp_path, capsys):
    out, table = tmp_path / "landscape.png", tmp_path / "tune.json"
    code = main(["tune", "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.seq_len=16",
                 "--batches", "8,16", "--axes", "data,tensor", "--microbatches", "1",
                 "--remat", "none", "--b-noise", "24", "--max-compile", "2", "--measure", "1",
                 "--trial-steps", "2", "--out", str(out), "--json", str(table)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "entropyput" in text and "measured" in text and "best: " in text
    # Without --budget-mb the budget is what a device holds: here the host's free memory over 8.
    budget = re.search(r"^memory budget: ([\d,]+) MiB per device \(this host's [\d.]+ GiB free, shared by 8 "
                       r"devices; --budget-mb sets another\)$", text, re.M)
    assert budget and 0 < int(budget[1].replace(",", "")) < 2**20, text[:500]
    rows = json.loads(table.read_text())["rows"]
    assert len(rows) == 4  # (d8, d4 t2; tensor 4 and 8 exceed n_heads=2) x 2 batches
    first = rows[0]
    assert first["measured_s"] > 0 and first["fits"] and first["peak_bytes"] > 0
    # efficiency(B) = (B_noise + b0) / (B_noise + B) with b0 = the smallest batch
    for r in rows:
        b = r["candidate"]["global_batch"]
        assert r["efficiency"] == pytest.approx((24 + 8) / (24 + b))
    assert out.stat().st_size > 10_000


@pytest.mark.parametrize("args, message", [
    (["--batches", "0,8"], "--batches must be a comma-separated list of integers >= 1"),
    (["--axes", "data,tensr"], "--axes='data,tensr': tensr not valid"),
    (["--b-noise", "-3"], "--b-noise must be 'auto' or a number > 0"),
    (["--budget-mb", "lots"], "--budget-mb must be a number > 0"),
    (["--measure", "x"], "--measure must be an integer >= 0"),
    (["--out", "/nonexistent/dir/x.png"], "/nonexistent/dir"),
    (["--json", "/nonexistent/dir/x.json"], "--json '/nonexistent/dir/x.json': directory"),
    # Options the rest of the command line leaves without effect: refused, not ignored.
    (["--measure", "0", "--trial-steps", "3"], "--trial-steps 3 times the measured candidates, and "
                                               "--measure 0 measures none"),
    (["--batches", "8,16", "--b-noise", "24", "--probe-steps", "5"],
     "--probe-steps 5 sizes the noise probe, which runs only with --b-noise auto and several --batches, "
     "and --b-noise 24 is given"),
    (["--probe-steps", "5"], "and one batch is considered; drop --probe-steps"),
    (["--axes", "data,tensor", "--schedules", "zb-h1"], "--schedules zb-h1 applies to pipeline layouts, and "
                                                        "--axes data,tensor does not vary pipe"),
    # Keys the tuned run would not read: the supernet section of a dense tune, and what a
    # supernet run does not build with (a dense supernet was tuned, silently).
    (["supernet.subnets_per_step=8"], "supernet.subnets_per_step=8 has no effect on `mindpipe tune`"),
    (["--supernet", "model.n_experts=4"], "model.n_experts=4 has no effect on a supernet run"),
    (["--supernet", "data.val_fraction=0"], "data.val_fraction=0 leaves no validation data"),
    # A setting no layout can run: its reason given whole (it was cut at 60 characters).
    (["model.dtype=float16"], "(model.dtype=float16 does not compile on CPU devices (XLA's CPU matmuls take "
                              "no float16 inputs with float32 accumulation); use model.dtype=bfloat16 or "
                              "float32)"),
    # Layout keys every row sets for itself: the given value was replaced without a word.
    (["parallel.data=2"], "parallel.data=2 is what mindpipe tune chooses for each row, from --axes (axes "
                          "left out of --axes stay 1); drop it, and set the choices with --axes"),
    (["model.remat=full"], 'model.remat="full" is what mindpipe tune chooses for each row, from --remat'),
    # Every layout was refused for it, and the message named one layout's reason.
    (["--axes", "data,subnet"], "--axes data,subnet: the subnet axis trains a supernet's subnets side by "
                                "side; tune a supernet job with --supernet"),
    (["--batches", "16", "train.global_batch=8"], "train.global_batch=8 is what mindpipe tune chooses"),
])
def test_mindpipe_tune_bad_input_is_one_line_and_exit_2(args, message, capsys, tmp_path):
    assert main(["tune", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not any(tmp_path.iterdir())


def test_tune_outputs_are_not_written_over_each_other_or_over_a_file_that_is_no_cache(capsys, tmp_path):
    """`--cache config.toml` replaced the user's file with the cache (a file that did not
    parse was taken for a damaged cache), and `--json x --cache x` or `--out x.png --json
    x.png` wrote one output over the other."""
    mine = tmp_path / "mine.toml"
    mine.write_text("[model]\nd_model = 64\n")
    other = tmp_path / "other.json"
    other.write_text('{"rows": [1, 2]}')
    cases = {
        ("--cache", str(mine)): f"tuner cache '{mine}' holds something other than the compiled-memory",
        ("--cache", str(other)): f"tuner cache '{other}' holds something other than",
        ("--json", str(tmp_path / "a.json"), "--cache", str(tmp_path / "a.json")):
            f"--json and --cache name the same file '{tmp_path / 'a.json'}'; give each its own",
        ("--out", str(tmp_path / "a.png"), "--json", str(tmp_path / "." / "a.png")):
            "--out and --json name the same file",
    }
    for args, message in cases.items():
        assert main(["tune", "--measure", "0", *args]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
    assert mine.read_text() == "[model]\nd_model = 64\n" and other.read_text() == '{"rows": [1, 2]}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.toml", "other.json"]


_SMALL_TUNE = ["tune", "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.seq_len=16",
               "--batches", "8", "--axes", "data,tensor", "--microbatches", "1", "--remat", "none",
               "--b-noise", "24", "--max-compile", "1", "--measure", "1"]


def _tune_refused(args: list[str], capsys) -> tuple[str, str]:
    """(stdout, the one error line) of a small `mindpipe tune` that must end in no best."""
    code = main([*_SMALL_TUNE, *args])
    captured = capsys.readouterr()
    assert code == 2 and "best" not in captured.out, captured.out
    err = captured.err.strip()
    assert len(err.splitlines()) == 1, err
    return captured.out, err


def test_no_layout_fitting_the_budget_is_an_error_not_a_best(capsys):
    # Before: every compiled layout refused, the best *prediction* (never compiled) was
    # printed as "best: ... -> overrides", a layout that did not fit the budget either.
    # 0.3 MiB: above the layouts' floors (~0.1 MiB), below what they compile to (~0.6).
    _, err = _tune_refused(["--budget-mb", "0.3"], capsys)
    assert re.search(r"tune: none of the 1 layouts checked could run \(the lightest, .* needs [\d.]+ "
                     r"MiB per device against 0.3 MiB\); the rest were not checked: raise --max-compile "
                     r"\(now 1\)", err), err


def test_layouts_below_their_memory_floor_are_refused_without_compiling(capsys, monkeypatch):
    """``mindpipe tune --batches 1048576`` compiled layouts for over 5 minutes each (XLA's
    constant folding) before refusing them; a layout whose measured floor (a microbatch's
    hidden state and gradient, the parameter shard) exceeds the budget is refused without
    a compile, so every layout is judged, not only --max-compile of them."""
    from mindpipe_jax.tuner import aot

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled a layout whose floor exceeds the budget")

    monkeypatch.setattr(aot, "compile_candidate", no_compile)
    out, err = _tune_refused(["--budget-mb", "0.001"], capsys)
    assert re.search(r"^mindpipe: error: tune: none of the 2 layouts checked could run \(the lightest, "
                     r"d4 t2 .* needs at least 0.0\d+ MiB per device against 0.001 MiB\); try smaller "
                     r"--batches, more --microbatches, or a larger --budget-mb$", err), err
    assert "needs at least" in out and "budget 0.001 MiB" in out


def test_an_unmeasured_row_predicted_well_ahead_of_the_choice_is_named():
    """The choice is the best measured row; an unmeasured one predicted more than 10% ahead
    of it is named (``mindpipe tune`` prints it with the --measure to raise), one within
    10% or known infeasible is not."""
    from types import SimpleNamespace

    from mindpipe_jax.tuner.aot import Feasibility
    from mindpipe_jax.tuner.tune import Row, TuneResult

    def row(batch, predicted_s, measured_s=None, fits=None):
        cand = Candidate(data=8, global_batch=batch)
        feasibility = None if fits is None else Feasibility(cand, fits)
        return Row(cand, SimpleNamespace(step_s=predicted_s), 1.0, feasibility, measured_s)

    chosen = row(32, 0.010, measured_s=0.010)  # 3200 samples/s measured
    for ahead_s, infeasible, named in ((0.008, False, True), (0.0095, False, False), (0.008, True, False)):
        other = row(32, ahead_s, fits=False if infeasible else None)
        result = TuneResult([chosen, other], None, None, None, 32)
        assert (result.unmeasured_ahead() is other) == named, (ahead_s, infeasible)
    assert TuneResult([row(32, 0.010), row(32, 0.001)], None, None, None, 32).unmeasured_ahead() is None
