"""GPipe by autodiff through scan + ppermute (the MaxText-style baseline and oracle):
loss and every gradient equal the unpipelined model."""

import jax
import pytest
from pipeline_oracle import assert_matches, microbatches, reference, tiny_gpt

from mindpipe_jax.config import ParallelConfig
from mindpipe_jax.parallel.mesh import make_mesh
from mindpipe_jax.parallel.pipeline.contract import stage_fns
from mindpipe_jax.parallel.pipeline.runtime.gpipe_autodiff import gpipe_autodiff_grads

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
    model, params = tiny_gpt(4)
    inputs, targets = microbatches(p * m, m)
    ref_loss, ref_grads = reference(model, params, inputs, targets)
    mesh = make_mesh(ParallelConfig(pipe=p, **axes))
    # NaN in every stage's initial state: a bubble reaching a result would show.
    run = gpipe_autodiff_grads(stage_fns(model), p, m, mesh, remat=remat, nan_bubbles=True)
    with jax.set_mesh(mesh):
        loss, grads = jax.jit(run)(params["embed"], params["blocks"], params["head"], inputs, targets)
    assert_matches(loss, grads, ref_loss, ref_grads)
