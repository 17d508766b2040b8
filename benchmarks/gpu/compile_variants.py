"""Which variants of a pipeline step XLA:GPU compiles, for a mock topology of 8 GPUs.

    python benchmarks/gpu/compile_variants.py           # on the lent GPU
    python benchmarks/gpu/compile_variants.py --smoke   # the same variants on 8 CPU devices

On 2026-12-04 the AFAPAB step with ``grad_sync="chunk"`` (pipe2 x data2 x tensor2) crashed
XLA:GPU in its SPMD partitioner (Shardy: a segfault in ``shardy-xla``; GSPMD: "Incompatible
manual sharding" at the head weight's bf16 copy), while ``end`` and ``overlap`` compiled
and XLA:CPU compiles all three. Each variant here changes one thing from that program and
compiles in its own child process (a crash ends only the child); the table says which
ones compile, so the crash is narrowed to what they share. Found (jax 0.11.2): it needs the
ring's steps inside the tick loop; none of the patched workarounds below compiles
(benchmarks/results/2026-12-04-h200-hlo-checks-2.txt), so the runtime refuses
``grad_sync="chunk"`` there; the child resets that refusal to re-check a later jax.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

BASE = dict(dims=dict(vocab=8192, seq=256, d_model=512, heads=8, layers=4, rows=2, m=4, v=2),
            axes=dict(pipe=2, data=2, tensor=2), schedule="afapab", grad_sync="chunk", dtype="bfloat16",
            remat="full")
VARIANTS = {
    "base (afapab chunk)": {},
    "grad_sync end": dict(grad_sync="end"),
    "float32": dict(dtype="float32"),
    "tiny dims (d 64)": dict(dims=dict(vocab=64, seq=16, d_model=64, heads=4, layers=4, rows=2, m=4, v=2)),
    "v=1": dict(dims=dict(v=1)),
    "schedule 1f1b": dict(schedule="1f1b", dims=dict(v=1)),
    "no tensor (pipe2 x data4)": dict(axes=dict(pipe=2, data=4)),
    "m=2": dict(dims=dict(m=2)),
    "remat none": dict(remat="none"),
    # candidate workarounds, patched into the runtime in the child (see patch())
    "patch: ring after the tick": dict(patch="serialize"),
    "patch: one scan per stretch": dict(patch="split_scans"),
    "patch: both": dict(patch="serialize+split_scans"),
    "end with bf16 wire": dict(grad_sync="end", grad_sync_dtype="bf16"),
    "patch: ring gather by psum": dict(patch="gather_psum"),
}


def patch(which: str) -> None:
    """Runtime changes tried as workarounds: ``serialize``: the ring's collectives tied after
    each tick's (what XLA:CPU gets); ``split_scans``: the tick loop cut into one scan per
    stretch between sync points (what fsdp-sharded weights get) instead of one scan with
    the ring's steps in conditionals; ``gather_psum``: the ring's all-gather as a ``psum``
    of each device's piece placed in zeros. (A ring whose gather is dropped compiles only
    because its unused result makes the whole ring dead code: no such variant here.)"""
    import jax.numpy as jnp
    from jax import lax

    from mindpipe_jax.parallel.pipeline.runtime import grads, ringsync, tickloop

    if "gather" in which:
        def gather_step(self, state, b):
            print(f"patched: gather_step {which}", flush=True)
            me = lax.axis_index(self.axes)
            pieces = lax.dynamic_index_in_dim(state["parts"], b, 0, keepdims=False)
            mine = lax.dynamic_index_in_dim(pieces, (me + 1) % self.d, 0, keepdims=False)
            placed = jnp.zeros((self.d, self.piece), jnp.float32).at[(me + 1) % self.d].set(mine)
            whole = lax.psum(placed, self.axes)  # invariant over the ring's axes, as all_gather's
            return {**state, "out": lax.dynamic_update_index_in_dim(state["out"], whole, b, 0)}
        ringsync.RingSync.gather_step = gather_step
    if "split_scans" in which:
        def one_scan(tick, carry, num_ticks, points, **kw):
            print("patched: _split_scans", flush=True)
            return tickloop._split_scans(tick, carry, num_ticks, points, owned=tickloop.OwnedShards(), **kw)
        tickloop._one_scan = one_scan
    if "serialize" in which:
        plain = grads.run_ticks_with_sync

        def serialized(*args, **kw):
            print("patched: serialize_ring", flush=True)
            return plain(*args, **dict(kw, serialize_ring=True))
        grads.run_ticks_with_sync = serialized


def merged(change: dict) -> dict:
    out = dict(BASE, **{k: v for k, v in change.items() if k != "dims"})
    out["dims"] = dict(BASE["dims"], **change.get("dims", {}))
    if "axes" in change:
        out["axes"] = change["axes"]
    return out


def child(spec: dict, smoke: bool, keep: str | None) -> None:
    import jax

    if smoke:
        jax.config.update("jax_num_cpu_devices", 8)
        jax.config.update("jax_platforms", "cpu")
    else:
        jax.config.update("jax_mock_gpu_topology", "1x8x1")
    from mindpipe_jax.parallel.pipeline.runtime import grads
    from mindpipe_jax.sim.program_bytes import compile_pipeline_step

    grads.CHUNK_RING_CRASHES_XLA_GPU_FROM = None  # compile the ring even where it crashed: re-checks it
    if spec.get("patch"):
        patch(spec["patch"])
    d = spec["dims"]
    compiled, mesh, _ = compile_pipeline_step(d, spec["axes"], spec["schedule"], d["m"], d["v"],
                                              grad_sync=spec["grad_sync"], dtype=spec["dtype"],
                                              grad_sync_dtype=spec.get("grad_sync_dtype", "fp32"),
                                              remat=spec["remat"], abstract=True)
    if keep:  # the compiled program, with its mesh on the first line (hlo_checks.py --read)
        import numpy as np

        ids = np.vectorize(lambda dev: dev.id)(mesh.devices).tolist()
        name = "".join(ch if ch.isalnum() else "-" for ch in spec["name"]).strip("-")
        mesh_json = json.dumps(dict(names=list(mesh.axis_names), ids=ids))
        (Path(keep) / f"variant-{name}.hlo.txt").write_text(f"// MESH-JSON {mesh_json}\n{compiled.as_text()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--timeout", type=float, default=40.0)
    ap.add_argument("--only", default=None, help="comma-separated variant names")
    ap.add_argument("--keep", default=None, help="write each compiled program into this folder")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child), args.smoke, args.keep)
        return
    names = args.only.split(",") if args.only else list(VARIANTS)
    for name in names:
        spec = dict(merged(VARIANTS[name]), name=name)
        flags = [] if args.smoke else ["--xla_gpu_autotune_level=0"]
        import os

        env = dict(os.environ, XLA_FLAGS=" ".join([os.environ.get("XLA_FLAGS", "")] + flags))
        cmd = [sys.executable, __file__, "--child", json.dumps(spec)] + (["--smoke"] if args.smoke else [])
        cmd += ["--keep", args.keep] if args.keep else []
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
            rc, err = proc.returncode, (proc.stdout + proc.stderr).strip().splitlines()
        except subprocess.TimeoutExpired:
            rc, err = "timeout", []
        why = next((ln for ln in reversed(err) if "Error" in ln or "error" in ln or "Fatal" in ln), "")
        why = " ".join(ln for ln in err if ln.startswith("patched:")) + " " + why
        result = "compiles" if rc == 0 else f"FAILS (exit {rc})"
        print(f"{name:28s} {result:18s} {time.perf_counter() - t0:5.1f} s  {why[:200]}", flush=True)


if __name__ == "__main__":
    main()
