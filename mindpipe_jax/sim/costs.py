"""Costs for the simulator: per-stage task durations and sizes (``StageCosts``),
per-layer measurements summed into stages (``LayerCost``), and their resolution
against one schedule. Pure Python; the model is described in ``sim/__init__.py``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mindpipe_jax.errors import ConfigError
from mindpipe_jax.parallel.pipeline.schedules import DEFAULT_COST, Kind, Schedule, Task

Number = int | float
PerStage = Number | Sequence[Number] | Sequence[Sequence[Number]]


# ------------------------------------------------------------------ helpers
def _number(value, name: str, *, positive: bool = False, allow_inf: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if math.isnan(value) or (math.isinf(value) and not allow_inf) or value < 0 or (positive and value == 0):
        raise ConfigError(f"{name} must be {'> 0' if positive else '>= 0'}"
                          f"{'' if allow_inf else ' and finite'}, got {value!r}")
    return value


def _is_number(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _per_global(value: PerStage, name: str, schedule: Schedule) -> list[float]:
    """A number, one value per global stage, or ``p`` rows of ``v`` (device ×
    chunk, mapped through the schedule's placement) -> one value per global stage."""
    p, v, G = schedule.num_stages, schedule.virtual_stages, schedule.num_global_stages
    if _is_number(value):
        return [_number(value, name)] * G
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise ConfigError(f"{name} must be a number or a sequence, got {value!r}")
    rows = list(value)
    if len(rows) == p and rows and all(isinstance(r, Sequence) and not isinstance(r, str | bytes)
                                       for r in rows):
        if any(len(r) != v for r in rows):
            raise ConfigError(f"{name}: {p} rows (devices) must each hold {v} values (chunks), "
                              f"got lengths {[len(r) for r in rows]}")
        out = [0.0] * G
        for s, row in enumerate(rows):
            for c, x in enumerate(row):
                out[schedule.global_stage(s, c)] = _number(x, f"{name}[{s}][{c}]")
        return out
    if len(rows) == G and all(_is_number(x) for x in rows):
        return [_number(x, f"{name}[{g}]") for g, x in enumerate(rows)]
    raise ConfigError(f"{name}: expected a number, {G} values (one per global stage) or {p} rows of {v} "
                      f"(device x chunk) for p={p}, v={v}; got {len(rows)} entries")


# -------------------------------------------------------------------- costs
@dataclass(frozen=True)
class StageCosts:
    """Per-stage task durations (seconds) and sizes (bytes).

    Each field is a number (the same for every stage), a sequence of ``p * v``
    values indexed by *global* stage, or ``p`` rows of ``v`` values indexed
    ``[device][chunk]`` (mapped through the schedule's placement).

    ``F``, ``B``, ``W``: forward, input-gradient and weight-gradient durations.
    ``BW``: fused backward; ``None`` means ``B + W``.
    ``activation_bytes[g]``: size of global stage ``g``'s output, which its ``F``
    sends to ``g + 1`` and which ``g + 1``'s backward sends back (same shape).
    ``param_bytes[g]``: parameters (= gradient) of global stage ``g``, all-reduced
    by a ``DPSync``.
    """

    F: PerStage = 1.0
    B: PerStage = 1.0
    W: PerStage = 1.0
    BW: PerStage | None = None
    activation_bytes: PerStage = 0.0
    param_bytes: PerStage = 0.0

    @classmethod
    def from_layers(cls, layers: LayerCost | Sequence[LayerCost], stage_of_layer: Sequence[int],
                    num_stages: int, *, embed: LayerCost | None = None,
                    head: LayerCost | None = None) -> StageCosts:
        """Sum per-layer costs into ``num_stages`` global stages.

        ``stage_of_layer[i]`` is the global stage of layer ``i`` (non-decreasing:
        stages are contiguous runs of layers; a stage may hold none). ``layers`` is
        one ``LayerCost`` for every layer or one per layer. ``embed`` is added to
        global stage 0 and ``head`` to the last one. A stage's activation bytes are
        those of its last layer's output (an empty stage passes its input through).
        """
        stage_of_layer = list(stage_of_layer)
        n = len(stage_of_layer)
        if isinstance(layers, LayerCost):
            layers = [layers] * n
        layers = list(layers)
        if len(layers) != n:
            raise ConfigError(f"{len(layers)} layer costs for {n} layers in stage_of_layer")
        if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
            raise ConfigError(f"num_stages must be an integer >= 1, got {num_stages!r}")
        for i, g in enumerate(stage_of_layer):
            if isinstance(g, bool) or not isinstance(g, int) or not 0 <= g < num_stages:
                raise ConfigError(f"stage_of_layer[{i}] = {g!r} is not a global stage 0..{num_stages - 1}")
            if i and g < stage_of_layer[i - 1]:
                raise ConfigError(f"stage_of_layer must be non-decreasing (stages are contiguous runs "
                                  f"of layers): layer {i} on stage {g} after stage {stage_of_layer[i - 1]}")
        zero = LayerCost(0.0, 0.0, 0.0)
        F, B, W, BW, P = ([0.0] * num_stages for _ in range(5))
        act: list[float | None] = [None] * num_stages
        parts = [(0, embed or zero)] + list(zip(stage_of_layer, layers, strict=True)) \
            + [(num_stages - 1, head or zero)]
        for g, layer in parts:
            F[g] += layer.F
            B[g] += layer.B
            W[g] += layer.W
            BW[g] += layer.fused
            P[g] += layer.param_bytes
        for g, layer in zip(stage_of_layer, layers, strict=True):
            act[g] = layer.activation_bytes
        carry = (embed or zero).activation_bytes
        for g in range(num_stages):   # an empty stage forwards what it received
            carry = carry if act[g] is None else act[g]
            act[g] = carry
        return cls(F=F, B=B, W=W, BW=BW, activation_bytes=act, param_bytes=P)


@dataclass(frozen=True)
class LayerCost:
    """One layer's (or the embed's / head's) measured costs: durations of F, B, W
    (and BW, default ``B + W``), output activation bytes and parameter bytes."""

    F: float
    B: float
    W: float
    BW: float | None = None
    activation_bytes: float = 0.0
    param_bytes: float = 0.0

    def __post_init__(self):
        for name in ("F", "B", "W", "activation_bytes", "param_bytes"):
            _number(getattr(self, name), f"LayerCost.{name}")
        if self.BW is not None:
            _number(self.BW, "LayerCost.BW")

    @property
    def fused(self) -> float:
        return self.B + self.W if self.BW is None else self.BW


class _Resolved:
    """Costs resolved against one schedule: ``duration(stage, task, g)``,
    ``activation(g)``, ``params(g)``."""

    def __init__(self, costs, schedule: Schedule):
        G = schedule.num_global_stages
        self.act = [0.0] * G
        self.params = [0.0] * G
        if costs is None:
            costs = StageCosts()
        if isinstance(costs, StageCosts):
            table = {kind: _per_global(getattr(costs, kind.value), kind.value, schedule)
                     for kind in (Kind.F, Kind.B, Kind.W)}
            table[Kind.BW] = ([b + w for b, w in zip(table[Kind.B], table[Kind.W], strict=True)]
                              if costs.BW is None else _per_global(costs.BW, "BW", schedule))
            self.act = _per_global(costs.activation_bytes, "activation_bytes", schedule)
            self.params = _per_global(costs.param_bytes, "param_bytes", schedule)
            self._fn = lambda stage, task, g: table[task.kind][g]
        elif isinstance(costs, Mapping):
            # Schedule.timeline's reading: missing kinds from DEFAULT_COST, BW = B + W
            # when both are given.
            try:
                kinds = {Kind(k): _number(c, f"cost[{k!r}]") for k, c in costs.items()}
            except ValueError as err:
                raise ConfigError(f"cost keys must be task kinds F, B, W, BW: {err}") from None
            if Kind.BW not in kinds and Kind.B in kinds and Kind.W in kinds:
                kinds[Kind.BW] = kinds[Kind.B] + kinds[Kind.W]
            for kind, c in DEFAULT_COST.items():
                kinds.setdefault(kind, float(c))
            self._fn = lambda stage, task, g: kinds[task.kind]
        elif callable(costs):
            self._fn = lambda stage, task, g: float(costs(stage, task))
        else:
            raise ConfigError(f"costs must be StageCosts, a kind -> seconds mapping or a function "
                              f"(stage, task) -> seconds, got {type(costs).__name__}")

    def duration(self, stage: int, task: Task, g: int) -> float:
        return self._fn(stage, task, g)
