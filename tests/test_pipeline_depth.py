"""A pipeline that runs only the stack's first layers (``pipeline_grads(active_layers=)``,
what a shallow subnet needs): its loss and gradients equal the shallow model's, one
device, no pipeline, with zero gradients for the layers it skips."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pipeline_oracle import assert_matches, microbatches, reference, tiny_gpt

from mindpipe_jax.config import ParallelConfig
from mindpipe_jax.parallel.mesh import make_mesh
from mindpipe_jax.parallel.pipeline import get_schedule
from mindpipe_jax.parallel.pipeline.contract import stage_fns
from mindpipe_jax.parallel.pipeline.runtime import StageLayout, pipeline_grads

# p=2, two layers per chunk: depth 3 stops inside stage 1 (chunk 1 for v=2), depth 1
# leaves stage 1 with nothing to run. tensor=2 runs the stages in lockstep (skipped
# layers computed and dropped); the others skip them under a cond.
DATA = dict(data=-1, tensor=1)
CASES = [("1f1b", 4, 1, 3, DATA, False), ("1f1b", 4, 1, 1, DATA, True), ("zb-h1", 4, 1, 3, DATA, True),
         ("interleaved", 4, 2, 5, DATA, False), ("1f1b", 4, 1, 3, dict(data=2, tensor=2), True)]
IDS = ["1f1b-d3", "1f1b-d1-remat", "zbh1-d3-remat", "interleaved-v2-d5", "1f1b-d3-tensor2"]


@pytest.mark.parametrize("name,m,v,depth,axes,remat", CASES, ids=IDS)
def test_only_the_first_layers_run_and_match_the_shallow_model(name, m, v, depth, axes, remat):
    layers = 2 * 2 * v
    model, params = tiny_gpt(layers)
    shallow, _ = tiny_gpt(depth)
    inputs, targets = microbatches(7, m)
    kept = {**params, "blocks": jax.tree.map(lambda x: x[:depth], params["blocks"])}
    ref_loss, ref_grads = reference(shallow, kept, inputs, targets)
    padded = lambda g: jnp.concatenate([g, jnp.zeros((layers - depth, *g.shape[1:]), g.dtype)])  # noqa: E731
    ref_grads = {**ref_grads, "blocks": jax.tree.map(padded, ref_grads["blocks"])}
    mesh = make_mesh(ParallelConfig(pipe=2, **axes))
    run = pipeline_grads(stage_fns(model), get_schedule(name, 2, m, v), mesh, remat=remat,
                         active_layers=depth, nan_bubbles=True)
    with jax.set_mesh(mesh):
        loss, grads = jax.jit(run)(params["embed"], params["blocks"], params["head"], inputs, targets)
    assert_matches(loss, grads, ref_loss, ref_grads)
    for g in jax.tree.leaves(grads["blocks"]):  # exactly zero past the depth, not merely small
        assert not np.any(np.asarray(g[depth:]))


def test_the_layers_that_run_are_each_stages_own_prefix():
    # 8 layers over p=2, v=2 (Megatron's interleaving: device 0 holds stages 0 and 2).
    layout = StageLayout.even(8, 2, 2)
    np.testing.assert_array_equal(layout.counts_array(5), [[2, 1], [2, 0]])
    np.testing.assert_array_equal(layout.counts_array(8), layout.counts_array())
    np.testing.assert_array_equal(StageLayout((1, 3), 2, 1).counts_array(2), [[1], [1]])
