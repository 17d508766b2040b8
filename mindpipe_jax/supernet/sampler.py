"""Deterministic subnet sampling: the subnets of step t are a pure function of (seed, t).

Nothing here looks at devices, processes or earlier steps: every process of a
run, on any mesh, draws the same ``int32[K, genes]`` for step t, and a resumed
run draws what an uninterrupted one would have. The generator is NumPy's PCG64
seeded by ``SeedSequence([seed, t, tag])`` (stable across NumPy versions and
platforms by NumPy's own guarantee for ``SeedSequence`` + ``PCG64``).

Strategies
----------
``uniform``
    Every gene independently uniform over its choices (depth too), then
    :meth:`SearchSpace.canonical` (genes of skipped layers set to 0).
``sandwich``
    BigNAS/OFA's sandwich rule: the largest subnet, the smallest, and K-2
    uniform ones. "Largest"/"smallest" fix the ordered genes (widths, heads,
    depth) at their extremes; unordered genes (which operator) are drawn
    uniformly, so every operator candidate gets trained at both extremes.
"""

from __future__ import annotations

import numpy as np

from mindpipe_jax.errors import ConfigError
from mindpipe_jax.supernet.space import SearchSpace

STRATEGIES = ("uniform", "sandwich")
_TAG = 0x5A9A  # separates the sampler's streams from any other use of (seed, t)

__all__ = ["STRATEGIES", "sample_subnets", "Sampler", "rng_for"]


def rng_for(seed: int, step: int, tag: int = _TAG) -> np.random.Generator:
    """A generator that depends on (seed, step, tag) only."""
    if seed < 0 or step < 0:
        raise ConfigError(f"seed={seed} and step={step} must be >= 0")
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, step, tag])))


def _uniform(space: SearchSpace, rng: np.random.Generator, n: int) -> np.ndarray:
    return space.canonical(rng.integers(0, space.cardinalities, size=(n, space.num_genes)).astype(np.int32))


def sample_subnets(space: SearchSpace, seed: int, step: int, k: int, strategy: str = "uniform") -> np.ndarray:
    """The ``k`` subnets of step ``step``: ``int32[k, space.num_genes]``."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"supernet.strategy={strategy!r} is not valid; valid: "
                          f"{', '.join(repr(s) for s in STRATEGIES)}")
    if k < 1:
        raise ConfigError(f"supernet.subnets_per_step={k} must be >= 1")
    rng = rng_for(seed, step)
    if strategy == "uniform":
        return _uniform(space, rng, k)
    if k < 2:
        raise ConfigError(f"supernet.subnets_per_step={k}: the sandwich strategy needs >= 2 "
                          f"(largest + smallest [+ random])")
    unordered = [len(g) for g in space.genes if not g.ordered]
    big = space.largest([int(rng.integers(0, n)) for n in unordered])
    small = space.smallest([int(rng.integers(0, n)) for n in unordered])
    return np.concatenate([big[None], small[None], _uniform(space, rng, k - 2)]).astype(np.int32)


class Sampler:
    """``Sampler(space, k, strategy, seed)(t)`` → the subnets of step t."""

    def __init__(self, space: SearchSpace, k: int, strategy: str = "sandwich", seed: int = 0):
        sample_subnets(space, seed, 0, k, strategy)  # validates now, not at step 0 of a long run
        self.space, self.k, self.strategy, self.seed = space, k, strategy, seed

    def __call__(self, step: int) -> np.ndarray:
        return sample_subnets(self.space, self.seed, step, self.k, self.strategy)
