"""Run a 2-process benchmark script (``benchmarks/afapab.py``,
``benchmarks/pipeline_2proc.py``) in ``--smoke`` mode, as the tests of those
scripts do: the script bounds and kills its own workers (``--timeout-s``); the
outer limit here also covers its start-up, and on a timeout the test fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_smoke(script: Path, out: Path, *, worker_timeout_s: int, timeout_s: int) -> str:
    """Run ``script --smoke --out out``; assert it succeeded and that ``--out``
    recorded exactly what it printed. Returns what it printed."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    try:
        proc = subprocess.run([sys.executable, str(script), "--smoke", "--timeout-s", str(worker_timeout_s),
                               "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{script.stem} --smoke did not finish in {err.timeout} s")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert out.read_text() == proc.stdout   # --out records exactly what was printed
    return proc.stdout
