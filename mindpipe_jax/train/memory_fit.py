"""Refuse a compiled train step that cannot fit in memory, before its first step runs.

On CPUs the devices (simulated ones included) share this host's RAM. A step whose
buffers exceed what is free was killed by the kernel's OOM killer: SIGKILL, status 137,
not a word (seen: ``mindpipe train model.seq_len=4096`` on the default data=4 x tensor=2
layout, whose step needs 12.7 GiB per device, 102 GiB for the eight, on a 24 GiB host).
On an accelerator, XLA's allocator would raise RESOURCE_EXHAUSTED at the first step with
a page of traceback. Here the compiler's own account (``memory_analysis``) is checked
against what the devices have, and a step that cannot fit is one line naming both and
what would shrink it.
"""

from __future__ import annotations

import math

import jax

from mindpipe_jax.errors import ConfigError
from mindpipe_jax.train.agreement import all_or_none

_GIB = 2**30
_SHRINK = ("lower train.global_batch (or raise train.grad_accum), shorten model.seq_len, set "
           "model.remat=full, or spread the batch over more devices")


def peak_bytes(stats) -> float:
    """A compiled step's peak bytes per device from its ``memory_analysis()``, the state
    donated: arguments + temporaries + outputs - aliases."""
    return step_bytes(stats)[0]


def step_bytes(stats) -> tuple[float, float, float, float, float]:
    """``(peak, arguments, temporaries, outputs, aliased)`` bytes per device."""
    arg, out = float(stats.argument_size_in_bytes), float(stats.output_size_in_bytes)
    temp, alias = float(stats.temp_size_in_bytes), float(stats.alias_size_in_bytes)
    return arg + temp + out - alias, arg, temp, out, alias


def host_free_bytes(meminfo: str = "/proc/meminfo") -> float | None:
    """Memory a new allocation can still get on this host (Linux's MemAvailable plus free
    swap), or None where that is not known."""
    try:
        with open(meminfo) as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        kib = int(fields["MemAvailable"].split()[0]) + int(fields.get("SwapFree", "0 kB").split()[0])
    except (OSError, KeyError, ValueError):
        return None
    return kib * 1024.0


def _local(devices) -> list:
    """This process's devices among ``devices``."""
    return [d for d in devices if d.process_index == jax.process_index()]


def _allocator_limit(device) -> float | None:
    """An accelerator's allocator limit in bytes, or None where it keeps no statistics."""
    try:
        limit = (device.memory_stats() or {}).get("bytes_limit")
    except Exception:  # noqa: BLE001 -- a device that keeps no statistics
        return None
    return float(limit) if limit else None


def device_budget_bytes(devices) -> tuple[float, str]:
    """What one of ``devices`` (this process's) can hold for a step, and where that figure
    comes from: an accelerator's allocator limit, or on CPUs the host's free memory shared
    by the devices; ``inf`` where neither is known."""
    local = _local(devices) or list(devices)
    if local[0].platform == "cpu":
        free = host_free_bytes()
        if free is None:
            return math.inf, "unknown"
        return free / len(local), f"this host's {free / _GIB:.1f} GiB free, shared by {len(local)} devices"
    limit = _allocator_limit(local[0])
    return (limit, f"a {local[0].device_kind}'s limit") if limit else (math.inf, "unknown")


def check_step_fits(compiled, mesh, *, state_resident: bool, free_bytes: float | None = None) -> None:
    """ConfigError (one line) when ``compiled``, the train step, cannot fit: on CPUs, its
    bytes times this process's devices against what the host has free (``free_bytes``,
    default ``host_free_bytes()``), less the state where it is in memory already
    (``state_resident``: restored from a checkpoint); on an accelerator, its peak against a
    device's limit. Silent where the compiler or the platform does not say."""
    try:
        stats = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 -- a backend without the analysis: nothing to check
        return
    if stats is None:
        return
    peak, _, temp, out, alias = step_bytes(stats)
    local = _local(mesh.devices.flat)
    if not local:
        return
    if local[0].platform == "cpu":
        free = host_free_bytes() if free_bytes is None else free_bytes
        each = (temp + out - alias) if state_resident else peak
        what = "activations and temporaries beside the state" if state_resident else \
            "state, activations and temporaries"
        need = each * len(local)
        if free is not None and need > free:
            raise ConfigError(
                f"the train step needs {need / _GIB:.1f} GiB of memory ({len(local)} devices x "
                f"{each / _GIB:.2f} GiB of {what}, by the compiler's count) and this host has "
                f"{free / _GIB:.1f} GiB free: it would be killed for it; {_SHRINK}")
        return
    limit = _allocator_limit(local[0])
    if limit and peak > limit:
        raise ConfigError(
            f"the train step needs {peak / _GIB:.2f} GiB per device (state, activations and "
            f"temporaries, by the compiler's count) and a {local[0].device_kind} holds "
            f"{limit / _GIB:.2f} GiB; {_SHRINK}")


def compile_fitting(layout, *, state_resident: bool, on_error=None) -> float:
    """Compile ``layout``'s own step (kept by the layout) and refuse it on every process
    where it cannot fit on any (``check_step_fits``); the seconds the compile took.
    ``on_error``: called before an exception leaves (to close what the caller opened)."""
    try:
        step_fn, seconds = layout.compile()
        with all_or_none("training run"):
            check_step_fits(getattr(step_fn, "compiled", step_fn), layout.mesh, state_resident=state_resident)
    except BaseException:
        if on_error is not None:
            on_error()
        raise
    return seconds
