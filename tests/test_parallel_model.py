"""Mesh construction, the rules table, and the GPT under data/fsdp/tensor sharding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mindpipe_jax.config import DistributedConfig, ModelConfig, ParallelConfig
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.models.gpt import GPT, flops_per_token, matmul_params
from mindpipe_jax.parallel.mesh import distributed_settings, make_mesh, resolve_axis_sizes
from mindpipe_jax.parallel.rules import check_sharded_as_rules, spec_for
from mindpipe_jax.train.state import model_spec
from mindpipe_jax.train.step import model_loss

CFG = ModelConfig(vocab_size=256, seq_len=16, d_model=64, n_layers=2, n_heads=4)


def test_fill_axis_and_product_errors():
    assert resolve_axis_sizes(ParallelConfig(tensor=2), 8)["data"] == 4
    with pytest.raises(ConfigError, match="data=3.*8 devices"):
        resolve_axis_sizes(ParallelConfig(data=3), 8)
    with pytest.raises(ConfigError, match="multiple of 3"):
        resolve_axis_sizes(ParallelConfig(tensor=3), 8)
    with pytest.raises(ConfigError, match="only one axis may be -1"):
        ParallelConfig(data=-1, tensor=-1)
    mesh = make_mesh(ParallelConfig(data=2, fsdp=2, tensor=2))
    assert dict(mesh.shape) == {"pipe": 1, "data": 2, "subnet": 1, "fsdp": 2, "expert": 1, "tensor": 2}


def test_rules_storage_vs_compute():
    # FSDP shards storage on embed; compute keeps weights whole on embed.
    assert spec_for(("embed", "mlp"), "storage") == jax.sharding.PartitionSpec("fsdp", "tensor")
    assert spec_for(("embed", "mlp"), "compute") == jax.sharding.PartitionSpec(None, "tensor")
    assert spec_for(("batch", "length", "embed"), "compute") == jax.sharding.PartitionSpec(
        ("data", "fsdp", "expert"), None, None)
    with pytest.raises(ConfigError, match="'nope'"):
        spec_for(("nope",))


def test_distributed_settings_from_env_and_slurm():
    assert distributed_settings(DistributedConfig(), {}) is None
    env = {"MINDPIPE_COORDINATOR": "10.0.0.1:1234", "MINDPIPE_NUM_PROCESSES": "2",
           "MINDPIPE_PROCESS_ID": "1"}
    got = distributed_settings(DistributedConfig(), env)
    assert got["coordinator_address"] == "10.0.0.1:1234" and got["process_id"] == 1
    slurm = {"SLURM_NTASKS": "4", "SLURM_PROCID": "3", "SLURM_STEP_NODELIST": "gpu[007-010],cpu1"}
    got = distributed_settings(DistributedConfig(), slurm)
    assert got["coordinator_address"].startswith("gpu007:") and got["num_processes"] == 4
    with pytest.raises(ConfigError, match="process_id"):
        distributed_settings(DistributedConfig(coordinator="h:1", num_processes=2, process_id=5), {})
    # Without a coordinator these ran one process alone, silently.
    for given in (dict(num_processes=2), dict(process_id=1), dict(num_processes=2, process_id=0)):
        with pytest.raises(ConfigError, match=r"^distributed.\w+=\d needs a coordinator: "
                                              r"distributed.coordinator=host:port"):
            distributed_settings(DistributedConfig(**given), {})
    assert distributed_settings(DistributedConfig(num_processes=2, process_id=1), slurm) is not None
    assert distributed_settings(DistributedConfig(num_processes=1, process_id=0), {}) is None  # one process


def _reference(spec, params, batch):
    """Loss and gradients on one device, no mesh: the oracle."""
    host = jax.device_get(params)
    return jax.jit(jax.value_and_grad(lambda p: model_loss(spec, p, batch, None)))(host)


@pytest.mark.parametrize("axes", [dict(data=4, tensor=2), dict(data=2, fsdp=4),
                                  dict(data=2, fsdp=2, tensor=2)])
def test_sharded_loss_and_grads_equal_unsharded(axes):
    cfg = ModelConfig(vocab_size=256, seq_len=16, d_model=64, n_layers=2, n_heads=8)
    mesh = make_mesh(ParallelConfig(**axes))
    spec, create = model_spec(lambda r: GPT(cfg, rngs=r), mesh, seed=0)
    params = jax.jit(create, out_shardings=spec.storage)()
    check_sharded_as_rules_pure(spec, params)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (8, 17)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    ref_loss, ref_grads = _reference(spec, params, batch)
    batch_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))
    sharded_batch = jax.device_put(batch, batch_sharding)
    with jax.set_mesh(mesh):
        loss, grads = jax.jit(jax.value_and_grad(
            lambda p, b: model_loss(spec, p, b, None)))(params, sharded_batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    # fp32 with different reduction orders: relative 1e-4 of each leaf's scale.
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6 * float(np.abs(want).max() + 1))


def check_sharded_as_rules_pure(spec, params):
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(spec.storage), strict=True):
        assert got.sharding.is_equivalent_to(want, got.ndim), (got.sharding, want)


def test_rules_check_catches_silent_replication():
    mesh = make_mesh(ParallelConfig(data=2, fsdp=2, tensor=2))
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: GPT(CFG, rngs=nnx.Rngs(0)))
    _, state = nnx.split(abstract)
    from mindpipe_jax.parallel.rules import state_shardings
    shardings = state_shardings(state, mesh)

    def make():
        with nnx.use_eager_sharding(False):
            return nnx.state(GPT(CFG, rngs=nnx.Rngs(0)))

    good = jax.jit(make, out_shardings=shardings)()
    check_sharded_as_rules(good, mesh)
    # Every weight sharded over tensor/fsdp must really be split: a replicated copy fails.
    replicated = jax.device_put(good, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    with pytest.raises(AssertionError, match="w_in"):
        check_sharded_as_rules(replicated, mesh)


def test_heads_not_divisible_by_tensor_is_a_config_error():
    cfg = ModelConfig(vocab_size=256, seq_len=16, d_model=48, n_layers=1, n_heads=3)
    mesh = make_mesh(ParallelConfig(data=4, tensor=2))
    with pytest.raises(ConfigError, match="heads=3.*tensor"):
        model_spec(lambda r: GPT(cfg, rngs=r), mesh, seed=0)


def test_flops_per_token_counts_matmuls():
    d, f, L, V, T = CFG.d_model, CFG.ff_dim, CFG.n_layers, CFG.vocab_size, CFG.seq_len
    assert matmul_params(CFG) == L * (4 * d * d + 2 * d * f) + d * V
    assert flops_per_token(CFG) == 6 * matmul_params(CFG) + 12 * L * T * d
    # Cross-check against XLA's count for a 1-layer model (a scan body is counted once):
    # the forward pass is a third of the training FLOPs, up to elementwise work.
    one = ModelConfig(vocab_size=256, seq_len=T, d_model=d, n_layers=1, n_heads=4)
    with nnx.use_eager_sharding(False):
        model = GPT(one, rngs=nnx.Rngs(0))
    batch = 4
    tokens = jnp.zeros((batch, T), jnp.int32)
    fwd = jax.jit(lambda t: model(t)).lower(tokens).compile().cost_analysis()["flops"]
    predicted = batch * T * flops_per_token(one) / 3
    assert abs(fwd - predicted) / predicted < 0.15, (fwd, predicted)


@pytest.mark.parametrize("chain", ["adamw", "clip+masked-adamw"])
def test_optimizer_moments_are_stored_as_their_parameters(chain):
    # Before: the moments' shardings were read off the compiled tx.init, where
    # zeros_like has no sharding to inherit, so XLA replicated them: with fsdp=8 every
    # device held all of Adam's state. The created state is checked, not the table.
    import optax

    from mindpipe_jax.train.state import init_train_state

    mesh = make_mesh(ParallelConfig(data=1, fsdp=8, tensor=1))
    with jax.set_mesh(None):
        spec, create = model_spec(lambda rngs: GPT(CFG, rngs=rngs), mesh, 0)
    tx = optax.adamw(1e-3)
    if chain != "adamw":
        tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, mask=spec.decay_mask))
    state = init_train_state(spec, create, tx, mesh, seed=0)
    moments = [leaf for path, leaf in jax.tree_util.tree_flatten_with_path(state["opt"])[0]
               if any(getattr(k, "name", None) in ("mu", "nu") for k in path)]
    params = jax.tree.leaves(state["params"])
    assert len(moments) == 2 * len(params)
    for moment, param in zip(moments, params + params, strict=True):
        assert moment.sharding.is_equivalent_to(param.sharding, param.ndim), (moment.sharding, param.sharding)
    w_in = state["params"]["blocks"]["mlp"]["w_in"]
    assert w_in.addressable_shards[0].data.nbytes * 8 == w_in.nbytes


_SMALL_GPT = ("model.vocab_size=64", "model.seq_len=16", "model.d_model=32", "model.n_layers=2",
              "model.n_heads=4", "train.global_batch=64")


def test_data_x_fsdp_compiles_without_an_involuntary_rematerialization_warning():
    """XLA 0.10 logged "[SPMD] Involuntary full rematerialization" compiling every train
    step with fsdp and another batch axis: the token table's gradient, a scatter-add of
    batch-split rows, was planned straight into the table's fsdp storage shards. The
    embedding now takes the table in its compute layout inside the differentiated
    function. Checked in a child process with XLA's warnings shown (the tests hide them)."""
    import subprocess
    import sys

    from cli_procs import cli_env

    code = ("import jax; jax.config.update('jax_num_cpu_devices', 8)\n"
            "from mindpipe_jax.config import Config\n"
            "from mindpipe_jax.tuner.aot import build_step\n"
            f"cfg = Config().replace(*{_SMALL_GPT!r}, 'parallel.data=2', 'parallel.fsdp=4',"
            " 'parallel.tensor=1')\n"
            "build_step(cfg).lower().compile(); print('compiled')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=cli_env(TF_CPP_MIN_LOG_LEVEL="0"))
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-2000:]
    assert "Involuntary full rematerialization" not in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("axes", [dict(data=2, fsdp=4, tensor=1), dict(data=4, fsdp=2, tensor=1)])
def test_data_x_fsdp_moves_parameters_never_activations(axes):
    """On a data x fsdp mesh every collective of the compiled train step moves at most a
    stacked parameter's worth (the weights gathered, the gradients reduced), none an
    activation (as it did already while XLA warned of a rematerialization, above).
    The activations here (64 rows x 16 x 32 = 32768 values, logits 65536) are larger
    than any parameter (8192), so a replicated activation would be seen (a device's
    shard, 8 rows, would not: no tensor axis here, whose all-reduces move those)."""
    from mindpipe_jax.config import Config
    from mindpipe_jax.parallel.collectives import collectives
    from mindpipe_jax.tuner.aot import build_step

    cfg = Config().replace(*_SMALL_GPT, *(f"parallel.{k}={v}" for k, v in axes.items()))
    built = build_step(cfg)
    largest = max(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(built.abstract_state["params"]))
    assert largest == 2 * 32 * 128  # the stacked MLP weights
    ops = collectives(built.lower().compile().as_text())
    assert ops, "no collective at all: the step is not sharded"
    moved = {op.name: max(int(np.prod(dims)) for _, dims in op.shapes) for op in ops}
    assert max(moved.values()) <= largest, sorted(moved.items(), key=lambda kv: -kv[1])[:5]
