"""Orbax checkpoints: train state, data-iterator state and the run's config.

Each checkpoint step holds three items: ``state`` (params, optimizer state, step,
RNG; sharded arrays), ``data`` (the loader's iterator state) and ``meta`` (the
config and the model's parameter fingerprint). Saving is asynchronous, keeps the
last N, and a step is only visible once orbax has committed it, so a run killed
mid-save resumes from the previous complete step. Restoring takes the target
shardings of the *current* mesh, so a 2×4 checkpoint restores onto 8×1.
"""

from __future__ import annotations

from pathlib import Path

import orbax.checkpoint as ocp

from mindpipe_jax.errors import ConfigError


class Checkpointer:
    def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        self._manager = ocp.CheckpointManager(
            self.directory,
            item_names=("state", "data", "meta"),
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, enable_async_checkpointing=async_save, create=True),
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state, data_state: dict, meta: dict, *, force: bool = False) -> bool:
        args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                                  data=ocp.args.JsonSave(data_state),
                                  meta=ocp.args.JsonSave(meta))
        return self._manager.save(step, args=args, force=force)

    def restore(self, step: int, abstract_state):
        """(state on the target shardings, data-iterator state, meta)."""
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state),
            data=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore()))
        return restored["state"], restored["data"], restored["meta"]

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def read_meta(directory: str | Path) -> tuple[int, dict] | None:
    """(latest committed step, its meta) without building a manager that could write."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    # Orbax writes a step under a temporary name and renames it when committed,
    # so only plain numeric directories are complete checkpoints.
    committed = [int(p.name) for p in directory.iterdir()
                 if p.is_dir() and p.name.isdigit() and (p / "meta").exists()]
    if not committed:
        if any(directory.iterdir()):
            raise ConfigError(f"checkpoint dir {str(directory)!r} is not empty but holds no mindpipe "
                              f"checkpoint; choose another train.out_dir or empty it")
        return None
    step = max(committed)
    try:
        meta = ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(directory / str(step) / "meta")
    except Exception as err:  # corrupt or foreign files: a user-facing problem
        raise ConfigError(f"checkpoint {str(directory / str(step))!r} is unreadable "
                          f"({type(err).__name__}); choose another train.out_dir") from None
    return step, meta


def check_same_model(directory, meta: dict, fingerprint: dict) -> None:
    theirs = meta.get("fingerprint")
    if theirs is None:
        raise ConfigError(f"checkpoint dir {str(directory)!r} holds a checkpoint without a model "
                          f"fingerprint (not written by mindpipe); choose another train.out_dir")
    if theirs != fingerprint:
        diff = _first_difference(theirs, fingerprint)
        raise ConfigError(f"checkpoint dir {str(directory)!r} holds a different model ({diff}); "
                          f"use a new train.out_dir or the model config that wrote it")


def _first_difference(theirs: dict, ours: dict) -> str:
    for key in sorted(set(theirs) | set(ours)):
        a, b = theirs.get(key), ours.get(key)
        if a != b:
            return f"{key}: checkpoint {a}, model {b}"
    return "same"
