"""What a model's ``pipeline_parts()`` returns, and the loss the parts must reproduce.

Kept apart from ``contract.py`` (which turns parts into what the runtime runs) so that
``list_parts.py``, which finds the parts of a model calling an ``nnx.List`` of layers,
can build them without importing the contract that calls it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

HOOK = "pipeline_parts"


def dotted(path: tuple) -> str:
    """An attribute path as the user writes it: ``("decoder", "layers", 0)`` -> ``decoder.layers.0``."""
    return ".".join(map(str, path))


@dataclasses.dataclass(frozen=True)
class PipelineParts:
    """What ``model.pipeline_parts()`` returns (``contract.py``'s docstring says how the
    runtime uses it)."""

    stack: str  # attribute path of the layer stack, dots between names: "decoder.layers"
    prologue: Callable[[Any, jax.Array], jax.Array]  # (model, tokens) -> hidden
    epilogue: Callable[[Any, jax.Array, jax.Array], jax.Array]  # (model, hidden, targets) -> loss
    # Units that return (hidden, aux), a scalar auxiliary loss each (an MoE block's load
    # balancing): the model's loss adds aux_weight x their mean over the units.
    aux_weight: float | None = None
    # (model, tokens) -> list_parts.Checked (how the model calls each layer, whether its
    # loss reads the tokens after the layers, what the layers sow), run once abstractly
    # before a run: raises ConfigError where the parts would not compute the model's loss
    # (set for a found nnx.List; its epilogue then takes the tokens as a fourth argument).
    check: Callable[[Any, jax.Array], Any] | None = None
    # (model, tokens) -> the arrays ``check``'s SideInput marks stand for (list_parts.py).
    sides: Callable[[Any, jax.Array], tuple] | None = None


def merged(graphdef, params, rest):
    """``nnx.merge(graphdef, params, rest)`` with fresh copies of ``rest``'s variables (its
    constant buffers): a variable built outside a trace cannot be used by an NNX transform
    (``nnx.scan``) or written inside it, and a merged model's writes stay its own."""
    from flax import nnx

    return nnx.merge(graphdef, params, jax.tree.map(lambda x: x, rest))


def model_loss(model, inputs, targets):
    """A model's mean loss: ``model.loss`` if it has one, else token cross-entropy of its
    logits."""
    if callable(getattr(model, "loss", None)):
        return model.loss(inputs, targets)
    logits = model(inputs).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
