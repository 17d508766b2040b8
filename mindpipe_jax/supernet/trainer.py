"""``train_supernet``: config → mesh → supernet → SPara steps → search.

The loop is deliberately small: the SPara step does the work. Each step the
host draws the step's subnets (a pure function of (seed, step)), plans its
rounds and waves, and calls one jitted step; every process builds the same
global batch and places its own rows, so the result does not depend on how
devices are spread over processes.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mindpipe_jax.config import Config, DataConfig
from mindpipe_jax.data import Loader, TokenSplits, eval_batches, load_tokens
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.parallel.mesh import make_mesh, setup_runtime
from mindpipe_jax.supernet.model import SuperGPT
from mindpipe_jax.supernet.sampler import Sampler
from mindpipe_jax.supernet.search import SearchResult, evolutionary_search, make_evaluator
from mindpipe_jax.supernet.spara import (
    check_layout,
    init_state,
    jit_step,
    make_spara_step,
    plan_step,
    state_shardings,
    supernet_spec,
)

__all__ = ["SupernetResult", "train_supernet", "supernet_factory"]


@dataclasses.dataclass
class SupernetResult:
    state: Any  # {"step", "params", "opt"}: replicated arrays
    history: list[dict]  # one entry per logged step
    search: SearchResult | None
    config: Config
    mesh: Any
    spec: Any  # SupernetSpec: space, unit grid, merge(params) -> module

    @property
    def space(self):
        return self.spec.space


def supernet_factory(cfg: Config):
    """``rngs -> SuperGPT`` from the ``model`` and ``supernet`` sections."""
    sn, m = cfg.supernet, cfg.model
    widths = sorted({max(1, round(r * m.ff_dim)) for r in sn.ffn_ratios})
    if sn.min_depth > m.n_layers:
        raise ConfigError(f"supernet.min_depth={sn.min_depth} must be <= model.n_layers={m.n_layers}")
    depths = tuple(range(sn.min_depth, m.n_layers + 1))
    return lambda rngs: SuperGPT(m, ops=sn.ops, ffn_widths=widths, heads=sn.heads, depths=depths, rngs=rngs)


def _resolve_data(data, cfg: Config) -> TokenSplits:
    if data is None:
        return load_tokens(cfg.data, cfg.model.vocab_size)
    if isinstance(data, TokenSplits):
        return data
    if isinstance(data, DataConfig):
        return load_tokens(data, cfg.model.vocab_size)
    if isinstance(data, (str, Path)):
        source = "tokens" if str(data).endswith((".npy", ".bin")) else "text"
        return load_tokens(dataclasses.replace(cfg.data, source=source, path=str(data)), cfg.model.vocab_size)
    raise ConfigError(f"data must be None, a path, a DataConfig or TokenSplits, got {type(data).__name__}")


def _global_array(host: np.ndarray, sharding: NamedSharding):
    # Every process holds the whole global batch (the loader is deterministic), so each
    # places exactly the rows its devices own, whatever the process/device layout.
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def train_supernet(model=None, data=None, config: Config | None = None, *overrides: str,
                   search: bool = True, log=print) -> SupernetResult:
    """Train a supernet with SPara, then (``search=True``) run the evolutionary search.

    ``model``: None (the reference ``SuperGPT`` of ``config.model`` + ``config.supernet``),
    a supernet ``nnx.Module`` or a factory ``rngs -> module``. ``data`` as in
    ``mindpipe_jax.train``. Uses ``train.steps``, ``train.global_batch``,
    ``train.virtual_shards``, ``train.seed``, ``train.log_every``,
    ``train.eval_batches``, ``optim.*``, ``parallel.subnet`` / ``parallel.data``
    and the ``supernet`` section. ``log``: a callable for progress lines (None: quiet).
    """
    cfg = config or Config()
    if overrides:
        cfg = cfg.replace(*overrides)
    if cfg.parallel.tensor == 0:
        cfg = cfg.replace("parallel.tensor=1")  # auto must not pick an axis SPara does not use
    sn, tr = cfg.supernet, cfg.train
    setup_runtime(cfg.parallel, cfg.distributed)
    mesh = make_mesh(cfg.parallel)
    check_layout(mesh, subnets_per_step=sn.subnets_per_step, vmap_width=sn.vmap_width,
                 virtual_shards=tr.virtual_shards, global_batch=tr.global_batch)
    factory = model if model is not None else supernet_factory(cfg)
    spec, create = supernet_spec(factory, tr.seed)
    sampler = Sampler(spec.space, sn.subnets_per_step, sn.strategy, tr.seed)
    splits = _resolve_data(data, cfg)
    loader = Loader(splits.train, seq_len=cfg.model.seq_len, batch_size=tr.global_batch, seed=tr.seed,
                    name="train")
    rows = NamedSharding(mesh, P("data"))
    step_fn = jit_step(make_spara_step(
        spec, mesh, semantics=sn.semantics, subnets_per_step=sn.subnets_per_step,
        vmap_width=sn.vmap_width, virtual_shards=tr.virtual_shards, global_batch=tr.global_batch,
        optim=cfg.optim, total_steps=tr.steps), mesh)
    state = jax.jit(lambda: init_state(spec, create()), out_shardings=state_shardings(mesh))()
    say = log if (log is not None and jax.process_index() == 0) else (lambda *_: None)
    round_slots = mesh.shape["subnet"] * sn.vmap_width
    # Ahead-of-time compile, so that step times are step times.
    t0 = time.perf_counter()
    tokens = jax.ShapeDtypeStruct((tr.global_batch, cfg.model.seq_len), np.int32, sharding=rows)
    plan0 = plan_step(spec, sampler(0), sn.semantics, round_slots).arrays()
    step_fn = step_fn.lower(state, plan0, {"inputs": tokens, "targets": tokens}).compile()
    say(f"supernet: {spec.space.num_architectures:,} architectures ({spec.space.size:,} vectors) | "
        f"{sn.subnets_per_step} subnets/step, {sn.semantics}, {sn.strategy} | mesh subnet="
        f"{mesh.shape['subnet']} x data={mesh.shape['data']} | compiled in {time.perf_counter() - t0:.1f}s")
    history: list[dict] = []
    t_last, waves_sum, since = time.perf_counter(), 0, 0
    try:
        for step in range(tr.steps):
            plan = plan_step(spec, sampler(step), sn.semantics, round_slots)
            batch = {k: _global_array(v, rows) for k, v in next(loader).items()}
            state, metrics = step_fn(state, plan.arrays(), batch)
            waves_sum, since = waves_sum + plan.num_waves, since + 1
            if (step + 1) % tr.log_every == 0 or step + 1 == tr.steps:
                values = jax.device_get(metrics)  # the only host sync of the interval
                now = time.perf_counter()
                losses = values["loss"]
                record = {"step": step + 1, "loss": float(np.mean(losses)), "loss_min": float(np.min(losses)),
                          "loss_max": float(np.max(losses)), "lr": float(values["lr"]),
                          "waves": waves_sum / since, "step_time_s": (now - t_last) / since}
                history.append(record)
                say(f"step {step + 1:>5} | loss {record['loss']:.4f} (subnets {record['loss_min']:.3f}.."
                    f"{record['loss_max']:.3f}) | waves {record['waves']:.2f} | "
                    f"{record['step_time_s']:.3f} s/step")
                t_last, waves_sum, since = now, 0, 0
    finally:
        loader.close()
    result = None
    if search:
        result = search_subnets(spec, state["params"], splits, cfg, mesh)
        say("search (validation loss with inherited weights):\n" + result.table())
    return SupernetResult(state, history, result, cfg, mesh, spec)


def search_subnets(spec, params, splits: TokenSplits, cfg: Config, mesh) -> SearchResult:
    """Evolutionary search of ``cfg.supernet`` on the validation split, scores bitwise stable."""
    sn, tr = cfg.supernet, cfg.train
    val = eval_batches(splits.val, seq_len=cfg.model.seq_len, batch_size=tr.global_batch,
                       num_batches=sn.search_eval_batches)
    batches = {k: np.stack([b[k] for b in val]) for k in ("inputs", "targets")}
    evaluate = make_evaluator(spec, mesh, vmap_width=sn.vmap_width, virtual_shards=tr.virtual_shards,
                              pad_to=sn.search_population)
    module = spec.module
    return evolutionary_search(
        spec.space, lambda subs: evaluate(params, subs, batches), module.active_params,
        population=sn.search_population, generations=sn.search_generations, top_k=sn.search_top_k,
        max_cost=sn.search_max_params, seed=tr.seed)
