"""``mindpipe``: the command line. Thin on purpose: parse, call the library, print.

Subcommands:

* ``mindpipe train [--config FILE] [section.key=value ...]`` — run ``mindpipe_jax.train``.
* ``mindpipe config [--config FILE] [section.key=value ...]`` — print the resolved config as TOML.
* ``mindpipe schedule --schedule NAME --stages P --microbatches M [--virtual V] [--out FILE]`` —
  print a pipeline schedule's timeline, bubble and live activations; draw it with ``--out``.
* ``mindpipe plan [--config FILE] [section.key=value ...] [--budget-mb N] [--out FILE]`` — measure
  the model's layer costs on this machine and print the vPipe partition: layers, predicted time,
  memory and remat per stage, and the predicted utilization; draw it with ``--out``.
* ``mindpipe supernet [--config FILE] [section.key=value ...]`` — SPara: train the reference
  supernet (``mindpipe_jax.supernet.train_supernet``), checkpoint it into ``train.out_dir``,
  then print the search's best subnets.
* ``mindpipe search RUN_DIR [--step N] [section.key=value ...]`` — run the search again on a
  saved supernet (``mindpipe_jax.supernet.search_checkpoint``) and print its best subnets.

A user mistake (``ConfigError``) becomes one line on stderr and exit status 2; a
run stopped by a non-finite loss exits 3, a multi-host run whose processes could
not start or lost one another exits 4, each with one line. SIGTERM or a first
Ctrl-C during training saves a checkpoint and exits 0; Ctrl-C elsewhere exits
130. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

from mindpipe_jax.config import Config, load_config
from mindpipe_jax.errors import (
    EXIT_CONFIG,
    EXIT_DISTRIBUTED,
    EXIT_NONFINITE,
    ConfigError,
    NonFiniteError,
)
from mindpipe_jax.parallel.pipeline.schedules import SCHEDULES

PROG = "mindpipe"

_OVERRIDES_HELP = """\
overrides:
  Any config key can be set on the command line as section.key=value, after the
  subcommand. The value is a TOML literal: 2, -1, 0.5, 3e-4, true, "text".
  A bare word that is not a TOML literal is taken as a string (data.source=text).
  Precedence, lowest first:
    1. the defaults (the dataclasses in mindpipe_jax/config.py, written out with
       comments in examples/configs/default.toml),
    2. the TOML file given with --config (same section names, any subset of keys),
    3. the overrides, left to right (a later one wins).
  Run `mindpipe config [same arguments]` to print every resolved key and value.
"""

_EXAMPLES = """\
examples:
  mindpipe train                                     # the default run (see README)
  mindpipe train parallel.tensor=2 train.steps=50    # tensor parallel, 50 steps
  mindpipe train --config examples/configs/tiny.toml # a small run in seconds
  mindpipe train --config examples/configs/tiny.toml train.resume=true train.steps=60
  mindpipe train --config examples/configs/tiny.toml --resume   # same as train.resume=true
  mindpipe config parallel.fsdp=4 > my.toml          # write a full config to edit
  mindpipe schedule --schedule 1f1b --stages 4 --microbatches 8 --out 1f1b.png
  mindpipe plan parallel.pipe=4 parallel.microbatches=16 --out plan.png
"""

_ERRORS = """\
exit status:
  0 success, or stopped by SIGTERM / a first Ctrl-C after saving a checkpoint
    (continue with --resume); 2 a bad argument or config value (one line on
    stderr, nothing written); 3 training stopped on a non-finite loss or
    gradient norm (train.nonfinite=stop; the last checkpoint is untouched);
    4 a multi-host run whose processes did not all start or lost one another;
    130 interrupted outside the training loop (or a second Ctrl-C). Any other
    failure prints a traceback: a bug.
"""


def _paragraphs(cls) -> list[str]:
    """A config section's docstring as plain one-line paragraphs."""
    doc = textwrap.dedent(cls.__doc__ or "").strip()
    return [" ".join(p.split()).replace("``", "").replace("\u00d7", "x")
            for p in doc.split("\n\n") if p.strip()]


def _first_line(cls) -> str:
    """The first paragraph of a config section's docstring."""
    paragraphs = _paragraphs(cls)
    return paragraphs[0] if paragraphs else ""


def _sections_help(width: int = 78) -> str:
    """Each config section, what it is for, and its keys (generated from config.py)."""
    lines = ["config sections (keys; `mindpipe config` shows values and defaults):"]
    for f in dataclasses.fields(Config):
        cls = f.default_factory  # type: ignore[misc]
        lines.extend(textwrap.wrap(f"{f.name}: {_first_line(cls)}", width,
                                   initial_indent="  ", subsequent_indent=" " * (len(f.name) + 4),
                                   break_long_words=False))
        keys = "keys: " + ", ".join(g.name for g in dataclasses.fields(cls))
        lines.extend(textwrap.wrap(keys, width, initial_indent="    ", subsequent_indent="          "))
    return "\n".join(lines) + "\n"


# --- a tiny TOML writer for the two-level config table -----------------------------------------

_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_string(s: str) -> str:
    out = []
    for ch in s:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != value:
            return "nan"
        if value in (float("inf"), float("-inf")):
            return "inf" if value > 0 else "-inf"
        return repr(value)  # always has '.', 'e' (valid TOML) — e.g. 0.003, 1e-08
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} value {value!r} as TOML")


def to_toml(cfg: Config, *, comments: bool = True) -> str:
    """The config as TOML that ``load_config`` reads back to an equal ``Config``.

    With ``comments``, each section starts with its description and a key whose
    value differs from the default says so (``steps = 7  # default: 300``).
    """
    defaults = Config().to_dict()
    blocks = []
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        lines = []
        if comments:
            for i, paragraph in enumerate(_paragraphs(type(section))):
                lines.extend(["#"] * (i > 0) + ["# " + ln for ln in textwrap.wrap(paragraph, 76)])
        lines.append(f"[{f.name}]")
        for key, value in dataclasses.asdict(section).items():
            line = f"{key} = {_toml_value(value)}"
            default = defaults[f.name][key]
            if comments and value != default:
                line += f"  # default: {_toml_value(default)}"
            lines.append(line)
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"


# --- the parser -------------------------------------------------------------------------------


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", metavar="FILE", default=None,
                   help="TOML file with any subset of the config sections (default: none, "
                        "i.e. the built-in defaults)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="config overrides; the value is a TOML literal (see below)")


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog=PROG, formatter_class=fmt,
        description=textwrap.dedent("""\
            Train Flax NNX models across data, fsdp, tensor, pipeline, supernet and
            expert parallelism in JAX, and tune the layout (mindpipe tune).

            With no config file and no overrides, `mindpipe train` trains a small
            byte-level GPT on the Python standard library's own sources, on every
            device it finds: on a CPU-only machine 8 simulated devices as a
            data=4 x tensor=2 mesh, on GPUs data parallel over all of them."""),
        epilog="\n".join([_OVERRIDES_HELP, _sections_help(), _EXAMPLES, _ERRORS]))
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p_train = sub.add_parser(
        "train", formatter_class=fmt, help="train a model (the reference GPT) from a config",
        description=textwrap.dedent("""\
            Train the reference GPT described by the config: build the device mesh,
            load the data, train for train.steps steps, evaluate every
            train.eval_every steps and checkpoint into train.out_dir. Every check
            (keys, types, mesh against the devices, batch divisibility, data path,
            an existing run in train.out_dir) happens before any file is written.
            Continue a run with train.resume=true (or --resume); train.resume=auto
            continues when there is a checkpoint and starts fresh when there is none
            (a job script that is requeued). SIGTERM or Ctrl-C stops after the current
            step with a checkpoint."""),
        epilog="\n".join([_OVERRIDES_HELP, _sections_help(), _EXAMPLES, _ERRORS]))
    _add_config_args(p_train)
    p_train.add_argument("--resume", action="store_true",
                         help="continue the run in train.out_dir from its newest complete "
                              "checkpoint (the same as train.resume=true)")
    p_train.set_defaults(func=_cmd_train, parser=p_train)

    p_config = sub.add_parser(
        "config", formatter_class=fmt, help="print the fully resolved config as TOML",
        description=textwrap.dedent("""\
            Print the config that `mindpipe train` would use with the same arguments,
            as TOML: every section and key, with a comment on each value that differs
            from its default. The output is a valid --config file. Only the config
            itself is checked here; the mesh and batch sizes are checked against the
            devices when training starts."""),
        epilog="\n".join([_OVERRIDES_HELP, _sections_help(), _EXAMPLES]))
    _add_config_args(p_config)
    p_config.add_argument("--no-comments", action="store_true",
                          help="plain TOML without section descriptions and default notes")
    p_config.set_defaults(func=_cmd_config, parser=p_config)

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

            examples:
              mindpipe schedule --schedule 1f1b --stages 4 --microbatches 8
              mindpipe schedule --schedule 1f1b --stages 4 --microbatches 8 --out 1f1b.png
              mindpipe schedule --schedule interleaved --stages 4 --microbatches 8 --virtual 2 --out il.svg
              mindpipe schedule --schedule zb-h1 --stages 4 --microbatches 8 --weighted --out zb.pdf

            pictures need matplotlib: pip install 'mindpipe-jax[plots]'.
            """) + "\n" + _ERRORS)
    p_schedule.add_argument("--schedule", required=True, metavar=f"{{{names}}}",
                            help="which schedule to build")
    p_schedule.add_argument("--stages", required=True, metavar="P",
                            help="pipeline stages (devices along the pipe axis), an integer >= 1")
    p_schedule.add_argument("--microbatches", required=True, metavar="M",
                            help="microbatches per step, an integer >= 1")
    p_schedule.add_argument("--virtual", default="1", metavar="V",
                            help="model chunks per stage (interleaved only; default: 1)")
    p_schedule.add_argument("--out", metavar="FILE", default=None,
                            help="also draw the timeline to FILE (.png, .svg or .pdf); its "
                                 "directory must exist")
    p_schedule.add_argument("--weighted", action="store_true",
                            help="in the picture, size boxes by duration (F=B=W=1, BW=2, "
                                 "as-soon-as-possible replay) instead of one tick per task")
    p_schedule.set_defaults(func=_cmd_schedule, parser=p_schedule)

    p_plan = sub.add_parser(
        "plan", formatter_class=fmt,
        help="measure layer costs and print the pipeline partition (vPipe plan); draw it with --out",
        description=textwrap.dedent("""\
            Measure the configured GPT's layer costs on this machine (one block, the
            embedding and the head: forward, input-gradient, weight-gradient and fused
            backward times, FLOPs, activation, residual and parameter bytes; JAX's
            default device, median of --repeats runs) and split the layers over the
            pipeline: parallel.pipe stages (must be > 1) x parallel.virtual_stages
            chunks, parallel.microbatches microbatches, parallel.schedule. The split
            minimises the slowest stage (embed on the first stage, head on the last, so
            those get fewer blocks); each stage then takes the cheapest remat policy
            that fits --budget-mb per device. Prints one row per stage: layers,
            predicted time, memory and remat policy, and the predicted utilization
            (event simulation of the schedule with these costs).

            The microbatch size is train.global_batch / parallel.microbatches: the
            whole global batch goes through one pipeline (no data-parallel split).
            Memory counts parameters with gradients and Adam state (4 copies), the
            microbatches in flight and, under remat, one microbatch rebuilt."""),
        epilog=textwrap.dedent("""\
            examples:
              mindpipe plan parallel.pipe=4 parallel.microbatches=16
              mindpipe plan parallel.pipe=4 parallel.microbatches=16 --budget-mb 20 --out plan.png
              mindpipe plan --config my.toml parallel.pipe=2 parallel.schedule=interleaved \\
                  parallel.virtual_stages=2 parallel.microbatches=8

            pictures need matplotlib: pip install 'mindpipe-jax[plots]'.
            """) + "\n" + _OVERRIDES_HELP + "\n" + _ERRORS)
    _add_config_args(p_plan)
    p_plan.add_argument("--budget-mb", metavar="N", default=None,
                        help="memory budget per device in MB (1 MB = 2^20 bytes); default: unlimited")
    p_plan.add_argument("--remat", metavar="LIST", default="none,dots,full",
                        help="remat policies to choose from, comma-separated, of none, dots, full "
                             "(default: all three; dots needs one more measurement)")
    p_plan.add_argument("--repeats", metavar="N", default="5",
                        help="timed runs per measurement, the median is used (default: 5)")
    p_plan.add_argument("--out", metavar="FILE", default=None,
                        help="also draw per-stage time and per-device memory bars to FILE "
                             "(.png, .svg or .pdf); its directory must exist")
    p_plan.set_defaults(func=_cmd_plan, parser=p_plan)

    p_supernet = sub.add_parser(
        "supernet", formatter_class=fmt,
        help="SPara: train a weight-sharing supernet (many subnets per step), then search it",
        description=textwrap.dedent("""\
            Train the reference supernet (the GPT of the model section with searchable
            blocks: FFN operator, FFN width, attention heads, depth; see the supernet
            section) with supernet.subnets_per_step subnets per step, split over
            parallel.subnet device groups and each subnet's batch over parallel.data.
            The parameters are bitwise identical for any such split of the devices.
            Checkpoints go to train.out_dir (every train.checkpoint_every steps and at
            the end; a directory that already holds a run is refused unless --resume
            continues it, to the same bits as an uninterrupted run). SIGTERM or Ctrl-C
            stops after the current step with a checkpoint. Then run the
            evolutionary search on the validation split and print the best subnets with
            their validation loss and parameter count; `mindpipe search` repeats it
            later from the checkpoint."""),
        epilog=textwrap.dedent("""\
            examples:
              mindpipe supernet parallel.subnet=4 parallel.data=2 train.steps=100
              mindpipe supernet supernet.semantics=causal supernet.search_max_params=500000
              mindpipe supernet train.out_dir=runs/super && mindpipe search runs/super
              mindpipe supernet train.out_dir=runs/super train.steps=200 --resume
            """) + "\n" + "\n".join([_OVERRIDES_HELP, _sections_help(), _ERRORS]))
    _add_config_args(p_supernet)
    p_supernet.add_argument("--resume", action="store_true",
                            help="continue the supernet run in train.out_dir from its newest complete "
                                 "checkpoint (the same as train.resume=true)")
    p_supernet.set_defaults(func=_cmd_supernet, parser=p_supernet)

    p_search = sub.add_parser(
        "search", formatter_class=fmt,
        help="search a saved supernet (the train.out_dir of `mindpipe supernet`) for its best subnets",
        description=textwrap.dedent("""\
            Restore the supernet saved by `mindpipe supernet` in RUN_DIR (its newest
            committed checkpoint, or --step N) onto this machine's devices and run the
            evolutionary search on the validation split: subnets scored with the weights
            they inherit, no retraining. Prints the best subnets (supernet.search_top_k)
            with their validation loss and parameter count. The run's own config is
            used; overrides may change how the search runs (supernet.search_population,
            search_generations, search_top_k, search_max_params, search_eval_batches,
            train.seed, parallel.*, data.*) but not the supernet (model.*,
            supernet.ops, ffn_ratios, heads, min_depth). The same settings give the same
            top-k as the search at the end of training, on any device count."""),
        epilog=textwrap.dedent("""\
            examples:
              mindpipe search runs/super
              mindpipe search runs/super supernet.search_max_params=500000 supernet.search_top_k=10
              mindpipe search runs/super --step 200 parallel.subnet=1 parallel.data=8
            """) + "\n" + "\n".join([_OVERRIDES_HELP, _ERRORS]))
    p_search.add_argument("run_dir", metavar="RUN_DIR",
                          help="the train.out_dir of a `mindpipe supernet` run")
    p_search.add_argument("--step", metavar="N", default=None,
                          help="search the checkpoint of step N (default: the newest)")
    p_search.add_argument("overrides", nargs="*", metavar="section.key=value",
                          help="search settings; the value is a TOML literal (see below)")
    p_search.set_defaults(func=_cmd_search, parser=p_search)

    from mindpipe_jax.tuner.command import add_parser as add_tune_parser

    p_tune = add_tune_parser(sub, _add_config_args, fmt)
    p_tune.set_defaults(parser=p_tune)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    # Options may come after overrides (`mindpipe train a.b=1 --config f.toml c.d=2`):
    # argparse leaves the later positionals over, so collect them as overrides in order.
    args, extra = parser.parse_known_args(argv)
    for item in extra:
        if item.startswith("-") or not hasattr(args, "overrides"):
            getattr(args, "parser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides.append(item)
    return args


# --- the commands -----------------------------------------------------------------------------


def _cmd_config(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    sys.stdout.write(to_toml(cfg, comments=not args.no_comments))
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    overrides = [*args.overrides, *(["train.resume=true"] if args.resume else [])]
    cfg = load_config(args.config, overrides)
    import mindpipe_jax as mp  # train() runs setup_runtime before any other JAX operation

    try:
        result = mp.train(config=cfg)
    except Exception as err:
        _exit_if_peer_lost(err)
        raise

    import jax

    if jax.process_index() == 0 and result.stopped is None:
        last_loss = next((h["loss"] for h in reversed(result.history) if "loss" in h), None)
        val = "n/a" if result.final_val_loss is None else f"{result.final_val_loss:.4f}"
        train_loss = "n/a" if last_loss is None or last_loss != last_loss else f"{last_loss:.4f}"
        skipped = f" | {result.skipped_steps} non-finite steps skipped" if result.skipped_steps else ""
        print(f"done: {cfg.train.steps} steps | final train loss {train_loss} | "
              f"final validation loss {val}{skipped} | out_dir {result.out_dir}", flush=True)
    return 0


# What a collective says when the process at the other end is gone (Gloo on CPUs,
# NCCL on GPUs, the coordination service's heartbeat).
_PEER_LOST = ("gloo", "nccl", "connection reset", "connection refused", "broken pipe", "heartbeat",
              "unavailable", "deadline_exceeded", "socket closed", "task is set to error")


def _exit_if_peer_lost(err: Exception) -> None:
    """In a multi-process run, a runtime error from a collective means another process
    died: say so in one line and exit 4 now. (Exiting normally would first wait at
    JAX's shutdown barrier for the dead process and then abort with a C++ trace.)"""
    import jax

    if jax.process_count() < 2 or not isinstance(err, jax.errors.JaxRuntimeError):
        return
    text = str(err)
    if not any(word in text.lower() for word in _PEER_LOST):
        return
    first = (text.strip().splitlines() or [""])[0][:200]
    print(f"{PROG}: error: process {jax.process_index()} of {jax.process_count()} lost contact with "
          f"another process ({first}); see the other processes' logs for why one of them stopped",
          file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_DISTRIBUTED)


def _positive_int(value: str, option: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise ConfigError(f"{option} must be an integer >= 1, got {value!r}")
    return number


def _cmd_schedule(args: argparse.Namespace) -> int:
    from mindpipe_jax import viz
    from mindpipe_jax.parallel.pipeline.schedules import DEFAULT_COST, get_schedule

    # Every check before any output, so that a mistake writes nothing.
    p = _positive_int(args.stages, "--stages")
    m = _positive_int(args.microbatches, "--microbatches")
    v = _positive_int(args.virtual, "--virtual")
    schedule = get_schedule(args.schedule, p, m, v)
    if args.out is not None:
        viz.check_picture_path(args.out)
        viz.require_matplotlib()
    print(viz.schedule_summary(schedule), flush=True)
    if args.out is not None:
        path = viz.draw_schedule(schedule, args.out, cost=DEFAULT_COST if args.weighted else None)
        print(f"wrote {path}", flush=True)
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    import math

    from mindpipe_jax import viz
    from mindpipe_jax.parallel.pipeline.partition import MB, REMAT_POLICIES
    from mindpipe_jax.parallel.pipeline.schedules import get_schedule

    # Every check before touching JAX or writing anything.
    cfg = load_config(args.config, args.overrides)
    par = cfg.parallel
    if par.pipe < 2:
        raise ConfigError(f"mindpipe plan needs parallel.pipe > 1 (the number of pipeline stages), got "
                          f"parallel.pipe={par.pipe}; e.g. mindpipe plan parallel.pipe=4")
    p, v, m = par.pipe, par.virtual_stages, par.microbatches
    get_schedule(par.schedule, p, m, v)  # refuses an unknown schedule or a bad (p, m, v)
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
    repeats = _positive_int(args.repeats, "--repeats")
    if args.out is not None:
        viz.check_picture_path(args.out)
        viz.require_matplotlib()

    from mindpipe_jax.parallel.mesh import setup_runtime

    setup_runtime(par, cfg.distributed)  # before any other JAX operation, as train does
    from mindpipe_jax.parallel.pipeline.partition import measure_layer_costs, partition

    profile = measure_layer_costs(cfg.model, microbatch=cfg.train.global_batch // m, repeats=repeats,
                                  dots="dots" in options)
    plan = partition(profile, p=p, v=v, m=m, schedule=par.schedule, memory_budget_bytes=budget,
                     remat_options=options)
    print(plan.table(), flush=True)
    if args.out is not None:
        print(f"wrote {viz.draw_plan(plan, args.out)}", flush=True)
    return 0


def _cmd_supernet(args: argparse.Namespace) -> int:
    overrides = [*args.overrides, *(["train.resume=true"] if args.resume else [])]
    cfg = load_config(args.config, overrides)
    from mindpipe_jax.supernet import train_supernet  # runs setup_runtime before any other JAX operation

    result = train_supernet(config=cfg, checkpoint=True)  # prints progress and the search table

    import jax

    if result.stopped is not None:
        return 0  # stopped by a signal: the loop said where it saved
    best = result.search.top[0] if result.search and result.search.top else None
    if best is not None and jax.process_index() == 0:
        print(f"done: {cfg.train.steps} steps | best subnet {best['subnet']} ({best['arch']}) | "
              f"validation loss {best['loss']:.4f} | {best['params']:,} parameters", flush=True)
    return 0


def _cmd_search(args: argparse.Namespace) -> int:
    step = None if args.step is None else _positive_int(args.step, "--step")
    from mindpipe_jax.supernet import search_checkpoint  # runs setup_runtime before any other JAX operation

    result, _, step = search_checkpoint(args.run_dir, *args.overrides, step=step, log=print)

    import jax

    if jax.process_index() == 0:
        print(result.table(), flush=True)
        best = result.top[0]
        print(f"done: searched step {step} | {result.evaluated} subnets scored | best subnet "
              f"{best['subnet']} ({best['arch']}) | validation loss {best['loss']:.4f} | "
              f"{best['params']:,} parameters", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mindpipe`` console script; returns the exit status."""
    parser = build_parser()
    try:
        args = _parse(parser, list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exit_:  # --help (0) and usage errors (2)
        code = exit_.code
        return code if isinstance(code, int) else (0 if code is None else 2)
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    except NonFiniteError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr, flush=True)
        return EXIT_NONFINITE
    except KeyboardInterrupt:
        newline = "\n" if sys.stderr.isatty() else ""  # off the terminal's ^C line
        print(f"{newline}{PROG}: interrupted", file=sys.stderr, flush=True)
        return 130
    except BrokenPipeError:
        # The reader went away (`mindpipe schedule ... | head`): stop quietly, as cat does.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
