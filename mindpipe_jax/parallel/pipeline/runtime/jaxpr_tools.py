"""Equation-level surgery on a traced backward: inline calls, then cut it in two.

``inline_calls`` flattens call-like equations (``jit``, ``closed_call``,
``remat``/``checkpoint``, ``custom_jvp_call``, ``custom_vjp_call``) into the
equations they call, so a split sees the matmuls and elementwise work instead of
one opaque call that computes both halves. Custom-derivative calls are replaced
by their primal body: that is exact for evaluation, and the split programs are
only ever evaluated, never differentiated again. ``remat`` loses its CSE barrier
the same way, harmless here (a split backward holds one copy of each value).

``split_jaxpr`` partitions the top-level equations of such a backward into

* B: every equation the outputs marked "first" (the input cotangent) depend on;
* W: the equations the remaining outputs (the weight cotangents) need and B
  does not compute;
* the cut: the values W reads that it cannot get on its own: those B defines,
  and B's inputs W is not handed (the incoming cotangent, or the kept values
  when they are stashed).

Each equation lands in at most one half, so B + W executes exactly the work of
the fused backward. The exception is values that depend on the weights only
(casts, transposes of a parameter): W recomputes them rather than have them
stashed per microbatch.

Making the cut small: liveness alone can leave W computing a value from two
bigger ones B has (a GELU output from its two factors; under remat, an attention
output from the probabilities, quadratic in the length). Such equations move
from W into B when that shrinks the cut's bytes, greedily, best move first:
cheap ones (elementwise, layout, reductions, e.g. a layernorm's weight
gradients, a vector per microbatch instead of two activations) and any that do
not depend on the cotangent (forward work). The weight-gradient matmuls never
move. For a GPT block the cut is then the cotangent at each weight matmul's
output plus, where B recomputed them, that matmul's input.

Equations with their own sub-programs that were not inlined (``scan``,
``while``, ``cond``, ``shard_map``, ...) are atoms: one needed by both halves
runs whole in B and W reads its outputs through the cut. That is correct but
leaves the weight work inside it on B's critical path and may make the cut as
large as those outputs; a stack of layers should therefore be split per layer
and scanned (``bwsplit.ChunkSplit``), not split through its scan. Equations
with effects stay in B.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
from jax import lax
from jax._src.core import join_effects, pvary_p
from jax.extend.core import ClosedJaxpr, DebugInfo, DropVar, Jaxpr, Literal, Var

# primitive name -> the parameter holding the program it calls
_CALLS = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "call": "call_jaxpr",
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
}


def _callee(eqn):
    key = _CALLS.get(eqn.primitive.name)
    if key is None or key not in eqn.params:
        return None
    sub = eqn.params[key]
    if isinstance(sub, ClosedJaxpr):
        return sub.jaxpr, list(sub.consts)
    if isinstance(sub, Jaxpr) and not sub.constvars:
        return sub, []
    return None


def _debug(name: str) -> DebugInfo:
    return DebugInfo("bwsplit", name, None, None)


def inline_calls(closed: ClosedJaxpr) -> ClosedJaxpr:
    """The same program with every call-like equation replaced by its body, recursively."""
    constvars, consts, eqns = list(closed.jaxpr.constvars), list(closed.consts), []

    def emit(jaxpr, env):
        def read(a):
            return a if isinstance(a, Literal) else env[a]

        for eqn in jaxpr.eqns:
            invals = [read(a) for a in eqn.invars]
            sub = _callee(eqn)
            if sub is None:
                outs = [v if isinstance(v, DropVar) else Var(v.aval) for v in eqn.outvars]
                eqns.append(eqn.replace(invars=invals, outvars=outs))
            else:
                inner, inner_consts = sub
                inner_env = dict(zip(inner.invars, invals, strict=True))
                for v, c in zip(inner.constvars, inner_consts, strict=True):
                    inner_env[v] = Var(v.aval)
                    constvars.append(inner_env[v])
                    consts.append(c)
                outs = emit(inner, inner_env)
            for v, o in zip(eqn.outvars, outs, strict=True):
                if not isinstance(v, DropVar):
                    env[v] = o
        return [read(a) for a in jaxpr.outvars]

    env = {v: v for v in [*closed.jaxpr.constvars, *closed.jaxpr.invars]}
    outvars = emit(closed.jaxpr, env)
    jaxpr = Jaxpr(constvars, closed.jaxpr.invars, outvars, eqns,
                  join_effects(*(e.effects for e in eqns)), _debug("inlined"))
    return ClosedJaxpr(jaxpr, consts)


def _vars(atoms):
    return [a for a in atoms if isinstance(a, Var) and not isinstance(a, DropVar)]


@dataclass(frozen=True)
class Split:
    """The two halves of a backward and what passes between them.

    ``b``: inputs = the backward's inputs, outputs = (the first outputs, *cut).
    ``w``: inputs = (the inputs W is handed, *cut), outputs = the other outputs.
    ``w_inputs``: indices into the backward's inputs of those W is handed and reads.
    """
    b: ClosedJaxpr
    w: ClosedJaxpr
    w_inputs: tuple[int, ...]
    n_cut: int


# Cheap work (elementwise, layout, reductions) that may move from W into B when that
# shrinks the cut. Other equations move only if they do not depend on the cotangent
# (forward work W would otherwise recompute, e.g. under remat); the weight-gradient
# matmuls never do.
CHEAP = frozenset("""
    abs add add_any and broadcast_in_dim clamp concatenate convert_element_type copy copy_p cos
    div eq erf erf_inv exp exp2 expand_dims ge gt integer_pow iota le log log1p logistic lt max
    min mul ne neg not or pad pow reduce_max reduce_min reduce_sum reshape rsqrt select_n sign
    sin slice sqrt square squeeze sub tan tanh transpose
""".split())


def _nbytes(v) -> int:
    aval = v.aval
    return int(math.prod(aval.shape)) * aval.dtype.itemsize


def split_jaxpr(closed: ClosedJaxpr, n_first: int, w_given, weight_inputs, cot_inputs,
                shrink: bool = True) -> Split:
    """Split ``closed`` (already inlined) into B for its first ``n_first`` outputs and W for the rest.

    ``w_given``: per input, whether W may read it directly (weights, kept residuals);
    the others (the cotangent, stashed values) reach W through the cut.
    ``weight_inputs``: per input, whether it is a weight: values computed from
    weights alone are recomputed by W rather than stashed per microbatch.
    ``cot_inputs``: per input, whether it is a cotangent.
    ``shrink``: move equations of W whose inputs B has into B where that makes
    the cut smaller in bytes (greedy, best move first): cheap ones (elementwise,
    layout, reductions) and those that do not depend on the cotangent (forward
    values W would recompute, e.g. an attention output under remat). The total
    work stays the same; B gains that work.
    """
    jaxpr = closed.jaxpr
    eqns = jaxpr.eqns
    first, rest = jaxpr.outvars[:n_first], jaxpr.outvars[n_first:]
    given = {v for v, g in zip(jaxpr.invars, w_given, strict=True) if g}
    free = given | set(jaxpr.constvars)

    # B: liveness from the first outputs (effects always run, in B).
    live = set(_vars(first))
    in_b = [False] * len(eqns)
    for i in reversed(range(len(eqns))):
        e = eqns[i]
        if e.effects or any(v in live for v in _vars(e.outvars)):
            in_b[i] = True
            live.update(_vars(e.invars))

    # Values that depend on weights (and constants) only.
    weight_only = {v for v, w in zip(jaxpr.invars, weight_inputs, strict=True) if w}
    weight_only.update(jaxpr.constvars)
    for e in eqns:
        if not e.effects and all(v in weight_only for v in _vars(e.invars)):
            weight_only.update(_vars(e.outvars))
    recompute = [all(v in weight_only for v in _vars(e.outvars)) for e in eqns]
    linear = {v for v, c in zip(jaxpr.invars, cot_inputs, strict=True) if c}
    for e in eqns:
        if any(v in linear for v in _vars(e.invars)):
            linear.update(_vars(e.outvars))
    movable = [not e.effects and (e.primitive.name in CHEAP or not any(v in linear for v in _vars(e.outvars)))
               for e in eqns]

    def w_side(in_b):
        """W's equations (liveness from the other outputs, stopping at values B has) and the cut."""
        live = set(_vars(rest))
        in_w = [False] * len(eqns)
        for i in reversed(range(len(eqns))):
            e = eqns[i]
            if any(v in live for v in _vars(e.outvars)) and (not in_b[i] or recompute[i]):
                in_w[i] = True
                live.update(_vars(e.invars))
        defined = {v for i, e in enumerate(eqns) if in_w[i] for v in _vars(e.outvars)}
        needed = [v for v in _ordered_reads(eqns, in_w, rest) if v not in defined]
        return in_w, needed, [v for v in needed if v not in free]

    in_w, needed, cut = w_side(in_b)
    while shrink:
        size = sum(map(_nbytes, cut))
        best = None
        for moved in _candidates(eqns, in_w, in_b, cut, movable):
            trial = [b or j in moved for j, b in enumerate(in_b)]
            t_w, t_needed, t_cut = w_side(trial)
            gain = size - sum(map(_nbytes, t_cut))
            if gain > 0 and (best is None or gain > best[0]):
                best = (gain, trial, t_w, t_needed, t_cut)
        if best is None:
            break
        _, in_b, in_w, needed, cut = best

    needed_set = set(needed)
    w_inputs = tuple(i for i, v in enumerate(jaxpr.invars) if v in given and v in needed_set)
    b_eqns = [e for i, e in enumerate(eqns) if in_b[i]]
    w_eqns = [e for i, e in enumerate(eqns) if in_w[i]]
    b = Jaxpr(jaxpr.constvars, jaxpr.invars, [*first, *cut], b_eqns,
              join_effects(*(e.effects for e in b_eqns)), _debug("bwsplit_b"))
    w = Jaxpr(jaxpr.constvars, [jaxpr.invars[i] for i in w_inputs] + cut, rest, w_eqns,
              join_effects(*(e.effects for e in w_eqns)), _debug("bwsplit_w"))
    return Split(ClosedJaxpr(b, closed.consts), ClosedJaxpr(w, closed.consts), w_inputs, len(cut))


def _candidates(eqns, in_w, in_b, cut, movable):
    """Sets of W-only equations that B could take over: each movable equation with its
    W ancestors, and for each cut value every movable W equation downstream of it
    (with their ancestors), so a value read by several chains can leave the cut."""
    only_w = [w and not b for w, b in zip(in_w, in_b, strict=True)]
    producer = {v: j for j, e in enumerate(eqns) if only_w[j] for v in _vars(e.outvars)}
    readers = {}
    for j, e in enumerate(eqns):
        if only_w[j]:
            for v in _vars(e.invars):
                readers.setdefault(v, []).append(j)

    def close(seeds):
        moved, todo = set(), list(seeds)
        while todo:
            j = todo.pop()
            if j in moved:
                continue
            if not movable[j]:
                return None
            moved.add(j)
            todo.extend(producer[v] for v in _vars(eqns[j].invars) if v in producer)
        return moved

    for i in range(len(eqns)):
        if only_w[i] and (moved := close([i])) is not None:
            yield moved
    for v in cut:
        cone, todo = set(), list(readers.get(v, []))
        while todo:
            j = todo.pop()
            if j in cone or not movable[j]:
                continue
            cone.add(j)
            todo.extend(k for u in _vars(eqns[j].outvars) for k in readers.get(u, []))
        if cone and (moved := close(cone)) is not None:
            yield moved


def _ordered_reads(eqns, selected, outvars):
    """Variables read by the selected equations or returned, in first-read order, no repeats."""
    seen, order = set(), []
    for v in [*(a for i, e in enumerate(eqns) if selected[i] for a in _vars(e.invars)), *_vars(outvars)]:
        if v not in seen:
            seen.add(v)
            order.append(v)
    return order


def count_primitive(closed: ClosedJaxpr, name: str) -> int:
    """How many top-level equations of ``closed`` bind the primitive ``name``."""
    return sum(e.primitive.name == name for e in closed.jaxpr.eqns)


def _varying(x):
    """The manual axes a traced array varies over (None for a non-JAX value: a literal)."""
    if not isinstance(x, jax.Array | jax.core.Tracer):
        return None
    mat = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(mat.varying) if mat is not None else frozenset()


def _matching_varying(values: list) -> list:
    """``values`` with the arrays that vary over fewer manual axes than the others cast to
    varying over all of them (what tracing inserts before an equation's ``bind``)."""
    axes = [_varying(x) for x in values]
    union = frozenset().union(*(a for a in axes if a is not None))
    if all(a is None or a == union for a in axes):
        return values
    return [x if a is None or a == union else lax.pcast(x, tuple(sorted(union - a)), to="varying")
            for x, a in zip(values, axes, strict=True)]


def replay(closed: ClosedJaxpr):
    """``jaxpr_as_fun(closed)`` for arguments that may vary over more ``shard_map`` axes
    than the examples it was traced with: where an equation's inputs would then disagree
    (a constant the model closes over, invariant, beside a weight that now varies), the
    less varying ones are cast first, as tracing with the real arguments would have done.
    Only equations whose inputs disagree change; the values never do (a cast to varying
    is the identity on each device)."""
    jaxpr, consts = closed.jaxpr, closed.consts

    def run(*args):
        env = dict(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(jaxpr.invars, args, strict=True))
        read = lambda v: v.val if isinstance(v, Literal) else env[v]  # noqa: E731
        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            params = eqn.primitive.get_bind_params(eqn.params)
            if eqn.primitive is pvary_p:  # a cast the trace needed: only over the axes still missing
                have = _varying(ins[0]) or frozenset()
                params = {**params, "axes": tuple(a for a in params["axes"] if a not in have)}
                if not params["axes"]:
                    env[eqn.outvars[0]] = ins[0]
                    continue
            else:
                ins = _matching_varying(ins)
            with eqn.ctx.manager:
                outs = eqn.primitive.bind(*ins, **params)
            env.update(zip(eqn.outvars, outs if eqn.primitive.multiple_results else [outs], strict=True))
        return [read(v) for v in jaxpr.outvars]
    return run
