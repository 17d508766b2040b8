"""The examples run: each notebook executes top to bottom without a cell error, and
``examples/train_custom_model.py`` trains and exits 0.

The notebooks run in a fresh ``python3`` kernel (working directory ``examples/``),
which must be the interpreter running these tests — the one where mindpipe_jax is
installed. When no ``python3`` kernelspec is found, or the one found names another
interpreter, a throwaway kernelspec for ``sys.executable`` is written to a temporary
directory and put first on ``JUPYTER_PATH``.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
NOTEBOOKS = ["quickstart.ipynb", "pipeline_1f1b.ipynb", "afapab_3d.ipynb", "epara_tuner.ipynb",
             "supernet_search.ipynb"]
KERNEL = "python3"
CELL_TIMEOUT_S = 300


def _kernel_runs_this_python(name: str) -> bool:
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        argv = KernelSpecManager().get_kernel_spec(name).argv
    except NoSuchKernel:
        return False
    # jupyter_client itself swaps a bare "python"/"python3" for sys.executable.
    bare = {"python", f"python{sys.version_info[0]}", "python{}.{}".format(*sys.version_info[:2])}
    return bool(argv) and (argv[0] in bare or os.path.realpath(argv[0]) == os.path.realpath(sys.executable))


@pytest.fixture(scope="module")
def kernel_name(tmp_path_factory):
    if _kernel_runs_this_python(KERNEL):
        yield KERNEL
        return
    from ipykernel.kernelspec import install

    prefix = tmp_path_factory.mktemp("kernelspec")
    install(kernel_name=KERNEL, prefix=str(prefix))  # argv: [sys.executable, -m, ipykernel_launcher, ...]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_PATH", os.pathsep.join(
            p for p in (str(prefix / "share" / "jupyter"), os.environ.get("JUPYTER_PATH")) if p))
        assert _kernel_runs_this_python(KERNEL)
        yield KERNEL


def test_notebooks_are_stored_without_outputs():
    for name in NOTEBOOKS:
        nb = nbformat.read(EXAMPLES / name, as_version=4)
        nbformat.validate(nb)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert code, name
        assert all(not c.outputs and c.execution_count is None for c in code), f"{name} has outputs"


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, kernel_name, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the kernel's tempfile.mkdtemp() lands here
    nb = nbformat.read(EXAMPLES / name, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name=kernel_name,
                                     resources={"metadata": {"path": str(EXAMPLES)}})
    client.execute()  # raises CellExecutionError, naming the cell, on the first error
    errors = [out for cell in nb.cells if cell.cell_type == "code"
              for out in cell.outputs if out.output_type == "error"]
    assert not errors, errors
    assert any(tmp_path.iterdir()), "the notebook should write its runs under a temporary directory"


@pytest.mark.slow
def test_train_custom_model_script(tmp_path):
    out_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_custom_model.py"), "--steps", "10", "--out-dir", str(out_dir)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "final train loss" in proc.stdout
    assert (out_dir / "metrics.jsonl").is_file()
    assert (out_dir / "checkpoints" / "10").is_dir()


@pytest.mark.slow
def test_bring_your_own_model_script(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "bring_your_own_model.py"), "--steps", "2",
         "--out-dir", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    losses = [line.split("->")[1].split()[0] for line in proc.stdout.splitlines() if " -> " in line]
    assert len(losses) == 3  # data x tensor, fsdp, pipeline x tensor: one run each
    assert len({round(float(x), 3) for x in losses}) == 1  # the same training on every layout
    for run in range(3):
        assert (tmp_path / str(run) / "checkpoints" / "2").is_dir()


@pytest.mark.parametrize("script, args, words", [
    ("train_custom_model.py", ["--steps", "0"], "train.steps=0 must be > 0"),
    ("bring_your_own_model.py", ["--steps", "1", "--out-dir", "{tmp}/a_file"], "is a file, not a directory"),
    ("supernet_search.py", ["--subnet", "3"], "need a multiple of 3 devices"),
])
def test_an_example_given_a_bad_argument_says_so_in_one_line(script, args, words, tmp_path):
    """The examples are run from a shell like `mindpipe`: a bad argument is one line and
    exit status 2, as the command line's, not a ConfigError traceback."""
    (tmp_path / "a_file").write_text("")
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), *(a.replace("{tmp}", str(tmp_path))
                                                                    for a in args)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert proc.stderr.count("\n") == 1 and f"{script}: error: " in proc.stderr and words in proc.stderr, \
        proc.stderr
    assert proc.stdout == "" and sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]
