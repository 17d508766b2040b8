"""bfloat16 reductions over devices inside a partly manual shard_map: XLA's CPU compiler
aborts the process on them (SIGABRT), so the step refuses them in one line first; a
model with its own shard_map trains (it was refused by the output check, which traced
it without a mesh)."""

import math
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mindpipe_jax as mp
from mindpipe_jax.config import ParallelConfig
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.parallel.cpu_guard import lower_checked
from mindpipe_jax.parallel.mesh import make_mesh
from mindpipe_jax.tuner.aot import compile_candidate
from mindpipe_jax.tuner.space import Candidate

REDUCTIONS = {
    "psum": lambda v: lax.psum(v, "data"),
    "pmean": lambda v: lax.pmean(v, "data"),
    "pmax": lambda v: lax.pmax(v, "data"),
    "psum_scatter": lambda v: lax.psum_scatter(v, "data", tiled=True),
}


def _program(reduce, dtype, manual):
    """A jitted function reducing a [8, 8] ``dtype`` batch over ``data`` inside a
    shard_map manual over ``manual``, and its argument on a data=4 x tensor=2 mesh."""
    mesh = make_mesh(ParallelConfig(data=4, tensor=2))
    x = jax.device_put(jnp.arange(64, dtype=dtype).reshape(8, 8), NamedSharding(mesh, P("data")))
    out = P("data") if reduce is REDUCTIONS["psum_scatter"] else P()

    def f(x):
        return jax.shard_map(lambda xs: reduce(xs.sum(0)), in_specs=P("data"), out_specs=out,
                             axis_names=manual)(x)

    return mesh, jax.jit(f), x


@pytest.mark.parametrize("name", list(REDUCTIONS))
def test_a_bfloat16_reduction_in_a_partly_manual_shard_map_is_refused_naming_its_line(name):
    mesh, fn, x = _program(REDUCTIONS[name], jnp.bfloat16, {"data"})
    with jax.set_mesh(mesh), pytest.raises(ConfigError) as err:
        lower_checked(fn, x, platform="cpu")
    message = str(err.value)
    assert "\n" not in message
    assert "XLA's CPU compiler aborts on" in message and "test_cpu_guard.py:" in message
    assert "automatic (" in message and "tensor" in message.split("automatic (")[1].split(")")[0]


@pytest.mark.parametrize("dtype,all_manual", [(jnp.float32, False), (jnp.bfloat16, True)],
                         ids=["float32-partly-manual", "bfloat16-all-manual"])
def test_what_xla_compiles_is_not_refused(dtype, all_manual):
    mesh = make_mesh(ParallelConfig(data=4, tensor=2))
    mesh, fn, x = _program(REDUCTIONS["psum"], dtype, set(mesh.axis_names) if all_manual else {"data"})
    with jax.set_mesh(mesh):
        got = lower_checked(fn, x, platform="cpu").compile()(x)
    want = np.arange(64, dtype=np.float32).reshape(8, 8).sum(0)
    np.testing.assert_array_equal(np.asarray(got, np.float32), want)


def test_other_platforms_are_only_lowered():
    # GPUs widen only 16-bit integer all-reduces: the same program compiles there.
    mesh, fn, x = _program(REDUCTIONS["psum"], jnp.bfloat16, {"data"})
    with jax.set_mesh(mesh):
        assert "all_reduce" in lower_checked(fn, x, platform="gpu").as_text()


def test_the_refused_program_does_abort_xla_on_cpu():
    """The guard's reason, kept honest: when XLA stops aborting here this fails, and the
    guard (mindpipe_jax/parallel/cpu_guard.py) can go."""
    code = textwrap.dedent("""
        import jax
        jax.config.update("jax_num_cpu_devices", 4)
        import jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec as P
        mesh = jax.make_mesh((2, 2), ("data", "tensor"))
        x = jax.device_put(jnp.ones((4, 8), jnp.bfloat16), NamedSharding(mesh, P("data")))
        f = lambda x: jax.shard_map(lambda v: jax.lax.psum(v.sum(0), "data"), in_specs=P("data"),
                                    out_specs=P(), axis_names={"data"})(x)
        with jax.set_mesh(mesh):
            jax.jit(f).lower(x).compile()
        print("compiled")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert proc.returncode == -6, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert "Invalid binary instruction opcode copy" in proc.stderr


class CentredOverDevices(nnx.Module):
    """A user's model with its own shard_map: embeddings centred by their mean over the
    batch, averaged over the ``data`` devices (manual over ``data`` only) in ``dtype``."""

    def __init__(self, rngs, dtype=jnp.float32):
        self.emb = nnx.Embed(64, 16, rngs=rngs)
        self.dtype = dtype

    def __call__(self, tokens):
        h = self.emb(tokens).astype(self.dtype)
        mean = jax.shard_map(lambda x: lax.pmean(x.mean(0), "data"), in_specs=P("data"), out_specs=P(),
                             axis_names={"data"})(h)
        return self.emb.attend((h - mean).astype(jnp.float32))


COMMON = ("model.vocab_size=64", "model.seq_len=8", "data.source=synthetic", "train.global_batch=8",
          "train.eval_every=0", "train.checkpoint_every=0", "train.progress=false", "train.tensorboard=false",
          "parallel.tensor=2")


def test_a_model_with_its_own_shard_map_trains(tmp_path):
    # Before: "running the model, CentredOverDevices(tokens) on a [1, 8] batch, raised
    # ValueError: The context mesh cannot be empty" (the output check ran it meshless).
    result = mp.train(lambda rngs: CentredOverDevices(rngs), None, None, *COMMON, "train.steps=4",
                      "train.log_every=1", f"train.out_dir={tmp_path / 'run'}")
    losses = [h["loss"] for h in result.history if "loss" in h]
    assert len(losses) == 4 and all(np.isfinite(losses))


def test_a_model_reducing_bfloat16_in_its_shard_map_is_one_line_and_writes_nothing(tmp_path):
    with pytest.raises(ConfigError, match=r"sums bfloat16 values over devices .*: psum\w* at "
                                          r"\S*test_cpu_guard\.py:\d+"):
        mp.train(lambda rngs: CentredOverDevices(rngs, jnp.bfloat16), None, None, *COMMON, "train.steps=1",
                 f"train.out_dir={tmp_path / 'run'}")
    assert not (tmp_path / "run").exists()


def test_the_tuner_rejects_such_a_layout_with_the_reason_instead_of_aborting():
    cfg = mp.Config().replace(*COMMON)
    model = lambda rngs: CentredOverDevices(rngs, jnp.bfloat16)  # noqa: E731
    bad = compile_candidate(cfg, Candidate(data=4, tensor=2, global_batch=8), math.inf, model=model)
    assert not bad.fits
    assert "XLA's CPU compiler aborts on" in bad.reason and "test_cpu_guard.py:" in bad.reason
    good = compile_candidate(cfg, Candidate(data=4, tensor=2, global_batch=8), math.inf,
                             model=lambda rngs: CentredOverDevices(rngs))
    assert good.fits, good.reason
