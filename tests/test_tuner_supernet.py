"""EPara for supernet jobs (tuner/supernet.py): the space and its rejections, the choice under
the objective, real trials, and ``mindpipe tune --supernet``."""

import json

import pytest

import mindpipe_jax as mp
from mindpipe_jax.cli import main
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.supernet import train_supernet
from mindpipe_jax.tuner.supernet import (
    Measurement,
    SupernetCandidate,
    enumerate_supernet_space,
    measurement_order,
    tune_supernet,
)

TINY = ("model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.seq_len=32",
        'data.source="synthetic"', "data.synthetic_tokens=65536", "train.steps=100", "train.global_batch=16",
        "parallel.subnet=1", "parallel.data=8", "parallel.simulate_cpu_devices=0",
        "supernet.subnets_per_step=4", "supernet.ladder_levels=0")


def tiny(*more: str) -> mp.Config:
    return mp.Config().replace(*TINY, *more)


# --- the space --------------------------------------------------------------------------------------


def test_rejections_are_the_errors_the_real_run_raises():
    cfg = tiny()
    valid, rejected = enumerate_supernet_space(cfg, 8, ks=(1, 2, 4, 8), widths=(1, 2), batches=(16, 12))
    assert len(valid) + len(rejected) == 4 * 4 * 2 * 2  # subnet in 1, 2, 4, 8
    reasons = {why for _, why in rejected}
    # Each kind of rule that a candidate can break is met, and no valid candidate breaks one.
    assert any("the sandwich strategy needs >= 2" in r for r in reasons)  # Config validation
    assert any("must be divisible by parallel.subnet x supernet.vmap_width" in r for r in reasons)
    assert any("train.global_batch=12 must be divisible by train.virtual_shards=8" in r for r in reasons)
    assert all(c.global_batch == 16 and c.subnets_per_step % (c.subnet * c.vmap_width) == 0 for c in valid)
    # The reason is what train_supernet itself raises for that candidate (it fails before any
    # compile: the layout is checked first).
    for cand, why in rejected[::5]:
        with pytest.raises(ConfigError) as err:
            train_supernet(config=cand.apply(cfg), search=False, log=None)
        assert str(err.value) == why, cand


def test_axes_spara_does_not_use_reject_every_layout_with_that_reason():
    valid, rejected = enumerate_supernet_space(tiny("parallel.pipe=2"), 8, ks=(4,), widths=(1,))
    assert not valid
    assert {why for _, why in rejected} == {
        "supernet training splits devices over parallel.subnet, fsdp, data and tensor only; got pipe=2; "
        "set parallel.pipe=1"}
    assert sorted(c.devices for c, _ in rejected) == [4] * 3  # pipe keeps half the devices
    with pytest.raises(ConfigError, match="no candidate layout runs this supernet job; e.g. s1 d4"):
        tune_supernet(tiny("parallel.pipe=2"), 8, measure_fn=_never, ks=(4,), widths=(1,))


def _never(cand):
    raise AssertionError(f"measured {cand}")


def test_measurement_order_starts_with_the_config_and_alternates_statistics():
    valid, _ = enumerate_supernet_space(tiny(), 8, ks=(2, 4, 8), widths=(1,))
    current = SupernetCandidate(1, 8, 4, 1, 16)
    order = measurement_order(valid, current)
    assert order[0] == current and sorted(order) == sorted(valid)
    # After the config's own: the other classes (K 2, 8) before a second layout of K=4.
    assert {c.subnets_per_step for c in order[1:3]} == {2, 8}
    # Within a class, fewest rounds per step first.
    k8 = [c for c in order if c.subnets_per_step == 8]
    assert [c.rounds for c in k8] == sorted(c.rounds for c in k8)


# --- the choice --------------------------------------------------------------------------------------


def test_objective_is_loss_drop_per_second_of_training():
    m = Measurement(step_s=0.05, loss_start=5.0, loss_end=4.0, steps=40)
    assert m.progress_per_s == pytest.approx(1.0 / (40 * 0.05))


def test_the_pick_is_the_best_measured_under_the_objective_not_the_fastest():
    cfg = tiny()
    seen = []

    def fake(cand: SupernetCandidate) -> Measurement:
        # Fewer rounds and more data devices are faster; a larger K drops the loss further
        # per step. K=2 is the fastest but learns too little; the best is in the middle.
        seen.append(cand)
        step_s = 0.01 * cand.rounds + 0.002 * cand.subnets_per_step + 0.001 * cand.subnet
        drop = {2: 0.2, 4: 1.0, 8: 1.3}[cand.subnets_per_step]
        return Measurement(step_s, 5.0, 5.0 - drop, 10)

    result = tune_supernet(cfg, 8, measure_fn=fake, measure=6, ks=(1, 2, 4, 8), widths=(1, 2))
    assert len(seen) == 6 and seen[0] == SupernetCandidate(1, 8, 4, 1, 16)  # the config's own first
    measured = [r for r in result.rows if r.measurement is not None]
    assert [r.candidate for r in measured] == sorted(seen, key=lambda c: -fake_rate(c, fake))
    best = result.best
    assert best.measurement.progress_per_s == max(r.measurement.progress_per_s for r in measured)
    fastest = min(measured, key=lambda r: r.measurement.step_s)
    assert best.candidate != fastest.candidate and best.candidate.subnets_per_step == 4
    # Not measured (valid), then rejected with reasons, in that order.
    tail = result.rows[len(measured):]
    kinds = [r.reason is not None for r in tail]
    assert kinds == sorted(kinds) and any(kinds) and not all(kinds)
    table = result.table()
    assert "the config's own" in table and "rejected: supernet.subnets_per_step=1" in table
    assert json.loads(result.to_json())["rows"][0]["overrides"] == best.candidate.overrides()


def fake_rate(cand, fake):
    return fake(cand).progress_per_s


class Retimed:
    """A fake trial whose first timing was taken under load: K=2 looks slow until re-timed."""

    def __init__(self):
        self.calls, self.closed = [], False

    def __call__(self, cand):
        self.calls.append(("trial", cand))
        slow = 0.5 if cand.subnets_per_step == 2 else 0.0
        times = (0.1 + slow, 0.1 + slow, 0.1 + slow)
        return Measurement(0.1 + slow, 5.0, 4.0, 10, times)

    def retime(self, cand):
        self.calls.append(("retime", cand))
        return [0.05] * 4 if cand.subnets_per_step == 2 else [0.1] * 4

    def close(self):
        self.closed = True


def test_a_config_layout_left_out_of_the_candidates_is_said():
    """--subnets-per-step without the config's K: the table had no row to compare against
    and said nothing. The config's K=4 with W 1 and batch 16 here."""
    lines = []
    result = tune_supernet(tiny(), 8, measure_fn=Retimed(), measure=1, ks=(2,), widths=(1,), rounds=1,
                           log=lines.append)
    assert result.current is None
    assert lines[0] == ("the config's own layout s1 d8 | K4 W1 | B16 is not among the candidates: list its "
                        "K, W and batch in --subnets-per-step, --vmap-widths and --batches to compare "
                        "against it"), lines
    lines.clear()
    tune_supernet(tiny(), 8, measure_fn=Retimed(), measure=1, ks=(2, 4), widths=(1,), rounds=1,
                  log=lines.append)
    assert not any("config's own layout" in line for line in lines), lines


def test_retiming_passes_come_after_every_trial_and_enter_the_median():
    fake = Retimed()
    result = tune_supernet(tiny(), 8, measure_fn=fake, measure=2, ks=(2, 4), widths=(1,), rounds=3)
    kinds = [kind for kind, _ in fake.calls]
    assert kinds == ["trial", "trial", "retime", "retime", "retime", "retime"] and fake.closed
    best = result.best
    assert best.candidate.subnets_per_step == 2  # only after re-timing: 0.6 s at first
    assert len(best.measurement.step_times) == 3 + 2 * 4 and best.measurement.step_s == 0.05
    once = tune_supernet(tiny(), 8, measure_fn=Retimed(), measure=2, ks=(2, 4), widths=(1,), rounds=1)
    assert once.best.candidate.subnets_per_step == 4


class Timed:
    """A fake trial that can also only time a candidate: a class's later candidates must be
    timed, not trained to the panel, and borrow the class's loss drop."""

    def __init__(self):
        self.calls = []

    def step_s(self, cand):
        return 0.01 * cand.rounds + 0.001 * cand.subnet

    def __call__(self, cand):
        self.calls.append(("trial", cand))
        drop = {2: 0.3, 4: 1.0}[cand.subnets_per_step]
        return Measurement(self.step_s(cand), 5.0, 5.0 - drop, 10, (self.step_s(cand),) * 5)

    def time_only(self, cand):
        self.calls.append(("time", cand))
        return [self.step_s(cand)] * 3


def test_a_class_loss_drop_is_measured_once_and_its_other_layouts_only_timed():
    fake = Timed()
    result = tune_supernet(tiny(), 8, measure_fn=fake, measure=5, ks=(2, 4), widths=(1,), rounds=1)
    trials = [c for kind, c in fake.calls if kind == "trial"]
    timed = [c for kind, c in fake.calls if kind == "time"]
    # One trial per (K, batch) class, the first candidate of each; every later one timed.
    assert len(fake.calls) == 5 and sorted(c.statistics for c in trials) == [(2, 16), (4, 16)]
    assert {c.statistics for c in timed} <= {c.statistics for c in trials} and len(timed) == 3
    rows = {r.candidate: r.measurement for r in result.rows if r.measurement is not None}
    for cand in timed:
        m, trial = rows[cand], next(t for t in trials if t.statistics == cand.statistics)
        # its own step time, its class's drop over its class's trial steps
        assert m.step_s == fake.step_s(cand) and m.step_times == (fake.step_s(cand),) * 3
        assert (m.loss_start, m.loss_end, m.steps) == (5.0, rows[trial].loss_end, 10)
        assert m.loss_from == trial.label() and rows[trial].loss_from is None
        assert m.progress_per_s == pytest.approx((5.0 - m.loss_end) / (10 * fake.step_s(cand)))
    assert f"loss drop of {trials[0].label()} (same K, batch)" in result.table()
    assert json.loads(result.to_json())["rows"][0]["measurement"].keys() >= {"loss_from", "progress_per_s"}
    # A measure function that cannot only time runs every candidate's trial, as before.
    plain = Retimed()
    tune_supernet(tiny(), 8, measure_fn=plain, measure=3, ks=(4,), widths=(1,), rounds=1)
    assert [kind for kind, _ in plain.calls] == ["trial"] * 3


def test_a_trial_too_large_for_memory_is_skipped_and_the_next_measured_in_its_place():
    """A trial's step is checked before it runs (the trainer's check): one that cannot fit
    is a row with the reason, and the next candidate in order is measured instead (it was
    the kernel's SIGKILL of the whole tuner)."""
    from mindpipe_jax.train.memory_fit import DoesNotFit

    seen = []

    def fake(cand):
        seen.append(cand)
        if cand.subnet == 1:  # every device runs its subnets whole: the most activations
            raise DoesNotFit("the train step needs 9.0 GiB of memory (...)", "lower train.global_batch")
        return Measurement(0.01 * cand.rounds, 5.0, 4.0, 10)

    result = tune_supernet(tiny(), 8, measure_fn=fake, measure=2, ks=(4,), widths=(1,))
    measured = [r for r in result.rows if r.measurement is not None]
    assert len(measured) == 2 and all(r.candidate.subnet > 1 for r in measured)
    assert seen[0].subnet == 1 and len(seen) == 3  # the config's own first: refused, then two more
    refused = [r for r in result.rows if r.reason and r.reason.startswith("does not fit in memory")]
    assert [r.candidate for r in refused] == [seen[0]]
    assert "rejected: does not fit in memory: the train step needs 9.0 GiB" in result.table()

    def never_fits(cand):
        raise DoesNotFit("the train step needs 9.0 GiB of memory (...)", "lower train.global_batch")

    with pytest.raises(ConfigError, match=r"no candidate layout of this supernet job fits in memory; e\.g\. "
                                          r"s1 d8 \| K4 W1 \| B16: does not fit in memory: the train step"):
        tune_supernet(tiny(), 8, measure_fn=never_fits, measure=2, ks=(4,), widths=(1,))


# --- real trials and the command line ----------------------------------------------------------------


def test_mindpipe_tune_supernet_with_no_layout_that_fits_is_one_line(tmp_path, capsys, monkeypatch):
    """Every trial's step checked before it runs: here ~TBs each, where the first trial
    was the kernel's SIGKILL."""
    monkeypatch.chdir(tmp_path)
    code = main(["tune", "--supernet", *TINY, "--subnets-per-step", "4", "--vmap-widths", "1",
                 "model.seq_len=4096", "train.global_batch=2048", "data.synthetic_tokens=16777216"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "no candidate layout of this supernet job fits in memory; e.g. s1 d8 | K4 W1 | B2048: does not " \
           "fit in memory: the train step needs" in err and "GiB free: it would be killed for it" in err, err
    assert not any(tmp_path.iterdir())


def test_mindpipe_tune_supernet_measures_real_steps_and_writes_the_pick(tmp_path, capsys):
    out = tmp_path / "sn.json"
    # Learnable text (the synthetic tokens are random) and a short warm-up, so that 8 steps
    # lower the search-validation loss.
    learnable = [o for o in TINY if not o.startswith("data.")] + ["optim.warmup_steps=2"]
    code = main(["tune", "--supernet", *learnable, "--subnets-per-step", "4", "--vmap-widths", "1",
                 "--measure", "2", "--trial-steps", "8", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "progress/s" in text and "rejected: " in text and "best: " in text
    data = json.loads(out.read_text())
    rows = [r for r in data["rows"] if r["measurement"] is not None]
    assert len(rows) == 2 and data["current"] == {"subnet": 1, "data": 8, "subnets_per_step": 4,
                                                  "vmap_width": 1, "global_batch": 16}
    for r in rows:
        m = r["measurement"]
        assert m["step_s"] > 0 and m["steps"] == 8 and m["loss_end"] < m["loss_start"]
        assert len(m["step_times"]) == 2 * (8 - 5)  # the trial's (or timing's) steps, then one re-timing pass
    # Both are K=4 on another split of the devices: SPara trains the same bits, so the second
    # is only timed and takes the first's search-validation loss drop; the time decides.
    own = [r for r in rows if r["measurement"]["loss_from"] is None]
    borrowed = [r for r in rows if r["measurement"]["loss_from"] is not None]
    assert len(own) == 1 and len(borrowed) == 1 and own[0]["candidate"] == data["current"]
    assert borrowed[0]["measurement"]["loss_end"] == own[0]["measurement"]["loss_end"]
    assert "(same K, batch)" in text
    assert rows[0]["measurement"]["step_s"] <= rows[1]["measurement"]["step_s"]
    best = " ".join(rows[0]["overrides"])
    assert text.strip().splitlines()[-2].endswith(best) and f"wrote {out}" in text


@pytest.mark.parametrize("args, message", [
    (["--supernet", "--axes", "data"], "--axes applies to dense jobs only, not with --supernet"),
    (["--supernet", "--b-noise", "20"], "--b-noise applies to dense jobs only"),
    (["--vmap-widths", "1,2"], "--vmap-widths applies to supernet jobs only; add --supernet"),
    (["--supernet", "--subnets-per-step", "0,4"], "--subnets-per-step must be a comma-separated list"),
    (["--supernet", "--measure", "0"], "--measure must be an integer >= 1"),
    (["--supernet", "--trial-steps", "3"], "--trial-steps must be an integer >= 6"),
    (["--supernet", "--json", "/nonexistent/dir/x.json"], "--json '/nonexistent/dir/x.json': directory"),
    (["--supernet", "parallel.pipe=2", "parallel.data=4"],
     "no candidate layout runs this supernet job; e.g. s1 d4 | K2 W1 | B16: supernet training splits"),
    (["--supernet", "supernet.subnets_per_step=0"], "supernet.subnets_per_step"),
])
def test_mindpipe_tune_supernet_bad_input_is_one_line_and_exit_2(args, message, capsys, tmp_path,
                                                                 monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["tune", *TINY, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not any(tmp_path.iterdir())


def test_fsdp_and_tensor_keep_their_devices_and_the_rest_is_split():
    """SPara runs with fsdp and tensor: the candidates split what they leave (8 / (2 x 2) = 2
    devices) between subnet and data, and every one of them is valid."""
    valid, rejected = enumerate_supernet_space(tiny("parallel.fsdp=2", "parallel.tensor=2"), 8, ks=(4,),
                                               widths=(1,))
    assert sorted((c.subnet, c.data) for c in valid) == [(1, 2), (2, 1)], rejected
