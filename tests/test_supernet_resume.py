"""Resuming SPara supernet runs: to the bits, and the search, of an uninterrupted run.

* In one process: 4 steps with checkpoints at 2 and 4, then ``train.resume=true``
  with ``train.steps=6`` gives the parameters, optimizer state and search of a
  6-step run, bit for bit. Every refusal is one line, exit status 2, nothing written.
* ``mindpipe supernet`` in a child process, SIGKILLed at a random step after a
  checkpoint has committed (plus what an interrupted save leaves: orbax's temporary
  directory, a step without the commit marker), then ``--resume``: the final state
  and ``search.json`` equal an uninterrupted run's.
* SIGTERM: the step finishes, a checkpoint is saved, exit 0 with a line saying
  where; ``--resume`` continues to the same bits.

The children share a persistent compilation cache (``cli_procs.py``).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import random
import shutil
import signal
from pathlib import Path

import jax
import numpy as np
import pytest
from ckpt_damage import flip_a_restored_byte
from cli_procs import Train, cli_env, kill_after_first_commit, plant_interrupted_saves, run_train
from treecheck import assert_bitwise

import mindpipe_jax as mp
from mindpipe_jax.cli import main
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.supernet import supernet_factory, supernet_spec, train_supernet
from mindpipe_jax.supernet.trainer import _abstract_state
from mindpipe_jax.train.checkpoint import COMMIT_MARKER, committed_steps, restore

# One xdist worker runs all of this file's tests, so its expensive module fixture runs
# once rather than once per worker (pytest -n 2 with --dist loadgroup, pyproject.toml).
pytestmark = pytest.mark.xdist_group("supernet_resume")

TINY = ("model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.seq_len=32",
        'data.source="synthetic"', "data.synthetic_tokens=65536", "train.global_batch=16",
        "parallel.tensor=1", "parallel.subnet=4", "parallel.data=2", "supernet.subnets_per_step=4",
        "supernet.semantics=sequential", "supernet.search_population=6",
        "supernet.search_generations=2", "supernet.search_top_k=3", "optim.lr=1e-2",
        "optim.warmup_steps=0", "train.log_every=1",
        # Resuming, not slicing: masked, one program per process instead of one per shape
        # (the sliced step keeps the same state; its bits: test_supernet_determinism).
        "supernet.ladder_levels=0")
HERE = (*TINY, "parallel.simulate_cpu_devices=0")  # in this process: conftest's 8 CPU devices
# The learning-rate schedule is a function of train.steps, so a 4-step run continued
# to 6 follows the 6-step schedule only from step 5 on (as dense runs do). To compare
# it with a 6-step run the schedule is constant here; the child-process tests below
# keep train.steps and use the decaying schedule.
CONSTANT_LR = "optim.min_lr_ratio=1.0"
# The child processes: SIGKILL or SIGTERM from step 2-12 on (SIGKILL after the first
# checkpoint), well before the end of the 24 steps, which the resumed run then trains.
STEPS, EVERY = 24, 4
KILL = (*TINY, f"train.steps={STEPS}", f"train.checkpoint_every={EVERY}")
TIMEOUT_S = 240


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def _snapshot(root: Path) -> dict[str, tuple[str, int]]:
    """Every path under ``root``: a hash of its bytes (directories as such) and its mtime."""
    return {str(p.relative_to(root)): (hashlib.sha1(p.read_bytes()).hexdigest() if p.is_file() else "dir",
                                       p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


def _saved_state(out_dir: Path, step: int, *overrides: str):
    """A run's checkpointed state at ``step``, restored here onto the same mesh (host arrays)."""
    cfg = mp.Config().replace(*HERE, *overrides)
    spec, create = supernet_spec(supernet_factory(cfg), cfg.train.seed)
    state, _, meta = restore(out_dir / "checkpoints", step, _abstract_state(spec, create,
                                                                            mp.make_mesh(cfg.parallel)))
    assert meta["kind"] == "supernet" and meta["step"] == step
    return jax.device_get(state)


# --- in one process -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory) -> Path:
    """The out_dir of a 4-step run (checkpoints at 2 and 4), to copy or to refuse."""
    out = tmp_path_factory.mktemp("four") / "run"
    result = train_supernet(config=mp.Config().replace(*HERE, CONSTANT_LR, "train.steps=4",
                                                       "train.checkpoint_every=2", f"train.out_dir={out}"),
                            checkpoint=True, search=False, log=None)
    assert result.stopped is None and committed_steps(out / "checkpoints") == [2, 4]
    return out


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dense") / "run"
    mp.train(None, None, mp.Config(), *TINY[:8], "parallel.simulate_cpu_devices=0", "train.steps=2",
             "train.progress=false", "train.eval_every=0", "train.tensorboard=false", f"train.out_dir={out}")
    return out


@pytest.mark.slow
def test_resume_gives_the_bits_and_the_search_of_an_uninterrupted_run(four_steps, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(four_steps, run)
    six = (*HERE, CONSTANT_LR, "train.steps=6", "train.checkpoint_every=2")
    lines: list[str] = []
    resumed = train_supernet(config=mp.Config().replace(*six, f"train.out_dir={run}", "train.resume=true"),
                             checkpoint=True, log=lines.append)
    assert "| resuming at step 4" in lines[0], lines[0]
    assert [h["step"] for h in resumed.history] == [5, 6] and int(resumed.state["step"]) == 6
    assert committed_steps(run / "checkpoints")[-1] == 6
    whole = train_supernet(config=mp.Config().replace(*six, f"train.out_dir={tmp_path / 'whole'}"),
                           checkpoint=True, log=None)
    assert_bitwise(jax.device_get(whole.state), jax.device_get(resumed.state), "resumed at step 4")
    # The comparison can fail: the state the run resumed from is not the end state.
    start = jax.tree.leaves(_saved_state(run, 4)["params"])
    assert any(np.asarray(a).tobytes() != np.asarray(b).tobytes()
               for a, b in zip(start, jax.tree.leaves(jax.device_get(resumed.state["params"])), strict=True))
    assert resumed.search.top == whole.search.top and resumed.search.top
    assert resumed.search.best_per_generation == whole.search.best_per_generation
    assert json.loads((run / "search.json").read_text())["top"] == whole.search.top
    # metrics.jsonl: the first run's steps, then the resumed ones, each once.
    logged = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5, 6] and "loss_min" in logged[0]


def _damaged(src: Path, dst: Path) -> Path:
    """A copy of ``src`` with one byte of array data changed in its newest step."""
    shutil.copytree(src, dst)
    step = committed_steps(dst / "checkpoints")[-1]
    flip_a_restored_byte(dst / "checkpoints" / str(step) / "state")
    return dst


def test_refusals_are_one_line_exit_2_and_write_nothing(four_steps, dense_run, tmp_path):
    _damaged(four_steps, tmp_path / "flipped")
    partial = tmp_path / "partial" / "checkpoints" / "2.orbax-checkpoint-tmp-1700000000"
    shutil.copytree(four_steps / "checkpoints" / "2", partial)
    (partial / COMMIT_MARKER).unlink()
    run, six = str(four_steps), ("train.steps=6", "train.checkpoint_every=2", CONSTANT_LR)
    cases = {
        "nothing to resume": ([f"train.out_dir={tmp_path / 'new'}", *six, "--resume"], "nothing to resume"),
        "only an interrupted save": ([f"train.out_dir={tmp_path / 'partial'}", *six, "--resume"],
                                     "only an incomplete checkpoint"),
        "a dense run": ([f"train.out_dir={dense_run}", *six, "--resume"], "checkpoint of a dense model"),
        "another space": ([f"train.out_dir={run}", *six, "supernet.ops=['gelu','relu']", "--resume"],
                          "holds a different model (genes.op0: checkpoint ['gelu', 'relu', 'silu'], "
                          "model ['gelu', 'relu'])"),
        "another model": ([f"train.out_dir={run}", *six, "model.d_model=64", "--resume"],
                          "holds a different model (genes.ffn0"),
        "a finished run": ([f"train.out_dir={run}", "train.steps=4", "--resume"], "train.steps above 4"),
        "changed bytes": ([f"train.out_dir={tmp_path / 'flipped'}", *six, "--resume"],
                          ("do not match the checksum", "could not be restored")),
        "other data": ([f"train.out_dir={run}", *six, "train.global_batch=32", "--resume"],
                       "saved with global_batch=16"),
        "a run without resume": ([f"train.out_dir={run}", *six], "already holds checkpoints up to step 4"),
    }
    roots = (four_steps, dense_run, tmp_path)
    before = [_snapshot(root) for root in roots]
    for case, (argv, needles) in cases.items():
        code, stdout, stderr = _cli("supernet", *HERE, *argv)
        assert code == 2, (case, stdout[-2000:], stderr)
        assert stderr.count("\n") == 1 and stderr.startswith("mindpipe: error: "), (case, stderr)
        needles = (needles,) if isinstance(needles, str) else needles
        assert any(n in stderr for n in needles), (case, stderr)
    # And the other way: `mindpipe train` on a supernet's directory says whose it is (it
    # named the first differing parameter, "checkpoint None").
    code, _, stderr = _cli("train", "parallel.simulate_cpu_devices=0", f"train.out_dir={run}", "--resume")
    assert code == 2 and stderr.count("\n") == 1, stderr
    assert "holds the checkpoint of a supernet (`mindpipe supernet`, step 4), not of a dense model" in stderr
    assert [_snapshot(root) for root in roots] == before
    assert not (tmp_path / "new").exists()
    with pytest.raises(ConfigError, match=r"^train.resume=true needs checkpoints: call "
                                          r"train_supernet\(\.\.\., checkpoint=True\)"):
        train_supernet(config=mp.Config().replace(*HERE, "train.resume=true", f"train.out_dir={run}"))


# --- child processes: SIGKILL and SIGTERM ---------------------------------------------------------


@pytest.fixture(scope="module")
def reference(tmp_path_factory, compile_cache) -> Path:
    """The out_dir of an uninterrupted `mindpipe supernet` run of the same config."""
    out = tmp_path_factory.mktemp("reference") / "run"
    rc, output = run_train([*KILL, f"train.out_dir={out}"], env=cli_env(compile_cache), cwd=out.parent,
                           timeout=TIMEOUT_S, command="supernet")
    assert rc == 0, output[-4000:]
    assert committed_steps(out / "checkpoints")[-1] == STEPS and (out / "search.json").is_file()
    return out


def _assert_same_run(ref: Path, out: Path, what: str) -> None:
    assert_bitwise(_saved_state(ref, STEPS, *KILL), _saved_state(out, STEPS, *KILL), what)
    assert json.loads((out / "search.json").read_text()) == json.loads((ref / "search.json").read_text())


@pytest.mark.slow
def test_sigkill_after_a_checkpoint_then_resume_is_bitwise_identical(reference, compile_cache, tmp_path):
    out = tmp_path / "run"
    args = [*KILL, f"train.out_dir={out}"]
    env = cli_env(compile_cache)
    kill_at = random.randint(EVERY + 1, 3 * EVERY)  # after the first checkpoint, well before the end
    child = Train(args, env=env, cwd=tmp_path, command="supernet")
    seen = child.wait_for_step(kill_at, TIMEOUT_S)
    ckpt = out / "checkpoints"
    last = kill_after_first_commit(child, ckpt, STEPS)
    plant_interrupted_saves(ckpt, last, EVERY)

    rc, output = run_train([*args, "--resume"], env=env, cwd=tmp_path, timeout=TIMEOUT_S, command="supernet")
    assert rc == 0, output[-4000:]
    assert f"| resuming at step {last}" in output, output[-4000:]
    assert str(last + EVERY) in output.split("removed what interrupted saves left")[1].splitlines()[0]
    assert not [p for p in ckpt.iterdir() if "tmp" in p.name], sorted(p.name for p in ckpt.iterdir())
    assert f"done: {STEPS} steps | best subnet" in output
    _assert_same_run(reference, out, f"killed at step {seen} (>= {kill_at}), resumed from {last}")


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_exits_0_and_resume_continues(reference, compile_cache, tmp_path):
    out = tmp_path / "run"
    args = [*KILL, f"train.out_dir={out}"]
    env = cli_env(compile_cache)
    child = Train(args, env=env, cwd=tmp_path, command="supernet")
    seen = child.wait_for_step(random.randint(2, 3 * EVERY), TIMEOUT_S)
    child.signal(signal.SIGTERM)
    assert child.wait(60) == 0, child.output[-4000:]
    lines = [ln for ln in child.output.splitlines() if ln.startswith("stopped by SIGTERM after step ")]
    assert len(lines) == 1, child.output[-3000:]
    stopped = int(lines[0].split("after step ")[1].split()[0])
    assert seen <= stopped < STEPS
    assert f"checkpoint saved in {out / 'checkpoints' / str(stopped)};" in lines[0]
    assert "--resume" in lines[0] and "done:" not in child.output and not (out / "search.json").exists()
    assert committed_steps(out / "checkpoints")[-1] == stopped

    rc, output = run_train([*args, "--resume"], env=env, cwd=tmp_path, timeout=TIMEOUT_S, command="supernet")
    assert rc == 0, output[-4000:]
    assert f"| resuming at step {stopped}" in output
    _assert_same_run(reference, out, f"SIGTERM at step {stopped}")
