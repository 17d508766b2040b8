"""Search with inherited weights: score subnets on validation data, evolve the best.

Scores are bitwise identical on any device count (the same cell layout as the
SPara step: ``vmap_width`` subnets per device per round, the batch cut into a
fixed number of virtual shards, losses gathered unreduced and summed in a fixed
pairwise order), and the search itself runs on the host from a seeded
generator with ties broken by the subnet vector — so the top-k is identical on
1, 2, 4 or 8 devices.

The search is the usual evolutionary loop of once-for-all / SPOS supernets:
a population of uniform subnets (within an optional parameter budget), then
each generation keeps the best half as parents and refills the population with
mutations (each gene redrawn with probability ``mutate_prob``) and uniform
crossovers of two parents. ``generations=0`` is random search. Every subnet is
scored once (a cache keyed by its canonical vector).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mindpipe_jax.errors import ConfigError
from mindpipe_jax.parallel.mesh import manual_axis_names
from mindpipe_jax.supernet.layout import global_array, param_shardings
from mindpipe_jax.supernet.plan import AXES, DATA_AXES, data_devices
from mindpipe_jax.supernet.sampler import rng_for
from mindpipe_jax.supernet.space import SearchSpace
from mindpipe_jax.supernet.spara import SupernetSpec, pairwise_sum

_SEARCH_TAG = 0x5EA4

__all__ = ["make_evaluator", "evolutionary_search", "SearchResult"]


def make_evaluator(spec: SupernetSpec, mesh, *, vmap_width: int, virtual_shards: int, pad_to: int = 1):
    """``evaluate(params, subnets, batches) -> float32[N]``: each subnet's mean validation loss.

    ``batches``: ``{"inputs", "targets"}`` of ``int32[n_batches, rows, T]`` (rows divisible
    by ``virtual_shards``, which must be divisible by ``parallel.fsdp x data``). Any N: the
    subnets are padded to a multiple of ``pad_to`` rounded up to whole rounds of
    ``subnet × vmap_width`` (one compiled program for every call up to that size).
    """
    s, d = mesh.shape["subnet"], data_devices(mesh)
    w, v = vmap_width, virtual_shards
    if v % d:
        raise ConfigError(f"train.virtual_shards={v} must be divisible by parallel.fsdp x data = {d}")
    round_slots = s * w
    bucket = -(-max(pad_to, 1) // round_slots) * round_slots

    def loss_one(params, subnet, shard):
        return spec.loss(params, shard["inputs"], shard["targets"], subnet)

    def per_device(params, subnets, cells):
        # subnets: [rounds, 1, W, G] (this group's column); cells: [n_batches, V/D, rows/V, T].
        params = jax.tree.map(lambda p: lax.pcast(p, AXES, to="varying"), params)
        nb = cells["inputs"].shape[0]
        flat = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), cells)

        def one_round(subs):
            losses = lax.map(lambda shard: jax.vmap(loss_one, in_axes=(None, 0, None))(params, subs, shard),
                             flat)  # [n_batches * V/D, W]
            return losses.reshape(nb, -1, w)

        losses = lax.map(one_round, subnets[:, 0])  # [rounds, n_batches, V/D, W]
        losses = lax.all_gather(losses, DATA_AXES, axis=2, tiled=True, to="invarying")
        # Sums only, then one scale: no product for the compiler to fuse into an FMA.
        losses = pairwise_sum(jnp.moveaxis(losses, 2, 0))  # [rounds, n_batches, W]
        losses = pairwise_sum(jnp.moveaxis(losses, 1, 0)) * (1.0 / (v * nb))  # [rounds, W]
        return lax.all_gather(losses[:, None], "subnet", axis=1, tiled=True, to="invarying")

    # The parameters come as stored (split over fsdp/tensor): gathered over fsdp going in,
    # left split over tensor for the partitioner.
    by_subnet, by_rows = NamedSharding(mesh, P(None, "subnet")), NamedSharding(mesh, P(None, DATA_AXES))
    fn = jax.jit(jax.shard_map(per_device, mesh=mesh, axis_names=manual_axis_names(mesh, AXES),
                               in_specs=(P(), P(None, "subnet"), P(None, DATA_AXES)), out_specs=P()),
                 in_shardings=(param_shardings(mesh, spec), by_subnet, by_rows))

    def evaluate(params, subnets, batches) -> np.ndarray:
        subnets = spec.space.validate(subnets)
        n = len(subnets)
        pad = -n % bucket
        padded = np.concatenate([subnets, np.repeat(subnets[:1], pad, axis=0)])
        grid = padded.reshape(-1, s, w, padded.shape[-1])
        rows = batches["inputs"].shape[1]
        if rows % v:
            raise ConfigError(f"validation batches of {rows} rows must be divisible by "
                              f"train.virtual_shards={v}")
        cells = {k: np.asarray(x).reshape(x.shape[0], v, rows // v, *x.shape[2:]) for k, x in batches.items()}
        cells = {k: global_array(x, by_rows) for k, x in cells.items()}
        losses = fn(params, global_array(grid, by_subnet), cells)
        return np.asarray(jax.device_get(losses)).reshape(-1)[:n]

    return evaluate


@dataclasses.dataclass
class SearchResult:
    """The best subnets found (best first), and what the search did."""

    top: list[dict]  # {"subnet": list[int], "loss": float, "params": int, "arch": str}
    evaluated: int  # distinct subnets scored
    best_per_generation: list[float]

    def table(self) -> str:
        lines = [f"{'rank':>4}  {'val loss':>9}  {'params':>9}  subnet"]
        for i, t in enumerate(self.top):
            lines.append(f"{i + 1:>4}  {t['loss']:>9.4f}  {t['params']:>9,}  {t['arch']}")
        return "\n".join(lines)


def check_budget(space: SearchSpace, cost: Callable[[np.ndarray], int], max_cost: int) -> None:
    """Refuse a parameter budget (``max_cost``, 0 = none) the space's smallest subnet
    exceeds: said before training, not after it, when the search finds nothing."""
    smallest = int(cost(space.smallest()))
    if max_cost and smallest > max_cost:
        raise ConfigError(f"no subnet of the space satisfies the parameter budget {max_cost:,} "
                          f"(supernet.search_max_params); the smallest has {smallest:,}")


def evolutionary_search(space: SearchSpace, score: Callable[[np.ndarray], np.ndarray],
                        cost: Callable[[np.ndarray], int], *, population: int = 16, generations: int = 4,
                        top_k: int = 5, max_cost: int = 0, mutate_prob: float = 0.25,
                        seed: int = 0) -> SearchResult:
    """Minimise ``score`` (lower is better) over the space, subject to ``cost(subnet) <= max_cost``.

    ``score`` maps ``int32[N, genes]`` to ``float[N]``; it is called once per
    generation with the subnets not scored before. Deterministic: the same
    scores give the same result (ties broken by the subnet vector).
    """
    if population < 2:
        raise ConfigError(f"supernet.search_population={population} must be >= 2")
    if not 0 < mutate_prob <= 1:
        raise ConfigError(f"mutate_prob={mutate_prob} must be in (0, 1]")
    scores: dict[tuple, float] = {}
    costs: dict[tuple, int] = {}

    def allowed(sub: np.ndarray) -> bool:
        key = tuple(int(x) for x in sub)
        if key not in costs:
            costs[key] = int(cost(sub))
        return not max_cost or costs[key] <= max_cost

    def fill(pop: list[tuple], make: Callable[[], np.ndarray], limit: int, tries: int) -> list[tuple]:
        seen = set(pop) | set(scores)  # only subnets not scored yet
        for _ in range(tries):
            if len(pop) >= limit:
                break
            sub = space.canonical(make())
            key = tuple(int(x) for x in sub)
            if key not in seen and allowed(sub):
                pop.append(key)
                seen.add(key)
        return pop

    def rank(keys) -> list[tuple]:
        return sorted(keys, key=lambda k: (scores[k], k))

    def evaluate(keys: list[tuple]) -> None:
        new = [k for k in keys if k not in scores]
        if new:
            for k, s in zip(new, np.asarray(score(np.asarray(new, np.int32)), np.float64), strict=True):
                scores[k] = float(s)

    rng = rng_for(seed, 0, _SEARCH_TAG)
    card = space.cardinalities
    pop = fill([], lambda: rng.integers(0, card), population, tries=200 * population)
    if not pop:
        check_budget(space, cost, max_cost)
        raise ConfigError(f"no subnet sampled in {200 * population:,} tries satisfies the parameter "
                          f"budget {max_cost:,} (supernet.search_max_params), close to the smallest "
                          f"subnet's {int(cost(space.smallest())):,}; raise it")
    evaluate(pop)
    best = [scores[rank(pop)[0]]]
    for gen in range(1, generations + 1):
        rng = rng_for(seed, gen, _SEARCH_TAG)
        parents = rank(scores)[: max(2, population // 2)]
        arr = np.asarray(parents, np.int32)

        mutate = functools.partial(_mutate, rng, arr, card, mutate_prob)
        crossover = functools.partial(_crossover, rng, arr)
        children = fill([], mutate, population // 2, tries=50 * population)
        children = fill(children, crossover, population, tries=50 * population)
        evaluate(children)
        best.append(scores[rank(scores)[0]])
    top = rank(scores)[:top_k]
    out = [{"subnet": list(k), "loss": scores[k], "params": costs[k],
            "arch": space.describe(np.asarray(k, np.int32))} for k in top]
    return SearchResult(out, len(scores), best)


def _mutate(rng, parents: np.ndarray, card: np.ndarray, prob: float) -> np.ndarray:
    """A random parent with each gene redrawn with probability ``prob``."""
    child = parents[rng.integers(0, len(parents))]
    return np.where(rng.random(len(card)) < prob, rng.integers(0, card), child)


def _crossover(rng, parents: np.ndarray) -> np.ndarray:
    """Each gene from one of two random parents."""
    a, b = parents[rng.integers(0, len(parents), size=2)]
    return np.where(rng.random(len(a)) < 0.5, a, b)
