"""The machine's side of the cost model: ``Hardware`` (per-device FLOP rates, launch
and loop-iteration costs, and with a ``calibrate.Calibration`` memory bandwidth,
kernel cost and per-axis collective fits), which times one ``Piece`` (a roofline)
and one collective. Re-exported by ``tuner/costmodel.py``.
"""

from __future__ import annotations

import dataclasses
import math

from mindpipe_jax.sim.network import Collective, Link
from mindpipe_jax.tuner.calibrate import Calibration
from mindpipe_jax.tuner.pieces import Piece


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Per-device FLOP rate (all devices busy), the collective link, launch costs;
    with ``calibration`` also memory bandwidth, kernel cost and per-axis collective
    fits (``Hardware.calibrate`` measures and caches them)."""

    flop_rate: float
    link: Link
    solo_rate: float  # one device computing alone (CPU devices then get the idle cores)
    launch_s: float  # one step's fixed cost (dispatch, optimizer, host sync)
    iteration_s: float  # one loop iteration's fixed cost (microbatch or pipeline tick)
    memory_bytes: float = math.inf
    note: str = ""
    calibration: Calibration | None = None

    @classmethod
    def calibrate(cls, devices=None, *, memory_bytes: float = math.inf, cache_dir=None,
                  refresh: bool = False) -> Hardware:
        """This machine's calibration (``calibrate.load_or_measure``: measured once per
        machine key and cached) on ``devices``."""
        import jax

        from mindpipe_jax.tuner.calibrate import load_or_measure

        devices = list(jax.devices() if devices is None else devices)
        return cls.from_calibration(load_or_measure(devices, cache_dir=cache_dir, refresh=refresh),
                                    memory_bytes)

    @classmethod
    def from_calibration(cls, cal: Calibration, memory_bytes: float = math.inf) -> Hardware:
        n = cal.key.get("devices", 1)
        alpha, beta = cal.collectives.get(f"all-reduce:{n}", (0.0, 0.0))
        link = Link(alpha, 1.0 / beta if beta > 0 else math.inf)
        return cls(cal.flops_busy, link, cal.flops_solo, cal.launch_s, cal.iteration_s, memory_bytes,
                   cal.note(), cal)

    # --------------------------------------------------------------- rates
    def piece_time(self, piece: Piece, rows: float, *, split: int = 1, solo: bool = False) -> float:
        """Seconds of one call of ``piece`` on ``rows`` rows with its work split
        ``split`` ways (tensor parallelism): the roofline max of flop time and
        memory time, plus its kernels' fixed cost."""
        cal = self.calibration
        flops = (piece.flops * rows + piece.flops_sq * rows * rows + piece.fixed_flops) / split
        rate = self.solo_rate if solo else self.flop_rate
        if cal is None:
            return flops / rate
        nbytes = (piece.bytes * rows + piece.bytes_sq * rows * rows + piece.fixed_bytes) / split
        mem = cal.mem_solo if solo else cal.mem_busy
        kernel = cal.kernel_solo_s if solo else cal.kernel_busy_s
        return max(flops / rate, nbytes / mem) + piece.kernels * kernel

    def collective(self, kind: str, ranks: int, nbytes: float) -> float:
        """One collective of ``nbytes`` per device over an axis of ``ranks`` devices."""
        if ranks <= 1:
            return 0.0
        if self.calibration is not None:
            return self.calibration.collective_time(kind, ranks, nbytes)
        if kind == "ppermute":
            return self.link.time(nbytes)
        return Collective(ranks, self.link, kind).time(nbytes)
