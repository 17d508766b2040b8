"""``mindpipe_jax.train``: config → mesh → data → abstract state → step → loop.

Everything a user can get wrong is checked before the first file is written:
config values, the mesh against the devices, batch divisibility, the data, and
whether ``train.out_dir`` already holds a run (a different model's checkpoint
is refused; the same model's is only continued with ``train.resume=true``).
"""

from __future__ import annotations

import dataclasses
import json
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
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.models.gpt import GPT, flops_per_token
from mindpipe_jax.parallel.mesh import make_mesh, setup_runtime
from mindpipe_jax.train.checkpoint import Checkpointer, check_same_model, read_meta
from mindpipe_jax.train.metrics import MetricsWriter, format_line, mfu, peak_flops_per_device
from mindpipe_jax.train.state import (
    abstract_train_state,
    init_train_state,
    make_optimizer,
    model_spec,
    state_shardings_for,
)
from mindpipe_jax.train.step import BATCH_AXES, check_step_config, make_eval_step, make_train_step


@dataclasses.dataclass
class TrainResult:
    state: Any  # final train state (sharded arrays): step, params, opt, rng
    history: list[dict]  # one entry per logging interval / evaluation
    out_dir: Path
    checkpoint_dir: Path
    final_val_loss: float | None
    config: Config
    mesh: Any = None


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


class _Batches:
    """Host batches → global arrays sharded over the batch axes (multi-host aware)."""

    def __init__(self, mesh):
        self.sharding = NamedSharding(mesh, P(BATCH_AXES))

    def __call__(self, host_batch: dict) -> dict:
        return {k: jax.make_array_from_process_local_data(self.sharding, np.asarray(v))
                for k, v in host_batch.items()}


def _prepare_out_dir(cfg: Config, fingerprint: dict) -> tuple[Path, Path, int | None]:
    out_dir = Path(cfg.train.out_dir).absolute()
    ckpt_dir = out_dir / "checkpoints"
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"train.out_dir {str(out_dir)!r} exists and is not a directory")
    found = read_meta(ckpt_dir)
    if found is None:
        return out_dir, ckpt_dir, None
    step, meta = found
    check_same_model(ckpt_dir, meta, fingerprint)
    if not cfg.train.resume:
        raise ConfigError(f"train.out_dir {str(out_dir)!r} already holds checkpoints up to step {step}; "
                          f"set train.resume=true to continue it or choose a new train.out_dir")
    return out_dir, ckpt_dir, step


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
    pid, pcount = jax.process_index(), jax.process_count()
    loader = Loader(splits.train, seq_len=cfg.model.seq_len, batch_size=tr.global_batch,
                    seed=tr.seed, process_index=pid, process_count=pcount, name="train")
    val = (eval_batches(splits.val, seq_len=cfg.model.seq_len, batch_size=tr.global_batch,
                        num_batches=tr.eval_batches, process_index=pid, process_count=pcount)
           if tr.eval_every > 0 else [])
    factory = model if model is not None else (lambda rngs: GPT(cfg.model, rngs=rngs))
    spec, create = model_spec(factory, mesh, tr.seed)
    fingerprint = spec.fingerprint()
    tx = make_optimizer(cfg.optim, tr.steps, spec.decay_mask)
    train_step = make_train_step(spec, tx, cfg, mesh, tr.steps)  # checks schedule and contract
    out_dir, ckpt_dir, resume_step = _prepare_out_dir(cfg, fingerprint)

    # From here on files may be written: every user mistake has been caught above.
    shardings = state_shardings_for(spec, tx, mesh)
    primary = pid == 0
    meta = {"config": cfg.to_dict(), "fingerprint": fingerprint}
    if resume_step is not None:
        ckpt = Checkpointer(ckpt_dir, keep=tr.keep_checkpoints)
        state, data_state, _ = ckpt.restore(resume_step, abstract_train_state(spec, tx, mesh, shardings))
        loader.set_state(data_state)
    else:
        state = init_train_state(spec, create, tx, mesh, tr.seed, shardings)
        ckpt = Checkpointer(ckpt_dir, keep=tr.keep_checkpoints)
    if primary:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    writer = MetricsWriter(out_dir, tensorboard=tr.tensorboard, enabled=primary)

    to_device = _Batches(mesh)
    batch_spec = jax.ShapeDtypeStruct((tr.global_batch, cfg.model.seq_len), np.int32,
                                      sharding=to_device.sharding)
    abstract_state = abstract_train_state(spec, tx, mesh, shardings)

    def compile_step(run_cfg: Config, step=None):
        """Ahead-of-time compile of the step (once; again only when repartitioning)."""
        t0 = time.perf_counter()
        step_fn = jax.jit(step or make_train_step(spec, tx, run_cfg, mesh, tr.steps),
                          in_shardings=(shardings, to_device.sharding),
                          out_shardings=(shardings, None), donate_argnums=0)
        compiled = step_fn.lower(abstract_state, {"inputs": batch_spec, "targets": batch_spec}).compile()
        return compiled, time.perf_counter() - t0

    eval_fn = jax.jit(make_eval_step(spec), in_shardings=(spec.storage, to_device.sharding))
    with jax.set_mesh(mesh):
        state, history, final_val = _run(
            cfg, state, compile_step, train_step, eval_fn, loader, val, to_device, ckpt, meta, writer,
            flops=_model_flops_per_token(model, cfg), mesh=mesh)
    ckpt.close()
    writer.close()
    return TrainResult(state, history, out_dir, ckpt_dir, final_val, cfg, mesh)


def _evaluate(eval_fn, params, val, to_device) -> float:
    losses = [eval_fn(params, to_device(b)) for b in val]
    return float(np.mean(jax.device_get(losses)))


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


def _run(cfg, state, compile_step, first_step, eval_fn, loader, val, to_device, ckpt, meta, writer, *,
         flops, mesh):
    tr = cfg.train
    step_fn, compile_s = compile_step(cfg, first_step)
    tokens_per_step = tr.global_batch * cfg.model.seq_len
    peak = peak_flops_per_device(tr.peak_tflops)
    primary = jax.process_index() == 0
    start = int(jax.device_get(state["step"]))
    history: list[dict] = []
    final_val = None
    bar = tqdm(total=tr.steps, initial=start, disable=not (tr.progress and primary),
               dynamic_ncols=True, desc="train")
    say = bar.write if not bar.disable else (print if primary else (lambda *_: None))
    say(f"mesh {dict(mesh.shape)} | {len(jax.devices())} devices | compiled step in {compile_s:.1f}s"
        + (f" | resuming at step {start}" if start else ""))
    pending, t_last, steps_since = None, time.perf_counter(), 0
    for step in range(start, tr.steps):
        state, metrics = step_fn(state, to_device(next(loader)))
        pending, steps_since = metrics, steps_since + 1
        done = step + 1
        record: dict = {}
        if done % tr.log_every == 0 or done == tr.steps:
            values = jax.device_get(pending)  # the only host sync of the interval
            elapsed = time.perf_counter() - t_last
            tps = tokens_per_step * steps_since / elapsed
            record.update({k: float(v) for k, v in values.items()})
            record.update(tokens_per_s=tps, step_time_s=elapsed / steps_since,
                          mfu=mfu(tps, flops, len(jax.devices()), peak))
            t_last, steps_since = time.perf_counter(), 0
        if val and (done % tr.eval_every == 0 or done == tr.steps):
            t_eval = time.perf_counter()
            final_val = _evaluate(eval_fn, state["params"], val, to_device)
            record["val_loss"] = final_val
            t_last += time.perf_counter() - t_eval  # evaluation is not step time
        if (tr.checkpoint_every and done % tr.checkpoint_every == 0) or done == tr.steps:
            t_save = time.perf_counter()
            ckpt.save(done, state, loader.get_state(), {**meta, "step": done})
            t_last += time.perf_counter() - t_save  # saving is not step time either
        if cfg.parallel.repartition_after and done == cfg.parallel.repartition_after:
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
            history.append({"step": done, **record})
            writer.write(done, record)
            say(format_line(done, record))
            bar.set_postfix(loss=f"{record.get('loss', float('nan')):.3f}")
        bar.update(1)
    bar.close()
    return state, history, final_val
