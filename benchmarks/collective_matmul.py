"""Train-step time of the GPT with ``model.collective_matmul`` on vs off, 8 simulated CPU devices.

What this can and cannot show. XLA:CPU executes collectives synchronously, one
after another with the compute (there is no asynchronous collective and no
latency-hiding scheduler on the CPU backend), so nothing overlaps here. The
option replaces each of the four blocking all-reduces per block and direction
by p-step rings of ``ppermute`` + a p-times-smaller partial matmul (plus one
all-gather of the residual stream each way): more, smaller matmuls and p-1
rendezvous per ring instead of one collective. It also changes the work: with
the option off every tensor device repeats the layer norms, residual adds and
bias adds on all rows (activations are replicated over ``tensor``), with it on
each does its own T/p rows. The CPU ratio is the sum of those two effects, and
says nothing about overlap; that can only show on a GPU with the flags of
``benchmarks/gpu/xla_flags.sh``, which this script does not claim to measure.

Method. One process, 8 CPU devices, meshes data=4 x tensor=2 and data=2 x
tensor=4; the same jitted train step the loop uses (``make_train_step``: loss,
gradients, clipping, AdamW; state donated), compiled ahead of time for each
setting. The two settings alternate in blocks of ``--block`` steps (ABAB...,
so a shared machine's drift hits both alike); each block is timed by wall clock
and by process CPU time (all threads) and divided by its steps; the first block
of each side is dropped (warm-up). Reported: median ms/step per side, their
ratio (on / off) and the median of the paired block ratios.

Usage: ``python benchmarks/collective_matmul.py [--blocks 8] [--block 3]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import mindpipe_jax as mp  # noqa: E402
from mindpipe_jax.models.gpt import GPT  # noqa: E402
from mindpipe_jax.parallel.mesh import make_mesh  # noqa: E402
from mindpipe_jax.train.state import (  # noqa: E402
    abstract_train_state,
    init_train_state,
    make_optimizer,
    model_spec,
    state_shardings_for,
)
from mindpipe_jax.train.step import BATCH_AXES, make_train_step  # noqa: E402

MODEL = ("model.d_model=128", "model.n_layers=4", "model.n_heads=8", "model.seq_len=128")
BATCH = 32


def compiled_step(cfg, mesh):
    """(compiled step, initial state, batch) for one setting, as the loop builds them."""
    spec, create = model_spec(lambda r: GPT(cfg.model, rngs=r), mesh, seed=0)
    tx = make_optimizer(cfg.optim, cfg.train.steps, spec.decay_mask)
    shardings = state_shardings_for(spec, tx, mesh)
    abstract = abstract_train_state(spec, tx, mesh, shardings)
    rows = NamedSharding(mesh, P(BATCH_AXES))
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (BATCH, cfg.model.seq_len + 1))
    batch = {"inputs": jax.device_put(tokens[:, :-1].astype(np.int32), rows),
             "targets": jax.device_put(tokens[:, 1:].astype(np.int32), rows)}
    with jax.set_mesh(mesh):
        step = jax.jit(make_train_step(spec, tx, cfg, mesh, cfg.train.steps),
                       in_shardings=(shardings, rows), out_shardings=(shardings, None), donate_argnums=0)
        t0 = time.perf_counter()
        compiled = step.lower(abstract, batch).compile()
        compile_s = time.perf_counter() - t0
        state = init_train_state(spec, create, tx, mesh, 0, shardings)
    return compiled, state, batch, compile_s


def run(tensor: int, blocks: int, block: int) -> dict:
    data = 8 // tensor
    sides = {}
    for on in (False, True):
        cfg = mp.Config().replace(*MODEL, f"model.collective_matmul={str(on).lower()}",
                                  f"parallel.data={data}", f"parallel.tensor={tensor}",
                                  "parallel.simulate_cpu_devices=0", "train.steps=1000",
                                  "optim.warmup_steps=0")
        mesh = make_mesh(cfg.parallel)
        sides[on] = {"fn": compiled_step(cfg, mesh), "mesh": mesh, "wall": [], "cpu": [], "loss": []}
    for _ in range(blocks):
        for on in (False, True):
            side = sides[on]
            compiled, state, batch, _ = side["fn"]
            with jax.set_mesh(side["mesh"]):
                w0, c0 = time.perf_counter(), time.process_time()
                for _ in range(block):
                    state, metrics = compiled(state, batch)
                loss = float(metrics["loss"])  # blocks until the block's last step is done
                side["wall"].append((time.perf_counter() - w0) / block * 1e3)
                side["cpu"].append((time.process_time() - c0) / block * 1e3)
            side["loss"].append(loss)
            side["fn"] = (compiled, state, batch, side["fn"][3])
    return {"data": data, "tensor": tensor, "sides": sides}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--block", type=int, default=3, help="steps per timed block")
    args = parser.parse_args()
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"# collective matmul on vs off: GPT train step — {stamp}")
    print(f"# jax {jax.__version__}, {len(jax.devices())} simulated CPU devices, {os.cpu_count()} cores; "
          f"load average at start {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"# GPT {' '.join(m.split('.')[1] for m in MODEL)}, global batch {BATCH}, fp32 AdamW; "
          f"{args.blocks} blocks x {args.block} steps per side, alternating, first block dropped")
    print("# command: python benchmarks/collective_matmul.py "
          f"--blocks {args.blocks} --block {args.block}")
    t_start = time.perf_counter()
    rows = []
    for tensor in (2, 4):
        r = run(tensor, args.blocks, args.block)
        off, on = r["sides"][False], r["sides"][True]
        for name, side in (("off", off), ("on", on)):
            print(f"# data={r['data']} x tensor={tensor}, {name}: compile {side['fn'][3]:.1f}s; wall ms/step "
                  + " ".join(f"{x:.0f}" for x in side["wall"]) + "; CPU ms/step "
                  + " ".join(f"{x:.0f}" for x in side["cpu"]))
        # The same data and the same updates: the two sides must train alike.
        np.testing.assert_allclose(on["loss"], off["loss"], rtol=1e-4)
        med = {k: {s: statistics.median(side[k][1:]) for s, side in (("off", off), ("on", on))}
               for k in ("wall", "cpu")}
        paired = {k: statistics.median(b / a for a, b in zip(off[k][1:], on[k][1:], strict=True))
                  for k in ("wall", "cpu")}
        rows.append((r["data"], tensor, med, paired))
    print()
    print("mesh            off ms/step  on ms/step   ratio  paired  |  "
          "CPU: off ms/step  on ms/step   ratio  paired")
    for data, tensor, med, paired in rows:
        print(f"data={data} x tensor={tensor}  {med['wall']['off']:10.1f} {med['wall']['on']:11.1f} "
              f"{med['wall']['on'] / med['wall']['off']:7.3f} {paired['wall']:7.3f}  |  "
              f"{med['cpu']['off']:16.1f} {med['cpu']['on']:11.1f} "
              f"{med['cpu']['on'] / med['cpu']['off']:7.3f} {paired['cpu']:7.3f}")
    print("# ratio = on / off of the medians; paired = median of adjacent-block ratios. XLA:CPU runs")
    print("# collectives synchronously, so NOTHING OVERLAPS HERE: the ratio weighs the rings' overhead (p")
    print("# smaller matmuls, p-1 rendezvous per ring) against the norm/residual work the row split stops")
    print("# repeating on every tensor device. It is not what a GPU with async collectives would show.")
    print(f"# total {time.perf_counter() - t_start:.0f}s; load average at end "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
