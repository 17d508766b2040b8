"""8 simulated CPU devices for every test, set before any JAX operation."""

import os

os.environ.setdefault("XLA_FLAGS", "")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # quiet XLA's C++ warnings in test logs

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
