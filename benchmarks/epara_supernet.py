"""EPara for a supernet job: the tuner's pick of (parallel.subnet, parallel.data, K, vmap
width) vs the default layout, in wall time to a target search-validation loss.

Setup, on 8 simulated CPU devices (one process): a tiny SuperGPT (d_model 64, 2 layers,
4 heads, seq 64, byte vocabulary; FFN operator / width, heads and depth searchable) on
the stdlib corpus, SPara ``sync`` semantics with the sandwich sampler, masked execution
(``supernet.ladder_levels=0``: one compiled program; the sliced path compiles one
program per subnet shape, which on this machine would be most of a short run), global
batch 16, AdamW with the default schedule over ``train.steps`` = 600 (the same for
every run, so no run's learning rate depends on when it stops).

1. **Tune**: ``tuner.supernet.tune_supernet`` on that config (K from 2, 4, 8; vmap width
   1, 2; every subnet x data split of 8), ``--measure`` candidates trained for
   ``--trial-steps`` steps each, ranked by search-validation loss drop per second (the
   objective in tuner/supernet.py). Its wall time is printed: the price of the pick.
2. **Compare**: the default layout (parallel.subnet=1, parallel.data=8, the config's K=4
   and vmap width 1) and the pick, ``--repeats`` (5) runs each, interleaved in pairs
   whose order alternates (default, pick, pick, default, ...) so that the shared
   machine's load drifts over both alike.

The search-validation loss is the mean validation loss, with inherited weights, of a
fixed panel of 8 subnets (largest, smallest and 6 drawn with a fixed seed), scored with
the search's ``make_evaluator`` on the same validation rows for every run
(``supernet_trial.Panel``), every ``--eval-every`` steps. Clock: wall seconds from the
start of building the run (mesh, supernet, state, first compile) plus every training
step; the panel evaluations are not counted (they are the benchmark's, alike for both).
A run's time to target is that clock at its first evaluation at or below
``--target-loss`` (2.15, chosen from a pilot run of the default layout, which got
there in ~200 steps), resolution one evaluation interval; a run that reaches
``--max-steps`` first reports "not reached". The headline is the ratio of the medians
of wall time (pick / default); the spreads are min..max over the repeats. Beside it,
the same ratio in this process's CPU seconds (``time.process_time``, all its threads,
evaluations left out), which other jobs on this shared 2-core machine disturb less
than wall time; the tuning time is reported apart, and added to the pick once.

Usage: ``python benchmarks/epara_supernet.py [--repeats 5] [--target-loss 2.15]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

from mindpipe_jax.config import Config  # noqa: E402
from mindpipe_jax.data import load_tokens  # noqa: E402
from mindpipe_jax.tuner.supernet import SupernetCandidate, make_measure, tune_supernet  # noqa: E402
from mindpipe_jax.tuner.supernet_trial import Panel, SparaRun  # noqa: E402

BASE = ("model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.seq_len=64", "train.steps=600",
        "train.global_batch=16", "parallel.subnet=1", "parallel.data=8", "parallel.simulate_cpu_devices=0",
        "supernet.subnets_per_step=4", "supernet.vmap_width=1", "supernet.ladder_levels=0")


def time_to_target(cfg: Config, cand: SupernetCandidate, splits, panel: Panel, args) -> dict:
    """One run of ``cand`` until the panel loss reaches the target (or the step cap)."""
    t0, c0 = time.perf_counter(), time.process_time()
    run = SparaRun(cand.apply(cfg), splits=splits)
    build_s = time.perf_counter() - t0
    cpu_s = time.process_time() - c0  # this process's CPU seconds (all its threads), evaluations left out
    loss, reached, reached_cpu = float("nan"), None, None
    try:
        while run.step < args.max_steps:
            c0 = time.process_time()
            run.run(args.eval_every)
            cpu_s += time.process_time() - c0
            loss = panel(run.params)
            if loss <= args.target_loss:
                reached, reached_cpu = build_s + run.seconds, cpu_s
                break
    finally:
        run.close()
    return {"candidate": cand, "seconds": reached, "cpu_s": reached_cpu, "steps": run.step, "loss": loss,
            "build_s": build_s, "train_s": run.seconds}


def spread(values: list[float]) -> str:
    return f"median {statistics.median(values):6.1f} s  (min {min(values):.1f}, max {max(values):.1f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--target-loss", type=float, default=2.15)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--max-steps", type=int, default=450)
    p.add_argument("--measure", type=int, default=6)
    p.add_argument("--trial-steps", type=int, default=40)
    args = p.parse_args()
    cfg = Config().replace(*BASE)
    print(f"config: {' '.join(BASE)}")
    print(f"devices: {jax.device_count()} x {jax.devices()[0].platform}, cpus {os.cpu_count()}, "
          f"load average {os.getloadavg()[0]:.1f}")
    splits = load_tokens(cfg.data, cfg.model.vocab_size)

    t0 = time.perf_counter()
    result = tune_supernet(cfg, 8, measure=args.measure, log=print,
                           measure_fn=make_measure(cfg, trial_steps=args.trial_steps, splits=splits))
    tune_s = time.perf_counter() - t0
    print(result.table())
    pick, default = result.best.candidate, SupernetCandidate.from_config(cfg, 8)
    print(f"tuning took {tune_s:.1f} s; pick: {pick.label()} -> {' '.join(pick.overrides())}")
    print(f"default: {default.label()}")
    if pick == default:
        print("the pick is the default layout: nothing to compare (ratio 1.00)")
        return

    # The panel's evaluator on the default layout's mesh; every run is scored on it.
    reference = SparaRun(default.apply(cfg), splits=splits)
    panel = Panel(reference)
    print(f"panel of {len(panel.subnets)} subnets, loss at initialization {panel(reference.params):.4f}; "
          f"target {args.target_loss}")
    reference.close()
    runs: dict[str, list[dict]] = {"default": [], "pick": []}
    for i in range(args.repeats):
        pair = (("default", default), ("pick", pick))
        for name, cand in pair if i % 2 == 0 else pair[::-1]:  # who goes first alternates
            r = time_to_target(cfg, cand, splits, panel, args)
            runs[name].append(r)
            got = (f"{r['seconds']:6.1f} s (cpu {r['cpu_s']:5.1f} s)" if r["seconds"] is not None
                   else "not reached")
            print(f"repeat {i + 1} {name:7s} {cand.label():26s} time to target {got} at step {r['steps']:>3} "
                  f"(loss {r['loss']:.4f}; build+compile {r['build_s']:.1f} s, steps {r['train_s']:.1f} s, "
                  f"load {os.getloadavg()[0]:.1f})", flush=True)
    reached = {name: [r["seconds"] for r in rs if r["seconds"] is not None] for name, rs in runs.items()}
    if any(len(v) < args.repeats for v in reached.values()):
        print(f"not every run reached the target: {({k: len(v) for k, v in reached.items()})} of "
              f"{args.repeats}; no ratio")
        return
    cpu = {name: [r["cpu_s"] for r in rs] for name, rs in runs.items()}
    for name in runs:
        steps = [r["steps"] for r in runs[name]]
        print(f"{name:7s} wall {spread(reached[name])}  cpu {spread(cpu[name])}  "
              f"steps {statistics.median(steps):.0f}")
    ratio = statistics.median(reached["pick"]) / statistics.median(reached["default"])
    overlap = "overlap" if max(reached["pick"]) >= min(reached["default"]) else "do not overlap"
    print(f"pick / default time to target: {ratio:.2f}x (spreads {overlap}); "
          f"with the tuning time added to the pick's median: "
          f"{(statistics.median(reached['pick']) + tune_s) / statistics.median(reached['default']):.2f}x")
    print(f"in process CPU seconds (less sensitive to other jobs on the machine): "
          f"{statistics.median(cpu['pick']) / statistics.median(cpu['default']):.2f}x")


if __name__ == "__main__":
    main()
