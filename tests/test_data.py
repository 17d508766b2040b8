"""mindpipe_jax.data: sources, splits, errors, and the grain batch loader."""

from __future__ import annotations

import json
import re
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from mindpipe_jax.config import DataConfig
from mindpipe_jax.data import (
    Loader,
    TokenSplits,
    array_tokens,
    eval_batches,
    files,
    load_tokens,
    resolve_data,
    sources,
)
from mindpipe_jax.data.splits import is_val_file
from mindpipe_jax.errors import ConfigError

# --- sources ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def stdlib_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def stdlib_splits(stdlib_cache):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINDPIPE_CACHE", str(stdlib_cache))
        return load_tokens(DataConfig(source="stdlib"), 256)


def test_stdlib_corpus_is_large_and_split(stdlib_splits):
    s = stdlib_splits
    assert isinstance(s, TokenSplits) and s.vocab_size == 256
    n_files = int(s.name.split("(")[1].split()[0])
    assert n_files > 1000
    assert len(s.train) > 10_000_000 and len(s.val) > 100_000
    assert s.train.dtype == np.uint8 and s.val.dtype == np.uint8
    assert 0.01 < len(s.val) / (len(s.train) + len(s.val)) < 0.2


def test_stdlib_cache_hit_is_identical_and_split_is_by_file(stdlib_splits, stdlib_cache, monkeypatch):
    monkeypatch.setenv("MINDPIPE_CACHE", str(stdlib_cache))
    assert list(stdlib_cache.glob("*.npy"))  # the first load wrote the cache
    again = load_tokens(DataConfig(source="stdlib"), 256)
    assert isinstance(again.train, np.memmap)  # served from the cache
    np.testing.assert_array_equal(again.train, stdlib_splits.train)
    np.testing.assert_array_equal(again.val, stdlib_splits.val)
    # Disjoint by file: a validation file's text is nowhere in the training split.
    root = Path(sysconfig.get_paths()["stdlib"])
    listing = files.list_files(root, keep_dir=lambda d: d not in (
        "site-packages", "dist-packages", "__pycache__"), keep_file=lambda f: f.endswith(".py"))
    val_files = [rel for rel, size, _ in listing if is_val_file(rel, 0.05) and size > 4000]
    assert val_files
    probe = (root / val_files[0]).read_bytes()[:4000]
    assert probe in stdlib_splits.val.tobytes()
    assert probe not in stdlib_splits.train.tobytes()


def test_stdlib_works_without_a_writable_cache(tmp_path, monkeypatch, stdlib_splits):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    monkeypatch.setenv("MINDPIPE_CACHE", str(blocker / "cache"))
    s = load_tokens(DataConfig(source="stdlib"), 256)
    assert len(s.train) == len(stdlib_splits.train)
    np.testing.assert_array_equal(s.val, stdlib_splits.val)


def test_file_split_is_stable_hash_of_path():
    rels = [f"pkg/mod_{i}.py" for i in range(2000)]
    val = [r for r in rels if is_val_file(r, 0.1)]
    assert 100 < len(val) < 300
    assert val == [r for r in reversed(rels) if is_val_file(r, 0.1)][::-1]


def test_text_file_splits_by_position(tmp_path):
    data = bytes(range(256)) * 40
    f = tmp_path / "corpus.txt"
    f.write_bytes(data)
    s = load_tokens(DataConfig(source="text", path=str(f), val_fraction=0.25), 256)
    assert s.vocab_size == 256
    assert len(s.val) == len(data) // 4
    assert s.train.tobytes() + s.val.tobytes() == data


def test_text_directory_splits_by_file(tmp_path):
    contents = {}
    for i in range(60):
        sub = tmp_path / f"d{i % 3}"
        sub.mkdir(exist_ok=True)
        contents[f"d{i % 3}/f{i:02d}.txt"] = f"file number {i}\n".encode() * 10
        (tmp_path / f"d{i % 3}/f{i:02d}.txt").write_bytes(contents[f"d{i % 3}/f{i:02d}.txt"])
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "junk").write_bytes(b"\x00" * 100)
    s = load_tokens(DataConfig(source="text", path=str(tmp_path), val_fraction=0.2), 256)
    train, val = s.train.tobytes(), s.val.tobytes()
    assert b"\x00" not in train + val  # hidden directories skipped
    in_val = [rel for rel in sorted(contents) if is_val_file(rel, 0.2)]
    assert in_val and len(in_val) < len(contents)
    for rel, body in contents.items():
        assert (body in val) == (rel in in_val)
        assert (body in train) == (rel not in in_val)
    assert len(train) + len(val) == sum(len(b) + 1 for b in contents.values())


def test_text_directory_with_one_file_falls_back_to_position(tmp_path):
    (tmp_path / "only.txt").write_bytes(b"abcdefghij" * 100)
    s = load_tokens(DataConfig(source="text", path=str(tmp_path), val_fraction=0.1), 256)
    assert len(s.train) > 0 and len(s.val) > 0


def test_val_fraction_zero_trains_on_every_token_of_each_source(tmp_path):
    """``data.val_fraction=0`` (a run with ``train.eval_every=0``): no validation split,
    and the training split holds everything (a directory too, not its position split)."""
    text = bytes(range(256)) * 40
    (tmp_path / "corpus.txt").write_bytes(text)
    (tmp_path / "dir" / "sub").mkdir(parents=True)
    bodies = {f"sub/f{i}.txt": f"file {i}\n".encode() * 20 for i in range(30)}
    for rel, body in bodies.items():
        (tmp_path / "dir" / rel).write_bytes(body)
    ids = np.arange(5000) % 1000
    np.save(tmp_path / "ids.npy", ids)
    cases = {"text file": (DataConfig(source="text", path=str(tmp_path / "corpus.txt"), val_fraction=0.0),
                           len(text)),
             "text directory": (DataConfig(source="text", path=str(tmp_path / "dir"), val_fraction=0.0),
                                sum(len(b) + 1 for b in bodies.values())),
             "token file": (DataConfig(source="tokens", path=str(tmp_path / "ids.npy"), vocab_size=1000,
                                       val_fraction=0.0), len(ids)),
             "synthetic": (DataConfig(source="synthetic", synthetic_tokens=4096, val_fraction=0.0), 4096)}
    for name, (cfg, total) in cases.items():
        s = load_tokens(cfg, 1024)
        assert len(s.val) == 0 and len(s.train) == total, name
    assert np.array_equal(array_tokens(ids, DataConfig(val_fraction=0.0), 1024).train, ids)
    with pytest.raises(ConfigError, match=r"data.val_fraction=-0.1 must be in \[0, 1\)"):
        DataConfig(val_fraction=-0.1)
    (tmp_path / "one.txt").write_bytes(b"a")
    with pytest.raises(ConfigError, match="has 1 token, too few to train on"):
        load_tokens(DataConfig(source="text", path=str(tmp_path / "one.txt"), val_fraction=0.0), 256)


def test_npy_tokens_round_trip(tmp_path):
    ids = np.random.default_rng(0).integers(0, 1000, 5000).astype(np.int64)
    f = tmp_path / "ids.npy"
    np.save(f, ids)
    s = load_tokens(DataConfig(source="tokens", path=str(f), vocab_size=1000), 1024)
    assert s.vocab_size == 1000
    np.testing.assert_array_equal(np.concatenate([s.train, s.val]), ids)
    assert len(s.val) == int(5000 * 0.05)


def test_token_ids_in_memory_split_as_the_same_npy_file(tmp_path):
    """``mp.train(model, ids)``: an array of ids gives the splits its .npy file gives, with the
    file's checks (integer 1-D ids, within the vocabulary); a list and a JAX array alike."""
    import jax.numpy as jnp

    ids = np.random.default_rng(0).integers(0, 1000, 5000).astype(np.int32)
    np.save(tmp_path / "ids.npy", ids)
    cfg = DataConfig(source="tokens", path=str(tmp_path / "ids.npy"), vocab_size=1000)
    want = load_tokens(cfg, 1024)
    for given in (ids, list(ids), jnp.asarray(ids)):
        got = array_tokens(given, DataConfig(), 1000)
        assert got.vocab_size == want.vocab_size == 1000
        np.testing.assert_array_equal(got.train, want.train)
        np.testing.assert_array_equal(got.val, want.val)
    for bad, needle in ((ids.astype(np.float32), "non-empty 1-D array of integers"),
                        (ids.reshape(50, 100), "non-empty 1-D array of integers"),
                        (ids + 1000, "holds id 1999 but the vocabulary size is 1000"),
                        (ids[:3], "too few to split")):
        with pytest.raises(ConfigError, match=needle):
            array_tokens(bad, DataConfig(), 1000)


def test_a_data_argument_beside_a_config_naming_other_data_is_refused(tmp_path):
    """``mp.train(model, ids, cfg)`` with ``data.source=synthetic`` (or ``data.path``) in
    ``cfg`` trained on the argument and silently dropped what the config named; now one
    line naming both. The same source named twice, or a search of a saved run on other
    data (``saved_config``: the argument replaces the run's data by design), is read."""
    from mindpipe_jax.config import Config

    ids = np.random.default_rng(0).integers(0, 200, 5000).astype(np.int32)
    text, other = tmp_path / "a.txt", tmp_path / "b.txt"
    for f in (text, other):
        f.write_text("some text to read " * 200)
    for cfg_keys, given, needle in (
            (("data.source=synthetic",), ids, "as the argument (token ids in memory) and in the config "
                                               "(data.source='synthetic')"),
            ((f"data.path={text}",), str(other), f"(the path '{other}')"),
            ((f"data.path={text}",), DataConfig(source="synthetic"), "(a DataConfig)")):
        cfg = Config().replace(*cfg_keys)
        with pytest.raises(ConfigError, match=re.escape(needle)) as err:
            resolve_data(given, cfg)
        assert "pass one of them (data=None reads the config's)" in str(err.value)
        assert resolve_data(given, cfg, saved_config=True).train.size > 0
    same = Config().replace(f"data.path={text}")
    np.testing.assert_array_equal(resolve_data(text, same).train, resolve_data(None, same).train)
    np.testing.assert_array_equal(resolve_data(same.data, same).train, resolve_data(None, same).train)


def test_the_entry_points_data_argument_is_read_one_way(tmp_path):
    """``resolve_data``: what ``mp.train``, ``train_supernet`` and ``search_checkpoint``
    take as ``data``. The supernet entry points had their own reading, which took no
    array and let ``TokenSplits`` of a larger vocabulary than the model's through."""
    import jax.numpy as jnp

    from mindpipe_jax.config import Config

    cfg = Config().replace("model.vocab_size=1000")
    ids = np.random.default_rng(0).integers(0, 1000, 5000).astype(np.int32)
    np.save(tmp_path / "ids.npy", ids)
    want = load_tokens(DataConfig(source="tokens", path=str(tmp_path / "ids.npy")), 1000)
    for given in (ids, list(ids), jnp.asarray(ids), str(tmp_path / "ids.npy"), tmp_path / "ids.npy",
                  DataConfig(source="tokens", path=str(tmp_path / "ids.npy")), want):
        got = resolve_data(given, cfg)
        np.testing.assert_array_equal(got.train, want.train)
        np.testing.assert_array_equal(got.val, want.val)
    wider = TokenSplits(train=want.train, val=want.val, vocab_size=1024, name="wider")
    for bad, needle in ((wider, "data vocab_size 1024 exceeds model.vocab_size 1000"),
                        ("train.steps=3", "data='train.steps=3' is an override"),
                        ({"train": ids}, "data must be None, a path, a DataConfig, TokenSplits or an array")):
        with pytest.raises(ConfigError, match=needle):
            resolve_data(bad, cfg)


def test_bin_tokens_round_trip_and_vocab_from_model(tmp_path):
    ids = np.random.default_rng(1).integers(0, 50000, 10_000).astype(np.uint16)
    f = tmp_path / "train.bin"
    ids.tofile(f)
    s = load_tokens(DataConfig(source="tokens", path=str(f)), 50304)
    assert s.vocab_size == 50304 and s.train.dtype == np.uint16
    np.testing.assert_array_equal(np.concatenate([s.train, s.val]), ids)


def test_synthetic_is_deterministic():
    cfg = DataConfig(source="synthetic", synthetic_tokens=10_000, seed=3)
    a, b = load_tokens(cfg, 512), load_tokens(cfg, 512)
    np.testing.assert_array_equal(a.train, b.train)
    assert a.vocab_size == 512 and a.train.max() < 512
    c = load_tokens(DataConfig(source="synthetic", synthetic_tokens=10_000, seed=4), 512)
    assert not np.array_equal(a.train, c.train)


# --- source errors ---------------------------------------------------------------

def _raises(match: str, cfg: DataConfig, model_vocab: int = 256):
    with pytest.raises(ConfigError, match=match):
        load_tokens(cfg, model_vocab)


def test_missing_path(tmp_path):
    missing = str(tmp_path / "nope")
    _raises("nope' does not exist", DataConfig(source="text", path=missing))
    _raises("nope' does not exist", DataConfig(source="tokens", path=missing))
    # Named before the vocabulary: a byte-level text source (256 ids) on a smaller model
    # first sent the user to model.vocab_size, then, once fixed, to the path.
    _raises("nope' does not exist", DataConfig(source="text", path=missing), model_vocab=64)


def test_empty_data(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    _raises("empty.txt' is empty", DataConfig(source="text", path=str(empty)))
    d = tmp_path / "dir"
    d.mkdir()
    _raises("dir' holds no files", DataConfig(source="text", path=str(d)))
    (d / "a.txt").write_bytes(b"")
    _raises("dir' holds only empty files", DataConfig(source="text", path=str(d)))
    np.save(tmp_path / "none.npy", np.zeros(0, np.int32))
    _raises("none.npy' holds no tokens", DataConfig(source="tokens", path=str(tmp_path / "none.npy")))
    (tmp_path / "none.bin").write_bytes(b"")
    _raises("none.bin' holds no tokens", DataConfig(source="tokens", path=str(tmp_path / "none.bin")))


def test_too_short_to_split(tmp_path):
    f = tmp_path / "tiny.txt"
    f.write_bytes(b"hello")
    _raises(r"tiny.txt' has 5 tokens, too few .* at least 40", DataConfig(source="text", path=str(f)))


def test_token_extension_and_bin_size(tmp_path):
    f = tmp_path / "ids.txt"
    f.write_bytes(b"1 2 3")
    _raises(r"extension '.txt'; valid: .npy, .bin", DataConfig(source="tokens", path=str(f)))
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x02\x03")
    _raises(r"odd.bin' has 3 bytes, not a multiple of 2", DataConfig(source="tokens", path=str(odd)))
    np.save(tmp_path / "floats.npy", np.ones(10, np.float32))
    _raises("float32", DataConfig(source="tokens", path=str(tmp_path / "floats.npy")))


def test_token_ids_outside_vocab(tmp_path):
    big = tmp_path / "big.bin"
    ids = np.zeros(1000, np.uint32)
    ids[700] = 70000
    ids.tofile(big)
    _raises(r"'.*big.bin' holds id 70000 but the vocabulary size is 50304; "
            r"set data.vocab_size / model.vocab_size > 70000",
            DataConfig(source="tokens", path=str(big), token_dtype="uint32"), 50304)
    neg = tmp_path / "neg.npy"
    np.save(neg, np.array([1, 2, -3] * 100, np.int32))
    _raises("neg.npy' holds negative id -3", DataConfig(source="tokens", path=str(neg)), 256)


def test_data_vocab_larger_than_model(tmp_path):
    f = tmp_path / "ids.npy"
    np.save(f, np.arange(100, dtype=np.int32))
    _raises("data vocab_size 50304 exceeds model.vocab_size 256",
            DataConfig(source="tokens", path=str(f), vocab_size=50304), 256)
    _raises("data vocab_size 256 exceeds model.vocab_size 100", DataConfig(source="stdlib"), 100)


def test_token_scan_is_chunked(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "_SCAN_CHUNK", 7)
    ids = np.arange(100, dtype=np.int32)
    ids[93] = 300
    np.save(tmp_path / "ids.npy", ids)
    _raises("holds id 300", DataConfig(source="tokens", path=str(tmp_path / "ids.npy")), 256)


# --- loader ----------------------------------------------------------------------

TOKENS = np.random.default_rng(7).integers(0, 256, 20_000).astype(np.uint8)


def _take(loader, n):
    return [next(loader) for _ in range(n)]


def _same(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys, strict=True):
        np.testing.assert_array_equal(x["inputs"], y["inputs"])
        np.testing.assert_array_equal(x["targets"], y["targets"])


def test_loader_shapes_and_shifted_targets():
    b = next(Loader(TOKENS, seq_len=16, batch_size=8, seed=0))
    assert b["inputs"].shape == (8, 16) and b["inputs"].dtype == np.int32
    assert b["targets"].dtype == np.int32
    np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
    # Each row is a stride-T window of the token array.
    for row_in, row_tg in zip(b["inputs"], b["targets"], strict=True):
        window = np.concatenate([row_in, row_tg[-1:]])
        start = np.flatnonzero(TOKENS[: len(TOKENS) - 16] == window[0])
        assert any(s % 16 == 0 and np.array_equal(TOKENS[s:s + 17], window) for s in start)


def test_loader_is_deterministic_per_seed():
    a = _take(Loader(TOKENS, seq_len=16, batch_size=8, seed=0), 5)
    b = _take(Loader(TOKENS, seq_len=16, batch_size=8, seed=0), 5)
    c = _take(Loader(TOKENS, seq_len=16, batch_size=8, seed=1), 5)
    _same(a, b)
    assert not np.array_equal(a[0]["inputs"], c[0]["inputs"])


def test_epochs_cover_records_once_and_reshuffle():
    tokens = np.arange(10 * 4 + 1, dtype=np.int32)  # 10 records of seq_len 4
    loader = Loader(tokens, seq_len=4, batch_size=3, seed=0)  # 3 batches/epoch, 1 dropped
    assert loader.batches_per_epoch == 3
    firsts = [next(loader)["inputs"][:, 0] // 4 for _ in range(6)]
    epoch0, epoch1 = np.concatenate(firsts[:3]), np.concatenate(firsts[3:])
    assert len(set(epoch0)) == 9 and len(set(epoch1)) == 9
    assert not np.array_equal(epoch0, epoch1)
    assert loader.epoch == 2


def test_unshuffled_loader_is_sequential():
    tokens = np.arange(8 * 4 + 1, dtype=np.int32)
    b = next(Loader(tokens, seq_len=4, batch_size=2, seed=0, shuffle=False))
    np.testing.assert_array_equal(b["inputs"], [[0, 1, 2, 3], [4, 5, 6, 7]])
    np.testing.assert_array_equal(b["targets"], [[1, 2, 3, 4], [5, 6, 7, 8]])


@pytest.mark.parametrize("stop", [2, 5, 7])  # mid-epoch, at the boundary, next epoch
def test_state_restore_is_exact(stop):
    tokens = TOKENS[:700]  # 43 records of 16: 5 batches of 8 per epoch
    kwargs = {"seq_len": 16, "batch_size": 8, "seed": 5}
    reference = _take(Loader(tokens, **kwargs), stop + 6)
    assert Loader(tokens, **kwargs).batches_per_epoch == 5
    first = Loader(tokens, **kwargs)
    _take(first, stop)
    state = json.loads(json.dumps(first.get_state()))
    assert state["step"] == stop
    resumed = Loader(tokens, **kwargs)
    resumed.set_state(state)
    _same(_take(resumed, 6), reference[stop:])
    # Rewinding an iterator that has read ahead also replays exactly.
    _take(first, 4)
    first.set_state(state)
    _same(_take(first, 6), reference[stop:])


def test_state_refuses_a_different_stream():
    state = Loader(TOKENS, seq_len=16, batch_size=8, seed=5).get_state()
    with pytest.raises(ConfigError, match="global_batch=8 but this run has global_batch=16"):
        Loader(TOKENS, seq_len=16, batch_size=16, seed=5).set_state(state)


def test_state_refuses_other_tokens_of_the_same_count():
    """Another data.seed (or an edited file of the same length): the counts matched, so
    the run resumed on other data, silently. The digest reads 16 windows of 4,096 tokens,
    all of this corpus: one changed token is seen. A state saved before the digest
    existed still resumes."""
    kwargs = {"seq_len": 16, "batch_size": 8, "seed": 5}
    state = Loader(TOKENS, **kwargs).get_state()
    edited = TOKENS.copy()
    edited[len(edited) // 2] ^= 1
    with pytest.raises(ConfigError, match="the training tokens differ from those the saved run was"):
        Loader(edited, **kwargs).set_state(state)
    Loader(TOKENS.copy(), **kwargs).set_state(state)
    Loader(edited, **kwargs).set_state({k: v for k, v in state.items() if k != "tokens_digest"})


def test_two_processes_union_is_the_global_batch():
    kwargs = {"seq_len": 16, "batch_size": 8, "seed": 2}
    single = _take(Loader(TOKENS, **kwargs), 12)
    parts = [_take(Loader(TOKENS, process_index=p, process_count=2, **kwargs), 12) for p in range(2)]
    assert parts[0][0]["inputs"].shape == (4, 16)
    joined = [{k: np.concatenate([a[k], b[k]]) for k in a} for a, b in zip(*parts, strict=True)]
    _same(joined, single)
    # A state saved by the single process resumes each shard at the same batch.
    one = Loader(TOKENS, **kwargs)
    _take(one, 5)
    shard = Loader(TOKENS, process_index=1, process_count=2, **kwargs)
    shard.set_state(one.get_state())
    _same(_take(shard, 3), parts[1][5:8])


def test_loader_errors():
    with pytest.raises(ConfigError, match=r"data split 'val' has 1000 tokens, fewer than one batch "
                                          r"needs \(batch 32 x seq_len 128 \+ 1\)"):
        Loader(TOKENS[:1000], seq_len=128, batch_size=32, seed=0, name="val")
    with pytest.raises(ConfigError, match="global_batch=6 is not divisible by the 4 processes"):
        Loader(TOKENS, seq_len=16, batch_size=6, seed=0, process_count=4)


def test_eval_batches_fixed_sequential_and_sharded():
    a = eval_batches(TOKENS, seq_len=16, batch_size=8, num_batches=3)
    b = eval_batches(TOKENS, seq_len=16, batch_size=8, num_batches=3)
    assert len(a) == 3
    _same(a, b)
    np.testing.assert_array_equal(a[0]["inputs"][0], TOKENS[:16])
    np.testing.assert_array_equal(a[1]["inputs"][0], TOKENS[8 * 16:9 * 16])
    halves = [eval_batches(TOKENS, seq_len=16, batch_size=8, num_batches=3, process_index=p,
                           process_count=2) for p in range(2)]
    _same([{k: np.concatenate([x[k], y[k]]) for k in x} for x, y in zip(*halves, strict=True)], a)
    # Asking for more batches than the split holds returns them all.
    assert len(eval_batches(TOKENS[:16 * 8 * 2 + 1], seq_len=16, batch_size=8, num_batches=9)) == 2
