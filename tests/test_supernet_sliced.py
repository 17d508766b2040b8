"""Sliced SPara: subnets computed from slices of the shared weights, at (close to) their own size.

The oracle is a dense GPT written in plain JAX (no framework code; ``supernet_oracle.py``): built at the
subnet's own size from slices of the supernet's weights, differentiated with
``jax.value_and_grad``. The sliced path must give its loss and gradients (fp32, rtol
1e-5: the two sum in different orders), zero gradient outside the slices, the masked
path's values, the sequential reference's parameters after two steps, and a step
whose XLA FLOP count is within 1.25x of what the subnets cost at their own sizes.

Compiling dominates: the sliced programs are shared by the tests through the
``sliced_fn`` fixture (one per shape) and ``dense_grad`` (one per subnet size), and
the subnets are chosen so that few shapes cover the cases (a mixed subnet at its ladder
shape and its own, the smallest rounded up, the full size)."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from supernet_oracle import SHARED, _get, _slices, dense_grad, own_size, sequential_reference, small_weights

import mindpipe_jax as mp
from mindpipe_jax.config import ModelConfig, OptimConfig, ParallelConfig, SupernetConfig
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.parallel.mesh import make_mesh
from mindpipe_jax.supernet import (
    SlicedStep,
    SuperGPT,
    init_state,
    plan_sliced,
    reference_step,
    supernet_spec,
)
from mindpipe_jax.supernet.model import ladder
from mindpipe_jax.supernet.sliced import max_shapes, sliced_loss_and_grad
from mindpipe_jax.supernet.spara import state_shardings

# One xdist worker runs the file, so the programs its fixtures share are compiled once
# (pytest -n 2 --dist loadgroup, pyproject.toml), not once per worker.
pytestmark = pytest.mark.xdist_group("supernet_sliced")

CFG = ModelConfig(d_model=32, n_layers=2, n_heads=4, seq_len=32)  # head_dim 8, d_ff 128
WIDTHS = (16, 32, 64, 96, 128)  # five widths: a 4-level ladder rounds one of them up
OPS = ("gelu", "relu", "silu")


def make_tiny(rngs):
    return SuperGPT(CFG, ops=OPS, ffn_widths=WIDTHS, depths=(1, 2), rngs=rngs)


@pytest.fixture(scope="module")
def spec_create():
    return supernet_spec(make_tiny, 0)


@pytest.fixture(scope="module")
def params(spec_create):
    return jax.jit(spec_create[1])()


@pytest.fixture(scope="module")
def sliced_fn(spec_create):
    """The sliced loss and raveled gradient, one compiled program per shape (shared by the tests)."""
    return jax.jit(functools.partial(sliced_loss_and_grad, spec_create[0]), static_argnames="shape")


def _batch(rows=4, seed=0):
    toks = np.random.default_rng(seed).integers(0, 256, (rows, CFG.seq_len + 1)).astype(np.int32)
    return {"inputs": toks[:, :-1], "targets": toks[:, 1:]}


def check_against_reference(spec, sliced_fn, params, subnet, batch, shape):
    """The sliced path at ``shape`` vs the dense reference at the subnet's own size."""
    space = spec.space
    sizes = own_size(space, subnet)
    acts = [OPS[op] for _, op, _, _ in sizes]
    small = small_weights(params, space, subnet)
    want_loss, want = dense_grad(small, batch["inputs"], batch["targets"], tuple(acts))
    got_loss, flat = sliced_fn(params, subnet, batch, shape=shape)
    got = jax.tree.map(np.array, spec.unravel(flat))
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
    for name, path in SHARED.items():
        np.testing.assert_allclose(_get(got, path), want[name], rtol=1e-5, atol=1e-7, err_msg=name)
        _get(got, path)[...] = 0
    for size, want_layer in zip(sizes, want["layers"], strict=True):
        for name, (path, index) in _slices(*size).items():
            np.testing.assert_allclose(_get(got, path)[index], want_layer[name], rtol=1e-5, atol=1e-7,
                                       err_msg=f"layer {size[0]} {name}")
            _get(got, path)[index] = 0
    # Everything outside the subnet's slices: exactly zero gradient.
    rest = [jax.tree_util.keystr(p) for p, leaf in jax.tree_util.tree_leaves_with_path(got) if leaf.any()]
    assert not rest, rest
    return float(got_loss)


# --- the ladder --------------------------------------------------------------------------------------


def test_ladder_keeps_the_largest_and_rounds_up(spec_create):
    assert ladder(WIDTHS, 4) == (32, 64, 96, 128)  # 16 rounds up to 32
    assert ladder(WIDTHS, 5) == WIDTHS and ladder(WIDTHS, 9) == WIDTHS
    assert ladder(WIDTHS, 1) == (128,)  # one level: every subnet at full width
    assert ladder(range(1, 9), 4) == (2, 4, 6, 8)
    module = spec_create[0].module
    # depth 2; widths 16 and 64 -> max 64; heads 1 and 3 -> max 3 -> 3 (heads 1..4 fit 4 levels)
    assert module.own_shape(MIXED) == ((16, 1), (64, 3))
    assert module.sliced_shape(MIXED, 4) == ((64, 3), (64, 3))
    assert module.sliced_shape(SMALLEST, 4) == ((32, 1),)


def test_shapes_of_the_whole_space_are_the_ladder_bound(spec_create):
    """Every subnet of the space, through ``sliced_shape``: exactly depths x widths x heads
    shapes at 4 levels (the bound is met, not only respected), fewer at 2."""
    spec = spec_create[0]
    space, module = spec.space, spec.module
    subnets = np.array(list(itertools.product(*(range(c) for c in space.cardinalities))), np.int32)
    for levels, widths in ((4, 4), (2, 2)):
        shapes = {module.sliced_shape(s, levels) for s in space.canonical(subnets)}
        assert len(shapes) == 2 * widths * min(4, levels)
        assert max_shapes(module, levels) == len(shapes)


def _bad_step(spec_create):
    return SlicedStep(spec_create[0], make_mesh(ParallelConfig(subnet=1, data=1, tensor=1),
                                                devices=jax.devices()[:1]),
                      semantics="sync", subnets_per_step=2, vmap_width=1, virtual_shards=1, global_batch=2,
                      optim=OptimConfig(), total_steps=1, levels=0)


BAD = {
    "negative levels": (lambda _: SupernetConfig(ladder_levels=-1), "supernet.ladder_levels=-1 must be >= 0"),
    "override": (lambda _: mp.Config().replace("supernet.ladder_levels=-2"), "supernet.ladder_levels=-2"),
    "not an int": (lambda _: mp.Config().replace("supernet.ladder_levels=true"),
                   "supernet.ladder_levels=true"),
    "step with 0 levels": (_bad_step, "supernet.ladder_levels=0"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_ladder_is_a_one_line_config_error(spec_create, case):
    make, needle = BAD[case]
    with pytest.raises(ConfigError) as err:
        make(spec_create)
    assert needle in str(err.value) and "\n" not in str(err.value)


# --- the sliced forward/backward against the reference and the masked path ---------------------------

# [depth, op0, ffn0, heads0, op1, ffn1, heads1] with WIDTHS (16..128) and heads 1..4.
MIXED = np.array([1, 0, 0, 0, 1, 2, 2], np.int32)  # gelu/16/1 then relu/64/3: sliced at 64 x 3 in both
SMALLEST = np.array([0, 0, 0, 0, 0, 0, 0], np.int32)  # depth 1, gelu/16/1: width rounds up to 32
LARGEST = np.array([1, 1, 4, 3, 2, 4, 3], np.int32)  # relu/128/4, silu/128/4: the full size
# MIXED's sliced shape again (silu/64/3, gelu/32/2): two subnets of one shape share a round.
SAME_SHAPE = np.array([1, 2, 2, 2, 0, 1, 1], np.int32)


@pytest.mark.parametrize("name,subnet,shape", [
    ("mixed, ladder shape (one scan, masked inside the slice)", MIXED, ((64, 3), (64, 3))),
    ("mixed, its own shape (blocks of two sizes)", MIXED, ((16, 1), (64, 3))),
    ("smallest, rounded up", SMALLEST, ((32, 1),)),
])
def test_sliced_loss_and_grads_equal_a_dense_model_of_the_subnets_own_size(spec_create, params, sliced_fn,
                                                                            name, subnet, shape):
    check_against_reference(spec_create[0], sliced_fn, params, subnet, _batch(seed=1), shape)


def test_sliced_equals_masked(spec_create, params, sliced_fn):
    """The sliced path is the masked path's function, computed on slices: the same loss and
    gradients (fp32, rtol 1e-5: the full-size matmuls sum zeros in other orders)."""
    spec = spec_create[0]
    masked = jax.jit(spec.loss_and_grad)
    for subnet in (MIXED, SMALLEST):  # widths and heads masked inside their slices
        shape = spec.module.sliced_shape(subnet, 4)
        batch = _batch(seed=7)
        loss, grad = sliced_fn(params, subnet, batch, shape=shape)
        want_loss, want_grad = masked(params, subnet, batch)
        np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
        np.testing.assert_allclose(np.asarray(grad), np.asarray(want_grad), rtol=1e-5, atol=1e-8)
        assert float(jnp.abs(want_grad).max()) > 1e-3  # not a comparison of zeros


# --- the plan ----------------------------------------------------------------------------------------


def test_plan_groups_subnets_by_shape(spec_create):
    spec = spec_create[0]
    subs = np.stack([MIXED, SMALLEST, LARGEST, SMALLEST, MIXED])  # 5 subnets, 3 shapes
    plan = plan_sliced(spec, subs, "sync", 2, 4)
    rows = [(shape, r.tolist(), v.tolist()) for shape, r, v, _ in plan.rounds]
    k = len(subs)
    assert [r for _, r, _ in rows] == [[0, 4], [1, 3], [2, k]]  # one shape per round, padded
    assert all(len({plan.shapes[i] for i in r if i < k} | {s}) == 1 for s, r, _ in rows)
    assert plan.used.tolist() == spec.units(subs).any(0).tolist()
    causal = plan_sliced(spec, subs, "operator-causal", 2, 4)
    # 2 shares no unit with 0 (relu then silu vs gelu then relu): one wave of two shapes.
    # 1, 3 and 4 each read layer 0's gelu after the one before them: a wave each. Inside a
    # wave, one round per shape; the wave's units updated after its last round.
    assert causal.waves.tolist() == [0, 1, 0, 2, 3]
    ends = [(r.tolist(), end) for _, r, _, end in causal.rounds]
    assert ends == [([0, k], False), ([2, k], True), ([1, k], True), ([3, k], True), ([4, k], True)]


# --- the step: the sequential reference, programs per shape, cached ----------------------------------


@pytest.mark.parametrize("semantics,width", [("sync", 2), ("operator-causal", 1)])
def test_sliced_step_equals_the_sequential_reference(spec_create, semantics, width):
    """Two steps of 4 subnets of 2 shapes on subnet=2 x data=2 against ``reference_step``
    (one subnet after another, masked, no mesh): losses, norms, params and moments."""
    spec, create = spec_create
    optim = OptimConfig(lr=3e-3, warmup_steps=0, clip_norm=0.5, eps=1e-3)  # eps: see test_supernet.py
    mesh = make_mesh(ParallelConfig(subnet=2, data=2, tensor=1), devices=jax.devices()[:4])
    step = SlicedStep(spec, mesh, semantics=semantics, subnets_per_step=4, vmap_width=width, virtual_shards=4,
                      global_batch=8, optim=optim, total_steps=10, levels=4)
    subnets = np.stack([MIXED, SMALLEST, SAME_SHAPE, SMALLEST])
    plan = step.plan(subnets)
    assert len(set(plan.shapes)) == 2
    if width == 2:  # one round per shape: R = 4 slots, two subnets and two of padding each
        assert [r.tolist() for _, r, _, _ in plan.rounds] == [[0, 2, 4, 4], [1, 3, 4, 4]]
    state = jax.jit(lambda: init_state(spec, create()), out_shardings=state_shardings(mesh, spec))()
    start = spec.ravel(jax.jit(create)())
    ref = jax.tree.map(jnp.asarray, jax.jit(lambda: init_state(spec, create()))())
    for seed in (1, 2):
        batch = _batch(8, seed)
        state, metrics = step(state, plan, batch)
        ref, ref_metrics = reference_step(spec, ref, subnets, batch, semantics=semantics, optim=optim,
                                          total_steps=10)
        np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-6)
        np.testing.assert_allclose(metrics["grad_norm"], ref_metrics["grad_norm"], rtol=1e-5)
    got, want = spec.ravel(state["params"]), spec.ravel(ref["params"])
    assert float(jnp.abs(got - want).max()) < 1e-6
    assert float(jnp.abs(got - start).max()) > 3e-3  # training moved them: the comparison can fail
    assert np.array_equal(np.asarray(state["opt"]["count"]), np.asarray(ref["opt"]["count"]))
    np.testing.assert_allclose(state["opt"]["mu"], ref["opt"]["mu"], atol=1e-7)
    # One program per shape met plus start and finish, each compiled once for both steps;
    # the bound: 2 depths x 4 widths x 4 head counts + 2.
    assert step.programs == 2 + 2
    assert step.max_programs == 2 * 4 * 4 + 2
    assert all(fn._cache_size() == 1 for fn in step._rounds.values())


@pytest.mark.slow
def test_sequential_equals_training_the_subnets_one_after_another(spec_create):
    """The sliced ``sequential`` step (4 subnets of 2 shapes on subnet=2 x data=2, two steps)
    against ``sequential_reference``: the same losses and parameters (fp32; the step sums
    gradients over shards and devices in another order, and ``eps=1e-3`` keeps AdamW a
    smooth function of them, see test_supernet.py), one wave per subnet; and the framework's
    own loop (``reference_step``) lands on the same parameters."""
    spec, create = spec_create
    optim = OptimConfig(lr=3e-3, warmup_steps=0, clip_norm=0.5, eps=1e-3)
    mesh = make_mesh(ParallelConfig(subnet=2, data=2, tensor=1), devices=jax.devices()[:4])
    step = SlicedStep(spec, mesh, semantics="sequential", subnets_per_step=4, vmap_width=1, virtual_shards=4,
                      global_batch=8, optim=optim, total_steps=10, levels=4)
    subnets = np.stack([MIXED, SMALLEST, SAME_SHAPE, SMALLEST])
    plan = step.plan(subnets)
    # Every subnet reads the shared weights: a wave each.
    assert plan.waves.tolist() == [0, 1, 2, 3] and plan.num_rounds == 4
    batches = [_batch(8, seed) for seed in (1, 2)]
    start = jax.jit(create)()
    want, want_losses = sequential_reference(start, subnets, batches, optim, 10, spec.space, OPS)
    state = jax.jit(lambda: init_state(spec, create()), out_shardings=state_shardings(mesh, spec))()
    ref = jax.tree.map(jnp.asarray, jax.jit(lambda: init_state(spec, create()))())
    losses = []
    for batch in batches:
        state, metrics = step(state, plan, batch)
        losses += np.asarray(metrics["loss"]).tolist()
        ref, _ = reference_step(spec, ref, subnets, batch, semantics="sequential", optim=optim,
                                total_steps=10)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    got, want, loop = (np.asarray(spec.ravel(p)) for p in (state["params"], want, ref["params"]))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loop, want, rtol=1e-5, atol=1e-6)
    # The comparison can fail: training moved the params, and the one-update-per-step
    # semantics land elsewhere.
    assert float(np.abs(got - np.asarray(spec.ravel(start))).max()) > 3e-3
    for other in ("sync", "operator-causal"):
        ref = jax.tree.map(jnp.asarray, jax.jit(lambda: init_state(spec, create()))())
        for batch in batches:
            ref, _ = reference_step(spec, ref, subnets, batch, semantics=other, optim=optim, total_steps=10)
        assert float(np.abs(np.asarray(spec.ravel(ref["params"])) - want).max()) > 1e-3, other


def test_step_flops_are_within_1_25x_of_the_subnets_own(spec_create, params):
    """XLA's FLOP count of a sliced step (4 subnets of 3 shapes, one device, one shard; one
    counting program per shape)
    against the sum of each subnet's own dense model (the reference above, forward and
    backward) at the same batch."""
    spec, create = spec_create
    mesh = make_mesh(ParallelConfig(subnet=1, data=1, tensor=1), devices=jax.devices()[:1])
    rows = 4
    step = SlicedStep(spec, mesh, semantics="sync", subnets_per_step=4, vmap_width=1, virtual_shards=1,
                      global_batch=rows, optim=OptimConfig(), total_steps=10, levels=4)
    state = jax.eval_shape(lambda: init_state(spec, create()))
    batch = _batch(rows)

    def own_flops(subnet):
        small = small_weights(params, spec.space, subnet)
        acts = tuple(OPS[op] for _, op, _, _ in own_size(spec.space, subnet))
        lowered = dense_grad.lower(small, batch["inputs"], batch["targets"], acts)
        return float(lowered.compile().cost_analysis()["flops"])

    subnets = np.stack([LARGEST, MIXED, SMALLEST, SAME_SHAPE])
    own_cost = [own_flops(s) for s in subnets]
    own = sum(own_cost)
    got = step.flops(state, step.plan(subnets), batch)
    assert own <= got <= 1.25 * own, got / own
    # The bound tells sizes apart: every subnet at the largest's size would break it.
    assert 4 * own_cost[0] > 1.25 * own
