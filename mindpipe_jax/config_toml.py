"""The resolved config as TOML: a tiny writer for the two-level config table.

``to_toml`` writes what ``load_config`` reads back to an equal ``Config``, with each
section's docstring as its comment. ``paragraphs`` is that docstring as plain
one-line paragraphs (``mindpipe --help`` lists the sections with it too).
"""

from __future__ import annotations

import dataclasses
import textwrap
from typing import Any

from mindpipe_jax.config import Config


def paragraphs(cls) -> list[str]:
    """A config section's docstring as plain one-line paragraphs."""
    doc = textwrap.dedent(cls.__doc__ or "").strip()
    return [" ".join(p.split()).replace("``", "").replace("\u00d7", "x")
            for p in doc.split("\n\n") if p.strip()]


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_string(s: str) -> str:
    out = []
    for ch in s:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != value:
            return "nan"
        if value in (float("inf"), float("-inf")):
            return "inf" if value > 0 else "-inf"
        return repr(value)  # always has '.', 'e' (valid TOML) — e.g. 0.003, 1e-08
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} value {value!r} as TOML")


def to_toml(cfg: Config, *, comments: bool = True) -> str:
    """The config as TOML that ``load_config`` reads back to an equal ``Config``.

    With ``comments``, each section starts with its description and a key whose
    value differs from the default says so (``steps = 7  # default: 300``).
    """
    defaults = Config().to_dict()
    blocks = []
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        lines = []
        if comments:
            for i, paragraph in enumerate(paragraphs(type(section))):
                lines.extend(["#"] * (i > 0) + ["# " + ln for ln in textwrap.wrap(paragraph, 76)])
        lines.append(f"[{f.name}]")
        for key, value in dataclasses.asdict(section).items():
            line = f"{key} = {_toml_value(value)}"
            default = defaults[f.name][key]
            if comments and value != default:
                line += f"  # default: {_toml_value(default)}"
            lines.append(line)
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"
