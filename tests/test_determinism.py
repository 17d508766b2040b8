"""Deterministic mode: the same parameters, bit for bit, whatever the device count.

``train.deterministic=true`` cuts the global batch into ``train.virtual_shards``
fixed shards and sums their gradients in one fixed tree, so 1, 2, 4 and 8 devices
(data axis = device count) must end with bitwise identical parameters. Each device
count needs its own process (``jax_num_cpu_devices`` is read once, before the
backend starts): ``determinism_worker.py`` trains there and saves the params.

A control keeps the comparison honest: the same runs *without* deterministic mode
must differ between 1 and 8 devices, otherwise a bitwise comparison could not
detect anything. The tiny config clips on every step (``optim.clip_norm=0.05``)
and uses dropout, so the clipping norm and the per-shard dropout keys are covered.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from xla_flags import DEFAULT_EMITTERS

# One xdist worker runs all of this file's tests, so its expensive module fixture runs
# once rather than once per worker (pytest -n 2 with --dist loadgroup, pyproject.toml).
pytestmark = pytest.mark.xdist_group("determinism")

WORKER = Path(__file__).with_name("determinism_worker.py")
TIMEOUT_S = 420
# (device count, modes) of each worker process. ``plain`` only where the control needs it;
# the pipeline's modes (pipe=2 x data=N/2) on 2, 4 and 8 devices, 8's in a process of its own.
RUNS = [(1, "det,plain"), (2, "det,det-pipe,plain-pipe"), (4, "det,det-pipe"), (8, "det,plain,det-fsdp"),
        (8, "det-pipe,plain-pipe")]


def _bitwise_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> list[str]:
    """Leaves whose dtype, shape or raw bytes differ, with the largest difference."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    out = []
    for key in sorted(a):
        x, y = a[key], b[key]
        if x.dtype != y.dtype or x.shape != y.shape:
            out.append(f"{key}: {x.dtype}{x.shape} vs {y.dtype}{y.shape}")
        elif x.tobytes() != y.tobytes():
            diff = np.abs(x.astype(np.float64) - y.astype(np.float64)).max()
            out.append(f"{key}: max |diff| {diff:.3g}, "
                       f"{np.count_nonzero(x.view(np.uint8) != y.view(np.uint8))} bytes differ")
    return out


def _mode(arrays, mode: str) -> dict[str, np.ndarray]:
    prefix = f"{mode}/"
    out = {k[len(prefix):]: arrays[k] for k in arrays.files if k.startswith(prefix)}
    assert out, f"no {mode!r} params in {arrays.files}"
    return out


@pytest.fixture(scope="module")
def device_runs(tmp_path_factory):
    """{n: {mode: params}} from the worker processes (``RUNS``), run in parallel."""
    tmp = tmp_path_factory.mktemp("determinism")
    # XLA's default fusion emitters: the bits deterministic mode promises are those of the
    # programs users compile (tests/xla_flags.py).
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": DEFAULT_EMITTERS}
    procs = {}
    try:
        for i, (n, modes) in enumerate(RUNS):
            log = open(tmp / f"worker{i}.log", "wb")  # a file, not a pipe: no deadlock
            procs[i] = (subprocess.Popen([sys.executable, str(WORKER), str(n), str(tmp / f"p{i}.npz"),
                                          modes], env=env, stdout=log, stderr=subprocess.STDOUT), log)
        deadline = time.monotonic() + TIMEOUT_S
        for i, (proc, log) in procs.items():
            n, modes = RUNS[i]
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()  # this child only
                proc.wait()
                pytest.fail(f"worker for {n} devices ({modes}) ran over {TIMEOUT_S}s; log:\n"
                            + (tmp / f"worker{i}.log").read_text()[-3000:])
            log.close()
            if proc.returncode != 0:
                pytest.fail(f"worker for {n} devices ({modes}) exited with {proc.returncode}; log:\n"
                            + (tmp / f"worker{i}.log").read_text()[-3000:])
    finally:
        for proc, log in procs.values():  # on any failure, leave no worker behind
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    out = {}
    for i, (n, modes) in enumerate(RUNS):
        with np.load(tmp / f"p{i}.npz") as arrays:
            runs = out.setdefault(n, {"history": {}})
            runs.update({mode: _mode(arrays, mode) for mode in modes.split(",")})
            runs["history"].update(_mode(arrays, "history"))  # {"<mode>/loss": [...], ...}
    return out


@pytest.mark.slow
def test_deterministic_mode_is_bitwise_equal_on_1_2_4_8_devices(device_runs):
    reference = device_runs[1]["det"]
    assert len(reference) > 10  # every GPT parameter, not an empty tree
    for n in (2, 4, 8):
        diff = _bitwise_diff(reference, device_runs[n]["det"])
        assert not diff, f"deterministic params on {n} devices differ from 1 device:\n" + "\n".join(diff)


@pytest.mark.slow
def test_control_plain_mode_differs_between_1_and_8_devices(device_runs):
    # Without deterministic mode XLA's all-reduce reorders the sum (~1e-7 relative):
    # if these were equal, the bitwise test above would prove nothing.
    assert _bitwise_diff(device_runs[1]["plain"], device_runs[8]["plain"]), \
        "plain data parallelism gave bitwise equal params on 1 and 8 devices: the test cannot tell"
    # And training moved the params: the two gradient paths round differently.
    assert _bitwise_diff(device_runs[1]["det"], device_runs[1]["plain"])


@pytest.mark.slow
def test_deterministic_fsdp_equals_data_parallel(device_runs):
    """On 8 devices, data=2 x fsdp=4 (parameters stored in shards: the worker checks) gives
    the bits of data=8: the params, the losses and the clipping norms of every step."""
    diff = _bitwise_diff(device_runs[8]["det"], device_runs[8]["det-fsdp"])
    assert not diff, "deterministic data=2 x fsdp=4 differs from data=8:\n" + "\n".join(diff)
    history = device_runs[8]["history"]
    for key in ("loss", "grad_norm"):
        assert len(history[f"det-fsdp/{key}"]) == 3  # train.steps of the tiny config
        assert history[f"det/{key}"].tolist() == history[f"det-fsdp/{key}"].tolist(), (key, history)


@pytest.mark.slow
def test_deterministic_pipeline_is_bitwise_equal_on_2_4_8_devices(device_runs):
    """A 1F1B pipeline of 2 stages with data = 1, 2, 4 (each virtual shard one microbatch,
    ``pipeline_grads(deterministic=True)``): the same params, losses and clipping norms bit
    for bit; without deterministic mode the same pipelines differ (the control)."""
    reference = device_runs[2]["det-pipe"]
    assert len(reference) > 10
    for n in (4, 8):
        diff = _bitwise_diff(reference, device_runs[n]["det-pipe"])
        assert not diff, f"deterministic pipeline params on {n} devices differ from 2:\n" + "\n".join(diff)
        for key in ("loss", "grad_norm"):
            got, want = (device_runs[k]["history"][f"det-pipe/{key}"].tolist() for k in (n, 2))
            assert got == want and len(got) == 3, (n, key, got, want)
    assert _bitwise_diff(device_runs[2]["plain-pipe"], device_runs[8]["plain-pipe"]), \
        "plain pipelines gave bitwise equal params on 2 and 8 devices: the test cannot tell"
