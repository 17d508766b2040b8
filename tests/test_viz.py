"""Pictures and the ``mindpipe schedule`` command: files that open, text that says
the right numbers, and bad input that exits 2 and writes nothing."""

from __future__ import annotations

import builtins
import errno
import os
import re

import pytest

from mindpipe_jax import viz
from mindpipe_jax.cli import main
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.parallel.pipeline.schedules import DEFAULT_COST, get_schedule

mpl_image = pytest.importorskip("matplotlib.image")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _assert_png(path, min_width=600, min_height=200):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    height, width, channels = mpl_image.imread(path).shape
    assert min_width <= width <= 4000 and min_height <= height <= 2000
    assert channels in (3, 4)
    return width, height


# --- draw_schedule ----------------------------------------------------------------------------


@pytest.mark.parametrize("name, p, m, v", [("1f1b", 4, 8, 1), ("interleaved", 2, 4, 2), ("zbv", 4, 8, 2),
                                           ("dualpipev", 4, 8, 2)])
def test_draw_schedule_writes_a_png(tmp_path, name, p, m, v):
    out = tmp_path / f"{name}.png"
    assert viz.draw_schedule(get_schedule(name, p, m, v), out) == out
    _assert_png(out)


def test_weighted_picture_is_wider_than_unit_ticks(tmp_path):
    """With BW twice an F, 1F1B p=4 m=8 lasts 33 time units instead of 22 ticks."""
    schedule = get_schedule("1f1b", 4, 8)
    unit = _assert_png(viz.draw_schedule(schedule, tmp_path / "unit.png"))
    weighted = _assert_png(viz.draw_schedule(schedule, tmp_path / "w.png", cost=DEFAULT_COST))
    assert weighted[0] > unit[0]


@pytest.mark.parametrize("suffix, magic", [(".svg", b"<?xml"), (".pdf", b"%PDF")])
def test_draw_schedule_other_formats(tmp_path, suffix, magic):
    out = viz.draw_schedule(get_schedule("zb-h1", 2, 2), tmp_path / f"zb{suffix}", title="custom")
    assert out.read_bytes().startswith(magic)


@pytest.mark.parametrize("out, words", [("x.jpg", "must end in one of"), ("missing/x.png", "does not exist"),
                                        ("x", "no suffix"), ("a\nb.png", r"control character '\\n'")])
def test_draw_schedule_refuses_bad_paths(tmp_path, out, words):
    with pytest.raises(ConfigError, match=words):
        viz.draw_schedule(get_schedule("1f1b", 2, 2), tmp_path / out)
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_directory_is_refused_before_the_work(tmp_path, monkeypatch, capsys):
    """Checked with the other path checks, so `mindpipe schedule` prints nothing and `tune`
    measures nothing before a picture or --json it cannot write (root passes os.access
    everywhere, so the refusal is simulated for this one directory)."""
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: (str(path) != str(tmp_path)
                                                               and real_access(path, mode, **kw)))
    argv = ["schedule", "--schedule", "1f1b", "--stages", "2", "--microbatches", "4",
            "--out", str(tmp_path / "x.png")]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == (f"mindpipe: error: cannot write picture "
                                                   f"'{tmp_path / 'x.png'}': directory '{tmp_path}' "
                                                   f"is not writable by this user\n")
    assert main(["tune", "--measure", "0", "--json", str(tmp_path / "t.json")]) == 2
    assert capsys.readouterr().err == (f"mindpipe: error: cannot write --json '{tmp_path / 't.json'}': "
                                       f"directory '{tmp_path}' is not writable by this user\n")
    assert list(tmp_path.iterdir()) == []


def test_a_write_the_checks_could_not_foresee_is_one_line(tmp_path, monkeypatch, capsys):
    """A pseudo-filesystem (/proc) or permissions changed meanwhile: the write itself fails
    with an OSError that is not about room; the picture command says so in one line."""
    from mindpipe_jax import atomic_write

    def refuse(path, content):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    monkeypatch.setattr(atomic_write, "write_atomically", refuse)
    out = tmp_path / "x.png"
    assert main(["schedule", "--schedule", "1f1b", "--stages", "2", "--microbatches", "4",
                 "--out", str(out)]) == 2
    assert capsys.readouterr().err == f"mindpipe: error: cannot write picture '{out}': permission denied\n"
    assert list(tmp_path.iterdir()) == []


def test_missing_matplotlib_is_a_config_error(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.split(".")[0] == "matplotlib":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(ConfigError, match=r"pip install 'mindpipe-jax\[plots\]'"):
        viz.draw_schedule(get_schedule("1f1b", 2, 2), tmp_path / "x.png")
    assert list(tmp_path.iterdir()) == []


def test_schedule_summary_numbers():
    text = viz.schedule_summary(get_schedule("zb-h1", 4, 8))
    assert "s0: F0 F1 F2 F3" in text
    assert "27 ticks" in text and "0.111" in text          # (p-1)/(3m+p-1) = 3/27
    assert "s0=4  s1=3  s2=2  s3=1" in text                # live activations, like 1F1B
    assert "peak pending W:        s0=1  s1=2  s2=3  s3=4" in text


# --- mindpipe schedule ------------------------------------------------------------------------


def test_cli_schedule_prints_timeline_and_bubble(capsys):
    assert main(["schedule", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8"]) == 0
    out = capsys.readouterr().out
    assert "s0: F0" in out and "BW7" in out
    assert "22 ticks" in out
    assert "bubble fraction:       0.273" in out             # 3/11 in unit ticks
    assert "bubble (weighted):     0.273" in out             # and with BW = 2 F
    assert "s0=4  s1=3  s2=2  s3=1" in out
    assert "wrote" not in out


def test_cli_schedule_split_last_splits_only_the_tail(capsys):
    assert main(["schedule", "--schedule", "zb-h1", "--stages", "4", "--microbatches", "8",
                 "--split-last", "4"]) == 0
    out = capsys.readouterr().out
    assert "s0: F0  F1  F2  F3  ..  ..  ..  BW0" in out  # microbatches 0-3: one fused backward
    tasks = set(re.findall(r"\b(B|W|BW)(\d)\b", out))
    assert {("B", "4"), ("W", "7"), ("BW", "3")} <= tasks and not {("B", "3"), ("W", "3")} & tasks
    assert "peak pending W:        s0=1  s1=2  s2=3  s3=4" in out


def test_cli_schedule_out_writes_the_picture(tmp_path, capsys):
    out = tmp_path / "il.png"
    argv = ["schedule", "--schedule", "interleaved", "--stages", "2", "--microbatches", "4",
            "--virtual", "2", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "F0a" in printed and "F0b" in printed
    assert printed.rstrip().endswith(f"wrote {out}")
    _assert_png(out)
    assert main([*argv, "--weighted"]) == 0
    _assert_png(out)


def test_cli_schedule_help(capsys):
    assert main(["schedule", "--help"]) == 0
    out = capsys.readouterr().out
    for word in ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev", "--stages", "--microbatches",
                 "--virtual",
                 "--out", "mindpipe schedule --schedule 1f1b --stages 4 --microbatches 8 --out"):
        assert word in out
    assert main(["--help"]) == 0
    assert "schedule" in capsys.readouterr().out


def test_schedule_summary_sets_the_analytic_figures_beside_the_measured_ones():
    text = viz.schedule_summary(get_schedule("zbv", 4, 16))
    assert "99 ticks" in text and "bubble fraction:       0.030" in text          # 3/99, measured
    assert "analytic bubble:       0.030 in ticks, 0.030 weighted" in text        # (p-1)/(6m+p-1)
    assert "analytic live:         8  (min(2m, 2p) chunks" in text               # 1F1B's 4 microbatches
    assert "s0=8  s1=8  s2=8  s3=8" in text
    text = viz.schedule_summary(get_schedule("dualpipev", 4, 10))
    assert "47 ticks" in text and "bubble (weighted):     0.048" in text          # 3/63 with F = B = W
    assert "analytic bubble:       0.032 in ticks, 0.048 weighted" in text        # 3/94 and 3/63
    assert "analytic live:         9  (2p + 1 chunks" in text
    # pairs as one unit: 3 (F&B + BW - 3W) = 3 (3 + 2 - 3) = 6 idle per device, 6/66
    assert "F&B pairs as one unit: 0.091 replayed, 0.091 analytic" in text
    # a schedule without a closed form prints no analytic lines
    assert "analytic" not in viz.schedule_summary(get_schedule("afapab", 2, 4, 2))


def test_cli_schedule_v_schedules(tmp_path, capsys):
    out = tmp_path / "dpv.png"
    assert main(["schedule", "--schedule", "dualpipev", "--stages", "4", "--microbatches", "8",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "# dualpipev: p=4 m=8 v=2" in printed and "F&B pairs as one unit" in printed
    _assert_png(out)
    assert main(["schedule", "--schedule", "zbv", "--stages", "3", "--microbatches", "7",
                 "--virtual", "2"]) == 0
    assert "analytic bubble:       0.045 in ticks" in capsys.readouterr().out   # 2/(6*7+3-1)


BAD = {
    "unknown schedule": (["--schedule", "zb-v", "--stages", "4", "--microbatches", "8"],
                         "unknown pipeline schedule 'zb-v'"),
    "zero stages": (["--schedule", "1f1b", "--stages", "0", "--microbatches", "8"], "--stages"),
    "word for stages": (["--schedule", "1f1b", "--stages", "four", "--microbatches", "8"], "'four'"),
    "zero microbatches": (["--schedule", "gpipe", "--stages", "2", "--microbatches", "0"], "--microbatches"),
    "m not divisible": (["--schedule", "interleaved", "--stages", "4", "--microbatches", "6",
                         "--virtual", "2"], "divisible"),
    "virtual on 1f1b": (["--schedule", "1f1b", "--stages", "2", "--microbatches", "4", "--virtual", "2"],
                        "virtual_stages"),
    "missing directory": (["--schedule", "1f1b", "--stages", "2", "--microbatches", "4",
                           "--out", "{tmp}/nope/x.png"], "does not exist"),
    "bad extension": (["--schedule", "1f1b", "--stages", "2", "--microbatches", "4",
                       "--out", "{tmp}/x.jpg"], ".png, .svg, .pdf"),
    "dualpipev m < 2p": (["--schedule", "dualpipev", "--stages", "3", "--microbatches", "5"],
                         "dualpipev needs at least 2p microbatches: m=5 with p=3 stages (use m >= 6)"),
    "virtual 3 on zbv": (["--schedule", "zbv", "--stages", "4", "--microbatches", "8", "--virtual", "3"],
                         "(virtual_stages=2), got 3"),
    "virtual 1 on dualpipev": (["--schedule", "dualpipev", "--stages", "2", "--microbatches", "4",
                                "--virtual", "1"], "(virtual_stages=2), got 1"),
    "negative split tail": (["--schedule", "zb-h1", "--stages", "2", "--microbatches", "4",
                             "--split-last", "-1"], "--split-last must be an integer >= 0, got '-1'"),
    "weighted without a picture": (["--schedule", "1f1b", "--stages", "2", "--microbatches", "4",
                                    "--weighted"], "--weighted sizes the picture's boxes by duration"),
    "split tail of an unsplit schedule": (["--schedule", "1f1b", "--stages", "4", "--microbatches", "8",
                                           "--split-last", "2"],
                                          "split_last=2: schedule '1f1b' does not split its backwards"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_cli_schedule_bad_input_is_one_line_exit_2(case, tmp_path, capsys):
    args, words = BAD[case]
    argv = ["schedule", *(a.replace("{tmp}", str(tmp_path)) for a in args)]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""                                # nothing printed before the error
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mindpipe: error: ") and words in lines[0]
    assert list(tmp_path.iterdir()) == []                    # nothing written
