"""Dropout through the pipeline (``model.dropout`` > 0 with ``parallel.pipe`` > 1): each
unit of the batch (one microbatch of one batch device) draws the masks the unpipelined
model draws for it with the key ``fold_in(step_key, unit)``."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mindpipe_jax.config import Config
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.models.gpt import GPT
from mindpipe_jax.models.moe import MoEGPT
from mindpipe_jax.parallel.mesh import make_mesh
from mindpipe_jax.train.pipeline_storage import split_ends_over_pipe
from mindpipe_jax.train.state import model_spec
from mindpipe_jax.train.step import check_step_config, make_grad_fn

ROWS, LENGTH, VOCAB, SEED = 16, 8, 64, 0
MODEL = ("model.vocab_size=64", "model.seq_len=8", "model.d_model=32", "model.n_heads=2", "model.n_layers=4")


def _batch(seed=1):
    t = np.random.default_rng(seed).integers(0, VOCAB, (ROWS, LENGTH + 1)).astype(np.int32)
    return {"inputs": t[:, :-1], "targets": t[:, 1:]}


def _grads(*overrides, key=None, model=GPT):
    """Loss and gradients of the train step's own gradient function for the reference GPT
    (or ``model``, built from the config the same way)."""
    cfg = Config().replace(*MODEL, f"train.global_batch={ROWS}", f"train.seed={SEED}", *overrides)
    mesh = make_mesh(cfg.parallel)
    check_step_config(cfg, mesh)
    with jax.set_mesh(None):
        spec, create = model_spec(lambda rngs: model(cfg.model, rngs=rngs), mesh, SEED)
    spec = split_ends_over_pipe(spec, cfg.model.seq_len, mesh)
    params = jax.jit(create, out_shardings=spec.storage)()
    key = jax.random.key(7) if key is None else key
    loss, grads, _ = jax.jit(make_grad_fn(spec, cfg, mesh))(params, _batch(), key)
    return loss, jax.device_get(grads)


def _assert_close(got, want, rtol=1e-5, atol=1e-6):
    np.testing.assert_allclose(got[0], want[0], rtol=rtol, atol=atol)
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got[1])[0], jax.tree.leaves(want[1]),
                            strict=True):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("pipeline", [
    ("parallel.schedule=1f1b",),
    ("parallel.schedule=zb-h1", "parallel.stage_remat=full"),  # split backward, forward re-run
    ("parallel.schedule=interleaved", "parallel.virtual_stages=2", "parallel.stage_remat=dots")])
def test_deterministic_pipeline_draws_the_unpipelined_masks(pipeline):
    """In deterministic mode the pipeline's units are the unpipelined step's virtual
    shards, each with the key fold_in(step_key, unit): with dropout 0.2 the pipeline's
    loss and gradients equal the unpipelined deterministic step's on data=8 (fp32, the
    sums in another order), and differ from the same pipeline without dropout."""
    common = ("train.deterministic=true", "train.virtual_shards=8", "parallel.tensor=1")
    piped = (*common, "parallel.pipe=2", "parallel.data=4", "parallel.microbatches=2", *pipeline)
    flat = (*common, "parallel.data=8")
    want = _grads(*flat, "model.dropout=0.2")
    got = _grads(*piped, "model.dropout=0.2")
    _assert_close(got, want)
    off = _grads(*piped)
    assert abs(float(off[0]) - float(got[0])) > 1e-3  # the masks are applied


def _reference(dropout, key, devices, m, *overrides, build=GPT):
    """Plain value_and_grad of the mean over units of the model's own loss: unit (d, j) is
    microbatch j (rows k*m + j of the batch) of batch device d (its contiguous share of
    those rows), with the key fold_in(key, d*m + j)."""
    cfg = Config().replace(*MODEL, f"model.dropout={dropout}", *overrides).model
    model = build(cfg, rngs=nnx.Rngs(SEED))
    gdef, params = nnx.split(model, nnx.Param)
    batch = _batch()
    per = ROWS // (m * devices)

    def loss(p):
        total = 0.0
        for j in range(m):
            rows = {k: v[j::m] for k, v in batch.items()}
            for d in range(devices):
                unit = {k: jnp.asarray(v[d * per:(d + 1) * per]) for k, v in rows.items()}
                total += nnx.merge(gdef, p).loss(unit["inputs"], unit["targets"],
                                                 dropout_key=jax.random.fold_in(key, d * m + j))
        return total / (m * devices)

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    return value, nnx.to_pure_dict(grads)


def test_pipeline_with_tensor_draws_each_units_masks():
    """pipe2 x data2 x tensor2 (stages in lockstep), ZB-H1 with a remat per stage: the loss
    and gradients equal an independent reference that runs the GPT's own loss on each
    unit's rows with the unit's key (plain value_and_grad, one device)."""
    key = jax.random.key(3)
    got = _grads("parallel.pipe=2", "parallel.data=2", "parallel.tensor=2", "parallel.microbatches=2",
                 "parallel.schedule=zb-h1", 'parallel.stage_remat=["full","dots"]', "model.dropout=0.2",
                 key=key)
    _assert_close(got, _reference(0.2, key, devices=2, m=2))


def test_moe_blocks_draw_each_units_masks():
    """The MoE GPT (its blocks return (hidden, aux), the aux carried in the hidden state)
    on pipe2 x data4, ZB-H1, dropout 0.2: the loss and gradients equal the per-unit
    reference, its experts routed in one group per unit as the pipeline routes each
    microbatch on each device."""
    key, moe = jax.random.key(3), ("model.n_experts=4", "model.top_k=2")
    got = _grads("parallel.pipe=2", "parallel.data=4", "parallel.tensor=1", "parallel.microbatches=2",
                 "parallel.schedule=zb-h1", "model.dropout=0.2", *moe, key=key, model=MoEGPT)
    one_group = functools.partial(MoEGPT, dispatch_groups=1)
    _assert_close(got, _reference(0.2, key, 4, 2, *moe, build=one_group))


@pytest.mark.parametrize("uneven", [
    ("parallel.schedule=1f1b", "parallel.stage_layers=[1,3]"),
    ("parallel.schedule=interleaved", "parallel.virtual_stages=2", "parallel.stage_layers=[0,2,1,1]",
     "parallel.stage_remat=dots")])  # the first layer (the embedding's dropout) on global stage 1
def test_uneven_stages_draw_the_unpipelined_masks(uneven):
    """Uneven stages (as parallel.stage_layers or an online repartition leave them; refused
    with dropout until 2026-12-05): the keys follow each layer to its stage."""
    common = ("train.deterministic=true", "train.virtual_shards=8", "parallel.tensor=1", "model.dropout=0.2")
    got = _grads(*common, "parallel.pipe=2", "parallel.data=4", "parallel.microbatches=2", *uneven)
    _assert_close(got, _grads(*common, "parallel.data=8"))


class _UsersGPT(GPT):
    """A user's subclass of the reference GPT: not the built-in model, so its loss is
    checked for drawing from its key; the key reaches the layers through their scan."""


def test_a_subclass_without_dropout_pipelines_and_with_dropout_is_refused():
    """Its loss splits the key over the scanned layers and, at model.dropout 0, draws
    nothing: it pipelines with the built-in GPT's gradients (it was refused: the check
    counted every input of the layer scan as read). At 0.2 the draws inside the scan
    are seen and refused in one line."""
    pipe = ("parallel.pipe=2", "parallel.data=4", "parallel.tensor=1", "parallel.microbatches=2")
    _assert_close(_grads(*pipe, model=_UsersGPT), _grads(*pipe), rtol=0, atol=0)
    with pytest.raises(ConfigError) as err:
        _grads(*pipe, "model.dropout=0.2", model=_UsersGPT)
    assert "\n" not in str(err.value) and "_UsersGPT.loss draws random numbers" in str(err.value)
