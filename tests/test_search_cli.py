"""``mindpipe search``: the search of a saved supernet, after ``mindpipe supernet``.

One tiny supernet is trained once through the command line (checkpoints at steps 2
and 4, the search at the end of training written to ``search.json``). Searching its
checkpoint again — from the command line, from Python, on another split of the
devices — must give the same top-k, bit for bit: the same subnets, the same
validation losses, the same parameter counts. Bad input is one line on stderr, exit
status 2, and nothing written.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

import mindpipe_jax as mp
from mindpipe_jax.cli import main
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.supernet import search_checkpoint

# Every test reads the module's `mindpipe supernet` run: one xdist worker runs them all,
# so the run is trained once, not once per worker (pytest -n 2 --dist loadgroup).
pytestmark = pytest.mark.xdist_group("search_cli")

TINY = ("model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.seq_len=32",
        'data.source="synthetic"', "data.synthetic_tokens=65536", "train.global_batch=16",
        "parallel.tensor=1", "parallel.simulate_cpu_devices=0")
SUPERNET = ("train.steps=4", "train.log_every=2", "train.checkpoint_every=2", "optim.lr=1e-2",
            "optim.warmup_steps=0", "parallel.subnet=4", "parallel.data=2",
            "supernet.subnets_per_step=4", "supernet.semantics=operator-causal",
            "supernet.search_population=6",
            "supernet.search_generations=2", "supernet.search_top_k=3",
            # Checkpoints and the search, not slicing: masked, one program instead of one
            # per shape (the search scores subnets masked on either path).
            "supernet.ladder_levels=0")


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def _table(stdout: str) -> list[str]:
    """The search table's rows (rank, val loss, params, subnet) from a command's output."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["rank", "val"])
    return lines[start:start + 1 + 3]


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, str]:
    """(out_dir, stdout) of `mindpipe supernet` (trains, searches, checkpoints)."""
    out_dir = tmp_path_factory.mktemp("search_cli") / "super"
    code, stdout, stderr = _cli("supernet", *TINY, *SUPERNET, f"train.out_dir={out_dir}")
    assert code == 0, stderr
    return out_dir, stdout


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory) -> Path:
    out_dir = tmp_path_factory.mktemp("search_cli_dense") / "dense"
    mp.train(None, None, mp.Config(), *TINY, "train.steps=2", "train.progress=false", "train.eval_every=0",
             "train.tensorboard=false", f"train.out_dir={out_dir}")
    return out_dir


def test_supernet_command_saves_checkpoints_and_its_search(run):
    out_dir, stdout = run
    assert sorted(p.name for p in (out_dir / "checkpoints").iterdir()) == ["2", "4"]
    saved = json.loads((out_dir / "search.json").read_text())
    assert saved["step"] == 4 and len(saved["top"]) == 3
    assert f"mindpipe search {out_dir}" in stdout


def test_search_command_gives_the_top_k_of_the_search_after_training(run):
    out_dir, train_stdout = run
    code, stdout, stderr = _cli("search", str(out_dir))
    assert code == 0 and stderr == "", stderr
    assert _table(stdout) == _table(train_stdout)  # what the command prints
    assert "done: searched step 4" in stdout
    # ... and bit for bit: subnets, losses (JSON floats round-trip exactly), parameter counts.
    saved = json.loads((out_dir / "search.json").read_text())
    result, cfg, step = search_checkpoint(out_dir)
    assert step == 4 and result.top == saved["top"]
    assert result.best_per_generation == saved["best_per_generation"]
    assert cfg.supernet.semantics == "operator-causal"  # the run's own config


def test_a_search_on_fewer_validation_batches_than_asked_says_so(run):
    # The split holds a few batches: asking for more scored on those, silently.
    out_dir, train_stdout = run
    assert "validation batches" not in train_stdout  # 2 asked, 2 used
    code, stdout, stderr = _cli("search", str(out_dir), "supernet.search_eval_batches=1000")
    assert code == 0 and stderr == "", stderr
    note = [line for line in stdout.splitlines() if "validation batches" in line]
    assert len(note) == 1 and note[0].endswith(
        "validation batches, all the validation split holds (supernet.search_eval_batches=1000)"), stdout
    assert 2 < int(note[0].split()[3]) < 1000


def test_same_top_k_on_another_split_and_a_different_earlier_step(run):
    out_dir, _ = run
    saved = json.loads((out_dir / "search.json").read_text())
    other, cfg, _ = search_checkpoint(out_dir, "parallel.subnet=1", "parallel.data=8")
    assert (cfg.parallel.subnet, cfg.parallel.data) == (1, 8)
    assert other.top == saved["top"]
    # The comparison can fail: the supernet of step 2 scores differently.
    earlier, _, step = search_checkpoint(out_dir, step=2)
    assert step == 2
    assert [t["loss"] for t in earlier.top] != [t["loss"] for t in saved["top"]]


def _bad_cases(run_dir: Path, dense: Path, tmp: Path) -> dict[str, tuple[list[str], str]]:
    (tmp / "empty").mkdir(exist_ok=True)
    (tmp / "a_file").write_text("not a run")
    return {
        "missing dir": (["search", str(tmp / "nope")], "does not exist"),
        "a file": (["search", str(tmp / "a_file")], "is not a directory"),
        "not a run": (["search", str(tmp / "empty")], "has no config.json"),
        "dense run": (["search", str(dense)], "checkpoint of a dense model"),
        "model change": (["search", str(run_dir), "model.d_model=64"],
                         "model.d_model=64: the supernet in"),
        "space change": (["search", str(run_dir), "supernet.ops=['gelu']"],
                         "was trained with supernet.ops=[\"gelu\", \"relu\", \"silu\"]"),
        # A key only training reads: it was accepted and ignored.
        "a training key": (["search", str(run_dir), "optim.lr=0.5"],
                           "optim.lr=0.5 has no effect on a search of a saved supernet"),
        "the semantics": (["search", str(run_dir), "supernet.semantics=sync"],
                          "supernet.semantics=\"sync\" has no effect on a search"),
        "unknown key": (["search", str(run_dir), "supernet.search_topk=2"], "unknown config key"),
        "bad value": (["search", str(run_dir), "supernet.search_population=1"], "search_population=1"),
        # It printed the search's first line, then "split 'val' has 0 tokens ... use a smaller
        # train.global_batch/model.seq_len or more data".
        "no validation split": (["search", str(run_dir), "data.val_fraction=0"],
                                "data.val_fraction=0 leaves no validation data, and a supernet run ranks"),
        "no such step": (["search", str(run_dir), "--step", "3"], "committed checkpoints at steps 2, 4"),
        "step not a number": (["search", str(run_dir), "--step", "last"], "--step must be an integer"),
        "pipe axis": (["search", str(run_dir), "parallel.pipe=2", "parallel.subnet=2"],
                      "fsdp, data and tensor only; got pipe=2"),
        "train into a run": (["supernet", *TINY, *SUPERNET, f"train.out_dir={run_dir}"],
                             "already holds checkpoints up to step 4"),
        "resume": (["supernet", *TINY, *SUPERNET, f"train.out_dir={tmp / 'new'}", "train.resume=true"],
                   "nothing to resume"),
        # A budget no subnet meets: said after the training, when the search found nothing.
        "budget below the smallest, training": (
            ["supernet", *TINY, *SUPERNET, f"train.out_dir={tmp / 'new'}", "supernet.search_max_params=5"],
            "no subnet of the space satisfies the parameter budget 5 (supernet.search_max_params); "
            "the smallest has "),
        "budget below the smallest, search": (["search", str(run_dir), "supernet.search_max_params=5"],
                                              "satisfies the parameter budget 5"),
    }


def test_bad_input_is_one_line_exit_2_and_writes_nothing(run, dense_run, tmp_path):
    run_dir, _ = run
    before = {d: _tree(d) for d in (run_dir, dense_run)}
    for case, (argv, needle) in _bad_cases(run_dir, dense_run, tmp_path).items():
        code, stdout, stderr = _cli(*argv)
        assert code == 2, (case, stdout, stderr)
        assert stderr.count("\n") == 1 and stderr.startswith("mindpipe: error: ") and needle in stderr, \
            (case, stderr)
    assert {d: _tree(d) for d in before} == before
    assert not (tmp_path / "new").exists()
    # A run killed before its first save: the config is there, no checkpoint.
    (tmp_path / "unsaved").mkdir()
    (tmp_path / "unsaved" / "config.json").write_text((run_dir / "config.json").read_text())
    with pytest.raises(ConfigError, match="holds no committed checkpoint"):
        search_checkpoint(tmp_path / "unsaved")


@pytest.mark.parametrize("path", [
    ("supernet.ladder_levels=0",),  # masked: one program
    # sliced: a program per shape met, compiled on first use; the largest checked ahead
    ("supernet.ladder_levels=2",),
    ("supernet.ladder_levels=2", "parallel.pipe=2", "parallel.subnet=2", "parallel.data=2",
     "parallel.microbatches=2", "supernet.semantics=sync"),
], ids=["masked", "sliced", "sliced-pipeline"])
def test_a_supernet_step_larger_than_the_hosts_memory_is_one_line_before_anything_is_written(tmp_path, path):
    """Its step is compiled ahead of the first step, and checked as the train step is
    (train/memory_fit.py): here ~TBs by the compiler's count, where the kernel killed the
    run at its first step without a word (status 137; `mindpipe supernet
    model.seq_len=4096` on the default sliced path, 24 GiB resident). A sliced step
    is checked at K copies of the largest subnet, the most a step can hold."""
    out = tmp_path / "big"
    code, stdout, stderr = _cli("supernet", *TINY, *SUPERNET, *path, "model.seq_len=4096",
                                "train.global_batch=2048", "data.synthetic_tokens=16777216",
                                f"train.out_dir={out}")
    assert code == 2, (stdout, stderr)
    assert stderr.count("\n") == 1 and "GiB free: it would be killed for it" in stderr, stderr
    remat = "parallel.stage_remat=full" if "parallel.pipe=2" in path else "model.remat=full"
    assert "lower train.global_batch, supernet.vmap_width or supernet.subnets_per_step" in stderr, stderr
    assert f"set {remat}," in stderr and "grad_accum" not in stderr, stderr
    assert not out.exists()


def test_a_users_supernet_is_named_with_the_way_to_search_it(tmp_path):
    """`mindpipe search` rebuilds only the reference SuperGPT: on a run of a supernet of the
    user's own it said "another supernet than SuperGPT ... pass the model that wrote it",
    which the command cannot take. Now it names the model and the Python call, and that
    call searches the run."""
    from byom_models import TwoOpSupernet

    out_dir = tmp_path / "theirs"
    cfg = mp.Config().replace("model.vocab_size=64", "model.seq_len=8", 'data.source="synthetic"',
                              "data.synthetic_tokens=65536", "train.steps=2", "train.global_batch=16",
                              "parallel.tensor=1", "parallel.simulate_cpu_devices=0",
                              "supernet.search_population=4", "supernet.search_generations=1",
                              f"train.out_dir={out_dir}")
    mp.train_supernet(TwoOpSupernet, None, cfg, checkpoint=True, search=False, log=None)
    before = _tree(out_dir)
    code, _, stderr = _cli("search", str(out_dir))
    assert code == 2 and stderr.count("\n") == 1, stderr
    assert (f"is of the supernet TwoOpSupernet, not the SuperGPT its config describes: search it from "
            f"Python with mindpipe_jax.search_checkpoint('{out_dir}', model=<TwoOpSupernet's factory>)"
            in stderr), stderr
    assert _tree(out_dir) == before
    result, _, step = mp.search_checkpoint(out_dir, model=TwoOpSupernet)
    assert step == 2 and result.top
