"""Reliability: killed and preempted runs resume to the same bits; non-finite steps.

* SIGKILL at a random step after a checkpoint, then ``--resume``: the final
  parameters and optimizer state are bitwise those of an uninterrupted run (a
  dense data x tensor mesh with dropout, a 2-stage 1F1B pipeline, and the same
  pipeline with data=2 x tensor=2 inside each stage and 4 microbatches). Step
  directories an interrupted save could leave (orbax's temporary directory, a
  step without the commit marker) are never loaded, and are cleared.
* SIGTERM / SIGINT: the loop finishes the step, saves, exits 0 saying where;
  ``--resume`` continues to the same bits.
* A non-finite loss stops the run with one line naming the step and the first
  parameter with a non-finite gradient, leaving the checkpoints as they were;
  ``train.nonfinite=skip`` leaves bad updates out inside the compiled step.

The children run ``python -m mindpipe_jax`` (see ``cli_procs.py``); they share a
persistent compilation cache, so only the first run of a layout compiles.
"""

from __future__ import annotations

import hashlib
import json
import random
import signal
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from cli_procs import Train, cli_env, kill_after_first_commit, plant_interrupted_saves, run_train
from flax import nnx
from treecheck import assert_bitwise

import mindpipe_jax as mp
from mindpipe_jax.cli import main
from mindpipe_jax.errors import NonFiniteError
from mindpipe_jax.train.checkpoint import (
    committed_steps,
    restore,
    state_checksums,
    verify_checksums,
)
from mindpipe_jax.train.state import abstract_train_state, make_optimizer, model_spec
from mindpipe_jax.train.step import nonfinite_leaf_names

# One xdist worker runs all of this file's tests, so its expensive module fixture runs
# once rather than once per worker (pytest -n 2 with --dist loadgroup, pyproject.toml).
pytestmark = pytest.mark.xdist_group("reliability")

# SIGKILL from step 5-12 on, after the first checkpoint and well before the end of the
# 24 steps, which the resumed run then trains (and checkpoints).
STEPS = 24
EVERY = 4
BASE = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.seq_len=32",
        "data.source=synthetic", "data.synthetic_tokens=65536", "train.global_batch=16",
        f"train.steps={STEPS}", "train.log_every=1", f"train.checkpoint_every={EVERY}",
        "train.eval_every=0", "train.progress=false", "train.tensorboard=false", "optim.warmup_steps=2"]
LAYOUTS = {
    # data=4 x tensor=2 (auto tensor on 8 simulated CPU devices); dropout draws from the restored RNG
    "dense": ["model.dropout=0.1"],
    # pipe=2 x data=2 x tensor=2: every stage's weights are split over tensor and its batch over data
    # (pipe x data alone: its resume is bitwise in test_pipeline_runtime's online repartition)
    "pipeline_data_tensor": ["parallel.pipe=2", "parallel.data=2", "parallel.tensor=2",
                             "parallel.microbatches=4", "parallel.schedule=1f1b"],
}
SLOW_LAYOUTS = {"pipeline_data_tensor"}  # ~35-45 s on 2 cores, most of it compiling the reference run
TIMEOUT_S = 240


@pytest.fixture(scope="session")
def reference(tmp_path_factory, compile_cache):
    """layout -> out_dir of an uninterrupted CLI run (run once per session, on demand)."""
    done: dict[str, Path] = {}

    def get(layout: str) -> Path:
        if layout not in done:
            out = tmp_path_factory.mktemp(f"reference_{layout}")
            rc, output = run_train([*BASE, *LAYOUTS[layout], f"train.out_dir={out}"],
                                   env=cli_env(compile_cache), cwd=out, timeout=TIMEOUT_S)
            assert rc == 0, output[-4000:]
            assert committed_steps(out / "checkpoints")[-1] == STEPS
            done[layout] = out
        return done[layout]

    return get


def _final_state(out_dir: Path, layout: str, step: int = STEPS):
    """A run's checkpointed train state at ``step``, restored here onto the same mesh."""
    cfg = mp.Config().replace(*BASE, *LAYOUTS[layout])
    mesh = mp.make_mesh(cfg.parallel)
    spec, _ = model_spec(lambda rngs: mp.GPT(cfg.model, rngs=rngs), mesh, cfg.train.seed)
    tx = make_optimizer(cfg.optim, cfg.train.steps, spec.decay_mask)
    state, _, meta = restore(out_dir / "checkpoints", step, abstract_train_state(spec, tx, mesh))
    assert meta["step"] == step
    return jax.device_get(state)


def _logged_steps(out_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def _snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` with a hash of its bytes (directories as such)."""
    return {str(p.relative_to(root)): (hashlib.sha1(p.read_bytes()).hexdigest() if p.is_file() else "dir")
            for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("layout", [pytest.param(k, marks=pytest.mark.slow) if k in SLOW_LAYOUTS else k
                                    for k in LAYOUTS])
def test_sigkill_after_a_checkpoint_then_resume_is_bitwise_identical(layout, reference, compile_cache,
                                                                     tmp_path):
    ref = reference(layout)
    out = tmp_path / "run"
    args = [*BASE, *LAYOUTS[layout], f"train.out_dir={out}"]
    env = cli_env(compile_cache)
    kill_at = random.randint(EVERY + 1, 3 * EVERY)  # after the first checkpoint, well before the end
    child = Train(args, env=env, cwd=tmp_path)
    seen = child.wait_for_step(kill_at, TIMEOUT_S)
    ckpt = out / "checkpoints"
    last = kill_after_first_commit(child, ckpt, STEPS)
    plant_interrupted_saves(ckpt, last, EVERY)

    rc, output = run_train([*args, "--resume"], env=env, cwd=tmp_path, timeout=TIMEOUT_S)
    assert rc == 0, output[-4000:]
    assert f"resuming at step {last}" in output, output[-4000:]
    assert str(last + EVERY) in output.split("removed what interrupted saves left")[1].splitlines()[0]
    assert not [p for p in ckpt.iterdir() if "tmp" in p.name], sorted(p.name for p in ckpt.iterdir())
    assert_bitwise(_final_state(ref, layout), _final_state(out, layout),
                    f"{layout}: killed at step {seen} (>= {kill_at}), resumed from {last}")
    # Steps logged after the last checkpoint were trained again: each appears once.
    assert _logged_steps(out) == list(range(1, STEPS + 1))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_saves_a_checkpoint_exits_0_and_resume_continues(sig, reference, compile_cache, tmp_path):
    out = tmp_path / "run"
    args = [*BASE, *LAYOUTS["dense"], f"train.out_dir={out}"]
    env = cli_env(compile_cache)
    child = Train(args, env=env, cwd=tmp_path)
    seen = child.wait_for_step(random.randint(2, 3 * EVERY), TIMEOUT_S)
    child.signal(sig)
    assert child.wait(60) == 0, child.output[-4000:]
    name = signal.Signals(sig).name
    lines = [ln for ln in child.output.splitlines() if ln.startswith(f"stopped by {name} after step ")]
    assert len(lines) == 1, child.output[-3000:]
    stopped = int(lines[0].split("after step ")[1].split()[0])
    assert seen <= stopped < STEPS
    assert f"checkpoint saved in {out / 'checkpoints' / str(stopped)};" in lines[0]
    assert "--resume" in lines[0] and "done:" not in child.output
    assert committed_steps(out / "checkpoints")[-1] == stopped
    if sig == signal.SIGINT:
        return  # the stop is the same as SIGTERM's; resuming it is checked once, below

    rc, output = run_train([*args, "--resume"], env=env, cwd=tmp_path, timeout=TIMEOUT_S)
    assert rc == 0, output[-4000:]
    assert f"resuming at step {stopped}" in output
    assert_bitwise(_final_state(reference("dense"), "dense"), _final_state(out, "dense"),
                    f"{name} at step {stopped}")


# --- non-finite losses (in-process) ----------------------------------------------------------

NAN = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.seq_len=32",
       "data.source=synthetic", "data.synthetic_tokens=65536", "train.global_batch=16",
       "train.eval_every=0", "train.log_every=1", "train.progress=false", "train.tensorboard=false",
       "optim.warmup_steps=0", "parallel.simulate_cpu_devices=0"]
HUGE_LR = "optim.lr=1e30"  # one update makes the weights overflow: the next loss is NaN


def _leaf_names() -> list[str]:
    cfg = mp.Config().replace(*NAN)
    spec = model_spec(lambda r: mp.GPT(cfg.model, rngs=r), mp.make_mesh(cfg.parallel), 0)[0]
    return nonfinite_leaf_names(spec.abstract_params)


def test_nonfinite_loss_stops_naming_step_and_group_and_keeps_the_checkpoint(tmp_path):
    # With lr 1e30, step 1 is finite (and checkpointed) and ruins the weights: step 2
    # is the first non-finite step, and a checkpoint step too.
    out = tmp_path / "run"
    with pytest.raises(NonFiniteError) as err:
        mp.train(None, None, mp.Config(), *NAN, f"train.out_dir={out}", "train.steps=4",
                 "train.checkpoint_every=1", HUGE_LR)
    e, ckpt = err.value, out / "checkpoints"
    assert e.step == 2 and str(e).startswith("step 2: non-finite loss") and "\n" not in str(e), str(e)
    assert e.group in _leaf_names() and f"'{e.group}'" in str(e)
    assert e.last_checkpoint == ckpt / "1" and f"step 1, {ckpt / '1'}" in str(e)
    # Nothing of step 2 was written; step 1 is complete, and its bytes match its checksums.
    assert sorted(p.name for p in ckpt.iterdir()) == ["1"] and committed_steps(ckpt) == [1]
    cfg = mp.Config().replace(*NAN, HUGE_LR)
    mesh = mp.make_mesh(cfg.parallel)
    spec, _ = model_spec(lambda r: mp.GPT(cfg.model, rngs=r), mesh, 0)
    tx = make_optimizer(cfg.optim, 4, spec.decay_mask)
    state, _, meta = restore(ckpt, 1, abstract_train_state(spec, tx, mesh))
    assert verify_checksums(state, meta) is None and int(state["step"]) == 1
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(jax.device_get(state)))


def test_an_error_mid_run_starts_a_line_of_its_own_after_the_progress_bar(tmp_path, capfd):
    """The bar was left open when the loop raised: the error was written after its last
    frame on the same line (``train: 95%|...| 19/20 [...]mindpipe: error: ...``)."""
    from mindpipe_jax.cli import EXIT_NONFINITE

    rc = main(["train", *NAN, f"train.out_dir={tmp_path / 'run'}", "train.steps=4", HUGE_LR,
               "train.progress=true"])
    err = capfd.readouterr().err
    assert rc == EXIT_NONFINITE, err[-2000:]
    assert "train:" in err and "\nmindpipe: error: step 2: non-finite loss" in err, repr(err[-600:])


class ShortPositions(nnx.Module):
    """A model whose learned position table (8 rows) is shorter than the sequences it is
    given: ``jnp.take`` fills the rows past it with NaN, so its very first loss is NaN."""

    def __init__(self, rngs):
        self.tokens = nnx.Param(0.02 * jax.random.normal(rngs.params(), (256, 16)))
        self.positions = nnx.Param(0.02 * jax.random.normal(rngs.params(), (8, 16)))
        self.out = nnx.Param(0.02 * jax.random.normal(rngs.params(), (16, 256)))

    def loss(self, inputs, targets):
        h = self.tokens[...][inputs] + jnp.take(self.positions[...], jnp.arange(inputs.shape[1]), axis=0)
        return optax.softmax_cross_entropy_with_integer_labels(h @ self.out[...], targets).mean()


def test_a_loss_not_finite_before_any_update_does_not_blame_the_learning_rate(tmp_path):
    """Step 1's loss is the initial parameters' (no update has run): its advice was "lower
    optim.lr", which cannot help; it now says what the model does on the data instead."""
    with pytest.raises(NonFiniteError) as err:
        mp.train(ShortPositions, None, mp.Config(), *NAN, f"train.out_dir={tmp_path}/run", "train.steps=2")
    msg = str(err.value)
    assert err.value.step == 1 and msg.startswith("step 1: non-finite loss nan") and "\n" not in msg, msg
    assert "learning rate is not the cause" in msg and "positions past its table" in msg, msg
    assert "lower optim.lr" not in msg, msg


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32", "float64", "bool"])
def test_checksum_sees_any_single_changed_bit(dtype):
    # The checkpoint's guard against bytes changed on disk: flipping any one bit of
    # any one element changes that leaf's sum, and only that leaf's.
    rng = np.random.default_rng(0)
    with jax.enable_x64(dtype == "float64"):
        a = rng.standard_normal((7, 5)).astype(dtype) if dtype != "bool" else rng.random((7, 5)) > 0.5
        state = {"w": jax.numpy.asarray(a), "step": jax.numpy.asarray(3, jax.numpy.int32)}
        meta = {"checksums": state_checksums(state)}
        assert verify_checksums(state, meta) is None
        bits = np.frombuffer(a.tobytes(), np.uint8).copy()
        for i in rng.choice(bits.size, 12, replace=False):
            flipped = bits.copy()
            flipped[i] ^= 1 << int(rng.integers(8 if dtype != "bool" else 1))
            changed = np.frombuffer(flipped.tobytes(), a.dtype).reshape(a.shape)
            bad = {**state, "w": jax.numpy.asarray(changed)}
            assert verify_checksums(bad, meta) == "['w']", (dtype, int(i))


def test_nonfinite_error_is_one_line_and_exit_3_on_the_command_line(monkeypatch, capsys):
    def diverged(**_):
        raise NonFiniteError("step 7: non-finite loss nan; training stopped", step=7, group="loss")

    monkeypatch.setattr(mp, "train", diverged)
    assert main(["train", "train.steps=9"]) == 3
    assert capsys.readouterr().err == "mindpipe: error: step 7: non-finite loss nan; training stopped\n"


def test_nonfinite_skip_leaves_bad_updates_out_inside_the_step(tmp_path):
    # With lr 1e30 step 1 is finite and every later step is NaN. Skipping them must
    # keep params and optimizer state exactly as step 1 left them: the checkpoints of
    # steps 2..4 hold the bits of step 1's.
    skip = mp.train(None, None, mp.Config(), *NAN, f"train.out_dir={tmp_path / 'skip'}", "train.steps=4",
                    "train.checkpoint_every=1", "train.keep_checkpoints=4", HUGE_LR,
                    "train.nonfinite=skip")
    assert skip.skipped_steps == 3 and skip.step == 4  # the steps still count: data and schedule move on
    assert [np.isfinite(h["loss"]) for h in skip.history] == [True, False, False, False]
    assert [h["skipped_steps"] for h in skip.history] == [0, 1, 2, 3]
    cfg = mp.Config().replace(*NAN, HUGE_LR)
    mesh = mp.make_mesh(cfg.parallel)
    spec, _ = model_spec(lambda r: mp.GPT(cfg.model, rngs=r), mesh, 0)
    tx = make_optimizer(cfg.optim, 4, spec.decay_mask)
    ckpt = tmp_path / "skip" / "checkpoints"
    states = {n: restore(ckpt, n, abstract_train_state(spec, tx, mesh)) for n in (1, 2, 3, 4)}
    for n in (2, 3, 4):
        for item in ("params", "opt"):
            assert_bitwise(jax.device_get(states[1][0][item]), jax.device_get(states[n][0][item]),
                            f"{item} after skipped step {n}")
        assert states[n][2]["skipped_steps"] == n - 1  # the count survives a resume
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(jax.device_get(skip.state)))
