"""SPara through the pipeline (``supernet/pipelined.py``): the subnets of a step on a ``pipe``
axis, with ``subnet``, ``tensor`` and ``data`` beside it.

Checked against training the subnets with no framework code
(``supernet_oracle.sequential_reference``: dense GPTs of the subnets' own sizes in plain
JAX, optax's clipping and Adam): ``sync`` on subnet2 x pipe2 x tensor2 and ``sequential``
on pipe2 x data2 x tensor2 (1F1B) and pipe2 x data4 (ZB-H1, whose backward is split at
the equation level), losses and parameters after two steps at fp32 tolerance (the
pipeline sums microbatches, devices and tensor ranks in other orders). One subnet's
gradient through the pipeline is compared with ``jax.value_and_grad`` of its loss.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from byom_models import MixerSupernet
from flax import nnx
from supernet_oracle import lazy_adamw_reference, sequential_reference
from supernet_tiny import CFG, OPS, OPTIM, SUBNETS, make_tiny, tiny_batch

import mindpipe_jax as mp
from mindpipe_jax.config import OptimConfig, ParallelConfig
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.parallel.mesh import make_mesh
from mindpipe_jax.parallel.pipeline import get_schedule
from mindpipe_jax.parallel.pipeline.runtime import pipeline_grads
from mindpipe_jax.supernet import init_state, search_checkpoint, supernet_spec, train_supernet
from mindpipe_jax.supernet.layout import state_shardings
from mindpipe_jax.supernet.optimizer import adamw, adamw_tree
from mindpipe_jax.supernet.pipelined import PipelinedStep, check_pipelined, stage_fns
from mindpipe_jax.supernet.pipelined_sliced import SlicedPipelinedStep, pipeline_size

pytestmark = pytest.mark.xdist_group("supernet_pipeline")


@pytest.fixture(scope="module")
def spec_create():
    return supernet_spec(make_tiny, 0)


def test_one_subnet_through_the_pipeline_has_the_gradient_of_its_loss(spec_create):
    """Each of two subnets (one skips its second block) through 1F1B on pipe2 x data4, 4
    microbatches: loss and gradient of every parameter equal ``jax.value_and_grad`` of the
    supernet's loss on the whole batch, and its FFN candidates it did not choose get zero."""
    spec, create = spec_create
    params = jax.jit(create)()
    mesh = make_mesh(ParallelConfig(pipe=2, data=4, tensor=1))
    run = pipeline_grads(stage_fns(spec), get_schedule("1f1b", 2, 4), mesh)
    batch = tiny_batch(16, 3)

    @jax.jit
    def through_pipe(params, subnet):
        condition = spec.module.stage_conditions(subnet)
        micro = jax.tree.map(lambda x: x.reshape(4, 4, CFG.seq_len), batch)
        return run(params["embed"], {"weights": params["blocks"], "condition": condition}, params["head"],
                   micro["inputs"], micro["targets"])

    for subnet in SUBNETS[:2]:
        with jax.set_mesh(mesh):
            loss, grads = through_pipe(params, jnp.asarray(subnet))
        want_loss, want = spec.loss_and_grad(params, jnp.asarray(subnet), batch, ravel=False)
        assert np.all(np.asarray(grads["blocks"]["condition"]) == 0)
        got = {"blocks": grads["blocks"]["weights"], "embed": grads["embed"], "head": grads["head"]}
        np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(spec.ravel(got)), np.asarray(spec.ravel(want)), rtol=1e-4,
                                   atol=1e-7)
        unused = ~np.asarray(spec.module.units(subnet))
        w_in = np.asarray(grads["blocks"]["weights"]["ffn"]["w_in"])
        assert np.all(w_in[unused] == 0) and np.any(w_in[~unused] != 0)


@pytest.mark.slow
@pytest.mark.parametrize("semantics,layout,schedule,grad_sync,sliced", [
    ("sync", dict(subnet=2, pipe=2, tensor=2, data=1), "1f1b", "end", False),
    ("sync", dict(pipe=2, data=4, tensor=1), "1f1b", "end", False),
    ("sequential", dict(pipe=2, data=2, tensor=2), "1f1b", "end", False),
    ("sequential", dict(pipe=2, data=4, tensor=1), "zb-h1", "chunk", False),
    ("sequential", dict(pipe=2, fsdp=2, data=2, tensor=1), "1f1b", "end", False),
    ("sync", dict(pipe=2, fsdp=4, tensor=1), "zb-h1", "end", False),
    ("sync", dict(subnet=2, pipe=2, tensor=2, data=1), "1f1b", "end", True),
    ("sequential", dict(pipe=2, fsdp=2, data=2, tensor=1), "zb-h1", "chunk", True),
], ids=["sync-subnet2xpipe2xtensor2", "sync-pipe2xdata4-all-subnets-one-pass",
        "sequential-pipe2xdata2xtensor2", "sequential-pipe2xdata4-zbh1-chunk-sync",
        "sequential-pipe2xfsdp2xdata2", "sync-pipe2xfsdp4-zbh1",
        "sliced-sync-subnet2xpipe2xtensor2", "sliced-sequential-pipe2xfsdp2xdata2-zbh1-chunk-sync"])
def test_spara_through_the_pipeline_is_the_plain_loop(spec_create, semantics, layout, schedule, grad_sync,
                                                      sliced):
    """Two steps of K = 4 subnets, 4 microbatches each, against the plain-optax loop:
    ``sequential`` is training them one after another (each its own clipped AdamW step),
    ``sync`` one averaged update per step with each subnet's gradient clipped on its own:
    the subnets are the pipeline's microbatches (all 4 in one pass on pipe2 x data4, 2 per
    subnet group on subnet2), their gradients kept apart. ZB-H1 with ``chunk`` syncs each
    chunk's gradient over data behind the ticks (AFAPAB's ring) under its split backward.
    ``sliced``: each pass at its subnets' size (``pipelined_sliced.py``); on subnet2 x
    tensor2 the sizes are rounded to even head counts and the groups padded (3 sizes over
    4 subnets); on fsdp2 the sliced weights enter kept sharded."""
    spec, create = spec_create
    par = ParallelConfig(**layout, microbatches=4, schedule=schedule, grad_sync=grad_sync)
    mesh = make_mesh(par)
    kind = partial(SlicedPipelinedStep, levels=4) if sliced else PipelinedStep
    step = kind(spec, mesh, par, semantics=semantics, subnets_per_step=4, vmap_width=1,
                global_batch=16, optim=OPTIM, total_steps=10)
    state = jax.jit(lambda: init_state(spec, create()), out_shardings=state_shardings(mesh, spec))()
    losses = []
    for seed in (1, 2):
        state, metrics = step(state, step.plan(SUBNETS), tiny_batch(16, seed))
        losses.append(np.asarray(metrics["loss"]))
    want, want_losses = sequential_reference(jax.jit(create)(), SUBNETS, [tiny_batch(16, s) for s in (1, 2)],
                                             OPTIM, 10, spec.space, OPS, semantics)
    np.testing.assert_allclose(np.concatenate(losses), want_losses, rtol=1e-5)
    got, want = (np.asarray(spec.ravel(p)) for p in (state["params"], want))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # The blocks stay split over pipe between steps: a device holds its stage's layers
    # (and with fsdp and tensor its share of them: w_in is stored P(pipe, -, fsdp, tensor)).
    if sliced:  # tensor2 rounds the heads up to even counts: (64, 3) -> (64, 4), (128, 3) -> (128, 4)
        plan = step.plan(SUBNETS)
        assert len(set(plan.sizes)) == (3 if layout["tensor"] == 2 else 4), plan.sizes
        # One program per (size, pass length, depth), cached: the second step compiled nothing.
        assert step.programs == len({(p[0], p[1].shape[1], p[5]) for p in plan.passes}) + 2
        # A pass runs its deepest subnet's blocks (depths (1, 2): subnets 1 and 3 run 1 of
        # the 2, and a sequential pass of either skips stage 1's block), under ZB-H1 too
        # (its B and W skip them inside the split backward).
        deepest = [max(int(SUBNETS[i, 0]) + 1 for i in p[3].ravel() if i < 4) for p in plan.passes]
        assert [p[5] for p in plan.passes] == deepest
        assert semantics != "sequential" or deepest == [2, 1, 2, 1]
    w_in = state["params"]["blocks"]["ffn"]["w_in"]
    assert w_in.addressable_shards[0].data.shape[0] == CFG.n_layers // 2, w_in.sharding.spec
    split = 2 * layout.get("fsdp", 1) * layout.get("tensor", 1)
    assert w_in.addressable_shards[0].data.size * split == w_in.size, w_in.sharding.spec


def test_a_sliced_pass_costs_its_size(spec_create):
    """The weights enter the pipeline cut to the pass's size: XLA's FLOP count of a pass
    program (lowered, not compiled) grows with the size, the full-size pass costs what the
    masked step's pass does, and on tensor2 odd head counts round up to even."""
    spec, create = spec_create
    par = ParallelConfig(pipe=2, data=4, tensor=1, microbatches=4)
    mesh = make_mesh(par)
    sizes = dict(subnets_per_step=4, vmap_width=1, global_batch=16, optim=OPTIM, total_steps=10)
    step = SlicedPipelinedStep(spec, mesh, par, levels=4, semantics="sequential", **sizes)
    state = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                         jax.eval_shape(lambda: init_state(spec, create())), state_shardings(mesh, spec))
    tokens = jax.ShapeDtypeStruct((16, CFG.seq_len), np.int32)
    batch = {"inputs": tokens, "targets": tokens}
    plan = step.plan(SUBNETS)
    programs = step.lower(state, plan, batch)  # start, one per pass, finish
    assert len(programs) == plan.num_passes + 2
    flops = {size: program.cost_analysis()["flops"]
             for (size, *_), program in zip(plan.passes, programs[1:-1], strict=True)}
    with jax.set_mesh(mesh):
        masked = PipelinedStep(spec, mesh, par, semantics="sequential", **sizes)
        one = jax.jit(lambda p, c, b: masked._grads(p, c, masked._micro(b)))
        conditions = jnp.zeros((1, CFG.n_layers, 4))
        masked_flops = one.lower(state["params"], conditions, batch).cost_analysis()["flops"]
    assert plan.sizes == ((64, 3), (128, 4), (128, 3), (32, 1))
    assert flops[(32, 1)] < flops[(64, 3)] < flops[(128, 3)] < flops[(128, 4)], flops
    assert flops[(32, 1)] < 0.7 * flops[(128, 4)], flops  # embed and head (vocab 256) are not sliced
    # The full-size pass: the masked pass plus the padding and the update.
    assert masked_flops <= flops[(128, 4)] < 1.3 * masked_flops, (masked_flops, flops)
    assert pipeline_size(spec.module, SUBNETS[0], 4, tensor=2) == (64, 4)
    assert pipeline_size(spec.module, SUBNETS[3], 4, tensor=2) == (32, 2)


@pytest.mark.parametrize("layout,keys,message", [
    (dict(pipe=2, data=4), dict(semantics="operator-causal"),
     "supernet.semantics='operator-causal' does not run through a pipeline (parallel.pipe=2); use sync or "
     "sequential, or parallel.pipe=1"),
    (dict(pipe=2, subnet=2, data=2), dict(semantics="sequential"),
     "parallel.subnet=2 with supernet.semantics='sequential' through a pipeline"),
    (dict(pipe=2, data=4), dict(vmap_width=2), "supernet.vmap_width=2 has no effect through a pipeline"),
    (dict(pipe=2, subnet=4, data=1), dict(subnets_per_step=6),
     "supernet.subnets_per_step=6 must be divisible by parallel.subnet=4"),
    (dict(pipe=2, data=4), dict(global_batch=20),
     "train.global_batch=20 must be divisible by parallel.microbatches x fsdp x data = 2 x 4 = 8"),
    (dict(pipe=4, data=2), dict(n_layers=6),
     "model.n_layers=6 must be divisible by parallel.pipe x parallel.virtual_stages = 4 x 1 = 4"),
    (dict(pipe=2, data=4), dict(grad_sync="chunk"),
     "parallel.grad_sync='chunk' / grad_sync_dtype='fp32' with supernet.semantics='sync' through a pipeline"),
    (dict(pipe=2, expert=2, data=2), {},
     "supernet training through a pipeline splits devices over parallel.subnet, pipe, fsdp, data and tensor "
     "only; got expert=2"),
])
def test_what_does_not_run_through_the_pipeline_is_refused_in_one_line(layout, keys, message):
    par = ParallelConfig(**{"tensor": 1, **layout}, microbatches=2, grad_sync=keys.pop("grad_sync", "auto"))
    sizes = {"semantics": "sync", "subnets_per_step": 4, "vmap_width": 1, "global_batch": 16, "n_layers": 4,
             **keys}
    with pytest.raises(ConfigError) as err:
        check_pipelined(None, make_mesh(par), par, **sizes)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_user_supernet_is_split_by_its_own_depth_not_model_n_layers():
    """A user's supernet (2 blocks) through pipe=2 with ``model.n_layers=3`` left as it was:
    the GPT's depth does not divide the stages, the model's does. Before: refused, naming
    model.n_layers=3, before the model was built."""
    result = train_supernet(make_tiny, None, mp.Config().replace(
        "model.n_layers=3", f"model.seq_len={CFG.seq_len}", "data.source=synthetic", "train.steps=1",
        "train.global_batch=16", "train.progress=false", "parallel.pipe=2", "parallel.data=4",
        "parallel.tensor=1", "parallel.microbatches=2", "supernet.subnets_per_step=2",
        "supernet.semantics=sync"), search=False, log=lambda *_: None)
    assert result.history[-1]["step"] == 1 and np.isfinite(result.history[-1]["loss"])


@pytest.mark.slow
def test_mindpipe_supernet_through_the_pipeline_resumed_then_searched(tmp_path):
    """The user's path: ``mindpipe supernet`` on pipe=2 x data=4 (sequential, 1F1B),
    checkpointed after step 1, resumed to step 2 (the moments restored onto the pipeline's
    layout); ``mindpipe search`` of the run (its stages become data devices) finds the same
    top-k as the search at the end of training."""
    overrides = ("model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.seq_len=32",
                 'data.source="synthetic"', "data.synthetic_tokens=65536", "train.global_batch=16",
                 "train.log_every=1", "train.checkpoint_every=1", f"train.out_dir={tmp_path / 'run'}",
                 "parallel.pipe=2", "parallel.microbatches=2", "parallel.data=4", "parallel.tensor=1",
                 "parallel.simulate_cpu_devices=0", "supernet.semantics=sequential",
                 "supernet.subnets_per_step=2", "supernet.search_population=4",
                 "supernet.search_generations=1", "supernet.search_top_k=2", "supernet.search_eval_batches=1")
    lines = []
    first = train_supernet(config=mp.Config().replace(*overrides, "train.steps=1"), log=lines.append,
                           checkpoint=True)
    assert "mesh subnet=1 x pipe=2 x data=4" in lines[0], lines[0]
    assert "through the pipeline (1f1b" in lines[0], lines[0]
    result = train_supernet(config=mp.Config().replace(*overrides, "train.steps=2", "train.resume=true"),
                            log=lines.append, checkpoint=True)
    assert [h["step"] for h in first.history] == [1] and [h["step"] for h in result.history] == [2]
    assert np.isfinite([h["loss"] for h in result.history]).all()
    assert int(result.state["opt"]["count"][-1]) == 4  # two steps of two subnets, each updating the shared
    top = result.search.top
    again, cfg, step = search_checkpoint(tmp_path / "run")
    assert step == 2 and cfg.parallel.pipe == 1 and cfg.parallel.data == 8
    assert [t["subnet"] for t in again.top] == [t["subnet"] for t in top]
    np.testing.assert_allclose([t["loss"] for t in again.top], [t["loss"] for t in top], rtol=1e-6)


@pytest.mark.parametrize("shared", [True, False])
def test_adamw_on_the_tree_is_the_raveled_lazy_adamw(spec_create, shared):
    """The pipeline's leaf-by-leaf AdamW (``adamw_tree``) against the raveled one the other
    SPara steps use: the same parameters, moments and counts, with weight decay, some units
    selected and the shared weights in or out (to rounding: XLA may turn a division by a
    broadcast value into a multiplication; where the update cancels the weight, that ulp
    of the terms is what remains)."""
    spec, create = spec_create
    params = jax.jit(create)()
    optim = OptimConfig(lr=1e-3, weight_decay=0.1)
    rng = np.random.default_rng(0)
    grads = spec.unravel(jnp.asarray(rng.normal(size=spec.padded_size), jnp.float32))
    mu = jnp.asarray(rng.normal(size=spec.padded_size), jnp.float32)
    nu = jnp.asarray(rng.random(spec.padded_size), jnp.float32)
    count = jnp.asarray(rng.integers(0, 5, spec.num_units + 1), jnp.int32)
    units = jnp.asarray(rng.random(spec.unit_grid) < 0.5)
    p1, o1 = adamw(spec, spec.ravel(params), spec.ravel(grads), {"mu": mu, "nu": nu, "count": count}, units,
                   shared, 1e-3, optim)
    moments = {"mu": spec.unravel(mu, jnp.float32), "nu": spec.unravel(nu, jnp.float32)}
    p2, m2, c2 = adamw_tree(spec, params, grads, moments, count, units, shared, 1e-3, optim)
    n = spec.num_params
    np.testing.assert_array_equal(c2, o1["count"])
    for want, got in ((p1, p2), (o1["mu"], m2["mu"]), (o1["nu"], m2["nu"])):
        np.testing.assert_allclose(np.asarray(spec.ravel(got))[:n], np.asarray(want)[:n], rtol=2e-6,
                                   atol=1e-8)  # one ulp of a weight ~0.05 is 4e-9
    # Untouched: the units not selected (and the shared weights when not `shared`).
    moved = np.asarray(spec.ravel(p2))[:n] != np.asarray(spec.ravel(params))[:n]
    selected = np.append(np.asarray(units).reshape(-1), shared)[spec.unit_of[:n]]
    assert not moved[~selected].any() and moved[selected].mean() > 0.99


def _trained_through_pipe(spec, create, *, semantics, data, deterministic, fsdp=1, sliced=False):
    """Two steps of the 4 subnets through a 1F1B pipeline of 2 stages on 2 x ``fsdp`` x
    ``data`` devices (each device's 8 / (fsdp x data) virtual shards its microbatches), the
    state on the host; ``sliced``: each pass at its subnets' size."""
    par = ParallelConfig(pipe=2, fsdp=fsdp, data=data, tensor=1, microbatches=8 // (fsdp * data))
    mesh = make_mesh(par, jax.devices()[:2 * fsdp * data])
    kind = partial(SlicedPipelinedStep, levels=4) if sliced else PipelinedStep
    step = kind(spec, mesh, par, semantics=semantics, subnets_per_step=4, vmap_width=1,
                global_batch=16, optim=OPTIM, total_steps=10, deterministic=deterministic, virtual_shards=8)
    state = jax.jit(lambda: init_state(spec, create()), out_shardings=state_shardings(mesh, spec))()
    for seed in (1, 2):
        state, metrics = step(state, step.plan(SUBNETS), tiny_batch(16, seed))
    leaves = jax.tree_util.tree_flatten_with_path(jax.device_get(state))[0]
    return {jax.tree_util.keystr(path): np.asarray(x) for path, x in leaves}, np.asarray(metrics["loss"])


def _differing(a, b):
    return [k for k in a if a[k].tobytes() != b[k].tobytes()]


@pytest.mark.slow
@pytest.mark.xla_default_emitters  # bitwise across programs: as users compile them
def test_deterministic_spara_through_the_pipeline_is_bitwise_equal_on_2_4_8_devices(spec_create):
    """``train.deterministic``: two steps on pipe2 x data1 / data4 / fsdp4 end with
    the same parameters, moments and losses bit for bit (``sync``, the 4 subnets in one
    pass; ``sequential`` on 2 and 8 devices; and ``sync`` sliced, 4 passes of one size
    each, on 2 and 8 devices). The control: the same pipelines without it differ between
    2 and 8 devices, so the comparison can tell."""
    spec, create = spec_create
    for semantics, counts, sliced in (("sync", (1, 4, "fsdp4"), False), ("sequential", (1, 4), False),
                                      ("sync", (1, 4), True)):
        runs = {d: _trained_through_pipe(spec, create, semantics=semantics, deterministic=True, sliced=sliced,
                                         **(dict(data=1, fsdp=4) if d == "fsdp4" else dict(data=d)))
                for d in counts}
        (ref, ref_loss), n = runs[1], len(runs[1][0])
        assert n >= 10  # params, both moments and the counts
        for d in counts[1:]:
            state, loss = runs[d]
            assert not _differing(ref, state), (semantics, d, _differing(ref, state))
            assert loss.tobytes() == ref_loss.tobytes(), (semantics, d, loss, ref_loss)
    plain = [_trained_through_pipe(spec, create, semantics="sync", data=d, deterministic=False)[0]
             for d in (1, 4)]
    assert _differing(*plain), "plain pipelines were bitwise equal on 2 and 8 devices: the test cannot tell"


def test_deterministic_through_the_pipeline_needs_one_microbatch_per_virtual_shard():
    par = ParallelConfig(pipe=2, data=4, tensor=1, microbatches=4)
    with pytest.raises(ConfigError) as err:
        check_pipelined(None, make_mesh(par), par, semantics="sync", subnets_per_step=4, vmap_width=1,
                        global_batch=32, n_layers=4, deterministic=True, virtual_shards=8)
    assert str(err.value) == (
        "deterministic mode through a pipeline runs each virtual shard as one microbatch: "
        "parallel.microbatches=4 x fsdp x data (4) must equal train.virtual_shards=8; set "
        "parallel.microbatches=2 (or train.virtual_shards=16)")


# (keep, op) per block, keep = 0; no subnet runs block 3's tanh candidate.
MIXER_SUBNETS = np.array([[0, 0, 0, 1, 1, 0, 0, 0],
                          [1, 0, 0, 0, 0, 0, 1, 1],
                          [0, 1, 1, 1, 0, 1, 0, 0],
                          [0, 0, 0, 0, 0, 0, 0, 0]], np.int32)


@pytest.mark.slow
@pytest.mark.parametrize("semantics,layout,schedule", [
    ("sync", dict(pipe=2, data=4, tensor=1), "1f1b"),
    ("sequential", dict(pipe=2, data=2, tensor=2), "zb-h1"),
], ids=["sync-pipe2xdata4-1f1b", "sequential-pipe2xdata2xtensor2-zbh1"])
def test_a_user_supernet_of_another_family_through_the_pipeline(semantics, layout, schedule):
    """A supernet the project did not design (``byom_models.MixerSupernet``: attention-free
    mixer blocks each kept or skipped on its own, relu/tanh FFN candidates, RMSNorm) through
    the pipeline, two steps of 4 subnets, against ``lazy_adamw_reference``: plain
    ``jax.value_and_grad`` of the module's own loss, optax clipping and Adam per unit."""
    spec, create = supernet_spec(MixerSupernet, 0)
    optim = OptimConfig(lr=1e-2, warmup_steps=0, clip_norm=0.5, eps=1e-3, weight_decay=0.1)
    par = ParallelConfig(**layout, microbatches=2, schedule=schedule)
    mesh = make_mesh(par)
    step = PipelinedStep(spec, mesh, par, semantics=semantics, subnets_per_step=4, vmap_width=1,
                         global_batch=16, optim=optim, total_steps=10)
    state = jax.jit(lambda: init_state(spec, create()), out_shardings=state_shardings(mesh, spec))()
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(2):
        toks = rng.integers(0, 64, (16, 17)).astype(np.int32)
        batches.append({"inputs": toks[:, :-1], "targets": toks[:, 1:]})
    losses = []
    for batch in batches:
        state, metrics = step(state, step.plan(MIXER_SUBNETS), batch)
        losses.append(np.asarray(metrics["loss"]))

    module = MixerSupernet(nnx.Rngs(0))
    graphdef = nnx.graphdef(module)
    loss_and_grad = jax.jit(jax.value_and_grad(
        lambda p, subnet, b: nnx.merge(graphdef, p).loss(b["inputs"], b["targets"], subnet)))
    params = jax.jit(create)()
    candidate = jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key in ("w_in", "w_out"), params)
    decay = jax.tree_util.tree_map_with_path(
        lambda path, _: path[-1].key in ("w_in", "w_out", "table", "out"), params)
    grad_of = lambda p, s, b: loss_and_grad(p, jnp.asarray(s), b)  # noqa: E731
    want, want_losses = lazy_adamw_reference(params, grad_of, candidate, decay, module.units, MIXER_SUBNETS,
                                             batches, optim, 10, semantics)
    np.testing.assert_allclose(np.concatenate(losses), want_losses, rtol=1e-5)
    for (path, got), w in zip(jax.tree_util.tree_flatten_with_path(jax.device_get(state["params"]))[0],
                              jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    moved = np.asarray(jax.device_get(state["params"]["blocks"]["w_in"])) != np.asarray(
        params["blocks"]["w_in"])
    assert moved[0, 0].any() and not moved[3, 1].any()  # a unit no subnet ran stays as it was
