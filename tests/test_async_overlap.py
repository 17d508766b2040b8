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


# XLA:GPU in jax 0.11 wraps an asynchronous collective in a generic async pair whose called
# computation's root is the collective (from a scheduled AFAPAB step compiled for 8 mock GPUs).
HLO_WRAPPED = """HloModule jit_run, is_scheduled=true, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}

%async_computation (param_0.3216: f32[2,256]) -> f32[2,256] {
  %param_0.3216 = f32[2,256]{1,0} parameter(0)
  ROOT %all-reduce.2.2 = f32[2,256]{1,0} all-reduce(%param_0.3216), channel_id=4, replica_groups=[4,2]<=[8], use_global_device_ids=true, to_apply=%add, frontend_attributes={is_spmd_generated="true"}
}

%copy_computation (param_0.1: f32[2,256]) -> f32[2,256] {
  %param_0.1 = f32[2,256]{1,0} parameter(0)
  ROOT %copy.1 = f32[2,256]{1,0} copy(%param_0.1)
}

ENTRY %main (x: f32[2,256]) -> f32[2,256] {
  %x = f32[2,256]{1,0} parameter(0)
  %all-reduce-start = ((f32[2,256]{1,0}), f32[2,256]{1,0}) async-start(%x), output_to_operand_aliasing={{1}: (0, {})}, calls=%async_computation, frontend_attributes={is_spmd_generated="true"}, backend_config={"collective_backend_config":{"is_sync":false}}
  %copy-start = ((f32[2,256]{1,0}), f32[2,256]{1,0}) async-start(%x), calls=%copy_computation
  %fusion.1 = f32[2,256]{1,0} fusion(%x), kind=kLoop, calls=%fused
  %custom-call.3 = (f32[2,256]{1,0}, s8[16]{0}) custom-call(%fusion.1), custom_call_target="__cublas$gemm"
  %copy-done = f32[2,256]{1,0} async-done(%copy-start)
  %all-reduce-done = f32[2,256]{1,0} async-done(%all-reduce-start), frontend_attributes={is_spmd_generated="true"}
  ROOT %r = f32[2,256]{1,0} add(%all-reduce-done, %copy-done)
}
"""


def test_generic_async_pairs_wrapping_a_collective_are_read():
    pairs = async_pairs(HLO_WRAPPED)
    assert len(pairs) == 1  # the async copy is no collective
    (p,) = pairs
    assert (p.kind, p.start, p.done, p.computation) == ("all-reduce", "all-reduce-start", "all-reduce-done", "main")
    assert p.between == ("async-start", "fusion", "custom-call", "async-done") and p.compute_between == 2
    # joined with the byte reading by the wrapped collective's name, which it counts once
    (op,) = collectives(HLO_WRAPPED)
    assert (op.name, op.count, op.groups) == (p.collective, 1, ((0, 1), (2, 3), (4, 5), (6, 7)))

