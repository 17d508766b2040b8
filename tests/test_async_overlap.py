# ruff: noqa: E501
"""The scheduled-HLO reading that the GPU overlap checks use (parallel/async_overlap.py),
on program text written the way XLA:GPU prints a scheduled module."""

from mindpipe_jax.parallel.async_overlap import async_pairs
from mindpipe_jax.parallel.collectives import collectives

# (long lines: XLA prints each instruction on one)
HLO = """HloModule jit_step, is_scheduled=true, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}

%body (p: (s32[], f32[64])) -> (s32[], f32[64]) {
  %p = (s32[], f32[64]{0}) parameter(0)
  %g = f32[64]{0} get-tuple-element((s32[], f32[64]{0}) %p), index=1
  %all-reduce-start.1 = f32[64]{0} all-reduce-start(f32[64]{0} %g), channel_id=1, replica_groups=[4,2]<=[8], to_apply=%add
  %fusion.7 = f32[64]{0} fusion(f32[64]{0} %g), kind=kLoop, calls=%fused
  %custom-call.2 = (f32[64]{0}, s8[16]{0}) custom-call(f32[64]{0} %fusion.7), custom_call_target="__cublas$gemm"
  %all-reduce-done.1 = f32[64]{0} all-reduce-done(f32[64]{0} %all-reduce-start.1)
  %collective-permute-start.3 = (f32[64]{0}, f32[64]{0}, u32[], u32[]) collective-permute-start(f32[64]{0} %g), channel_id=2, source_target_pairs={{0,1},{1,0}}
  %collective-permute-done.3 = f32[64]{0} collective-permute-done((f32[64]{0}, f32[64]{0}, u32[], u32[]) %collective-permute-start.3)
  %i = s32[] get-tuple-element((s32[], f32[64]{0}) %p), index=0
  ROOT %t = (s32[], f32[64]{0}) tuple(s32[] %i, f32[64]{0} %all-reduce-done.1)
}

%cond (c: (s32[], f32[64])) -> pred[] {
  %c = (s32[], f32[64]{0}) parameter(0)
  ROOT %lt = pred[] constant(true)
}

ENTRY %main (x: f32[64]) -> f32[64] {
  %x = f32[64]{0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[64]{0}) tuple(s32[] %zero, f32[64]{0} %x)
  %while = (s32[], f32[64]{0}) while((s32[], f32[64]{0}) %init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  %all-gather-start = (f32[8]{0}, f32[64]{0}) all-gather-start(f32[8]{0} %x), channel_id=3, replica_groups=[1,8]<=[8], dimensions={0}
  %all-gather-done = f32[64]{0} all-gather-done((f32[8]{0}, f32[64]{0}) %all-gather-start)
  ROOT %r = f32[64]{0} copy(f32[64]{0} %all-gather-done)
}
"""


def test_async_pairs_read_what_runs_between_start_and_done():
    pairs = {p.start: p for p in async_pairs(HLO)}
    assert set(pairs) == {"all-reduce-start.1", "collective-permute-start.3", "all-gather-start"}
    ar = pairs["all-reduce-start.1"]
    assert (ar.kind, ar.done, ar.computation) == ("all-reduce", "all-reduce-done.1", "body")
    assert ar.between == ("fusion", "custom-call") and ar.compute_between == 2
    assert pairs["collective-permute-start.3"].between == ()
    assert pairs["all-gather-start"].compute_between == 0
    # The same start names as the byte reading's, so the two can be joined.
    assert {op.name for op in collectives(HLO)} == set(pairs)


def test_names_without_percent_signs_are_read_too():
    text = HLO.replace("%", "")
    assert [p.between for p in async_pairs(text) if p.kind == "all-reduce"] == [("fusion", "custom-call")]
