"""What each command reads, checked on a built ``Config``: a key set away from its
default that the command never reads is refused in one line instead of being ignored
(``mindpipe train`` and the supernet section, a supernet run and the train keys it does
not use), and a dense run that evaluates needs a validation split. ``check_no_effect``
(``config_load``) refuses what no command reads under the other settings.
"""

from __future__ import annotations

import dataclasses

from mindpipe_jax.config_load import Config
from mindpipe_jax.config_supernet_tuner import SupernetConfig, TunerConfig
from mindpipe_jax.config_values import _shown
from mindpipe_jax.errors import ConfigError


def check_train_keys(cfg: Config, command: str = "mindpipe train") -> None:
    """What ``mindpipe train`` reads no matter the rest, refused when set away from its
    default: the supernet section (``mindpipe supernet`` and ``mindpipe search`` read
    it) and ``train.virtual_shards`` without ``train.deterministic`` (a supernet run
    always uses it, so ``check_no_effect`` cannot refuse it for every command).
    ``command``: the one refusing (``mindpipe plan`` and ``mindpipe tune`` judge a
    ``mindpipe train`` run)."""
    default = Config()
    for f in dataclasses.fields(SupernetConfig):
        value = getattr(cfg.supernet, f.name)
        if value != getattr(default.supernet, f.name):
            raise ConfigError(f"supernet.{f.name}={_shown(value)} has no effect on `{command}`; the "
                              f"supernet section is for `mindpipe supernet` and `mindpipe search`: drop it")
    if cfg.train.virtual_shards != default.train.virtual_shards and not cfg.train.deterministic:
        raise ConfigError(f"train.virtual_shards={cfg.train.virtual_shards} has no effect with "
                          f"train.deterministic=false; set train.deterministic=true, or drop "
                          f"train.virtual_shards")


# train.* keys a supernet run (``mindpipe supernet``, ``train_supernet``) never reads and
# whose absence a user would not see: the memory accumulation saves, the handling of a
# non-finite step. (It never reads train.eval_every, eval_batches or peak_tflops either;
# those pass, as in a config file shared with dense runs, where an ignored evaluation
# period or MFU peak changes nothing and is visible in the output.)
_SUPERNET_UNREAD = {
    "grad_accum": "a supernet step trains supernet.subnets_per_step subnets on train.global_batch rows, "
                  "without accumulation",
    "nonfinite": "a supernet run does not check its losses for non-finite values",
}


# model.* keys the supernet (supernet/model.py's SuperGPT, or a user's) does not build
# with: `mindpipe supernet model.n_experts=4` trained a dense supernet, silently.
_SUPERNET_MODEL_UNREAD = {
    "n_experts": "its FFN choices are dense MLPs (supernet.ops), without experts",
    "collective_matmul": "its tensor-parallel matmuls are XLA's (the GPT's collective matmuls are not built)",
}


def check_validation_split(cfg: Config) -> None:
    """A dense run that evaluates needs the validation split ``data.val_fraction=0``
    leaves out (without this, the data loader's "split 'val' has 0 tokens")."""
    if cfg.data.val_fraction == 0 and cfg.train.eval_every > 0:
        raise ConfigError(f"data.val_fraction=0 leaves no validation data, and train.eval_every="
                          f"{cfg.train.eval_every} evaluates on it: set train.eval_every=0 to train on all "
                          f"the data without evaluating, or data.val_fraction > 0")


def check_search_validation(cfg: Config) -> None:
    """The search (after training, or ``mindpipe search`` of a saved run) ranks subnets by
    their validation loss: ``data.val_fraction=0`` leaves it nothing to rank on."""
    if cfg.data.val_fraction == 0:
        raise ConfigError("data.val_fraction=0 leaves no validation data, and a supernet run ranks its "
                          "subnets by validation loss (the search, the tuner's trials): set "
                          "data.val_fraction > 0")


def check_supernet_keys(cfg: Config) -> None:
    """What a supernet run never reads, refused when set away from its default (the
    counterpart of ``check_train_keys``): they were accepted and ignored. And
    ``data.val_fraction=0``: the search ranks subnets by their validation loss."""
    check_search_validation(cfg)
    default = Config()
    for section, unread in (("train", _SUPERNET_UNREAD), ("model", _SUPERNET_MODEL_UNREAD)):
        for name, why in unread.items():
            value = getattr(getattr(cfg, section), name)
            if value != getattr(getattr(default, section), name):
                raise ConfigError(f"{section}.{name}={_shown(value)} has no effect on a supernet run: {why}; "
                                  f"drop {section}.{name}")
    # The tuner section is the dense run's online tuner (mp.train): `mindpipe supernet
    # tuner.enabled=true` trained the fixed layout without a word.
    for f in dataclasses.fields(TunerConfig):
        value = getattr(cfg.tuner, f.name)
        if value != getattr(default.tuner, f.name):
            raise ConfigError(f"tuner.{f.name}={_shown(value)} has no effect on a supernet run: the tuner "
                              f"section sets the online tuner of `mindpipe train`; a supernet's layout and "
                              f"K are tuned by `mindpipe tune --supernet`: drop tuner.{f.name}")
