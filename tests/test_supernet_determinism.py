"""SPara's guarantee: the same supernet, bit for bit, on 1, 2, 4 and 8 devices and on
splits of them between the ``subnet``, ``fsdp`` and ``data`` axes (for a fixed ``tensor``
size, on every split of the others), in all three semantics, on the
sliced path (the default): sync on subnet axes 1, 2, 4, 8 and data axes 1, 2, 4, 8,
sequential and operator-causal each on pure subnet, pure data and mixed splits
(``supernet_worker.SPLITS``); the masked path (``supernet.ladder_levels=0``, sync) on 1
device and on subnet=4 x data=2; and the same search result.

One worker process per device count (``jax_num_cpu_devices`` is read once, before the
backend starts): ``supernet_worker.py`` trains the tiny supernet (3 layers of which
subnets run 2, d=32, K=8 subnets per step, 2 steps, clipping active) on every split of
its devices and saves the params and its search's top-k. Every subnet runs sliced at
one shape below the supernet's size in depth, width and heads (one round program per
run: see the worker). The control: the same run with ``supernet.vmap_width=2`` instead
of 1 must differ in its bits — so the comparison can see a change in how gradients are
computed, and the equality is not vacuous."""

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
pytestmark = pytest.mark.xdist_group("supernet_determinism")

WORKER = Path(__file__).with_name("supernet_worker.py")
TIMEOUT_S = 1500  # ~4 CPU-minutes of compiling; a shared 2-core machine can triple that
DEVICES = (1, 2, 4, 8)
# The worker's one shape: 2 of 3 blocks, FFN width 32 of 128, 1 of 2 heads (supernet_worker.SHAPE;
# not imported: that would import the library into this process for two constants).
SHAPE = ((32, 1), (32, 1))


def _diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> list[str]:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    out = []
    for key in sorted(a):
        x, y = a[key], b[key]
        if x.dtype != y.dtype or x.shape != y.shape:
            out.append(f"{key}: {x.dtype}{x.shape} vs {y.dtype}{y.shape}")
        elif x.tobytes() != y.tobytes():
            out.append(f"{key}: max |diff| {np.abs(x.astype(np.float64) - y).max():.3g}")
    return out


def _group(arrays, prefix: str) -> dict[str, np.ndarray]:
    out = {k[len(prefix):]: arrays[k] for k in arrays if k.startswith(prefix)}
    assert out, f"nothing under {prefix!r}"
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{n: {key: array}} from one worker per device count, run side by side."""
    tmp = tmp_path_factory.mktemp("supernet_determinism")
    # XLA's default fusion emitters: the bits SPara promises are those of the programs users
    # compile (tests/xla_flags.py).
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "2", "XLA_FLAGS": DEFAULT_EMITTERS}
    procs = {}
    try:
        for n in DEVICES:
            log = open(tmp / f"worker{n}.log", "wb")  # a file, not a pipe: no deadlock
            procs[n] = (subprocess.Popen([sys.executable, str(WORKER), str(n), str(tmp / f"w{n}.npz")],
                                         env=env, stdout=log, stderr=subprocess.STDOUT), log)
        deadline = time.monotonic() + TIMEOUT_S
        for n, (proc, log) in procs.items():
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()  # this child only
                proc.wait()
                pytest.fail(f"worker for {n} devices ran over {TIMEOUT_S}s; log:\n"
                            + (tmp / f"worker{n}.log").read_text()[-3000:])
            log.close()
            if proc.returncode != 0:
                pytest.fail(f"worker for {n} devices exited with {proc.returncode}; log:\n"
                            + (tmp / f"worker{n}.log").read_text()[-3000:])
    finally:
        for proc, log in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    out = {}
    for n in DEVICES:
        with np.load(tmp / f"w{n}.npz") as arrays:
            out[n] = {k: arrays[k] for k in arrays.files}
    return out


def _splits(runs, prefix: str) -> set[tuple[int, int]]:
    """{(devices, subnet axis)} of the runs stored under ``prefix`` (e.g. ``sliced/sync``)."""
    return {(n, int(key[len(prefix) + 2:].split("/", 1)[0])) for n in DEVICES for key in runs[n]
            if key.startswith(prefix + "/S")}


@pytest.mark.slow
@pytest.mark.parametrize("semantics", ["sync", "sequential", "operator-causal"])
def test_sliced_params_are_bitwise_equal_on_every_device_count_and_split(runs, semantics):
    reference = _group(runs[1], f"sliced/{semantics}/S1/")
    assert len(reference) > 10  # every parameter of the supernet
    splits = _splits(runs, f"sliced/{semantics}")
    for n, s in sorted(splits):
        diff = _diff(reference, _group(runs[n], f"sliced/{semantics}/S{s}/"))
        assert not diff, (f"sliced {semantics}: subnet={s} x data={n // s} differs from 1 device:\n"
                          + "\n".join(diff))
    # Every device count; subnet-split, data-split and mixed layouts (sync: every axis size).
    assert {n for n, _ in splits} == set(DEVICES)
    assert any(s == n > 1 for n, s in splits) and any(s == 1 < n for n, s in splits)
    assert any(1 < s < n for n, s in splits)
    if semantics == "sync":
        assert {s for _, s in splits} == {n // s for n, s in splits} == {1, 2, 4, 8}


@pytest.mark.slow
@pytest.mark.parametrize("semantics", ["sync"])
def test_masked_params_are_bitwise_equal_on_its_device_counts(runs, semantics):
    reference = _group(runs[1], f"masked/{semantics}/S1/")
    compared = []
    for n in DEVICES[1:]:
        for key in {k.rsplit("/", 1)[0] for k in runs[n] if k.startswith(f"masked/{semantics}/S")}:
            s = int(key.rsplit("/S", 1)[1])
            diff = _diff(reference, _group(runs[n], key + "/"))
            assert not diff, (f"masked {semantics}: subnet={s} x data={n // s} differs from 1 device:\n"
                              + "\n".join(diff))
            compared.append((n, s))
    assert compared, f"no masked {semantics} run on more than one device"


@pytest.mark.slow
def test_fsdp_keeps_the_bits_and_tensor_keeps_its_own_on_every_split(runs):
    """fsdp is a data-parallel axis whose devices also split the stored parameters: the
    bits of 1 device. A tensor split rounds its matmuls' partial sums its own way, the
    same way on every split of the other devices (supernet_worker.LAYOUTS)."""
    one = _group(runs[1], "sliced/sync/S1/")
    diff = _diff(one, _group(runs[4], "layout/S2F2/"))
    assert not diff, "sync subnet=2 x fsdp=2 differs from 1 device:\n" + "\n".join(diff)
    tensor2 = _group(runs[2], "layout/T2/")
    diff = _diff(tensor2, _group(runs[8], "layout/S2F2T2/"))
    assert not diff, "sync subnet=2 x fsdp=2 x tensor=2 differs from tensor=2 on 2:\n" + "\n".join(diff)
    print("tensor=2 vs 1 device:", _diff(one, tensor2) or "bitwise equal")


@pytest.mark.slow
def test_every_run_took_the_path_it_is_filed_under(runs):
    # The trainer's own report: sliced is the default, ladder_levels=0 is masked.
    for n in DEVICES:
        paths = {k[len("path/"):]: str(v) for k, v in runs[n].items() if k.startswith("path/")}
        elsewhere = ("control/", "layout/")  # runs filed by what they control, all sliced
        assert paths and all(path == key.split("/")[0] or key.startswith(elsewhere) and path == "sliced"
                             for key, path in paths.items()), (n, paths)
    # Every subnet at the one shape, below the supernet's size in depth (2 of 3 blocks),
    # FFN width (32 of 128) and heads (1 of 2): the runs are sliced in every dimension.
    for n in DEVICES:
        assert runs[n]["shapes"].tolist() == [[list(size) for size in SHAPE]], runs[n]["shapes"]
        compiles = {k: int(v) for k, v in runs[n].items() if k.startswith("compiles/sliced/")}
        print(n, "devices: programs compiled per sliced run:", compiles)


@pytest.mark.slow
def test_control_vmap_width_changes_the_bits(runs):
    # A different per-device vectorization rounds differently (~1e-7): the bitwise
    # comparison above would notice a device-count-dependent program.
    assert _diff(_group(runs[1], "sliced/sync/S1/"), _group(runs[1], "control/vmap2/"))
    # ... and the semantics differ from each other by far more.
    for other in ("sequential", "operator-causal"):
        assert _diff(_group(runs[1], "sliced/sync/S1/"), _group(runs[1], f"sliced/{other}/S1/"))
    assert _diff(_group(runs[1], "sliced/sequential/S1/"), _group(runs[1], "sliced/operator-causal/S1/"))


@pytest.mark.slow
def test_search_top_k_is_identical_on_every_device_count(runs):
    # Scored on data=1, data=2, subnet=4 and subnet=2 x data=4 evaluators (SEARCH_SPLIT).
    subnets, losses = runs[1]["search/subnets"], runs[1]["search/losses"]
    assert subnets.shape[0] == 3 and np.all(np.diff(losses) >= 0)
    for n in DEVICES[1:]:
        assert np.array_equal(runs[n]["search/subnets"], subnets), n
        assert runs[n]["search/losses"].tobytes() == losses.tobytes(), n


@pytest.mark.slow
def test_sampler_draws_the_same_subnets_in_every_process(runs):
    for n in DEVICES[1:]:
        assert np.array_equal(runs[n]["sampler"], runs[1]["sampler"])
