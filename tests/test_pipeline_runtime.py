"""vPipe runtime: every schedule's loss and gradients equal the unpipelined model."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from pipeline_oracle import assert_matches, microbatches, reference, tiny_gpt

import mindpipe_jax as mp
from mindpipe_jax.config import ModelConfig, ParallelConfig
from mindpipe_jax.models.gpt import GPT
from mindpipe_jax.parallel.mesh import make_mesh
from mindpipe_jax.parallel.pipeline import get_schedule
from mindpipe_jax.parallel.pipeline.contract import stage_fns
from mindpipe_jax.parallel.pipeline.runtime import StageLayout, make_plan, pipeline_grads

# Each schedule at p=2 and p=4; m from p to 4p; v=2 for the interleaved one.
CASES = [("gpipe", 2, 4, 1), ("gpipe", 4, 4, 1), ("1f1b", 2, 8, 1), ("1f1b", 4, 16, 1),
         ("zb-h1", 2, 2, 1), ("zb-h1", 4, 8, 1), ("interleaved", 2, 4, 2), ("interleaved", 4, 4, 2)]


@pytest.mark.parametrize("name,p,m,v", CASES, ids=[f"{c[0]}-p{c[1]}-m{c[2]}-v{c[3]}" for c in CASES])
def test_pipeline_grads_equal_unpipelined(name, p, m, v):
    # Residual buffers (no recompute) on the odd-numbered cases, stage remat on the others.
    remat = CASES.index((name, p, m, v)) % 2 == 0
    check_pipeline_grads(name, p, m, v, ParallelConfig(pipe=p, data=-1, tensor=1), remat=remat)


# pipe x data alone: the p=2 cases of test_pipeline_grads_equal_unpipelined (data=-1 fills 4).
@pytest.mark.parametrize("axes", [dict(data=2, tensor=2), dict(fsdp=2, tensor=2)])
@pytest.mark.parametrize("remat", [False, True])
def test_pipeline_composes_with_data_and_tensor(axes, remat):
    check_pipeline_grads("1f1b", 2, 4, 1, ParallelConfig(pipe=2, **axes), remat=remat)


@pytest.mark.parametrize("name,counts,v,remat", [
    ("1f1b", (1, 3), 1, False), ("1f1b", (0, 2, 1, 1), 1, True),
    ("zb-h1", (1, 3), 1, False), ("zb-h1", (3, 1), 1, True), ("zbv", (1, 2, 2, 1), 2, False),
], ids=["p2-1+3-residual", "p4-0+2+1+1-remat", "zbh1-p2-1+3", "zbh1-p2-3+1-remat", "zbv-p2-1+2+2+1"])
def test_uneven_stages(name, counts, v, remat):
    # Fewer blocks where embed/head live; an empty stage only passes activations on. The
    # zero-bubble schedules split the backward (B, then W) with each stage's layer count.
    p = len(counts) // v
    check_pipeline_grads(name, p, 2 * p, v, ParallelConfig(pipe=p, data=-1, tensor=1), remat=remat,
                         layout=StageLayout(counts, p, v))


@pytest.mark.parametrize("name,p,m,v,remat", [
    ("1f1b", 4, 8, 1, ("full", "dots", "none", "none")),
    ("zb-h1", 4, 4, 1, ("dots", "full", "dots", "none")),
    ("interleaved", 2, 4, 2, ("full", "none", "dots", "full")),
], ids=["1f1b-full-dots-none", "zbh1-dots-full", "interleaved-mixed"])
def test_per_stage_remat_policies(name, p, m, v, remat):
    # Each global stage keeps what its own policy says; every policy's buffer and
    # every branch must still give the unpipelined gradients.
    check_pipeline_grads(name, p, m, v, ParallelConfig(pipe=p, data=-1, tensor=1), remat=remat)


def test_residual_buffers_are_sized_per_policy():
    # 1F1B, p=4, one task per tick: stage s holds p-s microbatches. "full" on stages
    # 0-1 keeps inputs only; the residual buffer serves stage 2 (2 in flight); the
    # last stage keeps its input (its forward runs inside its backward) and no residuals.
    plan = make_plan(get_schedule("1f1b", 4, 16), ("full", "full", "none", "none"), "table")
    assert plan.res_slots == {"none": 2}
    assert plan.x_slots == 4
    assert make_plan(get_schedule("1f1b", 4, 16), "none", "table").res_slots == {"none": 4}
    assert make_plan(get_schedule("1f1b", 4, 16), "full").res_slots == {}
    # Fused ticks let stage s run 2(p-s)-1 forwards ahead (stage 0: 2p-1 at most).
    fused = make_plan(get_schedule("1f1b", 4, 16), "none")
    assert fused.num_ticks < plan.num_ticks and fused.res_slots["none"] <= 2 * 4 - 1
    with pytest.raises(ValueError, match="one policy each"):
        make_plan(get_schedule("1f1b", 4, 16), ("full", "none"))
    with pytest.raises(ValueError, match="'offload' is not one of"):
        make_plan(get_schedule("1f1b", 2, 4), ("offload", "none"))


def check_pipeline_grads(name, p, m, v, parallel, *, remat, layout=None):
    model, params = tiny_gpt(sum(layout.counts) if layout else p * v)
    inputs, targets = microbatches(p * m, m)
    ref_loss, ref_grads = reference(model, params, inputs, targets)
    mesh = make_mesh(parallel)
    # NaN in every buffer slot before use: an idle slot reaching a result would show.
    run = pipeline_grads(stage_fns(model), get_schedule(name, p, m, v), mesh, remat=remat,
                         layout=layout, nan_bubbles=True)
    with jax.set_mesh(mesh):
        loss, grads = jax.jit(run)(params["embed"], params["blocks"], params["head"], inputs, targets)
    assert_matches(loss, grads, ref_loss, ref_grads)


def test_slot_buffers_follow_the_schedule_not_m():
    # 1F1B keeps at most p microbatches alive on a stage (2p - 1 with fused ticks);
    # GPipe keeps all m.
    for m in (4, 8, 32):
        assert make_plan(get_schedule("1f1b", 4, m), fuse_mode="table").x_slots <= 4
        assert make_plan(get_schedule("1f1b", 4, m)).x_slots <= 2 * 4 - 1
        assert make_plan(get_schedule("gpipe", 4, m)).x_slots == m


TINY = ("model.d_model=32", "model.n_layers=4", "model.n_heads=2", "model.seq_len=32",
        "train.global_batch=16", "train.progress=false", "train.tensorboard=false", "train.eval_every=0",
        "train.steps=3", "optim.warmup_steps=0", "parallel.simulate_cpu_devices=0")


@pytest.fixture(scope="module")
def unpipelined(tmp_path_factory):
    # The tests that compare with it share one xdist worker (xdist_group below): trained once.
    out = tmp_path_factory.mktemp("ref")
    return mp.train(None, None, mp.Config(), *TINY, f"train.out_dir={out}", "parallel.data=8")


@pytest.mark.parametrize("layout", [
    ("parallel.pipe=2", "parallel.data=2", "parallel.tensor=2", "parallel.schedule=1f1b",
     "parallel.microbatches=4"),
    ("parallel.pipe=4", "parallel.data=2", "parallel.schedule=zb-h1", "parallel.microbatches=4"),
    ("parallel.pipe=2", "parallel.fsdp=4", "parallel.schedule=interleaved", "parallel.virtual_stages=2",
     "parallel.microbatches=2"),
    ("parallel.pipe=2", "parallel.data=4", "parallel.microbatches=2", "parallel.stage_layers=[1, 3]"),
    ("parallel.pipe=2", "parallel.data=2", "parallel.tensor=2", "parallel.schedule=afapab",
     "parallel.virtual_stages=2", "parallel.microbatches=2",
     'parallel.stage_remat=["full", "dots", "dots", "none"]',
     "parallel.sync_bucket_mb=0.01"),
], ids=["1f1b-pipe2xdata2xtensor2", "zbh1-pipe4xdata2", "interleaved-pipe2xfsdp4", "uneven-1+3-pipe2xdata4",
        "afapab-pipe2xdata2xtensor2"])
@pytest.mark.xdist_group("pipelined_training")
def test_pipelined_training_matches_unpipelined(tmp_path, layout, unpipelined):
    ref = unpipelined
    got = mp.train(None, None, mp.Config(), *TINY, f"train.out_dir={tmp_path / 'pipe'}", *layout)
    assert got.history[-1]["loss"] == pytest.approx(ref.history[-1]["loss"], rel=1e-5)
    # Three AdamW steps amplify fp32 reduction-order noise in tiny gradients: 1e-4 absolute
    # on weights of scale ~0.02 is still far below one step's update (lr 3e-3).
    for a, b in zip(jax.tree.leaves(jax.device_get(ref.state["params"])),
                    jax.tree.leaves(jax.device_get(got.state["params"])), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4)


def _temp_bytes(name, m, *, remat):
    p = 4
    cfg = ModelConfig(vocab_size=64, seq_len=32, d_model=64, n_layers=p, n_heads=2)
    model = GPT(cfg, rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    tokens = jax.ShapeDtypeStruct((m, 8, 32), jnp.int32)
    mesh = make_mesh(ParallelConfig(pipe=p, data=-1, tensor=1))
    run = pipeline_grads(stage_fns(model), get_schedule(name, p, m), mesh, remat=remat)
    with jax.set_mesh(mesh):
        compiled = jax.jit(run).lower(params["embed"], params["blocks"], params["head"],
                                      tokens, tokens).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_size_1_axes_are_manual_in_the_pipeline_so_its_program_holds_no_open_constraints():
    """With tensor = expert = 1 left automatic, JAX 0.10 wrapped nearly every op of the
    tick loop in an all-open sharding constraint (a third of a Gemma step's StableHLO,
    ``benchmarks/shard_map_axes.py``): size-1 axes are manual too
    (``parallel.mesh.manual_axis_names``). With tensor = 2, tensor stays automatic."""
    from mindpipe_jax.parallel.mesh import manual_axis_names

    cfg = ModelConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2)
    model = GPT(cfg, rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    tokens = jax.ShapeDtypeStruct((2, 4, 16), jnp.int32)
    for tensor, open_ok in ((1, False), (2, True)):
        mesh = make_mesh(ParallelConfig(pipe=2, data=4 // tensor, tensor=tensor))
        assert ("tensor" in manual_axis_names(mesh, ("pipe", "data"))) == (tensor == 1)
        run = pipeline_grads(stage_fns(model), get_schedule("1f1b", 2, 2), mesh)
        with jax.set_mesh(mesh):
            text = jax.jit(run).lower(params["embed"], params["blocks"], params["head"],
                                      tokens, tokens).as_text()
        open_constraints = text.count("[{?}")
        assert (open_constraints > 100) == open_ok, (tensor, open_constraints)


def test_1f1b_memory_is_flat_in_microbatches_while_gpipe_grows():
    ms = (8, 32)  # both >= 2p - 1, what fused 1F1B keeps on stage 0 at most
    one_f_one_b = [_temp_bytes("1f1b", m, remat=False) for m in ms]
    gpipe = [_temp_bytes("gpipe", m, remat=False) for m in ms]
    # 4x the microbatches: 1F1B keeps 2p - 1 slots (inputs grow only by the token ids),
    # GPipe keeps every microbatch's residuals until the flush.
    assert one_f_one_b[1] < 1.25 * one_f_one_b[0], one_f_one_b
    assert gpipe[1] > 2 * gpipe[0], gpipe
    assert one_f_one_b[1] < gpipe[1] / 2


@pytest.mark.slow
def test_online_repartition_keeps_every_bit_and_a_resume_keeps_its_split(tmp_path, monkeypatch, capsys):
    common = (*TINY, "train.steps=4", "train.checkpoint_every=2", "train.log_every=2",
              "parallel.pipe=2", "parallel.data=4", "parallel.microbatches=2",
              "parallel.stage_layers=[1, 3]")
    online = mp.train(None, None, mp.Config(), *common, f"train.out_dir={tmp_path / 'online'}",
                      "parallel.repartition_after=2", "train.log_every=4")
    events = [h["repartition"] for h in online.history if "repartition" in h]
    assert len(events) == 1 and events[0]["before"] == [1, 3]
    after = events[0]["after"]
    assert sum(after) == 4
    printed = capsys.readouterr().out.splitlines()
    assert f"step 2 | repartition [1, 3] -> {after}" in printed
    assert "step 2" not in printed  # nothing else to log at step 2: no bare step line
    online_bits = [np.asarray(x).tobytes() for x in jax.tree.leaves(jax.device_get(online.state))]
    # A requeued job resumes with the command it started with: it runs the split the
    # repartition chose (saved with step 2's checkpoint: the repartition comes before the
    # save), not parallel.stage_layers again. Before, repartition_after never fired again
    # past step 2 and the resumed run trained on [1, 3] to the end.
    from mindpipe_jax.train.reconfigure import Layout

    compiled, compile_layout = [], Layout.compile

    def recording(layout, *args, **kwargs):
        compiled.append(list(layout.cfg.parallel.stage_layers))
        return compile_layout(layout, *args, **kwargs)

    shutil.rmtree(online.checkpoint_dir / "4")
    monkeypatch.setattr(Layout, "compile", recording)
    again = mp.train(None, None, mp.Config(), *common, f"train.out_dir={tmp_path / 'online'}",
                     "parallel.repartition_after=2", "train.resume=true")
    monkeypatch.undo()
    # (compile is asked twice for the run's own step, before any file and by the loop: one program)
    assert compiled and all(split == after for split in compiled), compiled
    assert not [h for h in again.history if "repartition" in h]
    assert (f"resuming with the stage split {after} that the repartition at step 2 chose (the run "
            f"started from parallel.stage_layers=[1, 3])") in capsys.readouterr().out
    assert [np.asarray(x).tobytes() for x in jax.tree.leaves(jax.device_get(again.state))] == online_bits
    # The same run stopped at step 2 and restarted with the new split must land on
    # the same bits: repartitioning in place loses nothing a restart would keep.
    restart = mp.train(None, None, mp.Config(), *common, f"train.out_dir={tmp_path / 'r'}")

    shutil.rmtree(restart.checkpoint_dir / "4")
    resumed = mp.train(None, None, mp.Config(), *common, f"train.out_dir={tmp_path / 'r'}",
                       "train.resume=true", f"parallel.stage_layers={after}")
    for a, b in zip(jax.tree.leaves(jax.device_get(online.state)),
                    jax.tree.leaves(jax.device_get(resumed.state)), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert np.isfinite(online.history[-1]["loss"])


@pytest.mark.slow
def test_a_stop_at_the_repartition_step_leaves_the_repartition_to_the_resume(tmp_path, monkeypatch, capsys):
    """A SIGTERM right at ``repartition_after`` saves and exits without measuring and
    recompiling; the resume owes the repartition and runs it after its first step. Before,
    ``repartition_after`` (past by then) never fired and the requeued job trained on the
    unbalanced split to the end."""
    from mindpipe_jax.train.checkpoint import read_meta
    from mindpipe_jax.train.signals import StopSignals

    common = (*TINY, "train.steps=4", "train.checkpoint_every=2", "train.log_every=2",
              "parallel.pipe=2", "parallel.data=4", "parallel.microbatches=2",
              "parallel.stage_layers=[1, 3]", "parallel.repartition_after=2", f"train.out_dir={tmp_path}")
    monkeypatch.setattr(StopSignals, "reached", lambda self, step: "SIGTERM" if step == 2 else None)
    stopped = mp.train(None, None, mp.Config(), *common)
    monkeypatch.undo()
    assert stopped.stopped == "SIGTERM" and not [h for h in stopped.history if "repartition" in h]
    step, meta = read_meta(stopped.checkpoint_dir)
    assert step == 2 and meta["repartition_owed"] == 2 and "repartition" not in meta
    capsys.readouterr()
    resumed = mp.train(None, None, mp.Config(), *common, "train.resume=true")
    assert "the repartition that the stop after step 2 put off runs after step 3" in capsys.readouterr().out
    events = [(h["step"], h["repartition"]) for h in resumed.history if "repartition" in h]
    assert [(s, e["before"]) for s, e in events] == [(3, [1, 3])], events
    after = events[0][1]["after"]
    assert list(resumed.config.parallel.stage_layers) == after
    step, meta = read_meta(resumed.checkpoint_dir)
    assert step == 4 and meta["repartition"] == {"step": 3, "stage_layers": after}
    assert "repartition_owed" not in meta


def test_a_resume_keeps_a_repartitioned_split_only_with_the_config_that_chose_it():
    from mindpipe_jax.train.repartition import resumed_split

    cfg = mp.Config().replace("parallel.pipe=2", "parallel.stage_layers=[1, 3]",
                              "parallel.repartition_after=2")
    saved = json.loads(json.dumps(cfg.to_dict()))  # as a checkpoint's meta holds it
    meta = {"config": saved, "repartition": {"step": 2, "stage_layers": [2, 2]}}
    assert resumed_split(meta, cfg)[0] == [2, 2]
    assert resumed_split({"config": meta["config"]}, cfg) is None  # saved before any repartition
    for changed in ("parallel.pipe=4", "parallel.stage_layers=[3, 1]", "parallel.repartition_after=0",
                    "model.n_layers=6", "parallel.schedule=zb-h1"):
        assert resumed_split(meta, cfg.replace(changed)) is None, changed
    assert resumed_split(meta, cfg.replace("train.steps=9", "parallel.data=2"))[0] == [2, 2]


def test_pairwise_accumulator_is_the_balanced_tree():
    """``ticks._pairwise_add`` fed 8 values in order, or reversed (GPipe's backward), leaves
    ``pairwise_sum`` of them, bit for bit, in its top row of 4; a plain running sum differs."""
    from mindpipe_jax.parallel.ordered_sum import pairwise_sum
    from mindpipe_jax.parallel.pipeline.runtime.ticks import _pairwise_add

    values = jnp.asarray(np.random.default_rng(0).normal(size=(8, 64)) * 10.0 ** np.arange(-3, 5)[:, None],
                         jnp.float32)
    want = np.asarray(pairwise_sum(values))
    for order in (range(8), reversed(range(8))):
        acc = jnp.zeros((4, 64), jnp.float32)
        for rank, i in enumerate(order):
            acc = _pairwise_add(acc, 0, jnp.int32(rank), values[i])
        assert np.asarray(acc[3]).tobytes() == want.tobytes()
    running = values[0]
    for i in range(1, 8):
        running = running + values[i]
    assert np.asarray(running).tobytes() != want.tobytes()  # the control: association shows


def test_arrival_ranks_accept_the_orders_that_keep_the_tree():
    from mindpipe_jax.parallel.pipeline.runtime.ticks import arrival_ranks

    for name, v in (("1f1b", 1), ("gpipe", 1), ("zb-h1", 1), ("interleaved", 2), ("zbv", 2)):
        assert arrival_ranks(make_plan(get_schedule(name, 2, 8, v))) is not None, name
    with pytest.raises(ValueError, match="power-of-two microbatch count"):
        pipeline_grads(stage_fns(tiny_gpt(2)[0]), get_schedule("1f1b", 2, 6), make_mesh(
            ParallelConfig(pipe=2, data=4, tensor=1)), deterministic=True)


@pytest.mark.slow
@pytest.mark.xla_default_emitters  # bitwise across programs: as users compile them
@pytest.mark.parametrize("name,v", [("gpipe", 1), ("interleaved", 2), ("zbv", 2)])
def test_deterministic_pipeline_grads_are_the_same_bits_on_1_and_4_data_devices(name, v):
    """``pipeline_grads(deterministic=True)`` with 8 units of 2 rows: on pipe2 x data1 (8
    microbatches) and pipe2 x data4 (2 each) the loss and gradients equal the unpipelined
    ones and each other bit for bit (GPipe adds its microbatches in reverse; the
    V-shaped ZB-V holds two chunks per device)."""
    from mindpipe_jax.train.step import unit_microbatches

    model, params = tiny_gpt(4)
    tokens = np.random.default_rng(3).integers(0, 64, (16, 9)).astype(np.int32)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    ref_loss, ref_grads = reference(model, params, inputs[None], targets[None])
    results = []
    for data in (1, 4):
        m = 8 // data
        mesh = make_mesh(ParallelConfig(pipe=2, data=data, tensor=1), jax.devices()[:2 * data])
        run = pipeline_grads(stage_fns(model), get_schedule(name, 2, m, v), mesh, deterministic=True)
        micro = unit_microbatches({"inputs": inputs, "targets": targets}, m, data)
        with jax.set_mesh(mesh):
            loss, grads = jax.jit(run)(params["embed"], params["blocks"], params["head"], micro["inputs"],
                                       micro["targets"])
        assert_matches(loss, grads, ref_loss, ref_grads)
        results.append([np.asarray(x).tobytes() for x in jax.tree.leaves((loss, grads))])
    assert results[0] == results[1]
