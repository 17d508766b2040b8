"""The gradient noise scale and what it says about a batch size.

McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training", appendix
A): with G the true gradient and Σ the per-example gradient covariance, a batch
of ``B`` examples gives a gradient G_B with

    E|G_B|² = |G|² + tr(Σ)/B.

Two batch sizes measured on the same step — the microbatches' gradients (``b``
rows each; their squared norms averaged, |G_b|²) and the step's gradient (``B``
rows, |G_B|²) — give unbiased estimates of both terms:

    |G|²  = (B|G_B|² − b|G_b|²) / (B − b)
    tr(Σ) = (|G_b|² − |G_B|²) / (1/b − 1/B)

and the simple noise scale B_noise = tr(Σ)/|G|² is the batch size at which the
gradient's noise equals its signal. Each step's two estimates are very noisy
(|G|²'s can be negative), so each is smoothed with its own EMA and B_noise is
the ratio of the two averages — the paper's advice; an average of per-step
ratios would be dominated by steps whose |G|² estimate is near zero.

For an adaptive optimizer the same is done on preconditioned gradients (Pollux,
Qiao et al. OSDI '21, sec. 3.1): Adam moves along P g with P = diag(1/(sqrt(v̂)+ε)),
so the noise that matters is that of P g, and

    B_noise = tr(P Σ P) / |P G|²,

from |P G_b|² and |P G_B|² by the same two formulas (P is one fixed matrix for a
step's microbatches and batch, so both are still unbiased). The train step returns
both kinds (train/noise_stats.py ``noise_statistics``, P read from the optimizer's
``ScaleByAdamState`` after its update, i.e. what that update divided by, and only
once v̂ is more than this one step's gradient); ``NoiseScale.update_from_metrics``
takes the preconditioned pair when it is there, so efficiency and the AdaScale gain
below use Adam's noise scale for AdamW. The preconditioned norms are much larger
than the plain ones (P g is about one per element), so the two kinds never share an
EMA: a change of kind restarts it.

B_noise grows as the loss falls (McCandlish et al. sec. 3), so estimates taken at
different steps differ by design: on a tiny GPT (d_model 64, 2 layers, batch 32 in 4
microbatches, EMA 0.9, three seeds) plain B_noise went 0.6 -> 44-52 and the
preconditioned one 13-19 -> 70-88 from step 20/40 to step 100, the seeds within
±11% of each other at step 100. The online benchmark's 8.3 (step 100 of one run)
and 38.6 (the end of another) are two points of such a rise: replaying its recorded
history with this estimator gives 5.5 at step 170 and 30-60 after step 900.

Statistical efficiency of a batch ``B`` relative to a base batch ``b0`` (the
samples a batch of ``b0`` needs for some progress, over what ``B`` needs; Pollux,
OSDI '21, after the same paper) is ``(B_noise + b0)/(B_noise + B)``: 1 at b0,
falling towards b0/B once B is well above B_noise.

How the learning rate follows the batch (``lr_gain``):

* ``sqrt_adascale`` (the default: the rule for Adam-family optimizers, such as this
  project's AdamW) — the square root of AdaScale's gain,
  sqrt((1 + B_noise/b0)/(1 + B_noise/B)). Malladi et al. 2022 ("On the SDEs and
  Scaling Rules for Adaptive Gradient Algorithms") show that Adam's SDE is kept when
  the batch grows by k and the learning rate by sqrt(k) (the square-root rule), where
  SGD's needs k (the linear rule). Both rules assume the noise dominates (B << B_noise);
  AdaScale's gain r = (B/b0) x efficiency(B) is the k by which a batch of B actually
  reduces the gradient's noise relative to b0's: k while B << B_noise, saturating at
  1 + B_noise/b0 once a larger batch stops reducing the noise. The square root of r is
  therefore Malladi's rule where it was derived and stops raising the learning rate
  where larger batches stop helping, with the B_noise of Adam's preconditioned
  gradients. Without an estimate yet the gain is 1.
* ``adascale`` — AdaScale (Johnson et al. 2020), derived for SGD: gain = r =
  (1 + B_noise/b0)/(1 + B_noise/B): linear scaling while B << B_noise, flattening
  out when larger batches stop reducing the noise. Applied to AdamW it raised the
  learning rate x1.4-x8.1 as the online benchmark's batch climbed 8 -> 128
  (benchmarks/results/2026-12-02-cpu-epara-online-repeats.txt). Without an
  estimate yet the gain is 1.
* ``sqrt`` — sqrt(B/b0), Malladi's rule without the noise scale.
* ``linear`` — B/b0 (Goyal et al. 2017).
* ``none`` — 1.
"""

from __future__ import annotations

import dataclasses
import math

LR_RULES = ("sqrt_adascale", "adascale", "sqrt", "linear", "none")
NOISE_RULES = ("sqrt_adascale", "adascale")  # the rules that need a noise estimate


def noise_terms(b_small: float, small_sq: float, b_big: float, big_sq: float) -> tuple[float, float]:
    """Unbiased (|G|², tr(Σ)) from one step: |G_b|² over microbatches of ``b_small``
    rows and |G_B|² of the step's ``b_big`` rows."""
    if not 0 < b_small < b_big:
        raise ValueError(f"need 0 < b_small < b_big, got b_small={b_small}, b_big={b_big}")
    g_sq = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    trace = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
    return g_sq, trace


@dataclasses.dataclass
class NoiseScale:
    """EMA-smoothed |G|² and tr(Σ); ``b_noise`` is their ratio.

    ``ema`` is the weight of the past per update (0 = only the last step). The two
    EMAs start at zero and share the same start-up bias (1 − ema^n), which cancels
    in the ratio, so no correction is needed. The estimate is ``ready`` after
    about one EMA time constant of updates.
    """

    ema: float = 0.9
    g_sq: float = 0.0
    trace: float = 0.0
    count: int = 0
    preconditioned: bool = False  # whether the EMAs hold |P G|² and tr(P Σ P)

    def update_from_metrics(self, m: dict) -> None:
        """One step's metrics (host values, as the train step returns them): the
        preconditioned norms when the optimizer has a preconditioner, else the plain
        ones. The step returns NaN preconditioned norms until Adam's second moment has
        settled; until then the plain ones are used, and the first settled step
        restarts the EMAs (as does any change of kind, e.g. a resumed plain estimate).
        Once preconditioned, a non-finite step is skipped, never mixed in."""
        pre = "precond_micro_grad_sq" in m and (self.preconditioned or (
            math.isfinite(float(m["precond_micro_grad_sq"])) and math.isfinite(float(m["precond_grad_sq"]))))
        if pre != self.preconditioned:
            self.g_sq, self.trace, self.count, self.preconditioned = 0.0, 0.0, 0, pre
        small, big = (("precond_micro_grad_sq", float(m["precond_grad_sq"])) if pre else
                      ("micro_grad_sq", float(m["grad_norm"]) ** 2))
        self.update(float(m["micro_batch"]), float(m[small]), float(m["batch"]), big)

    def update(self, b_small: float, small_sq: float, b_big: float, big_sq: float) -> None:
        g_sq, trace = noise_terms(b_small, small_sq, b_big, big_sq)
        if not (math.isfinite(g_sq) and math.isfinite(trace)):
            return  # a non-finite step tells nothing about the noise
        self.g_sq = self.ema * self.g_sq + (1 - self.ema) * g_sq
        self.trace = self.ema * self.trace + (1 - self.ema) * trace
        self.count += 1

    @property
    def ready(self) -> bool:
        return self.count >= max(1, math.ceil(1 / (1 - self.ema)))

    @property
    def b_noise(self) -> float | None:
        """tr(Σ)/|G|², or None while not ready or while the smoothed |G|² is not
        positive (the signal is still lost in the noise: no batch size can be judged)."""
        if not self.ready or self.g_sq <= 0:
            return None
        return max(self.trace, 0.0) / self.g_sq

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> NoiseScale:
        return cls(**d)  # a checkpoint from before ``preconditioned`` existed: plain (False)


def efficiency(batch: float, b_noise: float | None, b0: float) -> float:
    """Statistical efficiency of ``batch`` relative to ``b0``: (B_noise + b0)/(B_noise + B).
    Unknown noise (None): 1 at b0 and NaN elsewhere, so nothing is ranked on a guess."""
    if b_noise is None:
        return 1.0 if batch == b0 else math.nan
    return (b_noise + b0) / (b_noise + batch)


def lr_gain(rule: str, batch: float, b0: float, b_noise: float | None) -> float:
    """Learning-rate multiplier for ``batch`` under ``rule`` (see the module docstring)."""
    if rule == "none":
        return 1.0
    if rule == "linear":
        return batch / b0
    if rule == "sqrt":
        return math.sqrt(batch / b0)
    if rule in NOISE_RULES:
        r = 1.0 if b_noise is None else (batch / b0) * efficiency(batch, b_noise, b0)
        return r if rule == "adascale" else math.sqrt(r)
    raise ValueError(f"learning-rate rule {rule!r} is not valid; valid: {', '.join(LR_RULES)}")
