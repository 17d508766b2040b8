"""SPara benchmark: K=8 subnets per step, SPara (sliced) vs one by one as a NAS user runs them.

Same supernet (``SuperGPT``: d_model 64, 2 blocks, 4 heads, seq 64, 3 FFN candidates,
FFN width 64 or 256, 2 or 4 heads per block, depth 1 or 2: a space small enough that
compiling every shape fits the time budget), the same K = 8 subnets per step (the
sandwich sampler's, a new draw every step), the same per-subnet batch (every subnet of
a step trains on the same B sequences), on the same 8 simulated CPU devices, one
process.

Methods
-------
**one by one (sliced, NAS user)**: what a user of a one-shot NAS library (NNI's
Retiarii one-shot, SPOS) runs: the K subnets one after another, each sliced to its
own size (its depth, each block's own FFN width and heads: no ladder), its step
jitted once per distinct shape (the cache kept across steps), data-parallel over
min(8, B) devices (rows split, one all-reduce of the gradient), clipped, and its own
lazy AdamW update (the units it used and the shared weights). K dispatches, K
all-reduces, K optimizer updates per step.

**SPara sequential, sliced**: ``SlicedStep`` with ``supernet.semantics=sequential``: the
same algorithm as one by one (K subnets one after another, K lazy AdamW updates of
everything each touches), so the like-for-like comparison. Every subnet reads the
shared layers, so the K subnets run as K waves of one: no subnet parallelism is
allowed, and it runs on the baseline's devices and layout (``subnet=1 x data=min(8,
B)``, ``virtual_shards`` = that count). What differs from one by one: ladder shapes
(fewer programs), the fixed-order (deterministic) reduction instead of an all-reduce,
and AdamW split over the devices.

**SPara sync, sliced**: ``SlicedStep`` on ``subnet=8 x data=1``, ``virtual_shards`` = the
baseline's data-parallel device count: each subnet at its ladder shape (widths and
heads rounded up to 4 levels; here the ladder holds every choice, so only the "max
over blocks" rounding remains), the K subnets grouped by shape, one round program per
group (a device per subnet), one averaged update. A different algorithm from one by
one (one update per step instead of K).

**SPara sync, masked** (context): the previous SPara step, every subnet at full size,
one program.

Columns
-------
Each method starts cold (its own compile cache) and runs ``--steps`` steps: **compile**
is the time JAX spent tracing, lowering and compiling (``jax.monitoring`` compile
events), **e2e** the wall time of those steps including it (CPU time beside). Then
``--repeats`` warm passes over the same steps, the methods interleaved (a shared
machine's drift hits all alike): **wall ms/step** median and [min, max] over the passes
is the headline; CPU ms/step (all threads) is the second column. ``base/this``: the
baseline's time over the method's (> 1: faster than one by one).

FLOPs: XLA's count (``cost_analysis``) of one SPara step on one device (all programs
it calls) against the sum of the step's subnets at their own size (each subnet's
gradient program at its own shape), and what the masked step computes (K x the
largest), at B = the middle batch.

On one accelerator (a GPU: fewer than 8 devices) every method runs on it: one by one and
SPara sequential on that device, SPara sync with all K subnets of a shape group in one
program (``vmap_width`` = K) — where a small subnet leaves most of the GPU idle.
``--d-model`` and ``--seq`` size the supernet (``benchmarks/gpu/issues.sh`` runs it so).

Usage: ``python benchmarks/spara.py [--steps 4] [--repeats 5] [--batches 4,16,64]
[--out benchmarks/results/DATE-cpu-spara-sliced.txt]``; ``--quick`` (or ``--smoke``):
d_model 32, batches 4 and 8, 2 steps, 2 repeats (checks the script runs).
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

import numpy as np  # noqa: E402
from _report import Tee  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from mindpipe_jax.config import ModelConfig, OptimConfig, ParallelConfig  # noqa: E402
from mindpipe_jax.parallel.mesh import make_mesh  # noqa: E402
from mindpipe_jax.supernet import SlicedStep, SuperGPT, sample_subnets  # noqa: E402
from mindpipe_jax.supernet.sliced import sliced_loss_and_grad  # noqa: E402
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
LEVELS = 4
TOTAL_STEPS = 10_000  # for the lr schedule only

# Compile time: every trace / lower / compile JAX does, from its monitoring events.
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")
_compile_s = [0.0]


def _on_event(name, seconds, **_):
    if name in COMPILE_EVENTS:
        _compile_s[0] += seconds


jax.monitoring.register_event_duration_secs_listener(_on_event)


class OneByOne:
    """The NAS user's run: each subnet sliced to its own size, its own data-parallel step
    (one program per distinct shape, cached), its own lazy AdamW update."""

    name = "one by one (sliced, NAS user)"

    def __init__(self, spec, create, mesh, optim, batch):
        self.spec, self.mesh, self.optim = spec, mesh, optim
        self.n = mesh.shape["data"]
        self.schedule = lr_schedule(optim, TOTAL_STEPS)
        self.batch = {k: jax.device_put(v, NamedSharding(mesh, P("data"))) for k, v in batch.items()}
        rep = NamedSharding(mesh, P())
        self.rep = rep
        self.state = jax.jit(lambda: init_state(spec, create()), out_shardings=rep)()
        self.fns = {}  # own shape -> jitted step

    @property
    def programs(self) -> int:
        return len(self.fns)

    def _fn(self, shape):
        if shape in self.fns:
            return self.fns[shape]
        spec, optim, n = self.spec, self.optim, self.n
        state_spec = {"step": P(), "params": P(), "opt": {"mu": P(), "nu": P(), "count": P()}}

        def per_device(state, subnet, rows):
            # Varying params: the gradient is this device's own (autodiff does not psum it).
            local = jax.tree.map(lambda p: lax.pcast(p, AXES, to="varying"), state["params"])
            _, g = sliced_loss_and_grad(spec, local, subnet, rows, shape)
            g = lax.psum(g, AXES) * (1.0 / n)  # data parallelism: one all-reduce
            g = clip(g, global_norm(g), optim.clip_norm)
            units, lr = spec.module.units(subnet), self.schedule(state["step"])
            p, opt = adamw(spec, spec.ravel(state["params"]), g, state["opt"], units, True, lr, optim)
            return {"step": state["step"] + 1, "params": spec.unravel(p), "opt": opt}

        fn = jax.shard_map(per_device, mesh=self.mesh, axis_names=set(AXES),
                           in_specs=(state_spec, P(), P("data")), out_specs=state_spec)
        self.fns[shape] = jax.jit(fn, in_shardings=(self.rep, self.rep, NamedSharding(self.mesh, P("data"))),
                                  out_shardings=self.rep, donate_argnums=(0,))
        return self.fns[shape]

    def step(self, subnets):
        for subnet in subnets:  # K dispatches, one program per distinct own shape
            self.state = self._fn(self.spec.module.own_shape(subnet))(self.state, subnet, self.batch)
        return self.state


class SparaSliced:
    def __init__(self, spec, create, mesh, optim, batch, v, semantics="sync", width=1):
        self.spec = spec
        self.name = f"SPara {semantics}, sliced" + (f" W{width}" if width > 1 else "")
        self.fn = SlicedStep(spec, mesh, semantics=semantics, subnets_per_step=K, vmap_width=width,
                             virtual_shards=v, global_batch=len(batch["inputs"]), optim=optim,
                             total_steps=TOTAL_STEPS, levels=LEVELS)
        self.batch = {k: jax.device_put(x, NamedSharding(mesh, P("data"))) for k, x in batch.items()}
        self.state = jax.jit(lambda: init_state(spec, create()), out_shardings=state_shardings(mesh, spec))()

    @property
    def programs(self) -> int:
        return self.fn.programs

    def step(self, subnets):
        self.state, _ = self.fn(self.state, self.fn.plan(subnets), self.batch)
        return self.state


class SparaMasked:
    def __init__(self, spec, create, mesh, optim, batch, v, width=1):
        self.spec, self.width = spec, width
        self.name = "SPara sync, masked (full size)" + (f" W{width}" if width > 1 else "")
        self.fn = jit_step(make_spara_step(spec, mesh, semantics="sync", subnets_per_step=K, vmap_width=width,
                                           virtual_shards=v, global_batch=len(batch["inputs"]), optim=optim,
                                           total_steps=TOTAL_STEPS), mesh, spec)
        self.batch = {k: jax.device_put(x, NamedSharding(mesh, P("data"))) for k, x in batch.items()}
        self.state = jax.jit(lambda: init_state(spec, create()), out_shardings=state_shardings(mesh, spec))()
        self.programs = 1
        self.fn_slots = mesh.shape["subnet"] * width  # a round's slots: S x W

    def step(self, subnets):
        self.state, _ = self.fn(self.state, plan_step(self.spec, subnets, "sync", self.fn_slots).arrays(),
                                self.batch)
        return self.state


def flops_of(lowered) -> float:
    cost = lowered.compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost.get("flops", 0.0))


def flop_lines(spec, create, optim, batch, subnets) -> list[str]:
    """One SPara step's XLA FLOPs on one device vs its subnets' own, and the masked step's."""
    one = make_mesh(ParallelConfig(subnet=1, data=1, tensor=1), devices=jax.devices()[:1])
    step = SlicedStep(spec, one, semantics="sync", subnets_per_step=K, vmap_width=1, virtual_shards=1,
                      global_batch=len(batch["inputs"]), optim=optim, total_steps=TOTAL_STEPS, levels=LEVELS)
    state = jax.eval_shape(lambda: init_state(spec, create()))
    got = step.flops(state, step.plan(subnets), batch)
    params = jax.eval_shape(create)
    own = {}
    for s in subnets:
        shape = spec.module.own_shape(s)
        if shape not in own:
            # Unrolled: XLA counts a scan body once (a uniform own shape runs as a scan).
            fn = jax.jit(lambda p, sub, b, shape=shape: sliced_loss_and_grad(spec, p, sub, b, shape,
                                                                            unroll=True))
            own[shape] = flops_of(fn.lower(params, s, batch))
    own_total = sum(own[spec.module.own_shape(s)] for s in subnets)
    largest = own[spec.module.own_shape(subnets[0])]  # the sandwich's first: the largest
    return [f"# FLOPs at B={len(batch['inputs'])}, step 1's subnets (XLA cost_analysis, one device): the "
            f"subnets at their own size {own_total / 1e9:.3f} GFLOP; SPara sliced step {got / 1e9:.3f} GFLOP "
            f"({got / own_total:.3f}x: ladder rounding + the update); masked (K x the largest) "
            f"{K * largest / 1e9:.3f} GFLOP ({K * largest / own_total:.2f}x)"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="steps per pass (the e2e column's step count)")
    parser.add_argument("--repeats", type=int, default=5, help="warm passes over the steps (median, spread)")
    parser.add_argument("--batches", default="4,16,64", help="per-subnet batches (sequences per subnet)")
    parser.add_argument("--date", default=datetime.date.today().isoformat())
    parser.add_argument("--out", default=None, help="also write the output to this file")
    parser.add_argument("--quick", "--smoke", dest="quick", action="store_true",
                        help="d_model 32, batches 4,8, 2 steps, 2 repeats")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--no-flops", action="store_true", help="skip the FLOP count (compiles every shape)")
    parser.add_argument("--devices", type=int, default=0, choices=(0, 1, 8),
                        help="8 or 1 (0: 8 when there are, else 1)")
    args = parser.parse_args()
    buffer = io.StringIO()
    out = Tee(sys.stdout, buffer)

    def say(text: str = "") -> None:
        out.write(text + "\n")

    d = 32 if args.quick else args.d_model
    # 8 devices (the simulated CPU ones): one by one data-parallel, SPara sync one subnet
    # per device. One device (a GPU): everything on it, SPara sync vmaps all K subnets of
    # a shape group in one program (vmap width K), where one by one runs them one at a time.
    n_dev = args.devices or (8 if len(jax.devices()) >= 8 else 1)
    width = 1 if n_dev == 8 else K
    steps = 2 if args.quick else args.steps
    repeats = 2 if args.quick else args.repeats
    batches = [4, 8] if args.quick else [int(b) for b in args.batches.split(",")]
    cfg = ModelConfig(d_model=d, n_layers=2, n_heads=4, seq_len=args.seq)
    # A small space (2 widths, 2 head counts, 2 depths: 20 own shapes, 8 ladder shapes) keeps the
    # compiles, at ~2-10 s each on this machine, inside the ~10 minute budget.
    spec, create = supernet_spec(lambda r: SuperGPT(cfg, ffn_widths=(d, 4 * d), heads=(2, 4), depths=(1, 2),
                                                    rngs=r))
    optim = OptimConfig(lr=3e-3, warmup_steps=0, clip_norm=1.0)
    t_start = time.perf_counter()
    widths, heads = spec.module.ladders(LEVELS)
    say(f"# SPara (sliced) vs one by one as a NAS user runs it (sliced, own shapes), K={K} subnets per step "
        f"— {args.date}")
    say(f"# machine: {os.cpu_count()}-core CPU, {platform.machine()}; jax {jax.__version__}; "
        f"load average at start {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    say(f"# SuperGPT d_model={d} n_layers=2 n_heads=4 seq_len={cfg.seq_len}; {spec.num_params:,} parameters; "
        f"{spec.space.num_architectures:,} architectures; ladder ({LEVELS} levels): widths {widths}, heads "
        f"{heads} -> at most {len(spec.module.depths) * len(widths) * len(heads)} "
        f"shapes + 2 programs; {n_dev} x {jax.devices()[0].device_kind}; sandwich sampler; {steps} steps "
        f"per pass, {repeats} warm passes")
    say(f"# command: python benchmarks/spara.py {' '.join(sys.argv[1:])}".rstrip())
    draws = [sample_subnets(spec.space, 0, t, K, "sandwich") for t in range(steps)]
    own_shapes = {spec.module.own_shape(s) for sub in draws for s in sub}
    ladder_shapes = {spec.module.sliced_shape(s, LEVELS) for sub in draws for s in sub}
    say(f"# the {steps * K} subnets of a pass: {len(own_shapes)} distinct own shapes (one by one compiles "
        f"each), {len(ladder_shapes)} ladder shapes (SPara)")
    rows = []
    flops = []
    for b in batches:
        rng = np.random.default_rng(b)
        toks = rng.integers(0, 256, (b, cfg.seq_len + 1)).astype(np.int32)
        batch = {"inputs": toks[:, :-1], "targets": toks[:, 1:]}
        n_dp = min(n_dev, b)  # rows cannot be split finer than one sequence
        dp_mesh = make_mesh(ParallelConfig(subnet=1, data=n_dp, tensor=1), devices=jax.devices()[:n_dp])
        mesh = make_mesh(ParallelConfig(subnet=n_dev, data=1, tensor=1), devices=jax.devices()[:n_dev])
        methods = [OneByOne(spec, create, dp_mesh, optim, batch),
                   SparaSliced(spec, create, dp_mesh, optim, batch, n_dp, semantics="sequential"),
                   SparaSliced(spec, create, mesh, optim, batch, n_dp, width=width),
                   SparaMasked(spec, create, mesh, optim, batch, n_dp, width=width)]
        cold = {}
        for m in methods:  # cold: compile as the steps meet new shapes
            c0, w0, p0 = _compile_s[0], time.perf_counter(), time.process_time()
            for sub in draws:
                m.step(sub)
            jax.block_until_ready(m.state)
            w1, p1 = time.perf_counter(), time.process_time()
            cold[m.name] = (_compile_s[0] - c0, w1 - w0, p1 - p0, m.programs)
        wall = {m.name: [] for m in methods}
        cpu = {m.name: [] for m in methods}
        for _ in range(repeats):
            for m in methods:
                c0, w0, p0 = _compile_s[0], time.perf_counter(), time.process_time()
                for sub in draws:
                    m.step(sub)
                jax.block_until_ready(m.state)
                assert _compile_s[0] - c0 < 0.05, f"{m.name} compiled on a warm pass"
                wall[m.name].append((time.perf_counter() - w0) / steps)
                cpu[m.name].append((time.process_time() - p0) / steps)
        for m in methods:
            rows.append((b, n_dp, m.name, *cold[m.name], wall[m.name], cpu[m.name]))
            say(f"# B={b} | {m.name}: {cold[m.name][3]} programs, compile {cold[m.name][0]:.1f}s, "
                f"e2e {cold[m.name][1]:.1f}s")
        if b == batches[len(batches) // 2] and not args.no_flops:
            flops += flop_lines(spec, create, optim, batch, draws[1 % steps])
        del methods

    say()
    say(f"{'B':>3}  {'method':<32} {'programs':>8} {'compile s':>9} {'e2e s':>7} {'e2e CPU s':>9} "
        f"{'base/this':>9}   {'wall ms/step [min, max]':<26} {'base/this':>9} {'CPU ms/step':>11} "
        f"{'base/this':>9}")
    for b in batches:
        mine = [r for r in rows if r[0] == b]
        base = mine[0]
        for _, _, name, comp, e2e, e2e_cpu, progs, wl, cp in mine:
            med, bmed = statistics.median(wl), statistics.median(base[7])
            spread = f"{1e3 * med:7.1f} [{1e3 * min(wl):6.1f}, {1e3 * max(wl):6.1f}]"
            say(f"{b:>3}  {name:<32} {progs:>8} {comp:>9.1f} {e2e:>7.1f} {e2e_cpu:>9.1f} "
                f"{base[4] / e2e:>9.2f}   "
                f"{spread:<26} {bmed / med:>9.2f} {1e3 * statistics.median(cp):>11.1f} "
                f"{statistics.median(base[8]) / statistics.median(cp):>9.2f}")
    say(f"# one step = all K={K} subnets on B sequences each; e2e = {steps} steps from a cold cache, "
        f"compile included; wall/CPU ms/step: warm, median [min, max] of {repeats} passes; base/this > 1: "
        f"faster than one by one")
    say(f"# one by one and SPara sequential run data-parallel on min({n_dev}, B) devices "
        f"({min(n_dev, batches[0])} at B={batches[0]}); SPara sync on subnet={n_dev} x data=1 with vmap "
        f"width {width}; virtual_shards = the data-parallel count")
    for line in flops:
        say(line)
    say(f"# total {time.perf_counter() - t_start:.0f}s; load average at end "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.out:
        with open(args.out, "w") as f:
            f.write(buffer.getvalue())


if __name__ == "__main__":
    main()
