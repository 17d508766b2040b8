"""What adapting the batch could gain on a run: a bound from the gradient-noise-scale model.

An estimate, not a measurement. The online tuning benchmark asks online batch
adaptation to reach a target in <= 0.85x the time of the best fixed batch. How
much any batch schedule could gain is set by the run itself: how fast the noise
scale grows and how step time grows with the batch. This module works it out
under the model the tuner itself uses (McCandlish et al., 2018; Pollux): at
batch B and noise scale B_noise, a step makes B / (B + B_noise) units of
progress (units: steps at an infinitely small batch's efficiency, S_min).

From an online run's history (``tuner/batch`` and ``tuner/b_noise`` every log
step, smoothed by a running median) it integrates the progress the run made to
reach its target and, along that path, the time

* of each fixed batch B: sum over the path of t(B) (1 + B_noise / B) per unit;
* of the best schedule (an oracle that switches for free, at every log step, to
  the batch that is fastest there): sum of min over B of the same.

``t(B)`` is the measured seconds per step of the fixed arms (train time over
steps, each arm's compile included). The fixed times it predicts are printed
beside the measured ones, so the model's fit to this run is on the page.

Usage: ``python benchmarks/batch_bound.py --history RUN-history.json --step-s
8:0.0381,16:0.0462,32:0.0723 [--measured 8:56.6,16:39.8,32:40.0]``;
``online_tuning.py`` calls ``report`` at the end of every run.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

SMOOTH = 7  # running-median window over log steps: one estimate swings by 2-4x


def progress_path(history: list[dict], smooth: int = SMOOTH) -> list[tuple[float, float]]:
    """``[(progress units, B_noise)]`` per log step of ``history``: the steps since the last
    record at the batch the run trained with, at the record's smoothed noise scale."""
    records = [h for h in history if "tuner/batch" in h]
    noise = [h.get("tuner/b_noise") for h in records]
    known = [b for b in noise if b is not None and math.isfinite(b)]
    if not known:
        raise ValueError("the history holds no noise-scale estimate (tuner/b_noise): was the tuner on?")
    path, prev_step, half = [], 0, smooth // 2
    for i, rec in enumerate(records):
        window = [b for b in noise[max(0, i - half):i + half + 1] if b is not None and math.isfinite(b)]
        b_noise = statistics.median(window) if window else known[0]
        batch = records[i - 1]["tuner/batch"] if i else rec["tuner/batch"]  # what ran up to this record
        steps = rec["step"] - prev_step
        prev_step = rec["step"]
        path.append((steps * batch / (batch + b_noise), b_noise))
    return path


def bound(path: list[tuple[float, float]], step_s: dict[int, float]) -> dict:
    """Times along ``path`` for each fixed batch and for the free-switching oracle."""
    fixed = {b: sum(units * t * (1 + noise / b) for units, noise in path) for b, t in step_s.items()}
    oracle = sum(units * min(t * (1 + noise / b) for b, t in step_s.items()) for units, noise in path)
    best = min(fixed, key=fixed.get)
    return dict(progress=sum(u for u, _ in path), fixed=fixed, oracle=oracle, best=best,
                ratio=oracle / fixed[best], noise=(path[0][1], path[-1][1]))


def report(histories: list[list[dict]], step_s: dict[int, float], measured: dict[int, float] | None = None,
           out=None) -> list[dict]:
    """Print the bound for each history (one line each) and return the figures."""
    out = out or sys.stdout
    results = [bound(progress_path(hist), step_s) for hist in histories]  # bad input fails before output
    print("\n### what adapting the batch could gain here (an estimate from the noise-scale model, not a "
          "measurement; see benchmarks/batch_bound.py)", file=out)
    print("seconds per step of the fixed arms (compile included): "
          + ", ".join(f"B{b} {t:.4f}" for b, t in sorted(step_s.items())), file=out)
    for i, r in enumerate(results):
        fixed = ", ".join(f"B{b} {t:.1f}" + (f" (measured {measured[b]:.1f})" if measured and b in measured
                                             else "") for b, t in sorted(r["fixed"].items()))
        print(f"  online run {i + 1}: B_noise {r['noise'][0]:.0f} -> {r['noise'][1]:.0f} over "
              f"{r['progress']:.0f} units; model's fixed arms {fixed} s; the best batch at every log step, "
              f"switching free: {r['oracle']:.1f} s = {r['ratio']:.3f}x the best fixed (B{r['best']})",
              file=out)
    if results:
        worst = min(r["ratio"] for r in results)
        print(f"  no batch schedule over these batches beats the best fixed one by more than "
              f"{100 * (1 - worst):.0f}% under this model"
              + (" (the 0.85x goal lies outside it)" if worst > 0.85 else ""), file=out)
    return results


def _pairs(parser, text: str, what: str) -> dict[int, float]:
    try:
        pairs = {int(b): float(v) for b, v in (item.split(":") for item in text.split(","))}
    except ValueError:
        parser.error(f"{what} must look like 8:0.038,16:0.046 (batch:value, comma-separated), got {text!r}")
    if any(b < 1 or not v > 0 for b, v in pairs.items()):
        parser.error(f"{what} needs batches >= 1 and positive values, got {text!r}")
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--history", required=True, help="an online_tuning.py *-history.json")
    parser.add_argument("--step-s", required=True, help="seconds per step of each fixed batch, B:s,...")
    parser.add_argument("--measured", default=None,
                        help="measured time to target of each fixed batch, B:s,...")
    args = parser.parse_args()
    step_s = _pairs(parser, args.step_s, "--step-s")
    measured = _pairs(parser, args.measured, "--measured") if args.measured else None
    try:
        runs = json.loads(open(args.history).read())
        histories = [r["history"] for r in runs]
    except (OSError, ValueError, KeyError, TypeError) as e:
        parser.error(f"--history {args.history!r} is not an online_tuning.py history file ({e})")
    try:
        report(histories, step_s, measured)
    except ValueError as e:
        parser.error(str(e))


if __name__ == "__main__":
    main()
