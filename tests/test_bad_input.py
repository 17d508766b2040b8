"""Every user mistake the core knows of: one-line ConfigError naming the value, nothing written."""

import numpy as np
import pytest

import mindpipe_jax as mp
from mindpipe_jax.errors import ConfigError

TINY = ("model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.seq_len=32",
        "train.global_batch=16", "train.steps=2", "train.progress=false", "train.eval_every=0",
        "parallel.simulate_cpu_devices=0")


def _files(tmp_path):
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "empty.txt").write_bytes(b"")
    np.save(tmp_path / "big_ids.npy", np.arange(5000, dtype=np.int32) % 300)
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    (tmp_path / "tokens.csv").write_text("1,2,3")
    # A directory that already holds someone else's files.
    (tmp_path / "foreign" / "checkpoints").mkdir(parents=True)
    (tmp_path / "foreign" / "checkpoints" / "notes.txt").write_text("not a checkpoint")


CASES = [
    # (overrides, substring the one-line message must contain)
    (["train.stepz=1"], "train.stepz"),
    (["train.steps=abc"], "'abc'"),
    (["train.steps=0"], "train.steps=0"),
    (["optim.lr=-1.0"], "optim.lr=-1.0"),
    (["parallel.schedule=zigzag"], "'zigzag'"),
    (["parallel.data=3"], "data=3"),
    (["parallel.data=-1", "parallel.tensor=-1"], "only one axis"),
    (["train.global_batch=12", "parallel.data=8"], "train.global_batch=12"),
    (["model.n_layers=3", "parallel.pipe=2", "parallel.data=4"], "model.n_layers=3"),
    (["parallel.pipe=2", "parallel.data=4", "model.dropout=0.1"], "model.dropout=0.1"),
    (["parallel.pipe=2", "parallel.data=4", "parallel.schedule=afapab"], "afapab"),
    (["parallel.pipe=2", "parallel.data=4", "parallel.virtual_stages=2"], "virtual"),
    (["parallel.pipe=2", "parallel.data=4", "parallel.microbatches=3"], "microbatches"),
    (["parallel.subnet=2", "parallel.data=4"], "subnet=2"),
    (["parallel.pipe=2", "parallel.data=4", "parallel.stage_layers=[1, 2]"], "[1, 2]"),
    (["model.d_model=30", "model.n_heads=4"], "model.d_model=30"),
    (["model.n_heads=3", "model.d_model=48", "parallel.tensor=2", "parallel.data=4"], "heads=3"),
    (["data.source=text", "data.path={tmp}/missing"], "missing"),
    (["data.source=text", "data.path={tmp}/empty_dir"], "empty_dir"),
    (["data.source=text", "data.path={tmp}/empty.txt"], "empty.txt"),
    (["data.source=tokens", "data.path={tmp}/big_ids.npy"], "299"),
    (["data.source=tokens", "data.path={tmp}/odd.bin"], "odd.bin"),
    (["data.source=tokens", "data.path={tmp}/tokens.csv"], "tokens.csv"),
    (["data.source=tokens"], "data.path"),
    (["train.deterministic=true", "parallel.tensor=2", "parallel.data=4"], "tensor=2"),
    (["train.out_dir={tmp}/foreign"], "foreign"),
]


@pytest.mark.parametrize("overrides,needle", CASES, ids=[c[1] for c in CASES])
def test_bad_input_is_one_clear_line_and_writes_nothing(tmp_path, overrides, needle):
    _files(tmp_path)
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    out = tmp_path / "out"
    args = [o.replace("{tmp}", str(tmp_path)) for o in overrides]
    if not any(a.startswith("train.out_dir=") for a in args):
        args.append(f"train.out_dir={out}")
    with pytest.raises(ConfigError) as err:
        mp.train(None, None, mp.Config(), *TINY, *args)
    message = str(err.value)
    assert "\n" not in message and needle.replace("{tmp}", str(tmp_path)) in message, message
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before  # nothing written


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
