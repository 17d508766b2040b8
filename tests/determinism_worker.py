"""Train a tiny GPT on N simulated CPU devices and save its final params to .npz.

Usage: ``python determinism_worker.py N OUT.npz [MODES]`` where MODES is a
comma-separated list of ``det`` (train.deterministic=true) and ``plain``
(train.deterministic=false); default ``det``. Each mode's params are stored
under keys ``"<mode>/<keystr path>"``.

Run by ``tests/test_determinism.py`` in a fresh process per device count,
because ``jax_num_cpu_devices`` must be set before JAX creates its backend.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402

if __name__ == "__main__":
    # Before anything else touches JAX: the backend reads this once.
    jax.config.update("jax_num_cpu_devices", int(sys.argv[1]))

import tempfile  # noqa: E402

import numpy as np  # noqa: E402

import mindpipe_jax as mp  # noqa: E402

TINY = (
    "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.seq_len=32",
    "model.dropout=0.1",  # exercises the per-shard dropout keys too
    'data.source="synthetic"', "data.synthetic_tokens=65536",
    "train.steps=3", "train.global_batch=16", "train.eval_every=0", "train.log_every=1",
    "train.progress=false", "train.tensorboard=false", "train.checkpoint_every=0",
    "train.virtual_shards=8",
    "optim.warmup_steps=0",
    "parallel.simulate_cpu_devices=0",
)


def host_params(state) -> dict[str, np.ndarray]:
    flat, _ = jax.tree_util.tree_flatten_with_path(state["params"])
    return {jax.tree_util.keystr(path): np.asarray(jax.device_get(leaf)) for path, leaf in flat}


def run(n: int, deterministic: bool, out_dir: str, *extra: str) -> dict[str, np.ndarray]:
    cfg = mp.Config().replace(*TINY, f"parallel.data={n}",
                              f"train.deterministic={'true' if deterministic else 'false'}",
                              f'train.out_dir="{out_dir}"', *extra)
    result = mp.train(config=cfg)
    return host_params(result.state)


def main() -> None:
    n, out = int(sys.argv[1]), sys.argv[2]
    modes = (sys.argv[3] if len(sys.argv) > 3 else "det").split(",")
    assert len(jax.devices()) == n, (jax.devices(), n)
    arrays = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            if mode not in ("det", "plain"):
                raise SystemExit(f"unknown mode {mode!r}; valid: det, plain")
            params = run(n, mode == "det", os.path.join(tmp, mode))
            arrays.update({f"{mode}/{k}": v for k, v in params.items()})
    np.savez(out, **arrays)


if __name__ == "__main__":
    main()
