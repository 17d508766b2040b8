"""SPara in one process (8 simulated CPU devices): the space, the sampler, the masking,
lazy AdamW, the wave plan, the vectorized step against the sequential loop, and the API.

Bitwise equality across 1/2/4/8 devices needs one process per device count: see
``test_supernet_determinism.py``.

Comparing with the reference loop: the SPara step sums gradients over virtual
shards and vmaps subnets, the loop takes ``jax.grad`` of the whole batch one
subnet at a time, so the two round differently (~1e-7). AdamW turns such a
difference into a full ``lr``-sized step on any element whose gradient is
rounding noise (``mu_hat / sqrt(nu_hat)`` is ±1 there), so those tests use
``optim.eps = 1e-3``: the update stays a smooth function of the gradient and
the comparison can be tight (1e-6, while parameters move by ~5e-3 and the two
semantics differ by ~1e-2).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from byom_models import TwoOpSupernet
from flax import nnx

import mindpipe_jax as mp
from mindpipe_jax.config import ModelConfig, OptimConfig, ParallelConfig, SupernetConfig
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.models.gpt import GPT
from mindpipe_jax.parallel.mesh import make_mesh
from mindpipe_jax.supernet import (
    Gene,
    Sampler,
    SuperGPT,
    causal_waves,
    init_state,
    jit_step,
    make_evaluator,
    make_spara_step,
    plan_step,
    reference_step,
    sample_subnets,
    sequential_waves,
    supernet_factory,
    supernet_spec,
    train_supernet,
)
from mindpipe_jax.supernet.spara import adamw, check_layout

CFG = ModelConfig(d_model=32, n_layers=2, n_heads=2, seq_len=32)
WIDTHS = (32, 64, 128)  # of d_ff = 128


def make_tiny(rngs):
    return SuperGPT(CFG, ops=("gelu", "relu", "silu"), ffn_widths=WIDTHS, depths=(1, 2), rngs=rngs)


@pytest.fixture(scope="module")
def spec_create():
    return supernet_spec(make_tiny, 0)


@pytest.fixture(scope="module")
def params(spec_create):
    return jax.jit(spec_create[1])()


def _batch(rows=16, seed=0):
    toks = np.random.default_rng(seed).integers(0, 256, (rows, CFG.seq_len + 1)).astype(np.int32)
    return {"inputs": toks[:, :-1], "targets": toks[:, 1:]}


# --- the space ----------------------------------------------------------------------------------


def test_space_reports_its_size_and_distinct_architectures(spec_create):
    space = spec_create[0].space
    assert [g.name for g in space.genes] == ["depth", "op0", "ffn0", "heads0", "op1", "ffn1", "heads1"]
    per_layer = 3 * 3 * 2  # ops x widths x heads
    assert space.size == 2 * per_layer ** 2
    # Brute force: every vector, canonicalised, gives the distinct architectures.
    grids = np.stack(np.meshgrid(*[np.arange(n) for n in space.cardinalities], indexing="ij"), -1)
    distinct = {tuple(v) for v in space.canonical(grids.reshape(-1, space.num_genes).astype(np.int32))}
    assert len(distinct) == space.num_architectures == per_layer + per_layer ** 2
    assert space.describe([0, 1, 2, 0, 2, 2, 1]) == "depth=1 relu/128/1"  # layer 1 is skipped


def test_largest_and_smallest(spec_create):
    space = spec_create[0].space
    assert space.largest([2, 1]).tolist() == [1, 2, 2, 1, 1, 2, 1]
    assert space.smallest([2, 1]).tolist() == [0, 2, 0, 0, 0, 0, 0]  # depth 1: layer 1 zeroed


def test_subnet_validation_names_the_gene(spec_create):
    space = spec_create[0].space
    with pytest.raises(ConfigError, match=r"gene 'ffn1' index 3 is out of range; valid: 0..2"):
        space.validate([1, 0, 0, 0, 0, 3, 0])
    with pytest.raises(ConfigError, match="integer vector of 7 choice indices"):
        space.validate([1, 0, 0])


# --- the sampler --------------------------------------------------------------------------------


def test_sampler_is_a_pure_function_of_seed_and_step(spec_create):
    space = spec_create[0].space
    a = sample_subnets(space, 3, 17, 8, "uniform")
    assert a.dtype == np.int32 and a.shape == (8, space.num_genes)
    assert np.array_equal(a, sample_subnets(space, 3, 17, 8, "uniform"))
    # No hidden state: drawing other steps first changes nothing.
    sampler = Sampler(space, 8, "uniform", seed=3)
    _ = [sampler(t) for t in range(5)]
    assert np.array_equal(sampler(17), a)
    assert not np.array_equal(a, sample_subnets(space, 3, 18, 8, "uniform"))
    assert not np.array_equal(a, sample_subnets(space, 4, 17, 8, "uniform"))
    assert np.array_equal(a, space.canonical(a))


def test_uniform_sampler_covers_every_choice(spec_create):
    space = spec_create[0].space
    draws = np.concatenate([sample_subnets(space, 0, t, 4, "uniform") for t in range(100)])
    for i, gene in enumerate(space.genes):
        assert set(draws[:, i]) == set(range(len(gene))), gene.name


def test_sandwich_is_largest_smallest_then_random(spec_create):
    space = spec_create[0].space
    ordered = [i for i, g in enumerate(space.genes) if g.ordered]
    seen_ops = set()
    for t in range(30):
        subs = sample_subnets(space, 0, t, 4, "sandwich")
        top = space.largest()
        assert np.array_equal(subs[0, ordered], top[ordered])
        assert np.array_equal(space.canonical(subs[1]), subs[1]) and subs[1, 0] == 0  # smallest depth
        assert subs[1, 2] == 0 and subs[1, 3] == 0  # smallest width and heads in layer 0
        seen_ops.add(int(subs[0, 1]))
    assert seen_ops == {0, 1, 2}  # the extremes still try every operator


# --- masking: a subnet is exactly the smaller network -------------------------------------------


def _perturb(params, path, index, scale=1.0):
    """A copy with random noise added at ``index`` of one leaf. (Random, not a constant
    shift: layer norm makes every row of a projection it feeds blind to a constant.)"""
    out = jax.tree.map(np.array, params)
    node = out
    for key in path[:-1]:
        node = node[key]
    part = node[path[-1]][index]
    node[path[-1]][index] = part + scale * np.random.default_rng(0).normal(size=part.shape)
    return out


def test_weights_a_subnet_does_not_choose_do_not_change_its_output(spec_create, params):
    spec = spec_create[0]
    loss = jax.jit(lambda p, s, b: spec.loss(p, b["inputs"], b["targets"], s))
    batch = _batch(4)
    subnet = np.array([0, 1, 1, 0, 2, 2, 1], np.int32)  # depth 1: relu, width 64, 1 head; layer 1 skipped
    base = loss(params, subnet, batch)
    unchosen = [
        (("blocks", "ffn", "w_in"), (0, 0)),              # another candidate of layer 0
        (("blocks", "ffn", "w_out"), (0, 2)),
        (("blocks", "ffn", "w_in"), (0, 1, slice(None), slice(64, None))),  # beyond width 64
        (("blocks", "ffn", "w_out"), (0, 1, slice(64, None))),
        (("blocks", "attn", "qkv"), (0, slice(None), slice(None), 1)),       # head 2 of 2
        (("blocks", "attn", "out"), (0, 1)),
        (("blocks", "ffn", "w_in"), (1,)),                 # the skipped layer
        (("blocks", "attn", "qkv"), (1,)),
        (("blocks", "ln1", "scale"), (1,)),
    ]
    for path, index in unchosen:
        assert np.asarray(loss(_perturb(params, path, index), subnet, batch)).tobytes() == \
            np.asarray(base).tobytes(), (path, index)
    for path, index in [(("blocks", "ffn", "w_in"), (0, 1, slice(None), slice(0, 64))),
                        (("blocks", "attn", "qkv"), (0, slice(None), slice(None), 0))]:
        assert abs(float(loss(_perturb(params, path, index, 0.5), subnet, batch)) - float(base)) > 1e-4


def test_a_full_width_subnet_equals_the_dense_gpt(spec_create, params):
    """depth 1, gelu candidate, width 64, both heads == the dense GPT with those weights."""
    spec = spec_create[0]
    dense_cfg = ModelConfig(d_model=32, n_layers=1, n_heads=2, seq_len=32, d_ff=64)
    dense = GPT(dense_cfg, rngs=nnx.Rngs(1))
    graphdef, state = nnx.split(dense, nnx.Param)
    d = nnx.to_pure_dict(state)
    p = jax.tree.map(np.asarray, params)
    d["embed"] = dict(p["embed"])
    d["head"] = p["head"]
    blk, ffn = p["blocks"], p["blocks"]["ffn"]
    d["blocks"]["ln1"] = {k: v[:1] for k, v in blk["ln1"].items()}
    d["blocks"]["ln2"] = {k: v[:1] for k, v in blk["ln2"].items()}
    d["blocks"]["attn"] = {k: v[:1] for k, v in blk["attn"].items()}
    d["blocks"]["mlp"] = {"w_in": ffn["w_in"][:1, 0, :, :64], "b_in": ffn["b_in"][:1, 0, :64],
                          "w_out": ffn["w_out"][:1, 0, :64], "b_out": ffn["b_out"][:1, 0]}
    batch = _batch(4)
    want = nnx.merge(graphdef, d).loss(batch["inputs"], batch["targets"])
    got = spec.loss(params, batch["inputs"], batch["targets"], np.array([0, 0, 1, 1, 0, 0, 0], np.int32))
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)


def test_candidate_gradients_are_dense_zero_exactly_where_unused(spec_create, params):
    spec = spec_create[0]
    grad = jax.jit(jax.grad(lambda p, s, b: spec.loss(p, b["inputs"], b["targets"], s)))
    batch = _batch(4)
    for subnet in (np.array([1, 2, 0, 1, 0, 2, 0], np.int32), np.array([0, 1, 2, 1, 0, 0, 0], np.int32)):
        g = grad(params, subnet, batch)["blocks"]["ffn"]
        touched = np.abs(np.asarray(g["w_in"])).sum(axis=(2, 3)) > 0  # per (layer, candidate)
        assert np.array_equal(touched, spec.units(subnet[None])[0]), subnet
        width = WIDTHS[subnet[2]]
        assert not np.asarray(g["w_in"])[0, subnet[1], :, width:].any()  # masked width: exactly zero


# --- lazy AdamW ---------------------------------------------------------------------------------


def test_lazy_adamw_is_optax_adamw_where_active_and_a_no_op_elsewhere(spec_create):
    spec = spec_create[0]
    optim = OptimConfig(lr=1e-2, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
    rng = np.random.default_rng(0)
    p0 = jnp.asarray(rng.normal(size=spec.padded_size), jnp.float32)
    grads = [jnp.asarray(rng.normal(size=spec.padded_size), jnp.float32) for _ in range(3)]
    opt = init_state(spec, None)["opt"]
    # optax masks weight decay per leaf: split the flat vector into decayed / not decayed leaves.
    dec = spec.decay_flat

    def split(x):
        return {"decay": x[dec], "keep": x[~dec]}

    tx = optax.adamw(optim.lr, b1=optim.b1, b2=optim.b2, eps=optim.eps, weight_decay=optim.weight_decay,
                     mask={"decay": True, "keep": False})
    q = split(p0)
    ox = tx.init(q)
    every = np.ones(spec.unit_grid, bool)
    p = p0
    for g in grads:
        p, opt = adamw(spec, p, g, opt, every, True, optim.lr, optim)
        updates, ox = tx.update(split(g), ox, q)
        q = optax.apply_updates(q, updates)
    assert 0 < dec.sum() < len(dec)
    for part in ("decay", "keep"):
        np.testing.assert_allclose(np.asarray(split(p)[part]), np.asarray(q[part]), rtol=1e-6, atol=1e-7)
    assert np.asarray(opt["count"]).tolist() == [3] * (spec.num_units + 1)
    # One unit and no shared params: everything else keeps its bits, its moments and its count.
    one = np.zeros(spec.unit_grid, bool)
    one[1, 2] = True
    p2, opt2 = adamw(spec, p, grads[0], opt, one, False, optim.lr, optim)
    moved = spec.unit_of == np.ravel_multi_index((1, 2), spec.unit_grid)
    assert np.array_equal(np.asarray(p2)[~moved], np.asarray(p)[~moved])
    assert np.array_equal(np.asarray(opt2["mu"])[~moved], np.asarray(opt["mu"])[~moved])
    assert (np.asarray(p2)[moved] != np.asarray(p)[moved]).all()
    assert np.asarray(opt2["count"]).sum() == np.asarray(opt["count"]).sum() + 1


def test_per_unit_values_expand_like_an_index_and_slices_update_like_the_whole(spec_create):
    """``expand`` (broadcasts, no gather) is ``values[unit_of]``; AdamW on one device's
    slice (``offset``) is the same slice of the whole update, bit for bit."""
    spec = spec_create[0]
    rng = np.random.default_rng(1)
    values = rng.normal(size=(3, spec.num_units + 1)).astype(np.float32)
    assert np.array_equal(np.asarray(spec.expand(values)), values[:, spec.unit_of])
    optim = OptimConfig(lr=1e-2, weight_decay=0.1)
    p, g, mu = (jnp.asarray(rng.normal(size=spec.padded_size), jnp.float32) for _ in range(3))
    opt = {"mu": mu, "nu": jnp.square(mu), "count": jnp.arange(spec.num_units + 1, dtype=jnp.int32)}
    mask = np.zeros(spec.unit_grid, bool)
    mask[0, 1] = mask[1, 2] = True
    whole_p, whole_opt = adamw(spec, p, g, opt, mask, True, optim.lr, optim)
    n = spec.padded_size // 8
    for start in (0, 3 * n, 7 * n):
        part = {"mu": opt["mu"][start:start + n], "nu": opt["nu"][start:start + n], "count": opt["count"]}
        got_p, got_opt = adamw(spec, p[start:start + n], g[start:start + n], part, mask, True, optim.lr,
                               optim, offset=jnp.int32(start))
        assert np.asarray(got_p).tobytes() == np.asarray(whole_p[start:start + n]).tobytes()
        assert np.asarray(got_opt["nu"]).tobytes() == np.asarray(whole_opt["nu"][start:start + n]).tobytes()


# --- the plan: waves and rounds -----------------------------------------------------------------


def test_causal_waves_follow_the_sequential_order():
    a, b, c = np.eye(3, dtype=bool)
    assert causal_waves(np.stack([a, a, b, b | a])).tolist() == [0, 1, 0, 2]
    assert causal_waves(np.stack([a, b, c])).tolist() == [0, 0, 0]
    assert causal_waves(np.stack([a, a, a])).tolist() == [0, 1, 2]
    assert causal_waves(np.stack([a, b, a | b, c, c])).tolist() == [0, 0, 1, 0, 1]
    # sequential: shared weights order every subnet after the one before; without any,
    # only unit conflicts would.
    assert sequential_waves(np.stack([a, b, c])).tolist() == [0, 1, 2]
    assert sequential_waves(np.stack([a, b, c]), shares_weights=False).tolist() == [0, 0, 0]


def test_every_supernet_here_shares_weights(spec_create):
    assert spec_create[0].shares_weights  # embedding, attention, norms and head


@pytest.mark.parametrize("slots", [1, 2, 4])
def test_causal_plan_runs_each_subnet_once_wave_by_wave(spec_create, slots):
    spec = spec_create[0]
    subnets = sample_subnets(spec.space, 0, 5, 8, "uniform")
    plan = plan_step(spec, subnets, "operator-causal", slots)
    k = len(subnets)
    rows = plan.slot_subnet[: int(plan.n_rounds)]
    valid = plan.slot_valid[: int(plan.n_rounds)]
    assert sorted(rows[valid].tolist()) == list(range(k))  # every subnet exactly once
    assert (rows[~valid] == k).all() and not plan.slot_valid[int(plan.n_rounds):].any()
    waves = [set(plan.waves[row[v]].tolist()) for row, v in zip(rows, valid, strict=True)]
    assert all(len(w) == 1 for w in waves)  # a round never mixes waves
    order = [w.pop() for w in waves]
    assert order == sorted(order)
    ends = [i for i in range(len(order)) if i + 1 == len(order) or order[i + 1] != order[i]]
    assert np.flatnonzero(plan.wave_end).tolist() == ends
    # Subnets of one wave never share a unit.
    units = spec.units(subnets)
    for w in range(plan.num_waves):
        members = units[plan.waves == w].reshape((plan.waves == w).sum(), -1)
        assert (members.sum(0) <= 1).all()


# --- the step against the sequential loop -------------------------------------------------------

# K = 4 subnets with a known conflict pattern: 0 and 2 use disjoint units, 1 shares
# layer 0's relu with 0, 3 shares layer 1's silu with 2 -> waves [0, 1, 0, 1].
SUBNETS = np.array([[1, 1, 2, 1, 0, 0, 0],
                    [1, 1, 0, 0, 1, 1, 1],
                    [1, 0, 1, 1, 2, 2, 0],
                    [1, 2, 2, 0, 2, 0, 1]], np.int32)


@pytest.mark.slow
@pytest.mark.parametrize("semantics", ["sync", "sequential", "operator-causal"])
def test_step_equals_the_sequential_reference(spec_create, semantics):
    spec, create = spec_create
    optim = OptimConfig(lr=3e-3, warmup_steps=0, clip_norm=0.5, eps=1e-3)
    mesh = make_mesh(ParallelConfig(subnet=2, data=4, tensor=1))
    step = make_spara_step(spec, mesh, semantics=semantics, subnets_per_step=4, vmap_width=2,
                           virtual_shards=8, global_batch=16, optim=optim, total_steps=10)
    jitted = jit_step(step, mesh, spec)
    plan = plan_step(spec, SUBNETS, semantics, 4)
    assert plan.waves.tolist() == {"sync": [0] * 4, "sequential": [0, 1, 2, 3],
                                   "operator-causal": [0, 1, 0, 1]}[semantics]
    batches = [_batch(16, seed) for seed in (1, 2)]
    # No scatter anywhere in the program: selection is one-hot and masks only.
    abstract = jax.eval_shape(lambda: init_state(spec, create()))
    hlo = jitted.lower(abstract, plan.arrays(), batches[0]).as_text()
    assert not re.search(r"scatter", hlo)

    state = jax.jit(lambda: init_state(spec, create()))()
    start = jax.tree.map(np.asarray, state)
    refs = {s: jax.tree.map(jnp.asarray, start) for s in ("sync", "sequential", "operator-causal")}
    for batch in batches:
        state, metrics = jitted(state, plan.arrays(), batch)
        for s in refs:
            refs[s], ref_metrics = reference_step(spec, refs[s], SUBNETS, batch, semantics=s, optim=optim,
                                                  total_steps=10)
            if s == semantics:
                np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-6)
                np.testing.assert_allclose(metrics["grad_norm"], ref_metrics["grad_norm"], rtol=1e-5)
    got, want = spec.ravel(state["params"]), spec.ravel(refs[semantics]["params"])
    assert float(jnp.abs(got - want).max()) < 1e-6
    assert np.array_equal(np.asarray(state["opt"]["count"]), np.asarray(refs[semantics]["opt"]["count"]))
    np.testing.assert_allclose(state["opt"]["mu"], refs[semantics]["opt"]["mu"], atol=1e-7)
    # The comparison can fail: training moved the params, and the other semantics lands elsewhere.
    assert float(jnp.abs(got - spec.ravel(start["params"])).max()) > 3e-3
    for other in set(refs) - {semantics}:
        assert float(jnp.abs(got - spec.ravel(refs[other]["params"])).max()) > 1e-3, other


@pytest.mark.parametrize("remat,policy", [("full", "policy=None"), ("dots", "policy=DotsSaveable(")])
def test_model_remat_is_the_supernets_block_policy(remat, policy):
    """model.remat=dots rematerialised the supernet's blocks fully (jax.checkpoint with no
    policy, as full does) before 2026-12-07; now each block's checkpoint carries the
    policy the GPT's blocks use, in the training loss and in the forward alike."""
    model = SuperGPT(dataclasses.replace(CFG, remat=remat), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    subnet, tokens = np.asarray(model.space.largest()), jnp.zeros((2, CFG.seq_len), jnp.int32)
    for run in (lambda m: m.loss(tokens, tokens, subnet), lambda m: m(tokens, jnp.asarray(subnet)).sum()):
        jaxpr = str(jax.make_jaxpr(lambda p, run=run: run(nnx.merge(graphdef, p)))(params))
        assert re.findall(r"policy=\S*", jaxpr) == [policy + ("only_if_no_batch_dims=True)" if remat == "dots"
                                                               else "")], jaxpr[:2000]


def test_a_supernet_built_by_the_caller_keeps_the_gpt_keys_of_its_config(tmp_path):
    """A SuperGPT the caller's factory builds from the config it passes reads model.remat:
    not refused as a user's supernet is."""
    cfg = mp.Config().replace("model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.seq_len=16",
                              "model.remat=full", "data.source=synthetic", "train.steps=1",
                              "train.global_batch=8", "train.progress=false", "train.tensorboard=false")
    result = mp.train_supernet(lambda rngs: SuperGPT(cfg.model, rngs=rngs), None, cfg, search=False, log=None)
    assert int(result.state["step"]) == 1


# --- bad input: one line naming the value and what is valid -------------------------------------


def _with_a_counter(rngs):
    supernet = TwoOpSupernet(rngs)
    supernet.calls = nnx.Param(jnp.zeros((), jnp.int32))  # a step counter kept as a Param
    return supernet


BAD = {
    "semantics config": (lambda: SupernetConfig(semantics="async"), "supernet.semantics='async'"),
    "semantics override": (lambda: mp.Config().replace("supernet.semantics=async"),
                           "'sync', 'sequential', 'operator-causal'"),
    "semantics renamed": (lambda: mp.Config().replace("supernet.semantics=causal"),
                          "supernet.semantics='causal' is now called 'operator-causal'"),
    "strategy": (lambda: sample_subnets(supernet_spec(make_tiny)[0].space, 0, 0, 4, "greedy"),
                 "supernet.strategy='greedy'"),
    "sandwich of one": (lambda: SupernetConfig(subnets_per_step=1), "sandwich strategy needs >= 2"),
    "ratio": (lambda: SupernetConfig(ffn_ratios=(0.5, 1.5)), "supernet.ffn_ratios=[0.5, 1.5]"),
    # A repeated candidate is the same subnet under two codes (sampled twice as often).
    "repeated op": (lambda: SupernetConfig(ops=("gelu", "relu", "gelu")),
                    "supernet.ops=['gelu', 'relu', 'gelu'] names 'gelu' more than once"),
    "repeated ratio": (lambda: SupernetConfig(ffn_ratios=(0.5, 0.5)), "names 0.5 more than once"),
    # Refused with the config: the search refused it after the whole supernet trained.
    "population of one": (lambda: mp.Config().replace("supernet.search_population=1"),
                          "supernet.search_population=1 must be >= 2"),
    # Which of the two conditions fails, and a batch that fits ("... and global_batch by it").
    "batch not in whole shards": (lambda: mp.train_supernet(config=mp.Config().replace(
        "train.global_batch=12", "parallel.subnet=4", "parallel.data=2", "parallel.tensor=1")),
        "train.global_batch=12 must be divisible by train.virtual_shards=8 (each subnet's batch is cut "
        "into that many fixed shards); e.g. 8 or 16"),
    "op name": (lambda: SuperGPT(CFG, ops=("gelu", "swish"), rngs=nnx.Rngs(0)), "'swish'"),
    "heads": (lambda: SuperGPT(CFG, heads=(1, 3), rngs=nnx.Rngs(0)), "model.n_heads=2"),
    "min depth": (lambda: supernet_factory(mp.Config().replace("supernet.min_depth=9")),
                  "supernet.min_depth=9"),
    "unordered gene": (lambda: Gene("w", (4, 2)), "smallest first"),
    # train.* keys a supernet run never reads: they were accepted and ignored.
    "accumulation": (lambda: mp.train_supernet(config=mp.Config().replace("train.grad_accum=2")),
                     "train.grad_accum=2 has no effect on a supernet run"),
    "non-finite policy": (lambda: mp.train_supernet(config=mp.Config().replace("train.nonfinite=skip")),
                          "train.nonfinite='skip' has no effect on a supernet run"),
    # The dense run's online tuner: `mindpipe supernet tuner.enabled=true` trained the
    # fixed layout without a word.
    "online tuner": (lambda: mp.train_supernet(config=mp.Config().replace("tuner.enabled=true")),
                     "tuner.enabled=true has no effect on a supernet run"),
    # model.* keys the supernet does not build with: it trained a dense supernet, silently.
    "experts": (lambda: mp.train_supernet(config=mp.Config().replace("model.n_experts=4")),
                "model.n_experts=4 has no effect on a supernet run"),
    # The search ranks subnets by validation loss (data.val_fraction=0 is for a dense run
    # that does not evaluate).
    "no validation split": (lambda: mp.train_supernet(config=mp.Config().replace("data.val_fraction=0")),
                            "data.val_fraction=0 leaves no validation data, and a supernet run ranks"),
    "collective matmul": (lambda: mp.train_supernet(config=mp.Config().replace(
        "model.collective_matmul=true", "parallel.tensor=2", "parallel.data=4")),
        "model.collective_matmul=true has no effect on a supernet run"),
    # A supernet of the user's own: the GPT's compute keys size nothing (a SuperGPT the
    # caller builds keeps them: test_a_supernet_built_by_the_caller_keeps_the_gpt_keys...).
    "GPT key on a user's supernet": (lambda: mp.train_supernet(TwoOpSupernet, None, mp.Config().replace(
        "model.remat=full")), "model.remat='full' has no effect on a model passed in"),
    # A parameter the step cannot differentiate (jax.grad raised a traceback).
    "integer Param": (lambda: supernet_spec(_with_a_counter), "the model has nnx.Param it cannot train: "
                                                             "calls (int32[])"),
    # XLA's CPU backend cannot lower the attention backward's float16 matmul.
    "float16 on CPU": (lambda: mp.train_supernet(config=mp.Config().replace("model.dtype=float16")),
                       "model.dtype=float16 does not compile on CPU devices"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_a_one_line_config_error(case):
    make, needle = BAD[case]
    with pytest.raises(ConfigError) as err:
        make()
    assert "\n" not in str(err.value) and needle in str(err.value), str(err.value)


def test_layout_errors_name_the_sizes(spec_create):
    spec = spec_create[0]
    mesh = make_mesh(ParallelConfig(subnet=8, data=1, tensor=1))
    with pytest.raises(ConfigError, match=r"subnets_per_step=4 must be divisible by parallel.subnet x "
                                          r"supernet.vmap_width = 8 x 1 = 8"):
        check_layout(mesh, subnets_per_step=4, vmap_width=1, virtual_shards=8, global_batch=16)
    with pytest.raises(ConfigError, match=r"over parallel.subnet, fsdp, data and tensor only; got pipe=2"):
        check_layout(make_mesh(ParallelConfig(subnet=1, data=2, pipe=2, tensor=2)), subnets_per_step=4,
                     vmap_width=1, virtual_shards=8, global_batch=16)
    with pytest.raises(ConfigError, match=r"train.virtual_shards=4 must be divisible by parallel.fsdp x "
                                          r"data = 8"):
        check_layout(make_mesh(ParallelConfig(subnet=1, fsdp=2, data=4, tensor=1)), subnets_per_step=4,
                     vmap_width=1, virtual_shards=4, global_batch=16)
    with pytest.raises(ConfigError, match=r"train.virtual_shards=4 must be divisible by parallel.fsdp x "
                                          r"data = 8"):
        check_layout(make_mesh(ParallelConfig(subnet=1, data=8, tensor=1)), subnets_per_step=4,
                     vmap_width=1, virtual_shards=4, global_batch=16)
    with pytest.raises(ConfigError, match=r"supernet.semantics='eventual'"):
        plan_step(spec, SUBNETS, "eventual", 2)


# --- the API: train, then search ----------------------------------------------------------------


@pytest.mark.slow
def test_train_supernet_then_search_under_a_parameter_budget():
    cfg = mp.Config().replace(
        "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.seq_len=32",
        'data.source="synthetic"', "data.synthetic_tokens=65536", "train.steps=4", "train.global_batch=16",
        "train.log_every=2", "parallel.subnet=4", "parallel.data=2", "parallel.simulate_cpu_devices=0",
        "supernet.subnets_per_step=4", "supernet.semantics=operator-causal", "supernet.search_population=6",
        "supernet.search_generations=2", "supernet.search_top_k=3", "supernet.search_max_params=26000",
        # The search under a budget, not slicing (test_supernet_sliced, and the sliced
        # trainer in test_supernet_determinism): masked, one program instead of ~10.
        "supernet.ladder_levels=0")
    lines = []
    result = train_supernet(config=cfg, log=lines.append)
    assert int(result.state["step"]) == 4 and [h["step"] for h in result.history] == [2, 4]
    assert all(np.isfinite(h["loss"]) and 1 <= h["waves"] <= 4 for h in result.history)
    assert dict(result.mesh.shape)["subnet"] == 4 and "search" in lines[-1]
    top = result.search.top
    assert len(top) == 3 and [t["loss"] for t in top] == sorted(t["loss"] for t in top)
    assert all(t["params"] <= 26000 for t in top)
    assert result.search.evaluated >= 6
    # The reported scores are what the evaluator gives for those subnets, bit for bit.
    from mindpipe_jax.data import eval_batches, load_tokens

    splits = load_tokens(cfg.data, cfg.model.vocab_size)
    val = eval_batches(splits.val, seq_len=32, batch_size=16, num_batches=cfg.supernet.search_eval_batches)
    batches = {k: np.stack([b[k] for b in val]) for k in ("inputs", "targets")}
    evaluate = make_evaluator(result.spec, result.mesh, vmap_width=1, virtual_shards=8, pad_to=6)
    again = evaluate(result.state["params"], np.asarray([t["subnet"] for t in top], np.int32), batches)
    assert again.tolist() == [np.float32(t["loss"]).item() for t in top]


# --- the command line ---------------------------------------------------------------------------


def test_cli_supernet_help_and_one_line_errors(capsys):
    from mindpipe_jax.cli import main

    assert main(["supernet", "--help"]) == 0
    out = capsys.readouterr().out
    assert "parallel.subnet" in out and "supernet.semantics=sequential" in out and "  supernet:" in out
    assert main(["supernet", "supernet.semantics=async"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "supernet.semantics='async'" in err
    assert "'sync', 'sequential', 'operator-causal'" in err
    # Checked against the mesh before anything is compiled or read.
    assert main(["supernet", "parallel.subnet=8", "parallel.data=1", "supernet.subnets_per_step=4",
                 'data.source="synthetic"']) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "supernet.subnets_per_step=4 must be divisible by parallel.subnet" in err
