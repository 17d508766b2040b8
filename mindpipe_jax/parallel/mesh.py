"""Devices → a named mesh, and the multi-host start-up that must come first.

Order of operations matters in JAX: the distributed runtime must be initialised,
and the number of simulated CPU devices set, before the first JAX operation
creates a backend. ``setup_runtime`` does both and is safe to call twice.
"""

from __future__ import annotations

import math
import os
import re
import sys
import threading

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from mindpipe_jax.config import MESH_AXES, DistributedConfig, ParallelConfig
from mindpipe_jax.errors import EXIT_DISTRIBUTED, ConfigError

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


def unused_axes(sizes: dict[str, int]) -> str:
    """``got tensor=2, subnet=2; set parallel.tensor=1 and parallel.subnet=1``: the end of
    an error refusing mesh axes a path does not split over."""
    got = ", ".join(f"{a}={n}" for a, n in sizes.items())
    return f"got {got}; set " + " and ".join(f"parallel.{a}=1" for a in sizes)


def manual_axis_names(mesh, axes) -> set[str]:
    """A ``shard_map``'s manual axes: ``axes``, and every other axis of ``mesh`` of size 1.

    A size-1 axis computes the same manual or automatic, but one left automatic makes
    the mesh mixed, and JAX 0.10 then wraps the result of nearly every op it lowers
    inside the ``shard_map`` (each reshape, broadcast, slice) in an all-open sharding
    constraint for the compiler to propagate: a third of a pipelined Gemma step's
    StableHLO (4.4k of 11.8k lines on pipe4 x data2; compile times in
    ``benchmarks/shard_map_axes.py``)."""
    return set(axes) | {a for a, n in mesh.shape.items() if n == 1}


def make_mesh(cfg: ParallelConfig, devices=None) -> Mesh:
    """A mesh with all six named axes (size-1 axes cost nothing and keep specs uniform)."""
    if not isinstance(cfg, ParallelConfig):
        raise ConfigError(f"make_mesh takes a ParallelConfig (a Config's .parallel), "
                          f"got {type(cfg).__name__}")
    devices = list(jax.devices() if devices is None else devices)
    sizes = resolve_axis_sizes(cfg, len(devices), devices[0].platform)
    shape = tuple(sizes[a] for a in MESH_ORDER)
    auto = (AxisType.Auto,) * len(MESH_ORDER)
    if set(devices) == set(jax.devices()):
        # All devices: make_mesh orders them by physical topology on GPU/TPU.
        return jax.make_mesh(shape, MESH_ORDER, axis_types=auto, devices=devices)
    # A subset (the tuner's trials pass one): make_mesh cannot lay it out by topology,
    # so the given order is kept.
    return Mesh(np.asarray(devices).reshape(shape), MESH_ORDER, axis_types=auto)


def refuse_processes(cfg: DistributedConfig, command: str) -> None:
    """``mindpipe plan`` and ``mindpipe tune`` time programs on the devices of the process
    that runs them and decide from those times: launched as several processes, each
    decided from its own (the tuner's next trial, a cost; process 1 of ``plan`` died on a
    cross-host transfer). Refused in one line on every process, before they connect."""
    settings = distributed_settings(cfg)
    if settings is not None and settings["num_processes"] > 1:
        raise ConfigError(f"`{command}` runs as one process (it times programs on this process's devices "
                          f"and decides from those times), and it was launched as process "
                          f"{settings['process_id']} of {settings['num_processes']}: run it once without "
                          f"distributed settings (distributed.*, MINDPIPE_*, SLURM_NTASKS > 1), then give "
                          f"what it picks to every process of `mindpipe train`")


def distributed_settings(cfg: DistributedConfig, environ=os.environ) -> dict | None:
    """The coordinator/process settings a launcher gave us, or None for one process.

    Precedence: explicit config, then ``MINDPIPE_*`` variables, then SLURM's
    (``SLURM_NTASKS``, ``SLURM_PROCID``, first host of ``SLURM_STEP_NODELIST``).
    """
    def env_int(name: str, default: int) -> int:
        raw = environ.get(name, "").strip()
        try:
            return int(raw) if raw else default
        except ValueError:
            raise ConfigError(f"environment variable {name}={raw!r} must be an integer") from None

    coordinator = cfg.coordinator or environ.get("MINDPIPE_COORDINATOR", "")
    count = cfg.num_processes or env_int("MINDPIPE_NUM_PROCESSES", 0)
    pid = cfg.process_id if cfg.process_id >= 0 else env_int("MINDPIPE_PROCESS_ID", -1)
    if not coordinator and env_int("SLURM_NTASKS", 1) > 1:
        nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST", "")
        host = _first_slurm_host(nodelist)
        if host:
            port = environ.get("MINDPIPE_COORDINATOR_PORT", "12355")
            coordinator = f"{host}:{port}"
            count = count or env_int("SLURM_NTASKS", 1)
            pid = pid if pid >= 0 else env_int("SLURM_PROCID", 0)
    if not coordinator:
        # (num_processes=1, process_id=0: one process, which it is without them)
        given = ([f"distributed.num_processes={cfg.num_processes}"] if cfg.num_processes > 1 else []) + \
            ([f"distributed.process_id={cfg.process_id}"] if cfg.process_id > 0 else [])
        if given:  # one process would run alone: the others would wait for it until their timeout
            raise ConfigError(f"{given[0]} needs a coordinator: distributed.coordinator=host:port (process "
                              f"0's address; or MINDPIPE_COORDINATOR, or a SLURM job step of several tasks)")
        return None
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"distributed coordinator {coordinator!r} must be host:port "
                          f"(e.g. 10.0.0.1:12355)")
    if count < 1 or not 0 <= pid < count:
        raise ConfigError(
            f"distributed coordinator {coordinator!r} needs num_processes >= 1 and "
            f"0 <= process_id < num_processes, got num_processes={count}, process_id={pid}")
    settings = dict(coordinator_address=coordinator, num_processes=count, process_id=pid,
                    initialization_timeout=cfg.timeout_s)
    # Process 0 runs the coordinator. JAX binds it to every interface ([::]:port) unless
    # told otherwise: bind it to the address given when that is an IP address. A host
    # name is left to JAX's default, since a name can resolve to another address on
    # process 0 than on the others (Debian maps a machine's own name to 127.0.1.1).
    import ipaddress

    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        ip = None
    if ip is not None:
        settings["coordinator_bind_address"] = f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"
    return settings


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
        except RuntimeError:  # a backend exists: the device count is fixed for this process
            _check_existing_devices(parallel)
    if settings is not None and not jax.distributed.is_initialized():
        _initialize_distributed(settings)


def _check_existing_devices(parallel: ParallelConfig) -> None:
    """JAX ran before ``setup_runtime`` could set the CPU device count. Same count
    (a test session that set it first): nothing to say. Else a mesh that still fits
    gets one warning line, and one that does not a one-line error saying why."""
    have, wanted = jax.device_count(), parallel.simulate_cpu_devices
    if have == wanted:
        return
    why = (f"JAX was initialized before mindpipe_jax could set parallel.simulate_cpu_devices={wanted}, "
           f"so this process has {have} CPU device(s)")
    fix = (f"call mindpipe_jax.setup_runtime(config.parallel, config.distributed) (or "
           f"jax.config.update('jax_num_cpu_devices', {wanted})) before any other JAX operation, "
           f"or set JAX_NUM_CPU_DEVICES={wanted}")
    try:
        resolve_axis_sizes(parallel, have)
    except ConfigError:
        raise ConfigError(f"{why}; {fix}") from None
    sys.stderr.write(f"mindpipe: warning: {why}; running on those. To get {wanted}: {fix}\n")


# JAX aborts the process (SIGABRT, a C++ stack trace) when the other processes do not
# join in time; it cannot be caught. A watchdog that fires first says what happened.
_STARTUP_GRACE_S = 15
# How long a silent process may go before the coordinator declares it dead (JAX's
# default is 100 s); a shorter distributed.timeout_s shortens it too.
_MAX_HEARTBEAT_S = 100


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _check_coordinator_port(bind: str, address: str) -> None:
    """Process 0: ``DistributedError`` (one line) if the coordinator cannot bind ``bind``
    (gRPC would crash the process: a segfault after one log line)."""
    import errno
    import socket

    from mindpipe_jax.errors import DistributedError

    host, port = _split_address(bind)
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise DistributedError(f"distributed start-up failed: the coordinator address {address!r} does not "
                               f"resolve on process 0 ({err.strerror})") from None
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does
        try:
            probe.bind(sockaddr)
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                why = (f"port {port} is already in use on this machine (another run, or another "
                       f"program); choose another port for distributed.coordinator (or "
                       f"MINDPIPE_COORDINATOR / MINDPIPE_COORDINATOR_PORT) on every process")
            elif err.errno == errno.EADDRNOTAVAIL:
                why = (f"{host} is not an address of this machine; process 0 runs the coordinator, "
                       f"so give its own address")
            else:
                why = f"{bind} cannot be bound ({err.strerror})"
            raise DistributedError(f"distributed start-up failed: process 0 cannot run the coordinator "
                                   f"at {address}: {why}") from None


# How long a process other than 0 waits for the coordinator's first answer once a
# connection is accepted: a gRPC server answers at once.
_ANSWER_S = 10
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # + SETTINGS


def _check_coordinator_answers(address: str) -> None:
    """Processes other than 0: once something accepts connections at ``address``, it must
    speak HTTP/2 (gRPC) like JAX's coordinator; a program that does not (the port was
    taken before process 0 could bind it) is a one-line ``DistributedError`` now, not
    after distributed.timeout_s. While nothing listens yet, process 0 may still be
    starting: the watchdog's deadline applies."""
    import socket
    import time

    from mindpipe_jax.errors import DistributedError

    host, port = _split_address(address)
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=_ANSWER_S)
        except OSError:  # refused (nothing listens yet), unreachable, timed out
            time.sleep(0.5)
            continue
        with conn:
            try:
                conn.sendall(_HTTP2_PREFACE)
                head = conn.recv(9)
            except OSError:
                head = b""
        if len(head) >= 4 and head[3] == 4:  # an HTTP/2 SETTINGS frame: a gRPC server
            return
        raise DistributedError(f"distributed start-up failed: what listens at {address} is not a JAX "
                               f"coordinator (it did not answer as one within {_ANSWER_S} s); the port is "
                               f"probably taken by another program: choose another port on every process")


def _initialize_distributed(settings: dict) -> None:
    """``jax.distributed.initialize`` that ends with one clear line, not an abort, when
    the processes do not all join within ``distributed.timeout_s``.

    The watchdog thread runs while the connect call blocks (it releases the GIL);
    JAX's own deadline is set a little later, so the watchdog speaks first.
    """
    timeout = settings["initialization_timeout"]
    address, count, pid = settings["coordinator_address"], settings["num_processes"], settings["process_id"]
    if pid == 0:
        bind = settings.get("coordinator_bind_address") or f"[::]:{address.rpartition(':')[2]}"
        _check_coordinator_port(bind, address)
    if pid == 0:
        what = (f"not all {count} processes joined the coordinator this process (0) runs at {address} "
                f"within distributed.timeout_s={timeout} s")
    else:
        what = (f"process {pid} of {count} could not join the coordinator at {address} within "
                f"distributed.timeout_s={timeout} s (is process 0 running there?)")
    message = (f"{what}; start every process with the same coordinator and num_processes, "
               f"or raise distributed.timeout_s")
    joined = threading.Event()

    def expire() -> None:
        if not joined.is_set():
            sys.stderr.write(f"mindpipe: error: distributed start-up failed: {message}\n")
            sys.stderr.flush()
            os._exit(EXIT_DISTRIBUTED)  # the connect call cannot be interrupted from Python

    watchdog = threading.Timer(timeout, expire)
    watchdog.daemon = True
    watchdog.start()
    try:
        if pid != 0:
            _check_coordinator_answers(address)
        jax.distributed.initialize(**{**settings, "initialization_timeout": timeout + _STARTUP_GRACE_S},
                                   heartbeat_timeout_seconds=min(timeout, _MAX_HEARTBEAT_S))
    finally:
        joined.set()
        watchdog.cancel()
