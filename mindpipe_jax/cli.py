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
* ``mindpipe tune [--config FILE] [section.key=value ...] [--batches LIST] ...`` — EPara's
  offline tuner: rank layouts and batch sizes by predicted and measured entropyput.

This module holds the top-level parser and dispatch, ``train`` and ``config``;
``schedule`` and ``plan`` live in ``cli_pipeline``, ``supernet`` and ``search`` in
``cli_supernet``, ``tune`` in ``tuner/command.py``; what their parsers share is in
``cli_common``.

A user mistake (``ConfigError``) becomes one line on stderr and exit status 2; a
run stopped by a non-finite loss exits 3, a multi-host run whose processes could
not start or lost one another exits 4, each with one line. SIGTERM or a first
Ctrl-C during training saves a checkpoint and exits 0; Ctrl-C elsewhere exits
130. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
import textwrap
from collections.abc import Sequence

from mindpipe_jax import _interrupt, cli_pipeline, cli_supernet
from mindpipe_jax.cli_common import (
    ERRORS_HELP,
    OVERRIDES_HELP,
    PROG,
    OneLineParser,
    add_config_args,
    sections_help,
)
from mindpipe_jax.config import check_train_keys, load_config
from mindpipe_jax.config_toml import to_toml
from mindpipe_jax.errors import (
    EXIT_CONFIG,
    EXIT_DISTRIBUTED,
    EXIT_NONFINITE,
    ConfigError,
    DistributedError,
    NonFiniteError,
)

__all__ = ["build_parser", "main", "to_toml"]

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


# --- the parser -------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = OneLineParser(
        prog=PROG, formatter_class=fmt,
        description=textwrap.dedent("""\
            Train Flax NNX models across data, fsdp, tensor, pipeline, supernet and
            expert parallelism in JAX, and tune the layout (mindpipe tune).

            With no config file and no overrides, `mindpipe train` trains a small
            byte-level GPT on the Python standard library's own sources, on every
            device it finds: on a CPU-only machine 8 simulated devices as a
            data=4 x tensor=2 mesh, on GPUs data parallel over all of them."""),
        epilog="\n".join([OVERRIDES_HELP, sections_help(), _EXAMPLES, ERRORS_HELP]))
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
        epilog="\n".join([OVERRIDES_HELP, sections_help(), _EXAMPLES, ERRORS_HELP]))
    add_config_args(p_train)
    p_train.add_argument("--resume", action="store_true",
                         help="continue the run in train.out_dir from its newest complete "
                              "checkpoint (the same as train.resume=true)")
    p_train.add_argument("--model", metavar="MODULE:NAME", default=None,
                         help="train your own model instead of the reference GPT: a factory rngs -> "
                              "nnx.Module, an nnx.Module or a Linen module, e.g. my_models:make_llama "
                              "or path/to/models.py:make_llama (model.* keys then only set seq_len "
                              "and vocab_size of the data)")
    p_train.set_defaults(func=_cmd_train, parser=p_train)

    p_config = sub.add_parser(
        "config", formatter_class=fmt, help="print the fully resolved config as TOML",
        description=textwrap.dedent("""\
            Print the config that `mindpipe train` would use with the same arguments,
            as TOML: every section and key, with a comment on each value that differs
            from its default. The output is a valid --config file. Only the config
            itself is checked here; the mesh and batch sizes are checked against the
            devices when training starts."""),
        epilog="\n".join([OVERRIDES_HELP, sections_help(), _EXAMPLES]))
    add_config_args(p_config)
    p_config.add_argument("--no-comments", action="store_true",
                          help="plain TOML without section descriptions and default notes")
    p_config.set_defaults(func=_cmd_config, parser=p_config)

    cli_pipeline.add_parsers(sub, fmt)  # schedule, plan
    cli_supernet.add_parsers(sub, fmt)  # supernet, search

    from mindpipe_jax.tuner.command import add_parser as add_tune_parser

    p_tune = add_tune_parser(sub, add_config_args, fmt)
    p_tune.set_defaults(parser=p_tune)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    # Options may come after overrides (`mindpipe train a.b=1 --config f.toml c.d=2`):
    # argparse leaves the later positionals over, so collect them as overrides in order.
    args, extra = parser.parse_known_args(argv)
    if hasattr(args, "overrides"):  # a copy: with none given it is the parser's default list
        args.overrides = list(args.overrides)
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
    from mindpipe_jax.train.agreement import stops_everywhere

    # A config file or module on this host only stops the other processes too.
    with stops_everywhere("training run", overrides):
        cfg = load_config(args.config, overrides)
        check_train_keys(cfg)  # the supernet section, virtual_shards without deterministic
        if args.model:  # before the model's module is imported (train checks it too)
            from mindpipe_jax.train.step_checks import check_user_model_keys
            check_user_model_keys(cfg.model)
        import mindpipe_jax as mp  # train() runs setup_runtime before any other JAX operation

        model = None
        if args.model:  # imported after setup_runtime: the module may touch JAX at import
            from mindpipe_jax.models.loading import load_model_ref
            mp.setup_runtime(cfg.parallel, cfg.distributed)
            model = load_model_ref(args.model)
    try:
        result = mp.train(model=model, config=cfg)
    except Exception as err:
        _exit_if_peer_lost(err)
        raise

    import jax

    if result.already_complete:
        if jax.process_index() == 0:
            print(already_complete_line(result.step, cfg.train.steps, result.checkpoint_dir), flush=True)
        return 0
    if jax.process_index() == 0 and result.stopped is None:
        last_loss = next((h["loss"] for h in reversed(result.history) if "loss" in h), None)
        val = "n/a" if result.final_val_loss is None else f"{result.final_val_loss:.4f}"
        train_loss = "n/a" if last_loss is None or last_loss != last_loss else f"{last_loss:.4f}"
        skipped = f" | {result.skipped_steps} non-finite steps skipped" if result.skipped_steps else ""
        print(f"done: {cfg.train.steps} steps | final train loss {train_loss} | "
              f"final validation loss {val}{skipped} | out_dir {result.out_dir}", flush=True)
    return 0


def already_complete_line(step: int, steps: int, ckpt_dir) -> str:
    """What ``train.resume=auto`` on a finished run prints (a requeued job that is done)."""
    return (f"already complete at step {step}: {ckpt_dir}/{step} is the final checkpoint "
            f"(train.steps={steps}); nothing to train")


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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mindpipe`` console script; returns the exit status.

    As the process's own entry (``argv`` None), a Ctrl-C ends it with one line and
    status 130 at any moment: raised as ``KeyboardInterrupt`` while the command runs
    (so a run releases its lock and removes what it had started), and handled by
    ``_interrupt`` before (imports) and after (interpreter shutdown).
    """
    entry = argv is None
    if entry:
        _interrupt.raise_on_interrupt()
    try:
        return _main(argv)
    except KeyboardInterrupt:  # while parsing (the command's own are handled in _main)
        return _interrupted(entry)
    finally:
        if entry:
            _interrupt.exit_on_interrupt()


def _interrupted(entry: bool) -> int:
    newline = "\n" if sys.stderr.isatty() else ""  # off the terminal's ^C line
    print(f"{newline}{PROG}: interrupted", file=sys.stderr, flush=True)
    if entry:
        _interrupt.exit_now()  # JAX's threads may still be in an interrupted compile
    return 130


def _main(argv: Sequence[str] | None) -> int:
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
    except DistributedError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr, flush=True)
        return EXIT_DISTRIBUTED
    except KeyboardInterrupt:
        return _interrupted(argv is None)
    except BrokenPipeError:
        # The reader went away (`mindpipe schedule ... | head`): stop quietly, as cat does.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as err:
        # The disk filled up, or the filesystem turned read-only, outside a checkpoint
        # save (which says more: DiskFullError, a ConfigError): one line, exit 2. So is a
        # path the filesystem refuses by its length (pathlib's exists() and is_file()
        # raise it wherever a path the user gave is first looked at).
        if err.errno == errno.ENAMETOOLONG:
            print(f"{PROG}: error: {_name_too_long(err)}", file=sys.stderr, flush=True)
            return EXIT_CONFIG
        if err.errno in (errno.EACCES, errno.EPERM) and err.filename:  # a path this user may not use
            print(f"{PROG}: error: {(err.strerror or str(err)).lower()}: {str(err.filename)!r}; check its "
                  f"permissions or choose another path", file=sys.stderr, flush=True)
            return EXIT_CONFIG
        if err.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
            raise
        print(f"{PROG}: error: {_write_failure(err, args.command)}", file=sys.stderr, flush=True)
        return EXIT_CONFIG


def _name_too_long(err: OSError) -> str:
    """The refused path shortened to its ends, with the limits it broke."""
    path = str(err.filename or "")
    shown = repr(path) if len(path) <= 120 else repr(f"{path[:60]}...{path[-40:]}")
    longest = max((len(part.encode()) for part in path.split(os.sep)), default=0)
    try:
        name_max = os.pathconf(os.path.dirname(path) or ".", "PC_NAME_MAX")
    except OSError:  # the directory itself is unreachable: the usual limit
        name_max = 255
    if longest > name_max:
        limit = f"its longest name {longest}; this filesystem allows {name_max} bytes per name"
    else:  # every name fits: the whole path is past the system's PATH_MAX
        limit = "more than this system allows for a whole path"
    return f"file name too long: {shown} ({len(path.encode())} bytes, {limit}): choose a shorter path"


def _write_failure(err: OSError, command: str) -> str:
    """A write that failed for want of room (or a read-only filesystem), said with what
    helps: a run (train, supernet) continues from its checkpoints; the other commands
    wrote nothing that counts (their outputs are written whole or not at all) and are
    run again."""
    where = f" writing {err.filename!r}" if err.filename else ""
    remedy = "choose another place" if err.errno == errno.EROFS else "free some space"
    if command in ("train", "supernet"):
        then = f"{remedy} (or choose another train.out_dir) and continue with train.resume=true"
    else:
        then = f"{remedy} and run `{PROG} {command}` again"
    return f"{os.strerror(err.errno).lower()}{where}; {then}"


if __name__ == "__main__":
    sys.exit(main())
