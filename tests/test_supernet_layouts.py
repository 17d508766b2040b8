"""SPara with fsdp and tensor: the subnets of a step split over ``subnet``, their batch over
``fsdp`` x ``data``, their matmuls over ``tensor``; the stored parameters split over fsdp
and tensor.

Each layout is checked against training the subnets with no framework code
(``supernet_oracle.sequential_reference``: dense GPTs of the subnets' own sizes in plain
JAX, optax's clipping and Adam): ``sequential`` on the sliced path and ``sync`` on the
masked one, losses and parameters after two steps at fp32 tolerance (the step sums over
shards, devices and tensor ranks in other orders; ``eps=1e-3`` keeps AdamW a smooth
function of the gradient, see test_supernet.py). The supernet's FFN candidates are smooth
activations: a relu's kink turns the other rounding of a tensor split into a different
gradient where a pre-activation sits at zero (seen: 6e-5 on one element).

Bitwise equality across device counts with fsdp and with a fixed tensor size is in
``test_supernet_determinism.py``."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from supernet_oracle import sequential_reference
from supernet_tiny import CFG, OPS, OPTIM, SUBNETS, make_tiny, tiny_batch

import mindpipe_jax as mp
from mindpipe_jax.config import ParallelConfig
from mindpipe_jax.parallel.collectives import axes_of, collectives, per_device_bytes
from mindpipe_jax.parallel.mesh import make_mesh
from mindpipe_jax.supernet import (
    SlicedStep,
    init_state,
    jit_step,
    make_spara_step,
    plan_step,
    search_checkpoint,
    supernet_spec,
    train_supernet,
)
from mindpipe_jax.supernet.spara import state_shardings

pytestmark = pytest.mark.xdist_group("supernet_layouts")

LAYOUTS = {"subnet2 x fsdp2 x data2": dict(subnet=2, fsdp=2, data=2),
           "subnet2 x data2 x tensor2": dict(subnet=2, data=2, tensor=2),
           "subnet2 x fsdp2 x tensor2": dict(subnet=2, fsdp=2, tensor=2)}


@pytest.fixture(scope="module")
def spec_create():
    return supernet_spec(make_tiny, 0)


def _mesh(layout):
    return make_mesh(ParallelConfig(**{"tensor": 1, **LAYOUTS[layout]}))


def _check_against_plain(spec, create, state, losses, semantics):
    batches = [tiny_batch(16, seed) for seed in (1, 2)]
    start = jax.jit(create)()
    want, want_losses = sequential_reference(start, SUBNETS, batches, OPTIM, 10, spec.space, OPS, semantics)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    got, want = (np.asarray(spec.ravel(p)) for p in (state["params"], want))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert float(np.abs(got - np.asarray(spec.ravel(start))).max()) > 3e-3  # training moved them


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["subnet2 x fsdp2 x data2", "subnet2 x data2 x tensor2"])
def test_sliced_sequential_on_fsdp_and_tensor_is_training_one_after_another(spec_create, layout):
    spec, create = spec_create
    mesh = _mesh(layout)
    step = SlicedStep(spec, mesh, semantics="sequential", subnets_per_step=4, vmap_width=1, virtual_shards=8,
                      global_batch=16, optim=OPTIM, total_steps=10, levels=4)
    plan = step.plan(SUBNETS)
    # A wave per subnet, one slot of the subnet axis's two padded: with tensor, the group
    # without a subnet computes the padding too (a branch would strand XLA's collectives).
    assert plan.num_waves == 4 and all(not valid[1] for _, _, valid, _ in plan.rounds)
    state = jax.jit(lambda: init_state(spec, create()), out_shardings=state_shardings(mesh, spec))()
    losses = []
    for seed in (1, 2):
        state, metrics = step(state, plan, tiny_batch(16, seed))
        losses += np.asarray(metrics["loss"]).tolist()
    _check_against_plain(spec, create, state, losses, "sequential")


@pytest.mark.slow
def test_masked_sync_on_subnet_fsdp_tensor_is_one_averaged_update(spec_create):
    spec, create = spec_create
    mesh = _mesh("subnet2 x fsdp2 x tensor2")
    step = make_spara_step(spec, mesh, semantics="sync", subnets_per_step=4, vmap_width=2, virtual_shards=8,
                           global_batch=16, optim=OPTIM, total_steps=10)
    jitted = jit_step(step, mesh, spec)
    plan = plan_step(spec, SUBNETS, "sync", 4)
    state = jax.jit(lambda: init_state(spec, create()), out_shardings=state_shardings(mesh, spec))()
    losses = []
    for seed in (1, 2):
        state, metrics = jitted(state, plan.arrays(), tiny_batch(16, seed))
        losses += np.asarray(metrics["loss"]).tolist()
    _check_against_plain(spec, create, state, losses, "sync")


def _device_bytes(tree) -> int:
    """Bytes of the parameters device 0 holds."""
    return sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(tree))


def test_stored_parameters_are_split_over_fsdp_and_tensor(spec_create):
    spec, create = spec_create
    mesh = _mesh("subnet2 x fsdp2 x tensor2")
    state = jax.jit(lambda: init_state(spec, create()), out_shardings=state_shardings(mesh, spec))()
    params = state["params"]
    total = sum(a.nbytes for a in jax.tree.leaves(params))
    # The weight matrices: 1/4 each (embed over fsdp; mlp, heads, vocab over tensor).
    matrices = (("blocks", "ffn", "w_in"), ("blocks", "attn", "qkv"), ("embed", "tokens"),
                ("head", "lm_head"))
    for path in matrices:
        leaf = params
        for key in path:
            leaf = leaf[key]
        assert leaf.addressable_shards[0].data.nbytes * 4 == leaf.nbytes, (path, leaf.sharding.spec)
    # Biases and norms stay whole (or split once): the whole stays below 0.3 of the model.
    assert _device_bytes(params) <= 0.3 * total, _device_bytes(params) / total
    # AdamW moments: 1/N of the raveled vector on each of the subnet x fsdp devices.
    assert state["opt"]["mu"].addressable_shards[0].data.size * 4 == state["opt"]["mu"].size


def test_tensor_splits_the_subnets_compute(spec_create):
    """XLA's per-device FLOPs of a sliced step (cost_analysis: one virtual shard, one round
    per shape) with tensor=2 against the same step with tensor=1: the matmuls are split
    over the tensor ranks, not repeated on each (measured 0.53; the exchange and the
    optimizer chunk, repeated per tensor rank, are the rest)."""
    spec, create = spec_create
    flops = {}
    for tensor in (1, 2):
        mesh = make_mesh(ParallelConfig(subnet=2, data=2, tensor=tensor), devices=jax.devices()[:4 * tensor])
        step = SlicedStep(spec, mesh, semantics="sync", subnets_per_step=4, vmap_width=2, virtual_shards=4,
                          global_batch=8, optim=OPTIM, total_steps=10, levels=1)  # one shape: the largest
        state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                             jax.eval_shape(lambda: init_state(spec, create())), state_shardings(mesh, spec))
        tokens = jax.ShapeDtypeStruct((8, CFG.seq_len), np.int32)
        flops[tensor] = step.flops(state, step.plan(SUBNETS), {"inputs": tokens, "targets": tokens})
    assert flops[2] <= 0.6 * flops[1], flops


@pytest.mark.slow
def test_train_supernet_on_subnet_fsdp_tensor_then_search(tmp_path):
    """The user's path: ``mindpipe supernet``'s config on subnet=2 x fsdp=2 x tensor=2,
    checkpointed, then ``mindpipe search`` on the saved (split) parameters restored onto
    another split of the batch (fsdp=1 x data=2): the same top-k, bit for bit (fsdp never
    changes the bits; tensor stays 2)."""
    overrides = ("model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.seq_len=32",
                 'data.source="synthetic"', "data.synthetic_tokens=65536", "train.steps=2",
                 "train.global_batch=16", "train.virtual_shards=4", "train.log_every=1",
                 "train.checkpoint_every=2", f"train.out_dir={tmp_path / 'run'}",
                 "parallel.subnet=2", "parallel.fsdp=2", "parallel.tensor=2", "parallel.data=1",
                 "parallel.simulate_cpu_devices=0", "supernet.subnets_per_step=4",
                 "supernet.search_population=4", "supernet.search_generations=1", "supernet.search_top_k=2",
                 "supernet.search_eval_batches=1")
    lines = []
    result = train_supernet(config=mp.Config().replace(*overrides), log=lines.append, checkpoint=True)
    assert "mesh subnet=2 x fsdp=2 x data=1 x tensor=2" in lines[0], lines[0]
    top = result.search.top
    assert len(top) == 2 and np.isfinite([t["loss"] for t in top]).all()
    w_in = result.state["params"]["blocks"]["ffn"]["w_in"]
    assert w_in.addressable_shards[0].data.nbytes * 4 == w_in.nbytes, w_in.sharding.spec
    again, _, step = search_checkpoint(tmp_path / "run", "parallel.fsdp=1", "parallel.data=2")
    assert step == 2
    assert [t["subnet"] for t in again.top] == [t["subnet"] for t in top]
    losses = [np.asarray([t["loss"] for t in run]).tobytes() for run in (again.top, top)]
    assert losses[0] == losses[1]


def test_tensor_ranks_reshuffle_the_raveled_gradient_once_per_round(spec_create):
    """The compiled masked step on subnet2 x data2 x tensor2: the all-to-alls among tensor
    ranks alone (the partitioner's reshuffle of tensor-split gradient leaves into the
    raveled vector) send about one round's raveled gradients, W x P x 4 bytes, per device
    and step: the shards are summed in the parameters' tree and raveled once (raveled per
    shard, they sent V/D = 4 times as much)."""
    spec, create = spec_create
    mesh = _mesh("subnet2 x data2 x tensor2")
    step = make_spara_step(spec, mesh, semantics="sync", subnets_per_step=4, vmap_width=2, virtual_shards=8,
                           global_batch=16, optim=OPTIM, total_steps=10)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         jax.eval_shape(lambda: init_state(spec, create())), state_shardings(mesh, spec))
    tokens = jax.ShapeDtypeStruct((16, CFG.seq_len), np.int32)
    plan = plan_step(spec, SUBNETS, "sync", 4)  # one round of 4 slots: W = 2 per subnet group
    hlo = jit_step(step, mesh, spec).lower(state, plan.arrays(), {"inputs": tokens, "targets": tokens})
    ops = collectives(hlo.compile().as_text())
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    within_tensor = [op for op in ops if op.kind == "all-to-all"
                     and axes_of(op, ids, mesh.axis_names) == frozenset({"tensor"})]
    sent = per_device_bytes(within_tensor, mesh.size)[0]
    one_round = 2 * spec.padded_size * 4
    assert 0.5 * one_round <= sent <= 1.25 * one_round, sent / one_round
