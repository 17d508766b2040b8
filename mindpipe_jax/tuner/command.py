"""``mindpipe tune``: the offline tuner from the command line.

Kept beside the tuner rather than in ``cli.py``: the options mirror ``tune``'s
arguments, and the command only parses, checks and prints.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import textwrap

from mindpipe_jax.atomic_write import check_output_file, write_output
from mindpipe_jax.config import MESH_AXES, check_train_keys, load_config
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.tuner.space import REMATS, SCHEDULES

DESCRIPTION = textwrap.dedent("""\
    EPara's offline tuner. For the configured model on this machine's devices it
    enumerates every valid layout (mesh axis sizes over --axes, microbatches,
    pipeline schedule and chunks, remat policy, global batch), rejecting invalid
    ones with the reason; predicts each one's step time with the cost model
    (FLOPs read from compiled programs and a measured device rate, an α-β model of
    each axis' collectives, pipeline bubbles from the simulator); compiles the most
    promising ones on abstract shapes to check memory against --budget-mb; runs the
    best --measure of them for a few real steps; and prints them ranked by
    entropyput = samples/s x statistical efficiency of the batch.

    Efficiency needs the gradient noise scale B_noise: with several --batches it
    is estimated by a short probe run on the configured data (--b-noise auto) or
    given (--b-noise 200).

    With --supernet it tunes a supernet job (`mindpipe supernet`, SPara) instead:
    every parallel.subnet x parallel.data split of the devices with each
    supernet.subnets_per_step K (--subnets-per-step), supernet.vmap_width
    (--vmap-widths) and global batch (--batches), rejected with the reason the run
    would give; the --measure most promising are trained for --trial-steps real
    steps from the same start and ranked by progress of the search per second: the
    drop of the search-validation loss (mean validation loss of a fixed panel of
    subnets) over the trial, divided by its training time. One trial per (K, batch):
    other splits at the same K and batch train the same bits, so they are only
    timed and take that trial's loss drop.""")

EPILOG = textwrap.dedent("""\
    examples:
      mindpipe tune model.n_layers=4 --batches 16,32,64
      mindpipe tune --config my.toml --budget-mb 4096 --measure 5 --out landscape.png
      mindpipe tune --axes data,tensor --microbatches 1,2 --b-noise 150 --json tune.json
      mindpipe tune --supernet supernet.ladder_levels=0 --subnets-per-step 2,4,8 --json sn.json

    The chosen configuration's overrides are printed last; pass them to mindpipe train
    (with --supernet: to mindpipe supernet).
    pictures need matplotlib: pip install 'mindpipe-jax[plots]'.""")


def add_parser(sub, add_config_args, formatter) -> argparse.ArgumentParser:
    p = sub.add_parser("tune", formatter_class=formatter, description=DESCRIPTION, epilog=EPILOG,
                       help="EPara: rank layouts and batch sizes by predicted and measured entropyput")
    add_config_args(p)
    p.add_argument("--batches", metavar="LIST", default=None,
                   help="global batch sizes to consider, comma-separated (default: train.global_batch)")
    p.add_argument("--axes", metavar="LIST", default=None,
                   help=f"mesh axes to vary, of {', '.join(MESH_AXES)} (default: data,fsdp,tensor,pipe, "
                        f"and expert for a Mixture-of-Experts model)")
    p.add_argument("--microbatches", metavar="LIST", default="1,2,4",
                   help="microbatch counts (pipeline microbatches or accumulation; default: 1,2,4)")
    p.add_argument("--schedules", metavar="LIST", default="1f1b,interleaved",
                   help=f"pipeline schedules, of {', '.join(SCHEDULES)} (default: 1f1b,interleaved)")
    p.add_argument("--remat", metavar="LIST", default="none,full",
                   help=f"remat policies, of {', '.join(REMATS)} (default: none,full)")
    p.add_argument("--budget-mb", metavar="N", default=None,
                   help="memory budget per device in MB (2^20 bytes); default: what a device "
                        "holds (an accelerator's limit; on CPUs the host's free memory shared by "
                        "its devices)")
    p.add_argument("--max-compile", metavar="N", default="8",
                   help="candidates to compile for the memory check, best predicted first (default: 8)")
    p.add_argument("--measure", metavar="N", default="3",
                   help="feasible candidates to run for real, best predicted first, after one trial of each "
                        "global batch predicted within 2x of the best (default: 3)")
    p.add_argument("--trial-steps", metavar="N", default=None,
                   help="timed steps per trial; the median counts (default: 5; with --supernet: "
                        "steps trained per trial, 40, of which the first 5 are not timed; "
                        "a layout whose K and batch were tried is timed for 10)")
    p.add_argument("--b-noise", metavar="auto|X", default="auto",
                   help="gradient noise scale: 'auto' = a probe run when several batches are "
                        "considered, or a number > 0 (default: auto)")
    p.add_argument("--probe-steps", metavar="N", default="30",
                   help="steps of the noise probe run (default: 30)")
    p.add_argument("--out", metavar="FILE", default=None,
                   help="draw the entropyput landscape to FILE (.png, .svg or .pdf)")
    p.add_argument("--json", metavar="FILE", default=None, help="write every row as JSON to FILE")
    p.add_argument("--cache", metavar="FILE", default=None,
                   help="keep compiled-memory results in FILE (JSON) between runs")
    p.add_argument("--model", metavar="MODULE:NAME", default=None,
                   help="tune your own model (a factory rngs -> nnx.Module, e.g. my_models:make_llama): "
                        "its measured costs, parameters and compiled memory instead of model.*")
    p.add_argument("--supernet", action="store_true",
                   help="tune a supernet job (mindpipe supernet): parallel.subnet x parallel.data, "
                        "supernet.subnets_per_step and vmap_width, ranked by search progress per second")
    p.add_argument("--subnets-per-step", metavar="LIST", default=None,
                   help="with --supernet: K choices (default: K/2, K, 2K of supernet.subnets_per_step)")
    p.add_argument("--vmap-widths", metavar="LIST", default=None,
                   help="with --supernet: supernet.vmap_width choices (default: 1, 2 and the config's)")
    p.set_defaults(func=run)
    return p


def _ints(text: str, option: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise ConfigError(f"{option} must be a comma-separated list of integers >= 1, got {text!r}")
    return values


def _names(text: str, option: str, valid) -> tuple[str, ...]:
    values = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [v for v in values if v not in valid]
    if not values or bad:
        raise ConfigError(f"{option}={text!r}: {', '.join(bad) or 'empty'} not valid; "
                          f"valid: {', '.join(valid)}")
    return values


def _count(text: str, option: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ConfigError(f"{option} must be an integer >= {minimum}, got {text!r}")
    return value


# What `mindpipe tune` chooses for each row (the option that sets its choices): a value
# given in the config would be replaced without a word.
_CHOSEN = {**{f"parallel.{a}": "--axes" for a in MESH_AXES}, "parallel.microbatches": "--microbatches",
           "parallel.schedule": "--schedules", "parallel.virtual_stages": "--schedules",
           "parallel.stage_remat": "--remat", "model.remat": "--remat"}


def _refuse_chosen_keys(cfg, *, batches_given: bool) -> None:
    """A layout key set away from its default is refused: every row sets its own (mesh
    axes not in --axes stay 1), so the value would be silently replaced."""
    from mindpipe_jax.config import Config

    default = Config()
    chosen = dict(_CHOSEN, **({"train.global_batch": "--batches"} if batches_given else {}))
    for key, option in chosen.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value != getattr(getattr(default, section), name):
            hold = " (axes left out of --axes stay 1)" if option == "--axes" else ""
            raise ConfigError(f"{key}={json.dumps(value)} is what mindpipe tune chooses for each row, from "
                              f"{option}{hold}; drop it, and set the choices with {option}")


def _refuse_shared_outputs(outputs: dict[str, str | None]) -> None:
    """Two options naming one file: the second write would replace the first."""
    seen: dict[str, str] = {}
    for option, path in outputs.items():
        if path is None:
            continue
        where = os.path.realpath(path)
        if where in seen:
            raise ConfigError(f"{seen[where]} and {option} name the same file {path!r}; give each its own")
        seen[where] = option


# Dense-only options and their defaults: given with --supernet they are refused, not ignored.
_DENSE_ONLY = {"axes": None, "microbatches": "1,2,4", "schedules": "1f1b,interleaved", "remat": "none,full",
               "budget_mb": None, "max_compile": "8", "b_noise": "auto", "probe_steps": "30", "out": None,
               "cache": None, "model": None}
_SUPERNET_ONLY = ("subnets_per_step", "vmap_widths")


def _refuse_unused_options(args: argparse.Namespace, batches, axes, measure: int) -> None:
    """An option the rest of the command line leaves without effect is refused, not ignored
    (as config keys are: config_load.check_no_effect)."""
    if args.trial_steps is not None and measure == 0:
        raise ConfigError(f"--trial-steps {args.trial_steps} times the measured candidates, and --measure 0 "
                          f"measures none; drop --trial-steps or raise --measure")
    if args.probe_steps != _DENSE_ONLY["probe_steps"] and (args.b_noise != "auto" or len(batches) < 2):
        why = f"--b-noise {args.b_noise} is given" if args.b_noise != "auto" else "one batch is considered"
        raise ConfigError(f"--probe-steps {args.probe_steps} sizes the noise probe, which runs only with "
                          f"--b-noise auto and several --batches, and {why}; drop --probe-steps")
    if args.schedules != _DENSE_ONLY["schedules"] and axes is not None and "pipe" not in axes:
        raise ConfigError(f"--schedules {args.schedules} applies to pipeline layouts, and --axes {args.axes} "
                          f"does not vary pipe; add pipe to --axes or drop --schedules")


def run(args: argparse.Namespace) -> int:
    from mindpipe_jax import viz

    # Every check before JAX starts or anything is written.
    cfg = load_config(args.config, args.overrides)
    from mindpipe_jax.parallel.mesh import refuse_processes

    refuse_processes(cfg.distributed, "mindpipe tune")
    if args.supernet:
        return run_supernet(args, cfg)
    given = [k for k in _SUPERNET_ONLY if getattr(args, k) is not None]
    if given:
        raise ConfigError(f"--{given[0].replace('_', '-')} applies to supernet jobs only; add --supernet")
    check_train_keys(cfg, "mindpipe tune")  # it tunes a `mindpipe train` run
    if args.model:
        from mindpipe_jax.train.step_checks import check_user_model_keys
        check_user_model_keys(cfg.model)
    _refuse_chosen_keys(cfg, batches_given=bool(args.batches))
    batches = _ints(args.batches, "--batches") if args.batches else (cfg.train.global_batch,)
    axes = _names(args.axes, "--axes", MESH_AXES) if args.axes else None
    if axes is not None and "subnet" in axes:  # every layout would be refused for it, one by one
        raise ConfigError(f"--axes {args.axes}: the subnet axis trains a supernet's subnets side by side; "
                          f"tune a supernet job with --supernet (it chooses parallel.subnet)")
    micro = _ints(args.microbatches, "--microbatches")
    schedules = _names(args.schedules, "--schedules", SCHEDULES)
    remats = _names(args.remat, "--remat", REMATS)
    budget = math.inf
    if args.budget_mb is not None:
        try:
            budget = float(args.budget_mb) * 2**20
        except ValueError:
            budget = math.nan
        if not 0 < budget < math.inf:
            raise ConfigError(f"--budget-mb must be a number > 0 (MB per device), got {args.budget_mb!r}")
    max_compile = _count(args.max_compile, "--max-compile", 1)
    measure = _count(args.measure, "--measure", 0)
    trial_steps = _count(args.trial_steps or "5", "--trial-steps", 1)
    probe_steps = _count(args.probe_steps, "--probe-steps", 2)
    b_noise: float | None | str = "auto"
    if args.b_noise != "auto":
        try:
            b_noise = float(args.b_noise)
        except ValueError:
            b_noise = math.nan
        if not 0 < b_noise < math.inf:
            raise ConfigError(f"--b-noise must be 'auto' or a number > 0, got {args.b_noise!r}")
    _refuse_unused_options(args, batches, axes, measure)
    if args.out is not None:
        viz.check_picture_path(args.out)
        viz.require_matplotlib()
    json_out = check_output_file(args.json, "--json") if args.json else None
    if args.cache:
        check_output_file(args.cache, "--cache")
        from mindpipe_jax.tuner.aot import read_cache_file
        read_cache_file(args.cache)
    _refuse_shared_outputs({"--out": args.out, "--json": args.json, "--cache": args.cache})

    from mindpipe_jax.parallel.mesh import setup_runtime

    setup_runtime(cfg.parallel, cfg.distributed)
    model = None
    if args.model:  # imported after setup_runtime: the module may touch JAX at import
        from flax import nnx

        from mindpipe_jax.models.bridge import nnx_model
        from mindpipe_jax.models.loading import load_model_ref
        from mindpipe_jax.train.state import abstract_model
        model = nnx_model(load_model_ref(args.model), cfg.model.seq_len)  # a Linen one: its factory
        if callable(model) and not isinstance(model, nnx.Module):
            abstract_model(model)  # a factory that raises is refused before any measurement
    from mindpipe_jax.tuner.tune import tune

    if b_noise == "auto":
        b_noise = None
        if len(batches) > 1:
            from mindpipe_jax.tuner.probe import estimate_b_noise

            probe = estimate_b_noise(cfg.replace(f"train.global_batch={min(batches)}"), steps=probe_steps,
                                     model=model)
            b_noise = probe.b_noise
            if b_noise is None:
                raise ConfigError(f"the {probe_steps}-step noise probe gave no estimate yet (the gradient "
                                  f"signal is still below its noise); raise --probe-steps or give --b-noise")
            print(f"noise probe: {probe_steps} steps at batch {min(batches)}, loss {probe.losses[0]:.3f} -> "
                  f"{probe.losses[-1]:.3f}, B_noise ~ {b_noise:.1f}", flush=True)
    if args.budget_mb is None:  # what the devices hold: a layout past it would be killed
        import jax

        from mindpipe_jax.train.memory_fit import device_budget_bytes
        budget, source = device_budget_bytes(jax.devices())
        if budget < math.inf:
            print(f"memory budget: {budget / 2**20:,.0f} MiB per device ({source}; --budget-mb sets "
                  f"another)", flush=True)
    result = tune(cfg, budget_bytes=budget, global_batches=batches, axes=axes, microbatches=micro,
                  schedules=schedules, remats=remats, max_compile=max_compile, measure=measure,
                  trial_steps=trial_steps, b_noise=b_noise, cache_path=args.cache, model=model,
                  log=lambda line: print(line, flush=True))
    print(result.table(), flush=True)
    best = result.best
    if best.measured_s is None and (best.feasibility is None or not best.feasibility.fits):
        raise ConfigError(_nothing_fits(result, budget, max_compile))
    predicted = "" if best.measured_s is not None else " (predicted, not measured: --measure 0)"
    print(f"best{predicted}: {best.candidate.label()} -> {' '.join(best.candidate.overrides())}", flush=True)
    ahead = result.unmeasured_ahead()
    if ahead is not None:
        print(f"not measured: {ahead.candidate.label()}, predicted "
              f"{ahead.predicted_entropyput / best.measured_entropyput:.2f}x the entropyput measured for the "
              f"best; raise --measure (now {measure}) to try it", flush=True)
    if json_out is not None:
        write_output(json_out, json.dumps({"b_noise": result.b_noise, "b0": result.b0,
                                           "hardware": result.hardware.note,
                                           "rows": [r.to_dict() for r in result.rows]}, indent=1), "--json")
        print(f"wrote {json_out}", flush=True)
    if args.out is not None:
        print(f"wrote {viz.draw_landscape(result, args.out)}", flush=True)
    return 0


SUPERNET_WARMUP = 5  # untimed steps of a supernet trial: the compile and the first shapes


def run_supernet(args: argparse.Namespace, cfg) -> int:
    """``mindpipe tune --supernet``: the table of SPara candidates and the pick's overrides."""
    for key, default in _DENSE_ONLY.items():
        if getattr(args, key) != default:
            raise ConfigError(f"--{key.replace('_', '-')} applies to dense jobs only, not with --supernet")
    ks = _ints(args.subnets_per_step, "--subnets-per-step") if args.subnets_per_step else None
    widths = _ints(args.vmap_widths, "--vmap-widths") if args.vmap_widths else None
    batches = _ints(args.batches, "--batches") if args.batches else None
    measure = _count(args.measure, "--measure", 1)
    trial_steps = _count(args.trial_steps or "40", "--trial-steps", SUPERNET_WARMUP + 1)
    json_out = check_output_file(args.json, "--json") if args.json else None

    from mindpipe_jax.parallel.mesh import setup_runtime

    setup_runtime(cfg.parallel, cfg.distributed)
    import jax

    from mindpipe_jax.tuner.supernet import make_measure, tune_supernet

    result = tune_supernet(cfg, jax.device_count(), measure=measure, ks=ks, widths=widths, batches=batches,
                           measure_fn=make_measure(cfg, trial_steps=trial_steps, warmup=SUPERNET_WARMUP),
                           log=lambda line: print(line, flush=True))
    print(result.table(), flush=True)
    best = result.best
    print(f"best: {best.candidate.label()} ({best.measurement.progress_per_s:.4f} search-validation loss "
          f"per second) -> {' '.join(best.candidate.overrides())}", flush=True)
    if json_out is not None:
        write_output(json_out, result.to_json(), "--json")
        print(f"wrote {json_out}", flush=True)
    return 0


def _nothing_fits(result, budget: float, max_compile: int) -> str:
    """Why there is no answer: every layout checked was refused (compiled, or refused
    before compiling by its memory floor), and the rest are predictions whose memory
    nobody checked (recommending one printed a layout that did not fit the budget as
    "best")."""
    from mindpipe_jax.tuner.aot import mib

    refused = [r for r in result.rows if r.feasibility is not None and not r.feasibility.fits]
    need = {id(r): r.feasibility.peak_bytes or r.feasibility.floor_bytes for r in refused}
    sized = [r for r in refused if need[id(r)]]
    if sized:
        lightest = min(sized, key=lambda r: need[id(r)])
        least = "at least " if lightest.feasibility.floor_bytes else ""
        why = (f"the lightest, {lightest.candidate.label()}, needs {least}"
               f"{mib(need[id(lightest)])} MiB per device against {mib(budget)} MiB")
    elif refused:
        why = f"{refused[0].candidate.label()}: {refused[0].feasibility.reason}"
    else:
        why = "none compiled"
    unchecked = sum(r.feasibility is None for r in result.rows)
    rest = (f"the rest were not checked: raise --max-compile (now {max_compile}) to check more, or try "
            if unchecked else "try ")
    return (f"tune: none of the {len(refused)} layouts checked could run ({why}); {rest}smaller --batches, "
            f"more --microbatches, or a larger --budget-mb")
