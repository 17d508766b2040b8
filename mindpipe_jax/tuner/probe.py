"""A short probe run that estimates the gradient noise scale before tuning.

The offline tuner ranks batch sizes by entropyput, which needs B_noise. The probe
trains the configured model on its real data for ``steps`` steps with the batch
split into ``microbatches`` accumulated microbatches (data parallel over the
devices), and feeds each step's two squared gradient norms — the microbatches'
mean and the whole batch's — to ``noise.NoiseScale``. Nothing is written to
disk. B_noise grows as training proceeds (McCandlish et al. 2018), so a probe
at the start of training is a lower bound for later; the online tuner
(``tuner.enabled=true``) keeps re-estimating while the run goes on.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from mindpipe_jax.config import Config
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.tuner.aot import build_step
from mindpipe_jax.tuner.noise import NoiseScale


@dataclasses.dataclass
class Probe:
    b_noise: float | None
    noise: NoiseScale
    losses: list[float]
    history: list[float | None]  # B_noise after each step (None while not ready)


def estimate_b_noise(cfg: Config, *, steps: int = 30, microbatches: int = 4, model=None,
                     devices=None, ema: float = 0.8) -> Probe:
    """Train ``steps`` steps from scratch and estimate B_noise (see the module docstring)."""
    from mindpipe_jax.data import Loader, load_tokens
    from mindpipe_jax.parallel.mesh import resolve_axis_sizes
    from mindpipe_jax.train.state import init_train_state

    if steps < 1 or microbatches < 2:
        raise ConfigError(f"noise probe: steps={steps} must be >= 1 and microbatches={microbatches} >= 2")
    devices = list(jax.devices() if devices is None else devices)
    # Data parallel over every device: the simplest layout whose step computes
    # whole-model microbatch gradients (a pipeline never does).
    n = len(devices)
    batch = cfg.train.global_batch
    while n > 1 and batch % (n * microbatches):
        n //= 2
    run = cfg.replace(f"parallel.data={n}", "parallel.fsdp=1", "parallel.tensor=1", "parallel.pipe=1",
                      "parallel.subnet=1", "parallel.expert=1", f"parallel.microbatches={microbatches}",
                      "train.grad_accum=1", "train.deterministic=false", "parallel.virtual_stages=1",
                      'parallel.stage_remat="none"', "parallel.stage_layers=[]")
    resolve_axis_sizes(run.parallel, n)
    built = build_step(run, model, devices[:n], noise_stats=True)
    splits = load_tokens(run.data, run.model.vocab_size)
    loader = Loader(splits.train, seq_len=run.model.seq_len, batch_size=batch, seed=run.train.seed)
    noise = NoiseScale(ema=ema)
    plain = NoiseScale(ema=ema)  # SGD's estimate beside it, for a probe too short for Adam's
    losses: list[float] = []
    history: list[float | None] = []
    try:
        with jax.set_mesh(built.mesh):
            state = init_train_state(built.spec, built.create, built.tx, built.mesh, run.train.seed,
                                     built.shardings)
            for _ in range(steps):
                host = next(loader)
                arrays = {k: jax.device_put(np.asarray(v), built.batch_sharding) for k, v in host.items()}
                state, metrics = built.jitted(state, arrays)
                m = jax.device_get(metrics)
                noise.update_from_metrics(m)  # Adam's preconditioned noise scale (tuner/noise.py)
                plain.update_from_metrics({k: v for k, v in m.items() if not k.startswith("precond_")})
                losses.append(float(m["loss"]))
                history.append(noise.b_noise)
    finally:
        loader.close()
    # Adam's preconditioned estimate needs its second moment settled (about 14 steps at
    # b2 = 0.95) and then the EMA's warm-up: a shorter probe reports the plain estimate
    # (``probe.noise.preconditioned`` says which) rather than none.
    if noise.b_noise is None and plain.b_noise is not None:
        noise = plain
    return Probe(noise.b_noise, noise, losses, history)
