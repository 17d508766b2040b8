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


# ---- gathered per chunk use (fsdp_gather="chunk") -------------------------------------

@pytest.mark.parametrize("name,v,remat,sync,mesh_axes", [
    ("zb-h1", 1, "full", "end", dict(fsdp=4, data=1, tensor=1)),         # split W gathers its chunk too
    ("dualpipev", 2, True, "overlap", dict(fsdp=4, data=1, tensor=1)),   # a V, both directions
    ("afapab", 2, False, "chunk", dict(fsdp=2, data=2, tensor=1)),       # the ring over data after it
    ("interleaved", 2, "dots", "end", dict(fsdp=2, data=1, tensor=2))])  # lockstep (tensor)
def test_gathering_per_chunk_use_equals_unpipelined(name, v, remat, sync, mesh_axes):
    """Each part of a tick all-gathers its task's chunk and reduce-scatters its weight
    gradient: the gradients still equal the unpipelined model's, leave sharded over
    fsdp as stored, and idle slots (NaN) never reach them."""
    p, m = 2, 4
    model, params = tiny_gpt(2 * p * v)
    mesh = make_mesh(ParallelConfig(pipe=p, **mesh_axes))
    storage = nnx.to_pure_dict(state_shardings(nnx.state(model, nnx.Param), mesh, "storage"))
    inputs, targets = microbatches(7, m, rows=8)
    ref_loss, ref_grads = reference(model, params, inputs, targets)
    params = jax.device_put(params, storage)
    run = pipeline_grads(stage_fns(model), get_schedule(name, p, m, v), mesh, remat=remat, grad_sync=sync,
                         param_specs=storage, nan_bubbles=True, fsdp_gather="chunk")
    with jax.set_mesh(mesh):
        loss, grads = jax.jit(run)(params["embed"], params["blocks"], params["head"], inputs, targets)
    assert_matches(loss, grads, ref_loss, ref_grads)
    # Each layer's gradient leaves sharded as its weight is stored (the layer axis aside:
    # interleaved and V chunks are not contiguous, so it comes back whole there).
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(grads["blocks"])[0],
                            jax.tree.leaves(params["blocks"]), strict=True):
        assert g.addressable_shards[0].data.shape[1:] == w.addressable_shards[0].data.shape[1:], path


def _temp_bytes(gather: str, v: int) -> tuple[int, int]:
    """Temp bytes of a compiled pipe2 x fsdp4 step whose weights outweigh its activations
    (d_model 128, one row of 8 tokens per microbatch), and one chunk's fp32 bytes."""
    from mindpipe_jax.config import ModelConfig
    from mindpipe_jax.models.gpt import GPT

    cfg = ModelConfig(vocab_size=64, seq_len=8, d_model=128, n_layers=4 * v, n_heads=2)
    model = GPT(cfg, rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    mesh = make_mesh(ParallelConfig(pipe=2, fsdp=4, data=1, tensor=1))
    storage = nnx.to_pure_dict(state_shardings(nnx.state(model, nnx.Param), mesh, "storage"))
    inputs, targets = microbatches(0, 4, rows=4)
    run = pipeline_grads(stage_fns(model), get_schedule("interleaved", 2, 4, v), mesh, remat="full",
                         param_specs=storage, fsdp_gather=gather)
    args = jax.eval_shape(lambda: (params["embed"], params["blocks"], params["head"]))
    args = [jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), x, storage[k])
            for x, k in zip(args, ("embed", "blocks", "head"), strict=True)]
    with jax.set_mesh(mesh):
        compiled = jax.jit(run).lower(*args, inputs, targets).compile()
    chunk = sum(x.nbytes for x in jax.tree.leaves(params["blocks"])) // (2 * v)
    return compiled.memory_analysis().temp_size_in_bytes, chunk


def test_gathering_per_chunk_use_holds_less_than_the_gathered_stage():
    """v = 4 chunks of 2 layers per device. Gathered once per step, a device holds its
    stage gathered (4 chunks) and the stage's whole fp32 gradient (4 chunks): 8 chunks.
    Gathered per use: the gradient accumulators are 1/4 of the stage (1 chunk), and a
    tick's parts run one after another, so a gathered chunk or two and one chunk's
    gradient before its reduce-scatter are live at once: 3 to 4 chunks. The compiled
    temp bytes must fall by at least 3 chunks' worth (measured: 15.1 -> 8.9 MB, 3.97
    chunks of 1.59 MB)."""
    step, chunk = _temp_bytes("step", 4)
    per_use, _ = _temp_bytes("chunk", 4)
    assert per_use <= step - 3 * chunk, (step, per_use, chunk)


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


def test_train_step_gathers_per_chunk_use_when_asked():
    """``parallel.fsdp_gather=chunk`` reaches the train step's pipeline: its gradients
    equal a plain one-device jax.value_and_grad (the train layout's weights, embed and
    head stored split over pipe and fsdp)."""
    _, _, got, want = _layout_grads("parallel.pipe=2", "parallel.tensor=1", "parallel.microbatches=4",
                                    "parallel.fsdp=4", "parallel.data=1", "parallel.schedule=interleaved",
                                    "parallel.virtual_stages=2", "parallel.fsdp_gather=chunk")
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(got[1])[0], jax.tree.leaves(want[1]),
                            strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))
