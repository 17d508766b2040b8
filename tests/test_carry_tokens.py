"""Token ids carried as features of the hidden state (``carry_tokens.py``): exact in every
float dtype a hidden state has, for any int32 id, negative ones included."""

import jax.numpy as jnp
import numpy as np
import pytest

from mindpipe_jax.parallel.pipeline.carry_tokens import feature_count, token_features, tokens_from

IDS = np.array([[0, 1, 255, 256, 257, 2047, 2049, 50257],
                [2**24 - 1, 2**24 + 1, 2**31 - 1, -1, -2**31, 128_256, 65_535, 7]], np.int32)


@pytest.mark.parametrize("dtype,count", [(jnp.float32, 2), (jnp.bfloat16, 4), (jnp.float16, 3)])
def test_every_int32_id_comes_back_exactly(dtype, count):
    features = token_features(jnp.asarray(IDS), dtype)
    assert features.shape == (*IDS.shape, count) and features.dtype == dtype
    assert feature_count(dtype, jnp.int32) == count
    # Every digit is an integer the dtype holds exactly, so no NaN or Inf bit pattern rides along.
    assert bool(jnp.all(jnp.isfinite(features))) and bool(jnp.all(features == jnp.round(features)))
    back = tokens_from(features, jnp.int32)
    assert back.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(back), IDS)
