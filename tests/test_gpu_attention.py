"""model.attention=cudnn computes what model.attention=xla does: loss and gradients of the
reference GPT in bf16, the same parameters and batch, on an NVIDIA GPU.

Skipped where JAX has no GPU (CI); run on a lent GPU with
``python -m pytest -q tests/test_gpu_attention.py`` (the framework's import-time
dependencies must be installed there). The cuDNN kernel uses another summation order
and keeps its softmax statistics in fp32 while XLA's path rounds the scores to bf16,
so the two agree to bf16 accuracy, not bitwise.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mindpipe_jax as mp

GPUS = [d for d in jax.devices() if d.platform == "gpu"] if jax.default_backend() == "gpu" else []
pytestmark = pytest.mark.skipif(not GPUS, reason="needs an NVIDIA GPU (cuDNN attention)")


def _loss_and_grads(attention: str, tokens, targets):
    cfg = mp.ModelConfig(vocab_size=512, seq_len=256, d_model=256, n_layers=2, n_heads=4,
                         dtype="bfloat16", param_dtype="float32", attention=attention)
    model = mp.GPT(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)

    def loss_fn(p):
        return nnx.merge(graphdef, p).loss(tokens, targets)

    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params)
    return float(loss), jax.tree.leaves(jax.device_get(nnx.to_pure_dict(grads)))


def test_cudnn_attention_matches_xla_loss_and_grads():
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 512, (4, 256)), jnp.int32)
    targets = jnp.asarray(rng.integers(0, 512, (4, 256)), jnp.int32)
    loss_xla, grads_xla = _loss_and_grads("xla", tokens, targets)
    loss_cudnn, grads_cudnn = _loss_and_grads("cudnn", tokens, targets)
    assert abs(loss_cudnn - loss_xla) < 1e-2 * abs(loss_xla)
    for a, b in zip(grads_xla, grads_cudnn, strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        # Relative to the leaf's scale: bf16 keeps ~3 significant digits.
        scale = float(np.abs(a).max()) or 1.0
        assert float(np.abs(a - b).max()) <= 5e-2 * scale, (a.shape, float(np.abs(a - b).max()), scale)
        cos = float((a * b).sum() / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))
        assert cos > 0.99, (a.shape, cos)
