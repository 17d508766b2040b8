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

__all__ = ["grad_bytes_per_element", "measure_grad_bytes_per_element", "compile_pipeline_step", "BYTES_DIMS"]


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
    d = dict(BYTES_DIMS, **(dims or {}))
    compiled, mesh, params = compile_pipeline_step(
        d, dict(pipe=2, data=2, tensor=2), "afapab", d["m"], d["v"], grad_sync=grad_sync,
        grad_sync_dtype=grad_sync_dtype)
    return compiled.as_text(), mesh, params


def compile_pipeline_step(dims: dict, axes: dict, schedule: str, m: int, v: int = 1, *, remat: str = "full",
                          grad_sync: str = "end", grad_sync_dtype: str = "fp32", dtype: str = "float32",
                          abstract: bool = False):
    """``(compiled, mesh, params)``: the pipeline train step of a reference GPT of ``dims``
    (``BYTES_DIMS``' keys) on a mesh of ``axes`` (e.g. ``{"pipe": 2, "data": 2, "tensor":
    2}``, over all of JAX's devices), ``schedule`` with ``m`` microbatches of ``dims["rows"]``
    rows per data rank, weights sharded as training stores them. ``abstract``: the
    parameters are shapes only (nothing is allocated: a model of any size compiles, e.g.
    for a mock topology of GPUs this machine does not have), and ``params`` is those shapes."""
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

    n = math.prod(axes.values())
    if jax.device_count() != n:
        raise ConfigError(f"the pipeline program compiles for {n} devices ({axes}), JAX has "
                          f"{jax.device_count()} (on the CPU set jax_num_cpu_devices before JAX starts)")
    cfg = ModelConfig(vocab_size=dims["vocab"], seq_len=dims["seq"], d_model=dims["d_model"],
                      n_layers=dims["layers"], n_heads=dims["heads"], dtype=dtype)
    make = lambda: GPT(cfg, rngs=nnx.Rngs(0))  # noqa: E731
    model = nnx.eval_shape(make) if abstract else make()
    mesh = make_mesh(ParallelConfig(**axes, simulate_cpu_devices=0))
    storage = nnx.to_pure_dict(state_shardings(nnx.state(model, nnx.Param), mesh, "storage"))
    values = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    if abstract:
        params = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), values,
                              storage)
    else:
        params = jax.device_put(values, storage)
    data = axes.get("data", 1) * axes.get("fsdp", 1)
    tokens = jax.ShapeDtypeStruct((m, data * dims["rows"], dims["seq"]), np.int32)
    sched = get_schedule(schedule, axes["pipe"], m, v)
    run = pipeline_grads(stage_fns(model), sched, mesh, remat=remat, grad_sync=grad_sync,
                         grad_sync_dtype=grad_sync_dtype, param_specs=storage)
    with jax.set_mesh(mesh):
        compiled = jax.jit(run).lower(params["embed"], params["blocks"], params["head"], tokens,
                                      tokens).compile()
    return compiled, mesh, params


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
