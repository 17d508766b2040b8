"""What share of the parameters one device of a pipelined mesh holds: the
partitioner's parameter bytes on a mesh with ``fsdp``, ``tensor`` or ``expert`` > 1.

The profile measures a layer whole, on one device. On a mesh the pipeline keeps,
per device (``runtime/fsdp.py``, ``train/pipeline_storage.py``):

- a stage's layers **stored** at their storage sharding (over ``fsdp``, ``tensor``,
  ``expert``; the layer axis's split over ``pipe`` is the stage split itself), with
  Adam's moments and the gradient the step returns at the same sharding;
- the embedding and head stored split over ``pipe`` as well, on every device;
- inside the step, whatever storage splits over ``fsdp`` **used** gathered (at the
  compute sharding, which keeps the ``tensor`` and ``expert`` splits): the gathered
  weights and a gradient accumulator of that size, per step for the whole stage
  (``parallel.fsdp_gather="step"``), or per chunk use for a device's largest chunk
  (``"chunk"``, whose accumulators stay ``fsdp`` shards, but each part of a fused tick
  gathers its chunk and a weight-gradient part makes its chunk's whole gradient). The
  embedding and head are gathered once per step.

``ParamShare`` holds these fractions of the whole bytes; ``train.plan_layout`` reads
them from the model's storage and compute shardings on a config's mesh, as
``mindpipe_jax.train`` builds them (what ``mindpipe plan`` plans for). Activations
are not this module's: over ``tensor`` the profile's residuals are measured per device
(``measure_layer_costs(..., tensor=)``, ``residual_share.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

GATHERED_COPIES = 2  # the gathered weights and a gradient accumulator of their size
# Per chunk use: a fused tick's parts (forward, input gradient, weight gradient) each
# gather their chunk, and the weight-gradient part makes the chunk's whole gradient
# before reduce-scattering it.
CHUNK_GATHERED_COPIES = 4


@dataclass(frozen=True)
class ParamShare:
    """Fractions of the whole parameter bytes a device holds: a stage's layers as
    stored (``blocks_stored``) and as used inside the step (``blocks_used``), and the
    embedding and head likewise (``ends_*``). All 1: one device per stage (the
    profile's own figures)."""

    blocks_stored: float = 1.0
    blocks_used: float = 1.0
    ends_stored: float = 1.0
    ends_used: float = 1.0
    fsdp_gather: Literal["step", "chunk"] = "step"
    layout: str = ""  # the mesh it describes, for the plan's table

    def __post_init__(self):
        for name in ("blocks_stored", "blocks_used", "ends_stored", "ends_used"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
                raise ValueError(f"ParamShare.{name} must be in (0, 1], got {value!r}")
        if self.fsdp_gather not in ("step", "chunk"):
            raise ValueError(f"ParamShare.fsdp_gather must be 'step' or 'chunk', got {self.fsdp_gather!r}")

    @property
    def whole(self) -> bool:
        return (self.blocks_stored, self.blocks_used, self.ends_stored, self.ends_used) == (1, 1, 1, 1)

    def gathers_blocks(self) -> bool:
        return self.blocks_used > self.blocks_stored

    def gathers_ends(self) -> bool:
        return self.ends_used > self.ends_stored

    def describe(self) -> str:
        if self.whole:
            return ""

        def frac(x: float) -> str:
            return "1" if x == 1 else f"1/{1 / x:.3g}"

        gathered = (f", gathered to {frac(self.blocks_used)} in the step ({self.fsdp_gather})"
                    if self.gathers_blocks() else "")
        return (f"parameters per device on {self.layout}: a stage's layers {frac(self.blocks_stored)} stored"
                f"{gathered}; embed + head {frac(self.ends_stored)} stored, "
                f"{frac(self.ends_used)} gathered")
