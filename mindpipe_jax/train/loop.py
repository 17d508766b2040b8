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
  that step's update out inside the compiled step and only counts it;
* with ``tuner.enabled`` feeds EPara's online tuner (tuner/epara.py) and, when it
  decides, switches the job in place to another global batch, microbatch count or
  mesh shape (train/reconfigure.py). The tuned configuration and learning-rate gain
  are kept in each checkpoint's meta, and ``train.resume=true`` continues with them.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from mindpipe_jax.atomic_write import write_atomically
from mindpipe_jax.config import Config, check_validation_split, config_argument
from mindpipe_jax.data import TokenSplits, resolve_data
from mindpipe_jax.errors import ConfigError, NonFiniteError
from mindpipe_jax.models import build_model, flops_per_token
from mindpipe_jax.parallel.dispatch import DispatchWindow
from mindpipe_jax.parallel.rules import check_rules_used, recording_lookups, use_rules
from mindpipe_jax.train.agreement import (
    agree_on_checkpoint,
    agree_on_model,
    all_or_none,
    start_together,
    stops_everywhere,
)
from mindpipe_jax.train.checkpoint import (
    Checkpointer,
    prepare_out_dir,
    remove_incomplete,
    restore_verified,
)
from mindpipe_jax.train.clock import Interval, aside
from mindpipe_jax.train.memory_fit import compile_fitting
from mindpipe_jax.train.metrics import MetricsWriter, format_line, mfu, peak_flops_per_device
from mindpipe_jax.train.prepare import Preparer
from mindpipe_jax.train.reconfigure import Layout, build_layout, make_feed, rebatched
from mindpipe_jax.train.repartition import Resumed, on_resume, replan
from mindpipe_jax.train.rundir import hold_run_dir
from mindpipe_jax.train.signals import FinalSave, StartupInterrupts, StopSignals, raise_if_interrupted
from mindpipe_jax.train.state import init_train_state, resume_lines
from mindpipe_jax.train.step import nonfinite_leaf_names
from mindpipe_jax.train.step_checks import check_step_model
from mindpipe_jax.train.tuned import OnlineTuning, Switcher, SwitchRefused, saved_tuning


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
    # train.resume="auto" found the run finished (its newest checkpoint at train.steps or
    # later): nothing was trained, and ``state`` is that checkpoint's
    already_complete: bool = False

    @property
    def step(self) -> int:
        return int(_host(self.state["step"]))


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


def train(model=None, data=None, config: Config | None = None, *overrides: str,
          step_model=None, tuning: OnlineTuning | None = None) -> TrainResult:
    """Train ``model`` (an ``nnx.Module``, a factory ``rngs -> Module``, or None for the
    reference model of ``config.model``) on ``data`` (None = ``config.data``, a path,
    a ``DataConfig``, ``TokenSplits``, or token ids in memory: a 1-D integer array, split
    by ``data.val_fraction`` as a token file is; a config naming another source as well
    is refused). ``overrides`` are ``key=value`` strings.
    ``tuning``: the online tuner ``tuner.enabled`` needs (``mindpipe_jax.train`` passes
    EPara's). ``step_model`` predicts step times for it: any object with
    ``step_time(candidate)`` and ``observe(candidate, seconds)``; default: what this run
    measures (``tuner.epara.MeasuredThroughput``).
    """
    with StartupInterrupts():  # Ctrl-C before the loop: KeyboardInterrupt, never swallowed
        with stops_everywhere("training run", overrides):  # a mistake of this process only stops all
            cfg = config_argument(config)
            if overrides:
                cfg = cfg.replace(*overrides)
            if cfg.train.deterministic and cfg.parallel.tensor == 0:
                cfg = cfg.replace("parallel.tensor=1")  # auto never picks what deterministic mode refuses
            if not isinstance(data, TokenSplits):  # split by data.val_fraction
                check_validation_split(cfg)
        start_together(cfg, "training run")
        # train.out_dir: writable (checked before anything is computed) and locked against
        # a second run for this run's life; a failure before the first write leaves nothing.
        with hold_run_dir(cfg.train.out_dir), use_rules(cfg.parallel.rules), recording_lookups():
            # Reading a checkpoint is collective (orbax): every process must see the same ones.
            agree_on_checkpoint(Path(cfg.train.out_dir).absolute() / "checkpoints", "training run")
            return _train(cfg, model, data, step_model, tuning)


def _train(cfg: Config, model, data, step_model, tuning: OnlineTuning | None) -> TrainResult:
    tuned = saved_tuning(cfg)
    if (tuned or cfg.tuner.enabled) and tuning is None:
        raise ConfigError("tuner.enabled=true (or resuming a tuned run) needs the online tuner: call "
                          "mindpipe_jax.train, which plugs it in, not mindpipe_jax.train.loop.train")
    check_step_model(step_model, bool(tuned or cfg.tuner.enabled))
    if tuned:  # a tuned run resumes with the batch, mesh and learning-rate gain it had,
        # re-planned when it now has another number of devices (elastic)
        cfg, tuned = tuning.resume(cfg, tuned, model)
    if tuned or cfg.tuner.enabled:
        gain = tuned["lr_gain"] if tuned else tuning.initial_gain(cfg)
    else:
        gain = None  # no tuner: the default step, no gain argument

    def factory_for(run_cfg: Config):
        return model if model is not None else (lambda rngs: build_model(run_cfg.model, rngs))

    with all_or_none("training run"):  # the user's model code failing on one process (an import it lacks)
        layout = build_layout(cfg, factory_for, gain)
    agree_on_model(layout.spec.fingerprint(), "training run")  # another model on a process would hang
    tr = cfg.train
    with all_or_none("training run"):  # a data path one process cannot read stops them all
        splits = resolve_data(data, cfg)
    # Evaluations keep the first run's batch (the same rows) across batch switches.
    val_rows = tuned.get("initial_batch", 0) or tr.global_batch
    feed = make_feed(splits, layout, val_rows=val_rows)
    fingerprint = layout.spec.fingerprint()
    layout.make_step()  # checks schedule and contract (the layout keeps the step it built)
    # Its own stretch: a resume reads the checkpoint's meta collectively (orbax), alike on
    # every process (they agreed on the checkpoints they see: agree_on_checkpoint).
    with all_or_none("training run"):
        out_dir, ckpt_dir, resume_step, saved_meta = prepare_out_dir(cfg, fingerprint)
    primary = jax.process_index() == 0
    resumed = Resumed()  # an online repartition's split a checkpoint carries, or one a stop put off
    if resume_step is not None:
        try:
            state, data_state, _ = restore_verified(ckpt_dir, resume_step, layout.abstract_state)
            if tuned:  # the tuner (or an elastic resume) may have changed the batch since
                data_state = rebatched(data_state, tr.global_batch)
            feed.loader.set_state(data_state)
        except BaseException:
            feed.close()
            raise
        if resume_step >= tr.steps:  # train.resume="auto" on a finished run
            feed.close()
            return TrainResult(state, [], out_dir, ckpt_dir, None, cfg, layout.mesh,
                               skipped_steps=int(saved_meta.get("skipped_steps", 0)), already_complete=True)
        resumed = on_resume(saved_meta, cfg, resume_step)
        for line in (*resume_lines(saved_meta, cfg, resume_step), *resumed.lines) if primary else ():
            print(line, flush=True)
        if resumed.split is not None:
            split = f"parallel.stage_layers={resumed.split}"
            layout = dataclasses.replace(layout, cfg=layout.cfg.replace(split))

    # Before any file: a step that cannot fit in memory is a mistake to refuse.
    compile_s = compile_fitting(layout, state_resident=resume_step is not None, on_error=feed.close)
    try:  # the model and its step are traced: every logical name they use was looked up
        check_rules_used(cfg.parallel.rules)
    except ConfigError:
        feed.close()
        raise

    # From here on files may be written: every user mistake has been caught above.
    raise_if_interrupted()
    if primary:
        removed = remove_incomplete(ckpt_dir)
        if removed:
            print(f"removed what interrupted saves left in {ckpt_dir}: {', '.join(removed)}", flush=True)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("mindpipe: checkpoint dir ready")
    if resume_step is None:
        state = init_train_state(layout.spec, layout.create, layout.tx, layout.mesh, tr.seed,
                                 layout.shardings)
    ckpt = Checkpointer(ckpt_dir, keep=tr.keep_checkpoints)
    if primary:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_atomically(out_dir / "config.json", json.dumps(cfg.to_dict(), indent=2))
    writer = MetricsWriter(out_dir, tensorboard=tr.tensorboard, enabled=primary, resume_step=resume_step)
    meta = {"config": cfg.to_dict(), "fingerprint": fingerprint, **({"tuner": tuned} if tuned else {}),
            **({"repartition": resumed.chosen} if resumed.chosen else {})}  # later checkpoints carry it on
    tuner = tuning.make(cfg, layout.mesh, tuned, gain, step_model, model) if cfg.tuner.enabled else None
    # candidates compiled ahead in the background (tuner.prepare)
    preparer = Preparer(factory_for) if tuner is not None and cfg.tuner.prepare else None
    switcher = Switcher(factory_for, splits, val_rows, preparer)

    run = _Run(cfg, ckpt, meta, writer, leaf_names=nonfinite_leaf_names(layout.spec.abstract_params),
               skipped=int(saved_meta.get("skipped_steps", 0)), repartition_owed=resumed.owed_after)
    try:
        # No mesh is set around the loop: the step compiles and evaluation traces under
        # their own layout's mesh, and a switch builds the next model spec outside any.
        state = run(state, layout, feed, flops=_model_flops_per_token(model, cfg),
                    tuner=tuner, switcher=switcher, preparer=preparer, first_compile_s=compile_s)
    finally:
        with FinalSave(jax.process_count() > 1):  # the loop is over: a Ctrl-C now lets this finish
            if preparer is not None:
                preparer.close()
            ckpt.close()  # waits for a save in flight: a stop or an error never leaves half a step
            writer.close()
            run.feed.close() if run.feed is not None else feed.close()
    return TrainResult(state, run.history, out_dir, ckpt_dir, run.final_val, run.layout.cfg,
                       run.layout.mesh, stopped=run.stopped, skipped_steps=run.skipped)


def _evaluate(eval_fn, params, feed, mesh) -> float:
    # A bounded look-ahead, as for the steps: 100 validation batches queued at once
    # deadlocked XLA:CPU's collectives and aborted the run (parallel/dispatch.py).
    window, losses = DispatchWindow(), []
    with jax.set_mesh(mesh):  # traced on first use: the model's constraints read the mesh
        for batch in feed.val:
            losses.append(eval_fn(params, feed.val_to_device(batch)))
            window.push(losses[-1])
    return float(np.mean(_host(losses)))


class _Run:
    """The loop's state between steps: history, skipped-step count, stop reason."""

    def __init__(self, cfg: Config, ckpt: Checkpointer, meta: dict, writer: MetricsWriter, *,
                 leaf_names: list[str], skipped: int, repartition_owed: int | None = None):
        self.cfg, self.ckpt, self.meta, self.writer = cfg, ckpt, meta, writer
        self.repartition_owed = repartition_owed  # a step past repartition_after that still runs it
        self.leaf_names = leaf_names
        self.skipped = skipped
        self.history: list[dict] = []
        self.final_val: float | None = None
        self.stopped: str | None = None
        self.say = print
        self.layout: Layout | None = None  # the current ones: a tuner switch replaces them
        self.feed = None

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
            if step == 1:  # the initial parameters: no update has run, the learning rate is not it
                advice = ("at step 1 no update has run yet, so the learning rate is not the cause: the "
                          "model's loss on its initial parameters is not finite on this data (token ids "
                          "past its vocabulary, positions past its table, a log or division of zero, a "
                          "non-finite initialisation)")
            else:
                advice = "lower optim.lr, or set train.nonfinite=skip to leave such updates out"
            raise NonFiniteError(
                f"step {step}: non-finite {what}; training stopped and {kept}; {advice}",
                step=step, group=group,
                last_checkpoint=None if last is None else self.ckpt.directory / str(last))

    def __call__(self, state, layout: Layout, feed, *, flops, tuner=None, switcher=None, preparer=None,
                 first_compile_s: float | None = None):
        self.layout, self.feed = layout, feed
        tr = layout.cfg.train
        # train_s in each record: seconds since this call began (first compile, steps, tuner
        # switches and recompiles included), less evaluation and checkpoint saving.
        clock = Interval()
        step_fn, compile_s = layout.compile()
        if first_compile_s is not None:  # compiled before the call (_train's memory check): count it
            clock.t0 -= (compile_s := first_compile_s)
        eval_fn = layout.eval_fn(feed)
        peak = peak_flops_per_device(tr.peak_tflops)
        primary = jax.process_index() == 0
        start = int(_host(state["step"]))
        bar = tqdm(total=tr.steps, initial=start, disable=not (tr.progress and primary),
                   dynamic_ncols=True, desc="train")
        say = bar.write if not bar.disable else (print if primary else (lambda *_: None))
        self.say = say
        say(f"mesh {dict(layout.mesh.shape)} | {len(jax.devices())} devices | compiled step in "
            f"{compile_s:.1f}s" + (f" | resuming at step {start}" if start else ""))
        if tr.eval_every > 0 and len(self.feed.val) < tr.eval_batches:  # not silently fewer
            say(f"validation: {len(self.feed.val)} batches, all the validation split holds "
                f"(train.eval_batches={tr.eval_batches})")
        if tuner is not None:
            tuner.restart(start, compile_s)
            for line in tuner.start_notes(tr.steps, start):
                say(line)
        # Metrics of the steps not yet seen on the host: fetched together (one sync)
        # at a logging, evaluation, checkpoint or tuner step, so no step is left unchecked.
        pending: list[tuple[int, dict]] = []
        window = DispatchWindow()  # a bounded look-ahead (parallel/dispatch.py: XLA:CPU deadlocks past it)
        since_log, since_fetch = Interval(), Interval()  # step time for the log, for the tuner
        # The bar is closed (its line ended) however the loop ends: an error's one line
        # starts a line of its own.
        with bar, StopSignals(jax.process_count() > 1) as signals:
            for step in range(start, tr.steps):
                state, metrics = step_fn(state, layout.batches(next(self.feed.loader)))
                window.push(metrics)
                pending.append((step + 1, metrics))
                since_log.add(layout.tokens_per_step)
                since_fetch.add(layout.tokens_per_step)
                done = step + 1
                stop = signals.reached(done)
                log_now = done % tr.log_every == 0 or done == tr.steps
                eval_now = bool(self.feed.val) and (done % tr.eval_every == 0 or done == tr.steps)
                save_now = bool(stop) or done == tr.steps or bool(
                    tr.checkpoint_every and done % tr.checkpoint_every == 0)
                tune_now = tuner is not None and tuner.fetch_due(done)
                record: dict = {}
                if log_now or eval_now or save_now or tune_now:
                    steps, values = zip(*pending, strict=True)
                    values = _host(list(values))
                    pending.clear()
                    self._check_finite(list(steps), values)
                    self.ckpt.check()  # a save that failed in the background stops the run now
                    if tuner is not None:
                        # (steps timed while a layout compiled alongside ran slower than they do)
                        quiet = preparer is None or not preparer.busy()
                        tuner.observe(values, since_fetch.per_step() if quiet else None, done)
                        since_fetch.reset()
                        for candidate in preparer.finished() if preparer is not None else ():
                            tuner.prepared(candidate)
                    if log_now:
                        tps = since_log.tokens / since_log.elapsed()
                        record.update({k: float(v) for k, v in values[-1].items() if k != "nonfinite_leaf"})
                        record.update(tokens_per_s=tps, step_time_s=since_log.per_step(),
                                      mfu=mfu(tps, flops, len(jax.devices()), peak),
                                      batch=layout.cfg.train.global_batch)
                        if tr.nonfinite == "skip":
                            record["skipped_steps"] = self.skipped
                        if tuner is not None:
                            record.update(tuner.metrics())
                        since_log.reset()
                # Switch before evaluating and saving: a checkpoint of this step then holds
                # the new layout, loader position and tuner state, so resuming is exact.
                decision = tuner.decide(done) if tune_now and not stop and done < tr.steps else None
                if decision is not None:
                    try:
                        with aside(since_log, since_fetch):
                            state, layout, self.feed, compile_s = switcher(state, layout, self.feed,
                                                                           decision, layout.cfg)
                            step_fn, _ = layout.compile()  # the program the switcher compiled
                            eval_fn = layout.eval_fn(self.feed)
                    except SwitchRefused as err:  # the run goes on as it was; the tuner drops that layout
                        tuner.refuse(decision.after)
                        record["tuner_refused"] = {"to": decision.after.label(), "why": str(err)}
                        say(f"step {done} | tuner: not switching to {decision.after.label()}: {err}")
                    else:
                        self.layout = layout
                        tuner.accept(decision, layout.cfg, compile_s)
                        self.meta["config"] = layout.cfg.to_dict()
                        self.meta.pop("repartition", None)  # a tuned layout splits its stages evenly
                        record.update({"tuner": decision.to_dict(), **tuner.metrics()})
                        say(f"{decision.line()} | compiled in {compile_s:.1f}s")
                if tune_now and preparer is not None and (ahead := tuner.to_prepare()) is not None:
                    if preparer.submit(ahead, ahead.apply(layout.cfg), tuner.lr_gain):  # (once)
                        say(f"step {done} | tuner: compiling {ahead.label()} in the background")
                par = layout.cfg.parallel
                repartition_now = bool(par.repartition_after) and done in (
                    par.repartition_after, self.repartition_owed)
                if repartition_now and stop:  # no time to measure and recompile: the resume does it
                    self.meta["repartition_owed"] = done
                elif repartition_now:
                    self.meta.pop("repartition_owed", None)
                    # The stage split lives only inside the step (storage keeps the [layers]
                    # axis), so moving layers between stages changes no parameter bit.
                    with aside(since_log, since_fetch):
                        before, counts = replan(layout)  # the run's own model, decided on process 0
                        if counts != before:
                            layout = self.layout = dataclasses.replace(
                                layout, cfg=layout.cfg.replace(f"parallel.stage_layers={list(counts)}"))
                            step_fn, _ = layout.compile()
                    record["repartition"] = {"before": list(before), "after": list(counts)}
                    self.meta["repartition"] = {"step": done, "stage_layers": list(counts)}
                    say(f"step {done} | repartition {list(before)} -> {list(counts)}")
                if eval_now:
                    with aside(since_log, since_fetch, clock):  # evaluation is not step time
                        self.final_val = _evaluate(eval_fn, state["params"], self.feed, layout.mesh)
                    record["val_loss"] = self.final_val
                if save_now:
                    meta = {**self.meta, "step": done, "skipped_steps": self.skipped}
                    if tuner is not None:
                        meta["tuner"] = tuner.state_dict()
                    with aside(since_log, since_fetch, clock):  # saving is not step time either
                        self.ckpt.save(done, state, self.feed.loader.get_state(), meta, force=bool(stop))
                if record:
                    record["train_s"] = clock.elapsed()
                    self.history.append({"step": done, **record})
                    self.writer.write(done, record)
                    if (line := format_line(done, record)) is not None:
                        say(line)
                    bar.set_postfix(loss=f"{record.get('loss', float('nan')):.3f}")
                bar.update(1)
                if stop and done < tr.steps:
                    self.ckpt.wait()
                    self.stopped = stop
                    say(f"stopped by {stop} after step {done} of {tr.steps}: checkpoint saved in "
                        f"{self.ckpt.directory / str(done)}; continue with train.resume=true "
                        f"(mindpipe train ... --resume)")
                    break
        return state
