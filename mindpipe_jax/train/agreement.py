"""The processes of a multi-process run agree on their config before anything runs.

Each process reads its own command line or config file. Given different values (one
process told ``train.steps=6``, the other 4), they compile and run different programs,
and at the first step they disagree on one waits in a collective for a peer that never
joins: a hang until an outer timeout (seen: the run stopped at step 3 for good). So each
process sends a digest of its config, and where any differs from process 0's, process
0's config is sent to all, the processes that differ name the first differing key, and
every process stops with a one-line ``ConfigError`` (exit 2) before anything is written.

The same hang follows a mistake only one process sees: a data path or a run directory
that exists on one host, not on another. That process stops with its one line, and the
others go on into the first collective it never joins (seen: the other process waited
past any timeout, and the stopped one aborted with a page of C++ stack as the
coordination service saw it go). ``all_or_none`` runs such a stretch of the start-up on
every process and then shares its outcome: an exception on any process stops every
process, the others naming the one that failed and its message. And
``agree_on_checkpoint``: every process sees the same checkpoints before any reads one.

A mistake found before the processes connect (a config file or run directory on one
host only) left the others waiting out ``distributed.timeout_s`` for a peer that had
already gone. ``joined_by_all`` is the first collective of every multi-process start;
``stop_everywhere`` has a process whose config could not be read join the others there
anyway (the launcher's environment, or the ``distributed.*`` overrides, say how) and stop
them with its error.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
from typing import NoReturn

import jax
import numpy as np

from mindpipe_jax.config import Config
from mindpipe_jax.config_values import _shown
from mindpipe_jax.errors import ConfigError

# Keys that may differ between processes: how each one joins the run (its rank, the
# coordinator as it reaches it, its timeout) and what only process 0 shows (progress
# bars, TensorBoard events).
_PER_PROCESS = ("distributed.", "train.progress", "train.tensorboard")


def _compared(cfg: Config) -> dict:
    flat = {}
    for section, values in cfg.to_dict().items():
        for key, value in values.items():
            name = f"{section}.{key}"
            if not name.startswith(_PER_PROCESS):
                flat[name] = list(value) if isinstance(value, tuple) else value
    return flat


def agree_on_config(cfg: Config, what: str = "run") -> None:
    """On every process of a multi-process job (nothing to do with one): a ConfigError
    unless every process was given the same ``cfg`` (``_PER_PROCESS`` keys aside).
    Collective: every process must call it at the same point. ``what`` names the job."""
    _agree(_compared(cfg), f"every process of a {what} must be given the same config", "config")


def agree_on_model(fingerprint: dict[str, list[int]], what: str = "run", genes: dict | None = None) -> None:
    """As ``agree_on_config`` for the model each process built (its parameter paths and
    shapes, ``ModelSpec.fingerprint``; a supernet's ``genes`` too): a ``--model`` or
    factory that builds another model on one process would hang the run as another
    config does."""
    entries = {f"parameter {path}": shape for path, shape in fingerprint.items()}
    entries.update({f"gene {name}": choices for name, choices in (genes or {}).items()})
    _agree(entries, f"every process of a {what} must build the same model", "model")


def _agree(mine: dict, fix: str, noun: str) -> None:
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    blob = json.dumps(mine, sort_keys=True).encode()
    mine = json.loads(blob)  # compared as process 0's arrives: tuples as lists
    digest = np.frombuffer(hashlib.sha256(blob).digest(), np.uint8)
    digests = np.asarray(multihost_utils.process_allgather(digest))
    differ = [p for p in range(len(digests)) if not np.array_equal(digests[p], digests[0])]
    if not differ:
        return
    size = int(multihost_utils.broadcast_one_to_all(np.int32(len(blob))))
    buffer = np.zeros(size, np.uint8)
    if jax.process_index() == 0:
        buffer[:] = np.frombuffer(blob, np.uint8)
    first = json.loads(np.asarray(multihost_utils.broadcast_one_to_all(buffer)).tobytes())
    me = jax.process_index()
    if me in differ:
        key = next(k for k in sorted(set(first) | set(mine)) if first.get(k) != mine.get(k))
        sep = " " if noun == "model" else "="

        def shown(value):
            return "absent" if value is None and sep == " " else _shown(value)
        raise ConfigError(f"{key}{sep}{shown(mine.get(key))} on process {me}, but {key}{sep}"
                          f"{shown(first.get(key))} on process 0: {fix} (they would wait on each other "
                          f"at the first step they differ in)")
    raise ConfigError(f"the {noun} of process {differ[0]} differs from process 0's (its error line names "
                      f"the difference): {fix}")


def agree_on_checkpoint(ckpt_dir, what: str = "run") -> None:
    """Every process sees the same newest committed checkpoint in ``ckpt_dir`` (or none)
    before any reads one: orbax reads collectively. A ``train.out_dir`` that is not on a
    filesystem the processes share showed process 0 its checkpoints and the others none;
    resuming, process 0 read them while the others went on, and both crashed on
    mismatched collectives (gloo's "Received data size doesn't match", SIGABRT)."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    from mindpipe_jax.train.checkpoint import committed_steps

    steps = committed_steps(ckpt_dir)
    seen = np.asarray(multihost_utils.process_allgather(np.int64(steps[-1] if steps else -1)))
    if (seen == seen[0]).all():
        return
    views = ", ".join(f"process {p}: {f'step {s}' if s >= 0 else 'none'}" for p, s in enumerate(seen))
    raise ConfigError(f"the processes of the {what} see different checkpoints in {str(ckpt_dir)!r} (the "
                      f"newest on {views}): put train.out_dir on a filesystem every process shares (each "
                      f"writes its shards of a checkpoint there)")


_MESSAGE_BYTES = 2048  # a failing process's error line, as sent to the others


@contextlib.contextmanager
def all_or_none(what: str = "run"):
    """Run the ``with`` block on every process; an exception it raises on any of them
    stops all of them, instead of the others going on alone. The failing process raises
    its own; the others a ``ConfigError`` ("process N stopped the {what}: {its message}")
    where that was one (a user's mistake: exit 2 everywhere), else a ``RuntimeError``
    naming it (a bug: its traceback is in that process's output). Collective: every
    process must enter the block at the same point, and a collective inside the block
    must be one every process reaches alike (a process that failed before it would
    leave the others waiting there): end the block before it where that may differ."""
    failure = None
    try:
        yield
    except Exception as err:  # noqa: BLE001 -- shared with the other processes, then raised
        failure = err
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        # [0]: 0 went through, 1 a ConfigError, 2 another exception; then the message.
        line = np.zeros(_MESSAGE_BYTES + 1, np.uint8)
        if failure is not None:
            text = _outcome(failure).encode()[:_MESSAGE_BYTES + 1]
            line[:len(text)] = np.frombuffer(text, np.uint8)
        lines = np.asarray(multihost_utils.process_allgather(line))
        failed = [p for p in range(len(lines)) if lines[p, 0]]
        if failure is None and failed:
            p = failed[0]
            _raise_theirs(p, lines[p].tobytes().rstrip(b"\0").decode(errors="replace"), what)
    if failure is not None:
        raise failure


_gates = itertools.count()  # every process passes the same gates in the same order


def joined_by_all(what: str, timeout_s: int, failure: Exception | None = None) -> None:
    """The first exchange of a multi-process start, right after ``setup_runtime``: a
    process that arrives with a ``failure`` (``stop_everywhere``) stops every process.
    Through the coordination service's key-value store, not a device collective: a
    process that could not read its config may have another device count, and Gloo's
    connection lines, printed as a first collective connects, garbled the error lines
    printed just after it. Nothing to do with one process."""
    if jax.process_count() == 1:
        if failure is not None:
            raise failure
        return
    from jax._src.distributed import global_state  # the client jax.distributed started

    client = global_state.client
    if client is None:  # processes JAX connected some other way: a device collective then
        with all_or_none(what):
            if failure is not None:
                raise failure
        return
    gate = f"mindpipe/start/{next(_gates)}"
    client.key_value_set(f"{gate}/{jax.process_index()}", "" if failure is None else _outcome(failure))
    if failure is not None:
        raise failure
    for p in range(jax.process_count()):
        theirs = client.blocking_key_value_get(f"{gate}/{p}", timeout_s * 1000)
        if theirs:
            _raise_theirs(p, theirs, what)


def _outcome(failure: Exception) -> str:
    """A failure as sent to the other processes: ``1`` (a ConfigError) or ``2`` (anything
    else, named), then its message."""
    if isinstance(failure, ConfigError):
        return "1" + str(failure)[:_MESSAGE_BYTES]
    return "2" + f"{type(failure).__name__}: {failure}"[:_MESSAGE_BYTES]


def _raise_theirs(p: int, outcome: str, what: str) -> NoReturn:
    """Stop this process for process ``p``'s failure (``_outcome``)."""
    if outcome[0] == "1":
        raise ConfigError(f"process {p} stopped the {what}: {outcome[1:]}")
    raise RuntimeError(f"process {p} failed in the {what} ({outcome[1:]}); its output has the traceback")


def stop_everywhere(err: Exception, what: str, overrides=()) -> NoReturn:
    """Raise ``err``, a mistake found before the runtime started (this process's config
    file or run directory missing), after stopping the other processes of a multi-process
    job with it at their ``joined_by_all``, if this process can reach them: the launcher's
    environment (``MINDPIPE_*``, SLURM) or the ``distributed.*`` overrides among
    ``overrides`` say how. Without that, the others stop when ``distributed.timeout_s``
    ends their wait for it."""
    from mindpipe_jax.parallel.mesh import distributed_settings, setup_runtime

    cfg = Config()
    # How this process joins: whichever of those overrides parse (one may be the mistake).
    joining = ("distributed.", "parallel.simulate_cpu_devices=")
    for override in overrides:
        if isinstance(override, str) and override.startswith(joining):
            with contextlib.suppress(ConfigError):
                cfg = cfg.replace(override)
    if not jax.distributed.is_initialized():  # (it is where a --model import failed)
        try:
            reachable = distributed_settings(cfg.distributed) is not None
        except ConfigError:
            reachable = False
        if not reachable:
            raise err
        setup_runtime(cfg.parallel, cfg.distributed)
    joined_by_all(what, cfg.distributed.timeout_s, err)
    raise err  # (joined_by_all raised it)


def start_together(cfg: Config, what: str) -> None:
    """``setup_runtime`` for ``cfg``, then, with several processes, stop all of them if
    any could not read its config (``joined_by_all``) or was given another config than
    process 0 (``agree_on_config``): they would wait on each other at the first step
    they differ in."""
    from mindpipe_jax.parallel.mesh import setup_runtime

    setup_runtime(cfg.parallel, cfg.distributed)
    joined_by_all(what, cfg.distributed.timeout_s)
    agree_on_config(cfg, what)


@contextlib.contextmanager
def stops_everywhere(what: str, overrides=()):
    """The start-up before ``setup_runtime`` (reading the config, checks of it): a
    ``ConfigError`` in it is raised through ``stop_everywhere``."""
    try:
        yield
    except ConfigError as err:
        stop_everywhere(err, what, overrides)


__all__ = ["agree_on_checkpoint", "agree_on_config", "agree_on_model", "all_or_none", "joined_by_all",
           "start_together", "stop_everywhere", "stops_everywhere"]
