"""The unpipelined model as the oracle that every pipeline test is held to."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mindpipe_jax.config import ModelConfig
from mindpipe_jax.models.gpt import GPT


def tiny_gpt(n_layers: int):
    """A small GPT and its parameters as a pure dict (embed / blocks / head)."""
    cfg = ModelConfig(vocab_size=64, seq_len=8, d_model=32, n_layers=n_layers, n_heads=2)
    model = GPT(cfg, rngs=nnx.Rngs(0))
    return model, nnx.to_pure_dict(nnx.state(model, nnx.Param))


def microbatches(seed: int, m: int, rows: int = 4):
    tokens = np.random.default_rng(seed).integers(0, 64, (m, rows, 9)).astype(np.int32)
    return tokens[..., :-1], tokens[..., 1:]


def reference(model, params, inputs, targets):
    """Mean loss over the microbatches and its gradient, one device, no pipeline."""
    return _reference(nnx.graphdef(model), params, inputs, targets)


# The model's structure is a static argument: every test of one model shape and
# microbatch shape reuses one compiled reference (10 of test_afapab's cases share 2).
# The microbatches go through ``lax.map`` (one at a time, as a Python loop would, but
# compiled once instead of m times: the p=4, m=16 reference compiled in ~9 s unrolled).
@functools.partial(jax.jit, static_argnums=0)
def _reference(graphdef, params, inputs, targets):
    def loss(prm):
        per_microbatch = jax.lax.map(lambda xy: nnx.merge(graphdef, prm).loss(*xy), (inputs, targets))
        return jnp.mean(per_microbatch)
    return jax.value_and_grad(loss)(params)


def assert_matches(loss, grads, ref_loss, ref_grads):
    """fp32 equality (rtol 1e-5, atol 1e-6) of the loss and every gradient leaf."""
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
    for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                                 jax.tree.leaves(ref_grads), strict=True):
        assert got.shape == want.shape, path
        assert np.all(np.isfinite(got)), path
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=str(path))
