"""``--model module:attribute``: a user's model named on the command line."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from mindpipe_jax.errors import ConfigError


def load_model_ref(ref: str):
    """The object ``ref`` names: ``package.module:factory`` or ``path/to/file.py:factory``
    (a factory ``rngs -> nnx.Module``, an ``nnx.Module`` or a Linen module). The current
    directory is importable, as for ``python -m``. Import it only after
    ``setup_runtime``: a module that touches JAX at import would fix the device count."""
    module_name, sep, attr = ref.rpartition(":")
    if not sep or not module_name or not attr.isidentifier():
        raise ConfigError(f"--model {ref!r} must be 'module:name' or 'file.py:name' (e.g. "
                          f"my_models:make_llama), naming a factory rngs -> nnx.Module, an nnx.Module "
                          f"or a Linen module")
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise ConfigError(f"--model {ref!r}: file {module_name!r} does not exist")
        sys.path.insert(0, str(path.resolve().parent))
        module_name = path.stem
    elif "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise ConfigError(f"--model {ref!r}: no module named {err.name!r} (run from the directory "
                          f"that holds it, or install it)") from None
    except Exception as err:  # the user's module failed while importing
        raise ConfigError(f"--model {ref!r}: importing {module_name} failed: "
                          f"{type(err).__name__}: {err}") from None
    if not hasattr(module, attr):
        names = sorted(n for n in vars(module) if not n.startswith("_"))[:12]
        raise ConfigError(f"--model {ref!r}: module {module_name} has no {attr!r} (it has "
                          f"{', '.join(names) or 'nothing public'})")
    return getattr(module, attr)
