"""``mindpipe supernet`` and ``mindpipe search``: SPara's subcommands.

``add_parsers`` adds both to the top-level parser's subcommands; the handlers
import the supernet package lazily, so ``--help`` starts no JAX and its
``setup_runtime`` runs before any other JAX operation.
"""

from __future__ import annotations

import argparse
import textwrap

from mindpipe_jax.cli_common import ERRORS_HELP, OVERRIDES_HELP, add_config_args, positive_int, sections_help
from mindpipe_jax.config import load_config


def add_parsers(sub, fmt) -> None:
    """Add ``supernet`` and ``search`` to ``sub``, the top-level parser's subparsers (help in ``fmt``)."""
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
              mindpipe supernet supernet.semantics=sequential supernet.search_max_params=500000
              mindpipe supernet train.out_dir=runs/super && mindpipe search runs/super
              mindpipe supernet train.out_dir=runs/super train.steps=200 --resume
            """) + "\n" + "\n".join([OVERRIDES_HELP, sections_help(), ERRORS_HELP]))
    add_config_args(p_supernet)
    p_supernet.add_argument("--resume", action="store_true",
                            help="continue the supernet run in train.out_dir from its newest complete "
                                 "checkpoint (the same as train.resume=true)")
    p_supernet.set_defaults(func=run_supernet, parser=p_supernet)

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
            """) + "\n" + "\n".join([OVERRIDES_HELP, ERRORS_HELP]))
    p_search.add_argument("run_dir", metavar="RUN_DIR",
                          help="the train.out_dir of a `mindpipe supernet` run")
    p_search.add_argument("--step", metavar="N", default=None,
                          help="search the checkpoint of step N (default: the newest)")
    p_search.add_argument("overrides", nargs="*", default=[], metavar="section.key=value",
                          help="search settings; the value is a TOML literal (see below)")
    p_search.set_defaults(func=run_search, parser=p_search)


def run_supernet(args: argparse.Namespace) -> int:
    overrides = [*args.overrides, *(["train.resume=true"] if args.resume else [])]
    from mindpipe_jax.train.agreement import stops_everywhere

    with stops_everywhere("supernet run", overrides):  # a config file on this host only stops all
        cfg = load_config(args.config, overrides)
    from mindpipe_jax.supernet import train_supernet  # runs setup_runtime before any other JAX operation

    result = train_supernet(config=cfg, checkpoint=True)  # prints progress and the search table

    import jax

    from mindpipe_jax.cli import already_complete_line

    if result.already_complete:
        if jax.process_index() == 0:
            step = int(jax.device_get(result.state["step"].addressable_data(0)))
            print(already_complete_line(step, cfg.train.steps, result.out_dir / "checkpoints"), flush=True)
        return 0
    if result.stopped is not None:
        return 0  # stopped by a signal: the loop said where it saved
    best = result.search.top[0] if result.search and result.search.top else None
    if best is not None and jax.process_index() == 0:
        print(f"done: {cfg.train.steps} steps | best subnet {best['subnet']} ({best['arch']}) | "
              f"validation loss {best['loss']:.4f} | {best['params']:,} parameters", flush=True)
    return 0


def run_search(args: argparse.Namespace) -> int:
    step = None if args.step is None else positive_int(args.step, "--step")
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
