"""What a pipeline stage's tasks cost at the level the runtime runs them: one chunk of layers.

``benchmarks/pipeline.py``'s table 2 prices tasks from per-layer probes. The runtime
runs a stage's chunk (a ``lax.scan`` over its layers) through the code timed here:

* F, plain: the chunk's forward alone (what a remat "full" stage's F runs);
* F keeping residuals: ``ResidualStore.forward`` (a "none" stage's F) and
  ``ChunkSplit.fwd`` (the F of a stage whose backward is split), residuals written out;
* BW: the unsplit backward from those residuals, ``ResidualStore.backward`` and
  ``ChunkSplit.fused`` (a BW task on a split stage, e.g. under ``parallel.split_last``);
* B and W: ``ChunkSplit.b`` (input cotangent and the cut) and ``ChunkSplit.w`` (weight
  gradients from the cut).

It prints medians [min, max] over rounds (each round calls every function once, in a
fixed order, so that load drifting on a shared machine hits all alike) and the ratios
that decide a zero-bubble schedule's cost: (B + W) / BW and F kept / F plain.

Usage: ``python benchmarks/split_cost.py [--layers 2] [--d-model 128] [--heads 4]
[--seq 64] [--rows 8] [--dtype float32] [--rounds 60] [--out FILE]``. One core per
device (as ``benchmarks/pipeline_2proc.py`` runs each stage): prefix ``taskset -c 0``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _report import report, time_round_robin  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
from flax import nnx  # noqa: E402
from jax import lax  # noqa: E402

from mindpipe_jax.config import ModelConfig  # noqa: E402
from mindpipe_jax.models.gpt import GPT  # noqa: E402
from mindpipe_jax.parallel.pipeline.contract import stage_fns  # noqa: E402
from mindpipe_jax.parallel.pipeline.runtime.bwsplit import ChunkSplit  # noqa: E402
from mindpipe_jax.parallel.pipeline.runtime.residuals import ResidualStore  # noqa: E402


def chunk_tasks(layers: int, d_model: int, heads: int, seq: int, rows: int, dtype: str):
    """``{name: (jitted function, args)}`` for one chunk of ``layers`` GPT blocks."""
    cfg = ModelConfig(vocab_size=256, seq_len=seq, d_model=d_model, n_layers=layers, n_heads=heads,
                      dtype=dtype)
    model = GPT(cfg, rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    fns = stage_fns(model)
    tokens = np.random.default_rng(0).integers(0, 256, (rows, seq)).astype(np.int32)
    h = jax.jit(fns.embed)(params["embed"], tokens)
    dy = jnp.ones_like(h)
    blocks = params["blocks"]

    def run_layers(c, x):
        return lax.scan(lambda hh, lp: (fns.layer(lp, hh), None), x, c)[0]

    store = ResidualStore(run_layers, blocks, h)
    split = ChunkSplit(fns.layer, {"layers": blocks}, h, policy="none")
    kept_store = jax.jit(store.forward)(blocks, h)[1]
    kept_split = jax.jit(split.fwd)({"layers": blocks}, h)[1]
    cut = jax.jit(split.b)({"layers": blocks}, kept_split, dy)[1]
    return {
        "F plain": (jax.jit(run_layers), (blocks, h)),
        "F kept (none)": (jax.jit(store.forward), (blocks, h)),
        "F kept (split)": (jax.jit(lambda c, x: split.fwd({"layers": c}, x)), (blocks, h)),
        "BW (none)": (jax.jit(store.backward), (blocks, kept_store, dy)),
        "BW (split, fused)": (jax.jit(lambda c, k, d: split.fused({"layers": c}, k, d)),
                              (blocks, kept_split, dy)),
        "B": (jax.jit(lambda c, k, d: split.b({"layers": c}, k, d)), (blocks, kept_split, dy)),
        "W": (jax.jit(lambda c, k, ct: split.w({"layers": c}, k, ct)), (blocks, kept_split, cut)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=2, help="layers in the chunk (a stage's share)")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--rows", type=int, default=8, help="rows of a microbatch")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--out", default=None, help="also write the output to this file")
    args = parser.parse_args()
    for name in ("layers", "d_model", "heads", "seq", "rows", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")

    with report("pipeline chunk task costs (benchmarks/split_cost.py)", args.out):
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        print(f"# chunk: {args.layers} GPT blocks, d_model {args.d_model}, {args.heads} heads, "
              f"seq {args.seq}, {args.rows} rows, {args.dtype}; {cores} core(s) usable by this process; "
              f"{args.rounds} rounds\n")
        times = time_round_robin(chunk_tasks(args.layers, args.d_model, args.heads, args.seq, args.rows,
                                        args.dtype), args.rounds)
        med = {k: statistics.median(v) for k, v in times.items()}
        for k, v in times.items():
            print(f"  {k:<18} {1e3 * med[k]:9.2f} ms  [{1e3 * min(v):.2f}, {1e3 * max(v):.2f}]")
        print(f"\n(B + W) / BW (split, fused): {(med['B'] + med['W']) / med['BW (split, fused)']:.3f}   "
              f"(B + W) / BW (none): {(med['B'] + med['W']) / med['BW (none)']:.3f}")
        print(f"F kept / F plain: none {med['F kept (none)'] / med['F plain']:.3f}, "
              f"split {med['F kept (split)'] / med['F plain']:.3f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
