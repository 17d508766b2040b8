"""What the training loop needs for a tuned run (``tuner.enabled``): the online tuner
it is handed, the tuner state a resumed run continues with, and the move to the layout
the tuner decides on.

A switch used to move the state first and compile the new layout's step after: a
candidate whose step does not fit in memory (a larger batch, a mesh that replicates
more) then ran out of it mid-run, on CPUs a SIGKILL from the kernel that lost every step
since the last checkpoint. ``Switcher`` compiles first and checks the compiler's count
against what is free (train/memory_fit.py, the same check as the run's first step);
a layout that cannot fit is refused on every process alike (``SwitchRefused``), the run
goes on with its current one, and the tuner drops that candidate.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from mindpipe_jax.config import Config
from mindpipe_jax.data import TokenSplits
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.train.agreement import all_or_none
from mindpipe_jax.train.checkpoint import read_meta
from mindpipe_jax.train.memory_fit import fit_problem, state_bytes
from mindpipe_jax.train.reconfigure import Layout, build_layout, switch


class OnlineTuning(Protocol):
    """What the loop needs from an online tuner (``tuner.epara.EParaTuning``). The loop
    does not import ``tuner/`` (imports point from tuner to train): ``mindpipe_jax.train``
    plugs it in."""

    def resume(self, cfg: Config, saved: dict, model=None) -> tuple[Config, dict]:
        """``cfg`` as the tuned run was when ``saved`` (a checkpoint's tuner state) was
        written, and that state; on another device count both re-planned for it (and for
        ``model``, a user's as ``train`` takes it; None: ``cfg.model``'s)."""

    def initial_gain(self, cfg: Config) -> float:
        """The learning-rate gain a fresh tuned run starts with."""

    def make(self, cfg: Config, mesh, saved: dict, lr_gain: float, step_model, model=None):
        """The tuner object the loop feeds and asks (``tuner.epara.OnlineTuner``), judging
        layouts for ``model`` (a user's; None: ``cfg.model``'s)."""


def saved_tuning(cfg: Config) -> dict:
    """The tuner's state in the checkpoint ``train.resume=true`` continues from, or {}."""
    if not cfg.train.resume:
        return {}
    found = read_meta(Path(cfg.train.out_dir).absolute() / "checkpoints")
    return (found[1].get("tuner") or {}) if found else {}


class SwitchRefused(ConfigError):
    """The tuner's choice cannot run here (its message says why); the run keeps its layout."""


class Switcher:
    """Moves a running job to the tuner's decision (``__call__``). Keeps the layout of
    every candidate the run has trained on (switching back compiles nothing) and takes
    those ``preparer`` compiled ahead. ``factory_for``, ``splits`` and ``val_rows`` as
    for ``reconfigure.switch``."""

    def __init__(self, factory_for: Callable[[Config], Any], splits: TokenSplits, val_rows: int,
                 preparer=None):
        self.factory_for, self.splits, self.val_rows = factory_for, splits, val_rows
        self.preparer = preparer
        self.ran: dict = {}  # candidate -> the layout it ran on, compiled step kept

    def _compiled(self, decision, cfg: Config, state) -> tuple[Layout, float]:
        """The decision's layout, its step compiled (seconds it took; 0 for one kept), or a
        ConfigError where that step cannot fit beside what the run holds."""
        new = self.ran.get(decision.after)
        if new is None and self.preparer is not None:
            new = self.preparer.take(decision.after)
        if new is None:
            new = build_layout(decision.after.apply(cfg), self.factory_for, decision.lr_gain)
        step_fn, compile_s = new.compile()
        problem = fit_problem(getattr(step_fn, "compiled", step_fn), new.mesh, state_resident=False,
                              replacing_bytes=state_bytes(state))
        if problem is not None:
            raise ConfigError(problem)
        return new, compile_s

    def __call__(self, state, layout: Layout, feed, decision, cfg: Config):
        """(state on the new layout, the layout, its feed, seconds its compile took), the
        old feed closed; or ``SwitchRefused`` (on every process alike) with nothing moved
        when the new layout cannot be built here or its step cannot fit in memory.
        ``cfg``: the run's current config."""
        try:
            with all_or_none("tuner's switch"):  # a process short of memory refuses it for all
                new, compile_s = self._compiled(decision, cfg, state)
        except ConfigError as err:
            raise SwitchRefused(str(err)) from None
        self.ran[decision.before] = layout
        moved, new, feed = switch(state, layout, feed, decision.after.apply(cfg), decision.lr_gain,
                                  factory_for=self.factory_for, splits=self.splits, val_rows=self.val_rows,
                                  reuse=new)
        self.ran[decision.after] = new
        return moved, new, feed, compile_s
