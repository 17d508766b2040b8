"""The equation-level B/W split (runtime/bwsplit.py) against jax.vjp, and its executed work.

Tolerance: B and W execute exactly the equations of jax.vjp's backward, each once,
but as separate XLA programs, whose fusions may round a few values differently
(on the CPU they have come out bitwise equal). rtol = atol = 1e-6 is ~8 float32
ulps on the O(1) values used here: rounding passes, while a missing, doubled or
misrouted term (>= 1e-3 with these weights) fails.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from mindpipe_jax.parallel.pipeline.runtime.bwsplit import ChunkSplit, PieceSplit
from mindpipe_jax.parallel.pipeline.runtime.jaxpr_tools import count_primitive, inline_calls

TOL = dict(rtol=1e-6, atol=1e-6)
B, T, D, H, KV, V = 2, 12, 32, 4, 2, 64  # head dim 8 != T: a T x T value stands out


def _w(rng, *shape, scale=None):
    scale = 1.0 / math.sqrt(shape[0]) if scale is None else scale
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32) * scale)


def _ln(x, g, b):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) * lax.rsqrt(v + 1e-5) * g + b


def _attend(q, k, v):  # q [B,T,H,hd], k/v [B,T,H,hd]
    b, t = q.shape[:2]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v).reshape(b, t, -1)


def gpt_block(p, x):
    b, t, d = x.shape
    h = _ln(x, p["g1"], p["b1"])
    q, k, v = (u.reshape(b, t, H, d // H) for u in jnp.split(h @ p["wqkv"], 3, -1))
    x = x + _attend(q, k, v) @ p["wo"]
    h = _ln(x, p["g2"], p["b2"])
    return x + jax.nn.gelu(h @ p["w1"] + p["c1"]) @ p["w2"]


def gpt_params(rng, layers=None, D=D):
    lead = () if layers is None else (layers,)
    one = lambda *s, **k: _w(rng, *lead, *s, **k) if not lead else jnp.stack(
        [_w(rng, *s, **k) for _ in range(layers)])
    return {"g1": 1 + one(D, scale=0.1), "b1": one(D, scale=0.1), "g2": 1 + one(D, scale=0.1),
            "b2": one(D, scale=0.1), "wqkv": one(D, 3 * D), "wo": one(D, D), "w1": one(D, 4 * D),
            "c1": one(4 * D, scale=0.1), "w2": one(4 * D, D)}


def gqa_block(p, x):
    """RMSNorm, grouped-query attention (KV < H heads), SwiGLU, no biases."""
    rms = lambda x, g: x * lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * g
    h = rms(x, p["n1"])
    hd = D // H
    q = (h @ p["wq"]).reshape(B, T, H, hd)
    k = jnp.repeat((h @ p["wk"]).reshape(B, T, KV, hd), H // KV, axis=2)
    v = jnp.repeat((h @ p["wv"]).reshape(B, T, KV, hd), H // KV, axis=2)
    x = x + _attend(q, k, v) @ p["wo"]
    h = rms(x, p["n2"])
    return x + (jax.nn.silu(h @ p["wg"]) * (h @ p["wu"])) @ p["wd"]


@jax.custom_vjp
def _clip_tanh(x):
    return jnp.tanh(x)


_clip_tanh.defvjp(lambda x: (jnp.tanh(x), jnp.tanh(x)), lambda t, g: (g * (1 - t * t),))


@jax.jit
def _mlp(w1, w2, h):
    return jax.nn.relu(h @ w1) @ w2


def jit_piece(p, x):
    """Plain jax: a jitted MLP, a custom_vjp nonlinearity, an integer (non-trainable) leaf."""
    y = x + _mlp(p["w1"], p["w2"], x)
    return jnp.where(p["mask"] > 0, _clip_tanh(y @ p["w3"]), y)


def scan_piece(p, x):
    """A piece with its own scan: it stays whole in B (see jaxpr_tools)."""
    return lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, p["ws"])[0]


def embed(ep, tokens):
    return ep["tok"][tokens] + ep["pos"][None]


def head_loss(hp, h, targets):
    logits = _ln(h, hp["g"], hp["b"]) @ hp["w"]
    logp = jax.nn.log_softmax(logits, -1)
    return -jnp.take_along_axis(logp, targets[..., None], -1).mean()


def _case(name, seed=0):
    """(piece, params, h, aux, dy) of each family."""
    rng = np.random.default_rng(seed)
    x, dy = _w(rng, B, T, D, scale=1.0), _w(rng, B, T, D, scale=1.0)
    tokens = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    if name == "gpt":
        return gpt_block, gpt_params(rng), x, (), dy
    if name == "gpt-remat":
        policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
        return jax.checkpoint(gpt_block, policy=policy), gpt_params(rng), x, (), dy
    if name == "gqa":
        p = {"n1": 1 + _w(rng, D, scale=0.1), "n2": 1 + _w(rng, D, scale=0.1), "wq": _w(rng, D, D),
             "wk": _w(rng, D, KV * D // H), "wv": _w(rng, D, KV * D // H), "wo": _w(rng, D, D),
             "wg": _w(rng, D, 2 * D), "wu": _w(rng, D, 2 * D), "wd": _w(rng, 2 * D, D)}
        return gqa_block, p, x, (), dy
    if name == "jit":
        p = {"w1": _w(rng, D, 2 * D), "w2": _w(rng, 2 * D, D), "w3": _w(rng, D, D),
             "mask": jnp.asarray(rng.integers(0, 2, (D,)), jnp.int32)}
        return jit_piece, p, x, (), dy
    if name == "scan":
        return scan_piece, {"ws": _w(rng, 2, D, D)}, x, (), dy
    if name == "embed":
        return embed, {"tok": _w(rng, V, D, scale=1.0), "pos": _w(rng, T, D, scale=1.0)}, tokens, (), dy
    if name == "head":
        hp = {"g": 1 + _w(rng, D, scale=0.1), "b": _w(rng, D, scale=0.1), "w": _w(rng, D, V)}
        return head_loss, hp, x, (tokens,), jnp.float32(0.25)
    raise ValueError(name)


def _close(a, b):
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, **TOL) if u.dtype != jax.dtypes.float0
                 else None, a, b)


def _run_pieces(splits, fn, params, h, aux, dy):
    """One program: each split's forward, B and W (W handed only the kept values it
    says it reads), and the jax.vjp reference."""
    @jax.jit
    def run(params, h, aux, dy):
        got = []
        for s in splits:
            out, kept = s.fwd(params, h, *aux)
            dh, cut = s.b(params, kept, dy)
            dw = s.w(params, [k if r else None for k, r in zip(kept, s.w_reads_kept, strict=True)], cut)
            got.append((out, dh, dw, cut))
        ref_out, vjp = jax.vjp(lambda p, x: fn(p, x, *aux), params, h)
        ref_dw, ref_dh = vjp(dy)
        return got, (ref_out, ref_dh if splits[0].has_dh else None, ref_dw)
    return run(params, h, aux, dy)


FAMILIES = ["gpt", "gqa", "gpt-remat", "jit", "scan", "embed", "head"]


@pytest.mark.parametrize("family", FAMILIES)
def test_piece_split_equals_vjp(family):
    # Both policies: "none" (backward from kept residuals), "full" (B re-runs the forward).
    fn, params, h, aux, dy = _case(family)
    splits = [PieceSplit(fn, params, h, *aux, policy=policy) for policy in ("none", "full")]
    got, (ref_out, ref_dh, ref_dw) = _run_pieces(splits, fn, params, h, aux, dy)
    for s, (out, dh, dw, cut) in zip(splits, got, strict=True):
        _close(out, ref_out)
        _close(dw, ref_dw)
        assert jax.tree.structure(dw) == jax.tree.structure(ref_dw)
        if s.has_dh:
            _close(dh, ref_dh)
        else:  # integer tokens: no input cotangent, B computes nothing and hands dy on
            assert dh is None and family == "embed"
            assert len(s.b_jaxpr.jaxpr.eqns) == 0
            assert [c.shape for c in cut] == [dy.shape]
        assert [(c.shape, c.dtype) for c in cut] == [(a.shape, a.dtype) for a in s.cut_avals]
        if family == "jit":
            assert dw["mask"].dtype == jax.dtypes.float0
            assert not any(e.primitive.name in ("jit", "custom_vjp_call", "custom_jvp_call")
                           for j in (s.b_jaxpr, s.w_jaxpr) for e in j.jaxpr.eqns)


def test_a_scan_inside_a_piece_stays_whole_in_b():
    # Both halves need the backward scan: it runs in B and W gets its weight
    # cotangent through the cut (correct; the split of a layer stack is ChunkSplit's).
    s = PieceSplit(*_case("scan")[:3])
    assert count_primitive(s.b_jaxpr, "scan") == 1 and count_primitive(s.w_jaxpr, "scan") == 0
    assert [a.shape for a in s.cut_avals] == [(2, D, D)]


def _gpt_work_case():
    """A GPT block big enough that matmuls, not elementwise work, dominate its FLOPs.

    XLA duplicates cheap elementwise producers into several fusions and counts them
    once per fusion; which ones it duplicates depends on the program, so at toy
    sizes (D=32, T=12) the fused backward counts ~5% more than B + W, all of it
    elementwise. At D=64, T=16 the counts agree exactly.
    """
    rng = np.random.default_rng(5)
    x, dy = _w(rng, B, 16, 64, scale=1.0), _w(rng, B, 16, 64, scale=1.0)
    return gpt_block, gpt_params(rng, D=64), x, dy


def _flops(fn, *args):
    return jax.jit(fn).lower(*args).compile().cost_analysis()["flops"]


def _sds(avals):
    return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]


def test_gpt_block_work():
    fn, params, h, dy = _gpt_work_case()
    none = PieceSplit(fn, params, h, policy="none")
    kept = _sds(none.kept_avals)
    fb, fw = _flops(none.b, params, kept, dy), _flops(none.w, params, kept, _sds(none.cut_avals))
    fused = _flops(none.fused, params, kept, dy)
    # Policy "none": B + W executes what the fused backward does (<= 3% more), and W
    # is exactly the rest: it re-runs none of the input-gradient chain.
    assert (fb + fw) / fused <= 1.03, (fb, fw, fused)
    assert abs(fw - (fused - fb)) <= 0.03 * fw, (fb, fw, fused)
    # Equation level: every matmul of the backward runs once, in B or in W, and W's
    # are the four weight gradients.
    dots = lambda j: count_primitive(j, "dot_general")
    assert dots(none.b_jaxpr) + dots(none.w_jaxpr) == dots(inline_calls(none.fused_jaxpr))
    assert dots(none.w_jaxpr) == 4

    # Policy "full": B re-runs the forward, so compare with forward + fused backward.
    full = PieceSplit(fn, params, h, policy="full")
    fb_full = _flops(full.b, params, [h], dy)
    fw_full = _flops(full.w, params, [h], _sds(full.cut_avals))
    fwd = _flops(none.fwd, params, h)
    assert (fb_full + fw_full) / (fwd + fused) <= 1.03, (fb_full, fw_full, fwd, fused)
    assert count_primitive(full.w_jaxpr, "dot_general") == 4
    assert abs(fw_full - fw) <= 0.03 * fw  # the same weight-gradient work as under "none"


def test_gpt_block_cut_is_the_matmul_cotangents():
    # Under "none" the cut is the cotangent at the output of each weight matmul
    # (qkv 3D, attention out D, MLP up 4D, MLP down D per token), plus the layernorm
    # weight gradients (4 vectors of D), which B forms on the way; W reads the
    # matmul inputs from the residuals. Under "full" the cut also carries those inputs.
    # Under remat (dots saved) B recomputes those inputs, so they are in the cut too;
    # W recomputes no attention: nothing quadratic in T is stashed.
    fn, params, h, _, _ = _case("gpt")
    remat = _case("gpt-remat")[0]
    for f, policy, per_token in ((fn, "none", 9 * D), (fn, "full", 9 * D + 7 * D),
                                 (remat, "none", 9 * D + 7 * D)):
        s = PieceSplit(f, params, h, policy=policy)
        acts = sum(math.prod(a.shape) for a in s.cut_avals if a.ndim > 1)
        vecs = [a.shape for a in s.cut_avals if a.ndim == 1]
        assert acts == B * T * per_token and vecs == [(D,)] * 4, (policy, s.cut_avals)
    kept_bytes = sum(math.prod(a.shape) * a.dtype.itemsize for a in PieceSplit(fn, params, h).kept_avals)
    assert B * T * 9 * D * 4 < kept_bytes / 3


def mlp_layer(p, h):
    """A light residual layer for the chunk tests (the pieces' tests cover the heavy ones)."""
    return h + jnp.tanh(_ln(h, p["g"], p["b"]) @ p["w1"]) @ p["w2"]


def mlp_params(rng, layers):
    return {"g": 1 + _w(rng, layers, D, scale=0.1), "b": _w(rng, layers, D, scale=0.1),
            "w1": _w(rng, layers, D, 2 * D, scale=D ** -0.5), "w2": _w(rng, layers, 2 * D, D, scale=0.1)}


def _chunk_fn(params, x, *aux, first, last):
    h = embed(params["embed"], x) if first else x
    h = lax.scan(lambda c, lp: (mlp_layer(lp, c), None), h, params["layers"])[0]
    return head_loss(params["head"], h, *aux) if last else h


@pytest.mark.parametrize("policy", ["none", "full"])
def test_chunk_split_equals_vjp_of_the_scanned_chunk(policy):
    # A first-and-last stage's chunk: embedding (integer tokens), 3 layers, head loss.
    # The middle stage's chunk (input cotangent) is the shard_map test's.
    rng = np.random.default_rng(1)
    _, ep, tokens, _, _ = _case("embed", 2)
    _, hp, _, aux, seed = _case("head", 3)
    params = {"embed": ep, "layers": mlp_params(rng, 3), "head": hp}
    c = ChunkSplit(mlp_layer, params, tokens, *aux, policy=policy, embed=embed, head_loss=head_loss)
    assert not c.has_dh

    @jax.jit
    def run(params, tokens, aux, seed):
        out, kept = c.fwd(params, tokens, *aux)
        dx, cut = c.b(params, kept, seed)
        assert dx is None
        dw = c.w(params, [k if r else None for k, r in zip(kept, c.w_reads_kept, strict=True)], cut)
        no_dx, fused_dw = c.fused(params, kept, seed)  # a BW on a split stage: unsplit, same residuals
        assert no_dx is None
        f = lambda p: _chunk_fn(p, tokens, *aux, first=True, last=True)
        ref_out, vjp = jax.vjp(f, params)
        return out, ref_out, dw, vjp(seed)[0], kept, cut, fused_dw

    out, ref_out, dw, ref_dw, kept, cut, fused_dw = run(params, tokens, aux, seed)
    _close(out, ref_out)
    _close(dw, ref_dw)
    _close(fused_dw, ref_dw)
    assert [(k.shape, k.dtype) for k in kept] == [(a.shape, a.dtype) for a in c.kept_avals]
    assert [(k.shape, k.dtype) for k in cut] == [(a.shape, a.dtype) for a in c.cut_avals]
    if policy == "full":  # W reads the cut only; per-layer cuts are stacked [L, ...]
        assert not any(c.w_reads_kept)
    assert any(a.shape[0] == 3 and a.shape[1:] == (B, T, 2 * D) for a in c.cut_avals)


@pytest.mark.parametrize("policy", ["none", "full"])
def test_chunk_split_inside_shard_map(policy):
    # The runtime traces and runs it inside its shard_map body, on per-device
    # (varying) values: each device's middle-stage chunk gradients equal its own
    # jax.vjp, traced in the same body.
    mesh = jax.make_mesh((2,), ("pipe",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:2])
    rng = np.random.default_rng(4)
    params = mlp_params(rng, 4)  # two layers per device
    x, dy = _w(rng, 2 * B, T, D, scale=1.0), _w(rng, 2 * B, T, D, scale=1.0)

    def body(lp, x, dy):
        c = ChunkSplit(mlp_layer, {"layers": lp}, x, policy=policy)
        assert c.has_dh
        _, kept = c.fwd({"layers": lp}, x)
        dx, cut = c.b({"layers": lp}, kept, dy)
        dw = c.w({"layers": lp}, kept, cut)["layers"]
        fused_dx, fused_dw = c.fused({"layers": lp}, kept, dy)
        ref = lambda p, h: _chunk_fn({"layers": p}, h, first=False, last=False)
        ref_dw, ref_dx = jax.vjp(ref, lp, x)[1](dy)
        return dx, dw, ref_dx, ref_dw, fused_dx, fused_dw["layers"]

    spec = P("pipe")
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec), out_specs=(spec,) * 6))
    dx, dw, ref_dx, ref_dw, fused_dx, fused_dw = f(params, x, dy)
    _close(dx, ref_dx)
    _close(dw, ref_dw)
    _close(fused_dx, ref_dx)
    _close(fused_dw, ref_dw)
