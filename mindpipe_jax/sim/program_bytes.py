"""The gradient bytes per parameter a compiled training program puts on the data axis,
for the cluster prediction (``sim/cluster.py``) to use instead of an assumption.

``grad_bytes_per_element(hlo, ...)`` reads a compiled program's collectives with
``parallel/collectives.py``, keeps those whose groups span only the batch axes
(the data-parallel gradient sync: ``end``'s all-reduces, ``chunk``'s ring
permutes and all-gathers, bf16's all-to-alls), sums the bytes one device sends
per step, and divides by what a ring all-reduce of one element per gradient
element would send: ``elements x 2 (d - 1) / d`` (``d``: the batch ranks; at
``d = 2`` this is plain bytes sent / elements). ``elements`` are the gradient
elements the device syncs: its own shards (its pipeline stage's layers, its
tensor shard of each leaf) plus the embed and head leaves it holds. So the
figure is the wire's bytes per gradient element: 4 for fp32, 2 for bf16, plus
what else rides on the axis (the loss, a scalar).

``measure_grad_bytes_per_element(grad_sync_dtype, ...)`` compiles a small
pipe2 x data2 x tensor2 pipeline step (the reference GPT, weights stored sharded
as training stores them, as ``benchmarks/afapab.py`` part 0 does) and applies
the above. It needs JAX with 8 devices (on the CPU: ``jax_num_cpu_devices=8``
set before JAX starts); JAX is imported inside it, so importing this module
stays pure Python like the rest of ``sim/``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from mindpipe_jax.errors import ConfigError

__all__ = ["grad_bytes_per_element", "measure_grad_bytes_per_element", "BYTES_DIMS"]


def grad_bytes_per_element(hlo: str, device_ids, axis_names: Iterable[str], grad_elements: int, *,
                           data_axes: Iterable[str] = ("data",), device: int = 0) -> float:
    """Bytes per gradient element that ``device`` sends on ``data_axes`` per call of the
    compiled program ``hlo`` (module docstring). ``device_ids``: the mesh's array of
    device ids; ``axis_names``: its axis names; ``grad_elements``: the gradient elements
    the device syncs."""
    import numpy as np

    from mindpipe_jax.parallel.collectives import axes_of, collectives

    names = tuple(axis_names)
    ids = np.asarray(device_ids)
    batch = frozenset(data_axes)
    unknown = batch - set(names)
    if unknown:
        raise ConfigError(f"data_axes {sorted(unknown)} are not axes of the mesh {names}")
    if isinstance(grad_elements, bool) or not isinstance(grad_elements, int) or grad_elements < 1:
        raise ConfigError(f"grad_elements must be an integer >= 1, got {grad_elements!r}")
    d = math.prod(ids.shape[names.index(a)] for a in batch)
    if d < 2:
        raise ConfigError(f"the batch axes {sorted(batch)} have {d} rank: nothing is synced over them")
    sent = sum(op.sent_by(device) * op.count for op in collectives(hlo)
               if (axes := axes_of(op, ids, names)) and axes <= batch)
    return sent / (grad_elements * 2 * (d - 1) / d)


# The small program: big enough that the loss scalar is noise (< 0.01 %), small enough
# to compile in seconds on two cores.
BYTES_DIMS = dict(vocab=64, seq=16, d_model=64, heads=4, layers=4, rows=2, m=4, v=2)


def compile_afapab_step(grad_sync: str = "chunk", grad_sync_dtype: str = "fp32", *,
                        dims: dict | None = None):
    """``(hlo text, mesh, params)`` of the compiled pipe2 x data2 x tensor2 AFAPAB step of a
    small GPT (``dims``: ``BYTES_DIMS``), weights sharded as training stores them."""
    import jax
    import numpy as np
    from flax import nnx

    from mindpipe_jax.config import ModelConfig, ParallelConfig
    from mindpipe_jax.models.gpt import GPT
    from mindpipe_jax.parallel.mesh import make_mesh
    from mindpipe_jax.parallel.pipeline import get_schedule
    from mindpipe_jax.parallel.pipeline.contract import stage_fns
    from mindpipe_jax.parallel.pipeline.runtime import pipeline_grads
    from mindpipe_jax.parallel.rules import state_shardings

    dims = dict(BYTES_DIMS, **(dims or {}))
    if jax.device_count() < 8:
        raise ConfigError(f"the AFAPAB bytes program compiles for 8 devices, JAX has "
                          f"{jax.device_count()} (on the CPU set jax_num_cpu_devices=8 before JAX starts)")
    cfg = ModelConfig(vocab_size=dims["vocab"], seq_len=dims["seq"], d_model=dims["d_model"],
                      n_layers=dims["layers"], n_heads=dims["heads"])
    model = GPT(cfg, rngs=nnx.Rngs(0))
    mesh = make_mesh(ParallelConfig(pipe=2, data=2, tensor=2, simulate_cpu_devices=0))
    storage = nnx.to_pure_dict(state_shardings(nnx.state(model, nnx.Param), mesh, "storage"))
    params = jax.device_put(nnx.to_pure_dict(nnx.state(model, nnx.Param)), storage)
    tokens = np.zeros((dims["m"], 2 * dims["rows"], dims["seq"]), np.int32)   # rows x data=2
    sched = get_schedule("afapab", 2, dims["m"], dims["v"])
    run = pipeline_grads(stage_fns(model), sched, mesh, remat="full", grad_sync=grad_sync,
                         grad_sync_dtype=grad_sync_dtype, param_specs=storage)
    with jax.set_mesh(mesh):
        hlo = jax.jit(run).lower(params["embed"], params["blocks"], params["head"], tokens,
                                 tokens).compile().as_text()
    return hlo, mesh, params


def measure_grad_bytes_per_element(grad_sync_dtype: str = "fp32", grad_sync: str = "chunk", *,
                                   dims: dict | None = None) -> dict:
    """Compile the pipe2 x data2 x tensor2 AFAPAB step (``dims``: ``BYTES_DIMS``) with
    ``grad_sync`` / ``grad_sync_dtype`` and return ``{"bytes_per_element", "bytes_sent",
    "grad_elements", "data_ranks"}`` for device 0."""
    import jax
    import numpy as np

    hlo, mesh, params = compile_afapab_step(grad_sync, grad_sync_dtype, dims=dims)
    device = mesh.devices.reshape(-1)[0]
    # the gradient elements device 0 holds: its shard of every leaf (its stage's layers,
    # its tensor shard), embed and head included (each pipe rank syncs them over data)
    elements = sum(shard.data.size for leaf in jax.tree.leaves(params)
                   for shard in leaf.addressable_shards if shard.device == device)
    ids = np.vectorize(lambda dev: dev.id)(mesh.devices)
    per = grad_bytes_per_element(hlo, ids, mesh.axis_names, int(elements), device=device.id)
    d = mesh.shape["data"]
    return dict(bytes_per_element=per, bytes_sent=per * elements * 2 * (d - 1) / d,
                grad_elements=int(elements), data_ranks=d)
