"""Collective matmul: tensor-parallel communication split into ``ppermute`` steps
that can run while partial matmuls compute.

Where the communication is. Under the rules table (``parallel/rules.py``) the
GPT's activations between blocks are replicated over ``tensor`` (``length`` and
``embed`` map to no mesh axis) and each projection pair is Megatron's
column/row split: the first projection (``qkv``, ``w_in``) is sharded on its
output dimension, the second (``out``, ``w_out``) on its input dimension. XLA
then needs one all-reduce over ``tensor`` after each row-sharded projection in
the forward, and one after each column-sharded projection's input gradient in
the backward: four blocking all-reduces per block per step, each waiting for
the matmul before it and stalling the one after it.

The decomposition chosen. An all-reduce is a reduce-scatter followed by an
all-gather, and both halves can be fused with a neighbouring matmul if the
activation is split over ``tensor`` by rows (sequence positions) in between --
Megatron's sequence parallelism (Korthikanti et al., 2022) and the collective
matmul of Wang et al. (2023). Inside a block, with the option on:

    x (replicated) ── scatter_rows ──> x_s (my T/p rows; a local slice, no transfer)
    LN1(x_s) ── all_gather_matmul(W_qkv) ──> qkv (all rows, my heads)      pattern 1
    attention (my heads)                                                   local
    y ── matmul_reduce_scatter(W_out) ──> x_s + attn (my rows)             pattern 2
    LN2 ── all_gather_matmul(W_in) ── gelu ── matmul_reduce_scatter(W_out)  patterns 1, 2
    x_s ── gather_rows ──> x (replicated again, the rules' layout)

* pattern 1, ``all_gather_matmul``: ``all_gather(x over rows) @ W_col`` in p
  steps around a ring; in step s a device multiplies the row chunk it holds while
  the ``ppermute`` that brings the next chunk is in flight;
* pattern 2, ``matmul_reduce_scatter``: ``reduce_scatter(h @ W_row)`` in p steps;
  in step s a device computes the partial product of the row chunk whose
  accumulator it is about to receive, while the previous accumulator travels.

Both are ``jax.custom_vjp`` functions with hand-written backward rings: the
backward of pattern 1 is pattern 2 (``dx = reduce_scatter(dy @ W^T)``, the weight
gradient from the gathered rows kept by the forward, which the plain path keeps
too), the backward of pattern 2 is pattern 1 (``dh = all_gather(dy) @ W^T``, the
weight gradient accumulated chunk by chunk as ``dy`` goes round). So the forward
and the backward each leave one transfer of a block un-hidden: ``gather_rows`` at
the end of the block in the forward and its transpose at the start in the
backward, an all-gather of the ``[B, T, d]`` residual stream -- a quarter of the
four all-reduces' volume. Hiding that one too needs the residual stream kept
split over rows *between* blocks (a ``length -> tensor`` rule for activations),
a change to the rules table and to every consumer of the hidden states, which
this option deliberately does not make: with it off or on the blocks take and
return the same layout, so it composes with the scan over layers and remat
unchanged.

Inside the pipeline (``parallel.pipe > 1``): the primitives nest in its
``shard_map`` and differentiate there under every remat policy. A
``collective-permute`` inside a conditional that only some devices take cannot be
matched on XLA:CPU (with stages on different branches the rings paired up wrongly
or hung), so the rings run only where the runtime runs its stages in lockstep
(``spmd.needs_lockstep``: always with ``tensor`` > 1): every device then runs every
task kind of a tick under ``cond``s whose predicate is the same on all devices, in
one fixed order, and keeps its own task's outputs, so every device issues every
ring step at the same place in the tick. The runtime says so while it traces its
stages (``stages_in_lockstep``); a stage traced in per-device branches refuses the
option (``refuse_in_pipeline``). The equation-level B/W split cannot replay the
rings' retyping of values inside their nested ``shard_map``s, so the train step
runs split-backward schedules (ZB-H1, ZB-V, DualPipeV) with B and W each forming the
whole vjp there (``pipeline_grads(split_backward=False)``).

Why ``custom_vjp`` around each ``shard_map``, and ``check_vma=False``. The
primitives run in the plain data x tensor step (``tensor`` automatic in a
``jit``) and must also nest inside a ``shard_map`` that is already manual over
the batch axes with ``tensor`` left automatic (the pipeline runtime's shape, or a
user's own step); so each is a ``shard_map`` manual over ``tensor`` only
(``axis_names={'tensor'}``). In JAX 0.10, differentiating a nested ``shard_map`` with ``check_vma=True``
gives its residuals a spec that names the *outer* manual axes (``nospec`` takes
the value's whole varying set), which Shardy then rejects ("operates on axis
'data' which is already bound by a parent"); with ``check_vma=False`` the
automatic transpose fails a cotangent-type check instead. A ``custom_vjp`` whose
forward and backward are each a ``shard_map`` never asks JAX to differentiate or
partially evaluate across a ``shard_map`` boundary with residuals; and
``check_vma=False`` makes the residual specs name ``tensor`` only when a remat
policy re-partitions the forward. The backward is written by hand anyway,
because that is where the overlap of the backward comes from.

XLA overlaps the ``ppermute`` of a step with that step's matmul only where
collectives are asynchronous (GPU with the latency-hiding scheduler; see
``benchmarks/gpu/xla_flags.sh``). XLA:CPU runs them one after another, so on the
CPU the option costs p small matmuls and p-1 transfers instead of one of each,
and saves the norms and adds that every device otherwise repeats on all rows.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from mindpipe_jax.errors import ConfigError
from mindpipe_jax.parallel.ring_specs import TENSOR, ring_specs, tensor_spec

__all__ = ["TENSOR", "tensor_size", "refuse_in_pipeline", "stages_in_lockstep", "tensor_spec", "rows_spec",
           "scatter_rows", "gather_rows", "all_gather_matmul", "matmul_reduce_scatter"]

ROWS = 1  # activations are [batch, length, ...]: rows are sequence positions


def tensor_size() -> int:
    """Size of the ``tensor`` axis that a collective matmul may split over here: 1
    without a mesh, or where ``tensor`` is already manual (nothing to nest)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or TENSOR not in mesh.axis_names:
        return 1
    if TENSOR in getattr(mesh, "manual_axes", ()):
        return 1
    return mesh.shape[TENSOR]


_LOCKSTEP = contextvars.ContextVar("pipeline_stages_in_lockstep", default=False)


@contextlib.contextmanager
def stages_in_lockstep(on: bool):
    """While the pipeline runtime traces its stages: whether every device runs every
    task of a tick in one order (the rings may live there) or per-device branches."""
    token = _LOCKSTEP.set(on)
    try:
        yield
    finally:
        _LOCKSTEP.reset(token)


def refuse_in_pipeline() -> None:
    """Refuse a collective matmul in a pipeline stage that runs in per-device branches
    (see the module docstring): its ring steps could not be matched across devices."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and "pipe" in getattr(mesh, "manual_axes", ()) and mesh.shape["pipe"] > 1 \
            and not _LOCKSTEP.get():
        raise ConfigError(
            f"model.collective_matmul=true needs the pipeline's stages run in lockstep "
            f"(parallel.pipe={mesh.shape['pipe']}): in per-device conditionals the collective matmul's "
            f"ppermutes cannot be matched across devices; leave pipeline_grads(lockstep=None) or set "
            f"model.collective_matmul=false")


def rows_spec(ndim: int) -> P:
    """``[batch, length, ...]`` split over ``tensor`` by rows (sequence positions)."""
    return P(None, TENSOR, *([None] * (ndim - 2)))


def _check_rows(x, p: int) -> int:
    rows = x.shape[ROWS]
    if rows % p:
        raise ConfigError(
            f"model.collective_matmul=true splits the sequence over parallel.tensor={p}, but the "
            f"sequence length {rows} is not divisible by it; make model.seq_len a multiple of {p} "
            f"or set model.collective_matmul=false")
    return rows // p


def _varying(x) -> frozenset:
    """The enclosing manual axes ``x`` varies over (empty outside a ``shard_map``)."""
    return frozenset(jax.typeof(x).manual_axis_type.varying)


def _retype(x, axes: frozenset):
    """``x`` typed as varying over exactly ``axes`` of the enclosing manual axes.

    Extra axes are summed away -- the cotangent of a value that is invariant over
    an axis is the sum of the per-device cotangents, what JAX's own transpose of
    ``pcast`` does -- and missing ones are cast to varying (no data moves).
    """
    extra = tuple(sorted(_varying(x) - axes))
    x = lax.psum(x, extra) if extra else x
    missing = tuple(sorted(axes - _varying(x)))
    return lax.pcast(x, missing, to="varying") if missing else x


def _smap(body, in_specs, out_specs):
    """``shard_map`` manual over ``tensor`` only, whose results vary over the same
    enclosing manual axes as its arguments.

    Batch axes stay automatic in the plain step and are already manual (the
    pipeline's ``shard_map``) there; ``check_vma=False`` (see the module docstring)
    types the results as varying over nothing, which inside the pipeline would be
    a lie that later autodiff turns into sums over ``pipe``/``data``. Retyping the
    results to the arguments' axes keeps the outer program's types true.
    """
    mapped = jax.shard_map(body, in_specs=in_specs, out_specs=out_specs,
                           axis_names={TENSOR}, check_vma=False)

    def call(*args):
        axes = frozenset().union(*(_varying(a) for a in jax.tree.leaves(args)))
        return jax.tree.map(lambda y: _retype(y, axes), mapped(*args))

    return call


def _ring():
    """(p, my index, permutation to the previous device, permutation to the next)."""
    p = lax.axis_size(TENSOR)
    to_prev = [(j, (j - 1) % p) for j in range(p)]
    to_next = [(j, (j + 1) % p) for j in range(p)]
    return p, lax.axis_index(TENSOR), to_prev, to_next


def _rows_of(x, chunk, size):
    return lax.dynamic_slice_in_dim(x, chunk * size, size, ROWS)


def _put_rows(buf, chunk, size, value):
    return lax.dynamic_update_slice_in_dim(buf, value.astype(buf.dtype), chunk * size, ROWS)


def _full_rows(chunk_value, p: int):
    shape = list(chunk_value.shape)
    shape[ROWS] *= p
    return jnp.zeros(shape, chunk_value.dtype)


class _Einsum:
    """A projection ``"<rows operand>,<weight>-><out>"`` and its two transposes.

    Written as einsums rather than found by ``jax.vjp`` inside the bodies: inside
    the pipeline, values in a ``check_vma=False`` body mix types with and without
    the outer manual axes, which autodiff there refuses. For a matmul-like einsum
    (each index in two of the three terms) the transposes are einsums again.
    """

    def __init__(self, equation: str):
        operands, out = equation.replace(" ", "").split("->")
        x, w = operands.split(",")
        for term in (x, w, out):
            if len(set(term)) != len(term):
                raise ValueError(f"{equation!r}: repeated index in {term!r}")
        for idx in set(x + w + out):
            if (idx in x) + (idx in w) + (idx in out) != 2:
                raise ValueError(f"{equation!r}: index {idx!r} must appear in exactly two terms")
        if len(x) < 2 or len(out) < 2 or x[ROWS] != out[ROWS] or x[ROWS] in w:
            raise ValueError(f"{equation!r}: axis {ROWS} (rows) of the first operand and of the "
                             f"result must be the same index, absent from the weight")
        self.equation, self.x, self.w, self.out = equation, x, w, out

    def __call__(self, x, w):
        return jnp.einsum(f"{self.x},{self.w}->{self.out}", x, w)

    def d_x(self, dy, w):
        return jnp.einsum(f"{self.out},{self.w}->{self.x}", dy, w)

    def d_w(self, x, dy):
        return jnp.einsum(f"{self.x},{self.out}->{self.w}", x, dy)


# ----------------------------------------------------------------------------
# Moving rows: the one exposed transfer per block (and its free transpose).
# ----------------------------------------------------------------------------


def scatter_rows(x):
    """Replicated ``[B, T, ...]`` -> this device's ``T/p`` rows (a local slice, no
    transfer); its transpose is ``gather_rows``."""
    return _moved(_scatter_rows, _gather_rows, x)


def gather_rows(xs):
    """Rows split over ``tensor`` -> replicated (an all-gather); its transpose is a
    local slice."""
    return _moved(_gather_rows, _scatter_rows, xs)


def _scatter_rows(x):
    size = _check_rows(x, tensor_size())
    body = lambda v: _rows_of(v, lax.axis_index(TENSOR), size)
    return _smap(body, P(), rows_spec(x.ndim))(x)


def _gather_rows(xs):
    body = lambda v: lax.all_gather(v, TENSOR, axis=ROWS, tiled=True)
    return _smap(body, rows_spec(xs.ndim), P())(xs)


def _moved(forward, transpose, x):
    axes = _varying(x)  # static: the cotangent must be typed as the primal

    @jax.custom_vjp
    def run(v):
        return forward(v)

    run.defvjp(lambda v: (forward(v), None), lambda _, g: (_retype(transpose(g), axes),))
    return run(x)


# ----------------------------------------------------------------------------
# Pattern 1: all_gather(x over rows) @ W_column.
# ----------------------------------------------------------------------------


def all_gather_matmul(equation: str, xs, w, w_names, out_names):
    """``einsum(equation, all_gather(xs over rows), w)`` as p ring steps, each
    step's matmul overlapping the ``ppermute`` of the next row chunk.

    ``xs``: rows split over ``tensor`` (``rows_spec``). ``w``: column-sharded, its
    logical axis names ``w_names`` mapping an output dimension to ``tensor``.
    Result: all rows, that dimension split over ``tensor`` (``out_names``). The
    backward runs the reduce-scatter ring of
    ``matmul_reduce_scatter`` for the input gradient; the weight gradient is one
    local einsum with the gathered rows the forward kept (the plain path keeps the
    same replicated rows).
    """
    mm = _Einsum(equation)
    w_spec, out_spec = ring_specs(mm, w_names, out_names, column=True)
    size = _check_rows(xs, tensor_size())
    x_spec = rows_spec(xs.ndim)

    def forward(v, wl):
        p, i, to_prev, _ = _ring()
        chunk, out, gathered = v, None, None
        for s in range(p):
            # Issue the transfer of the next chunk first: it does not depend on this
            # step's matmul, so an asynchronous collective runs underneath it.
            incoming = lax.ppermute(chunk, TENSOR, to_prev) if s < p - 1 else None
            y = mm(chunk, wl)
            c = (i + s) % p  # after s shifts to the previous device we hold chunk i+s
            out = _put_rows(_full_rows(y, p) if out is None else out, c, size, y)
            gathered = _put_rows(_full_rows(chunk, p) if gathered is None else gathered,
                                 c, size, chunk)
            chunk = incoming
        return out, gathered

    def backward(gathered, wl, dy):
        p, i, _, to_next = _ring()
        dw = mm.d_w(gathered, dy)
        part = lambda c: mm.d_x(_rows_of(dy, c, size), wl)
        # Reduce-scatter ring: the accumulator for chunk i-s-1 arrives while this
        # device computes its own contribution to it; after p-1 passes device i
        # holds the full input gradient of its own rows.
        acc = part((i - 1) % p)
        for s in range(1, p):
            acc = lax.ppermute(acc, TENSOR, to_next) + part((i - s - 1) % p)
        return acc, dw

    fwd_map = _smap(forward, (x_spec, w_spec), (out_spec, P()))
    bwd_map = _smap(backward, (P(), w_spec, out_spec), (x_spec, w_spec))
    x_axes = _varying(xs)

    @jax.custom_vjp
    def run(v, wl):
        return fwd_map(v, wl)[0]

    def run_fwd(v, wl):
        out, gathered = fwd_map(v, wl)
        return out, (gathered, wl)

    def run_bwd(res, dy):
        gathered, wl = res
        dx, dw = bwd_map(gathered, wl, dy)
        # Cotangents typed as their primals (the custom_vjp contract).
        return _retype(dx, x_axes), _retype(dw, _varying(wl))

    run.defvjp(run_fwd, run_bwd)
    return run(xs, w)


# ----------------------------------------------------------------------------
# Pattern 2: reduce_scatter(h @ W_row) over rows.
# ----------------------------------------------------------------------------


def matmul_reduce_scatter(equation: str, h, w, h_names, w_names):
    """``reduce_scatter(einsum(equation, h, w) over rows)`` as p ring steps: each
    device adds its partial product for one row chunk to the accumulator it
    receives and passes it on, so a step's partial product overlaps the previous
    step's ``ppermute``.

    ``h``: all rows, its contracted dimension split over ``tensor`` (logical
    names ``h_names``); ``w``: row-sharded on that dimension (``w_names``). Result: the summed product, rows
    split over ``tensor`` (``rows_spec``). The backward is the all-gather ring of
    ``all_gather_matmul`` on the output gradient, which also accumulates the
    weight gradient chunk by chunk as the gradient goes round.
    """
    mm = _Einsum(equation)
    w_spec, h_spec = ring_specs(mm, w_names, h_names, column=False)
    size = _check_rows(h, tensor_size())
    out_spec = rows_spec(len(mm.out))

    def forward(hl, wl):
        p, i, _, to_next = _ring()
        part = lambda c: mm(_rows_of(hl, c, size), wl)
        # The accumulator passed on must be for the chunk the next device adds to
        # next; after p-1 passes device i holds the full sum for its own chunk i.
        acc = part((i - 1) % p)
        for s in range(1, p):
            acc = lax.ppermute(acc, TENSOR, to_next) + part((i - s - 1) % p)
        return acc

    def backward(hl, wl, dys):
        p, i, to_prev, _ = _ring()
        chunk, dh = dys, jnp.zeros(hl.shape, hl.dtype)
        # Weight-gradient partial sums in fp32 at least: p of them, not one einsum.
        dw = jnp.zeros(wl.shape, jnp.promote_types(wl.dtype, jnp.float32))
        for s in range(p):
            incoming = lax.ppermute(chunk, TENSOR, to_prev) if s < p - 1 else None
            c = (i + s) % p
            dh = _put_rows(dh, c, size, mm.d_x(chunk, wl))
            dw = dw + mm.d_w(_rows_of(hl, c, size), chunk).astype(dw.dtype)
            chunk = incoming
        return dh, dw.astype(wl.dtype)

    fwd_map = _smap(forward, (h_spec, w_spec), out_spec)
    bwd_map = _smap(backward, (h_spec, w_spec, out_spec), (h_spec, w_spec))

    @jax.custom_vjp
    def run(hl, wl):
        return fwd_map(hl, wl)

    def run_bwd(res, dy):
        hl, wl = res
        dh, dw = bwd_map(hl, wl, dy)
        return _retype(dh, _varying(hl)), _retype(dw, _varying(wl))

    run.defvjp(lambda hl, wl: (fwd_map(hl, wl), (hl, wl)), run_bwd)
    return run(h, w)
