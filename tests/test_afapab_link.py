"""AFAPAB's communication model: the collectives the runtime issues (``simcomm``),
their α–β costs and replay, the cluster prediction (``simcluster``), the lanes
picture, and ``benchmarks/afapab.py --smoke`` end to end (a rate-limited network
namespace, two Gloo processes). The smoke test checks that every figure is
finite and printed, not how close the predictions are: that depends on the load
of the machine and is the benchmark's figure."""

from __future__ import annotations

import math
import re
import subprocess
from pathlib import Path

import pytest
from two_procs import run_smoke

from mindpipe_jax.errors import ConfigError
from mindpipe_jax.parallel.pipeline import get_schedule
from mindpipe_jax.parallel.pipeline.schedules.sync import sync_points
from mindpipe_jax.sim import cluster as simcluster
from mindpipe_jax.sim.cluster import (
    GPT3_2_7B,
    GPT3_13B,
    H100_400G,
    V100_CLOUD,
    Layout3D,
    layer_cost,
    memory_per_gpu,
    predict,
    step_lower_bound,
)
from mindpipe_jax.sim.comm import (
    RingGeometry,
    collective_time,
    fit_collective,
    simulate_sync,
    sync_ops,
)
from mindpipe_jax.sim.layout_search import _refused, candidates, search
from mindpipe_jax.sim.network import Link

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "afapab.py"


@pytest.mark.parametrize("n,d,bucket", [(1000, 2, None), (1000, 4, 1000), (12345, 3, 4096), (7, 8, 16)])
def test_ring_geometry_is_ringsyncs(n, d, bucket):
    from mindpipe_jax.parallel.pipeline.runtime.ringsync import RingSync

    ring, geo = RingSync(n, ("data",), d, bucket), RingGeometry(n, d, bucket)
    assert (geo.buckets, geo.piece, geo.scatter_steps, geo.num_steps) == \
        (ring.buckets, ring.piece, ring.scatter_steps, ring.num_steps)


def test_end_sync_is_one_all_reduce_per_leaf_after_the_last_tick():
    sched = get_schedule("afapab", 2, 4, 2)
    ops = sync_ops(sched, [[10, 20], [30]], 4, "end", end_elems=[5, 6])
    last = sched.num_ticks - 1
    assert all(op.kind == "all-reduce" and not op.beside and op.tick == last for op in ops)
    data = [op.nbytes for op in ops if op.axis == "data"]
    pipe = [op.nbytes for op in ops if op.axis == "pipe"]
    assert sorted(data) == sorted(4.0 * n for n in (10, 20, 30, 1, 5, 6))   # + the loss
    assert sorted(pipe) == [4.0, 20.0, 24.0]                                 # loss, embed, head over pipe


def test_overlap_sync_all_reduces_each_chunk_at_its_sync_point():
    # Megatron's overlapped reduction as the runtime issues it: at the chunk's sync point,
    # one all-reduce per leaf between two loop segments (replayed blocking), no ring.
    sched = get_schedule("afapab", 2, 4, 2)
    ops = sync_ops(sched, [[10, 20], [30]], 4, "overlap")
    at = {sp.chunk: sp.after_tick for sp in sync_points(sched, "overlap")}
    assert at == {sp.chunk: sp.after_tick for sp in sync_points(sched, "chunk")}
    assert at[1] < sched.num_ticks - 1  # chunk 1 finishes before the last tick
    assert all(op.kind == "all-reduce" and not op.beside for op in ops)
    for c, leaves in ((0, [10, 20]), (1, [30])):
        mine = [op for op in ops if op.chunks == (c,)]
        assert [op.nbytes for op in mine] == [4.0 * n for n in leaves] and {op.tick for op in mine} == {at[c]}


def test_chunk_sync_rings_beside_the_ticks_after_the_sync_point():
    p, m, v, d = 1, 8, 2, 2
    sched = get_schedule("afapab", p, m, v)
    elems, bucket = 1000, 1000   # 4 buckets of 250 elements: 4 ring steps + 4 all-gathers
    ops = sync_ops(sched, [elems, elems], d, "chunk", bucket_bytes=bucket)
    first = {sp.chunk: sp.after_tick for sp in sync_points(sched, "chunk")}[v - 1]
    beside = [op for op in ops if op.beside]
    geo = RingGeometry(elems, d, bucket)
    assert [op.tick for op in beside] == list(range(first + 1, first + 1 + geo.num_steps))
    assert [op.kind for op in beside] == ["ring-step"] * geo.scatter_steps + ["all-gather"] * geo.buckets
    assert all(op.chunks == (v - 1,) for op in beside)
    # Chunk 0 finishes at the last tick: all-reduced after it.
    assert [op.nbytes for op in ops if op.chunks == (0,)] == [4.0 * elems]
    # Too few ticks left: the rest of the ring runs back to back at the next sync point.
    short = sync_ops(get_schedule("afapab", p, 2, v), [elems, elems], d, "chunk", bucket_bytes=bucket)
    assert sum(op.beside for op in short) == 2
    assert sum(op.kind != "all-reduce" for op in short) == geo.num_steps
    with pytest.raises(ConfigError):
        sync_ops(sched, [elems], d, "chunk")


def test_blocking_replay_adds_every_collective_and_overlap_hides_the_ring():
    sched = get_schedule("afapab", 1, 8, 2)
    link = Link(1e-4, 1e8)
    costs = {"F": 0.01, "BW": 0.02}
    kw = dict(data_ranks=2, dp_link=link, chunk_elems=[200_000, 200_000], bucket_bytes=200_000)
    compute = simulate_sync(sched, costs, **{**kw, "data_ranks": 1}).step_time
    assert compute == pytest.approx(8 * (0.01 + 0.02) * 2)
    for mode in ("end", "chunk"):
        ops = sync_ops(sched, kw["chunk_elems"], 2, mode, bucket_bytes=kw["bucket_bytes"])
        total = sum(collective_time(op.kind, op.nbytes, 2, link) for op in ops)
        blocking = simulate_sync(sched, costs, grad_sync=mode, **kw)
        assert blocking.step_time == pytest.approx(compute + total)
        syncs = [e for e in blocking.events if e.kind == "sync"]
        assert len(syncs) == len(ops) and blocking.network_busy[0] == pytest.approx(total)
    # Each ring step (2 ms) is shorter than a backward tick (20 ms): with a communication
    # stream the ring costs nothing and only chunk 0's all-reduce (after the loop) remains.
    overlap = simulate_sync(sched, costs, grad_sync="chunk", overlap=True, **kw)
    tail = collective_time("all-reduce", 800_000, 2, link) + collective_time("all-reduce", 4, 2, link)
    assert overlap.step_time == pytest.approx(compute + tail)
    assert overlap.step_time < simulate_sync(sched, costs, grad_sync="end", overlap=True, **kw).step_time


def test_overlap_replay_runs_the_early_all_reduce_behind_the_remaining_ticks():
    """"overlap" with a communication stream: chunk 1's all-reduces, issued at its sync
    point between two loop segments, run behind the remaining ticks; the step then ends
    with chunk 0's (after the loop). Blocking, every all-reduce adds to the step."""
    sched = get_schedule("afapab", 1, 8, 2)
    link = Link(1e-4, 1e8)
    costs = {"F": 0.01, "BW": 0.02}
    kw = dict(data_ranks=2, dp_link=link, chunk_elems=[200_000, 200_000])
    compute = simulate_sync(sched, costs, **{**kw, "data_ranks": 1}).step_time
    ops = sync_ops(sched, kw["chunk_elems"], 2, "overlap")
    total = sum(collective_time(op.kind, op.nbytes, 2, link) for op in ops)
    assert simulate_sync(sched, costs, grad_sync="overlap", **kw).step_time == pytest.approx(compute + total)
    early = collective_time("all-reduce", 800_000, 2, link)   # chunk 1's, 16 ms: behind 8 backward ticks
    overlapped = simulate_sync(sched, costs, grad_sync="overlap", overlap=True, **kw)
    assert overlapped.step_time == pytest.approx(compute + total - early)
    end = simulate_sync(sched, costs, grad_sync="end", overlap=True, **kw)
    assert overlapped.step_time < end.step_time == pytest.approx(compute + total)
    # The stream is one lane: an early all-reduce longer than the ticks left delays the end's.
    slow = dict(kw, dp_link=Link(1e-4, 2e6))
    t_slow = simulate_sync(sched, costs, grad_sync="overlap", overlap=True, **slow).step_time
    left = 8 * 0.02   # chunk 0's backwards after chunk 1's sync point
    early_slow = collective_time("all-reduce", 800_000, 2, slow["dp_link"])
    tail = sum(collective_time(op.kind, op.nbytes, 2, slow["dp_link"]) for op in ops) - early_slow
    assert t_slow == pytest.approx(compute - left + early_slow + tail)


@pytest.mark.parametrize("kind", ["ring-step", "all-gather", "all-reduce"])
def test_fit_collective_recovers_the_link(kind):
    link = Link(250e-6, 1.5e8)
    sizes = [2**18, 2**20, 2**22, 2**24]
    fitted = fit_collective(kind, 2, sizes, [collective_time(kind, n, 2, link) for n in sizes])
    assert fitted.latency_s == pytest.approx(link.latency_s, rel=1e-6)
    assert fitted.bandwidth_Bps == pytest.approx(link.bandwidth_Bps, rel=1e-6)
    with pytest.raises(ConfigError):
        fit_collective("broadcast", 2, sizes, sizes)


def test_cluster_prediction():
    shape = GPT3_2_7B
    # Megatron-LM's FLOP count = 4 passes of every layer (F, recompute, 2 x backward) + 3 of the logits.
    b = 3
    passes = 4 * shape.layers * shape.layer_flops(b) + 3 * shape.logit_flops(b)
    assert shape.step_flops(b) == pytest.approx(passes)
    layout = Layout3D(t=4, p=2, d=8, v=2)
    plain, tp = layer_cost(shape, V100_CLOUD, layout)
    cm, tp_cm = layer_cost(shape, V100_CLOUD, layout, tp_overlap=True)
    assert 0 < tp_cm < tp and cm.BW < plain.BW
    # Six all-reduces per layer: two in the forward, four in the backward (with the recompute).
    assert plain.BW - 3 * (plain.F - tp / 3) == pytest.approx(tp * 2 / 3)
    meg, afapab = (predict(shape, V100_CLOUD, layout, s) for s in ("megatron", "afapab"))
    # The same compute: the gap is the sync AFAPAB hides.
    assert afapab.tflops_per_gpu > meg.tflops_per_gpu
    assert meg.step_s - meg.compute_s == pytest.approx(meg.dp_sync_s, rel=0.02)
    assert afapab.step_s - afapab.compute_s < 0.75 * meg.dp_sync_s
    # No data parallelism: nothing to sync, nothing exposed.
    solo = predict(shape, V100_CLOUD, Layout3D(t=4, p=2, d=1, v=2, global_batch=64), "afapab")
    assert solo.dp_sync_s == 0 and solo.step_s == pytest.approx(solo.compute_s)
    with pytest.raises(ConfigError):
        predict(shape, V100_CLOUD, Layout3D(t=4, p=3, d=1), "megatron")   # 32 layers, 6 stages


def test_megatron_overlap_prediction():
    layout = Layout3D(t=4, p=2, d=8, v=2)
    end, over, afapab = (predict(GPT3_2_7B, V100_CLOUD, layout, s)
                         for s in ("megatron", "megatron-overlap", "afapab"))
    # the same compute in all three; --overlap-grad-reduce hides part of what "end" exposes
    assert end.compute_s <= over.compute_s and over.step_s < end.step_s
    assert end.sim.busy == over.sim.busy and afapab.sim.busy == pytest.approx(end.sim.busy)
    # Megatron's bucket: max(40M, 1M x d) elements (d = 8: 40M), grad_bytes each
    assert simcluster.megatron_bucket_elems(layout) == 40e6
    assert simcluster.megatron_bucket_elems(Layout3D(t=1, p=1, d=64)) == 64e6
    syncs = [e for e in over.sim.events if e.kind == "sync"]
    assert max(e.nbytes for e in syncs) <= 40e6 * 4
    # distributed optimizer: bf16 weights gathered, half the bytes of the fp32 gradient slices
    (gather,) = {e.nbytes for e in syncs if e.start == 0.0 and e.device == 0} or {None}
    assert gather is not None and gather <= 40e6 * 2


def test_gradient_bytes_per_element_scale_the_sync():
    layout4 = Layout3D(t=4, p=2, d=8, v=2)                     # the runtime's fp32 default
    layout2 = Layout3D(t=4, p=2, d=8, v=2, grad_bytes=2.0)     # bf16 on the wire
    for schedule in ("megatron", "afapab"):
        a, b = (predict(GPT3_2_7B, V100_CLOUD, lay, schedule) for lay in (layout4, layout2))
        # ring time = steps x (alpha + bytes / bw): the bytes halve, the alphas stay
        assert b.dp_sync_s < a.dp_sync_s and b.dp_sync_s == pytest.approx(a.dp_sync_s / 2, rel=0.02)
    # per GPU and layer: its own tensor shard, grad_bytes per element
    (layer_cost4, _), (layer_cost2, _) = (layer_cost(GPT3_2_7B, V100_CLOUD, lay)
                                          for lay in (layout4, layout2))
    assert layer_cost4.param_bytes == pytest.approx(GPT3_2_7B.layer_params / 4 * 4)
    assert layer_cost2.param_bytes == pytest.approx(layer_cost4.param_bytes / 2)


def test_memory_model():
    layout = Layout3D(t=8, p=4, d=2, v=2, microbatch=1)
    sched = simcluster._schedule("megatron-overlap", layout)
    shape = GPT3_13B
    params = (40 / 4 * shape.layer_params + (shape.vocab + shape.seq_len) * shape.hidden) / 8
    act = max(sched.peak_live_activations()) * 2048 * 5120 * 2
    work = 2048 * 5120 * (10 + 24 / 8 + 5 * 40 * 2048 / (5120 * 8)) + 8 * 2048 * 51200 / 8
    assert memory_per_gpu(shape, layout, "megatron-overlap", sched) == \
        pytest.approx((6 + 12 / 2) * params + act + work)
    assert memory_per_gpu(shape, layout, "megatron", sched) == pytest.approx(18 * params + act + work)
    # AFAPAB holds every microbatch's stage inputs (all forwards first): more than interleaved 1F1B
    af = simcluster._schedule("afapab", layout)
    assert max(af.peak_live_activations()) == layout.microbatches * layout.v
    assert memory_per_gpu(shape, layout, "afapab", af) > memory_per_gpu(shape, layout, "megatron", sched)


def test_step_lower_bound_never_exceeds_the_simulated_step():
    for cluster, shape in ((V100_CLOUD, GPT3_2_7B), (H100_400G, GPT3_13B)):
        for layout in candidates(shape, cluster, 16, microbatches=(1, 4), vs=(1, 2))[::3]:
            for schedule in simcluster.SCHEDULES:
                if _refused(schedule, layout):
                    continue
                for cm in (False, True):
                    lb = step_lower_bound(shape, cluster, layout, schedule, tp_overlap=cm)
                    step = predict(shape, cluster, layout, schedule, tp_overlap=cm).step_s
                    assert 0 < lb <= step * (1 + 1e-9), (layout, schedule, cm)


@pytest.mark.parametrize("schedule", ["megatron-overlap", "afapab"])
def test_search_finds_what_simulating_every_layout_finds(schedule):
    kw = dict(microbatches=(1, 2), vs=(1, 2, 4), global_batch=64)
    found = search(GPT3_2_7B, V100_CLOUD, 16, schedule, **kw)
    usable = V100_CLOUD.usable_fraction * V100_CLOUD.memory_bytes
    every = [predict(GPT3_2_7B, V100_CLOUD, lay, schedule)
             for lay in candidates(GPT3_2_7B, V100_CLOUD, 16, **kw) if not _refused(schedule, lay)]
    fitting = [r for r in every if r.memory_bytes <= usable]
    best = min(fitting, key=lambda r: r.step_s)
    assert found.best.step_s == pytest.approx(best.step_s) and found.best.fits
    assert found.candidates == len(every) and found.simulated < len(fitting)   # the bound pruned some
    with pytest.raises(ConfigError):
        search(GPT3_2_7B, V100_CLOUD, 16, "gpipe")


@pytest.mark.slow
def test_program_bytes_per_element_is_the_wire_dtype():
    # Two compiles of the pipe2 x data2 x tensor2 AFAPAB step (~20 s each on 2 cores).
    # The data-axis bytes over the gradient elements (d = 2: a ring all-reduce sends one
    # buffer) are the wire's bytes per element: 4 for fp32, 2 for bf16.
    from mindpipe_jax.sim.program_bytes import measure_grad_bytes_per_element

    fp32 = measure_grad_bytes_per_element("fp32", "end", dims=dict(m=2))
    bf16 = measure_grad_bytes_per_element("bf16", "end", dims=dict(m=2))
    assert fp32["grad_elements"] == bf16["grad_elements"] > 10_000
    assert fp32["bytes_per_element"] == pytest.approx(4.0, rel=0.10)
    assert bf16["bytes_per_element"] == pytest.approx(2.0, rel=0.10)


def test_lanes_picture(tmp_path):
    pytest.importorskip("matplotlib")
    from mindpipe_jax import viz

    layout = Layout3D(t=4, p=2, d=8, v=2, global_batch=32)
    sims = [predict(GPT3_2_7B, V100_CLOUD, layout, s).sim for s in ("megatron", "afapab")]
    path = viz.draw_lanes(sims, tmp_path / "lanes.png", titles=["Megatron", "AFAPAB"])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ConfigError):
        viz.draw_lanes(sims, tmp_path / "lanes.txt")


# ------------------------------------------------------------------ end to end
def _namespaces() -> set[str]:
    try:
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return set()
    return {line.split()[0] for line in out.splitlines() if line.strip()}


@pytest.mark.slow
def test_smoke_run_prints_measured_and_predicted(tmp_path):
    before = _namespaces()
    # Hard limits: the workers (--timeout-s) and the whole script (start-up, two
    # processes, four small compiles each, the probes and the scale table).
    text = run_smoke(SCRIPT, tmp_path / "smoke.txt", worker_timeout_s=75, timeout_s=90)
    assert "rate-limited by `tc qdisc add dev lo root tbf rate 2gbit" in text or "UNTHROTTLED" in text
    assert not {n for n in _namespaces() - before if n.startswith("mpafapab")}, "namespace left behind"

    link = re.search(r"fitted link: alpha (\S+) us per message, bandwidth (\S+) Gbit/s", text)
    assert link and all(math.isfinite(float(x)) for x in link.groups()), text
    rows = {}
    row = re.compile(r"\s+(compute only|end|overlap|chunk)\s+([\d.]+)\s+[\d.]+-[\d.]+\s+([\d.]+)"
                     r"\s+([+-][\d.]+)%")
    for line in text.splitlines():
        found = row.match(line)
        if found:
            rows[found.group(1)] = [float(x) for x in found.groups()[1:]]
    assert set(rows) == {"compute only", "end", "overlap", "chunk"}, text
    for name, (measured, predicted, err) in rows.items():
        assert measured > 0 and predicted > 0 and math.isfinite(err), (name, rows)
    scale = [line for line in text.splitlines() if re.match(r"\s+GPT-3 2\.7B\s+64\s", line)]
    assert len(scale) == 4, text
    for line in scale:
        label = r"(?:Megatron-overlap|AFAPAB)(?: \+ CM)?"
        tflops = float(re.search(label + r"\s+[\d.]+\s+([\d.]+)", line).group(1))
        assert 0 < tflops < 125, line


def test_bf16_sync_ops_carry_half_the_gradient_bytes():
    sched = get_schedule("afapab", 2, 4, 2)
    for mode in ("end", "chunk"):
        fp32 = sync_ops(sched, [1000, 1000], 2, mode, end_elems=[64])
        bf16 = sync_ops(sched, [1000, 1000], 2, mode, end_elems=[64], elem_bytes=2)
        loss = [op for op in fp32 if op.nbytes == 4.0]
        assert [op.nbytes for op in bf16 if op not in loss and op.axis == "data"] == \
            [op.nbytes / 2 for op in fp32 if op not in loss and op.axis == "data"]
