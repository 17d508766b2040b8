"""Orbax checkpoints: train state, data-iterator state and the run's config.

Each checkpoint step holds three items: ``state`` (params, optimizer state, step,
RNG; sharded arrays), ``data`` (the loader's iterator state) and ``meta`` (the
config, the model's parameter fingerprint, the count of skipped non-finite
steps, a checksum of every state array). Saving is asynchronous and keeps the
last N.

Orbax notices a truncated or missing array file but not changed bytes inside
one (those restore silently as other numbers), hence the checksums: the sum of
each array's bits as uint32, wrapping. Integer addition is exact, so the sum is
the same whatever the mesh the state is saved from or restored onto; one
changed bit changes it.

A step counts only once orbax has committed it: orbax writes a step under a
temporary name, puts ``commit_success.txt`` in it as its last act and then
renames it. A run killed mid-save leaves a temporary directory (or, on object
stores, a step directory without the marker); it is never restored, the run
resumes from the newest committed step, and the leftovers are removed when the
resumed run starts writing. Restoring takes the target shardings of the
*current* mesh, so a 2×4 checkpoint restores onto 8×1. Multi-process runs save
and restore collectively: every process calls the same methods and orbax
writes each shard once.
"""

from __future__ import annotations

import errno
import json
import logging
import re
import shutil
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import numpy as np
import orbax.checkpoint as ocp

from mindpipe_jax.errors import ConfigError, DiskFullError
from mindpipe_jax.train import abandoned_io
from mindpipe_jax.train.agreement import all_or_none
from mindpipe_jax.train.checksums import dtype_change, state_checksums, verify_checksums  # re-exported

if TYPE_CHECKING:
    from mindpipe_jax.config import Config

# orbax's commit marker (orbax.checkpoint._src.path.atomicity_types.COMMIT_SUCCESS_FILE).
COMMIT_MARKER = "commit_success.txt"
_TMP_SUFFIX = ".orbax-checkpoint-tmp"

# Orbax's default "replica-parallel" save splits every replicated shard among its
# replicas, each writing a slice; slicing compiles one small program per array,
# which made the first save of a small model cost seconds of compilation. Only
# arrays whose slices are at least this large are split (where parallel writes
# pay); smaller ones are written whole by one replica. The bytes on disk are the
# same format either way. (No array-metadata store: it only records typed PRNG
# keys, and the state keeps its key as raw uint32 data.)
_MIN_SLICE_BYTES = 4 << 20
_STATE_HANDLERS = ocp.type_handlers.create_type_handler_registry(
    (jax.Array, ocp.type_handlers.ArrayHandler(
        use_replica_parallel=True, min_slice_bytes_for_replica_parallel=_MIN_SLICE_BYTES)),
    (np.ndarray, ocp.type_handlers.NumpyHandler()),
    (np.number, ocp.type_handlers.ScalarHandler()),
    (int, ocp.type_handlers.ScalarHandler()),
    (float, ocp.type_handlers.ScalarHandler()),
)


def _disk_full(err: BaseException | None) -> bool:
    """Whether ``err`` (or what caused it) says the disk is full: an ``OSError`` ENOSPC from
    Python, or the text of tensorstore's (``RESOURCE_EXHAUSTED ... No space left on device``)."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(err)
        if "No space left on device" in text or "os_error_code='28'" in text or "Disk quota exceeded" in text:
            return True
        err = err.__cause__ or err.__context__
    return False


class _QuietDiskFull(logging.Filter):
    """Orbax logs a failed background save with several tracebacks before raising the
    error in the main thread; for a full disk the Checkpointer says it in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            if _disk_full(record.exc_info[1]):
                return False
            text += "".join(traceback.format_exception(*record.exc_info))
        return not ("No space left on device" in text or "os_error_code='28'" in text)


_QUIET = _QuietDiskFull()
logging.getLogger("absl").addFilter(_QUIET)


def _tree_bytes(directory: Path) -> int:
    """What the files under ``directory`` occupy on the disk (whole blocks)."""
    sizes = (p.stat() for p in directory.rglob("*") if p.is_file())
    return sum(max(st.st_size, st.st_blocks * 512) for st in sizes)


def _state_bytes(state) -> int:
    """The bytes of ``state``'s arrays (one copy of each, however they are sharded)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state) if hasattr(x, "dtype"))


def _megabytes(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


class Checkpointer:
    """One orbax ``CheckpointManager`` over ``directory`` (created if missing); it
    removes orbax's temporary directories left by an interrupted save.

    A full disk ends the run with ``DiskFullError`` (one line): before a save when the
    free space is less than the newest committed step occupies, or when a save fails
    with ENOSPC; the half-written step is removed and the committed ones are untouched.
    """

    def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        self._saving: int | None = None  # the step of the save in flight
        self._saving_bytes = 0  # its arrays' bytes: what a failed first save needed at least
        abandoned_io.drop_their_reports()  # a save failing on a full disk abandons its other writes
        self._failed = False
        self._manager = ocp.CheckpointManager(
            self.directory,
            item_handlers={"state": ocp.PyTreeCheckpointHandler(type_handler_registry=_STATE_HANDLERS),
                           "data": ocp.JsonCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()},
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, enable_async_checkpointing=async_save, create=True,
                cleanup_tmp_directories=True),
        )

    def latest_step(self) -> int | None:
        """The newest committed step (see ``committed_steps``)."""
        steps = committed_steps(self.directory)
        return steps[-1] if steps else None

    def save(self, step: int, state, data_state: dict, meta: dict, *, force: bool = False) -> bool:
        self.wait()  # a failed earlier save is reported before anything else is written
        # Every process refuses alike: one that went on into orbax's save alone waited at
        # its barrier for the others (seen: two processes whose first checkpoint did not
        # fit, both hung past SIGTERM; orbax's barrier gives up after 20 minutes).
        with all_or_none("checkpoint save"):
            self._refuse_without_room(step, state)
        meta = {**meta, "checksums": state_checksums(state)}
        args = ocp.args.Composite(state=ocp.args.PyTreeSave(state),
                                  data=ocp.args.JsonSave(data_state),
                                  meta=ocp.args.JsonSave(meta))
        self._saving = step
        self._saving_bytes = _state_bytes(state)
        try:
            return self._manager.save(step, args=args, force=force)
        except Exception as err:
            self._raise_if_disk_full(err)
            raise

    def restore(self, step: int, abstract_state):
        """(state on the target shardings, data-iterator state, meta)."""
        return restore(self.directory, step, abstract_state)

    def _refuse_without_room(self, step: int, state) -> None:
        """``DiskFullError`` before writing where the disk has less free than the save
        needs: the newest committed step's size on the disk, or for a first save the
        state's bytes (what it occupies uncompressed: orbax may compress a little)."""
        last = self.latest_step()
        needed = _tree_bytes(self.directory / str(last)) if last is not None else _state_bytes(state)
        free = shutil.disk_usage(self.directory).free
        if free < needed:
            basis = f"step {last}'s size" if last is not None else "the state uncompressed"
            raise self._full_error(step, needed, free, removed=False, basis=basis)

    def check(self) -> None:
        """Raise now (``DiskFullError`` for a full disk) if the save going on in the
        background has failed; never waits for it. Without this a failed save surfaced
        at the next one (``train.checkpoint_every`` steps later, all of them lost with it).
        One process only: with several, a failure one of them saw first would stop it
        alone and leave the others in their next collective; they meet at the next save."""
        if self._saving is not None and not self._failed and jax.process_count() == 1 \
                and self._failed_in_background():
            self.wait()  # the save has ended: this returns at once, raising its error

    def _failed_in_background(self) -> bool:
        """Whether orbax's thread that finishes a save has ended with an error. Orbax keeps
        it to raise from ``wait_until_finished`` and has no public way to ask without
        waiting; where its internals differ, False (the next save reports it)."""
        try:
            return bool(self._manager._finalize_thread.map(
                lambda t: t is not None and not t.is_alive() and t.exception is not None))
        except Exception:  # noqa: BLE001 -- another orbax version: leave it to the next save
            return False

    def wait(self) -> None:
        try:
            self._manager.wait_until_finished()
        except Exception as err:
            self._raise_if_disk_full(err)
            raise

    def close(self) -> None:
        if self._failed:  # the error was raised already; orbax's threads are done
            try:
                self._manager.close()
            except Exception:
                pass
            return
        self.wait()
        self._manager.close()

    def _raise_if_disk_full(self, err: Exception) -> None:
        if not _disk_full(err):
            return
        self._failed = True
        abandoned_io.settle()  # the save's other writes end into orbax's closed loop
        free = shutil.disk_usage(self.directory).free  # as the save found it
        if jax.process_index() == 0:
            remove_incomplete(self.directory)
        last = self.latest_step()
        needed = _tree_bytes(self.directory / str(last)) if last is not None else self._saving_bytes
        raise self._full_error(self._saving, needed, free, removed=True) from None

    def _full_error(self, step, needed: int, free: int, *, removed: bool, basis: str = "") -> DiskFullError:
        last = self.latest_step()
        kept = (f"the last committed checkpoint (step {last}) is untouched" if last is not None
                else "no checkpoint was committed")
        gone = "its half-written files were removed and " if removed else "nothing was written and "
        basis = f", {basis}" if basis else ""
        need = f"a checkpoint needs about {needed} bytes ({_megabytes(needed)}{basis})" if needed else \
            "a checkpoint needs more"
        self._failed = self._failed or removed
        return DiskFullError(
            f"no space left on the device of {str(self.directory)!r} to save step {step}: {need}, "
            f"{free} bytes are free; {gone}{kept}; free some space and continue with "
            f"train.resume=true",
            directory=self.directory, needed=needed, free=free,
            last_checkpoint=None if last is None else self.directory / str(last))


def restore(directory: str | Path, step: int, abstract_state):
    """(state on the target shardings, data-iterator state, meta) of one step.

    Reads only: no manager, so nothing in ``directory`` is created or cleaned up.
    """
    restored = ocp.Checkpointer(ocp.CompositeCheckpointHandler()).restore(
        Path(directory).absolute() / str(step),
        args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                data=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore()))
    return restored["state"], restored["data"], restored["meta"]


def committed_steps(directory: str | Path) -> list[int]:
    """Steps under ``directory`` that orbax finished writing (commit marker present), ascending."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir()
                  if p.name.isdigit() and (p / COMMIT_MARKER).is_file())


def incomplete_steps(directory: str | Path) -> list[Path]:
    """What interrupted saves left: orbax temporary directories and step
    directories without the commit marker."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.is_dir() and (
        _TMP_SUFFIX in p.name or (p.name.isdigit() and not (p / COMMIT_MARKER).exists())))


def remove_incomplete(directory: str | Path) -> list[str]:
    """Delete the leftovers of interrupted saves; returns their names.

    Orbax's own ``cleanup_tmp_directories`` handles temporary directories; a step
    directory without the marker (an object store's half-written step) would block
    saving that step again, so it goes too. Call on one process only.
    """
    removed = []
    for path in incomplete_steps(directory):
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path.name)
    return removed


def read_meta(directory: str | Path) -> tuple[int, dict] | None:
    """(newest committed step, its meta) without building a manager that could write."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    # "0041" would be read as step 41, whose directory "41" does not exist: name the real one.
    padded = sorted(p.name for p in directory.iterdir() if p.name.isdigit() and p.name != str(int(p.name)))
    if padded:
        raise ConfigError(f"checkpoint dir {str(directory)!r} holds {padded[0]!r}, a step directory "
                          f"mindpipe did not write (it names steps without leading zeros): rename "
                          f"{str(directory / padded[0])!r} to {str(int(padded[0]))!r} if it is that "
                          f"step, or move it away")
    steps = committed_steps(directory)
    if not steps:
        leftovers = set(incomplete_steps(directory))
        if any(p not in leftovers for p in directory.iterdir()):
            raise ConfigError(f"checkpoint dir {str(directory)!r} is not empty but holds no mindpipe "
                              f"checkpoint; choose another train.out_dir or empty it")
        return None
    step = steps[-1]
    try:
        meta = ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(directory / str(step) / "meta")
    except Exception as err:  # corrupt or foreign files: a user-facing problem
        raise ConfigError(f"checkpoint {str(directory / str(step))!r} is unreadable "
                          f"({type(err).__name__}); delete that step directory to resume from an "
                          f"earlier checkpoint, or choose another train.out_dir") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"checkpoint {str(directory / str(step))!r} has no mindpipe metadata; "
                          f"choose another train.out_dir")
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


def _first_difference(theirs: dict, ours: dict, prefix: str = "") -> str:
    """The first differing entry; nested tables (a supernet's params and genes) are
    entered, so the line names one leaf rather than printing a whole table."""
    for key in sorted(set(theirs) | set(ours)):
        a, b = theirs.get(key), ours.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            if a != b:
                return _first_difference(a, b, f"{prefix}{key}.")
        elif a != b:  # one side without the entry said so, not as "None" (n_experts added)
            a, b = ("has none" if x is None else x for x in (a, b))
            return f"{prefix}{key}: checkpoint {a}, model {b}"
    return "same"


def prepare_out_dir(cfg: Config, fingerprint: dict, kind: str | None = None
                    ) -> tuple[Path, Path, int | None, dict]:
    """(out_dir, checkpoint dir, step to resume from or None, its meta), for a run about to
    write into ``cfg.train.out_dir``; refuses (``ConfigError``, before anything is
    written) a file, a foreign directory, another model, an existing run without
    ``train.resume``, nothing to resume with ``train.resume=true``, and a finished run
    (with ``train.resume="auto"`` a finished run is returned: its step is at least
    ``train.steps``, and the caller reports it complete). ``kind``: the meta's ``kind`` of
    the caller's checkpoints (None: a dense run's; ``"supernet"``: a supernet's)."""
    out_dir = Path(cfg.train.out_dir).absolute()
    ckpt_dir = out_dir / "checkpoints"
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"train.out_dir {str(out_dir)!r} exists and is not a directory")
    found = read_meta(ckpt_dir)
    resume = cfg.train.resume  # True, False or "auto" (resume if there is a checkpoint)
    if found is None:
        if resume is True:
            partial = incomplete_steps(ckpt_dir)
            why = (f"only an incomplete checkpoint ({partial[0].name}, its save was interrupted)"
                   if partial else "no checkpoint")
            raise ConfigError(f"train.resume=true but train.out_dir {str(out_dir)!r} holds {why}; "
                              f"nothing to resume: drop train.resume (or use train.resume=\"auto\") "
                              f"to start a new run there")
        return out_dir, ckpt_dir, None, {}
    step, meta = found
    if kind is None and meta.get("kind") is not None:  # a supernet run's (its trainer names ours)
        raise ConfigError(f"train.out_dir {str(out_dir)!r} holds the checkpoint of a supernet (`mindpipe "
                          f"supernet`, step {step}), not of a dense model; continue it with `mindpipe "
                          f"supernet --resume`, or choose another train.out_dir")
    check_same_model(ckpt_dir, meta, fingerprint)
    if not resume:
        raise ConfigError(f"train.out_dir {str(out_dir)!r} already holds checkpoints up to step {step}; "
                          f"set train.resume=true to continue it or choose a new train.out_dir")
    if step >= cfg.train.steps and resume == "auto":
        return out_dir, ckpt_dir, step, meta  # already complete: the caller trains nothing
    if step >= cfg.train.steps:
        raise ConfigError(f"train.resume={str(resume).lower()}: the newest checkpoint in {str(ckpt_dir)!r} "
                          f"is at step {step}, and train.steps={cfg.train.steps}; nothing to resume: set "
                          f"train.steps above {step} to train further")
    return out_dir, ckpt_dir, step, meta


# Keys whose change on a resume is the point of resuming or says nothing about the run.
# What a resume may change without it being news: how long to train, and what the
# trained bits do not depend on (where the run lives, what it prints and keeps).
_EXPECTED_CHANGES = ("train.resume", "train.steps", "train.out_dir", "train.progress", "train.tensorboard",
                     "train.log_every", "train.eval_every", "train.eval_batches", "train.checkpoint_every",
                     "train.keep_checkpoints")


def config_changes(saved: dict, current: dict) -> list[str]:
    """``key old -> new`` for each config value of ``current`` (``Config.to_dict()``) that
    differs from the checkpoint's ``saved`` one, save those a resume is expected to
    change (``_EXPECTED_CHANGES``, ``distributed.*``)."""
    changes = []
    for section in sorted(set(saved) | set(current)):
        old, new = saved.get(section), current.get(section)
        if section == "distributed" or not isinstance(old, dict) or not isinstance(new, dict):
            continue
        for key in sorted(set(old) | set(new)):
            name = f"{section}.{key}"
            a, b = old.get(key), new.get(key)
            if name in _EXPECTED_CHANGES or a == b or (isinstance(a, list) and tuple(a) == b):
                continue
            changes.append(f"{name} {json.dumps(a)} -> {json.dumps(list(b) if isinstance(b, tuple) else b)}")
    return changes


_LOCAL_FILE = re.compile(r' (at|of) local file "[^"]*"')
_RESUME_ADVICE = ("delete that step directory to resume from an earlier checkpoint, "
                  "or choose a new train.out_dir")


def restore_verified(ckpt_dir: Path, step: int, abstract_state, advice: str = _RESUME_ADVICE):
    """Restore a committed step, reading only; a damaged one is a user-facing error
    ending in ``advice`` (what the caller can do instead)."""
    where = str(ckpt_dir / str(step))
    abandoned_io.drop_their_reports()
    try:
        state, data_state, meta = restore(ckpt_dir, step, abstract_state)
    except Exception as err:  # truncated or missing array files, garbled metadata
        while err.__cause__ is not None:  # orbax wraps TensorStore's error, which names the array
            err = err.__cause__
        detail = (str(err).strip().splitlines() or [""])[0]
        detail = detail.split(" See full")[0].split(" [tensorstore_spec")[0]
        detail = _LOCAL_FILE.sub("", detail)[:300]  # the path is in the message already
        failure = (f"checkpoint {where!r} could not be restored ({type(err).__name__}: "
                   f"{detail}); it is damaged: {advice}")
    else:
        failure = None
    if failure is not None:
        abandoned_io.settle()
        raise ConfigError(failure)
    if (leaf := verify_checksums(state, meta)) is not None:
        if (dtypes := dtype_change(ckpt_dir / str(step) / "state", state, leaf)) is not None:
            # Restored with a cast, so the sum differs: the run changed, not the disk.
            raise ConfigError(f"checkpoint {where!r} holds state{leaf} as {dtypes[0]}, and this run builds "
                              f"it as {dtypes[1]} (model.param_dtype, or the model's dtypes, changed since "
                              f"it was written); resume with the dtypes that wrote it or a new train.out_dir")
        raise ConfigError(f"checkpoint {where!r} is damaged: the restored bytes of state{leaf} do not "
                          f"match the checksum saved with them; {advice}")
    return state, data_state, meta
