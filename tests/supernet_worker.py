"""Train the tiny supernet on N simulated CPU devices, every subnet x data split, and save it.

Usage: ``python supernet_worker.py N OUT.npz``. For each semantics (sync, causal)
and each split ``parallel.subnet=S, parallel.data=N/S`` (S = 1, 2, 4, ... N) the
worker runs ``train_supernet`` for ``STEPS`` steps and stores the final params
under ``"<semantics>/S<S>/<path>"``. One split (``SEARCH_SPLIT``) of the sync runs also
runs the evolutionary search and stores its top-k subnets and scores under
``"sync/search/subnets"`` / ``"sync/search/losses"``. On one device it also trains
with ``vmap_width=2`` (``"control/vmap2/<path>"``): the bits depend on that
width, which is what makes a bitwise comparison meaningful. The subnets the
sampler drew are stored under ``"sampler"``.

``tests/test_supernet_determinism.py`` runs one worker per device count, because
``jax_num_cpu_devices`` must be set before JAX creates its backend.
"""

import sys

import jax

if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", int(sys.argv[1]))

import numpy as np  # noqa: E402

import mindpipe_jax as mp  # noqa: E402
from mindpipe_jax.supernet import sample_subnets, train_supernet  # noqa: E402

STEPS = 2
# The split whose run also searches, per device count: data-split, mixed and subnet-split
# evaluators all take part in the top-k comparison.
SEARCH_SPLIT = {1: 1, 2: 1, 4: 2, 8: 8}
K = 8  # subnets per step: divisible by every subnet axis size up to 8 (vmap_width 1)
TINY = (
    "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.seq_len=32",
    'data.source="synthetic"', "data.synthetic_tokens=65536",
    f"train.steps={STEPS}", "train.global_batch=16", "train.virtual_shards=8", "train.log_every=1",
    "optim.warmup_steps=0", "optim.clip_norm=0.5",  # clipping acts: grad norms are ~0.5-0.6 here
    "parallel.tensor=1", "parallel.simulate_cpu_devices=0",
    f"supernet.subnets_per_step={K}", "supernet.strategy=sandwich", "supernet.vmap_width=1",
    "supernet.ffn_ratios=[0.25, 0.5, 1.0]",
    "supernet.search_population=6", "supernet.search_generations=1", "supernet.search_top_k=3",
    "supernet.search_eval_batches=2",
)


def config(semantics: str, subnet: int, data: int, *extra: str):
    return mp.Config().replace(*TINY, f"supernet.semantics={semantics}", f"parallel.subnet={subnet}",
                               f"parallel.data={data}", *extra)


def host_params(state) -> dict[str, np.ndarray]:
    flat, _ = jax.tree_util.tree_flatten_with_path(state["params"])
    return {jax.tree_util.keystr(path): np.asarray(jax.device_get(leaf)) for path, leaf in flat}


def main() -> None:
    n, out = int(sys.argv[1]), sys.argv[2]
    if len(jax.devices()) != n:
        raise SystemExit(f"asked for {n} CPU devices, JAX has {len(jax.devices())}")
    arrays = {}
    splits = [s for s in (1, 2, 4, 8) if s <= n]
    for semantics in ("sync", "causal"):
        for s in splits:
            first = s == SEARCH_SPLIT[n] and semantics == "sync"  # the search is the same code for both
            result = train_supernet(config=config(semantics, s, n // s), search=first, log=None)
            if dict(result.mesh.shape)["subnet"] != s or dict(result.mesh.shape)["data"] != n // s:
                raise SystemExit(f"mesh {dict(result.mesh.shape)} is not subnet={s} x data={n // s}")
            arrays.update({f"{semantics}/S{s}/{k}": v for k, v in host_params(result.state).items()})
            if first:
                top = result.search.top
                arrays[f"{semantics}/search/subnets"] = np.asarray([t["subnet"] for t in top], np.int32)
                arrays[f"{semantics}/search/losses"] = np.asarray([t["loss"] for t in top], np.float64)
    if n == 1:
        result = train_supernet(config=config("sync", 1, 1, "supernet.vmap_width=2"), search=False, log=None)
        arrays.update({f"control/vmap2/{k}": v for k, v in host_params(result.state).items()})
    space = result.spec.space
    arrays["sampler"] = np.stack([sample_subnets(space, 0, t, K, "sandwich") for t in range(STEPS)])
    np.savez(out, **arrays)


if __name__ == "__main__":
    main()
