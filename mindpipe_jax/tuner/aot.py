"""Feasibility by ahead-of-time compilation: lower and compile a candidate's train
step on abstract shapes (nothing is allocated) and read its memory per device.

This is the test MaxText's ``train_compile.py`` makes, and the only one that
counts what XLA really keeps (fusion, rematerialization, the pipeline's buffers,
collective scratch). ``memory_analysis()`` gives per-device argument, output,
temporary and aliased bytes; with the state donated, the peak is arguments +
temporaries + outputs − aliases. A candidate whose peak exceeds the budget is
infeasible, and so is one the compiler refuses (the error's first line is kept).

``build_step`` is the same path ``mindpipe_jax.train`` takes (model spec → state
shardings → ``make_train_step`` → ``jit`` with donated state), exposed so the
tuner's trials and the online reconfiguration run exactly what a run would.
Results are cached by (model config, candidate, device kind); a JSON file can
keep the cache between processes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mindpipe_jax.atomic_write import write_atomically
from mindpipe_jax.config import Config
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.parallel.cpu_guard import lower_checked, platform_of
from mindpipe_jax.train.memory_fit import step_bytes
from mindpipe_jax.tuner.facts import ModelFacts
from mindpipe_jax.tuner.space import Candidate, check_candidate


def default_model_factory(cfg: Config):
    """The model ``mindpipe_jax.train`` builds from ``cfg.model`` when given none."""
    try:
        from mindpipe_jax.models import build_model
    except ImportError:  # before the MoE model existed every default model was the GPT
        from mindpipe_jax.models.gpt import GPT
        return lambda rngs: GPT(cfg.model, rngs=rngs)
    return lambda rngs: build_model(cfg.model, rngs)


@dataclasses.dataclass
class BuiltStep:
    """A candidate's train step, jitted as a run would jit it, and what it needs."""

    cfg: Config
    mesh: Any
    spec: Any
    tx: Any
    create: Any
    shardings: Any
    abstract_state: Any
    batch_sharding: NamedSharding
    jitted: Any

    def batch_spec(self) -> dict:
        shape = (self.cfg.train.global_batch, self.cfg.model.seq_len)
        one = jax.ShapeDtypeStruct(shape, np.int32, sharding=self.batch_sharding)
        return {"inputs": one, "targets": one}

    def lower(self):
        """Lowered for the mesh's devices: a ``ConfigError`` for a program XLA's CPU
        compiler would abort on (``parallel.cpu_guard``)."""
        with jax.set_mesh(self.mesh):
            return lower_checked(self.jitted, self.abstract_state, self.batch_spec(),
                                 platform=platform_of(self.mesh))


def build_step(cfg: Config, model=None, devices=None, *, noise_stats: bool | None = None) -> BuiltStep:
    """Mesh, model spec, optimizer, shardings and the jitted step for ``cfg``
    (``noise_stats``: as ``make_train_step``; default ``tuner.enabled``)."""
    from mindpipe_jax.parallel.mesh import make_mesh
    from mindpipe_jax.train.pipeline_storage import split_ends_over_pipe
    from mindpipe_jax.train.state import abstract_train_state, make_optimizer, model_spec, state_shardings_for
    from mindpipe_jax.train.step import BATCH_AXES, check_step_config, make_train_step

    mesh = make_mesh(cfg.parallel, devices)
    check_step_config(cfg, mesh)
    spec, create = model_spec(model if model is not None else default_model_factory(cfg), mesh,
                              cfg.train.seed)
    spec = split_ends_over_pipe(spec, cfg.model.seq_len, mesh)
    tx = make_optimizer(cfg.optim, cfg.train.steps, spec.decay_mask)
    shardings = state_shardings_for(spec, tx, mesh)
    abstract_state = abstract_train_state(spec, tx, mesh, shardings)
    batch_sharding = NamedSharding(mesh, P(BATCH_AXES))
    step = make_train_step(spec, tx, cfg, mesh, cfg.train.steps, noise_stats=noise_stats)
    jitted = jax.jit(step, in_shardings=(shardings, batch_sharding), out_shardings=(shardings, None),
                     donate_argnums=0)
    return BuiltStep(cfg, mesh, spec, tx, create, shardings, abstract_state, batch_sharding, jitted)


@dataclasses.dataclass(frozen=True)
class Feasibility:
    """What compiling a candidate said. Bytes are per device."""

    candidate: Candidate
    fits: bool
    peak_bytes: float = 0.0
    argument_bytes: float = 0.0
    temp_bytes: float = 0.0
    output_bytes: float = 0.0
    alias_bytes: float = 0.0
    compiled_flops: float = 0.0  # cost_analysis: per device, each loop body counted once
    compile_s: float = 0.0
    reason: str = ""  # why it does not fit (budget, compiler error, invalid candidate)
    floor_bytes: float = 0.0  # refused before compiling: what it needs at least (``memory_floor``)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["candidate"] = self.candidate.to_dict()
        return out

    @classmethod
    def from_dict(cls, d: dict) -> Feasibility:
        return cls(**{**d, "candidate": Candidate(**d["candidate"])})


def mib(nbytes: float) -> str:
    """``nbytes`` in MiB for a message: one decimal, two significant digits below 0.1
    (a budget of 0.001 MiB read "0.0 MiB")."""
    return f"{nbytes / 2**20:,.1f}" if nbytes >= 0.1 * 2**20 else f"{nbytes / 2**20:.2g}"


def memory_floor(cand: Candidate, hidden_bytes_per_row: float, param_bytes: float) -> float:
    """Bytes per device that any program of ``cand`` holds at once, from the measured
    sizes of the model (``ModelCosts``), not from a compile: one microbatch's hidden
    state and its gradient (both live in the backward of a stage's first layer), split
    over ``tensor`` at best, beside this device's share of the parameters. A layout past
    its budget by this much is refused without compiling: far beyond memory, XLA's
    constant folding ran for minutes before the compile said so (``mindpipe tune
    --batches 1048576``: over 5 minutes per layout on this CPU)."""
    rows = cand.global_batch / (cand.batch_shards * cand.microbatches)
    shards = cand.tensor * cand.pipe * cand.fsdp * cand.expert
    return 2 * rows * hidden_bytes_per_row / cand.tensor + param_bytes / shards


def compile_candidate(cfg: Config, cand: Candidate, budget_bytes: float, model=None,
                      devices=None, facts: ModelFacts | None = None) -> Feasibility:
    """Compile ``cand``'s step on abstract shapes and judge it against the budget
    (``facts``: ``model``'s, for the checks before compiling; ``tuner.facts``)."""
    devices = list(jax.devices() if devices is None else devices)
    why = check_candidate(cfg, cand, len(devices), facts)
    if why is not None:
        return Feasibility(cand, False, reason=why)
    t0 = time.perf_counter()
    try:
        compiled = build_step(cand.apply(cfg), model, devices).lower().compile()
    except ConfigError as err:
        return Feasibility(cand, False, reason=str(err))
    except Exception as err:  # the compiler's refusal (e.g. out of memory) is an answer, not a crash
        first = (str(err).strip().splitlines() or [""])[0][:200]
        return Feasibility(cand, False, reason=f"compile failed: {type(err).__name__}: {first}")
    compile_s = time.perf_counter() - t0
    peak, arg, temp, out, alias = step_bytes(compiled.memory_analysis())
    costs = compiled.cost_analysis()
    costs = costs[0] if isinstance(costs, list) else costs
    fits = peak <= budget_bytes
    reason = "" if fits else f"needs {mib(peak)} MiB per device, budget {mib(budget_bytes)} MiB"
    return Feasibility(cand, fits, peak, arg, temp, out, alias, float(costs.get("flops", 0.0)),
                       compile_s, reason)


def _model_key(cfg: Config, devices, model=None) -> str:
    """What a compiled candidate's memory depends on besides the candidate: the model
    (cfg.model, or a user's model by its class and parameter shapes), the optimizer,
    the devices."""
    what = {"model": cfg.to_dict()["model"], "optim": cfg.to_dict()["optim"],
            "device": devices[0].device_kind, "n": len(devices)}
    if model is not None:
        from flax import nnx

        with nnx.use_eager_sharding(False):
            built = model if isinstance(model, nnx.Module) else nnx.eval_shape(lambda: model(nnx.Rngs(0)))
        shapes = jax.tree.map(lambda a: [list(a.shape), str(a.dtype)],
                              nnx.to_pure_dict(nnx.state(built, nnx.Param)))
        what["user_model"] = [type(built).__name__, shapes]
    text = json.dumps(what, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def read_cache_file(path: str | Path) -> dict[str, dict]:
    """The entries of the tuner cache at ``path`` ({} when there is none, or it is empty).
    A file that is something else (a config, another program's JSON) is refused, not
    overwritten with the cache: the user named the wrong file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8") if path.is_file() else ""
    except OSError as err:
        raise ConfigError(f"tuner cache {str(path)!r} cannot be read: {err.strerror or err}") from None
    except UnicodeDecodeError:
        text = "not JSON"
    try:
        entries = json.loads(text) if text.strip() else {}
    except ValueError:
        entries = None
    if not (isinstance(entries, dict) and all(isinstance(e, dict) and {"candidate", "fits"} <= e.keys()
                                              for e in entries.values())):
        raise ConfigError(f"tuner cache {str(path)!r} holds something other than the compiled-memory "
                          f"results a tune writes there, which would replace it; give a new file name")
    return entries


class FeasibilityCache:
    """Compile each (model, candidate, device kind) once; optionally persisted as JSON.

    The budget is applied when reading, so one cache serves any budget."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path else None
        self._entries: dict[str, dict] = read_cache_file(self.path) if self.path else {}
        self.hits = 0
        self.misses = 0

    def check(self, cfg: Config, cand: Candidate, budget_bytes: float, model=None,
              devices=None, facts: ModelFacts | None = None) -> Feasibility:
        devices = list(jax.devices() if devices is None else devices)
        key = f"{_model_key(cfg, devices, model)}:{json.dumps(cand.to_dict(), sort_keys=True)}"
        if key in self._entries:
            self.hits += 1
            found = Feasibility.from_dict(self._entries[key])
        else:
            self.misses += 1
            found = compile_candidate(cfg, cand, float("inf"), model, devices, facts)
            self._entries[key] = found.to_dict()
            self._save()
        if found.fits and found.peak_bytes > budget_bytes:
            reason = f"needs {mib(found.peak_bytes)} MiB per device, budget {mib(budget_bytes)} MiB"
            return dataclasses.replace(found, fits=False, reason=reason)
        return found

    def _save(self) -> None:
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(self.path, json.dumps(self._entries))
