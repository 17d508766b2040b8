"""benchmarks/gpu/train_step.py --smoke: the H200 benchmark script runs end to end on the CPU.

The real run needs a GPU (benchmarks/gpu/run.sh on a lent H200); this only checks that
the script builds the model, times the train step and the per-layer costs, and prints
finite numbers, so it does not rot where CI has no accelerator.
"""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from xla_flags import FAST

REPO = Path(__file__).resolve().parents[1]
NUMBER = r"([-+0-9.eEinfa]+)"


@pytest.mark.slow
def test_gpu_train_step_smoke(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env.pop("OUT", None)
    # One CPU device, not the suite's 8 simulated ones, and cheaper CPU compiles: the
    # smoke run is almost all compilation (the train step and ~10 per-layer programs).
    env["XLA_FLAGS"] = FAST
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu" / "train_step.py"), "--smoke",
         "--out", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=180)  # a bound, not a speed check
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr

    def value(label):
        m = re.search(rf"^{label}: {NUMBER}", out, re.M)
        assert m, f"no '{label}:' line in\n{out}"
        x = float(m.group(1))
        assert math.isfinite(x) and x > 0, f"{label} = {x}"
        return x

    value("tokens/s")
    value("TFLOP/s")
    assert re.search(r"^MFU: ", out, re.M)
    for part in ("embed", "layer", "head"):
        m = re.search(rf"^\s+{part}\s+F\s+{NUMBER} ms\s+B\s+{NUMBER} ms\s+W\s+{NUMBER} ms\s+"
                      rf"BW\s+{NUMBER} ms", out, re.M)
        assert m, f"no per-layer line for {part} in\n{out}"
        times = [float(g) for g in m.groups()]
        assert all(math.isfinite(t) and t >= 0 for t in times), (part, times)
        assert times[0] > 0, (part, times)
    files = list(tmp_path.glob("*-cpu.txt"))
    assert len(files) == 1, files
    text = files[0].read_text()
    assert "# device: cpu" in text and "# command:" in text and "tokens/s:" in text
