"""8 simulated CPU devices for every test, set before any JAX operation."""

import os

import pytest

# The tests' models are tiny: compiling dominates their time, not running. LLVM at -O0
# compiles XLA:CPU programs ~1/3 faster (a vPipe step: 7.8 -> 5.2 s); what XLA computes
# is the same (gradient tests hold at the same tolerances). Children of the tests
# (cli_procs) inherit it. Set XLA_FLAGS yourself to test with other flags.
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # quiet XLA's C++ warnings in test logs

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


@pytest.fixture(scope="session", autouse=True)
def _compilation_cache(tmp_path_factory):
    """A persistent compilation cache for the programs this test process compiles.

    Many tests train the same tiny config more than once in one process (a run and its
    resumed copy, fixtures of several files): ``mp.train`` jits anew each time, and
    without this each one compiled again (tests/test_train.py: 63 s -> 49 s with it). A
    cache hit loads the executable XLA compiled before: the same bits, the same HLO text
    and memory analysis. It is per test process (each xdist worker has its own), and only
    for this process: child processes keep the caches ``cli_procs.cli_env`` gives them.
    A ``JAX_COMPILATION_CACHE_DIR`` set by the user is left as it is.
    """
    if jax.config.jax_compilation_cache_dir:
        yield
        return
    from jax.experimental.compilation_cache import compilation_cache

    jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("jax_cache_in_process")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    compilation_cache.reset_cache()  # a compile at collection time may have found no cache set
    yield
