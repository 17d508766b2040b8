"""Fitting the cost model's coefficients to measured trials (``CostModel.observe``).

A prediction is ``coef · features`` (compute, comm, update, 1, ticks). ``fit``
minimizes the trials' *relative* errors (what the model is judged by; a slow
layout does not outweigh a fast one) plus a ridge pull towards the priors, per
coefficient: compute, comm and update are multipliers (prior 1; update held
closer, since few layouts tell it apart from the fixed cost); the fixed costs are
measured in units of the mean observed step, so trials can teach the model an
overhead the micro-benchmarks did not see (a pipeline tick's bookkeeping, a step's
host work). All coefficients stay >= 0.

How hard to pull is chosen by ``leave_one_out_ridge``: the one of
``RIDGE_CHOICES`` whose fits predict each trial left out best (mean |relative
error|; ties go to the stronger pull, ``inf`` keeping the priors), so a handful of
trials that a fit would chase worse than the calibration predicts them leave the
priors in place. With fewer than ``MIN_TRIALS_TO_CHOOSE`` trials the weakest pull
is used (nothing to leave out).
"""

from __future__ import annotations

import math

import numpy as np

RIDGE_CHOICES = (0.1, 1.0, 10.0, math.inf)
MIN_TRIALS_TO_CHOOSE = 3
# Per coefficient: how much more the update's multiplier is held to its prior, and how
# much less a tick's overhead is (compute, comm, update, fixed, tick).
_PULL = np.array([1.0, 1.0, 10.0, 1.0, 0.1])


def fit(X: np.ndarray, y: np.ndarray, prior: np.ndarray, ridge: float) -> np.ndarray:
    """Coefficients for trials with features ``X`` (rows) measured at ``y`` seconds."""
    if math.isinf(ridge):
        return prior.copy()
    ybar = float(np.mean(y))
    scale = np.array([1.0, 1.0, 1.0, ybar, ybar / 10])  # a fixed cost of ~ybar, a tick ~ybar/10
    u0 = prior / scale
    Z = X * scale / y[:, None]  # rows in units of their own measurement: relative errors
    lam = ridge * _PULL
    A = np.vstack([Z, np.diag(np.sqrt(lam))])
    b = np.concatenate([np.ones(len(y)), np.sqrt(lam) * u0])
    u, *_ = np.linalg.lstsq(A, b, rcond=None)
    return np.maximum(u, 0.0) * scale


def leave_one_out_ridge(X: np.ndarray, y: np.ndarray, prior: np.ndarray) -> float:
    """The ridge of ``RIDGE_CHOICES`` whose fits best predict each trial left out."""
    if len(y) < MIN_TRIALS_TO_CHOOSE:
        return RIDGE_CHOICES[0]
    best = None
    for ridge in reversed(RIDGE_CHOICES):  # strongest first: a tie keeps it
        errors = []
        for i in range(len(y)):
            rest = np.arange(len(y)) != i
            coef = fit(X[rest], y[rest], prior, ridge)
            errors.append(abs(max(float(X[i] @ coef), 1e-9) / y[i] - 1))
        score = float(np.mean(errors))
        if best is None or score < best[0] * (1 - 1e-9):
            best = (score, ridge)
    return best[1]
