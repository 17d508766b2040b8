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


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1),
                                    ("afapab", 2)])
def test_every_schedule_on_3d_meshes_matches_unpipelined(name, v):
    # Chunk-wise sync (the AFAPAB mechanism) on every schedule; "end" is covered by
    # test_pipeline_runtime.py. Pipe x data alone: afapab's chunk sync in
    # test_sync_of_sharded_weights_matches_unpipelined below.
    mesh_name = "pipe2xtensor2xdata2"
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


def _reachable(comps: dict[str, str], name: str) -> list[str]:
    """``name`` and every computation it calls (branches of conditionals, nested loops,
    fusions), transitively."""
    seen, todo = [], [name]
    while todo:
        here = todo.pop()
        if here in seen or here not in comps:
            continue
        seen.append(here)
        body = comps[here].split("\n", 1)[-1]  # its instructions, not its own header
        todo += [ref for ref in re.findall(r"%([\w.\-]+)", body) if ref in comps]
    return seen


def test_early_chunk_sync_runs_inside_the_remaining_backward_loop():
    """The compiled program: chunk 1's gradient ring (collective-permutes along the
    data axis, then an all-gather over it) runs inside the loop over the ticks (the
    one loop whose body moves activations and gradients between stages), under the
    per-tick switch that picks the ring step, i.e. beside the last backward
    computations."""
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
    # The tick loop: its own body moves the pipeline's two transfers every tick.
    ticks = [b for b in loops
             if sum("collective-permute(" in ln and pairs(ln) != ring for ln in comps[b].splitlines()) == 2]
    assert len(ticks) == 1, "the ticks should run as one loop"
    inside = [ln for c in _reachable(comps, ticks[0]) for ln in comps[c].splitlines()]
    steps = [ln for ln in inside if "collective-permute(" in ln and pairs(ln) == ring]
    gathers = [ln for ln in inside if "all-gather(" in ln]
    assert steps, "no data-axis ring step inside the tick loop"
    assert gathers, "no all-gather of the ring's pieces inside the tick loop"


def test_several_rings_with_steps_left_over_match_unpipelined():
    """v = 4: three chunks ring before the last tick, one after another, each with more
    steps than the ticks before the next one starts (tiny buckets): the steps left over
    run when the next ring starts, after the gather beside the tick before it."""
    p, m, v = 2, 4, 4
    model, params = tiny_gpt(p * v)
    inputs, targets = microbatches(7, m)
    ref_loss, ref_grads = reference(model, params, inputs, targets)
    mesh = make_mesh(ParallelConfig(pipe=p, tensor=1, data=4))
    run = pipeline_grads(stage_fns(model), get_schedule("afapab", p, m, v), mesh, remat="none",
                         grad_sync="chunk", sync_bucket_bytes=2_000)
    with jax.set_mesh(mesh):
        loss, grads = jax.jit(run)(params["embed"], params["blocks"], params["head"], inputs, targets)
    assert_matches(loss, grads, ref_loss, ref_grads)


def _copied_shapes(comps: dict[str, str], names) -> list[tuple[int, ...]]:
    return [tuple(int(d) for d in dims.split(",") if d) for name in names
            for dims in re.findall(r"= \w+\[([\d,]*)\]\{[^}]*\} copy\(", comps[name])]


@pytest.mark.xla_default_emitters  # a property of the program XLA compiles for users
@pytest.mark.parametrize("v", [2, 4])  # one ring, three rings
def test_chunk_ring_tick_loop_copies_no_accumulator(v):
    """The chunk ring's tick loop (its body and every branch it takes) copies no array of
    an accumulator's shape, nor the ring's state (a chunk's gradient, flattened). Before:
    the ring's start read the accumulators in a switch before the tick updated them in
    place, and XLA copied every one of them every tick; then the ring's parts (and, with
    several rings, their stacked results) were copied every tick, the start switch
    returning a fresh buffer where its other branch returned the carried one
    (tickloop._one_scan)."""
    model, params = tiny_gpt(2 * v)
    hlo, _ = _afapab_program(p=2, m=4, v=v, data=4)
    comps = _computations(hlo)
    chunk_shapes = {tuple(x.shape[1:]) for x in jax.tree.leaves(params["blocks"])}
    acc_shapes = {(v, 1, *shape) for shape in chunk_shapes} | {(v, *shape) for shape in chunk_shapes}
    acc_shapes |= {tuple(x.shape) for x in jax.tree.leaves((params["embed"], params["head"]))}
    # A d_model-long vector (a norm's scale) has the shape of many small values; the
    # accumulators that cost are the weight matrices.
    acc_shapes = {s for s in acc_shapes if np.prod(s) >= 256}
    entry = next(b for b in comps.values() if b.startswith("ENTRY"))
    loops = [re.search(r"body=%?([\w.\-]+)", ln).group(1) for ln in entry.splitlines()
             if re.search(r"\bwhile\(", ln)]
    assert loops
    chunk_elements = sum(x.size for x in jax.tree.leaves(params["blocks"])) // (2 * v)
    for loop in loops:
        inside = [c for c in _reachable(comps, loop) if not c.startswith(("fused", "wrapped"))]
        copied = [s for s in _copied_shapes(comps, inside) if s in acc_shapes]
        assert not copied, f"accumulator-shaped copies {copied} in the tick loop"
        ring_sized = [s for s in _copied_shapes(comps, inside) if np.prod(s) >= chunk_elements]
        assert not ring_sized, f"copies of the ring's state {ring_sized} in the tick loop"


@pytest.mark.parametrize("sync,loops", [("end", 1), ("overlap", 2)])
def test_megatron_style_sync_has_no_ring(sync, loops):
    """"end": one tick loop, every sync after it. "overlap" (Megatron's overlapped
    reduction): the loop split at chunk 1's last backward, where its all-reduce is issued
    (XLA:CPU's combiner then merges it with the later ones: tickloop._early_means).
    Neither rings."""
    model, params = tiny_gpt(4)
    inputs, targets = microbatches(1, 8)
    mesh = make_mesh(ParallelConfig(pipe=2, tensor=1, data=4))
    run = pipeline_grads(stage_fns(model), get_schedule("afapab", 2, 8, 2), mesh, remat="full",
                         grad_sync=sync)
    with jax.set_mesh(mesh):
        hlo = jax.jit(run).lower(params["embed"], params["blocks"], params["head"], inputs,
                                 targets).compile().as_text()
    entry = next(b for b in _computations(hlo).values() if b.startswith("ENTRY")).splitlines()
    loops_at = [i for i, ln in enumerate(entry) if re.search(r"\bwhile\(", ln)]
    assert len(loops_at) == loops
    ring = {f"{{{a},{b}}}" for a, b in _data_ring_pairs(mesh)}
    assert not any("collective-permute(" in ln and any(r in ln for r in ring) for ln in hlo.splitlines()
                   if "source_target_pairs" in ln and all(r in ln for r in ring))


def _sharded_as_stored(model, params, mesh):
    """The parameters placed as training stores them (the rules' storage shardings), and
    those shardings as ``pipeline_grads``' ``param_specs``."""
    from flax import nnx

    from mindpipe_jax.parallel.rules import state_shardings

    storage = nnx.to_pure_dict(state_shardings(nnx.state(model, nnx.Param), mesh, "storage"))
    return jax.device_put(params, storage), storage


def _sharded_program(mesh_name, sync, dtype="fp32", m=4):
    p, v = 2, 2
    model, params = tiny_gpt(p * v)
    mesh = make_mesh(ParallelConfig(**MESHES[mesh_name]))
    placed, storage = _sharded_as_stored(model, params, mesh)
    run = pipeline_grads(stage_fns(model), get_schedule("afapab", p, m, v), mesh, remat="full",
                         grad_sync=sync, sync_bucket_bytes=16_000, param_specs=storage,
                         grad_sync_dtype=dtype)
    return model, params, placed, mesh, run


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("sync,dtype", [("chunk", "fp32"), ("overlap", "fp32"), ("end", "bf16"),
                                        ("chunk", "bf16")])
def test_sync_of_sharded_weights_matches_unpipelined(mesh_name, sync, dtype):
    # Weights stored sharded over tensor (as training keeps them) and their specs given:
    # the chunk ring works on each device's own shards (ringsync.LocalRing). The fp32 end
    # sync of stored shardings is the train step's (test_byom's pipe x tensor families).
    model, params, placed, mesh, run = _sharded_program(mesh_name, sync, dtype)
    inputs, targets = microbatches(3, 4)
    ref_loss, ref_grads = reference(model, params, inputs, targets)
    with jax.set_mesh(mesh):
        loss, grads = jax.jit(run)(placed["embed"], placed["blocks"], placed["head"], inputs, targets)
    if dtype == "fp32":
        assert_matches(loss, grads, ref_loss, ref_grads)
        return
    # bf16 on the wire: each device's contribution and the reduced result are rounded to
    # 8 significant bits (2^-9 relative) once or twice; a device's contribution is at most
    # a few times the mean's largest entry, so 2^-6 of each leaf's largest entry bounds it.
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)  # the loss is not a gradient: fp32
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=2**-6 * float(np.abs(want).max()))


def test_chunk_sync_sends_no_more_than_end_and_bf16_half():
    """The issue's acceptance, read from the compiled pipe2 x data2 x tensor2 programs:
    per device, the data-axis bytes of "chunk" are at most 1.05 x "end"'s (they were 2x
    when the ring gathered the tensor shards), and bf16 sends about half of fp32."""
    from mindpipe_jax.parallel.collectives import axes_of, collectives, per_device_bytes

    inputs, targets = microbatches(1, 4)
    sent = {}
    for sync in ("end", "chunk"):
        for dtype in ("fp32", "bf16"):
            _, _, placed, mesh, run = _sharded_program("pipe2xtensor2xdata2", sync, dtype)
            with jax.set_mesh(mesh):
                hlo = jax.jit(run).lower(placed["embed"], placed["blocks"], placed["head"], inputs,
                                         targets).compile().as_text()
            ids = np.vectorize(lambda d: d.id)(mesh.devices)
            data = [op for op in collectives(hlo) if axes_of(op, ids, mesh.axis_names) == {"data"}]
            sent[sync, dtype] = max(per_device_bytes(data, mesh.size).values())
    assert sent["chunk", "fp32"] <= 1.05 * sent["end", "fp32"], sent
    assert sent["chunk", "bf16"] <= 1.05 * sent["end", "bf16"], sent
    for sync in ("end", "chunk"):  # half, but for the fp32 loss scalar
        assert 0.4 * sent[sync, "fp32"] <= sent[sync, "bf16"] <= 0.55 * sent[sync, "fp32"], sent


TRAIN = ("model.d_model=32", "model.n_layers=4", "model.n_heads=2", "model.seq_len=32",
         "train.global_batch=16", "train.progress=false", "train.tensorboard=false", "train.eval_every=0",
         "train.steps=20", "train.log_every=1", "optim.warmup_steps=0", "parallel.simulate_cpu_devices=0",
         "parallel.pipe=2", "parallel.data=2", "parallel.tensor=2", "parallel.schedule=afapab",
         "parallel.virtual_stages=2", "parallel.microbatches=2", "parallel.grad_sync=chunk")


def test_bf16_gradient_sync_stays_close_to_fp32_over_20_steps(tmp_path):
    """bf16 on the wire rounds each value it sends to 8 significant bits (relative error
    <= 2^-9), at most twice on a gradient's way here (data=2: the ring's one partial
    sum, then the gathered result). AdamW normalises its update per element, so a
    relative gradient error of ~2^-8 moves an update by about that fraction of lr,
    except where the synced sum is near zero and its sign may change. Bounds: every
    step's loss within 0.5% of fp32's, and the parameters' distance from the fp32 run
    below 2% of how far 20 steps moved them; and not zero, or the key did nothing."""
    from flax import nnx

    import mindpipe_jax as mp

    cfg = mp.load_config(None, TRAIN)
    model = mp.GPT(cfg.model, rngs=nnx.Rngs(0))
    init = [np.array(x) for x in jax.tree.leaves(nnx.to_pure_dict(nnx.state(model, nnx.Param)))]
    runs = {dtype: mp.train(model, None, mp.Config(), *TRAIN, f"train.out_dir={tmp_path / dtype}",
                            f"parallel.grad_sync_dtype={dtype}") for dtype in ("fp32", "bf16")}
    losses = {k: np.array([h["loss"] for h in r.history if "loss" in h]) for k, r in runs.items()}
    assert len(losses["fp32"]) == len(losses["bf16"]) == 20
    np.testing.assert_allclose(losses["bf16"], losses["fp32"], rtol=5e-3)
    fp32, bf16 = (jax.tree.leaves(jax.device_get(runs[k].state["params"])) for k in ("fp32", "bf16"))
    norm = lambda xs, ys: np.sqrt(sum(float(np.sum((a - b) ** 2)) for a, b in zip(xs, ys, strict=True)))  # noqa: E731
    moved, apart = norm(fp32, init), norm(fp32, bf16)
    assert apart > 0, "bf16 sync gave the fp32 bits: the wire dtype was not applied"
    assert apart < 0.02 * moved, f"bf16 vs fp32 params {apart:.3g} apart; 20 steps moved them {moved:.3g}"


# fsdp with data (reduce-scatter, then the ring over data) and with tensor (each tensor rank
# scatters its own shards); fsdp alone is the first case's reduce-scatter without the ring.
FSDP_MESHES = {"pipe2xfsdp2xdata2": dict(pipe=2, fsdp=2, data=2, tensor=1),
               "pipe2xfsdp2xtensor2": dict(pipe=2, fsdp=2, data=1, tensor=2)}


@pytest.mark.parametrize("mesh_name", list(FSDP_MESHES))
def test_fsdp_chunk_sync_keeps_only_owned_shards(mesh_name):
    """With weights stored sharded over fsdp, the chunk sync reduce-scatters them over fsdp
    at the sync point and rings only the owned shards over data: the same gradients as
    the unpipelined model, and no more data x fsdp bytes than the end-of-step sync."""
    from mindpipe_jax.parallel.collectives import axes_of, collectives, per_device_bytes

    p, m, v = 2, 4, 2
    model, params = tiny_gpt(p * v)
    inputs, targets = microbatches(5, m, rows=8)
    ref_loss, ref_grads = reference(model, params, inputs, targets)
    mesh = make_mesh(ParallelConfig(**FSDP_MESHES[mesh_name]))
    placed, storage = _sharded_as_stored(model, params, mesh)
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    sent = {}
    for sync in ("end", "chunk"):
        run = pipeline_grads(stage_fns(model), get_schedule("afapab", p, m, v), mesh, remat="full",
                             grad_sync=sync, param_specs=storage)
        args = (placed["embed"], placed["blocks"], placed["head"], inputs, targets)
        with jax.set_mesh(mesh):
            compiled = jax.jit(run).lower(*args).compile()
            loss, grads = compiled(*args)
        assert_matches(loss, grads, ref_loss, ref_grads)
        batch = [op for op in collectives(compiled.as_text())
                 if axes_of(op, ids, mesh.axis_names) <= {"data", "fsdp"}]
        sent[sync] = max(per_device_bytes(batch, mesh.size).values())
    assert sent["chunk"] <= 1.05 * sent["end"], sent


def test_the_chunk_ring_is_refused_where_xla_gpu_crashes_compiling_it(monkeypatch):
    """jax 0.11.2's XLA:GPU segfaults compiling the chunk ring (benchmarks/results/
    2026-12-04-h200-hlo-checks-2.txt): refused there with one line, 'auto' runs 'overlap'."""
    import jax
    import pytest

    from mindpipe_jax.config import ParallelConfig
    from mindpipe_jax.errors import ConfigError
    from mindpipe_jax.parallel.pipeline.runtime import grads
    from mindpipe_jax.train.step import resolved_grad_sync

    monkeypatch.setattr(jax, "__version__", "0.11.2")
    assert grads.chunk_ring_compiles_on("cpu") and not grads.chunk_ring_compiles_on("gpu")
    with pytest.raises(ConfigError, match="grad_sync='chunk'.*use parallel.grad_sync='overlap'") as err:
        grads.refuse_chunk_ring_where_xla_crashes("gpu")
    assert "\n" not in str(err.value)
    grads.refuse_chunk_ring_where_xla_crashes("cpu")
    afapab = ParallelConfig(pipe=2, data=2, schedule="afapab", virtual_stages=2, microbatches=4)
    with pytest.warns(UserWarning, match="'overlap' instead of 'chunk'"):
        assert resolved_grad_sync(afapab, "gpu") == "overlap"
    assert resolved_grad_sync(afapab, "cpu") == "chunk"
    assert resolved_grad_sync(ParallelConfig(pipe=2, data=2, schedule="afapab", virtual_stages=2,
                                             microbatches=4, grad_sync="chunk"), "gpu") == "chunk"
    monkeypatch.setattr(jax, "__version__", "0.10.2")  # releases not seen crashing keep the ring
    assert grads.chunk_ring_compiles_on("gpu") and resolved_grad_sync(afapab, "gpu") == "chunk"
    monkeypatch.setattr(jax, "__version__", "0.11.2")
    monkeypatch.setattr(grads, "CHUNK_RING_CRASHES_XLA_GPU_FROM", None)  # how a re-check turns it off
    assert grads.chunk_ring_compiles_on("gpu")
