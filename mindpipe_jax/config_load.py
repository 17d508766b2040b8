"""The whole ``Config`` and how one is built: a TOML file, ``key=value`` overrides,
``dacite`` (strict) turning the merged dictionary into the sections, and the checks
across keys that run on the result.

A ``data.path`` set without ``data.source`` selects the source; a key set away from
its default that has no effect under the other settings is refused
(``check_no_effect``); what one command does not read, its command refuses
(``config_commands``). Unknown keys and wrong types become one-line
``ConfigError`` messages naming the key, the value and what is valid.

``Config`` lives here rather than with its sections because ``Config.replace`` is a
load (overrides, then the checks) and loading builds a ``Config``: one module keeps
the imports one way.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import stat
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import dacite

from mindpipe_jax.config_sections import (
    DataConfig,
    DistributedConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
    source_for_path,
)
from mindpipe_jax.config_supernet_tuner import SupernetConfig, TunerConfig, semantics_error
from mindpipe_jax.config_values import _shown
from mindpipe_jax.errors import ConfigError


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    supernet: SupernetConfig = field(default_factory=SupernetConfig)
    tuner: TunerConfig = field(default_factory=TunerConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, *overrides: str, **sections: Any) -> Config:
        """A copy with ``key=value`` overrides and/or whole sections replaced.

        The keys set here are checked against the result: one that has no effect
        under the other settings is refused (``check_no_effect``)."""
        merged = self.to_dict()
        explicit: dict[str, int] = {}
        for name, section in sections.items():
            merged[name] = dataclasses.asdict(section) if dataclasses.is_dataclass(section) else section
            explicit.update(_set_keys({name: merged[name]}, layer=1))
        return _build(_apply_overrides(merged, overrides, explicit), explicit)


def _parse_value(raw: str) -> Any:
    """A TOML literal (``2``, ``true``, ``"x"``, ``[1, 2]``), else the bare string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _apply_overrides(tree: dict[str, Any], overrides: typing.Iterable[str],
                     explicit: dict[str, int] | None = None) -> dict[str, Any]:
    """Set each ``key=value`` in ``tree``; record the keys set in ``explicit`` (layer 1)."""
    for item in overrides:
        if not isinstance(item, str):  # Config.replace("a=1", "b=2"), not replace(["a=1"]) or replace(5)
            raise ConfigError(f"override {item!r} must be a string section.key=value, got "
                              f"{type(item).__name__}; pass each override as its own argument")
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            hint = f"; a config file is read with --config {item}" if item.endswith(".toml") else ""
            raise ConfigError(f"override {item!r} must look like section.key=value{hint}")
        parts = key.split(".")
        node = tree
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if not isinstance(child, dict):
                where = ".".join(parts[: depth + 1])
                if depth == 0 and part in _SECTIONS:  # a config file set it to a value
                    raise ConfigError(_not_a_table(part, child))
                if part in node:
                    raise ConfigError(f"config key {where!r} is a value, not a section; set it as "
                                      f"{where}=VALUE")
                raise ConfigError(f"unknown config section {where!r}; valid: {', '.join(sorted(node))}")
            node = child
        if parts[-1] not in node and len(parts) > 1:
            raise ConfigError(f"unknown config key {key!r}; valid keys in {'.'.join(parts[:-1])!r}: "
                              f"{', '.join(sorted(node))}")
        value = _parse_value(raw.strip())
        if isinstance(value, str) and value.startswith("["):
            # Meant as a list but not a TOML array (it would be taken as a string).
            raise ConfigError(f"{key}={value} is not a TOML array (unquoted strings or a missing ']'), "
                              f"e.g. {key}='{_as_array(value)}' on the command line")
        node[parts[-1]] = value
        if explicit is not None:
            explicit.update(_set_keys({key: node[parts[-1]]}, layer=1))
    return tree


def _as_array(text: str) -> str:
    """``text`` (``[a, 2`` or ``[none,full]``) as the TOML array it was meant to be: items
    that are not TOML literals quoted."""
    items = [x.strip() for x in text.strip("[]").split(",") if x.strip()]
    return "[" + ", ".join(x if not isinstance(_parse_value(x), str) else json.dumps(x.strip("'\""))
                           for x in items) + "]"


def _set_keys(update: dict[str, Any], layer: int, prefix: str = "") -> dict[str, int]:
    """The dotted keys a TOML table or an override sets (a table: each key in it), with the
    layer that set them: 0 the config file, 1 the overrides."""
    out: dict[str, int] = {}
    for name, value in update.items():
        key = f"{prefix}{name}"
        if isinstance(value, dict):
            out.update(_set_keys(value, layer, key + "."))
        else:
            out[key] = layer
    return out


def _not_a_table(section: str, value: Any) -> str:
    return (f"config section {section!r} must be a table of keys ([{section}] in a TOML file, "
            f"{section}.KEY=VALUE on the command line), got {section} = {_shown(value)}")


def _build(tree: dict[str, Any], explicit: dict[str, int]) -> Config:
    """The validated ``Config`` of a merged tree whose keys in ``explicit`` the user set."""
    _select_data_source(tree, explicit)
    cfg = from_dict(tree)
    check_no_effect(cfg, explicit)
    return cfg


def _select_data_source(tree: dict[str, Any], explicit: dict[str, int]) -> None:
    """A ``data.path`` set without ``data.source`` selects the source from the path
    (``source_for_path``). A source set as late as the path (both on the command line,
    or both in the file) is the user's choice and stays, except the default "stdlib"
    in a file (``mindpipe config > my.toml`` lists every key); a synthetic source
    stays too (and refuses the path)."""
    data = tree.get("data")
    if not isinstance(data, dict) or "data.path" not in explicit:
        return
    path, source = data.get("path"), data.get("source")
    if not isinstance(path, str) or not path or source == "synthetic":
        return
    chosen = explicit.get("data.source", -1)
    if chosen == 0 and source == DataConfig.source:
        chosen = -1
    if chosen < explicit["data.path"]:
        data["source"] = source_for_path(path)


def _pipe_is_one(cfg: Config) -> str | None:
    return "parallel.pipe=1" if cfg.parallel.pipe == 1 else None


def _chunk_sync_off(cfg: Config) -> str | None:
    par = cfg.parallel
    if par.pipe == 1:
        return "parallel.pipe=1"
    sync = par.grad_sync_mode
    if sync == "chunk":
        return None
    return f"parallel.grad_sync={par.grad_sync!r}, parallel.schedule={par.schedule!r} (one sync at the end)"


# (keys, what makes them inert -> a description or None, how to make them count). Only
# keys that no command reads under those settings; what one command ignores (the
# supernet section in `mindpipe train`) its command refuses.
SPLIT_SCHEDULES = ("zb-h1", "zbv", "dualpipev")  # the schedules with B and W tasks

_NO_EFFECT: tuple[tuple[tuple[str, ...], typing.Callable[[Config], str | None], str], ...] = (
    (("model.top_k", "model.capacity_factor", "model.moe_aux_weight"),
     lambda c: "model.n_experts=0 (the dense GPT)" if c.model.n_experts == 0 else None,
     "set model.n_experts > 0"),
    (("model.collective_matmul",), lambda c: "parallel.tensor=1" if c.parallel.tensor == 1 else None,
     "set parallel.tensor > 1 (or 0, auto)"),
    (("parallel.schedule", "parallel.virtual_stages", "parallel.stage_remat", "parallel.stage_layers",
      "parallel.grad_sync", "parallel.grad_sync_dtype", "parallel.repartition_after", "parallel.fuse_ticks"),
     _pipe_is_one,
     "set parallel.pipe > 1"),
    # A pipeline runs its stages' layers under its own per-stage policy (stand-ins trace
    # the model with its remat switched off): the GPT's block remat never applies there.
    (("model.remat",),
     lambda c: (f"parallel.pipe={c.parallel.pipe} (a pipeline rematerialises its stages by "
                f"parallel.stage_remat)") if c.parallel.pipe > 1 else None,
     "set parallel.stage_remat to that policy instead"),
    (("parallel.split_last",),
     lambda c: _pipe_is_one(c) or (None if c.parallel.schedule in SPLIT_SCHEDULES
                                   else f"parallel.schedule={c.parallel.schedule!r} (no B/W split)"),
     f"it says which backwards a zero-bubble schedule splits: set parallel.pipe > 1 and "
     f"parallel.schedule to one of {', '.join(SPLIT_SCHEDULES)}"),
    (("parallel.fsdp_gather",),
     lambda c: _pipe_is_one(c) or ("parallel.fsdp=1" if c.parallel.fsdp == 1 else None),
     "it says when a pipeline gathers weights sharded over fsdp: set parallel.pipe > 1 and "
     "parallel.fsdp > 1"),
    (("parallel.sync_bucket_mb",), _chunk_sync_off,
     "it sizes the chunk-wise gradient sync of a pipeline: set parallel.grad_sync='chunk'"),
    (tuple(f"tuner.{f.name}" for f in dataclasses.fields(TunerConfig) if f.name != "enabled"),
     lambda c: None if c.tuner.enabled else "tuner.enabled=false", "set tuner.enabled=true"),
)


def check_no_effect(cfg: Config, explicit: typing.Iterable[str]) -> None:
    """Refuse a key in ``explicit`` (dotted names the user set) whose value differs from
    its default but has no effect under the rest of ``cfg``. Values equal to their
    default pass, so a full config file (``mindpipe config > my.toml``) loads."""
    explicit = set(explicit)
    default = Config()
    for keys, inert, fix in _NO_EFFECT:
        for key in keys:
            section, name = key.split(".")
            value = getattr(getattr(cfg, section), name)
            if key not in explicit or value == getattr(getattr(default, section), name):
                continue
            why = inert(cfg)
            if why is not None:
                raise ConfigError(f"{key}={_shown(value)} has no effect with {why}; {fix}, or drop {key}")


def _deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


_DACITE = dacite.Config(strict=True, cast=[tuple])


def _explain_dacite(err: dacite.DaciteError, data: dict[str, Any]) -> str:
    if isinstance(err, dacite.UnexpectedDataError):
        keys = ", ".join(sorted(err.keys))
        section = _find_section_with(data, err.keys)
        where = f"{section}." if section else ""
        valid = _valid_keys(section)
        return f"unknown config key {where}{keys}; valid keys{(' in ' + section) if section else ''}: {valid}"
    if isinstance(err, dacite.WrongTypeError):
        if err.field_path == "supernet.semantics" and semantics_error(err.value):
            return semantics_error(err.value)  # names a renamed value's new name
        if typing.get_origin(err.field_type) is Literal or _is_bool_or_literal(err.field_type):
            valid = ", ".join(str(v).lower() if isinstance(v, bool) else repr(v)
                              for v in _flat_choices(err.field_type))
            return f"config key {err.field_path}={err.value!r} is not valid; valid: {valid}"
        expected = getattr(err.field_type, "__name__", None) or str(err.field_type).replace("typing.", "")
        if typing.get_origin(err.field_type) is tuple:  # tuple[str, ...]: "tuple" says too little
            item = typing.get_args(err.field_type)[0]
            expected = f"a list of {getattr(item, '__name__', None) or str(item).replace('typing.', '')}"
        value = list(err.value) if isinstance(err.value, tuple) else err.value  # as the user wrote it
        return f"config key {err.field_path}={value!r} has the wrong type; expected {expected}"
    if isinstance(err, dacite.MissingValueError):
        return f"config key {err.field_path} is missing"
    return str(err)


def _check_lists(data: dict[str, Any]) -> None:
    """A key that takes only a list, given one value: refused here, since dacite's cast to
    ``tuple`` would split a string into its characters (or fail on a generator's repr)."""
    for name, cls in _SECTIONS.items():
        section = data.get(name)
        if not isinstance(section, dict):
            continue
        for key, tp in typing.get_type_hints(cls).items():
            value = section.get(key)
            if typing.get_origin(tp) is tuple and key in section and not isinstance(value, (list, tuple)):
                if isinstance(value, dict):  # a table: the rules' "name=axes" strings, else no example
                    rows = [json.dumps(f"{k}={v}") for k, v in value.items()] if key == "rules" else []
                    item = ", ".join(rows)
                else:
                    item = json.dumps(value) if isinstance(value, str) else _shown(value)
                example = f", e.g. {name}.{key}='[{item}]' on the command line" if item else ""
                raise ConfigError(f"config key {name}.{key}={_shown(value)} must be a list (a TOML array)"
                                  f"{example}")


def _is_bool_or_literal(tp) -> bool:
    args = typing.get_args(tp)
    return bool(args) and all(a is bool or typing.get_origin(a) is Literal for a in args)


def _flat_choices(tp) -> list:
    """The values a ``Literal`` or ``bool | Literal[...]`` field takes."""
    if typing.get_origin(tp) is Literal:
        return list(typing.get_args(tp))
    return [v for a in typing.get_args(tp) for v in ((True, False) if a is bool else typing.get_args(a))]


def _find_section_with(data: dict[str, Any], keys) -> str:
    for name, cls in _SECTIONS.items():
        section = data.get(name)
        if isinstance(section, dict) and set(keys) <= set(section) and not set(keys) <= _field_names(cls):
            return name
    return ""


def _valid_keys(section: str) -> str:
    cls = _SECTIONS.get(section, Config)
    return ", ".join(sorted(_field_names(cls)))


def _field_names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


_SECTIONS: dict[str, type] = typing.get_type_hints(Config)


def from_dict(data: dict[str, Any]) -> Config:
    """Build a validated ``Config`` from a nested dictionary (strict: no unknown keys)."""
    if not isinstance(data, dict):
        raise ConfigError(f"config must be a table of sections, got {type(data).__name__}")
    for name, value in data.items():
        if name in _SECTIONS and not isinstance(value, dict):
            raise ConfigError(_not_a_table(name, value))
    _check_lists(data)
    try:
        return dacite.from_dict(Config, data, config=_DACITE)
    except dacite.DaciteError as err:
        raise ConfigError(_explain_dacite(err, data)) from None


_OVERRIDE = re.compile(r"^\s*[A-Za-z_]+\.[A-Za-z_]+\s*=")


def refuse_override_as(argument: str, value: Any) -> None:
    """A ``section.key=value`` string passed as ``mindpipe_jax.train``'s ``config`` or
    ``data`` (positional arguments one place off) is refused saying where it goes, not
    read as a file that does not exist."""
    if isinstance(value, str) and _OVERRIDE.match(value):
        raise ConfigError(f"{argument}={value!r} is an override, and overrides come after the model, "
                          f"data and config: train(model, data, config, {value!r}, ...)")


def config_argument(config: Any) -> Config:
    """The ``config`` argument of ``mindpipe_jax.train`` / ``train_supernet``: a Config, or
    None for the defaults; anything else is a one-line ConfigError saying how to make
    one (a file's path raised ``str.replace``'s TypeError)."""
    if config is None:
        return Config()
    if isinstance(config, Config):
        return config
    refuse_override_as("config", config)
    if isinstance(config, (str, Path)):
        how = f"mindpipe_jax.load_config({str(config)!r}) reads that file"
    elif isinstance(config, dict):
        how = "mindpipe_jax.config.from_dict(...) builds one from a dict of sections"
    else:
        how = "mindpipe_jax.Config().replace(\"section.key=value\", ...) builds one"
    raise ConfigError(f"config must be a mindpipe_jax.Config or None, got {type(config).__name__}; {how}")


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Read a TOML file (optional), apply ``key=value`` overrides, validate."""
    if isinstance(overrides, str):  # would be read a character at a time
        raise ConfigError(f"load_config overrides={overrides!r} is one string; give a list: "
                          f"load_config(path, [{overrides!r}])")
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"load_config path must be a TOML file's path or None, got {type(path).__name__}")
    tree: dict[str, Any] = Config().to_dict()
    explicit: dict[str, int] = {}
    if path is not None:
        path = Path(path)
        shown = str(path)
        if not path.is_file():
            kind = path_kind(path)
            raise ConfigError(f"config file {shown!r} does not exist" if kind is None else
                              f"config file {shown!r} is {kind}, not a TOML file")
        try:
            # TOML is UTF-8 whatever the locale; a byte-order mark (Notepad) is not a key.
            update = tomllib.loads(path.read_text(encoding="utf-8-sig"))
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"config file {shown!r} is not valid TOML: {err}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"config file {shown!r} is not UTF-8 text") from None
        except OSError as err:
            raise ConfigError(f"config file {shown!r} cannot be read: {err.strerror or err}") from None
        explicit.update(_set_keys(update, layer=0))
        tree = _deep_merge(tree, update)
    return _build(_apply_overrides(tree, overrides, explicit), explicit)


def path_kind(path: str | Path) -> str | None:
    """What is at ``path`` in words ("a directory", "a FIFO (named pipe)", ...); None if nothing."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as err:  # a parent that is a file, a loop of links, no permission
        return f"not reachable ({err.strerror or err})"
    kinds = ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"),
             (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")
