"""The configuration space EPara searches: mesh axis sizes × pipeline × remat × batch.

A ``Candidate`` is one point: the six mesh axis sizes (their product is the device
count), pipeline microbatches, schedule and virtual chunks, a remat policy and the
global batch. It is plain data (frozen, hashable, JSON-able) and turns into config
overrides, so every candidate is checked by exactly the rules a user's run meets:
``Config`` validation, ``check_step_config`` (divisibility, layers vs stages,
deterministic mode, axes the step does not use) and the parameter sharding rules
(heads, MLP width and vocabulary vs ``tensor``; ``d_model`` vs ``fsdp``; experts
vs ``expert``). A rejected candidate keeps the one-line reason.

``enumerate_space`` walks the product of the choices and returns the valid
candidates and the rejected ones with their reasons.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import types
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from mindpipe_jax.config import MESH_AXES, Config
from mindpipe_jax.errors import ConfigError

if TYPE_CHECKING:
    from mindpipe_jax.tuner.facts import ModelFacts

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "afapab", "zbv", "dualpipev")
V_SCHEDULES = ("zbv", "dualpipev")  # two chunks per device in a V, always
REMATS = ("none", "dots", "full")


@dataclasses.dataclass(frozen=True, order=True)
class Candidate:
    """One configuration. ``remat`` is ``model.remat`` without a pipeline and the
    pipeline's ``parallel.stage_remat`` (every stage alike) with one."""

    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    pipe: int = 1
    subnet: int = 1
    expert: int = 1
    microbatches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    remat: str = "none"
    global_batch: int = 32

    @property
    def axes(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in MESH_AXES}

    @property
    def devices(self) -> int:
        return math.prod(self.axes.values())

    @property
    def batch_shards(self) -> int:
        """Devices the batch splits over (train.step.BATCH_AXES): expert devices run
        the dense layers data-parallel."""
        return self.data * self.fsdp * self.expert

    @property
    def per_device_batch(self) -> int:
        """Rows each batch shard holds per step (all its microbatches together)."""
        return self.global_batch // self.batch_shards

    def overrides(self) -> list[str]:
        """``key=value`` strings that make a config run this candidate."""
        out = [f"parallel.{a}={n}" for a, n in self.axes.items()]
        out += [f"parallel.microbatches={self.microbatches}", f"train.global_batch={self.global_batch}"]
        if self.pipe > 1:
            out += [f'parallel.schedule="{self.schedule}"', f"parallel.virtual_stages={self.virtual_stages}",
                    f'parallel.stage_remat="{self.remat}"', 'model.remat="none"']
        else:
            out += ['parallel.stage_remat="none"', "parallel.virtual_stages=1", f'model.remat="{self.remat}"']
        return out

    def apply(self, cfg: Config) -> Config:
        return cfg.replace(*self.overrides(), "parallel.stage_layers=[]")

    def label(self) -> str:
        """Short and readable: ``d4 t2 | m2 | remat dots | B32`` (size-1 axes left out)."""
        short = {"data": "d", "fsdp": "f", "tensor": "t", "pipe": "p", "subnet": "s", "expert": "e"}
        mesh = " ".join(f"{short[a]}{n}" for a, n in self.axes.items() if n > 1) or "d1"
        parts = [mesh, f"m{self.microbatches}"]
        if self.pipe > 1:
            parts.append(self.schedule + (f" v{self.virtual_stages}" if self.virtual_stages > 1 else ""))
        parts += [f"remat {self.remat}", f"B{self.global_batch}"]
        return " | ".join(parts)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_config(cls, cfg: Config, num_devices: int) -> Candidate:
        """The candidate a config describes (axis sizes resolved for ``num_devices``)."""
        from mindpipe_jax.parallel.mesh import resolve_axis_sizes

        sizes = resolve_axis_sizes(cfg.parallel, num_devices)
        par = cfg.parallel
        pipelined = sizes["pipe"] > 1
        remat = par.stage_remat if isinstance(par.stage_remat, str) else par.stage_remat[0]
        return cls(**sizes, microbatches=par.microbatches,
                   schedule=par.schedule if pipelined else "1f1b",
                   virtual_stages=par.virtual_stages if pipelined else 1,
                   remat=remat if pipelined else cfg.model.remat, global_batch=cfg.train.global_batch)


def _model_limits(cfg: Config, cand: Candidate) -> str | None:
    """What the rules table needs of the model's sizes (checked without building it)."""
    m = cfg.model
    if cand.tensor > 1:
        for name, size in (("model.n_heads", m.n_heads), ("model.d_ff", m.ff_dim),
                           ("model.vocab_size", m.vocab_size)):
            if size % cand.tensor:
                return f"{name}={size} is not divisible by tensor={cand.tensor}"
        if m.collective_matmul and m.seq_len % cand.tensor:
            return f"model.seq_len={m.seq_len} is not divisible by tensor={cand.tensor} (collective matmul)"
    if cand.fsdp > 1 and m.d_model % cand.fsdp:
        return f"model.d_model={m.d_model} is not divisible by fsdp={cand.fsdp}"
    experts = getattr(m, "n_experts", 0)
    if cand.expert > 1 and experts and experts % cand.expert:
        return f"model.n_experts={experts} is not divisible by expert={cand.expert}"
    return None


def check_candidate(cfg: Config, cand: Candidate, num_devices: int | None = None,
                    facts: ModelFacts | None = None) -> str | None:
    """None if ``cand`` is a valid run of ``cfg``'s model, else the one-line reason.
    ``facts``: a user's model (``tuner.facts``), judged on its own parameters and depth
    instead of ``cfg.model``'s sizes."""
    from mindpipe_jax.train.step import check_step_config

    if num_devices is not None and cand.devices != num_devices:
        return f"mesh {cand.label().split(' | ')[0]} uses {cand.devices} devices, not {num_devices}"
    if cand.pipe == 1 and (cand.schedule != "1f1b" or cand.virtual_stages != 1):
        return "schedule and virtual_stages only apply with pipe > 1"
    if facts is not None and cand.pipe == 1 and cand.remat != "none":
        # model.remat builds the reference GPT's blocks; a user's layers decide their own.
        return f"remat {cand.remat} applies to the model's layers only through a pipeline (pipe > 1)"
    try:
        run = cand.apply(cfg)
        check_step_config(run, types.SimpleNamespace(shape=cand.axes))
    except ConfigError as err:
        return str(err)
    if cand.pipe > 1:
        from mindpipe_jax.parallel.pipeline import ScheduleError, get_schedule
        from mindpipe_jax.train.step import check_pipeline_depth
        try:
            depth = (run.model.n_layers, None, 1) if facts is None else facts.depth
        except ConfigError as err:
            return f"the model cannot be pipelined: {err}"
        try:
            check_pipeline_depth(depth[0], run, cand.pipe * cand.virtual_stages, depth[1], depth[2])
        except ConfigError as err:
            return str(err)
        try:
            get_schedule(cand.schedule, cand.pipe, cand.microbatches, cand.virtual_stages)
        except (ScheduleError, ValueError) as err:
            return (f"schedule {cand.schedule} p={cand.pipe} m={cand.microbatches} "
                    f"v={cand.virtual_stages}: {err}")
    return _model_limits(run, cand) if facts is None else facts.unshardable(cand.axes)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _meshes(num_devices: int, axes: Sequence[str]) -> Iterable[dict[str, int]]:
    """Every assignment of sizes to ``axes`` whose product is ``num_devices``."""
    def split(n: int, names: Sequence[str]):
        if len(names) == 1:
            yield {names[0]: n}
            return
        for d in _divisors(n):
            for rest in split(n // d, names[1:]):
                yield {names[0]: d, **rest}
    yield from split(num_devices, list(axes))


@dataclasses.dataclass
class SpaceReport:
    valid: list[Candidate]
    rejected: list[tuple[Candidate, str]]

    def reasons(self) -> dict[str, int]:
        """How many candidates each kind of reason rejected (first 60 characters)."""
        counts: dict[str, int] = {}
        for _, why in self.rejected:
            counts[why[:60]] = counts.get(why[:60], 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def enumerate_space(cfg: Config, num_devices: int, *,
                    axes: Sequence[str] = ("data", "fsdp", "tensor", "pipe"),
                    global_batches: Sequence[int] | None = None,
                    microbatches: Sequence[int] = (1, 2, 4, 8),
                    schedules: Sequence[str] = ("1f1b", "interleaved"),
                    virtual_stages: Sequence[int] = (1, 2),
                    remats: Sequence[str] = ("none", "full"),
                    facts: ModelFacts | None = None) -> SpaceReport:
    """Every candidate over the given choices, split into valid and rejected.

    Axes not listed stay 1. Without a pipeline, schedule and virtual chunks do not
    apply, so those candidates are generated once (``1f1b``, ``v=1``); a schedule
    that has no virtual chunks (everything but ``interleaved`` and the V schedules)
    is only paired with ``v=1``, a V schedule (``zbv``, ``dualpipev``) only with ``v=2``.
    """
    for name in axes:
        if name not in MESH_AXES:
            raise ConfigError(f"tuner axis {name!r} is not a mesh axis; valid: {', '.join(MESH_AXES)}")
    for s in schedules:
        if s not in SCHEDULES:
            raise ConfigError(f"tuner schedule {s!r} is not valid; valid: {', '.join(SCHEDULES)}")
    for r in remats:
        if r not in REMATS:
            raise ConfigError(f"tuner remat {r!r} is not valid; valid: {', '.join(REMATS)}")
    batches = tuple(global_batches or (cfg.train.global_batch,))
    valid: list[Candidate] = []
    rejected: list[tuple[Candidate, str]] = []
    seen: set[Candidate] = set()
    for mesh in _meshes(num_devices, axes):
        pipelined = mesh.get("pipe", 1) > 1
        pipe_choices = (list(itertools.product(schedules, virtual_stages)) if pipelined
                        else [("1f1b", 1)])
        for (schedule, v), m, remat, batch in itertools.product(pipe_choices, microbatches, remats, batches):
            if pipelined and schedule in V_SCHEDULES:
                if v != 2:
                    continue
            elif pipelined and v > 1 and schedule != "interleaved":
                continue
            if pipelined and schedule == "interleaved" and v == 1:
                continue
            cand = Candidate(**mesh, microbatches=m, schedule=schedule, virtual_stages=v, remat=remat,
                             global_batch=batch)
            if cand in seen:
                continue
            seen.add(cand)
            why = check_candidate(cfg, cand, facts=facts)
            if why is None:
                valid.append(cand)
            else:
                rejected.append((cand, why))
    return SpaceReport(valid, rejected)
