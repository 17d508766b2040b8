"""Where a pipelined run keeps its embedding and head: split over ``pipe``.

The rules table (``parallel/rules.py``) shards a weight's ``embed`` dimension over
``fsdp`` and leaves the embedding and head whole on every pipeline stage, though
only the first stage computes the embedding and the last the head. One SPMD
program gives every device the same shapes, so they cannot live on their owners
alone; split over ``pipe`` as well, each device keeps ``1 / (pipe · fsdp)`` of
them and of their optimizer state (Adam's two moments: the bulk of a large
vocabulary's memory) instead of ``1 / fsdp``. The pipeline gathers them once per
step and reduce-scatters their gradients over ``pipe`` (``runtime/fsdp.py``), the
same bytes as the ``psum`` it replaces plus one all-gather of the two tables.

A leaf is split along the dimension its storage shards over ``fsdp`` (the
``embed`` axis), when that dimension divides by ``fsdp · pipe``; anything else
(norm scales, a dimension that does not divide) stays as the rules say.
"""

from __future__ import annotations

import dataclasses
import math

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mindpipe_jax.parallel.pipeline.runtime.fsdp import PIPE, fsdp_dim
from mindpipe_jax.train.state import ModelSpec
from mindpipe_jax.train.step import pipeline_model


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else entry if isinstance(entry, tuple) else (entry,)


def over_pipe(sharding: NamedSharding, shape: tuple[int, ...]) -> NamedSharding:
    """``sharding`` with ``pipe`` added after ``fsdp`` on the dimension it shards over
    ``fsdp``, where that divides; otherwise ``sharding`` itself."""
    mesh = sharding.mesh
    entries = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
    dim = fsdp_dim(P(*entries))
    if dim < 0 or any(PIPE in _axes(e) for e in entries):
        return sharding
    axes = (*_axes(entries[dim]), PIPE)
    if shape[dim] % math.prod(mesh.shape[a] for a in axes):
        return sharding
    entries[dim] = axes
    return NamedSharding(mesh, P(*entries))


def split_ends_over_pipe(spec: ModelSpec, seq_len: int, mesh) -> ModelSpec:
    """``spec`` with the storage of every parameter the pipeline's prologue or
    epilogue uses split over ``pipe`` (``over_pipe``); ``spec`` itself without a
    pipeline (``pipe`` = 1)."""
    if mesh.shape.get(PIPE, 1) == 1:
        return spec
    with jax.set_mesh(None):  # traced for its structure only
        ends = {tuple(path) for path in pipeline_model(spec, seq_len).end_paths()}

    def one(path, sharding, abstract):
        key = tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)
        return over_pipe(sharding, abstract.shape) if key in ends else sharding

    storage = jax.tree_util.tree_map_with_path(one, spec.storage, spec.abstract_params)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            spec.abstract_params, storage)
    return dataclasses.replace(spec, storage=storage, abstract_params=abstract)
