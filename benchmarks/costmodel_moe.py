"""Cost model on MoE steps beside dense ones: calibration-only prediction vs measured.

The tuner tests' small GPT (d_model 64, 4 layers, 4 heads, seq 32) and its MoE twin
(4 experts, top-2, capacity 1.25), global batch 32, the full train step on 8 simulated
CPU devices: dense data=8 (1 and 2 microbatches), MoE data=8 / data=4 x expert=2 /
data=2 x expert=4 / data=8 with 2 microbatches. Each layout is compiled and warmed up
(``tuner.trial.Trial``), then timed in ``--rounds`` interleaved rounds of ``--steps``
steps; its time is the median step, its spread the 10-90% range over the median.
Predictions are ``CostModel`` from this machine's calibration (cached per machine) and
each model's measured pieces, fitted on nothing (no trial seen).

What it shows is the MoE's error *beside* the dense model's on the same machine and run
(measured / predicted): an MoE block priced as its dense twin scaled by the active
parameters (before 2026-12-06) ran 1.4x further from its prediction than the dense
step; priced from its own compiled block, quadratic in a device's rows, the two agree.

Usage: ``python benchmarks/costmodel_moe.py [--rounds 5] [--steps 3] [--out FILE]``.
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
from mindpipe_jax.tuner.costmodel import CostModel, Hardware, ModelCosts  # noqa: E402
from mindpipe_jax.tuner.space import Candidate as C  # noqa: E402
from mindpipe_jax.tuner.trial import Trial  # noqa: E402

SMALL = ("model.d_model=64", "model.n_layers=4", "model.n_heads=4", "model.seq_len=32",
         "train.progress=false", "train.tensorboard=false")
MOE = ("model.n_experts=4", "model.top_k=2")
B = 32
LAYOUTS = {"dense": [C(data=8, global_batch=B), C(data=8, microbatches=2, global_batch=B)],
           "MoE": [C(data=8, global_batch=B), C(data=4, expert=2, global_batch=B),
                   C(data=2, expert=4, global_batch=B), C(data=8, microbatches=2, global_batch=B)]}


def main(args) -> None:
    hw = Hardware.calibrate(jax.devices())
    print(f"calibration: {hw.note}")
    trials, models = {}, {}
    for name, layouts in LAYOUTS.items():
        cfg = Config().replace(*SMALL, *(MOE if name == "MoE" else ()))
        models[name] = CostModel(ModelCosts.measure(cfg), hw, cfg.model.seq_len)
        for cand in layouts:
            trials[name, cand] = Trial(cfg, cand)
            print(f"  compiled {name} {cand.label()}", flush=True)
    for _ in range(args.rounds):  # round-robin: the machine's drift hits every layout alike
        for trial in trials.values():
            trial.run(args.steps)
    print(f"\n{'model':6s} {'layout':32s} {'predicted':>10s} {'measured':>9s} {'spread':>7s} "
          f"{'measured/predicted':>19s}")
    ratios = {name: [] for name in LAYOUTS}
    for (name, cand), trial in trials.items():
        pred, meas = models[name].step_time(cand), statistics.median(trial.times)
        lo, hi = np.percentile(trial.times, [10, 90])
        ratios[name].append(meas / pred)
        print(f"{name:6s} {cand.label():32s} {pred * 1e3:8.1f}ms {meas * 1e3:7.1f}ms "
              f"{(hi - lo) / meas:7.0%} {meas / pred:19.2f}")
    dense, moe = (statistics.median(ratios[n]) for n in ("dense", "MoE"))
    print(f"\nmedian measured/predicted: dense {dense:.2f}, MoE {moe:.2f}; MoE / dense {moe / dense:.2f} "
          f"(1.00: the MoE priced as well as the dense model on this machine)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="steps per layout per round")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    with report("Cost model: MoE beside dense, calibration only", args.out):
        main(args)
