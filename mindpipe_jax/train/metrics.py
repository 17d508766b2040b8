"""Where metrics go: a JSONL file, TensorBoard event files, and the terminal.

Only process 0 writes. Values arrive already on the host (the loop fetches them
once per logging interval, never per step, so logging adds no device syncs).
A resumed run first drops the JSONL records past the step it resumes from: the
steps a killed run logged after its last checkpoint are trained (and logged)
again, and each step should appear once.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import jax
import numpy as np

from mindpipe_jax.atomic_write import write_atomically
from mindpipe_jax.train.tb_events import ScalarEvents

# Dense peak FLOP/s per device by device kind (bf16 for accelerators). The CPU
# has no meaningful published peak; set train.peak_tflops to get an MFU there.
PEAK_TFLOPS = {
    "H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0,
    "TPU v4": 275.0, "TPU v5 lite": 197.0, "TPU v5": 459.0, "TPU v6 lite": 918.0,
}


def peak_flops_per_device(configured_tflops: float) -> float | None:
    if configured_tflops > 0:
        return configured_tflops * 1e12
    kind = jax.devices()[0].device_kind
    for name, tflops in PEAK_TFLOPS.items():
        if name.lower() in kind.lower():
            return tflops * 1e12
    return None


def mfu(tokens_per_s: float, flops_per_token: float, n_devices: int, peak: float | None) -> float | None:
    if peak is None or not tokens_per_s:
        return None
    return tokens_per_s * flops_per_token / (n_devices * peak)


def _number(value) -> bool:
    return isinstance(value, int | float | np.number)


class MetricsWriter:
    def __init__(self, out_dir: Path, *, tensorboard: bool, enabled: bool, resume_step: int | None = None):
        self.enabled = enabled
        self._failed = False
        self._jsonl = None
        self._tb = None
        if not enabled:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / "metrics.jsonl"
        if path.exists():
            # Resuming: drop what the run logged past its checkpoint. Starting fresh in a
            # directory without checkpoints: what is there came from an attempt killed
            # before its first save, and its steps are about to be trained again.
            _truncate_after(path, resume_step or 0)
        self._jsonl = open(path, "a", buffering=1)
        if tensorboard:
            # The steps after ``resume_step`` are trained again: TensorBoard hides what an
            # earlier attempt logged for them (the purge step), as JSONL drops it above;
            # else both attempts' curves overlap from the checkpoint on. The file name
            # gets the time in ns: tensorboardX names it by the second and host, so an
            # attempt started within the same second truncated the earlier one's file.
            self._tb = ScalarEvents(out_dir / "tensorboard", purge_step=(resume_step or 0) + 1,
                                    filename_suffix=f".{time.time_ns()}")

    def write(self, step: int, values: dict) -> None:
        if not self.enabled:
            return
        # A value not measured this step (NaN: e.g. the noise statistics on a step that
        # skips them) is null in JSONL and left out of TensorBoard, which warns per NaN.
        clean = {k: (None if _number(v) and not math.isfinite(v) else v.item() if isinstance(v, np.number)
                     else v) for k, v in values.items()}
        try:
            self._jsonl.write(json.dumps({"step": step, **clean}) + "\n")
            if self._tb is not None:
                self._tb.add_scalars(step, {key: value for key, value in clean.items() if _number(value)})
        except OSError as err:  # a full disk: the error names the file
            err.filename = err.filename or self._jsonl.name
            self._failed = True
            raise

    def close(self) -> None:
        """Close the files; after a failed write (a full disk) what they still hold
        unwritten is dropped: closing would fail again and hide the first error."""
        for f in (self._jsonl, self._tb):
            if f is None:
                continue
            try:
                f.close()
            except OSError:
                if not self._failed:
                    raise


def _truncate_after(path: Path, step: int) -> None:
    """Keep the JSONL records up to ``step``; drop later ones and a line cut short by a kill."""
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(record, dict) or not isinstance(record.get("step"), int) \
                or record["step"] <= step:
            kept.append(line)
    write_atomically(path, "".join(f"{line}\n" for line in kept))


def format_line(step: int, values: dict) -> str | None:
    """The step's log line; None where ``values`` holds none of the figures it shows (a
    record of only a repartition or a tuner event, which print their own line)."""
    parts = [f"step {step}"]
    for key, fmt in (("loss", ".4f"), ("val_loss", ".4f"), ("lr", ".2e"), ("grad_norm", ".3f"),
                     ("tokens_per_s", ",.0f"), ("step_time_s", ".3f"), ("mfu", ".1%")):
        value = values.get(key)
        if value is not None:
            parts.append(f"{key} {value:{fmt}}")
    return " | ".join(parts) if len(parts) > 1 else None
