"""How a SPara step cuts its work, decided on the host: layout checks, rounds and waves.

The mesh axes are ``AXES`` = (``subnet``, ``fsdp``, ``data``): S device groups share
the K subnets of a step, the D = fsdp × data devices of a group split the batch
(``DATA_AXES``; ``fsdp`` also keeps the stored parameters split, see ``spara.py``),
and ``tensor``, when > 1, splits each subnet's matmuls inside every device group. A *round* holds R = S·W
slots (W = ``supernet.vmap_width``); ``plan_step`` lays the step's subnets into
rounds as fixed-shape arrays (``StepPlan``), so every step runs the same compiled
program whatever subnets it drew.

``sync`` fills rounds in sampling order. The other two run in **waves**; a wave
takes whole rounds (its last round may be part padding) and ``wave_end`` marks the
round after which the wave's gradients are applied:

* ``sequential``: every subnet reads the shared weights (embedding, attention,
  norms, head), so each one depends on the update of the one before it: one wave
  per subnet, K waves (``sequential_waves``). A supernet with no shared weight
  would get the waves of its unit conflicts instead.
* ``operator-causal``: subnet k goes into wave 1 + max(wave of an earlier subnet
  sharing an operator unit with it), or wave 0 (``causal_waves``). Subnets of a wave
  use disjoint units, so computing them together at the wave's start weights and
  updating each unit from its one user equals the sequential loop for the units;
  the shared weights take one averaged update at the end of the step.

Separate because it is plain NumPy run before each step (no tracing, no mesh
beyond its shape), called by the trainer on its own, and testable without devices.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mindpipe_jax.config import SUPERNET_SEMANTICS, semantics_error
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.parallel.mesh import unused_axes
from mindpipe_jax.supernet.spec import PARAM_CHUNKS, SupernetSpec

SEMANTICS = SUPERNET_SEMANTICS  # config.py validates them without importing JAX
AXES = ("subnet", "fsdp", "data")  # manual in the step's shard_map; device index subnet-major
DATA_AXES = ("fsdp", "data")  # split the batch: one data-parallel group of fsdp x data devices
COMPUTE_AXES = ("tensor",)  # left to the compiler inside the step (the model's Megatron split)


def data_devices(mesh) -> int:
    """D: the devices of a subnet group that split the batch (fsdp x data)."""
    return mesh.shape["fsdp"] * mesh.shape["data"]


def skips_padding(mesh) -> bool:
    """Whether a device whose slots of a round are all padding may skip the round's
    compute (a per-device ``cond``): only when the compute holds no collective.

    With ``tensor`` > 1 the partitioner puts the model's collectives inside the compute,
    wherever it likes; a resharding collective-permute is one instruction over every
    device of the mesh, so a device group that skips it strands the others (XLA:CPU
    aborts; seen on subnet=2 x tensor=2 with rounds padded by shape). Then every device
    computes every round, padding slots included (their results are never read).
    """
    return all(mesh.shape[a] == 1 for a in COMPUTE_AXES)


def mesh_label(mesh) -> str:
    """``subnet=2 x data=4``, with ``pipe``, ``fsdp`` and ``tensor`` when they are > 1: for log lines."""
    axes = ["subnet"] + [a for a in ("pipe", "fsdp") if mesh.shape[a] > 1] + ["data"] + \
        [a for a in COMPUTE_AXES if mesh.shape[a] > 1]
    return " x ".join(f"{a}={mesh.shape[a]}" for a in axes)


def check_semantics(semantics: str) -> None:
    error = semantics_error(semantics)
    if error:
        raise ConfigError(error)


def updates_shared_per_wave(semantics: str) -> bool:
    """Whether each wave's update includes the shared weights (``sequential``) or they take
    one update from the mean at the end of the step (``sync``, ``operator-causal``)."""
    return semantics == "sequential"


def sequential_waves(units: np.ndarray, shares_weights: bool = True) -> np.ndarray:
    """Waves of ``sequential``: with shared weights every subnet depends on the one before
    (``0..K-1``); without, the waves of its unit conflicts (``causal_waves``)."""
    return np.arange(len(units), dtype=np.int32) if shares_weights else causal_waves(units)


def step_waves(semantics: str, units: np.ndarray, shares_weights: bool = True) -> np.ndarray:
    """Each subnet's wave for ``semantics`` (all 0 in ``sync``)."""
    if semantics == "sync":
        return np.zeros(len(units), np.int32)
    if semantics == "sequential":
        return sequential_waves(units, shares_weights)
    return causal_waves(units)


def check_axes(mesh, what: str, pipe_ok: bool = False) -> None:
    """ConfigError naming every mesh axis > 1 that SPara does not use (``what``: who asks;
    ``pipe_ok``: the step through a pipeline, ``pipelined.py``, uses ``pipe`` too)."""
    used = AXES + COMPUTE_AXES + (("pipe",) if pipe_ok else ())
    others = {a: n for a, n in mesh.shape.items() if a not in used and n > 1}
    if others:
        names = "subnet, pipe, fsdp, data" if pipe_ok else "subnet, fsdp, data"
        raise ConfigError(f"{what} splits devices over parallel.{names} and tensor only; "
                          f"{unused_axes(others)}")


def check_layout(mesh, *, subnets_per_step: int, vmap_width: int, virtual_shards: int,
                 global_batch: int) -> None:
    """The mesh and sizes the SPara step supports; ConfigError naming the value otherwise."""
    check_axes(mesh, "supernet training")
    s, d = mesh.shape["subnet"], data_devices(mesh)
    if PARAM_CHUNKS % (s * d):
        raise ConfigError(f"parallel.subnet x fsdp x data = {s} x {mesh.shape['fsdp']} x "
                          f"{mesh.shape['data']} = {s * d} devices must divide {PARAM_CHUNKS} (SPara splits "
                          f"the optimizer into {PARAM_CHUNKS} equal chunks)")
    if subnets_per_step % (s * vmap_width):
        raise ConfigError(
            f"supernet.subnets_per_step={subnets_per_step} must be divisible by parallel.subnet x "
            f"supernet.vmap_width = {s} x {vmap_width} = {s * vmap_width}")
    check_shards(virtual_shards, d, global_batch)


def check_shards(virtual_shards: int, data: int, global_batch: int, rows: str = "") -> None:
    """Each subnet's batch is cut into ``virtual_shards`` fixed shards (what makes the bits
    independent of the device count), spread evenly over the ``data`` devices; the error
    names the condition that fails (``rows``: what the batch's rows are, if not training)."""
    if virtual_shards % data:
        raise ConfigError(f"train.virtual_shards={virtual_shards} must be divisible by parallel.fsdp x "
                          f"data = {data} (each device group takes a whole number of the fixed shards)")
    if global_batch % virtual_shards:
        near = sorted({max(virtual_shards, global_batch // virtual_shards * virtual_shards),
                       -(-global_batch // virtual_shards) * virtual_shards})
        raise ConfigError(f"train.global_batch={global_batch}{rows} must be divisible by "
                          f"train.virtual_shards={virtual_shards} (each subnet's batch is cut into that "
                          f"many fixed shards); e.g. {' or '.join(map(str, near))}")


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
    wave's gradients are applied (sequential, operator-causal); ``n_rounds``;
    ``waves``: per subnet.
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
    check_semantics(semantics)
    subnets = spec.space.validate(subnets)
    k = len(subnets)
    if semantics == "sync":
        waves = np.zeros(k, np.int32)
        rows = [list(range(i, min(i + round_slots, k))) for i in range(0, k, round_slots)]
        ends = [False] * len(rows)
        max_rounds = -(-k // round_slots)
    else:
        waves = step_waves(semantics, spec.units(subnets), spec.shares_weights)
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

