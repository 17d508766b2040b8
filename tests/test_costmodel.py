"""The cost model's calibration cache, its pipeline term (the fused ticks the runtime
runs, not the table's) and its monotonicity. No timing assertions: every number
here is built by hand or read from a compiled program's structure."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from mindpipe_jax.parallel.pipeline import get_schedule
from mindpipe_jax.parallel.pipeline.schedules.fused import fuse
from mindpipe_jax.sim.network import Link
from mindpipe_jax.tuner import calibrate
from mindpipe_jax.tuner.calibrate import Calibration
from mindpipe_jax.tuner.costmodel import CostModel, Hardware, ModelCosts, Piece, count_kernels
from mindpipe_jax.tuner.space import Candidate


def _calibration(key=None, **changes) -> Calibration:
    key = key or calibrate.machine_key(jax.devices())
    fits = {f"{kind}:{r}": [1e-4, 1e-9] for kind in calibrate.KINDS for r in (2, 4, 8)}
    base = Calibration(key, flops_busy=1e9, flops_solo=4e9, mem_busy=1e9, mem_solo=4e9, kernel_busy_s=1e-5,
                       kernel_solo_s=5e-6, launch_s=1e-3, iteration_s=1e-5, collectives=fits,
                       measured_at="by hand")
    return dataclasses.replace(base, **changes)


def _costs(scale: float = 1.0, bytes_scale: float = 1.0) -> ModelCosts:
    """A 4-layer model whose pieces are given by hand (FLOPs and bytes per row)."""
    layer_f = Piece(1e6 * scale, 2e5 * bytes_scale, 0.0, 1e5 * bytes_scale, 30)
    layer_bw = Piece(2e6 * scale, 4e5 * bytes_scale, 0.0, 2e5 * bytes_scale, 60)
    pieces = {"layer_F": layer_f, "layer_BW:none": layer_bw, "layer_BW:dots": layer_bw,
              "layer_BW:full": layer_f + layer_bw,
              "rest_F": Piece(5e5 * scale, 1e5 * bytes_scale, kernels=10),
              "rest_BW": Piece(1e6 * scale, 2e5 * bytes_scale, kernels=20),
              "update": Piece(0.0, 0.0, 1e6 * scale, 4e6 * bytes_scale, 100)}
    return ModelCosts(n_layers=4, layer_fwd=1e6 * scale, layer_bwd={"none": 2e6 * scale, "dots": 2e6 * scale,
                                                                      "full": 3e6 * scale},
                      rest_fwd=5e5 * scale, rest_bwd=1e6 * scale, param_bytes=4e6, hidden_bytes_per_row=1e4,
                      pieces=pieces)


def _model(costs=None, **kw) -> CostModel:
    return CostModel(costs or _costs(), Hardware.from_calibration(_calibration()), seq_len=16, **kw)


# ------------------------------------------------------------ calibration cache
def test_calibration_cache_round_trips_and_a_changed_key_misses(tmp_path):
    cal = _calibration()
    calibrate.save(cal, tmp_path)
    assert calibrate.load(cal.key, tmp_path) == cal  # every field, the collective fits included
    other = {**cal.key, "jax": "0.0.0"}  # another jax version: not this calibration
    assert calibrate.load(other, tmp_path) is None
    # A file under the right name whose stored key differs (edited, or a hash clash) misses too.
    calibrate.cache_file(other, tmp_path).write_text(calibrate.cache_file(cal.key, tmp_path).read_text())
    assert calibrate.load(other, tmp_path) is None
    calibrate.cache_file(cal.key, tmp_path).write_text("{not json")
    assert calibrate.load(cal.key, tmp_path) is None  # damaged: measure again


def test_load_or_measure_measures_once_per_machine_key(tmp_path, monkeypatch):
    calls = []

    def fake_measure(devices):
        calls.append(len(devices))
        return _calibration(calibrate.machine_key(devices))

    first = calibrate.load_or_measure(cache_dir=tmp_path, measure_fn=fake_measure)
    again = calibrate.load_or_measure(cache_dir=tmp_path, measure_fn=fake_measure)
    assert calls == [len(jax.devices())] and again == first  # the second run reads the cache
    calibrate.load_or_measure(jax.devices()[:4], cache_dir=tmp_path, measure_fn=fake_measure)
    assert calls[-1] == 4  # other devices: another key, measured
    real_key = calibrate.machine_key
    monkeypatch.setattr(calibrate, "machine_key", lambda d: {**real_key(d), "host": "elsewhere"})
    calibrate.load_or_measure(cache_dir=tmp_path, measure_fn=fake_measure)
    assert len(calls) == 3  # another host: measured again
    calibrate.load_or_measure(cache_dir=tmp_path, measure_fn=fake_measure, refresh=True)
    assert len(calls) == 4
    hw = Hardware.calibrate(cache_dir=tmp_path)  # the tuner's entry point reads the same cache
    assert hw.calibration.key["host"] == "elsewhere" and len(calls) == 4


def test_a_cache_that_cannot_be_written_costs_a_re_measure_not_the_run(tmp_path):
    """A read-only home or a MINDPIPE_CACHE that is a file: the calibration is used and
    the log says it was not cached (it was a traceback after the measurement)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    said = []
    fake = lambda devices: _calibration(calibrate.machine_key(devices))  # noqa: E731
    cal = calibrate.load_or_measure(cache_dir=blocker / "cache", measure_fn=fake, log=said.append)
    assert cal == fake(jax.devices())
    assert len(said) == 1 and "not cached: " in said[0] and str(blocker / "cache") in said[0]


# ------------------------------------------------------------- pipeline term
def test_prediction_counts_the_fused_ticks_the_runtime_runs():
    cand = Candidate(data=2, pipe=4, microbatches=8, global_batch=32)
    table = get_schedule("1f1b", 4, 8)
    fused = fuse(table, "auto")
    assert fused.num_ticks < table.num_ticks  # 1F1B fused forward-ahead: F and BW share a tick
    as_run = _model()
    as_table = _model(fuse_mode="table")
    run, tab = as_run.breakdown(cand), as_table.breakdown(cand)
    assert run.iterations == fused.num_ticks and tab.iterations == table.num_ticks
    # Each fused tick pays its ppermutes: the pipe term follows the tick count.
    assert run.comm_s["pipe"] / tab.comm_s["pipe"] == pytest.approx(fused.num_ticks / table.num_ticks)
    # Same work, fewer ticks and a shorter replay: the prediction is shorter.
    assert run.compute_s < tab.compute_s and run.step_s < tab.step_s
    # After trials teach it a per-tick cost, the gap is that cost times the ticks saved.
    for model in (as_run, as_table):
        model.coef = model.coef.copy()
        model.coef[4] = 1e-3
    gap = as_table.step_time(cand) - as_run.step_time(cand)
    assert gap > 1e-3 * (table.num_ticks - fused.num_ticks)


def test_a_pipeline_tick_shares_the_host_cores_among_its_busy_stages():
    """A pipeline's compute is its fused ticks one after another, each as long as its
    slowest device. The calibration's all-busy rates are what each device gets when
    every device computes; simulated CPU devices share the host's cores, so in a tick
    where ``a`` of ``p`` stages have work their devices run ``p / a`` times as fast, up
    to a device's solo rates. With solo = busy rates (a GPU) that is the plain tick
    replay; with unbounded solo rates each tick costs ``a / p`` of its all-busy work."""
    cand = Candidate(data=2, pipe=4, microbatches=8, global_batch=32)

    def model(solo: float) -> CostModel:  # a device alone ``solo`` times as fast as all busy
        cal = _calibration(flops_solo=1e9 * solo, mem_solo=1e9 * solo, kernel_solo_s=1e-5 / solo)
        return CostModel(_costs(), Hardware.from_calibration(cal), seq_len=16)

    gpu, cpu, unbounded = model(1.0), model(2.0), model(1e9)
    fused = gpu.fused_schedule(cand)
    sc = gpu._stage_costs(cand, 32 / (2 * 8), solo=False)

    def work(s, cell) -> float:
        by_kind = {"F": sc.F, "B": sc.B, "W": sc.W, "BW": sc.BW}
        return sum(by_kind[t.kind.value][s] for t in cell if t is not None)

    ticks = [[work(s, cell) for s, cell in enumerate(row)] for row in fused.cells]
    plain = sum(max(tick) for tick in ticks)
    shared = sum(max(tick) * sum(w > 0 for w in tick) / 4 for tick in ticks)
    assert any(0 < sum(w > 0 for w in tick) < 4 for tick in ticks)  # ramp and drain ticks exist
    assert gpu.breakdown(cand).compute_s == pytest.approx(plain, rel=1e-9)
    assert unbounded.breakdown(cand).compute_s == pytest.approx(shared, rel=1e-6)
    assert shared < cpu.breakdown(cand).compute_s < plain
    # The model before it (the critical path at solo rates or the mean work all busy) is kept
    # for comparison; with unbounded solo rates it saw only the mean work.
    before = CostModel(_costs(), unbounded.hw, seq_len=16, shared_cores=False).breakdown(cand).compute_s
    assert before == pytest.approx(sum(map(sum, ticks)) / 4, rel=1e-6)
    assert before < shared


def test_a_pipeline_tick_pays_for_moving_its_residual_slots():
    """Every fused tick the runtime reads the backward's residual slot of each buffer and
    writes one back (``SLOT_MOVES`` slot transfers at the all-busy memory rate; in
    lockstep it reads the F's slot too, ``SLOT_MOVES_TWO_READS``): a cost in the ticks and
    the residual bytes the policy keeps, none for remat "full" (its stage input lives
    elsewhere) or without a pipeline."""
    from mindpipe_jax.tuner.costmodel import SLOT_MOVES, SLOT_MOVES_TWO_READS

    costs = dataclasses.replace(_costs(), residual_bytes_per_row={"none": 4e5, "dots": 1e5, "full": 0.0})
    cand = Candidate(data=2, pipe=4, microbatches=8, global_batch=32)
    with_slots, without = _model(costs), _model(costs, slot_traffic=False)
    rows, ticks = 32 / (2 * 8), with_slots.fused_schedule(cand).num_ticks
    per_tick = SLOT_MOVES * rows * (4 / 4) * 4e5 / 1e9  # 1 layer per stage, memory 1 GB/s busy
    gap = with_slots.breakdown(cand).compute_s - without.breakdown(cand).compute_s
    assert gap == pytest.approx(ticks * per_tick, rel=1e-9)
    dots = dataclasses.replace(cand, remat="dots")
    assert with_slots.breakdown(dots).compute_s - without.breakdown(dots).compute_s == pytest.approx(gap / 4)
    for same in (dataclasses.replace(cand, remat="full"), Candidate(data=8, global_batch=32)):
        assert with_slots.breakdown(same).compute_s == without.breakdown(same).compute_s
    tensor = Candidate(tensor=2, pipe=4, microbatches=8, global_batch=32)  # lockstep: two rows read
    lock_gap = with_slots.breakdown(tensor).compute_s - without.breakdown(tensor).compute_s
    lock_ticks = with_slots.breakdown(tensor).iterations
    assert lock_gap == pytest.approx(lock_ticks * SLOT_MOVES_TWO_READS * (32 / 8) * 4e5 / 1e9)


# --------------------------------------------------------------- monotonicity
CANDIDATES = [Candidate(data=8, global_batch=32), Candidate(data=4, tensor=2, global_batch=32),
              Candidate(fsdp=8, global_batch=32), Candidate(data=2, pipe=4, microbatches=4, global_batch=32),
              Candidate(data=4, pipe=2, microbatches=4, schedule="interleaved", virtual_stages=2,
                        global_batch=32)]


@pytest.mark.parametrize("cand", CANDIDATES, ids=lambda c: c.label())
def test_more_flops_or_bytes_predict_more_time(cand):
    base = _model().step_time(cand)
    assert _model(_costs(scale=2.0)).step_time(cand) > base  # more FLOPs, all else equal
    assert _model(_costs(bytes_scale=20.0)).step_time(cand) > base  # memory-bound pieces
    # A bigger batch is more work on every layout.
    assert _model().step_time(dataclasses.replace(cand, global_batch=64)) > base


def test_piece_time_is_a_roofline_plus_kernels():
    hw = Hardware.from_calibration(_calibration())
    compute_bound = Piece(flops=1e6, bytes=1e3, kernels=10)  # 1 ms of FLOPs, 1 us of bytes per row
    assert hw.piece_time(compute_bound, 2) == pytest.approx(2e-3 + 10 * 1e-5)
    memory_bound = Piece(flops=1e3, bytes=1e6, fixed_bytes=1e6, kernels=0)
    assert hw.piece_time(memory_bound, 2) == pytest.approx(3e-3)
    assert hw.piece_time(memory_bound, 2, split=2) == pytest.approx(1.5e-3)  # tensor shards the work
    assert hw.piece_time(compute_bound, 2, solo=True) < hw.piece_time(compute_bound, 2)
    # Collectives read the fit of the axis size.
    assert hw.collective("all-reduce", 4, 1e6) == pytest.approx(1e-4 + 1e-3)
    assert hw.collective("all-reduce", 1, 1e6) == 0.0


def test_hand_written_costs_without_a_calibration_still_predict():
    """The FLOP fields alone (no pieces, no calibration) keep the old model's behaviour."""
    costs = ModelCosts(n_layers=4, layer_fwd=1e6, layer_bwd={"none": 2e6, "dots": 2.2e6, "full": 3e6},
                       rest_fwd=5e5, rest_bwd=1e6, param_bytes=4e6, hidden_bytes_per_row=1e4)
    hw = Hardware(flop_rate=1e9, link=Link(1e-5, 1e9), solo_rate=1e9, launch_s=1e-3, iteration_s=1e-4)
    small = CostModel(costs, hw, 16).breakdown(Candidate(data=8, global_batch=8))
    assert small.compute_s == pytest.approx(costs.step_flops(1) / 1e9)


def test_count_kernels_reads_the_compiled_entry():
    def f(a, b):
        return jnp.tanh(a @ b) @ b

    x = jnp.ones((16, 16))
    compiled = jax.jit(f).lower(x, x).compile()
    kernels = count_kernels(compiled.as_text())
    assert kernels >= 2  # two dots at least; parameters, constants and tuples are not kernels
    assert count_kernels(jax.jit(lambda a: a).lower(x).compile().as_text()) <= 1


def _lockstep_by_hand(model: CostModel, c: Candidate) -> float:
    """Every fused tick, every device runs each (part, kind) some device runs there: one
    branch that every stage's tasks of that kind share (the last stage's forward runs
    its layers and the loss), costing the dearest stage's work."""
    fused = fuse(get_schedule(c.schedule, c.pipe, c.microbatches, c.virtual_stages), model.fuse_mode)
    sc = model._stage_costs(c, c.global_batch / (c.batch_shards * c.microbatches), solo=False)
    stages = range(fused.schedule.num_global_stages)

    def cost(kind):
        return max({"F": sc.F, "B": sc.B, "W": sc.W, "BW": sc.BW}[kind.value][g] for g in stages)

    total = 0.0
    for row in fused.cells:
        for part in range(3):
            total += sum(cost(kind) for kind in {cell[part].kind for cell in row if cell[part] is not None})
    return total


@pytest.mark.parametrize("schedule,m", [("1f1b", 4), ("zb-h1", 8)])
def test_tensor_inside_a_pipeline_costs_every_active_branch_on_every_device(schedule, m):
    """With tensor > 1 the runtime runs its stages in lockstep (``needs_lockstep``): the
    stage work is split over tensor, but each tick costs the sum of its active
    branches on every device, bubbles included. Without tensor the per-device branches
    stay, and a device idle in a bubble frees the host's cores."""
    tp = Candidate(tensor=2, pipe=4, microbatches=m, schedule=schedule, global_batch=32)
    dp = Candidate(data=2, pipe=4, microbatches=m, schedule=schedule, global_batch=32)
    model = _model()
    assert model.breakdown(tp).compute_s == pytest.approx(_lockstep_by_hand(model, tp), rel=1e-9)
    # The same rows per device and the same split work: lockstep costs more than branches.
    assert model.breakdown(tp).compute_s > 1.2 * model.breakdown(dp).compute_s
    # Every stage shares one branch per kind, so a lockstep tick is as long as the
    # switch's busiest device: the bubble is the same (fuller with branches apart).
    assert model.breakdown(tp).bubble_fraction >= model.breakdown(dp).bubble_fraction - 1e-9
    unsplit = _model(pipeline_tensor_split=False)  # the older model: tensor ranks do it all
    assert unsplit.breakdown(tp).compute_s > 1.5 * unsplit.breakdown(dp).compute_s


def test_a_pipeline_stage_keeps_its_weights_split_over_tensor():
    """What the lockstep model rests on: inside the pipeline's shard_map the stage's
    matmuls run on the tensor shard of the weights. The compiled t2 p4 step's MLP dots
    are [rows, d_ff / 2] with twice d2 p4's rows (the same work per device)."""
    import re
    from collections import Counter

    from mindpipe_jax.config import Config
    from mindpipe_jax.tuner.aot import build_step

    cfg = Config().replace("model.d_model=32", "model.n_layers=4", "model.n_heads=4", "model.seq_len=8",
                           "model.d_ff=96", "train.progress=false", "train.tensorboard=false")

    def dot_shapes(cand):
        text = build_step(cand.apply(cfg)).lower().compile().as_text()
        return Counter(re.findall(r"= f32\[(\d+),(\d+)\]\{1,0\} dot\(", text))

    dp = dot_shapes(Candidate(data=2, pipe=4, microbatches=4, global_batch=32))
    tp = dot_shapes(Candidate(tensor=2, pipe=4, microbatches=4, global_batch=32))
    assert ("32", "96") in dp and ("64", "48") in tp  # rows x d_ff: d2 p4 full width, t2 p4 half
    assert not any(cols == "96" for _, cols in tp)  # no unsplit MLP dot inside the t2 pipeline


def test_tensor_all_reduces_inside_a_pipeline_are_counted_per_active_branch():
    """In lockstep every device runs every branch some device takes in a tick, its
    tensor all-reduces too: the model counts them per active branch per fused tick, which
    is more than Megatron's count per microbatch and at most what the compiled program
    holds in its tick loop (read from the HLO, each branch's collectives counted as if it
    ran in every tick)."""
    import numpy as np

    from mindpipe_jax.config import Config
    from mindpipe_jax.parallel.collectives import axes_of, collectives
    from mindpipe_jax.tuner.aot import build_step

    cfg = Config().replace("model.d_model=32", "model.n_layers=4", "model.n_heads=4", "model.seq_len=8",
                           "train.progress=false", "train.tensorboard=false")
    cand = Candidate(tensor=2, pipe=4, microbatches=4, global_batch=32)
    built = build_step(cand.apply(cfg))
    ids = np.vectorize(lambda d: d.id)(built.mesh.devices)
    compiled = sum(op.count for op in collectives(built.lower().compile().as_text())
                   if op.in_branch and op.kind == "all-reduce"
                   and axes_of(op, ids, built.mesh.axis_names) == {"tensor"})
    model = _model()
    per_microbatch = cand.microbatches * (4 * 4 / cand.pipe + 2)
    counted = model._tensor_all_reduces(cand)
    assert per_microbatch < counted <= compiled, (per_microbatch, counted, compiled)
    # without a pipeline (no lockstep) the count is Megatron's per microbatch
    flat = Candidate(data=4, tensor=2, microbatches=2, global_batch=32)
    assert model._tensor_all_reduces(flat) == 2 * (4 * 4 + 2)


def test_a_calibration_measured_under_load_says_so_and_old_files_still_load(tmp_path):
    """Rates measured while other work holds the cores are too low for every prediction
    made from them: the note says so. Files cached before the load was recorded load."""
    quiet = _calibration(load_average=0.5, cores=2)
    loaded = _calibration(load_average=6.0, cores=2)
    assert not quiet.loaded and "UNDER LOAD" not in quiet.note()
    assert loaded.loaded and "load average 6.0 on 2 cores" in loaded.note()
    old = {k: v for k, v in loaded.to_dict().items() if k not in ("load_average", "cores")}
    assert not Calibration.from_dict(old).loaded
    measured = calibrate.measure(jax.devices()[:2], repeats=1)
    assert measured.cores >= 1 and measured.load_average >= 0


def test_a_calibration_cached_under_load_is_measured_again_once_the_host_is_quiet(tmp_path, monkeypatch):
    calls = []

    def fake_measure(devices):
        calls.append(1)
        return _calibration(calibrate.machine_key(devices), load_average=calibrate._host_load()[0], cores=2)

    monkeypatch.setattr(calibrate, "_host_load", lambda: (6.0, 2))  # other work holds the cores
    first = calibrate.load_or_measure(cache_dir=tmp_path, measure_fn=fake_measure)
    assert first.loaded and len(calls) == 1
    calibrate.load_or_measure(cache_dir=tmp_path, measure_fn=fake_measure)
    assert len(calls) == 1  # still loaded: measuring again would be no better
    monkeypatch.setattr(calibrate, "_host_load", lambda: (0.4, 2))
    quiet = calibrate.load_or_measure(cache_dir=tmp_path, measure_fn=fake_measure)
    assert len(calls) == 2 and not quiet.loaded
    assert calibrate.load_or_measure(cache_dir=tmp_path, measure_fn=fake_measure) == quiet and len(calls) == 2


def test_an_moe_block_is_priced_from_its_own_compiled_work_quadratic_in_a_devices_rows():
    """An MoE block's one-hot dispatch and combine grow with the square of the tokens a
    device routes together, so its pieces are the real block's, compiled at 1, 3 and 5
    rows and fitted as a quadratic. Checked against XLA's count of the block compiled at
    9 rows, a size the fit never saw. (Before: the dense twin's pieces scaled by the
    active parameters, 1/2 to 1/3 of the block's work at such sizes.)"""
    from functools import partial

    import numpy as np
    from flax import nnx

    from mindpipe_jax.config import Config
    from mindpipe_jax.models import gpt, moe
    from mindpipe_jax.parallel.pipeline.contract import PipelineModel
    from mindpipe_jax.parallel.pipeline.parts import merged
    from mindpipe_jax.tuner.pieces import compiled_piece

    shape = ("model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.seq_len=16",
             "model.vocab_size=64")
    cfg = Config().replace(*shape, "model.n_experts=4", "model.top_k=2")
    costs = ModelCosts.measure(cfg, rows=2)
    layer = costs.pieces["layer_F"]
    assert layer.flops_sq > 0 and costs.pieces["rest_F"].flops_sq == 0
    rows = 9
    with jax.set_mesh(None), nnx.use_eager_sharding(False):
        model = moe.MoEGPT(cfg.model, rngs=nnx.Rngs(0), dispatch_groups=1)
        graphdef, state, rest = nnx.split(model, nnx.Param, ...)
        params = nnx.to_pure_dict(state)
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (rows, 16)), jnp.int32)
        split = PipelineModel(model, params, partial(merged, graphdef, rest=rest), tokens)
        _, stack, _ = split.split(params)
        block = jax.tree.map(lambda x: x[0], stack)
        compiled_flops = compiled_piece(split.fns.layer, block, jax.jit(split.fns.embed)(
            split.split(params)[0], tokens))[0]
    priced = layer.flops * rows + layer.flops_sq * rows ** 2 + layer.fixed_flops
    assert priced == pytest.approx(compiled_flops, rel=0.05), (priced, compiled_flops)
    dense = ModelCosts.measure(Config().replace(*shape), rows=2).pieces["layer_F"]
    twin = (dense.flops * rows + dense.fixed_flops) * moe.flops_per_token(cfg.model) / gpt.flops_per_token(
        dataclasses.replace(cfg.model, n_experts=0))
    assert twin < 0.6 * compiled_flops, (twin, compiled_flops)
