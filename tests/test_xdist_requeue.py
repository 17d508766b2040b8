"""The test run survives a crashed worker (tests/xdist_requeue.py): a child pytest on
2 workers with ``--dist loadgroup`` whose tests abort the process, once alone and once
inside an xdist group, ends with those two failed and every other test run. Without
the patch the same child never ends (checked by hand: killed at 60 s)."""

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
import xdist_requeue

def pytest_configure(config):
    xdist_requeue.install(config)
"""

ALONE = """
import os
import pytest

@pytest.mark.parametrize("i", range(12))
def test_alone(i):
    if i == 5:
        os.abort()
"""

GROUPED = """
import os
import pytest

pytestmark = pytest.mark.xdist_group("g")

@pytest.mark.parametrize("i", range(6))
def test_grouped(i):
    if i == 2:
        os.abort()
"""


def test_a_crashed_worker_fails_its_test_and_the_rest_runs(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_alone.py").write_text(ALONE)
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    command = [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-q",
               "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path)]
    proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    summary = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "2 failed, 16 passed" in summary, proc.stdout[-3000:]
    assert "crashed while running 'test_alone.py::test_alone[5]'" in proc.stdout
    assert "crashed while running 'test_grouped.py::test_grouped[2]@g'" in proc.stdout
