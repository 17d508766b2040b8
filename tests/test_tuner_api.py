"""Where the public ``train`` lives: mindpipe_jax/api.py composes the loop and the tuner,
and the imports between train/, tuner/ and api point one way (read from the source, no
training)."""

import ast
import inspect
from pathlib import Path

import mindpipe_jax as mp
from mindpipe_jax import api
from mindpipe_jax.train import loop

PACKAGE = Path(mp.__file__).parent


def imported_modules(path: Path) -> set[str]:
    """Every absolute mindpipe_jax module a file imports, at top level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in found if m.startswith("mindpipe_jax")}


def sources(sub: str) -> list[Path]:
    return sorted((PACKAGE / sub).rglob("*.py"))


def test_imports_point_one_way():
    for path in sources("train"):
        bad = {m for m in imported_modules(path) if m.startswith(("mindpipe_jax.tuner", "mindpipe_jax.api"))}
        assert not bad, f"{path.relative_to(PACKAGE)} imports {sorted(bad)}: train/ must not know the tuner"
    for path in sources("tuner"):
        bad = {m for m in imported_modules(path) if m.startswith("mindpipe_jax.api")}
        assert not bad, f"{path.relative_to(PACKAGE)} imports {sorted(bad)}: the tuner must not know api"
    both = [p.relative_to(PACKAGE).as_posix() for p in sorted(PACKAGE.rglob("*.py"))
            if any(m.startswith("mindpipe_jax.train.loop") for m in imported_modules(p))
            and any(m.startswith("mindpipe_jax.tuner") for m in imported_modules(p))]
    assert both == ["api.py"]


def test_public_train_is_the_loop_with_the_tuner():
    assert mp.train is api.train
    loop_params = dict(inspect.signature(loop.train).parameters)
    assert "tuning" in loop_params
    del loop_params["tuning"]  # what api.train plugs in
    assert list(inspect.signature(mp.train).parameters) == list(loop_params)
