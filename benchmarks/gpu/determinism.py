"""SPara's bits on a GPU: the same steps in two fresh processes give the same parameters.

    python benchmarks/gpu/determinism.py --write /tmp/a.json     # process 1
    python benchmarks/gpu/determinism.py --compare /tmp/a.json   # process 2: each compiles anew

Five SPara ``sync`` steps (masked SuperGPT d_model 256, 2 blocks, seq 128; K = 8 subnets a
step from the sandwich sampler with fixed seeds, all 8 vectorized on the one device,
``vmap_width`` 8; global batch 8) from the same initial parameters, in two processes:
each compiles its own program (GPU autotuning runs again) and the state's every leaf is
hashed. SPara's sums run in a fixed order and its selection has no scatter, so the two
must agree bit for bit; the printed line says EQUAL or lists the leaves that differ.
``--smoke``: d_model 32, seq 16 (checks the script on a CPU).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def run(smoke: bool) -> dict:
    import jax
    import numpy as np

    from mindpipe_jax.config import ModelConfig, OptimConfig, ParallelConfig
    from mindpipe_jax.parallel.mesh import make_mesh
    from mindpipe_jax.supernet import SuperGPT, sample_subnets, spara

    d, seq, k, batch = (32, 16, 8, 8) if smoke else (256, 128, 8, 8)
    cfg = ModelConfig(d_model=d, n_layers=2, n_heads=4, seq_len=seq)
    spec, create = spara.supernet_spec(lambda r: SuperGPT(cfg, rngs=r))
    mesh = make_mesh(ParallelConfig(subnet=1, data=1, tensor=1), devices=jax.devices()[:1])
    optim = OptimConfig(lr=3e-3, warmup_steps=0, clip_norm=1.0)
    made = spara.make_spara_step(spec, mesh, semantics="sync", subnets_per_step=k, vmap_width=k,
                                 virtual_shards=1, global_batch=batch, optim=optim, total_steps=100)
    step = spara.jit_step(made, mesh, spec)
    shardings = spara.state_shardings(mesh, spec)
    state = jax.jit(lambda: spara.init_state(spec, create()), out_shardings=shardings)()
    rng = np.random.default_rng(0)
    losses = []
    with jax.set_mesh(mesh):
        for t in range(5):
            toks = rng.integers(0, 256, (batch, seq + 1)).astype(np.int32)
            plan = spara.plan_step(spec, sample_subnets(spec.space, 0, t, k, "sandwich"), "sync", k).arrays()
            state, metrics = step(state, plan, {"inputs": toks[:, :-1], "targets": toks[:, 1:]})
            losses.append(np.asarray(metrics["loss"]).tolist())
    leaves = jax.tree_util.tree_flatten_with_path(jax.device_get(state))[0]
    digest = {jax.tree_util.keystr(p): hashlib.sha256(np.asarray(x).tobytes()).hexdigest() for p, x in leaves}
    return {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "leaves": digest,
            "losses": losses}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", help="save this process's hashes here")
    ap.add_argument("--compare", help="compare this process's hashes with a saved run")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    got = run(args.smoke)
    print(f"{got['device']}, jax {got['jax']}: {len(got['leaves'])} leaves hashed; losses of step 5: "
          f"{[round(x, 4) for x in got['losses'][-1]]}")
    if args.write:
        Path(args.write).write_text(json.dumps(got))
    if args.compare:
        ref = json.loads(Path(args.compare).read_text())
        differ = [k for k in ref["leaves"] if ref["leaves"][k] != got["leaves"].get(k)]
        same_loss = ref["losses"] == got["losses"]
        verdict = "EQUAL" if not differ and same_loss else "DIFFERENT"
        print(f"two processes, 5 SPara steps each: {verdict} ({len(ref['leaves']) - len(differ)} of "
              f"{len(ref['leaves'])} leaves bitwise equal; losses {'equal' if same_loss else 'differ'})"
              + (f"; differing: {differ[:8]}" if differ else ""))


if __name__ == "__main__":
    main()
