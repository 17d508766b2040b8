"""Wrappers of a pipelined model's stage functions (``StageFns``) that the contract puts
around the parts it found: ``carrying_aux`` (units returning an auxiliary loss: its sum
rides in the hidden state) and ``returning_hidden`` (a unit must return one array shaped
like its input; anything else is refused in one line). ``carry_tokens.py`` holds the
third, the token ids carried for models that read them past the first layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mindpipe_jax.errors import ConfigError
from mindpipe_jax.parallel.pipeline.runtime.spmd import StageFns


def carrying_aux(fns: StageFns, weight: float, units: int) -> StageFns:
    """``fns`` whose hidden state carries the units' auxiliary losses to the epilogue.

    A stage passes its neighbour one array, and only the last stage computes the loss,
    so the running sum of the units' aux losses rides along as one more feature of the
    hidden state (``[..., d + 1]``; every position holds the same sum). The epilogue
    adds ``weight`` x the mean over the units to the loss, so the loss and every
    gradient are the model's own, aux included, through the runtime unchanged: the
    backward of the epilogue's read of that feature is what reaches each unit's aux
    (Megatron injects it with a custom backward instead; here autodiff does it). The
    sum is kept in the hidden state's dtype: with bf16 activations the loss *value*
    rounds its aux term, while the gradient each unit's aux receives (a constant) does
    not.
    """
    def embed(p, tokens):
        h = fns.embed(p, tokens)
        return jnp.concatenate([h, jnp.zeros((*h.shape[:-1], 1), h.dtype)], axis=-1)

    def layer(unit, h):
        out = fns.layer(unit, h[..., :-1])
        if not (isinstance(out, tuple) and len(out) == 2 and jnp.ndim(out[1]) == 0):
            raise ConfigError(f"PipelineParts(aux_weight={weight}) needs each unit to return (hidden, "
                              f"a scalar aux loss); a unit returned {jax.tree.structure(out)}")
        out, aux = out
        return jnp.concatenate([out, h[..., -1:] + aux.astype(h.dtype)], axis=-1)

    def head_loss(p, h, targets):
        total = h[..., -1].reshape(-1)[0].astype(jnp.float32)
        return fns.head_loss(p, h[..., :-1], targets) + weight * total / units

    return StageFns(embed=embed, layer=layer, head_loss=head_loss)


def returning_hidden(fns: StageFns, where: str) -> StageFns:
    """``fns`` whose units are checked, when traced, to return one array shaped like their
    input: the pipeline hands that array to the next unit (and stage). A unit returning
    anything else (e.g. ``(hidden, aux)`` of an MoE block without ``aux_weight``) is
    refused here in one line rather than failing inside the runtime's transfers."""
    def layer(unit, h, *tokens):  # tokens: see carry_tokens.py
        out = fns.layer(unit, h, *tokens)
        if not (hasattr(out, "shape") and hasattr(out, "dtype")) or tuple(out.shape) != tuple(h.shape):
            what = f"an array of shape {tuple(out.shape)}" if hasattr(out, "shape") else \
                f"{type(out).__name__} {jax.tree.structure(out)}"
            extra = (" (a unit that also returns an auxiliary loss, (hidden, scalar), needs "
                     "PipelineParts(aux_weight=...))" if isinstance(out, tuple) and len(out) == 2 else "")
            raise ConfigError(f"{where}: a unit returned {what}; the pipeline passes one hidden array of "
                              f"shape {tuple(h.shape)} from unit to unit{extra}")
        return out

    return StageFns(embed=fns.embed, layer=layer, head_loss=fns.head_loss)
