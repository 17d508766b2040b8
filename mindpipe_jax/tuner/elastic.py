"""Elastic resume: a tuned run requeued on a different number of devices.

A tuned run's checkpoint keeps the tuner's state: the candidate it ran (mesh,
microbatches, batch), its noise statistics, its base batch and learning-rate gain.
Requeued on N' devices instead of N, the saved candidate cannot run; ``replan``
chooses what the run continues with:

* **Layout.** The saved ``fsdp``, ``tensor``, ``pipe``, ``expert`` and ``subnet`` sizes
  are kept where their product divides N' (halving ``fsdp`` first, then the
  model-parallel axes, largest first, until it does); ``data`` takes the rest.
  Microbatches, schedule, chunks and remat stay.
* **Batch.** Two natural choices: keep the *global* batch (the same statistics: the
  noise scale's efficiency and the learning rate do not move; each device computes
  N/N' times the rows) or keep the *rows per device* (the step time the tuner
  measured; the global batch scales by N'/N). The saved noise scale arbitrates: each
  is scored by entropyput, ``B / t(B) x efficiency(B)``, with ``t`` from the model
  the online tuner uses for a candidate it has not measured (``MeasuredThroughput``:
  linear in rows per device with its fixed-overhead prior), relative to the saved
  candidate's time, so the unknown time of a step on the new machine cancels.
  Without a noise estimate another batch's efficiency is unknown and the global
  batch is kept when it fits.
* **Learning rate.** The gain follows the chosen batch by the run's rule
  (``tuner.lr_scaling``; the AdaScale rules' from the noise scale).

From there the online tuner continues as before, with the restored noise
statistics, and measures the new machine before it switches anything else.
"""

from __future__ import annotations

import dataclasses
import math

from mindpipe_jax.config import Config
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.tuner.facts import ModelFacts
from mindpipe_jax.tuner.noise import NOISE_RULES, NoiseScale, efficiency, lr_gain
from mindpipe_jax.tuner.space import Candidate, check_candidate

# Axes kept as they were when they fit, in the order they give way: fsdp (a batch axis
# like data) first, then the model-parallel axes.
_KEPT = ("fsdp", "tensor", "expert", "pipe", "subnet")


@dataclasses.dataclass(frozen=True)
class Replan:
    before: Candidate
    after: Candidate
    b_noise: float | None
    lr_gain: float
    policy: str  # "kept the global batch" / "kept the rows per device"

    def line(self) -> str:
        noise = f"B_noise {self.b_noise:.1f}" if self.b_noise is not None else "no noise estimate"
        return (f"elastic resume: the tuned run ran {self.before.label()} on {self.before.devices} devices; "
                f"{self.after.devices} now: {self.after.label()} ({self.policy}; {noise}; "
                f"lr x{self.lr_gain:.3g})")


def fit_layout(cand: Candidate, devices: int) -> Candidate:
    """``cand``'s mesh on ``devices``: the kept axes as they were where their product
    divides it; until it does, ``fsdp`` is halved, then the largest of the others (ties
    in ``_KEPT`` order). ``data`` takes the rest."""
    kept = {a: cand.axes[a] for a in _KEPT}
    while devices % math.prod(kept.values()):
        shrink = "fsdp" if kept["fsdp"] > 1 else max(_KEPT[1:], key=lambda a: kept[a])
        kept[shrink] //= 2
    return dataclasses.replace(cand, data=devices // math.prod(kept.values()), **kept)


def replan(cfg: Config, saved: dict, devices: int, facts: ModelFacts | None = None) -> Replan:
    """The candidate and learning-rate gain a tuned run (``saved``: the tuner's state in
    its checkpoint) continues with on ``devices`` devices (``facts``: the user's model it
    trains; None: ``cfg.model``'s). ConfigError, one line, when no layout of the saved run
    fits them."""
    from mindpipe_jax.tuner.measured import MeasuredThroughput

    before = Candidate(**saved["candidate"])
    fitted = fit_layout(before, devices)
    options = {
        "kept the global batch": fitted,
        "kept the rows per device": dataclasses.replace(
            fitted, global_batch=before.per_device_batch * fitted.batch_shards),
    }
    reasons = {policy: check_candidate(cfg, c, devices, facts) for policy, c in options.items()}
    valid = {policy: c for policy, c in options.items() if reasons[policy] is None}
    if not valid:
        raise ConfigError(f"resuming the tuned run ({before.label()} on {before.devices} devices) on "
                          f"{devices} devices: {fitted.label()} does not fit: "
                          f"{reasons['kept the global batch']}")
    noise = NoiseScale.from_dict(saved["noise"]) if "noise" in saved else None
    bn = noise.b_noise if noise is not None else None
    b0 = saved.get("b0") or cfg.tuner.base_batch or saved.get("initial_batch") or before.global_batch
    if bn is None and "kept the global batch" in valid:
        policy = "kept the global batch"
    elif bn is None:
        policy = "kept the rows per device"
    else:
        model = MeasuredThroughput()
        model.observe(before, 1.0)  # times relative to the saved candidate's

        def entropyput(c: Candidate) -> float:
            return c.global_batch / model.step_time(c) * efficiency(c.global_batch, bn, b0)

        policy = max(valid, key=lambda p: entropyput(valid[p]))
    after = valid[policy]
    rule = cfg.tuner.lr_scaling
    gain = saved.get("lr_gain", 1.0) if bn is None and rule in NOISE_RULES else lr_gain(
        rule, after.global_batch, b0, bn)
    return Replan(before, after, bn, gain, policy)
