"""Refuse a compiled train step that cannot fit in memory, before its first step runs.

On CPUs the devices (simulated ones included) share this host's RAM. A step whose
buffers exceed what is free was killed by the kernel's OOM killer: SIGKILL, status 137,
not a word (seen: ``mindpipe train model.seq_len=4096`` on the default data=4 x tensor=2
layout, whose step needs 12.7 GiB per device, 102 GiB for the eight, on a 24 GiB host).
On an accelerator, XLA's allocator would raise RESOURCE_EXHAUSTED at the first step with
a page of traceback. Here the compiler's own account (``memory_analysis``) is checked
against what the devices have, and a step that cannot fit is one line naming both and
what would shrink it. The same check guards an online tuner's switch to another layout
(train/tuned.py) and a supernet's sliced step, a chain of programs (``check_programs_fit``).
"""

from __future__ import annotations

import math
import types

import jax

from mindpipe_jax.errors import ConfigError
from mindpipe_jax.train.agreement import all_or_none

_GIB = 2**30


def _shrink(mesh) -> str:
    """What would make a step smaller: the remat key is the pipeline's own through one."""
    remat = "parallel.stage_remat=full" if dict(getattr(mesh, "shape", {})).get("pipe", 1) > 1 \
        else "model.remat=full"
    return (f"lower train.global_batch (or raise train.grad_accum), shorten model.seq_len, set {remat}, "
            f"or spread the batch over more devices")


def peak_bytes(stats) -> float:
    """A compiled step's peak bytes per device from its ``memory_analysis()``, the state
    donated: arguments + temporaries + outputs - aliases."""
    return step_bytes(stats)[0]


def step_bytes(stats) -> tuple[float, float, float, float, float]:
    """``(peak, arguments, temporaries, outputs, aliased)`` bytes per device."""
    arg, out = float(stats.argument_size_in_bytes), float(stats.output_size_in_bytes)
    temp, alias = float(stats.temp_size_in_bytes), float(stats.alias_size_in_bytes)
    return arg + temp + out - alias, arg, temp, out, alias


def _size(n: float, digits: int = 1) -> str:
    """Bytes as GiB, or MiB/KiB below one GiB (a small model's step is not "0.0 GiB")."""
    for unit, scale in (("GiB", _GIB), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.{digits}f} {unit}"
    return f"{n / 1024:.{digits}f} KiB"


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


def _host_share(free: float, local: list) -> float:
    """One CPU device's share of the host's free bytes: simulated devices split one RAM."""
    return free / len(local)


def device_budget_bytes(devices) -> tuple[float, str]:
    """What one of ``devices`` (this process's) can hold for a step, and where that figure
    comes from: an accelerator's allocator limit, or on CPUs the host's free memory shared
    by the devices; ``inf`` where neither is known."""
    local = _local(devices) or list(devices)
    if local[0].platform == "cpu":
        free = host_free_bytes()
        if free is None:
            return math.inf, "unknown"
        shown = f"this host's {free / _GIB:.1f} GiB free, shared by {len(local)} devices"
        return _host_share(free, local), shown
    limit = _allocator_limit(local[0])
    return (limit, f"a {local[0].device_kind}'s limit") if limit else (math.inf, "unknown")


def room_now(devices) -> float:
    """Bytes each of ``devices`` (this process's) can still take at this moment: on CPUs the
    host's free memory shared by them, on an accelerator the least any has left under its
    limit; ``inf`` where that is not known."""
    local = _local(devices) or list(devices)
    if local[0].platform == "cpu":
        free = host_free_bytes()
        return math.inf if free is None else _host_share(free, local)
    left = []
    for device in local:
        limit = _allocator_limit(device)
        if limit:
            left.append(limit - float((device.memory_stats() or {}).get("bytes_in_use", 0)))
    return min(left) if left else math.inf


def fit_problem(compiled, mesh, *, state_resident: bool, replacing_bytes: float = 0.0,
                free_bytes: float | None = None) -> str | None:
    """Why ``compiled``, a train step, cannot fit (one clause naming what it needs and what
    there is), or None: on CPUs, its bytes times this process's devices against what the
    host has free (``free_bytes``, default ``host_free_bytes()``), less the state where it
    is in memory already (``state_resident``: restored from a checkpoint); on an
    accelerator, its peak against a device's limit. ``replacing_bytes``: this process's
    bytes of the run's current state, which this step's state replaces (a tuner's switch:
    the state is copied onto the new layout beside the current one, which is freed before
    the step runs). None where the compiler or the platform does not say."""
    try:
        stats = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 -- a backend without the analysis: nothing to check
        return None
    if stats is None:
        return None
    peak, arg, temp, out, alias = step_bytes(stats)
    local = _local(mesh.devices.flat)
    if not local:
        return None
    n = len(local)
    if local[0].platform == "cpu":
        free = host_free_bytes() if free_bytes is None else free_bytes
        if free is None:
            return None
        if replacing_bytes:
            need = max(peak * n - replacing_bytes, arg * n)  # the step, or the copy beside the old state
            if need <= free:
                return None
            return (f"the switch needs {_size(need)} more memory than the run holds now (its step "
                    f"{n} devices x {_size(peak, 2)} by the compiler's count, less the current "
                    f"state's {_size(replacing_bytes, 2)} it replaces; the state's copy "
                    f"{_size(arg * n, 2)} beside the current one) and this host has "
                    f"{_size(free)} free")
        each = (temp + out - alias) if state_resident else peak
        what = "activations and temporaries beside the state" if state_resident else \
            "state, activations and temporaries"
        if each * n <= free:
            return None
        return (f"the train step needs {_size(each * n)} of memory ({n} devices x "
                f"{_size(each, 2)} of {what}, by the compiler's count) and this host has "
                f"{_size(free)} free: it would be killed for it")
    limit = _allocator_limit(local[0])
    need = max(peak, arg + replacing_bytes / n)  # the copy sits beside the old state until it is freed
    if not limit or need <= limit:
        return None
    return (f"the train step needs {_size(need, 2)} per device (state, activations and temporaries"
            f"{', and the current state while it is copied' if need > peak else ''}, by the compiler's "
            f"count) and a {local[0].device_kind} holds {_size(limit, 2)}")


class DoesNotFit(ConfigError):
    """A step that cannot fit in memory (``check_step_fits``); ``problem``: what it needs
    and what there is, without the advice (a tuner's table row)."""

    def __init__(self, problem: str, advice: str):
        super().__init__(f"{problem}; {advice}")
        self.problem = problem


def check_step_fits(compiled, mesh, *, state_resident: bool, free_bytes: float | None = None,
                    advice: str | None = None) -> None:
    """``DoesNotFit`` (a ConfigError, one line) when ``compiled``, the train step, cannot fit
    (``fit_problem``), with what would shrink it (``advice``: another job's keys; default a
    dense run's)."""
    problem = fit_problem(compiled, mesh, state_resident=state_resident, free_bytes=free_bytes)
    if problem is not None:
        raise DoesNotFit(problem, advice or _shrink(mesh))


def check_programs_fit(programs, mesh, *, advice: str | None = None) -> None:
    """``check_step_fits`` for a step run as a chain of compiled ``programs`` (a supernet's
    sliced paths: a start program taking the state, the rounds or passes, a finish program
    giving the new state): the most any of them holds beside the state at once. The
    first's arguments are the state (in memory already) and what it donates of it lives
    on in the later programs' arguments (the carry), so neither is counted twice. Silent
    where the compiler does not say."""
    try:
        stats = [program.memory_analysis() for program in programs]
    except Exception:  # noqa: BLE001 -- a backend without the analysis: nothing to check
        return
    if not stats or any(s is None for s in stats):
        return
    _, arg, temp, out, alias = step_bytes(stats[0])
    beside = max([temp + out - alias] + [step_bytes(s)[0] - alias for s in stats[1:]])

    class Chain:  # the chain as one step: the state as its arguments, the rest beside it
        def memory_analysis(self):
            return types.SimpleNamespace(argument_size_in_bytes=arg, temp_size_in_bytes=beside,
                                         output_size_in_bytes=0, alias_size_in_bytes=0)

    check_step_fits(Chain(), mesh, state_resident=True, advice=advice)


def state_bytes(state) -> float:
    """This process's bytes of ``state`` (a tree of arrays): its addressable shards."""
    return float(sum(shard.data.nbytes for leaf in jax.tree.leaves(state)
                     for shard in getattr(leaf, "addressable_shards", ())))


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
