"""The host never queues more than a bounded number of programs ahead of the devices
(parallel/dispatch.py): XLA:CPU aborts the process on a collective deadlock past ~32
queued computations per device. The failure mode is an abort, so the runs that would
hit it are children with a timeout, and their exit status is the test."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mindpipe_jax.parallel import dispatch
from mindpipe_jax.parallel.dispatch import DispatchWindow, throttle

ROOT = Path(__file__).resolve().parents[1]


def _child(code: str, timeout: int = 240) -> subprocess.CompletedProcess:
    prelude = "import jax\njax.config.update('jax_num_cpu_devices', 8)\n"
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_the_window_waits_for_the_oldest_step_beyond_its_limit(monkeypatch):
    waited = []
    monkeypatch.setattr(dispatch.jax, "block_until_ready", lambda x: waited.append(x))
    window = DispatchWindow(limit=2)
    for step in range(5):
        window.push(step)
        assert len(window) == min(step + 1, 2)
    assert waited == [0, 1, 2]  # the oldest, one per push past the limit
    with pytest.raises(ValueError, match="a dispatch window of 0 steps: must be >= 1"):
        DispatchWindow(0)


def test_throttle_waits_every_nth_program(monkeypatch):
    waited = []
    monkeypatch.setattr(dispatch.jax, "block_until_ready", lambda x: waited.append(x))
    for i in range(20):
        assert throttle(i, f"carry{i}", every=8) == f"carry{i}"
    assert waited == ["carry8", "carry16"]


def test_a_long_chain_of_collective_programs_runs_through_the_window():
    proc = _child("""
        import jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec as P
        from mindpipe_jax.parallel.dispatch import DispatchWindow, STEPS_AHEAD
        mesh = jax.make_mesh((8,), ("d",))
        x = jax.device_put(jnp.ones((8, 256)), NamedSharding(mesh, P("d")))
        step = jax.jit(lambda x: (x + jnp.sum(x) * 1e-9, jnp.sum(x)), donate_argnums=0)
        window = DispatchWindow()
        for _ in range(200):  # without the window this aborted at 33 queued (parallel/dispatch.py)
            x, total = step(x)
            window.push(total)
            assert len(window) <= STEPS_AHEAD
        print("total", float(total))
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert float(proc.stdout.split("total")[1]) == pytest.approx(8 * 256, rel=1e-3)


@pytest.mark.slow
def test_the_train_loop_logging_rarely_does_not_abort_xla(tmp_path):
    """The train loop with its only host sync at the end (log_every > steps) on a step
    slower than its dispatch: before the window, 120 steps of this queued up and XLA
    aborted (exit -6) after its 40 s rendezvous timeout."""
    proc = _child(f"""
        import mindpipe_jax as mp
        r = mp.train(None, None, mp.Config(), "model.d_model=64", "model.n_layers=4", "model.n_heads=4",
                     "model.seq_len=64", "parallel.data=8", "parallel.tensor=1", "train.global_batch=32",
                     "train.steps=120", "train.log_every=1000", "train.eval_every=0",
                     "train.checkpoint_every=0", "train.progress=false", "train.tensorboard=false",
                     "train.out_dir={tmp_path / 'run'}")
        print("loss", r.history[-1]["loss"])
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loss" in proc.stdout


def test_many_validation_batches_do_not_abort_xla(tmp_path):
    """Evaluation queued every validation batch at once: train.eval_batches=100000 (all the
    split's, here several hundred) aborted the run after XLA's 40 s rendezvous timeout
    (exit -6) before its first step's validation loss. It now keeps the window, and says
    that it evaluated fewer batches than asked (all the split holds)."""
    proc = _child(f"""
        import mindpipe_jax as mp
        r = mp.train(None, None, mp.Config(), "model.d_model=32", "model.n_layers=2", "model.n_heads=2",
                     "model.seq_len=16", "train.global_batch=8", "train.steps=1", "train.eval_batches=100000",
                     "data.source=synthetic", "train.checkpoint_every=0", "train.progress=false",
                     "train.tensorboard=false", "train.out_dir={tmp_path / 'run'}")
        print("val_loss", r.final_val_loss)
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shown = [line for line in proc.stdout.splitlines() if line.startswith("validation: ")]
    assert len(shown) == 1 and "(train.eval_batches=100000)" in shown[0], proc.stdout
    assert int(shown[0].split()[1]) > 100, shown  # enough queued to have aborted before
