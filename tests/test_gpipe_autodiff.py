"""GPipe by autodiff through scan + ppermute (the MaxText-style baseline and oracle):
loss and every gradient equal the unpipelined model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mindpipe_jax.config import ModelConfig, ParallelConfig
from mindpipe_jax.models.gpt import GPT
from mindpipe_jax.parallel.mesh import make_mesh
from mindpipe_jax.parallel.pipeline.contract import stage_fns
from mindpipe_jax.parallel.pipeline.gpipe_autodiff import gpipe_autodiff_grads

# (p, m, remat, other mesh axes): p in {2, 4}, m in {p, 2p}, both remat settings,
# and the batch axes (data, fsdp) and tensor composed on the 8 simulated devices.
CASES = [
    (2, 2, False, dict(data=4, tensor=1)),
    (2, 4, True, dict(data=1, fsdp=2, tensor=2)),
    (4, 4, True, dict(data=2, tensor=1)),
    (4, 8, False, dict(data=1, fsdp=2, tensor=1)),
]


@pytest.mark.parametrize("p,m,remat,axes", CASES,
                         ids=[f"p{c[0]}-m{c[1]}-{'remat' if c[2] else 'noremat'}-"
                              + "x".join(f"{k}{v}" for k, v in c[3].items()) for c in CASES])
def test_gpipe_autodiff_equals_unpipelined(p, m, remat, axes):
    # Two layers per stage at p=2 (the stage's scan runs more than one layer).
    cfg = ModelConfig(vocab_size=64, seq_len=8, d_model=32, n_layers=4, n_heads=2)
    model = GPT(cfg, rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    tokens = np.random.default_rng(p * m).integers(0, 64, (m, 4, 9)).astype(np.int32)
    inputs, targets = tokens[..., :-1], tokens[..., 1:]

    def reference(prm):
        merged = nnx.merge(nnx.graphdef(model), prm)
        return jnp.mean(jnp.stack([merged.loss(inputs[i], targets[i]) for i in range(m)]))

    ref_loss, ref_grads = jax.jit(jax.value_and_grad(reference))(params)
    mesh = make_mesh(ParallelConfig(pipe=p, **axes))
    # NaN in every stage's initial state: a bubble reaching a result would show.
    run = gpipe_autodiff_grads(stage_fns(model), p, m, mesh, remat=remat, nan_bubbles=True)
    with jax.set_mesh(mesh):
        loss, grads = jax.jit(run)(params["embed"], params["blocks"], params["head"], inputs, targets)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
    for path, got in jax.tree_util.tree_flatten_with_path(grads)[0]:
        want = ref_grads
        for key in path:
            want = want[key.key]
        assert got.shape == want.shape, path
        assert np.all(np.isfinite(got)), path
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=str(path))
