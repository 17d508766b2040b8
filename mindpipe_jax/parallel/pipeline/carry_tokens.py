"""The microbatch's token ids carried beside the hidden state, for models that read them
past the prologue.

A model may make its layers' padding mask from the tokens (``tokens != pad``) or mask
its loss with them; in a pipeline only the first stage embeds the tokens, and a stage
hands its neighbour one array. So the ids ride along as a few more features of the
hidden state (``[..., d + k]``), exactly: each id's bits are cut into ``k`` digits
small enough that the hidden state's dtype holds every digit exactly (24-bit digits in
fp32, 8-bit ones in bf16: two or four features for int32 ids). Each unit reads them back
to compute its side inputs, and the epilogue to compute the loss; their cotangent is
cut (``stop_gradient``), so no backward work is spent on them. The cost is k/d more
bytes per activation sent, stashed and kept (2/4096 of a fp32 GPT-3 hidden state).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from mindpipe_jax.errors import ConfigError
from mindpipe_jax.parallel.pipeline.runtime.spmd import StageFns


def _digit_bits(hidden_dtype, token_dtype) -> int:
    """Bits per digit: every integer below 2**bits is exact in ``hidden_dtype``."""
    return min(jnp.finfo(hidden_dtype).nmant + 1, jnp.iinfo(token_dtype).bits)


def feature_count(hidden_dtype, token_dtype) -> int:
    """How many features one token id takes in a hidden state of ``hidden_dtype``."""
    return -(-jnp.iinfo(token_dtype).bits // _digit_bits(hidden_dtype, token_dtype))


def _unsigned(token_dtype):
    return jnp.dtype(f"uint{jnp.iinfo(token_dtype).bits}")


def token_features(tokens, hidden_dtype):
    """``tokens`` ``[...]`` (integers) as ``[..., k]`` digits in ``hidden_dtype``, exact."""
    bits = _digit_bits(hidden_dtype, tokens.dtype)
    raw = lax.bitcast_convert_type(tokens, _unsigned(tokens.dtype))  # negative ids keep their bits
    mask, count = raw.dtype.type((1 << bits) - 1), feature_count(hidden_dtype, tokens.dtype)
    digits = [(raw >> raw.dtype.type(bits * i)) & mask for i in range(count)]
    return jnp.stack(digits, axis=-1).astype(hidden_dtype)


def tokens_from(features, token_dtype):
    """The ids ``token_features`` encoded, back in ``token_dtype``."""
    unsigned = _unsigned(token_dtype)
    bits = _digit_bits(features.dtype, token_dtype)
    digits = lax.stop_gradient(features).astype(unsigned)
    raw = sum(digits[..., i] << unsigned.type(bits * i) for i in range(features.shape[-1]))
    return lax.bitcast_convert_type(raw, token_dtype)


def carrying_tokens(fns: StageFns, token_dtype, where: str) -> StageFns:
    """``fns`` whose hidden state carries the microbatch's tokens: ``fns.layer(unit, h,
    tokens)`` and ``fns.head_loss(p, h, targets, tokens)`` get them, the runtime sees
    ``[..., d + k]`` hidden states and nothing else changes."""
    def embed(p, tokens):
        h = fns.embed(p, tokens)
        if not jnp.issubdtype(h.dtype, jnp.floating) or tuple(h.shape[:-1]) != tuple(tokens.shape):
            raise ConfigError(f"{where}: the model reads its tokens past its first layer, and the pipeline "
                              f"carries them beside a hidden state of shape (rows, length, features) in "
                              f"a float dtype; this one is {h.dtype}{list(h.shape)} for tokens "
                              f"{list(tokens.shape)}: train it without parallel.pipe")
        return jnp.concatenate([h, token_features(tokens, h.dtype)], axis=-1)

    def split(hc):
        k = feature_count(hc.dtype, token_dtype)
        return hc[..., :-k], lax.stop_gradient(hc[..., -k:])

    def layer(unit, hc):
        h, features = split(hc)
        return jnp.concatenate([fns.layer(unit, h, tokens_from(features, token_dtype)), features], axis=-1)

    def head_loss(p, hc, targets):
        h, features = split(hc)
        return fns.head_loss(p, h, targets, tokens_from(features, token_dtype))

    return StageFns(embed=embed, layer=layer, head_loss=head_loss)
