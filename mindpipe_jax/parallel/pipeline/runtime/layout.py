"""Which layers each pipeline stage runs (``StageLayout``).

Parameters keep the plain stacked layer axis ``[L, ...]`` in storage and in
checkpoints; the split into stages happens inside the step, so changing the
split (the partitioner, online repartition) never transforms parameters or
optimizer state.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class StageLayout:
    """Which layers each (device, chunk) runs. Global stage ``g`` runs the next
    ``counts[g]`` layers; ``placement[s][c]`` is the global stage chunk ``c`` of device
    ``s`` holds (default: Megatron's interleaving, ``g = c·p + s``; a V placement
    puts stages s and 2p − 1 − s on device s). Uneven stages are padded to the
    longest with slots that ``lax.cond`` skips (never computed)."""

    counts: tuple[int, ...]
    p: int
    v: int
    placement: tuple[tuple[int, ...], ...] | None = None

    @classmethod
    def even(cls, num_layers: int, p: int, v: int, placement=None) -> StageLayout:
        if num_layers % (p * v):
            raise ValueError(f"{num_layers} layers do not split evenly into {p * v} stages")
        return cls((num_layers // (p * v),) * (p * v), p, v, placement)

    def __post_init__(self):
        if len(self.counts) != self.p * self.v or min(self.counts) < 0:
            raise ValueError(f"stage layer counts {self.counts} must be {self.p * self.v} values >= 0")
        if self.placement is not None:
            object.__setattr__(self, "placement", tuple(tuple(int(g) for g in row) for row in self.placement))

    def _placement(self) -> tuple[tuple[int, ...], ...]:
        if self.placement is not None:
            return self.placement
        return tuple(tuple(c * self.p + s for c in range(self.v)) for s in range(self.p))

    @property
    def _interleaved(self) -> bool:
        return self._placement() == tuple(tuple(c * self.p + s for c in range(self.v)) for s in range(self.p))

    @property
    def uniform(self) -> bool:
        return len(set(self.counts)) == 1

    @property
    def width(self) -> int:
        return max(self.counts)

    def _slots(self) -> np.ndarray:
        """[p, v, width] layer index per slot, -1 where padded."""
        out = np.full((self.p, self.v, self.width), -1, np.int64)
        start = np.concatenate([[0], np.cumsum(self.counts)])
        for s, row in enumerate(self._placement()):
            for c, g in enumerate(row):
                n = self.counts[g]
                out[s, c, :n] = np.arange(start[g], start[g] + n)
        return out

    def counts_array(self, depth: int | None = None) -> np.ndarray:
        """``[p, v]``: how many layers chunk ``c`` of device ``s`` runs; with ``depth``, when
        only the stack's first ``depth`` layers run (each stage its own layers' prefix)."""
        runs = np.asarray(self.counts)
        if depth is not None:
            start = np.concatenate([[0], np.cumsum(self.counts)[:-1]])
            runs = np.clip(depth - start, 0, runs)
        return np.asarray([[runs[g] for g in row] for row in self._placement()], np.int32)

    def to_stages(self, blocks):
        """[L, ...] -> [p, v, width, ...]."""
        if self.uniform and self._interleaved:  # a free reshape (no gather)
            def one(x):
                x = x.reshape(self.v, self.p, self.width, *x.shape[1:])
                return jnp.swapaxes(x, 0, 1)
        else:
            index = np.maximum(self._slots(), 0).reshape(-1)

            def one(x):
                return jnp.take(x, index, axis=0).reshape(self.p, self.v, self.width, *x.shape[1:])
        return jax.tree.map(one, blocks)

    def from_stages(self, blocks):
        """[p, v, width, ...] -> [L, ...] (padded slots dropped)."""
        if self.uniform and self._interleaved:
            def one(x):
                return jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[3:])
        else:
            flat = self._slots().reshape(-1)
            order = np.argsort(np.where(flat >= 0, flat, np.iinfo(np.int64).max))[: sum(self.counts)]

            def one(x):
                return jnp.take(x.reshape(-1, *x.shape[3:]), order, axis=0)
        return jax.tree.map(one, blocks)
