"""``mindpipe schedule`` and ``mindpipe plan``: the pipeline's subcommands.

``add_parsers`` adds both to the top-level parser's subcommands; each handler
checks every argument before it touches JAX or writes anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import textwrap

from mindpipe_jax.cli_common import (
    ERRORS_HELP,
    OVERRIDES_HELP,
    add_config_args,
    nonnegative_int,
    positive_int,
)
from mindpipe_jax.config import check_train_keys, load_config
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.parallel.pipeline.schedules import SCHEDULES


def add_parsers(sub, fmt) -> None:
    """Add ``schedule`` and ``plan`` to ``sub``, the top-level parser's subparsers (help in ``fmt``)."""
    names = ",".join(SCHEDULES)
    p_schedule = sub.add_parser(
        "schedule", formatter_class=fmt,
        help="print (and with --out draw) a pipeline schedule: timeline, bubble, live activations",
        description=textwrap.dedent("""\
            Build a pipeline schedule table for P stages (devices on the pipe axis) and M
            microbatches and print it: the timeline (one row per stage, one column per
            tick; F3 = forward of microbatch 3, BW3 = its fused backward, B3/W3 = input /
            weight gradient, '..' = idle, and with --virtual V > 1 a letter names the
            chunk: F3a, F3b), the tick count, the bubble fraction counting every task as
            one tick and replayed with durations F=B=W=1, BW=2, and the peak number of
            live activations (microbatches forwarded but not yet backwarded) per stage.
            With --out, also draw the timeline as a picture. Nothing needs JAX devices."""),
        epilog=textwrap.dedent("""\
            schedules:
              gpipe        all forwards, then all backwards (bubble (p-1)/(m+p-1), m live)
              1f1b         PipeDream-flush one-forward-one-backward (same bubble, <= p live)
              interleaved  Megatron interleaved 1F1B with V chunks per stage; needs M
                           divisible by P (bubble (p-1)/(V*m+p-1) in ticks)
              zb-h1        zero bubble H1: backward split into B and W, W's fill the
                           bubbles (about (p-1)/(3m+p-1) with F=B=W)
              zbv          zero bubble V: 2 chunks per stage in a V (stage s holds s and
                           2P-1-s), B/W split; (p-1)/(6m+p-1) with F=B=W at 1F1B's memory
              dualpipev    DeepSeek's DualPipe cut in half, same V; M >= 2P; an F&B pair is
                           an F then the other chunk's BW; 2P+1 live chunks

            --split-last K (zb-h1, zbv, dualpipev) splits only the last K microbatches'
            backwards into B and W and runs the others' as one BW: the W's that fill the
            drain stay, the steady state pays the fused backward (parallel.split_last).

            With a closed form the analytic bubble and memory are printed beside the
            measured ones; for dualpipev also its F&B pairs replayed as one unit, which
            gives the DualPipe repository's (p-1)(F&B+B-3W).

            examples:
              mindpipe schedule --schedule 1f1b --stages 4 --microbatches 8
              mindpipe schedule --schedule 1f1b --stages 4 --microbatches 8 --out 1f1b.png
              mindpipe schedule --schedule interleaved --stages 4 --microbatches 8 --virtual 2 --out il.svg
              mindpipe schedule --schedule zb-h1 --stages 4 --microbatches 8 --weighted --out zb.pdf
              mindpipe schedule --schedule zbv --stages 4 --microbatches 16 --out zbv.png
              mindpipe schedule --schedule dualpipev --stages 4 --microbatches 10 --out dpv.png
              mindpipe schedule --schedule zb-h1 --stages 4 --microbatches 16 --split-last 4

            pictures need matplotlib: pip install 'mindpipe-jax[plots]'.
            """) + "\n" + ERRORS_HELP)
    p_schedule.add_argument("--schedule", required=True, metavar=f"{{{names}}}",
                            help="which schedule to build")
    p_schedule.add_argument("--stages", required=True, metavar="P",
                            help="pipeline stages (devices along the pipe axis), an integer >= 1")
    p_schedule.add_argument("--microbatches", required=True, metavar="M",
                            help="microbatches per step, an integer >= 1")
    p_schedule.add_argument("--virtual", default=None, metavar="V",
                            help="model chunks per stage (interleaved, afapab; default: 1, and 2 "
                                 "for zbv and dualpipev, which take no other value)")
    p_schedule.add_argument("--split-last", default=None, metavar="K",
                            help="zero-bubble schedules (zb-h1, zbv, dualpipev): split only the last K "
                                 "microbatches' backwards into B and W (an integer >= 0; default: "
                                 "as the schedule splits them)")
    p_schedule.add_argument("--out", metavar="FILE", default=None,
                            help="also draw the timeline to FILE (.png, .svg or .pdf); its "
                                 "directory must exist")
    p_schedule.add_argument("--weighted", action="store_true",
                            help="in the picture, size boxes by duration (F=B=W=1, BW=2, "
                                 "as-soon-as-possible replay) instead of one tick per task")
    p_schedule.set_defaults(func=run_schedule, parser=p_schedule)

    p_plan = sub.add_parser(
        "plan", formatter_class=fmt,
        help="measure layer costs and print the pipeline partition (vPipe plan); draw it with --out",
        description=textwrap.dedent("""\
            Measure the configured GPT's (or MoE GPT's) layer costs on this machine (one block, the
            embedding and the head: forward, input-gradient, weight-gradient and fused
            backward times, FLOPs, activation, residual and parameter bytes; every
            local device running its copy at once, as the pipeline runs them; median
            of --repeats runs) and split the layers over the pipeline:
            parallel.pipe stages (must be > 1) x parallel.virtual_stages
            chunks, parallel.microbatches microbatches, parallel.schedule. The split
            minimises the slowest stage (embed on the first stage, head on the last, so
            those get fewer blocks); each stage then takes the cheapest remat policy
            that fits --budget-mb per device. Prints one row per stage: layers,
            predicted time, memory and remat policy, and the predicted utilization
            (event simulation of the schedule with these costs).

            It plans for the mesh the config trains on (an axis left to fill, -1 or
            tensor 0, is filled from this machine's devices; with every axis given, a
            bigger machine can be planned): a microbatch is what one batch device runs,
            train.global_batch / (parallel.microbatches x data x fsdp x expert).
            Memory counts a device's share of the parameters with gradients and Adam
            state (4 copies; split over fsdp, tensor and expert as stored, plus what
            the step gathers over fsdp), the microbatches in flight and, under remat,
            one microbatch rebuilt (activations counted whole over tensor: an upper
            bound). --compiled replaces the SPMD runtime's modelled figure by the
            compiled train step's own (this machine's devices must match the layout).

            A zero-bubble schedule that splits backwards into B and W (zb-h1, zbv) plans
            the table parallel.split_last gives; with --split-last auto the plan is
            made for each of a few split_last values (none, powers of two, p, 2p,
            all) and the one whose step replays fastest as the runtime runs it
            (fused ticks) is kept: splitting only the drain's backwards wins where
            the measured B + W cost more than the fused backward."""),
        epilog=textwrap.dedent("""\
            examples:
              mindpipe plan parallel.pipe=4 parallel.microbatches=16
              mindpipe plan parallel.pipe=4 parallel.microbatches=16 --budget-mb 20 --out plan.png
              mindpipe plan parallel.pipe=4 parallel.microbatches=16 parallel.schedule=zb-h1 \
                  --split-last auto
              mindpipe plan --config my.toml parallel.pipe=2 parallel.schedule=interleaved \\
                  parallel.virtual_stages=2 parallel.microbatches=8
              mindpipe plan --model my_models.py:make_llama parallel.pipe=2 parallel.microbatches=8

            pictures need matplotlib: pip install 'mindpipe-jax[plots]'.
            """) + "\n" + OVERRIDES_HELP + "\n" + ERRORS_HELP)
    add_config_args(p_plan)
    p_plan.add_argument("--budget-mb", metavar="N", default=None,
                        help="memory budget per device in MB (1 MB = 2^20 bytes); default: unlimited")
    p_plan.add_argument("--remat", metavar="LIST", default="none,dots,full",
                        help="remat policies to choose from, comma-separated, of none, dots, full "
                             "(default: all three; dots needs one more measurement)")
    p_plan.add_argument("--repeats", metavar="N", default="5",
                        help="timed runs per measurement, the median is used (default: 5)")
    p_plan.add_argument("--split-last", metavar="K", default=None,
                        help="zero-bubble schedules: split only the last K microbatches' backwards "
                             "(-1: all), or 'auto' to plan each of a few K and keep the fastest as run "
                             "(default: parallel.split_last)")
    p_plan.add_argument("--compiled", action="store_true",
                        help="judge the budget and report the SPMD runtime's memory by compiling the train "
                             "step for each remat tried (ahead of time, nothing allocated) on this "
                             "machine's devices, instead of the memory model: exact, a compile each")
    p_plan.add_argument("--model", metavar="MODULE:NAME", default=None,
                        help="plan your own model instead of the reference GPT (as mindpipe train "
                             "--model takes it: a factory rngs -> nnx.Module, an nnx.Module or a Linen "
                             "module); its stack's units are what the stages split")
    p_plan.add_argument("--out", metavar="FILE", default=None,
                        help="also draw per-stage time and per-device memory bars to FILE "
                             "(.png, .svg or .pdf); its directory must exist")
    p_plan.set_defaults(func=run_plan, parser=p_plan)


def run_schedule(args: argparse.Namespace) -> int:
    from mindpipe_jax import viz
    from mindpipe_jax.parallel.pipeline.schedules import DEFAULT_COST, get_schedule

    # Every check before any output, so that a mistake writes nothing.
    p = positive_int(args.stages, "--stages")
    m = positive_int(args.microbatches, "--microbatches")
    v = None if args.virtual is None else positive_int(args.virtual, "--virtual")
    k = None if args.split_last is None else nonnegative_int(args.split_last, "--split-last")
    if args.weighted and args.out is None:
        raise ConfigError("--weighted sizes the picture's boxes by duration, and there is no picture; "
                          "add --out FILE (.png, .svg or .pdf)")
    if args.out is not None:
        viz.check_picture_path(args.out)
        viz.require_matplotlib()
    schedule = get_schedule(args.schedule, p, m, v, k)
    print(viz.schedule_summary(schedule), flush=True)
    if args.out is not None:
        path = viz.draw_schedule(schedule, args.out, cost=DEFAULT_COST if args.weighted else None)
        print(f"wrote {path}", flush=True)
    return 0


def run_plan(args: argparse.Namespace) -> int:
    import math

    from mindpipe_jax import viz
    from mindpipe_jax.parallel.pipeline.plan.partition import MB, REMAT_POLICIES
    from mindpipe_jax.parallel.pipeline.schedules import get_schedule

    # Every check before touching JAX or writing anything.
    cfg = load_config(args.config, args.overrides)
    check_train_keys(cfg, "mindpipe plan")  # it plans a `mindpipe train` run
    if args.model:
        from mindpipe_jax.train.step_checks import check_user_model_keys
        check_user_model_keys(cfg.model)
    par = cfg.parallel
    if par.pipe < 2:
        raise ConfigError(f"mindpipe plan needs parallel.pipe > 1 (the number of pipeline stages), got "
                          f"parallel.pipe={par.pipe}; e.g. mindpipe plan parallel.pipe=4")
    # What the plan chooses: a given one would be silently replaced by the plan's.
    chosen = {"stage_layers": (par.stage_layers, ()), "stage_remat": (par.stage_remat, "none")}
    for key, (given, default) in chosen.items():
        if given != default:
            shown = list(given) if isinstance(given, tuple) else given
            raise ConfigError(f"parallel.{key}={shown!r} is what mindpipe plan chooses (it prints the split "
                              f"and remat to train with); drop it (--remat limits the policies it may pick)")
    p, v, m = par.pipe, par.virtual_stages, par.microbatches
    split_last = par.split_last
    if args.split_last is not None and args.split_last != "auto":
        try:
            split_last = int(args.split_last)
        except ValueError:
            split_last = -2
        if split_last < -1:
            raise ConfigError(f"--split-last must be 'auto', -1 (split every backward) or an integer >= 0, "
                              f"got {args.split_last!r}")
    schedule = get_schedule(par.schedule, p, m, v, split_last)  # refuses a bad name or (p, m, v)
    if args.split_last == "auto" and not schedule.has_split():
        raise ConfigError(f"--split-last auto chooses which backwards a zero-bubble schedule (zb-h1, zbv, "
                          f"dualpipev) splits into B and W; parallel.schedule={par.schedule!r} splits none")
    if cfg.train.global_batch % m:
        raise ConfigError(f"train.global_batch={cfg.train.global_batch} must be divisible by "
                          f"parallel.microbatches={m} (microbatch = global_batch / microbatches)")
    budget = None
    if args.budget_mb is not None:
        try:
            budget_mb = float(args.budget_mb)
        except ValueError:
            budget_mb = math.nan
        if not 0 < budget_mb < math.inf:
            raise ConfigError(f"--budget-mb must be a number > 0 (MB per device), got {args.budget_mb!r}")
        budget = budget_mb * MB
    options = tuple(o.strip() for o in args.remat.split(",") if o.strip())
    if not options or any(o not in REMAT_POLICIES for o in options):
        raise ConfigError(f"--remat must list policies from {', '.join(REMAT_POLICIES)}, got {args.remat!r}")
    repeats = positive_int(args.repeats, "--repeats")
    if args.out is not None:
        viz.check_picture_path(args.out)
        viz.require_matplotlib()

    from mindpipe_jax.parallel.mesh import refuse_processes, setup_runtime

    refuse_processes(cfg.distributed, "mindpipe plan")
    setup_runtime(par, cfg.distributed)  # before any other JAX operation, as train does
    from mindpipe_jax.parallel.pipeline.plan.partition import (
        choose_split_last,
        measure_layer_costs,
        partition,
    )
    from mindpipe_jax.parallel.pipeline.runtime.spmd import needs_lockstep
    from mindpipe_jax.train.plan_layout import plan_layout
    from mindpipe_jax.train.state import probe_factory

    model = None
    if args.model:  # imported after setup_runtime: the module may touch JAX at import
        from mindpipe_jax.models.bridge import nnx_model
        from mindpipe_jax.models.loading import load_model_ref
        model = nnx_model(load_model_ref(args.model), cfg.model.seq_len)  # a Linen one: its factory
    mesh, microbatch, share, spec = plan_layout(cfg, model)
    measure = _compiled_memory(cfg, mesh, model) if args.compiled else None
    profile = measure_layer_costs(cfg.model, microbatch=microbatch, repeats=repeats, dots="dots" in options,
                                  model=probe_factory(spec), tensor=mesh.shape["tensor"])
    lockstep = needs_lockstep(mesh)  # the runtime's rule on the run's mesh
    common = dict(memory_budget_bytes=budget, remat_options=options, lockstep=lockstep, param_share=share,
                  measure_memory=measure)
    if args.split_last == "auto":
        plan = choose_split_last(profile, p=p, v=v, m=m, schedule=par.schedule, **common)
    else:
        plan = dataclasses.replace(partition(profile, p=p, v=v, m=m, schedule=schedule, **common),
                                   split_last=split_last)
    print(plan.table(), flush=True)
    if args.out is not None:
        print(f"wrote {viz.draw_plan(plan, args.out)}", flush=True)
    return 0


def _compiled_memory(cfg, mesh, model=None):
    """``measure(remat, counts, fuse_mode)``: the peak bytes per device of ``cfg``'s train
    step compiled ahead of time with that split, remat and tick mode (the tuner's
    feasibility check, ``tuner.aot``), once per distinct plan."""
    import json
    import math

    import jax

    from mindpipe_jax.errors import ConfigError
    from mindpipe_jax.train.memory_fit import peak_bytes
    from mindpipe_jax.tuner.aot import build_step

    need, have = math.prod(mesh.shape.values()), jax.device_count()
    if need != have:
        raise ConfigError(f"--compiled compiles the step on this machine's devices: the layout needs {need}, "
                          f"this machine has {have}; drop --compiled to plan for another machine")
    seen: dict = {}

    def measure(remat, counts, fuse_mode) -> float:
        key = (tuple(remat), tuple(counts), fuse_mode)
        if key not in seen:
            run = cfg.replace(f"parallel.stage_layers={list(counts)}", f"parallel.fuse_ticks={fuse_mode}",
                              f"parallel.stage_remat={json.dumps(list(remat))}")
            seen[key] = peak_bytes(build_step(run, model).lower().compile().memory_analysis())
        return seen[key]
    return measure
