"""What keeping residuals costs inside the SPMD pipeline: one pipeline step under each
stage remat policy, timed side by side, and what the compiled tick loop moves per tick.

Setup: 8 simulated CPU devices, the cost-model benchmark's small GPT (d_model 64, 4
layers, 4 heads, seq 32, byte vocabulary), ``pipeline_grads`` with 1F1B on pipe 4 x
data 2, 4 microbatches of 8 rows (4 per device), XLA's default flags (as users compile).

For each policy (``none`` keeps every residual of a microbatch's forward until its
backward; ``dots`` keeps the matmul outputs; ``full`` keeps the stage input and
re-runs the forward) the step is compiled, warmed up and timed in ``--rounds``
interleaved rounds of ``--steps`` calls; printed: the median and the 10-90% range, the
ratio to ``full``, the compiled temporaries, and, from the scheduled HLO of the tick
loop's body, the elements its top-level fusions read out of buffers per tick (gather or
dynamic-slice: the runtime reads the backward's slot of every residual buffer, and the
other operands, once per tick, ``ticks.make_tick``), how many ``dynamic-update-slice``
fusions write buffers back, and the elements of any large copy in the body (a whole
buffer copied each tick: none expected).
Then the partitioner's view of the same pipeline (``planner_view``): its predicted step
per policy with the residual slot moves priced per tick and free, and its pick in each
case, beside the measured ratios.

``--tensor 2`` runs the same on pipe 4 x tensor 2 (no data axis), where the stages run in
lockstep (``runtime.spmd.needs_lockstep``) and the tick reads the F's slot too.

Usage: ``python benchmarks/pipeline_remat.py [--rounds 8] [--steps 3] [--tensor 2] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _report import report  # noqa: E402
from flax import nnx  # noqa: E402

from mindpipe_jax.config import ModelConfig, ParallelConfig  # noqa: E402
from mindpipe_jax.models.gpt import GPT  # noqa: E402
from mindpipe_jax.parallel.collectives import split_computations  # noqa: E402
from mindpipe_jax.parallel.mesh import make_mesh  # noqa: E402
from mindpipe_jax.parallel.pipeline import get_schedule  # noqa: E402
from mindpipe_jax.parallel.pipeline.contract import stage_fns  # noqa: E402
from mindpipe_jax.parallel.pipeline.runtime import pipeline_grads  # noqa: E402

POLICIES = ("none", "dots", "full")


def _elements(dims: str) -> int:
    return int(np.prod([int(d) for d in dims.split(",") if d] or [1]))


def loop_body_traffic(hlo: str) -> tuple[int, int, int]:
    """(elements the tick loop body's top-level fusions read out of buffers with a gather
    or a dynamic slice, its dynamic-update-slice fusions, the elements its copies of
    more than 10k elements move) in a compiled program's text."""
    comps = {name: lines for name, lines, _ in split_computations(hlo)}
    ops = {name: set(re.findall(r"= \S+ ([a-z\-]+)\(", "\n".join(lines))) for name, lines in comps.items()}
    bodies = set(re.findall(r"while\(.*?body=%?([\w.\-]+)", hlo))
    read = updates = copied = 0
    for body in bodies:
        for ln in comps.get(body, []):
            copy = re.search(r"= \w+\[([\d,]*)\]\S* copy\(", ln)
            if copy and _elements(copy.group(1)) > 10_000:
                copied += _elements(copy.group(1))
            found = re.search(r"= \w+\[([\d,]*)\]\S* fusion\(.*calls=%?([\w.\-]+)", ln)
            if not found:
                continue
            dims, callee = found.groups()
            if "dynamic-update-slice" in ops.get(callee, ()):
                updates += 1
            elif ops.get(callee, set()) & {"gather", "dynamic-slice"}:
                read += _elements(dims)
    return read, updates, copied


def main(args) -> None:
    p, m, rows = 4, 4, 8
    cfg = ModelConfig(vocab_size=256, seq_len=32, d_model=64, n_layers=4, n_heads=4)
    model = GPT(cfg, rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    rng = np.random.default_rng(0)
    inputs = jnp.asarray(rng.integers(0, cfg.vocab_size, (m, rows, cfg.seq_len)), jnp.int32)
    targets = jnp.asarray(rng.integers(0, cfg.vocab_size, (m, rows, cfg.seq_len)), jnp.int32)
    data, tensor = 8 // (p * args.tensor), args.tensor
    mesh = make_mesh(ParallelConfig(pipe=p, data=data, tensor=tensor))
    step_args = (params["embed"], params["blocks"], params["head"], inputs, targets)
    lockstep = " (lockstep: every device runs every branch some device takes)" if tensor > 1 else ""
    print(f"1F1B pipe {p} x data {data} x tensor {tensor}{lockstep}, {m} microbatches of {rows} rows, "
          f"GPT d {cfg.d_model}, {cfg.n_layers} layers, seq {cfg.seq_len}")
    steps, info = {}, {}
    with jax.set_mesh(mesh):
        for remat in POLICIES:
            step = jax.jit(pipeline_grads(stage_fns(model), get_schedule("1f1b", p, m), mesh, remat=remat))
            compiled = step.lower(*step_args).compile()
            temp = compiled.memory_analysis().temp_size_in_bytes
            info[remat] = (temp, *loop_body_traffic(compiled.as_text()))
            jax.block_until_ready(step(*step_args))
            steps[remat] = step
        times = {r: [] for r in POLICIES}
        for _ in range(args.rounds):  # interleaved: the machine's drift hits every policy alike
            for remat, step in steps.items():
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    jax.block_until_ready(step(*step_args))
                    times[remat].append(time.perf_counter() - t0)
    full = statistics.median(times["full"])
    print(f"\n{'remat':6s} {'median ms':>10s} {'10-90% ms':>14s} {'/ full':>7s} {'temp MB':>8s} "
          f"{'read per tick (elements)':>25s} {'DUS fusions':>12s} {'copied per tick':>16s}")
    for remat in POLICIES:
        ts = times[remat]
        lo, hi = np.percentile(ts, [10, 90])
        temp, read, updates, copied = info[remat]
        print(f"{remat:6s} {statistics.median(ts) * 1e3:10.1f} {lo * 1e3:6.1f}-{hi * 1e3:6.1f} "
              f"{statistics.median(ts) / full:7.2f} {temp / 2**20:8.2f} {read:25d} {updates:12d} "
              f"{copied:16d}")
    print(f"\n{args.rounds} rounds x {args.steps} calls per policy, interleaved")
    if tensor == 1:  # the planner's profile is of one unsharded device: no tensor split
        planner_view(cfg, p, m, rows // data, times)


def planner_view(cfg, p: int, m: int, rows: int, times) -> None:
    """What the partitioner predicts for the same pipeline from the block's measured costs
    (compute and slot moves both timed with every device busy at once): each policy
    forced, its step as run (fused-tick replay) with the runtime's residual slot moves
    priced per tick and with them free (the model before), and the policy it picks
    among all three in each case."""
    import dataclasses

    from mindpipe_jax.parallel.pipeline.plan.partition import measure_layer_costs, partition

    prof = measure_layer_costs(cfg, microbatch=rows, model=lambda rngs: GPT(cfg, rngs=rngs))
    free = dataclasses.replace(prof, slot_move_s_per_byte=0.0)
    print(f"\npartitioner, from one block measured on all {len(jax.devices())} devices at once at {rows} "
          f"rows per microbatch; "
          f"slot moves at {1e-9 / prof.slot_move_s_per_byte:.1f} GB/s per device (all {len(jax.devices())} "
          f"streaming at once); residual row {prof.residual_bytes[0] / 2**20:.2f} MB per layer")

    def plan(profile, options):
        return partition(profile, p=p, m=m, schedule="1f1b", remat_options=options, fuse_modes=("auto",))

    forced = {r: (plan(prof, (r,)), plan(free, (r,))) for r in POLICIES}
    print(f"{'remat':6s} {'as run ms':>10s} {'/ full':>7s} {'slots ms/tick':>14s} {'free ms':>8s} "
          f"{'/ full':>7s} {'measured / full':>16s}")
    measured_full = statistics.median(times["full"])
    for r in POLICIES:
        priced, unpriced = forced[r]
        print(f"{r:6s} {1e3 * priced.step_time_s['as run']:10.2f} "
              f"{priced.step_time_s['as run'] / forced['full'][0].step_time_s['as run']:7.2f} "
              f"{1e3 * priced.tick_slot_s:14.3f} {1e3 * unpriced.step_time_s['as run']:8.2f} "
              f"{unpriced.step_time_s['as run'] / forced['full'][1].step_time_s['as run']:7.2f} "
              f"{statistics.median(times[r]) / measured_full:16.2f}")
    fastest = min(POLICIES, key=lambda r: statistics.median(times[r]))
    for name, profile in (("slot moves priced", prof), ("slot moves free", free)):
        picked = plan(profile, POLICIES).remat
        print(f"picks with {name}: {'/'.join(picked)} (the measured fastest single policy: {fastest})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--tensor", type=int, default=1, choices=(1, 2),
                        help="2: pipe 4 x tensor 2, the stages in lockstep (no planner view)")
    args = parser.parse_args()
    if args.rounds < 1 or args.steps < 1:
        raise SystemExit(f"--rounds {args.rounds} and --steps {args.steps} must be >= 1")
    with report("Pipeline step per stage remat policy", args.out):
        main(args)
