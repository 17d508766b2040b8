"""What every picture of ``mindpipe_jax.viz`` shares: the file types a picture can
be written as, the colour of each kind of task and its shades per chunk, the names
of the schedules, the lazy matplotlib import (``require_matplotlib``) and the
check of a picture's path (``check_picture_path``).
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from pathlib import Path

from mindpipe_jax.atomic_write import check_output_file, write_output
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.parallel.pipeline.schedules import Kind

# File types a picture can be written as (matplotlib picks the writer from the suffix).
PICTURE_FORMATS = (".png", ".svg", ".pdf")

# One colour per kind of task (Tableau 10: readable, distinct for colour-blind eyes
# by lightness as well as hue).
KIND_COLORS: Mapping[Kind, str] = {
    Kind.F: "#4c78a8",   # forward: blue
    Kind.B: "#f58518",   # input gradient: orange
    Kind.BW: "#e45756",  # fused backward: red
    Kind.W: "#54a24b",   # weight gradient: green
}
_KIND_NAMES = {Kind.F: "F  forward", Kind.B: "B  input grad", Kind.BW: "BW  backward (B+W)",
               Kind.W: "W  weight grad"}
_IDLE_FACE, _IDLE_HATCH = "#f4f4f4", "#cfcfcf"
_NAMES = {"1f1b": "1F1B", "gpipe": "GPipe", "zb-h1": "ZB-H1", "zbv": "ZB-V", "dualpipev": "DualPipeV"}

_MATPLOTLIB_MISSING = "matplotlib is needed for pictures: pip install 'mindpipe-jax[plots]'"


def require_matplotlib():
    """Import matplotlib lazily; a missing install is a user-fixable ConfigError."""
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch, Rectangle
    except ImportError:
        raise ConfigError(_MATPLOTLIB_MISSING) from None
    return Figure, FigureCanvasAgg, Rectangle, Patch


def check_picture_path(out_path: str | os.PathLike) -> Path:
    """Refuse, before anything is computed or written, a picture path whose suffix
    is not one of ``PICTURE_FORMATS`` or whose directory does not exist or cannot be
    written."""
    path = Path(out_path)
    if path.suffix.lower() not in PICTURE_FORMATS:
        got = repr(path.suffix) if path.suffix else "no suffix"
        raise ConfigError(f"picture file {str(path)!r} must end in one of "
                          f"{', '.join(PICTURE_FORMATS)} (got {got})")
    return check_output_file(path, "picture")


def save_figure(fig, path: Path) -> Path:
    """Draw ``fig`` to ``path`` (its suffix names the format) whole or not at all: on a
    full disk matplotlib left an empty file and an error naming no file."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format=path.suffix.lstrip(".").lower())
    write_output(path, buffer.getvalue(), "picture")
    return path


def _rgb(color: str) -> tuple[float, float, float]:
    color = color.lstrip("#")
    return tuple(int(color[i:i + 2], 16) / 255 for i in (0, 2, 4))  # type: ignore[return-value]


def _shade(kind: Kind, chunk: int, v: int) -> tuple[float, float, float]:
    """The kind's colour; with several chunks, chunk 0 is lightest and the last
    chunk the full colour, so a chunk reads as a lightness step within its hue."""
    r, g, b = _rgb(KIND_COLORS[kind])
    if v <= 1:
        return r, g, b
    mix = 0.55 * (1 - chunk / (v - 1))   # fraction of white blended in
    return tuple(c + (1 - c) * mix for c in (r, g, b))  # type: ignore[return-value]
