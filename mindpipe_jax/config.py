"""Typed, frozen configuration: TOML files plus ``key=value`` overrides.

A run is described by one ``Config`` made of sections (``model``, ``data``,
``parallel``, ``optim``, ``train``, ``distributed``). Files are TOML with the same
section names; command-line overrides use dotted keys (``parallel.tensor=2``) and
TOML literals for values. ``dacite`` (strict mode) turns the merged dictionary into
the dataclasses, so unknown keys and wrong types are refused in one place; each
section's ``__post_init__`` checks ranges. Every refusal is a one-line
``ConfigError`` naming the key, the value and what is valid. Numbers are checked
as numbers (a boolean is not one; integers within their range, floats finite), and a
key set away from its default that has no effect under the other settings is
refused rather than ignored (``check_no_effect``; a ``data.path`` given without
``data.source`` selects the source instead).

The code lives in sibling modules; this one is the public face and re-exports their
names, so import from ``mindpipe_jax.config``:

- ``config_values``: the checks on one value (numbers, ranges) every section runs;
- ``config_sections``: the ``model``, ``data``, ``parallel``, ``optim``, ``train`` and
  ``distributed`` sections and their constants (``MESH_AXES``, ...);
- ``config_supernet_tuner``: the ``supernet`` (SPara) and ``tuner`` (EPara) sections;
- ``config_load``: ``Config``, the overrides, ``from_dict``, ``load_config`` and the
  check across keys on every build (``check_no_effect``);
- ``config_commands``: what each command reads (``check_train_keys``,
  ``check_supernet_keys``, ``check_validation_split``, ``check_search_validation``);
- ``config_toml``: ``to_toml``, a ``Config`` written as TOML (imports this module).
"""

from mindpipe_jax.config_commands import (
    check_search_validation,
    check_supernet_keys,
    check_train_keys,
    check_validation_split,
)
from mindpipe_jax.config_load import (
    Config,
    check_no_effect,
    config_argument,
    from_dict,
    load_config,
    path_kind,
    refuse_override_as,
)
from mindpipe_jax.config_sections import (
    MAX_SIMULATED_DEVICES,
    MESH_AXES,
    STAGE_REMAT_POLICIES,
    TOKEN_FILE_EXTENSIONS,
    DataConfig,
    DistributedConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
    source_for_path,
)
from mindpipe_jax.config_supernet_tuner import (
    SUPERNET_SEMANTICS,
    SupernetConfig,
    TunerConfig,
    semantics_error,
)

__all__ = [
    "MESH_AXES", "STAGE_REMAT_POLICIES", "MAX_SIMULATED_DEVICES", "TOKEN_FILE_EXTENSIONS",
    "SUPERNET_SEMANTICS", "semantics_error", "source_for_path",
    "ModelConfig", "DataConfig", "ParallelConfig", "OptimConfig", "TrainConfig", "DistributedConfig",
    "SupernetConfig", "TunerConfig", "Config",
    "from_dict", "config_argument", "load_config", "check_no_effect", "check_search_validation",
    "check_supernet_keys", "check_train_keys", "check_validation_split", "path_kind", "refuse_override_as",
]
