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

``ParamShare`` holds these fractions of the whole bytes; ``param_share`` reads them
from the model's storage and compute shardings on a mesh, as ``mindpipe_jax.train``
builds them, and ``plan_layout`` gives a config's mesh, per-device microbatch and share
(what ``mindpipe plan`` plans for). Activations are not divided over ``tensor`` here: the profile's
residuals are a tensor-1 figure, an upper bound on a tensor-split stage's.
"""

from __future__ import annotations

import math
import types
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


def _fraction(sharding, shape, skip: tuple[str, ...]) -> float:
    """The share of an array of ``shape`` one device keeps under ``sharding``, not
    counting the mesh axes in ``skip``."""
    mesh = sharding.mesh
    parts = 1
    for entry in tuple(sharding.spec)[:len(shape)]:
        axes = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
        parts *= math.prod(mesh.shape[a] for a in axes if a not in skip)
    return 1.0 / parts


def _share(paths: list[tuple], shardings: dict, shapes: dict, skip: tuple[str, ...]) -> float:
    """Bytes-weighted share of the leaves at ``paths``."""
    total = kept = 0.0
    for path in paths:
        a = shapes[path]
        nbytes = math.prod(a.shape) * a.dtype.itemsize
        total += nbytes
        kept += nbytes * _fraction(shardings[path], a.shape, skip)
    return kept / total if total else 1.0


def param_share(spec, mesh, seq_len: int, fsdp_gather: Literal["step", "chunk"] = "step") -> ParamShare:
    """The ``ParamShare`` of ``spec`` (``train.state.ModelSpec``) on ``mesh``, with the
    embedding and head split over ``pipe`` as a pipelined run stores them."""
    import jax

    from mindpipe_jax.train.pipeline_storage import split_ends_over_pipe
    from mindpipe_jax.train.step import pipeline_model

    spec = split_ends_over_pipe(spec, seq_len, mesh)
    with jax.set_mesh(None):  # traced for its structure only
        ends = {tuple(p) for p in pipeline_model(spec, seq_len).end_paths()}

    def flat(tree) -> dict:
        return {tuple(getattr(k, "key", k) for k in path): leaf
                for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}

    shapes, storage, compute = flat(spec.abstract_params), flat(spec.storage), flat(spec.compute)
    end_paths = [p for p in shapes if p in ends]
    block_paths = [p for p in shapes if p not in ends]
    layout = " x ".join(f"{a}={n}" for a, n in mesh.shape.items() if n > 1) or "one device"
    return ParamShare(
        blocks_stored=_share(block_paths, storage, shapes, ("pipe",)),
        blocks_used=_share(block_paths, compute, shapes, ("pipe",)),
        ends_stored=_share(end_paths, storage, shapes, ()),
        ends_used=_share(end_paths, compute, shapes, ("pipe",)),
        fsdp_gather=fsdp_gather, layout=layout)

def plan_layout(cfg):
    """The mesh shape a run of ``cfg`` trains on, the microbatch one of its batch devices
    runs (``global_batch / (microbatches x data x fsdp x expert)``) and the share of
    the parameters a device holds there (``param_share``). Axes all given: that mesh,
    whatever this machine has (a plan for a bigger one); an axis left to fill (-1, or
    tensor 0): filled from this machine's devices, as ``train`` would. What ``train``
    refuses on that mesh is refused here, in its words."""
    import jax
    from jax.sharding import AbstractMesh, AxisType

    from mindpipe_jax.models import build_model
    from mindpipe_jax.parallel.mesh import MESH_ORDER, resolve_axis_sizes
    from mindpipe_jax.train.state import model_spec
    from mindpipe_jax.train.step import BATCH_AXES, check_step_config

    par = cfg.parallel
    sizes = par.axis_sizes()
    if -1 in sizes.values() or sizes["tensor"] == 0:
        sizes = resolve_axis_sizes(par, jax.device_count(), jax.default_backend())
    check_step_config(cfg, types.SimpleNamespace(shape=sizes))
    mesh = AbstractMesh(tuple(sizes[a] for a in MESH_ORDER), MESH_ORDER,
                        axis_types=(AxisType.Auto,) * len(MESH_ORDER))
    spec, _ = model_spec(lambda rngs: build_model(cfg.model, rngs), mesh, cfg.train.seed)
    share = param_share(spec, mesh, cfg.model.seq_len, par.fsdp_gather)
    n_batch = math.prod(sizes[a] for a in BATCH_AXES)
    return mesh, cfg.train.global_batch // (par.microbatches * n_batch), share
