"""mindpipe_jax.train end to end: learning, bitwise resume, restore onto another mesh."""

import json
import re
import shutil
import struct
from pathlib import Path

import jax
import numpy as np
import pytest

import mindpipe_jax as mp
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.train.checkpoint import Checkpointer
from mindpipe_jax.train.state import abstract_train_state, make_optimizer, model_spec

TINY = ("model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.seq_len=32",
        "train.global_batch=16", "train.progress=false", "train.tensorboard=false",
        "train.eval_batches=2", "optim.warmup_steps=2", "parallel.simulate_cpu_devices=0")


def run(tmp_path, *overrides, name="run"):
    return mp.train(None, None, mp.Config(), *TINY, f"train.out_dir={tmp_path / name}", *overrides)


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def assert_bitwise(a, b):
    for x, y in zip(leaves(a), leaves(b), strict=True):
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes()


def test_stdlib_training_reduces_loss_and_writes_metrics(tmp_path, capsys):
    result = run(tmp_path, "train.steps=40", "train.eval_every=20", "train.log_every=10",
                 "optim.lr=1e-2", "train.tensorboard=true")
    compile_s = float(re.search(r"compiled step in ([\d.]+)s", capsys.readouterr().out)[1])
    evals = [h["val_loss"] for h in result.history if "val_loss" in h]
    assert len(evals) == 2 and evals[-1] < 3.6 < np.log(256), evals  # ln 256 = 5.55 nats/byte
    lines = [json.loads(x) for x in (result.out_dir / "metrics.jsonl").read_text().splitlines()]
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "train_s"} <= set(lines[0])
    assert 0 < lines[0]["train_s"] < lines[-1]["train_s"]  # cumulative, evaluation and saving excluded
    assert lines[0]["train_s"] >= compile_s - 0.05  # the first compile counts (done before the loop)
    assert any((result.out_dir / "tensorboard").iterdir())
    assert (result.checkpoint_dir / "40").is_dir()


def test_a_value_not_measured_this_step_is_null_and_left_out_of_tensorboard(tmp_path, caplog):
    """NaN marks a metric a step did not measure (the noise statistics between their
    steps); TensorBoard warned once per NaN written, every log line of a tuned run."""
    from mindpipe_jax.train.metrics import MetricsWriter

    writer = MetricsWriter(tmp_path, tensorboard=True, enabled=True)
    with caplog.at_level("WARNING"):
        writer.write(1, {"loss": 2.5, "b_noise": float("nan"), "grad_norm": np.float32(0.5), "note": "x"})
    writer.close()
    assert not [r for r in caplog.records if "NaN" in r.getMessage()], caplog.text
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert record == {"step": 1, "loss": 2.5, "b_noise": None, "grad_norm": 0.5, "note": "x"}


def _tensorboard_scalars(log_dir: Path, tag: str) -> dict[int, float]:
    """``tag``'s scalars as TensorBoard shows them: the event files read in the order
    they were written, a START session log at step s hiding what came before it at
    steps >= s (its purge)."""
    from tensorboardX.proto.event_pb2 import Event, SessionLog

    events = []
    for path in log_dir.iterdir():
        raw, at, found = path.read_bytes(), 0, []
        while at < len(raw):  # TFRecords: length (u64), its CRC, the bytes, their CRC
            (length,) = struct.unpack("<Q", raw[at:at + 8])
            found.append(Event.FromString(raw[at + 12:at + 12 + length]))
            at += 12 + length + 4
        events += found
    shown: dict[int, float] = {}
    for event in sorted(events, key=lambda e: e.wall_time):
        if event.HasField("session_log") and event.session_log.status == SessionLog.START:
            shown = {s: v for s, v in shown.items() if s < event.step}
        for value in event.summary.value:
            if value.tag == tag:
                shown[event.step] = value.simple_value
    return shown


def test_tensorboard_after_a_resume_shows_each_step_once(tmp_path):
    """A run killed at step 6 after its checkpoint at 3, resumed: TensorBoard showed the
    killed attempt's steps 4-6 beside the resumed ones (two curves from the checkpoint
    on), while metrics.jsonl dropped them. (Resumed within the same second, as here,
    the second event file truncated the first: tensorboardX names them by the second.)"""
    from mindpipe_jax.train.metrics import MetricsWriter

    killed = MetricsWriter(tmp_path, tensorboard=True, enabled=True)
    for step in range(1, 7):
        killed.write(step, {"loss": 10.0 + step})
    killed.close()
    resumed = MetricsWriter(tmp_path, tensorboard=True, enabled=True, resume_step=3)
    for step in range(4, 8):
        resumed.write(step, {"loss": 20.0 + step})
    resumed.close()
    expected = {1: 11.0, 2: 12.0, 3: 13.0, 4: 24.0, 5: 25.0, 6: 26.0, 7: 27.0}
    assert _tensorboard_scalars(tmp_path / "tensorboard", "loss") == expected
    logged = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {r["step"]: r["loss"] for r in logged} == expected


def test_resume_is_bitwise_identical(tmp_path):
    common = ("train.steps=6", "train.checkpoint_every=3", "train.eval_every=3", "train.log_every=3",
              "model.dropout=0.1", "parallel.data=4", "parallel.tensor=2")
    full = run(tmp_path, *common)
    # Forget the final checkpoint: resuming must redo steps 4..6 from step 3's state,
    # data-iterator position and RNG, and land on the same bits.
    shutil.rmtree(full.checkpoint_dir / "6")
    resumed = run(tmp_path, *common, "train.resume=true")
    assert int(resumed.state["step"]) == 6
    assert_bitwise(full.state["params"], resumed.state["params"])
    assert_bitwise(full.state["opt"], resumed.state["opt"])
    assert resumed.history[-1]["loss"] == full.history[-1]["loss"]


def test_resume_auto_starts_fresh_or_continues(tmp_path):
    common = ("train.steps=4", "train.checkpoint_every=2", "train.eval_every=0", "train.log_every=2")
    fresh = run(tmp_path, *common, name="plain")
    # An empty out_dir: "auto" starts a new run (train.resume=true would refuse it).
    with pytest.raises(ConfigError, match="nothing to resume"):
        run(tmp_path, *common, "train.resume=true", name="auto")
    auto = run(tmp_path, *common, "train.resume=auto", name="auto")
    assert_bitwise(fresh.state, auto.state)
    # A requeued job: the same command continues from the newest complete checkpoint.
    shutil.rmtree(auto.checkpoint_dir / "4")
    again = run(tmp_path, *common, "train.resume=auto", name="auto")
    assert [h["step"] for h in again.history] == [4]
    assert_bitwise(fresh.state, again.state)
    # Finished: a requeued job that is done succeeds without training or writing.
    done = run(tmp_path, *common, "train.resume=auto", name="auto")
    assert done.already_complete and done.step == 4 and done.history == []
    assert_bitwise(fresh.state, done.state)


def test_a_fresh_start_drops_the_metrics_of_an_attempt_that_never_saved(tmp_path):
    common = ("train.steps=3", "train.eval_every=0", "train.log_every=1")
    first = run(tmp_path, *common)
    shutil.rmtree(first.checkpoint_dir)  # as if killed before its first checkpoint
    second = run(tmp_path, *common, "train.resume=auto")
    steps = [json.loads(x)["step"] for x in (second.out_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_restore_onto_a_different_mesh(tmp_path):
    first = run(tmp_path, "train.steps=3", "train.eval_every=0", "parallel.data=2", "parallel.fsdp=4",
                "train.checkpoint_every=3")
    cfg = mp.Config().replace(*TINY, "parallel.data=8")
    mesh = mp.make_mesh(cfg.parallel)
    spec, _ = model_spec(lambda r: mp.GPT(cfg.model, rngs=r), mesh, seed=0)
    tx = make_optimizer(cfg.optim, cfg.train.steps, spec.decay_mask)
    ckpt = Checkpointer(first.checkpoint_dir)
    state, data_state, meta = ckpt.restore(3, abstract_train_state(spec, tx, mesh))
    ckpt.close()
    assert_bitwise(first.state, state)
    w = state["params"]["blocks"]["mlp"]["w_in"]
    # Was split 4 ways over fsdp; on data=8 every device holds the whole weight.
    assert w.sharding.mesh.shape["data"] == 8 and w.sharding.shard_shape(w.shape) == w.shape
    assert first.state["params"]["blocks"]["mlp"]["w_in"].sharding.shard_shape(w.shape)[1] == w.shape[1] // 4
    assert meta["step"] == 3 and data_state
    # And the loop continues on the new mesh.
    more = run(tmp_path, "train.steps=5", "train.eval_every=0", "parallel.data=8", "train.resume=true")
    assert int(more.state["step"]) == 5


def test_existing_run_needs_resume_and_same_model(tmp_path):
    run(tmp_path, "train.steps=2", "train.eval_every=0")
    before = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    with pytest.raises(ConfigError, match="train.resume=true"):
        run(tmp_path, "train.steps=4", "train.eval_every=0")
    with pytest.raises(ConfigError, match="different model"):
        run(tmp_path, "train.steps=4", "train.eval_every=0", "model.d_model=64", "train.resume=true")
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == before


def test_grad_accumulation_matches_one_big_batch(tmp_path):
    one = run(tmp_path, "train.steps=2", "train.eval_every=0", name="a")
    acc = run(tmp_path, "train.steps=2", "train.eval_every=0", "train.grad_accum=2", name="b")
    for x, y in zip(leaves(one.state["params"]), leaves(acc.state["params"]), strict=True):
        np.testing.assert_allclose(x, y, rtol=2e-4, atol=2e-6)
