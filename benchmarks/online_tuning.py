"""EPara validation figure (2): wall time to a target validation loss, the online
tuner vs the best of three fixed global batch sizes with their best learning rates.

Setup, on 8 simulated CPU devices (data=8, one process): a small GPT (d_model 64,
4 layers, 4 heads, seq 64, byte vocabulary) on the stdlib corpus (the default
data), AdamW with the default settings except a constant learning rate after the
20-step warmup (``optim.min_lr_ratio=1``), so that no run's schedule depends on
its step cap. Every run uses ``train.deterministic=true`` (the gradient is
computed as 8 virtual shards, one per device): that is where the tuner gets the
per-shard gradients its noise scale needs (tuner/noise.py), and the fixed runs use
the same step program so the comparison is not about the step's form (measured
here: the same step time as plain data parallelism).

* **fixed** — global batch 8, 32 and 128 (``--batches``), each with the learning
  rates ``--lrs`` (default 1e-3, 3e-3, 1e-2: the default 3e-3 and half a decade
  either side; clipping at 1.0 keeps the largest stable); the best learning rate
  per batch is the one with the shortest time to target (or, if none reached
  it, the lowest validation loss).
* **online** — ``tuner.enabled=true`` from the smallest batch with that batch's
  best learning rate; batch ladder 8, 16, 32, 64, 128; AdaScale learning-rate gain;
  a decision every 100 steps after the first 100 (``--tuner-every``,
  ``--tuner-warmup``: ~5 s at batch 8), threshold 10 % (``--tuner-threshold``: a
  switch recompiles the step, ~7-10 s here, about a tenth of a run to target).
  One run per step model (``--step-models``): ``costmodel`` — tuner/costmodel.py's
  ``CostModel`` (compiled FLOPs, calibrated rate and launch costs, refitted from
  the step times the run measures; its calibration, ~20 s, runs before the run and
  is reported beside the ratio), and ``measured`` — the default
  ``MeasuredThroughput``, which knows only the batch sizes the run has trained with
  and predicts others with a 10 % fixed-overhead prior.

Clock: ``train_s`` of the loop's history records — seconds since the loop began,
including the first compile and every tuner switch and recompile, excluding
evaluation and checkpoint saving (alike for every run). Evaluation every
``--eval-every`` steps on the same 128 validation sequences (8 K tokens) for every
run (``eval_batches`` = 128 / batch; the validation batches are the first
unshuffled windows, so 16 x 8 rows and 1 x 128 rows are the same rows, which the
script checks). A run's time to
target is ``train_s`` at its first evaluation at or below ``--target-loss``
(default 1.75 nats/byte, chosen from a pilot run in which the best fixed run got
there in ~50 s at a load average of 7; 84 s at 11 in the recorded run; the
default cap is 100 s):
the resolution is one evaluation interval (10 steps: 0.4 s at batch 8, ~9 s at
batch 128 here). Runs stop when they reach the target (a SIGTERM to this process
from a watcher thread; the loop finishes the step and saves a checkpoint, after
the time was taken), at ``--max-seconds`` of ``train_s`` or at ``--max-steps``,
and then report "not reached". Checkpoints go to a temporary directory.

Two rounds. The first runs the fixed grid and picks the best learning rate per
batch and the best fixed run. The second runs, back to back, the best fixed run
again, the tuner runs, and the best fixed run once more; the headline is each
tuner run's time over the mean of the two repeats. This is a shared 2-core
machine whose 8 simulated devices share the cores with other jobs: the same run
took 51 s and 101 s to target in a pilot, minutes apart (load average 7 vs 9.5;
batch 8's small steps suffer most), so comparing a tuner run with a grid run from
ten minutes earlier measures the load, not the tuner. The bracketing repeats show
how much the load moved during the second round.

Usage: ``python benchmarks/online_tuning.py [--out FILE] [--history-out FILE]``, or
``python benchmarks/epara.py --part online`` (``run_online_comparison(args)``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

SMALL = ("model.d_model=64", "model.n_layers=4", "model.n_heads=4", "model.seq_len=64")
COMMON = (*SMALL, "parallel.data=8", "parallel.tensor=1", "train.deterministic=true",
          "optim.min_lr_ratio=1.0", "train.checkpoint_every=0", "train.log_every=10",
          "train.progress=false", "train.tensorboard=false")
VAL_SEQUENCES = 128  # every run evaluates on the same first 128 validation windows

DEFAULTS = dict(target_loss=1.75, max_seconds=100.0, max_steps=20000, eval_every=10,
                batches="8,32,128", lrs="1e-3,3e-3,1e-2", ladder="8,16,32,64,128",
                tuner_every=100, tuner_warmup=100, tuner_threshold=0.1, history_out="",
                skip_fixed=False, tuner_lr=0.0, step_models="costmodel,measured")


def add_options(parser: argparse.ArgumentParser) -> None:
    """This part's options (benchmarks/epara.py may add them to its parser)."""
    d = DEFAULTS
    parser.add_argument("--target-loss", type=float, default=d["target_loss"],
                        help="target validation loss, nats per byte")
    parser.add_argument("--max-seconds", type=float, default=d["max_seconds"],
                        help="cap on each run's training time (train_s)")
    parser.add_argument("--max-steps", type=int, default=d["max_steps"], help="cap on each run's steps")
    parser.add_argument("--eval-every", type=int, default=d["eval_every"])
    parser.add_argument("--batches", default=d["batches"], help="fixed global batches, comma-separated")
    parser.add_argument("--lrs", default=d["lrs"], help="learning rates tried per fixed batch")
    parser.add_argument("--ladder", default=d["ladder"], help="the tuner's batch sizes")
    parser.add_argument("--tuner-every", type=int, default=d["tuner_every"])
    parser.add_argument("--tuner-warmup", type=int, default=d["tuner_warmup"])
    parser.add_argument("--tuner-threshold", type=float, default=d["tuner_threshold"])
    parser.add_argument("--tuner-lr", type=float, default=d["tuner_lr"],
                        help="with --skip-fixed: the tuner run's learning rate")
    parser.add_argument("--skip-fixed", action="store_true", help="only the tuner run")
    parser.add_argument("--step-models", default=d["step_models"],
                        help="tuner runs, one per step model: measured (the default MeasuredThroughput), "
                             "costmodel (tuner/costmodel.py's CostModel, calibrated first)")
    parser.add_argument("--history-out", default=d["history_out"],
                        help="write the tuner run's history (JSON list of records) here")


def _opt(args, name):
    return getattr(args, name, DEFAULTS[name])


def _floats(text: str) -> list[float]:
    return [float(x) for x in str(text).split(",") if x.strip()]


class _Watcher(threading.Thread):
    """Reads the run's metrics.jsonl as it grows and stops the run (SIGTERM to this
    process: the loop ends after the current step, with a checkpoint) once a
    validation loss is at or below ``target`` or ``train_s`` passes ``max_seconds``."""

    def __init__(self, path: Path, target: float, max_seconds: float):
        super().__init__(daemon=True)
        self.path, self.target, self.max_seconds = path, target, max_seconds
        self.finished = threading.Event()
        self.reason: str | None = None
        self._offset = 0
        self._partial = ""

    def _records(self):
        if not self.path.exists():
            return []
        with open(self.path) as f:
            f.seek(self._offset)
            text = f.read()
            self._offset = f.tell()
        text, self._partial = self._partial + text, ""
        lines = text.split("\n")
        self._partial = lines.pop()  # "" or a line not finished yet
        return [json.loads(x) for x in lines if x.strip()]

    def run(self) -> None:
        while self.reason is None and not self.finished.wait(0.2):
            for rec in self._records():
                val = rec.get("val_loss")
                if val is not None and val <= self.target:
                    self.reason = f"target reached at step {rec['step']}"
                elif rec.get("train_s", 0.0) >= self.max_seconds:
                    self.reason = f"time cap at step {rec['step']}"
                if self.reason is not None:
                    _Stopper.expect()
                    os.kill(os.getpid(), signal.SIGTERM)
                    break


class _Stopper:
    """While the benchmark runs, a SIGTERM that arrives between runs (a watcher's, late)
    is ignored rather than killing the process; any other one still ends it."""

    expected = 0.0

    @classmethod
    def expect(cls) -> None:
        cls.expected = time.monotonic()

    @classmethod
    def handle(cls, signum, frame) -> None:
        if time.monotonic() - cls.expected > 30:
            raise SystemExit(f"stopped by signal {signum}")


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def run_one(name: str, splits, batch: int, lr: float, args, tmp: Path, tuner: bool = False,
            step_model=None) -> dict:
    """Train one run until the target, the time cap or the step cap; its figures."""
    import mindpipe_jax as mp

    target, max_s = _opt(args, "target_loss"), _opt(args, "max_seconds")
    overrides = [*COMMON, f"train.global_batch={batch}", f"optim.lr={lr}",
                 f"train.steps={_opt(args, 'max_steps')}", f"train.eval_every={_opt(args, 'eval_every')}",
                 f"train.eval_batches={max(1, VAL_SEQUENCES // batch)}",
                 f"train.out_dir={tmp / name.replace(' ', '_')}"]
    if tuner:
        ladder = [int(b) for b in _floats(_opt(args, "ladder"))]
        overrides += ["tuner.enabled=true", f"tuner.batch_sizes={ladder}", "tuner.lr_scaling=\"adascale\"",
                      f"tuner.every={_opt(args, 'tuner_every')}",
                      f"tuner.warmup={_opt(args, 'tuner_warmup')}",
                      f"tuner.threshold={_opt(args, 'tuner_threshold')}"]
    out_dir = tmp / name.replace(" ", "_")
    watcher = _Watcher(out_dir / "metrics.jsonl", target, max_s)
    watcher.start()
    t0 = time.perf_counter()
    try:
        # The loop's own lines (compile, every log step) go to the terminal only, not to --out.
        with contextlib.redirect_stdout(sys.__stdout__):
            result = mp.train(None, splits, mp.Config(), *overrides, step_model=step_model)
    finally:
        watcher.finished.set()
        watcher.join()
    wall = time.perf_counter() - t0
    hist = result.history
    evals = [h for h in hist if "val_loss" in h]
    hit = next((h for h in evals if h["val_loss"] <= target), None)
    last = hist[-1] if hist else {}
    batches = []  # (first step, batch) of each batch the run trained with
    for h in hist:
        b = int(h.get("tuner/batch", h.get("batch", batch)))
        if "batch" in h or "tuner/batch" in h:
            if not batches or batches[-1][1] != b:
                batches.append((h["step"] if batches else 0, b))
    decisions = [h["tuner"] for h in hist if "tuner" in h]
    gains = [h["tuner/lr_gain"] for h in hist if "tuner/lr_gain" in h]
    b_noise = [h["tuner/b_noise"] for h in hist if h.get("tuner/b_noise") is not None
               and math.isfinite(h["tuner/b_noise"])]
    return dict(name=name, batch=batch, lr=lr, tuner=tuner, history=hist, wall_s=wall,
                time_to_target=hit["train_s"] if hit else None, steps_to_target=hit["step"] if hit else None,
                steps=result.step, train_s=last.get("train_s", math.nan),
                best_val=min((h["val_loss"] for h in evals), default=math.nan),
                final_batch=result.config.train.global_batch, batches=batches, decisions=decisions,
                final_gain=gains[-1] if gains else 1.0, b_noise=b_noise[-1] if b_noise else None,
                stop=watcher.reason or ("step cap" if result.step >= _opt(args, "max_steps") else "end"))


def _best(runs: list[dict]) -> dict:
    """The run with the shortest time to target, else the lowest validation loss."""
    reached = [r for r in runs if r["time_to_target"] is not None]
    if reached:
        return min(reached, key=lambda r: r["time_to_target"])
    return min(runs, key=lambda r: r["best_val"])


def _fmt_time(r: dict) -> str:
    return f"{r['time_to_target']:7.1f} s" if r["time_to_target"] is not None else "not reached"


def _trajectory(r: dict) -> str:
    return " -> ".join(f"{b}" + (f" (step {s})" if s else "") for s, b in r["batches"])


def _check_same_validation_rows(splits, batches: list[int], seq_len: int) -> None:
    """Each batch size's evaluation batches hold the same windows (see the docstring)."""
    import numpy as np

    from mindpipe_jax.data import eval_batches

    seen = []
    for b in sorted(set(batches)):
        got = eval_batches(splits.val, seq_len=seq_len, batch_size=b, num_batches=VAL_SEQUENCES // b)
        seen.append(np.concatenate([np.asarray(x["inputs"]) for x in got]))
    assert all(s.shape == seen[0].shape and (s == seen[0]).all() for s in seen), \
        "validation rows differ between batch sizes"


def _row(r: dict) -> str:
    return (f"{r['name']:26s} {r['lr']:8.0e} {r['steps']:6d} {r['train_s']:8.1f} {r['wall_s']:7.0f} "
            f"{r['best_val']:8.3f}  {_fmt_time(r):>14s}   ({os.getloadavg()[0]:.1f})")


def _cost_model(cfg):
    """tuner/costmodel.py's step model for the online tuner, calibrated on this machine
    (FLOPs from compiled programs, FLOP rate, all-reduce link, launch costs)."""
    from mindpipe_jax.tuner.costmodel import CostModel, Hardware, ModelCosts

    t0 = time.perf_counter()
    model = CostModel(ModelCosts.measure(cfg), Hardware.calibrate(), cfg.model.seq_len)
    return model, time.perf_counter() - t0


def run_online_comparison(args) -> dict:
    """Run the fixed grid and the tuner run(s), print the tables and the headline ratio."""
    import mindpipe_jax as mp
    from mindpipe_jax.data import load_tokens

    cfg = mp.Config().replace(*COMMON)
    splits = load_tokens(cfg.data, cfg.model.vocab_size)
    batches = [int(b) for b in _floats(_opt(args, "batches"))]
    lrs = _floats(_opt(args, "lrs"))
    ladder = [int(b) for b in _floats(_opt(args, "ladder"))]
    step_models = [m.strip() for m in str(_opt(args, "step_models")).split(",") if m.strip()]
    _check_same_validation_rows(splits, batches + ladder, cfg.model.seq_len)
    target, max_s = _opt(args, "target_loss"), _opt(args, "max_seconds")
    print(f"model: d_model 64, 4 layers, 4 heads, seq 64, byte vocabulary; data: {splits.name}; mesh data=8; "
          f"deterministic (8 virtual shards); AdamW, warmup 20 steps then constant lr")
    print(f"target validation loss {target} (nats/byte, {VAL_SEQUENCES} validation sequences, evaluated "
          f"every {_opt(args, 'eval_every')} steps); caps: {max_s:.0f} s of training time, "
          f"{_opt(args, 'max_steps')} steps")
    print(f"tuner: batch ladder {ladder}, AdaScale lr gain, every {_opt(args, 'tuner_every')} steps after "
          f"{_opt(args, 'tuner_warmup')}, threshold {_opt(args, 'tuner_threshold'):.0%}; step models: "
          f"{', '.join(step_models)}")
    print("clock: train_s = loop time incl. compile and tuner switches, excl. evaluation and checkpoints; "
          "wall = the whole run incl. set-up and evaluations\n")

    previous = signal.signal(signal.SIGTERM, _Stopper.handle)
    fixed: list[dict] = []
    tuned: list[dict] = []
    repeats: list[dict] = []  # the best fixed run again, before and after the tuner runs
    best_per_batch: dict[int, dict] = {}
    best_fixed = None
    header = (f"{'run':26s} {'lr':>8s} {'steps':>6s} {'train_s':>8s} {'wall':>7s} {'best val':>8s}  "
              f"time to target   (load average)")
    try:
        with tempfile.TemporaryDirectory(prefix="online_tuning_") as tmp:
            tmp = Path(tmp)
            if not _opt(args, "skip_fixed"):
                print("### fixed batch sizes x learning rates")
                print(header)
                for b in batches:
                    for lr in lrs:
                        fixed.append(r := run_one(f"fixed B{b} lr{lr:g}", splits, b, lr, args, tmp))
                        print(_row(r), flush=True)
                    best_per_batch[b] = _best([r for r in fixed if r["batch"] == b])
                start_batch = min(batches)
                start_lr = best_per_batch[start_batch]["lr"]
                reached = [r for r in best_per_batch.values() if r["time_to_target"] is not None]
                best_fixed = min(reached, key=lambda r: r["time_to_target"]) if reached else None
            else:
                start_batch, start_lr = min(ladder), _opt(args, "tuner_lr") or 3e-3
            print("\n### head to head: the best fixed run again, the tuner runs, the best fixed run again "
                  "(back to back, so the machine's load drifts over all of them alike)")
            print(header)

            def repeat(which: str) -> None:
                if best_fixed is not None:
                    r = run_one(f"best fixed B{best_fixed['batch']} ({which})", splits, best_fixed["batch"],
                                best_fixed["lr"], args, tmp)
                    repeats.append(r)
                    print(_row(r), flush=True)

            repeat("before")
            for kind in step_models:
                model, calibration_s = None, 0.0
                if kind == "costmodel":
                    model, calibration_s = _cost_model(cfg.replace(f"train.global_batch={start_batch}"))
                elif kind != "measured":
                    raise SystemExit(f"--step-models: {kind!r} is not one of measured, costmodel")
                r = run_one(f"online ({kind})", splits, start_batch, start_lr, args, tmp, tuner=True,
                            step_model=model)
                r["step_model"], r["calibration_s"] = kind, calibration_s
                tuned.append(r)
                print(_row(r), flush=True)
                for d in r["decisions"]:
                    bn = "none" if d["b_noise"] is None else f"{d['b_noise']:.1f}"
                    print(f"    decision after step {d['step']}: B {d['from'].split(' B')[-1]} -> "
                          f"{d['to'].split(' B')[-1]}, predicted entropyput {d['gain']:+.0%}, B_noise {bn}, "
                          f"lr x{d['lr_gain']:.3g}; {d['reason']}")
                if not r["decisions"]:
                    bn = "none" if r["b_noise"] is None else f"{r['b_noise']:.1f}"
                    print(f"    no switch (last B_noise estimate {bn})")
                if kind == "costmodel":
                    print(f"    cost model calibration before the run: {calibration_s:.1f} s "
                          f"(not in train_s)")
            repeat("after")
    finally:
        signal.signal(signal.SIGTERM, previous)

    def table(rows, ref: float | None, what: str) -> None:
        print(f"{'run':26s} {'batch':44s} {'lr':>12s} {'steps':>6s} {'time to target':>15s} "
              f"{what:>14s}")
        for r in rows:
            ratio = f"{r['time_to_target'] / ref:.2f}" if ref and r["time_to_target"] is not None else "-"
            batch = _trajectory(r) if r["tuner"] else str(r["batch"])
            gain = r["tuner"] and r["final_gain"] != 1.0
            lr = f"{r['lr']:.0e}" + (f" x{r['final_gain']:.2f}" if gain else "")
            steps = r["steps_to_target"] if r["steps_to_target"] is not None else r["steps"]
            print(f"{r['name']:26s} {batch:44s} {lr:>12s} {steps:6d} {_fmt_time(r):>15s} {ratio:>14s}")

    if best_per_batch:
        print(f"\n### best learning rate per batch (first round; target {target})")
        table([best_per_batch[b] for b in batches],
              best_fixed["time_to_target"] if best_fixed else None, "vs best fixed")
    times = [r["time_to_target"] for r in repeats]
    ref = sum(times) / len(times) if times and None not in times else None
    print(f"\n### head to head (target {target}; ratios vs the mean of the two best-fixed repeats"
          + (f", {ref:.1f} s)" if ref else ")"))
    table(repeats + tuned, ref, "vs best fixed")
    ratios = {}
    for r in tuned:
        if ref and r["time_to_target"] is not None:
            ratios[r["step_model"]] = ratio = r["time_to_target"] / ref
            first = r["time_to_target"] / best_fixed["time_to_target"]
            extra = f"; {(r['time_to_target'] + r['calibration_s']) / ref:.2f} counting its " \
                    f"{r['calibration_s']:.0f} s calibration" if r["calibration_s"] else ""
            print(f"online ({r['step_model']}) / best fixed = {ratio:.2f}   (goal <= 1.0; best fixed: "
                  f"B{best_fixed['batch']} lr {best_fixed['lr']:g}; {first:.2f} vs its first-round "
                  f"time{extra})")
        else:
            print(f"online ({r['step_model']}) / best fixed = n/a (online "
                  f"{'reached' if r['time_to_target'] is not None else 'not reached'}, best fixed "
                  f"{'reached' if ref else 'not reached'})")
    print(f"load average {tuple(round(x, 1) for x in os.getloadavg())}")

    history_out = _opt(args, "history_out")
    if not history_out and getattr(args, "out", None):  # next to the report: NAME-history.json
        history_out = str(Path(args.out).with_name(Path(args.out).stem + "-history.json"))
    if history_out and tuned:
        main_run = tuned[0]
        Path(history_out).write_text(json.dumps(_clean(main_run["history"]), indent=1) + "\n")
        print(f"history of the {main_run['name']} run ({len(main_run['history'])} records: step, "
              f"tuner/batch, lr, tuner/lr_gain, val_loss, train_s, ...) written to {history_out}")
        for other in tuned[1:]:
            path = Path(history_out).with_name(Path(history_out).stem + f"-{other['step_model']}.json")
            path.write_text(json.dumps(_clean(other["history"]), indent=1) + "\n")
            print(f"history of the {other['name']} run written to {path}")
    return dict(fixed=fixed, best_per_batch=best_per_batch, repeats=repeats, tuned=tuned, ratios=ratios)


def main() -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _report import report

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_options(parser)
    parser.add_argument("--out", default=None, help="also write the report to this file")
    args = parser.parse_args()
    with report("EPara online tuning benchmark", args.out):
        run_online_comparison(args)


if __name__ == "__main__":
    main()
