"""Deterministic, resumable batches of (inputs, targets) windows, built on grain.

Record ``i`` is the window ``tokens[i*T : i*T + T + 1]`` (stride ``T``, one token of
overlap so every position has a target). The record order is a pure function of
``(seed, epoch)`` — grain's index shuffle, reseeded each epoch — so batch ``k`` is
the same whatever happened before it. That is what makes the loader's state a
single integer (the next global batch) and restores exact.

Multi-process: ``batch_size`` is the *global* batch. Process ``p`` of ``P`` gets rows
``[p*B/P, (p+1)*B/P)`` of every global batch, so stacking the processes' batches
in process order reproduces the single-process batch bit for bit, and a state
saved with one process count resumes with another.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any, Self

import grain
import numpy as np

from mindpipe_jax.errors import ConfigError

Batch = dict[str, np.ndarray]
_STATE_VERSION = 1


class _Windows:
    """Random-access source of overlapping ``T + 1``-token windows (no copy made)."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self._tokens = tokens
        self._seq_len = seq_len
        self._len = max(0, (len(tokens) - 1) // seq_len)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> np.ndarray:
        start = int(index) * self._seq_len
        return self._tokens[start:start + self._seq_len + 1]


def _to_example(window: np.ndarray) -> Batch:
    # int32 whatever the storage dtype (uint8 bytes, uint16 nanoGPT ids): the model's
    # embedding lookup wants one index type, and astype also copies out of a memmap.
    window = np.asarray(window)
    return {"inputs": window[:-1].astype(np.int32), "targets": window[1:].astype(np.int32)}


def _shuffle_seed(seed: int) -> int:
    # grain reseeds epoch e with (seed + e) % 2**32, so seeds 0 and 1 would share
    # all but one epoch, shifted. Hashing the user's seed first spreads seeds apart.
    return int(np.random.SeedSequence(seed % 2**63).generate_state(1, dtype=np.uint32)[0])


def _check_shape(tokens: np.ndarray, seq_len: int, batch_size: int, process_index: int,
                 process_count: int, name: str) -> None:
    if seq_len <= 0 or batch_size <= 0:
        raise ConfigError(f"seq_len={seq_len} and batch_size={batch_size} must be > 0")
    if process_count <= 0 or not 0 <= process_index < process_count:
        raise ConfigError(f"process_index={process_index} must be in [0, {process_count}) "
                          f"with process_count={process_count} >= 1")
    if batch_size % process_count:
        raise ConfigError(f"train.global_batch={batch_size} is not divisible by the "
                          f"{process_count} processes; use a multiple of {process_count}")
    if np.ndim(tokens) != 1:
        raise ConfigError(f"data split {name!r} must be 1-D token ids, got shape {np.shape(tokens)}")
    if len(tokens) < batch_size * seq_len + 1:
        raise ConfigError(f"data split {name!r} has {len(tokens)} tokens, fewer than one batch "
                          f"needs (batch {batch_size} x seq_len {seq_len} + 1); use a smaller "
                          "train.global_batch/model.seq_len or more data")


def _local_batches(tokens: np.ndarray, *, seq_len: int, batch_size: int, process_index: int,
                   process_count: int, seed: int | None) -> tuple[grain.MapDataset, int]:
    """One epoch of this process's batches (shuffled when ``seed`` is given).

    Returns the dataset and the number of global batches per epoch. Epoch ``e`` of
    a ``.repeat()`` of it is reshuffled with epoch ``e``'s seed: every index-based
    grain step below passes the epoch through (index ``e*len + i``).
    """
    ds = grain.MapDataset.source(_Windows(tokens, seq_len))
    if seed is not None:
        ds = ds.shuffle(seed=_shuffle_seed(seed))
    local = batch_size // process_count
    per_epoch = len(ds) // batch_size
    # Local batches k*P .. k*P+P-1 together are global batch k; cutting at a whole
    # number of global batches drops each epoch's remainder records (different
    # ones every epoch, as the order changes) instead of letting a batch straddle
    # two epochs and hold the same record twice.
    ds = ds.map(_to_example).batch(local, drop_remainder=True)
    ds = ds[: per_epoch * process_count][process_index::process_count]
    return ds, per_epoch


def tokens_digest(tokens: np.ndarray, windows: int = 16, width: int = 4096) -> str:
    """A digest of the token stream from its length, dtype and ``windows`` evenly spaced
    runs of ``width`` tokens: changed data of the same length (another data.seed, an
    edited file) is told apart at a cost that does not grow with the corpus."""
    flat = tokens.reshape(-1)
    h = hashlib.blake2b(f"{flat.size}:{flat.dtype}".encode(), digest_size=8)
    last = max(flat.size - width, 0)
    for k in range(windows):
        start = last * k // max(windows - 1, 1)
        h.update(np.ascontiguousarray(flat[start:start + width]).tobytes())
    return h.hexdigest()


class Loader:
    """Endless shuffled batches ``{"inputs", "targets"}`` of shape ``[B_local, T]``, int32.

    ``get_state()`` is a small JSON-able dict; ``set_state()`` makes the following
    batches identical to those of an uninterrupted loader. ``prefetch`` batches are
    prepared ahead in one background thread (0: prepare on demand).
    """

    def __init__(self, tokens: np.ndarray, *, seq_len: int, batch_size: int, seed: int,
                 process_index: int = 0, process_count: int = 1, shuffle: bool = True,
                 name: str = "train", prefetch: int = 2):
        _check_shape(tokens, seq_len, batch_size, process_index, process_count, name)
        self.seq_len = seq_len
        self.global_batch = batch_size
        self.local_batch = batch_size // process_count
        self.process_index = process_index
        self.process_count = process_count
        self._seed = seed
        self._shuffle = shuffle
        self._num_records = len(_Windows(tokens, seq_len))
        self._digest = tokens_digest(tokens)
        epoch_ds, self.batches_per_epoch = _local_batches(
            tokens, seq_len=seq_len, batch_size=batch_size, process_index=process_index,
            process_count=process_count, seed=seed if shuffle else None)
        read = grain.ReadOptions(num_threads=1 if prefetch > 0 else 0,
                                 prefetch_buffer_size=max(prefetch, 0))
        self._dataset = epoch_ds.repeat().to_iter_dataset(read)
        self._iter = iter(self._dataset)
        self._step = 0  # index of the next global batch

    @property
    def step(self) -> int:
        """Global batches handed out so far (the next batch's index)."""
        return self._step

    @property
    def epoch(self) -> int:
        """Epoch of the next batch (0-based)."""
        return self._step // self.batches_per_epoch

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        batch = next(self._iter)
        self._step += 1
        return batch

    def close(self) -> None:
        """Stop the prefetch thread now rather than when the loader is collected."""
        self._iter.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _identity(self) -> dict[str, Any]:
        # What fixes the batch stream: a state only replays under the same values.
        # The process layout is not part of it: batch k is the same global batch.
        return {"seed": self._seed, "shuffle": self._shuffle, "seq_len": self.seq_len,
                "global_batch": self.global_batch, "num_records": self._num_records}

    def get_state(self) -> dict[str, Any]:
        """``{"version", "step", ...}``: plain ints, bools and a string, JSON-serialisable."""
        return {"version": _STATE_VERSION, "step": self._step, **self._identity(),
                "tokens_digest": self._digest}

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from ``get_state``, possibly through JSON)."""
        if state.get("version") != _STATE_VERSION:
            raise ConfigError(f"data loader state version {state.get('version')!r} is not "
                              f"supported; valid: {_STATE_VERSION}")
        if state.get("tokens_digest", self._digest) != self._digest:  # absent: saved before digests
            raise ConfigError("the training tokens differ from those the saved run was trained on (same "
                              "count, other content: data.path's files, data.seed, data.source); the "
                              "batches would not continue the saved run: resume with the data it was "
                              "trained on, or start a new train.out_dir")
        for key, value in self._identity().items():
            if state.get(key) != value:
                raise ConfigError(f"data loader state was saved with {key}={state.get(key)!r} but "
                                  f"this run has {key}={value!r}; the batches would not continue "
                                  "the saved run (use the same data, seed, batch and seq_len)")
        step = int(state["step"])
        if step < 0:
            raise ConfigError(f"data loader state step={step} must be >= 0")
        # The grain iterator's position is the index into the repeated per-process
        # dataset, which is the global batch index: restoring it is exact.
        self._iter.set_state({"next_index": step})
        self._step = step


def eval_batches(tokens: np.ndarray, *, seq_len: int, batch_size: int, num_batches: int,
                 process_index: int = 0, process_count: int = 1, name: str = "val") -> list[Batch]:
    """The first ``num_batches`` unshuffled batches of ``tokens``: the same every call.

    A fixed set keeps successive validation losses comparable. If the split holds
    fewer whole batches than asked for, all of them are returned (check ``len``);
    fewer than one batch is a ``ConfigError``.
    """
    _check_shape(tokens, seq_len, batch_size, process_index, process_count, name)
    if num_batches <= 0:
        raise ConfigError(f"num_batches={num_batches} must be > 0")
    ds, per_epoch = _local_batches(tokens, seq_len=seq_len, batch_size=batch_size,
                                   process_index=process_index, process_count=process_count,
                                   seed=None)
    return [ds[k] for k in range(min(num_batches, per_epoch))]
