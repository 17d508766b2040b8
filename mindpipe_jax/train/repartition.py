"""Online repartition (``parallel.repartition_after``): measure the layers of the model
this run trains and re-balance its stage split.

The model measured is the run's own (its ``ModelSpec``: a user's factory, module or
Linen model as well as the built-in GPT), on parameters of the run's shapes; the units
counted are its stack's (groups of layers where the model alternates layer kinds). Timings
differ between processes, so process 0 decides and every process takes its split: two
processes running different stage splits would run different programs and hang.
"""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import numpy as np
from jax.experimental import multihost_utils

from mindpipe_jax.config import Config
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.train.state import probe_factory
from mindpipe_jax.train.step_checks import BATCH_AXES


def current_split(cfg: Config, units: int, stages: int) -> tuple[int, ...]:
    """The units per global stage the step runs: ``parallel.stage_layers``, or even."""
    return tuple(cfg.parallel.stage_layers) or (units // stages,) * stages


def replan(layout) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the split the step runs now, the balanced split measured now) for ``layout``'s
    model, mesh and schedule, the same on every process."""
    from mindpipe_jax.parallel.pipeline import get_schedule
    from mindpipe_jax.parallel.pipeline.plan.partition import measure_layer_costs, partition
    from mindpipe_jax.parallel.pipeline.runtime.spmd import needs_lockstep

    cfg, mesh, spec = layout.cfg, layout.mesh, layout.spec
    par = cfg.parallel
    p = mesh.shape["pipe"]
    schedule = get_schedule(par.schedule, p, par.microbatches, par.virtual_stages,
                            par.split_last)  # the table the runtime runs
    stages = schedule.num_global_stages
    counts, failure = np.full(stages, -1, np.int32), None  # -1s: process 0 could not plan
    if jax.process_index() == 0:
        try:
            n_batch = math.prod(mesh.shape[a] for a in BATCH_AXES)  # expert devices run their own rows too
            microbatch = cfg.train.global_batch // (n_batch * par.microbatches)
            profile = measure_layer_costs(cfg.model, microbatch=microbatch, model=probe_factory(spec),
                                          tensor=mesh.shape["tensor"])
            plan = partition(profile, p=p, v=par.virtual_stages, m=par.microbatches,
                             schedule=schedule, fuse_modes=(par.fuse_ticks,),  # the runtime keeps its mode
                             lockstep=needs_lockstep(mesh))
            counts = np.asarray(plan.counts, np.int32)
        except Exception as err:  # the others wait for its answer: they must hear of it, not hang
            failure = err
    if jax.process_count() > 1:
        counts = np.asarray(multihost_utils.broadcast_one_to_all(counts))
    if failure is not None:
        raise failure
    if (counts < 0).any():
        raise ConfigError(f"parallel.repartition_after={par.repartition_after}: process 0 could not measure "
                          f"and re-plan the stages (its log says why)")
    after = tuple(int(c) for c in counts)
    return current_split(cfg, sum(after), stages), after


# The keys that decide which stage split a repartition chose for: resuming with any of
# them changed (another pipe, schedule, model depth or configured split) is another run,
# whose split is the one its config gives.
_SPLIT_KEYS = (("parallel", "pipe"), ("parallel", "virtual_stages"), ("parallel", "schedule"),
               ("parallel", "stage_layers"), ("parallel", "repartition_after"), ("model", "n_layers"))


def resumed_split(saved_meta: dict, cfg: Config) -> tuple[list[int], str] | None:
    """(the stage split, the line that says so) where a checkpoint was saved after an online
    repartition and the run resumes with the config that repartitioned: the split measured
    then, not ``parallel.stage_layers`` again (``repartition_after`` does not fire again on
    a resume past it, so a requeued job would otherwise run the unbalanced split to the
    end). ``None`` otherwise."""
    chosen = saved_meta.get("repartition")
    saved = saved_meta.get("config") or {}
    now = json.loads(json.dumps(cfg.to_dict()))  # as the checkpoint holds it: lists, not tuples
    if not chosen or any((saved.get(s) or {}).get(k) != now[s][k] for s, k in _SPLIT_KEYS):
        return None
    split = [int(c) for c in chosen["stage_layers"]]
    started = (f"parallel.stage_layers={list(cfg.parallel.stage_layers)}" if cfg.parallel.stage_layers
               else "an even split")
    return split, (f"resuming with the stage split {split} that the repartition at step {chosen['step']} "
                   f"chose (the run started from {started})")


def put_off_repartition(saved_meta: dict, cfg: Config, resume_step: int) -> tuple[int, str] | None:
    """(the step after which it runs, the line that says so) where a stop (SIGTERM, Ctrl-C)
    came right at ``parallel.repartition_after``: the stop saves and exits without the
    measuring and recompiling, so the repartition is owed. The resume with the same
    ``repartition_after`` runs it after its first step; without this, ``repartition_after``
    (past by then) never fired and the job trained on the unbalanced split to the end.
    ``None`` otherwise."""
    owed = saved_meta.get("repartition_owed")
    saved = (saved_meta.get("config") or {}).get("parallel") or {}
    if not owed or saved.get("repartition_after") != cfg.parallel.repartition_after:
        return None
    return resume_step + 1, (f"the repartition that the stop after step {owed} put off runs after "
                             f"step {resume_step + 1}")


@dataclasses.dataclass(frozen=True)
class Resumed:
    """What a checkpoint tells a resume about online repartition (``on_resume``)."""

    split: list[int] | None = None  # the split to run instead of the config's
    chosen: dict | None = None  # the checkpoint's record of that repartition, carried on
    owed_after: int | None = None  # the step after which a repartition a stop put off runs
    lines: tuple[str, ...] = ()  # what the resume prints about it


def on_resume(saved_meta: dict, cfg: Config, resume_step: int) -> Resumed:
    """``resumed_split`` and ``put_off_repartition`` together, as the train loop takes them."""
    split, chosen, owed, lines = None, None, None, []
    if (resplit := resumed_split(saved_meta, cfg)) is not None:
        (split, line), chosen = resplit, saved_meta["repartition"]
        lines.append(line)
    if (late := put_off_repartition(saved_meta, cfg, resume_step)) is not None:
        owed, line = late
        lines.append(line)
    return Resumed(split, chosen, owed, tuple(lines))
