"""Per-machine calibration for the cost model: a few micro-benchmarks, measured once
per machine and cached as a small JSON file.

What is measured (``measure``), each as the median of ``repeats`` timed calls after
a compile and a warm-up, each call waited for with ``block_until_ready``:

* matmul rate — FLOP/s of one device running 128×128 matmuls, with every device
  running them at once (``busy``) and with one device alone (``solo``): simulated
  CPU devices share the host's cores, so a device whose neighbours idle (a
  pipeline bubble) runs faster. On a GPU the two agree.
* memory bandwidth — bytes/s of an elementwise pass over 1 MiB per device
  (read + write counted, as ``cost_analysis``'s "bytes accessed" counts them),
  busy and solo.
* kernel cost — seconds per kernel of a chain of small matmuls the compiler cannot
  fuse (busy and solo; the difference of a 256- and a 32-long chain, so no
  launch): a tiny model's step is hundreds of small kernels, and their fixed
  cost is what its FLOPs do not show.
* launch and loop iteration — a trivial jitted call, and one iteration of a
  ``fori_loop`` over a trivial body.
* collectives per axis size — α (seconds) and β (seconds per byte of the
  per-device buffer) of all-reduce, all-gather, reduce-scatter and a ring
  ``ppermute`` over an axis of each size ``r`` that divides the device count,
  fitted to two buffer sizes (each the difference of a program with 5 chained
  collectives and one with 1, so the launch is not in α), measured as the mesh runs them: all ``n / r``
  groups of the axis at once (on simulated CPU devices they share the cores).
  A mesh axis of size ``r`` (data, fsdp, tensor, pipe, subnet, expert) reads the
  fit of its size: on one host every group of a size looks alike.

The host's load average as the measurement begins is recorded beside it: on a host
whose cores other work holds, every rate comes out low (on this project's 2-core
machine a calibration taken during the test suite had 1.9 GFLOP/s per busy device
where a quiet one has 13.5, and put steps up to 5.8x too long), and ``note`` then
says so; ``load_or_measure`` measures such a cached calibration again once the host is
quiet.

The cache (``load_or_measure``) is keyed by the host name, the platform, device
kind and count, the jax and jaxlib versions and ``FORMAT``; a changed key is a
miss and measures again. The file lives under ``cache_dir`` (a run directory),
``$MINDPIPE_CACHE`` or ``~/.cache/mindpipe_jax``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from mindpipe_jax.atomic_write import write_atomically

FORMAT = 3  # bump when what is measured changes: old cache files then miss
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "ppermute")


@dataclasses.dataclass(frozen=True)
class Calibration:
    """One machine's measured rates (per device) and collective fits."""

    key: dict
    flops_busy: float  # FLOP/s per device, all devices computing
    flops_solo: float  # FLOP/s of one device computing alone
    mem_busy: float  # bytes/s per device, all devices streaming
    mem_solo: float
    kernel_busy_s: float  # fixed seconds per kernel, all devices running kernels
    kernel_solo_s: float
    launch_s: float  # one jitted call's fixed cost
    iteration_s: float  # one loop iteration's fixed cost
    collectives: dict  # "kind:r" -> [alpha_s, beta_s_per_byte]
    measured_at: str = ""
    # The host's 1-minute load average (as the measurement began) and core count (-1, 0:
    # not recorded). The rates are per device with this run's devices busy: on a host
    # loaded by other work they come out low, and every prediction from them long.
    load_average: float = -1.0
    cores: int = 0

    @property
    def loaded(self) -> bool:
        """Measured while other work held more than the host's cores."""
        return _is_loaded((self.load_average, self.cores))

    def collective_time(self, kind: str, ranks: int, nbytes: float) -> float:
        """Seconds of one ``kind`` collective over ``ranks`` devices of an
        ``nbytes`` per-device buffer (0 for one rank)."""
        if ranks <= 1:
            return 0.0
        fit = self.collectives.get(f"{kind}:{ranks}")
        if fit is None:  # a size not measured: the nearest measured size of that kind
            sizes = [int(k.split(":")[1]) for k in self.collectives if k.startswith(kind + ":")]
            if not sizes:
                raise KeyError(f"calibration has no {kind} fit (has {sorted(self.collectives)})")
            fit = self.collectives[f"{kind}:{min(sizes, key=lambda r: abs(r - ranks))}"]
        alpha, beta = fit
        return alpha + beta * nbytes

    def note(self) -> str:
        ar = {k.split(":")[1]: v for k, v in self.collectives.items() if k.startswith("all-reduce:")}
        links = ", ".join(f"r={r} α={a * 1e6:.0f} µs {1 / b / 1e9 if b > 0 else float('inf'):.2f} GB/s"
                          for r, (a, b) in sorted(ar.items(), key=lambda kv: int(kv[0])))
        where = f"{self.key.get('devices')} x {self.key.get('device_kind')}"
        return (f"{where}: matmul {self.flops_busy / 1e9:.2f} "
                f"GFLOP/s per device busy, {self.flops_solo / 1e9:.2f} alone; memory "
                f"{self.mem_busy / 1e9:.2f} / {self.mem_solo / 1e9:.2f} GB/s; kernel "
                f"{self.kernel_busy_s * 1e6:.0f} / {self.kernel_solo_s * 1e6:.0f} µs; launch "
                f"{self.launch_s * 1e3:.2f} ms; all-reduce {links}" + (
                    f"; MEASURED UNDER LOAD (load average {self.load_average:.1f} on {self.cores} cores): "
                    f"rates too low, measure again on a quiet machine (refresh)" if self.loaded else ""))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Calibration:
        return cls(**d)


def machine_key(devices) -> dict:
    """What a calibration depends on: the machine, its devices, the software."""
    import jax
    import jaxlib

    d0 = devices[0]
    return {"host": socket.gethostname(), "platform": d0.platform, "device_kind": d0.device_kind,
            "devices": len(devices), "cpus": os.cpu_count(), "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "format": FORMAT}


def key_digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def default_cache_dir() -> Path:
    return Path(os.environ.get("MINDPIPE_CACHE") or Path.home() / ".cache" / "mindpipe_jax")


def cache_file(key: dict, cache_dir: str | Path | None = None) -> Path:
    return Path(cache_dir or default_cache_dir()) / f"calibration-{key_digest(key)}.json"


def load(key: dict, cache_dir: str | Path | None = None) -> Calibration | None:
    """The cached calibration for ``key``, or None (missing, damaged, or another key)."""
    path = cache_file(key, cache_dir)
    try:
        found = Calibration.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None
    return found if found.key == key else None


def save(cal: Calibration, cache_dir: str | Path | None = None) -> Path:
    """Cache ``cal``; an ``OSError`` (naming the file) when the cache cannot be written."""
    path = cache_file(cal.key, cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps(cal.to_dict(), indent=1, sort_keys=True))
    return path


def load_or_measure(devices=None, *, cache_dir: str | Path | None = None, refresh: bool = False,
                    measure_fn: Callable | None = None,
                    log: Callable[[str], None] | None = None) -> Calibration:
    """The cached calibration of this machine, measured (and cached) on a miss."""
    import jax

    devices = list(jax.devices() if devices is None else devices)
    key = machine_key(devices)
    if not refresh:
        found = load(key, cache_dir)
        # One measured under load is replaced once the host is quiet (still loaded: no better).
        if found is not None and not (found.loaded and not _is_loaded(_host_load())):
            return found
    cal = (measure_fn or measure)(devices)
    try:   # a cache that cannot be written (read-only home, MINDPIPE_CACHE elsewhere) costs a re-measure
        where = f"cached in {save(cal, cache_dir)}"
    except OSError as err:
        where = f"not cached: {err.strerror or err} writing {err.filename or cache_file(key, cache_dir)}"
    if log:
        log(f"calibrated {cal.note()} ({where})")
    return cal


# ------------------------------------------------------------------ measuring
def _median_seconds(fn, *args, repeats: int) -> float:
    """Median seconds per call; a sample repeats the call to last >= ~2 ms so that
    short programs are not timed at the clock's resolution."""
    import jax

    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    once = time.perf_counter() - t0
    number = max(1, min(100, int(2e-3 / max(once, 1e-6))))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(number):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / number)
    return statistics.median(samples)


def _fit(sizes, times) -> list[float]:
    """α, β of ``time = α + β·bytes`` through two or more points (α, β >= 0)."""
    beta, alpha = np.polyfit(np.asarray(sizes, float), np.asarray(times, float), 1)
    beta = max(float(beta), 0.0)
    alpha = max(float(np.median(np.asarray(times) - beta * np.asarray(sizes))), 0.0)
    return [alpha, beta]


def measure(devices=None, *, repeats: int = 9) -> Calibration:
    """Run the micro-benchmarks on ``devices`` (see the module docstring)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = list(jax.devices() if devices is None else devices)
    load = _host_load()  # before this measurement adds its own
    n = len(devices)
    flat = jax.sharding.Mesh(np.asarray(devices), ("all",))
    shard = NamedSharding(flat, P("all"))

    def busy_and_solo(fn, make, per_device_work):
        """(work/s per device with all busy, work/s of one device alone) of ``fn``."""
        x_all = jax.device_put(make(n), shard)
        x_one = jax.device_put(make(1), devices[0])
        return (per_device_work / _median_seconds(fn, x_all, repeats=repeats),
                per_device_work / _median_seconds(fn, x_one, repeats=repeats))

    size, depth = 128, 8

    @jax.jit
    def matmuls(x):
        return jax.lax.fori_loop(0, depth, lambda _, h: jnp.tanh(h @ h) * 0.5, x)

    flops_busy, flops_solo = busy_and_solo(matmuls, lambda k: jnp.ones((k * 8, size, size), jnp.float32),
                                           8 * depth * 2 * size ** 3)

    # 1 MiB per device: a small model's step streams buffers of this order; larger
    # ones measured the host's oversubscribed threads more than its memory here
    elems = 1 << 18

    @jax.jit
    def stream(x):
        return x * 1.0001 + 0.5

    mem_busy, mem_solo = busy_and_solo(stream, lambda k: jnp.ones((k, elems), jnp.float32), 2 * 4 * elems)

    def chain_of(count):
        @jax.jit
        def chain(x):
            for _ in range(count):  # unrolled: each small matmul is its own kernel
                x = x @ x
            return x
        return chain

    # A permutation matrix stays one under x @ x: no values drift into denormals.
    perm = jnp.eye(8, dtype=jnp.float32)[jnp.asarray([3, 0, 6, 1, 7, 2, 4, 5])]
    # Two chain lengths: their difference is the kernels' cost without the launch.
    long, short = 256, 32
    per_call = {count: busy_and_solo(chain_of(count), lambda k: jnp.tile(perm, (k, 1, 1)), 1.0)
                for count in (long, short)}
    kernel_busy = max(1 / per_call[long][0] - 1 / per_call[short][0], 0.0) / (long - short)
    kernel_solo = max(1 / per_call[long][1] - 1 / per_call[short][1], 0.0) / (long - short)
    tiny = jax.device_put(jnp.ones((n, 8), jnp.float32), shard)
    launch = _median_seconds(jax.jit(lambda b: b * 2.0 + 1.0), tiny, repeats=repeats)

    loops = 64
    loop = jax.jit(lambda b: jax.lax.fori_loop(0, loops, lambda _, h: jnp.sin(h) + 1.0, b))
    iteration = max(0.0, (_median_seconds(loop, tiny, repeats=repeats) - launch) / loops)

    collectives = {}
    for r in (d for d in range(2, n + 1) if n % d == 0):
        mesh = jax.sharding.Mesh(np.asarray(devices).reshape(n // r, r), ("rest", "axis"))
        spec = P(("rest", "axis"))
        ring = [(i, (i + 1) % r) for i in range(r)]
        programs = {
            "all-reduce": lambda b: jax.lax.psum(b, "axis"),
            "all-gather": lambda b: jax.lax.all_gather(b, "axis", tiled=True)[: b.shape[0]],
            "reduce-scatter": lambda b, r=r: jnp.tile(jax.lax.psum_scatter(b, "axis", tiled=True), r),
            "ppermute": lambda b, ring=ring: jax.lax.ppermute(b, "axis", ring),
        }
        for kind, body in programs.items():
            sizes, times = [], []
            for count in (256 * r, 65536 * r):  # 1 KiB·r and 256 KiB·r of float32 per device
                buf = jax.device_put(jnp.ones((n * count,), jnp.float32), NamedSharding(mesh, spec))
                calls = {}
                for chain in (1, 5):  # the difference is the collectives' cost without the launch
                    def chained(b, body=body, chain=chain):
                        for _ in range(chain):
                            b = body(b) * 0.5
                        return b
                    prog = jax.jit(jax.shard_map(chained, mesh=mesh, in_specs=spec, out_specs=spec))
                    calls[chain] = _median_seconds(prog, buf, repeats=2 * repeats + 1)
                sizes.append(4.0 * count)
                times.append(max(calls[5] - calls[1], 0.0) / 4)
            collectives[f"{kind}:{r}"] = _fit(sizes, times)
    return Calibration(machine_key(devices), flops_busy, max(flops_solo, flops_busy), mem_busy,
                       max(mem_solo, mem_busy), kernel_busy, kernel_solo or kernel_busy, launch, iteration,
                       collectives, time.strftime("%Y-%m-%d %H:%M:%S"), *load)


def _is_loaded(load: tuple[float, int]) -> bool:
    average, cores = load
    return cores > 0 and average > cores


def _host_load() -> tuple[float, int]:
    """(1-minute load average, cores) of the host now; (-1, 0) where the OS has none."""
    try:
        return float(os.getloadavg()[0]), int(os.cpu_count() or 0)
    except (AttributeError, OSError):
        return -1.0, 0
