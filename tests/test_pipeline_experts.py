"""Expert parallelism inside pipeline stages (``parallel.expert > 1`` with ``parallel.pipe
> 1``; refused until 2026-12-05): the expert devices are batch shards outside the MoE
layers, each holds its own experts, and tokens reach them by ``all_to_all``
(``parallel/pipeline/runtime/experts.py``)."""

import functools

import jax
import numpy as np
import pytest
from test_pipeline_dropout import MODEL, _assert_close, _grads, _reference

from mindpipe_jax.config import Config
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.models.moe import MoEGPT
from mindpipe_jax.parallel.mesh import make_mesh
from mindpipe_jax.train.pipeline_storage import split_ends_over_pipe
from mindpipe_jax.train.state import model_spec
from mindpipe_jax.train.step import make_grad_fn

MOE = ("model.n_experts=4", "model.top_k=2", "model.moe_aux_weight=0.5")


@pytest.mark.parametrize("layout,devices", [
    (("parallel.data=2", "parallel.tensor=1", "parallel.expert=2", "parallel.schedule=1f1b"), 4),
    # stages in lockstep (tensor), split backward (its B replays the all_to_all's transpose)
    (("parallel.data=1", "parallel.tensor=2", "parallel.expert=2", "parallel.schedule=zb-h1",
      'parallel.stage_remat=["full","dots"]'), 2),
    # fsdp-sharded experts gathered per chunk use, a V schedule, and AFAPAB's chunk-wise
    # sync: the ring averages the fsdp shards of the other weights over data x expert while
    # each chunk's expert weights are averaged at its sync point
    (("parallel.fsdp=2", "parallel.data=1", "parallel.tensor=1", "parallel.expert=2",
      "parallel.schedule=zbv", "parallel.virtual_stages=2", "parallel.fsdp_gather=chunk",
      "parallel.grad_sync=chunk"), 4),
    (("parallel.data=1", "parallel.tensor=1", "parallel.expert=4", "parallel.schedule=dualpipev",
      "parallel.virtual_stages=2"), 4),
    # pipe4: per-device branches hung here on XLA:CPU when a device could start the ring's
    # ppermute before its branch's all_to_all (now the tick's parts and transfers are chained)
    (("parallel.pipe=4", "parallel.data=1", "parallel.tensor=1", "parallel.expert=2",
      "parallel.schedule=zb-h1"), 2),
])
def test_experts_split_inside_stages_equal_the_per_unit_reference(layout, devices):
    """pipe2 (and pipe4) with the experts split over 2 or 4 devices per stage, dropout 0.2, capacity
    1.25 (tokens dropped, so routing groups matter) and a large aux weight: the loss and
    every gradient equal plain value_and_grad of the MoE GPT's own loss averaged over the
    units (one microbatch of one batch device: data x fsdp x expert), each routed as one
    group with its own dropout key."""
    key = jax.random.key(5)
    got = _grads("parallel.pipe=2", "parallel.microbatches=4", "model.dropout=0.2", *MOE, *layout,
                 key=key, model=MoEGPT)
    want = _reference(0.2, key, devices, 4, *MOE, build=functools.partial(MoEGPT, dispatch_groups=1))
    _assert_close(got, want)


def test_an_expert_axis_orders_the_tick_instead_of_lockstep():
    from mindpipe_jax.config import ParallelConfig
    from mindpipe_jax.parallel.pipeline.runtime import needs_lockstep
    from mindpipe_jax.parallel.pipeline.runtime.spmd import branch_collectives

    with_experts = make_mesh(ParallelConfig(pipe=2, data=2, expert=2, tensor=1))
    assert not needs_lockstep(with_experts) and branch_collectives(with_experts)
    dense = make_mesh(ParallelConfig(pipe=2, data=4, expert=1, tensor=1))
    assert not needs_lockstep(dense) and not branch_collectives(dense)
    assert needs_lockstep(make_mesh(ParallelConfig(pipe=2, data=1, expert=2, tensor=2)))


def test_a_stage_holds_only_its_experts():
    """pipe2 x expert2 x data2: each device stores 1 / (pipe x expert) of the expert weights
    and the compiled step sends tokens by all-to-all."""
    cfg = Config().replace(*MODEL, "train.global_batch=16", *MOE, "parallel.pipe=2", "parallel.expert=2",
                           "parallel.data=2", "parallel.tensor=1", "parallel.microbatches=2")
    mesh = make_mesh(cfg.parallel)
    with jax.set_mesh(None):
        spec, create = model_spec(lambda rngs: MoEGPT(cfg.model, rngs=rngs), mesh, 0)
    spec = split_ends_over_pipe(spec, cfg.model.seq_len, mesh)
    params = jax.jit(create, out_shardings=spec.storage)()
    for name in ("w_in", "w_out"):
        w = params["blocks"]["moe"][name]
        assert w.addressable_shards[0].data.size * 4 == w.size, (name, w.sharding.spec)
    tokens = np.zeros((16, 9), np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    hlo = jax.jit(make_grad_fn(spec, cfg, mesh)).lower(params, batch, jax.random.key(0)).compile().as_text()
    assert "all-to-all" in hlo


class _UsersMoE(MoEGPT):
    """A user's model with weights split over ``expert``: its layers are not the built-in
    MoE block the pipeline knows to hand each device its own experts."""


def test_a_users_layers_with_expert_split_weights_are_refused_through_a_pipeline():
    with pytest.raises(ConfigError) as err:
        _grads("parallel.pipe=2", "parallel.data=2", "parallel.tensor=1", "parallel.expert=2",
               "parallel.microbatches=2", *MOE, model=_UsersMoE)
    msg = str(err.value)
    assert "\n" not in msg and "model _UsersMoE" in msg and "parallel.expert=1" in msg, msg


def _sub_jaxprs(eqn):
    """The jaxprs nested in one equation (a scan's body, a cond's branches, a shard_map's)."""
    for value in eqn.params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            if isinstance(item, jax.extend.core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, jax.extend.core.Jaxpr):
                yield item


def _holds(eqn, name) -> bool:
    return any(e.primitive.name == name or _holds(e, name) for j in _sub_jaxprs(eqn) for e in j.eqns)


def _tick_bodies(jaxpr):
    """Every scan body that runs a tick: it has the ring's ppermutes at its top level."""
    for eqn in jaxpr.eqns:
        for sub in _sub_jaxprs(eqn):
            if eqn.primitive.name == "scan" and any(e.primitive.name == "ppermute" for e in sub.eqns):
                yield sub
            yield from _tick_bodies(sub)


def test_a_ticks_transfers_wait_for_every_branch_with_an_all_to_all():
    """The property that keeps pipe x expert from hanging on XLA:CPU: in the tick loop's
    body every ``ppermute`` (the ring's transfers) depends on the output of every part's
    branch that holds the MoE layer's ``all_to_all``, and those branches on each other,
    so every device issues them in one order (before the ordering, the forward's
    transfer depended on the forward's branch alone)."""
    cfg = Config().replace("model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.seq_len=16",
                           "model.vocab_size=64", "train.global_batch=8", *MOE, "parallel.pipe=2",
                           "parallel.data=2", "parallel.tensor=1", "parallel.expert=2",
                           "parallel.microbatches=2", "parallel.schedule=1f1b")
    mesh = make_mesh(cfg.parallel)
    with jax.set_mesh(None):
        spec, _ = model_spec(lambda rngs: MoEGPT(cfg.model, rngs=rngs), mesh, 0)
    spec = split_ends_over_pipe(spec, cfg.model.seq_len, mesh)
    batch = {k: jax.ShapeDtypeStruct((8, 16), np.int32) for k in ("inputs", "targets")}
    closed = jax.make_jaxpr(make_grad_fn(spec, cfg, mesh))(spec.abstract_params, batch, jax.random.key(0))
    bodies = list(_tick_bodies(closed.jaxpr))
    assert bodies
    for body in bodies:
        after: dict = {}  # var -> indices of the branch equations it depends on
        branches = []
        for i, eqn in enumerate(body.eqns):
            deps = set().union(*(after.get(v, set()) for v in eqn.invars
                                 if isinstance(v, jax.extend.core.Var)))
            if eqn.primitive.name == "cond" and _holds(eqn, "all_to_all"):
                assert set(branches) <= deps, "a part's branch does not wait for the previous one"
                branches.append(i)
                deps = deps | {i}
            if eqn.primitive.name == "ppermute":
                assert set(branches) <= deps and branches, "a transfer does not wait for the branches"
            for v in eqn.outvars:
                after[v] = deps
        assert len(branches) >= 2  # the forward's and the backward's parts
