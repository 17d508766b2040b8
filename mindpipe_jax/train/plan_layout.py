"""The mesh, microbatch and parameter share ``mindpipe plan`` plans a pipeline for:
a config's run as ``mindpipe_jax.train`` would lay it out (``plan_layout``), and the
share of the parameters one device keeps there and gathers in the step, read from the
model's storage and compute shardings (``param_share``, a
``parallel.pipeline.plan.shares.ParamShare``)."""

from __future__ import annotations

import math
import types
from typing import Literal

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType

from mindpipe_jax.models import build_model
from mindpipe_jax.parallel.mesh import MESH_ORDER, resolve_axis_sizes
from mindpipe_jax.parallel.pipeline.plan.shares import ParamShare
from mindpipe_jax.train.pipeline_storage import split_ends_over_pipe
from mindpipe_jax.train.state import model_spec
from mindpipe_jax.train.step import BATCH_AXES, check_step_config, pipeline_model
from mindpipe_jax.train.step_checks import check_user_model_keys


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


def plan_layout(cfg, model=None):
    """The mesh shape a run of ``cfg`` trains on, the microbatch one of its batch devices
    runs (``global_batch / (microbatches x data x fsdp x expert)``), the share of
    the parameters a device holds there (``param_share``) and the model's spec
    (``train.state.ModelSpec``). ``model``: a user's (as ``train`` takes it: a factory,
    an ``nnx.Module`` or a Linen module); None: the configured GPT. Axes all given: that mesh,
    whatever this machine has (a plan for a bigger one); an axis left to fill (-1, or
    tensor 0): filled from this machine's devices, as ``train`` would. What ``train``
    refuses on that mesh is refused here, in its words."""
    par = cfg.parallel
    sizes = par.axis_sizes()
    if -1 in sizes.values() or sizes["tensor"] == 0:
        sizes = resolve_axis_sizes(par, jax.device_count(), jax.default_backend())
    check_step_config(cfg, types.SimpleNamespace(shape=sizes))
    mesh = AbstractMesh(tuple(sizes[a] for a in MESH_ORDER), MESH_ORDER,
                        axis_types=(AxisType.Auto,) * len(MESH_ORDER))
    example = np.zeros((1, cfg.model.seq_len), np.int32)  # what initialises a Linen model
    spec, _ = model_spec(model if model is not None else (lambda rngs: build_model(cfg.model, rngs)), mesh,
                         cfg.train.seed, example)
    if model is not None:
        check_user_model_keys(cfg.model, spec)  # its declared experts against its parameters
    share = param_share(spec, mesh, cfg.model.seq_len, par.fsdp_gather)
    n_batch = math.prod(sizes[a] for a in BATCH_AXES)
    return mesh, cfg.train.global_batch // (par.microbatches * n_batch), share, spec
