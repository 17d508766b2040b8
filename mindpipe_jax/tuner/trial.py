"""Short real trials: run a candidate's train step on real (random) parameters and a
synthetic batch, and time it.

The step is the one ``mindpipe_jax.train`` would compile for that configuration
(``aot.build_step``); the batch is random tokens of the model's vocabulary, which
costs what a real batch costs. Timing: compile, ``warmup`` steps, then the
median of ``steps`` single steps, each waited for with ``block_until_ready``
(medians, because a shared machine's noise comes in bursts).
"""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np

from mindpipe_jax.config import Config
from mindpipe_jax.tuner.aot import build_step
from mindpipe_jax.tuner.space import Candidate


def measure_candidate(cfg: Config, cand: Candidate, *, steps: int = 5, warmup: int = 2, model=None,
                      devices=None) -> float:
    """Median seconds per step of ``cand`` (random init, synthetic tokens)."""
    from mindpipe_jax.train.state import init_train_state

    run_cfg = cand.apply(cfg)
    devices = list(jax.devices() if devices is None else devices)[:cand.devices]
    built = build_step(run_cfg, model, devices)
    with jax.set_mesh(built.mesh):
        state = init_train_state(built.spec, built.create, built.tx, built.mesh, run_cfg.train.seed,
                                 built.shardings)
        rng = np.random.default_rng(0)
        shape = (run_cfg.train.global_batch, run_cfg.model.seq_len)
        tokens = rng.integers(0, run_cfg.model.vocab_size, (shape[0], shape[1] + 1)).astype(np.int32)
        batch = {k: jax.device_put(v, built.batch_sharding)
                 for k, v in (("inputs", tokens[:, :-1]), ("targets", tokens[:, 1:]))}
        step = built.jitted
        for _ in range(warmup):
            state, metrics = step(state, batch)
        jax.block_until_ready(state)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            state, metrics = step(state, batch)
            jax.block_until_ready(state)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)
