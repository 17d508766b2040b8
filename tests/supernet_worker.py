"""Train the tiny supernet on N simulated CPU devices, every subnet x data split, and save it.

Usage: ``python supernet_worker.py N OUT.npz``. For each semantics (sync, sequential,
operator-causal) and each of its splits ``parallel.subnet=S, parallel.data=N/S`` on N
devices (``SPLITS``) the worker runs ``train_supernet`` on the **sliced** path (the
default) for ``STEPS`` steps and stores the final params under
``"sliced/<semantics>/S<S>/<path>"``. The masked path
(``supernet.ladder_levels=0``) runs on fewer configurations, to keep the cost down
(``MASKED_SPLIT``: sync on 1 device and on subnet=4 x data=2), under
``"masked/<semantics>/S<S>/<path>"``. One split (``SEARCH_SPLIT``) of the sliced
sync runs also runs the evolutionary search and stores its top-k subnets and scores
under ``"search/subnets"`` / ``"search/losses"``. On one device it also trains sliced
with ``vmap_width=2`` (``"control/vmap2/<path>"``): the bits depend on that width,
which is what makes a bitwise comparison meaningful. The subnets the sampler drew
are stored under ``"sampler"``, and per run the path the trainer reported and the
programs XLA compiled under ``"path/<run>"`` / ``"compiles/<run>"``.

The supernet (``factory``) keeps the sliced path to one program per step function and
still slices every dimension: 3 blocks of which subnets run 2, FFN widths 16 and 32
of d_ff 128, 1 of 2 heads, and a 1-level ladder: every subnet runs at the one shape
"2 blocks, width 32 (16 masked inside the slice), 1 head". Each sliced run compiles
its init program (shared by the runs of one mesh through this worker's compilation
cache), the step's start and finish, and that one round program. Causal waves have
unequal sizes, so their rounds are padded on wider subnet axes and some devices
compute only padding. (A second shape costs a second round program per run: ~2
CPU-seconds x 20 runs.)

``tests/test_supernet_determinism.py`` runs one worker per device count, because
``jax_num_cpu_devices`` must be set before JAX creates its backend.
"""

import resource
import sys

import jax

if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", int(sys.argv[1]))
    # A cache for this worker: the splits' runs of one mesh share their init program.
    jax.config.update("jax_compilation_cache_dir", sys.argv[2] + ".jax_cache")
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

import jax.monitoring  # noqa: E402
import numpy as np  # noqa: E402

import mindpipe_jax as mp  # noqa: E402
from mindpipe_jax.supernet import SuperGPT, sample_subnets, train_supernet  # noqa: E402

STEPS = 2
# The splits (subnet axis sizes) each semantics runs on N devices. sync, whose step the
# others build on, runs subnet axes 1, 2, 4 and 8 and data axes 1, 2, 4 and 8; sequential
# and operator-causal each run a pure subnet split, a pure data split and mixed ones
# across the device counts. (Every split of every count for every semantics: ~100 more
# CPU-seconds for combinations these already cover.)
SPLITS = {"sync": {1: (1,), 2: (1, 2), 4: (4,), 8: (1, 2, 8)},
          "sequential": {1: (1,), 2: (2,), 4: (1,), 8: (4,)},
          "operator-causal": {1: (1,), 2: (1,), 4: (2,), 8: (8,)}}
# The sync split whose run also searches, per device count: data-split, subnet-split and
# mixed evaluators all take part in the top-k comparison.
SEARCH_SPLIT = {1: 1, 2: 1, 4: 4, 8: 2}
# The masked path's runs (semantics -> {devices: subnet axis}): sync on 1 device (the
# reference) and on a mixed split of 8. (Each run costs as much as a sliced one; the
# masked step is unchanged by slicing and was checked on every split before it came;
# test_supernet checks both of its semantics against the sequential reference.)
MASKED_SPLIT = {"sync": {1: 1, 8: 4}}
# Layouts with fsdp and tensor (devices -> [(name, subnet, fsdp, tensor)], sync, sliced),
# stored under "layout/<name>/": fsdp splits the batch as data does (the bits of subnet x
# data); tensor splits the matmuls (bits of their own, the same on every split of the
# other devices for one tensor size).
# One run per worker (the 8-device worker is the fixture's slowest): fsdp on 4 devices
# against 1 device, tensor=2 on 2 devices against 8.
LAYOUTS = {1: [], 2: [("T2", 1, 1, 2)], 4: [("S2F2", 2, 2, 1)], 8: [("S2F2T2", 2, 2, 2)]}
LADDER = 1  # sizes per ladder: the widths 16 and 32 both run at 32
SHAPE = ((32, 1), (32, 1))  # what every subnet runs at: (FFN width, heads) per block
K = 8  # subnets per step: divisible by every subnet axis size up to 8 (vmap_width 1)
TINY = (
    "model.d_model=32", "model.n_layers=3", "model.n_heads=2", "model.seq_len=32",
    'data.source="synthetic"', "data.synthetic_tokens=65536",
    f"train.steps={STEPS}", "train.global_batch=16", "train.virtual_shards=8", "train.log_every=1",
    "optim.warmup_steps=0", "optim.clip_norm=0.5",  # clipping acts: grad norms are ~0.5-0.6 here
    "parallel.tensor=1", "parallel.simulate_cpu_devices=0",
    f"supernet.subnets_per_step={K}", "supernet.strategy=sandwich", "supernet.vmap_width=1",
    f"supernet.ladder_levels={LADDER}",
    "supernet.search_population=6", "supernet.search_generations=1", "supernet.search_top_k=3",
    "supernet.search_eval_batches=2",
)


def factory(model_config):
    return lambda rngs: SuperGPT(model_config, ops=("gelu", "relu", "silu"), ffn_widths=(16, 32), heads=(1,),
                                 depths=(2,), rngs=rngs)


def config(semantics: str, subnet: int, data: int, *extra: str):
    return mp.Config().replace(*TINY, f"supernet.semantics={semantics}", f"parallel.subnet={subnet}",
                               f"parallel.data={data}", *extra)


def host_params(state) -> dict[str, np.ndarray]:
    flat, _ = jax.tree_util.tree_flatten_with_path(state["params"])
    return {jax.tree_util.keystr(path): np.asarray(jax.device_get(leaf)) for path, leaf in flat}


_compiles = [0]


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _count(name, _secs, **_):
    if name == "/jax/core/compile/backend_compile_duration":
        _compiles[0] += 1


def run(arrays, key, n, semantics, s, *extra, search=False, fsdp=1, tensor=1):
    """Train one configuration; its params go under ``key/``."""
    lines, before, cpu = [], _compiles[0], _cpu_s()
    data = n // (s * fsdp * tensor)
    cfg = config(semantics, s, data, f"parallel.fsdp={fsdp}", f"parallel.tensor={tensor}", *extra)
    result = train_supernet(factory(cfg.model), config=cfg, search=search, log=lines.append)
    want = {"subnet": s, "fsdp": fsdp, "data": data, "tensor": tensor}
    if any(dict(result.mesh.shape)[a] != size for a, size in want.items()):
        raise SystemExit(f"mesh {dict(result.mesh.shape)} is not {want}")
    arrays.update({f"{key}/{k}": v for k, v in host_params(result.state).items()})
    header = lines[0]  # "supernet: ... | sliced (...)" or "... | masked, compiled in ..."
    arrays[f"path/{key}"] = np.asarray("sliced" if "| sliced (" in header else
                                       "masked" if "| masked," in header else header)
    arrays[f"compiles/{key}"] = np.asarray(_compiles[0] - before)
    print(f"{key}: {_compiles[0] - before} programs compiled, {_cpu_s() - cpu:.1f} CPU-s | "
          f"{header.split(' | ')[-1]}", flush=True)
    return result


def main() -> None:
    n, out = int(sys.argv[1]), sys.argv[2]
    if len(jax.devices()) != n:
        raise SystemExit(f"asked for {n} CPU devices, JAX has {len(jax.devices())}")
    jax.monitoring.register_event_duration_secs_listener(_count)
    arrays = {}
    for semantics, splits in SPLITS.items():
        for s in splits[n]:
            search = s == SEARCH_SPLIT[n] and semantics == "sync"  # the search is the same code for both
            result = run(arrays, f"sliced/{semantics}/S{s}", n, semantics, s, search=search)
            if search:
                top = result.search.top
                arrays["search/subnets"] = np.asarray([t["subnet"] for t in top], np.int32)
                arrays["search/losses"] = np.asarray([t["loss"] for t in top], np.float64)
        if n in MASKED_SPLIT.get(semantics, {}):
            s = MASKED_SPLIT[semantics][n]
            run(arrays, f"masked/{semantics}/S{s}", n, semantics, s, "supernet.ladder_levels=0")
    for name, s, fsdp, tensor in LAYOUTS[n]:
        run(arrays, f"layout/{name}", n, "sync", s, fsdp=fsdp, tensor=tensor)
    if n == 1:
        run(arrays, "control/vmap2", 1, "sync", 1, "supernet.vmap_width=2")
    space = result.spec.space
    arrays["sampler"] = np.stack([sample_subnets(space, 0, t, K, "sandwich") for t in range(STEPS)])
    arrays["shapes"] = np.asarray(sorted({result.spec.module.sliced_shape(sub, LADDER)
                                          for sub in arrays["sampler"].reshape(-1, space.num_genes)}))
    print(f"{_compiles[0]} programs compiled in all, {_cpu_s():.1f} CPU-s", flush=True)
    np.savez(out, **arrays)


if __name__ == "__main__":
    main()
