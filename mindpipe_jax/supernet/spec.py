"""The supernet as raveled vectors: ``SupernetSpec`` and ``supernet_spec``.

Inside SPara every gradient, every parameter update and the AdamW moments are one
``float32[padded_size]`` vector over all parameters in tree order, padded to
``PARAM_CHUNKS`` equal chunks, and each element knows its unit (an operator
candidate of the grid, or "shared"). This module builds that picture once from a
supernet module: which parameters are searchable (``Candidate``), which decay, the
element → unit map as runs of broadcasts, and ravel / unravel / expand.

Separate because everything else reads it and it knows nothing of meshes or steps:
the planner (``plan.py``, units per subnet), the optimizer (``optimizer.py``,
per-unit values per element), the step (``spara.py``), the search and the trainer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mindpipe_jax.errors import ConfigError
from mindpipe_jax.supernet.space import Candidate, SearchSpace
from mindpipe_jax.train.state import refuse_untrainable_params

# Raveled vectors are cut into this many equal chunks. Each device updates the chunks
# it owns (ZeRO-1 style), and the per-subnet gradient norm sums per-chunk partial sums
# in a fixed order: the same association on every device count that divides it.
PARAM_CHUNKS = 64


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity (caches key on it)
class SupernetSpec:
    """Static facts about a supernet: structure, params, which are searchable, the unit grid."""

    graphdef: Any
    module: Any  # the abstract module: space, unit_grid, units()
    abstract_params: Any  # pure dict of ShapeDtypeStruct
    searchable: Any  # pure dict of bool: Candidate parameters
    decay: Any  # pure dict of bool: weight decay (matrices only)
    units_batch: Callable  # jitted int32[N, genes] -> bool[N, *unit_grid]
    unit_of: np.ndarray  # int32[Pp]: each raveled parameter's unit (raveled grid index), U if shared
    decay_flat: np.ndarray  # bool[Pp]
    # unit_of as runs, in order: (per_unit, n) is a Candidate leaf of n elements, per_unit for
    # each unit of the grid in turn; (0, n) is n consecutive shared elements.
    segments: tuple[tuple[int, int], ...] = ()
    # The parameters as an abstract nnx State, with their logical axis names: the rules
    # table turns them into storage shardings (fsdp, tensor) for the step's state.
    abstract_state: Any = None

    @property
    def space(self):
        return self.module.space

    @property
    def num_params(self) -> int:
        """Parameters of the supernet (the raveled vectors are padded to ``padded_size``)."""
        return sum(leaf.size for leaf in jax.tree.leaves(self.abstract_params))

    @property
    def padded_size(self) -> int:
        """Length of a raveled vector: ``num_params`` rounded up to ``PARAM_CHUNKS`` chunks."""
        return len(self.unit_of)

    @property
    def shares_weights(self) -> bool:
        """Whether any parameter is shared (read by every subnet): then ``sequential``
        orders every subnet after the one before it."""
        return int((self.unit_of[:self.num_params] == self.num_units).sum()) > 0

    @property
    def num_units(self) -> int:
        return int(np.prod(self.unit_grid))

    def ravel(self, tree) -> jax.Array:
        """All parameters (or gradients) as one ``float32[padded_size]`` vector, in tree order."""
        parts = [x.reshape(-1).astype(jnp.float32) for x in jax.tree.leaves(tree)]
        pad = self.padded_size - self.num_params
        return jnp.concatenate(parts + ([jnp.zeros((pad,), jnp.float32)] if pad else []))

    def expand(self, values) -> jax.Array:
        """Per-unit values ``[..., U + 1]`` (the last: shared) as per-element values
        ``[..., padded_size]``: the same as ``values[..., unit_of]``, built from broadcasts.

        (A gather over every parameter was most of the optimizer's time on the CPU:
        ~10x optax's adamw. Broadcasting the per-unit values over :attr:`segments`
        copies the same numbers, so the results are bitwise the same.)
        """
        values = jnp.asarray(values)
        lead, n_units = values.shape[:-1], self.num_units
        pieces = []
        for per_unit, n in self.segments:
            if per_unit:
                block = jnp.broadcast_to(values[..., :n_units, None], (*lead, n_units, per_unit))
                pieces.append(block.reshape(*lead, n))
            else:
                pieces.append(jnp.broadcast_to(values[..., n_units:], (*lead, n)))
        return jnp.concatenate(pieces, axis=-1)

    def unravel(self, flat, dtype=None):
        """The inverse of :meth:`ravel`, in the parameters' own dtypes (or ``dtype``: the
        AdamW moments stay float32 whatever the parameters' dtype)."""
        leaves, treedef = jax.tree.flatten(self.abstract_params)
        out, start = [], 0
        for leaf in leaves:
            out.append(flat[start:start + leaf.size].reshape(leaf.shape).astype(dtype or leaf.dtype))
            start += leaf.size
        return jax.tree.unflatten(treedef, out)

    @property
    def unit_grid(self) -> tuple[int, ...]:
        return tuple(self.module.unit_grid)

    def merge(self, params):
        return nnx.merge(self.graphdef, params)

    def loss(self, params, inputs, targets, subnet):
        return self.merge(params).loss(inputs, targets, subnet)

    def loss_and_grad(self, params, subnet, batch, ravel: bool = True):
        """``subnet``'s loss on ``batch`` (``{"inputs", "targets"}``) and its gradient,
        raveled (or, ``ravel=False``, in the parameters' tree)."""
        loss, grads = jax.value_and_grad(
            lambda p: self.loss(p, batch["inputs"], batch["targets"], subnet))(params)
        return loss, self.ravel(grads) if ravel else grads

    def units(self, subnets) -> np.ndarray:
        """``bool[N, *unit_grid]``: the units each subnet reads (host NumPy)."""
        return np.asarray(self.units_batch(jnp.asarray(subnets, jnp.int32)))


def _decays(variable) -> bool:
    names = (variable.get_metadata() or {}).get("out_sharding")
    if names is None:
        return variable.get_value().ndim >= 2
    return sum(1 for n in names if n not in (None, "layers", "stages")) >= 2


@runtime_checkable
class Supernet(Protocol):
    """What SPara's training and the search need of a supernet module; the reference
    ``SuperGPT`` implements it. Searchable weights are ``Candidate`` parameters whose
    leading axes are ``unit_grid``; every other ``nnx.Param`` is shared."""

    space: SearchSpace  # the genes; a subnet is an int32 vector of choice indices

    @property
    def unit_grid(self) -> tuple[int, ...]: ...  # leading axes of every Candidate parameter

    def units(self, subnet) -> jax.Array: ...  # bool[unit_grid]: the units the subnet reads (traced)

    def loss(self, inputs, targets, subnet) -> jax.Array: ...  # the subnet's mean loss

    def active_params(self, subnet) -> int: ...  # parameters its forward pass uses (host NumPy)


SUPERNET_MEMBERS = ("space", "unit_grid", "units(subnet)", "loss(inputs, targets, subnet)",
                    "active_params(subnet)")


def check_supernet(module) -> None:
    """Every member of ``Supernet`` at once, named in one line."""
    def lacks(member: str) -> bool:
        name = member.split("(")[0]
        return not hasattr(module, name) or ("(" in member and not callable(getattr(module, name)))
    missing = [m for m in SUPERNET_MEMBERS if lacks(m)]
    if missing:
        raise ConfigError(f"{type(module).__name__} is not a supernet: it lacks {', '.join(missing)} "
                          f"(mindpipe_jax.supernet.Supernet lists what a supernet provides: "
                          f"{', '.join(SUPERNET_MEMBERS)}; SuperGPT is one)")
    if not isinstance(module.space, SearchSpace):
        raise ConfigError(f"{type(module).__name__}.space is a {type(module.space).__name__}, not a "
                          f"mindpipe_jax.supernet.SearchSpace")


def supernet_spec(model_or_factory, seed: int = 0):
    """A supernet module (or factory ``rngs -> module``) → (SupernetSpec, create).

    The module needs ``space`` (a SearchSpace), ``unit_grid``, ``units(subnet)``
    and ``loss(inputs, targets, subnet)``; its searchable parameters are
    :class:`Candidate` variables whose leading axes are the unit grid.
    ``create()`` returns the initial params as a pure dict (call it under jit).
    """
    if isinstance(model_or_factory, nnx.Module):
        module = model_or_factory
        graphdef, state = nnx.split(module, nnx.Param)
        concrete = nnx.to_pure_dict(state)
        create = lambda: concrete  # noqa: E731
        abstract_state = nnx.eval_shape(lambda: state)
    elif callable(model_or_factory):
        def build():
            with nnx.use_eager_sharding(False):
                return model_or_factory(nnx.Rngs(seed))

        module = nnx.eval_shape(build)
        graphdef, abstract_state = nnx.split(module, nnx.Param)

        def create():
            return nnx.to_pure_dict(nnx.split(build(), nnx.Param)[1])
    else:
        raise ConfigError(f"the supernet must be an nnx.Module or a callable rngs -> nnx.Module, "
                          f"got {type(model_or_factory).__name__}")
    check_supernet(module)
    refuse_untrainable_params(abstract_state)
    grid = tuple(module.unit_grid)
    searchable = nnx.to_pure_dict(nnx.map_state(lambda _, v: isinstance(v, Candidate), abstract_state))
    decay = nnx.to_pure_dict(nnx.map_state(lambda _, v: _decays(v), abstract_state))
    shapes = nnx.to_pure_dict(abstract_state)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), shapes)
    flat = jax.tree_util.tree_flatten_with_path(abstract)[0]
    marks = jax.tree.leaves(searchable)
    if not any(marks):
        raise ConfigError(f"{type(module).__name__} has no Candidate parameters: nothing is searchable")
    for (path, leaf), is_unit in zip(flat, marks, strict=True):
        if is_unit and tuple(leaf.shape[:len(grid)]) != grid:
            raise ConfigError(f"Candidate parameter {jax.tree_util.keystr(path)} has shape {leaf.shape}; "
                              f"its leading axes must be the unit grid {grid}")
    units_batch = jax.jit(jax.vmap(module.units))
    n_units = int(np.prod(grid))
    unit_of, decay_flat, segments = [], [], []
    for leaf, is_unit, decays in zip(jax.tree.leaves(abstract), marks, jax.tree.leaves(decay), strict=True):
        per_unit = leaf.size // n_units
        unit_of.append(np.repeat(np.arange(n_units, dtype=np.int32), per_unit) if is_unit
                       else np.full(leaf.size, n_units, np.int32))
        decay_flat.append(np.full(leaf.size, decays, bool))
        segments.append((per_unit if is_unit else 0, leaf.size))
    pad = -sum(len(u) for u in unit_of) % PARAM_CHUNKS  # padding: a "shared" zero, never decayed
    unit_of.append(np.full(pad, n_units, np.int32))
    decay_flat.append(np.zeros(pad, bool))
    segments.append((0, pad))
    runs = []  # consecutive shared leaves as one run
    for per_unit, n in segments:
        if runs and per_unit == 0 and runs[-1][0] == 0:
            runs[-1] = (0, runs[-1][1] + n)
        elif n:
            runs.append((per_unit, n))
    spec = SupernetSpec(graphdef, module, abstract, searchable, decay, units_batch,
                        np.concatenate(unit_of), np.concatenate(decay_flat), tuple(runs), abstract_state)
    return spec, create
