"""The run directory (``train.out_dir``) under a hostile but realistic user:

* two runs into one directory: the second exits 2 with one line naming the first's
  pid and host, and the first finishes with a committed checkpoint; a lock file left
  by a dead run is taken over with a one-line notice;
* an out_dir that cannot be written (a parent that is a file; a read-only
  filesystem, mounted here when the tests run as root): one line, exit 2, before
  anything is computed and with nothing written;
* the disk filling up during a save (a small tmpfs, root only): one line naming the
  directory and the bytes needed, exit 2, the half-written step removed, the last
  committed checkpoint untouched and resumable to the same bits;
* Ctrl-C at any moment of start-up: exit 130, one line, nothing half-written;
* resuming with changed values (``optim.lr``, ``model.dtype``): allowed, one line says
  what changed; ``train.resume=auto`` on a finished run: exit 0, "already complete".

Mounts are made only as root and always unmounted in a ``finally``; the child
processes are bounded and only those started here are killed.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from cli_procs import Train, cli_env, run_train
from treecheck import assert_bitwise

import mindpipe_jax as mp
from mindpipe_jax.atomic_write import write_atomically
from mindpipe_jax.cli import main
from mindpipe_jax.errors import ConfigError, DiskFullError
from mindpipe_jax.train.checkpoint import Checkpointer, committed_steps, restore, verify_checksums
from mindpipe_jax.train.rundir import LOCK_NAME, RunDirLock, check_writable
from mindpipe_jax.train.state import abstract_train_state, make_optimizer, model_spec

TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.seq_len=32",
        "data.source=synthetic", "data.synthetic_tokens=65536", "train.global_batch=16",
        "train.log_every=1", "train.eval_every=0", "train.progress=false", "train.tensorboard=false",
        "optim.warmup_steps=2"]
HERE = [*TINY, "parallel.simulate_cpu_devices=0"]  # in this process: conftest's 8 CPU devices
SUPERNET = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.seq_len=32",
            'data.source="synthetic"', "data.synthetic_tokens=65536", "train.global_batch=16",
            "parallel.tensor=1", "parallel.subnet=4", "parallel.data=2", "supernet.subnets_per_step=4",
            "supernet.search_population=6", "supernet.search_generations=2", "supernet.search_top_k=3",
            "optim.warmup_steps=0", "train.log_every=1", "train.tensorboard=false",
            "parallel.simulate_cpu_devices=0"]
TIMEOUT_S = 240
ROOT = os.geteuid() == 0


@pytest.fixture(scope="module")
def cache(compile_cache):
    return compile_cache  # the run's (conftest.py)


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@contextlib.contextmanager
def _tmpfs(where: Path, size: str, *options: str):
    """A tmpfs of ``size`` at ``where`` (root only), unmounted on the way out."""
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join([f"size={size}", *options]), "tmpfs",
                    str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("mindpipe: error: "), err
    return lines[0]


# --- the lock -----------------------------------------------------------------------------------


def test_a_held_lock_refuses_a_second_holder_naming_pid_and_host(tmp_path):
    out = tmp_path / "run" / "deeper"
    with RunDirLock(out):
        record = json.loads((out / LOCK_NAME).read_text())
        assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
        with pytest.raises(ConfigError) as err:
            RunDirLock(out).acquire()  # a second open file: flock refuses it as it would another process
        assert f"is in use by another run (pid {os.getpid()} on host {socket.gethostname()}" in str(err.value)
    # Released: the lock file is gone, the directory the lock created stays (the run may have written).
    assert out.is_dir() and not (out / LOCK_NAME).exists()


def test_a_lock_of_a_failed_start_leaves_nothing(tmp_path):
    out = tmp_path / "a" / "b"
    with pytest.raises(RuntimeError), RunDirLock(out):
        raise RuntimeError("a check failed after the lock was taken")
    assert list(tmp_path.iterdir()) == []


def test_a_stale_lock_of_a_dead_process_is_taken_over_with_one_notice(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    pid = _dead_pid()
    (out / LOCK_NAME).write_text(json.dumps({"pid": pid, "host": socket.gethostname(), "started": 1.0}))
    result = mp.train(None, None, mp.Config(), *HERE, "train.steps=2", f"train.out_dir={out}")
    assert result.step == 2 and committed_steps(out / "checkpoints") == [2]
    err = capsys.readouterr().err.strip().splitlines()
    notices = [ln for ln in err if "taking over the lock" in ln]
    assert len(notices) == 1 and f"pid {pid} on host {socket.gethostname()}" in notices[0], err
    assert not (out / LOCK_NAME).exists()


@pytest.mark.slow
def test_a_second_run_into_the_same_dir_exits_2_and_the_first_finishes(tmp_path, cache):
    # The first run is long (it is stopped by SIGTERM once the second has been refused).
    out = tmp_path / "run"
    args = [*TINY, "train.steps=100000", "train.checkpoint_every=4", "train.log_every=4",
            f"train.out_dir={out}"]
    env = cli_env(cache)
    first = Train(args, env=env, cwd=tmp_path)
    try:
        first.wait_for_step(4, TIMEOUT_S)
        rc, output = run_train(args, env=env, cwd=tmp_path, timeout=TIMEOUT_S)
        assert rc == 2, output
        line = _error_line(output)
        assert f"is in use by another run (pid {first.proc.pid} on host {socket.gethostname()}" in line
        assert first.proc.poll() is None  # still training
        first.signal(signal.SIGTERM)
        assert first.wait(TIMEOUT_S) == 0, first.output[-3000:]
    finally:
        first.kill()
    stops = [ln for ln in first.output.splitlines() if ln.startswith("stopped by SIGTERM after step ")]
    assert len(stops) == 1, first.output[-3000:]
    stopped = int(stops[0].split("after step ")[1].split()[0])
    assert committed_steps(out / "checkpoints")[-1] == stopped
    assert not (out / LOCK_NAME).exists()


# --- an out_dir that cannot be written --------------------------------------------------------


def _refused_before_computing(monkeypatch, argv: list[str]) -> str:
    """Run the CLI in this process with every computation after the checks made to fail."""
    loop = importlib.import_module("mindpipe_jax.train.loop")  # mp.train shadows the package name
    trainer = importlib.import_module("mindpipe_jax.supernet.trainer")

    def computed(*_, **__):
        raise AssertionError("computed before the out_dir check")

    monkeypatch.setattr(loop, "_train", computed)
    monkeypatch.setattr(trainer, "_train_supernet", computed)
    return argv


@pytest.mark.parametrize("command", ["train", "supernet"])
def test_an_out_dir_under_a_file_is_one_line_exit_2_before_computing(command, tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("not a directory")
    out = tmp_path / "file" / "run"
    argv = _refused_before_computing(monkeypatch, [command, *HERE, f"train.out_dir={out}"])
    assert main(argv) == 2
    line = _error_line(capsys.readouterr().err)
    assert f"cannot be created: {str(tmp_path / 'file')!r} is a file, not a directory" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.mark.skipif(not ROOT, reason="mounting a read-only filesystem needs root (as non-root a mode "
                                     "0o500 directory would do, but root writes through it)")
@pytest.mark.parametrize("command", ["train", "supernet"])
@pytest.mark.parametrize("exists", [False, True], ids=["new", "existing"])
def test_an_out_dir_on_a_read_only_filesystem_is_one_line_exit_2(command, exists, tmp_path, monkeypatch,
                                                                  capsys):
    with _tmpfs(tmp_path / "ro", "1M") as ro:
        if exists:
            (ro / "run").mkdir()
        subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True)
        out = ro / "run"
        argv = _refused_before_computing(monkeypatch, [command, *HERE, f"train.out_dir={out}"])
        assert main(argv) == 2
        line = _error_line(capsys.readouterr().err)
        assert "is on a read-only filesystem; choose another train.out_dir" in line, line
        with pytest.raises(ConfigError):
            check_writable(out)


# --- a full disk --------------------------------------------------------------------------------


@pytest.mark.skipif(not ROOT, reason="mounting a small tmpfs needs root")
def test_a_save_that_fills_the_disk_is_one_error_removes_the_half_written_step(tmp_path, capfd):
    # Step 1 is small; step 2 does not fit: the precheck (step 1's size) lets it start,
    # and orbax's write fails with ENOSPC in its background thread.
    with _tmpfs(tmp_path / "disk", "300k") as disk:
        ckpt = Checkpointer(disk / "checkpoints")
        small = {"w": jax.numpy.arange(10_000, dtype=jax.numpy.float32), "step": jax.numpy.asarray(1)}
        ckpt.save(1, small, {"pos": 1}, {"step": 1})
        ckpt.wait()
        noise = np.random.default_rng(0).standard_normal(100_000).astype(np.float32)  # incompressible
        big = {"w": jax.numpy.asarray(noise), "step": jax.numpy.asarray(2)}
        with pytest.raises(DiskFullError) as err:
            ckpt.save(2, big, {"pos": 2}, {"step": 2}, force=True)
            ckpt.wait()
        ckpt.close()
        e = err.value
        assert e.last_checkpoint == disk / "checkpoints" / "1" and e.needed > 0
        assert str(disk / "checkpoints") in str(e) and f"needs about {e.needed} bytes" in str(e)
        assert "\n" not in str(e) and "half-written files were removed" in str(e)
        assert sorted(p.name for p in (disk / "checkpoints").iterdir()) == ["1"]
        state, data, meta = restore(disk / "checkpoints", 1, jax.eval_shape(lambda: small))
        assert verify_checksums(state, meta) is None and data == {"pos": 1}
        for key in small:
            assert np.asarray(small[key]).tobytes() == np.asarray(state[key]).tobytes(), key
    captured = capfd.readouterr()
    assert "Traceback" not in captured.err and "No space left" not in captured.err, captured.err[-3000:]


@pytest.mark.skipif(not ROOT, reason="mounting a small tmpfs needs root")
def test_a_first_save_that_does_not_fit_is_one_error_without_the_abandoned_writes(tmp_path):
    """No checkpoint yet, so nothing to measure the next one by: the save starts and fails
    with ENOSPC. Orbax then closes its event loop while TensorStore finishes the other
    arrays' writes into it: 35 tracebacks on stderr for 60 arrays (a model's state has
    that many), and "a checkpoint needs more" in the error. Now one error naming the
    state's bytes, and a quiet stderr. The check before writing is switched off (it
    refuses this save now): a disk another writer fills once it has passed. In a process
    of its own: pytest would take the reports for warnings rather than let them reach
    stderr."""
    with _tmpfs(tmp_path / "disk", "1M") as disk:
        code = f"""if True:
            import numpy as np, jax
            from mindpipe_jax.errors import DiskFullError
            from mindpipe_jax.train.checkpoint import Checkpointer
            rng = np.random.default_rng(0)
            state = {{f"w{{i}}": jax.numpy.asarray(rng.standard_normal(20_000).astype(np.float32))
                     for i in range(60)}}
            Checkpointer._refuse_without_room = lambda self, step, state: None
            ckpt = Checkpointer({str(disk / "checkpoints")!r})
            try:
                ckpt.save(1, state, {{"pos": 1}}, {{"step": 1}})
                ckpt.wait()
            except DiskFullError as err:
                print("needed", err.needed, err.last_checkpoint)
                print(err)
            ckpt.close()
            """
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "2"}
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        needed, error = done.stdout.splitlines()
        assert needed == f"needed {60 * 20_000 * 4} None", done.stdout
        assert "needs about 4800000 bytes (4.8 MB)" in error, error
        assert "half-written files were removed and no checkpoint was committed" in error, error
        assert list((disk / "checkpoints").iterdir()) == []
    assert "Traceback" not in done.stderr and "Event loop is closed" not in done.stderr, done.stderr[-3000:]


@pytest.mark.skipif(not ROOT, reason="mounting a small tmpfs needs root")
def test_a_save_without_room_is_refused_before_writing(tmp_path):
    with _tmpfs(tmp_path / "disk", "600k") as disk:
        ckpt = Checkpointer(disk / "checkpoints")
        state = {"w": jax.numpy.asarray(np.random.default_rng(0).standard_normal(100_000), np.float32)}
        ckpt.save(1, state, {}, {})
        with pytest.raises(DiskFullError) as err:
            ckpt.save(2, state, {}, {}, force=True)
        ckpt.close()
        assert "nothing was written and the last committed checkpoint (step 1) is untouched" in str(err.value)
        assert "MB, step 1's size)" in str(err.value), str(err.value)
        assert err.value.free < err.value.needed
        assert sorted(p.name for p in (disk / "checkpoints").iterdir()) == ["1"]


@pytest.mark.skipif(not ROOT, reason="mounting a small tmpfs needs root")
def test_a_first_save_without_room_is_refused_before_writing(tmp_path):
    """With no committed step to measure by, a first save was started and failed half
    written (with several processes: they hung, test_multihost); now the state's bytes
    are the measure."""
    with _tmpfs(tmp_path / "disk", "600k") as disk:
        ckpt = Checkpointer(disk / "checkpoints")
        state = {f"w{i}": jax.numpy.ones(20_000, np.float32) for i in range(60)}
        with pytest.raises(DiskFullError) as err:
            ckpt.save(1, state, {}, {})
        ckpt.close()
        msg = str(err.value)
        assert "needs about 4800000 bytes (4.8 MB, the state uncompressed)" in msg, msg
        assert "nothing was written and no checkpoint was committed" in msg, msg
        assert list((disk / "checkpoints").iterdir()) == []


@pytest.mark.skipif(not ROOT, reason="mounting a small tmpfs needs root")
def test_a_save_that_failed_in_the_background_stops_the_run_at_the_next_fetch(tmp_path, capsys,
                                                                              monkeypatch):
    """The save of step 100 fails on a full disk while the run goes on (orbax writes in
    the background). It surfaced at the next save, step 200 here: 100 steps trained and
    lost (``train.checkpoint_every`` of them on any run). Now the run stops at the first
    fetch of its metrics after the failure (seen: at step 102), with the same one line.
    The check before writing is switched off (it refuses this save now): a disk another
    writer fills once it has passed."""
    monkeypatch.setattr(Checkpointer, "_refuse_without_room", lambda self, step, state: None)
    with _tmpfs(tmp_path / "disk", "200k") as disk:  # the logs fit, the state (0.5 MB) does not
        out = disk / "run"
        rc = main(["train", *HERE, "train.steps=200", "train.checkpoint_every=100", f"train.out_dir={out}"])
        err = capsys.readouterr().err
        assert rc == 2, err[-3000:]
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("mindpipe: error: no space left on the device"), err
        assert "to save step 100:" in lines[0] and "no checkpoint was committed" in lines[0], lines[0]
        logged = []
        for line in (out / "metrics.jsonl").read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):  # a last line the full disk cut short
                logged.append(json.loads(line)["step"])
        assert 100 <= max(logged) < 180, logged[-5:]
        assert list((out / "checkpoints").iterdir()) == []


@pytest.mark.skipif(not ROOT, reason="mounting a small tmpfs needs root")
def test_outputs_on_a_full_disk_are_written_whole_or_not_at_all(tmp_path, capsys):
    """``--out`` pictures, ``--json`` files, the tuner's caches, ``config.json``: on a
    full disk each was left empty or cut short (an empty .svg; a cache that no longer
    parsed), and the error named no file and told ``mindpipe schedule`` to continue with
    train.resume=true. Now the file is whole or as it was, and the line names it and
    says to run the command again."""
    with _tmpfs(tmp_path / "disk", "16k") as disk:
        kept = disk / "kept.json"
        kept.write_text('{"old": true}')
        with pytest.raises(OSError) as err:
            write_atomically(kept, "x" * 100_000)
        assert err.value.filename == str(kept) and kept.read_text() == '{"old": true}'
        assert sorted(p.name for p in disk.iterdir()) == ["kept.json"]
        picture = disk / "timeline.svg"
        assert main(["schedule", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8",
                     "--out", str(picture)]) == 2
        assert _error_line(capsys.readouterr().err) == (
            f"mindpipe: error: no space left on device writing {str(picture)!r}; free some space and run "
            f"`mindpipe schedule` again")
        assert sorted(p.name for p in disk.iterdir()) == ["kept.json"]


@pytest.mark.skipif(not ROOT, reason="mounting a small tmpfs needs root")
@pytest.mark.parametrize("tensorboard", [True, False])
def test_logs_that_fill_the_disk_stop_the_run_in_one_line_naming_the_file(tensorboard, tmp_path, cache):
    """TensorBoard's events went through tensorboardX's writer thread: on a full disk it
    died (a traceback on stderr) and the next writes filled its queue and blocked, the
    run hung for good at its next log step. metrics.jsonl's error named no file."""
    with _tmpfs(tmp_path / "disk", "40k") as disk:  # no checkpoints: the logs fill it
        out = disk / "run"
        rc, output = run_train([*TINY, "train.steps=400", "train.checkpoint_every=0",
                                f"train.tensorboard={str(tensorboard).lower()}", f"train.out_dir={out}"],
                               env=cli_env(cache), cwd=tmp_path, timeout=120)  # (a hang: 120 s)
        assert rc == 2 and "Traceback" not in output, output[-3000:]
        errors = [ln for ln in output.splitlines() if ln.startswith("mindpipe: error:")]
        where = out / ("tensorboard" if tensorboard else "metrics.jsonl")
        want = (f"mindpipe: error: no space left on device writing {str(where)!r}; free some space (or "
                f"choose another train.out_dir) and continue with train.resume=true")
        assert errors == [want], output[-3000:]


def _final_state(out_dir: Path, overrides: list[str], step: int):
    cfg = mp.Config().replace(*TINY, *overrides)
    mesh = mp.make_mesh(cfg.parallel)
    spec, _ = model_spec(lambda rngs: mp.GPT(cfg.model, rngs=rngs), mesh, cfg.train.seed)
    tx = make_optimizer(cfg.optim, cfg.train.steps, spec.decay_mask)
    state, _, meta = restore(out_dir / "checkpoints", step, abstract_train_state(spec, tx, mesh))
    assert verify_checksums(state, meta) is None
    return jax.device_get(state)


@pytest.mark.slow
@pytest.mark.skipif(not ROOT, reason="mounting a small tmpfs needs root")
def test_a_full_disk_mid_run_is_one_line_exit_2_and_resumes_bitwise(tmp_path, cache):
    run = ["train.steps=12", "train.checkpoint_every=4", "train.keep_checkpoints=3"]
    env = cli_env(cache)
    ref = tmp_path / "reference"
    rc, output = run_train([*TINY, *run, f"train.out_dir={ref}"], env=env, cwd=tmp_path, timeout=TIMEOUT_S)
    assert rc == 0, output[-3000:]
    step_bytes = sum(p.stat().st_blocks * 512 for p in (ref / "checkpoints" / "4").rglob("*") if p.is_file())
    # Room for one checkpoint and the logs, not for two.
    with _tmpfs(tmp_path / "disk", f"{int(step_bytes * 1.6) // 1024}k") as disk:
        out = disk / "run"
        rc, output = run_train([*TINY, *run, f"train.out_dir={out}"], env=env, cwd=tmp_path,
                               timeout=TIMEOUT_S)
        assert rc == 2, output[-3000:]
        errors = [ln for ln in output.splitlines() if ln.startswith("mindpipe: error:")]
        assert len(errors) == 1 and "Traceback" not in output, output[-3000:]
        assert f"no space left on the device of {str(out / 'checkpoints')!r} to save step 8" in errors[0]
        assert "bytes are free" in errors[0]
        assert "the last committed checkpoint (step 4) is untouched" in errors[0]
        assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["4"]
        assert not (out / LOCK_NAME).exists()
        # Free some space (a bigger disk), then resume: the same bits as the uninterrupted run.
        subprocess.run(["mount", "-o", f"remount,size={step_bytes * 8 // 1024}k", str(disk)], check=True)
        rc, output = run_train([*TINY, *run, f"train.out_dir={out}", "--resume"], env=env, cwd=tmp_path,
                               timeout=TIMEOUT_S)
        assert rc == 0 and "resuming at step 4" in output, output[-3000:]
        assert_bitwise(_final_state(ref, run, 12), _final_state(out, run, 12), "resumed after a full disk")


# --- Ctrl-C during start-up -------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.5, 2.0, 5.0, 9.0, 13.0])
def test_ctrl_c_during_start_up_is_exit_130_one_line_nothing_half_written(delay, tmp_path, cache):
    out = tmp_path / "run"
    # Enough steps that every delay lands before the run ends, even on a quick machine.
    child = Train([*TINY, "train.steps=500", "train.checkpoint_every=4", f"train.out_dir={out}"],
                  env=cli_env(cache), cwd=tmp_path)
    try:
        time.sleep(delay)
        child.signal(signal.SIGINT)
        rc = child.wait(TIMEOUT_S)
    finally:
        child.kill()
    lines = child.output.strip().splitlines()
    # The start-up's one status line can land between our sleep and the signal's delivery: it was
    # true when printed, so it may precede the interrupt; anything else may not.
    lines = [ln for ln in lines if not ln.startswith("mesh {")]
    if any(ln.startswith("done: ") for ln in lines) and rc in (0, -signal.SIGINT):
        # The run finished all its steps before the signal came (it then lands in the
        # interpreter's exit): nothing about start-up to test.
        assert "Traceback" not in child.output, child.output[-3000:]
        pytest.skip(f"the run had ended {delay} s after the start")
    if rc != 130 or any(ln.startswith("step ") for ln in lines):
        # The loop had begun: the first Ctrl-C is a stop with a checkpoint (tested elsewhere).
        assert rc == 0 and "Traceback" not in child.output, child.output[-3000:]
        pytest.skip(f"the loop had begun {delay} s after the start (a stop, tested elsewhere)")
    assert lines == ["mindpipe: interrupted"], child.output[-3000:]
    assert not out.exists()  # the run created it: it went, with what the run had begun writing


# --- resuming ---------------------------------------------------------------------------------


def test_resume_with_changed_lr_and_dtype_says_what_changed(tmp_path, capsys):
    out = tmp_path / "run"
    mp.train(None, None, mp.Config(), *HERE, "train.steps=2", f"train.out_dir={out}")
    capsys.readouterr()
    result = mp.train(None, None, mp.Config(), *HERE, "train.steps=3", f"train.out_dir={out}",
                      "train.resume=true", "optim.lr=0.001", "model.dtype=bfloat16")
    assert result.step == 3
    out_lines = capsys.readouterr().out.splitlines()
    lines = [ln for ln in out_lines if "changed config" in ln]
    assert lines == ['resuming step 2 with a changed config: model.dtype "float32" -> "bfloat16", '
                     'optim.lr 0.003 -> 0.001'], lines
    # train.steps 2 -> 3 moves the schedule's end: step 3 is no longer past the decay (lr x
    # min_lr_ratio) but the last of the warmup (the peak). Said, with the lr the step then took.
    lines = [ln for ln in out_lines if "learning-rate schedule" in ln]
    assert lines == ["train.steps 2 -> 3 re-times the learning-rate schedule: step 3 trains at lr 1.00e-03 "
                     "(1.00e-04 with train.steps=2)"], lines
    assert result.history[-1]["lr"] == pytest.approx(1e-3)


def _assert_requeue_is_already_complete(args, out, capsys) -> None:
    """``args`` again with train.resume=auto: exit 0, one line on stdout, nothing on stderr."""
    capsys.readouterr()
    assert main([*args, "train.resume=auto"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert captured.out.strip().splitlines() == [
        f"already complete at step 2: {out / 'checkpoints'}/2 is the final checkpoint (train.steps=2); "
        f"nothing to train"], captured.out


def test_resume_auto_on_a_finished_dense_run_is_exit_0_already_complete(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", *HERE, "train.steps=2", f"train.out_dir={out}"]
    assert main(args) == 0
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    _assert_requeue_is_already_complete(args, out, capsys)
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before  # nothing written
    result = mp.train(None, None, mp.Config(), *HERE, "train.steps=2", f"train.out_dir={out}",
                      "train.resume=auto")
    assert result.already_complete and result.step == 2 and result.history == []


def test_resume_auto_on_a_finished_supernet_run_is_exit_0_already_complete(tmp_path, capsys):
    out = tmp_path / "super"
    args = ["supernet", *SUPERNET, "train.steps=2", f"train.out_dir={out}"]
    assert main(args) == 0
    _assert_requeue_is_already_complete(args, out, capsys)
    assert not (out / LOCK_NAME).exists()
    np.testing.assert_array_equal(committed_steps(out / "checkpoints"), [2])


def test_a_ctrl_c_python_cannot_raise_is_recorded_not_printed():
    # Python raises a Ctrl-C wherever the main thread is; inside a __del__ it cannot
    # propagate and Python printed "Exception ignored in ..." with a traceback beside the
    # command's one line. The request is recorded and raised where it can be handled.
    import signal
    import sys

    from mindpipe_jax.train.signals import StartupInterrupts, raise_if_interrupted

    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("this test process has its own SIGINT handler")
    reports = []
    previous = sys.unraisablehook
    sys.unraisablehook = reports.append
    try:
        with StartupInterrupts():
            class ExitsDuringCtrlC:
                def __del__(self):
                    signal.raise_signal(signal.SIGINT)  # the handler runs inside __del__

            ExitsDuringCtrlC()  # collected at once
            with pytest.raises(KeyboardInterrupt):
                raise_if_interrupted()

            class Fails:
                def __del__(self):
                    raise ValueError("not a Ctrl-C")

            Fails()
    finally:
        sys.unraisablehook = previous
    assert [r.exc_type for r in reports] == [ValueError]  # other reports still reach the old hook


def test_a_ctrl_c_while_the_last_save_is_written_lets_it_finish(tmp_path, monkeypatch):
    """The loop is over and its last checkpoint is being written: a Ctrl-C then (seen in a
    CLI run whose 50 steps ended before the test's signal) raised KeyboardInterrupt out of
    the wait, exit 130 with orbax's traceback and the save half written. Now the save
    finishes and the run ends as a stop would; a second Ctrl-C stops the wait at once."""
    from mindpipe_jax.train.signals import FinalSave

    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("this test process has its own SIGINT handler")
    original = Checkpointer.close

    def close_after_a_ctrl_c(self):
        signal.raise_signal(signal.SIGINT)  # the user's Ctrl-C, as the last save is waited for
        original(self)

    monkeypatch.setattr(Checkpointer, "close", close_after_a_ctrl_c)
    out = tmp_path / "run"
    try:
        result = mp.train(None, None, mp.Config(), *HERE, "train.steps=4", "train.checkpoint_every=2",
                          f"train.out_dir={out}")
    except KeyboardInterrupt:  # failed here, not as an interrupt of the whole test session
        pytest.fail("a Ctrl-C during the last save escaped the run")
    assert result.step == 4
    assert committed_steps(out / "checkpoints") == [2, 4]
    with pytest.raises(KeyboardInterrupt), FinalSave() as final:
        signal.raise_signal(signal.SIGINT)
        assert final.received == "SIGINT"
        signal.raise_signal(signal.SIGINT)  # asked twice
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
