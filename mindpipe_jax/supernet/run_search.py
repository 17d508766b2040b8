"""The search of a supernet run: ``search_subnets`` (the evolutionary search on the
validation split, run at the end of training) and ``search_checkpoint`` (``mindpipe
search``: a saved run's config read back, its checkpoint restored onto the current
mesh bit for bit, and the same search run there). Re-exported by ``trainer.py``.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import os
from pathlib import Path

import jax
import numpy as np

from mindpipe_jax.config import Config, check_search_validation, from_dict
from mindpipe_jax.data import TokenSplits, eval_batches, resolve_data
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.parallel.mesh import make_mesh
from mindpipe_jax.supernet.plan import check_axes, check_shards, data_devices, mesh_label
from mindpipe_jax.supernet.run_setup import (
    KIND,
    _abstract_state,
    fingerprint,
    supernet_factory,
)
from mindpipe_jax.supernet.search import SearchResult, check_budget, evolutionary_search, make_evaluator
from mindpipe_jax.supernet.spara import supernet_spec
from mindpipe_jax.train.agreement import agree_on_checkpoint, all_or_none, start_together, stops_everywhere
from mindpipe_jax.train.checkpoint import committed_steps, read_meta, restore_verified


def search_subnets(spec, params, splits: TokenSplits, cfg: Config, mesh,
                   say=lambda line: None) -> SearchResult:
    """Evolutionary search of ``cfg.supernet`` on the validation split, scores bitwise
    stable. ``say``: where a note goes (fewer validation batches than asked)."""
    sn, tr = cfg.supernet, cfg.train
    val = eval_batches(splits.val, seq_len=cfg.model.seq_len, batch_size=tr.global_batch,
                       num_batches=sn.search_eval_batches)
    if len(val) < sn.search_eval_batches:  # not silently fewer
        say(f"search scores on {len(val)} validation batches, all the validation split holds "
            f"(supernet.search_eval_batches={sn.search_eval_batches})")
    batches = {k: np.stack([b[k] for b in val]) for k in ("inputs", "targets")}
    evaluate = make_evaluator(spec, mesh, vmap_width=sn.vmap_width, virtual_shards=tr.virtual_shards,
                              pad_to=sn.search_population)
    module = spec.module
    return evolutionary_search(
        spec.space, lambda subs: evaluate(params, subs, batches), module.active_params,
        population=sn.search_population, generations=sn.search_generations, top_k=sn.search_top_k,
        max_cost=sn.search_max_params, seed=tr.seed)


# --- searching a saved run ------------------------------------------------------------------------


# What the supernet is: fixed by a checkpoint (the rest of a config only says how to
# train or evaluate it, and may differ in a search).
_ARCH_KEYS = ("supernet.ops", "supernet.ffn_ratios", "supernet.heads", "supernet.min_depth")
# What a search reads besides the supernet: how it searches, on which devices and data.
# Any other key (train.steps, optim.*, supernet.semantics ...) only says how to train.
_SEARCH_KEYS = ("supernet.search_", "supernet.vmap_width", "train.seed", "train.global_batch",
                "train.virtual_shards", "data.", "parallel.", "distributed.")
_CAN_CHANGE = ("a search can change supernet.search_*, supernet.vmap_width, train.seed, train.global_batch, "
               "train.virtual_shards, data.*, parallel.* and distributed.*")


def _run_config(run_dir: Path, overrides) -> Config:
    """The run's config (``config.json``, plain JSON: read before JAX starts) with the
    search's overrides; refuses overrides that would change the supernet."""
    path = run_dir / "config.json"
    if not path.is_file():
        raise ConfigError(f"{str(run_dir)!r} has no config.json: not the train.out_dir of a "
                          f"`mindpipe supernet` run")
    try:
        saved = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{str(path)!r} is not valid JSON ({type(err).__name__})") from None
    if not isinstance(saved, dict):
        raise ConfigError(f"{str(path)!r} does not hold a config table")
    tree = Config().to_dict()
    for section, values in saved.items():
        if isinstance(values, dict) and isinstance(tree.get(section), dict):
            tree[section].update(values)
        else:
            tree[section] = values  # from_dict names what is wrong
    base = from_dict(tree)
    if base.parallel.pipe > 1 and not any(o.startswith("parallel.pipe=") for o in overrides):
        # The search evaluates subnets whole: a pipelined run's stages become data devices.
        data = base.parallel.data * base.parallel.pipe if base.parallel.data > 0 else -1
        base = base.replace("parallel.pipe=1", f"parallel.data={data}")
    cfg = base.replace(*overrides) if overrides else base
    fixed = [f"model.{k}" for k in dataclasses.asdict(cfg.model)] + list(_ARCH_KEYS)
    for key in fixed:
        section, name = key.split(".")
        ours, theirs = getattr(getattr(cfg, section), name), getattr(getattr(base, section), name)
        if ours != theirs:
            raise ConfigError(f"{key}={_show(ours)}: the supernet in {str(run_dir)!r} was trained with "
                              f"{key}={_show(theirs)}; {_CAN_CHANGE}, not the supernet")
    mine, saved_tree = cfg.to_dict(), base.to_dict()
    for section, values in mine.items():
        for name, value in values.items():
            key = f"{section}.{name}"
            if not key.startswith(_SEARCH_KEYS) and value != saved_tree[section][name]:
                raise ConfigError(f"{key}={_show(value)} has no effect on a search of a saved supernet (it "
                                  f"trains nothing; the run had {key}={_show(saved_tree[section][name])}); "
                                  f"{_CAN_CHANGE}: drop {key}")
    check_search_validation(cfg)
    return cfg


def _show(value) -> str:
    return json.dumps(list(value) if isinstance(value, tuple) else value)


def _saved_supernet(run_dir: Path, step: int | None, cfg: Config, model, data):
    """The checkpoint directory and step to search, the mesh, the supernet (spec and
    ``create``) matched against the checkpoint's fingerprint, and the data splits;
    one-line ConfigErrors for what does not match."""
    ckpt_dir = run_dir / "checkpoints"
    found = read_meta(ckpt_dir)
    if found is None:
        raise ConfigError(f"{str(run_dir)!r} holds no committed checkpoint (checkpoints/<step>/); "
                          f"train with `mindpipe supernet train.out_dir=...` first")
    newest, meta = found
    if meta.get("kind") != KIND:
        raise ConfigError(f"{str(run_dir)!r} holds the checkpoint of a dense model (`mindpipe train`), "
                          f"not of a supernet; search a run of `mindpipe supernet`")
    steps = committed_steps(ckpt_dir)
    if step is None:
        step = newest
    elif step not in steps:
        raise ConfigError(f"--step {step}: {str(ckpt_dir)!r} has committed checkpoints at steps "
                          f"{', '.join(map(str, steps))}")
    mesh = make_mesh(cfg.parallel)
    check_axes(mesh, "the search")
    check_shards(cfg.train.virtual_shards, data_devices(mesh), cfg.train.global_batch, " (validation rows)")
    factory = model if model is not None else supernet_factory(cfg)
    spec, create = supernet_spec(factory, cfg.train.seed)
    if meta.get("fingerprint") != fingerprint(spec):
        ours, theirs = type(spec.module).__name__, meta.get("model")
        if model is None and theirs not in (None, ours):
            # `mindpipe search` rebuilds only the reference supernet; a user's needs its factory.
            raise ConfigError(f"the checkpoint in {str(run_dir)!r} is of the supernet {theirs}, not the "
                              f"{ours} its config describes: search it from Python with "
                              f"mindpipe_jax.search_checkpoint({str(run_dir)!r}, model=<{theirs}'s factory>)")
        raise ConfigError(f"the checkpoint in {str(run_dir)!r} is of another supernet than "
                          f"{ours} of its config (parameter shapes or genes differ); "
                          f"pass the model that wrote it")
    return ckpt_dir, step, mesh, spec, create, resolve_data(data, cfg, saved_config=True)


def search_checkpoint(run_dir, *overrides: str, step: int | None = None, model=None, data=None,
                      log=None) -> tuple[SearchResult, Config, int]:
    """The evolutionary search on a saved supernet: ``(result, config, step)``.

    ``run_dir``: the ``train.out_dir`` of ``train_supernet(..., checkpoint=True)`` /
    ``mindpipe supernet``; ``step``: which committed checkpoint (default: the newest).
    ``overrides`` change how the search runs (``supernet.search_*``, ``parallel.*``, the
    validation data, ...), never the supernet itself. ``model``: the factory of a
    custom supernet (default: the reference ``SuperGPT`` of the saved config); ``data``
    as in ``train_supernet`` (default: the saved ``data`` section). ConfigError, one
    line, for a missing or foreign directory, a dense run, a checkpoint of another
    supernet, a damaged checkpoint or a bad override.
    """
    if not isinstance(run_dir, (str, os.PathLike)):
        raise ConfigError(f"run_dir must be the path of a `mindpipe supernet` run directory, got "
                          f"{type(run_dir).__name__}")
    if step is not None and (isinstance(step, bool) or not isinstance(step, numbers.Integral)):
        # 2.0 equals step 2 and was looked for in a directory named "2.0" ("damaged").
        raise ConfigError(f"step={step!r} must be a checkpoint's step number (an int) or None (the newest)")
    if log is not None and not callable(log):
        raise ConfigError(f"log={log!r} must be a callable taking one line (e.g. print) or None")
    run_dir = Path(run_dir).expanduser().absolute()
    with stops_everywhere("search", overrides):  # a run directory on this host only stops all
        if not run_dir.is_dir():
            raise ConfigError(f"run directory {str(run_dir)!r} does not exist" if not run_dir.exists()
                              else f"{str(run_dir)!r} is not a directory")
        cfg = _run_config(run_dir, overrides)
    if cfg.parallel.tensor == 0:
        cfg = cfg.replace("parallel.tensor=1")
    start_together(cfg, "search")
    # Reading a checkpoint is collective (orbax): every process must see the same ones.
    agree_on_checkpoint(run_dir / "checkpoints", "search")
    # What else one process may see alone (a data path): checked on every process, then
    # all of them stop if any failed (a collective follows: the restore).
    with all_or_none("search"):
        ckpt_dir, step, mesh, spec, create, splits = _saved_supernet(run_dir, step, cfg, model, data)
        check_budget(spec.space, spec.module.active_params, cfg.supernet.search_max_params)
    target = _abstract_state(spec, create, mesh)
    earlier = "search an earlier step (--step N, search_checkpoint(step=N))"
    state, _, saved_meta = restore_verified(ckpt_dir, step, target, advice=earlier)
    say = log if (log is not None and jax.process_index() == 0) else (lambda *_: None)
    sn = cfg.supernet
    say(f"search of {run_dir} at step {step}: {spec.space.num_architectures:,} architectures | population "
        f"{sn.search_population}, {sn.search_generations} generation{'s' * (sn.search_generations != 1)}, "
        f"top {sn.search_top_k}"
        + (f", at most {sn.search_max_params:,} parameters" if sn.search_max_params else "")
        + f" | mesh {mesh_label(mesh)}")
    return search_subnets(spec, state["params"], splits, cfg, mesh, say), cfg, step
