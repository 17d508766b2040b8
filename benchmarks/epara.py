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
2. **online** — time to reach a target validation loss with the online tuner vs
   the best of three fixed batch sizes with their best learning rates (see
   ``online_part``).

This machine is a shared 2-core container and 8 simulated devices share its
cores: single timings move by ±20% with the load, so read the ratios, and the
load average printed with them.

Usage: ``python benchmarks/epara.py [--part space|online|all] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import report  # noqa: E402

from mindpipe_jax.config import Config  # noqa: E402
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


def space_part(args) -> None:
    cfg = Config().replace(*SMALL)
    if args.b_noise:
        b_noise = args.b_noise
        print(f"B_noise = {b_noise} (given)")
    else:
        probe = estimate_b_noise(cfg.replace("train.global_batch=16"), steps=args.probe_steps)
        b_noise = probe.b_noise
        print(f"B_noise = {b_noise:.1f} (noise probe: {args.probe_steps} steps at batch 16 on the stdlib "
              f"corpus, loss {probe.losses[0]:.2f} -> {probe.losses[-1]:.2f})")
    b0 = min(SPACE["global_batches"])
    space = enumerate_space(cfg, 8, **SPACE)
    print(f"space: {len(space.valid)} valid, {len(space.rejected)} rejected "
          f"({'; '.join(f'{n} x {why}' for why, n in list(space.reasons().items())[:3])})")

    hardware = Hardware.calibrate()
    costs = ModelCosts.measure(cfg)
    print(f"hardware: {hardware.note}")
    model = CostModel(costs, hardware, cfg.model.seq_len)
    predicted = {c: model.step_time(c) for c in space.valid}

    t0 = time.perf_counter()
    trials = {}
    for i, cand in enumerate(space.valid, 1):
        trials[cand] = Trial(cfg, cand)
        trials[cand].run(args.trial_steps)
        print(f"  [{i:2d}/{len(space.valid)}] compiled and timed {cand.label()}", flush=True)
    exhaustive_s = time.perf_counter() - t0  # what an exhaustive search costs: one trial each
    # More rounds, interleaved over all candidates, so the shared machine's drift
    # hits every candidate alike; the median over all rounds counts.
    for _ in range(args.rounds - 1):
        for trial in trials.values():
            trial.run(args.trial_steps)
    measured = {c: t.median for c, t in trials.items()}
    for c in space.valid:
        print(f"  {c.label():40s} predicted {predicted[c] * 1e3:7.1f} ms  "
              f"measured {measured[c] * 1e3:7.1f} ms (median of {len(trials[c].times)})")

    def entropyput(c, seconds):
        return c.global_batch / seconds * efficiency(c.global_batch, b_noise, b0)

    best = max(space.valid, key=lambda c: entropyput(c, measured[c]))
    rho_time = spearman([predicted[c] for c in space.valid], [measured[c] for c in space.valid])
    rho_ent = spearman([entropyput(c, predicted[c]) for c in space.valid],
                       [entropyput(c, measured[c]) for c in space.valid])

    t0 = time.perf_counter()
    result = tune(cfg, b_noise=b_noise, b0=b0, measure=3, max_compile=6, trial_steps=args.trial_steps,
                  rounds=args.rounds,
                  hardware=hardware, costs=costs, log=lambda line: print("  tune: " + line), **SPACE)
    tune_s = time.perf_counter() - t0
    chosen = result.best.candidate
    ratio = entropyput(chosen, measured[chosen]) / entropyput(best, measured[best])

    print()
    print(result.table(limit=10))
    print()
    print(f"exhaustive best : {best.label():40s} entropyput {entropyput(best, measured[best]):8.1f}")
    print(f"tuner's choice  : {chosen.label():40s} entropyput {entropyput(chosen, measured[chosen]):8.1f} "
          f"(its exhaustive measurement)")
    print(f"choice / best   : {ratio:.3f}   (goal >= 0.90)")
    print(f"search time     : tuner {tune_s:.0f} s vs exhaustive {exhaustive_s:.0f} s "
          f"({exhaustive_s / tune_s:.1f}x less)")
    print(f"cost model over all {len(space.valid)} candidates, before any trial: Spearman rho "
          f"{rho_time:.2f} (step time), {rho_ent:.2f} (entropyput)")


def online_part(args) -> None:
    from online_tuning import run_online_comparison  # noqa: E402  (benchmarks/online_tuning.py)

    run_online_comparison(args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("space", "online", "all"), default="all")
    parser.add_argument("--trial-steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds over the space")
    parser.add_argument("--probe-steps", type=int, default=40)
    parser.add_argument("--b-noise", type=float, default=0.0, help="skip the probe and use this B_noise")
    parser.add_argument("--out", default=None, help="also write the report to this file")
    args = parser.parse_args()
    with report("EPara benchmark", args.out):
        if args.part in ("space", "all"):
            print("\n## 1. tuner's choice vs exhaustive measurement of the space")
            space_part(args)
        if args.part in ("online", "all"):
            print("\n## 2. time to target validation loss: online tuner vs fixed batch sizes")
            online_part(args)

if __name__ == "__main__":
    main()
