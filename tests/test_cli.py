"""The ``mindpipe`` command line: help, ``config``, one-line errors, a tiny training run.

Most checks call ``main([...])`` in-process (the test session already has 8 CPU
devices). A few spawn ``python -m mindpipe_jax`` to check real exit statuses and
stderr, where the CLI simulates its own 8 CPU devices; each spawn costs a JAX
import, so they are kept few and the model tiny.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import mindpipe_jax
from mindpipe_jax.cli import main, to_toml
from mindpipe_jax.config import Config, from_dict, load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "examples" / "configs"
TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.seq_len=32",
        "train.steps=4", "train.global_batch=8", "train.eval_every=2", "train.eval_batches=1",
        "train.log_every=2", "train.progress=false", "train.tensorboard=false"]


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    return subprocess.run([sys.executable, "-m", "mindpipe_jax", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


# --- help ------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["config", "--help"]])
def test_help_exits_0_and_explains_overrides(argv, capsys):
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "section.key=value" in out and "overrides" in out
    assert "TOML literal" in out and "--config" in out
    for section in ("model", "data", "parallel", "optim", "train", "distributed"):
        assert f"  {section}:" in out  # every section is listed with its keys
    assert "mindpipe_jax/config.py" in out  # where the defaults come from


def test_top_level_help_lists_subcommands_and_examples(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "train" in out and "config" in out
    assert "mindpipe train parallel.tensor=2 train.steps=50" in out
    assert "mindpipe train --config examples/configs/tiny.toml" in out


# argparse's usage errors printed its usage block above the error line before 2026-12-07
USAGE_ERRORS = {
    "no command": ([], "mindpipe: error: no command given; choose one of: train, config"),
    "unknown command": (["trian"], "invalid choice: 'trian' (choose from 'train'"),
    "unknown option": (["train", "--bogus"], "mindpipe train: error: unrecognized arguments: --bogus"),
    "option without its value": (["tune", "--batches"], "argument --batches: expected one argument"),
    # the overrides positional (nargs="*") is not listed as required
    "missing required": (["search"], "search: error: the following arguments are required: RUN_DIR;"),
}


@pytest.mark.parametrize("case", list(USAGE_ERRORS), ids=list(USAGE_ERRORS))
def test_usage_errors_are_one_line_pointing_at_help(case, capsys):
    argv, needle = USAGE_ERRORS[case]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and needle in err, err
    command = "mindpipe" if argv[:1] in ([], ["trian"]) else f"mindpipe {argv[0]}"
    assert err.rstrip().endswith(f"; see `{command} --help`"), err


# --- config ----------------------------------------------------------------------------------


def test_config_prints_the_override(capsys):
    assert main(["config", "train.steps=7"]) == 0
    out = capsys.readouterr().out
    assert "steps = 7" in out
    assert "global_batch = 32" in out  # untouched keys show their defaults


def test_config_output_loads_back_to_the_same_config(tmp_path, capsys):
    overrides = ["parallel.tensor=2", "parallel.data=4", "train.steps=7", "optim.lr=3e-4",
                 'train.out_dir="runs/a \\"quoted\\" dir"', "model.dtype=bfloat16", "train.resume=true"]
    for flag in ([], ["--no-comments"]):
        assert main(["config", *flag, *overrides]) == 0
        path = tmp_path / "resolved.toml"
        path.write_text(capsys.readouterr().out)
        assert load_config(path) == load_config(None, overrides)


def test_to_toml_writes_every_key_of_every_section():
    parsed = tomllib.loads(to_toml(Config()))
    expected = Config().to_dict()
    assert {k: set(v) for k, v in parsed.items()} == {k: set(v) for k, v in expected.items()}
    assert from_dict(parsed) == Config()  # TOML has no tuples: lists read back as tuples


def test_options_and_overrides_mix_in_any_order(capsys):
    argv = ["config", "train.steps=5", "--config", str(CONFIGS / "tiny.toml"), "train.global_batch=8"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "steps = 5" in out and "global_batch = 8" in out
    assert "d_model = 64" in out  # from tiny.toml


# --- example configs -------------------------------------------------------------------------


def test_an_out_dir_under_home_is_expanded(tmp_path, monkeypatch):
    """A config file's out_dir = "~/runs/x" is no shell word, so nothing expanded it: the
    run went into a directory named "~" under the working directory."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    config = tmp_path / "run.toml"
    config.write_text('[train]\nout_dir = "~/runs/x"\n')
    assert load_config(config).train.out_dir == str(tmp_path / "home" / "runs" / "x")
    assert Config().replace("train.out_dir=~/y").train.out_dir == str(tmp_path / "home" / "y")


def test_default_toml_is_exactly_the_built_in_defaults():
    assert load_config(CONFIGS / "default.toml") == Config()


@pytest.mark.parametrize("name", ["default", "tiny", "tensor_parallel", "fsdp"])
def test_example_configs_load(name):
    cfg = load_config(CONFIGS / f"{name}.toml")
    if name == "tensor_parallel":
        assert (cfg.parallel.data, cfg.parallel.tensor) == (4, 2)
    if name == "fsdp":
        assert (cfg.parallel.data, cfg.parallel.fsdp) == (2, 4)
    if name == "tiny":
        assert cfg.model.d_model == 64 and cfg.train.steps == 30 and cfg.data.source == "stdlib"


# --- one-line errors, exit 2, nothing written --------------------------------------------------

BAD = {
    "unknown key": (["train.stepz=1"], "train.stepz"),
    "wrong type": (["train.steps=abc"], "'abc'"),
    "bad literal": (["parallel.schedule=foo"], "'foo'"),
    "mesh product": (["parallel.data=3", "parallel.tensor=1"], "data=3"),
    "batch not divisible": (["train.global_batch=12", "parallel.data=8"], "train.global_batch=12"),
    "heads vs tensor": (["model.n_heads=3", "model.d_model=48", "parallel.tensor=2", "parallel.data=4"],
                        "heads=3"),
    "missing data path": (["data.source=text", "data.path=/nonexistent"], "/nonexistent"),
    "malformed override": (["train.steps"], "train.steps"),
    "unknown section": (["nosuch.key=1"], "nosuch"),
    "out of range": (["train.steps=0"], "train.steps=0"),
    # optax's Adam with eps=0 turns a zero gradient into 0/0 = NaN on the first step
    "adam eps": (["optim.eps=0"], "optim.eps=0 must be > 0"),
    # a list is unhashable: a TypeError traceback before 2026-12-07
    "semantics not a string": (["supernet.semantics=[1]"], "supernet.semantics=[1] is not valid"),
}


def _assert_one_line_error(err: str, needle: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("mindpipe: error:"), err
    assert needle in lines[0], err
    assert "Traceback" not in err


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_input_is_one_line_exit_2_and_writes_nothing(case, tmp_path, capsys):
    overrides, needle = BAD[case]
    out_dir = tmp_path / "run"
    code = main(["train", *TINY, f"train.out_dir={out_dir}", *overrides])
    captured = capsys.readouterr()
    assert code == 2
    _assert_one_line_error(captured.err, needle)
    assert not out_dir.exists()


def test_missing_config_file(tmp_path, capsys):
    missing = tmp_path / "nope.toml"
    assert main(["train", "--config", str(missing)]) == 2
    _assert_one_line_error(capsys.readouterr().err, "nope.toml")
    assert main(["config", "--config", str(missing)]) == 2
    _assert_one_line_error(capsys.readouterr().err, "nope.toml")


def test_invalid_toml_file(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 1\n")
    assert main(["config", "--config", str(bad)]) == 2
    _assert_one_line_error(capsys.readouterr().err, "not valid TOML")


def test_keyboard_interrupt_exits_130(monkeypatch, capsys):
    def interrupted(**_):
        raise KeyboardInterrupt

    monkeypatch.setattr(mindpipe_jax, "train", interrupted)
    assert main(["train", "train.steps=1"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "mindpipe: interrupted"


_SWALLOWED_CTRL_C = """
import gc, sys, time
from mindpipe_jax import _interrupt
_interrupt.raise_on_interrupt()
fired = []
def callback(phase, info):  # as a Ctrl-C landing in JAX's gc callback
    if not fired:
        fired.append(1)
        raise KeyboardInterrupt
gc.callbacks.append(callback)
try:
    gc.collect()
    time.sleep(20)
    print("ran to the end")
except KeyboardInterrupt:
    print("interrupted")
"""


def test_a_ctrl_c_python_would_swallow_still_interrupts_the_command():
    """`mindpipe schedule` interrupted ~3 s in: the KeyboardInterrupt was raised inside
    JAX's garbage-collector callback, where Python only prints "Exception ignored in ..."
    with a traceback; the command went on and exited 0. Now the report is dropped and the
    signal sent again, to be raised where the command handles it."""
    proc = subprocess.run([sys.executable, "-c", _SWALLOWED_CTRL_C], capture_output=True, text=True,
                          timeout=120)
    assert proc.stdout.strip() == "interrupted", (proc.stdout, proc.stderr)
    assert "Exception ignored" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_bugs_keep_their_traceback(monkeypatch):
    def broken(**_):
        raise RuntimeError("a bug")

    monkeypatch.setattr(mindpipe_jax, "train", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["train", "train.steps=1"])


# --- real processes: exit statuses, stderr, a tiny run ------------------------------------------


def test_python_m_help(tmp_path):
    proc = _run("--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "section.key=value" in proc.stdout


@pytest.mark.parametrize("case", ["unknown key", "mesh product"])
def test_process_exit_status_2_without_traceback(case, tmp_path):
    overrides, needle = BAD[case]
    out_dir = tmp_path / "run"
    proc = _run("train", *TINY, f"train.out_dir={out_dir}", *overrides, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    _assert_one_line_error(proc.stderr, needle)
    if case == "mesh product":
        assert "there are 8 devices" in proc.stderr  # the CLI simulates 8 CPU devices on its own
    assert not out_dir.exists()
    assert list(tmp_path.iterdir()) == []


def test_train_tiny_run(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(3000)))
    out_dir = tmp_path / "run"
    proc = _run("train", *TINY, "train.tensorboard=true", f"train.out_dir={out_dir}",
                "data.source=text", f"data.path={corpus}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    summary = proc.stdout.strip().splitlines()[-1]
    assert "final validation loss" in summary and str(out_dir) in summary
    val = float(summary.split("final validation loss ")[1].split()[0])
    assert 0 < val < 6  # a byte-level model starts near ln(256) = 5.55

    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4]
    assert abs(records[-1]["val_loss"] - val) < 1e-3
    steps = [p.name for p in (out_dir / "checkpoints").iterdir() if p.name.isdigit()]
    assert "4" in steps
    assert (out_dir / "config.json").is_file()

    # Training again into the same out_dir is refused (one line, exit 2) unless resuming.
    again = ["train", *TINY, f"train.out_dir={out_dir}", "data.source=text", f"data.path={corpus}"]
    assert main(again) == 2
    _assert_one_line_error(capsys.readouterr().err, "train.resume=true")


# --- the README's two commands and CI stay in step -----------------------------------------------


def test_readme_quick_start_and_ci_run_the_same_commands():
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("## Quick start")[1].split("\n## ")[0]
    blocks = [b.split("```")[0].strip() for b in quick.split("```bash\n")[1:]]
    assert blocks == ['pip install -e . && mindpipe train',
                      'pip install -e ".[dev]" && python -m pytest -n 2 -q']
    ci = (ROOT / ".ci" / "run").read_text()
    assert "set -euo pipefail" in ci
    assert 'python -m pip install -e ".[dev]"' in ci
    assert ci.rstrip().splitlines()[-1] == "python -m pytest -n 2 -q"
    assert os.access(ROOT / ".ci" / "run", os.X_OK)


@pytest.mark.parametrize("argv", [
    ["train", "train.out_dir={long}"],
    ["train", "--config", "{long}.toml"],
    ["search", "{long}"],
    ["schedule", "--schedule", "1f1b", "--stages", "2", "--microbatches", "4", "--out", "{long}.png"],
    ["tune", "--measure", "0", "--json", "{long}.json"],
], ids=["out_dir", "config", "search", "picture", "json"])
def test_a_path_too_long_for_the_filesystem_is_one_line(argv, tmp_path, capsys):
    """A name past the filesystem's 255 bytes: pathlib's exists()/is_file() raise it
    (only 'no such file' is read as False), and the command ended in a traceback."""
    long = str(tmp_path / ("a" * 300))
    assert main([a.replace("{long}", long) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    if argv[1].startswith("train.out_dir"):  # checked where the Python API's callers meet it too
        assert err == f"mindpipe: error: train.out_dir '{long}' cannot be used: file name too long; " \
                      f"choose another train.out_dir\n", err
    else:
        assert err.startswith("mindpipe: error: file name too long: '"), err
        assert "its longest name 30" in err and "bytes per name): choose a shorter path" in err, err
    assert list(tmp_path.iterdir()) == []


def test_a_path_this_user_may_not_look_at_is_one_line(tmp_path, monkeypatch, capsys):
    """pathlib's exists() raises PermissionError for a path under a directory this user
    cannot search (root passes every check, so the refusal is simulated for one path)."""
    config = tmp_path / "locked" / "job.toml"
    real_stat = os.stat

    def stat(path, *args, **kwargs):
        if str(path) == str(config):
            raise PermissionError(13, "Permission denied", str(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    assert main(["train", "--config", str(config), f"train.out_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err == (f"mindpipe: error: permission denied: '{config}'; check its permissions or choose "
                   f"another path\n"), err
    assert list(tmp_path.iterdir()) == []
