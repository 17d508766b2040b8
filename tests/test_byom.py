"""Bring your own model: models written elsewhere train on every axis, gradients equal
to an independent single-device reference (plain ``jax.value_and_grad``)."""

import functools
import re
import subprocess
import sys
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from byom_models import (
    BF16Net,
    Gemma,
    HalfSupernet,
    HFStyle,
    KeyedDropout,
    Llama,
    LlamaStyle,
    OtherNames,
    PaddedLlamaStyle,
    PartsOnly,
    PlainListNet,
    PositionsInLayers,
    ReadsBesideTheChain,
    RematInTheLoop,
    ResidualInTheLoop,
    ScannedWithBuffers,
    SoftExperts,
    Sowing,
    StockGPT2,
    TwoOpSupernet,
    WithBatchStats,
    WithBuffers,
    linen_transformer,
    padded_tokens,
    reference_grads,
    tokens,
)
from cli_procs import cli_env
from flax import nnx

import mindpipe_jax as mp
from mindpipe_jax.config import Config
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.models import GPT
from mindpipe_jax.models.bridge import from_linen
from mindpipe_jax.parallel.mesh import make_mesh
from mindpipe_jax.supernet.spec import supernet_spec
from mindpipe_jax.train.pipeline_storage import split_ends_over_pipe
from mindpipe_jax.train.reconfigure import build_layout
from mindpipe_jax.train.state import init_train_state, model_spec
from mindpipe_jax.train.step import make_eval_step, make_grad_fn
from mindpipe_jax.train.step_checks import check_user_model_keys

SEED = 0
ROWS = 16  # global batch: 4 microbatches of 4 rows, 2 per data shard


def framework_grads(factory, *overrides, devices=None, batch=None):
    """Loss and gradients through the train step's own gradient function (on ``devices``:
    default all), for ``batch`` (default ``tokens(1, ROWS)``)."""
    cfg = Config().replace("model.vocab_size=64", "model.seq_len=8", f"train.global_batch={ROWS}",
                           f"train.seed={SEED}", *overrides)
    mesh = make_mesh(cfg.parallel, devices)
    with jax.set_mesh(None):
        spec, create = model_spec(factory, mesh, SEED)
    spec = split_ends_over_pipe(spec, cfg.model.seq_len, mesh)  # as the train layout stores them
    params = jax.jit(create, out_shardings=spec.storage)()
    grad_fn = make_grad_fn(spec, cfg, mesh)
    batch = tokens(1, ROWS) if batch is None else batch
    loss, grads, _ = jax.jit(grad_fn)(params, batch, jax.random.key(0))
    return loss, jax.device_get(grads)


def assert_grads_equal(got, want):
    loss, grads = got
    ref_loss, ref_grads = want
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(ref_grads),
                            strict=True):
        assert np.all(np.isfinite(g)), path
        # fp32: the pipeline sums microbatches and shards in another order (~1e-7).
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))


LINEN = from_linen(linen_transformer(), np.zeros((1, 8), np.int32))

FAMILIES = {
    # GQA with 1 kv head (fewer than tensor=2: the flat kv projection splits inside a
    # head), rotary, SwiGLU, output projection tied to the input embedding; the
    # reference attribute names.
    "llama-tied": lambda rngs: Llama(heads=4, kv_heads=1, tied=True, rngs=rngs),
    # The Llama family under its own names, stack run by nnx.scan: found in the trace.
    "llama-style": lambda rngs: LlamaStyle(rngs=rngs),
    # An nnx.List alternating local/global attention (split as groups of 2), qk-norm,
    # soft-caps, tied embeddings.
    "gemma": lambda rngs: Gemma(layers=8, rngs=rngs),
    # Linen through nnx.bridge: logical partitioning metadata, nn.scan blocks.
    "linen": LINEN,
}


@functools.cache
def reference(family: str):
    with nnx.use_eager_sharding(False):
        model = (FAMILIES | ODD)[family](nnx.Rngs(SEED))
    return reference_grads(model, tokens(1, ROWS))


# 3 heads of 8 on tensor=2: the flat [24, 24] projection splits mid-head, so
# reshaping it into heads needs a resharding collective.
ODD = {"odd-heads": lambda rngs: Llama(d=24, heads=3, kv_heads=3, rngs=rngs)}

SCHEDULES = [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("afapab", 2)]
PIPE_TENSOR = ("parallel.pipe=2", "parallel.data=2", "parallel.tensor=2", "parallel.microbatches=4")
LAYOUTS = {
    "data4xtensor2": ("parallel.data=4", "parallel.tensor=2"),
    "fsdp8": ("parallel.fsdp=8", "parallel.data=1", "parallel.tensor=1"),
    **{f"pipe2xdata2xtensor2-{s}": (*PIPE_TENSOR, f"parallel.schedule={s}", f"parallel.virtual_stages={v}")
       for s, v in SCHEDULES},
    "pipe4xdata2": ("parallel.pipe=4", "parallel.data=2", "parallel.tensor=1", "parallel.microbatches=4"),
}
# Every family on every axis (data x tensor, fsdp, pipe x data, pipe x tensor); the four
# pipe x tensor schedules rotate so each family runs two and each schedule two families
# (a schedule changes the tick table, the model enters only through the stage function).
# The odd-heads model below adds zb-h1 and afapab again.
PIPE_TENSOR_SCHEDULES = {"gemma": ("interleaved", "zb-h1"), "linen": ("1f1b", "afapab"),
                         "llama-style": ("interleaved", "afapab"), "llama-tied": ("1f1b", "zb-h1")}
FAMILY_LAYOUTS = [(family, layout) for family in sorted(FAMILIES) for layout in sorted(LAYOUTS)
                  if not layout.startswith("pipe2xdata2xtensor2-")
                  or layout.split("-", 1)[1] in PIPE_TENSOR_SCHEDULES[family]]


def test_the_rotation_covers_every_schedule_and_family_twice():
    pairs = [(f, lay.split("-", 1)[1]) for f, lay in FAMILY_LAYOUTS if lay.startswith("pipe2xdata2xtensor2-")]
    for schedule, _ in SCHEDULES:
        assert sum(s == schedule for _, s in pairs) == 2, schedule
    for family in FAMILIES:
        assert sum(f == family for f, _ in pairs) == 2, family


@pytest.mark.parametrize("family,layout", FAMILY_LAYOUTS, ids=[f"{f}-{lay}" for f, lay in FAMILY_LAYOUTS])
def test_model_family_gradients_equal_an_independent_reference(family, layout):
    got = framework_grads(FAMILIES[family], *LAYOUTS[layout])
    assert_grads_equal(got, reference(family))


# GPT-2 from Flax's stock layers (LayerNorm, MultiHeadAttention, biased Linear), its blocks a
# plain nnx.List of identical layers: the stack the pipeline finds is a list of period 1, which
# the step stacks as it stacks a grouped one (before 2026-12-05 it went in unstacked and the
# first layer's trace failed on a shape mismatch).
STOCK_LAYOUTS = {"pipe4xdata2": LAYOUTS["pipe4xdata2"],
                 "pipe2xdata2xtensor2-1f1b": LAYOUTS["pipe2xdata2xtensor2-1f1b"],
                 "pipe2xdata4-zb-h1": ("parallel.pipe=2", "parallel.data=4", "parallel.tensor=1",
                                       "parallel.microbatches=4", "parallel.schedule=zb-h1"),
                 "data4xtensor2": LAYOUTS["data4xtensor2"]}


@pytest.mark.parametrize("layout", sorted(STOCK_LAYOUTS))
def test_a_plain_list_of_stock_flax_layers_pipelines_with_the_reference_gradients(layout):
    got = framework_grads(lambda rngs: StockGPT2(rngs), *STOCK_LAYOUTS[layout])
    with nnx.use_eager_sharding(False):
        want = reference_grads(StockGPT2(nnx.Rngs(SEED)), tokens(1, ROWS))
    assert_grads_equal(got, want)


def test_layers_called_with_alternating_flags_pipeline_as_groups_of_two():
    """Like layers the loop calls with a static flag that alternates (scale=1.0, 0.5, ...,
    as a local/global attention flag would): the stack splits as groups of two, each layer
    called with its own flag, gradients as plain value_and_grad's."""
    def make(rngs):
        return StockGPT2(rngs, scales=[1.0, 0.5, 1.0, 0.5])

    got = framework_grads(make, *STOCK_LAYOUTS["pipe2xdata4-zb-h1"])
    with nnx.use_eager_sharding(False):
        assert_grads_equal(got, reference_grads(make(nnx.Rngs(SEED)), tokens(1, ROWS)))


@pytest.mark.parametrize("layout", ["pipe2xdata4-zb-h1", "pipe4xdata2"])
def test_a_bf16_model_pipelines_with_gradients_in_its_dtype(layout):
    """bf16 parameters (stock layers' param_dtype): the pipeline accumulates the microbatches'
    gradients in float32 (the branches' bf16 gradients once met float32 accumulators and the
    tick's switch refused to trace) and hands back gradients in the parameters' dtype. Against
    plain value_and_grad on one device at bf16's resolution: both round every activation to
    8 bits of mantissa, in other orders."""
    loss, grads = framework_grads(BF16Net, *STOCK_LAYOUTS[layout])
    with nnx.use_eager_sharding(False):
        ref_loss, ref_grads = reference_grads(BF16Net(nnx.Rngs(SEED)), tokens(1, ROWS))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-2)
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(ref_grads),
                            strict=True):
        assert g.dtype == r.dtype == jnp.bfloat16, path
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        # bf16 rounding (2^-8 relative per value) through 4 blocks, in two orders: measured at
        # most 2.3% of a leaf's norm (median 0.8%; data x tensor, unpipelined: 0.8%)
        assert np.linalg.norm(g - r) <= 0.04 * np.linalg.norm(r), jax.tree_util.keystr(path)


# parallel.split_last: only the last microbatches' backwards split, the others' BW the unsplit
# backward on the split's residuals (ChunkSplit.fused), traced from the user's layer.
SPLIT_LAST = [("gemma", ("parallel.pipe=4", "parallel.data=2", "parallel.tensor=1", "parallel.microbatches=4",
                         "parallel.schedule=zb-h1", "parallel.split_last=2")),
              ("llama-tied", (*PIPE_TENSOR, "parallel.schedule=zbv", "parallel.virtual_stages=2",
                              "parallel.split_last=1"))]


@pytest.mark.parametrize("family,overrides", SPLIT_LAST, ids=[f for f, _ in SPLIT_LAST])
def test_split_only_last_gradients_equal_an_independent_reference(family, overrides):
    assert_grads_equal(framework_grads(FAMILIES[family], *overrides), reference(family))


# zb-h1 (its B and W branches) and afapab (virtual stages, chunk sync in the tick loop)
# have the most branch kinds between them; 1f1b and interleaved share the tick loop.
STRANDED = [("zb-h1", 1), ("afapab", 2)]


@pytest.mark.parametrize("schedule,v", STRANDED, ids=[s for s, _ in STRANDED])
def test_pipe_tensor_resharding_heads_no_collective_stranded_in_a_branch(schedule, v):
    # Before: XLA placed a mesh-wide collective-permute inside the per-stage branch
    # and aborted the process (rendezvous: 4 of 8 devices arrived).
    got = framework_grads(ODD["odd-heads"], *PIPE_TENSOR, f"parallel.schedule={schedule}",
                          f"parallel.virtual_stages={v}")
    assert_grads_equal(got, reference("odd-heads"))


@pytest.mark.slow
@pytest.mark.xla_default_emitters  # bitwise across programs: as users compile them
@pytest.mark.parametrize("family,schedule", [("llama-tied", "1f1b"), ("gemma", "zb-h1")])
def test_deterministic_pipeline_gradients_are_the_same_bits_on_any_data_count(family, schedule):
    """Deterministic mode through a pipeline of 2 stages on data = 1, (2,) 4 and fsdp = 4 (each
    device's 8 / (data x fsdp) virtual shards its microbatches; with fsdp the weights enter
    the pipeline sharded and the gradients leave it so): the gradients equal the
    independent reference to fp32 tolerance and each other bit for bit (tied embeddings
    summed from two stages; Gemma's stack of unlike layer groups under ZB-H1's split
    backward)."""
    runs = {}
    # Gemma (the slower family to compile) skips data=2: data=1 against data=4 and fsdp=4
    # already spans one shard per device to four; Llama keeps it.
    layouts = ((1, 1), (2, 1), (4, 1), (1, 4)) if family == "llama-tied" else ((1, 1), (4, 1), (1, 4))
    for data, fsdp in layouts:
        runs[data, fsdp] = framework_grads(
            FAMILIES[family], "train.deterministic=true", "train.virtual_shards=8", "parallel.pipe=2",
            f"parallel.data={data}", f"parallel.fsdp={fsdp}", "parallel.tensor=1",
            f"parallel.microbatches={8 // (data * fsdp)}", f"parallel.schedule={schedule}",
            devices=jax.devices()[:2 * data * fsdp])
        assert_grads_equal(runs[data, fsdp], reference(family))
    want = [np.asarray(x).tobytes() for x in jax.tree.leaves(runs[1, 1])]
    for layout in layouts[1:]:  # (data, fsdp): fsdp keeps the weights and gradients sharded
        got = [np.asarray(x).tobytes() for x in jax.tree.leaves(runs[layout])]
        differ = sum(g != w for g, w in zip(got, want, strict=True))
        assert not differ, f"(data, fsdp)={layout}: {differ} leaves differ from data=1"


# ---- each defect of the first try, as a test -------------------------------------------

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=cli_env(), capture_output=True,
                          text=True, timeout=300)


def test_jax_touched_before_setup_is_a_warning_or_one_line_error():
    # Before: the run silently went on 1 device, or failed later without saying why.
    fits = _python("import jax.numpy as jnp; jnp.ones(1)\n"
                   "import mindpipe_jax as mp\n"
                   "mp.setup_runtime(mp.ParallelConfig(), mp.DistributedConfig())")
    assert fits.returncode == 0, fits.stderr
    warning = [line for line in fits.stderr.splitlines() if "mindpipe: warning" in line]
    assert len(warning) == 1 and "JAX was initialized before" in warning[0], fits.stderr
    refused = _python("import jax.numpy as jnp; jnp.ones(1)\n"
                      "import mindpipe_jax as mp\n"
                      "try:\n"
                      "    mp.setup_runtime(mp.ParallelConfig(pipe=2, data=4), mp.DistributedConfig())\n"
                      "except mp.ConfigError as err:\n"
                      "    print('refused:', err)\n")
    assert refused.returncode == 0, refused.stderr
    assert "refused: JAX was initialized before" in refused.stdout
    assert "jax_num_cpu_devices" in refused.stdout and "\n" not in refused.stdout.strip()


def test_depth_checks_read_the_model_not_model_n_layers():
    # Before: model.n_layers=4 passed the check and layout.py raised a traceback.
    with pytest.raises(ConfigError, match="layer stack of model Llama has 2 units, not a multiple of"):
        framework_grads(lambda rngs: Llama(layers=2, rngs=rngs), "parallel.pipe=4", "parallel.data=2",
                        "parallel.tensor=1", "parallel.microbatches=4", "model.n_layers=4")
    # And model.n_layers=3 does not refuse a 4-layer model on 2 stages.
    cfg = Config().replace("model.n_layers=3", "model.seq_len=8", "parallel.pipe=2", "parallel.data=4",
                           "parallel.tensor=1", "parallel.microbatches=4")
    mesh = make_mesh(cfg.parallel)
    with jax.set_mesh(None):
        spec, _ = model_spec(FAMILIES["llama-tied"], mesh, SEED)
    make_grad_fn(spec, cfg, mesh)


def test_evaluation_needs_only_the_contract():
    # Before: a model with only embed/blocks/head trained, then evaluation raised
    # "'PL' object is not callable".
    mesh = make_mesh(Config().parallel)
    with jax.set_mesh(None):
        spec, create = model_spec(PartsOnly, mesh, SEED)
    batch = tokens(2, 8)
    got = jax.jit(make_eval_step(spec))(jax.jit(create, out_shardings=spec.storage)(), batch)
    inner = PartsOnly(nnx.Rngs(SEED))
    h = inner.embed(jnp.asarray(batch["inputs"]))
    gdef, layers = nnx.split(inner.blocks)
    h = jax.lax.scan(lambda x, lp: (nnx.merge(gdef, lp)(x), None), h, layers)[0]
    np.testing.assert_allclose(got, inner.head.loss(h, jnp.asarray(batch["targets"])), rtol=1e-6)


def test_a_linen_module_trains_directly(tmp_path):
    # Before: a Linen module was taken as a factory (CallCompactUnboundModuleError).
    result = mp.train(linen_transformer(), None, None, "model.vocab_size=64", "model.seq_len=8",
                      "data.source=synthetic", "train.steps=2", "train.global_batch=8",
                      "train.eval_every=0", "train.tensorboard=false", "train.progress=false",
                      f"train.out_dir={tmp_path}")
    assert result.step == 2 and np.isfinite(result.history[-1]["loss"])
    assert any("ScanBlock" in k or "blocks" in k for k in result.state["params"])


def test_a_loss_drawing_from_its_dropout_key_is_refused_through_a_pipeline():
    """A loss that splits its dropout_key over its layers trained through a pipeline without
    dropout, silently (no key reaches the units). Refused in one line, nothing built; a
    loss that takes the key and draws nothing pipelines with the reference gradients, and
    the keyed model still trains without a pipeline."""
    pipe = LAYOUTS["pipe4xdata2"]
    with pytest.raises(ConfigError, match=re.escape("KeyedDropout.loss draws random numbers from its "
                                                    "dropout_key (dropout); through a pipeline "
                                                    "(parallel.pipe=4)")) as err:
        framework_grads(lambda rngs: KeyedDropout(rngs), *pipe)
    assert str(err.value).count("\n") == 0
    no_draws = functools.partial(KeyedDropout, rate=0.0)
    assert_grads_equal(framework_grads(no_draws, *pipe),
                       reference_grads(no_draws(nnx.Rngs(SEED)), tokens(1, ROWS)))
    loss, _ = framework_grads(lambda rngs: KeyedDropout(rngs), *LAYOUTS["data4xtensor2"])
    assert np.isfinite(loss)


def test_a_variable_that_is_not_a_param_is_named_by_its_path():
    with pytest.raises(ConfigError, match=r"running_mean \(BatchStat\)") as err:
        model_spec(WithBatchStats, make_mesh(Config().parallel), SEED)
    assert str(err.value).endswith("(the train step keeps no running statistics: normalise without them, "
                                   "e.g. nnx.LayerNorm or nnx.RMSNorm)")


def test_a_constant_kept_as_a_plain_attribute_is_named_with_the_fix():
    """A rotary-frequency table kept as a plain array attribute (which crashed tracing the
    model with a leaked tracer), from a factory and as a built instance."""
    class Layer(nnx.Module):
        def __init__(self, rngs):
            self.inv_freq = 1.0 / 10000 ** (jnp.arange(0, 16, 2) / 16)
            self.lin = nnx.Linear(16, 16, rngs=rngs)

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([Layer(rngs), Layer(rngs)])

    for model in (Model, Model(nnx.Rngs(0))):
        with pytest.raises(ConfigError, match=re.escape("layers/0/inv_freq (float32[8])")) as err:
            model_spec(model, make_mesh(Config().parallel), SEED)
        assert str(err.value).count("\n") == 0
        assert "make a trained array nnx.Param, and a constant (rotary frequencies, a mask) an nnx.Variable" \
               in str(err.value)


# Constant buffers (nnx.Variable that is no Param: rotary frequencies), held fixed: the
# gradients of the Params equal plain value_and_grad's on every axis (refused before
# 2026-12-05 (e)); a buffer the forward writes, or one that differs from layer to layer
# under a pipeline, is refused (tests/test_bad_input.py).
# B/W splits of "dots"-checkpointed layers closing over a buffer: replayed with weights
# that vary over more manual axes than the trace's examples, the buffer's product with
# them crashed (JAX's "requires varying manual axes to match") until 2026-12-05.
BUFFER_LAYOUTS = {**LAYOUTS,
                  "pipe2xdata4-zb-h1-dots": ("parallel.pipe=2", "parallel.data=4", "parallel.tensor=1",
                                             "parallel.microbatches=4", "parallel.schedule=zb-h1",
                                             "parallel.stage_remat=dots"),
                  "pipe2xfsdp2xdata2-zbv-remat-list": (
                      "parallel.pipe=2", "parallel.fsdp=2", "parallel.data=2", "parallel.tensor=1",
                      "parallel.microbatches=4", "parallel.schedule=zbv", "parallel.virtual_stages=2",
                      'parallel.stage_remat=["none","full","dots","none"]')}


@pytest.mark.parametrize("kind,layout", [("same", "data4xtensor2"), ("same", "fsdp8"),
                                         ("same", "pipe4xdata2"), ("same", "pipe2xdata2xtensor2-zb-h1"),
                                         ("remat", "pipe4xdata2"), ("same", "pipe2xdata4-zb-h1-dots"),
                                         ("same", "pipe2xfsdp2xdata2-zbv-remat-list")])
def test_constant_buffers_are_held_fixed_and_the_gradients_equal_the_reference(kind, layout):
    make = partial(WithBuffers, kind=kind)
    got = framework_grads(make, *BUFFER_LAYOUTS[layout])
    with nnx.use_eager_sharding(False):
        assert_grads_equal(got, reference_grads(make(nnx.Rngs(SEED)), tokens(1, ROWS)))


@pytest.mark.parametrize("layout", ["data4xtensor2", "fsdp8"])
def test_stacked_buffers_run_by_a_scan_are_held_fixed_too(layout):
    got = framework_grads(ScannedWithBuffers, *LAYOUTS[layout])
    with nnx.use_eager_sharding(False):
        assert_grads_equal(got, reference_grads(ScannedWithBuffers(nnx.Rngs(SEED)), tokens(1, ROWS)))


def test_a_model_with_buffers_trains_and_resumes_through_a_pipeline(tmp_path):
    args = ("model.vocab_size=64", "model.seq_len=8", "data.source=synthetic", "train.global_batch=8",
            "parallel.pipe=2", "parallel.data=4", "parallel.microbatches=2", "train.eval_every=0",
            "train.tensorboard=false", "train.progress=false", "train.checkpoint_every=2",
            f"train.out_dir={tmp_path}")
    first = mp.train(WithBuffers, None, None, "train.steps=2", *args)
    resumed = mp.train(WithBuffers, None, None, "train.steps=4", "train.resume=true", *args)
    assert first.step == 2 and resumed.step == 4
    assert all(np.isfinite(h["loss"]) for h in first.history + resumed.history)
    assert not any("inv_freq" in jax.tree_util.keystr(path)
                   for path, _ in jax.tree_util.tree_flatten_with_path(resumed.state["params"])[0])


def test_dropout_with_a_random_stream_is_refused_with_the_way_to_build_it():
    class WithDropout(nnx.Module):
        def __init__(self, rngs):
            self.inner = StockGPT2(rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)

        def __call__(self, tokens):
            return self.drop(self.inner(tokens))

    with pytest.raises(ConfigError) as err:
        model_spec(WithDropout, make_mesh(Config().parallel), SEED)
    message = str(err.value)
    assert "drop/rngs/key (RngKey)" in message and "\n" not in message
    assert "build dropout and other random layers without rngs=, e.g. nnx.Dropout(rate, deterministic=True)" \
        in message


def test_rules_for_other_names_from_config_and_python():
    mesh = make_mesh(Config().replace("parallel.data=2", "parallel.fsdp=2", "parallel.tensor=2").parallel)
    with pytest.raises(ConfigError, match=r"parameter table \('tp', 'fsdp'\).*'tp'.*parallel.rules"):
        model_spec(OtherNames, mesh, SEED)
    for rules in (Config().replace('parallel.rules=["tp=tensor"]').parallel.rules, {"tp": ("tensor",)}):
        with mp.use_rules(rules):
            spec, _ = model_spec(OtherNames, mesh, SEED)
        assert spec.storage["table"].spec == jax.sharding.PartitionSpec("tensor", "fsdp")
        assert spec.compute["table"].spec == jax.sharding.PartitionSpec("tensor", None)


def test_a_rules_row_no_name_of_the_model_uses_is_refused_before_any_file(tmp_path):
    # A misspelt name ("tpp" for "tp") was accepted and changed nothing; the model's own
    # name still needs its row, so the typo surfaces as that name's refusal, and a row
    # for a name of the built-in table the model never uses ("experts") is named here.
    common = ("model.vocab_size=64", "model.seq_len=8", "data.source=synthetic", "train.steps=1",
              "train.global_batch=8", "parallel.tensor=2", f"train.out_dir={tmp_path}/run")
    with pytest.raises(ConfigError, match=r"parallel.rules has a row for 'experts', a logical name no "
                                          r"parameter or activation of the model uses, so it changes nothing "
                                          r"\(names used: .*\btp\b.*\); check its spelling"):
        mp.train(OtherNames, None, None, *common, 'parallel.rules=["tp=tensor", "experts="]')
    assert not (tmp_path / "run").exists()


def test_cli_trains_a_model_named_module_colon_factory(tmp_path):
    args = ["train", "--model", str(ROOT / "tests" / "byom_models.py") + ":make_llama", "model.vocab_size=64",
            "model.seq_len=8", "data.source=synthetic", "train.steps=2", "train.global_batch=8",
            "train.eval_every=0", "train.tensorboard=false", "train.progress=false",
            f"train.out_dir={tmp_path}/run"]
    done = subprocess.run([sys.executable, "-m", "mindpipe_jax", *args], cwd=tmp_path, env=cli_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "done: 2 steps" in done.stdout
    for ref, needle in ((str(ROOT / "tests" / "byom_models.py") + ":nope", "has no 'nope'"),
                        ("no_such_module_xyz:f", "no module named 'no_such_module_xyz'"),
                        ("justaname", "must be 'module:name'")):
        bad = subprocess.run([sys.executable, "-m", "mindpipe_jax", "train", "--model", ref,
                              f"train.out_dir={tmp_path}/bad"], cwd=tmp_path, env=cli_env(),
                             capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2 and needle in bad.stderr and bad.stderr.count("\n") == 1, bad.stderr
        assert not (tmp_path / "bad").exists()


def test_a_vocabulary_smaller_than_the_datas_is_refused_before_the_nan(tmp_path):
    """A model with its own loss shows no logits to count: its 64-row embedding against
    the byte data's 256 ids gave a NaN loss at step 1 and the advice to lower the learning
    rate. Its 'vocab'-named axis is counted instead, in one line, before anything runs."""
    with pytest.raises(ConfigError, match=re.escape("Llama's embed/table has 64 rows on its 'vocab' axis, "
                                                    "fewer than model.vocab_size=256")):
        mp.train(lambda rngs: Llama(rngs=rngs), None, None, "model.seq_len=8", "data.source=synthetic",
                 "train.steps=1", "train.global_batch=16", f"train.out_dir={tmp_path}/run")
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_an_auto_tensor_split_the_model_cannot_take_says_how_to_avoid_it(tmp_path):
    """parallel.tensor=0 (the default) splits over tensor=2 on simulated CPU devices; a
    model whose MLP width is odd cannot take it, and the user never asked for it."""
    with pytest.raises(ConfigError, match=re.escape("(mlp=37) is not divisible by mesh axes tensor=2; choose "
                                                    "sizes so that mlp divides evenly; parallel.tensor=0 "
                                                    "(auto) chose tensor=2 on these devices: set "
                                                    "parallel.tensor=1")):
        mp.train(lambda rngs: Llama(ff=37, rngs=rngs), None, None, "model.vocab_size=64", "model.seq_len=8",
                 "data.source=synthetic", "train.steps=1", "train.global_batch=16",
                 f"train.out_dir={tmp_path}/run")
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())
    run = mp.train(lambda rngs: Llama(ff=37, rngs=rngs), None, None, "model.vocab_size=64", "model.seq_len=8",
                   "data.source=synthetic", "train.steps=1", "train.global_batch=16", "parallel.tensor=1",
                   "train.progress=false", "train.tensorboard=false", f"train.out_dir={tmp_path}/ok")
    assert run.step == 1


def test_repartition_and_plan_measure_the_users_model(tmp_path, capsys):
    """The online repartition and ``mindpipe plan --model`` measure the model being
    trained, its stack's units, not the configured GPT. Before: a 6-layer Llama run with
    ``model.n_layers=4`` reported its split as [2, 2] and re-planned the GPT's 4 layers."""
    from mindpipe_jax.cli import main

    common = ["model.vocab_size=64", "model.seq_len=8", "model.n_layers=4", "data.source=synthetic",
              "train.global_batch=16", "train.eval_every=0", "train.tensorboard=false",
              "train.progress=false", "parallel.pipe=2", "parallel.data=4", "parallel.tensor=1",
              "parallel.microbatches=2"]
    run = mp.train(lambda rngs: Llama(layers=6, rngs=rngs), None, None, *common, "train.steps=3",
                   "parallel.stage_layers=[1, 5]", "parallel.repartition_after=2",
                   f"train.out_dir={tmp_path}/r")
    (event,) = [h["repartition"] for h in run.history if "repartition" in h]
    assert event["before"] == [1, 5] and sum(event["after"]) == 6 and min(event["after"]) >= 2, event
    assert run.step == 3 and np.isfinite(run.history[-1]["loss"])

    capsys.readouterr()
    ref = str(ROOT / "tests" / "byom_models.py") + ":make_llama"
    assert main(["plan", "--model", ref, *common, "--repeats", "1", "--remat", "full", "--compiled"]) == 0
    out = capsys.readouterr().out
    assert "one unit of Llama (seq_len=8)" in out and "parallel.stage_layers=[" in out, out
    assert "compiled" in out, out


def test_a_supernet_missing_members_is_named_in_one_error():
    with pytest.raises(ConfigError, match=r"HalfSupernet is not a supernet: it lacks unit_grid, "
                                          r"units\(subnet\), active_params\(subnet\)"):
        supernet_spec(HalfSupernet)


@pytest.mark.slow
def test_a_user_written_supernet_trains_and_is_searched():
    # Before: training worked, then the search raised AttributeError (active_params).
    cfg = Config().replace(
        "model.vocab_size=64", "model.seq_len=16", 'data.source="synthetic"', "data.synthetic_tokens=32768",
        "train.steps=3", "train.global_batch=16", "train.log_every=3", "parallel.subnet=2", "parallel.data=4",
        "supernet.subnets_per_step=2", "supernet.search_population=4", "supernet.search_generations=1",
        "supernet.search_top_k=2")
    result = mp.train_supernet(TwoOpSupernet, config=cfg, log=None)
    assert int(result.state["step"]) == 3 and np.isfinite(result.history[-1]["loss"])
    top = result.search.top
    assert len(top) == 2 and all(np.isfinite(t["loss"]) for t in top)
    assert all(t["params"] == TwoOpSupernet(nnx.Rngs(0)).active_params(t["subnet"]) for t in top)


def test_noise_statistics_for_a_user_model_without_accumulation():
    # Before: the online tuner's noise estimate stayed NaN (one microbatch per step: no
    # second gradient to compare). Now the statistics' step accumulates two halves.
    cfg = Config().replace("model.vocab_size=64", "model.seq_len=8", "train.global_batch=16",
                           "parallel.data=4", "parallel.tensor=2", "tuner.enabled=true")
    layout = build_layout(cfg, lambda c: FAMILIES["llama-style"])
    state = init_train_state(layout.spec, layout.create, layout.tx, layout.mesh, 0, layout.shardings)
    params = jax.device_get(state["params"])
    batch = tokens(3, 16)
    step, _ = layout.compile()
    metrics = jax.device_get(step(state, layout.batches(batch))[1])
    assert (int(metrics["micro_batch"]), int(metrics["batch"])) == (8, 16)
    # Independently: the two halves' gradients (rows j, j+2, ... for half j), one device.
    with nnx.use_eager_sharding(False):
        gdef = nnx.graphdef(FAMILIES["llama-style"](nnx.Rngs(SEED)))

    def loss(p, b):
        logits = nnx.merge(gdef, p)(b["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"]).mean()
    halves = [jax.jit(jax.grad(loss))(params, {k: v[j::2] for k, v in batch.items()}) for j in (0, 1)]
    sq = [sum(float(np.sum(np.square(x, dtype=np.float64))) for x in jax.tree.leaves(g)) for g in halves]
    assert np.isfinite(metrics["micro_grad_sq"])
    np.testing.assert_allclose(float(metrics["micro_grad_sq"]), np.mean(sq), rtol=1e-4)


@pytest.mark.parametrize("command", ["train", "tune"])
def test_a_factory_that_raises_is_one_line_from_train_and_tune(command, tmp_path, capsys):
    from mindpipe_jax.cli import main

    ref = f"{Path(__file__).with_name('byom_models.py')}:make_broken"
    extra = ["--budget-mb", "100"] if command == "tune" else [f"train.out_dir={tmp_path / 'run'}"]
    assert main([command, "--model", ref, *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("mindpipe: error: building the model, make_broken(rngs) raised ValueError: "
                          "width 0 is not a width at ") and "byom_models.py:" in err
    assert list(tmp_path.iterdir()) == []


def test_a_factory_without_rngs_or_of_a_linen_module_is_one_line(tmp_path):
    """A zero-argument function returning the model, or a factory returning a Linen
    module, failed deep in the build (TypeError from the call, or "must return an
    nnx.Module"); each is now named with what to pass instead."""
    common = ("model.vocab_size=64", "model.seq_len=8", "data.source=synthetic", "train.steps=1",
              f"train.out_dir={tmp_path}/run")
    with pytest.raises(ConfigError, match=r"the model factory .*<lambda> cannot be called as .*\(rngs\) "
                                          r"\(too many positional arguments\): give it an rngs parameter"):
        mp.train(lambda: Llama(rngs=nnx.Rngs(0)), None, None, *common)
    with pytest.raises(ConfigError, match=r"returned a Linen module \(LM\); pass the Linen module itself"):
        mp.train(lambda rngs: linen_transformer(), None, None, *common)
    assert not (tmp_path / "run").exists()


def test_tuner_costs_come_from_the_user_model():
    # Before: tune(model=...) predicted from config.model (the built-in GPT).
    from mindpipe_jax.tuner.costmodel import ModelCosts

    cfg = Config().replace("model.vocab_size=64", "model.seq_len=8")
    measured = {}
    for family, units in (("llama-tied", 4), ("gemma", 4)):
        costs = measured[family] = ModelCosts.measure(cfg, model=FAMILIES[family])
        with nnx.use_eager_sharding(False):
            params = nnx.state(FAMILIES[family](nnx.Rngs(0)), nnx.Param)
        assert costs.n_layers == units
        # Every parameter once (the tied table is not counted twice).
        assert costs.param_bytes == sum(x.nbytes for x in jax.tree.leaves(params))
        assert costs.layer_fwd > 0 and costs.rest_fwd > 0
    builtin = ModelCosts.measure(cfg)
    assert builtin.param_bytes != measured["llama-tied"].param_bytes


def test_the_tuner_prices_a_model_the_pipeline_cannot_cut_whole_and_rejects_its_pipelines():
    """A model computing between its layers (a residual in its loop) cannot be cut into
    stages; before 2026-12-05 (e) the tuner refused the whole search with the pipeline's
    refusal, even for data-parallel layouts. Now its costs are the whole loss's and its
    pipeline layouts are rejected with the reason."""
    from mindpipe_jax.tuner.costmodel import ModelCosts
    from mindpipe_jax.tuner.tune import tune

    cfg = Config().replace("model.vocab_size=256", "model.seq_len=8", "train.global_batch=16")
    costs = ModelCosts.measure(cfg, model=ResidualInTheLoop)
    assert costs.unsplit.startswith("ResidualInTheLoop.layers[1] is not called on the output of")
    assert costs.n_layers == 0 and costs.rest_bwd > costs.rest_fwd > 0
    with nnx.use_eager_sharding(False):
        model = ResidualInTheLoop(nnx.Rngs(0))
    # The whole forward: four [*, 32] x [32, 32] layers and the [32, 256] head per token, at least.
    assert costs.rest_fwd >= 2 * 8 * (4 * 32 * 32 + 32 * 256)
    assert costs.param_bytes == sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    result = tune(cfg, axes=("pipe", "data"), schedules=("1f1b",), microbatches=(1, 2), remats=("none",),
                  max_compile=1, measure=1, trial_steps=2, rounds=1, model=ResidualInTheLoop, costs=costs,
                  log=lambda _: None)
    assert result.best.candidate.pipe == 1 and result.best.measured_s is not None
    assert all(c.pipe == 1 for c in (r.candidate for r in result.rows))
    cut = [c for c, why in result.space.rejected
           if why.startswith("the model cannot be pipelined: ResidualInTheLoop.layers[1]")]
    assert {c.pipe for c in cut} == {2, 4, 8}  # judged on the model itself (tuner/facts.py)


@pytest.mark.parametrize("how", ["nnx", "jax"])
def test_layers_rematerialised_in_the_loop_pipeline_with_the_reference_gradients(how):
    """``nnx.remat`` / ``jax.checkpoint`` around each layer call in the model's loop: the
    stand-ins ran inside those transforms and crashed (nnx.remat: a TypeError splitting the
    stand-in) or hid the chain of calls (jax.checkpoint: refused as computing between
    layers) before 2026-12-05 (e); the pipeline's own per-stage remat stands in for it."""
    make = partial(RematInTheLoop, how=how)
    got = framework_grads(make, *LAYOUTS["pipe4xdata2"])
    with nnx.use_eager_sharding(False):
        assert_grads_equal(got, reference_grads(make(nnx.Rngs(SEED)), tokens(1, ROWS)))


def test_layers_in_a_plain_list_kept_as_data_pipeline_with_the_reference_gradients():
    """A plain list marked nnx.data (what Flax's error for a list of modules offers besides
    nnx.List) is found and pipelined as an nnx.List is (it was refused as 'not a module')."""
    got = framework_grads(PlainListNet, *STOCK_LAYOUTS["pipe2xdata4-zb-h1"])
    with nnx.use_eager_sharding(False):
        assert_grads_equal(got, reference_grads(PlainListNet(nnx.Rngs(SEED)), tokens(1, ROWS)))


def test_layers_called_by_keyword_returning_tuples_pipeline_with_the_reference_gradients():
    """Hugging Face's calling convention: layer(hidden_states=h, attention_mask=mask) returning
    (hidden, probs), unpacked in the loop. Each unit calls its layer the same way and passes
    on the hidden state (both crashed the stand-in trace before 2026-12-05); the probs
    computed in the loop but not used by the loss are checked to be unread."""
    got = framework_grads(HFStyle, *STOCK_LAYOUTS["pipe2xdata4-zb-h1"])
    with nnx.use_eager_sharding(False):
        assert_grads_equal(got, reference_grads(HFStyle(nnx.Rngs(SEED)), tokens(1, ROWS)))


# Side inputs: arrays the model's loop passes every layer besides the hidden state. A mask
# or positions made from the microbatch's shape alone are recomputed by each unit (they were
# refused before 2026-12-05); one read from the tokens' values or from parameters cannot be.
# Masks that alternate with depth (one array for even layers, another for odd) split the
# stack as groups of two, as alternating static flags do.
SIDE_INPUT_MODELS = {"stock-causal-mask": lambda rngs: StockGPT2(rngs, mask="causal"),
                     "stock-alternating-masks": lambda rngs: StockGPT2(rngs, mask="alternating"),
                     "positions": lambda rngs: PositionsInLayers(rngs)}
SIDE_INPUT_LAYOUTS = {"stock-causal-mask": "pipe4xdata2", "stock-alternating-masks": "pipe2xdata4-zb-h1",
                      "positions": "pipe2xdata2xtensor2-1f1b"}


@pytest.mark.parametrize("family", sorted(SIDE_INPUT_MODELS))
def test_layers_given_a_mask_or_positions_pipeline_with_the_reference_gradients(family):
    make = SIDE_INPUT_MODELS[family]
    layout = SIDE_INPUT_LAYOUTS[family]
    got = framework_grads(make, *(STOCK_LAYOUTS.get(layout) or LAYOUTS[layout]))
    with nnx.use_eager_sharding(False):
        assert_grads_equal(got, reference_grads(make(nnx.Rngs(SEED)), tokens(1, ROWS)))


def test_a_loss_masked_with_the_targets_pipelines_with_the_reference_gradients():
    """The fix the refusal of a loss mask made from the inputs offers: made from the
    targets, which the last stage has, the masked loss pipelines exactly."""
    make = partial(ReadsBesideTheChain, reads="targets", vocab=64)
    got = framework_grads(make, *LAYOUTS["pipe4xdata2"])
    with nnx.use_eager_sharding(False):
        assert_grads_equal(got, reference_grads(make(nnx.Rngs(SEED)), tokens(1, ROWS)))


def test_a_loss_reading_what_layers_return_besides_the_hidden_state_is_refused():
    cfg = Config().replace("model.vocab_size=64", "model.seq_len=8", "parallel.pipe=2", "parallel.data=4",
                           "parallel.tensor=1", "parallel.microbatches=4")
    mesh = make_mesh(cfg.parallel)
    with jax.set_mesh(None):
        spec, _ = model_spec(lambda rngs: HFStyle(rngs, read_probs=True), mesh, SEED)
    with pytest.raises(ConfigError, match=r"^HFStyle\.layers: its layers return more than the hidden state "
                                          r"and the model's loss reads the rest .*aux_weight"):
        make_grad_fn(spec, cfg, mesh)


# Models reading their tokens past the first layer: a padding mask made in the loop and
# passed to every layer, a loss masked with the inputs, the embedded input added back
# before the head (tied to the prologue's table). The hidden state carries the ids to
# every stage (carry_tokens.py); each unit recomputes the mask for its own microbatch.
# The batch is padded (token 0 from a random place in most rows), so a unit reading
# another microbatch's tokens, or none, changes the gradients.
READS_TOKENS = {
    "padding-mask": (lambda rngs: StockGPT2(rngs, mask="padding"), "pipe4xdata2"),
    # A scanned stack (cut from the traced loss): the mask is a loop invariant of the scan,
    # and the loss skips padded inputs.
    "scanned-padding-mask-loss-mask": (lambda rngs: PaddedLlamaStyle(rngs=rngs), "pipe2xdata2xtensor2-zb-h1"),
    "padding-mask-zb-h1-tensor": (lambda rngs: StockGPT2(rngs, mask="padding"), "pipe2xdata2xtensor2-zb-h1"),
    "loss-mask-from-inputs": (partial(ReadsBesideTheChain, reads="tokens", vocab=64), "pipe4xdata2"),
    "embedded-input-added-back": (partial(ReadsBesideTheChain, reads="input", vocab=64),
                                  "pipe2xdata2xtensor2-interleaved"),
}


@pytest.mark.parametrize("case", sorted(READS_TOKENS))
def test_models_reading_their_tokens_past_the_first_layer_pipeline_with_the_reference_gradients(case):
    make, layout = READS_TOKENS[case]
    batch = padded_tokens(1, ROWS)
    got = framework_grads(make, *LAYOUTS[layout], batch=batch)
    with nnx.use_eager_sharding(False):
        assert_grads_equal(got, reference_grads(make(nnx.Rngs(SEED)), batch))


# Values sown along the way (self.sow): layers that sow what the loss ignores, and a
# loss collecting the head's sown z-loss with nnx.capture (Flax 0.12's way), pipeline
# exactly; without a pipeline the layers' sown values reach the loss too. (Before
# 2026-12-05 (e) nnx.capture in a loss crashed the pipeline's checks with
# Flax's TraceContextError, and a loss reading what the layers sow trained without it:
# now refused, tests/test_bad_input.py.)
@pytest.mark.parametrize("aux,layout", [("none", "pipe4xdata2"), ("head", "pipe4xdata2"),
                                        ("head", "pipe2xdata2xtensor2-zb-h1"), ("capture", "data4xtensor2")])
def test_models_that_sow_pipeline_with_the_reference_gradients(aux, layout):
    make = partial(Sowing, aux=aux)
    got = framework_grads(make, *LAYOUTS[layout])
    with nnx.use_eager_sharding(False):
        assert_grads_equal(got, reference_grads(make(nnx.Rngs(SEED)), tokens(1, ROWS)))


@pytest.mark.parametrize("side,reads", [("embedded", "the tokens' values and parameters"),
                                        ("param", "parameters")])
def test_side_inputs_read_from_parameters_are_refused_in_one_line(side, reads):
    make = partial(PositionsInLayers, side=side)
    cfg = Config().replace("model.vocab_size=64", "model.seq_len=8", "parallel.pipe=2", "parallel.data=4",
                           "parallel.tensor=1", "parallel.microbatches=4")
    mesh = make_mesh(cfg.parallel)
    with jax.set_mesh(None):
        spec, _ = model_spec(make, mesh, SEED)
    refused = (rf"\.(h|layers): its layers are called with an array computed from {reads} \(e\.g\. .*\) "
               rf"besides the hidden state; .*compute it inside the layer from its input, or train without "
               rf"parallel\.pipe$")
    with pytest.raises(ConfigError, match=refused):
        make_grad_fn(spec, cfg, mesh)


# FSDP gathered per chunk use (parallel.fsdp_gather=chunk) on families the project did
# not design around: tied embeddings with grouped-query attention, and a Linen model
# through the bridge (interleaved chunks). (A grouped stack, gemma's nnx.List, enters
# the pipeline gathered, so the option does not apply there.)
@pytest.mark.parametrize("family,schedule,v", [("llama-tied", "1f1b", 1), ("linen", "interleaved", 2)])
def test_fsdp_gathered_per_chunk_use_equals_an_independent_reference(family, schedule, v):
    got = framework_grads(FAMILIES[family], "parallel.pipe=2", "parallel.fsdp=4", "parallel.data=1",
                          "parallel.tensor=1", "parallel.microbatches=4", f"parallel.schedule={schedule}",
                          f"parallel.virtual_stages={v}", "parallel.fsdp_gather=chunk")
    assert_grads_equal(got, reference(family))


EXPERT_LAYOUTS = {
    "data2xexpert2xtensor2": ("parallel.data=2", "parallel.expert=2", "parallel.tensor=2"),
    "pipe2xexpert2xdata2": ("parallel.pipe=2", "parallel.expert=2", "parallel.data=2", "parallel.tensor=1",
                            "parallel.microbatches=4", "parallel.schedule=zb-h1"),
}


@pytest.mark.parametrize("layout", sorted(EXPERT_LAYOUTS))
def test_a_users_experts_split_over_the_expert_axis_with_the_reference_gradients(layout):
    """A Mixture-of-Experts model of the user's own (experts on the ``experts`` logical
    axis, declared in model.n_experts) stores each expert weight split over ``expert``,
    not replicated, and its gradients equal plain ``jax.value_and_grad`` on one device,
    beside tensor and through a pipeline."""
    overrides = (*EXPERT_LAYOUTS[layout], "model.n_experts=4")
    cfg = Config().replace(*overrides)
    mesh = make_mesh(cfg.parallel)
    with jax.set_mesh(None):
        spec, _ = model_spec(SoftExperts, mesh, SEED)
    check_user_model_keys(cfg.model, spec)  # the declared count is the model's
    w_in = spec.abstract_params["blocks"][0]["w_in"]
    assert w_in.sharding.shard_shape(w_in.shape)[0] == 2, w_in.sharding  # 4 experts over expert=2
    got = framework_grads(SoftExperts, *overrides)
    with nnx.use_eager_sharding(False):
        assert_grads_equal(got, reference_grads(SoftExperts(nnx.Rngs(SEED)), tokens(1, ROWS)))


WRONG_COUNT = ("model.n_experts=6, but parameter blocks/0/w_in of model SoftExperts holds 4 experts on its "
               "'experts' axis; set model.n_experts=4")


@pytest.mark.parametrize("command,declared,needle", [
    ("train", 6, WRONG_COUNT), ("plan", 6, WRONG_COUNT),
    ("train", 0, "parallel.expert=2 splits the experts of a Mixture-of-Experts model, but "
                 "model.n_experts=0")])
def test_a_users_experts_declared_wrong_or_not_at_all_are_one_line(command, declared, needle, tmp_path,
                                                                   capsys):
    """model.n_experts sized nothing on a model passed in: a wrong count trained (and was
    planned) silently; only its divisibility by parallel.expert was checked."""
    from mindpipe_jax.cli import main

    ref = str(ROOT / "tests" / "byom_models.py") + ":SoftExperts"
    axes = ["parallel.pipe=2", "parallel.data=2"] if command == "plan" else ["parallel.data=4"]
    code = main([command, "--model", ref, "model.seq_len=8", "model.vocab_size=64", "parallel.expert=2",
                 *axes, f"model.n_experts={declared}", f"train.out_dir={tmp_path}/run"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert needle in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command,key", [("train", "model.remat=full"), ("plan", "model.dtype=bfloat16"),
                                         ("tune", "model.dropout=0.1")])
def test_the_gpts_compute_keys_with_a_model_passed_in_are_one_line_exit_2(command, key, tmp_path, capsys):
    """model.remat / dtype / dropout build the reference GPT: with ``--model`` they did
    nothing, silently (the run trained the model as it is). Refused before the model's
    module is imported or anything is written."""
    from mindpipe_jax.cli import main

    extra = ["parallel.pipe=2"] if command == "plan" else []
    ref = str(ROOT / "tests" / "byom_models.py") + ":make_llama"
    code = main([command, "--model", ref, "model.seq_len=8", "model.vocab_size=64", *extra, key,
                 f"train.out_dir={tmp_path}/run"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"mindpipe: error: {key.split('=')[0]}="), err
    assert "has no effect on a model passed in" in err, err
    assert not (tmp_path / "run").exists()


class _ConfiguredGPT(GPT):
    """A user's subclass of the reference GPT, built from the caller's ``cfg.model``."""


def test_a_gpt_built_from_the_callers_config_keeps_its_compute_keys(tmp_path):
    """A factory of the caller's may build the reference GPT (or a subclass) from the very
    ``cfg.model`` it passes: then model.dropout / remat / dtype do apply, and are not
    refused; a Llama passed in with the same config is."""
    cfg = mp.Config().replace("model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.seq_len=8",
                              "model.vocab_size=64", "model.dropout=0.1", "model.remat=full",
                              "data.source=synthetic", "train.steps=1", "train.global_batch=8",
                              "train.eval_every=0", "train.progress=false", "train.tensorboard=false")
    run = mp.train(lambda rngs: _ConfiguredGPT(cfg.model, rngs=rngs), None, cfg,
                   f"train.out_dir={tmp_path}/a")
    assert run.step == 1
    with pytest.raises(ConfigError, match=re.escape("model.remat='full' has no effect on a model passed in")):
        mp.train(FAMILIES["llama-tied"], None, cfg.replace("model.dropout=0.0"),
                 f"train.out_dir={tmp_path}/b")
    assert not (tmp_path / "b").exists()
