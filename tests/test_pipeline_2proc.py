"""The 2-process simulator benchmark runs end to end (``--smoke``: a tiny GPT, one
calibration run and one predicted run) and prints a measured and a predicted step
time for each. Correctness only: how close the prediction is depends on the
machine's load and is the benchmark's figure, not a test."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from two_procs import run_smoke

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "pipeline_2proc.py"


def _rows(text: str) -> list[dict]:
    """The result table's rows: schedule/fuse v m ticks role measured IQR neighbour err 1/tick err ..."""
    rows = []
    for line in text.splitlines():
        cells = line.split()
        if len(cells) >= 11 and cells[4] in ("calibration", "prediction"):
            rows.append(dict(schedule=cells[0], role=cells[4], measured=float(cells[5]),
                             neighbour=float(cells[7]), table=float(cells[9])))
    return rows


@pytest.mark.slow
def test_two_process_benchmark_prints_measured_and_predicted(tmp_path):
    # The script bounds its own workers (--timeout-s) and kills them on failure; the
    # outer limit also covers its start-up. Two compiles take ~25 s on 2 idle cores.
    text = run_smoke(SCRIPT, tmp_path / "smoke.txt", worker_timeout_s=200, timeout_s=240)
    rows = _rows(text)
    assert {r["role"] for r in rows} == {"calibration", "prediction"}, text
    for r in rows:
        for key in ("measured", "neighbour", "table"):
            assert math.isfinite(r[key]) and r[key] > 0, (key, r)
    assert "predictions within +-15%" in text
    assert "per-device busy, predicted runs" in text
