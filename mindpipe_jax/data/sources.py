"""Where tokens come from: one function, ``load_tokens``, per ``DataConfig.source``.

Every source returns a ``TokenSplits``: two 1-D integer arrays (train, validation)
that the loader windows into sequences. Byte-level sources (``stdlib``, ``text``)
have a vocabulary of 256; ``tokens`` files bring their own ids; ``synthetic`` is
random. Anything a user can get wrong (a missing path, an empty or too-short file,
ids outside the vocabulary) is a one-line ``ConfigError``.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mindpipe_jax.config import TOKEN_FILE_EXTENSIONS, DataConfig, path_kind
from mindpipe_jax.data import cache, files
from mindpipe_jax.data.splits import (
    check_split_sizes,
    partition_files,
    split_by_position,
)
from mindpipe_jax.errors import ConfigError

BYTE_VOCAB = 256
TOKEN_EXTENSIONS = TOKEN_FILE_EXTENSIONS
TOKEN_DTYPES = ("uint16", "uint32", "int32")
# Elements per chunk when scanning a token file's range: bounded memory for memmaps
# of many GB, large enough that the per-chunk overhead does not matter.
_SCAN_CHUNK = 1 << 24
# Bumped when the cached stdlib arrays would change for the same file list.
_STDLIB_CACHE_FORMAT = 1


@dataclass(frozen=True, eq=False)  # eq=False: comparing arrays with == is ambiguous
class TokenSplits:
    """Train and validation token ids (1-D; may be read-only memory maps)."""

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    name: str


def load_tokens(cfg: DataConfig, model_vocab: int) -> TokenSplits:
    """Load ``cfg.source`` and split it; ``model_vocab`` is the model's vocabulary."""
    loaders = {"stdlib": _stdlib, "text": _text, "tokens": _token_file, "synthetic": _synthetic}
    if cfg.source not in loaders:
        raise ConfigError(f"data.source={cfg.source!r} is not valid; valid: "
                          f"{', '.join(repr(s) for s in loaders)}")
    splits = loaders[cfg.source](cfg, model_vocab)
    _check_vocab(splits.vocab_size, model_vocab)
    return splits


def _check_vocab(data_vocab: int, model_vocab: int) -> None:
    # A token id >= model.vocab_size would index past the embedding table: on an
    # accelerator that is a silent clamp, not an error, so refuse it here.
    if data_vocab > model_vocab:
        raise ConfigError(f"data vocab_size {data_vocab} exceeds model.vocab_size {model_vocab}; "
                          f"set model.vocab_size >= {data_vocab}")


def _require_path(cfg: DataConfig) -> Path:
    path = Path(cfg.path).expanduser()
    kind = path_kind(path)
    if kind is None:
        raise ConfigError(f"data.path {cfg.path!r} does not exist")
    if kind.startswith("not reachable"):
        raise ConfigError(f"data.path {cfg.path!r} is {kind}")
    if kind not in ("a regular file", "a directory"):
        # Reading a FIFO or a device would block or never end.
        raise ConfigError(f"data.path {cfg.path!r} is {kind}, not a regular file or a directory")
    if not os.access(path, os.R_OK | (os.X_OK if kind == "a directory" else 0)):
        raise ConfigError(f"data.path {cfg.path!r} is {kind} this user may not read")
    return path


# --- stdlib --------------------------------------------------------------------

def _stdlib(cfg: DataConfig, model_vocab: int) -> TokenSplits:
    """The standard library's own ``.py`` files: real code, on every machine."""
    _check_vocab(BYTE_VOCAB, model_vocab)  # before reading 30 MB for nothing
    root = Path(sysconfig.get_paths()["stdlib"])
    listing = files.list_files(
        root,
        # Third-party packages differ between machines; the corpus must not.
        keep_dir=lambda d: d not in ("site-packages", "dist-packages", "__pycache__"),
        keep_file=lambda f: f.endswith(".py"),
    )
    if not listing:
        raise ConfigError(f"data.source='stdlib' found no .py files under {str(root)!r}; "
                          "use data.source='text' with a data.path")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    name = f"stdlib-py{version}"
    train, val = _split_files(root, listing, cfg.val_fraction, name, cache_key=_stdlib_key(
        version, listing, cfg.val_fraction))
    return TokenSplits(train=train, val=val, vocab_size=BYTE_VOCAB,
                       name=f"{name} ({len(listing)} files)")


def _stdlib_key(version: str, listing: list[tuple[str, int, int]], val_fraction: float) -> str:
    # Sizes and mtimes stand in for contents: hashing 30 MB would cost what the
    # cache saves. Anything that changes the arrays is in the digest.
    h = hashlib.sha256(f"{_STDLIB_CACHE_FORMAT}|{val_fraction!r}|{files.SEPARATOR!r}\n".encode())
    for rel, size, mtime in listing:
        h.update(f"{rel}\0{size}\0{mtime}\n".encode("utf-8", "surrogateescape"))
    return f"stdlib-py{version}-{h.hexdigest()[:16]}"


# --- text ----------------------------------------------------------------------

def _text(cfg: DataConfig, model_vocab: int) -> TokenSplits:
    """Bytes of one file (split by position) or of a directory (split by file)."""
    path = _require_path(cfg)  # a path that is not there is the mistake to name first
    _check_vocab(BYTE_VOCAB, model_vocab)
    if path.is_file():
        if path.stat().st_size == 0:
            raise ConfigError(f"data.path {cfg.path!r} is empty (0 bytes)")
        # A memory map: a multi-GB text file costs page cache, not process memory.
        data = np.memmap(path, dtype=np.uint8, mode="r")
        train, val = split_by_position(data, cfg.val_fraction, f"text file {cfg.path!r}")
        return TokenSplits(train=train, val=val, vocab_size=BYTE_VOCAB, name=f"text:{path.name}")
    listing = files.list_files(
        path,
        # Hidden entries are tool state (.git objects, editor swap files), not text.
        keep_dir=lambda d: not d.startswith("."),
        keep_file=lambda f: not f.startswith("."),
    )
    if not listing:
        raise ConfigError(f"data.path {cfg.path!r} holds no files")
    if sum(size for _, size, _ in listing) == 0:
        raise ConfigError(f"data.path {cfg.path!r} holds only empty files ({len(listing)})")
    train, val = _split_files(path, listing, cfg.val_fraction, f"text directory {cfg.path!r}")
    return TokenSplits(train=train, val=val, vocab_size=BYTE_VOCAB,
                       name=f"text:{path.name}/ ({len(listing)} files)")


def _split_files(root: Path, listing: list[tuple[str, int, int]], val_fraction: float,
                 what: str, cache_key: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate the train files and the validation files, split by path hash.

    With few files the hash can put every file on one side; then the whole
    concatenation is split by position instead, so small directories still work.
    """
    rels = [rel for rel, _, _ in listing]
    sizes = [size for _, size, _ in listing]
    train_idx, val_idx = partition_files(rels, val_fraction)
    if not train_idx or (not val_idx and val_fraction > 0):
        everything = files.concat(root, rels)
        return split_by_position(everything, val_fraction, what)
    expected = {"train": files.concat_length([sizes[i] for i in train_idx]),
                "val": files.concat_length([sizes[i] for i in val_idx])}
    if cache_key is not None:
        hit = cache.load(cache_key, expected)
        if hit is not None:
            return hit["train"], hit["val"]
    train = files.concat(root, [rels[i] for i in train_idx])
    val = files.concat(root, [rels[i] for i in val_idx])
    check_split_sizes(what, len(train), len(val), val_fraction)
    if cache_key is not None:
        cache.store(cache_key, {"train": train, "val": val})  # best effort
    return train, val


# --- token files -----------------------------------------------------------------

def _token_file(cfg: DataConfig, model_vocab: int) -> TokenSplits:
    """Pre-tokenised ids: ``.npy`` (any integer dtype) or raw ``.bin`` (nanoGPT)."""
    path = _require_path(cfg)
    if not path.is_file():
        raise ConfigError(f"data.path {cfg.path!r} is not a file; data.source='tokens' "
                          f"needs a {' or '.join(TOKEN_EXTENSIONS)} file")
    ext = path.suffix.lower()
    if ext == ".npy":
        tokens = _read_npy(path, cfg.path)
    elif ext == ".bin":
        tokens = _read_bin(path, cfg.path, cfg.token_dtype)
    else:
        raise ConfigError(f"token file {cfg.path!r} has extension {ext or '(none)'!r}; "
                          f"valid: {', '.join(TOKEN_EXTENSIONS)}")
    if tokens.size == 0:
        raise ConfigError(f"token file {cfg.path!r} holds no tokens")
    vocab = cfg.vocab_size if cfg.vocab_size > 0 else model_vocab
    _check_vocab(vocab, model_vocab)  # before scanning a possibly huge file
    _check_ids(tokens, vocab, f"token file {cfg.path!r}")
    train, val = split_by_position(tokens, cfg.val_fraction, f"token file {cfg.path!r}")
    return TokenSplits(train=train, val=val, vocab_size=vocab, name=f"tokens:{path.name}")


def array_tokens(tokens, cfg: DataConfig, model_vocab: int) -> TokenSplits:
    """Token ids held in memory (``mindpipe_jax.train(model, ids)``: a 1-D integer NumPy or
    JAX array, or a list), checked and split as a token file is."""
    tokens = np.asarray(tokens)
    what = f"the data array (shape {tokens.shape}, {tokens.dtype})"
    if not np.issubdtype(tokens.dtype, np.integer) or tokens.ndim != 1 or tokens.size == 0:
        raise ConfigError(f"{what}: token ids must be a non-empty 1-D array of integers")
    vocab = cfg.vocab_size if cfg.vocab_size > 0 else model_vocab
    _check_vocab(vocab, model_vocab)
    _check_ids(tokens, vocab, what)
    train, val = split_by_position(tokens, cfg.val_fraction, what)
    return TokenSplits(train=train, val=val, vocab_size=vocab, name=f"array:{len(tokens)}")


def _read_npy(path: Path, shown: str) -> np.ndarray:
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError:
        # numpy cannot memory-map a zero-length array; anything else wrong with the
        # file fails again below with numpy's own reason.
        try:
            tokens = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as err:
            raise ConfigError(f"token file {shown!r} is not a readable .npy array: {err}") from None
    except OSError as err:
        raise ConfigError(f"token file {shown!r} is not a readable .npy array: {err}") from None
    if not np.issubdtype(tokens.dtype, np.integer):
        raise ConfigError(f"token file {shown!r} holds {tokens.dtype} values; token ids must "
                          "be an integer dtype")
    if tokens.ndim != 1:
        raise ConfigError(f"token file {shown!r} holds an array of shape {tokens.shape}; "
                          "token ids must be 1-D")
    return tokens


def _read_bin(path: Path, shown: str, token_dtype: str) -> np.ndarray:
    if token_dtype not in TOKEN_DTYPES:
        raise ConfigError(f"data.token_dtype={token_dtype!r} is not valid; valid: "
                          f"{', '.join(TOKEN_DTYPES)}")
    dtype = np.dtype(token_dtype)
    nbytes = path.stat().st_size
    if nbytes == 0:
        raise ConfigError(f"token file {shown!r} holds no tokens (0 bytes)")
    if nbytes % dtype.itemsize:
        raise ConfigError(f"token file {shown!r} has {nbytes} bytes, not a multiple of "
                          f"{dtype.itemsize} (data.token_dtype={token_dtype!r}); "
                          f"check data.token_dtype (valid: {', '.join(TOKEN_DTYPES)})")
    return np.memmap(path, dtype=dtype, mode="r")


def _check_ids(tokens: np.ndarray, vocab: int, what: str) -> None:
    """Every id in ``[0, vocab)``; chunked so a memmap is never loaded whole."""
    info = np.iinfo(tokens.dtype)
    need_low = info.min < 0
    need_high = info.max >= vocab  # e.g. uint16 ids can never reach a 70k vocabulary
    if not (need_low or need_high):
        return
    low, high = 0, 0
    for start in range(0, len(tokens), _SCAN_CHUNK):
        chunk = tokens[start:start + _SCAN_CHUNK]
        low = min(low, int(chunk.min()))
        high = max(high, int(chunk.max()))
    if low < 0:
        raise ConfigError(f"{what} holds negative id {low}; token ids must be in [0, {vocab})")
    if high >= vocab:
        raise ConfigError(f"{what} holds id {high} but the vocabulary size is {vocab}; set "
                          f"data.vocab_size / model.vocab_size > {high}")


# --- synthetic -------------------------------------------------------------------

def _synthetic(cfg: DataConfig, model_vocab: int) -> TokenSplits:
    """Uniform random ids: no I/O, for benchmarks. Same seed, same tokens."""
    dtype = np.uint16 if model_vocab <= np.iinfo(np.uint16).max + 1 else np.int32
    tokens = np.random.default_rng(cfg.seed).integers(0, model_vocab, cfg.synthetic_tokens, dtype=dtype)
    train, val = split_by_position(tokens, cfg.val_fraction,
                                   f"data.synthetic_tokens={cfg.synthetic_tokens}")
    return TokenSplits(train=train, val=val, vocab_size=model_vocab, name="synthetic")
