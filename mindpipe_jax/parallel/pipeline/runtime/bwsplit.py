"""A real B/W split of a stage's backward, at the level of the backward's equations.

Zero-bubble schedules split a stage's backward into B (the input cotangent, on
the critical path: the previous stage waits for it) and W (the weight
gradients, deferred into bubbles). Forming the whole vjp twice and keeping half
each time makes W cost a full backward. Here the backward is traced once, as a
jaxpr, and cut in two (``jaxpr_tools``): B is the dead-code-eliminated backward
for the input cotangent; W is exactly the equations that remain; B also returns
the cut, the values W reads from it (the cotangents at each weight-consuming
operation, mostly), which the runtime keeps in slot buffers until W runs. B + W
executes the fused backward's equations, each once.

``PieceSplit`` splits one ``piece(params, h, *aux) -> out``: a layer, an
embedding (integer ``h``: no input cotangent, B is empty and W does all the
work) or a head (``out`` a scalar loss, ``aux`` its targets). Every piece has the
same three functions, whatever its policy:

* ``fwd(params, h, *aux) -> (out, kept)``: the forward and what a microbatch
  keeps until its B (``kept_avals``);
* ``b(params, kept, dy) -> (dh, cut)``: ``dh`` is None when ``h`` is integer;
  ``cut`` a flat list with fixed avals (``cut_avals``), one slot's worth;
* ``w(params, kept, cut) -> dparams``: reads only the kept entries flagged in
  ``w_reads_kept``, so a runtime may drop the others at B.

Policy "none" keeps the forward's residuals (traced and ordered by
``ResidualStore``, which also leaves out those that are the weights); its
backward takes (residuals, dy). Policy "full" keeps ``[h, *aux]`` and its
backward re-runs the forward: B computes the forward and the input-gradient
chain and hands W what it needs of both. ``stash=True`` moves into the cut the
kept values W reads, so the kept slot can be freed at B and W needs only
``(params, cut)``.

``ChunkSplit`` applies this to a stage's chunk: ``lax.scan`` of identical layers
over parameters with a leading layer axis, optionally preceded by the embedding
(first stage) and followed by the head's loss (last stage). Layers are split one
at a time (splitting through the scan would leave the scan whole in B, see
``jaxpr_tools``): the forward stacks per-layer residuals, B is a reverse scan of
the per-layer B that stacks the per-layer cuts, W a scan of the per-layer W.

Trace inside the ``shard_map`` body that will run it, as for ``ResidualStore``
(avals and residual lists differ between inside and outside). Weight gradients
of integer parameter leaves are float0 zeros, as ``jax.vjp`` gives.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.core import ShapedArray

from mindpipe_jax.parallel.pipeline.runtime.jaxpr_tools import inline_calls, replay, split_jaxpr
from mindpipe_jax.parallel.pipeline.runtime.residuals import ResidualStore

POLICIES = ("none", "full")


def _aval(x):
    """A ``ShapeDtypeStruct`` of an array, tracer, aval or struct, keeping its manual-axis
    type (which axes it varies over inside ``shard_map``) but not its sharding: inside a
    ``shard_map`` with automatic axes the sharding names a mesh the struct cannot carry."""
    a = x if isinstance(x, ShapedArray | jax.ShapeDtypeStruct) else jax.typeof(x)
    return jax.ShapeDtypeStruct(a.shape, a.dtype, manual_axis_type=getattr(a, "manual_axis_type", None))


def _example(a):
    """Zeros of aval ``a``, varying over the manual axes ``a`` varies over: ``make_jaxpr``
    inside a ``shard_map`` body takes values, not structs carrying manual-axis types."""
    z = jnp.zeros(a.shape, a.dtype)
    mat = getattr(a, "manual_axis_type", None)
    varying = tuple(sorted(mat.varying)) if mat is not None else ()
    return lax.pcast(z, varying, to="varying") if varying else z


def _inexact(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


class _Store(ResidualStore):
    """A ``ResidualStore`` whose input may be a tuple ``(h, *aux)``: its leaves enter the jaxpr flat."""

    def forward(self, params, x):
        y, *leaves = replay(self._closed)(*jax.tree_util.tree_leaves(params), *x)
        return y, [r for r, (kind, _) in zip(leaves, self._sources, strict=True) if kind == "buffer"]


class PieceSplit:
    """The B/W split of ``piece(params, h, *aux) -> out``, traced once from example arguments.

    ``fwd``/``b``/``w`` as in the module docstring; ``kept_avals``, ``cut_avals``
    (one microbatch's worth, for ``[slots, *shape]`` buffers), ``w_reads_kept``,
    ``has_dh``. ``b_jaxpr``/``w_jaxpr`` are the two halves, ``fused_jaxpr`` and
    ``fused`` the unsplit backward (a reference and a cost baseline).
    """

    def __init__(self, piece, params, h, *aux, policy: str = "none", stash: bool = False):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.policy, self.stash = policy, stash
        flat, self._tree = jax.tree_util.tree_flatten(params)
        self._n_params, self._n_aux = len(flat), len(aux)
        self._diff = [_inexact(x) for x in flat]
        self._zeros = [None if d else np.zeros(jnp.shape(x), jax.dtypes.float0)
                       for x, d in zip(flat, self._diff, strict=True)]
        self.has_dh = _inexact(h)

        def pick(dp, dx):  # (dh?, *inexact dparams): the cotangents the split returns
            leaves = [g for g, d in zip(jax.tree_util.tree_leaves(dp), self._diff, strict=True) if d]
            return ([dx] if self.has_dh else []) + leaves

        if policy == "none":
            self._store = _Store(lambda p, x: piece(p, *x), params, (h, *aux))
            self.kept_avals = list(self._store.buffer_avals)

            def backward(flat_p, kept, dy):
                dp, dx = self._store.backward(jax.tree_util.tree_unflatten(self._tree, flat_p), kept, dy)
                return pick(dp, dx[0])
        else:
            self._piece = piece
            self.kept_avals = [_aval(h)] + [_aval(a) for a in aux]

            def backward(flat_p, kept, dy):
                hh, *aa = kept
                p = jax.tree_util.tree_unflatten(self._tree, flat_p)
                _, vjp = jax.vjp(lambda p, x: piece(p, x, *aa), p, hh)
                return pick(*vjp(dy))

        kept_ex = [_example(a) for a in self.kept_avals]
        self.dy_aval = _aval(jax.eval_shape(piece, params, h, *aux))
        self.fused_jaxpr = jax.make_jaxpr(backward)(flat, kept_ex, _example(self.dy_aval))
        n_k = len(kept_ex)
        given = [True] * self._n_params + [not stash] * n_k + [False]
        weights = [True] * self._n_params + [False] * (n_k + 1)
        cots = [False] * (self._n_params + n_k) + [True]
        self._split = split_jaxpr(inline_calls(self.fused_jaxpr), int(self.has_dh), given, weights, cots)
        self.b_jaxpr, self.w_jaxpr = self._split.b, self._split.w
        n_dh = int(self.has_dh)
        self.cut_avals = list(self.b_jaxpr.out_avals[n_dh:])
        reads = set(self._split.w_inputs)
        self.w_reads_kept = tuple(self._n_params + j in reads for j in range(n_k))
        self._b_fn, self._w_fn = replay(self.b_jaxpr), replay(self.w_jaxpr)
        self._fused_fn = replay(self.fused_jaxpr)

    # -- the runtime's three calls ---------------------------------------------------
    def fwd(self, params, h, *aux):
        if self.policy == "none":
            return self._store.forward(params, (h, *aux))
        return self._piece(params, h, *aux), [h, *aux]

    def b(self, params, kept, dy):
        outs = self._b_fn(*jax.tree_util.tree_leaves(params), *kept, dy)
        if self.has_dh:
            return outs[0], list(outs[1:])
        return None, list(outs)

    def w(self, params, kept, cut):
        return self.dparams(self.w_flat(params, kept, cut))

    def w_flat(self, params, kept, cut) -> list:
        """W's gradients of the inexact parameter leaves, flat (``dparams`` makes the tree)."""
        return list(self._w_fn(*self._w_args(params, kept), *cut))

    def fused(self, params, kept, dy):
        """(dh, dparams) from the unsplit backward on the same kept values: what a backward
        that is not split runs (it costs the fused vjp, not B + W), and the reference."""
        dh, flat = self.fused_flat(params, kept, dy)
        return dh, self.dparams(flat)

    def fused_flat(self, params, kept, dy):
        """``fused`` with the inexact parameter leaves' gradients flat, as ``w_flat``."""
        outs = list(self._fused_fn(*jax.tree_util.tree_leaves(params), *kept, dy))
        if self.has_dh:
            return outs[0], outs[1:]
        return None, outs

    # -- helpers -------------------------------------------------------------------

    def _w_args(self, params, kept):
        inputs = [*jax.tree_util.tree_leaves(params), *kept]
        return [inputs[i] for i in self._split.w_inputs]

    def dparams(self, grads):
        """The parameters' tree of cotangents from the inexact leaves' (float0 zeros for the rest)."""
        grads = iter(grads)
        leaves = [next(grads) if d else z for d, z in zip(self._diff, self._zeros, strict=True)]
        return jax.tree_util.tree_unflatten(self._tree, leaves)

    def empty_cut(self, slots: int, fill: float = 0.0):
        return [jnp.full((slots, *a.shape), fill, a.dtype) for a in self.cut_avals]


def _stack(avals, n):
    return [jax.ShapeDtypeStruct((n, *a.shape), a.dtype) for a in avals]


def _layer0(x):
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
    return x[0]


class ChunkSplit:
    """The B/W split of ``[embed] -> scan(layer) -> [head_loss]`` with the ``PieceSplit`` interface.

    ``params`` is a dict with ``"layers"`` (leading layer axis) and, when given,
    ``"embed"`` and ``"head"``. ``x`` is the tokens with an embedding, else the
    hidden state; ``aux`` is ``(targets,)`` with a head, whose ``dy`` is the loss
    cotangent (the seed). Under "full" the kept values are ``[x, *aux]`` and B
    re-runs the chunk's forward (stacking per-layer residuals inside B only);
    under "none" they are the embedding's, the stacked layers' and the head's
    residuals, in that order. ``params`` may also hold ``"n"``, how many of the stack's
    layers run (a traced count: uneven stages padded to one width, a shallow subnet): the
    rest are skipped in the forward, B and W alike (identity for h and its cotangent, zero
    residuals, cut and gradients), by ``cond`` or, with ``lockstep``, computed and dropped.
    """

    def __init__(self, layer, params, x, *aux, policy: str = "none", embed=None, head_loss=None,
                 lockstep: bool = False):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if (head_loss is None) != (len(aux) == 0):
            raise ValueError("pass the head's targets as aux exactly when head_loss is given")
        self.policy, self.lockstep = policy, lockstep
        stash = policy == "full"  # W then reads the cut only: the per-layer residuals exist inside B
        self.n_layers = jax.tree_util.tree_leaves(params["layers"])[0].shape[0]
        self.embed = self.head = None
        h = x
        if embed is not None:
            self.embed = PieceSplit(embed, params["embed"], x, policy="none", stash=stash)
            h = _aval(jax.eval_shape(embed, params["embed"], x))
        lp0 = jax.tree.map(_layer0, params["layers"])
        self.layer = PieceSplit(layer, lp0, h, policy="none", stash=stash)
        if head_loss is not None:
            self.head = PieceSplit(head_loss, params["head"], h, *aux, policy="none", stash=stash)
        self.has_dh = embed is None
        L = self.n_layers
        parts = [p for p in (self.embed, self.layer, self.head) if p is not None]
        self._kept_n = [len(p.kept_avals) for p in parts]
        self._cut_n = [len(p.cut_avals) for p in parts]
        stacked = [lambda a: a, lambda a: _stack(a, L), lambda a: a]
        present = [i for i, p in enumerate((self.embed, self.layer, self.head)) if p is not None]
        self._res_avals = [a for i, p in zip(present, parts, strict=True) for a in stacked[i](p.kept_avals)]
        self.cut_avals = [a for i, p in zip(present, parts, strict=True) for a in stacked[i](p.cut_avals)]
        self.kept_avals = ([_aval(x)] + [_aval(a) for a in aux]) if policy == "full" else self._res_avals
        self.w_reads_kept = (tuple(False for _ in self.kept_avals) if policy == "full" else
                             tuple(r for p in parts for r in p.w_reads_kept))

    def _split(self, flat, counts):
        out, i = [], 0
        for p in (self.embed, self.layer, self.head):
            if p is None:
                out.append([])
            else:
                n = counts.pop(0)
                out.append(list(flat[i:i + n]))
                i += n
        return out

    def _gate(self, on, run, skip):
        """``run()`` where the layer runs (``on``; None: every layer does), else ``skip`` (same
        structure): a ``cond``, or in lockstep (stage code that may hold collectives every
        device must join) both, selected."""
        if on is None:
            return run()
        if self.lockstep:
            return jax.tree.map(lambda a, b: jnp.where(on, a, b), run(), skip)
        return lax.cond(on, run, lambda: skip)

    def _scan_layers(self, one, init, xs, n, reverse=False):
        """``lax.scan`` of ``one(carry, xs_i) -> (carry, out)`` over the stack; with ``n`` (how
        many of the stack's layers run: uneven stages, a shallow subnet) ``one`` also gets
        whether layer i runs."""
        if n is None:
            return lax.scan(lambda c, x: one(c, x, None), init, xs, reverse=reverse)
        idx = jnp.arange(self.n_layers)
        return lax.scan(lambda c, x: one(c, x[:-1], x[-1] < n), init, (*xs, idx), reverse=reverse)

    def _fwd_none(self, params, x, *aux):
        kept_e, kept_h = [], []
        h = x
        if self.embed is not None:
            h, kept_e = self.embed.fwd(params["embed"], x)
        skip_kept = [_example(a) for a in self.layer.kept_avals]

        def one(c, xs, on):
            return self._gate(on, lambda: self.layer.fwd(xs[0], c), (c, skip_kept))
        h, kept_l = self._scan_layers(one, h, (params["layers"],), params.get("n"))
        out = h
        if self.head is not None:
            out, kept_h = self.head.fwd(params["head"], h, *aux)
        return out, [*kept_e, *kept_l, *kept_h]

    def fwd(self, params, x, *aux):
        if self.policy == "full":
            return self._fwd_none(params, x, *aux)[0], [x, *aux]
        return self._fwd_none(params, x, *aux)

    def b(self, params, kept, dy):
        if self.policy == "full":
            _, kept = self._fwd_none(params, *kept)
        kept_e, kept_l, kept_h = self._split(kept, list(self._kept_n))
        cut_e, cut_h = [], []
        dh = dy
        if self.head is not None:
            dh, cut_h = self.head.b(params["head"], kept_h, dy)

        skip_cut = [_example(a) for a in self.layer.cut_avals]

        def one(d, xs, on):
            lp, res = xs
            return self._gate(on, lambda: self.layer.b(lp, res, d), (d, skip_cut))  # skipped: identity
        dh, cut_l = self._scan_layers(one, dh, (params["layers"], kept_l), params.get("n"), reverse=True)
        if self.embed is not None:
            dh, cut_e = self.embed.b(params["embed"], kept_e, dh)
        return dh, [*cut_e, *cut_l, *cut_h]

    def w(self, params, kept, cut):
        if self.policy == "full":
            kept = [None] * sum(self._kept_n)  # stashed: every piece's W reads the cut only
        kept_e, kept_l, kept_h = self._split(kept, list(self._kept_n))
        cut_e, cut_l, cut_h = self._split(cut, list(self._cut_n))
        reads = [k for k, r in zip(kept_l, self.layer.w_reads_kept, strict=True) if r]

        skip_w = [_example(a) for a in self.layer.w_jaxpr.out_avals]

        def one(_, xs, on):
            lp, res, c = xs
            it = iter(res)
            full = [next(it) if r else None for r in self.layer.w_reads_kept]
            flat = self._gate(on, lambda: self.layer.w_flat(lp, full, c), skip_w)  # skipped: zeros
            return None, self.layer.dparams(flat)
        grads = {"layers": self._scan_layers(one, None, (params["layers"], reads, cut_l), params.get("n"))[1]}
        if self.embed is not None:
            grads["embed"] = self.embed.w(params["embed"], kept_e, cut_e)
        if self.head is not None:
            grads["head"] = self.head.w(params["head"], kept_h, cut_h)
        return grads

    def fused(self, params, kept, dy):
        """(dh, grads) from the unsplit backward on the kept values of ``fwd`` (``grads``
        as ``w`` gives them): a backward of this chunk that is not split (a BW task on a
        stage whose other backwards are) costs the fused vjp, not B + W, and needs no cut."""
        if self.policy == "full":
            _, kept = self._fwd_none(params, *kept)
        kept_e, kept_l, kept_h = self._split(kept, list(self._kept_n))
        grads, dh = {}, dy
        if self.head is not None:
            dh, grads["head"] = self.head.fused(params["head"], kept_h, dy)
        skip = [_example(a) for a in self.layer.w_jaxpr.out_avals]

        def one(d, xs, on):
            lp, res = xs
            # a skipped layer: identity for the cotangent, zero gradients
            d, flat = self._gate(on, lambda: self.layer.fused_flat(lp, res, d), (d, skip))
            return d, self.layer.dparams(flat)
        dh, grads["layers"] = self._scan_layers(one, dh, (params["layers"], kept_l), params.get("n"),
                                                reverse=True)
        if self.embed is not None:
            dh, grads["embed"] = self.embed.fused(params["embed"], kept_e, dh)
        return dh, grads

    def empty_cut(self, slots: int, fill: float = 0.0):
        return [jnp.full((slots, *a.shape), fill, a.dtype) for a in self.cut_avals]
