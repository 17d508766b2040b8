"""THE logical-axis rules table, and every sharding derived from it.

Models name logical axes only (``embed``, ``mlp``, ``heads`` ...). This table is
the one place that says which mesh axes shard them. Each logical axis has two
mappings:

* storage — how a parameter is kept between steps (and in the optimizer state).
  FSDP shards the ``embed`` dimension of every weight over ``fsdp``.
* compute — how a parameter or activation is laid out while the step runs.
  Weights are all-gathered over ``fsdp`` (compute has no ``fsdp`` on ``embed``)
  while the batch is split over ``data`` × ``fsdp`` × ``expert`` (``expert`` is 1
  unless an MoE model splits its experts over it; models/moe.py).

Tensor parallelism is Megatron's column/row split and comes from this table
alone: the first projection of attention (``heads``) and of the MLP (``mlp``) is
sharded on its output dimension, the second on its input dimension, so each pair
needs one reduction — XLA inserts it from these specs.
"""

from __future__ import annotations

from typing import Literal

import jax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mindpipe_jax.errors import ConfigError

Kind = Literal["storage", "compute"]

# logical axis   storage (params, optimizer)   compute (step: params + activations)
RULES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # The expert devices do data parallelism outside the MoE layers (GShard).
    "batch":    ((),                 ("data", "fsdp", "expert")),
    "length":   ((),                 ()),
    "embed":    (("fsdp",),          ()),
    "mlp":      (("tensor",),        ("tensor",)),
    "heads":    (("tensor",),        ("tensor",)),
    "kv":       ((),                 ()),
    "vocab":    (("tensor",),        ("tensor",)),
    "norm":     ((),                 ()),
    "layers":   (("pipe",),          ("pipe",)),  # stacked blocks: stage s holds its layers
    "stages":   (("pipe",),          ("pipe",)),
    "experts":  (("expert",),        ("expert",)),
    "subnets":  (("subnet",),        ("subnet",)),
}


def spec_for(names, kind: Kind = "compute", mesh=None) -> P:
    """PartitionSpec for a tuple of logical names (None = unsharded dim)."""
    column = 0 if kind == "storage" else 1
    used: set[str] = set()
    parts = []
    for name in names:
        if name is None:
            parts.append(None)
            continue
        if name not in RULES:
            raise ConfigError(f"logical axis {name!r} is not in the rules table; valid: "
                              f"{', '.join(RULES)}")
        axes = tuple(a for a in RULES[name][column]
                     if a not in used and (mesh is None or a in mesh.axis_names))
        used.update(axes)
        parts.append(axes[0] if len(axes) == 1 else (axes or None))
    return P(*parts)


def _axes_size(mesh, entry) -> int:
    if entry is None:
        return 1
    entry = (entry,) if isinstance(entry, str) else entry
    size = 1
    for axis in entry:
        size *= mesh.shape[axis]
    return size


def _logical_names(variable) -> tuple | None:
    meta = variable.get_metadata() if hasattr(variable, "get_metadata") else {}
    names = meta.get("out_sharding")
    return tuple(names) if names is not None else None


# Logical axes that may stay whole when their size does not divide: an uneven
# pipeline split (parallel.stage_layers) cannot shard the stacked layers evenly.
MAY_REPLICATE = {"layers"}


def _checked_spec(path, shape, names, kind: Kind, mesh) -> P:
    spec = list(spec_for(names, kind, mesh))
    for dim, (size, entry) in enumerate(zip(shape, spec, strict=False)):
        parts = _axes_size(mesh, entry)
        if size % parts and names[dim] in MAY_REPLICATE:
            spec[dim] = None
        elif size % parts:
            where = "/".join(map(str, path))
            raise ConfigError(
                f"parameter {where} dimension {dim} ({names[dim]}={size}) is not divisible by mesh "
                f"axes {entry}={parts}; choose sizes so that {names[dim]} divides evenly")
    return P(*spec)


def state_shardings(state: nnx.State, mesh, kind: Kind = "storage"):
    """NamedShardings for an (abstract) nnx State from the variables' logical names."""

    def one(path, variable):
        names = _logical_names(variable)
        shape = variable.get_value().shape if hasattr(variable, "get_value") else variable.shape
        spec = P() if names is None else _checked_spec(path, shape, names, kind, mesh)
        return variable.replace(NamedSharding(mesh, spec))

    return nnx.map_state(one, state)


def constrain(x, names):
    """Activation sharding constraint from logical names.

    A no-op without a mesh, and inside a ``shard_map`` with manual axes (the
    pipeline runtime): there the batch axes are already manual, and constraints
    on the remaining automatic axes made XLA 0.10's SPMD partitioner abort, so
    the compiler propagates the parameters' shardings instead.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or getattr(mesh, "manual_axes", ()):
        return x
    return jax.lax.with_sharding_constraint(x, spec_for(names, "compute", mesh))


def check_sharded_as_rules(state: nnx.State, mesh, kind: Kind = "storage") -> None:
    """Raise AssertionError listing every array whose sharding differs from the rules.

    Guards against silent replication: a parameter the rules shard over a mesh
    axis of size > 1 must really be split over it.
    """
    expected = state_shardings(state, mesh, kind)
    wrong = []
    for (path, var), (_, want) in zip(nnx.to_flat_state(state), nnx.to_flat_state(expected), strict=True):
        got = var.get_value().sharding
        want = want.get_value()
        if not got.is_equivalent_to(want, var.get_value().ndim):
            wrong.append(f"{'/'.join(map(str, path))}: {got.spec} (rules say {want.spec})")
    if wrong:
        raise AssertionError("parameters not sharded as the rules say: " + "; ".join(wrong))
