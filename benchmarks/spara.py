"""SPara benchmark: K=8 subnets per step in one SPara step vs one by one (Retiarii-style).

Same supernet (``SuperGPT``: d_model 64, 2 blocks, 4 heads, seq 64, 3 FFN candidates,
elastic width / heads / depth; 269k parameters), same K = 8 subnets per step (the
sandwich sampler's, a new draw every step), same per-subnet batch (every subnet of a
step trains on the same B sequences), same update arithmetic (lazy AdamW on the
raveled parameters, per-subnet clipping at 1.0), on the same 8 simulated CPU
devices, one process. Total FLOPs per step are equal by construction (8 subnets x B
rows, forward and backward); the script also prints XLA's FLOP count of both.

The methods, a ladder from the one-by-one baseline to SPara (each rung removes one
cost of the rung above it, keeping the rest):

1. **one by one** (NNI Retiarii's way): 8 jitted data-parallel steps per step, one
   per subnet. Each: the rows split over the devices, the local gradient raveled and
   all-reduced once (one ``psum`` of the whole gradient: the baseline gets a single
   fused collective per subnet), clipped, and a lazy AdamW update of the units the
   subnet used plus the shared parameters, on every device (data parallelism keeps
   replicated optimizer state). 8 dispatches, 8 all-reduces, 8 optimizer updates.
2. **one program**: the same 8 steps in one jitted program (``fori_loop``): removes
   7 dispatches (host work, launch and device synchronisation between steps).
3. **+ one optimizer update**: the loop accumulates the 8 clipped, all-reduced
   gradients (all at the step's starting weights) and applies one AdamW update: 7
   fewer optimizer updates. (This is SPara's ``sync`` semantics, data-parallel.)
4. **+ one collective**: each device keeps its 8 local gradients ``[8, P]`` and one
   ``psum`` of the stack replaces the 8 all-reduces: 7 fewer gradient collectives
   (the same bytes, one synchronisation instead of 8).
5. **SPara** ``sync`` on ``subnet=8 x data=1``, ``train.virtual_shards`` V = the data-parallel
   device count (8; 4 at B=4): each device computes one subnet, as V gradients of B/V
   rows (``lax.map``) summed in a fixed order — the same gradient sizes as rungs 1-4. No
   gradient is reduced across devices: one ``all_to_all`` gives each device its 1/8 of
   every subnet's gradient, AdamW runs on that 1/8 (sharded), the parameters are
   all-gathered. (V=8 is the default: the setting that keeps the bits the same on every
   split of the devices.)
6. **SPara, V=1**: each device computes one gradient of all B rows: the same FLOPs as
   8x larger per-device work.

Each rung's saving (ms per step) is shown with its share of SPara's total saving at
the default V (rung 1 minus rung 5; the shares of rungs 2-5 add up to 100 % by
construction); rung 6 is reported as what V=1 adds or costs on top. "Fewer gradient
collectives" is two rungs: fewer collectives of the same bytes (3 -> 4), then 1/8 the
bytes and no reduction (4 -> 5, with the sharded update). The order of the ladder is a
choice: a saving measured after another one is removed can differ from the same saving
measured first.

Also measured: SPara ``causal`` (subnet=8 x data=1, V as in rung 5; subnets that share
an operator run in later waves, each wave a round of the step) against rung 1, and
**the floor**: the 8 gradients alone (device i computes subnet i's, V shards as in rung
5; no collective, no update), the bound on any schedule of this work on this machine.

Per-subnet batch 4: four rows cannot be split over 8 devices, so the data-parallel
rungs run on 4 devices (one row each) and the other 4 idle; SPara uses all 8. On a
GPU cluster the idle half is lost; on this 2-core CPU idle devices free the cores
for the others, which favours the baseline.

Method: compile and one warm-up step of every method first; then ``--repeats``
rounds, each timing one step of every method in turn (so a shared machine's drift
hits all alike), ``block_until_ready`` on the new state. Reported: the median wall
ms per step (one step = all 8 subnets), the ratio rung 1 / this, and the median
process CPU time (all threads) beside it: the 8 simulated devices share the
machine's 2 cores, and on a shared machine CPU time is the steadier measure of work.

Usage: ``python benchmarks/spara.py [--repeats 11] [--batches 4,16,64]
[--out benchmarks/results/DATE-cpu-spara.txt]``; ``--smoke``: d_model 32, batches
4 and 8, 2 repeats (checks the script runs).
"""

from __future__ import annotations

import argparse
import datetime
import io
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _report import Tee  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from mindpipe_jax.config import ModelConfig, OptimConfig, ParallelConfig  # noqa: E402
from mindpipe_jax.parallel.mesh import make_mesh  # noqa: E402
from mindpipe_jax.supernet import SuperGPT, sample_subnets  # noqa: E402
from mindpipe_jax.supernet.spara import (  # noqa: E402
    AXES,
    adamw,
    clip,
    global_norm,
    init_state,
    jit_step,
    make_spara_step,
    plan_step,
    state_shardings,
    supernet_spec,
)
from mindpipe_jax.train.state import lr_schedule  # noqa: E402

K = 8
TOTAL_STEPS = 10_000  # for the lr schedule only
LADDER = ["one_by_one", "one_program", "one_update", "one_collective", "spara", "spara_v1"]
CAUSE = {  # what the step from the rung above to this rung removes
    "one_program": "7 fewer dispatches (host work, launches, device syncs)",
    "one_update": "7 fewer optimizer updates",
    "one_collective": "7 fewer gradient collectives (one psum of the stack: same bytes)",
    "spara": "no reduction across devices (1/8 the collective bytes), the update sharded",
    "spara_v1": "larger per-device work (one gradient of B rows per device, V=1)",
}


def display(key: str, batch_rows: int, v: int) -> str:
    """A method's name in the table (V: the data-parallel device count)."""
    return {"one_by_one": "one by one (8 programs)", "one_program": "one program",
            "one_update": "+ one optimizer update", "one_collective": "+ one collective",
            "spara": f"SPara sync 8x1, V={v} ({batch_rows // v} rows/grad)",
            "spara_v1": f"SPara sync 8x1, V=1 ({batch_rows} rows/grad)",
            "causal": f"SPara causal 8x1, V={v}",
            "floor": f"gradients only, V={v} (the floor)"}[key]
GPU_NOTE = """\
# What a GPU would amplify. The FLOPs are the same on both sides, so what the ladder
# measures is everything else, and a GPU makes FLOPs ~100x cheaper than this CPU while
# the rest shrinks far less:
# - larger per-device work, most of all: a GPU reaches its peak only on large matmuls
#   (one by one at B=4 gives a GPU at most one 64-token sequence: a [64 x 64] by
#   [64 x 256] matmul fills a few of an H200's 132 SMs); SPara's 8x larger per-device
#   gradient (V=1) raises utilization up to 8x until the GPU saturates. A CPU core is
#   near its peak already at one row, and here V=1 even costs time (8 device threads on
#   2 cores, each with 8x the activations, out of cache): this CPU cannot show it.
# - gradient collectives: here a collective is a memory copy inside one process, the
#   cheapest it will ever be; on GPUs each all-reduce pays NCCL latency (~10-50 us per
#   call on NVLink, more across nodes) and 2x the gradient's bytes over links ~100x
#   slower than the SMs. Per step one by one sends ~16 P floats per device (8 ring
#   all-reduces of the P-float gradient), SPara ~2 P (one all_to_all of its gradient, one
#   all-gather of the new parameters). (Fusing the 8 into one, rung 4, pays on a GPU by
#   amortising latency; on this CPU it only adds a large buffer.)
# - optimizer updates and dispatches: both are memory- and launch-bound, not FLOP-bound:
#   a few kernel launches (~5 us each) and 7 reads/writes of 4 bytes per parameter at HBM
#   speed, which grows with the supernet: for 1B parameters, 8 replicated AdamW updates
#   move ~220 GB per GPU per step (~47 ms at 4.8 TB/s) vs SPara's one update of 1/8
#   of the parameters per device.""".splitlines()


def baseline_methods(spec, mesh, optim: OptimConfig):
    """Rungs 1-4: per-device programs over the mesh's ``data`` axis (params replicated).

    Each takes ``(state, subnets int32[K, genes], batch)`` and returns the new state;
    rung 1 returns the per-subnet step, called K times by the caller.
    """
    n = mesh.shape["data"]
    schedule = lr_schedule(optim, TOTAL_STEPS)
    units = spec.module.units
    units_of = jax.vmap(units)
    rep = NamedSharding(mesh, P())
    state_spec = {"step": P(), "params": P(), "opt": {"mu": P(), "nu": P(), "count": P()}}

    def local_grad(params, subnet, rows):
        # Varying params: their gradient is this device's own (not psummed by autodiff).
        local = jax.tree.map(lambda p: lax.pcast(p, AXES, to="varying"), params)
        grads = jax.grad(lambda p: spec.loss(p, rows["inputs"], rows["targets"], subnet))(local)
        return spec.ravel(grads)  # [P], the mean over this device's rows

    def dp_grad(params, subnet, rows):
        # Data parallelism: one all-reduce of the whole raveled gradient, then the clip.
        g = lax.psum(local_grad(params, subnet, rows), AXES) * (1.0 / n)
        return clip(g, global_norm(g), optim.clip_norm)

    def update(state, g, unit_mask, lr):
        p, opt = adamw(spec, spec.ravel(state["params"]), g, state["opt"], unit_mask, True, lr, optim)
        return {"step": state["step"], "params": spec.unravel(p), "opt": opt}

    def one_subnet(state, subnet, rows):
        """Rung 1: one subnet's whole data-parallel step."""
        new = update(state, dp_grad(state["params"], subnet, rows), units(subnet), schedule(state["step"]))
        return {**new, "step": state["step"] + 1}

    def one_program(state, subnets, rows):
        """Rung 2: the K steps of rung 1 in one program."""
        return lax.fori_loop(0, K, lambda k, s: one_subnet(s, subnets[k], rows), state)

    def one_update(state, subnets, rows):
        """Rung 3: K all-reduced, clipped gradients at the same weights; one update."""
        acc = lax.fori_loop(0, K, lambda k, a: a + dp_grad(state["params"], subnets[k], rows),
                            jnp.zeros((spec.padded_size,), jnp.float32))
        new = update(state, acc * (1.0 / K), jnp.any(units_of(subnets), axis=0), schedule(state["step"]))
        return {**new, "step": state["step"] + 1}

    def one_collective(state, subnets, rows):
        """Rung 4: K local gradients, one psum of the stack, then clip each, one update."""
        def body(k, buf):
            return lax.dynamic_update_index_in_dim(buf, local_grad(state["params"], subnets[k], rows), k, 0)

        buf = lax.pcast(jnp.zeros((K, spec.padded_size), jnp.float32), AXES, to="varying")
        g = lax.psum(lax.fori_loop(0, K, body, buf), AXES) * (1.0 / n)  # [K, P]
        norms = jnp.sqrt(jnp.sum(jnp.square(g), axis=1))
        scale = jnp.where(norms < optim.clip_norm, 1.0, optim.clip_norm / norms)
        mean = jnp.sum(g * scale[:, None], axis=0) * (1.0 / K)
        new = update(state, mean, jnp.any(units_of(subnets), axis=0), schedule(state["step"]))
        return {**new, "step": state["step"] + 1}

    def wrap(fn):
        sharded = jax.shard_map(fn, mesh=mesh, axis_names=set(AXES),
                                in_specs=(state_spec, P(), P("data")), out_specs=state_spec)
        return jax.jit(sharded, in_shardings=(rep, rep, NamedSharding(mesh, P("data"))),
                       out_shardings=rep, donate_argnums=(0,))

    return {name: wrap(fn) for name, fn in zip(LADDER[:4], (one_subnet, one_program, one_update,
                                                             one_collective), strict=True)}


def gradients_only(spec, mesh, v: int):
    """The floor: device i computes subnet i's gradient (V shards of B/V rows, summed),
    nothing else — no collective, no update. What no schedule of the same work can beat."""
    def per_device(params, subnets, rows):
        local = jax.tree.map(lambda p: lax.pcast(p, AXES, to="varying"), params)
        subnet = subnets[lax.axis_index(AXES)]
        shards = jax.tree.map(lambda x: x.reshape(v, -1, *x.shape[1:]), rows)
        grads = lax.map(lambda shard: spec.ravel(jax.grad(
            lambda p: spec.loss(p, shard["inputs"], shard["targets"], subnet))(local)), shards)
        return jnp.sum(grads)[None]  # every element, so no part of the gradient is dropped

    return jax.jit(jax.shard_map(per_device, mesh=mesh, axis_names=set(AXES), in_specs=(P(), P(), P()),
                                 out_specs=P(AXES)))


def flops(compiled) -> float:
    """XLA's FLOP count of a compiled program, per device."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost.get("flops", 0.0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=11, help="timed steps per method (median)")
    parser.add_argument("--batches", default="4,16,64", help="per-subnet batches (sequences per subnet)")
    parser.add_argument("--date", default=datetime.date.today().isoformat())
    parser.add_argument("--out", default=None, help="also write the output to this file")
    parser.add_argument("--smoke", action="store_true", help="d_model 32, batches 4,8, 2 repeats")
    args = parser.parse_args()
    buffer = io.StringIO()
    out = Tee(sys.stdout, buffer)

    def say(text: str = "") -> None:
        out.write(text + "\n")

    d = 32 if args.smoke else 64
    repeats = 2 if args.smoke else args.repeats
    batches = [4, 8] if args.smoke else [int(b) for b in args.batches.split(",")]
    cfg = ModelConfig(d_model=d, n_layers=2, n_heads=4, seq_len=64)
    spec, create = supernet_spec(lambda r: SuperGPT(cfg, ffn_widths=(d, 2 * d, 4 * d), depths=(1, 2), rngs=r))
    optim = OptimConfig(lr=3e-3, warmup_steps=0, clip_norm=1.0)
    t_start = time.perf_counter()
    say(f"# SPara: K={K} subnets per step, SPara vs one by one (Retiarii-style) and the ladder "
        f"between them — {args.date}")
    say(f"# machine: {os.cpu_count()}-core CPU, {platform.machine()}; jax {jax.__version__}; "
        f"load average at start {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    say(f"# SuperGPT d_model={d} n_layers=2 n_heads=4 seq_len={cfg.seq_len}; "
        f"{spec.space.num_architectures:,} architectures; {spec.num_params:,} supernet parameters; "
        f"8 simulated CPU devices; sandwich sampler; median of {repeats} steps per method")
    say(f"# command: python benchmarks/spara.py {' '.join(sys.argv[1:])}".rstrip())

    def subnets(t):
        return sample_subnets(spec.space, 0, t, K, "sandwich")

    grad_fn = jax.jit(jax.grad(lambda p, s, b: spec.loss(p, b["inputs"], b["targets"], s)))

    table = []  # (batch, method, wall ms, cpu ms)
    waves_seen = []
    flop_lines = []
    for batch_rows in batches:
        rng = np.random.default_rng(batch_rows)
        toks = rng.integers(0, 256, (batch_rows, cfg.seq_len + 1)).astype(np.int32)
        host_batch = {"inputs": toks[:, :-1], "targets": toks[:, 1:]}
        n_dp = min(8, batch_rows)  # rows cannot be split finer than one sequence
        dp_mesh = make_mesh(ParallelConfig(subnet=1, data=n_dp, tensor=1), devices=jax.devices()[:n_dp])
        dp_batch = {k: jax.device_put(v, NamedSharding(dp_mesh, P("data"))) for k, v in host_batch.items()}
        dp_rep = NamedSharding(dp_mesh, P())
        dp_state = {"step": dp_rep, "params": dp_rep, "opt": {"mu": dp_rep, "nu": dp_rep, "count": dp_rep}}
        methods = {}  # name -> (run(state, t) -> state, state shardings)
        base = baseline_methods(spec, dp_mesh, optim)
        step1 = base[LADDER[0]]

        def run_one_by_one(state, t, step1=step1, dp_batch=dp_batch):
            for subnet in subnets(t):  # K dispatches
                state = step1(state, subnet, dp_batch)
            return state

        methods[LADDER[0]] = (run_one_by_one, dp_state)
        for name in LADDER[1:4]:
            methods[name] = (lambda state, t, fn=base[name], rows=dp_batch: fn(state, subnets(t), rows),
                             dp_state)
        mesh = make_mesh(ParallelConfig(subnet=8, data=1, tensor=1))
        mesh_batch = {k: jax.device_put(v, NamedSharding(mesh, P("data"))) for k, v in host_batch.items()}
        variants = (("spara", "sync", n_dp), ("spara_v1", "sync", 1), ("causal", "causal", n_dp))
        for name, semantics, v in variants:
            step = jit_step(make_spara_step(spec, mesh, semantics=semantics, subnets_per_step=K, vmap_width=1,
                                            virtual_shards=v, global_batch=batch_rows, optim=optim,
                                            total_steps=TOTAL_STEPS), mesh)

            def run(state, t, step=step, sem=semantics, rows=mesh_batch):
                return step(state, plan_step(spec, subnets(t), sem, 8).arrays(), rows)[0]

            methods[name] = (run, state_shardings(mesh))

        floor = gradients_only(spec, mesh, n_dp)

        def run_floor(state, t, fn=floor, rows=mesh_batch):
            jax.block_until_ready(fn(state["params"], subnets(t), rows))
            return state

        methods["floor"] = (run_floor, state_shardings(mesh))
        states, wall, cpu = {}, {m: [] for m in methods}, {m: [] for m in methods}
        for name, (fn, sharding) in methods.items():
            t0 = time.perf_counter()
            state = jax.jit(lambda: init_state(spec, create()), out_shardings=sharding)()
            states[name] = jax.block_until_ready(fn(state, 0))  # compile + warm-up
            say(f"# B={batch_rows} | {display(name, batch_rows, n_dp)}: compile + first step "
                f"{time.perf_counter() - t0:.1f}s")
        # Equal work: one subnet's gradient on B rows (SPara: one device) vs on B/n rows
        # (data parallel: each of n devices). XLA counts the layer scan's body once in both.
        rows = batch_rows // n_dp
        part = {k: v[:rows] for k, v in host_batch.items()}
        params = jax.jit(create)()
        whole_f = flops(grad_fn.lower(params, subnets(0)[0], host_batch).compile())
        part_f = flops(grad_fn.lower(params, subnets(0)[0], part).compile())
        flop_lines.append(f"# B={batch_rows}: one subnet's gradient, XLA's FLOP count: {batch_rows} rows on "
                          f"one device {whole_f / 1e6:.1f} M (SPara) vs {n_dp} devices x {rows} rows = "
                          f"{n_dp * part_f / 1e6:.1f} M (data parallel)")
        for t in range(1, repeats + 1):
            waves_seen.append(plan_step(spec, subnets(t), "causal", 8).num_waves)
            for name, (fn, _) in methods.items():
                w0, c0 = time.perf_counter(), time.process_time()
                states[name] = jax.block_until_ready(fn(states[name], t))
                wall[name].append(time.perf_counter() - w0)
                cpu[name].append(time.process_time() - c0)
        for name in methods:
            table.append((batch_rows, name, display(name, batch_rows, n_dp),
                          1e3 * statistics.median(wall[name]), 1e3 * statistics.median(cpu[name])))
        del states

    def row(b, name):
        return next(r for r in table if r[0] == b and r[1] == name)

    say()
    say(f"{'B':>3}  {'method':<36}  {'wall ms/step':>12}  {'rung1/this':>10}  {'CPU ms/step':>11}  "
        f"{'rung1/this':>10}")
    for b in batches:
        _, _, _, base_ms, base_cpu = row(b, LADDER[0])
        for _, _, name, ms, cpu_ms in (r for r in table if r[0] == b):
            say(f"{b:>3}  {name:<36}  {ms:>12.1f}  {base_ms / ms:>10.2f}  {cpu_ms:>11.1f}  "
                f"{base_cpu / cpu_ms:>10.2f}")
    say(f"# one step = all K={K} subnets on B sequences each; rung1/this > 1: faster than one by one")
    say(f"# data-parallel rungs on {min(8, batches[0])} devices at B={batches[0]}"
        if batches[0] < 8 else "# data-parallel rungs on 8 devices")
    say(f"# causal waves per step over the timed steps: mean {np.mean(waves_seen):.2f} of K={K} "
        f"(min {min(waves_seen)}, max {max(waves_seen)})")
    for line in flop_lines:
        say(line)

    say()
    say("# SPara vs one by one (wall / CPU ratios), and where the difference comes from: ms per step")
    say("# saved by each rung (wall / CPU; negative: that rung costs time), and its share of the total")
    say("# saving of SPara at the default V (rung 1 - rung 5); then what V=1 adds (rung 5 - rung 6)")
    for b in batches:
        rungs = [row(b, name) for name in LADDER]
        first, causal = rungs[0], row(b, "causal")

        def ratio(r, first=first):
            return f"{first[3] / r[3]:.2f}x / {first[4] / r[4]:.2f}x"

        say(f"B={b}: SPara sync {ratio(rungs[4])} (V=1: {ratio(rungs[5])}); causal {ratio(causal)}; "
            f"the floor {ratio(row(b, 'floor'))}")
        total_w, total_c = rungs[0][3] - rungs[4][3], rungs[0][4] - rungs[4][4]
        for prev, cur in zip(rungs, rungs[1:], strict=False):
            dw, dc = prev[3] - cur[3], prev[4] - cur[4]
            share = (f"{100 * dw / total_w:>5.0f}% / {100 * dc / total_c:>5.0f}%"
                     if cur[1] != "spara_v1" and total_w > 0 and total_c > 0 else "")
            say(f"    {CAUSE[cur[1]]:<78} {dw:>8.1f} / {dc:>8.1f} ms  {share}".rstrip())
    for line in GPU_NOTE:
        say(line)
    say(f"# total {time.perf_counter() - t_start:.0f}s; load average at end "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.out:
        with open(args.out, "w") as f:
            f.write(buffer.getvalue())


if __name__ == "__main__":
    main()
