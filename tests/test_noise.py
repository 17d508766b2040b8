"""The gradient noise scale: the estimator on gradients of known statistics, and the
statistics a real train step returns."""

import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mindpipe_jax as mp
from mindpipe_jax.models import build_model
from mindpipe_jax.train.reconfigure import build_layout
from mindpipe_jax.train.state import init_train_state
from mindpipe_jax.train.step import adam_preconditioner, model_loss, noise_statistics
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
    # The default, for Adam-family optimizers: the square root of AdaScale's gain. Noise-
    # dominated (B << B_noise) it is Malladi et al.'s square-root rule sqrt(B/b0); once a
    # bigger batch stops reducing the noise it saturates at sqrt(1 + B_noise/b0).
    assert mp.Config().tuner.lr_scaling == "sqrt_adascale"
    assert lr_gain("sqrt_adascale", 128, 32, 1e9) == pytest.approx(2.0)
    assert lr_gain("sqrt_adascale", 64, 32, 100.0) == pytest.approx(math.sqrt(2 * 132 / 164))
    assert lr_gain("sqrt_adascale", 1e12, 32, 96.0) == pytest.approx(2.0)
    assert lr_gain("sqrt_adascale", 64, 32, None) == 1.0
    # The online benchmark's last switch (b0 8, B_noise 115.4, 32 -> 128): AdaScale x8.11.
    assert lr_gain("adascale", 128, 8, 115.4) == pytest.approx(8.11, abs=0.01)
    assert lr_gain("sqrt_adascale", 128, 8, 115.4) == pytest.approx(math.sqrt(8.11), abs=0.01)
    with pytest.raises(ValueError):
        lr_gain("cubic", 64, 32, None)


def test_linear_regression_with_known_noise_sgd_and_adam():
    """Least squares with label noise, where B_noise is known in closed form.

    Model y = x.w* + e, x ~ N(0, S) with S = diag(s), e ~ N(0, sigma^2), loss per example
    (x.w - y)^2 / 2. At w = w* + d the per-example gradient is g = x (x.d - e), so

      G = E[g] = S d,
      E[g g'] = E[x x' d d' x x'] + sigma^2 S = 2 S d d' S + (d'S d) S + sigma^2 S
                (Isserlis: E[x_a x_b x_c x_e] = S_ab S_ce + S_ac S_be + S_ae S_bc),
      Sigma = E[g g'] - G G' = G G' + (d'S d + sigma^2) S.

    With a fixed diagonal preconditioner P (identity for SGD):

      B_noise = tr(P Sigma P) / |P G|^2 = 1 + (d'S d + sigma^2) sum_j P_j^2 s_j / sum_j P_j^2 G_j^2.

    P for Adam is the one the train step uses: ``adam_preconditioner`` of a real optax
    chain(clip, adamw) state after 50 updates on this problem, then held fixed. Each of
    2000 steps draws B = 64 examples in m = 8 microbatches; the statistics come from the
    train step's own ``noise_statistics`` and go through ``NoiseScale.update_from_metrics``
    (preconditioned pair when present, plain otherwise), EMA 0.99.

    Tolerance: the brief's 25%. Over seeds 0-6 the errors were at most 6% (SGD) and 6%
    (Adam); the two truths differ 5x here, so an estimate that ignored P could not pass.
    """
    rng = np.random.default_rng(0)
    d, m, b, steps, sigma = 16, 8, 8, 2000, 0.5
    big = m * b
    s = np.logspace(-2, 0, d)  # feature scales: Adam's preconditioner is far from uniform
    delta = 0.3 * rng.normal(size=d)

    def per_example_grads(x, e):
        return x * (x @ delta - e)[..., None]

    def draw(*shape):
        return rng.normal(size=(*shape, d)) * np.sqrt(s), rng.normal(size=shape) * sigma

    optim = types.SimpleNamespace(b2=0.99, eps=1e-8)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, b2=optim.b2, eps=optim.eps))
    w = {"w": jnp.zeros(d, jnp.float32)}  # the update's value is not used: only the moments
    opt = tx.init(w)
    for _ in range(50):
        g = per_example_grads(*draw(big)).mean(axis=0)
        _, opt = tx.update({"w": jnp.asarray(g, jnp.float32)}, opt, w)
    precond = np.asarray(adam_preconditioner(opt, optim.b2, optim.eps)["w"], np.float64)

    def truth(p):
        grad = s * delta
        return 1 + (delta @ (s * delta) + sigma**2) * np.sum(p**2 * s) / np.sum(p**2 * grad**2)

    micro = per_example_grads(*draw(steps, m, b)).mean(axis=2)  # [steps, m, d]

    def statistics(g):  # one step's metrics, as the train step returns them
        step_grad = {"w": g.mean(axis=0)}
        out = noise_statistics({"w": jnp.mean(g**2, axis=0)}, step_grad, opt, optim)
        return {**out, "grad_norm": jnp.sqrt(jnp.sum(step_grad["w"] ** 2))}

    metrics = jax.device_get(jax.jit(jax.vmap(statistics))(jnp.asarray(micro, jnp.float32)))
    assert set(metrics) == {"micro_grad_sq", "precond_micro_grad_sq", "precond_grad_sq", "grad_norm"}

    def estimate(preconditioned):
        noise = NoiseScale(ema=0.99)
        for i in range(steps):
            m_i = {k: v[i] for k, v in metrics.items() if preconditioned or not k.startswith("precond")}
            noise.update_from_metrics({**m_i, "micro_batch": b, "batch": big})
        assert noise.preconditioned == preconditioned
        return noise.b_noise

    sgd, adam = truth(np.ones(d)), truth(precond)
    assert adam > 2 * sgd  # the preconditioner matters on this problem
    fresh = tx.update({"w": jnp.ones(d)}, tx.init(w), w)[1]  # count 1: v_hat is this gradient
    unsettled = noise_statistics({"w": jnp.ones(d)}, {"w": jnp.ones(d)}, fresh, optim)
    assert np.isnan(unsettled["precond_grad_sq"]) and np.isnan(unsettled["precond_micro_grad_sq"])
    assert estimate(False) == pytest.approx(sgd, rel=0.25)
    assert estimate(True) == pytest.approx(adam, rel=0.25)


def test_preconditioner_is_found_only_in_adam_states():
    params = {"a": jnp.ones(3), "b": jnp.ones((2, 2))}
    grads = {"a": jnp.array([1.0, -2.0, 0.5]), "b": jnp.full((2, 2), 3.0)}
    tx = optax.chain(optax.clip_by_global_norm(10.0), optax.adamw(1e-3, b2=0.9, eps=1e-3,
                                                                 mask={"a": True, "b": False}))
    _, opt = tx.update(grads, tx.init(params), params)
    # After one update: v_hat = g^2 exactly (bias-corrected), so P = 1/(|g| + eps).
    got = adam_preconditioner(opt, 0.9, 1e-3)
    for k in params:
        np.testing.assert_allclose(got[k], 1 / (np.abs(grads[k]) + 1e-3), rtol=1e-6)
    sgd = optax.sgd(0.1, momentum=0.9)
    assert adam_preconditioner(sgd.init(params), 0.9, 1e-3) is None
    two = optax.chain(optax.scale_by_adam(), optax.scale_by_adam())  # ambiguous: refused
    assert adam_preconditioner(two.init(params), 0.9, 1e-3) is None


@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("adam", [True, False])
def test_fused_statistics_equal_the_per_leaf_ones(stacked, adam):
    """The train step's ``fused`` statistics (all leaves concatenated, summed by rows)
    against the same sums leaf by leaf and against float64 numpy: leaves of odd sizes,
    together more than one row of the fused sum, a stack sharded or not."""
    rng = np.random.default_rng(3)
    shapes = {"a": (37,), "b": (5, 301), "c": (2, 3, 7), "d": (1,)}
    params = {k: jnp.zeros(v, jnp.float32) for k, v in shapes.items()}
    tx = optax.adamw(1e-3, b2=0.99, eps=1e-6) if adam else optax.sgd(0.1)
    optim = types.SimpleNamespace(b2=0.99, eps=1e-6)
    opt = tx.init(params)
    for _ in range(20):  # settled: at count 20 this gradient is 0.01 / (1 - 0.99**20) = 5.5% of v_hat
        g = {k: jnp.asarray(rng.normal(size=v), jnp.float32) for k, v in shapes.items()}
        opt = tx.update(g, opt, params)[1]
    parts = {k: rng.normal(size=(4, *v)).astype(np.float32) for k, v in shapes.items()}
    grads = {k: jnp.asarray(v.mean(0)) for k, v in parts.items()}
    micro = ({k: jnp.asarray(v) for k, v in parts.items()} if stacked
             else {k: jnp.asarray((v**2).mean(0)) for k, v in parts.items()})
    fused = noise_statistics(micro, grads, opt, optim, stacked=stacked, fused=True)
    leafwise = noise_statistics(micro, grads, opt, optim, stacked=stacked)
    assert set(fused) == set(leafwise) == ({"micro_grad_sq", "precond_micro_grad_sq", "precond_grad_sq"}
                                           if adam else {"micro_grad_sq"})
    for k in leafwise:
        assert float(fused[k]) == pytest.approx(float(leafwise[k]), rel=1e-6), k
    want = np.mean([sum(np.sum(np.float64(v[i]) ** 2) for v in parts.values()) for i in range(4)])
    assert float(fused["micro_grad_sq"]) == pytest.approx(want, rel=1e-6)
    if adam:
        p = {k: np.float64(v) for k, v in adam_preconditioner(opt, 0.99, 1e-6).items()}
        want = sum(np.sum((np.float64(grads[k]) * p[k]) ** 2) for k in shapes)
        assert float(fused["precond_grad_sq"]) == pytest.approx(want, rel=1e-6)


def test_noise_kind_change_restarts_the_estimate():
    noise = NoiseScale(ema=0.5)
    plain = {"micro_batch": 8, "batch": 16, "micro_grad_sq": 3.0, "grad_norm": math.sqrt(2.0)}
    for _ in range(4):
        noise.update_from_metrics(plain)
    assert noise.b_noise == pytest.approx(16.0) and not noise.preconditioned
    noise.update_from_metrics({**plain, "precond_micro_grad_sq": math.nan, "precond_grad_sq": math.nan})
    assert not noise.preconditioned and noise.count == 5  # Adam not settled yet: plain goes on
    noise.update_from_metrics({**plain, "precond_micro_grad_sq": 30.0, "precond_grad_sq": 25.0})
    assert noise.preconditioned and noise.count == 1  # the plain EMAs were dropped
    noise.update_from_metrics({**plain, "precond_micro_grad_sq": math.nan, "precond_grad_sq": math.nan})
    assert noise.preconditioned and noise.count == 1  # a bad step is skipped, plain never mixed in
    assert NoiseScale.from_dict({k: v for k, v in noise.to_dict().items()
                                 if k != "preconditioned"}).preconditioned is False  # old checkpoints


TINY = ("model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.seq_len=32",
        "train.global_batch=16", "parallel.simulate_cpu_devices=0", "tuner.enabled=true")


@pytest.mark.parametrize("overrides,micro", [
    (("parallel.data=4", "parallel.tensor=2", "train.grad_accum=4"), 4),  # accumulated microbatches
    (("parallel.data=8", "parallel.tensor=1", "train.deterministic=true"), 8),  # virtual shards
    # A 1F1B pipeline of 4 microbatches: the runtime keeps the step's two halves apart.
    (("parallel.pipe=2", "parallel.data=4", "parallel.tensor=1", "parallel.microbatches=4"), 2),
    # ... with its weights stored split over fsdp (gathered once per step, reduce-scattered back).
    (("parallel.pipe=2", "parallel.fsdp=2", "parallel.data=2", "parallel.tensor=1",
      "parallel.microbatches=4"), 2),
])
def test_train_step_returns_microbatch_statistics(overrides, micro):
    cfg = mp.Config().replace(*TINY, *overrides)
    layout = build_layout(cfg, lambda c: (lambda rngs: mp.GPT(c.model, rngs=rngs)))
    state = init_train_state(layout.spec, layout.create, layout.tx, layout.mesh, 0, layout.shardings)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (16, 33)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    params = jax.device_get(state["params"])  # before the step donates the state
    # An optimizer with history (count 99): the preconditioned statistics count only once
    # Adam's v_hat is more than the step's own gradient (train/noise_stats.py PRECOND_SETTLED_SHARE).
    clip, (adam, *rest) = state["opt"]
    state["opt"] = (clip, (adam._replace(count=jax.device_put(jnp.int32(99), adam.count.sharding)), *rest))
    step, _ = layout.compile()
    new_state, metrics = step(state, layout.batches(batch))
    metrics = jax.device_get(metrics)

    # Independently: each microbatch's gradient on one device, no mesh. Accumulation
    # gives microbatch j the rows j, j+m, ...; deterministic mode gives shard s a block;
    # a pipeline of m microbatches gives microbatch j the rows j, j+m, ..., and half h
    # its microbatches h·m/2 .. (h+1)·m/2 - 1.
    grad = jax.jit(jax.grad(lambda p, b: model_loss(layout.spec, p, b, None)))
    m = cfg.parallel.microbatches
    if cfg.parallel.pipe > 1:
        rows = [np.sort(np.concatenate([np.arange(j, 16, m) for j in range(h * m // 2, (h + 1) * m // 2)]))
                for h in range(2)]
    else:
        rows = [np.arange(j, 16, micro) if not cfg.train.deterministic else
                np.arange(j * 16 // micro, (j + 1) * 16 // micro) for j in range(micro)]
    sq = lambda t: sum(float(np.sum(np.square(x, dtype=np.float64))) for x in jax.tree.leaves(t))  # noqa: E731
    grads = [grad(params, {k: v[r] for k, v in batch.items()}) for r in rows]
    small = np.mean([sq(g) for g in grads])
    full = sq(jax.tree.map(lambda *g: np.mean(g, axis=0), *grads))
    assert (int(metrics["micro_batch"]), int(metrics["batch"])) == (16 // micro, 16)
    assert float(metrics["micro_grad_sq"]) == pytest.approx(small, rel=1e-4)
    assert float(metrics["grad_norm"]) ** 2 == pytest.approx(full, rel=1e-4)
    # AdamW's preconditioner after this step's update, read by hand from the chain
    # (clip, adamw): v_hat = nu / (1 - b2^count), P = 1 / (sqrt(v_hat) + eps).
    adam = jax.device_get(new_state["opt"][1][0])
    assert isinstance(adam, optax.ScaleByAdamState) and int(adam.count) == 100
    b2, eps = cfg.optim.b2, cfg.optim.eps
    p_sq = jax.tree.map(lambda v: (1 / (np.sqrt(v.astype(np.float64) / (1 - b2**100)) + eps)) ** 2, adam.nu)
    weighted = lambda t: sum(float(np.sum(p * np.square(x, dtype=np.float64)))  # noqa: E731
                             for p, x in zip(jax.tree.leaves(p_sq), jax.tree.leaves(t), strict=True))
    assert float(metrics["precond_micro_grad_sq"]) == pytest.approx(
        np.mean([weighted(g) for g in grads]), rel=1e-4)
    assert float(metrics["precond_grad_sq"]) == pytest.approx(
        weighted(jax.tree.map(lambda *g: np.mean(g, axis=0), *grads)), rel=1e-4)
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
    assert {"micro_grad_sq", "precond_micro_grad_sq", "precond_grad_sq", "micro_batch", "batch"} <= set(asked)


def test_noise_every_computes_the_statistics_on_every_nth_step_only():
    """tuner.noise_every=3: steps 0, 3, ... return the statistics noise_every=1 returns
    from the same state; the others NaN (the loss and gradient norm are unchanged)."""
    cfg = mp.Config().replace(*TINY, "parallel.data=8", "parallel.tensor=1", "train.deterministic=true")
    layout = build_layout(cfg, lambda c: (lambda rngs: mp.GPT(c.model, rngs=rngs)))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (16, 33)).astype(np.int32)
    batch = layout.batches({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
    every1, _ = layout.compile()
    every3, _ = layout.compile(step=layout.make_step(cfg.replace("tuner.noise_every=3")))
    names = ("micro_grad_sq", "precond_micro_grad_sq", "precond_grad_sq")
    def state_at(step):  # a fresh state at ``step``, with Adam settled (count 99, v = 1e-4)
        state = init_train_state(layout.spec, layout.create, layout.tx, layout.mesh, 0, layout.shardings)
        state["step"] = jax.device_put(jnp.asarray(step, state["step"].dtype), state["step"].sharding)
        clip, (adam, *rest) = state["opt"]
        count = jax.device_put(jnp.int32(99), adam.count.sharding)
        # (with v = 0, as init leaves it, P is ~1/eps wherever this step's gradient is
        # ~0, and |P g_b|^2 is those few elements' ratios of rounding noise)
        nu = jax.tree.map(lambda v: jnp.full_like(v, 1e-4), adam.nu)
        state["opt"] = (clip, (adam._replace(count=count, nu=nu), *rest))
        return state

    for step in range(4):
        a = jax.device_get(every1(state_at(step), batch)[1])
        b = jax.device_get(every3(state_at(step), batch)[1])
        assert float(a["loss"]) == float(b["loss"]) and float(a["grad_norm"]) == float(b["grad_norm"])
        assert all(np.isfinite(float(a[k])) for k in names)
        if step % 3 == 0:
            # (equal up to rounding: the conditional changes what XLA fuses)
            assert [float(b[k]) for k in names] == pytest.approx([float(a[k]) for k in names], rel=1e-5)
        else:
            assert all(np.isnan(float(b[k])) for k in names)
    with pytest.raises(mp.ConfigError, match="tuner.noise_every=0 must be > 0"):
        mp.Config().replace("tuner.noise_every=0")


def test_pipeline_statistics_of_a_moe_model():
    """MoE through a 1F1B pipeline (pipe2 x data4, 2 microbatches) with the statistics: the
    step's two halves are its two microbatches, each the mean over the 4 data devices of
    the gradient of the MoE loss (routing, capacity and load-balancing loss) on that
    device's 2 rows. Checked against those gradients computed one by one on one device."""
    cfg = mp.Config().replace(*TINY, "model.n_experts=4", "model.top_k=2", "parallel.pipe=2",
                              "parallel.data=4", "parallel.tensor=1", "parallel.microbatches=2")
    layout = build_layout(cfg, lambda c: (lambda rngs: build_model(c.model, rngs)))
    state = init_train_state(layout.spec, layout.create, layout.tx, layout.mesh, 0, layout.shardings)
    tokens = np.random.default_rng(1).integers(0, 256, (16, 33)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    params = jax.device_get(state["params"])
    step, _ = layout.compile()
    _, metrics = step(state, layout.batches(batch))
    metrics = jax.device_get(metrics)

    grad = jax.jit(jax.grad(lambda p, b: model_loss(layout.spec, p, b, None)))
    sq = lambda t: sum(float(np.sum(np.square(x, dtype=np.float64))) for x in jax.tree.leaves(t))  # noqa: E731
    # Row k·2 + j is microbatch j's; the data devices split it into blocks of 2 rows.
    halves = []
    for j in range(2):
        rows = np.arange(j, 16, 2)
        per_device = [grad(params, {k: v[rows[2 * d:2 * d + 2]] for k, v in batch.items()}) for d in range(4)]
        halves.append(jax.tree.map(lambda *g: np.mean(g, axis=0), *per_device))
    assert int(metrics["micro_batch"]) == 8
    assert float(metrics["micro_grad_sq"]) == pytest.approx(np.mean([sq(g) for g in halves]), rel=1e-4)
    assert float(metrics["grad_norm"]) ** 2 == pytest.approx(
        sq(jax.tree.map(lambda *g: np.mean(g, axis=0), *halves)), rel=1e-4)
