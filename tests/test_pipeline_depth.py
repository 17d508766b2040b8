"""A pipeline that runs only the stack's first layers (``pipeline_grads(active_layers=)``,
what a shallow subnet needs): its loss and gradients equal the shallow model's, one
device, no pipeline, with zero gradients for the layers it skips."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from byom_models import Llama, reference_grads, tokens
from flax import nnx
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
# The zero-bubble schedules split the backward at the equation level (B, then W) and
# skip the same layers in both.
CASES = [("1f1b", 4, 1, 3, DATA, False), ("1f1b", 4, 1, 1, DATA, True), ("zb-h1", 4, 1, 3, DATA, True),
         ("zb-h1", 4, 1, 3, DATA, False), ("zb-h1", 4, 1, 1, dict(data=2, tensor=2), False),
         ("zbv", 4, 2, 5, DATA, False),
         ("interleaved", 4, 2, 5, DATA, False), ("1f1b", 4, 1, 3, dict(data=2, tensor=2), True)]
IDS = ["1f1b-d3", "1f1b-d1-remat", "zbh1-d3-remat", "zbh1-d3", "zbh1-d1-tensor2", "zbv-d5",
       "interleaved-v2-d5", "1f1b-d3-tensor2"]


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


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_grouped_query_attention_model_the_project_did_not_design(schedule):
    """A Llama-shaped model (``byom_models``: RMSNorm, rotary, 4 heads sharing one kv
    head) through 1F1B and ZB-H1 (its backward split into B and W) on pipe2 x data4
    running 3 of its 4 blocks, against plain ``jax.value_and_grad`` of the same model
    built with 3 blocks and those weights."""
    layers, depth, m = 4, 3, 4
    model = Llama(layers=layers, heads=4, kv_heads=1, rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    shallow = Llama(layers=depth, heads=4, kv_heads=1, rngs=nnx.Rngs(1))
    state = nnx.state(shallow, nnx.Param)
    nnx.replace_by_pure_dict(state, {**params, "blocks": jax.tree.map(lambda x: x[:depth], params["blocks"])})
    nnx.update(shallow, state)
    batch = tokens(3, 16)
    ref_loss, ref_grads = reference_grads(shallow, batch)
    mesh = make_mesh(ParallelConfig(pipe=2, data=4, tensor=1))
    run = pipeline_grads(stage_fns(model), get_schedule(schedule, 2, m), mesh, remat=False,
                         active_layers=depth)
    split = lambda x: x.reshape(m, -1, x.shape[-1])  # noqa: E731
    with jax.set_mesh(mesh):
        loss, grads = jax.jit(run)(params["embed"], params["blocks"], params["head"], split(batch["inputs"]),
                                   split(batch["targets"]))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for name in ("embed", "head"):
        for got, want in zip(jax.tree.leaves(grads[name]), jax.tree.leaves(ref_grads[name]), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for got, want in zip(jax.tree.leaves(grads["blocks"]), jax.tree.leaves(ref_grads["blocks"]), strict=True):
        np.testing.assert_allclose(got[:depth], want, rtol=1e-5, atol=1e-6)
        assert not np.any(np.asarray(got[depth:]))


def test_zero_bubble_skips_layers_inside_the_split_backward(monkeypatch):
    """ZB-H1 with a shallow depth keeps its equation-level B/W split (``bwsplit.ChunkSplit``
    with a layer count): the F, the B and the W each gate their layers on the count,
    rather than B and W each forming the whole vjp (about a full backward per W)."""
    from mindpipe_jax.parallel.pipeline.runtime import bwsplit

    gated = []
    gate = bwsplit.ChunkSplit._gate

    def recording(self, on, run, skip):
        gated.append(type(skip).__name__)  # F and B skip to (h, zeros), W to zero gradients
        return gate(self, on, run, skip)
    monkeypatch.setattr(bwsplit.ChunkSplit, "_gate", recording)
    model, params = tiny_gpt(4)
    inputs, targets = microbatches(7, 4)
    mesh = make_mesh(ParallelConfig(pipe=2, **DATA))
    run = pipeline_grads(stage_fns(model), get_schedule("zb-h1", 2, 4), mesh, remat=False, active_layers=3)
    with jax.set_mesh(mesh):
        jax.jit(run).lower(params["embed"], params["blocks"], params["head"], inputs, targets)
    assert gated.count("tuple") >= 2 and "list" in gated, gated
