"""Real SPara steps for the supernet tuner and its benchmark: a run you can step and score.

``SparaRun(cfg)`` builds what ``supernet.train_supernet`` builds for ``cfg`` (mesh,
layout check, supernet spec and initial state, sampler, train loader, and the step:
sliced where the supernet offers it and ``supernet.ladder_levels`` > 0, else masked),
from the supernet package's public functions, and lets the caller run any number of
steps, time each one, and stop. ``train_supernet`` itself cannot serve here: it runs to
``train.steps`` (a trial must stop early while keeping the real learning-rate schedule,
which is a function of ``train.steps``) and scores subnets only at the end (a benchmark
of time to a target loss must score during training). The step choice mirrors the
trainer's eight lines; the trainer has no public "build the step" function to call.

``Panel``: the search-validation loss used by the tuner's objective and the benchmark:
the mean validation loss, with inherited weights, of a fixed panel of subnets (the
largest, the smallest and some drawn with a fixed seed), scored by the search's own
``make_evaluator`` on fixed validation batches. It is built once on one mesh and
scores parameters from any run (they are replicated; they are placed on its mesh), so
runs with different layouts and batches are scored on the same rows.
"""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mindpipe_jax.config import Config
from mindpipe_jax.data import Loader, TokenSplits, eval_batches, load_tokens
from mindpipe_jax.parallel.mesh import make_mesh, setup_runtime
from mindpipe_jax.supernet import Sampler, make_evaluator, sample_subnets, supernet_factory, supernet_spec
from mindpipe_jax.supernet.layout import param_shardings
from mindpipe_jax.supernet.plan import DATA_AXES, check_layout
from mindpipe_jax.supernet.run_setup import configured_step
from mindpipe_jax.supernet.spara import init_state, state_shardings


def runnable(cfg: Config) -> Config:
    """``cfg`` as ``train_supernet`` runs it: an automatic tensor axis becomes 1 (the
    candidates split the devices between ``subnet`` and ``data``)."""
    return cfg.replace("parallel.tensor=1") if cfg.parallel.tensor == 0 else cfg


class SparaRun:
    """A supernet training run of ``cfg`` that the caller steps: ``run(n)`` trains n steps.

    ``splits``: the data (default: ``load_tokens`` of ``cfg.data``, what the trainer
    loads); ``model``: a supernet factory (default: the reference ``SuperGPT``);
    ``check_memory``: refuse a step that cannot fit in memory before it runs.
    """

    def __init__(self, cfg: Config, *, splits: TokenSplits | None = None, model=None,
                 check_memory: bool = False):
        cfg = runnable(cfg)
        setup_runtime(cfg.parallel, cfg.distributed)
        sn, tr = cfg.supernet, cfg.train
        self.cfg = cfg
        self.mesh = mesh = make_mesh(cfg.parallel)
        check_layout(mesh, subnets_per_step=sn.subnets_per_step, vmap_width=sn.vmap_width,
                     virtual_shards=tr.virtual_shards, global_batch=tr.global_batch)
        factory = model if model is not None else supernet_factory(cfg)
        self.spec, create = supernet_spec(factory, tr.seed)
        self.sampler = Sampler(self.spec.space, sn.subnets_per_step, sn.strategy, tr.seed)
        self.splits = splits if splits is not None else load_tokens(cfg.data, cfg.model.vocab_size)
        self.loader = Loader(self.splits.train, seq_len=cfg.model.seq_len, batch_size=tr.global_batch,
                             seed=tr.seed, name="train")
        self.rows = NamedSharding(mesh, P(DATA_AXES))
        self.state = jax.jit(lambda: init_state(self.spec, create()),
                             out_shardings=state_shardings(mesh, self.spec))()
        # The trainer's step (compiled on first use: the trials' warm-up steps absorb it);
        # ``check_memory``: its largest programs compiled here and refused (``DoesNotFit``)
        # where they cannot fit beside what this host holds, as the trainer refuses them.
        try:
            configured = configured_step(self.spec, mesh, cfg, compile_with=(
                self.state, self.sampler(0)) if check_memory else None)
        except BaseException:
            self.loader.close()
            raise
        self._plan, self._step = configured.plan, configured.run
        self.step = 0
        self.seconds = 0.0  # wall time spent in steps so far
        self.last_loss = float("nan")

    def run(self, steps: int) -> list[float]:
        """Train ``steps`` more steps; each step's wall seconds (host planning, batch, step,
        waited for), as the trainer's loop pays them."""
        times = []
        with jax.set_mesh(self.mesh):
            for _ in range(steps):
                t0 = time.perf_counter()
                plan = self._plan(self.sampler(self.step))
                batch = {k: jax.device_put(v, self.rows) for k, v in next(self.loader).items()}
                self.state, metrics = self._step(self.state, plan, batch)
                jax.block_until_ready(self.state)
                times.append(time.perf_counter() - t0)
                self.step += 1
                self.last_loss = float(np.mean(jax.device_get(metrics["loss"])))
        self.seconds += sum(times)
        return times

    @property
    def params(self):
        return self.state["params"]

    def close(self) -> None:
        self.loader.close()


def median_step_s(run: SparaRun, warmup: int, steps: int) -> float:
    """Median seconds of ``steps`` steps after ``warmup`` untimed ones (compiles, first shapes)."""
    run.run(warmup)
    return statistics.median(run.run(steps))


class Panel:
    """The search-validation loss of a supernet's parameters: the mean validation loss of a
    fixed panel of subnets (largest, smallest, ``random`` drawn with a fixed seed)."""

    def __init__(self, base: SparaRun, *, random: int = 6):
        cfg = base.cfg
        space = base.spec.space
        drawn = sample_subnets(space, cfg.train.seed + 7919, 0, random, "uniform") if random else []
        panel = [space.largest(), space.smallest(), *drawn]
        self.subnets = np.unique(space.canonical(np.asarray(panel, np.int32)), axis=0)
        val = eval_batches(base.splits.val, seq_len=cfg.model.seq_len, batch_size=cfg.train.global_batch,
                           num_batches=cfg.supernet.search_eval_batches)
        self.batches = {k: np.stack([b[k] for b in val]) for k in ("inputs", "targets")}
        self.mesh = base.mesh
        self._evaluate = make_evaluator(base.spec, base.mesh, vmap_width=cfg.supernet.vmap_width,
                                        virtual_shards=cfg.train.virtual_shards, pad_to=len(self.subnets))
        self._stored = param_shardings(base.mesh, base.spec)

    def losses(self, params) -> np.ndarray:
        params = jax.device_put(params, self._stored)  # from any run's mesh onto ours
        with jax.set_mesh(self.mesh):
            return self._evaluate(params, self.subnets, self.batches)

    def __call__(self, params) -> float:
        return float(np.mean(self.losses(params)))
