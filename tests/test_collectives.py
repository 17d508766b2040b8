"""Bytes sent per device, read from compiled programs whose collectives are known."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from mindpipe_jax.parallel.collectives import _groups, axes_of, bytes_sent, collectives, per_device_bytes


def _mesh(shape, names):
    return Mesh(np.asarray(jax.devices()[:int(np.prod(shape))]).reshape(shape), names,
                axis_types=(AxisType.Auto,) * len(names))


def _hlo(fn, mesh, in_spec, out_spec, *args):
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_spec, out_specs=out_spec))
    return f.lower(*args).compile().as_text()


X = np.ones((8 * 1024,), np.float32)  # 1024 fp32 = 4096 bytes per device on 8 devices


def test_all_reduce_sends_twice_n_times_g_minus_1_over_g():
    hlo = _hlo(lambda x: lax.psum(x, "x"), _mesh((8,), ("x",)), P("x"), P("x"), X)
    ops = collectives(hlo)
    assert [op.kind for op in ops] == ["all-reduce"]
    assert ops[0].groups == (tuple(range(8)),)
    assert bytes_sent(hlo) == 2 * 4096 * 7 / 8


def test_all_gather_reduce_scatter_and_all_to_all_send_n_g_minus_1_over_g():
    mesh = _mesh((2, 4), ("a", "x"))
    gather = _hlo(lambda x: lax.all_gather(x, "x", tiled=True, to="invarying"), mesh, P(("a", "x")),
                  P("a"), X)
    assert bytes_sent(gather) == 4 * 4096 * 3 / 4  # gathers 4 pieces of 4096 bytes
    scatter = _hlo(lambda x: lax.psum_scatter(x, "x", tiled=True), mesh, P(("a", "x")), P(("a", "x")), X)
    assert [op.kind for op in collectives(scatter)] == ["reduce-scatter"]
    assert bytes_sent(scatter) == 4096 * 3 / 4
    a2a = _hlo(lambda x: lax.all_to_all(x.reshape(4, -1), "x", 0, 0, tiled=True).reshape(-1), mesh,
               P(("a", "x")), P(("a", "x")), X)
    assert [op.kind for op in collectives(a2a)] == ["all-to-all"]
    assert bytes_sent(a2a) == 4096 * 3 / 4
    # Groups along x: {0..3}, {4..7}; axes_of names the mesh axis they span.
    ids = np.arange(8).reshape(2, 4)
    assert collectives(scatter)[0].groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert axes_of(collectives(scatter)[0], ids, ("a", "x")) == {"x"}


def test_collective_permute_sends_its_operand_from_each_source_only():
    pairs = [(i, i + 1) for i in range(7)]  # not cyclic: device 7 sends nothing
    hlo = _hlo(lambda x: lax.ppermute(x, "x", pairs), _mesh((8,), ("x",)), P("x"), P("x"), X)
    (op,) = collectives(hlo)
    assert op.kind == "collective-permute" and set(op.pairs) == set(pairs)
    sent = per_device_bytes([op], 8)
    assert sent == {**{d: 4096.0 for d in range(7)}, 7: 0.0}


def test_ops_in_a_loop_count_once_per_trip():
    def body(x):
        return lax.fori_loop(0, 5, lambda i, c: lax.pcast(lax.psum(c, "x"), "x", to="varying") * 0.5, x)

    hlo = _hlo(body, _mesh((8,), ("x",)), P("x"), P("x"), X)
    (op,) = collectives(hlo)
    assert op.count == 5 and op.trip_count_known
    assert bytes_sent(hlo) == 5 * 2 * 4096 * 7 / 8


def test_a_branch_tagged_with_its_runs_counts_that_often():
    """A ppermute in a ``switch`` branch that 2 of a loop's 6 iterations take: untagged it
    is counted every iteration (an upper bound, ``in_branch``); under ``runs_tag(2, 6)``
    exactly twice, as the pipeline runtime's ring steps are."""
    from mindpipe_jax.parallel.collectives import runs_tag

    ring = [(i, (i + 1) % 8) for i in range(8)]
    which = jnp.asarray([0, 1, 0, 0, 1, 0])

    def program(tag):
        # Two sizes: the tests' persistent compilation cache keys programs without their
        # metadata, so the same program with and without the tag would be one executable.
        x = X if tag else X[:4096]

        def send(x):
            if tag:
                with jax.named_scope(runs_tag(2, 6)):
                    return lax.ppermute(x, "x", ring)
            return lax.ppermute(x, "x", ring)

        def body(x):
            step = lambda c, t: (lax.switch(which[t], [lambda y: y, send], c) * 0.5, None)  # noqa: E731
            return lax.scan(step, x, jnp.arange(6))[0]
        return _hlo(body, _mesh((8,), ("x",)), P("x"), P("x"), x)

    (untagged,) = collectives(program(False))
    assert untagged.count == 6 and untagged.in_branch
    (tagged,) = collectives(program(True))
    assert tagged.count == 2 and not tagged.in_branch
    assert bytes_sent(program(True)) == 2 * 4096


def test_the_bytes_are_the_compiled_dtypes():
    mesh = _mesh((8,), ("x",))
    gather = lambda x: lax.all_gather(x, "x", tiled=True, to="invarying")  # noqa: E731
    fp32 = bytes_sent(_hlo(gather, mesh, P("x"), P(), X))
    assert bytes_sent(_hlo(gather, mesh, P("x"), P(), X.astype(jnp.uint16))) == fp32 / 2
    # Read from the program, not from the source: XLA:CPU widens bf16 collectives to fp32
    # (0.10.2 does), so a bf16 gather there is counted at whatever width it was compiled to.
    hlo = _hlo(gather, mesh, P("x"), P(), X.astype(jnp.bfloat16))
    (op,) = collectives(hlo)
    assert bytes_sent(hlo) == fp32 * {"bf16": 0.5, "f32": 1.0}[op.shapes[0][0]]


def test_async_pairs_count_once_and_loops_multiply():
    # The GPU form: *-start / *-done pairs, a while loop with XLA's known trip count.
    hlo = """HloModule m, num_partitions=4

%body (p: (s32[], f32[256])) -> (s32[], f32[256]) {
  %p = (s32[], f32[256]{0}) parameter(0)
  %x = f32[256]{0} get-tuple-element(%p), index=1
  %ags = (f32[64]{0}, f32[256]{0}) all-gather-start(%y), channel_id=1, replica_groups=[1,4]<=[4], dimensions={0}
  %agd = f32[256]{0} all-gather-done(%ags)
  %cps = (f32[256]{0}, f32[256]{0}, u32[], u32[]) collective-permute-start(%x), channel_id=2, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %cpd = f32[256]{0} collective-permute-done(%cps)
  ROOT %t = (s32[], f32[256]{0}) tuple(%i, %cpd)
}

%cond (p: (s32[], f32[256])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[256]) -> f32[256] {
  %a = f32[256]{0} parameter(0)
  %w = (s32[], f32[256]{0}) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %ars = f32[256]{0} all-reduce-start(%a), channel_id=3, replica_groups={{0,1},{2,3}}, to_apply=%add
  ROOT %ard = f32[256]{0} all-reduce-done(%ars)
}
"""  # noqa: E501
    ops = {op.kind: op for op in collectives(hlo)}
    assert sorted(ops) == ["all-gather", "all-reduce", "collective-permute"]
    assert ops["all-gather"].count == ops["collective-permute"].count == 3 and ops["all-reduce"].count == 1
    assert ops["all-gather"].result_bytes == 1024 and ops["collective-permute"].result_bytes == 1024
    # per trip: all-gather 1024 * 3/4, permute 1024; once: all-reduce 2 * 1024 * 1/2
    assert bytes_sent(hlo, device=0) == 3 * (768 + 1024) + 1024


@pytest.mark.parametrize("text,groups", [
    ("replica_groups={{0,2},{1,3}}", ((0, 2), (1, 3))),
    ("replica_groups=[2,2]<=[4]", ((0, 1), (2, 3))),
    ("replica_groups=[2,2]<=[2,2]T(1,0)", ((0, 2), (1, 3))),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=2] {'axis_0'}", ((0, 2), (1, 3))),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=2], device_ids=([2,2]T(1,0)) {'axis_1'}", ((0, 2), (1, 3))),
    ("replica_groups={}", ((0, 1, 2, 3),)),
])
def test_replica_group_forms(text, groups):
    assert _groups(f"%x = f32[4] all-reduce(%y), {text}, to_apply=%add", 4) == groups
