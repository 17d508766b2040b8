"""``mindpipe_jax.train``: config → mesh → data → abstract state → step → loop.

Everything a user can get wrong is checked before the first file is written:
config values, the mesh against the devices, batch divisibility, the data, and
whether ``train.out_dir`` already holds a run (a different model's checkpoint
is refused; the same model's is only continued with ``train.resume=true``, and
a resumed checkpoint is read completely before anything is written).

While training, the loop also

* stops cleanly on SIGTERM or SIGINT: the current step finishes, a checkpoint
  is saved and ``train`` returns with ``result.stopped`` set (a second Ctrl-C
  aborts at once). With several processes, JAX's preemption service makes them
  all stop after the same step;
* watches for non-finite losses and gradient norms. The step computes the flag;
  the host reads it together with the other metrics, once per logging,
  evaluation or checkpoint step, and always before a checkpoint is written.
  ``train.nonfinite="stop"`` raises ``NonFiniteError`` naming the step and the
  first parameter whose gradient was not finite; ``"skip"`` has already left
  that step's update out inside the compiled step and only counts it.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from mindpipe_jax.config import Config, DataConfig
from mindpipe_jax.data import Loader, TokenSplits, eval_batches, load_tokens
from mindpipe_jax.errors import ConfigError, NonFiniteError
from mindpipe_jax.models.gpt import GPT, flops_per_token
from mindpipe_jax.parallel.mesh import make_mesh, setup_runtime
from mindpipe_jax.train.checkpoint import (
    Checkpointer,
    check_same_model,
    incomplete_steps,
    read_meta,
    remove_incomplete,
    restore,
    verify_checksums,
)
from mindpipe_jax.train.metrics import MetricsWriter, format_line, mfu, peak_flops_per_device
from mindpipe_jax.train.state import (
    abstract_train_state,
    init_train_state,
    make_optimizer,
    model_spec,
    state_shardings_for,
)
from mindpipe_jax.train.step import (
    BATCH_AXES,
    check_step_config,
    make_eval_step,
    make_train_step,
    nonfinite_leaf_names,
)


@dataclasses.dataclass
class TrainResult:
    state: Any  # final train state (sharded arrays): step, params, opt, rng
    history: list[dict]  # one entry per logging interval / evaluation
    out_dir: Path
    checkpoint_dir: Path
    final_val_loss: float | None
    config: Config
    mesh: Any = None
    stopped: str | None = None  # "SIGTERM"/"SIGINT" when a signal ended the run early
    skipped_steps: int = 0  # non-finite steps left out (train.nonfinite="skip"), resumed runs included

    @property
    def step(self) -> int:
        return int(_host(self.state["step"]))


def _resolve_data(data, cfg: Config) -> TokenSplits:
    if data is None:
        return load_tokens(cfg.data, cfg.model.vocab_size)
    if isinstance(data, TokenSplits):
        if data.vocab_size > cfg.model.vocab_size:
            raise ConfigError(f"data vocab_size {data.vocab_size} exceeds model.vocab_size "
                              f"{cfg.model.vocab_size}")
        return data
    if isinstance(data, DataConfig):
        return load_tokens(data, cfg.model.vocab_size)
    if isinstance(data, (str, Path)):
        source = "tokens" if str(data).endswith((".npy", ".bin")) else "text"
        return load_tokens(dataclasses.replace(cfg.data, source=source, path=str(data)),
                           cfg.model.vocab_size)
    raise ConfigError(f"data must be None, a path, a DataConfig or TokenSplits, got {type(data).__name__}")


def _model_flops_per_token(model, cfg: Config) -> float:
    if model is None:
        return flops_per_token(cfg.model)
    fn = getattr(model, "flops_per_token", None)
    return float(fn()) if callable(fn) else 0.0


def _host(tree):
    """Device values → NumPy. A replicated value of a multi-process run is not fully
    addressable from one process; its local copy is the value."""
    def local(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return x.addressable_data(0)
        return x
    return jax.device_get(jax.tree.map(local, tree))


def _row_block(sharding: NamedSharding, global_batch: int) -> tuple[int, int]:
    """(block, blocks): this process feeds rows ``[block*B/blocks, (block+1)*B/blocks)``
    of every global batch.

    Read off the batch sharding, not the process count: with ``pipe`` spanning the
    processes, each of them holds every batch row (on its own stage's devices).
    """
    rows: dict[int, set[tuple[int, int]]] = {}
    for device, index in sharding.devices_indices_map((global_batch, 1)).items():
        start, stop, _ = index[0].indices(global_batch)
        rows.setdefault(device.process_index, set()).add((start, stop))
    spans = {}
    for process, ranges in rows.items():
        ordered = sorted(ranges)
        if any(a[1] != b[0] for a, b in itertools.pairwise(ordered)):
            raise ConfigError(f"the mesh gives process {process} batch rows that are not contiguous "
                              f"({ordered}); reorder the parallel axes")
        spans[process] = (ordered[0][0], ordered[-1][1])
    blocks = sorted(set(spans.values()))
    size = global_batch // len(blocks)
    if blocks != [(i * size, (i + 1) * size) for i in range(len(blocks))]:
        raise ConfigError(f"the mesh splits the batch rows unevenly over processes ({blocks})")
    return blocks.index(spans[jax.process_index()]), len(blocks)


class _Batches:
    """Host batches → global arrays sharded over the batch axes (multi-host aware)."""

    def __init__(self, mesh, global_batch: int, seq_len: int):
        self.sharding = NamedSharding(mesh, P(BATCH_AXES))
        self.shape = (global_batch, seq_len)

    def __call__(self, host_batch: dict) -> dict:
        return {k: jax.make_array_from_process_local_data(self.sharding, np.asarray(v), self.shape)
                for k, v in host_batch.items()}


def _prepare_out_dir(cfg: Config, fingerprint: dict) -> tuple[Path, Path, int | None, dict]:
    """(out_dir, checkpoint dir, step to resume from or None, its meta)."""
    out_dir = Path(cfg.train.out_dir).absolute()
    ckpt_dir = out_dir / "checkpoints"
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"train.out_dir {str(out_dir)!r} exists and is not a directory")
    found = read_meta(ckpt_dir)
    if found is None:
        if cfg.train.resume:
            partial = incomplete_steps(ckpt_dir)
            why = (f"only an incomplete checkpoint ({partial[0].name}, its save was interrupted)"
                   if partial else "no checkpoint")
            raise ConfigError(f"train.resume=true but train.out_dir {str(out_dir)!r} holds {why}; "
                              f"nothing to resume: drop train.resume to start a new run there")
        return out_dir, ckpt_dir, None, {}
    step, meta = found
    check_same_model(ckpt_dir, meta, fingerprint)
    if not cfg.train.resume:
        raise ConfigError(f"train.out_dir {str(out_dir)!r} already holds checkpoints up to step {step}; "
                          f"set train.resume=true to continue it or choose a new train.out_dir")
    if step >= cfg.train.steps:
        raise ConfigError(f"train.resume=true: the newest checkpoint in {str(ckpt_dir)!r} is at step "
                          f"{step}, and train.steps={cfg.train.steps}; nothing to resume: set "
                          f"train.steps above {step} to train further")
    return out_dir, ckpt_dir, step, meta


def _restore(ckpt_dir: Path, step: int, abstract_state):
    """Restore a committed step, reading only; a damaged one is a user-facing error."""
    where = str(ckpt_dir / str(step))
    advice = "delete that step directory to resume from an earlier checkpoint, or choose a new train.out_dir"
    try:
        state, data_state, meta = restore(ckpt_dir, step, abstract_state)
    except Exception as err:  # truncated or missing array files, garbled metadata
        detail = (str(err).strip().splitlines() or [""])[0].split(" See full")[0][:160]
        raise ConfigError(f"checkpoint {where!r} could not be restored ({type(err).__name__}: "
                          f"{detail}); it is damaged: {advice}") from None
    if (leaf := verify_checksums(state, meta)) is not None:
        raise ConfigError(f"checkpoint {where!r} is damaged: the restored bytes of state{leaf} do not "
                          f"match the checksum saved with them; {advice}")
    return state, data_state, meta


def train(model=None, data=None, config: Config | None = None, *overrides: str) -> TrainResult:
    """Train ``model`` (an ``nnx.Module``, a factory ``rngs -> Module``, or None for the
    reference GPT of ``config.model``) on ``data`` (None = ``config.data``, a path,
    a ``DataConfig`` or ``TokenSplits``). ``overrides`` are ``key=value`` strings.
    """
    cfg = config or Config()
    if overrides:
        cfg = cfg.replace(*overrides)
    if cfg.train.deterministic and cfg.parallel.tensor == 0:
        cfg = cfg.replace("parallel.tensor=1")  # auto never picks what deterministic mode refuses
    setup_runtime(cfg.parallel, cfg.distributed)
    mesh = make_mesh(cfg.parallel)
    check_step_config(cfg, mesh)
    tr = cfg.train
    splits = _resolve_data(data, cfg)
    to_device = _Batches(mesh, tr.global_batch, cfg.model.seq_len)
    block, blocks = _row_block(to_device.sharding, tr.global_batch)
    loader = Loader(splits.train, seq_len=cfg.model.seq_len, batch_size=tr.global_batch,
                    seed=tr.seed, process_index=block, process_count=blocks, name="train")
    val = (eval_batches(splits.val, seq_len=cfg.model.seq_len, batch_size=tr.global_batch,
                        num_batches=tr.eval_batches, process_index=block, process_count=blocks)
           if tr.eval_every > 0 else [])
    factory = model if model is not None else (lambda rngs: GPT(cfg.model, rngs=rngs))
    spec, create = model_spec(factory, mesh, tr.seed)
    fingerprint = spec.fingerprint()
    tx = make_optimizer(cfg.optim, tr.steps, spec.decay_mask)
    train_step = make_train_step(spec, tx, cfg, mesh, tr.steps)  # checks schedule and contract
    out_dir, ckpt_dir, resume_step, saved_meta = _prepare_out_dir(cfg, fingerprint)
    shardings = state_shardings_for(spec, tx, mesh)
    abstract_state = abstract_train_state(spec, tx, mesh, shardings)
    if resume_step is not None:
        state, data_state, _ = _restore(ckpt_dir, resume_step, abstract_state)
        loader.set_state(data_state)

    # From here on files may be written: every user mistake has been caught above.
    primary = jax.process_index() == 0
    if primary:
        removed = remove_incomplete(ckpt_dir)
        if removed:
            print(f"removed what interrupted saves left in {ckpt_dir}: {', '.join(removed)}", flush=True)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("mindpipe: checkpoint dir ready")
    if resume_step is None:
        state = init_train_state(spec, create, tx, mesh, tr.seed, shardings)
    ckpt = Checkpointer(ckpt_dir, keep=tr.keep_checkpoints)
    if primary:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    writer = MetricsWriter(out_dir, tensorboard=tr.tensorboard, enabled=primary, resume_step=resume_step)
    meta = {"config": cfg.to_dict(), "fingerprint": fingerprint}
    batch_spec = jax.ShapeDtypeStruct(to_device.shape, np.int32, sharding=to_device.sharding)

    def compile_step(run_cfg: Config, step=None):
        """Ahead-of-time compile of the step (once; again only when repartitioning)."""
        t0 = time.perf_counter()
        step_fn = jax.jit(step or make_train_step(spec, tx, run_cfg, mesh, tr.steps),
                          in_shardings=(shardings, to_device.sharding),
                          out_shardings=(shardings, None), donate_argnums=0)
        compiled = step_fn.lower(abstract_state, {"inputs": batch_spec, "targets": batch_spec}).compile()
        return compiled, time.perf_counter() - t0

    eval_fn = jax.jit(make_eval_step(spec), in_shardings=(spec.storage, to_device.sharding))
    run = _Run(cfg, ckpt, meta, writer, leaf_names=nonfinite_leaf_names(spec.abstract_params),
               skipped=int(saved_meta.get("skipped_steps", 0)))
    try:
        with jax.set_mesh(mesh):
            state = run(state, compile_step, train_step, eval_fn, loader, val, to_device,
                        flops=_model_flops_per_token(model, cfg), mesh=mesh)
    finally:
        ckpt.close()  # waits for a save in flight: a stop or an error never leaves half a step
        writer.close()
        loader.close()
    return TrainResult(state, run.history, out_dir, ckpt_dir, run.final_val, cfg, mesh,
                       stopped=run.stopped, skipped_steps=run.skipped)


def _evaluate(eval_fn, params, val, to_device) -> float:
    losses = [eval_fn(params, to_device(b)) for b in val]
    return float(np.mean(_host(losses)))


def _replan(cfg: Config, mesh) -> tuple[int, ...]:
    """Measure the model's layer costs now and return the balanced stage split."""
    from mindpipe_jax.parallel.pipeline.partition import measure_layer_costs, partition

    par = cfg.parallel
    n_batch = mesh.shape["data"] * mesh.shape["fsdp"]
    microbatch = cfg.train.global_batch // (n_batch * par.microbatches)
    profile = measure_layer_costs(cfg.model, microbatch=microbatch)
    plan = partition(profile, p=mesh.shape["pipe"], v=par.virtual_stages, m=par.microbatches,
                     schedule=par.schedule)
    return tuple(plan.counts)


class _StopSignals:
    """SIGTERM and SIGINT ask the loop to stop after the current step with a checkpoint.

    One process: a Python handler sets a flag the loop reads after each step.
    Several processes must stop after the *same* step, or their collective save
    would deadlock: JAX's preemption service (started by ``jax.distributed``)
    catches SIGTERM on any process and agrees on a step, which
    ``reached_preemption_sync_point`` reports; Ctrl-C is handed to it as SIGTERM.
    A second Ctrl-C raises ``KeyboardInterrupt`` at once. Handlers are installed
    only from the main thread and put back on exit.
    """

    def __init__(self, multi_process: bool):
        self.multi = multi_process
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            ours = (signal.SIGINT,) if self.multi else (signal.SIGINT, signal.SIGTERM)
            for sig in ours:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)

    def _handle(self, signum, frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # asked twice: stop now, without a checkpoint
        self.received = self.received or signal.Signals(signum).name
        if self.multi:
            os.kill(os.getpid(), signal.SIGTERM)  # JAX's notifier tells the other processes

    def reached(self, step: int) -> str | None:
        """The signal's name if the loop should stop after ``step``."""
        if not self.multi:
            return self.received
        from jax.experimental import multihost_utils
        try:
            if multihost_utils.reached_preemption_sync_point(step):
                return self.received or "SIGTERM"
        except RuntimeError:  # the preemption service is switched off
            pass
        return None


class _Run:
    """The loop's state between steps: history, skipped-step count, stop reason."""

    def __init__(self, cfg: Config, ckpt: Checkpointer, meta: dict, writer: MetricsWriter, *,
                 leaf_names: list[str], skipped: int):
        self.cfg, self.ckpt, self.meta, self.writer = cfg, ckpt, meta, writer
        self.leaf_names = leaf_names
        self.skipped = skipped
        self.history: list[dict] = []
        self.final_val: float | None = None
        self.stopped: str | None = None
        self.say = print

    def _check_finite(self, steps: list[int], values: list[dict]) -> None:
        """Act on every non-finite step among those just fetched."""
        for step, v in zip(steps, values, strict=True):
            leaf = int(v["nonfinite_leaf"])
            if leaf < 0 and math.isfinite(float(v["loss"])):
                continue
            group = self.leaf_names[leaf] if leaf >= 0 else "loss"
            what = (f"loss {float(v['loss'])}, gradient norm {float(v['grad_norm'])}, first non-finite "
                    f"gradient in {group!r}" if leaf >= 0 else f"loss {float(v['loss'])}")
            if self.cfg.train.nonfinite == "skip":
                self.skipped += 1
                self.say(f"step {step} | non-finite {what} | update skipped ({self.skipped} so far)")
                continue
            self.ckpt.wait()
            last = self.ckpt.latest_step()
            kept = (f"the last checkpoint (step {last}, {self.ckpt.directory / str(last)}) is untouched"
                    if last is not None else "no checkpoint was written")
            raise NonFiniteError(
                f"step {step}: non-finite {what}; training stopped and {kept}; lower optim.lr, or set "
                f"train.nonfinite=skip to leave such updates out",
                step=step, group=group,
                last_checkpoint=None if last is None else self.ckpt.directory / str(last))

    def __call__(self, state, compile_step, first_step, eval_fn, loader, val, to_device, *, flops, mesh):
        cfg = self.cfg
        tr = cfg.train
        step_fn, compile_s = compile_step(cfg, first_step)
        tokens_per_step = tr.global_batch * cfg.model.seq_len
        peak = peak_flops_per_device(tr.peak_tflops)
        primary = jax.process_index() == 0
        start = int(_host(state["step"]))
        bar = tqdm(total=tr.steps, initial=start, disable=not (tr.progress and primary),
                   dynamic_ncols=True, desc="train")
        say = bar.write if not bar.disable else (print if primary else (lambda *_: None))
        self.say = say
        say(f"mesh {dict(mesh.shape)} | {len(jax.devices())} devices | compiled step in {compile_s:.1f}s"
            + (f" | resuming at step {start}" if start else ""))
        # Metrics of the steps not yet seen on the host: fetched together (one sync)
        # at a logging, evaluation or checkpoint step, so no step is left unchecked.
        pending: list[tuple[int, dict]] = []
        t_last, steps_since = time.perf_counter(), 0
        with _StopSignals(jax.process_count() > 1) as signals:
            for step in range(start, tr.steps):
                state, metrics = step_fn(state, to_device(next(loader)))
                pending.append((step + 1, metrics))
                steps_since += 1
                done = step + 1
                stop = signals.reached(done)
                log_now = done % tr.log_every == 0 or done == tr.steps
                eval_now = bool(val) and (done % tr.eval_every == 0 or done == tr.steps)
                save_now = bool(stop) or done == tr.steps or bool(
                    tr.checkpoint_every and done % tr.checkpoint_every == 0)
                record: dict = {}
                if log_now or eval_now or save_now:
                    steps, values = zip(*pending, strict=True)
                    values = _host(list(values))
                    pending.clear()
                    self._check_finite(list(steps), values)
                    if log_now:
                        elapsed = time.perf_counter() - t_last
                        tps = tokens_per_step * steps_since / elapsed
                        record.update({k: float(v) for k, v in values[-1].items() if k != "nonfinite_leaf"})
                        record.update(tokens_per_s=tps, step_time_s=elapsed / steps_since,
                                      mfu=mfu(tps, flops, len(jax.devices()), peak))
                        if tr.nonfinite == "skip":
                            record["skipped_steps"] = self.skipped
                        t_last, steps_since = time.perf_counter(), 0
                if eval_now:
                    t_eval = time.perf_counter()
                    self.final_val = _evaluate(eval_fn, state["params"], val, to_device)
                    record["val_loss"] = self.final_val
                    t_last += time.perf_counter() - t_eval  # evaluation is not step time
                if save_now:
                    t_save = time.perf_counter()
                    self.ckpt.save(done, state, loader.get_state(),
                                   {**self.meta, "step": done, "skipped_steps": self.skipped},
                                   force=bool(stop))
                    t_last += time.perf_counter() - t_save  # saving is not step time either
                if cfg.parallel.repartition_after and done == cfg.parallel.repartition_after and not stop:
                    # The stage split lives only inside the step (storage keeps the [layers]
                    # axis), so moving layers between stages changes no parameter bit.
                    t_plan = time.perf_counter()
                    stages = mesh.shape["pipe"] * cfg.parallel.virtual_stages
                    before = tuple(cfg.parallel.stage_layers) or (cfg.model.n_layers // stages,) * stages
                    counts = _replan(cfg, mesh)
                    if counts != before:
                        cfg = cfg.replace(f"parallel.stage_layers={list(counts)}")
                        step_fn, _ = compile_step(cfg)
                    record["repartition"] = {"before": list(before), "after": list(counts)}
                    say(f"step {done} | repartition {list(before)} -> {list(counts)}")
                    t_last += time.perf_counter() - t_plan
                if record:
                    self.history.append({"step": done, **record})
                    self.writer.write(done, record)
                    say(format_line(done, record))
                    bar.set_postfix(loss=f"{record.get('loss', float('nan')):.3f}")
                bar.update(1)
                if stop and done < tr.steps:
                    self.ckpt.wait()
                    self.stopped = stop
                    say(f"stopped by {stop} after step {done} of {tr.steps}: checkpoint saved in "
                        f"{self.ckpt.directory / str(done)}; continue with train.resume=true "
                        f"(mindpipe train ... --resume)")
                    break
        bar.close()
        return state
