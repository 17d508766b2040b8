"""Checks on one config value, run by every section's ``__post_init__``.

Numbers are checked as numbers (a boolean is not one; integers within their range,
floats finite) by ``_check_numbers``, which reads each section's type hints;
``_check`` and ``_positive`` turn a failed condition into a one-line ``ConfigError``;
``_shown`` writes a value as the user typed it, for the messages here and in
``config_load``.
"""

from __future__ import annotations

import functools
import math
import numbers
import typing
from typing import Any

from mindpipe_jax.errors import ConfigError

# Integer keys hold counts and sizes that JAX keeps as 32-bit integers (the step
# counter, shapes); these are wider or narrower: (low, high, why).
_INT32 = (-2**31, 2**31 - 1, "")
_INT_RANGES = {
    "train.seed": (0, 2**32 - 1, "; a JAX key holds 32 bits of seed"),
    "data.seed": (0, 2**32 - 1, "; a 32-bit seed, as train.seed"),
    "supernet.search_max_params": (0, 2**63 - 1, ""),
}


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _positive(section: str, **values: int | float) -> None:
    for key, value in values.items():
        _check(value > 0, f"{section}.{key}={value!r} must be > 0")


def _shown(value: Any) -> str:
    """A value as the user typed it: TOML booleans, lists for tuples."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_shown(v) for v in value) + "]"
    return repr(value)


@functools.cache
def _number_fields(cls) -> tuple[tuple[str, type, bool], ...]:
    """(name, int or float, is a list) for each numeric field of a config section."""
    out = []
    for name, tp in typing.get_type_hints(cls).items():
        args = typing.get_args(tp)
        if tp in (int, float):
            out.append((name, tp, False))
        elif typing.get_origin(tp) is tuple and args[1:] == (Ellipsis,) and args[0] in (int, float):
            out.append((name, args[0], True))
    return tuple(out)


def _check_numbers(obj, section: str) -> None:
    """Numbers are numbers (``true`` is not 1), integers fit their range, floats are finite.

    Runs first in each section's ``__post_init__``: dacite accepts a bool where an int
    or float is declared (``bool`` is an ``int``), and Python integers are unbounded.
    """
    for name, tp, is_list in _number_fields(type(obj)):
        value = getattr(obj, name)
        key = f"{section}.{name}"
        if is_list:
            if not isinstance(value, (tuple, list)):
                raise ConfigError(f"config key {key}={_shown(value)} has the wrong type; expected a list "
                                  f"of {tp.__name__}")
            for item in value:
                _check_number(key, item, tp, value, f"a list of {tp.__name__}")
        else:
            _check_number(key, value, tp, value, tp.__name__)


def _check_number(key: str, value: Any, tp: type, whole: Any, expected: str) -> None:
    shown = _shown(whole)
    # numbers.*: NumPy scalars (np.int64 is no int) pass as what they are.
    number = isinstance(value, numbers.Integral if tp is int else numbers.Real)
    if isinstance(value, bool) or not number:
        got = ", not a boolean" if isinstance(value, bool) else ""
        raise ConfigError(f"config key {key}={shown} has the wrong type; expected {expected}{got}")
    if tp is int:
        low, high, why = _INT_RANGES.get(key, _INT32)
        _check(low <= value <= high, f"config key {key}={shown} is out of range; valid: integers from "
                                     f"{low} to {high}{why}")
    else:
        try:
            finite = math.isfinite(value)
        except OverflowError:  # an integer beyond any float
            finite = False
        _check(finite, f"config key {key}={shown} is not a finite number")
