"""What every ``mindpipe`` subcommand parser shares: the program name, the help
texts on overrides and exit status, the config sections' help (generated from
``config.py``), the ``--config FILE`` + overrides arguments, and the integer check
for an option.
"""

from __future__ import annotations

import argparse
import dataclasses
import textwrap

from mindpipe_jax.config import Config
from mindpipe_jax.config_toml import paragraphs
from mindpipe_jax.errors import ConfigError

PROG = "mindpipe"


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser whose usage errors are one line (argparse prints the usage block
    above them) that points at the command's ``--help``; exit status 2 as argparse's.
    Subcommand parsers inherit it (``add_subparsers`` makes parsers of the parent's class)."""

    def error(self, message: str):
        if "required: COMMAND" in message:  # bare `mindpipe`: name what it takes
            message = "no command given; choose one of: " + ", ".join(self._command_names())
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")

    def _command_names(self) -> list[str]:
        return [name for action in self._actions if isinstance(action, argparse._SubParsersAction)
                for name in action.choices]


OVERRIDES_HELP = """\
overrides:
  Any config key can be set on the command line as section.key=value, after the
  subcommand. The value is a TOML literal: 2, -1, 0.5, 3e-4, true, "text".
  A bare word that is not a TOML literal is taken as a string (data.source=text).
  Precedence, lowest first:
    1. the defaults (the dataclasses in mindpipe_jax/config.py, written out with
       comments in examples/configs/default.toml),
    2. the TOML file given with --config (same section names, any subset of keys),
    3. the overrides, left to right (a later one wins).
  Run `mindpipe config [same arguments]` to print every resolved key and value.
"""

ERRORS_HELP = """\
exit status:
  0 success, or stopped by SIGTERM / a first Ctrl-C after saving a checkpoint
    (continue with --resume); 2 a bad argument or config value (one line on
    stderr, nothing written); 3 training stopped on a non-finite loss or
    gradient norm (train.nonfinite=stop; the last checkpoint is untouched);
    4 a multi-host run whose processes did not all start or lost one another;
    130 interrupted outside the training loop (or a second Ctrl-C). Any other
    failure prints a traceback: a bug.
"""


def _first_line(cls) -> str:
    """The first paragraph of a config section's docstring."""
    paras = paragraphs(cls)
    return paras[0] if paras else ""


def sections_help(width: int = 78) -> str:
    """Each config section, what it is for, and its keys (generated from config.py)."""
    lines = ["config sections (keys; `mindpipe config` shows values and defaults):"]
    for f in dataclasses.fields(Config):
        cls = f.default_factory  # type: ignore[misc]
        lines.extend(textwrap.wrap(f"{f.name}: {_first_line(cls)}", width,
                                   initial_indent="  ", subsequent_indent=" " * (len(f.name) + 4),
                                   break_long_words=False))
        keys = "keys: " + ", ".join(g.name for g in dataclasses.fields(cls))
        lines.extend(textwrap.wrap(keys, width, initial_indent="    ", subsequent_indent="          "))
    return "\n".join(lines) + "\n"


def add_config_args(p: argparse.ArgumentParser) -> None:
    """``--config FILE`` and the ``section.key=value`` overrides, as every config command takes them."""
    p.add_argument("--config", "-c", metavar="FILE", default=None,
                   help="TOML file with any subset of the config sections (default: none, "
                        "i.e. the built-in defaults)")
    p.add_argument("overrides", nargs="*", default=[], metavar="section.key=value",
                   help="config overrides; the value is a TOML literal (see below)")


def positive_int(value: str, option: str) -> int:
    """``value`` (an option's text) as an integer >= 1, else a ``ConfigError`` naming ``option``."""
    return _int_at_least(value, option, 1)


def nonnegative_int(value: str, option: str) -> int:
    """``value`` (an option's text) as an integer >= 0, else a ``ConfigError`` naming ``option``."""
    return _int_at_least(value, option, 0)


def _int_at_least(value: str, option: str, low: int) -> int:
    try:
        number = int(value)
    except ValueError:
        number = low - 1
    if number < low:
        raise ConfigError(f"{option} must be an integer >= {low}, got {value!r}")
    return number
