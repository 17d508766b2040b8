"""8 simulated CPU devices for every test, set before any JAX operation."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import xdist_requeue
from xla_flags import CHILD, DEFAULT_EMITTERS, FAST

# The tests' models are tiny: compiling dominates their time. Every test process (and
# its children, which inherit it) compiles with xla_flags.FAST; tests of what XLA's
# default emitters give run with those (xla_flags.py says why). Set XLA_FLAGS yourself
# to run every test with other flags.
os.environ.setdefault("XLA_FLAGS", FAST)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # quiet XLA's C++ warnings in test logs

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


def pytest_configure(config):
    xdist_requeue.install(config)  # a crashed worker fails its test, not the whole run


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` first, each kind in collection order. xdist's ``loadgroup``
    hands out work units largest first, then in collection order (modules alphabetically),
    so a slow test collected late could run alone at the end while the other worker has
    nothing left to do."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory) -> Path:
    """The persistent compilation cache of this test run: this process's programs and the
    ``mindpipe`` children the tests start with ``cli_procs.cli_env(compile_cache)``.

    Tests compile the same tiny programs again and again: ``mp.train`` jits anew in each
    run and its resumed copy, the fixtures of several files train one config, and a
    child ``mindpipe train`` compiles what an in-process run of its config compiled (a
    cache hit loads the executable XLA compiled before: the same bits, the same HLO text
    and memory analysis). Without a cache tests/test_train.py took 63 s, 49 s with one.
    The xdist workers of one run share the directory, as they share the tests of a
    file (test_byom.py with ``-n 2``: 328 s with one cache per worker, 249 s shared);
    JAX's key includes the directory, so only a shared one can hit. Two writers of one
    entry write the same bytes; a read of an entry still being written fails zlib's
    check, and JAX then warns and compiles. A ``JAX_COMPILATION_CACHE_DIR`` set by the
    user is used as it is.
    """
    if jax.config.jax_compilation_cache_dir:
        return Path(jax.config.jax_compilation_cache_dir)
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "jax_compile_cache"
    shared.mkdir(exist_ok=True)
    return shared


@pytest.fixture(scope="session", autouse=True)
def _compilation_cache(compile_cache):
    """This process compiles through ``compile_cache``."""
    if jax.config.jax_compilation_cache_dir:
        yield
        return
    from jax.experimental.compilation_cache import compilation_cache

    jax.config.update("jax_compilation_cache_dir", str(compile_cache))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    compilation_cache.reset_cache()  # a compile at collection time may have found no cache set
    yield


@pytest.fixture(scope="session", autouse=True)
def _calibration_cache(tmp_path_factory):
    """Machine calibrations the tests measure (``tuner.calibrate.load_or_measure`` without a
    cache directory: the tuner, ``mindpipe tune``) are cached in this test process's
    temporary directory, not the user's ``~/.cache/mindpipe_jax``: measured under the
    suite's load, their rates are several times too low, and every later tune or
    benchmark on the machine would read them (one did, 2026-12-03: 1.9 GFLOP/s per busy
    device where a quiet calibration has 13.5)."""
    from mindpipe_jax.tuner import calibrate

    path = tmp_path_factory.mktemp("calibration_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(calibrate, "default_cache_dir", lambda: path)
        yield


def pytest_pyfunc_call(pyfuncitem):
    """A test marked ``xla_default_emitters`` runs in a child pytest that compiles with
    XLA's default fusion emitters (``xla_flags.DEFAULT_EMITTERS``), unless this process
    already does (the child itself, or XLA_FLAGS set by the user)."""
    if pyfuncitem.get_closest_marker("xla_default_emitters") is None or os.environ.get(CHILD) \
            or os.environ.get("XLA_FLAGS") != FAST:
        return None
    node = pyfuncitem.nodeid.split("@", 1)[0]  # xdist's loadgroup suffix is not part of the id
    env = {**os.environ, "XLA_FLAGS": DEFAULT_EMITTERS, CHILD: "1"}
    root = Path(__file__).resolve().parents[1]
    try:
        command = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", node]
        proc = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired as err:  # subprocess.run kills the child it started
        pytest.fail(f"{node} with XLA's default emitters ran over {err.timeout}s")
    if proc.returncode != 0 or "1 passed" not in proc.stdout:
        pytest.fail(f"{node} with XLA's default emitters (XLA_FLAGS={DEFAULT_EMITTERS!r}), in a child "
                    f"pytest, exited {proc.returncode}:\n{proc.stdout[-6000:]}{proc.stderr[-2000:]}",
                    pytrace=False)
    return True
