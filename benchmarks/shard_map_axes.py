"""Compile time of the pipelined step: size-1 mesh axes manual in its ``shard_map``, or not.

The pipeline runtime's ``shard_map`` (and SPara's, and the deterministic step's) makes
the pipe and batch axes manual and leaves the rest to the compiler. Where those other
axes have size 1 (``tensor=1``, ``expert=1``: most layouts), the mesh inside is still
mixed manual/automatic, and JAX 0.10 then wraps the result of nearly every op it lowers
in an all-open sharding constraint. ``parallel.mesh.manual_axis_names`` makes size-1
axes manual too: the same computation, a smaller program.

Printed per layout, for the grad function of the train step (``train/step.make_grad_fn``
on the built-in GPT, lowered and compiled from scratch each time, the two variants
round-robin): StableHLO lines, sharding constraints in it, and the median lower+compile
seconds over ``--repeats`` with (max - min) / median, then the ratio. The old variant is
the same code with ``manual_axis_names`` returning only the named axes (patched here).

Usage: ``python benchmarks/shard_map_axes.py [--repeats 3] [--out FILE]``.
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

from mindpipe_jax.config import Config  # noqa: E402
from mindpipe_jax.models import build_model  # noqa: E402
from mindpipe_jax.parallel import mesh as mesh_lib  # noqa: E402
from mindpipe_jax.parallel.mesh import make_mesh  # noqa: E402
from mindpipe_jax.train.pipeline_storage import split_ends_over_pipe  # noqa: E402
from mindpipe_jax.train.state import model_spec  # noqa: E402
from mindpipe_jax.train.step import make_grad_fn  # noqa: E402

MODEL = ("model.d_model=64", "model.n_heads=4", "model.n_layers=8", "model.seq_len=32",
         "model.vocab_size=256", "train.global_batch=16")
LAYOUTS = {
    "pipe4 x data2, 1f1b": ("parallel.pipe=4", "parallel.data=2", "parallel.microbatches=4",
                            "parallel.schedule=1f1b"),
    "pipe2 x data4, zbv": ("parallel.pipe=2", "parallel.data=4", "parallel.microbatches=4",
                           "parallel.schedule=zbv", "parallel.virtual_stages=2"),
    "pipe2 x fsdp4, 1f1b": ("parallel.pipe=2", "parallel.fsdp=4", "parallel.data=1",
                            "parallel.microbatches=4", "parallel.schedule=1f1b"),
    "data8, deterministic": ("parallel.data=8", "train.deterministic=true"),
}
REAL = mesh_lib.manual_axis_names


def _named_only(mesh, axes):  # the old behaviour: size-1 axes left automatic
    return set(axes)


def _patch(fn) -> None:
    """Every module that imported ``manual_axis_names`` sees ``fn``."""
    for module in list(sys.modules.values()):
        if getattr(module, "manual_axis_names", None) in (REAL, _named_only):
            module.manual_axis_names = fn


def _lower_compile(cfg: Config):
    mesh = make_mesh(cfg.parallel)
    with jax.set_mesh(None):
        spec, create = model_spec(lambda rngs: build_model(cfg.model, rngs), mesh, 0)
    spec = split_ends_over_pipe(spec, cfg.model.seq_len, mesh)
    params = jax.eval_shape(create)
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), params,
                          spec.storage)
    rows = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.model.seq_len), jax.numpy.int32)
    tokens = {"inputs": rows, "targets": rows}
    grad = jax.jit(make_grad_fn(spec, cfg, mesh))
    start = time.perf_counter()
    lowered = grad.lower(params, tokens, jax.random.key(0))
    lowered.compile()
    seconds = time.perf_counter() - start
    text = lowered.as_text()
    return seconds, text.count("\n"), text.count("sharding_constraint")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="also write the table to this file")
    args = parser.parse_args(argv)
    jax.config.update("jax_enable_compilation_cache", False)  # every compile from scratch
    lines = [f"{'layout':<22} {'variant':<16} {'stablehlo':>9} {'constraints':>11} {'compile s':>9} "
             f"{'spread':>7}"]
    for name, overrides in LAYOUTS.items():
        cfg = Config().replace(*MODEL, *overrides)
        times: dict[str, list[float]] = {"size-1 automatic": [], "size-1 manual": []}
        sizes = {}
        for _ in range(args.repeats):
            for variant, fn in (("size-1 automatic", _named_only), ("size-1 manual", REAL)):
                _patch(fn)
                jax.clear_caches()
                seconds, n_lines, n_constraints = _lower_compile(cfg)
                times[variant].append(seconds)
                sizes[variant] = (n_lines, n_constraints)
        _patch(REAL)
        medians = {}
        for variant, ts in times.items():
            med = medians[variant] = statistics.median(ts)
            n_lines, n_constraints = sizes[variant]
            lines.append(f"{name:<22} {variant:<16} {n_lines:>9} {n_constraints:>11} {med:>9.2f} "
                         f"{(max(ts) - min(ts)) / med:>7.0%}")
        lines.append(f"{name:<22} {'ratio':<16} {'':>9} {'':>11} "
                     f"{medians['size-1 manual'] / medians['size-1 automatic']:>9.2f}")
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
