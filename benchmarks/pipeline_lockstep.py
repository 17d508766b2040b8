"""What lockstep ticks cost: the vPipe runtime with a per-device ``lax.switch`` against
lockstep ``cond``s (every device runs every branch some device runs in the tick), with
the stages' branches kept apart, the first stage's shared with the middle stages', or
every stage's shared, side by side in one run, on the reference GPT.

With ``tensor`` > 1 the runtime always runs in lockstep (``runtime.needs_lockstep``):
XLA may put a model's resharding collectives inside the stage code, and a per-device
branch would strand them. A branch is a task kind at a stage position. Since
2026-12-04, in lockstep, the first stage's tasks take the middle stages' branches (its
embedding under a select, ``make_plan(merge_first=True)``); later that day so do the
last stage's (its forward runs its layers and the loss, so its backward is a middle
stage's, ``merge_last=True``): a tick runs the stage layers once per kind.
Rows: pipe=4 x data=2 (tensor=1, where the switch is correct too: every mode) and
pipe=4 x tensor=2 (lockstep only), 1F1B, m = 2p and 4p, fused ticks as the runtime
runs them; the reference GPT (d_model 128, ``--layers-per-stage`` 2), seq 64, 8 rows
per microbatch per batch shard.

Columns: median step wall time over ``--calls`` timed calls (after one warm-up), the
spread (min-max); the ratios of "all shared" to the switch and to "first shared". The
calls of the modes alternate, so load drift hits them alike. On this machine the
simulated devices share 2 cores: an idle device frees a core, so the switch's skipped
work shows as wall time here. Work counted from the fused plan (``work``: F = 1,
B = W = 1, BW = 2; apart and first shared: the last stage's backward + 1 for its
forward, its F 0): per tick, lockstep runs the sum of the active branches, the switch
the largest device's cell: what each mode costs on the critical path of a lockstep
SPMD program.

Usage: ``python benchmarks/pipeline_lockstep.py [--calls 7] [--out FILE]``.
"""

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402
from _report import report  # noqa: E402
from flax import nnx  # noqa: E402

from mindpipe_jax.config import ModelConfig, ParallelConfig  # noqa: E402
from mindpipe_jax.models.gpt import GPT  # noqa: E402
from mindpipe_jax.parallel.mesh import make_mesh  # noqa: E402
from mindpipe_jax.parallel.pipeline import get_schedule  # noqa: E402
from mindpipe_jax.parallel.pipeline.contract import stage_fns  # noqa: E402
from mindpipe_jax.parallel.pipeline.runtime import make_plan, pipeline_grads  # noqa: E402
from mindpipe_jax.parallel.pipeline.runtime.tickplan import LAST  # noqa: E402
from mindpipe_jax.parallel.pipeline.schedules import Kind  # noqa: E402

UNITS = {Kind.F: 1, Kind.BW: 2, Kind.B: 1, Kind.W: 1}
MODES = ("switch", "lockstep, apart", "lockstep, first shared", "lockstep, all shared")
MERGES = {"switch": (False, False), "lockstep, apart": (False, False),
          "lockstep, first shared": (True, False), "lockstep, all shared": (True, True)}


def _unit(kind, pos, merge_last) -> int:
    if pos == LAST and not merge_last:  # its F runs inside its backward
        return 0 if kind is Kind.F else UNITS[kind] + (kind is not Kind.W)
    return UNITS[kind]


def plan_work(schedule, mode: str) -> int:
    """Critical-path work units of the fused ticks ``mode`` runs."""
    first, last = MERGES[mode]
    plan = make_plan(schedule, "none", merge_first=first, merge_last=last)
    total = 0
    for t in range(plan.num_ticks):
        if mode == "switch":
            total += max(sum(_unit(*part.keys[part.branch[t, s] - 1][:2], last) for part in plan.parts
                             if part.branch[t, s] > 0) for s in range(schedule.num_stages))
        else:
            total += sum(_unit(*part.keys[k][:2], last) for part in plan.parts if part.keys
                         for k in np.flatnonzero(part.active()[t]))
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=7)
    parser.add_argument("--layers-per-stage", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    with report("vPipe lockstep ticks vs per-device switch", args.out):
        print(f"{'mesh':22s} {'m':>3s} " + " ".join(f"{mode.removeprefix('lockstep, ') + ' ms':>17s}"
                                                    for mode in MODES)
              + f" {'all/sw':>6s} {'all/first':>9s} {'first/apart':>11s} {'work sw/apart/first/all':>24s}")
        for axes in ({"pipe": 4, "data": 2, "tensor": 1}, {"pipe": 4, "data": 1, "tensor": 2}):
            p = axes["pipe"]
            mesh = make_mesh(ParallelConfig(**axes))
            cfg = ModelConfig(vocab_size=256, seq_len=64, d_model=128, n_layers=p * args.layers_per_stage,
                              n_heads=4)
            model = GPT(cfg, rngs=nnx.Rngs(0))
            params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
            modes = MODES if axes["tensor"] == 1 else MODES[1:]  # tensor > 1: lockstep only
            for m in (2 * p, 4 * p):
                schedule = get_schedule("1f1b", p, m)
                rng = np.random.default_rng(0)
                tokens = rng.integers(0, 256, (m, 8 * axes["data"], 65)).astype(np.int32)
                fns = {mode: jax.jit(pipeline_grads(stage_fns(model), schedule, mesh, remat="none",
                                                    lockstep=mode != "switch", merge_first=MERGES[mode][0],
                                                    merge_last=MERGES[mode][1]))
                       for mode in modes}
                def call(mode, fns=fns, tokens=tokens, params=params, mesh=mesh):
                    operands = (params["embed"], params["blocks"], params["head"],
                                tokens[..., :-1], tokens[..., 1:])
                    with jax.set_mesh(mesh):
                        return jax.block_until_ready(fns[mode](*operands))
                times = {mode: [] for mode in fns}
                for mode in fns:
                    call(mode)  # compile + warm-up
                for _ in range(args.calls):
                    for mode in fns:
                        t0 = time.perf_counter()
                        call(mode)
                        times[mode].append(time.perf_counter() - t0)
                med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
                cells = [f"{med[k]:6.1f} ({min(times[k]) * 1e3:.0f}-{max(times[k]) * 1e3:.0f})" if k in med
                         else "-" for k in MODES]
                base, every = med.get("switch"), med["lockstep, all shared"]
                ratio = [f"{every / base:6.2f}" if base else f"{'-':>6s}",
                         f"{every / med['lockstep, first shared']:9.2f}",
                         f"{med['lockstep, first shared'] / med['lockstep, apart']:11.2f}"]
                work = "/".join(str(plan_work(schedule, k)) for k in MODES)
                label = " x ".join(f"{a}={n}" for a, n in axes.items())
                print(f"{label:22s} {m:3d} " + " ".join(f"{c:>17s}" for c in cells) + " " + " ".join(ratio)
                      + f" {work:>24s}", flush=True)

if __name__ == "__main__":
    main()
