"""Linen models, trained as NNX ones through ``flax.nnx.bridge``."""

from __future__ import annotations

from flax import linen, nnx


def is_linen(model) -> bool:
    return isinstance(model, linen.Module)


def nnx_model(model, seq_len: int):
    """``model`` as the NNX side takes it: a Linen module becomes its ``from_linen``
    factory, initialised on a [1, ``seq_len``] batch of token ids (what ``train`` does);
    anything else is returned as it is."""
    if not is_linen(model):
        return model
    import numpy as np

    return from_linen(model, np.zeros((1, seq_len), np.int32))


def from_linen(module: linen.Module, example_input):
    """A factory ``rngs -> nnx.Module`` for a Linen module: ``nnx.bridge.ToNNX``
    initialised on ``example_input`` (a batch of the model's inputs; only its shape
    and dtype count). Logical partitioning annotations become the variables'
    logical names, so the rules table shards them as it does NNX ones.

    The bridge keeps the ``Rngs`` it was initialised with and draws from them on
    every call; the train step passes no random streams (it is a pure function of
    the state and the batch), so they are dropped after initialisation. A Linen
    model that needs a random stream while training (dropout) is refused at its
    first call by Linen itself, naming the stream.
    """
    def factory(rngs: nnx.Rngs):
        model = nnx.bridge.lazy_init(nnx.bridge.ToNNX(module, rngs=rngs), example_input)
        model.to_nnx__rngs = None
        return model
    return factory
