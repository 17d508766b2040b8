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

import contextlib
import contextvars
from typing import Literal

import jax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mindpipe_jax.config import MESH_AXES
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
    # Mesh axis names used as logical names (models annotated for a mesh like ours).
    "tensor":   (("tensor",),        ("tensor",)),
    "fsdp":     (("fsdp",),          ()),
    "expert":   (("expert",),        ("expert",)),
}


_extra: contextvars.ContextVar[dict | None] = contextvars.ContextVar("mindpipe_rules", default=None)
# The logical names looked up while ``recording_lookups`` runs (None: not recording).
_looked_up: contextvars.ContextVar[set | None] = contextvars.ContextVar("mindpipe_rules_seen", default=None)


def _row(axes: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A user's row: the same mesh axes for storage and compute, except ``fsdp``,
    which shards storage only (gathered for compute, as the ``embed`` row does)."""
    return axes, tuple(a for a in axes if a != "fsdp")


def parse_rules(entries) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """``["tp=tensor", "kv=", "w=fsdp,tensor"]`` (or a dict name -> axes) as table rows."""
    items = entries.items() if isinstance(entries, dict) else [
        (e.partition("=")[0].strip(), e.partition("=")[2]) if "=" in e else (e, None)
        for e in _entries(entries)]
    rows = {}
    for name, axes in items:
        if not isinstance(name, str) or axes is None or not name:
            raise ConfigError(f"parallel.rules entry {name!r} must be 'logical_name=mesh_axis[,mesh_axis]' "
                              f"or 'logical_name=' (keep whole), e.g. 'tp=tensor'")
        if isinstance(axes, str):
            axes = tuple(a.strip() for a in axes.split(",") if a.strip())
        if not isinstance(axes, (tuple, list)) or not all(isinstance(a, str) for a in axes):
            raise ConfigError(f"parallel.rules row {name!r}: {axes!r} must be mesh axis names (a tuple of "
                              f"strings, or one string 'tensor' / 'fsdp,tensor'; () keeps it whole)")
        axes = tuple(axes)
        bad = [a for a in axes if a not in MESH_AXES]
        if bad:
            raise ConfigError(f"parallel.rules entry {name}={','.join(axes)}: {bad[0]!r} is not a mesh axis; "
                              f"valid: {', '.join(MESH_AXES)}")
        rows[name] = _row(axes)
    return rows


def _entries(entries) -> list:
    """The ``["name=axes", ...]`` form checked: one string, or a non-list, is refused in one
    line (a string would be read a character at a time)."""
    if isinstance(entries, str):
        raise ConfigError(f"parallel.rules {entries!r} is one string; give a list of them, "
                          f"['{entries}'], or a dict logical name -> mesh axes")
    if not isinstance(entries, (list, tuple)):
        raise ConfigError(f"parallel.rules must be a list of 'logical_name=mesh_axis' strings or a dict "
                          f"logical name -> mesh axes, got {type(entries).__name__}")
    bad = [e for e in entries if not isinstance(e, str)]
    if bad:
        raise ConfigError(f"parallel.rules entry {bad[0]!r} must be a string 'logical_name=mesh_axis', "
                          f"e.g. 'tp=tensor'")
    return list(entries)


@contextlib.contextmanager
def use_rules(entries):
    """Extra rows of the rules table while the block runs (``parallel.rules`` uses
    this too): ``with mp.use_rules({"tp": ("tensor",), "kv_heads": ()}): mp.train(...)``.
    A row for a built-in name replaces it."""
    token = _extra.set({**(_extra.get() or {}), **parse_rules(entries)})
    try:
        yield
    finally:
        _extra.reset(token)


def active_rules() -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    return {**RULES, **(_extra.get() or {})}


def user_row_names() -> frozenset[str]:
    """The logical names a ``use_rules`` block (or ``parallel.rules``) gives a row."""
    return frozenset(_extra.get() or ())


@contextlib.contextmanager
def recording_lookups():
    """The set of logical names ``spec_for`` resolves while the block runs (parameters
    sharded, activations constrained): what ``check_rules_used`` compares against."""
    seen: set[str] = set()
    token = _looked_up.set(seen)
    try:
        yield seen
    finally:
        _looked_up.reset(token)


def check_rules_used(entries) -> None:
    """Refuse a ``parallel.rules`` row for a name nothing looked up in the enclosing
    ``recording_lookups`` block: a misspelt name (``"mpl="`` for ``"mlp="``) was accepted
    and left the built-in row in force. Outside such a block, nothing to compare."""
    looked_up = _looked_up.get()
    if looked_up is None:
        return
    unused = [name for name in parse_rules(entries) if name not in looked_up]
    if unused:
        used = ", ".join(sorted(looked_up)) or "none"
        raise ConfigError(f"parallel.rules has a row for {unused[0]!r}, a logical name no parameter or "
                          f"activation of the model uses, so it changes nothing (names used: {used}); "
                          f"check its spelling, or drop it")


class UnknownLogicalAxis(ConfigError):
    def __init__(self, name: str, known):
        self.name = name
        super().__init__(f"logical axis {name!r} is not in the rules table (known: {', '.join(known)}); "
                         f"add a row: parallel.rules=[\"{name}=tensor\"] in the config, or "
                         f"mindpipe_jax.use_rules({{{name!r}: ('tensor',)}}) in Python (\"{name}=\" keeps "
                         f"it whole)")


def spec_for(names, kind: Kind = "compute", mesh=None) -> P:
    """PartitionSpec for a tuple of logical names (None = unsharded dim)."""
    if kind not in ("storage", "compute"):
        raise ConfigError(f"spec_for kind={kind!r}: valid kinds are 'storage' and 'compute'")
    if isinstance(names, str):
        raise ConfigError(f"spec_for names={names!r}: give a tuple of logical names, one per dimension, "
                          f"e.g. ({names!r},)")
    column = 0 if kind == "storage" else 1
    rules = active_rules()
    seen = _looked_up.get()
    if seen is not None:
        seen.update(name for name in names if name is not None)
    used: set[str] = set()
    parts = []
    for name in names:
        if name is None:
            parts.append(None)
            continue
        if name not in rules:
            raise UnknownLogicalAxis(name, rules)
        axes = tuple(a for a in rules[name][column]
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
    if len(names) != len(shape):  # zipped, the extra dimensions were silently left whole
        raise ConfigError(f"parameter {'/'.join(map(str, path))} of shape {tuple(shape)} has {len(names)} "
                          f"logical axis name{'s' * (len(names) != 1)} {tuple(names)}; give one per "
                          f"dimension (None keeps one whole)")
    try:
        spec = list(spec_for(names, kind, mesh))
    except UnknownLogicalAxis as err:
        raise ConfigError(f"parameter {'/'.join(map(str, path))} {tuple(names)}: {err}") from None
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
