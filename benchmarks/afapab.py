"""AFAPAB: gradient sync measured over a rate-limited link, and predicted at scale.

Part 1 — communication measured, not assumed. Two worker processes
(``jax.distributed``, Gloo, one CPU device each, each pinned to its own core when
the machine has two) form a mesh ``data=2`` (``pipe=1``) and run the SPMD
pipeline runtime (``runtime.pipeline_grads``) on the reference GPT cut into
``v`` chunks, AFAPAB schedule (all forwards, then all backwards chunk by chunk in
reverse). They run inside a network namespace this script creates (``ip netns
add``) whose loopback is rate-limited by a token bucket (``tc qdisc add dev lo
root tbf rate 2gbit ...``), so every byte between the two processes (Gloo's TCP
connections and the coordinator's) crosses a 2 Gbit/s "cloud link"; the
namespace is deleted afterwards whatever happens. Where ``ip netns`` is not
permitted the run falls back to the plain loopback and says so in its output.

Four step variants, same schedule and per-device work:

* ``compute only``: each process runs the step on a one-device mesh (data=1) on
  its own rows: no gradient sync;
* ``end``: ``grad_sync="end"`` — every chunk's gradient all-reduced after the last
  tick (Megatron-style);
* ``overlap``: ``grad_sync="overlap"`` — Megatron's overlapped reduction as the SPMD
  runtime issues it: chunk ``v-1``'s gradient all-reduced at its last backward, the
  tick loop split there (XLA:CPU's combiner may merge that all-reduce with the later
  ones; Gloo blocks either way);
* ``chunk``: ``grad_sync="chunk"`` — chunk ``v-1``'s gradient reduced by a ring,
  one step beside each remaining backward tick (AFAPAB), buckets sized so the
  steps fit in the ticks that remain.

The α–β link is fitted (``simcomm.fit_collective``) on a separate probe: a loop
of ``psum``s of several sizes over the two processes. ``ppermute`` (one ring step)
and ``all_gather`` probes, and a probe timing a compute and an independent
``psum`` alone and in one program, are printed to check the model's premises
(full mode only). The simulator (``sim/comm.simulate_sync``) then replays the
schedule with the collectives the runtime issues (``simcomm.sync_ops``) and
predicts each variant's step time. Compute is calibrated on the compute-only run
(its median step time spread over the ticks by FLOPs: a layer's backward costs
two forwards, and the last chunk's forward runs inside its backward, as the
runtime does it); so ``compute only`` is a calibration row, ``end`` and
``chunk`` are predictions. XLA:CPU runs a Gloo collective synchronously on the
device's thread, so the CPU prediction is ``overlap=False``; the line "if
collectives overlapped" replays the same measured costs with ``overlap=True``,
which is what a device with a communication stream would do.

Measurement: every variant compiled once and warmed up, then called once per
round, round-robin, ``--rounds`` rounds, a barrier before each call. A coupled
step (end, chunk) takes the same wall time on both processes; for the
uncoupled compute-only step the slower process's time is taken each round
(a data-parallel step waits for the slower one). Medians over rounds.

Part 2 — prediction at scale: ``sim.cluster.predict`` on a GPT-3-class model on
V100 nodes (NVLink inside a node, a shared 25 Gbps NIC between nodes), fixed
layouts, Megatron-LM with ``--overlap-grad-reduce`` (interleaved 1F1B) against
AFAPAB (chunk-wise sync overlapped), fp32 gradients on the wire, assumptions
printed with the table. The searched layouts are ``benchmarks/afapab_predict.py``.

Part 0 — bytes from the programs. The pipeline step compiled on 8 simulated CPU
devices as pipe2 x data2 x tensor2 (weights stored sharded as training stores them),
for ``end`` and ``chunk`` with fp32 and bf16 gradient sync (``parallel.grad_sync_dtype``);
``parallel/collectives.py`` reads every collective of each compiled program and sums
the bytes one device sends per step, split by the mesh axes the collective spans. The
data-parallel sync is the ``data`` column; ``tensor`` and ``pipe`` are the model's and
the pipeline's own, the same in every variant (collectives inside the lockstep
``cond``s are counted as if their branch ran). ``--bytes-only`` runs only this part; ``--smoke`` skips it.

Part 3 (``--picture PATH``): the AFAPAB and Megatron timelines with compute and
communication lanes per device, from the simulator's events.

Usage: ``python benchmarks/afapab.py [--rounds 10] [--out FILE] [--picture PNG]
[--smoke] [--scale-only] [--bytes-only]``.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _procs import add_worker_args, launch, start_worker  # noqa: E402  (benchmarks/ is on sys.path)
from _report import Tee, cpu_header  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# rows: per data shard (device). v chunks of layers / v layers each; m microbatches.
# The smoke run's blocks are one dense layer each (model "mlp"): a GPT block takes
# ~50 s per variant to compile on a loaded 2-core machine, a dense layer ~5 s.
# Sizes: the gradient sync over the 2 Gbit/s link should be a sizeable part of the
# step (comm grows with the parameters, compute with parameters x tokens).
FULL = dict(model="gpt", vocab=256, seq=16, d_model=512, heads=4, layers=4, rows=1, m=4, v=2)
SMOKE = dict(model="mlp", vocab=64, seq=8, d_model=32, heads=2, layers=2, rows=2, m=2, v=2)
SYNC_VARIANTS = ("end", "overlap", "chunk")
VARIANTS = ("compute only", *SYNC_VARIANTS)


# ====================================================================== worker
def worker(args) -> None:
    spec, log = start_worker(args)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax import lax
    from jax.experimental.multihost_utils import sync_global_devices
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from mindpipe_jax.config import ModelConfig, ParallelConfig
    from mindpipe_jax.models.gpt import GPT
    from mindpipe_jax.parallel.mesh import make_mesh
    from mindpipe_jax.parallel.pipeline import get_schedule
    from mindpipe_jax.parallel.pipeline.contract import stage_fns
    from mindpipe_jax.parallel.pipeline.runtime import pipeline_grads
    from mindpipe_jax.parallel.pipeline.schedules.sync import sync_points

    dims = spec["dims"]
    m, v = dims["m"], dims["v"]
    if dims["model"] == "gpt":
        cfg = ModelConfig(vocab_size=dims["vocab"], seq_len=dims["seq"], d_model=dims["d_model"],
                          n_layers=dims["layers"], n_heads=dims["heads"])
        model = GPT(cfg, rngs=nnx.Rngs(0))
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        fns = stage_fns(model)
    else:
        params, fns = dense_model(dims)
    sched = get_schedule("afapab", 1, m, v)

    rows = dims["rows"]
    tokens = np.random.default_rng(0).integers(0, dims["vocab"], (m, 2 * rows, dims["seq"] + 1))
    tokens = tokens.astype(np.int32)
    devices = sorted(jax.devices(), key=lambda d: d.process_index)
    mesh2 = make_mesh(ParallelConfig(pipe=1, data=2, tensor=1, simulate_cpu_devices=0), devices=devices)
    mesh1 = make_mesh(ParallelConfig(pipe=1, data=1, tensor=1, simulate_cpu_devices=0),
                      devices=jax.local_devices()[:1])

    # Gradient sizes: the bucket makes chunk v-1's ring (buckets scatter steps and
    # buckets all-gathers for d = 2) fit in the ticks left after its last backward.
    # Per leaf: a pmean is one Gloo all-reduce per leaf (see simcomm.sync_ops).
    chunk_leaves = [x[0].size * (dims["layers"] // v) for x in jax.tree.leaves(params["blocks"])]
    chunk_elems = sum(chunk_leaves)
    end_leaves = [x.size for x in jax.tree.leaves((params["embed"], params["head"]))]
    points = {sp.chunk: sp.after_tick for sp in sync_points(sched, "chunk")}
    left = sched.num_ticks - 1 - points[v - 1]
    buckets = max(1, left // 2)
    bucket_bytes = math.ceil(4 * chunk_elems / buckets) + 64
    result = {"process": args.worker, "load": [os.getloadavg()[0]], "times": {}, "probe": {},
              "overlap_probe": {}, "chunk_elems": chunk_elems, "chunk_leaves": chunk_leaves,
              "end_leaves": end_leaves,
              "bucket_bytes": bucket_bytes, "ticks_left": left, "compile_s": {},
              "n_params": sum(x.size for x in jax.tree.leaves(params))}

    def data_for(mesh, shard):
        x, y = tokens[:, :, :-1], tokens[:, :, 1:]
        if shard is not None:   # this process's rows only, on its own device
            x, y = x[:, shard * rows:(shard + 1) * rows], y[:, shard * rows:(shard + 1) * rows]
        return jax.device_put((x, y), NamedSharding(mesh, P()))

    compiled = {}
    for name in VARIANTS:
        mesh = mesh1 if name == "compute only" else mesh2
        sync = "end" if name == "compute only" else name
        run = pipeline_grads(fns, sched, mesh, remat="none", grad_sync=sync,
                             sync_bucket_bytes=bucket_bytes if name == "chunk" else None)
        weights = jax.device_put((params["embed"], params["blocks"], params["head"]),
                                 NamedSharding(mesh, P()))
        step_args = (*weights, *data_for(mesh, args.worker if name == "compute only" else None))
        t0 = time.perf_counter()
        with jax.set_mesh(mesh):
            exe = jax.jit(run).lower(*step_args).compile()
        for _ in range(2):   # warm-up
            jax.block_until_ready(exe(*step_args))
        result["compile_s"][name] = time.perf_counter() - t0
        compiled[name] = (exe, step_args)
        log(f"{name}: compiled and warmed up in {result['compile_s'][name]:.1f} s")

    # Probes: a loop of `iters` collectives of n bytes over the two processes.
    iters = spec["probe_iters"]
    row = P("data")

    def probe_fn(kind):
        def one(y):
            if kind == "all-reduce":
                return lax.psum(y, "data") * 0.5
            if kind == "ring-step":
                return lax.ppermute(y, "data", [(0, 1), (1, 0)])
            return lax.all_gather(y[: y.shape[0] // 2], "data", tiled=True)   # gathers n bytes
        return lambda x: lax.fori_loop(0, iters, lambda _, y: one(y), x)

    probes = {}
    for kind, sizes in spec["probes"].items():
        for nbytes in sizes:
            x = jax.device_put(jnp.ones((2 * (nbytes // 4),), jnp.float32), NamedSharding(mesh2, row))
            fn = jax.shard_map(probe_fn(kind), mesh=mesh2, in_specs=row, out_specs=row, axis_names={"data"},
                               check_vma=False)
            exe = jax.jit(fn).lower(x).compile()
            jax.block_until_ready(exe(x))
            probes[(kind, nbytes)] = (exe, x)

    # Overlap probe: a matmul chain and an independent psum, alone and in one program.
    if spec["overlap_probe"]:
        k, n_mm, nbytes = 512, spec["overlap_matmuls"], spec["overlap_bytes"]

        def compute(a):
            return lax.fori_loop(0, n_mm, lambda _, z: jnp.tanh(z @ a), a)

        def comm(g):
            return lax.psum(g, "data")
        bodies = {"compute": lambda a, g: (compute(a), g), "psum": lambda a, g: (a, comm(g)),
                  "both": lambda a, g: (compute(a), comm(g))}
        a = jax.device_put(jnp.full((2 * k, k), 0.01, jnp.float32), NamedSharding(mesh2, row))
        g = jax.device_put(jnp.ones((2 * (nbytes // 4),), jnp.float32), NamedSharding(mesh2, row))
        for name, body in bodies.items():
            fn = jax.shard_map(body, mesh=mesh2, in_specs=(row, row), out_specs=(row, row),
                               axis_names={"data"}, check_vma=False)
            exe = jax.jit(fn).lower(a, g).compile()
            jax.block_until_ready(exe(a, g))
            probes[("overlap", name)] = (exe, (a, g))
    log("probes compiled")

    for r in range(spec["probe_repeats"]):
        for (kind, what), (exe, x) in probes.items():
            xs = x if isinstance(x, tuple) else (x,)
            sync_global_devices(f"probe {kind} {what} {r}")
            t0 = time.perf_counter()
            jax.block_until_ready(exe(*xs))
            dt = time.perf_counter() - t0
            if kind == "overlap":
                result["overlap_probe"].setdefault(what, []).append(dt)
            else:
                result["probe"].setdefault(kind, {}).setdefault(str(what), []).append(dt / iters)
    log("probes timed")

    for r in range(spec["rounds"]):
        for name, (exe, step_args) in compiled.items():
            sync_global_devices(f"{name} {r}")
            t0 = time.perf_counter()
            jax.block_until_ready(exe(*step_args))
            result["times"].setdefault(name, []).append(time.perf_counter() - t0)
        log(f"round {r + 1}/{spec['rounds']} done")
    result["load"].append(os.getloadavg()[0])
    Path(args.result).write_text(json.dumps(result))
    log("done")


def dense_model(dims: dict):
    """A model following the pipeline contract whose blocks are one ``tanh`` dense
    layer each (cheap to compile): embedding lookup, blocks, softmax head."""
    import jax.numpy as jnp
    import numpy as np
    import optax

    from mindpipe_jax.parallel.pipeline.runtime import StageFns

    d, vocab, n = dims["d_model"], dims["vocab"], dims["layers"]
    rng = np.random.default_rng(0)

    def normal(scale, *shape):
        return jnp.asarray(rng.normal(0.0, scale, shape), jnp.float32)
    params = {"embed": {"tokens": normal(0.02, vocab, d)},
              "blocks": {"w": normal(d ** -0.5, n, d, d), "b": jnp.zeros((n, d), jnp.float32)},
              "head": {"w": normal(0.02, d, vocab)}}
    fns = StageFns(embed=lambda p, t: p["tokens"][t],
                   layer=lambda p, h: jnp.tanh(h @ p["w"] + p["b"]),
                   head_loss=lambda p, h, y: optax.softmax_cross_entropy_with_integer_labels(
                       h @ p["w"], y).mean())
    return params, fns


# ============================================================ network namespace
class Namespace:
    """A network namespace whose loopback is rate-limited by a token bucket, or,
    where that is not permitted, nothing (``name`` None and ``why`` says why)."""

    def __init__(self, rate: str, burst: str, latency: str):
        self.rate, self.burst, self.latency = rate, burst, latency
        self.name, self.why, self.qdisc = None, "", ""

    def _ip(self, *cmd, check=True):
        return subprocess.run(list(cmd), capture_output=True, text=True, timeout=20, check=check)

    def __enter__(self):
        name = f"mpafapab{os.getpid()}"
        try:
            self._ip("ip", "netns", "add", name)
        except (OSError, subprocess.SubprocessError) as err:
            self.why = _err_text(err)
            return self
        self.name = name
        try:
            self._ip("ip", "-n", name, "link", "set", "lo", "up")
            self._ip("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
                     "rate", self.rate, "burst", self.burst, "latency", self.latency)
            shown = self._ip("ip", "netns", "exec", name, "tc", "qdisc", "show", "dev", "lo")
            self.qdisc = shown.stdout.strip()
        except (OSError, subprocess.SubprocessError) as err:
            self.__exit__()
            self.name, self.why = None, _err_text(err)
        return self

    def stats(self) -> str:
        if self.name is None:
            return ""
        out = self._ip("ip", "netns", "exec", self.name, "tc", "-s", "qdisc", "show", "dev", "lo",
                       check=False)
        return " ".join(out.stdout.split())

    def prefix(self) -> list[str]:
        return [] if self.name is None else ["ip", "netns", "exec", self.name]

    def __exit__(self, *exc):
        if self.name is not None:
            self._ip("ip", "netns", "del", self.name, check=False)


def _err_text(err) -> str:
    if isinstance(err, subprocess.CalledProcessError):
        return f"{' '.join(err.cmd)}: {(err.stderr or '').strip() or f'exit {err.returncode}'}"
    return str(err)


# ====================================================================== part 1
def stage_costs(dims: dict, compute_s: float):
    """Per-task costs of the afapab p=1 schedule, spread from the measured compute
    step by FLOPs: F of a layer 1 unit, its backward 2; the last chunk's forward
    runs inside its backward (its F tick computes nothing, its BW costs 3 units)."""
    from mindpipe_jax.sim import StageCosts

    m, v = dims["m"], dims["v"]
    per_chunk = dims["layers"] // v
    units = m * per_chunk * 3 * v
    unit = compute_s / units
    F = [per_chunk * unit] * (v - 1) + [0.0]
    BW = [2 * per_chunk * unit] * (v - 1) + [3 * per_chunk * unit]
    return StageCosts(F=F, BW=BW, B=0.0, W=0.0)


def analyse(dims: dict, results: list[dict]) -> dict:
    from mindpipe_jax.errors import ConfigError
    from mindpipe_jax.parallel.pipeline import get_schedule
    from mindpipe_jax.sim.comm import (
        collective_time,
        fit_collective,
        simulate_sync,
        sync_ops,
    )

    med = statistics.median
    r0 = results[0]
    probe = {kind: {int(n): med(ts) for n, ts in by.items()} for kind, by in r0["probe"].items()}
    ar = probe["all-reduce"]
    try:
        link, note = fit_collective("all-reduce", 2, list(ar), list(ar.values())), ""
    except ConfigError:   # noise above the size effect (tiny smoke sizes on a loaded machine)
        from mindpipe_jax.sim import Link
        link, note = Link(latency_s=min(ar.values()) / 2), " (times did not grow with size: latency only)"
    checks = [(kind, n, t, collective_time(kind, n, 2, link)) for kind, by in probe.items()
              for n, t in sorted(by.items())]
    measured = {}
    for name in VARIANTS:
        if name == "compute only":   # uncoupled: the slower process each round
            per_round = [max(a, b) for a, b in zip(results[0]["times"][name], results[1]["times"][name],
                                                     strict=True)]
        else:
            per_round = r0["times"][name]
        q = statistics.quantiles(per_round, n=4) if len(per_round) >= 2 else [per_round[0]] * 3
        measured[name] = dict(median=med(per_round), q1=q[0], q3=q[2], n=len(per_round), rounds=per_round)
    # What the sync costs, paired by round (the load of this machine drifts between rounds).
    paid = {name: med(a - b for a, b in zip(measured[name]["rounds"], measured["compute only"]["rounds"],
                                            strict=True)) for name in SYNC_VARIANTS}
    sched = get_schedule("afapab", 1, dims["m"], dims["v"])
    costs = stage_costs(dims, measured["compute only"]["median"])
    kw = dict(data_ranks=2, dp_link=link, chunk_elems=[r0["chunk_leaves"]] * dims["v"],
              end_elems=r0["end_leaves"], bucket_bytes=r0["bucket_bytes"])
    sims = {"compute only": simulate_sync(sched, costs, **{**kw, "data_ranks": 1}),
            **{name: simulate_sync(sched, costs, grad_sync=name, **kw) for name in SYNC_VARIANTS}}
    overlapped = {name: simulate_sync(sched, costs, grad_sync=name, overlap=True, **kw)
                  for name in SYNC_VARIANTS}
    ov = {k: med(ts) for k, ts in r0["overlap_probe"].items()}
    ops = {name: sync_ops(sched, kw["chunk_elems"], 2, name, bucket_bytes=kw["bucket_bytes"],
                          end_elems=kw["end_elems"]) for name in SYNC_VARIANTS}
    return dict(link=link, note=note, probe=probe, checks=checks, measured=measured, sims=sims,
                overlapped=overlapped, sched=sched, overlap_probe=ov, ops=ops, paid=paid)


def describe_ops(ops, link) -> str:
    """'2 ring-steps beside ticks 12-13, ... (x ms)' for a list of CommOps."""
    from mindpipe_jax.sim.comm import op_time

    groups: dict[tuple, list] = {}
    for op in ops:
        groups.setdefault((op.kind, op.beside, None if op.beside else op.tick), []).append(op)
    parts = []
    for (kind, beside, tick), grp in groups.items():
        where = (f"beside ticks {min(o.tick for o in grp)}-{max(o.tick for o in grp)}" if beside
                 else f"after tick {tick}")
        size = sum(o.nbytes for o in grp) / 2**20
        parts.append(f"{len(grp)} {kind}{'s' if len(grp) > 1 else ''} {where} ({size:.1f} MiB, "
                     f"{1e3 * sum(op_time(o, 2, link) for o in grp):.0f} ms)")
    return ", ".join(parts)


def report_part1(out, args, dims, results, ns, a) -> None:
    ms = lambda x: f"{1e3 * x:.1f}"  # noqa: E731
    r0 = results[0]
    print("Part 1: AFAPAB's chunk-wise gradient sync, measured over a rate-limited link", file=out)
    if ns.name is not None:
        print(f"  link: network namespace with loopback rate-limited by `tc qdisc add dev lo root tbf rate "
              f"{ns.rate} burst {ns.burst} latency {ns.latency}` ({ns.qdisc})", file=out)
        print(f"  qdisc after the run: {ns.stats()}", file=out)
    else:
        print(f"  link: UNTHROTTLED plain loopback — could not create a network namespace ({ns.why}); "
              f"the figures below are for 127.0.0.1 without a rate limit", file=out)
    n_params = r0["n_params"]
    what = (f"reference GPT, {dims['layers']} layers (d_model {dims['d_model']}, {dims['heads']} heads"
            if dims["model"] == "gpt" else
            f"dense stand-in (smoke), {dims['layers']} tanh layers (d_model {dims['d_model']}")
    print(f"  model: {what}, vocab {dims['vocab']}), seq {dims['seq']}, {n_params / 1e6:.2f} M parameters; "
          f"microbatch "
          f"{dims['rows']} rows per device, m={dims['m']}, AFAPAB p=1 v={dims['v']} "
          f"({a['sched'].num_ticks} ticks), fp32, residual mode; 2 processes x 1 CPU device (Gloo), "
          f"mesh data=2; {args.rounds} rounds; load average {r0['load'][0]:.1f} at the start, "
          f"{r0['load'][1]:.1f} at the end", file=out)
    print(f"  gradient per chunk {4 * r0['chunk_elems'] / 2**20:.2f} MiB fp32; 'chunk' ring bucket "
          f"{r0['bucket_bytes'] / 2**20:.2f} MiB (the ring's steps fit in the "
          f"{r0['ticks_left']} ticks left after chunk {dims['v'] - 1}'s last backward)", file=out)
    link = a["link"]
    print("\n  Collective probes (median per collective over 2 ranks; fit on the psum (all-reduce) rows):",
          file=out)
    print(f"    {'collective':<11} {'bytes':>9} {'measured ms':>11} {'model ms':>9} {'err':>7}", file=out)
    for kind, n, t, pred in a["checks"]:
        print(f"    {kind:<11} {n:>9} {ms(t):>11} {ms(pred):>9} {(pred - t) / t:>+7.1%}", file=out)
    print(f"  -> fitted link: alpha {1e6 * link.latency_s:.0f} us per message, bandwidth "
          f"{8 * link.bandwidth_Bps / 1e9:.2f} Gbit/s ({link.bandwidth_Bps / 1e6:.0f} MB/s) per rank"
          f"{a['note']} (all-reduce of n bytes over 2 ranks = 2 alpha + n / bw)", file=out)
    ov = a["overlap_probe"]
    if ov:
        serial = ov["compute"] + ov["psum"]
        print(f"  overlap probe (one program, independent compute and psum): compute alone "
              f"{ms(ov['compute'])} ms, "
              f"psum alone {ms(ov['psum'])} ms, both {ms(ov['both'])} ms (sum {ms(serial)}, max "
              f"{ms(max(ov['compute'], ov['psum']))}): XLA:CPU "
              f"{'runs them one after the other' if ov['both'] > 0.9 * serial else 'overlaps them in part'}",
              file=out)
    print("  collectives per step (simcomm.sync_ops; one Gloo all-reduce per gradient leaf, as XLA:CPU runs "
          "a tuple all-reduce), predicted time on the fitted link:", file=out)
    for name in SYNC_VARIANTS:
        print(f"    {name}: {describe_ops(a['ops'][name], link)}", file=out)
    print(f"\n  {'variant':<13} {'measured ms':>11} {'IQR ms':>13} {'predicted ms':>12} {'err':>7}  role",
          file=out)
    for name in VARIANTS:
        mm, pred = a["measured"][name], a["sims"][name].step_time
        role = "calibration (compute costs)" if name == "compute only" else "prediction"
        print(f"  {name:<13} {ms(mm['median']):>11} {ms(mm['q1']) + '-' + ms(mm['q3']):>13} {ms(pred):>12} "
              f"{(pred - mm['median']) / mm['median']:>+7.1%}  {role}", file=out)
    errs = [abs(a["sims"][n].step_time - a["measured"][n]["median"]) / a["measured"][n]["median"]
            for n in SYNC_VARIANTS]
    print(f"  predictions within +-15%: {sum(e <= 0.15 for e in errs)}/{len(errs)} "
          f"(max |err| {max(errs):.1%})", file=out)
    comp = a["sims"]["compute only"].step_time
    print("  communication the step pays (step - compute only), measured as the median over rounds of the "
          "difference within a round / predicted: "
          + ", ".join(f"{n} {ms(a['paid'][n])} / {ms(a['sims'][n].step_time - comp)} ms "
                      f"({(a['sims'][n].step_time - comp - a['paid'][n]) / a['paid'][n]:+.0%})"
                      for n in SYNC_VARIANTS), file=out)
    print("  if the collectives ran beside compute (a communication stream; same measured costs, "
          "simulate_sync(overlap=True)): "
          + ", ".join(f"{n} {ms(a['overlapped'][n].step_time)} ms" for n in SYNC_VARIANTS)
          + " — the CPU cannot show this: XLA:CPU blocks on every Gloo collective (overlap probe above)",
          file=out)


# ====================================================================== part 2
SCALE_MODELS = (("GPT-3 2.7B", dict(t=4, p=2)), ("GPT-3 6.7B", dict(t=4, p=4)))
SCALE_GPUS = (16, 32, 64)
GRAD_BYTES = 4  # fp32 on the wire: parallel.grad_sync_dtype's default
SCALE_VARIANTS = (("Megatron-overlap", "megatron-overlap", False),
                  ("Megatron-overlap + CM", "megatron-overlap", True),
                  ("AFAPAB", "afapab", False), ("AFAPAB + CM", "afapab", True))


def scale_rows(cluster, shape, base: dict, gpus: int, v: int, **layout_kw) -> list:
    from mindpipe_jax.sim.cluster import Layout3D, predict

    layout_kw = {"grad_bytes": GRAD_BYTES, **layout_kw}
    layout = Layout3D(d=gpus // (base["t"] * base["p"]), v=v, **base, **layout_kw)
    return [(label, predict(shape, cluster, layout, sched, tp_overlap=cm))
            for label, sched, cm in SCALE_VARIANTS]


def report_part2(out, smoke: bool = False) -> dict:
    """The table (``smoke``: one model at 64 GPUs, v = 2, no sensitivity runs)."""
    from dataclasses import replace

    from mindpipe_jax.sim.cluster import GPT3_2_7B, GPT3_6_7B, V100_CLOUD, Layout3D

    shapes = {"GPT-3 2.7B": GPT3_2_7B, "GPT-3 6.7B": GPT3_6_7B}
    c = V100_CLOUD
    lay = Layout3D(t=1, p=1, d=1)
    print("\nPart 2: predicted per-GPU TFLOP/s at scale (the simulator with collectives; not measured)",
          file=out)
    print("  Assumptions (stated, not tuned):", file=out)
    for name, shape in shapes.items():
        print(f"    model {name}: {shape.layers} layers, hidden {shape.hidden}, {shape.heads} heads, seq "
              f"{shape.seq_len}, vocab {shape.vocab} ({shape.params / 1e9:.2f} B parameters)", file=out)
    print(f"    batch {lay.global_batch} sequences per step ({lay.global_batch * 2048 / 1e6:.1f} M tokens), "
          f"microbatch {lay.microbatch}; full activation recompute (a fused backward = 3 forwards of "
          f"compute); "
          f"fp16 activations; gradients {GRAD_BYTES} bytes each on the wire (fp32: the runtime's "
          f"parallel.grad_sync_dtype default; benchmarks/afapab_predict.py --measure-bytes reads it "
          f"off the compiled step)", file=out)
    print(f"    GPU: V100, {c.peak_flops / 1e12:.0f} TFLOP/s fp16 peak x {c.efficiency:.2f} assumed "
          f"achievable "
          f"= {c.flop_rate / 1e12:.0f} TFLOP/s for every layer kernel (Megatron-LM measured 39 TFLOP/s, 30% "
          f"of peak, for a whole 1.2 B model on one V100); {c.memory_bytes / 2**30:.0f} GiB", file=out)
    print(f"    node: {c.gpus_per_node} GPUs; tensor axis inside the node on NVLink, all-reduce bus "
          f"bandwidth "
          f"{c.nvlink_Bps / 1e9:.0f} GB/s, alpha {1e6 * c.nvlink_latency_s:.0f} us; 6 activation all-reduces "
          f"per layer per microbatch (2 forward, 2 backward, 2 recompute)", file=out)
    print(f"    between nodes: {8 * c.nic_Bps / 1e9:.0f} Gbit/s NIC per node shared by {c.nic_sharing} "
          f"GPUs -> "
          f"{c.inter.bandwidth_Bps / 1e9:.2f} GB/s per GPU, alpha {1e6 * c.nic_latency_s:.0f} us; the "
          f"pipeline's sends (b s h / t fp16 per GPU) and the data-parallel gradient sync "
          f"({lay.bucket_bytes / 1e6:.0f} MB buckets) share it", file=out)
    print("    executor: asynchronous replay (simulate mode 'async'). Megatron-overlap = interleaved "
          "1F1B with Megatron-LM's --overlap-grad-reduce and distributed optimizer (bucketed "
          "reduce-scatters launched as each bucket's last gradient is ready, the parameter all-gather "
          "behind the next forward), blocking tensor-parallel all-reduces. AFAPAB = all "
          "forwards, "
          "then all backwards chunk by chunk in reverse, each chunk's sync from its last backward on, beside "
          "the remaining compute. '+ CM': tensor-parallel all-reduces as collective matmuls (1 ring step "
          "in t "
          "exposed, the rest under the layer's matmuls).", file=out)
    print("    FLOP rate: Megatron-LM's 96 B s l h^2 (1 + s/6h + V/16lh) per step (counts the recompute) / "
          "(GPUs x step time)", file=out)
    head = (f"\n  {'model':<11} {'GPUs':>4} {'t':>2} {'p':>2} {'d':>2} {'v':>2} {'m':>4}  {'schedule':<21} "
            f"{'step s':>7} {'TFLOP/s':>8} {'peak':>5} {'vs Meg.':>8} {'exposed':>8} {'DP sync':>8} "
            f"{'TP comm':>8} {'memory':>8}")
    print(head, file=out)
    print("  " + "-" * (len(head) - 3), file=out)
    table = {}
    for name, base in SCALE_MODELS[:1] if smoke else SCALE_MODELS:
        for gpus in SCALE_GPUS[-1:] if smoke else SCALE_GPUS:
            for v in (2,) if smoke else (2, 4):
                rows = scale_rows(c, shapes[name], base, gpus, v)
                for label, r in rows:
                    meg = dict(rows)["Megatron-overlap + CM" if label.endswith("CM")
                                     else "Megatron-overlap"].tflops_per_gpu
                    L = r.layout
                    table[(name, gpus, v, label)] = r
                    mem = f"{r.memory_bytes / 2**30:.1f}G" + ("!" if r.memory_bytes > c.memory_bytes else "")
                    print(f"  {name:<11} {gpus:>4} {L.t:>2} {L.p:>2} {L.d:>2} {L.v:>2} {L.microbatches:>4}  "
                          f"{label:<21} {r.step_s:>7.2f} {r.tflops_per_gpu:>8.1f} "
                          f"{r.tflops_per_gpu / (c.peak_flops / 1e12):>5.0%} "
                          f"{r.tflops_per_gpu / meg - 1:>+8.0%} {r.step_s - r.compute_s:>8.2f} "
                          f"{r.dp_sync_s:>8.2f} {r.tp_exposed_s:>8.2f} {mem:>8}",
                          file=out)
            print("", file=out)
    print("  (vs Meg.: over Megatron-overlap with the same tensor-parallel collectives; step, exposed "
          "(step time after the last compute), DP sync (one GPU's gradient sync on a free link) and TP comm "
          "(tensor-parallel time inside the tasks) in seconds per step; memory per GPU as "
          "sim.cluster.memory_per_gpu models each schedule (Megatron-overlap's distributed optimizer "
          "shards the fp32 master weights and Adam over d) + stored stage inputs, '!' = over the GPU's "
          "memory)", file=out)
    system = [(name, v, table[(name, gpus, v, "AFAPAB + CM")].tflops_per_gpu,
               table[(name, gpus, v, "Megatron-overlap")].tflops_per_gpu)
              for (name, gpus, v, label) in table
              if label == "Megatron-overlap" and gpus == SCALE_GPUS[-1]]
    print(f"  The whole of AFAPAB (chunk-wise sync and collective matmuls) against Megatron-overlap at "
          f"{SCALE_GPUS[-1]} GPUs: "
          + "; ".join(f"{name} v={v}: {a:.1f} vs {m:.1f} TFLOP/s ({a / m - 1:+.0%})"
                      for name, v, a, m in system), file=out)
    print("  Seed's target: about 40 TFLOP/s per V100 for AFAPAB vs about 29 for Megatron (+40%); Fold3D "
          "reported +25-42%.", file=out)

    if smoke:
        return table
    # One assumption at a time, at 64 GPUs, GPT-3 2.7B, v = 4.
    name, base = SCALE_MODELS[0]
    shape = shapes[name]
    sweeps = {
        "achievable fraction of peak": [(f"{e:.2f}", replace(c, efficiency=e), {})
                                        for e in (0.30, 0.40, 0.50)],
        "NIC per node": [(f"{g} Gbit/s", replace(c, nic_Bps=g * 1e9 / 8), {}) for g in (25, 50, 100)],
        "GPUs sharing a NIC": [(str(k), replace(c, nic_sharing=k), {}) for k in (8, 4, 1)],
        "global batch": [(f"{b} seqs", c, dict(global_batch=b)) for b in (256, 512, 1024)],
        "gradient bytes on the wire": [(f"{n} B", c, dict(grad_bytes=n)) for n in (2, 4)],
    }
    print(f"\n  Sensitivity: {name}, 64 GPUs, v=4, one assumption changed at a time "
          f"(TFLOP/s per GPU: Megatron-overlap / AFAPAB, gain; with collective matmuls: Megatron-overlap "
          f"+ CM / AFAPAB + CM, "
          f"gain):", file=out)
    spread = {}
    for what, options in sweeps.items():
        cells, gains = [], []
        for label, cluster, kw in options:
            rows = dict(scale_rows(cluster, shape, base, 64, 4, **kw))
            meg, mcm, af, acm = (rows[k].tflops_per_gpu for k, _, _ in SCALE_VARIANTS)
            gains.append(af / meg - 1)
            cells.append(f"{label}: {meg:.1f} / {af:.1f} ({af / meg - 1:+.0%}); {mcm:.1f} / {acm:.1f} "
                         f"({acm / mcm - 1:+.0%})")
        spread[what] = max(gains) - min(gains)
        print(f"    {what:<27} " + ";  ".join(cells), file=out)
    order = sorted(spread, key=spread.get, reverse=True)
    print("  What drives the gap (AFAPAB over Megatron, largest swing first): "
          + ", ".join(f"{w} ({100 * spread[w]:.0f} points)" for w in order)
          + ". What is left of the gap is the part of the data-parallel sync that Megatron-overlap can "
            "hide only behind the last microbatch's backward and AFAPAB behind the backwards of the later "
            "chunks; every assumption that makes that sync a larger share of the step widens it. The "
            "searched layouts of benchmarks/afapab_predict.py are the issue's table.",
          file=out)
    return table


def draw_picture(out_path: str):
    """The Megatron-overlap and AFAPAB timelines of one 64-GPU row of the table."""
    from mindpipe_jax import viz
    from mindpipe_jax.sim.cluster import GPT3_6_7B, V100_CLOUD

    name, base = SCALE_MODELS[1]
    rows = dict(scale_rows(V100_CLOUD, GPT3_6_7B, base, 64, 2))
    picked = [("Megatron-overlap", "interleaved 1F1B, bucketed sync in the last backward"),
              ("AFAPAB", "all-F-all-B, chunk-wise sync beside the backwards")]
    titles = [f"{label}: {what} — step {rows[label].step_s:.2f} s, "
              f"{rows[label].tflops_per_gpu:.1f} TFLOP/s per GPU "
              f"({name}, 64 V100, t=4 p=4 d=4 v=2, predicted)" for label, what in picked]
    return viz.draw_lanes([rows[label].sim for label, _ in picked], out_path, titles=titles)


# ============================================================ part 0: bytes
def compiled_bytes() -> dict:
    """Per-device bytes sent per step, by mesh axes, of the compiled pipe2 x data2 x tensor2
    AFAPAB step (``sim.program_bytes.compile_afapab_step``) for each (grad_sync,
    grad_sync_dtype); JAX must not have started yet."""
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np

    from mindpipe_jax.parallel.collectives import axes_of, collectives
    from mindpipe_jax.sim.program_bytes import compile_afapab_step

    out = {}
    for sync in SYNC_VARIANTS:
        for dtype in ("fp32", "bf16"):
            hlo, mesh, _ = compile_afapab_step(sync, dtype)
            ids = np.vectorize(lambda d: d.id)(mesh.devices)
            by_axis: dict[str, float] = {}
            for op in collectives(hlo):
                axes = "+".join(a for a in mesh.axis_names if a in axes_of(op, ids, mesh.axis_names)) or "-"
                # device 0: every device of this mesh sends the same, but for pipe's ends
                by_axis[axes] = by_axis.get(axes, 0.0) + op.sent_by(0) * op.count
            out[(sync, dtype)] = by_axis
    return out


def report_bytes(out) -> dict:
    from mindpipe_jax.sim.program_bytes import BYTES_DIMS

    d = BYTES_DIMS
    print("\nPart 0 — per-device bytes per step, read from the compiled programs "
          "(parallel/collectives.py)", file=out)
    print(f"  pipe2 x data2 x tensor2 on 8 CPU devices, AFAPAB p=2 m={d['m']} v={d['v']}, GPT "
          f"d_model={d['d_model']} layers={d['layers']} seq={d['seq']}, weights sharded as stored", file=out)
    table = compiled_bytes()
    axes = sorted({a for row in table.values() for a in row if row[a]}, key=lambda a: (a != "data", a))
    print("  " + f"{'variant':<14}" + "".join(f"{a:>12}" for a in axes) + f"{'total':>12}", file=out)
    for (sync, dtype), row in table.items():
        print("  " + f"{sync + ' ' + dtype:<14}" + "".join(f"{row.get(a, 0):>12,.0f}" for a in axes)
              + f"{sum(row.values()):>12,.0f}", file=out)
    data = {k: row.get("data", 0.0) for k, row in table.items()}
    print(f"  data-axis bytes: chunk / end = {data['chunk', 'fp32'] / data['end', 'fp32']:.3f} (fp32), "
          f"{data['chunk', 'bf16'] / data['end', 'bf16']:.3f} (bf16); bf16 / fp32 = "
          f"{data['end', 'bf16'] / data['end', 'fp32']:.3f} (end), "
          f"{data['chunk', 'bf16'] / data['chunk', 'fp32']:.3f} (chunk); overlap / end = "
          f"{data['overlap', 'fp32'] / data['end', 'fp32']:.3f} (fp32)", file=out)
    return table


# ======================================================================== main

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15, help="calls per variant (round-robin)")
    parser.add_argument("--probe-repeats", type=int, default=5)
    parser.add_argument("--rate", default="2gbit", help="tbf rate of the emulated link")
    parser.add_argument("--timeout-s", type=float, default=1200.0, help="hard limit for the two workers")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, few rounds: checks the script")
    parser.add_argument("--scale-only", action="store_true", help="skip the 2-process measurement")
    parser.add_argument("--bytes-only", action="store_true",
                        help="only part 0: bytes per device read from the compiled programs")
    parser.add_argument("--picture", default=None, help="draw the AFAPAB timeline to this file")
    parser.add_argument("--date", default=datetime.date.today().isoformat())
    parser.add_argument("--out", default=None, help="also write the output to this file")
    parser.add_argument("--raw", default=None, help="write every measurement (JSON) to this file")
    add_worker_args(parser)
    args = parser.parse_args(argv)
    if args.worker is not None:
        return worker(args)
    if args.smoke:
        args.rounds = min(args.rounds, 3)
        args.probe_repeats = min(args.probe_repeats, 2)
    dims = SMOKE if args.smoke else FULL
    buffer = io.StringIO()
    out = Tee(sys.stdout, buffer)
    start = time.perf_counter()
    cpu_header(out, "mindpipe_jax AFAPAB benchmark (gradient sync measured over a rate-limited link; "
               f"prediction at scale), {args.date}", "benchmarks/afapab.py", argv)
    if args.smoke and not args.bytes_only:  # its four compiles take minutes, not a smoke test's seconds
        print("\nPart 0 (bytes from the compiled programs) skipped with --smoke: run --bytes-only", file=out)
    else:
        report_bytes(out)  # before anything here starts JAX (it sets 8 CPU devices)
    out.flush()
    if args.bytes_only:
        print(f"\n(benchmark took {time.perf_counter() - start:.0f} s)", file=out)
        if args.out:
            Path(args.out).write_text(buffer.getvalue())
        return
    if not args.scale_only:
        mib = 2**20
        spec = dict(dims=dims, rounds=args.rounds, probe_repeats=args.probe_repeats,
                    probe_iters=2 if args.smoke else 3,
                    probes={"all-reduce": ([64 * 1024, mib] if args.smoke
                                           else [mib // 4, mib, 4 * mib, 16 * mib]),
                            **({} if args.smoke else {"ring-step": [mib, 8 * mib],
                                                      "all-gather": [mib, 8 * mib]})},
                    overlap_probe=not args.smoke, overlap_matmuls=60, overlap_bytes=8 * mib)
        with Namespace(args.rate, "512kb", "50ms") as ns:
            results = launch(__file__, "afapab", spec, args.timeout_s, prefix=ns.prefix())
            if args.raw:
                Path(args.raw).write_text(json.dumps(dict(spec=spec, results=results)))
            report_part1(out, args, dims, results, ns, analyse(dims, results))
        out.flush()
    report_part2(out, args.smoke)
    out.flush()
    if args.picture:
        path = draw_picture(args.picture)
        print(f"\nPicture: {path}", file=out)
    print(f"\n(benchmark took {time.perf_counter() - start:.0f} s)", file=out)
    if args.out:
        Path(args.out).write_text(buffer.getvalue())


if __name__ == "__main__":
    main()
