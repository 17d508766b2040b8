"""The Mixture-of-Experts GPT: routing, capacity, load balancing, expert parallelism."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mindpipe_jax as mp
from mindpipe_jax.config import ModelConfig, ParallelConfig
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.models import build_model, flops_per_token
from mindpipe_jax.models.gpt import GPT
from mindpipe_jax.models.moe import MoEGPT, capacity, load_balancing_loss, moe_ffn, route
from mindpipe_jax.parallel.mesh import make_mesh
from mindpipe_jax.parallel.rules import spec_for
from mindpipe_jax.train.state import model_spec
from mindpipe_jax.train.step import BATCH_AXES, check_step_config, model_loss

# capacity_factor 1: with random routing some experts overflow, so the per-group
# capacity (and hence the grouping of rows) changes the result.
CFG = ModelConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4, n_experts=4,
                  top_k=2, capacity_factor=1.0)


def _batch(rows=16):
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, (rows, CFG.seq_len + 1)).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


@functools.cache
def _reference(top_k: int, groups: int):
    """Loss and gradients on one device, no mesh, routed in ``groups`` dispatch groups
    (one per batch shard of the mesh it is compared with): the oracle."""
    cfg = dataclasses.replace(CFG, top_k=top_k)
    with nnx.use_eager_sharding(False):
        model = MoEGPT(cfg, rngs=nnx.Rngs(0), dispatch_groups=groups)
    graphdef, params = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(params)

    def loss(p, b):
        return nnx.merge(graphdef, p).loss(b["inputs"], b["targets"])

    return params, jax.jit(jax.value_and_grad(loss))(params, _batch())


# 8 dispatch groups throughout: one per device, or (tensor=2: 4 batch shards) two
# per device, which also covers several groups inside one shard.
@pytest.mark.parametrize("axes,top_k", [
    (dict(expert=2, data=4), 2),
    (dict(expert=4, data=2), 1),
    (dict(expert=2, data=2, fsdp=2), 2),
    (dict(expert=2, data=2, tensor=2), 2),
], ids=["e2xd4", "e4xd2-top1", "e2xd2xf2", "e2xd2xt2"])
def test_expert_parallel_loss_and_grads_equal_one_device(axes, top_k):
    mesh = make_mesh(ParallelConfig(**{"tensor": 1, **axes}))
    cfg = dataclasses.replace(CFG, top_k=top_k)
    shards = int(np.prod([mesh.shape[a] for a in BATCH_AXES]))
    groups = None if shards == 8 else 8  # None: one group per batch shard, the default
    spec, _ = model_spec(lambda r: MoEGPT(cfg, rngs=r, dispatch_groups=groups), mesh, seed=0)
    host_params, (want_loss, want_grads) = _reference(top_k, 8)
    params = jax.device_put(host_params, spec.storage)
    w_in = params["blocks"]["moe"]["w_in"]  # [layers, experts, embed, mlp]: experts split
    assert w_in.sharding.shard_shape(w_in.shape)[1] == cfg.n_experts // mesh.shape["expert"]
    batch = jax.device_put(_batch(), NamedSharding(mesh, P(BATCH_AXES)))
    with jax.set_mesh(mesh):
        step = jax.jit(jax.value_and_grad(lambda p, b: model_loss(spec, p, b, None)))
        compiled = step.lower(params, batch).compile()
    # The tokens travel to their experts' devices (and back): no weight all-gather instead.
    assert "all-to-all" in compiled.as_text()
    loss, grads = compiled(params, batch)
    # fp32, the same groups and capacities as the reference: only the summation order
    # differs (per-device partial sums, psum/pmean, tensor-split contractions), ~1e-7.
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    router = np.asarray(grads["blocks"]["moe"]["router"])
    assert np.abs(router).max() > 1e-6  # the gates carry gradient to the router
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * float(np.abs(want).max() + 1))


# bfloat16 compute with the weights in float32: the gradient of a weight cast inside
# the MoE layer's shard_map (manual over the batch axes, tensor automatic) was summed
# over the batch devices in bfloat16, and XLA's CPU compiler aborted the process on that
# all-reduce (SIGABRT, "Invalid binary instruction opcode copy") before 2026-12-07. The
# weights now vary over the batch devices before the cast: the sum is in float32.
@pytest.mark.parametrize("axes", [dict(data=4, tensor=2), dict(expert=2, data=2, tensor=2)],
                         ids=["d4xt2", "e2xd2xt2"])
def test_bfloat16_experts_compile_and_track_the_float32_gradients(axes):
    mesh = make_mesh(ParallelConfig(**axes))
    cfg = dataclasses.replace(CFG, dtype="bfloat16")
    spec, _ = model_spec(lambda r: MoEGPT(cfg, rngs=r, dispatch_groups=8), mesh, seed=0)
    host_params, (want_loss, want_grads) = _reference(CFG.top_k, 8)  # float32, one device
    params = jax.device_put(host_params, spec.storage)
    batch = jax.device_put(_batch(), NamedSharding(mesh, P(BATCH_AXES)))
    with jax.set_mesh(mesh):
        loss, grads = jax.jit(jax.value_and_grad(lambda p, b: model_loss(spec, p, b, None)))(params, batch)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-3)
    # Each weight's gradient within 3% (in norm) of float32's: measured <= 1.7% on both
    # meshes; the same model in bfloat16 on one device, whose batch sums stay in
    # bfloat16, is up to 8.5% off (the MoE weights, ln2), so a bfloat16 sum would show.
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        assert got.dtype == jnp.float32
        assert np.linalg.norm(got - want) <= 0.03 * np.linalg.norm(want)


def test_route_drops_over_capacity_in_priority_order():
    # 6 tokens, 3 experts, top-2, capacity 2. First choices in token order take the
    # slots first: e0 <- t0, t1 (t2 dropped), e1 <- t3, t5, e2 <- t4. Then second
    # choices: only t1 -> e2 finds a free slot.
    top_idx = jnp.array([[[0, 1], [0, 2], [0, 1], [1, 0], [2, 0], [1, 2]]])
    gates = jnp.full((1, 6, 2), 0.5)
    dispatch, combine, kept = route(top_idx, gates, n_experts=3, cap=2)
    want = np.array([[1, 0], [1, 1], [0, 0], [1, 0], [1, 0], [1, 0]], bool)
    np.testing.assert_array_equal(kept[0], want)
    assert int((~kept).sum()) == 6  # t2 entirely; the second choices of t0, t2, t3, t4, t5
    assert dispatch[0, 1, 2, 1] == 1  # t1's second choice: expert 2, slot 1
    assert float(dispatch[0].sum(0).max()) == 1.0  # no slot holds two tokens
    np.testing.assert_array_equal(dispatch[0].sum((1, 2)), want.sum(1))  # dropped: no slot
    np.testing.assert_allclose(combine[0].sum((1, 2)), 0.5 * want.sum(1))


def test_tokens_over_capacity_get_zero_output():
    # Every token prefers expert 0 (positive inputs, only router column 0 non-zero).
    d, f, e = 8, 16, 4
    x = jnp.abs(jax.random.normal(jax.random.key(0), (2, 4, d))) + 0.1
    router = jnp.zeros((d, e)).at[:, 0].set(1.0)
    w_in = jax.random.normal(jax.random.key(1), (e, d, f))
    w_out = jax.random.normal(jax.random.key(2), (e, f, d))
    for groups, kept_rows in ((1, [0, 1]), (2, [0, 4])):
        # 8 tokens (4 per group with 2 groups), top-1, capacity_factor 1:
        # capacity ceil(8/4) = 2 (ceil(4/4) = 1 per group) -> the first 2 (1 per group) keep.
        y, _ = jax.jit(functools.partial(moe_ffn, top_k=1, capacity_factor=1.0, groups=groups,
                                         dtype=jnp.float32))(router, w_in, w_out, x)
        nonzero = np.flatnonzero(np.abs(np.asarray(y).reshape(8, d)).sum(-1) > 0)
        assert list(nonzero) == kept_rows, (groups, nonzero)
    assert capacity(8, 4, 1, 1.0) == 2 and capacity(10, 4, 2, 1.25) == 7 and capacity(4, 2, 2, 9.0) == 4


def test_load_balancing_loss_by_hand():
    rng = np.random.default_rng(3)
    d, e = 8, 4
    x = rng.normal(size=(2, 8, d)).astype(np.float32)
    router = rng.normal(size=(d, e)).astype(np.float32)
    w_in, w_out = np.zeros((e, d, 16), np.float32), np.zeros((e, 16, d), np.float32)
    ffn = functools.partial(moe_ffn, top_k=2, capacity_factor=1.0, groups=2, dtype=jnp.float32)
    _, aux = jax.jit(ffn)(router, w_in, w_out, x)
    logits = x.reshape(-1, d).astype(np.float64) @ router
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    f = np.bincount(probs.argmax(-1), minlength=e) / len(probs)
    assert f.max() < 1  # a non-trivial routing
    np.testing.assert_allclose(aux, e * np.sum(f * probs.mean(0)), rtol=1e-5)
    # All tokens on one expert with a uniform router: E * (1 * 1/E) = 1.
    uniform = jnp.full((16, e), 1 / e)
    np.testing.assert_allclose(load_balancing_loss(uniform, jnp.zeros(16, jnp.int32)), 1.0, rtol=1e-6)
    # Fully confident and all on expert 0: E * 1 * 1 = E, the worst case.
    onehot = jax.nn.one_hot(jnp.zeros(16, jnp.int32), e)
    np.testing.assert_allclose(load_balancing_loss(onehot, jnp.zeros(16, jnp.int32)), e, rtol=1e-6)


def test_aux_loss_is_added_with_its_weight():
    cfg = dataclasses.replace(CFG, moe_aux_weight=0.5)
    with nnx.use_eager_sharding(False):
        model = MoEGPT(cfg, rngs=nnx.Rngs(0))
    b = _batch(4)

    @jax.jit
    def parts(inputs, targets):
        h, aux = model.run_blocks(model.embed(inputs))
        return model.loss(inputs, targets), model.head.loss(h, targets), aux

    loss, ce, aux = parts(b["inputs"], b["targets"])
    assert 0.0 < float(aux) < cfg.n_experts  # about 1 balanced, E = everything on one expert
    np.testing.assert_allclose(loss, ce + 0.5 * aux, rtol=1e-6)


def test_build_model_and_flops():
    with nnx.use_eager_sharding(False):
        assert isinstance(nnx.eval_shape(lambda: build_model(CFG, nnx.Rngs(0))), MoEGPT)
        dense_model = nnx.eval_shape(lambda: build_model(ModelConfig(d_model=32, n_heads=2), nnx.Rngs(0)))
        assert isinstance(dense_model, GPT)
    dense = ModelConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4)
    one = dataclasses.replace(dense, n_experts=1, top_k=1)
    # One expert, top-1: the dense MLP's work plus the router's d x 1 matmul per layer.
    assert flops_per_token(one) - flops_per_token(dense) == 6 * dense.n_layers * dense.d_model
    # Active parameters: top_k expert MLPs per token, whatever the number of experts.
    eight = dataclasses.replace(dense, n_experts=8, top_k=2)
    d, ff, layers = dense.d_model, dense.ff_dim, dense.n_layers
    assert flops_per_token(eight) - flops_per_token(dense) == 6 * layers * (2 * d * ff + 8 * d)


def test_batch_axes_include_expert():
    # The loader shards batches by P(BATCH_AXES) and the model's activations by the
    # rules' "batch": both must split over the expert devices, the same way.
    assert spec_for(("batch",), "compute") == P(BATCH_AXES) == P(("data", "fsdp", "expert"))
    mesh = make_mesh(ParallelConfig(expert=2, data=4, tensor=1))
    sharding = NamedSharding(mesh, P(BATCH_AXES))
    # Each of the 8 devices gets its own 2 rows: the expert devices split the batch too.
    rows = {idx[0].indices(16) for idx in sharding.devices_indices_map((16, CFG.seq_len)).values()}
    assert len(rows) == 8 and all(stop - start == 2 for start, stop, _ in rows)


def _cfg(*overrides):
    return mp.Config().replace("parallel.simulate_cpu_devices=0", *overrides)


def test_expert_axis_refusals():
    dense = _cfg("parallel.expert=2", "parallel.data=4", "parallel.tensor=1")
    with pytest.raises(ConfigError, match="parallel.expert=2.*model.n_experts") as err:
        check_step_config(dense, make_mesh(dense.parallel))
    assert "\n" not in str(err.value)
    odd = _cfg("model.n_experts=6", "parallel.expert=4", "parallel.data=2", "parallel.tensor=1")
    with pytest.raises(ConfigError, match="model.n_experts=6 must be divisible by parallel.expert=4"):
        check_step_config(odd, make_mesh(odd.parallel))
    exact = _cfg("model.n_experts=4", "parallel.pipe=2", "parallel.expert=2", "parallel.data=2",
                 "parallel.tensor=1", "parallel.microbatches=4", "train.deterministic=true")
    with pytest.raises(ConfigError, match="deterministic mode splits only the batch.*expert=2") as err:
        check_step_config(exact, make_mesh(exact.parallel))
    assert str(err.value).endswith("; got expert=2; set parallel.expert=1")
    with pytest.raises(ConfigError, match="model.top_k=5 must be >= 1 and <= model.n_experts=4"):
        _cfg("model.n_experts=4", "model.top_k=5")
    with pytest.raises(ConfigError, match="model.capacity_factor=0.0 must be > 0"):
        _cfg("model.n_experts=4", "model.capacity_factor=0.0")
    with pytest.raises(ConfigError, match="model.n_experts=-1"):
        _cfg("model.n_experts=-1")


def test_train_moe_with_expert_parallelism(tmp_path):
    result = mp.train(None, None, mp.Config(), "model.n_experts=4", "parallel.expert=2",
                      "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.seq_len=32",
                      "train.global_batch=16", "train.steps=12", "train.log_every=4", "train.eval_every=0",
                      "optim.lr=1e-2", "optim.warmup_steps=0", "train.progress=false",
                      "train.tensorboard=false", "parallel.simulate_cpu_devices=0",
                      f"train.out_dir={tmp_path / 'run'}")
    assert result.mesh.shape["expert"] == 2
    losses = [h["loss"] for h in result.history if "loss" in h]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.3, losses
    w_in = result.state["params"]["blocks"]["moe"]["w_in"]
    assert w_in.sharding.shard_shape(w_in.shape)[1] == 2  # 4 experts, 2 per expert device


@pytest.mark.parametrize("schedule,v,remat", [("1f1b", 1, "none"), ("interleaved", 2, "full"),
                                              ("zb-h1", 1, "none")])
def test_moe_through_the_pipeline_equals_a_plain_reference(schedule, v, remat):
    """pipe=2 (data=1): the MoE blocks' load-balancing losses ride to the last stage with
    the hidden state (unit_wrappers.carrying_aux). Loss and every gradient equal a plain
    jax.value_and_grad of the mean over microbatches of MoEGPT's own loss (CE +
    moe_aux_weight x the layers' mean aux), each microbatch routed on its own, as the
    stages route it; written here with no framework code. The aux weight is large so
    that a missing aux gradient would show."""
    from mindpipe_jax.parallel.pipeline import get_schedule
    from mindpipe_jax.parallel.pipeline.contract import PipelineModel
    from mindpipe_jax.parallel.pipeline.runtime import pipeline_grads

    cfg = ModelConfig(vocab_size=64, seq_len=8, d_model=32, n_layers=4, n_heads=2, n_experts=4, top_k=2,
                      moe_aux_weight=0.5)
    model = MoEGPT(cfg, rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    graphdef = nnx.graphdef(model)
    m = 4
    tokens = np.random.default_rng(3).integers(0, 64, (m, 4, 9)).astype(np.int32)
    inputs, targets = tokens[..., :-1], tokens[..., 1:]

    def reference(prm):
        per = [nnx.merge(graphdef, prm).loss(inputs[i], targets[i]) for i in range(m)]
        return sum(per) / m
    want_loss, want = jax.jit(jax.value_and_grad(reference))(params)

    piped = PipelineModel(model, params, lambda p: nnx.merge(graphdef, p), inputs[0])
    mesh = make_mesh(ParallelConfig(pipe=2, data=1, tensor=1), devices=jax.devices()[:2])
    run = pipeline_grads(piped.fns, get_schedule(schedule, 2, m, v), mesh, remat=remat)
    embed_p, stack, head_p = piped.split(params)
    with jax.set_mesh(mesh):
        loss, grads = jax.jit(run)(embed_p, stack, head_p, inputs, targets)
    got = piped.merge_grads(params, grads["embed"], grads["blocks"], grads["head"])
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    aux = jax.tree_util.tree_flatten_with_path(want)[0]
    for (path, w), g in zip(aux, jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))

    def without_aux(prm):  # the same model's loss with its aux term dropped
        def one(i):
            mdl = nnx.merge(graphdef, prm)
            return mdl.head.loss(mdl.run_blocks(mdl.embed(inputs[i]))[0], targets[i])
        return sum(one(i) for i in range(m)) / m
    plain = jax.jit(jax.grad(without_aux))(params)
    # The aux loss moves the router's gradient far beyond the tolerance above: a pipeline
    # that dropped it would fail the comparison.
    moved = np.abs(np.asarray(want["blocks"]["moe"]["router"]) - np.asarray(plain["blocks"]["moe"]["router"]))
    assert moved.max() > 1e-3, moved.max()


def test_train_moe_through_a_pipeline(tmp_path):
    """`mindpipe train` of an MoE model on pipe2 x data4: it runs through the vPipe
    runtime (each batch device routes its microbatch's rows) and learns."""
    result = mp.train(None, None, mp.Config(), "model.n_experts=4", "parallel.pipe=2", "parallel.data=4",
                      "parallel.tensor=1", "parallel.microbatches=2", "model.d_model=32", "model.n_layers=2",
                      "model.n_heads=2", "model.seq_len=32", "train.global_batch=16", "train.steps=12",
                      "train.log_every=4", "train.eval_every=0", "optim.lr=1e-2", "optim.warmup_steps=0",
                      "train.progress=false", "train.tensorboard=false", "parallel.simulate_cpu_devices=0",
                      f"train.out_dir={tmp_path / 'run'}")
    assert result.mesh.shape["pipe"] == 2
    losses = [h["loss"] for h in result.history if "loss" in h]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.3, losses


class _AuxUndeclared(MoEGPT):
    """An MoE model whose pipeline contract forgets ``aux_weight``: its blocks still return
    (hidden, aux)."""

    def pipeline_parts(self):
        return dataclasses.replace(super().pipeline_parts(), aux_weight=None)


def test_units_returning_aux_without_aux_weight_are_refused_in_one_line(tmp_path):
    cfg = mp.Config().replace(
        "model.n_experts=4", "parallel.pipe=2", "parallel.data=4", "parallel.tensor=1",
        "parallel.microbatches=2", "model.d_model=32", "model.n_layers=2", "model.n_heads=2",
        "model.seq_len=32", "train.global_batch=16",
        "train.steps=1", "train.progress=false", "train.tensorboard=false", "parallel.simulate_cpu_devices=0",
        f"train.out_dir={tmp_path / 'run'}")
    model = _AuxUndeclared(cfg.model, rngs=nnx.Rngs(0))
    with pytest.raises(ConfigError) as err:
        mp.train(model, None, cfg)
    msg = str(err.value)
    assert "\n" not in msg and "_AuxUndeclared.blocks: a unit returned tuple" in msg, msg
    assert "needs PipelineParts(aux_weight=...)" in msg, msg
    assert not (tmp_path / "run").exists()  # refused before anything was written
