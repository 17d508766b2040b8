"""Compile-only checks on a GPU compiler, for a mock topology of 8 GPUs on one real one.

    python benchmarks/gpu/hlo_checks.py              # on the lent GPU (issues.sh runs it)
    python benchmarks/gpu/hlo_checks.py --smoke      # 8 simulated CPU devices, small models

``jax_mock_gpu_topology=1x8x1`` (8 mock hosts of one GPU each: the devices per host must be the
local count) makes the GPU client present 8 devices, so XLA:GPU compiles
and schedules the 8-device programs (its latency-hiding scheduler on, from
``xla_flags.sh``) without 8 GPUs. Nothing is executed: parameters are shapes only.

* ``afapab`` (issue 16): the pipe2 x data2 x tensor2 AFAPAB step (schedule ``afapab``,
  v = 2) of a GPT for each gradient sync (``end``, ``overlap``, ``chunk``). For every
  asynchronous collective over the data axis (the gradient sync) the scheduled program
  is read for what runs between its ``-start`` and ``-done``
  (``parallel.async_overlap``): the claim is that chunk-wise sync has backward compute
  under it inside the tick loop.
* ``pipeline`` (issue 15): one 1F1B step of the 2.8B GPT (d_model 4096, 32 heads, 12
  layers, seq 2048, bf16 compute, fp32 parameters) on pipe4 x data2, remat full: XLA's
  per-device memory (arguments, outputs, temporaries) and whether every collective of
  the tick loop sits outside the per-device branches (``collectives(hlo)``' ``in_branch``;
  a collective inside one device's branch would strand the others).

On the CPU (``--smoke``) collectives are synchronous: there are no start/done pairs, and
the output says so; the smoke run checks that everything compiles and is read.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

AFAPAB_DIMS = dict(vocab=32000, seq=1024, d_model=2048, heads=16, layers=8, rows=2, m=4, v=2)
PIPE_DIMS = dict(vocab=50304, seq=2048, d_model=4096, heads=32, layers=12, rows=1, m=8, v=1)
AFAPAB_SMALL = dict(vocab=8192, seq=256, d_model=512, heads=8, layers=4, rows=2, m=4, v=2)
SMOKE_DIMS = dict(vocab=64, seq=16, d_model=64, heads=4, layers=4, rows=2, m=4, v=2)


def say(text: str = "") -> None:
    print(text, flush=True)


def memory_line(compiled) -> str:
    mem = compiled.memory_analysis()
    if mem is None:
        return "memory analysis: not available"
    mib = 2.0 ** 20
    return (f"per device: arguments {mem.argument_size_in_bytes / mib:,.1f} MiB, outputs "
            f"{mem.output_size_in_bytes / mib:,.1f} MiB, temporaries "
            f"{mem.temp_size_in_bytes / mib:,.1f} MiB, code {mem.generated_code_size_in_bytes / mib:.1f} MiB")


def data_axis_ops(hlo: str, mesh):
    import numpy as np

    from mindpipe_jax.parallel.collectives import axes_of, collectives

    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    return {op.name: (op, axes_of(op, ids, mesh.axis_names)) for op in collectives(hlo)}


def check_afapab(dims: dict, syncs=("end", "overlap", "chunk")) -> None:
    from mindpipe_jax.parallel.async_overlap import async_pairs
    from mindpipe_jax.sim.program_bytes import compile_pipeline_step

    say(f"== afapab: pipe2 x data2 x tensor2, schedule afapab v={dims['v']} m={dims['m']}, GPT d_model="
        f"{dims['d_model']} layers={dims['layers']} seq={dims['seq']} vocab={dims['vocab']}, bf16 compute")
    for sync in syncs:
        t0 = time.perf_counter()
        compiled, mesh, _ = compile_pipeline_step(dims, dict(pipe=2, data=2, tensor=2), "afapab", dims["m"],
                                                  dims["v"], grad_sync=sync, dtype="bfloat16", abstract=True)
        hlo = compiled.as_text()
        ops = data_axis_ops(hlo, mesh)
        pairs = async_pairs(hlo)
        say(f"-- grad_sync={sync}: compiled in {time.perf_counter() - t0:.1f} s; {memory_line(compiled)}")
        by_axes: dict[str, list] = {}
        for p in pairs:
            op, axes = ops.get(p.start, (None, frozenset()))
            by_axes.setdefault("+".join(sorted(axes)) or "?", []).append((p, op))
        if not pairs:
            say("   no asynchronous collectives in this program (synchronous backend, e.g. the CPU)")
        for axes, items in sorted(by_axes.items()):
            compute = [p.compute_between for p, _ in items]
            hidden = sum(c > 0 for c in compute)
            loops = sum(op is not None and op.count > 1 for _, op in items)
            say(f"   {axes:>12}: {len(items)} async collectives ({loops} inside a loop), {hidden} with "
                f"compute between start and done; compute ops between: median "
                f"{statistics.median(compute):.0f}, max {max(compute)}")
        for p, op in by_axes.get("data", []):
            runs = op.count if op is not None else "?"
            say(f"      data {p.kind:18s} {p.start:32s} in {p.computation:28s} x{runs}: "
                f"{p.compute_between} compute ops between ({len(p.between)} instructions)")
        sync_ops = [op for op, axes in ops.values() if axes == frozenset({"data"})]
        say(f"   data-axis collectives (sync or async): {len(sync_ops)}; async: "
            f"{len(by_axes.get('data', []))}")


def check_pipeline(dims: dict) -> None:
    from mindpipe_jax.parallel.async_overlap import async_pairs
    from mindpipe_jax.parallel.collectives import collectives
    from mindpipe_jax.sim.program_bytes import compile_pipeline_step

    n_params = 12 * dims["layers"] * dims["d_model"] ** 2 + (dims["vocab"] + dims["seq"]) * dims["d_model"]
    say(f"== pipeline: 1F1B pipe4 x data2, m={dims['m']}, GPT d_model={dims['d_model']} heads="
        f"{dims['heads']} layers={dims['layers']} seq={dims['seq']} vocab={dims['vocab']} (~"
        f"{n_params / 1e9:.2f} B parameters), bf16 compute, fp32 parameters, remat full, {dims['rows']} row "
        f"per microbatch per data rank")
    t0 = time.perf_counter()
    compiled, mesh, params = compile_pipeline_step(dims, dict(pipe=4, data=2), "1f1b", dims["m"],
                                                   remat="full", dtype="bfloat16", abstract=True)
    hlo = compiled.as_text()
    say(f"compiled in {time.perf_counter() - t0:.1f} s; {memory_line(compiled)}")
    import jax

    held = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(params))
    total = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params))
    say(f"parameters stored per device: {held / 2 ** 20:,.1f} MiB of {total / 2 ** 20:,.1f} MiB (fp32, as "
        f"training stores them)")
    ops = collectives(hlo)
    inside = [op for op in ops if op.in_branch]
    say(f"collectives: {len(ops)} in the program, {sum(op.count > 1 for op in ops)} inside a loop, "
        f"{len(inside)} inside a per-device branch" + (" (CHECK FAILED)" if inside else " (check passed)"))
    for op in inside[:10]:
        say(f"   in a branch: {op.kind} {op.name} in {op.computation}")
    kinds: dict[str, int] = {}
    for op in ops:
        kinds[op.kind] = kinds.get(op.kind, 0) + 1
    say("   by kind: " + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())))
    pairs = async_pairs(hlo)
    say(f"asynchronous pairs: {len(pairs)}, {sum(p.compute_between > 0 for p in pairs)} with compute between")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="8 simulated CPU devices, small models")
    ap.add_argument("--part", choices=("afapab", "pipeline"), required=True)
    ap.add_argument("--small", action="store_true", help="afapab: d_model 512, 4 layers (compiles faster)")
    ap.add_argument("--syncs", default="end,overlap,chunk")
    args = ap.parse_args()
    import jax

    if args.smoke:
        jax.config.update("jax_num_cpu_devices", 8)
        jax.config.update("jax_platforms", "cpu")
    else:
        jax.config.update("jax_mock_gpu_topology", "1x8x1")  # 8 mock hosts of the one GPU each
    devices = jax.devices()
    say(f"jax {jax.__version__}, {len(devices)} x {devices[0].device_kind} ({devices[0].platform})")
    if len(devices) != 8:
        say(f"need 8 devices, got {len(devices)}: the mock topology did not apply")
        sys.exit(1)
    if args.part == "afapab":
        dims = SMOKE_DIMS if args.smoke else AFAPAB_SMALL if args.small else AFAPAB_DIMS
        check_afapab(dims, tuple(args.syncs.split(",")))
    else:
        check_pipeline(dict(SMOKE_DIMS, m=8, rows=1) if args.smoke else PIPE_DIMS)


if __name__ == "__main__":
    main()
