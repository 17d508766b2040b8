"""Compile-only checks on a GPU compiler, for a mock topology of 8 GPUs on one real one.

    python benchmarks/gpu/hlo_checks.py --part afapab     # on the lent GPU (issues.sh runs it)
    python benchmarks/gpu/hlo_checks.py --part afapab --smoke   # 8 simulated CPU devices

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
* ``pipeline`` (issue 15): one 1F1B step of a GPT (``--small``: d_model 1024, 4 layers;
  else the 2.8B: d_model 4096, 32 heads, 12 layers, seq 2048) on pipe4 x data2, bf16
  compute, fp32 parameters, remat full: XLA's per-device memory and whether every
  collective of the tick loop sits outside the per-device branches
  (``collectives(hlo)``' ``in_branch``; a collective inside one device's branch would
  strand the others).

Each program is compiled in a child process with XLA's dump on
(``--xla_dump_to``), and the scheduled program is read from the dump's
``*after_optimizations.txt`` (written when the HLO passes end, before code is loaded),
so a crash in a child ends only that program's check, and a crash after the passes
still leaves its schedule to read. GPU autotuning is off in the child
(``--xla_gpu_autotune_level=0``): with it on, the full-size programs had not compiled in
107-127 s; off, the 2.8B step compiles in 15 s. The child's memory line appears only
when its compile returned. ``grad_sync="chunk"`` is compiled even where the runtime
refuses it (``runtime.grads.CHUNK_RING_CRASHES_XLA_GPU_FROM``): the check says whether
this jax's XLA:GPU still crashes on it.

On the CPU (``--smoke``) collectives are synchronous: there are no start/done pairs, and
the output says so; the smoke run checks that everything compiles and is read.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

AFAPAB_DIMS = dict(vocab=32000, seq=1024, d_model=2048, heads=16, layers=8, rows=2, m=4, v=2)
PIPE_DIMS = dict(vocab=50304, seq=2048, d_model=4096, heads=32, layers=12, rows=1, m=8, v=1)
AFAPAB_SMALL = dict(vocab=8192, seq=256, d_model=512, heads=8, layers=4, rows=2, m=4, v=2)
PIPE_SMALL = dict(vocab=8192, seq=512, d_model=1024, heads=8, layers=4, rows=1, m=8, v=1)
SMOKE_DIMS = dict(vocab=64, seq=16, d_model=64, heads=4, layers=4, rows=2, m=4, v=2)
MESH_TAG = "MESH-JSON "


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


def dims_for(part: str, smoke: bool, small: bool) -> dict:
    if part == "afapab":
        return SMOKE_DIMS if smoke else AFAPAB_SMALL if small else AFAPAB_DIMS
    return dict(SMOKE_DIMS, m=8, rows=1) if smoke else PIPE_SMALL if small else PIPE_DIMS


def start_jax(smoke: bool):
    import jax

    if smoke:
        jax.config.update("jax_num_cpu_devices", 8)
        jax.config.update("jax_platforms", "cpu")
    else:
        jax.config.update("jax_mock_gpu_topology", "1x8x1")  # 8 mock hosts of the one GPU each
    devices = jax.devices()
    say(f"jax {jax.__version__}, {len(devices)} x {devices[0].device_kind} ({devices[0].platform})")
    if len(devices) != 8:
        say(f"need 8 devices, got {len(devices)}: the mock topology did not apply")
        sys.exit(1)
    return jax


def child(part: str, dims: dict, sync: str, smoke: bool) -> None:
    """Compile one program (XLA dumps it); print the mesh first, so the parent can read the
    dump's replica groups even when this process dies in the compile."""
    import numpy as np

    from mindpipe_jax.config import ParallelConfig
    from mindpipe_jax.parallel.mesh import make_mesh
    from mindpipe_jax.parallel.pipeline.runtime import grads
    from mindpipe_jax.sim.program_bytes import compile_pipeline_step

    grads.CHUNK_RING_CRASHES_XLA_GPU_FROM = None  # compile the ring even where it crashed: re-checks it
    jax = start_jax(smoke)
    axes = dict(pipe=2, data=2, tensor=2) if part == "afapab" else dict(pipe=4, data=2)
    mesh = make_mesh(ParallelConfig(**axes, simulate_cpu_devices=0))
    ids = np.vectorize(lambda d: d.id)(mesh.devices).tolist()
    say(MESH_TAG + json.dumps(dict(names=list(mesh.axis_names), ids=ids)))
    t0 = time.perf_counter()
    if part == "afapab":
        compiled, _, params = compile_pipeline_step(dims, axes, "afapab", dims["m"], dims["v"],
                                                    grad_sync=sync, dtype="bfloat16", abstract=True)
    else:
        compiled, _, params = compile_pipeline_step(dims, axes, "1f1b", dims["m"], remat="full",
                                                    dtype="bfloat16", abstract=True)
        held = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                   for x in jax.tree.leaves(params))
        total = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params))
        say(f"parameters stored per device: {held / 2 ** 20:,.1f} MiB of {total / 2 ** 20:,.1f} MiB (fp32, "
            "as training stores them)")
    say(f"compiled and loaded in {time.perf_counter() - t0:.1f} s; {memory_line(compiled)}")


def compile_and_read(args, sync: str, timeout: float):
    """Run the child for one program; return ``(hlo text or None, mesh dict or None)``."""
    dump = tempfile.mkdtemp(prefix="hlo-dump-")
    flags = [os.environ.get("XLA_FLAGS", ""), f"--xla_dump_to={dump}", "--xla_dump_hlo_as_text"]
    if not args.smoke:
        flags.append("--xla_gpu_autotune_level=0")
    if args.no_combine:  # each early chunk's all-reduce stays its own op, free to run behind later ticks
        flags.append("--xla_gpu_all_reduce_combine_threshold_bytes=0")
    if args.pass_dump:  # every pass's output: the last one written names the pass XLA died in
        flags.append("--xla_dump_hlo_pass_re=.*")
    env = dict(os.environ, XLA_FLAGS=" ".join(f for f in flags if f), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, __file__, "--child", "--part", args.part, "--syncs", sync]
    cmd += ["--smoke"] if args.smoke else []
    cmd += ["--small"] if args.small else []
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        rc = "timeout"
    mesh = None
    for line in out.splitlines():
        if line.startswith(MESH_TAG):
            mesh = json.loads(line[len(MESH_TAG):])
        elif line.strip() and not line.startswith("jax "):
            say("   | " + line)
    if rc != 0:
        tail = [ln for ln in out.splitlines() if ln.strip()][-1:] or ["(no output)"]
        say(f"   child exit {rc} after {time.perf_counter() - t0:.0f} s ({tail[0][:160]}); reading the dump")
    if rc != 0 and args.pass_dump:
        last = sorted(Path(dump).glob("*.txt"), key=lambda p: p.stat().st_mtime)[-3:]
        say("   the last passes dumped before it died: " + ", ".join(p.name for p in last))
    dumps = sorted(Path(dump).glob("*after_optimizations.txt"), key=lambda p: p.stat().st_size)
    if not dumps:
        say(f"   no *after_optimizations.txt in {dump}: XLA did not finish the HLO passes")
        if not args.pass_dump:  # (the passes' dumps stay for a look)
            shutil.rmtree(dump, ignore_errors=True)
        return None, mesh
    size = dumps[-1].stat().st_size / 1e6
    say(f"   scheduled program read from the dump: {dumps[-1].name} ({size:.1f} MB)")
    hlo = dumps[-1].read_text()
    if args.keep:  # with the mesh on its first line, for --read
        tag = "-no-combine" if args.no_combine else ""
        (Path(args.keep) / f"{args.part}-{sync}{tag}.hlo.txt").write_text(
            f"// {MESH_TAG}{json.dumps(mesh)}\n" + hlo)
    shutil.rmtree(dump, ignore_errors=True)
    return hlo, mesh


def axes_by_name(hlo: str, mesh: dict):
    import numpy as np

    from mindpipe_jax.parallel.collectives import axes_of, collectives

    ids = np.asarray(mesh["ids"])
    return {op.name: (op, axes_of(op, ids, tuple(mesh["names"]))) for op in collectives(hlo)}


def check_afapab(args, dims: dict, syncs, timeout: float) -> None:
    say(f"== afapab: pipe2 x data2 x tensor2, schedule afapab v={dims['v']} m={dims['m']}, GPT d_model="
        f"{dims['d_model']} layers={dims['layers']} seq={dims['seq']} vocab={dims['vocab']}, bf16 compute")
    for sync in syncs:
        say(f"-- grad_sync={sync}")
        hlo, mesh = compile_and_read(args, sync, timeout)
        if hlo is not None and mesh is not None:
            read_afapab(hlo, mesh)


def read_afapab(hlo: str, mesh: dict) -> None:
    """What the scheduled AFAPAB program runs under each asynchronous collective, by mesh axes."""
    from mindpipe_jax.parallel.async_overlap import async_pairs

    ops = axes_by_name(hlo, mesh)
    pairs = async_pairs(hlo)
    by_axes: dict[str, list] = {}
    for p in pairs:
        op, axes = ops.get(p.collective, (None, frozenset()))
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


def check_pipeline(args, dims: dict, timeout: float) -> None:
    n_params = 12 * dims["layers"] * dims["d_model"] ** 2 + (dims["vocab"] + dims["seq"]) * dims["d_model"]
    say(f"== pipeline: 1F1B pipe4 x data2, m={dims['m']}, GPT d_model={dims['d_model']} heads="
        f"{dims['heads']} layers={dims['layers']} seq={dims['seq']} vocab={dims['vocab']} (~"
        f"{n_params / 1e9:.2f} B parameters), bf16 compute, fp32 parameters, remat full, {dims['rows']} row "
        f"per microbatch per data rank")
    hlo, _ = compile_and_read(args, "end", timeout)
    if hlo is not None:
        read_pipeline(hlo)


def read_pipeline(hlo: str) -> None:
    """Collectives of the scheduled pipeline program: none may sit in a per-device branch."""
    from mindpipe_jax.parallel.async_overlap import async_pairs
    from mindpipe_jax.parallel.collectives import collectives

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
    ap.add_argument("--small", action="store_true", help="a smaller model (compiles faster)")
    ap.add_argument("--syncs", default="end,overlap,chunk")
    ap.add_argument("--timeout", type=float, default=100.0, help="seconds for each program's compile")
    ap.add_argument("--keep", default=None, help="copy each scheduled program into this folder")
    ap.add_argument("--pass-dump", action="store_true", help="dump every HLO pass (names where XLA dies)")
    ap.add_argument("--no-combine", action="store_true",
                    help="XLA:GPU's all-reduce combiner off (overlap sync's per-chunk reduces kept apart)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--read", default=None, help="read a program --keep wrote instead of compiling")
    args = ap.parse_args()
    if args.read:
        hlo = Path(args.read).read_text()
        first = hlo.split("\n", 1)[0]
        mesh = json.loads(first.split(MESH_TAG, 1)[1]) if MESH_TAG in first else None
        if args.part == "afapab":
            read_afapab(hlo, mesh)
        else:
            read_pipeline(hlo)
        return
    dims = dims_for(args.part, args.smoke, args.small)
    if args.child:
        child(args.part, dims, args.syncs, args.smoke)
        return
    if args.part == "afapab":
        check_afapab(args, dims, tuple(args.syncs.split(",")), args.timeout)
    else:
        check_pipeline(args, dims, args.timeout)


if __name__ == "__main__":
    main()
