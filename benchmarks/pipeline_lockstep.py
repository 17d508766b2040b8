"""What lockstep ticks cost: the vPipe runtime with a per-device ``lax.switch`` against
lockstep ``cond``s (every device runs every task kind some stage runs in the tick),
side by side in one run, on the reference GPT where both are correct.

With ``tensor`` > 1 the runtime always runs in lockstep (``runtime.needs_lockstep``):
XLA may put a model's resharding collectives inside the stage code, and a per-device
branch would strand them. This script forces each mode on the same mesh and the same
model to show the price of that guarantee. Rows: pipe=2 x data=2 x tensor=2 and
pipe=4 x data=2 x tensor=1, 1F1B, m = 2p and 4p; the reference GPT (d_model 128,
4 layers per stage... see ``--layers-per-stage``), seq 64, 8 rows per microbatch.

Columns: median step wall time over ``--calls`` timed calls (after one warm-up), the
spread (min-max), and lockstep / switch. The calls of the two modes alternate, so load
drift hits both alike. On this machine the simulated devices share 2 cores: an idle
device frees a core, so the switch's skipped work shows as wall time here; on a GPU
cluster a tick's time is its slowest device in either mode. Work counted from the
table: ``executed`` is the sum over ticks of the task kinds run in that tick (lockstep)
or of the largest (switch), in units F = 1, BW = 2, an idle tick 0 — what each mode
costs on the critical path of a lockstep SPMD program.

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
from mindpipe_jax.parallel.pipeline.schedules import Kind  # noqa: E402

UNITS = {Kind.F: 1, Kind.BW: 2, Kind.B: 1, Kind.W: 1}


def table_work(schedule) -> tuple[int, int]:
    """(switch, lockstep) critical-path work units over the table's ticks."""
    plan = make_plan(schedule, "none")
    switch = lockstep = 0
    for t in range(schedule.num_ticks):
        kinds = {plan.keys[b - 1] for b in plan.branch[t] if b > 0}
        cost = [UNITS[k] for k, pos, _ in kinds if not (k is Kind.F and pos == 2)]  # last-stage F: empty
        switch += max(cost, default=0)
        lockstep += sum(cost)
    return switch, lockstep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=7)
    parser.add_argument("--layers-per-stage", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    with report("vPipe lockstep ticks vs per-device switch", args.out):
        print(f"{'mesh':28s} {'m':>3s} {'switch ms':>18s} {'lockstep ms':>18s} {'ratio':>6s} "
              f"{'work sw/ls':>11s}")
        for axes, p in (({"pipe": 2, "data": 2, "tensor": 2}, 2), ({"pipe": 4, "data": 2, "tensor": 1}, 4)):
            mesh = make_mesh(ParallelConfig(**axes))
            cfg = ModelConfig(vocab_size=256, seq_len=64, d_model=128, n_layers=p * args.layers_per_stage,
                              n_heads=4)
            model = GPT(cfg, rngs=nnx.Rngs(0))
            params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
            for m in (2 * p, 4 * p):
                schedule = get_schedule("1f1b", p, m)
                rng = np.random.default_rng(0)
                tokens = rng.integers(0, 256, (m, 8 * axes["data"], 65)).astype(np.int32)
                fns = {mode: jax.jit(pipeline_grads(stage_fns(model), schedule, mesh, remat="none",
                                                    lockstep=mode == "lockstep"))
                       for mode in ("switch", "lockstep")}
                def call(mode, fns=fns, tokens=tokens, params=params):
                    return jax.block_until_ready(fns[mode](params["embed"], params["blocks"], params["head"],
                                                           tokens[..., :-1], tokens[..., 1:]))
                times = {mode: [] for mode in fns}
                for mode in fns:
                    call(mode)  # compile + warm-up
                for _ in range(args.calls):
                    for mode in fns:
                        t0 = time.perf_counter()
                        call(mode)
                        times[mode].append(time.perf_counter() - t0)
                med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
                spread = {k: f"{med[k]:6.1f} ({min(v) * 1e3:.0f}-{max(v) * 1e3:.0f})"
                          for k, v in times.items()}
                sw, ls = table_work(schedule)
                label = " x ".join(f"{a}={n}" for a, n in axes.items())
                print(f"{label:28s} {m:3d} {spread['switch']:>18s} {spread['lockstep']:>18s} "
                      f"{med['lockstep'] / med['switch']:6.2f} {sw:5d}/{ls:<5d}", flush=True)


if __name__ == "__main__":
    main()
