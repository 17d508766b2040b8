"""What the multi-process benchmarks (``afapab.py``, ``pipeline_2proc.py``) share:
the parent runs its own script again as N worker processes on 127.0.0.1
(``jax.distributed``, one CPU device each) and collects their JSON results.

The parent waits a bounded time and kills only the processes it started; a
worker that fails or times out raises with the end of every worker's log.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    """The hidden options by which ``launch`` tells a worker who it is and where to write."""
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--tmp", help=argparse.SUPPRESS)   # the run's scratch folder (traces)
    parser.add_argument("--result", help=argparse.SUPPRESS)


def start_worker(args, num_processes: int = 2):
    """In a worker: one CPU device, join the coordinator. Returns (spec, log)."""
    import jax

    # Before initialize: the device count is fixed when the backend starts.
    jax.config.update("jax_num_cpu_devices", 1)
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}", num_processes=num_processes,
                               process_id=args.worker, initialization_timeout=60)

    def log(msg):
        print(f"[worker {args.worker}] {msg}", flush=True)

    return json.loads(Path(args.spec).read_text()), log


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script: str, name: str, spec: dict, timeout_s: float, n: int = 2,
           prefix: Sequence[str] = ()) -> list[dict]:
    """Run ``script`` as ``n`` workers (each command behind ``prefix``, e.g. ``ip netns
    exec NAME``); return their results. Kills only the processes it started."""
    tmp = tempfile.mkdtemp(prefix=f"{name}-")
    spec_path = os.path.join(tmp, "spec.json")
    Path(spec_path).write_text(json.dumps(spec))
    port = free_port()
    cores = sorted(os.sched_getaffinity(0))
    env = {**os.environ, "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false", "JAX_PLATFORMS": "cpu",
           "TF_CPP_MIN_LOG_LEVEL": "2",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    procs = []
    failed = None
    try:
        for i in range(n):
            log = open(os.path.join(tmp, f"worker{i}.log"), "w")  # noqa: SIM115  (closed below)
            cmd = [*prefix, sys.executable, os.path.abspath(script), "--worker", str(i), "--port", str(port),
                   "--spec", spec_path, "--tmp", tmp, "--result", os.path.join(tmp, f"result{i}.json")]
            # One core each when there are enough, so the workers really run in parallel.
            pin = (lambda core=cores[i]: os.sched_setaffinity(0, {core})) if len(cores) >= n else None
            procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                           preexec_fn=pin), log))
        deadline = time.monotonic() + timeout_s
        for i, (proc, _) in enumerate(procs):
            try:
                rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                rc = None
            if rc != 0:
                failed = (i, rc)
                break   # a dead peer leaves the other waiting until its own timeout
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    if failed:
        tails = "\n".join(f"--- worker {i} ---\n{Path(tmp, f'worker{i}.log').read_text()[-4000:]}"
                          for i in range(n))
        what = "timed out" if failed[1] is None else f"exited with {failed[1]}"
        raise RuntimeError(f"{name} worker {failed[0]} {what}\n{tails}")
    return [json.loads(Path(tmp, f"result{i}.json").read_text()) for i in range(n)]
