"""SPara benchmark: K subnets per step, vectorized in one program vs a Python loop of K steps.

Same supernet (``SuperGPT``: d_model 64, 2 blocks, 4 heads, seq 64, 3 FFN candidates,
elastic width / heads / depth), same global batch (16 rows), same K = 8 subnets per
step (the sampler's, a new draw every step), same update (lazy AdamW, per-subnet
clipping), on 8 simulated CPU devices, one process.

* **vectorized** — ``spara.make_spara_step``: one jitted call per step, the K subnets
  split over the ``subnet`` mesh axis (``vmap_width`` per device per round), the batch
  over ``data``; rows for several layouts.
* **loop** — ``spara.reference_step``: the definition of the semantics as K separate
  per-subnet steps, each a jitted gradient (``jax.grad`` of the whole batch, batch
  split over all 8 devices as data parallelism, params replicated) and, for causal,
  a jitted update per subnet; sync adds one update at the end, causal one for the
  shared params. This is what training K subnets one at a time costs.

Method: compile and one warm-up step per method first; then ``--repeats`` rounds,
each timing one step of every method in turn (so a shared machine's drift hits all
alike), ``block_until_ready`` on the new state. Reported: median ms per step (one
step = all K subnets), the ratio loop / vectorized, and the process CPU time per
step (all threads) beside the wall time — on a shared 2-core machine wall time is
noisy, CPU time less so. The simulated devices share the machine's 2 cores: the
vectorized step's gain here is one dispatch per step instead of ~2K, fewer and
larger kernels, and the device parallelism 2 cores allow — not a cluster claim.

Usage: ``python benchmarks/spara.py [--repeats 15] [--out benchmarks/results/DATE-cpu-spara.txt]``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from mindpipe_jax.config import ModelConfig, OptimConfig, ParallelConfig  # noqa: E402
from mindpipe_jax.parallel.mesh import make_mesh  # noqa: E402
from mindpipe_jax.supernet import SuperGPT, sample_subnets  # noqa: E402
from mindpipe_jax.supernet.spara import (  # noqa: E402
    init_state,
    jit_step,
    make_spara_step,
    plan_step,
    reference_step,
    state_shardings,
    supernet_spec,
)

K, BATCH, V = 8, 16, 8
LAYOUTS = [(8, 1, 1), (4, 2, 2), (1, 8, 8)]  # (subnet, data, vmap_width)


def _cpu_now() -> float:
    return time.process_time()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=15, help="timed steps per method (median)")
    parser.add_argument("--semantics", default="sync,causal")
    parser.add_argument("--date", default=datetime.date.today().isoformat())
    parser.add_argument("--out", default=None, help="also write the output to this file")
    parser.add_argument("--smoke", action="store_true", help="d_model 32, 2 repeats: check the script runs")
    args = parser.parse_args()
    lines: list[str] = []

    def say(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    d = 32 if args.smoke else 64
    repeats = 2 if args.smoke else args.repeats
    cfg = ModelConfig(d_model=d, n_layers=2, n_heads=4, seq_len=64)
    spec, create = supernet_spec(lambda r: SuperGPT(cfg, ffn_widths=(d, 2 * d, 4 * d), depths=(1, 2), rngs=r))
    optim = OptimConfig(lr=3e-3, warmup_steps=0, clip_norm=1.0)
    steps_total = 10_000
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 256, (BATCH, cfg.seq_len + 1)).astype(np.int32)
    host_batch = {"inputs": toks[:, :-1], "targets": toks[:, 1:]}
    t_start = time.perf_counter()
    say(f"# SPara: K={K} subnets per step, vectorized vs a loop of K per-subnet steps — {args.date}")
    say(f"# machine: {os.cpu_count()}-core CPU, {platform.machine()}; jax {jax.__version__}; "
        f"load average at start {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    say(f"# SuperGPT d_model={d} n_layers=2 n_heads=4 seq_len={cfg.seq_len}, batch {BATCH}; "
        f"{spec.space.num_architectures:,} architectures; {spec.num_params:,} supernet parameters; "
        f"8 simulated CPU devices; median of {repeats} steps per method")
    say(f"# command: python benchmarks/spara.py {' '.join(sys.argv[1:])}".rstrip())

    full = make_mesh(ParallelConfig(subnet=1, data=8, tensor=1))
    rep, rows = NamedSharding(full, P()), NamedSharding(full, P("data"))
    batch = {k: jax.device_put(v, rows) for k, v in host_batch.items()}

    def subnets(t):
        return sample_subnets(spec.space, 0, t, K, "sandwich")

    results = []
    for semantics in args.semantics.split(","):
        methods = {}
        for s, dd, w in LAYOUTS:
            mesh = make_mesh(ParallelConfig(subnet=s, data=dd, tensor=1))
            step = jit_step(make_spara_step(spec, mesh, semantics=semantics, subnets_per_step=K, vmap_width=w,
                                            virtual_shards=V, global_batch=BATCH, optim=optim,
                                            total_steps=steps_total), mesh)
            mesh_batch = {k: jax.device_put(v, NamedSharding(mesh, P("data"))) for k, v in host_batch.items()}

            def run(state, t, step=step, slots=s * w, mesh_batch=mesh_batch, sem=semantics):
                return step(state, plan_step(spec, subnets(t), sem, slots).arrays(), mesh_batch)[0]

            methods[f"vectorized subnet={s} x data={dd}, vmap {w}"] = (run, state_shardings(mesh))

        def loop(state, t, sem=semantics):
            return reference_step(spec, state, subnets(t), batch, semantics=sem, optim=optim,
                                  total_steps=steps_total)[0]

        methods["loop of K steps (data=8)"] = (loop, {"step": rep, "params": rep, "opt": rep})
        states, wall, cpu = {}, {m: [] for m in methods}, {m: [] for m in methods}
        for name, (fn, sharding) in methods.items():
            t0 = time.perf_counter()
            state = jax.jit(lambda: init_state(spec, create()), out_shardings=sharding)()
            states[name] = jax.block_until_ready(fn(state, 0))  # compile + warm-up
            say(f"# {semantics} | {name}: compile + first step {time.perf_counter() - t0:.1f}s")
        waves = [plan_step(spec, subnets(t), "causal", 1).num_waves for t in range(1, repeats + 1)]
        for t in range(1, repeats + 1):
            for name, (fn, _) in methods.items():
                w0, c0 = time.perf_counter(), _cpu_now()
                states[name] = jax.block_until_ready(fn(states[name], t))
                wall[name].append(time.perf_counter() - w0)
                cpu[name].append(_cpu_now() - c0)
        loop_ms = 1e3 * statistics.median(wall["loop of K steps (data=8)"])
        loop_cpu = 1e3 * statistics.median(cpu["loop of K steps (data=8)"])
        for name in methods:
            ms, cpu_ms = 1e3 * statistics.median(wall[name]), 1e3 * statistics.median(cpu[name])
            results.append((semantics, name, ms, loop_ms / ms, cpu_ms, loop_cpu / cpu_ms))
        if semantics == "causal":
            say(f"# causal waves per step over the timed steps: mean {np.mean(waves):.2f} of K={K} "
                f"(min {min(waves)}, max {max(waves)})")

    say()
    say(f"{'semantics':<9}  {'method':<40}  {'wall ms/step':>12}  {'loop/this':>9}  "
        f"{'CPU ms/step':>11}  {'loop/this':>9}")
    for semantics, name, ms, ratio, cpu_ms, cpu_ratio in results:
        say(f"{semantics:<9}  {name:<40}  {ms:>12.1f}  {ratio:>9.2f}  {cpu_ms:>11.1f}  {cpu_ratio:>9.2f}")
    say(f"# one step = all K={K} subnets; loop/this > 1: the vectorized step is faster")
    say(f"# total {time.perf_counter() - t_start:.0f}s; load average at end "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
