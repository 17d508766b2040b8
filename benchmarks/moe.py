"""Mixture of Experts on 8 simulated CPU devices: dense GPT vs MoE GPT with 2, 4, 8 experts.

Same trunk for every row (d_model 64, 2 blocks, 4 heads, seq_len 64, d_ff 256,
byte-level text of the Python standard library, global batch 32, AdamW lr 3e-3
with 10 warm-up steps, seed 0, the same batches in the same order). The dense row
is the reference GPT (``--experts 1`` selects it: one expert behind a router would
only be the dense MLP plus a router); the MoE rows replace every
block's MLP by n experts of the same width, top-1 routing (Switch: each token
still goes through one MLP, so the active FLOPs per token stay about those of the
dense model while the parameters grow n-fold), capacity factor 1.25,
load-balancing weight 0.01. Layouts: dense data=8; MoE expert=min(n, 8) x
data=8/expert, so the experts are spread over devices and tokens travel by
all_to_all.

Method: the train step the loop uses (``make_train_step``: loss, gradients,
clipping, AdamW; each batch as two accumulated microbatches, so the step also
returns what the gradient noise scale needs), compiled ahead of time per row. The rows train in turn, blocks
of ``--block`` steps round-robin (so a shared machine's drift hits all alike),
each block timed by wall clock and divided by its steps; the first block of each
row is dropped (warm-up). After ``--steps`` steps each row's validation loss is
the next-token cross-entropy alone (the MoE's auxiliary loss left out) over the
same ``--val-batches`` held-out batches. Reported: median ms/step, tokens/s, and
the validation loss, each with its ratio to the dense row, and EPara's view: the
gradient noise scale B_noise of each model (AdamW's preconditioned one, as the
tuner uses, once Adam's second moment has settled), the statistical efficiency of the
batch and entropyput = samples/s x efficiency.

What this can show on a 2-core CPU: the routing overhead (router, one-hot
dispatch/combine einsums, capacity padding, two all_to_alls per block) against
the dense MLP, and whether the extra expert parameters help the loss at equal
active compute. It is not a cluster claim about all_to_all bandwidth.

Usage: ``python benchmarks/moe.py [--steps 200] [--block 5] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import io
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from _report import Tee  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import mindpipe_jax as mp  # noqa: E402
from mindpipe_jax.data import Loader, eval_batches, load_tokens  # noqa: E402
from mindpipe_jax.models import build_model, flops_per_token  # noqa: E402
from mindpipe_jax.parallel.mesh import make_mesh  # noqa: E402
from mindpipe_jax.train.state import (  # noqa: E402
    abstract_train_state,
    init_train_state,
    make_optimizer,
    model_spec,
    state_shardings_for,
)
from mindpipe_jax.train.step import BATCH_AXES, check_step_config, make_train_step  # noqa: E402
from mindpipe_jax.tuner.noise import NoiseScale, efficiency  # noqa: E402

MODEL = ("model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.seq_len=64",
         "model.top_k=1", "model.capacity_factor=1.25", "model.moe_aux_weight=0.01")
_ROUTER_KEYS = ("model.top_k", "model.capacity_factor", "model.moe_aux_weight")
BATCH = 32
B0 = 8  # efficiency (and so entropyput) is relative to a batch of 8 sequences


@dataclasses.dataclass
class Row:
    name: str
    cfg: mp.Config
    mesh: object
    step: object
    state: object
    rows: NamedSharding
    eval_ce: object
    params: int
    times: list = dataclasses.field(default_factory=list)
    noise: NoiseScale = dataclasses.field(default_factory=lambda: NoiseScale(ema=0.95))


def build_row(n_experts: int, steps: int) -> Row:
    expert = 1 if n_experts == 1 else min(n_experts, 8)
    moe = n_experts > 1
    # The router keys apply to MoE models only (a dense model refuses them).
    keys = MODEL if moe else tuple(k for k in MODEL if k.split("=")[0] not in _ROUTER_KEYS)
    cfg = mp.Config().replace(*keys, f"model.n_experts={n_experts if moe else 0}",
                              f"parallel.expert={expert}", f"parallel.data={8 // expert}",
                              "parallel.tensor=1", f"train.global_batch={BATCH}", f"train.steps={steps}",
                              "train.grad_accum=2",  # two microbatches: the noise scale's small batch
                              "optim.lr=3e-3", "optim.warmup_steps=10", "parallel.simulate_cpu_devices=0")
    mesh = make_mesh(cfg.parallel)
    check_step_config(cfg, mesh)
    spec, create = model_spec(lambda r: build_model(cfg.model, r), mesh, seed=0)
    tx = make_optimizer(cfg.optim, steps, spec.decay_mask)
    shardings = state_shardings_for(spec, tx, mesh)
    rows = NamedSharding(mesh, P(BATCH_AXES))
    abstract = abstract_train_state(spec, tx, mesh, shardings)
    one = jax.ShapeDtypeStruct((BATCH, cfg.model.seq_len), np.int32, sharding=rows)

    def ce(params, batch):  # next-token cross-entropy alone: comparable with the dense model
        logits = spec.merge(params)(batch["inputs"]).astype(np.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    with jax.set_mesh(mesh):
        step = jax.jit(make_train_step(spec, tx, cfg, mesh, steps, noise_stats=True),
                       in_shardings=(shardings, rows),
                       out_shardings=(shardings, None), donate_argnums=0)
        compiled = step.lower(abstract, {"inputs": one, "targets": one}).compile()
        state = init_train_state(spec, create, tx, mesh, 0, shardings)
        eval_ce = jax.jit(ce, in_shardings=(spec.storage, rows))
    name = "dense GPT" if not moe else f"MoE {n_experts} experts"
    layout = " x ".join(f"{a}={n}" for a, n in mesh.shape.items() if n > 1)
    params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(spec.abstract_params))
    return Row(f"{name} ({layout})", cfg, mesh, compiled, state, rows, eval_ce, params)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps per row")
    parser.add_argument("--block", type=int, default=5, help="steps per timed block (round-robin)")
    parser.add_argument("--experts", default="1,2,4,8", help="1 = the dense GPT")
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--date", default=datetime.date.today().isoformat())
    parser.add_argument("--out", default=None, help="also write the output to this file")
    args = parser.parse_args()
    buffer = io.StringIO()
    out = Tee(sys.stdout, buffer)
    t_start = time.perf_counter()
    print(f"# MoE GPT vs dense GPT, 8 simulated CPU devices — {args.date}", file=out)
    print(f"# machine: {os.cpu_count()}-core CPU, {platform.machine()}; jax {jax.__version__}; "
          f"load average at start {' '.join(f'{x:.2f}' for x in os.getloadavg())}", file=out)
    print(f"# {' '.join(MODEL)}, global batch {BATCH}, {args.steps} steps, blocks of {args.block} "
          f"steps round-robin, first block dropped", file=out)
    print(f"# command: python benchmarks/moe.py {' '.join(sys.argv[1:])}".rstrip(), file=out)

    rows = []
    for n in (int(x) for x in args.experts.split(",")):
        t0 = time.perf_counter()
        rows.append(build_row(n, args.steps))
        print(f"# {rows[-1].name}: {rows[-1].params:,} parameters, compile + init "
              f"{time.perf_counter() - t0:.1f}s", file=out)
    model_cfg = rows[0].cfg
    splits = load_tokens(model_cfg.data, model_cfg.model.vocab_size)
    seq = model_cfg.model.seq_len
    with Loader(splits.train, seq_len=seq, batch_size=BATCH, seed=0, name="train") as loader:
        batches = [next(loader) for _ in range(args.steps)]
    val = eval_batches(splits.val, seq_len=seq, batch_size=BATCH, num_batches=args.val_batches)

    for start in range(0, args.steps, args.block):
        for row in rows:
            chunk = [{k: jax.device_put(v, row.rows) for k, v in b.items()}
                     for b in batches[start:start + args.block]]
            t0 = time.perf_counter()
            with jax.set_mesh(row.mesh):
                seen = []
                for b in chunk:
                    row.state, metrics = row.step(row.state, b)
                    seen.append(metrics)
                jax.block_until_ready(metrics["loss"])
            row.times.append((time.perf_counter() - t0) / len(chunk))
            for m in jax.device_get(seen):  # after the clock: the noise scale's inputs
                row.noise.update_from_metrics(m)  # AdamW's preconditioned estimate once it has settled

    print(file=out)
    print(f"{'configuration':<40} {'params':>9} {'MFLOP/tok':>9} {'ms/step':>8} {'x dense':>7} "
          f"{'tokens/s':>9} {'x dense':>7} {'val loss':>8} {'- dense':>7} {'B_noise':>7} {'eff':>5} "
          f"{'entropyput':>10} {'x dense':>7}", file=out)
    base = None
    for row in rows:
        ms = 1e3 * statistics.median(row.times[1:])
        with jax.set_mesh(row.mesh):
            loss = float(np.mean([row.eval_ce(row.state["params"],
                                              {k: jax.device_put(v, row.rows) for k, v in b.items()})
                                  for b in val]))
        tps = BATCH * seq / (ms / 1e3)
        mflop = flops_per_token(row.cfg.model) / 1e6
        b_noise = row.noise.b_noise
        eff = efficiency(BATCH, b_noise, B0) if b_noise is not None else float("nan")
        ent = BATCH / (ms / 1e3) * eff  # samples/s x statistical efficiency
        base = base or (ms, tps, loss, ent)
        print(f"{row.name:<40} {row.params:>9,} {mflop:>9.2f} {ms:>8.1f} {ms / base[0]:>7.2f} "
              f"{tps:>9,.0f} {tps / base[1]:>7.2f} {loss:>8.4f} {loss - base[2]:>+7.4f} "
              f"{b_noise or float('nan'):>7.1f} {eff:>5.2f} {ent:>10.1f} {ent / base[3]:>7.2f}", file=out)
    print("# MFLOP/tok: training FLOPs per token of the active parameters (flops_per_token); "
          "val loss: cross-entropy in nats per byte, aux loss excluded", file=out)
    kinds = sorted({"AdamW-preconditioned" if row.noise.preconditioned else "plain" for row in rows})
    print(f"# B_noise: gradient noise scale over the run (EMA 0.95 of the two microbatches' vs the "
          f"step's squared gradient norm; {' / '.join(kinds)} gradients, see tuner/noise.py); "
          f"eff = efficiency({BATCH}) relative to b0={B0}; entropyput = samples/s x eff", file=out)
    print(f"# total {time.perf_counter() - t_start:.0f}s; load average at end "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", file=out)
    if args.out:
        with open(args.out, "w") as f:
            f.write(buffer.getvalue())


if __name__ == "__main__":
    main()
