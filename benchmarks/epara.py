"""EPara benchmark: the two validation figures of the tuner, on 8 simulated CPU devices.

1. **space** — the offline tuner's choice vs the best configuration found by
   measuring the whole valid space. Small GPT (d_model 64, 4 layers, 4 heads,
   seq 32, byte vocabulary); the space is every valid mesh over data x tensor x
   pipe, microbatches {1, 4}, 1F1B, no remat, global batch {16, 64}. Every
   valid candidate is compiled and run for real (random init, synthetic tokens,
   2 warm-up steps), then timed in ``--rounds`` interleaved rounds of
   ``--trial-steps`` steps (median of all); entropyput = samples/s x
   efficiency(B) with B_noise from a noise probe on the stdlib corpus (or
   ``--b-noise``). Then ``tuner.tune`` runs as a user would (cost model, AOT
   memory check of the most promising, three trials) and its choice is scored by
   its *exhaustive* measurement, so both sides are measured the same way.
   Printed: the ratio chosen / best (goal >= 0.90), the tuner's wall time vs
   the exhaustive search's, and the cost model's rank correlation over the whole
   space (before any trial of the space was seen).
2. **memory** — the same comparison on a space where memory binds: a GPT whose
   optimizer state is large next to its activations (d_model 256, 4 layers, 8
   heads, seq 16), every mesh over data x fsdp x tensor x pipe, microbatches 4,
   global batch {16, 64}. Every candidate is first compiled on abstract shapes
   (``tuner.aot``: compiled bytes per device); the per-device budget is then set
   from those numbers, before any timing: halfway between the smallest pipeline
   layout and the smallest plain data-parallel layout at the largest batch
   (floored to a MiB), so plain data parallel does not fit and a pipeline does.
   The table prints every candidate's bytes vs the budget. Exhaustive = that
   memory check of every candidate plus a trial of every feasible one; then
   ``tuner.tune(budget_bytes=...)`` runs as a user would (``--budget-mb`` of
   ``mindpipe tune``) and is scored as in part 1. ``--memory-axes data,fsdp,pipe``
   leaves tensor out: tensor-only layouts are the smallest of this model, so with
   them memory binds only weakly; without them only pipeline and fsdp layouts fit
   at the largest batch. ``--memory-schedules 1f1b,zb-h1 --memory-remats none,full``
   widens the space over the pipeline schedule and remat policy (the other
   dimensions of the issue's space): 48 candidates instead of 14 on those axes.
3. **online** — time to reach a target validation loss with the online tuner vs
   the best of three fixed batch sizes with their best learning rates (see
   ``online_part``).

This machine is a shared 2-core container and 8 simulated devices share its
cores: single timings move by ±20% with the load, so read the ratios, and the
load average printed with them.

Usage: ``python benchmarks/epara.py [--part space|memory|online|all] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import report  # noqa: E402

from mindpipe_jax.config import Config  # noqa: E402
from mindpipe_jax.errors import ConfigError  # noqa: E402
from mindpipe_jax.tuner.aot import compile_candidate  # noqa: E402
from mindpipe_jax.tuner.costmodel import CostModel, Hardware, ModelCosts, spearman  # noqa: E402
from mindpipe_jax.tuner.noise import efficiency  # noqa: E402
from mindpipe_jax.tuner.probe import estimate_b_noise  # noqa: E402
from mindpipe_jax.tuner.space import enumerate_space  # noqa: E402
from mindpipe_jax.tuner.trial import Trial  # noqa: E402
from mindpipe_jax.tuner.tune import tune  # noqa: E402

SMALL = ("model.d_model=64", "model.n_layers=4", "model.n_heads=4", "model.seq_len=32",
         "train.progress=false", "train.tensorboard=false")
SPACE = dict(axes=("data", "tensor", "pipe"), global_batches=(16, 64), microbatches=(1, 4),
             schedules=("1f1b",), virtual_stages=(1,), remats=("none",))


MEMORY_MODEL = ("model.d_model=256", "model.n_layers=4", "model.n_heads=8", "model.seq_len=16",
                "train.progress=false", "train.tensorboard=false")
MEMORY_SPACE = dict(axes=("data", "fsdp", "tensor", "pipe"), global_batches=(16, 64), microbatches=(4,),
                    schedules=("1f1b",), virtual_stages=(1,), remats=("none",))
MiB = 2**20


def measure_b_noise(cfg: Config, args) -> float:
    """B_noise given on the command line, or from a noise probe at the space's smallest batch."""
    if args.b_noise:
        print(f"B_noise = {args.b_noise} (given)")
        return args.b_noise
    probe = estimate_b_noise(cfg, steps=args.probe_steps)
    print(f"B_noise = {probe.b_noise:.1f} (noise probe: {args.probe_steps} steps at batch "
          f"{cfg.train.global_batch} on the stdlib corpus, loss {probe.losses[0]:.2f} -> "
          f"{probe.losses[-1]:.2f})")
    return probe.b_noise


def time_all(cfg: Config, candidates, args) -> tuple[dict, float]:
    """Compile and time every candidate (one trial each: what an exhaustive search costs,
    returned as its wall time), then ``rounds - 1`` more interleaved rounds, so the shared
    machine's drift hits every candidate alike. Returns the median of all steps of each."""
    t0 = time.perf_counter()
    trials = {}
    for i, cand in enumerate(candidates, 1):
        trials[cand] = Trial(cfg, cand)
        trials[cand].run(args.trial_steps)
        print(f"  [{i:2d}/{len(candidates)}] compiled and timed {cand.label()}", flush=True)
    exhaustive_s = time.perf_counter() - t0
    for _ in range(args.rounds - 1):
        for trial in trials.values():
            trial.run(args.trial_steps)
    return {c: t.median for c, t in trials.items()}, exhaustive_s


def compare_with_tuner(cfg: Config, candidates, measured: dict, exhaustive_s: float, *, b_noise: float,
                       b0: int, space: dict, hardware: Hardware, costs: ModelCosts, args,
                       budget_bytes: float = math.inf) -> None:
    """Run ``tune`` as a user would and score its choice by the exhaustive measurement."""
    def entropyput(c):
        return c.global_batch / measured[c] * efficiency(c.global_batch, b_noise, b0)

    best = max(candidates, key=entropyput)
    t0 = time.perf_counter()
    result = tune(cfg, b_noise=b_noise, b0=b0, measure=3, max_compile=6, trial_steps=args.trial_steps,
                  rounds=args.rounds, budget_bytes=budget_bytes, hardware=hardware, costs=costs,
                  log=lambda line: print("  tune: " + line, flush=True), **space)
    tune_s = time.perf_counter() - t0
    chosen = result.best.candidate
    print()
    print(result.table(limit=12))
    print()
    if chosen not in measured:  # outside what the exhaustive search found feasible: say so, score 0
        print(f"tuner's choice {chosen.label()} is not among the exhaustive search's feasible candidates")
        ratio = 0.0
    else:
        ratio = entropyput(chosen) / entropyput(best)
    print(f"exhaustive best : {best.label():40s} entropyput {entropyput(best):8.1f}")
    if chosen in measured:
        print(f"tuner's choice  : {chosen.label():40s} entropyput {entropyput(chosen):8.1f} "
              f"(its exhaustive measurement)")
    print(f"choice / best   : {ratio:.3f}   (goal >= 0.90: {'met' if ratio >= 0.90 else 'NOT met'})")
    time_ratio = tune_s / exhaustive_s
    print(f"search time     : tuner {tune_s:.0f} s vs exhaustive {exhaustive_s:.0f} s "
          f"({exhaustive_s / tune_s:.1f}x less; ratio {time_ratio:.2f}, goal <= 0.20: "
          f"{'met' if time_ratio <= 0.20 else 'NOT met'})")


def space_part(args) -> None:
    cfg = Config().replace(*SMALL)
    b0 = min(SPACE["global_batches"])
    b_noise = measure_b_noise(cfg.replace(f"train.global_batch={b0}"), args)
    space = enumerate_space(cfg, 8, **SPACE)
    print(f"space: {len(space.valid)} valid, {len(space.rejected)} rejected "
          f"({'; '.join(f'{n} x {why}' for why, n in list(space.reasons().items())[:3])})")

    hardware = Hardware.calibrate()
    costs = ModelCosts.measure(cfg)
    print(f"hardware: {hardware.note}")
    model = CostModel(costs, hardware, cfg.model.seq_len)
    predicted = {c: model.step_time(c) for c in space.valid}

    measured, exhaustive_s = time_all(cfg, space.valid, args)
    for c in space.valid:
        print(f"  {c.label():40s} predicted {predicted[c] * 1e3:7.1f} ms  "
              f"measured {measured[c] * 1e3:7.1f} ms (median of {args.rounds * args.trial_steps})")

    def entropyput(c, seconds):
        return c.global_batch / seconds * efficiency(c.global_batch, b_noise, b0)

    rho_time = spearman([predicted[c] for c in space.valid], [measured[c] for c in space.valid])
    rho_ent = spearman([entropyput(c, predicted[c]) for c in space.valid],
                       [entropyput(c, measured[c]) for c in space.valid])
    compare_with_tuner(cfg, space.valid, measured, exhaustive_s, b_noise=b_noise, b0=b0, space=SPACE,
                       hardware=hardware, costs=costs, args=args)
    print(f"cost model over all {len(space.valid)} candidates, before any trial: Spearman rho "
          f"{rho_time:.2f} (step time), {rho_ent:.2f} (entropyput)")


def _is_plain(c, axis: str) -> bool:
    """Every device on ``axis`` alone (e.g. plain data parallel: d8)."""
    return getattr(c, axis) == c.devices


def memory_part(args) -> None:
    """Part 2 (module docstring): the tuner vs exhaustive search where memory binds."""
    cfg = Config().replace(*MEMORY_MODEL)
    axes = tuple(args.memory_axes.split(","))
    unknown = set(axes) - set(MEMORY_SPACE["axes"])
    if unknown or "pipe" not in axes:
        valid = ", ".join(MEMORY_SPACE["axes"])
        raise SystemExit(f"--memory-axes={args.memory_axes!r}: choose from {valid}, pipe included")
    space_kw = {**MEMORY_SPACE, "axes": axes, "schedules": tuple(args.memory_schedules.split(",")),
                "remats": tuple(args.memory_remats.split(","))}
    b0, top = min(MEMORY_SPACE["global_batches"]), max(MEMORY_SPACE["global_batches"])
    b_noise = measure_b_noise(cfg.replace(f"train.global_batch={b0}"), args)
    try:
        space = enumerate_space(cfg, 8, **space_kw)
    except ConfigError as err:
        raise SystemExit(f"--memory-schedules / --memory-remats: {err}") from None
    print(f"model: {' '.join(MEMORY_MODEL[:4])}; axes {', '.join(axes)}; schedules "
          f"{', '.join(space_kw['schedules'])}; remat {', '.join(space_kw['remats'])}; "
          f"space: {len(space.valid)} valid, {len(space.rejected)} rejected "
          f"({'; '.join(f'{n} x {why}' for why, n in list(space.reasons().items())[:3])})")
    hardware = Hardware.calibrate()
    costs = ModelCosts.measure(cfg)
    print(f"hardware: {hardware.note}")

    # Exhaustive search, step 1: the AOT memory check of every candidate (budget applied below).
    t0 = time.perf_counter()
    compiled = {}
    for i, cand in enumerate(space.valid, 1):
        compiled[cand] = compile_candidate(cfg, cand, math.inf)
        print(f"  [{i:2d}/{len(space.valid)}] compiled {cand.label():40s} "
              f"{compiled[cand].peak_bytes / MiB:7.1f} MiB/dev {compiled[cand].reason}", flush=True)
    check_s = time.perf_counter() - t0
    refused = [c for c, f in compiled.items() if not f.peak_bytes]
    if refused:
        print(f"  compiler refused {len(refused)}: " + "; ".join(compiled[c].reason[:80] for c in refused))
    peak = {c: f.peak_bytes for c, f in compiled.items() if f.peak_bytes}

    # The budget, fixed here from the compiled numbers and never changed after: halfway
    # between the smallest pipeline layout and the smallest plain data-parallel one at the
    # largest batch, floored to a MiB.
    at_top = [c for c in peak if c.global_batch == top]
    pipe_min = min(peak[c] for c in at_top if c.pipe > 1)
    data_min = min(peak[c] for c in at_top if _is_plain(c, "data"))
    budget = math.floor((pipe_min + data_min) / 2 / MiB) * MiB
    print(f"\nbudget: {budget / MiB:.0f} MiB per device = floor((smallest pipeline {pipe_min / MiB:.1f} + "
          f"smallest plain data parallel {data_min / MiB:.1f}) / 2) at B{top}, set before any timing")
    feasible = [c for c in space.valid if c in peak and peak[c] <= budget]
    print(f"\n{'configuration':40s} {'MiB/dev':>8} {'budget':>7}  feasible")
    for c in sorted(space.valid, key=lambda c: (-c.global_batch, peak.get(c, math.inf))):
        mem = f"{peak[c] / MiB:8.1f}" if c in peak else f"{'-':>8}"
        print(f"{c.label():40s} {mem} {budget / MiB:7.0f}  {'yes' if c in feasible else 'NO'}")
    for b in sorted(MEMORY_SPACE["global_batches"], reverse=True):
        fits = [c for c in feasible if c.global_batch == b]
        kinds = {name: [c.label().split(" | ")[0] for c in fits if test(c)] for name, test in (
            ("pipeline", lambda c: c.pipe > 1), ("fsdp", lambda c: c.fsdp > 1),
            ("plain data", lambda c: _is_plain(c, "data")),
            ("plain tensor", lambda c: _is_plain(c, "tensor")))}
        print(f"B{b}: {len(fits)} of {sum(c.global_batch == b for c in space.valid)} feasible; "
              + "; ".join(f"{k}: {', '.join(v) or 'none'}" for k, v in kinds.items()))
    print(f"feasible in all: {len(feasible)} of {len(space.valid)}\n")

    # Exhaustive search, step 2: time every feasible candidate.
    measured, trial_s = time_all(cfg, feasible, args)
    model = CostModel(costs, hardware, cfg.model.seq_len)
    for c in feasible:
        print(f"  {c.label():40s} predicted {model.step_time(c) * 1e3:7.1f} ms  "
              f"measured {measured[c] * 1e3:7.1f} ms (median of {args.rounds * args.trial_steps})")
    print(f"exhaustive search: memory check {check_s:.0f} s + first trial of each feasible {trial_s:.0f} s")
    compare_with_tuner(cfg, feasible, measured, check_s + trial_s, b_noise=b_noise, b0=b0,
                       space=space_kw, hardware=dataclasses.replace(hardware, memory_bytes=budget),
                       costs=costs, args=args, budget_bytes=budget)


def online_part(args) -> None:
    from online_tuning import run_online_comparison  # noqa: E402  (benchmarks/online_tuning.py)

    run_online_comparison(args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("space", "memory", "online", "all"), default="all")
    parser.add_argument("--trial-steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds over the space")
    parser.add_argument("--probe-steps", type=int, default=40)
    parser.add_argument("--b-noise", type=float, default=0.0, help="skip the probe and use this B_noise")
    parser.add_argument("--memory-axes", default="data,fsdp,tensor,pipe",
                        help="mesh axes of part 2's space; 'data,fsdp,pipe' leaves out tensor-only "
                             "layouts, the smallest here, so that at the largest batch only pipeline "
                             "and fsdp layouts fit (issue 18's memory-bound space)")
    parser.add_argument("--memory-schedules", default="1f1b",
                        help="pipeline schedules of part 2's space (comma-separated, e.g. 1f1b,zb-h1)")
    parser.add_argument("--memory-remats", default="none",
                        help="remat policies of part 2's space (comma-separated, e.g. none,full)")
    parser.add_argument("--out", default=None, help="also write the report to this file")
    args = parser.parse_args()
    with report("EPara benchmark", args.out):
        if args.part in ("space", "all"):
            print("\n## 1. tuner's choice vs exhaustive measurement of the space")
            space_part(args)
        if args.part in ("memory", "all"):
            print("\n## 2. tuner's choice vs exhaustive measurement where memory binds")
            memory_part(args)
        if args.part in ("online", "all"):
            print("\n## 3. time to target validation loss: online tuner vs fixed batch sizes")
            online_part(args)

if __name__ == "__main__":
    main()
