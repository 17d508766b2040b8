"""Simulator vs a real 2-process pipeline: measured step time against predicted.

Two worker processes on 127.0.0.1 (``jax.distributed``, one CPU device each,
``--xla_cpu_multi_thread_eigen=false``, each pinned to its own core when the
machine has two) form a mesh ``pipe=2`` and run the vPipe runtime
(``runtime.pipeline_grads``, residual mode) on the reference GPT, split in two
stages, for several schedules, fuse modes and microbatch counts, as the runtime
runs them now: fused ticks (``fuse_mode``, default "auto": per tick a device runs
up to one F, one backward and one W) and, for zb-h1, B and W split at the equation
level (``runtime/bwsplit.py``). The parent process calibrates the simulator on some
of those runs, predicts the step time of the others with the fused neighbour
replay (``simulate(fused, mode="neighbour")`` of the very ``FusedSchedule`` that
``tickplan.make_plan`` gives the runtime) and prints measured against predicted,
and per device the replay's busy / waiting time in the tick loop against the
profiled one (and each process's CPU time per call).

Measurement. Every configuration is compiled once, warmed up, then called once
per round (in a new shuffled order each round) for ``--rounds`` rounds: the load
of other jobs on this shared machine drifts, and interleaving the runs makes it
hit every configuration alike.
``measured`` is the median wall time of a call on process 0 (the step ends with
a ``psum`` over both processes, so both see the same time).

Calibration (only the runs marked ``calibration``: every schedule at m = 2, and
gpipe at m = 3, all with fuse mode "table", one task per tick, so that a tick's busy
time is one task's; zb-h1's B and W ticks then run the split B and W branches the
fused runs run, so their costs are those of what each branch executes):

* Per-task costs, in the runtime form that is predicted. In every round the
  calibration runs are also called once under ``jax.profiler``; the XLA CPU
  thunk trace gives, per device and tick, when the tick's two ``ppermute``s
  started and ended. A device's *busy* time in a tick is everything outside the
  two ppermutes (its task, slot reads and writes, the idle branch); the ppermute
  time is waiting for the other device plus the transfer. Means (a step is a sum
  of ticks) over ticks >= 1 (tick 0 also pays the loop entry) and rounds, per
  (device, task kind, global stage): ``tick_overhead[s]`` = busy of an idle tick
  on device ``s``, task cost = busy - ``tick_overhead[s]``.
* Transfers: a dedicated probe times a ``ppermute`` of 16 KiB to 4 MiB (both
  directions at once, as in the runtime) in a loop and fits ``time = α + n / bw``
  (``simulate.fit_alpha_beta``): the bandwidth. The latency is taken in the
  runtime: the device that finishes a tick's work last then spends
  ``2 (α + n / bw)`` in the two ppermutes; that α includes waking a process that
  slept while it waited, which the probe's tight loop never pays.
* What the simulator does not model — dispatch, the set-up before the tick loop
  and the loop's entry (allocating, filling and copying in the slot buffers: it
  grows with them) and the gradient ``psum`` after it — is ``a_v + b x``, ``x``
  the step's temp memory in MiB (``memory_analysis().temp_size_in_bytes``,
  mostly slot buffers). ``b``: slope of the profiled time before the loop plus
  tick 0 against ``x``; ``a_v`` (one per chunk layout ``v``): the median of
  measured - simulated - ``b x`` over the calibration runs.

Prediction: ``neighbour`` simulates what the runtime does (per-device clocks; every
fused tick each device runs its tasks, one after the other, and bookkeeping, then
two ppermutes in a row, and waits only for its ring neighbours); ``1/tick`` replays
the same costs one task per tick (``fuse="table"``, the model before fused ticks)
for comparison. Both get the same costs; each gets ``a_v`` from its own
simulation. The error is (predicted - measured) / measured.

Per device: every run is also profiled once per round; the busy time of a device
(its ticks outside the ppermutes, summed) and its ppermute time are set beside the
replay's busy time (tasks + ``tick_overhead``) and the rest of its step. Each
process also records its CPU time (``time.process_time``) per unprofiled call.

``--diagnose`` prints how each task's busy time in the predicted runs compares
with the calibration runs (for explaining errors; the predictions never use it).

Usage: ``python benchmarks/pipeline_2proc.py [--rounds 12] [--out FILE] [--smoke]``.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import gzip
import io
import json
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _procs import add_worker_args, launch, start_worker  # noqa: E402  (benchmarks/ is on sys.path)
from _report import Tee, cpu_header  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

FULL = dict(vocab=256, seq=64, d_model=128, heads=4, layers=4, rows=8)
SMOKE = dict(vocab=64, seq=16, d_model=32, heads=2, layers=4, rows=4)


def configurations(smoke: bool) -> list[dict]:
    """(schedule, m, v, role). The calibration runs cover every (device, task kind,
    global stage) the predicted runs use."""
    def c(name, m, v=1, role="prediction", fuse="auto", split_last=None):
        label = name if split_last is None else f"{name} last{split_last}"  # parallel.split_last
        return dict(key=f"{label} {fuse} v={v} m={m}", schedule=name, label=label, m=m, v=v, role=role,
                    fuse=fuse, split_last=split_last)

    if smoke:   # two compiles only: the test that runs this must stay short
        return [c("gpipe", 2, role="calibration", fuse="table"), c("1f1b", 4)]
    # The m = 2 run of every schedule. Not m = 1: with one buffer slot XLA elides the
    # per-tick slot copies (an idle tick costs half), a regime no predicted run is in.
    # And a task's cost on this machine depends on what the other core runs meanwhile
    # (shared caches and memory; other jobs move to whichever core idles), so the
    # calibration runs should show the predicted runs' pairings of tasks. gpipe at
    # m = 3 adds a bigger buffer for the slope of the set-up.
    # The calibration runs run one task per tick (fuse mode "table"), so that a tick's
    # busy time is one task's (plus the tick's bookkeeping); the predicted runs run the
    # runtime's default fused ticks ("auto"), and for comparison zb-h1 with "fill" (W's
    # only into bubbles) and 1f1b with "table" (the unfused table).
    schedules = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1))
    calib = [c(name, 2, v, role="calibration", fuse="table") for name, v in schedules]
    calib.append(c("gpipe", 3, role="calibration", fuse="table"))
    preds = [c(name, m, v) for name, v in schedules for m in (4, 8)]
    preds += [c("zb-h1", m, fuse="fill") for m in (4, 8)] + [c("1f1b", m, fuse="table") for m in (4, 8)]
    # Only the last 2 microbatches split (parallel.split_last=2): the others' BW runs the
    # unsplit backward on the split's residuals, priced with the calibrated BW.
    preds += [c("zb-h1", 8, split_last=2)]
    return calib + preds


# ====================================================================== worker
def _trace_file(trace_dir: str) -> str:
    files = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if len(files) != 1:
        raise RuntimeError(f"expected one perfetto trace under {trace_dir}, found {files}")
    return files[0]


def tick_loop_names(hlo: str, ticks: int) -> tuple[str, str, list[str]]:
    """HLO names of the module, of the tick loop (the entry computation's ``while``
    with ``ticks`` iterations) and of its two collective-permutes."""
    module = re.match(r"HloModule (\S+?),", hlo).group(1)
    permutes = re.findall(r"%(\S+) = \S+ collective-permute\(", hlo)
    entry = hlo[hlo.index("\nENTRY"):]
    loop_re = r'%(\S+) = .*? while\(.*"known_trip_count":\{"n":"(\d+)"\}'
    loops = [name for name, n in re.findall(loop_re, entry) if int(n) == ticks]
    if len(permutes) != 2 or len(loops) != 1:
        raise RuntimeError(f"cannot find the tick loop ({loops}) and its two ppermutes ({permutes})")
    return module, loops[0], permutes


def parse_trace(path: str, module: str, loop: str, permutes: list[str], ticks: int) -> list[dict]:
    """Per profiled call, per tick: this device's busy time (everything outside the
    two ppermutes, from the end of the previous tick's second ppermute, or the loop
    start, to the start of this tick's first, plus the gap between the two) and the
    time spent in each ppermute. Seconds."""
    with gzip.open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    by_run: dict[str, list[dict]] = {}
    for e in events:
        args = e.get("args") or {}
        if e.get("ph") == "X" and args.get("hlo_module") == module and not e["name"].startswith("end:"):
            by_run.setdefault(args.get("run_id"), []).append(e)
    calls = []
    for evs in by_run.values():
        evs.sort(key=lambda e: e["ts"])
        starts = [e["ts"] for e in evs if e["name"] == loop]
        pp = [e for e in evs if e["name"] in permutes]
        if not starts or len(pp) != 2 * ticks:
            continue   # not a call of this executable
        busy, waits, prev = [], [], starts[0]
        for t in range(ticks):
            a, b = pp[2 * t], pp[2 * t + 1]
            busy.append(((a["ts"] - prev) + (b["ts"] - a["ts"] - a["dur"])) * 1e-6)
            waits.append((a["dur"] + b["dur"]) * 1e-6)
            prev = b["ts"] + b["dur"]
        end = max(e["ts"] + e["dur"] for e in evs)
        calls.append(dict(busy=busy, ppermute=waits, prologue=(starts[0] - evs[0]["ts"]) * 1e-6,
                          epilogue=(end - prev) * 1e-6, total=(end - evs[0]["ts"]) * 1e-6))
    return calls


def worker(args) -> None:
    spec, log = start_worker(args)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax import lax
    from jax.experimental.multihost_utils import broadcast_one_to_all, sync_global_devices
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from mindpipe_jax.config import ModelConfig, ParallelConfig
    from mindpipe_jax.models.gpt import GPT
    from mindpipe_jax.parallel.mesh import make_mesh
    from mindpipe_jax.parallel.pipeline import get_schedule
    from mindpipe_jax.parallel.pipeline.contract import stage_fns
    from mindpipe_jax.parallel.pipeline.runtime import pipeline_grads
    from mindpipe_jax.parallel.pipeline.runtime.tickplan import make_plan

    dims = spec["dims"]
    cfg = ModelConfig(vocab_size=dims["vocab"], seq_len=dims["seq"], d_model=dims["d_model"],
                      n_layers=dims["layers"], n_heads=dims["heads"])
    model = GPT(cfg, rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    fns = stage_fns(model)
    m_max = max(c["m"] for c in spec["configs"])
    tokens = np.random.default_rng(0).integers(0, dims["vocab"], (m_max, dims["rows"], dims["seq"] + 1))
    tokens = tokens.astype(np.int32)
    devices = sorted(jax.devices(), key=lambda d: d.process_index)   # stage s on process s
    mesh = make_mesh(ParallelConfig(pipe=2, data=1, tensor=1, simulate_cpu_devices=0), devices=devices)
    replicated = NamedSharding(mesh, P())
    weights = jax.device_put((params["embed"], params["blocks"], params["head"]), replicated)
    result = {"process": args.worker, "load": [os.getloadavg()[0]], "profiles": {}, "temp_bytes": {},
              "times": {}, "cpu": {}, "probe": {}}

    # Both processes compile and call the same executables in the same order (SPMD).
    compiled = {}
    for c in spec["configs"]:
        sched = get_schedule(c["schedule"], 2, c["m"], c["v"], c["split_last"])
        run = pipeline_grads(fns, sched, mesh, remat=False, fuse_mode=c["fuse"])
        ticks = make_plan(sched, False, c["fuse"]).num_ticks   # the fused ticks the runtime runs

        def step(*a, run=run):
            return run(*a)
        # A name of its own: the profiler's events carry the module name, and the
        # executables of different runs otherwise share every HLO name.
        step.__name__ = step.__qualname__ = "step_" + re.sub(r"\W+", "_", c["key"])
        data = jax.device_put((tokens[:c["m"], :, :-1], tokens[:c["m"], :, 1:]), replicated)
        step_args = (*weights, *data)
        t0 = time.perf_counter()
        with jax.set_mesh(mesh):
            exe = jax.jit(step).lower(*step_args).compile()
        result["temp_bytes"][c["key"]] = exe.memory_analysis().temp_size_in_bytes
        # Every run is profiled: the predicted runs' per-device busy time (outside the
        # ppermutes) is compared with the replay's.
        names = tick_loop_names(exe.as_text(), ticks)
        compiled[c["key"]] = (exe, step_args, ticks, names)
        for _ in range(2):   # warm-up
            jax.block_until_ready(exe(*step_args))
        log(f"{c['key']}: compiled and warmed up in {time.perf_counter() - t0:.1f} s")

    # Transfer probe: a loop of ppermutes of n bytes, both directions at once as in
    # the runtime; seconds per ppermute = call time / iterations. Fixed sizes around
    # the runtime's buffer, wide enough apart that the bandwidth term shows.
    probe_iters = spec["probe_iters"]

    def probe_fn(x):
        return lax.fori_loop(0, probe_iters, lambda _, y: lax.ppermute(y, "pipe", [(0, 1), (1, 0)]), x)

    probes = {}
    for nbytes in spec["probe_bytes"]:
        x = jax.device_put(jnp.ones((2, nbytes // 4), jnp.float32), NamedSharding(mesh, P("pipe")))
        fn = jax.shard_map(probe_fn, mesh=mesh, in_specs=P("pipe"), out_specs=P("pipe"), axis_names={"pipe"})
        exe = jax.jit(fn).lower(x).compile()
        jax.block_until_ready(exe(x))
        probes[nbytes] = (exe, x)
    for _ in range(spec["probe_repeats"]):
        for nbytes, (exe, x) in probes.items():
            t0 = time.perf_counter()
            jax.block_until_ready(exe(x))
            result["probe"].setdefault(str(nbytes), []).append((time.perf_counter() - t0) / probe_iters)
    log("transfer probe done")

    rounds_start = time.monotonic()
    for r in range(spec["rounds"]):
        # Calibration runs under the profiler (one call each), then every run timed. The
        # barriers keep one process's profiler start-up or trace export out of the
        # other's timed calls (a ppermute would wait for it).
        sync_global_devices(f"profile {r}")
        trace_dir = tempfile.mkdtemp(prefix=f"trace{args.worker}-{r}-", dir=args.tmp)
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 0   # Python frames add overhead and are not needed
        # A new order every round (the same on both processes: it is SPMD), so that no
        # configuration always runs right after a heavy one or at the end of a block.
        order = sorted(compiled)
        random.Random(r).shuffle(order)
        jax.profiler.start_trace(trace_dir, create_perfetto_trace=True, profiler_options=options)
        for key in order:
            exe, step_args, _, names = compiled[key]
            if names is not None:
                jax.block_until_ready(exe(*step_args))
        jax.profiler.stop_trace()
        sync_global_devices(f"time {r}")
        for key in order:
            exe, step_args, _, _ = compiled[key]
            t0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(exe(*step_args))
            result["times"].setdefault(key, []).append(time.perf_counter() - t0)
            # This process's CPU time in the call (all its threads; one core each).
            result["cpu"].setdefault(key, []).append(time.process_time() - c0)
        path = _trace_file(trace_dir)
        for key, (_, _, ticks, names) in compiled.items():
            if names is not None:
                calls = parse_trace(path, *names, ticks)
                if len(calls) != 1:
                    raise RuntimeError(f"{key}: {len(calls)} profiled calls found in the trace instead of 1; "
                                       f"this benchmark reads the XLA CPU runtime's per-thunk trace events")
                result["profiles"].setdefault(key, []).extend(calls)
        shutil.rmtree(trace_dir, ignore_errors=True)
        log(f"round {r + 1}/{spec['rounds']} done")
        # Stop early, on both processes alike, once the rounds have used their budget:
        # a loaded machine must not push the run past the parent's timeout.
        spent = np.array(time.monotonic() - rounds_start)
        if r + 1 >= 3 and float(broadcast_one_to_all(spent)) * (r + 2) / (r + 1) > spec["budget_s"]:
            log(f"time budget reached after {r + 1} rounds")
            break
    result["load"].append(os.getloadavg()[0])
    Path(args.result).write_text(json.dumps(result))
    log("done")


# ====================================================================== parent
def fused_plan(c: dict):
    """The fused schedule the runtime runs for configuration ``c`` (as
    ``pipeline_grads`` makes it: ``tickplan.make_plan`` with the default fuse cost)."""
    from mindpipe_jax.parallel.pipeline import get_schedule
    from mindpipe_jax.parallel.pipeline.runtime.tickplan import make_plan

    return make_plan(get_schedule(c["schedule"], 2, c["m"], c["v"], c["split_last"]), False, c["fuse"]).fused


def _task_key(fused, t: int, s: int):
    """``"idle"``, ``(kind, global stage)`` for a tick running one task, or a tuple of
    them for a fused tick running several."""
    sched = fused.schedule
    keys = tuple((task.kind.value, sched.global_stage(s, task.chunk)) for task in fused.cells[t][s] if task)
    return "idle" if not keys else keys[0] if len(keys) == 1 else keys


def busy_samples(configs: list[dict], results: list[dict]) -> dict[tuple, list[float]]:
    """(v, device, task key) -> busy seconds of that device in the ticks running that
    task (key ``(kind, global stage)`` or ``"idle"``) in the profiled calls of ``configs``."""
    samples: dict[tuple, list[float]] = {}
    first: dict[tuple, list[float]] = {}     # the same, from tick 0
    for c in configs:
        fused = fused_plan(c)
        for s in range(2):
            for call in results[s]["profiles"][c["key"]]:
                for t in range(fused.num_ticks):
                    # Tick 0 also pays the loop entry: used only for a task seen nowhere else.
                    into = samples if t else first
                    into.setdefault((c["v"], s, _task_key(fused, t, s)), []).append(call["busy"][t])
    for key, xs in first.items():
        samples.setdefault(key, xs)
    return samples


def calibrate(configs: list[dict], results: list[dict], dims: dict) -> dict:
    """Costs for the simulator from the calibration runs (see the module docstring)."""
    from mindpipe_jax.errors import ConfigError
    from mindpipe_jax.sim import Link, StageCosts, fit_alpha_beta

    # Means, not medians, of per-tick samples: a step is a sum of many ticks, and the
    # median over calls of a sum is close to the sum of the means; on a loaded
    # machine the per-tick times are skewed (preemptions), and medians would miss
    # the tail that every long call collects.
    mean = statistics.fmean
    calib = [c for c in configs if c["role"] == "calibration"]
    samples = busy_samples(calib, results)
    act_bytes = dims["rows"] * dims["seq"] * dims["d_model"] * 4
    layouts = {}
    for v in sorted({c["v"] for c in configs}):
        overhead = [mean(samples[(v, s, "idle")]) for s in range(2)]
        G = 2 * v
        table = {k: [0.0] * G for k in ("F", "B", "W", "BW")}
        for (vv, s, key), xs in samples.items():
            if vv == v and key != "idle" and isinstance(key[0], str):   # one task per tick
                kind, g = key
                table[kind][g] = max(mean(xs) - overhead[s], 0.0)
        costs = StageCosts(F=table["F"], B=table["B"], W=table["W"], BW=table["BW"],
                           activation_bytes=act_bytes)
        layouts[v] = dict(overhead=overhead, costs=costs, table=table)
    # Bandwidth from the probe (large messages); the per-ppermute latency from the
    # runtime itself: in a tick, the device that finishes its work last waits only
    # for the two transfers, 2 (alpha + n / bw). This alpha includes waking a process
    # that slept in the ppermute, which the probe's tight loop never pays.
    probe = {int(n): statistics.median(ts) for n, ts in results[0]["probe"].items()}
    try:
        fitted, note = fit_alpha_beta(list(probe), list(probe.values())), ""
    except ConfigError:   # noise larger than the size effect (a loaded machine, tiny sizes)
        fitted = Link(latency_s=min(probe.values()))
        note = " (times did not grow with size: no bandwidth term)"
    waits = []
    for c in calib:
        ticks = fused_plan(c).num_ticks
        for a, b in zip(results[0]["profiles"][c["key"]], results[1]["profiles"][c["key"]], strict=True):
            for t in range(1, ticks):
                waits.append((a if a["busy"][t] >= b["busy"][t] else b)["ppermute"][t])
    alpha = max(mean(waits) / 2 - fitted.occupancy(act_bytes), 0.0)
    link = Link(latency_s=alpha, bandwidth_Bps=fitted.bandwidth_Bps)
    return dict(layouts=layouts, link=link, probe_link=fitted, probe=probe, act_bytes=act_bytes,
                link_note=note)


def predict(configs, results, cal) -> list[dict]:
    from mindpipe_jax.parallel.pipeline.schedules.fused import FUSE_MODES, fuse
    from mindpipe_jax.sim import simulate

    rows = []
    for c in configs:
        fused = fused_plan(c)   # the runtime's fused ticks
        sched = fused.schedule
        picked = c["fuse"]
        if picked == "auto":    # which mode "auto" picked (the same cells)
            picked = next((m for m in FUSE_MODES[1:] if fuse(sched, m).cells == fused.cells), "?")
        lay = cal["layouts"][c["v"]]
        kw = dict(link=cal["link"], mode="neighbour", tick_overhead=lay["overhead"])
        # "neighbour": the fused ticks as the runtime runs them (the prediction);
        # "table": the same costs replayed one task per tick (the pre-fusion model).
        sim = {"neighbour": simulate(fused, lay["costs"], **kw),
               "table": simulate(sched, lay["costs"], fuse="table", **kw)}
        times = results[0]["times"][c["key"]]
        q = statistics.quantiles(times, n=4) if len(times) >= 2 else [times[0]] * 3
        nb = sim["neighbour"]
        # Per device, in the tick loop: the replay's busy time (tasks + per-tick
        # bookkeeping) and the rest of its step (waiting + transfers), against the
        # profiled busy time (outside the ppermutes) and ppermute time, and the CPU time.
        # Busy over ticks >= 1: tick 0 also runs the loop's entry (copying the carried
        # buffers in), which the model counts in the set-up, not in the tick.
        per_device = []
        for d in range(2):
            profs = results[d]["profiles"].get(c["key"], [])
            ov = lay["overhead"][d]
            tick0 = ov + (nb.end[0][d] - nb.start[0][d] if nb.start[0][d] is not None else 0.0)
            per_device.append(dict(
                sim_busy=nb.busy[d] + fused.num_ticks * ov - tick0,
                sim_idle=nb.step_time - nb.busy[d] - fused.num_ticks * ov,
                busy=statistics.median(sum(x["busy"][1:]) for x in profs) if profs else float("nan"),
                wait=statistics.median(sum(x["ppermute"]) for x in profs) if profs else float("nan"),
                cpu=statistics.median(results[d]["cpu"][c["key"]]),
                wall=statistics.median(results[d]["times"][c["key"]])))
        rows.append(dict(c, ticks=fused.num_ticks, table_ticks=sched.num_ticks, picked=picked,
                         measured=statistics.median(times), q1=q[0], q3=q[2],
                         calls=len(times), temp=results[0]["temp_bytes"][c["key"]],
                         sim={k: r.step_time for k, r in sim.items()},
                         util=nb.utilization, per_device=per_device))
    # The set-up the simulator does not model, a_v + b * temp MiB. The slope b: least
    # squares of what a calibration call spends before the tick loop and in tick 0
    # (where the loop copies its carried buffers in), from the profile of device 0,
    # against temp (one intercept per layout). Then a_v: the median over the layout's
    # calibration runs of measured - simulated - b * temp, for each mode on its own
    # simulation, so neither mode is scored with the other's fit.
    import numpy as np

    calib = [r for r in rows if r["role"] == "calibration"]
    vs = sorted({r["v"] for r in rows})
    entry = [statistics.median(call["prologue"] + call["busy"][0] + call["ppermute"][0]
                               for call in results[0]["profiles"][r["key"]]) for r in calib]
    design = np.array([[float(r["v"] == v) for v in vs] + [r["temp"] / 2**20] for r in calib])
    b = 0.0
    if np.linalg.matrix_rank(design) == design.shape[1] and len(calib) > design.shape[1]:
        b = float(np.linalg.lstsq(design, np.array(entry), rcond=None)[0][-1])
    cal["setup"] = {}
    for mode in ("neighbour", "table"):
        a = {v: statistics.median(r["measured"] - r["sim"][mode] - b * r["temp"] / 2**20
                                  for r in calib if r["v"] == v) for v in vs}
        cal["setup"][mode] = dict(a=a, b_per_MiB=b)
        for r in rows:
            r.setdefault("setup", {})[mode] = a[r["v"]] + b * r["temp"] / 2**20
            r.setdefault("pred", {})[mode] = r["sim"][mode] + r["setup"][mode]
    return rows



def report(out, args, dims, configs, results, cal, rows) -> None:
    ms = lambda x: f"{1e3 * x:.1f}"  # noqa: E731
    rounds = len(next(iter(results[0]["times"].values())))
    print(f"Model: reference GPT, {dims['layers']} layers (d_model {dims['d_model']}, {dims['heads']} heads, "
          f"vocab {dims['vocab']}), seq {dims['seq']}, microbatch {dims['rows']} rows, fp32; p=2 stages on "
          f"2 processes (127.0.0.1, one CPU device and one core each), vPipe runtime (fused ticks, "
          f"equation-level B/W split for zb-h1), residual mode (remat=False). "
          f"{rounds} rounds; load average {results[0]['load'][0]:.1f} at the start, "
          f"{results[0]['load'][1]:.1f} at the end.", file=out)
    print("\nCalibration (from the calibration runs only):", file=out)
    for v, lay in cal["layouts"].items():
        print(f"  v={v}: tick overhead (busy time of an idle tick) device 0 {ms(lay['overhead'][0])} ms, "
              f"device 1 {ms(lay['overhead'][1])} ms; task costs (busy - overhead), ms per global stage:",
              file=out)
        for kind, vals in lay["table"].items():
            if any(vals):
                cells = "  ".join(f"g{g} {ms(x):>6}" for g, x in enumerate(vals))
                print(f"      {kind:<2} {cells}", file=out)
    link, fitted = cal["link"], cal["probe_link"]
    probe = ", ".join(f"{n / 1024:.0f} KiB {1e3 * t:.3f} ms" for n, t in sorted(cal["probe"].items()))
    print(f"  transfer probe (median per ppermute): {probe}", file=out)
    print(f"  -> fit alpha {1e6 * fitted.latency_s:.0f} us, bandwidth {fitted.bandwidth_Bps / 1e9:.2f} GB/s"
          f"{cal['link_note']}", file=out)
    print(f"  in the runtime (last device to finish a tick: its two ppermutes, mean): alpha "
          f"{1e6 * link.latency_s:.0f} us with the probe's bandwidth; the {cal['act_bytes'] / 1024:.0f} KiB "
          f"buffer: {1e3 * link.time(cal['act_bytes']):.3f} ms per ppermute, two per tick", file=out)
    b = cal["setup"]["neighbour"]["b_per_MiB"]
    print(f"  set-up outside the simulated tick loop, a_v + b x temp MiB: b {1e3 * b:.2f} ms per MiB "
          f"(profiled pre-loop + tick 0 against temp); a_v = median of measured - simulated - b x temp:",
          file=out)
    for mode, fit in cal["setup"].items():
        print(f"      {mode}: " + ", ".join(f"a(v={v}) {ms(x)} ms" for v, x in fit["a"].items()), file=out)
    prof = [(statistics.median(c["total"] for c in results[0]["profiles"][r["key"]]), r["measured"])
            for r in rows if r["role"] == "calibration"]
    print("  profiler check, calibration runs, profiled / unprofiled call (median): "
          + ", ".join(f"{p / u:.2f}" for p, u in prof), file=out)

    head = (f"\n{'schedule':<17} {'v':>1} {'m':>2} {'ticks':>5} {'role':<11} {'measured ms':>11} "
            f"{'IQR ms':>13} {'neighbour ms':>12} {'err':>6} {'1/tick ms':>9} {'err':>6} "
            f"{'set-up ms':>9} {'util':>9} {'fused as':<13}")
    print(head, file=out)
    print("-" * len(head), file=out)
    for r in rows:
        err = {k: (p - r["measured"]) / r["measured"] for k, p in r["pred"].items()}
        util = "/".join(f"{u:.2f}" for u in r["util"])
        name = f"{r['label']}/{r['fuse']}"
        print(f"{name:<17} {r['v']:>1} {r['m']:>2} {r['ticks']:>5} {r['role']:<11} "
              f"{ms(r['measured']):>11} {ms(r['q1']) + '-' + ms(r['q3']):>13} "
              f"{ms(r['pred']['neighbour']):>12} "
              f"{err['neighbour']:>+6.1%} {ms(r['pred']['table']):>9} {err['table']:>+6.1%} "
              f"{ms(r['setup']['neighbour']):>9} {util:>9} {r['picked']:<13}", file=out)
    preds = [r for r in rows if r["role"] == "prediction"]
    for mode, what in (("neighbour", "fused neighbour replay (the prediction)"),
                       ("table", "one task per tick replay (comparison)")):
        errs = [abs(r["pred"][mode] - r["measured"]) / r["measured"] for r in preds]
        inside = sum(e <= 0.15 for e in errs)
        print(f"{what}: predictions within +-15%: {inside}/{len(errs)}; max |err| {max(errs):.1%}, "
              f"mean |err| {statistics.mean(errs):.1%}", file=out)
    print("(schedule/fuse mode as run; ticks: fused ticks; fused as: the mode the runtime's 'auto' "
          "picked. neighbour: simulate(mode='neighbour') of the runtime's fused ticks + set-up; 1/tick: "
          "the same costs replayed one task per tick (fuse='table'), as before the runtime fused; util: "
          "simulated per-device utilization, device 0/1. measured: median over rounds of process 0's wall "
          "time per call; IQR: its quartiles.)", file=out)

    print("\nPer device, tick loop only (neighbour replay vs the profiled calls, medians over rounds), ms: "
          "busy = the device's work in ticks >= 1 (sim: tasks + per-tick bookkeeping; measured: everything "
          "outside the ppermutes in the XLA trace; tick 0 also pays the loop entry, which the model puts "
          "in the set-up), wait = the rest of the loop, all ticks (sim: step - busy; measured: time in "
          "the ppermutes: waiting for the other device + transfers); cpu / wall: process CPU time "
          "(time.process_time) and wall time of an unprofiled call, whole step.", file=out)
    head = (f"{'schedule':<17} {'m':>2} {'dev':>3} {'sim busy':>8} {'busy':>8} {'err':>6} {'sim wait':>8} "
            f"{'wait':>8} {'cpu':>8} {'wall':>8} {'cpu/wall':>8}")
    print(head, file=out)
    print("-" * len(head), file=out)
    busy_errs = []
    for r in rows:
        for d, x in enumerate(r["per_device"]):
            e = (x["sim_busy"] - x["busy"]) / x["busy"]
            if r["role"] == "prediction":
                busy_errs.append(abs(e))
            print(f"{r['label'] + '/' + r['fuse']:<17} {r['m']:>2} {d:>3} {ms(x['sim_busy']):>8} "
                  f"{ms(x['busy']):>8} {e:>+6.1%} {ms(x['sim_idle']):>8} {ms(x['wait']):>8} "
                  f"{ms(x['cpu']):>8} {ms(x['wall']):>8} {x['cpu'] / x['wall']:>8.2f}", file=out)
    print(f"per-device busy, predicted runs: max |err| {max(busy_errs):.1%}, mean |err| "
          f"{statistics.mean(busy_errs):.1%}", file=out)
    cpu_ratio = statistics.median(x["cpu"] / x["wall"] for r in rows for x in r["per_device"])
    print(f"(process CPU time / wall time, median {cpu_ratio:.2f}: "
          + ("a process that waits in a ppermute spins on its core (CPU time ~ wall time), so CPU time "
             "does not separate work from waiting here; the trace's busy time does."
             if cpu_ratio > 0.9 else
             "CPU time excludes most of the waiting; it also counts the set-up outside the tick loop.")
          + ")", file=out)
    if args.diagnose:
        seen = busy_samples(preds, results)
        base = busy_samples([c for c in configs if c["role"] == "calibration"], results)
        print("\nDiagnosis (--diagnose; not used by the predictions): median busy time per tick, "
              "calibration runs -> predicted runs, ms:", file=out)
        for (v, s, key), xs in sorted(seen.items(), key=str):
            if (v, s, key) in base:
                was, now = statistics.median(base[(v, s, key)]), statistics.median(xs)
                name = key if key == "idle" else f"{key[0]} g{key[1]}"
                print(f"  v={v} device {s} {name:<6} {ms(was):>7} -> {ms(now):>7} ({now / was - 1:+.0%}, "
                      f"{len(xs)} ticks)", file=out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=12, help="calls per configuration (round-robin)")
    parser.add_argument("--budget-s", type=float, default=360.0,
                        help="stop the rounds early (at least 3) when they would take longer than this")
    parser.add_argument("--probe-repeats", type=int, default=20)
    parser.add_argument("--timeout-s", type=float, default=1200.0, help="hard limit for the two workers")
    parser.add_argument("--smoke", action="store_true", help="a tiny model and 3 runs: checks the script")
    parser.add_argument("--date", default=datetime.date.today().isoformat())
    parser.add_argument("--out", default=None, help="also write the output to this file")
    parser.add_argument("--raw", default=None, help="write every measurement (JSON) to this file")
    parser.add_argument("--from-raw", default=None,
                        help="analyse the measurements a --raw file saved instead of measuring again")
    parser.add_argument("--diagnose", action="store_true",
                        help="also print the predicted runs' per-task busy times against the calibration's")
    add_worker_args(parser)
    args = parser.parse_args(argv)
    if args.worker is not None:
        return worker(args)
    if args.smoke:
        args.rounds = min(args.rounds, 3)
        args.probe_repeats = min(args.probe_repeats, 3)
    dims = SMOKE if args.smoke else FULL
    configs = configurations(args.smoke)
    spec = dict(dims=dims, configs=configs, rounds=args.rounds, budget_s=args.budget_s,
                probe_repeats=args.probe_repeats,
                probe_iters=10 if args.smoke else 20, diagnose=args.diagnose,
                probe_bytes=[2**14, 2**20] if args.smoke else [2**14, 2**18, 2**20, 2**22])
    buffer = io.StringIO()
    out = Tee(sys.stdout, buffer)
    start = time.perf_counter()
    cpu_header(out, f"mindpipe_jax 2-process pipeline benchmark (simulator vs measurement), {args.date}",
               "benchmarks/pipeline_2proc.py", argv)
    if args.from_raw:
        saved = json.loads(Path(args.from_raw).read_text())
        spec, results = saved["spec"], saved["results"]
        dims, configs = spec["dims"], spec["configs"]
        print(f"(measurements read from {args.from_raw}, not taken again)", file=out)
    else:
        results = launch(__file__, "pipeline_2proc", spec, args.timeout_s)
    if args.raw and not args.from_raw:
        Path(args.raw).parent.mkdir(parents=True, exist_ok=True)
        Path(args.raw).write_text(json.dumps(dict(spec=spec, results=results)))
    cal = calibrate(configs, results, dims)
    rows = predict(configs, results, cal)
    report(out, args, dims, configs, results, cal, rows)
    print(f"\n(benchmark took {time.perf_counter() - start:.0f} s)", file=out)
    if args.out:
        Path(args.out).write_text(buffer.getvalue())


if __name__ == "__main__":
    main()
