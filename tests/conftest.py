"""8 simulated CPU devices for every test, set before any JAX operation."""

import os

# The tests' models are tiny: compiling dominates their time, not running. LLVM at -O0
# compiles XLA:CPU programs ~1/3 faster (a vPipe step: 7.8 -> 5.2 s); what XLA computes
# is the same (gradient tests hold at the same tolerances). Children of the tests
# (cli_procs) inherit it. Set XLA_FLAGS yourself to test with other flags.
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # quiet XLA's C++ warnings in test logs

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
