"""SPara through the pipeline against SPara on data parallelism alone, side by side.

For one step of K = 4 subnets of a SuperGPT (d_model 64, 4 layers, 4 heads, d_ff 256,
byte vocabulary, batch 32) on 8 simulated CPU devices: ``sequential`` (each subnet its
own AdamW update) with the masked SPara step on data=8 (``spara.py``) and through the
pipeline (``pipelined.py``) on pipe=2 x data=4 and pipe=4 x data=2; ``sync`` on
subnet=2 x data=4 and through the pipeline, where the subnets are its microbatches: on
subnet=2 x pipe=2 x data=2 (each subnet group's 2 subnets through its own pipeline,
which runs in lockstep there, ``needs_lockstep``) and on pipe=2 x data=4 (all 4 subnets
in one pass); ``sequential`` on pipe=2 x fsdp=4 with the weights kept split over fsdp
into the pipeline (gathered once per step on their stage, gradients reduce-scattered)
and, beside it, handed to the pipeline whole; and, on pipe=2 x data=4, both semantics
on the pipeline's sliced path (``pipelined_sliced.py``: each pass at its subnets' FFN
width and heads, rounded to the ladder, and only to its deepest subnet's depth). 1F1B with 4 microbatches per
subnet. Per layout:

* what a device keeps between steps (its shards of the parameters and the AdamW
  moments, summed over the state's arrays as placed);
* the compiled step's temporary bytes (XLA's ``memory_analysis``);
* the bytes a device sends per step (``parallel/collectives.py``, the compiled HLO).
  A sliced step is several programs (start, one per pass, finish): its temp is the
  largest of theirs and its bytes their sum, for the plan of the first draw;
* the step's wall time: median and spread over ``--repeats`` interleaved rounds of
  ``--steps`` steps (after one warm-up step).

What to read: the pipeline splits the stored blocks over ``pipe``; in ``sequential`` each
subnet drains the pipeline before the next, a bubble of (p-1)/(m+p-1) of its time; in
``sync`` a pass holds n subnets, (p-1)/(n·m+p-1).

Usage: ``python benchmarks/spara_pipeline.py [--repeats 3] [--steps 3] [--only TEXT] [--out FILE]``
(``--only``: the layouts whose name contains TEXT; ``--schedule``: another pipeline schedule
than 1F1B, e.g. ``zb-h1``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict

import jax

jax.config.update("jax_num_cpu_devices", 8)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np  # noqa: E402
from _report import report  # noqa: E402

from mindpipe_jax.config import ModelConfig, OptimConfig, ParallelConfig  # noqa: E402
from mindpipe_jax.parallel.collectives import axes_of, collectives, per_device_bytes  # noqa: E402
from mindpipe_jax.parallel.mesh import make_mesh  # noqa: E402
from mindpipe_jax.supernet import (  # noqa: E402
    SuperGPT,
    init_state,
    jit_step,
    make_spara_step,
    plan_step,
    sample_subnets,
    supernet_spec,
)
from mindpipe_jax.supernet.layout import state_shardings  # noqa: E402
from mindpipe_jax.supernet.pipelined import PipelinedStep  # noqa: E402
from mindpipe_jax.supernet.pipelined_sliced import SlicedPipelinedStep  # noqa: E402

CFG = ModelConfig(d_model=64, n_layers=4, n_heads=4, seq_len=32)
K, BATCH, MICRO = 4, 32, 4
OPTIM = OptimConfig(lr=1e-3, warmup_steps=0)
# name -> (mesh axes, semantics[, PipelinedStep options])
LAYOUTS = {"sequential: data8 (no pipe)": (dict(data=8), "sequential"),
           "sequential: pipe2 x data4": (dict(pipe=2, data=4), "sequential"),
           "sequential: pipe4 x data2": (dict(pipe=4, data=2), "sequential"),
           "sequential: pipe2 x fsdp4": (dict(pipe=2, fsdp=4), "sequential"),
           "sequential: pipe2 x fsdp4, whole": (dict(pipe=2, fsdp=4), "sequential",
                                                dict(keep_fsdp_sharded=False)),
           "sync: subnet2 x data4 (no pipe)": (dict(subnet=2, data=4), "sync"),
           "sync: subnet2 x pipe2 x data2": (dict(subnet=2, pipe=2, data=2), "sync"),
           "sync: pipe2 x data4": (dict(pipe=2, data=4), "sync"),
           "sequential: pipe2 x data4, sliced": (dict(pipe=2, data=4), "sequential", dict(sliced=True)),
           "sync: pipe2 x data4, sliced": (dict(pipe=2, data=4), "sync", dict(sliced=True))}


def _batch(seed):
    toks = np.random.default_rng(seed).integers(0, 256, (BATCH, CFG.seq_len + 1)).astype(np.int32)
    return {"inputs": toks[:, :-1], "targets": toks[:, 1:]}


def build(spec, create, layout: dict, semantics: str, options: dict | None = None, draws=(), schedule="1f1b"):
    """(run(state, subnets, batch) -> state, compiled program or None, fresh state) for a
    layout; a sliced step has run every draw once (its programs compiled before timing)."""
    par = ParallelConfig(**{"tensor": 1, **layout}, microbatches=MICRO, schedule=schedule)
    mesh = make_mesh(par)
    fresh = jax.jit(lambda: init_state(spec, create()), out_shardings=state_shardings(mesh, spec))
    subnets = np.asarray(spec.space.validate(np.zeros((K, len(spec.space.genes)), np.int32)))
    batch = _batch(0)
    options = dict(options or {})
    if options.pop("sliced", False):
        step = SlicedPipelinedStep(spec, mesh, par, levels=4, semantics=semantics, subnets_per_step=K,
                                   vmap_width=1, global_batch=BATCH, optim=OPTIM, total_steps=100)

        def run(state, subs, b):
            return step(state, step.plan(subs), b)[0]

        state = fresh()
        for draw in draws:
            state = run(state, draw, batch)
        jax.block_until_ready(state)
        print(f"  {semantics}, sliced: {step.programs} programs for {len(draws)} draws; sizes (width, heads) "
              f"{sorted(set(s for d in draws for s in step.plan(d).sizes))}")
        # Its programs for the first draw's plan (start, one per pass, finish), for the columns.
        return run, step.compile(fresh(), step.plan(draws[0]), batch), fresh
    if layout.get("pipe", 1) > 1:
        step = PipelinedStep(spec, mesh, par, semantics=semantics, subnets_per_step=K, vmap_width=1,
                             global_batch=BATCH, optim=OPTIM, total_steps=100, **(options or {}))
        compiled = step.compile(fresh(), step.plan(subnets), batch)

        def run(state, subs, b):
            return step(state, step.plan(subs), b)[0]
    else:
        slots = layout.get("subnet", 1)
        jitted = jit_step(make_spara_step(spec, mesh, semantics=semantics, subnets_per_step=K,
                                          vmap_width=1, virtual_shards=8, global_batch=BATCH, optim=OPTIM,
                                          total_steps=100), mesh, spec)
        compiled = jitted.lower(fresh(), plan_step(spec, subnets, semantics, slots).arrays(), batch).compile()

        def run(state, subs, b):
            return compiled(state, plan_step(spec, subs, semantics, slots).arrays(), b)[0]
    return run, compiled, fresh


def stored_bytes(state) -> int:
    """Bytes device 0 holds of the state."""
    dev = jax.devices()[0]
    return sum(s.data.nbytes for a in jax.tree.leaves(state) for s in a.addressable_shards if s.device == dev)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--only", default="", help="only the layouts whose name contains this")
    parser.add_argument("--schedule", default="1f1b", help="the pipeline schedule (e.g. zb-h1: the sliced "
                        "passes then skip past their depth inside the B/W split)")
    parser.add_argument("--out", default=None, help="also write the report to this file")
    args = parser.parse_args()
    layouts = {name: how for name, how in LAYOUTS.items() if args.only in name}
    if not layouts:
        raise SystemExit(f"--only {args.only!r} matches no layout; layouts: {', '.join(LAYOUTS)}")

    def make(rngs):
        return SuperGPT(CFG, ops=("gelu", "silu", "tanh"), ffn_widths=(128, 256), depths=(2, 3, 4), rngs=rngs)

    spec, create = supernet_spec(make)
    draws = [sample_subnets(spec.space, 1, step, K) for step in range(args.steps + 1)]
    with report("SPara through the pipeline vs data parallelism alone", args.out):
        print(f"SuperGPT d_model {CFG.d_model}, {CFG.n_layers} layers, {spec.num_params:,} parameters "
              f"({spec.num_params * 4 / 1e6:.2f} MB fp32); sequential, K={K}, batch {BATCH}, "
              f"{MICRO} microbatches per subnet through the pipeline ({args.schedule})")
        built = {name: build(spec, create, *how, draws=draws, schedule=args.schedule)
                 for name, how in layouts.items()}
        times: dict[str, list[float]] = {name: [] for name in layouts}
        for _ in range(args.repeats):  # interleaved: the machine's load hits every layout alike
            for name, (run, _, fresh) in built.items():
                state = run(fresh(), draws[0], _batch(0))  # warm-up
                jax.block_until_ready(state)
                t0 = time.perf_counter()
                for i in range(1, args.steps + 1):
                    state = run(state, draws[i], _batch(i))
                jax.block_until_ready(state)
                times[name].append((time.perf_counter() - t0) / args.steps)
        print(f"\n{'layout':<34} {'kept/device':>12} {'temp':>10} {'sent/step':>10} "
              f"{'s/step median (min-max)':>26}")
        where = {}
        for name, (_, compiled, fresh) in built.items():
            t = times[name]
            programs = compiled if isinstance(compiled, list) else [compiled]  # the sliced step: several
            temp = max(p.memory_analysis().temp_size_in_bytes for p in programs)
            ops = [op for p in programs for op in collectives(p.as_text())]
            sent = per_device_bytes(ops, 8).get(0, 0.0)
            print(f"{name:<34} {stored_bytes(fresh()) / 1e6:>9.2f} MB {temp / 1e6:>7.2f} MB "
                  f"{sent / 1e6:>7.2f} MB {np.median(t):>12.3f} ({min(t):.3f}-{max(t):.3f})")
            where[name] = ops
        print("\nwhere the bytes go (device 0, MB per step, by collective and the mesh axes it spans):")
        for name, (layout, *_) in layouts.items():
            if name not in where:
                continue
            mesh = make_mesh(ParallelConfig(**{"tensor": 1, **layout}))
            ids = np.vectorize(lambda d: d.id)(mesh.devices)
            rows = defaultdict(float)
            for op in where[name]:
                axes = "+".join(a for a in mesh.axis_names if a in axes_of(op, ids, mesh.axis_names)) or "-"
                rows[(op.kind, axes)] += per_device_bytes([op], mesh.size).get(0, 0.0)
            top = sorted(rows.items(), key=lambda kv: -kv[1])[:4]
            print(f"  {name:<34} " + ", ".join(f"{k} over {a} {b / 1e6:.2f}" for (k, a), b in top))


if __name__ == "__main__":
    main()
