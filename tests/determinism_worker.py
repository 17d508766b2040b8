"""Train a tiny GPT on N simulated CPU devices and save its final params to .npz.

Usage: ``python determinism_worker.py N OUT.npz [MODES]``. MODES is a
comma-separated list of ``det`` (``train.deterministic=true``), ``plain``
(``train.deterministic=false``), ``det-fsdp`` (deterministic, ``parallel.data=2``
and ``parallel.fsdp=N/2``: parameters stored in shards), ``det-pipe`` / ``plain-pipe``
(a 1F1B pipeline of 2 stages, ``parallel.data=N/2``, each virtual shard one
microbatch, its dropout keys those of the virtual shards), default ``det``; each mode's
final params are
stored under ``"<mode>/<keystr path>"``, gathered to the host, and its logged
losses and gradient norms (float64, one per step) under ``"history/<mode>/loss"`` and
``"history/<mode>/grad_norm"``.

``tests/test_determinism.py`` runs one of these per device count, because
``jax_num_cpu_devices`` must be set before JAX creates its backend.
"""

import os
import sys

import jax

if __name__ == "__main__":
    # Before anything touches a backend: the CPU client reads this once.
    jax.config.update("jax_num_cpu_devices", int(sys.argv[1]))

import tempfile  # noqa: E402

import numpy as np  # noqa: E402

import mindpipe_jax as mp  # noqa: E402

TINY = (
    "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.seq_len=32",
    "model.dropout=0.1",  # exercises the per-shard dropout keys
    'data.source="synthetic"', "data.synthetic_tokens=65536",
    "train.steps=3", "train.global_batch=16", "train.virtual_shards=8",
    "train.eval_every=0", "train.log_every=1", "train.checkpoint_every=0",
    "train.progress=false", "train.tensorboard=false",
    "optim.warmup_steps=0",  # a non-zero lr from step 1
    "optim.clip_norm=0.05",  # grad_norm is ~0.5-0.7 here: clipping acts on every step
    "parallel.tensor=1", "parallel.simulate_cpu_devices=0",  # train must not change our device count
)


MODES = ("det", "plain", "det-fsdp", "det-pipe", "plain-pipe")


def train_tiny(data: int, deterministic: bool, out_dir: str, *extra: str):
    """``mindpipe_jax.train`` on the tiny config with ``parallel.data=data`` (+ overrides)."""
    cfg = mp.Config().replace(*TINY, f"parallel.data={data}",
                              f"train.deterministic={'true' if deterministic else 'false'}",
                              f'train.out_dir="{out_dir}"', *extra)
    return mp.train(config=cfg)


def host_params(state) -> dict[str, np.ndarray]:
    """Every parameter leaf, gathered to a host NumPy array, keyed by its tree path."""
    flat, _ = jax.tree_util.tree_flatten_with_path(state["params"])
    return {jax.tree_util.keystr(path): np.asarray(jax.device_get(leaf)) for path, leaf in flat}


def main() -> None:
    n, out = int(sys.argv[1]), sys.argv[2]
    modes = (sys.argv[3] if len(sys.argv) > 3 else "det").split(",")
    if bad := [m for m in modes if m not in MODES]:
        raise SystemExit(f"unknown mode(s) {bad}; valid: {', '.join(MODES)}")
    if len(jax.devices()) != n:
        raise SystemExit(f"asked for {n} CPU devices, JAX has {len(jax.devices())}")
    arrays = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            if mode == "det-fsdp":
                result = train_tiny(2, True, os.path.join(tmp, mode), f"parallel.fsdp={n // 2}")
                if result.mesh.shape["fsdp"] != n // 2:
                    raise SystemExit(f"mesh {dict(result.mesh.shape)} does not have fsdp={n // 2}")
                # Really stored in shards (else the test compares data=N with itself).
                if not any("fsdp" in str(p.sharding.spec) for p in jax.tree.leaves(result.state["params"])):
                    raise SystemExit("det-fsdp: no parameter is sharded over fsdp")
            elif mode.endswith("-pipe"):
                # Each device's virtual shards are its microbatches: 8 / (N / 2) of them.
                result = train_tiny(n // 2, mode == "det-pipe", os.path.join(tmp, mode), "parallel.pipe=2",
                                    f"parallel.microbatches={16 // n}")
                if result.mesh.shape["pipe"] != 2:
                    raise SystemExit(f"mesh {dict(result.mesh.shape)} does not have pipe=2")
            else:
                result = train_tiny(n, mode == "det", os.path.join(tmp, mode))
                if result.mesh.shape["data"] != n:
                    raise SystemExit(f"mesh {dict(result.mesh.shape)} does not have data={n}")
            arrays.update({f"{mode}/{k}": v for k, v in host_params(result.state).items()})
            for key in ("loss", "grad_norm"):
                arrays[f"history/{mode}/{key}"] = np.asarray([h[key] for h in result.history], np.float64)
    np.savez(out, **arrays)


if __name__ == "__main__":
    main()
