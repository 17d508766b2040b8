"""FSDP inside the pipeline: weights stay sharded over fsdp going in, gradients leave
reduce-scattered, and they equal the unpipelined model's."""

import jax
import numpy as np
import pytest
from byom_models import reference_grads, tokens
from flax import nnx
from pipeline_oracle import assert_matches, microbatches, reference, tiny_gpt

from mindpipe_jax.config import Config, ParallelConfig
from mindpipe_jax.models import build_model
from mindpipe_jax.parallel.mesh import make_mesh
from mindpipe_jax.parallel.pipeline import get_schedule
from mindpipe_jax.parallel.pipeline.contract import stage_fns
from mindpipe_jax.parallel.pipeline.runtime import pipeline_grads
from mindpipe_jax.parallel.rules import state_shardings
from mindpipe_jax.train.reconfigure import build_layout
from mindpipe_jax.train.step import make_grad_fn


def _bytes_per_device(tree) -> int:
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def _nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("name,v,remat", [("1f1b", 1, False), ("zb-h1", 1, "full"),
                                          ("interleaved", 2, "dots")])
def test_pipe2_fsdp4_keeps_weights_and_gradients_sharded(name, v, remat):
    p, m = 2, 4
    model, params = tiny_gpt(2 * p * v)
    mesh = make_mesh(ParallelConfig(pipe=p, fsdp=4, data=1, tensor=1))
    storage = nnx.to_pure_dict(state_shardings(nnx.state(model, nnx.Param), mesh, "storage"))
    inputs, targets = microbatches(7, m, rows=8)
    ref_loss, ref_grads = reference(model, params, inputs, targets)
    params = jax.device_put(params, storage)
    run = pipeline_grads(stage_fns(model), get_schedule(name, p, m, v), mesh, remat=remat,
                         param_specs=storage, nan_bubbles=True)
    args = (params["embed"], params["blocks"], params["head"], inputs, targets)
    with jax.set_mesh(mesh):
        loss, grads = jax.jit(run)(*args)
    assert_matches(loss, grads, ref_loss, ref_grads)
    # Every gradient is sharded over fsdp as its weight is stored (nothing left gathered).
    # The layer axis is split over pipe as stored when stages hold contiguous layers
    # (interleaved chunks are not contiguous: there it comes back whole).
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(params),
                            strict=True):
        got, want = g.addressable_shards[0].data.shape, w.addressable_shards[0].data.shape
        assert got[1:] == want[1:] if v > 1 and path[0].key == "blocks" else got == want, path
    mlp = grads["blocks"]["mlp"]["w_in"]
    assert mlp.addressable_shards[0].data.nbytes * (8 if v == 1 else 4) == mlp.nbytes
    assert _bytes_per_device(grads["embed"]) * 4 == _nbytes(grads["embed"])


def test_without_specs_the_gradients_leave_gathered_over_fsdp():
    # The old behaviour, still what a caller without storage specs gets: each device
    # holds its stage's whole gradient (1/2 of the stack, not 1/8).
    p, m = 2, 4
    model, params = tiny_gpt(2 * p)
    mesh = make_mesh(ParallelConfig(pipe=p, fsdp=4, data=1, tensor=1))
    inputs, targets = microbatches(7, m, rows=8)
    run = pipeline_grads(stage_fns(model), get_schedule("1f1b", p, m), mesh, remat=False)
    with jax.set_mesh(mesh):
        _, grads = jax.jit(run)(params["embed"], params["blocks"], params["head"], inputs, targets)
    assert _bytes_per_device(grads["blocks"]) * 2 == _nbytes(grads["blocks"])


# ---- the train layout: the embedding and head split over pipe as well ------------------

def _layout_grads(*overrides):
    """The train layout's storage, its params and the train step's gradients on a
    fixed batch, for a tiny GPT (8 simulated devices)."""
    cfg = Config().replace("model.d_model=32", "model.n_layers=4", "model.n_heads=2", "model.seq_len=8",
                           "model.vocab_size=64", "train.global_batch=16", "train.seed=3", *overrides)
    layout = build_layout(cfg, lambda c: (lambda rngs: build_model(c.model, rngs)))
    params = jax.jit(layout.create, out_shardings=layout.spec.storage)()
    batch = tokens(5, 16)
    loss, grads, _ = jax.jit(make_grad_fn(layout.spec, cfg, layout.mesh))(params, batch, jax.random.key(0))
    with nnx.use_eager_sharding(False):
        want = reference_grads(build_model(cfg.model, nnx.Rngs(cfg.train.seed)), batch)
    return layout, params, (loss, grads), want


def _split_ways(x) -> int:
    return x.nbytes // x.addressable_shards[0].data.nbytes


@pytest.mark.parametrize("mesh_name,ways", [("pipe2xfsdp4", 8), ("pipe2xdata4", 2)])
def test_train_layout_keeps_the_embedding_and_head_split_over_pipe(mesh_name, ways):
    """Only the first stage embeds and only the last computes the head, but one SPMD
    program holds the same shapes everywhere: stored split over pipe (and fsdp), each
    device keeps 1/(pipe x fsdp) of them and of their Adam moments; the gradients still
    equal a plain one-device jax.value_and_grad."""
    axes = {"pipe2xfsdp4": ("parallel.fsdp=4", "parallel.data=1"),
            "pipe2xdata4": ("parallel.data=4", "parallel.fsdp=1")}[mesh_name]
    layout, params, got, want = _layout_grads("parallel.pipe=2", "parallel.tensor=1",
                                              "parallel.microbatches=4", *axes)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(got[1])[0], jax.tree.leaves(want[1]),
                            strict=True):
        # fp32: the pipeline sums microbatches and shards in another order (~1e-7).
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    ends = {k: v for k, v in params.items() if k in ("embed", "head")}
    matrices = [x for x in jax.tree.leaves(ends) if x.ndim >= 2]
    assert matrices and all(_split_ways(x) == ways for x in matrices), [
        (x.shape, x.sharding.spec) for x in matrices]
    # Adam's moments are kept as their parameters are.
    opt = jax.tree_util.tree_flatten_with_path(layout.abstract_state["opt"])[0]
    end_moments = [x for path, x in opt if x.ndim >= 2 and any(getattr(k, "key", None) in ("embed", "head")
                                                                for k in path)]
    assert len(end_moments) == 2 * len(matrices)
    for x in end_moments:
        shard = x.sharding.shard_shape(x.shape)
        assert np.prod(x.shape) == ways * np.prod(shard), (x.shape, x.sharding.spec)
    if mesh_name == "pipe2xfsdp4":  # every weight stored over fsdp is 1/8 on each device
        over_fsdp = [x for x in jax.tree.leaves(params) if "fsdp" in str(x.sharding.spec)]
        assert len(over_fsdp) > len(matrices)
        assert all(_split_ways(x) == 8 for x in over_fsdp), [
            (x.shape, x.sharding.spec) for x in over_fsdp if _split_ways(x) != 8]
