"""The gradient noise scale: the estimator on gradients of known statistics, and the
statistics a real train step returns."""

import math

import jax
import numpy as np
import pytest

import mindpipe_jax as mp
from mindpipe_jax.train.reconfigure import build_layout
from mindpipe_jax.train.state import init_train_state
from mindpipe_jax.train.step import model_loss
from mindpipe_jax.tuner.noise import NoiseScale, efficiency, lr_gain, noise_terms


def test_noise_terms_are_exact_on_expected_values():
    # E|G_b|^2 = |G|^2 + tr/b: plugging the expectations in must give back |G|^2 and tr exactly.
    g_sq, trace = 2.0, 300.0
    got = noise_terms(8, g_sq + trace / 8, 64, g_sq + trace / 64)
    assert got == pytest.approx((g_sq, trace))
    with pytest.raises(ValueError):
        noise_terms(8, 1.0, 8, 1.0)


def test_estimator_recovers_a_known_noise_scale():
    """Per-example gradients g_i = mu + e_i, e_i ~ N(0, diag(s^2)): tr(Sigma) = sum s^2 and
    B_noise = tr(Sigma)/|mu|^2 are known. Each step draws B examples in m microbatches of b.

    Tolerance from the sample count, for Gaussian gradients (i.i.d. steps):
      tr estimate  T: Var = 2 tr(Sigma^2)/(m-1)  (a sample variance of m microbatch means, scaled)
      |G|^2 est.   G = |mu + mean e|^2 - T/B:
                   Var = 4 mu'Sigma mu/B + 2 tr(Sigma^2)/B^2 + Var(T)/B^2,  Cov(T, G) = -Var(T)/B
      ratio R = T/G (delta method): Var(R)/R^2 = Var(T)/T^2 + Var(G)/G^2 - 2 Cov(T, G)/(T G)
    An EMA with weight beta averages about (1+beta)/(1-beta) independent steps. The test
    allows 4 standard deviations (a false failure about once in 16 000 seeds).
    """
    rng = np.random.default_rng(0)
    d, m, b, steps, beta = 64, 4, 8, 2000, 0.99
    big = m * b
    var = np.linspace(0.5, 1.5, d)  # diag(Sigma)
    mu = rng.normal(size=d)
    mu *= math.sqrt(var.sum() / 50.0) / np.linalg.norm(mu)  # B_noise = 50, between b and B
    true = var.sum() / (mu @ mu)

    noise = NoiseScale(ema=beta)
    for _ in range(steps):
        g = mu + rng.normal(size=(big, d)) * np.sqrt(var)  # per-example gradients
        micro = g.reshape(m, b, d).mean(axis=1)
        noise.update(b, float(np.mean(np.sum(micro**2, axis=1))), big, float(np.sum(g.mean(axis=0)**2)))

    tr, tr2, g_sq = var.sum(), (var**2).sum(), mu @ mu
    v_t = 2 * tr2 / (m - 1)
    v_g = 4 * (mu * var) @ mu / big + 2 * tr2 / big**2 + v_t / big**2
    rel_var = v_t / tr**2 + v_g / g_sq**2 + 2 * v_t / (big * tr * g_sq)
    sigma = true * math.sqrt(rel_var * (1 - beta) / (1 + beta))
    assert abs(noise.b_noise - true) < 4 * sigma, (noise.b_noise, true, sigma)
    assert 4 * sigma < 0.2 * true  # the test can tell 50 from a biased estimate such as T/|G_B|^2 (~20)


def test_noise_scale_waits_and_refuses_what_it_cannot_judge():
    noise = NoiseScale(ema=0.9)
    noise.update(8, 3.0, 16, 2.0)
    assert not noise.ready and noise.b_noise is None  # fewer than 1/(1-ema) = 10 updates
    for _ in range(10):
        noise.update(8, 3.0, 16, 2.0)
    assert noise.b_noise == pytest.approx(16.0)  # |G|^2 = 1, tr = 16
    for _ in range(200):  # |G|^2 estimate negative: the signal is lost in the noise
        noise.update(8, 3.0, 16, 1.4)
    assert noise.b_noise is None
    restored = NoiseScale.from_dict(noise.to_dict())
    assert restored == noise


def test_efficiency_and_learning_rate_rules():
    assert efficiency(32, 100.0, 32) == 1.0
    assert efficiency(64, 100.0, 32) == pytest.approx(132 / 164)
    assert efficiency(64, 1e9, 32) == pytest.approx(1.0)  # very noisy: a bigger batch is free
    assert math.isnan(efficiency(64, None, 32)) and efficiency(32, None, 32) == 1.0
    assert lr_gain("none", 64, 32, 100.0) == 1.0
    assert lr_gain("linear", 64, 32, None) == 2.0
    assert lr_gain("sqrt", 128, 32, None) == pytest.approx(2.0)
    # AdaScale: linear while B << B_noise, flat when B >> B_noise, 1 without an estimate.
    assert lr_gain("adascale", 64, 32, 1e9) == pytest.approx(2.0)
    assert lr_gain("adascale", 64, 32, 0.0) == pytest.approx(1.0)
    assert lr_gain("adascale", 64, 32, None) == 1.0
    with pytest.raises(ValueError):
        lr_gain("cubic", 64, 32, None)


TINY = ("model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.seq_len=32",
        "train.global_batch=16", "parallel.simulate_cpu_devices=0", "tuner.enabled=true")


@pytest.mark.parametrize("overrides,micro", [
    (("parallel.data=4", "parallel.tensor=2", "train.grad_accum=4"), 4),  # accumulated microbatches
    (("parallel.data=8", "parallel.tensor=1", "train.deterministic=true"), 8),  # virtual shards
])
def test_train_step_returns_microbatch_statistics(overrides, micro):
    cfg = mp.Config().replace(*TINY, *overrides)
    layout = build_layout(cfg, lambda c: (lambda rngs: mp.GPT(c.model, rngs=rngs)))
    state = init_train_state(layout.spec, layout.create, layout.tx, layout.mesh, 0, layout.shardings)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (16, 33)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    params = jax.device_get(state["params"])  # before the step donates the state
    step, _ = layout.compile()
    _, metrics = step(state, layout.batches(batch))
    metrics = jax.device_get(metrics)

    # Independently: each microbatch's gradient on one device, no mesh. Accumulation
    # gives microbatch j the rows j, j+m, ...; deterministic mode gives shard s a block.
    grad = jax.jit(jax.grad(lambda p, b: model_loss(layout.spec, p, b, None)))
    rows = [np.arange(j, 16, micro) if not cfg.train.deterministic else
            np.arange(j * 16 // micro, (j + 1) * 16 // micro) for j in range(micro)]
    sq = lambda t: sum(float(np.sum(np.square(x, dtype=np.float64))) for x in jax.tree.leaves(t))  # noqa: E731
    grads = [grad(params, {k: v[r] for k, v in batch.items()}) for r in rows]
    small = np.mean([sq(g) for g in grads])
    full = sq(jax.tree.map(lambda *g: np.mean(g, axis=0), *grads))
    assert (int(metrics["micro_batch"]), int(metrics["batch"])) == (16 // micro, 16)
    assert float(metrics["micro_grad_sq"]) == pytest.approx(small, rel=1e-4)
    assert float(metrics["grad_norm"]) ** 2 == pytest.approx(full, rel=1e-4)
    # The step's statistics give the noise terms the independent gradients give.
    g_sq, trace = noise_terms(16 // micro, float(metrics["micro_grad_sq"]), 16,
                              float(metrics["grad_norm"]) ** 2)
    assert (g_sq, trace) == pytest.approx(noise_terms(16 // micro, small, 16, full), rel=1e-3)
    assert trace > 0  # different microbatches of random tokens do disagree


def test_statistics_only_when_asked():
    cfg = mp.Config().replace(*TINY, "parallel.data=4", "parallel.tensor=2", "train.grad_accum=2",
                              "tuner.enabled=false")
    layout = build_layout(cfg, lambda c: (lambda rngs: mp.GPT(c.model, rngs=rngs)))
    out = jax.eval_shape(layout.make_step(), layout.abstract_state, layout.batches.spec())[1]
    assert set(out) == {"loss", "grad_norm", "lr", "nonfinite_leaf"}
    asked = jax.eval_shape(layout.make_step(cfg.replace("tuner.enabled=true")), layout.abstract_state,
                           layout.batches.spec())[1]
    assert {"micro_grad_sq", "micro_batch", "batch"} <= set(asked)
