"""What the benchmark scripts share for printing: output to the terminal and to a
results file at once, and the header lines that say where and how a run was made."""

import contextlib
import datetime
import os
import platform
import sys
import time


class Tee:
    """A text stream that writes (and flushes) to several streams."""

    def __init__(self, *streams):
        self.streams = streams

    def write(self, text):
        for s in self.streams:
            s.write(text)
            s.flush()

    def flush(self):
        for s in self.streams:
            s.flush()


@contextlib.contextmanager
def report(title: str, out_path: str | None):
    """Print to the terminal (and to ``out_path`` when given) between a header line —
    title, date, host, devices, cores, load average, the command — and a footer with
    the total time and the load average at the end."""
    import jax

    out = open(out_path, "w") if out_path else None  # noqa: SIM115
    if out:
        sys.stdout = Tee(sys.__stdout__, out)
    try:
        print(f"# {title}, {datetime.date.today()}, {platform.node()}, {len(jax.devices())} x "
              f"{jax.devices()[0].device_kind}, {os.cpu_count()} cores; load average {os.getloadavg()}")
        print(f"# command: python {' '.join(sys.argv)}")
        t0 = time.perf_counter()
        yield
        print(f"\n# total {time.perf_counter() - t0:.0f} s; load average at end {os.getloadavg()}")
    finally:
        if out:
            sys.stdout = sys.__stdout__
            out.close()


def cpu_header(out, title: str, script: str, argv=None) -> None:
    """A CPU benchmark's first lines on ``out``: ``# title``, the machine and the
    versions, and the command that reproduces the run (``argv``, or this process's)."""
    import flax
    import jax

    print(f"# {title}", file=out)
    print(f"# machine: {os.cpu_count()}-core CPU container ({platform.machine()}, Python "
          f"{platform.python_version()}); jax {jax.__version__}, flax {flax.__version__}", file=out)
    command = " ".join(sys.argv[1:] if argv is None else argv)
    print(f"# command: python {script} {command}\n", file=out)
    out.flush()


def time_round_robin(calls: dict, rounds: int) -> dict:
    """Seconds per call of every ``name: (f, args)``: two warm-up calls each, then
    ``rounds`` rounds of one call of each (``jax.block_until_ready``), so that load drifting
    on a shared machine hits all alike. ``{name: [seconds, ...]}``."""
    import jax

    for f, args in calls.values():
        jax.block_until_ready(f(*args))
        jax.block_until_ready(f(*args))
    times = {k: [] for k in calls}
    for _ in range(rounds):
        for k, (f, args) in calls.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            times[k].append(time.perf_counter() - t0)
    return times
