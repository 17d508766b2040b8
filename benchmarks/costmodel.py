"""Cost-model benchmark: predicted vs measured step time on layouts the model has never run.

Setup: 8 simulated CPU devices, the tuner tests' small GPT (d_model 64, 4 layers,
4 heads, seq 32, byte vocabulary), adamw.

1. **Calibrate** the machine (``Hardware.calibrate``: matmul rate, memory
   bandwidth, kernel cost, per-axis-size collective α–β; read from the cache when
   this machine was calibrated before, ``--refresh`` measures again) and the model
   (``ModelCosts.measure``: FLOPs, bytes and kernels of its compiled pieces).
2. **Fit** the model's five coefficients on ``FIT`` layouts (global batch 16 and
   64), each measured like the held-out ones.
3. **Hold out** ``HELD_OUT`` layouts (global batch 32, never used in 1 or 2),
   mixing data, fsdp, tensor and pipe (schedules 1f1b, zb-h1, interleaved; remat
   none/full), and ``SUPERNET_HELD_OUT``: SPara steps (``sync``, masked) of a SuperGPT
   of the same size split between the ``subnet`` and ``data`` axes with K subnets per
   step and vmap width W, priced from the supernet's own compiled pieces
   (``tuner/supernet_costs.py``) with the coefficients fitted on dense layouts only: the
   model has run no supernet step. Each is timed as the trainer runs it
   (``supernet_trial.SparaRun``: host planning, the batch, the step).

Measurement: every layout is compiled and warmed up (2 steps), then all layouts
are timed in ``--rounds`` interleaved round-robin rounds of ``--steps`` steps each
(each step waited for with ``block_until_ready``); a layout's time is the median
of all its steps, its spread the 10th-90th percentile range relative to that
median. Printed per held-out layout: the prediction from calibration alone (no
trial seen), the prediction after fitting, the measured median and spread, and
both errors; then the median absolute error (goal <= 25%) and Spearman's rank
correlation over the held-out set (one global batch, goal >= 0.8). The machine is
shared: the load average before and after and the spreads decide whether the
output says the numbers are reliable.

Usage: ``python benchmarks/costmodel.py [--rounds 5] [--steps 2] [--out FILE]
[--save-times FILE | --load-times FILE]``; ``--load-times`` scores the model again on a
saved run's steps (a model change judged on the same measurement; it says so).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np  # noqa: E402
from _report import report  # noqa: E402

from mindpipe_jax.config import Config  # noqa: E402
from mindpipe_jax.data import load_tokens  # noqa: E402
from mindpipe_jax.tuner import calibrate  # noqa: E402
from mindpipe_jax.tuner import costmodel as costmodel_module  # noqa: E402
from mindpipe_jax.tuner.costmodel import CostModel, Hardware, ModelCosts, spearman  # noqa: E402
from mindpipe_jax.tuner.space import Candidate, check_candidate  # noqa: E402
from mindpipe_jax.tuner.supernet import SupernetCandidate  # noqa: E402
from mindpipe_jax.tuner.supernet_costs import SupernetCosts  # noqa: E402
from mindpipe_jax.tuner.supernet_trial import SparaRun  # noqa: E402
from mindpipe_jax.tuner.trial import Trial  # noqa: E402

SMALL = ("model.d_model=64", "model.n_layers=4", "model.n_heads=4", "model.seq_len=32",
         "train.progress=false", "train.tensorboard=false")
C = Candidate
FIT = [C(data=8, global_batch=16), C(data=8, microbatches=4, global_batch=64),
       C(data=4, tensor=2, global_batch=16), C(fsdp=8, global_batch=64),
       C(data=2, pipe=4, microbatches=4, global_batch=16), C(data=4, pipe=2, microbatches=2, global_batch=64),
       C(tensor=2, pipe=4, microbatches=4, global_batch=16)]
HELD = dict(global_batch=32)
HELD_OUT = [C(data=8, **HELD), C(data=8, microbatches=2, **HELD), C(data=8, remat="full", **HELD),
            C(fsdp=8, **HELD), C(data=4, tensor=2, **HELD), C(data=2, tensor=4, **HELD),
            C(data=2, fsdp=2, tensor=2, **HELD), C(fsdp=4, tensor=2, microbatches=2, **HELD),
            C(data=4, pipe=2, microbatches=2, **HELD), C(data=2, pipe=4, microbatches=4, **HELD),
            C(tensor=2, pipe=4, microbatches=4, **HELD), C(data=2, tensor=2, pipe=2, microbatches=4, **HELD),
            C(data=2, pipe=4, microbatches=8, schedule="zb-h1", **HELD),
            C(data=4, pipe=2, microbatches=4, schedule="interleaved", virtual_stages=2, **HELD),
            C(fsdp=2, pipe=4, microbatches=4, remat="full", **HELD),
            # added 2026-12-04 with the lockstep term (tensor inside a pipeline), unseen before it
            C(tensor=4, pipe=2, microbatches=4, **HELD), C(data=2, tensor=2, pipe=2, microbatches=2, **HELD),
            C(tensor=2, pipe=4, microbatches=8, schedule="zb-h1", **HELD)]
# SPara (sync, masked: supernet.ladder_levels=0) on the same model size, B32: (S, D, K, W, B)
SUPERNET = ("supernet.ladder_levels=0", "supernet.semantics=sync")
S = SupernetCandidate
SUPERNET_HELD_OUT = [S(1, 8, 4, 1, 32), S(2, 4, 4, 1, 32), S(4, 2, 4, 1, 32), S(2, 4, 8, 2, 32),
                     S(1, 8, 2, 1, 32)]
RELIABLE_SPREAD = 0.25  # a layout whose 10-90% range exceeds this fraction of its median is noisy


def spread(times) -> float:
    lo, hi = np.percentile(times, [10, 90])
    return float((hi - lo) / statistics.median(times))


class SparaTrial:
    """A SPara run kept ready to time, like ``Trial``: ``run(steps)`` records each step."""

    def __init__(self, cfg: Config, cand: SupernetCandidate, splits, warmup: int = 2):
        self.spara = SparaRun(cand.apply(cfg), splits=splits)
        self.spara.run(warmup)  # compiles
        self.times: list[float] = []

    def run(self, steps: int) -> None:
        self.times += self.spara.run(steps)

    @property
    def median(self) -> float:
        return statistics.median(self.times)


def time_layouts(args, cfg, scfg, devices, held_out) -> tuple[dict, tuple]:
    """Compile, warm up and time every layout round-robin: (trials, load averages before, after)."""
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    trials = {}
    for i, cand in enumerate(FIT + HELD_OUT, 1):
        trials[cand] = Trial(cfg, cand, devices=devices)
        print(f"  [{i:2d}/{len(FIT) + len(held_out)}] compiled {cand.label()}", flush=True)
    splits = load_tokens(scfg.data, scfg.model.vocab_size)
    for i, cand in enumerate(SUPERNET_HELD_OUT, len(trials) + 1):
        trials[cand] = SparaTrial(scfg, cand, splits)
        print(f"  [{i:2d}/{len(FIT) + len(held_out)}] compiled SPara {cand.label()}", flush=True)
    print(f"compiled and warmed up {len(trials)} layouts in {time.perf_counter() - t0:.0f} s")
    for _ in range(args.rounds):  # round-robin: the machine's drift hits every layout alike
        for trial in trials.values():
            trial.run(args.steps)
    return trials, (load_before, os.getloadavg())


class SavedTimes:
    """A layout's timed steps as ``--save-times`` wrote them."""

    def __init__(self, times):
        self.times = list(times)

    @property
    def median(self) -> float:
        return statistics.median(self.times)


def load_times(path: str, layouts) -> tuple[dict, tuple]:
    """The timings ``--save-times`` wrote, for exactly ``layouts`` (else exit saying why)."""
    with open(path) as f:
        saved = json.load(f)
    found = {}
    for row in saved["layouts"]:
        d = row["candidate"]
        cand = SupernetCandidate(**d) if "subnets_per_step" in d else Candidate(**d)
        found[cand] = SavedTimes(row["times"])
    if set(found) != set(layouts):
        raise SystemExit(f"{path}: its layouts are not this benchmark's ({len(set(found) ^ set(layouts))} "
                         f"differ): time them again without --load-times")
    print(f"timings read from {path} (measured earlier; the model is scored again on them)")
    return {c: found[c] for c in layouts}, tuple(tuple(x) for x in saved["load"])


def main(args) -> None:
    cfg = Config().replace(*SMALL)
    for cand in FIT + HELD_OUT:
        why = check_candidate(cfg, cand, 8)
        if why:
            raise SystemExit(f"{cand.label()}: {why}")
    assert not set(FIT) & set(HELD_OUT)
    devices = jax.devices()
    key = calibrate.machine_key(devices)
    cached = not args.refresh and calibrate.load(key, args.cache_dir) is not None
    t0 = time.perf_counter()
    hw = Hardware.calibrate(devices, cache_dir=args.cache_dir, refresh=args.refresh)
    how = "read from the cache" if cached else "measured"
    print(f"pipeline ticks priced at {costmodel_module.SLOT_MOVES} residual slot moves per buffer "
          f"({costmodel_module.SLOT_MOVES_TWO_READS} in lockstep)")
    print(f"calibration ({how} in {time.perf_counter() - t0:.1f} s, "
          f"{calibrate.cache_file(key, args.cache_dir)}):\n  {hw.note}")
    t0 = time.perf_counter()
    costs = ModelCosts.measure(cfg)
    update = costs.pieces["update"]
    print(f"model pieces (compiled on one device in {time.perf_counter() - t0:.1f} s):\n  " + "\n  ".join(
        f"{k:14s} {p.flops / 1e6:5.1f} MFLOP + {p.bytes / 1e6:5.2f} MB per row, {p.kernels:3.0f} kernels"
        for k, p in costs.pieces.items() if k != "update") +
        f"\n  {'update':14s} {update.fixed_bytes / 1e6:.1f} MB, {update.kernels:.0f} kernels")

    t0 = time.perf_counter()
    scfg = cfg.replace(*SUPERNET)
    scosts = SupernetCosts.measure(scfg)
    print(f"supernet pieces (SuperGPT of the same size, compiled on one device in "
          f"{time.perf_counter() - t0:.1f} s):\n  subnet {scosts.subnet.flops / 1e6:5.1f} MFLOP + "
          f"{scosts.subnet.bytes / 1e6:5.2f} MB per row, {scosts.subnet.kernels:.0f} kernels; raveled "
          f"parameters {scosts.param_bytes / 1e6:.1f} MB; AdamW {scosts.update.fixed_bytes / 1e6:.1f} MB")
    held_out = HELD_OUT + SUPERNET_HELD_OUT

    prior = CostModel(costs, hw, cfg.model.seq_len, supernet=scosts)
    if args.load_times:  # a saved measurement scored again (the model changed, not the timings)
        trials, (load_before, load_after) = load_times(args.load_times, FIT + held_out)
    else:
        trials, (load_before, load_after) = time_layouts(args, cfg, scfg, devices, held_out)
    measured = {c: t.median for c, t in trials.items()}
    if args.save_times:
        with open(args.save_times, "w") as f:
            json.dump({"load": [load_before, load_after], "layouts": [
                {"candidate": c.to_dict() if isinstance(c, Candidate) else dataclasses.asdict(c),
                 "times": t.times} for c, t in trials.items()]}, f)

    fitted = CostModel(costs, hw, cfg.model.seq_len, supernet=scosts)
    for cand in FIT:
        fitted.observe(cand, measured[cand])
    names = ("compute", "comm", "update", "launch s", "pipeline tick s")
    print("fitted coefficients (prior -> fit on the FIT layouts): " + ", ".join(
        f"{n} {p:.3g} -> {f:.3g}" for n, p, f in zip(names, prior.coef, fitted.coef, strict=True))
        + f"; ridge {fitted.ridge_used:g}, chosen by leave-one-out over the FIT layouts "
          f"(inf: the priors kept)")

    print("\nFIT layouts (B16/B64; used for the fit, not scored)")
    for cand in FIT:
        print(f"  {cand.label():44s} measured {measured[cand] * 1e3:7.1f} ms  prior "
              f"{prior.step_time(cand) * 1e3:7.1f}  fitted {fitted.step_time(cand) * 1e3:7.1f}")
    print("\nHELD-OUT layouts (B32; never run before this table's measurement, never fitted; the SPara "
          "rows: the model has run no supernet step)")
    # The same measurements through earlier forms of the model, fitted alike: before the
    # lockstep term (tensor inside a pipeline counted as unsplit stage work in per-device
    # branches), before the shared-cores tick replay (a pipeline's compute the larger of
    # its critical path at one device's solo rates and its devices' mean work all busy),
    # and before the residual slots' traffic per tick.
    earlier = {"without the lockstep term (pipeline_tensor_split=False)": dict(pipeline_tensor_split=False),
               "without the shared-cores tick replay (shared_cores=False)": dict(shared_cores=False),
               "without the residual slots' traffic (slot_traffic=False)": dict(slot_traffic=False)}
    earlier = {name: CostModel(costs, hw, cfg.model.seq_len, supernet=scosts, **kw)
               for name, kw in earlier.items()}
    for model in earlier.values():
        for cand in FIT:
            model.observe(cand, measured[cand])
    older = earlier["without the residual slots' traffic (slot_traffic=False)"]
    head = (f"  {'layout':44s} {'calib-only':>10} {'err':>6} {'fitted':>8} {'err':>6} {'measured':>9} "
            f"{'spread':>7} {'pipe ticks':>10} {'before slot traffic':>19}")
    print(head + "\n  " + "-" * (len(head) - 2))
    for cand in held_out:
        p0, p1, m = prior.step_time(cand), fitted.step_time(cand), measured[cand]
        e0, e1, s = p0 / m - 1, p1 / m - 1, spread(trials[cand].times)
        ticks = fitted.breakdown(cand).iterations if getattr(cand, "pipe", 1) > 1 else ""
        label = cand.label() if isinstance(cand, Candidate) else f"SPara sync {cand.label()}"
        print(f"  {label:44s} {p0 * 1e3:8.1f}ms {e0:+6.0%} {p1 * 1e3:6.1f}ms {e1:+6.0%} "
              f"{m * 1e3:7.1f}ms {s:7.0%} {ticks:>10} {older.step_time(cand) / m - 1:+19.0%}")

    def scores(model, cands):
        """(median |error|, Spearman) of ``model`` over ``cands``."""
        return (statistics.median(abs(model.step_time(c) / measured[c] - 1) for c in cands),
                spearman([model.step_time(c) for c in cands], [measured[c] for c in cands]))

    (mae0, rho0), (mae1, rho1) = scores(prior, held_out), scores(fitted, held_out)
    print(f"\n{len(held_out)} held-out layouts ({len(HELD_OUT)} dense, {len(SUPERNET_HELD_OUT)} SPara), "
          f"global batch 32, median of {args.rounds} x {args.steps} steps each, timed round-robin")
    print(f"median |error|   calibration only {mae0:5.0%}   fitted on {len(FIT)} dense layouts {mae1:5.0%}"
          f"   (goal <= 25%: {'met' if mae1 <= 0.25 else 'NOT met'})")
    print(f"Spearman rho     calibration only {rho0:5.2f}   fitted {rho1:5.2f}"
          f"   (goal >= 0.8: {'met' if rho1 >= 0.8 else 'NOT met'})")
    for name, cands in (("dense only", HELD_OUT), ("SPara only", SUPERNET_HELD_OUT)):
        (e0, r0), (e1, r1) = scores(prior, cands), scores(fitted, cands)
        print(f"  {name:11s} median |error| {e0:4.0%} calibration only, {e1:4.0%} fitted; Spearman "
              f"{r0:5.2f} / {r1:5.2f}")
    for name, model in earlier.items():
        mae_old, rho_old = scores(model, held_out)
        print(f"{name}, fitted alike: median |error| {mae_old:.0%}, Spearman {rho_old:.2f}")
    spreads = [spread(trials[c].times) for c in held_out]
    noisy = [c for c, s in zip(held_out, spreads, strict=True) if s > RELIABLE_SPREAD]
    cores = os.cpu_count() or 1
    load = max(load_before[0], load_after[0])
    print(f"spread (10-90% range / median) over the held-out layouts: median "
          f"{statistics.median(spreads):.0%}, max {max(spreads):.0%}; load average {load_before[0]:.1f} "
          f"before, {load_after[0]:.1f} after the timing, on {cores} cores")
    if noisy or load > 2 * cores:
        print(f"RELIABILITY: the machine was loaded (load average up to {load:.1f} on {cores} cores) and "
              f"{len(noisy)} of {len(held_out)} layouts spread by more than {RELIABLE_SPREAD:.0%}: "
              f"differences under that spread are noise, and the errors above carry it.")
    else:
        print("RELIABILITY: load and spreads were low enough for the errors to be read as the model's.")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="steps per layout per round")
    parser.add_argument("--cache-dir", default=None, help="calibration cache (default ~/.cache/mindpipe_jax)")
    parser.add_argument("--refresh", action="store_true", help="measure the calibration again")
    parser.add_argument("--out", default=None)
    parser.add_argument("--save-times", default=None, metavar="FILE", help="every timed step, as JSON")
    parser.add_argument("--load-times", default=None, metavar="FILE",
                        help="score the model on the steps a --save-times run wrote instead of timing "
                             "(calibration and pieces are read or measured as usual)")
    parser.add_argument("--slot-moves", type=int, default=None, metavar="N",
                        help="residual slots a pipeline tick moves per buffer, lockstep or not "
                             "(default: the runtime's now, costmodel.SLOT_MOVES and, in lockstep, "
                             "SLOT_MOVES_TWO_READS; 5 for timings of the runtime before 2026-12-05, "
                             "whose F part also read its slot, 7 before 2026-12-04 evening, whose W "
                             "part read them too)")
    args = parser.parse_args()
    if args.slot_moves is not None:
        if args.slot_moves < 0:
            raise SystemExit(f"--slot-moves {args.slot_moves} must be >= 0")
        costmodel_module.SLOT_MOVES = costmodel_module.SLOT_MOVES_TWO_READS = args.slot_moves
    if args.rounds * args.steps < 5:
        raise SystemExit(f"--rounds x --steps = {args.rounds * args.steps}: at least 5 timed steps per "
                         f"layout are needed")
    with report("Cost model on held-out layouts", args.out):
        main(args)
