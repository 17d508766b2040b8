"""What a supernet run is set up from, shared by training (``trainer.py``), by
searching a saved run (``run_search.py``) and by the tuner's trials: the reference
supernet, the step and the data of a config, and the checkpoint plumbing: the kind
and fingerprint a checkpoint must match, the checks of ``train.out_dir`` before
anything is written, and the state's shapes a checkpoint restores onto.
``trainer.py`` describes the checkpoints in its docstring and re-exports the public
names.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mindpipe_jax.config import Config
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.supernet.model import SuperGPT
from mindpipe_jax.supernet.pipelined import PipelinedStep
from mindpipe_jax.supernet.pipelined_sliced import SlicedPipelinedStep, supports_sliced_pipeline
from mindpipe_jax.supernet.plan import DATA_AXES
from mindpipe_jax.supernet.sliced import SlicedStep, supports_slicing
from mindpipe_jax.supernet.spara import (
    SupernetSpec,
    init_state,
    jit_step,
    make_spara_step,
    plan_step,
    state_shardings,
)
from mindpipe_jax.train.checkpoint import prepare_out_dir, read_meta
from mindpipe_jax.train.memory_fit import check_programs_fit, check_step_fits

KIND = "supernet"  # meta["kind"] of a supernet checkpoint (dense runs have none)


def supernet_factory(cfg: Config):
    """``rngs -> SuperGPT`` from the ``model`` and ``supernet`` sections."""
    sn, m = cfg.supernet, cfg.model
    widths = sorted({max(1, round(r * m.ff_dim)) for r in sn.ffn_ratios})
    if sn.min_depth > m.n_layers:
        raise ConfigError(f"supernet.min_depth={sn.min_depth} must be <= model.n_layers={m.n_layers}")
    depths = tuple(range(sn.min_depth, m.n_layers + 1))
    return lambda rngs: SuperGPT(m, ops=sn.ops, ffn_widths=widths, heads=sn.heads, depths=depths, rngs=rngs)


@dataclasses.dataclass(frozen=True)
class ConfiguredStep:
    """The SPara step a config asks for: ``plan(subnets)`` then ``run(state, plan, batch)``
    (``state`` donated); ``description`` says which path, for the run's first log line."""

    plan: Callable
    run: Callable
    description: str


def configured_step(spec: SupernetSpec, mesh, cfg: Config, *, compile_with=None) -> ConfiguredStep:
    """Sliced (subnets at their own size) where the supernet offers it, its programs
    compiled on first use of a shape; else masked, compiled ahead of time when
    ``compile_with`` = ``(state, subnets)`` is given (so that step times are step times)."""
    sn, tr = cfg.supernet, cfg.train
    if mesh.shape["pipe"] > 1:
        return _pipelined_step(spec, mesh, cfg, compile_with)
    sizes = dict(semantics=sn.semantics, subnets_per_step=sn.subnets_per_step, vmap_width=sn.vmap_width,
                 virtual_shards=tr.virtual_shards, global_batch=tr.global_batch, optim=cfg.optim,
                 total_steps=tr.steps)
    if sn.ladder_levels and supports_slicing(spec.module):
        sliced = SlicedStep(spec, mesh, levels=sn.ladder_levels, **sizes)
        bound = f"<= {sliced.max_programs} programs: " if sliced.max_programs else ""
        ahead = _largest_fits(sliced, spec, mesh, cfg, compile_with)
        return ConfiguredStep(sliced.plan, sliced,
                              f"sliced ({bound}one per shape, compiled on first use{ahead})")
    round_slots = mesh.shape["subnet"] * sn.vmap_width

    def plan(subnets):
        return plan_step(spec, subnets, sn.semantics, round_slots)

    t0 = time.perf_counter()
    masked = jit_step(make_spara_step(spec, mesh, **sizes), mesh, spec)
    if compile_with is not None:
        state, subnets = compile_with
        masked = masked.lower(state, plan(subnets).arrays(), _batch_spec(mesh, cfg)).compile()
        # Before its first step (it was a SIGKILL):
        check_step_fits(masked, mesh, state_resident=True, advice=_shrink(mesh))

    def run(state, step_plan, batch):
        return masked(state, step_plan.arrays(), batch)

    compiled = f", compiled in {time.perf_counter() - t0:.1f}s" if compile_with is not None else ""
    return ConfiguredStep(plan, run, f"masked{compiled}")


def _pipelined_step(spec: SupernetSpec, mesh, cfg: Config, compile_with) -> ConfiguredStep:
    """Through the pipeline: sliced (``pipelined_sliced.py``, each pass at its subnets'
    width and heads, programs compiled on first use) where the supernet offers it; else
    masked (``pipelined.py``: one program, compiled ahead of time when ``compile_with``
    is given)."""
    sn, tr, par = cfg.supernet, cfg.train, cfg.parallel
    sizes = dict(semantics=sn.semantics, subnets_per_step=sn.subnets_per_step, vmap_width=sn.vmap_width,
                 global_batch=tr.global_batch, optim=cfg.optim, total_steps=tr.steps,
                 deterministic=tr.deterministic, virtual_shards=tr.virtual_shards)
    if sn.ladder_levels and supports_sliced_pipeline(spec.module):
        sliced = SlicedPipelinedStep(spec, mesh, par, levels=sn.ladder_levels, **sizes)
        ahead = _largest_fits(sliced, spec, mesh, cfg, compile_with)
        return ConfiguredStep(sliced.plan, sliced,
                              f"through the pipeline ({par.schedule}, {par.microbatches} microbatches per "
                              f"subnet), sliced (each pass at its subnets' FFN width and heads, depth "
                              f"masked; <= {sliced.max_programs} programs, compiled on first use{ahead})")
    piped = PipelinedStep(spec, mesh, par, **sizes)
    t0 = time.perf_counter()
    compiled = ""
    if compile_with is not None:
        state, subnets = compile_with
        check_step_fits(piped.compile(state, piped.plan(subnets), _batch_spec(mesh, cfg)),
                        mesh, state_resident=True, advice=_shrink(mesh))
        compiled = f", compiled in {time.perf_counter() - t0:.1f}s"
    why = ("supernet.ladder_levels=0" if not sn.ladder_levels
           else f"{type(spec.module).__name__} has no sliced path")
    return ConfiguredStep(piped.plan, piped, f"through the pipeline ({par.schedule}, {par.microbatches} "
                                             f"microbatches per subnet), masked ({why}{compiled})")


def _batch_spec(mesh, cfg: Config) -> dict:
    """A training batch's shapes and shardings (rows split over the data axes)."""
    rows = NamedSharding(mesh, P(DATA_AXES))
    tokens = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.model.seq_len), np.int32, sharding=rows)
    return {"inputs": tokens, "targets": tokens}


def _shrink(mesh) -> str:
    """What makes a SPara step smaller (it has no train.grad_accum)."""
    remat = "parallel.stage_remat=full" if mesh.shape["pipe"] > 1 else "model.remat=full"
    return (f"lower train.global_batch, supernet.vmap_width or supernet.subnets_per_step, shorten "
            f"model.seq_len, set {remat}, or spread the batch over more devices")


def _largest_fits(step, spec: SupernetSpec, mesh, cfg: Config, compile_with) -> str:
    """A sliced step compiles a program per shape as it meets them, so the first step
    that meets one too large for memory was the kernel's SIGKILL mid-run (seen:
    ``mindpipe supernet model.seq_len=4096``, 24 GiB resident on this host, status 137).
    Compiled here for the step that holds the most: ``K`` copies of the space's largest
    subnet (the largest shape, every subnet in one group: the longest pass through a
    pipeline), and refused in one line if that cannot fit beside the state
    (``check_programs_fit``). Under the sandwich strategy every step has the largest
    subnet, so its programs are the ones the first step then finds compiled. Returns
    what the run's first line adds; nothing without ``compile_with`` (no check asked)."""
    if compile_with is None:
        return ""
    t0 = time.perf_counter()
    largest = np.repeat(spec.space.largest()[None], cfg.supernet.subnets_per_step, axis=0)
    lowered = step.lower(compile_with[0], step.plan(largest), _batch_spec(mesh, cfg))
    check_programs_fit([program.compile() for program in lowered], mesh, advice=_shrink(mesh))
    return f"; the largest subnet's compiled in {time.perf_counter() - t0:.1f}s"


def fingerprint(spec: SupernetSpec) -> dict:
    """Parameter paths and shapes, and the genes of the space: what a checkpoint must match.

    (Widths, head counts and depths do not change any shape, so the genes are part of it.)
    """
    flat = jax.tree_util.tree_flatten_with_path(spec.abstract_params)[0]
    return {"params": {jax.tree_util.keystr(path): list(leaf.shape) for path, leaf in flat},
            "genes": {g.name: list(g.choices) for g in spec.space.genes}}


def _prepare_out_dir(cfg: Config, spec: SupernetSpec) -> tuple[Path, Path, int | None, dict]:
    """(out_dir, checkpoint dir, step to resume from or None, its meta), before anything is written.

    The dense loop's rules (a file, a foreign directory, another model, a run without
    ``train.resume``, nothing to resume, a finished run), after two of a supernet's
    own: a dense run's checkpoint, or one of another supernet class, is refused by name.
    """
    found = read_meta(Path(cfg.train.out_dir).absolute() / "checkpoints")  # foreign/unreadable: ConfigError
    if found is not None:
        step, meta = found
        where = f"train.out_dir {str(Path(cfg.train.out_dir).absolute())!r}"
        if meta.get("kind") != KIND:
            raise ConfigError(f"{where} holds the checkpoint of a dense model (`mindpipe train`, step "
                              f"{step}), not of a supernet; choose another train.out_dir")
        ours = type(spec.module).__name__
        if meta.get("model", ours) != ours:
            raise ConfigError(f"{where} holds a checkpoint of the supernet {meta['model']}, not of {ours}; "
                              f"pass the model that wrote it or choose another train.out_dir")
    return prepare_out_dir(cfg, fingerprint(spec), KIND)


def _abstract_state(spec: SupernetSpec, create, mesh):
    """The train state's shapes on ``mesh``'s shardings: what a checkpoint restores onto."""
    abstract = jax.eval_shape(lambda: init_state(spec, create()))
    return jax.tree.map(
        lambda sharding, sub: jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), sub),
        state_shardings(mesh, spec), abstract)
