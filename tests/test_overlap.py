"""Collective matmul (model.collective_matmul): same loss and gradients as the plain
tensor-parallel path and the unsharded model, in the plain step and nested in a
shard_map like the pipeline's and inside the pipeline itself, and a compiled
program that really is ppermute rings beside partial matmuls."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mindpipe_jax as mp
from mindpipe_jax.config import ModelConfig, ParallelConfig
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.models.gpt import GPT, Block
from mindpipe_jax.parallel import overlap
from mindpipe_jax.parallel.mesh import make_mesh
from mindpipe_jax.parallel.rules import use_rules
from mindpipe_jax.train.state import model_spec
from mindpipe_jax.train.step import model_loss

RTOL, ATOL = 1e-5, 1e-6  # fp32: only the order of the tensor-parallel sums differs


def _cfg(on: bool, **kw) -> ModelConfig:
    base = dict(vocab_size=256, seq_len=16, d_model=64, n_layers=2, n_heads=8, collective_matmul=on)
    return ModelConfig(**{**base, **kw})


def _assert_close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=RTOL, atol=ATOL)


def _batch(rows=8, length=16, seed=0):
    tokens = np.random.default_rng(seed).integers(0, 256, (rows, length + 1)).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


@pytest.mark.parametrize("axes", [dict(data=2, tensor=4), dict(data=4, tensor=2)])
def test_gpt_loss_and_grads_on_equal_off_and_unsharded(axes):
    mesh = make_mesh(ParallelConfig(**axes))
    spec_on, create = model_spec(lambda r: GPT(_cfg(True), rngs=r), mesh, seed=0)
    spec_off, _ = model_spec(lambda r: GPT(_cfg(False), rngs=r), mesh, seed=0)
    params = jax.jit(create, out_shardings=spec_on.storage)()
    batch = _batch()

    def grads(spec, p, b):
        return jax.jit(jax.value_and_grad(lambda p_, b_: model_loss(spec, p_, b_, None)))(p, b)

    # The oracle: one device, no mesh (the option is off there: no tensor axis).
    ref = grads(spec_on, jax.device_get(params), batch)
    sharded = jax.device_put(batch, NamedSharding(mesh, P(("data", "fsdp"))))
    with jax.set_mesh(mesh):
        on = grads(spec_on, params, sharded)
        off = grads(spec_off, params, sharded)
    _assert_close(on, off)
    _assert_close(on, ref)
    _assert_close(off, ref)
    # The comparison is not vacuous: the two programs differ.
    with jax.set_mesh(mesh):
        hlo_on = jax.jit(lambda p, b: model_loss(spec_on, p, b, None)).lower(params, sharded).as_text()
        hlo_off = jax.jit(lambda p, b: model_loss(spec_off, p, b, None)).lower(params, sharded).as_text()
    assert "collective_permute" in hlo_on and "collective_permute" not in hlo_off


def test_dropout_masks_are_the_same_with_the_option_on():
    mesh = make_mesh(ParallelConfig(data=4, tensor=2))
    spec_on, create = model_spec(lambda r: GPT(_cfg(True, dropout=0.2), rngs=r), mesh, seed=0)
    spec_off, _ = model_spec(lambda r: GPT(_cfg(False, dropout=0.2), rngs=r), mesh, seed=0)
    params = jax.jit(create, out_shardings=spec_on.storage)()
    batch = jax.device_put(_batch(), NamedSharding(mesh, P(("data", "fsdp"))))
    key = jax.random.key(3)
    with jax.set_mesh(mesh):
        on, off = (jax.jit(jax.value_and_grad(lambda p, b, s=s: model_loss(s, p, b, key)))(params, batch)
                   for s in (spec_on, spec_off))
    _assert_close(on, off)


def _ring_mlp(x, w1, w2):
    """A residual MLP written with the four primitives (rows split in between)."""
    xs = overlap.scatter_rows(x)
    h = jnp.tanh(overlap.all_gather_matmul("btd,df->btf", xs, w1, ("embed", "mlp"),
                                           ("batch", "length", "mlp")))
    y = overlap.matmul_reduce_scatter("btf,fd->btd", h, w2, ("batch", "length", "mlp"), ("mlp", "embed"))
    return overlap.gather_rows(xs + y)


def _plain_mlp(x, w1, w2):
    return x + jnp.tanh(x @ w1) @ w2


def _mlp_data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(8, 16, 32)).astype(np.float32)
    w1 = (0.1 * rng.normal(size=(32, 64))).astype(np.float32)
    w2 = (0.1 * rng.normal(size=(64, 32))).astype(np.float32)
    return x, w1, w2


def _loss(f):
    return lambda x, w1, w2: jnp.mean(jnp.sin(f(x, w1, w2)))


@pytest.mark.parametrize("policy", ["none", "dots", "full"])
def test_primitives_nested_in_a_shard_map_manual_over_pipe_data_fsdp(policy):
    # The pipeline's situation: an outer shard_map (check_vma on) manual over pipe,
    # data and fsdp, tensor left to the compiler; the collective matmul nests inside,
    # under the remat policies the pipeline applies to a stage.
    x, w1, w2 = _mlp_data()
    want = jax.jit(jax.value_and_grad(_loss(_plain_mlp), argnums=(0, 1, 2)))(x, w1, w2)
    f = {"none": _ring_mlp,
         "dots": jax.checkpoint(_ring_mlp, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable),
         "full": jax.checkpoint(_ring_mlp)}[policy]
    outer_axes = ("pipe", "data", "fsdp")

    def body(x, w1, w2):
        # Weights varying over the outer axes, as the pipeline runtime makes them.
        w1, w2 = (lax.pcast(w, outer_axes, to="varying") for w in (w1, w2))
        x = lax.pcast(x, ("pipe", "fsdp"), to="varying")
        loss, (dx, d1, d2) = jax.value_and_grad(_loss(f), argnums=(0, 1, 2))(x, w1, w2)
        n = lax.axis_size("data")
        mean = lambda v: lax.pmean(lax.psum(v, "data") / n, ("pipe", "fsdp"))
        return mean(loss), lax.pmean(dx / n, ("pipe", "fsdp")), mean(d1), mean(d2)

    mesh = make_mesh(ParallelConfig(pipe=2, data=2, tensor=2))
    with jax.set_mesh(mesh):
        put = lambda a, *s: jax.device_put(a, NamedSharding(mesh, P(*s)))
        run = jax.jit(jax.shard_map(body, in_specs=(P("data"), P(), P()),
                                    out_specs=(P(), P("data"), P(), P()), axis_names=set(outer_axes)))
        got = run(put(x, "data"), put(w1, None, "tensor"), put(w2, "tensor"))
    _assert_close(got, (want[0], want[1]))


def test_primitives_refuse_misuse():
    mesh = make_mesh(ParallelConfig(data=4, tensor=2))
    x, w1, w2 = _mlp_data()
    with jax.set_mesh(mesh):
        with pytest.raises(ConfigError, match="collective_matmul.*tensor=2.*length 15 is not divisible"):
            jax.jit(_ring_mlp)(x[:, :15], w1, w2)
        # A row-parallel weight given to the column-parallel ring is a bug, not a layout.
        with pytest.raises(ValueError, match="column-parallel.*output dimension.*splits .mlp."):
            jax.jit(lambda a, w: overlap.all_gather_matmul(
                "btf,fd->btd", overlap.scatter_rows(a), w, ("mlp", "embed"), ("batch", "length", "embed"))
            )(np.zeros((8, 16, 64), np.float32), w2)


@pytest.mark.parametrize("rows, problem", [
    ({"mlp": ()}, r"weight \('embed', 'mlp'\) split over 'tensor' on one dimension.*rows for 'mlp'"),
    ({"embed": ("tensor",)}, r"on an output dimension, but the rules table splits 'embed'"),
    ({"length": ("tensor",)}, r"computes \('batch', 'length', 'mlp'\) split over 'tensor'.*for 'length'"),
])
def test_a_users_rules_row_reaches_the_collective_matmul(rows, problem):
    # The rings read the active table (parallel.rules included), as the plain path
    # does: a row the ring cannot run is one line naming it, not the built-in row
    # silently kept for the ring while the parameters follow the user's.
    mesh = make_mesh(ParallelConfig(data=4, tensor=2))
    x, w1, w2 = _mlp_data()
    with jax.set_mesh(mesh), use_rules(rows):
        with pytest.raises(ConfigError, match=f"collective_matmul=true: the .*{problem}"):
            jax.jit(_ring_mlp)(x, w1, w2)


def test_a_users_rules_row_the_ring_can_run_gives_the_same_numbers():
    # mlp over tensor and data: the ring still splits it over tensor alone.
    mesh = make_mesh(ParallelConfig(data=4, tensor=2))
    x, w1, w2 = _mlp_data()
    want = jax.jit(jax.value_and_grad(_loss(_plain_mlp), argnums=(1, 2)))(x, w1, w2)
    with jax.set_mesh(mesh), use_rules({"mlp": ("tensor", "data")}):
        got = jax.jit(jax.value_and_grad(_loss(_ring_mlp), argnums=(1, 2)))(x, w1, w2)
    _assert_close(got, want)


def _block_programs(on: bool, p: int = 4):
    """Forward + backward of one GPT block on a tensor=p mesh of p devices: the
    lowered StableHLO (the program as written) and the compiled HLO (after XLA)."""
    cfg = _cfg(on, n_layers=1)
    mesh = make_mesh(ParallelConfig(data=1, tensor=p), devices=jax.devices()[:p])
    spec, create = model_spec(lambda r: Block(cfg, r), mesh, seed=0)
    params = jax.jit(create, out_shardings=spec.storage)()
    x = jax.device_put(np.ones((4, cfg.seq_len, cfg.d_model), np.float32), NamedSharding(mesh, P()))

    def loss(prm, h):
        return jnp.sum(jnp.sin(spec.merge(prm)(h)))

    with jax.set_mesh(mesh):
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x)
        return lowered.as_text(), lowered.compile().as_text(), cfg


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\(([^)]*)\)(.*)$")


def _entry(hlo: str) -> dict:
    """The compiled entry computation: name -> (opcode, shape text, operands, rest of line)."""
    body = hlo[hlo.index("\nENTRY"):]
    body = body[:body.index("\n}")]
    instrs = {}
    for line in body.splitlines()[2:]:
        m = _INSTR.match(line)
        if m:
            name, shape, op, operands, rest = m.groups()
            instrs[name] = (op, shape, re.findall(r"%([\w.\-]+)", operands), rest)
    return instrs


def _elements(shape_text: str) -> int:
    """Elements of the largest array in an HLO shape (a tuple's largest member)."""
    dims = re.findall(r"\[([\d,]*)\]", shape_text)
    return max((int(np.prod([int(d) for d in s.split(",") if d])) for s in dims), default=1)


def _collectives(instrs, kind):
    return {n: v for n, v in instrs.items() if v[0] in (kind, kind + "-start")}


def test_hlo_projections_are_ppermute_rings_interleaved_with_dots():
    p = 4
    lowered_on, compiled_on, cfg = _block_programs(True, p)
    _, compiled_off, _ = _block_programs(False, p)
    on, off = _entry(compiled_on), _entry(compiled_off)
    rows = 4 * cfg.seq_len * cfg.d_model  # elements of the replicated [B, T, d] stream

    # Off: XLA's blocking all-reduces of activations, two forward and two backward.
    assert len([v for v in _collectives(off, "all-reduce").values() if _elements(v[1]) >= rows]) >= 4
    assert not _collectives(off, "collective-permute")

    # On: four rings of p-1 ppermutes forward and four backward, each moving one
    # device's rows ([B, T/p, ...]) ...
    permutes = _collectives(on, "collective-permute")
    assert len(permutes) == 8 * (p - 1), len(permutes)
    assert all(_elements(v[1]) == rows // p for v in permutes.values())
    # ... no all-reduce or reduce-scatter of activations: what is left reduces the
    # [d]-sized gradients of the norms and biases that act on row shards ...
    for kind in ("all-reduce", "reduce-scatter"):
        big = [v[1] for v in _collectives(on, kind).values() if _elements(v[1]) > cfg.d_model]
        assert not big, (kind, big)
    # ... and no all-gather for the projections: only the residual stream's, once each way.
    gathers = _collectives(on, "all-gather")
    assert len(gathers) == 2 and all(_elements(v[1]) == rows for v in gathers.values())

    # Interleaved, as written: in the lowered program every two consecutive ppermutes
    # have a matmul between them (ring step s's transfer, then its partial product).
    ops = re.findall(r"stablehlo\.(collective_permute|dot_general)", lowered_on)
    at = [k for k, o in enumerate(ops) if o == "collective_permute"]
    assert len(at) == 8 * (p - 1)
    assert all("dot_general" in ops[a + 1:b] for a, b in zip(at, at[1:], strict=False))

    # Interleaved, as compiled: next to every ppermute in the dataflow is a projection
    # matmul that neither depends on it nor feeds it, so a scheduler with asynchronous
    # collectives can run the two together (XLA:CPU's own schedule need not).
    def ancestors(name, memo={}):  # noqa: B006 -- per-call cache via the default dict
        if name not in memo:
            memo[name] = set()
            for o in on.get(name, (None, None, []))[2]:
                memo[name] |= {o} | ancestors(o)
        return memo[name]

    matmuls = {n for n, v in on.items() if "dot_general" in v[3] and "shard_map/" in v[3]}
    users = {}
    for n, v in on.items():
        for o in v[2]:
            users.setdefault(o, set()).add(n)
    near = lambda n: set(on.get(n, (None, None, []))[2]) | users.get(n, set())
    for name in permutes:
        frontier, seen = {name}, {name}
        for _ in range(4):  # a shared operand, a shared user, or a duplicated producer
            frontier = {m for f in frontier for m in near(f)} - seen
            seen |= frontier
        partners = [d for d in seen & matmuls if d not in ancestors(name) and name not in ancestors(d)]
        assert partners, f"ppermute {name} has no independent partial matmul beside it"


_TRAIN = ("model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.seq_len=16",
          "train.global_batch=8", "train.progress=false", "train.tensorboard=false",
          "train.steps=2", "train.eval_every=0", "train.log_every=1", "train.checkpoint_every=0",
          "data.source=synthetic", "data.synthetic_tokens=4096", "optim.warmup_steps=1",
          "parallel.simulate_cpu_devices=0")


def _train(tmp_path, name, *overrides):
    return mp.train(None, None, mp.Config(), *_TRAIN, *overrides, f"train.out_dir={tmp_path / name}")


def test_train_steps_on_equal_off(tmp_path):
    runs = {on: _train(tmp_path, str(on), "parallel.data=4", "parallel.tensor=2",
                       f"model.collective_matmul={str(on).lower()}") for on in (False, True)}
    metrics = {on: [(h["loss"], h["grad_norm"]) for h in r.history if "loss" in h] for on, r in runs.items()}
    assert len(metrics[True]) == 2
    # Step 2's loss and gradient norm follow step 1's update: the whole step agrees.
    np.testing.assert_allclose(metrics[True], metrics[False], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("schedule,remat,extra", [
    ("1f1b", "full", ()),             # a forward re-run in the backward: it hung in per-device branches
    ("zb-h1", "dots", ()),            # split B/W: each forms the whole vjp (split_backward=False)
    ("interleaved", "none", ("parallel.virtual_stages=2", "model.n_layers=4"))])
def test_pipeline_with_collective_matmul_equals_without(tmp_path, schedule, remat, extra):
    """pipe2 x tensor2 x data2: the stages run in lockstep (every device runs every task
    of a tick under conds with one predicate everywhere), so every device issues the
    rings' ppermutes at the same place. Two train steps' losses and gradient norms
    equal the same pipeline with the option off (the option was refused in pipelines:
    in per-device branches 1F1B came out 1e-3 to 2e-2 off, and remat "full" hung)."""
    runs = {on: _train(tmp_path, f"pipe-{on}", f"model.collective_matmul={str(on).lower()}",
                       "parallel.pipe=2", "parallel.tensor=2", "parallel.data=2", "parallel.microbatches=2",
                       f"parallel.schedule={schedule}", f"parallel.stage_remat={remat}", *extra)
            for on in (False, True)}
    metrics = {on: [(h["loss"], h["grad_norm"]) for h in r.history if "loss" in h] for on, r in runs.items()}
    assert len(metrics[True]) == 2
    np.testing.assert_allclose(metrics[True], metrics[False], rtol=RTOL, atol=ATOL)


def test_collective_matmul_in_per_device_branches_is_refused():
    """A pipeline told to run its stages in per-device branches (lockstep=False) cannot
    hold the rings: refused in one line naming the way out, before anything runs."""
    from flax import nnx

    from mindpipe_jax.parallel.pipeline import get_schedule
    from mindpipe_jax.parallel.pipeline.contract import stage_fns
    from mindpipe_jax.parallel.pipeline.runtime import pipeline_grads

    model = GPT(_cfg(True, n_layers=2), rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    mesh = make_mesh(ParallelConfig(pipe=2, tensor=2, data=2))
    run = pipeline_grads(stage_fns(model), get_schedule("1f1b", 2, 2), mesh, remat="none", lockstep=False)
    tokens = np.zeros((2, 4, 16), np.int32)
    with jax.set_mesh(mesh), pytest.raises(ConfigError, match=r"collective_matmul=true needs the pipeline's "
                                                                r"stages run in lockstep.*lockstep=None"):
        jax.jit(run).lower(params["embed"], params["blocks"], params["head"], tokens, tokens)
