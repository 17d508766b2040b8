"""Devices → a named mesh, and the multi-host start-up that must come first.

Order of operations matters in JAX: the distributed runtime must be initialised,
and the number of simulated CPU devices set, before the first JAX operation
creates a backend. ``setup_runtime`` does both and is safe to call twice.
"""

from __future__ import annotations

import math
import os
import re

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from mindpipe_jax.config import MESH_AXES, DistributedConfig, ParallelConfig
from mindpipe_jax.errors import ConfigError

# Mesh axis order, outermost first: axes whose collectives are rare or can hide
# behind compute (pipe, data) span the slow links between hosts; tensor, whose
# collectives sit on the critical path of every matmul, is innermost so it stays
# on the fastest links (neighbouring devices of one host).
MESH_ORDER = ("pipe", "data", "subnet", "fsdp", "expert", "tensor")
assert sorted(MESH_ORDER) == sorted(MESH_AXES)

__all__ = ["ParallelConfig", "MESH_ORDER", "resolve_axis_sizes", "make_mesh",
           "setup_runtime", "distributed_settings"]


def resolve_axis_sizes(cfg: ParallelConfig, num_devices: int, platform: str = "cpu") -> dict[str, int]:
    """Axis sizes with ``tensor=0`` (auto) decided and the one ``-1`` filled;
    refuse products that do not fit."""
    sizes = cfg.axis_sizes()
    if sizes["tensor"] == 0:
        # Auto: 2 only where it cannot break an explicit layout: simulated CPU
        # devices, another axis left to fill, and room for a factor of two.
        others = math.prod(n for a, n in sizes.items() if n > 0)
        room = -1 in sizes.values() and num_devices % (2 * others) == 0 and num_devices >= 4
        sizes["tensor"] = 2 if platform == "cpu" and room else 1
    fixed = math.prod(n for n in sizes.values() if n != -1)
    described = " x ".join(f"{a}={n}" for a, n in sizes.items() if n != 1)
    fill = [a for a, n in sizes.items() if n == -1]
    if fill:
        if num_devices % fixed:
            raise ConfigError(
                f"parallel axes {described or 'all 1'} need a multiple of {fixed} devices to fill "
                f"{fill[0]}=-1, but there are {num_devices} devices")
        sizes[fill[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise ConfigError(
            f"parallel axes {described or 'all 1'} multiply to {fixed} devices, but there are "
            f"{num_devices} devices; make the product {num_devices} or set one axis to -1")
    return sizes


def make_mesh(cfg: ParallelConfig, devices=None) -> Mesh:
    """A mesh with all six named axes (size-1 axes cost nothing and keep specs uniform)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = resolve_axis_sizes(cfg, len(devices), devices[0].platform)
    shape = tuple(sizes[a] for a in MESH_ORDER)
    auto = (AxisType.Auto,) * len(MESH_ORDER)
    try:
        # make_mesh orders devices by physical topology on GPU/TPU.
        return jax.make_mesh(shape, MESH_ORDER, axis_types=auto, devices=devices)
    except (ValueError, NotImplementedError):
        return Mesh(np.asarray(devices).reshape(shape), MESH_ORDER, axis_types=auto)


def distributed_settings(cfg: DistributedConfig, environ=os.environ) -> dict | None:
    """The coordinator/process settings a launcher gave us, or None for one process.

    Precedence: explicit config, then ``MINDPIPE_*`` variables, then SLURM's
    (``SLURM_NTASKS``, ``SLURM_PROCID``, first host of ``SLURM_STEP_NODELIST``).
    """
    coordinator = cfg.coordinator or environ.get("MINDPIPE_COORDINATOR", "")
    count = cfg.num_processes or int(environ.get("MINDPIPE_NUM_PROCESSES", "0") or 0)
    pid = cfg.process_id if cfg.process_id >= 0 else int(environ.get("MINDPIPE_PROCESS_ID", "-1") or -1)
    if not coordinator and int(environ.get("SLURM_NTASKS", "1") or 1) > 1:
        nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST", "")
        host = _first_slurm_host(nodelist)
        if host:
            port = environ.get("MINDPIPE_COORDINATOR_PORT", "12355")
            coordinator = f"{host}:{port}"
            count = count or int(environ["SLURM_NTASKS"])
            pid = pid if pid >= 0 else int(environ.get("SLURM_PROCID", "0"))
    if not coordinator:
        return None
    if count < 1 or not 0 <= pid < count:
        raise ConfigError(
            f"distributed coordinator {coordinator!r} needs num_processes >= 1 and "
            f"0 <= process_id < num_processes, got num_processes={count}, process_id={pid}")
    return dict(coordinator_address=coordinator, num_processes=count, process_id=pid,
                initialization_timeout=cfg.timeout_s)


def _first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list such as ``node[003-005,010],gpu7``."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        return ""
    prefix, ranges = match.groups()
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _platforms_without_accelerator() -> bool:
    import importlib.util
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return True
    names = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "libtpu")
    return all(importlib.util.find_spec(n) is None for n in names)


def setup_runtime(parallel: ParallelConfig, distributed: DistributedConfig) -> None:
    """Call before any other JAX operation: multi-host init, simulated CPU devices."""
    settings = distributed_settings(distributed)
    if parallel.simulate_cpu_devices and _platforms_without_accelerator():
        try:
            jax.config.update("jax_num_cpu_devices", parallel.simulate_cpu_devices)
        except RuntimeError:
            pass  # a backend already exists (e.g. a test session set its own count)
    if settings is not None and not jax.distributed.is_initialized():
        jax.distributed.initialize(**settings)
