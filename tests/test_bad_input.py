"""Every user mistake the core knows of, through the Python API and the command line.

Each case must give one line naming the bad value (``ConfigError`` from
``mindpipe_jax.train``; ``mindpipe: error: ...`` on stderr and exit status 2 from
``mindpipe train``, no traceback) and leave every file under the test's
directory exactly as it was: same names, same bytes, same modification times.
A few mistakes can only be made from Python (a custom module, a wrong argument
type); they run through the API only.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mindpipe_jax as mp
from mindpipe_jax.cli import main
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.train.checkpoint import COMMIT_MARKER

TINY = ("model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.seq_len=32",
        "train.global_batch=16", "train.steps=2", "train.progress=false", "train.eval_every=0",
        "train.tensorboard=false", "parallel.simulate_cpu_devices=0")


class Bigram(nnx.Module):
    """A fine model for data/tensor parallelism that has no embed/blocks/head for a pipeline."""

    def __init__(self, rngs: nnx.Rngs):
        self.table = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (256, 256)))

    def __call__(self, tokens):
        return jnp.take(self.table[...], tokens, axis=0)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A complete tiny run (one committed checkpoint at step 2) to copy into cases."""
    out = tmp_path_factory.mktemp("finished") / "run"
    mp.train(None, None, mp.Config(), *TINY, f"train.out_dir={out}")
    assert (out / "checkpoints" / "2" / COMMIT_MARKER).is_file()
    return out


def _files(tmp_path: Path, finished: Path, args: list[str]) -> None:
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "a_file").write_text("not a directory")
    np.save(tmp_path / "big_ids.npy", np.arange(5000, dtype=np.int32) % 300)
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    (tmp_path / "tokens.csv").write_text("1,2,3")
    # A directory that already holds someone else's files.
    (tmp_path / "foreign" / "checkpoints").mkdir(parents=True)
    (tmp_path / "foreign" / "checkpoints" / "notes.txt").write_text("not a checkpoint")
    joined = " ".join(args)
    if "{tmp}/done" in joined:  # a finished run at step 2
        shutil.copytree(finished, tmp_path / "done")
    for name, damage in (("flipped", _flip_bytes), ("truncated", _truncate)):
        if "{tmp}/" + name in joined:  # its array data damaged
            shutil.copytree(finished, tmp_path / name)
            # The largest data file of orbax's OCDBT store: array bytes (its small files
            # are index nodes, whose damage orbax reports itself).
            data = max((f for f in (tmp_path / name / "checkpoints" / "2" / "state").rglob("*")
                        if f.is_file() and f.parent.name == "d"), key=lambda f: f.stat().st_size)
            data.write_bytes(damage(data.read_bytes()))
    if "{tmp}/bad_meta" in joined:  # its config/fingerprint record not JSON
        shutil.copytree(finished, tmp_path / "bad_meta")
        for f in (tmp_path / "bad_meta" / "checkpoints" / "2" / "meta").rglob("*"):
            if f.is_file():
                f.write_text("{not json")
    if "{tmp}/partial" in joined:  # killed during its first save: only orbax's temporary dir
        tmp_step = tmp_path / "partial" / "checkpoints" / "2.orbax-checkpoint-tmp-1700000000"
        shutil.copytree(finished / "checkpoints" / "2", tmp_step)
        (tmp_step / COMMIT_MARKER).unlink()


def _flip_bytes(data: bytes) -> bytes:
    # One changed byte: it moves exactly one uint32 word of the checksum by a nonzero
    # amount, so it cannot cancel out (several changed bytes could). In raw array bytes
    # orbax restores it silently as other numbers and only the checksum sees it; where
    # the store's layout puts encoded chunk bytes at that offset, the decoder refuses.
    mid = len(data) // 2
    return data[:mid] + bytes([data[mid] ^ 0x01]) + data[mid + 1:]


def _truncate(data: bytes) -> bytes:
    return data[: len(data) // 2]


# (id, overrides, substring the one-line message must contain, API-only keyword arguments)
CASES = [
    ("unknown key", ["train.stepz=1"], "train.stepz", None),
    ("wrong type", ["train.steps=abc"], "'abc'", None),
    ("out of range", ["train.steps=0"], "train.steps=0", None),
    ("negative lr", ["optim.lr=-1.0"], "optim.lr=-1.0", None),
    ("bad schedule", ["parallel.schedule=zigzag"], "'zigzag'", None),
    ("bad nonfinite policy", ["train.nonfinite=ignore"], "'ignore'", None),
    ("mesh product", ["parallel.data=3"], "data=3", None),
    ("mesh larger than devices", ["parallel.data=16", "parallel.tensor=1"], "there are 8 devices", None),
    ("mesh does not divide devices", ["parallel.fsdp=3"], "multiple of 3", None),
    ("two fill axes", ["parallel.data=-1", "parallel.tensor=-1"], "only one axis", None),
    ("batch not divisible", ["train.global_batch=12", "parallel.data=8"], "train.global_batch=12", None),
    ("layers vs stages", ["model.n_layers=3", "parallel.pipe=2", "parallel.data=4"], "model.n_layers=3",
     None),
    ("dropout in a pipeline", ["parallel.pipe=2", "parallel.data=4", "model.dropout=0.1"],
     "model.dropout=0.1", None),
    ("negative sync bucket", ["parallel.pipe=2", "parallel.data=4", "parallel.schedule=afapab",
                              "parallel.sync_bucket_mb=-1"], "sync_bucket_mb=-1", None),
    ("virtual stages", ["parallel.pipe=2", "parallel.data=4", "parallel.virtual_stages=2"], "virtual",
     None),
    ("microbatches", ["parallel.pipe=2", "parallel.data=4", "parallel.microbatches=3"], "microbatches",
     None),
    ("unbuilt axis", ["parallel.subnet=2", "parallel.data=4"], "subnet=2", None),
    ("expert axis with a dense model", ["parallel.expert=2", "parallel.data=4"], "model.n_experts", None),
    ("experts vs expert axis", ["model.n_experts=6", "parallel.expert=4", "parallel.data=2"],
     "model.n_experts=6", None),
    ("top_k above n_experts", ["model.n_experts=4", "model.top_k=5"], "model.top_k=5", None),
    ("capacity factor", ["model.n_experts=4", "model.capacity_factor=0.0"], "capacity_factor=0.0", None),
    ("stage layers", ["parallel.pipe=2", "parallel.data=4", "parallel.stage_layers=[1, 2]"], "[1, 2]",
     None),
    ("heads vs d_model", ["model.d_model=30", "model.n_heads=4"], "model.d_model=30", None),
    ("attention kernel name", ["model.attention=flash"], "'flash'", None),
    ("cudnn attention in float32", ["model.attention=cudnn"], "model.dtype bfloat16", None),
    ("cudnn attention without a GPU", ["model.attention=cudnn", "model.dtype=bfloat16"], "devices are cpu",
     None),
    ("heads vs tensor", ["model.n_heads=3", "model.d_model=48", "parallel.tensor=2", "parallel.data=4"],
     "heads=3", None),
    ("missing data path", ["data.source=text", "data.path={tmp}/missing"], "missing", None),
    ("empty data dir", ["data.source=text", "data.path={tmp}/empty_dir"], "empty_dir", None),
    ("empty data file", ["data.source=text", "data.path={tmp}/empty.txt"], "empty.txt", None),
    ("token ids above vocabulary", ["data.source=tokens", "data.path={tmp}/big_ids.npy"], "299", None),
    ("odd token file", ["data.source=tokens", "data.path={tmp}/odd.bin"], "odd.bin", None),
    ("token file type", ["data.source=tokens", "data.path={tmp}/tokens.csv"], "tokens.csv", None),
    ("tokens without path", ["data.source=tokens"], "data.path", None),
    ("deterministic with tensor", ["train.deterministic=true", "parallel.tensor=2", "parallel.data=4"],
     "tensor=2", None),
    ("out_dir of someone else", ["train.out_dir={tmp}/foreign"], "foreign", None),
    ("out_dir is a file", ["train.out_dir={tmp}/a_file"], "not a directory", None),
    ("existing run without resume", ["train.out_dir={tmp}/done", "train.steps=4"], "train.resume=true",
     None),
    ("foreign checkpoint: different model",
     ["train.out_dir={tmp}/done", "train.steps=4", "train.resume=true", "model.d_model=64"],
     "different model", None),
    ("checkpoint with changed bytes", ["train.out_dir={tmp}/flipped", "train.steps=4", "train.resume=true"],
     ("do not match the checksum", "could not be restored"), None),
    ("truncated checkpoint", ["train.out_dir={tmp}/truncated", "train.steps=4", "train.resume=true"],
     "could not be restored", None),
    ("corrupt checkpoint metadata", ["train.out_dir={tmp}/bad_meta", "train.steps=4", "train.resume=true"],
     "unreadable", None),
    ("resume value", ["train.resume=yes"], "valid: true, false, 'auto'", None),
    ("resume with nothing to resume", ["train.out_dir={tmp}/never_ran", "train.resume=true"],
     "nothing to resume", None),
    ("resume from an interrupted first save", ["train.out_dir={tmp}/partial", "train.resume=true"],
     "incomplete checkpoint", None),
    ("resume a finished run", ["train.out_dir={tmp}/done", "train.resume=true"], "train.steps above 2",
     None),
    ("tuner decision interval", ["tuner.every=0"], "tuner.every=0", None),
    ("tuner threshold", ["tuner.threshold=-0.1"], "tuner.threshold=-0.1", None),
    ("tuner ema", ["tuner.ema=1.0"], "tuner.ema=1.0", None),
    ("tuner learning-rate rule", ["tuner.lr_scaling=cubic"], "'cubic'", None),
    ("tuner batch sizes", ["tuner.batch_sizes=[16, 0]"], "tuner.batch_sizes=[16, 0]", None),
    ("tuner batch range", ["tuner.min_batch=64", "tuner.max_batch=32"], "tuner.min_batch=64", None),
    ("coordinator without port", ["distributed.coordinator=nohost", "distributed.num_processes=2",
                                  "distributed.process_id=0"], "host:port", None),
    ("process id out of range", ["distributed.coordinator=127.0.0.1:1", "distributed.num_processes=2",
                                 "distributed.process_id=2"], "process_id=2", None),
    ("model without the pipeline contract", ["parallel.pipe=2", "parallel.data=4"], "pipeline contract",
     {"model": Bigram}),
    ("model of the wrong type", [], "got int", {"model": 42}),
    ("data of the wrong type", [], "got float", {"data": 3.5}),
]
RUNS = [(c, via) for c in CASES for via in (("api",) if c[3] else ("api", "cli"))]


def _snapshot(root: Path) -> dict[str, tuple]:
    """Every path under ``root``: (size, mtime_ns, bytes) for files; directories as such."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.stat()
        out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns, p.read_bytes()) if p.is_file() \
            else ("dir", st.st_mtime_ns)
    return out


@pytest.mark.parametrize("case,via", RUNS, ids=[f"{c[0]}-{via}" for c, via in RUNS])
def test_bad_input_is_one_clear_line_and_writes_nothing(case, via, tmp_path, finished_run, capsys):
    _, overrides, needle, api_args = case
    _files(tmp_path, finished_run, overrides)
    args = [o.replace("{tmp}", str(tmp_path)) for o in overrides]
    if not any(a.startswith("train.out_dir=") for a in args):
        args.append(f"train.out_dir={tmp_path / 'out'}")
    before = _snapshot(tmp_path)
    if via == "api":
        with pytest.raises(ConfigError) as err:
            mp.train(api_args.get("model") if api_args else None, api_args.get("data") if api_args else None,
                     mp.Config(), *TINY, *args)
        message = str(err.value)
    else:
        capsys.readouterr()
        code = main(["train", *TINY, *args])
        stderr = capsys.readouterr().err
        assert code == 2, stderr
        assert stderr.count("\n") == 1 and stderr.startswith("mindpipe: error: "), stderr
        assert "Traceback" not in stderr
        message = stderr.removeprefix("mindpipe: error: ").rstrip("\n")
    needles = (needle,) if isinstance(needle, str) else needle
    assert "\n" not in message and any(n in message for n in needles), message
    assert _snapshot(tmp_path) == before  # nothing written, nothing modified


def test_at_least_twenty_kinds_of_mistake_through_both_entry_points():
    assert len({c[0] for c in CASES if not c[3]}) >= 20


def test_launcher_variables_that_are_not_numbers(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("MINDPIPE_COORDINATOR", "127.0.0.1:12355")
    monkeypatch.setenv("MINDPIPE_NUM_PROCESSES", "two")
    assert main(["train", *TINY, f"train.out_dir={tmp_path / 'out'}"]) == 2
    assert capsys.readouterr().err.strip() == \
        "mindpipe: error: environment variable MINDPIPE_NUM_PROCESSES='two' must be an integer"
    assert list(tmp_path.iterdir()) == []


def test_bad_config_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 3")
    with pytest.raises(ConfigError, match="not valid TOML"):
        mp.load_config(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        mp.load_config(tmp_path / "nope.toml")
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[model]\nwidth = 3\n")
    with pytest.raises(ConfigError, match="width"):
        mp.load_config(unknown)
