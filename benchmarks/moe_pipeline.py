"""Expert parallelism inside pipeline stages, beside the layouts a user would otherwise run.

One MoE GPT (8 experts of d_ff 512, top-2, capacity 1.25, d_model 128, 4 blocks, 4
heads, seq_len 64), global batch 32, the full train step (loss, gradients, clipping,
AdamW) on 8 simulated CPU devices, in five layouts:

* ``expert=8``: expert parallelism without a pipeline (the MoE layer's all_to_all);
* ``fsdp=8``: plain FSDP, no pipeline (every weight sharded, gathered in the step);
* ``pipe=2 x data=4``: each stage keeps all its experts on each of its devices (the
  only pipelined MoE layout before 2026-12-05);
* ``pipe=2 x data=2 x expert=2`` and ``pipe=2 x expert=4``: each stage's experts split
  over its expert devices (``parallel/pipeline/runtime/experts.py``).

Pipelines run 1F1B with 4 microbatches, gradients averaged after the last tick.

Printed per row, from the compiled program (per device): the train state's bytes
(parameters and AdamW's two moments: the arguments), temp bytes
(``memory_analysis().temp_size_in_bytes``), and the step's wall time (median of
``--rounds`` round-robin calls after two warm-up calls each, with (max - min) /
median). The 8 devices share this machine's cores: wall times rank the layouts here,
they are no cluster claim (all_to_all between simulated devices is a memory copy).

Usage: ``python benchmarks/moe_pipeline.py [--rounds 7] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
from _report import Tee, cpu_header, time_round_robin  # noqa: E402  (benchmarks/ on sys.path)

import mindpipe_jax as mp  # noqa: E402
from mindpipe_jax.train.state import init_train_state  # noqa: E402
from mindpipe_jax.tuner.aot import build_step  # noqa: E402

MODEL = ("model.n_experts=8", "model.top_k=2", "model.capacity_factor=1.25", "model.d_model=128",
         "model.d_ff=512", "model.n_layers=4", "model.n_heads=4", "model.seq_len=64",
         "model.vocab_size=256", "train.global_batch=32", "train.steps=100",
         "parallel.simulate_cpu_devices=0")
PIPE = ("parallel.schedule=1f1b", "parallel.microbatches=4", "parallel.grad_sync=end")
LAYOUTS = {
    "expert=8": ("parallel.expert=8", "parallel.data=1"),
    "fsdp=8": ("parallel.fsdp=8", "parallel.data=1"),
    "pipe=2 x data=4": ("parallel.pipe=2", "parallel.data=4", *PIPE),
    "pipe=2 x data=2 x expert=2": ("parallel.pipe=2", "parallel.data=2", "parallel.expert=2", *PIPE),
    "pipe=2 x expert=4": ("parallel.pipe=2", "parallel.data=1", "parallel.expert=4", *PIPE),
}
MB = 2**20


def build(overrides):
    cfg = mp.Config().replace(*MODEL, "parallel.tensor=1", *overrides)
    built = build_step(cfg)
    compiled = built.lower().compile()
    stats = compiled.memory_analysis()
    with jax.set_mesh(built.mesh):
        state = init_train_state(built.spec, built.create, built.tx, built.mesh, 0, built.shardings)
    tokens = np.random.default_rng(0).integers(0, 256, (32, 65)).astype(np.int32)
    batch = jax.device_put({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, built.batch_sharding)

    def step(state, batch):  # the state is donated: keep the new one for the next call
        new, metrics = compiled(state, batch)
        holder[0] = new
        return metrics["loss"]
    holder = [state]
    return (lambda b: step(holder[0], b)), batch, stats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = Tee(sys.stdout, open(args.out, "w")) if args.out else sys.stdout  # noqa: SIM115
    cpu_header(out, "MoE: expert parallelism inside pipeline stages", "benchmarks/moe_pipeline.py")
    calls, stats = {}, {}
    for name, overrides in LAYOUTS.items():
        fn, batch, stats[name] = build(overrides)
        calls[name] = (fn, (batch,))
    times = time_round_robin(calls, args.rounds)
    print(f"{'layout':30s} {'state MB':>9s} {'temp MB':>8s} {'step ms':>8s} {'spread':>7s} "
          f"{'time / pipe=2 x data=4':>23s}", file=out)
    base = statistics.median(times["pipe=2 x data=4"])
    for name in LAYOUTS:
        t = times[name]
        med = statistics.median(t)
        print(f"{name:30s} {stats[name].argument_size_in_bytes / MB:9.2f} "
              f"{stats[name].temp_size_in_bytes / MB:8.2f} {med * 1e3:8.1f} "
              f"{(max(t) - min(t)) / med:7.0%} {med / base:23.2f}", file=out)
    out.flush()


if __name__ == "__main__":
    main()
