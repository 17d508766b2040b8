"""FSDP inside the pipeline: weights stay sharded over fsdp going in, gradients leave
reduce-scattered, and they equal the unpipelined model's."""

import jax
import pytest
from flax import nnx
from pipeline_oracle import assert_matches, microbatches, reference, tiny_gpt

from mindpipe_jax.config import ParallelConfig
from mindpipe_jax.parallel.mesh import make_mesh
from mindpipe_jax.parallel.pipeline import get_schedule
from mindpipe_jax.parallel.pipeline.contract import stage_fns
from mindpipe_jax.parallel.pipeline.runtime import pipeline_grads
from mindpipe_jax.parallel.rules import state_shardings


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
