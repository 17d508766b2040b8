"""One AFAPAB step with the chunk ring (``grad_sync="chunk"``), timed in this process.

The ring's per-tick work is small next to a tick's compute, so what it costs is mostly
what XLA adds around it: copies of the ring's state in the tick loop. This times the
compiled step (p=2 x data=4 on 8 simulated CPU devices, GPT d_model 128, 2v layers,
m=8 microbatches of 8 rows x 32 tokens, remat "full") so that a runtime change can be
compared with the code before it, alternated in one session (``PYTHONPATH`` at a
worktree of the older commit).

Usage: ``python benchmarks/afapab_ring_step.py [--v 4] [--calls 15]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--v", type=int, default=4, help="chunks per device (rings: those whose sync has "
                                                        "ticks left after it)")
    parser.add_argument("--calls", type=int, default=15, help="timed calls after one warm-up")
    args = parser.parse_args()
    if args.v < 1 or args.calls < 1:
        parser.error(f"--v and --calls must be >= 1, got {args.v} and {args.calls}")
    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    from flax import nnx

    from mindpipe_jax.config import ModelConfig, ParallelConfig
    from mindpipe_jax.models.gpt import GPT
    from mindpipe_jax.parallel.mesh import make_mesh
    from mindpipe_jax.parallel.pipeline import get_schedule
    from mindpipe_jax.parallel.pipeline.contract import stage_fns
    from mindpipe_jax.parallel.pipeline.runtime import pipeline_grads

    p, m, data = 2, 8, 4
    model = GPT(ModelConfig(vocab_size=256, seq_len=32, d_model=128, n_layers=p * args.v, n_heads=4),
                rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    tokens = np.random.default_rng(0).integers(0, 256, (m, 2 * data, 33)).astype(np.int32)
    step_args = (params["embed"], params["blocks"], params["head"], tokens[..., :-1], tokens[..., 1:])
    mesh = make_mesh(ParallelConfig(pipe=p, tensor=1, data=data))
    run = pipeline_grads(stage_fns(model), get_schedule("afapab", p, m, args.v), mesh, remat="full",
                         grad_sync="chunk")
    with jax.set_mesh(mesh):
        step = jax.jit(run).lower(*step_args).compile()
        jax.block_until_ready(step(*step_args))
        times = []
        for _ in range(args.calls):
            t0 = time.perf_counter()
            jax.block_until_ready(step(*step_args))
            times.append(time.perf_counter() - t0)
    print(f"afapab chunk ring, p={p} data={data} v={args.v} m={m}: median "
          f"{1e3 * statistics.median(times):.1f} ms [{1e3 * min(times):.1f}, {1e3 * max(times):.1f}] over "
          f"{args.calls} calls")


if __name__ == "__main__":
    main()
