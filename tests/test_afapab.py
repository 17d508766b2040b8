"""AFAPAB: the schedule, chunk-wise gradient sync hidden in the tick loop, 3D meshes."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from pipeline_oracle import assert_matches, microbatches, reference, tiny_gpt

from mindpipe_jax.config import ParallelConfig
from mindpipe_jax.parallel.mesh import make_mesh
from mindpipe_jax.parallel.pipeline import Kind, get_schedule
from mindpipe_jax.parallel.pipeline.contract import stage_fns
from mindpipe_jax.parallel.pipeline.runtime import pipeline_grads
from mindpipe_jax.parallel.pipeline.schedules.sync import last_backward_ticks, sync_points


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 4, 3)])
def test_afapab_runs_all_forwards_then_all_backwards_chunk_by_chunk(p, m, v):
    sched = get_schedule("afapab", p, m, v)
    for s in range(p):
        kinds = [task.kind for _, task in sched.tasks_of(s)]
        assert kinds == [Kind.F] * (m * v) + [Kind.BW] * (m * v)
        chunks = [task.chunk for _, task in sched.tasks_of(s) if task.kind is Kind.BW]
        assert chunks == sorted(chunks, reverse=True)  # chunk v-1 first, chunk 0 last
    assert sched.num_ticks == 2 * (v * m + p - 1) or m < p
    # Chunk c's sync can start with (c) chunk-rounds of backwards still to run.
    points = sync_points(sched, "chunk")
    assert [sp.chunk for sp in points] == list(reversed(range(v)))
    last = last_backward_ticks(sched)
    for sp in points:
        assert sp.after_tick == last[sp.chunk]
        assert sched.num_ticks - 1 - sp.after_tick >= sp.chunk * m
    assert all(sp.after_tick == sched.num_ticks - 1 for sp in sync_points(sched, "end"))


MESHES = {"pipe2xtensor2xdata2": dict(pipe=2, tensor=2, data=2),
          "pipe2xdata4": dict(pipe=2, tensor=1, data=4)}


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1),
                                    ("afapab", 2)])
def test_every_schedule_on_3d_meshes_matches_unpipelined(mesh_name, name, v):
    # Chunk-wise sync (the AFAPAB mechanism) on every schedule; "end" is covered by
    # test_pipeline_runtime.py.
    p, m = 2, 4
    model, params = tiny_gpt(p * v)
    inputs, targets = microbatches(7, m)
    ref_loss, ref_grads = reference(model, params, inputs, targets)
    mesh = make_mesh(ParallelConfig(**MESHES[mesh_name]))
    run = pipeline_grads(stage_fns(model), get_schedule(name, p, m, v), mesh, remat="dots",
                         nan_bubbles=True, grad_sync="chunk", sync_bucket_bytes=16_000)
    with jax.set_mesh(mesh):
        loss, grads = jax.jit(run)(params["embed"], params["blocks"], params["head"], inputs, targets)
    assert_matches(loss, grads, ref_loss, ref_grads)


def _afapab_program(p=2, m=8, v=2, data=4, bucket=None):
    model, params = tiny_gpt(p * v)
    inputs, targets = microbatches(1, m)
    mesh = make_mesh(ParallelConfig(pipe=p, tensor=1, data=data))
    run = pipeline_grads(stage_fns(model), get_schedule("afapab", p, m, v), mesh, remat="full",
                         grad_sync="chunk", sync_bucket_bytes=bucket)
    with jax.set_mesh(mesh):
        compiled = jax.jit(run).lower(params["embed"], params["blocks"], params["head"],
                                      inputs, targets).compile()
    return compiled.as_text(), mesh


def _computations(hlo: str) -> dict[str, str]:
    out = {}
    for block in re.split(r"\n(?=\S)", hlo):
        match = re.match(r"(?:ENTRY )?%?([\w.\-]+)", block)
        if match:
            out[match.group(1)] = block
    return out


def _data_ring_pairs(mesh) -> set[tuple[int, int]]:
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    axis = mesh.axis_names.index("data")
    moved = np.moveaxis(ids, axis, -1).reshape(-1, mesh.shape["data"])
    return {(int(r[i]), int(r[(i + 1) % len(r)])) for r in moved for i in range(len(r))}


def test_early_chunk_sync_runs_inside_the_remaining_backward_loop():
    """The compiled program: chunk 1's gradient ring (collective-permutes along the
    data axis, then an all-gather over it) sits in the body of the loop that runs
    chunk 0's backwards, i.e. before the last backward computations; the step has
    no data-axis all-reduce of block gradients after the loop."""
    # Two buckets: 2 x 3 reduce-scatter ticks, then 2 all-gather ticks, all within the
    # 9 ticks left after chunk 1's last backward (m = 8 chunk-0 backwards + p - 1).
    model, params = tiny_gpt(4)
    layer_bytes = sum(x[0].size * x.dtype.itemsize for x in jax.tree.leaves(params["blocks"]))
    hlo, mesh = _afapab_program(bucket=layer_bytes // 2 + 64)
    comps = _computations(hlo)
    entry = next(b for b in comps.values() if b.startswith("ENTRY"))
    ring = _data_ring_pairs(mesh)

    def pairs(line):
        found = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
        return {tuple(map(int, x.split(","))) for x in re.findall(r"\{(\d+,\d+)", found.group(1))} \
            if found else set()

    loops = [re.search(r"body=%?([\w.\-]+)", line).group(1)
             for line in entry.splitlines() if re.search(r"\bwhile\(", line)]
    assert len(loops) >= 2, "the tick loop should be split at chunk 1's sync point"

    def ring_ops(body_name):
        body = comps[body_name]
        steps = [ln for ln in body.splitlines() if "collective-permute(" in ln and pairs(ln) == ring]
        gathers = [ln for ln in body.splitlines() if "all-gather(" in ln]
        return steps, gathers

    found = [ring_ops(b) for b in loops]
    with_ring = [i for i, (steps, gathers) in enumerate(found) if steps or gathers]
    assert with_ring, "no data-axis ring step inside any tick loop"
    assert any(found[i][0] for i in with_ring) and any(found[i][1] for i in with_ring)
    # Those loops also run backward ticks: the pipeline's two transfers are there too.
    for i in with_ring:
        lines = comps[loops[i]].splitlines()
        assert sum("collective-permute(" in ln and pairs(ln) != ring for ln in lines) == 2


def test_megatron_style_sync_has_no_ring():
    model, params = tiny_gpt(4)
    inputs, targets = microbatches(1, 8)
    mesh = make_mesh(ParallelConfig(pipe=2, tensor=1, data=4))
    run = pipeline_grads(stage_fns(model), get_schedule("afapab", 2, 8, 2), mesh, remat="full",
                         grad_sync="end")
    with jax.set_mesh(mesh):
        hlo = jax.jit(run).lower(params["embed"], params["blocks"], params["head"], inputs,
                                 targets).compile().as_text()
    entry = next(b for b in _computations(hlo).values() if b.startswith("ENTRY"))
    assert sum(bool(re.search(r"\bwhile\(", ln)) for ln in entry.splitlines()) == 1
    ring = {f"{{{a},{b}}}" for a, b in _data_ring_pairs(mesh)}
    assert not any("collective-permute(" in ln and any(r in ln for r in ring) for ln in hlo.splitlines()
                   if "source_target_pairs" in ln and all(r in ln for r in ring))
