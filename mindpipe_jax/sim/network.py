"""The simulator's network: α–β point-to-point links (``Link``), ring collectives
(``Collective``), data-parallel gradient sync (``DPSync``), and fitting α and β
to measured transfers (``fit_alpha_beta``). The model is described in
``sim/__init__.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from mindpipe_jax.errors import ConfigError
from mindpipe_jax.sim.costs import _number


@dataclass(frozen=True)
class Link:
    """α–β model of a point-to-point link: ``time(n) = latency_s + n / bandwidth_Bps``.

    The sender's lane is busy for ``n / bandwidth_Bps`` (``occupancy``); the
    message arrives ``latency_s`` after it leaves the lane."""

    latency_s: float = 0.0
    bandwidth_Bps: float = math.inf

    def __post_init__(self):
        _number(self.latency_s, "Link.latency_s")
        _number(self.bandwidth_Bps, "Link.bandwidth_Bps", positive=True, allow_inf=True)

    @classmethod
    def fixed(cls, seconds: float) -> Link:
        """Every transfer takes ``seconds`` whatever its size and occupies no lane."""
        return cls(latency_s=seconds)

    def occupancy(self, nbytes: float) -> float:
        return nbytes / self.bandwidth_Bps if nbytes else 0.0

    def time(self, nbytes: float) -> float:
        return self.latency_s + self.occupancy(nbytes)


COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather")


@dataclass(frozen=True)
class Collective:
    """Ring collective over ``ranks`` devices on ``link``:

    * all-reduce: ``2 (r - 1) / r * n / bw + 2 (r - 1) α``
    * reduce-scatter, all-gather: ``(r - 1) / r * n / bw + (r - 1) α``

    (``n`` = bytes of the full buffer on each rank; free for ``r = 1``)."""

    ranks: int
    link: Link
    kind: str = "all-reduce"

    def __post_init__(self):
        if isinstance(self.ranks, bool) or not isinstance(self.ranks, int) or self.ranks < 1:
            raise ConfigError(f"Collective.ranks must be an integer >= 1, got {self.ranks!r}")
        if self.kind not in COLLECTIVES:
            raise ConfigError(f"Collective.kind must be one of {', '.join(COLLECTIVES)}, got {self.kind!r}")
        if not isinstance(self.link, Link):
            raise ConfigError(f"Collective.link must be a Link, got {self.link!r}")

    def time(self, nbytes: float) -> float:
        r = self.ranks
        if r == 1:
            return 0.0
        steps = 2 * (r - 1) if self.kind == "all-reduce" else r - 1
        return steps * (nbytes / r / self.link.bandwidth_Bps) + steps * self.link.latency_s


SYNC_WHEN = ("end", "overlap", "buckets")
PARAM_GATHER = ("none", "after", "forward")


@dataclass(frozen=True)
class DPSync:
    """Data-parallel gradient sync of every (device, chunk)'s ``param_bytes``.

    ``when``:

    * ``"end"``: after the device's compute (Megatron without overlap);
    * ``"overlap"``: each chunk's sync right after its last weight-gradient task,
      concurrent with the remaining compute (AFAPAB's chunk-wise sync);
    * ``"buckets"``: Megatron-LM's ``--overlap-grad-reduce``: the chunk's gradient is
      cut into buckets of ``slice_bytes`` (one bucket if ``None``) in the order the
      backward produces it (the chunk's last layer first), and each bucket's
      collective is requested as soon as its last gradient is ready during the
      chunk's last weight-gradient task (the last microbatch's backward; earlier
      microbatches only accumulate). The task is taken to produce its gradient at
      an even rate: bucket ``k`` of a chunk of ``P`` bytes is ready once
      ``min((k + 1) slice_bytes, P) / P`` of the task has run.

    ``slice_bytes`` cuts each chunk's sync into slices (buckets) of at most that
    many bytes (each pays its own α; with ``contention`` a send waits at most for
    the slice in progress).

    ``param_gather`` (the distributed optimizer: ``kind="reduce-scatter"`` leaves each
    rank its shard of the reduced gradient, it updates that shard, and the updated
    parameters are all-gathered, ``gather_ratio`` bytes per gradient byte, e.g. 0.5
    for bf16 weights against fp32 gradients, in the same slices):

    * ``"none"``: no all-gather is modelled;
    * ``"after"``: after the device's last reduce-scatter (the optimizer step
      itself is not timed), on the same lane: exposed;
    * ``"forward"``: Megatron's ``--overlap-param-gather``: the previous step's
      all-gathers run on the lane from the start of the step, chunk by chunk in the
      order the device first runs them, and a chunk's first forward waits for its
      chunk's all-gather (mode ``"async"`` only)."""

    ranks: int
    link: Link
    when: str = "end"
    kind: str = "all-reduce"
    slice_bytes: float | None = None
    param_gather: str = "none"
    gather_ratio: float = 1.0

    def __post_init__(self):
        if self.when not in SYNC_WHEN:
            raise ConfigError(f"DPSync.when must be one of {', '.join(map(repr, SYNC_WHEN))}, "
                              f"got {self.when!r}")
        if self.slice_bytes is not None:
            _number(self.slice_bytes, "DPSync.slice_bytes", positive=True)
        if self.param_gather not in PARAM_GATHER:
            raise ConfigError(f"DPSync.param_gather must be one of {', '.join(map(repr, PARAM_GATHER))}, "
                              f"got {self.param_gather!r}")
        if self.param_gather != "none" and self.kind != "reduce-scatter":
            raise ConfigError(f"DPSync.param_gather={self.param_gather!r} gathers what a reduce-scatter "
                              f"left sharded: it needs kind='reduce-scatter', got kind={self.kind!r}")
        _number(self.gather_ratio, "DPSync.gather_ratio", positive=True)
        Collective(self.ranks, self.link, self.kind)   # validates ranks, link and kind

    @property
    def collective(self) -> Collective:
        return Collective(self.ranks, self.link, self.kind)

    @property
    def gather(self) -> Collective:
        """The parameter all-gather (``param_gather``)."""
        return Collective(self.ranks, self.link, "all-gather")

    def slices(self, nbytes: float) -> list[float]:
        """The slice sizes one chunk's ``nbytes`` is synced in."""
        if nbytes <= 0:
            return []
        if self.slice_bytes is None or nbytes <= self.slice_bytes:
            return [nbytes]
        full, rest = divmod(nbytes, self.slice_bytes)
        return [self.slice_bytes] * int(full) + ([rest] if rest > 0 else [])

    def gather_time(self, nbytes: float) -> float:
        """Seconds of the parameter all-gather of a chunk of ``nbytes`` gradient bytes (0 if none)."""
        if self.param_gather == "none":
            return 0.0
        return sum(self.gather.time(n * self.gather_ratio) for n in self.slices(nbytes))

    def time(self, nbytes: float) -> float:
        """Seconds to sync ``nbytes`` on a free lane (all slices back to back, and the
        parameter all-gather when ``param_gather`` is not ``"none"``)."""
        return sum(self.collective.time(n) for n in self.slices(nbytes)) + self.gather_time(nbytes)


def fit_alpha_beta(sizes_bytes: Sequence[float], times_s: Sequence[float], *,
                   relative: bool = True) -> Link:
    """Fit ``time = α + size / bandwidth`` to measured transfers; returns a ``Link``.

    Least squares on the linear model ``t = α + β n`` (β = 1 / bandwidth).
    ``relative=True`` (default) minimises the sum of squared *relative* residuals
    ``((α + β n_i - t_i) / t_i)^2`` — right for timings whose noise grows with the
    time, and for sizes spanning orders of magnitude, where plain least squares
    lets the largest transfers decide α. ``relative=False``: ordinary least
    squares (constant absolute noise). A negative α (latency below the noise) is
    clamped to 0 and β refitted through the origin. Needs at least two distinct
    sizes and times that grow with size."""
    import numpy as np

    n = np.asarray(sizes_bytes, dtype=float)
    t = np.asarray(times_s, dtype=float)
    if n.ndim != 1 or n.shape != t.shape:
        raise ConfigError(f"fit_alpha_beta needs two equal-length 1-d sequences, got shapes "
                          f"{n.shape} and {t.shape}")
    if not (np.all(np.isfinite(n)) and np.all(np.isfinite(t))) or np.any(n < 0) or np.any(t <= 0):
        raise ConfigError("fit_alpha_beta needs finite sizes >= 0 and times > 0")
    if np.unique(n).size < 2:
        raise ConfigError("fit_alpha_beta needs transfers of at least two different sizes")
    w = 1.0 / t if relative else np.ones_like(t)
    design = np.stack([np.ones_like(n), n], axis=1) * w[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(design, t * w, rcond=None)
    if alpha < 0:
        alpha = 0.0
        beta = float(np.sum(w * w * n * t) / np.sum(w * w * n * n))
    if not beta > 0:
        raise ConfigError("fit_alpha_beta: the times do not grow with the size, so no bandwidth fits")
    return Link(latency_s=float(alpha), bandwidth_Bps=float(1.0 / beta))
