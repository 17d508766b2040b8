"""``train_supernet``: config → mesh → supernet → SPara steps → search; and
``search_checkpoint``: a saved run → the same search.

The loop is deliberately small: the SPara step does the work. Each step the
host draws the step's subnets (a pure function of (seed, step)), plans its
rounds and waves, and calls one jitted step; every process builds the same
global batch and places its own rows, so the result does not depend on how
devices are spread over processes.

Checkpoints (``train_supernet(..., checkpoint=True)``, what ``mindpipe supernet``
does): ``train.out_dir`` gets ``config.json``, ``checkpoints/<step>/`` every
``train.checkpoint_every`` steps and at the end, and the search's result
(``search.json``); the checkpoints go through the same orbax
``Checkpointer`` as dense runs (state, loader state, meta with checksums). The
meta says ``"kind": "supernet"`` and holds a fingerprint (parameter shapes and
the search space's genes), so a dense run's checkpoint, or a supernet trained
with another space, is refused by name. ``search_checkpoint`` (``mindpipe
search``) restores the parameters onto the current mesh, bit for bit, and runs
the search there: the same top-k as the search at the end of training, on any
device count.

Resuming (``train.resume=true``, ``mindpipe supernet --resume``) works as for dense
runs and with the dense loop's own helpers: the newest committed step is restored
(state and the loader's position; the sampler needs only the step) and its
checksums verified before anything is written, then training continues to
``train.steps``: the parameters, and the search at the end, are bitwise those of an
uninterrupted run on the same mesh. SIGTERM or a first Ctrl-C stops after the
current step with a checkpoint (``SupernetResult.stopped``), as in ``train``.

This module holds the loop; the rest lives beside it and is re-exported here:
``run_setup.py`` (the config's supernet and data, the checkpoints' kind and
fingerprint, the out_dir checks) and ``run_search.py`` (the search at the end of
training and ``search_checkpoint``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mindpipe_jax.atomic_write import write_atomically
from mindpipe_jax.config import Config, check_supernet_keys, config_argument
from mindpipe_jax.data import Loader, resolve_data
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.parallel.dispatch import DispatchWindow
from mindpipe_jax.parallel.mesh import make_mesh
from mindpipe_jax.parallel.rules import use_rules
from mindpipe_jax.supernet.layout import global_array
from mindpipe_jax.supernet.model import SuperGPT
from mindpipe_jax.supernet.pipelined import check_pipelined
from mindpipe_jax.supernet.plan import DATA_AXES, mesh_label
from mindpipe_jax.supernet.run_search import _show, search_checkpoint, search_subnets
from mindpipe_jax.supernet.run_setup import (
    KIND,
    _abstract_state,
    _prepare_out_dir,
    configured_step,
    fingerprint,
    supernet_factory,
)
from mindpipe_jax.supernet.sampler import Sampler
from mindpipe_jax.supernet.search import SearchResult, check_budget
from mindpipe_jax.supernet.spara import (
    check_layout,
    init_state,
    state_shardings,
    supernet_spec,
)
from mindpipe_jax.train.agreement import (
    agree_on_checkpoint,
    agree_on_model,
    all_or_none,
    start_together,
    stops_everywhere,
)
from mindpipe_jax.train.checkpoint import (
    Checkpointer,
    remove_incomplete,
    restore_verified,
)
from mindpipe_jax.train.metrics import MetricsWriter
from mindpipe_jax.train.rundir import hold_run_dir
from mindpipe_jax.train.signals import FinalSave, StartupInterrupts, StopSignals, raise_if_interrupted
from mindpipe_jax.train.state import resume_lines
from mindpipe_jax.train.step_checks import check_platform, check_user_model_keys

__all__ = ["SupernetResult", "train_supernet", "supernet_factory", "search_checkpoint", "KIND"]


@dataclasses.dataclass
class SupernetResult:
    state: Any  # {"step", "params", "opt"}: replicated arrays
    history: list[dict]  # one entry per logged step
    search: SearchResult | None
    config: Config
    mesh: Any
    spec: Any  # SupernetSpec: space, unit grid, merge(params) -> module
    out_dir: Path | None = None  # where the checkpoints went (checkpoint=True)
    stopped: str | None = None  # "SIGTERM"/"SIGINT" when a signal ended the run early (no search)
    # train.resume="auto" found the run finished (its newest checkpoint at train.steps or
    # later): nothing was trained or searched, and ``state`` is that checkpoint's
    already_complete: bool = False

    @property
    def space(self):
        return self.spec.space


def train_supernet(model=None, data=None, config: Config | None = None, *overrides: str,
                   search: bool = True, log=print, checkpoint: bool = False) -> SupernetResult:
    """Train a supernet with SPara, then (``search=True``) run the evolutionary search.

    ``model``: None (the reference ``SuperGPT`` of ``config.model`` + ``config.supernet``),
    a supernet ``nnx.Module`` or a factory ``rngs -> module``. ``data`` as in
    ``mindpipe_jax.train``. Uses ``train.steps``, ``train.global_batch``,
    ``train.virtual_shards``, ``train.seed``, ``train.log_every``, ``optim.*``,
    ``parallel.subnet`` / ``parallel.data`` and the ``supernet`` section (the search's
    validation batches are ``supernet.search_eval_batches``). ``log``: a callable for
    progress lines (None: quiet).
    ``checkpoint``: save into ``train.out_dir`` (``train.checkpoint_every``,
    ``train.keep_checkpoints``; a directory that already holds a run is refused unless
    ``train.resume`` continues it), so that ``search_checkpoint`` / ``mindpipe search``
    can search it later. With ``checkpoint``, SIGTERM or a first Ctrl-C stops after the
    current step with a checkpoint and returns with ``stopped`` set (no search).
    """
    with StartupInterrupts():  # Ctrl-C before the loop: KeyboardInterrupt, never swallowed
        with stops_everywhere("supernet run", overrides):  # a mistake of this process only stops all
            cfg = config_argument(config)
            if overrides:
                cfg = cfg.replace(*overrides)
            if cfg.parallel.tensor == 0:
                cfg = cfg.replace("parallel.tensor=1")  # auto must not pick an axis SPara does not use
            check_supernet_keys(cfg)
            if cfg.train.resume and not checkpoint:
                raise ConfigError(f"train.resume={_show(cfg.train.resume)} needs checkpoints: call "
                                  f"train_supernet(..., checkpoint=True) (what `mindpipe supernet` does)")
            _check_arguments(cfg, search=search, log=log, checkpoint=checkpoint)
        start_together(cfg, "supernet run")
        check_platform(cfg.model, jax.devices()[0].platform)
        # With checkpoints, train.out_dir is checked writable before anything is computed
        # and locked against a second run for this run's life (see train.rundir).
        with hold_run_dir(cfg.train.out_dir) if checkpoint else contextlib.nullcontext(), \
                use_rules(cfg.parallel.rules):
            if checkpoint:  # reading a checkpoint is collective (orbax): all must see the same ones
                agree_on_checkpoint(Path(cfg.train.out_dir).absolute() / "checkpoints", "supernet run")
            return _train_supernet(cfg, model, data, search=search, log=log, checkpoint=checkpoint)


def _check_arguments(cfg: Config, *, search, log, checkpoint) -> None:
    """One line for an argument of the wrong kind (``checkpoint=5`` saved, ``log=5`` failed
    at the first line), and for the checkpoint keys of a run that saves nothing (a
    ``train.out_dir`` set without ``checkpoint=True`` was silently left empty)."""
    for name, value in (("search", search), ("checkpoint", checkpoint)):
        if not isinstance(value, bool):
            raise ConfigError(f"train_supernet {name}={value!r} must be True or False")
    if log is not None and not callable(log):
        raise ConfigError(f"train_supernet log={log!r} must be a callable taking one line (print) or None")
    if not checkpoint:
        default = type(cfg.train)()
        for key in ("out_dir", "checkpoint_every", "keep_checkpoints"):
            if getattr(cfg.train, key) != getattr(default, key):
                raise ConfigError(f"train.{key}={_show(getattr(cfg.train, key))} has no effect: "
                                  f"train_supernet(..., checkpoint=False) saves nothing; pass "
                                  f"checkpoint=True (what `mindpipe supernet` does), or drop it")


def _train_supernet(cfg: Config, model, data, *, search: bool, log, checkpoint: bool) -> SupernetResult:
    sn, tr = cfg.supernet, cfg.train
    mesh = make_mesh(cfg.parallel)
    if mesh.shape["pipe"] > 1:
        check_pipelined(None, mesh, cfg.parallel, semantics=sn.semantics,
                        subnets_per_step=sn.subnets_per_step, vmap_width=sn.vmap_width,
                        global_batch=tr.global_batch,  # a user's supernet has its own depth
                        n_layers=cfg.model.n_layers if model is None else None,
                        deterministic=tr.deterministic, virtual_shards=tr.virtual_shards)
    else:
        check_layout(mesh, subnets_per_step=sn.subnets_per_step, vmap_width=sn.vmap_width,
                     virtual_shards=tr.virtual_shards, global_batch=tr.global_batch)
    factory = model if model is not None else supernet_factory(cfg)
    with all_or_none("supernet run"):  # the user's model code failing on one process (an import it lacks)
        spec, create = supernet_spec(factory, tr.seed)
    built = fingerprint(spec)
    agree_on_model(built["params"], "supernet run", built["genes"])  # another model on a process would hang
    if not isinstance(spec.module, SuperGPT):  # a model of the user's: model.* compute keys size nothing
        check_user_model_keys(cfg.model)
    if search:
        check_budget(spec.space, spec.module.active_params, sn.search_max_params)
    sampler = Sampler(spec.space, sn.subnets_per_step, sn.strategy, tr.seed)
    with all_or_none("supernet run"):  # a data path one process cannot read stops them all
        splits = resolve_data(data, cfg)
    out_dir = ckpt_dir = resume_step = None
    if checkpoint:
        # Its own stretch: a resume reads the checkpoint's meta collectively (orbax), which
        # a process stopped by its data above would not join.
        with all_or_none("supernet run"):
            out_dir, ckpt_dir, resume_step, saved_meta = _prepare_out_dir(cfg, spec)
    loader = Loader(splits.train, seq_len=cfg.model.seq_len, batch_size=tr.global_batch, seed=tr.seed,
                    name="train")
    if resume_step is not None:
        # Read completely (checksums verified, the loader's position checked against this
        # run's data) before anything is written; the sampler needs only the step.
        try:
            target = _abstract_state(spec, create, mesh)
            state, data_state, _ = restore_verified(ckpt_dir, resume_step, target)
            loader.set_state(data_state)
        except BaseException:
            loader.close()
            raise
        if resume_step >= tr.steps:  # train.resume="auto" on a finished run
            loader.close()
            return SupernetResult(state, [], None, cfg, mesh, spec, out_dir, already_complete=True)
        if log is not None and jax.process_index() == 0:
            for line in resume_lines(saved_meta, cfg, resume_step):
                log(line)
    rows = NamedSharding(mesh, P(DATA_AXES))
    if resume_step is None:
        state = jax.jit(lambda: init_state(spec, create()), out_shardings=state_shardings(mesh, spec))()
    start = int(np.asarray(jax.device_get(state["step"].addressable_data(0))))
    say = log if (log is not None and jax.process_index() == 0) else (lambda *_: None)
    # Sliced where the supernet offers it; a custom supernet without a sliced path trains
    # masked (compiled here, ahead of time).
    try:  # a step that cannot fit in memory is refused here, on every process if on one
        with all_or_none("supernet run"):
            configured = configured_step(spec, mesh, cfg, compile_with=(state, sampler(0)))
    except BaseException:
        loader.close()
        raise
    make_plan, step_fn, compiled = configured.plan, configured.run, configured.description
    say(f"supernet: {spec.space.num_architectures:,} architectures ({spec.space.size:,} vectors) | "
        f"{sn.subnets_per_step} subnets/step, {sn.semantics}, {sn.strategy} | mesh {mesh_label(mesh)} | "
        f"{compiled}"
        + (f" | resuming at step {start}" if start else ""))
    history: list[dict] = []
    t_last, waves_sum, since = time.perf_counter(), 0, 0
    # From here on files may be written: every user mistake has been caught above.
    ckpt, stopped, writer = None, None, None
    if checkpoint:
        raise_if_interrupted()
        if jax.process_index() == 0:
            removed = remove_incomplete(ckpt_dir)
            if removed:
                say(f"removed what interrupted saves left in {ckpt_dir}: {', '.join(removed)}")
            out_dir.mkdir(parents=True, exist_ok=True)
            write_atomically(out_dir / "config.json", json.dumps(cfg.to_dict(), indent=2))
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices("mindpipe: supernet checkpoint dir ready")
        ckpt = Checkpointer(ckpt_dir, keep=tr.keep_checkpoints)
        # metrics.jsonl and TensorBoard beside the checkpoints, as for dense runs (a
        # resumed run first drops the records past its checkpoint).
        writer = MetricsWriter(out_dir, tensorboard=tr.tensorboard, enabled=jax.process_index() == 0,
                               resume_step=start or None)
        meta = {"kind": KIND, "config": cfg.to_dict(), "fingerprint": fingerprint(spec),
                "model": type(spec.module).__name__}
    # Signals stop the loop only where a checkpoint keeps its work.
    signals = StopSignals(jax.process_count() > 1) if ckpt is not None else contextlib.nullcontext()
    window = DispatchWindow()  # a bounded look-ahead (parallel/dispatch.py: XLA:CPU deadlocks past it)
    try:
        with signals:
            for step in range(start, tr.steps):
                plan = make_plan(sampler(step))
                batch = {k: global_array(v, rows) for k, v in next(loader).items()}
                state, metrics = step_fn(state, plan, batch)
                window.push(metrics)
                waves_sum, since, done = waves_sum + plan.num_waves, since + 1, step + 1
                stop = signals.reached(done) if ckpt is not None else None
                if done % tr.log_every == 0 or done == tr.steps:
                    values = jax.device_get(metrics)  # the only host sync of the interval
                    if ckpt is not None:
                        ckpt.check()  # a save that failed in the background stops the run now
                    now = time.perf_counter()
                    losses = values["loss"]
                    record = {"step": done, "loss": float(np.mean(losses)), "loss_min": float(np.min(losses)),
                              "loss_max": float(np.max(losses)), "lr": float(values["lr"]),
                              "waves": waves_sum / since, "step_time_s": (now - t_last) / since}
                    history.append(record)
                    if writer is not None:
                        writer.write(done, {k: v for k, v in record.items() if k != "step"})
                    say(f"step {done:>5} | loss {record['loss']:.4f} (subnets {record['loss_min']:.3f}.."
                        f"{record['loss_max']:.3f}) | waves {record['waves']:.2f} | "
                        f"{record['step_time_s']:.3f} s/step")
                    t_last, waves_sum, since = now, 0, 0
                if ckpt is not None and (stop or done == tr.steps or (
                        tr.checkpoint_every and done % tr.checkpoint_every == 0)):
                    ckpt.save(done, state, loader.get_state(), {**meta, "step": done}, force=True)
                if stop and done < tr.steps:
                    ckpt.wait()
                    stopped = stop
                    say(f"stopped by {stop} after step {done} of {tr.steps}: checkpoint saved in "
                        f"{ckpt_dir / str(done)}; continue with train.resume=true "
                        f"(mindpipe supernet ... --resume)")
                    break
    finally:
        with FinalSave(jax.process_count() > 1):  # the loop is over: a Ctrl-C now lets this finish
            if ckpt is not None:
                ckpt.close()  # waits for the save in flight: an error never leaves half a step
            if writer is not None:
                writer.close()
            loader.close()
    result = None
    if search and stopped is None:
        result = search_subnets(spec, state["params"], splits, cfg, mesh, say)
        say("search (validation loss with inherited weights):\n" + result.table())
    if checkpoint and stopped is None:
        if result is not None and jax.process_index() == 0:
            # The search's result beside the checkpoint it was made from (floats as JSON
            # keeps them exactly): what a later `mindpipe search` of that step reproduces.
            write_atomically(out_dir / "search.json", json.dumps(
                {"step": tr.steps, "top": result.top, "evaluated": result.evaluated,
                 "best_per_generation": result.best_per_generation}, indent=1))
        say(f"checkpoints: {ckpt_dir} (search them again with: mindpipe search {out_dir})")
    return SupernetResult(state, history, result, cfg, mesh, spec, out_dir, stopped)
