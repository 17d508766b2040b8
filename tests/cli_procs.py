"""Run ``python -m mindpipe_jax train`` in child processes for the reliability and
multi-host tests: an environment that finds this checkout, a persistent JAX
compilation cache shared by the children of one test session (the same tiny
programs are compiled again and again otherwise), and a background reader that
collects each child's output so a test can act when it reaches a given step.

Every wait is bounded; on a timeout the child is killed (only that child) and
the test fails with the end of its output. ``command="supernet"`` runs ``mindpipe
supernet`` the same way (its step lines pad the step number: ``step     3 |``).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_STEP_LINE = re.compile(r"^step +(\d+) \|")


def cli_env(cache_dir: Path | None = None, **extra: str) -> dict[str, str]:
    """The test runner's environment without launcher variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MINDPIPE_", "SLURM_"))}
    env.update(PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
               PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2", JAX_PLATFORMS="cpu")
    if cache_dir is not None:
        env.update(JAX_COMPILATION_CACHE_DIR=str(cache_dir),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    env.update(extra)
    return env


class Train:
    """One ``mindpipe train`` (or ``command``) child; its stdout and stderr are read line by line."""

    def __init__(self, args: list[str], *, env: dict[str, str], cwd: Path, command: str = "train"):
        self.args = args
        self.proc = subprocess.Popen([sys.executable, "-m", "mindpipe_jax", command, *args], cwd=cwd,
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, bufsize=1)
        self.lines: list[str] = []
        self.last_step = 0
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                if m := _STEP_LINE.match(line):
                    self.last_step = int(m.group(1))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    @property
    def output(self) -> str:
        with self._changed:
            return "\n".join(self.lines)

    def wait_for_step(self, step: int, timeout: float) -> int:
        """Block until the child has logged ``step`` (or a later one); returns that step."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while self.last_step < step:
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    break
                self._changed.wait(min(left, 1.0))
            reached = self.last_step
        if reached < step:
            self.kill()
            pytest.fail(f"child never logged step {step} (rc {self.proc.returncode}); output:\n"
                        + self.output[-4000:])
        return reached

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"child ran over {timeout:.0f}s; output:\n" + self.output[-4000:])
        self._reader.join(timeout=10)
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self._reader.join(timeout=10)


def run_train(args: list[str], *, env: dict[str, str], cwd: Path, timeout: float = 240,
              command: str = "train") -> tuple[int, str]:
    """Run one ``mindpipe train`` (or ``command``) to the end: (exit status, output)."""
    child = Train(args, env=env, cwd=cwd, command=command)
    rc = child.wait(timeout)
    return rc, child.output


def kill_after_first_commit(child: Train, ckpt: Path, steps: int) -> int:
    """SIGKILL ``child`` once a checkpoint under ``ckpt`` is committed; the newest committed
    step, which must come before the run's last step ``steps``."""
    from mindpipe_jax.train.checkpoint import committed_steps

    # A bound, not a speed check: on a 2-core machine under heavy load the first
    # asynchronous commit once took over 60 s.
    deadline = time.monotonic() + 240
    while not committed_steps(ckpt) and time.monotonic() < deadline:
        time.sleep(0.01)
    child.signal(signal.SIGKILL)
    assert child.wait(30) == -signal.SIGKILL
    committed = committed_steps(ckpt)
    assert committed and committed[-1] < steps, (committed, child.output[-2000:])
    return committed[-1]


def plant_interrupted_saves(ckpt: Path, last: int, every: int) -> None:
    """What an interrupted save can leave after step ``last``: orbax's temporary directory,
    and (on object stores) a step directory without the commit marker, both with damaged
    arrays, so restoring either one would fail the run."""
    from mindpipe_jax.train.checkpoint import COMMIT_MARKER

    for name in (str(last + every), f"{last + 2 * every}.orbax-checkpoint-tmp-1234567890"):
        partial = ckpt / name
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(ckpt / str(last), partial)
        (partial / COMMIT_MARKER).unlink()
        for f in (partial / "state").rglob("*"):
            if f.is_file():
                f.write_bytes(b"\0half-written")
