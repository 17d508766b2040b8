"""Search spaces: genes, subnet vectors, and the NNX pieces a supernet layer is built from.

A **subnet** is a small integer vector: one entry per gene, each the index of a
choice. A **gene** is one decision a layer declares:

* an *operator choice* among candidates of the same shape (e.g. several FFN
  blocks, each with its own weights and activation) — unordered;
* an *elastic width* (MLP hidden size, attention heads) — ordered, the active
  units are a prefix of the full layer;
* an *elastic depth* (how many blocks run; the others are skipped) — ordered.

Weights of operator candidates live in :class:`Candidate` variables whose leading
axes are the model's **unit grid** (``[layers, candidates]`` for the reference
supernet): one unit per (layer, candidate). A subnet *uses* a unit when its
forward pass reads that candidate; two subnets that use no unit in common are
independent (what the operator-causal semantics in ``spara.py`` builds waves from).
Every other ``nnx.Param`` is **shared**: read by every subnet.

Everything in a subnet's forward pass is selected by data, never by shape:

* :func:`select` picks a candidate's weights with a one-hot contraction over the
  candidate axis. Its backward is an outer product with the one-hot vector, so
  each candidate's gradient is written densely (exactly zero for the ones not
  chosen): no scatter-add, no order that depends on duplicate indices.
* :func:`prefix_mask` turns a width choice into a mask of the first ``n``
  entries; masked activations are zero, so the masked weights get zero gradient.
* Depth is a per-layer gate (``jnp.where(active, block(x), x)``).

So one compiled program serves every subnet of the space, under ``vmap`` too.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mindpipe_jax.errors import ConfigError

__all__ = ["Gene", "SearchSpace", "Candidate", "select", "prefix_mask"]


@dataclasses.dataclass(frozen=True)
class Gene:
    """One decision of the space: ``choices`` are the values, a subnet stores the index.

    ``ordered`` genes (widths, depth) list their choices smallest first, so
    "largest" and "smallest" subnets are the last and first choice; an operator
    choice is unordered.
    """

    name: str
    choices: tuple
    ordered: bool = True

    def __post_init__(self):
        if not self.choices:
            raise ConfigError(f"gene {self.name!r} has no choices")
        if self.ordered and list(self.choices) != sorted(self.choices):
            raise ConfigError(f"gene {self.name!r} is ordered, so its choices {list(self.choices)} "
                              f"must be listed smallest first")

    def __len__(self) -> int:
        return len(self.choices)


@dataclasses.dataclass(frozen=True)
class SearchSpace:
    """An ordered tuple of genes; a subnet is an ``int32[len(genes)]`` vector of choice indices.

    ``depth_gene`` (optional) names the gene that decides how many of the
    ``layer_genes`` groups are active: the genes of skipped layers do not change
    the subnet, and :meth:`canonical` sets them to 0 so that one architecture
    has one vector.
    """

    genes: tuple[Gene, ...]
    depth_gene: str | None = None
    layer_genes: tuple[tuple[str, ...], ...] = ()  # per layer, the names of its genes

    def __post_init__(self):
        names = [g.name for g in self.genes]
        if len(set(names)) != len(names):
            raise ConfigError(f"gene names must be unique, got {names}")
        known = set(names)
        for layer in self.layer_genes:
            if not set(layer) <= known:
                raise ConfigError(f"layer genes {sorted(set(layer) - known)} are not in the space")
        if self.depth_gene is not None and self.depth_gene not in known:
            raise ConfigError(f"depth gene {self.depth_gene!r} is not in the space")

    # --- shape of the space -------------------------------------------------------------------

    @property
    def num_genes(self) -> int:
        return len(self.genes)

    @property
    def cardinalities(self) -> np.ndarray:
        return np.array([len(g) for g in self.genes], np.int64)

    @property
    def size(self) -> int:
        """Number of distinct subnet vectors (the product of the genes' choice counts)."""
        return math.prod(len(g) for g in self.genes)

    @property
    def num_architectures(self) -> int:
        """Number of distinct architectures: vectors differing only in skipped layers' genes count once."""
        if self.depth_gene is None:
            return self.size
        per_layer = [math.prod(len(self.gene(n)) for n in layer) for layer in self.layer_genes]
        in_layers = {n for layer in self.layer_genes for n in layer}
        rest = math.prod(len(g) for g in self.genes if g.name not in in_layers and g.name != self.depth_gene)
        return rest * sum(math.prod(per_layer[:d]) for d in self.gene(self.depth_gene).choices)

    def gene(self, name: str) -> Gene:
        for g in self.genes:
            if g.name == name:
                return g
        raise ConfigError(f"no gene {name!r}; genes: {', '.join(g.name for g in self.genes)}")

    def index(self, name: str) -> int:
        return [g.name for g in self.genes].index(self.gene(name).name)

    # --- subnets ------------------------------------------------------------------------------

    def validate(self, subnets) -> np.ndarray:
        """``int32[..., num_genes]`` with every index in range, else ConfigError."""
        arr = np.asarray(subnets)
        if arr.ndim < 1 or arr.shape[-1] != self.num_genes or not np.issubdtype(arr.dtype, np.integer):
            raise ConfigError(f"a subnet is an integer vector of {self.num_genes} choice indices "
                              f"({', '.join(g.name for g in self.genes)}); got shape {arr.shape} "
                              f"dtype {arr.dtype}")
        bad = (arr < 0) | (arr >= self.cardinalities)
        if bad.any():
            where = np.argwhere(bad)[0]
            gene = self.genes[where[-1]]
            raise ConfigError(f"subnet {arr[tuple(where[:-1])].tolist()}: gene {gene.name!r} index "
                              f"{arr[tuple(where)]} is out of range; valid: 0..{len(gene) - 1}")
        return arr.astype(np.int32)

    def canonical(self, subnets) -> np.ndarray:
        """Set the genes of skipped layers to 0 (one vector per architecture)."""
        arr = self.validate(subnets).copy()
        if self.depth_gene is None:
            return arr
        depth = np.asarray(self.gene(self.depth_gene).choices)[arr[..., self.index(self.depth_gene)]]
        for layer, names in enumerate(self.layer_genes):
            skipped = depth <= layer
            for name in names:
                arr[..., self.index(name)] = np.where(skipped, 0, arr[..., self.index(name)])
        return arr

    def decode(self, subnet) -> dict:
        """``{gene name: choice value}`` of one subnet."""
        arr = self.validate(subnet)
        if arr.ndim != 1:
            raise ConfigError(f"decode takes one subnet, got shape {arr.shape}")
        return {g.name: g.choices[i] for g, i in zip(self.genes, arr.tolist(), strict=True)}

    def describe(self, subnet) -> str:
        """A short human-readable form, skipped layers left out."""
        values = self.decode(subnet)
        depth = values.get(self.depth_gene) if self.depth_gene else None
        parts = [f"depth={depth}"] if depth is not None else []
        in_layers = {n for layer in self.layer_genes for n in layer}
        parts += [f"{g.name}={values[g.name]}" for g in self.genes
                  if g.name not in in_layers and g.name != self.depth_gene]
        for layer, names in enumerate(self.layer_genes):
            if depth is not None and layer >= depth:
                break
            parts.append("/".join(str(values[n]) for n in names))
        return " ".join(parts)

    def largest(self, op_choices: Sequence[int] | None = None) -> np.ndarray:
        """Every ordered gene at its last choice; unordered genes from ``op_choices`` (default 0)."""
        return self._extreme(-1, op_choices)

    def smallest(self, op_choices: Sequence[int] | None = None) -> np.ndarray:
        """Every ordered gene at its first choice; unordered genes from ``op_choices`` (default 0)."""
        return self._extreme(0, op_choices)

    def _extreme(self, which: int, op_choices) -> np.ndarray:
        unordered = [i for i, g in enumerate(self.genes) if not g.ordered]
        ops = list(op_choices) if op_choices is not None else [0] * len(unordered)
        if len(ops) != len(unordered):
            raise ConfigError(f"op_choices needs {len(unordered)} values (one per unordered gene), "
                              f"got {len(ops)}")
        out = np.array([len(g) - 1 if which == -1 else 0 for g in self.genes], np.int32)
        out[unordered] = ops
        return self.canonical(out)


class Candidate(nnx.Param):
    """A parameter stacked over operator candidates: its leading axes are the model's unit grid.

    Only the candidates a subnet chooses receive gradient; the operator-causal semantics
    treats each (layer, candidate) slice as one unit that subnets may share.
    """


def select(onehot, stacked):
    """The chosen candidate's weights: contract a one-hot ``[C]`` with ``stacked[C, ...]``.

    Exact in the forward (``1·w + 0·w' = w`` for finite weights) and dense in the
    backward (the gradient of candidate ``c`` is ``onehot[c] · g``).
    """
    return jnp.tensordot(onehot.astype(stacked.dtype), stacked, axes=1)


def prefix_mask(n_active, size: int):
    """Boolean ``[size]``: True for the first ``n_active`` entries (``n_active`` may be traced)."""
    return jnp.arange(size) < n_active


def choice_value(gene: Gene, index):
    """The value of a (traced) choice index of a numeric gene."""
    return jnp.asarray(np.asarray(gene.choices))[index]


def onehot(index, n: int):
    return jax.nn.one_hot(index, n, dtype=jnp.float32)
