"""The pipeline model contract: a model with ``embed``, stacked ``blocks`` and ``head``.

``stage_fns(model)`` checks that an ``nnx.Module`` follows the contract and
turns it into the three pure functions the runtime executes. ``blocks`` must be
created stacked (``nnx.vmap`` over a leading layer axis, as the reference GPT
does) so a stage is a slice of the layer axis run with ``lax.scan``; ``head``
must have ``loss(h, targets)``.
"""

from __future__ import annotations

from flax import nnx

from mindpipe_jax.errors import ConfigError
from mindpipe_jax.parallel.pipeline.runtime import StageFns


def check_contract(model) -> None:
    missing = [name for name in ("embed", "blocks", "head") if not hasattr(model, name)]
    if missing:
        raise ConfigError(f"model {type(model).__name__} does not follow the pipeline contract "
                          f"(missing {', '.join(missing)}); parallel.pipe>1 needs embed, stacked blocks "
                          f"and head with head.loss(h, targets)")
    if not callable(getattr(model.head, "loss", None)):
        raise ConfigError(f"model {type(model).__name__}.head has no loss(h, targets) method, which "
                          f"parallel.pipe>1 needs")


def stage_fns(model) -> StageFns:
    """Pure (params, inputs) functions for the runtime, from an (abstract) model."""
    check_contract(model)
    embed_def = nnx.graphdef(model.embed)
    blocks_def = nnx.graphdef(model.blocks)
    head_def = nnx.graphdef(model.head)

    def embed(params, tokens):
        return nnx.merge(embed_def, params)(tokens)

    def layer(params, h):
        return nnx.merge(blocks_def, params)(h)

    def head_loss(params, h, targets):
        return nnx.merge(head_def, params).loss(h, targets)

    return StageFns(embed, layer, head_loss)
