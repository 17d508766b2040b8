"""Short real trials: run a candidate's train step on real (random) parameters and a
synthetic batch, and time it.

The step is the one ``mindpipe_jax.train`` would compile for that configuration
(``aot.build_step``); the batch is random tokens of the model's vocabulary, which
costs what a real batch costs. Timing: compile, ``warmup`` steps, then the
median of single steps, each waited for with ``block_until_ready`` (medians,
because a shared machine's noise comes in bursts). ``Trial`` keeps a compiled
candidate ready, so a benchmark can time many candidates in interleaved rounds
and let the machine's drift hit all of them alike.
"""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np

from mindpipe_jax.config import Config
from mindpipe_jax.tuner.aot import build_step
from mindpipe_jax.tuner.space import Candidate


class Trial:
    """A candidate's compiled step with its state and one batch, ready to time."""

    def __init__(self, cfg: Config, cand: Candidate, *, model=None, devices=None, warmup: int = 2):
        from mindpipe_jax.train.state import init_train_state

        run_cfg = cand.apply(cfg)
        devices = list(jax.devices() if devices is None else devices)[:cand.devices]
        built = build_step(run_cfg, model, devices)
        self.candidate, self.mesh, self.step = cand, built.mesh, built.jitted
        with jax.set_mesh(self.mesh):
            self.state = init_train_state(built.spec, built.create, built.tx, built.mesh, run_cfg.train.seed,
                                          built.shardings)
            rng = np.random.default_rng(0)
            shape = (run_cfg.train.global_batch, run_cfg.model.seq_len + 1)
            tokens = rng.integers(0, run_cfg.model.vocab_size, shape).astype(np.int32)
            self.batch = {k: jax.device_put(v, built.batch_sharding)
                          for k, v in (("inputs", tokens[:, :-1]), ("targets", tokens[:, 1:]))}
        self.times: list[float] = []
        self.run(warmup, record=False)

    def run(self, steps: int, *, record: bool = True) -> list[float]:
        """Run ``steps`` steps, each timed alone; returns (and with ``record`` keeps) the times."""
        times = []
        with jax.set_mesh(self.mesh):
            jax.block_until_ready(self.state)
            for _ in range(steps):
                t0 = time.perf_counter()
                self.state, _ = self.step(self.state, self.batch)
                jax.block_until_ready(self.state)
                times.append(time.perf_counter() - t0)
        if record:
            self.times += times
        return times

    @property
    def median(self) -> float:
        return statistics.median(self.times)


def measure_candidate(cfg: Config, cand: Candidate, *, steps: int = 5, warmup: int = 2, model=None,
                      devices=None) -> float:
    """Median seconds per step of ``cand`` (random init, synthetic tokens)."""
    return statistics.median(Trial(cfg, cand, model=model, devices=devices, warmup=warmup).run(steps))
