"""The pieces a schedule is made of: task kinds, ``Task``, the error type, and the
figures a schedule reports (``ScheduleReport``, ``Timeline``).

Pure Python, no JAX. ``schedules.py`` describes the tick model these serve.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from mindpipe_jax.errors import ConfigError


class ScheduleError(ConfigError):
    """A schedule table that breaks a rule; the message is one line naming the
    tick, stage and task at fault (a ``ValueError``, like every ``ConfigError``)."""


class Kind(StrEnum):
    """What a task computes; compares equal to its one- or two-letter name."""

    F = "F"    # forward
    B = "B"    # input gradient only (weight gradient deferred to a W)
    W = "W"    # weight gradient only
    BW = "BW"  # fused backward: input and weight gradient


BACKWARD_KINDS = frozenset({Kind.B, Kind.BW})

# Relative durations used when none are given: a backward is about twice a
# forward, split evenly between its input and weight halves.
DEFAULT_COST: Mapping[Kind, float] = {Kind.F: 1.0, Kind.B: 1.0, Kind.W: 1.0, Kind.BW: 2.0}

_TOKEN = re.compile(r"^(BW|F|B|W)(\d+)([a-z]?)$")
_IDLE = re.compile(r"^(\.+|-+|_+)$")


@dataclass(frozen=True)
class Task:
    """One unit of work for one device: ``kind`` of ``microbatch`` on its ``chunk``
    (the device's ``chunk``-th model piece, 0 <= chunk < v)."""

    microbatch: int
    chunk: int
    kind: Kind

    def __post_init__(self):
        try:
            object.__setattr__(self, "kind", Kind(self.kind))
        except ValueError:
            raise ScheduleError(f"task kind {self.kind!r} is not one of "
                                f"{', '.join(k.value for k in Kind)}") from None
        for name in ("microbatch", "chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ScheduleError(f"task {name} must be an integer >= 0, got {value!r}")

    def token(self, with_chunk: bool = False) -> str:
        """``F3``, ``BW0``, ... and with the chunk as a letter (a = 0): ``F3b``."""
        suffix = chr(ord("a") + self.chunk) if with_chunk else ""
        return f"{self.kind.value}{self.microbatch}{suffix}"

    def __str__(self) -> str:
        return self.token(with_chunk=self.chunk > 0)

    @classmethod
    def parse(cls, token: str) -> Task | None:
        """The inverse of ``token``: ``"F3"``, ``"B2b"`` (chunk 1); ``".."`` is idle."""
        token = token.strip()
        if _IDLE.match(token):
            return None
        found = _TOKEN.match(token)
        if not found:
            raise ScheduleError(f"cannot read task {token!r}: expected e.g. F3, B3, W3, BW3, "
                                f"F3b (chunk 1) or '..' for idle")
        kind, mb, chunk = found.groups()
        return cls(int(mb), ord(chunk) - ord("a") if chunk else 0, Kind(kind))


@dataclass(frozen=True)
class ScheduleReport:
    """What ``validate`` measured on a correct table."""

    name: str
    ticks: int
    bubble_fraction: float                    # idle slots / all slots (unit ticks)
    peak_live_activations: tuple[int, ...]    # per stage: F done, B/BW not yet
    peak_pending_weight_grads: tuple[int, ...]  # per stage: B done, W not yet


@dataclass(frozen=True)
class Timeline:
    """A replay of a schedule with durations: ``start[tick][stage]`` and
    ``end[tick][stage]`` (``None`` where the table is idle)."""

    start: tuple[tuple[float | None, ...], ...]
    end: tuple[tuple[float | None, ...], ...]
    makespan: float
    busy: tuple[float, ...]   # per stage: the sum of its task durations

    @property
    def bubble_fraction(self) -> float:
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)

    @property
    def utilization(self) -> tuple[float, ...]:
        return tuple(b / self.makespan if self.makespan > 0 else 0.0 for b in self.busy)


Cost = Mapping[str, float] | Callable[[int, Task], float]


def _cost_fn(cost: Cost | None) -> Callable[[int, Task], float]:
    if callable(cost):
        return cost
    table = {Kind(k): float(c) for k, c in (cost or {}).items()}
    if Kind.BW not in table and Kind.B in table and Kind.W in table:
        table[Kind.BW] = table[Kind.B] + table[Kind.W]
    for kind, c in DEFAULT_COST.items():
        table.setdefault(kind, c)
    return lambda stage, task: table[task.kind]

