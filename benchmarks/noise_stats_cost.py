"""What the online tuner's noise statistics cost a train step, per layout.

With ``tuner.enabled`` the step also returns the statistics the gradient noise scale is
estimated from (``train/step.py``): a step without a pipeline and with one microbatch
computes its gradient as two half-batch passes to get them, a pipeline keeps its two
halves' gradients apart inside the runtime. The online tuner prices each candidate as
the tuned step runs it (``OnlineTuner._as_run``); this benchmark measures why.

The reference GPT (d_model 64, 4 layers, 4 heads, seq 32, byte vocabulary), global
batch 16, on 8 simulated CPU devices, each layout compiled with and without the
statistics (``tuner.trial.Trial``), warmed up, then timed in ``--rounds`` interleaved
rounds of ``--steps`` steps; a layout's time is the median step, its spread the 10-90%
range over the median.

Usage: ``python benchmarks/noise_stats_cost.py [--rounds 7] [--steps 4] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np  # noqa: E402
from _report import report  # noqa: E402

from mindpipe_jax.config import Config  # noqa: E402
from mindpipe_jax.tuner.space import Candidate as C  # noqa: E402
from mindpipe_jax.tuner.trial import Trial  # noqa: E402

SMALL = ("model.d_model=64", "model.n_layers=4", "model.n_heads=4", "model.seq_len=32",
         "train.progress=false", "train.tensorboard=false")
B = 16
LAYOUTS = [C(data=8, global_batch=B), C(data=2, fsdp=4, global_batch=B), C(fsdp=4, tensor=2, global_batch=B),
           C(data=4, pipe=2, microbatches=2, global_batch=B)]


def main(args) -> None:
    base = Config().replace(*SMALL)
    trials = {}
    for cand in LAYOUTS:
        for stats in (False, True):
            trials[cand, stats] = Trial(base.replace(f"tuner.enabled={str(stats).lower()}"), cand)
        print(f"  compiled {cand.label()} without and with the statistics", flush=True)
    for _ in range(args.rounds):
        for trial in trials.values():
            trial.run(args.steps)

    def med(c, s):
        return statistics.median(trials[c, s].times)

    def spread(c, s):
        lo, hi = np.percentile(trials[c, s].times, [10, 90])
        return (hi - lo) / med(c, s)

    print(f"\n{'layout':36s} {'plain':>8s} {'spread':>7s} {'with stats':>11s} {'spread':>7s} {'ratio':>6s}")
    for c in LAYOUTS:
        print(f"{c.label():36s} {med(c, False) * 1e3:6.1f}ms {spread(c, False):7.0%} "
              f"{med(c, True) * 1e3:9.1f}ms {spread(c, True):7.0%} {med(c, True) / med(c, False):6.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=4, help="steps per layout per round")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    with report("Train step with and without the online tuner's noise statistics", args.out):
        main(args)
