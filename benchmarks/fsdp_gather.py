"""FSDP inside a pipeline: weights gathered once per step against gathered per chunk use.

``parallel.fsdp_gather`` (``pipeline_grads(fsdp_gather=...)``, runtime/fsdp.py):

* ``step`` (MaxText's ``pipeline_fsdp_ag_once``): each stage all-gathers its layers
  over ``fsdp`` once, before the tick loop; the gathered stage and the stage's whole
  fp32 gradient live through the step, reduce-scattered at the end.
* ``chunk``: the layers stay ``fsdp`` shards through the loop; each part of a tick
  all-gathers the chunk its task runs and reduce-scatters the task's weight
  gradient after it, so the accumulators are shards too.

Setting: pipe2 x fsdp4 on 8 simulated CPU devices, interleaved 1F1B with v = 1, 2, 4
chunks per device, remat "full" (activations small next to the weights: one
microbatch of 4 rows x 32 tokens), a GPT with d_model 256 and 4 layers per chunk.
Beside them, the same model and devices as ``parallel.fsdp=8`` with no pipeline
(the rules' storage sharding, gathered to the compute layout inside the step).

Printed per row, from the compiled program: temp bytes per device
(``memory_analysis().temp_size_in_bytes``), parameter and gradient bytes per device
(arguments / outputs), the bytes one device sends per step over the ``fsdp`` axis
(``parallel/collectives.py`` reading the HLO), and the step's wall time (median of
``--calls`` round-robin calls after a warm-up, with (max - min) / median). The 8
devices share this machine's cores: wall times rank the variants here, they are no
cluster claim.

Usage: ``python benchmarks/fsdp_gather.py [--calls 7] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
from _report import Tee, cpu_header  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
from flax import nnx  # noqa: E402

from mindpipe_jax.config import ModelConfig, ParallelConfig  # noqa: E402
from mindpipe_jax.models.gpt import GPT  # noqa: E402
from mindpipe_jax.parallel.collectives import axes_of, collectives, per_device_bytes  # noqa: E402
from mindpipe_jax.parallel.mesh import make_mesh  # noqa: E402
from mindpipe_jax.parallel.pipeline import get_schedule  # noqa: E402
from mindpipe_jax.parallel.pipeline.contract import stage_fns  # noqa: E402
from mindpipe_jax.parallel.pipeline.runtime import pipeline_grads  # noqa: E402
from mindpipe_jax.parallel.rules import state_shardings  # noqa: E402

PIPE, FSDP, M, ROWS, SEQ, D_MODEL, HEADS, VOCAB, LAYERS_PER_CHUNK = 2, 4, 4, 4, 32, 256, 4, 256, 4
MB = 2**20


def _model(v: int):
    cfg = ModelConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=D_MODEL, n_layers=PIPE * v * LAYERS_PER_CHUNK,
                      n_heads=HEADS)
    model = GPT(cfg, rngs=nnx.Rngs(0))
    return model, nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _data(m: int):
    tokens = np.random.default_rng(0).integers(0, VOCAB, (m, ROWS * FSDP, SEQ + 1)).astype(np.int32)
    return tokens[..., :-1], tokens[..., 1:]


def _row(name, compiled, args, mesh):
    ma = compiled.memory_analysis()
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    ops = [op for op in collectives(compiled.as_text()) if axes_of(op, ids, mesh.axis_names) == {"fsdp"}]
    return {"name": name, "fn": compiled, "args": args, "temp": ma.temp_size_in_bytes,
            "params": ma.argument_size_in_bytes, "grads": ma.output_size_in_bytes,
            "fsdp_sent": max(per_device_bytes(ops, mesh.size).values(), default=0.0)}


def pipeline_row(v: int, gather: str):
    model, params = _model(v)
    mesh = make_mesh(ParallelConfig(pipe=PIPE, fsdp=FSDP, data=1, tensor=1))
    storage = nnx.to_pure_dict(state_shardings(nnx.state(model, nnx.Param), mesh, "storage"))
    params = jax.device_put(params, storage)
    inputs, targets = _data(M)
    name = "1f1b" if v == 1 else "interleaved"
    run = pipeline_grads(stage_fns(model), get_schedule(name, PIPE, M, v), mesh, remat="full",
                         param_specs=storage, fsdp_gather=gather)
    args = (params["embed"], params["blocks"], params["head"], inputs, targets)
    with jax.set_mesh(mesh):
        compiled = jax.jit(run).lower(*args).compile()
    return _row(f"pipe{PIPE} x fsdp{FSDP}, {name} v={v}, gather per {gather}", compiled, args, mesh)


def fsdp_row(v: int):
    """The same model on the same 8 devices as parallel.fsdp=8, no pipeline: weights stored
    sharded over fsdp, gathered to the compute layout in the step, gradients leaving
    reduce-scattered; the m microbatches' rows in one pass."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from mindpipe_jax.train.state import model_spec

    model, _ = _model(v)
    mesh = make_mesh(ParallelConfig(fsdp=PIPE * FSDP, data=1, tensor=1))
    spec, create = model_spec(model, mesh, 0)
    params = jax.device_put(create(), spec.storage)
    inputs, targets = _data(M)
    rows = NamedSharding(mesh, P(("data", "fsdp")))
    x = jax.device_put(inputs.reshape(-1, SEQ), rows)
    y = jax.device_put(targets.reshape(-1, SEQ), rows)
    grad = jax.value_and_grad(lambda p, a, b: spec.merge(p).loss(a, b))

    def step(params, x, y):
        params = jax.tree.map(jax.lax.with_sharding_constraint, params, spec.compute)
        loss, grads = grad(params, x, y)
        return loss, jax.tree.map(jax.lax.with_sharding_constraint, grads, spec.storage)

    with jax.set_mesh(mesh):
        compiled = jax.jit(step).lower(params, x, y).compile()
    return _row(f"fsdp{PIPE * FSDP}, no pipeline ({PIPE * v * LAYERS_PER_CHUNK} layers)", compiled,
                (params, x, y), mesh)


def time_rows(rows, calls: int):
    for r in rows:  # warm-up
        jax.block_until_ready(r["fn"](*r["args"]))
    times = {r["name"]: [] for r in rows}
    for _ in range(calls):
        for r in rows:
            t0 = time.perf_counter()
            jax.block_until_ready(r["fn"](*r["args"]))
            times[r["name"]].append(time.perf_counter() - t0)
    for r in rows:
        t = times[r["name"]]
        r["step"], r["spread"] = statistics.median(t), (max(t) - min(t)) / statistics.median(t)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=7, help="timed calls per row (round-robin)")
    parser.add_argument("--chunks", default="1,2,4", help="virtual stages v to run")
    parser.add_argument("--out", default=None, help="also write the output to this file")
    args = parser.parse_args()
    out = open(args.out, "w") if args.out else None  # noqa: SIM115
    if out:
        sys.stdout = Tee(sys.__stdout__, out)
    cpu_header(sys.stdout, "mindpipe_jax FSDP-in-pipeline gather benchmark", "benchmarks/fsdp_gather.py")
    print(f"pipe{PIPE} x fsdp{FSDP} on 8 simulated CPU devices; GPT d_model {D_MODEL}, {HEADS} heads, vocab "
          f"{VOCAB}, {LAYERS_PER_CHUNK} layers per chunk, seq {SEQ}, m={M} microbatches of {ROWS} rows per "
          f"fsdp device; remat full; fp32. Bytes are per device.\n")
    header = (f"{'variant':48s} {'temp MB':>8s} {'params MB':>9s} {'grads MB':>8s} {'fsdp sent MB':>12s} "
              f"{'step ms':>8s} {'spread':>6s}")
    for v in (int(x) for x in args.chunks.split(",")):
        rows = [pipeline_row(v, "step"), pipeline_row(v, "chunk"), fsdp_row(v)]
        time_rows(rows, args.calls)
        print(header)
        print("-" * len(header))
        for r in rows:
            print(f"{r['name']:48s} {r['temp'] / MB:8.2f} {r['params'] / MB:9.2f} {r['grads'] / MB:8.2f} "
                  f"{r['fsdp_sent'] / MB:12.2f} {1e3 * r['step']:8.0f} {100 * r['spread']:5.0f}%")
        step, chunk, plain = rows
        sent = chunk["fsdp_sent"] / max(step["fsdp_sent"], 1)
        print(f"  per chunk use / once per step: temp {chunk['temp'] / step['temp']:.2f}x, fsdp bytes sent "
              f"{sent:.2f}x, step time {chunk['step'] / step['step']:.2f}x; FSDP without a pipeline: "
              f"temp {plain['temp'] / MB:.2f} MB, step {1e3 * plain['step']:.0f} ms")
        slower = [f"{r['name'].split(', ', 1)[1]} {r['step'] / plain['step']:.2f}x" for r in (step, chunk)
                  if r["step"] > plain["step"]]
        print(f"  pipeline rows slower than FSDP without a pipeline: {', '.join(slower) or 'none'} (on this "
              f"machine its 8 devices share 2 cores, bubble-free, and its gathers are memory copies)\n")
    if out:
        sys.stdout = sys.__stdout__
        out.close()


if __name__ == "__main__":
    main()
