"""SPara: K subnets per step in one jitted program, bitwise equal on any device count.

The step
--------
A step trains K subnets (``int32[K, genes]``, from ``sampler.py``) on one global
batch. Two mesh axes split the work: ``subnet`` (S device groups, each takes its
share of the K subnets) and ``data`` (D devices per group split the batch). The
work is cut into fixed **cells**: (subnet, virtual data shard), with
``train.virtual_shards`` = V shards of the batch. A device computes, per
*round*, ``vmap_width`` = W subnets (``jax.vmap``, parameters shared, not
batched) on each of its V/D shards (``lax.map``). Rounds hold R = S·W slots.

Every cell's gradient is summed in one fixed order, never by an all-reduce: a
balanced pairwise tree over the V shards whose lower levels are a device's own
contiguous shards and whose upper levels run over the data devices in order
(for power-of-two V and D that is the same tree on every mesh). One
``all_to_all`` gives each of the N = S·D devices every device's partial
gradient of every slot of the round for the 1/N of the raveled parameters it
owns, and it sums the data devices' partials in device order; per-subnet
norms are sums of 64 fixed chunks (``PARAM_CHUNKS``) in a fixed order; clipping,
the ``[K, P/N]`` buffer, the pairwise sum over the K subnets and AdamW run on that
1/N; the new parameters are all-gathered. Each cell is
computed by the same per-device program (the vmap width W and the shard shape
are fixed by the config, not by the mesh; ``vmap`` of a different width *does*
change the bits, measured), and every later operation is elementwise on the
same values or a fixed-shape reduction, so the parameters after N steps are
bitwise identical for every split of the devices between ``subnet`` and
``data``. The cost is memory: a device holds the unreduced gradients of its
cells, ``[V/D, W, P]``, before the exchange.

Selecting a subnet never scatters: candidate weights are chosen by a one-hot
contraction and widths/depth by masks (``space.py``), so each candidate's
gradient is a dense array, exactly zero where the subnet did not read it.

Optimizer: lazy AdamW
---------------------
Every parameter has AdamW moments; **Candidate** parameters (the searchable
operators) have one step count per unit (``[layers, candidates]``) and are
updated only where a subnet used the unit: an operator no subnet chose keeps
its weights and moments (no weight decay or momentum drift while unsampled).
Shared parameters (embedding, attention, norms, head) are updated every step.
Each subnet's gradient is clipped to ``optim.clip_norm`` on its own (per-subnet
global norm) before it is combined. Inside the step every gradient is one
raveled ``float32[P]`` vector (a few large arrays instead of one per leaf: less
to compile); the optimizer state is kept the same way (``mu``, ``nu``:
``float32[P]``; ``count``: ``int32[units + 1]``, the last for shared params).

Two semantics
-------------
``sync``
    All K subnets read the weights of the step start. Gradients (each clipped)
    are averaged over the K subnets in a fixed pairwise order; one lazy AdamW
    update (units: those any subnet used).
    *Reference*: compute each subnet's gradient one by one, combine, update.

``causal``
    The result of training the K subnets one after another, in sampling order,
    where subnet k's **searchable** weights (operator candidates) include the
    updates of subnets 0..k-1, while the **shared** weights are those of the
    step start for all K and take one update at the end of the step from the
    average of the K subnets' gradients (fixed pairwise order).
    *Reference*: for k = 0..K-1: gradient of subnet k at the current weights,
    clip, apply a lazy AdamW update to the units it used (a full step with its
    own gradient), keep its shared gradient; then average the K shared
    gradients and update the shared weights.

    Executed in **waves**: subnet k goes into wave 1 + max(wave of an earlier
    subnet sharing a unit with it), or wave 0. Subnets of a wave use disjoint
    units, so computing them together at the wave's start weights and updating
    each unit from its one user equals the sequential loop. The unit gradients
    of a wave are summed over its slots: every element has at most one nonzero
    term, so that sum is exact in any order.

    Why shared layers are handled this way: every subnet reads the embedding,
    attention, norms and head, so if they defined conflicts, every pair of
    subnets would conflict and causal would mean fully sequential (NASPipe
    separates them for the same reason). Only the operator choices define
    conflicts; the shared weights follow the sync rule inside a step, and the
    steps themselves are sequential.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mindpipe_jax.config import OptimConfig
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.supernet.space import Candidate
from mindpipe_jax.train.state import lr_schedule

SEMANTICS = ("sync", "causal")
AXES = ("subnet", "data")
# Raveled vectors are cut into this many equal chunks. Each device updates the chunks
# it owns (ZeRO-1 style), and the per-subnet gradient norm sums per-chunk partial sums
# in a fixed order: the same association on every device count that divides it.
PARAM_CHUNKS = 64

__all__ = ["SEMANTICS", "SupernetSpec", "supernet_spec", "init_state", "StepPlan", "plan_step",
           "causal_waves", "make_spara_step", "reference_step", "check_layout"]


# --- the model ------------------------------------------------------------------------------------


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

    def unravel(self, flat):
        """The inverse of :meth:`ravel`, in the parameters' own dtypes."""
        leaves, treedef = jax.tree.flatten(self.abstract_params)
        out, start = [], 0
        for leaf in leaves:
            out.append(flat[start:start + leaf.size].reshape(leaf.shape).astype(leaf.dtype))
            start += leaf.size
        return jax.tree.unflatten(treedef, out)

    @property
    def unit_grid(self) -> tuple[int, ...]:
        return tuple(self.module.unit_grid)

    def merge(self, params):
        return nnx.merge(self.graphdef, params)

    def loss(self, params, inputs, targets, subnet):
        return self.merge(params).loss(inputs, targets, subnet)

    def units(self, subnets) -> np.ndarray:
        """``bool[N, *unit_grid]``: the units each subnet reads (host NumPy)."""
        return np.asarray(self.units_batch(jnp.asarray(subnets, jnp.int32)))


def _decays(variable) -> bool:
    names = (variable.get_metadata() or {}).get("out_sharding")
    if names is None:
        return variable.get_value().ndim >= 2
    return sum(1 for n in names if n not in (None, "layers", "stages")) >= 2


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
    missing = [a for a in ("space", "unit_grid", "units", "loss") if not hasattr(module, a)]
    if missing:
        raise ConfigError(f"{type(module).__name__} is not a supernet: it lacks {', '.join(missing)} "
                          f"(see mindpipe_jax.supernet.model.SuperGPT)")
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
                        np.concatenate(unit_of), np.concatenate(decay_flat), tuple(runs))
    return spec, create


# --- lazy AdamW on one flat vector ----------------------------------------------------------------


def init_state(spec: SupernetSpec, params) -> dict:
    """``{"step", "params", "opt": {"mu", "nu", "count"}}``.

    ``mu``/``nu`` are ``float32[padded_size]`` over all parameters raveled in tree
    order (the step keeps them split over the devices); ``count`` is
    ``int32[U + 1]``: one AdamW step count per unit of the grid (raveled) and,
    last, the count of the shared parameters.
    """
    zeros = jnp.zeros((spec.padded_size,), jnp.float32)
    return {"step": jnp.zeros((), jnp.int32), "params": params,
            "opt": {"mu": zeros, "nu": jnp.zeros_like(zeros),
                    "count": jnp.zeros((spec.num_units + 1,), jnp.int32)}}


def adamw(spec: SupernetSpec, p, g, opt: dict, unit_mask, shared: bool, lr, optim: OptimConfig,
          offset=None):
    """One lazy AdamW update of the flat params ``p`` with gradient ``g``.

    ``p``, ``g``, ``opt["mu"]``, ``opt["nu"]`` are raveled vectors, or (``offset``, may
    be traced) the same slice ``[offset, offset + len(p))`` of each; ``opt["count"]``
    is always whole.

    Updates the elements of the units where ``unit_mask`` (``bool[*unit_grid]``)
    is True, and the shared elements if ``shared``; every other element, its
    moments and its unit's count stay exactly as they were. The arithmetic is
    optax's ``adamw`` (moments, bias correction with the incremented count,
    ``mu_hat / (sqrt(nu_hat) + eps)``, decoupled weight decay on matrices).
    """
    sel = jnp.concatenate([jnp.asarray(unit_mask).reshape(-1), jnp.asarray(shared, bool).reshape(1)])
    count = opt["count"] + sel.astype(jnp.int32)
    cf = count.astype(jnp.float32)
    # Per unit: selected, and the two bias corrections; then the same per element.
    per_element = spec.expand(jnp.stack([sel.astype(jnp.float32), 1 - optim.b1 ** cf, 1 - optim.b2 ** cf]))
    decay = jnp.asarray(spec.decay_flat)
    if offset is not None:
        per_element = lax.dynamic_slice_in_dim(per_element, offset, p.shape[0], axis=1)
        decay = lax.dynamic_slice_in_dim(decay, offset, p.shape[0])
    mask, bc1, bc2 = per_element[0] > 0, per_element[1], per_element[2]
    mu = (1 - optim.b1) * g + optim.b1 * opt["mu"]
    nu = (1 - optim.b2) * jnp.square(g) + optim.b2 * opt["nu"]
    update = (mu / bc1) / (jnp.sqrt(nu / bc2) + optim.eps)
    if optim.weight_decay:
        update = update + jnp.where(decay, optim.weight_decay * p, 0)
    new_p = p + (-lr) * update
    return (jnp.where(mask, new_p, p),
            {"mu": jnp.where(mask, mu, opt["mu"]), "nu": jnp.where(mask, nu, opt["nu"]), "count": count})


def global_norm(flat) -> jax.Array:
    return jnp.sqrt(jnp.sum(jnp.square(flat)))


def clip(grads, norm, max_norm: float):
    """optax.clip_by_global_norm's rule (scale by max_norm / norm when above) given the norm; 0 disables."""
    if not max_norm:
        return grads
    # One scalar scale, then a multiply: a vector division here rounded differently in
    # different fusions (seen: 1 vs 2 data devices), a multiply by one scalar never does.
    scale = jnp.where(norm < max_norm, 1.0, max_norm / norm)
    return jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)


def pairwise_sum(stacked):
    """Sum the leading axis in one fixed balanced order (any length)."""
    def one(x):
        while x.shape[0] > 1:
            n = x.shape[0]
            pairs = x[0:n - n % 2:2] + x[1:n - n % 2:2]
            x = jnp.concatenate([pairs, x[n - 1:]]) if n % 2 else pairs
        return x[0]
    return jax.tree.map(one, stacked)


# --- the plan of a step (host, NumPy) -------------------------------------------------------------


def causal_waves(units: np.ndarray) -> np.ndarray:
    """Wave of each subnet: 1 + the latest wave of an earlier subnet sharing a unit, else 0.

    ``units``: ``bool[K, ...]``. This is the earliest wave every subnet can run in
    without changing what the sequential order gives (longest path in the
    conflict order), so it is also the fewest waves.
    """
    flat = np.asarray(units, bool).reshape(len(units), -1)
    waves = np.zeros(len(flat), np.int32)
    for k in range(len(flat)):
        earlier = [waves[j] for j in range(k) if (flat[j] & flat[k]).any()]
        waves[k] = 1 + max(earlier) if earlier else 0
    return waves


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What one step runs, in fixed-shape arrays (the same compiled program every step).

    ``subnets``: ``int32[K + 1, genes]`` (row K: padding, a copy of row 0);
    ``slot_subnet``: ``int32[rounds_max, R]``, the subnet of each slot of each
    round (K = padding); ``slot_valid``; ``wave_end``: after this round the
    wave's units are updated (causal); ``n_rounds``; ``waves``: per subnet.
    """

    subnets: np.ndarray
    slot_subnet: np.ndarray
    slot_valid: np.ndarray
    wave_end: np.ndarray
    n_rounds: np.ndarray
    waves: np.ndarray

    def arrays(self) -> dict[str, np.ndarray]:
        return {"subnets": self.subnets, "slot_subnet": self.slot_subnet, "slot_valid": self.slot_valid,
                "wave_end": self.wave_end, "n_rounds": self.n_rounds}

    @property
    def num_waves(self) -> int:
        return int(self.waves.max()) + 1


def plan_step(spec: SupernetSpec, subnets, semantics: str, round_slots: int) -> StepPlan:
    """Rounds of ``round_slots`` (= subnet axis × vmap width) slots for this step's subnets."""
    _check_semantics(semantics)
    subnets = spec.space.validate(subnets)
    k = len(subnets)
    if semantics == "sync":
        waves = np.zeros(k, np.int32)
        rows = [list(range(i, min(i + round_slots, k))) for i in range(0, k, round_slots)]
        ends = [False] * len(rows)
        max_rounds = -(-k // round_slots)
    else:
        waves = causal_waves(spec.units(subnets))
        rows, ends = [], []
        for w in range(int(waves.max()) + 1):
            members = [int(i) for i in np.flatnonzero(waves == w)]
            for start in range(0, len(members), round_slots):
                rows.append(members[start:start + round_slots])
                ends.append(start + round_slots >= len(members))
        max_rounds = k  # every wave may hold one subnet
    slot = np.full((max_rounds, round_slots), k, np.int32)
    for r, row in enumerate(rows):
        slot[r, :len(row)] = row
    wave_end = np.zeros(max_rounds, bool)
    wave_end[:len(ends)] = ends
    return StepPlan(np.concatenate([subnets, subnets[:1]]).astype(np.int32), slot, slot < k, wave_end,
                    np.asarray(len(rows), np.int32), waves)


# --- checks ---------------------------------------------------------------------------------------


def _check_semantics(semantics: str) -> None:
    if semantics not in SEMANTICS:
        raise ConfigError(f"supernet.semantics={semantics!r} is not valid; valid: "
                          f"{', '.join(repr(s) for s in SEMANTICS)}")


def check_layout(mesh, *, subnets_per_step: int, vmap_width: int, virtual_shards: int,
                 global_batch: int) -> None:
    """The mesh and sizes the SPara step supports; ConfigError naming the value otherwise."""
    others = {a: n for a, n in mesh.shape.items() if a not in AXES and n > 1}
    if others:
        raise ConfigError(f"supernet training splits devices over parallel.subnet and parallel.data only; "
                          f"got {', '.join(f'{a}={n}' for a, n in others.items())}; set them to 1")
    s, d = mesh.shape["subnet"], mesh.shape["data"]
    if PARAM_CHUNKS % (s * d):
        raise ConfigError(f"parallel.subnet x parallel.data = {s} x {d} = {s * d} devices must divide "
                          f"{PARAM_CHUNKS} (SPara splits the optimizer into {PARAM_CHUNKS} equal chunks)")
    if subnets_per_step % (s * vmap_width):
        raise ConfigError(
            f"supernet.subnets_per_step={subnets_per_step} must be divisible by parallel.subnet x "
            f"supernet.vmap_width = {s} x {vmap_width} = {s * vmap_width}")
    if virtual_shards % d or global_batch % virtual_shards:
        raise ConfigError(
            f"train.virtual_shards={virtual_shards} must be divisible by parallel.data={d}, and "
            f"train.global_batch={global_batch} by train.virtual_shards")


# --- the step -------------------------------------------------------------------------------------


def make_spara_step(spec: SupernetSpec, mesh, *, semantics: str, subnets_per_step: int,
                    vmap_width: int, virtual_shards: int, global_batch: int, optim: OptimConfig,
                    total_steps: int):
    """``step(state, plan_arrays, batch) -> (state, metrics)``, to be jitted once (``jit_step``).

    ``batch`` is ``{"inputs", "targets"}`` of ``int32[global_batch, T]`` (every
    subnet of the step trains on it); ``plan_arrays`` is ``StepPlan.arrays()``.
    Metrics: per-subnet ``loss`` and ``grad_norm`` (``[K]``), ``lr``.

    Per round, each device computes its W slots on its V/D shards, sums its shards
    (the lower levels of the fixed pairwise tree over V), and one ``all_to_all`` gives
    it, for the 1/N of the raveled parameters it owns (N devices), every device's
    partial gradient of every slot of the round; it sums the data devices' partials in
    device order (the upper levels of the tree). One ``all_gather`` brings the norms'
    chunk sums and the slots' losses. Norms, clipping, the K-buffer, the sums over
    subnets and AdamW then run on that 1/N only; the new parameters are all-gathered.
    """
    _check_semantics(semantics)
    check_layout(mesh, subnets_per_step=subnets_per_step, vmap_width=vmap_width,
                 virtual_shards=virtual_shards, global_batch=global_batch)
    k, w, v = subnets_per_step, vmap_width, virtual_shards
    n_sub, n_data = mesh.shape["subnet"], mesh.shape["data"]
    n_dev = n_sub * n_data
    r_slots = n_sub * w
    size = spec.padded_size
    chunk = size // n_dev  # this device's share of the raveled parameters
    per_fixed = size // PARAM_CHUNKS  # elements per fixed norm chunk
    schedule = lr_schedule(optim, total_steps)
    units_of = jax.vmap(spec.module.units)
    no_units = jnp.zeros(spec.unit_grid, bool)

    def grad_one(params, subnet, shard):
        value, grads = jax.value_and_grad(
            lambda p: spec.loss(p, shard["inputs"], shard["targets"], subnet))(params)
        return value, spec.ravel(grads)

    def per_device(state, plan, vbatch):
        lr = schedule(state["step"])
        group = lax.axis_index("subnet")
        me = lax.axis_index(AXES)  # = group * n_data + data index: owner of chunk `me`
        subnets = plan["subnets"]

        def round_grads(params, r):
            """Loss and norm of every slot of round r (``[R]``), and its clipped gradient on
            this device's chunk (``[R, chunk]``)."""
            local = jax.tree.map(lambda p: lax.pcast(p, AXES, to="varying"), params)
            ids = lax.dynamic_slice_in_dim(plan["slot_subnet"][r], group * w, w)
            valid = lax.dynamic_slice_in_dim(plan["slot_valid"][r], group * w, w)
            subs = jnp.take(subnets, ids, axis=0)

            def compute(_):
                losses, grads = lax.map(
                    lambda shard: jax.vmap(grad_one, in_axes=(None, 0, None))(local, subs, shard), vbatch)
                # The fixed pairwise tree over the V shards: its lower levels on this device's
                # contiguous shards (here), its upper levels over the devices, in device order.
                return pairwise_sum((losses, grads))  # [W], [W, Pp]

            def padding(_):
                return jax.tree.map(lambda a: lax.pcast(jnp.zeros(a.shape, a.dtype), AXES, to="varying"),
                                    jax.eval_shape(compute, None))

            # A device whose slots are all padding (a causal wave smaller than the round)
            # computes nothing: only the taken branch runs. No collective inside.
            losses, grads = lax.optimization_barrier(lax.cond(jnp.any(valid), compute, padding, None))
            # One exchange: device n receives chunk n of every device's W slots. Then the
            # upper levels of the tree: each group's data devices, in order.
            grads = lax.all_to_all(jnp.swapaxes(grads.reshape(w, n_dev, chunk), 0, 1), AXES, 0, 0)
            grads = jnp.moveaxis(grads.reshape(n_sub, n_data, w, chunk), 1, 0)  # [D, S, W, chunk]
            grads = lax.optimization_barrier(pairwise_sum(grads)) * (1.0 / v)  # [S, W, chunk]
            grads = grads.reshape(r_slots, chunk)  # slot order: group-major
            # Norm: per fixed chunk (same shape on every mesh), then a fixed tree over the chunks.
            parts = lax.map(lambda row: jnp.sum(jnp.square(row)), grads.reshape(-1, per_fixed))
            # One gather brings every device's norm parts and its slots' partial losses
            # (collectives are the fixed cost of a round: fewer of them, fewer waits).
            every = lax.all_gather(jnp.concatenate([parts, losses]), AXES, to="invarying")  # [N, ...]
            parts = every[:, :-w].reshape(n_dev, r_slots, -1)  # [N, R, 64/N]
            parts = jnp.moveaxis(parts, 0, 1).reshape(r_slots, PARAM_CHUNKS)  # columns in device order
            norms = jnp.sqrt(pairwise_sum(jnp.moveaxis(parts, 1, 0)))  # [R]
            losses = jnp.moveaxis(every[:, -w:].reshape(n_sub, n_data, w), 1, 0)  # [D, S, W]
            losses = (pairwise_sum(losses) * (1.0 / v)).reshape(r_slots)  # [R], group-major
            if optim.clip_norm:
                # One scalar scale per slot, then a multiply (a vector division rounded
                # differently in different fusions; a multiply by a scalar never does).
                scale = jnp.where(norms < optim.clip_norm, 1.0, optim.clip_norm / norms)
                grads = grads * scale[:, None]
            return losses, norms, grads

        def store(buffers, values, slot_ids):
            # Each slot's row goes to its subnet's index (K: padding). Indices are unique
            # per step, so these are plain writes, never an add.
            out = []
            for buf, val in zip(buffers, values, strict=True):
                for i in range(r_slots):
                    buf = lax.dynamic_update_index_in_dim(buf, val[i], slot_ids[i], 0)
                out.append(buf)
            return out

        def gather_params(p_mine):
            return spec.unravel(lax.all_gather(p_mine, AXES, tiled=True, to="invarying"))

        p_mine = lax.dynamic_slice_in_dim(spec.ravel(state["params"]), me * chunk, chunk)
        opt0 = state["opt"]  # mu, nu: this device's chunk; count: whole
        bufs0 = [lax.pcast(jnp.zeros((k + 1, chunk), jnp.float32), AXES, to="varying"),
                 jnp.zeros((k + 1,), jnp.float32), jnp.zeros((k + 1,), jnp.float32)]

        def update(p, g, opt, unit_mask, shared):
            return adamw(spec, p, g, opt, unit_mask, shared, lr, optim, offset=me * chunk)

        if semantics == "sync":
            def body(r, bufs):
                losses, norms, grads = round_grads(state["params"], r)
                return store(bufs, [grads, losses, norms], plan["slot_subnet"][r])

            bufs = lax.fori_loop(0, plan["n_rounds"], body, bufs0)
            mean = pairwise_sum(bufs[0][:k]) * (1.0 / k)
            p_mine, opt = update(p_mine, mean, opt0, jnp.any(units_of(subnets[:k]), axis=0), True)
        else:
            def body(r, carry):
                params, p_mine, opt, acc, wave_used, bufs = carry
                losses, norms, grads = round_grads(params, r)
                ids, valid = plan["slot_subnet"][r], plan["slot_valid"][r]
                # No two subnets of a wave share a unit, so each unit element has at most
                # one nonzero term here: the sum is exact in any order. (Shared elements of
                # acc are never applied; they come from the buffer at the end of the step.)
                # Row by row: elementwise adds; a reduce over the slot axis was the slowest
                # part of a causal round on the CPU.
                for i in range(r_slots):
                    acc = acc + jnp.where(valid[i], grads[i], 0)
                used = units_of(jnp.take(subnets, ids, axis=0)) & valid.reshape((-1,) + (1,) * no_units.ndim)
                wave_used = wave_used | jnp.any(used, axis=0)
                bufs = store(bufs, [grads, losses, norms], ids)

                def end_wave(c):
                    p_mine, opt, acc, wave_used = c
                    p_mine, opt = update(p_mine, acc, opt, wave_used, False)
                    return p_mine, opt, jnp.zeros_like(acc), jnp.zeros_like(wave_used)

                p_mine, opt, acc, wave_used = lax.cond(plan["wave_end"][r], end_wave, lambda c: c,
                                                       (p_mine, opt, acc, wave_used))
                # Every device gathers every round (a collective never sits in one branch).
                return gather_params(p_mine), p_mine, opt, acc, wave_used, bufs

            carry = (state["params"], p_mine, opt0, jnp.zeros_like(p_mine), no_units, bufs0)
            _, p_mine, opt, _, _, bufs = lax.fori_loop(0, plan["n_rounds"], body, carry)
            mean = pairwise_sum(bufs[0][:k]) * (1.0 / k)  # only its shared elements are applied
            p_mine, opt = update(p_mine, mean, opt, no_units, True)
        new_state = {"step": state["step"] + 1, "params": gather_params(p_mine), "opt": opt}
        return new_state, {"loss": bufs[1][:k], "grad_norm": bufs[2][:k], "lr": lr}

    def step(state, plan, batch):
        vbatch = jax.tree.map(lambda x: x.reshape(v, x.shape[0] // v, *x.shape[1:]), batch)
        state_specs = {"step": P(), "params": P(), "opt": {"mu": P(AXES), "nu": P(AXES), "count": P()}}
        fn = jax.shard_map(per_device, mesh=mesh, axis_names=set(AXES),
                           in_specs=(state_specs, P(), P("data")), out_specs=(state_specs, P()))
        return fn(state, plan, vbatch)

    return step


def state_shardings(mesh) -> dict:
    """Parameters, step and counts replicated; AdamW moments split over every device."""
    rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXES))
    return {"step": rep, "params": rep, "opt": {"mu": split, "nu": split, "count": rep}}


def jit_step(step, mesh, donate: bool = True):
    """The step jitted with its state shardings, the plan replicated, the batch split over ``data``."""
    rep = NamedSharding(mesh, P())
    batch = NamedSharding(mesh, P("data"))
    shardings = state_shardings(mesh)
    return jax.jit(step, in_shardings=(shardings, rep, batch), out_shardings=(shardings, rep),
                   donate_argnums=(0,) if donate else ())


# --- the oracle -----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _reference_fns(spec: SupernetSpec, optim: OptimConfig, total_steps: int):
    schedule = lr_schedule(optim, total_steps)

    @jax.jit
    def grad(params, subnet, batch):
        loss, grads = jax.value_and_grad(
            lambda p: spec.loss(p, batch["inputs"], batch["targets"], subnet))(params)
        flat = spec.ravel(grads)
        norm = global_norm(flat)
        return loss, norm, clip(flat, norm, optim.clip_norm)

    @functools.partial(jax.jit, static_argnums=4)
    def update(params, grads, opt, unit_mask, shared, step):
        p, opt = adamw(spec, spec.ravel(params), grads, opt, unit_mask, shared, schedule(step), optim)
        return spec.unravel(p), opt

    return grad, update


def reference_step(spec: SupernetSpec, state, subnets, batch, *, semantics: str, optim: OptimConfig,
                   total_steps: int):
    """The definition of both semantics as a plain Python loop over the K subnets.

    No mesh, no vmap, no virtual shards: each subnet's gradient is ``jax.grad``
    of its mean loss over the whole batch, one subnet at a time, in order.
    Returns ``(state, metrics)`` like the SPara step.
    """
    _check_semantics(semantics)
    grad, update = _reference_fns(spec, optim, total_steps)
    subnets = spec.space.validate(subnets)
    used = spec.units(subnets)
    params, opt, step = state["params"], state["opt"], state["step"]
    none = np.zeros(spec.unit_grid, bool)
    losses, norms, grads = [], [], []
    for i, subnet in enumerate(subnets):
        loss, norm, g = grad(params, subnet, batch)
        losses.append(loss), norms.append(norm), grads.append(g)
        if semantics == "causal":  # a full step of its own on the units it used
            params, opt = update(params, g, opt, used[i], False, step)
    mean = functools.reduce(jnp.add, grads) / len(grads)
    if semantics == "sync":  # one step on the mean: the units anyone used, and the shared params
        params, opt = update(params, mean, opt, used.any(0), True, step)
    else:  # the shared params: one step on the mean of the K subnets' gradients
        params, opt = update(params, mean, opt, none, True, step)
    return ({"step": step + 1, "params": params, "opt": opt},
            {"loss": jnp.stack(losses), "grad_norm": jnp.stack(norms)})
