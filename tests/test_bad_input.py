"""Every user mistake the core knows of, through the Python API and the command line.

Each case must give one line naming the bad value (``ConfigError`` from
``mindpipe_jax.train``; ``mindpipe: error: ...`` on stderr and exit status 2 from
``mindpipe train``, no traceback) and leave every file under the test's
directory exactly as it was: same names, same bytes, same modification times.
A few mistakes can only be made from Python (a custom module, a wrong argument
type); they run through the API only. A few are refused by ``mindpipe train`` only
(keys the train command does not read but ``mindpipe supernet`` does). An argument
``--config={tmp}/FILE`` is ``--config FILE`` on the command line and
``mp.load_config(FILE)`` as the API's base config.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from byom_models import (
    BrokenForward,
    CountsInAParam,
    EmbedIn,
    FewClasses,
    IntegerLogits,
    KeywordsOnly,
    LossWithMetrics,
    NeedsAttentionMask,
    NoForward,
    PlainListNet,
    ReadsBesideTheChain,
    ResidualInTheLoop,
    ReversedLoop,
    ScannedWithBuffers,
    SharedLayers,
    ShortNames,
    Sowing,
    StockGPT2,
    TupleInAnotherDtype,
    TwoStreams,
    WholeSequential,
    WithBuffers,
)
from ckpt_damage import flip_a_restored_byte
from cli_procs import cli_env
from flax import nnx

import mindpipe_jax as mp
from mindpipe_jax.cli import main
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.train.checkpoint import COMMIT_MARKER

# Every row copies the module's finished run: one xdist worker runs them all, so the
# run is trained once, not once per worker (pytest -n 2 --dist loadgroup).
pytestmark = pytest.mark.xdist_group("bad_input")

TINY = ("model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.seq_len=32",
        "train.global_batch=16", "train.steps=2", "train.progress=false", "train.eval_every=0",
        "train.tensorboard=false", "parallel.simulate_cpu_devices=0")


class Bigram(nnx.Module):
    """A fine model for data/tensor parallelism that has no embed/blocks/head for a pipeline."""

    def __init__(self, rngs: nnx.Rngs):
        self.table = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (256, 256)))

    def __call__(self, tokens):
        return jnp.take(self.table[...], tokens, axis=0)


def factory_that_raises(rngs):
    raise ValueError("no such width")


def factory_returning_params(rngs):
    return {"w": jnp.zeros((2, 2))}


def factory_taking_two(rngs, width):
    return Bigram(rngs)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A complete tiny run (one committed checkpoint at step 2) to copy into cases."""
    out = tmp_path_factory.mktemp("finished") / "run"
    mp.train(None, None, mp.Config(), *TINY, f"train.out_dir={out}")
    assert (out / "checkpoints" / "2" / COMMIT_MARKER).is_file()
    return out


def _files(tmp_path: Path, finished: Path, args: list[str]) -> None:
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "a_file").write_text("not a directory")
    np.save(tmp_path / "big_ids.npy", np.arange(5000, dtype=np.int32) % 300)
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    (tmp_path / "tokens.csv").write_text("1,2,3")
    (tmp_path / "model_3.toml").write_text("model = 3\n")  # a section set to a value
    # A directory that already holds someone else's files.
    (tmp_path / "foreign" / "checkpoints").mkdir(parents=True)
    (tmp_path / "foreign" / "checkpoints" / "notes.txt").write_text("not a checkpoint")
    joined = " ".join(args)
    if "{tmp}/fifo" in joined:  # a named pipe: reading it would block
        os.mkfifo(tmp_path / "fifo")
    if "{tmp}/done" in joined:  # a finished run at step 2
        shutil.copytree(finished, tmp_path / "done")
    if "{tmp}/zeros" in joined:  # its step directory renamed 2 -> 0002
        shutil.copytree(finished, tmp_path / "zeros")
        (tmp_path / "zeros" / "checkpoints" / "2").rename(tmp_path / "zeros" / "checkpoints" / "0002")
    if "{tmp}/flipped" in joined:  # one byte of its array data changed
        shutil.copytree(finished, tmp_path / "flipped")
        flip_a_restored_byte(tmp_path / "flipped" / "checkpoints" / "2" / "state")
    if "{tmp}/truncated" in joined:
        shutil.copytree(finished, tmp_path / "truncated")
        # The largest data file of orbax's OCDBT store: array bytes (its small files are
        # index nodes, whose damage orbax reports itself).
        data = max((f for f in (tmp_path / "truncated" / "checkpoints" / "2" / "state").rglob("*")
                    if f.is_file() and f.parent.name == "d"), key=lambda f: f.stat().st_size)
        data.write_bytes(_truncate(data.read_bytes()))
    if "{tmp}/bad_meta" in joined:  # its config/fingerprint record not JSON
        shutil.copytree(finished, tmp_path / "bad_meta")
        for f in (tmp_path / "bad_meta" / "checkpoints" / "2" / "meta").rglob("*"):
            if f.is_file():
                f.write_text("{not json")
    if "{tmp}/partial" in joined:  # killed during its first save: only orbax's temporary dir
        tmp_step = tmp_path / "partial" / "checkpoints" / "2.orbax-checkpoint-tmp-1700000000"
        shutil.copytree(finished / "checkpoints" / "2", tmp_step)
        (tmp_step / COMMIT_MARKER).unlink()


def _truncate(data: bytes) -> bytes:
    return data[: len(data) // 2]


# (id, overrides, substring the one-line message must contain, API-only keyword arguments)
CASES = [
    ("unknown key", ["train.stepz=1"], "train.stepz", None),
    ("wrong type", ["train.steps=abc"], "'abc'", None),
    ("out of range", ["train.steps=0"], "train.steps=0", None),
    ("negative lr", ["optim.lr=-1.0"], "optim.lr=-1.0", None),
    ("bad schedule", ["parallel.schedule=zigzag"], "'zigzag'", None),
    ("bad nonfinite policy", ["train.nonfinite=ignore"], "'ignore'", None),
    ("mesh product", ["parallel.data=3"], "data=3", None),
    ("mesh larger than devices", ["parallel.data=16", "parallel.tensor=1"], "there are 8 devices", None),
    ("mesh does not divide devices", ["parallel.fsdp=3"], "multiple of 3", None),
    ("two fill axes", ["parallel.data=-1", "parallel.tensor=-1"], "only one axis", None),
    ("batch not divisible", ["train.global_batch=12", "parallel.data=8"], "train.global_batch=12", None),
    ("layers vs stages", ["model.n_layers=3", "parallel.pipe=2", "parallel.data=4"], "model.n_layers=3",
     None),
    ("negative sync bucket", ["parallel.pipe=2", "parallel.data=4", "parallel.schedule=afapab",
                              "parallel.sync_bucket_mb=-1"], "sync_bucket_mb=-1", None),
    ("virtual stages", ["parallel.pipe=2", "parallel.data=4", "parallel.virtual_stages=2"], "virtual",
     None),
    ("microbatches", ["parallel.pipe=2", "parallel.data=4", "parallel.microbatches=3"], "microbatches",
     None),
    ("V schedule with one chunk per stage",
     ["parallel.pipe=2", "parallel.data=4", "parallel.schedule=zbv", "parallel.microbatches=4"],
     "got 1; set it to 2 (parallel.virtual_stages=2", None),
    ("unbuilt axis", ["parallel.subnet=2", "parallel.data=4"], "subnet=2", None),
    ("expert axis with a dense model", ["parallel.expert=2", "parallel.data=4"], "model.n_experts", None),
    ("experts vs expert axis", ["model.n_experts=6", "parallel.expert=4", "parallel.data=2"],
     "model.n_experts=6", None),
    ("top_k above n_experts", ["model.n_experts=4", "model.top_k=5"], "model.top_k=5", None),
    ("capacity factor", ["model.n_experts=4", "model.capacity_factor=0.0"], "capacity_factor=0.0", None),
    # ~2 TB by the compiler's count: killed by the kernel (status 137, no message) before.
    ("a step larger than the host's memory", ["model.seq_len=4096", "train.global_batch=2048"],
     "GiB free: it would be killed for it", "cli"),
    ("stage layers", ["parallel.pipe=2", "parallel.data=4", "parallel.stage_layers=[1, 2]"], "[1, 2]",
     None),
    ("heads vs d_model", ["model.d_model=30", "model.n_heads=4"], "model.d_model=30", None),
    ("attention kernel name", ["model.attention=flash"], "'flash'", None),
    ("cudnn attention in float32", ["model.attention=cudnn"], "model.dtype bfloat16", None),
    ("cudnn attention without a GPU", ["model.attention=cudnn", "model.dtype=bfloat16"], "devices are cpu",
     None),
    # XLA's CPU backend cannot lower the attention backward's float16 matmul (a compiler
    # traceback after the run directory was made, before 2026-12-06).
    ("float16 on CPU", ["model.dtype=float16"], "model.dtype=float16 does not compile on CPU devices", None),
    ("heads vs tensor", ["model.n_heads=3", "model.d_model=48", "parallel.tensor=2", "parallel.data=4"],
     "heads=3", None),
    ("missing data path", ["data.source=text", "data.path={tmp}/missing"], "missing", None),
    ("empty data dir", ["data.source=text", "data.path={tmp}/empty_dir"], "empty_dir", None),
    ("empty data file", ["data.source=text", "data.path={tmp}/empty.txt"], "empty.txt", None),
    ("token ids above vocabulary", ["data.source=tokens", "data.path={tmp}/big_ids.npy"], "299", None),
    ("odd token file", ["data.source=tokens", "data.path={tmp}/odd.bin"], "odd.bin", None),
    ("token file type", ["data.source=tokens", "data.path={tmp}/tokens.csv"], "tokens.csv", None),
    ("tokens without path", ["data.source=tokens"], "data.path", None),
    ("deterministic with tensor", ["train.deterministic=true", "parallel.tensor=2", "parallel.data=4"],
     "tensor=2", None),
    ("deterministic pipeline microbatches",
     ["train.deterministic=true", "parallel.pipe=2", "parallel.data=4", "parallel.microbatches=4"],
     "parallel.microbatches=4 x fsdp x data (4) must equal train.virtual_shards=8", None),
    # Without a pipeline, microbatches are accumulation, which the virtual shards replace:
    # they were ignored, silently.
    ("deterministic microbatches without a pipeline",
     ["train.deterministic=true", "parallel.tensor=1", "parallel.microbatches=2"],
     "without a pipeline set parallel.microbatches=1 (got 2)", None),
    ("deterministic pipeline chunk sync",
     ["train.deterministic=true", "parallel.pipe=2", "parallel.data=4", "parallel.microbatches=2",
      "parallel.grad_sync=chunk"], "parallel.grad_sync='chunk'", None),
    ("out_dir of someone else", ["train.out_dir={tmp}/foreign"], "foreign", None),
    ("out_dir is a file", ["train.out_dir={tmp}/a_file"], "not a directory", None),
    # pathlib's exists() raised the filesystem's refusal: a traceback.
    ("out_dir name too long", ["train.out_dir={tmp}/" + "a" * 300], "cannot be used: file name too long",
     None),
    # A quoting slip: the run's final line (and every path it prints) broke in two.
    ("out_dir with a newline", ['train.out_dir="{tmp}/run\\nx"'], "holds the control character '\\n'", None),
    ("existing run without resume", ["train.out_dir={tmp}/done", "train.steps=4"], "train.resume=true",
     None),
    ("foreign checkpoint: different model",
     ["train.out_dir={tmp}/done", "train.steps=4", "train.resume=true", "model.d_model=64"],
     "different model", None),
    # Read as damage ("delete that step directory"): orbax cast the saved float32 on restore.
    # A parameter only the checkpoint has: "model None" named no problem a user could see.
    ("resume with experts added", ["train.out_dir={tmp}/done", "train.steps=4", "train.resume=true",
                                   "model.n_experts=2"], ": checkpoint [2, 128], model has none", None),
    ("resume with another parameter dtype",
     ["train.out_dir={tmp}/done", "train.steps=4", "train.resume=true", "model.param_dtype=bfloat16"],
     "holds state['opt'][1][0].mu['blocks']['attn']['out'] as float32, and this run builds it as bfloat16 "
     "(model.param_dtype, or the model's dtypes, changed since it was written)", None),
    ("checkpoint with changed bytes", ["train.out_dir={tmp}/flipped", "train.steps=4", "train.resume=true"],
     ("do not match the checksum", "could not be restored"), None),
    ("truncated checkpoint", ["train.out_dir={tmp}/truncated", "train.steps=4", "train.resume=true"],
     "could not be restored", None),
    ("corrupt checkpoint metadata", ["train.out_dir={tmp}/bad_meta", "train.steps=4", "train.resume=true"],
     "unreadable", None),
    ("resume value", ["train.resume=yes"], "valid: true, false, 'auto'", None),
    ("validation fraction", ["data.val_fraction=1.0"], "data.val_fraction=1.0 must be in [0, 1)", None),
    # Without a validation split (data.val_fraction=0: train on all the data), a run that
    # evaluates failed in the loader ("split 'val' has 0 tokens").
    ("no validation split but evaluating", ["data.val_fraction=0", "train.eval_every=5"],
     "data.val_fraction=0 leaves no validation data, and train.eval_every=5 evaluates on it", None),
    ("resume with nothing to resume", ["train.out_dir={tmp}/never_ran", "train.resume=true"],
     "nothing to resume", None),
    ("resume from an interrupted first save", ["train.out_dir={tmp}/partial", "train.resume=true"],
     "incomplete checkpoint", None),
    ("resume a finished run", ["train.out_dir={tmp}/done", "train.resume=true"], "train.steps above 2",
     None),
    ("tuner decision interval", ["tuner.every=0"], "tuner.every=0", None),
    ("tuner threshold", ["tuner.threshold=-0.1"], "tuner.threshold=-0.1", None),
    ("tuner ema", ["tuner.ema=1.0"], "tuner.ema=1.0", None),
    ("tuner probe", ["tuner.probe=-5"], "tuner.probe=-5", None),
    ("tuner learning-rate rule", ["tuner.lr_scaling=cubic"], "'cubic'", None),
    ("tuner batch sizes", ["tuner.batch_sizes=[16, 0]"], "tuner.batch_sizes=[16, 0]", None),
    ("tuner batch range", ["tuner.min_batch=64", "tuner.max_batch=32"], "tuner.min_batch=64", None),
    # batch_sizes lists the candidates: a range beside it was ignored, silently.
    ("tuner batch list and range", ["tuner.enabled=true", "tuner.batch_sizes=[16, 32]", "tuner.max_batch=64"],
     "tuner.max_batch=64 has no effect with tuner.batch_sizes=[16, 32]", None),
    ("coordinator without port", ["distributed.coordinator=nohost", "distributed.num_processes=2",
                                  "distributed.process_id=0"], "host:port", None),
    ("process id out of range", ["distributed.coordinator=127.0.0.1:1", "distributed.num_processes=2",
                                 "distributed.process_id=2"], "process_id=2", None),
    # Without a coordinator each process trained alone, silently.
    ("process count without a coordinator", ["distributed.num_processes=2"],
     "distributed.num_processes=2 needs a coordinator: distributed.coordinator=host:port", None),
    # Booleans are not numbers (TOML true would pass as the integer 1).
    ("boolean as an integer", ["train.steps=true"], "train.steps=true has the wrong type; expected int",
     None),
    ("boolean as a model size", ["model.n_layers=true"], "model.n_layers=true has the wrong type", None),
    ("boolean as a float", ["optim.lr=true"], "optim.lr=true has the wrong type; expected float", None),
    ("boolean in a list of integers",
     ["parallel.pipe=2", "parallel.data=4", "parallel.stage_layers=[true, 1]"],
     "parallel.stage_layers=[true, 1] has the wrong type; expected a list of int", None),
    # Integers beyond what the run can hold; floats beyond any float.
    ("seed overflow", ["train.seed=1180591620717411303424"],
     "train.seed=1180591620717411303424 is out of range; valid: integers from 0 to 4294967295", None),
    ("negative seed", ["train.seed=-1"], "train.seed=-1 is out of range", None),
    ("step count overflow", ["train.steps=2147483648"], "train.steps=2147483648 is out of range", None),
    ("infinite float", ["optim.lr=1e999"], "optim.lr=inf is not a finite number", None),
    ("too many simulated devices", ["parallel.simulate_cpu_devices=100000"],
     "parallel.simulate_cpu_devices=100000 must be in 0..1024", None),
    # Rules-table rows for other logical names (issue 14).
    ("rules row on no mesh axis", ['parallel.rules=["tp=tensr"]'],
     "parallel.rules entry tp=tensr: 'tensr' is not a mesh axis", None),
    ("rules row without =", ['parallel.rules=["tp"]'], "parallel.rules entry 'tp' must be", None),
    # Messages that say what the thing is.
    ("config section set to a value", ["model=3"], "config section 'model' must be a table", None),
    ("config file section set to a value", ["--config={tmp}/model_3.toml"],
     "config section 'model' must be a table", None),
    ("config key used as a section", ["train.steps.x=1"], "'train.steps' is a value, not a section", None),
    ("config file is a directory", ["--config={tmp}/empty_dir"], "empty_dir' is a directory", None),
    ("config file is a FIFO", ["--config={tmp}/fifo"], "fifo' is a FIFO (named pipe)", None),
    ("data path is a FIFO", ["data.path={tmp}/fifo"], "fifo' is a FIFO (named pipe), not a regular file",
     None),
    ("step directory with leading zeros", ["train.out_dir={tmp}/zeros", "train.steps=4", "train.resume=true"],
     "zeros/checkpoints/0002' to '2'", None),
    # A data.path selects its source and is always read; keys a setting makes inert are refused.
    ("data path alone that does not exist", ["data.path=/nonexistent/corpus.txt"],
     "data.path '/nonexistent/corpus.txt' does not exist", None),
    ("data path alone selects tokens", ["data.path={tmp}/big_ids.npy"], "holds id 299", None),
    ("data path with the stdlib source", ["data.source=stdlib", "data.path={tmp}/empty.txt"],
     "is not read with data.source='stdlib'", None),
    ("data path with the synthetic source", ["data.source=synthetic", "data.path={tmp}/big_ids.npy"],
     "is not read with data.source='synthetic'", None),
    ("data vocabulary without token files", ["data.vocab_size=300"], "data.vocab_size=300 applies to", None),
    ("token dtype for a .npy file", ["data.path={tmp}/big_ids.npy", "data.token_dtype=uint32"],
     "data.token_dtype='uint32' applies to raw .bin", None),
    ("data seed without synthetic data", ["data.seed=3"], "data.seed=3 applies to data.source='synthetic'",
     None),
    ("MoE key on a dense model", ["model.top_k=3"], "model.top_k=3 has no effect with model.n_experts=0",
     None),
    ("collective matmul without a tensor axis", ["parallel.tensor=1", "model.collective_matmul=true"],
     "model.collective_matmul=true has no effect with parallel.tensor=1", None),
    ("pipeline schedule without a pipeline", ["parallel.schedule=gpipe"],
     "parallel.schedule='gpipe' has no effect with parallel.pipe=1", None),
    # (the pipeline rematerialises by parallel.stage_remat: model.remat=full changed no byte of
    # the compiled step's temporaries, 147 MiB either way for a 4-layer GPT on pipe=2)
    ("GPT block remat through a pipeline", ["parallel.pipe=2", "parallel.data=4", "model.remat=full"],
     "model.remat='full' has no effect with parallel.pipe=2 (a pipeline rematerialises its stages by "
     "parallel.stage_remat); set parallel.stage_remat to that policy instead", None),
    ("sync bucket without chunk sync", ["parallel.pipe=2", "parallel.data=4", "parallel.sync_bucket_mb=4"],
     "parallel.sync_bucket_mb=4 has no effect", None),
    ("gradient sync dtype without a pipeline", ["parallel.grad_sync_dtype=bf16"],
     "parallel.grad_sync_dtype='bf16' has no effect with parallel.pipe=1", None),
    ("bad gradient sync dtype", ["parallel.pipe=2", "parallel.data=4", "parallel.grad_sync_dtype=fp8"],
     "'fp8'", None),
    ("split tail without a zero-bubble schedule",
     ["parallel.pipe=2", "parallel.data=4", "parallel.split_last=2"],
     "parallel.split_last=2 has no effect with parallel.schedule='1f1b' (no B/W split)", None),
    ("negative split tail", ["parallel.pipe=2", "parallel.data=4", "parallel.schedule=zb-h1",
                             "parallel.split_last=-3"], "parallel.split_last=-3 must be -1", None),
    ("fsdp gather without fsdp", ["parallel.pipe=2", "parallel.data=4", "parallel.fsdp_gather=chunk"],
     "parallel.fsdp_gather='chunk' has no effect with parallel.fsdp=1", None),
    ("bad fsdp gather",
     ["parallel.pipe=2", "parallel.fsdp=4", "parallel.data=1", "parallel.fsdp_gather=layer"], "'layer'",
     None),
    ("config file given as an override", ["run.toml"], "a config file is read with --config run.toml", "cli"),
    ("list key given one value", ["parallel.rules=tp=tensor"],
     """parallel.rules='tp=tensor' must be a list (a TOML array), e.g. parallel.rules='["tp=tensor"]'""",
     None),
    ("list with unquoted strings", ["parallel.pipe=2", "parallel.data=4", "parallel.stage_remat=[none,full]"],
     """not a TOML array (unquoted strings or a missing ']'), e.g. parallel.stage_remat='["none", "full"]'""",
     None),
    ("list without its closing bracket", ["parallel.pipe=2", "parallel.data=4", "parallel.stage_layers=[1,3"],
     "e.g. parallel.stage_layers='[1, 3]'", None),
    ("tuner key with the tuner off", ["tuner.every=5"],
     "tuner.every=5 has no effect with tuner.enabled=false", None),
    ("virtual shards without deterministic mode", ["train.virtual_shards=4"],
     "train.virtual_shards=4 has no effect with train.deterministic=false", "cli"),
    ("supernet key in a train run", ["supernet.subnets_per_step=8"],
     "supernet.subnets_per_step=8 has no effect on `mindpipe train`", "cli"),
    ("model without the pipeline contract", ["parallel.pipe=2", "parallel.data=4"], "pipeline contract",
     {"model": Bigram}),
    ("model computing between its layers", ["parallel.pipe=2", "parallel.data=4"],
     "ResidualInTheLoop.layers[1] is not called on the output of ResidualInTheLoop.layers[0]",
     {"model": ResidualInTheLoop}),
    ("model listing one layer twice", ["parallel.pipe=2", "parallel.data=4"],
     "SharedLayers.layers[1] is SharedLayers.layers[0] (one module listed twice: shared weights)",
     {"model": lambda rngs: SharedLayers(rngs, share="module")}),
    ("model whose layers share a parameter", ["parallel.pipe=2", "parallel.data=4"],
     "SharedLayers.layers[1] and SharedLayers.layers[0] share the parameter scale",
     {"model": lambda rngs: SharedLayers(rngs, share="param")}),
    ("model calling its layers by keywords their signature does not name", ["parallel.pipe=2",
                                                                              "parallel.data=4"],
     "layer 0 of the list (KeywordsOnlyLayer) was called with no positional argument and a __call__ that "
     "names no first parameter, with keywords hidden_states", {"model": KeywordsOnly}),
    ("model writing a buffer as it runs", ["parallel.data=8"],
     "the model writes its buffers as it runs: layers/0/calls (Count)",
     {"model": lambda rngs: WithBuffers(rngs, kind="counter")}),
    ("model whose layers hold different buffers, pipelined", ["parallel.pipe=2", "parallel.data=4"],
     "WithBuffers.layers[1] holds other constants (nnx.Variable buffers) than WithBuffers.layers[0]",
     {"model": lambda rngs: WithBuffers(rngs, kind="per-layer")}),
    ("model scanning stacked layers that hold buffers, pipelined", ["parallel.pipe=2", "parallel.data=4"],
     "its layer scan also iterates over values that are not parameters (per-layer inputs such as keys, or "
     "stacked nnx.Variable buffers)", {"model": ScannedWithBuffers}),
    ("model that is one nnx.Sequential, pipelined", ["parallel.pipe=2", "parallel.data=4"],
     "WholeSequential.net.layers: its 7 layers (Embed, NormLinearBlock x4, LayerNorm, Linear) do not repeat "
     "in groups", {"model": WholeSequential}),
    ("model passing a second stream between its layers", ["parallel.pipe=2", "parallel.data=4"],
     "TwoStreams.layers[1] is called with what TwoStreams.layers[0] returned besides the hidden state",
     {"model": TwoStreams}),
    ("model whose loss reads what its layers sow", ["parallel.pipe=2", "parallel.data=4"],
     "Sowing.layers: its layers sow values (self.sow, e.g. an auxiliary loss) that Sowing's loss reads",
     {"model": lambda rngs: Sowing(rngs, aux="pop")}),
    ("model capturing what its layers sow for its loss", ["parallel.pipe=2", "parallel.data=4"],
     "Sowing.layers: its layers sow values (self.sow, e.g. an auxiliary loss) that Sowing's loss reads",
     {"model": lambda rngs: Sowing(rngs, aux="capture")}),
    ("model reading a middle layer's output in its loss", ["parallel.pipe=2", "parallel.data=4"],
     "ReadsBesideTheChain's loss reads the output of ReadsBesideTheChain.layers[1] besides passing it to "
     "ReadsBesideTheChain.layers[2]", {"model": lambda rngs: ReadsBesideTheChain(rngs, reads="layer1")}),
    ("model calling its layers last to first", ["parallel.pipe=2", "parallel.data=4"],
     "ReversedLoop.layers: the model calls its layers in the order [3, 2, 1, 0]; the pipeline runs them in "
     "the list's order", {"model": ReversedLoop}),
    ("model whose layers return no leaf like the hidden state", ["parallel.pipe=2", "parallel.data=4"],
     "a layer (HalfAndMean) returns (bfloat16[", {"model": TupleInAnotherDtype}),
    ("model keeping its layers in an nnx.Dict", ["parallel.pipe=2", "parallel.data=4"],
     "model PlainListNet does not follow the pipeline contract and cannot be split into stages "
     "automatically: its loss has no scan over stacked parameters (a layer stack created with nnx.vmap and "
     "run with nnx.scan / lax.scan, or Linen's nn.scan); keep its layers in one nnx.List (or "
     "nnx.Sequential) that it calls in order", {"model": lambda rngs: PlainListNet(rngs, holder="dict")}),
    ("model calling its layers with different flags", ["parallel.pipe=2", "parallel.data=4"],
     "StockGPT2.h[1] is called with (h, None, deterministic=True, scale=0.5) but StockGPT2.h[0], its "
     "place in the repeating group of 1, with (h, None, deterministic=True, scale=1.0), and the calls "
     "repeat in no group",
     {"model": lambda rngs: StockGPT2(rngs, vocab=256, length=32, scales=[1.0, 0.5, 0.5, 0.5])}),
    ("model factory that raises", [], "building the model, factory_that_raises(rngs) raised ValueError: "
     "no such width", {"model": factory_that_raises}),
    ("model factory returning something else", [],
     "the model factory factory_returning_params(rngs) returned dict; it must return an nnx.Module",
     {"model": factory_returning_params}),
    ("model factory taking other arguments", [],
     "the model factory factory_taking_two cannot be called as factory_taking_two(rngs) (missing a required "
     "argument: 'width'): give it an rngs parameter", {"model": factory_taking_two}),
    ("model loss returning a tuple", [],
     "LossWithMetrics.loss(inputs, targets) returned tuple", {"model": LossWithMetrics}),
    ("model needing more arguments than the tokens", [],
     "NeedsAttentionMask(tokens) cannot be called so (missing a required argument: 'attention_mask'); "
     "mindpipe_jax calls a model's loss(inputs, targets) when it has one, else model(tokens)",
     {"model": NeedsAttentionMask}),
    ("model whose forward has a bug", [], "running the model, BrokenForward(tokens) on a [1, ",
     {"model": BrokenForward}),
    ("model with fewer classes than the vocabulary", [],
     "FewClasses(tokens) returns 100 classes per position, fewer than model.vocab_size=256",
     {"model": FewClasses}),
    ("model returning integer logits", [], "IntegerLogits(tokens) returns logits of dtype int32; they must "
     "be floating point", {"model": IntegerLogits}),
    ("model with fewer logical names than dimensions", [], "parameter w of shape (32, 256) has 1 logical "
     "axis name ('embed',); give one per dimension", {"model": ShortNames}),
    ("model with neither a forward nor a loss", [], "model NoForward has neither __call__(tokens)",
     {"model": NoForward}),
    ("model with an integer Param", [],
     "the model has nnx.Param it cannot train: calls (int32[]); the train step differentiates",
     {"model": CountsInAParam}),
    ("model with float16 Params", [], "table (float16[256, 32]); AdamW's eps (1e-8) is 0 in float16",
     {"model": EmbedIn}),
    ("model with complex Params", [], "table (complex64[256, 32]); mindpipe_jax trains float32 and bfloat16",
     {"model": lambda rngs: EmbedIn(rngs, jnp.complex64)}),
    ("model of the wrong type", [], "got int", {"model": 42}),
    # The reference GPT's compute settings do nothing to a model passed in (it ran, silently).
    ("model.remat with a model passed in", ["model.remat=full"],
     "model.remat='full' has no effect on a model passed in", {"model": PlainListNet}),
    ("model.dtype with a model passed in", ["model.dtype=bfloat16"],
     "model.dtype='bfloat16' has no effect on a model passed in", {"model": PlainListNet}),
    ("model.collective_matmul with a model passed in", ["model.collective_matmul=true", "parallel.tensor=2",
                                                         "parallel.data=4"],
     "model.collective_matmul=true has no effect on a model passed in", {"model": PlainListNet}),
    ("model.top_k with a model passed in", ["model.n_experts=4", "model.top_k=3"],
     "model.top_k=3 has no effect on a model passed in", {"model": PlainListNet}),
    # model.n_experts declares a model's own experts (what parallel.expert splits): one
    # without any sized nothing, silently.
    ("model.n_experts on a model without experts", ["model.n_experts=4"],
     "model.n_experts=4, but model PlainListNet has no parameter on the 'experts' logical axis",
     {"model": PlainListNet}),
    ("data of the wrong type", [], "got float", {"data": 3.5}),
    ("data array of floats", [], "token ids must be a non-empty 1-D array of integers",
     {"data": np.arange(5000.0)}),
    ("data array past the vocabulary", [], "holds id 299 but the vocabulary size is 256",
     {"data": np.arange(5000) % 300}),
]
RUNS = [(c, via) for c in CASES
        for via in (("cli",) if c[3] == "cli" else ("api",) if c[3] else ("api", "cli"))]


def _snapshot(root: Path) -> dict[str, tuple]:
    """Every path under ``root``: (size, mtime_ns, bytes) for files; directories as such."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.stat()
        out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns, p.read_bytes()) if p.is_file() \
            else ("dir", st.st_mtime_ns)
    return out


@pytest.mark.parametrize("case,via", RUNS, ids=[f"{c[0]}-{via}" for c, via in RUNS])
def test_bad_input_is_one_clear_line_and_writes_nothing(case, via, tmp_path, finished_run, capsys, caplog):
    _, overrides, needle, api_args = case
    api_args = api_args if isinstance(api_args, dict) else {}
    _files(tmp_path, finished_run, overrides)
    caplog.clear()  # what preparing the case logged
    args = [o.replace("{tmp}", str(tmp_path)) for o in overrides]
    config = next((a.removeprefix("--config=") for a in args if a.startswith("--config=")), None)
    args = [a for a in args if not a.startswith("--config=")]
    if not any(a.startswith("train.out_dir=") for a in args):
        args.append(f"train.out_dir={tmp_path / 'out'}")
    before = _snapshot(tmp_path)
    if via == "api":
        with pytest.raises(ConfigError) as err:
            base = mp.Config() if config is None else mp.load_config(config)
            mp.train(api_args.get("model"), api_args.get("data"), base, *TINY, *args)
        message = str(err.value)
    else:
        capsys.readouterr()
        code = main(["train", *([] if config is None else ["--config", config]), *TINY, *args])
        stderr = capsys.readouterr().err
        assert code == 2, stderr
        assert stderr.count("\n") == 1 and stderr.startswith("mindpipe: error: "), stderr
        assert "Traceback" not in stderr
        message = stderr.removeprefix("mindpipe: error: ").rstrip("\n")
    needles = (needle,) if isinstance(needle, str) else needle
    assert "\n" not in message and any(n in message for n in needles), message
    assert _snapshot(tmp_path) == before  # nothing written, nothing modified
    # A library's warning reaches the terminal as a second line (pytest's log capture hides
    # it from capsys): orbax's "Metadata file does not exist" came before the dtype error.
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not warned, warned


def test_a_checkpoint_with_every_array_cut_short_is_one_line_from_a_process(finished_run, tmp_path,
                                                                           compile_cache):
    """Every array read of the restore fails. Orbax's other reads, abandoned by the first
    failure, were finalized as the process exited, each printing its traceback: some 260
    lines after the one-line error (seen only from a process of its own)."""
    run = tmp_path / "cut"
    shutil.copytree(finished_run, run)
    state = run / "checkpoints" / "2" / "state"
    arrays = [f for f in state.rglob("*") if f.is_file() and f.parent.name == "d"]
    assert len(arrays) > 1
    for f in arrays:
        f.write_bytes(_truncate(f.read_bytes()))
    before = _snapshot(tmp_path)
    done = subprocess.run([sys.executable, "-m", "mindpipe_jax", "train", *TINY, "train.steps=4",
                           f"train.out_dir={run}", "train.resume=true"],
                          env=cli_env(compile_cache), cwd=tmp_path, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.count("\n") == 1, done.stderr[-3000:]
    assert done.stderr.startswith(f"mindpipe: error: checkpoint {str(run / 'checkpoints' / '2')!r} could not "
                                  f"be restored"), done.stderr
    assert _snapshot(tmp_path) == before


def test_at_least_twenty_kinds_of_mistake_through_both_entry_points():
    assert len({c[0] for c in CASES if not c[3]}) >= 20


@pytest.mark.parametrize("argv,launcher", [
    (["tune", "--measure", "1"], {"MINDPIPE_COORDINATOR": "127.0.0.1:12355", "MINDPIPE_NUM_PROCESSES": "2",
                                  "MINDPIPE_PROCESS_ID": "1"}),
    (["tune", "--supernet"], {"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_STEP_NODELIST": "127.0.0.1"}),
    (["plan", "parallel.pipe=2", "parallel.data=4", "parallel.microbatches=4"],
     {"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_STEP_NODELIST": "127.0.0.1"}),
])
def test_plan_and_tune_launched_as_several_processes_say_they_run_as_one(argv, launcher, monkeypatch,
                                                                         tmp_path, capsys):
    """Each process timed and decided on its own: two `mindpipe tune` processes could pick
    different trials (and wait on each other in one), process 1 of `mindpipe plan` died
    with a cross-host transfer's traceback. Refused before they connect."""
    monkeypatch.chdir(tmp_path)
    for name, value in launcher.items():
        monkeypatch.setenv(name, value)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == (f"mindpipe: error: `mindpipe {argv[0]}` runs as one process (it times programs on this "
                   f"process's devices and decides from those times), and it was launched as process 1 of 2: "
                   f"run it once without distributed settings (distributed.*, MINDPIPE_*, SLURM_NTASKS > 1), "
                   f"then give what it picks to every process of `mindpipe train`\n")
    assert list(tmp_path.iterdir()) == []


def test_launcher_variables_that_are_not_numbers(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("MINDPIPE_COORDINATOR", "127.0.0.1:12355")
    monkeypatch.setenv("MINDPIPE_NUM_PROCESSES", "two")
    assert main(["train", *TINY, f"train.out_dir={tmp_path / 'out'}"]) == 2
    assert capsys.readouterr().err.strip() == \
        "mindpipe: error: environment variable MINDPIPE_NUM_PROCESSES='two' must be an integer"
    assert list(tmp_path.iterdir()) == []


def test_bad_config_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 3")
    with pytest.raises(ConfigError, match="not valid TOML"):
        mp.load_config(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        mp.load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="is a directory, not a TOML file"):
        mp.load_config(tmp_path)
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[model]\nwidth = 3\n")
    with pytest.raises(ConfigError, match="width"):
        mp.load_config(unknown)


def test_a_config_file_with_a_byte_order_mark_is_read(tmp_path):
    """TOML is UTF-8: a file saved by Notepad (with a byte-order mark) read "Invalid
    statement (at line 1, column 1)". (The file is now also decoded as UTF-8 whatever
    the locale, which this process cannot switch to test.)"""
    path = tmp_path / "run.toml"
    path.write_bytes("\ufeff[train]\nout_dir = \"runs/caf\u00e9\"\nsteps = 3\n".encode("utf-8"))
    cfg = mp.load_config(path)
    assert cfg.train.steps == 3 and cfg.train.out_dir == "runs/caf\u00e9"


@pytest.mark.parametrize("config,needle", [
    ("run.toml", "got str; mindpipe_jax.load_config('run.toml') reads that file"),
    ({"train": {"steps": 1}}, "got dict; mindpipe_jax.config.from_dict(...) builds one"),
    (5, "got int; mindpipe_jax.Config().replace("),
])
@pytest.mark.parametrize("entry", ["train", "train_supernet"])
def test_a_config_that_is_not_a_config_is_one_line(entry, config, needle, tmp_path, monkeypatch):
    """A config file's path given where a Config goes raised str.replace's TypeError from
    inside the entry point (a dict or a number, an AttributeError)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        getattr(mp, entry)(None, None, config, "train.steps=1")
    message = str(err.value)
    assert message.startswith("config must be a mindpipe_jax.Config or None, ") and needle in message, message
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("entry", ["train", "train_supernet"])
def test_an_override_one_argument_early_says_where_overrides_go(entry, tmp_path, monkeypatch):
    """``mp.train(model, "train.steps=3")`` (the data's place) looked for a data file named
    so; ``mp.train(model, data, "train.steps=3")`` told how to load it as a config file."""
    monkeypatch.chdir(tmp_path)
    run = getattr(mp, entry)
    for args, argument in (((None, "train.steps=3"), "data"), ((None, None, "train.steps=3"), "config")):
        with pytest.raises(ConfigError) as err:
            run(*args)
        assert str(err.value) == (f"{argument}='train.steps=3' is an override, and overrides come after the "
                                  f"model, data and config: train(model, data, config, 'train.steps=3', ...)")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("override,needle", [
    ("train.steps", "override 'train.steps' must look like section.key=value"),
    (["train.steps=1"], "override ['train.steps=1'] must be a string section.key=value, got list; pass each"),
    (5, "override 5 must be a string section.key=value, got int"),
])
def test_an_override_that_is_not_a_key_value_string_is_one_line(override, needle):
    """A list of overrides passed as one argument (or a number) raised an AttributeError
    ('list' object has no attribute 'partition')."""
    with pytest.raises(ConfigError) as err:
        mp.Config().replace(override)
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("entry", ["train", "train_supernet"])
def test_an_override_that_is_not_a_string_is_one_line_from_the_entry_points(entry, tmp_path, monkeypatch):
    """Through ``mp.train`` the ConfigError above turned into an AttributeError ('int' object
    has no attribute 'startswith'): the multi-process stop read every override as a string."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="override 5 must be a string section.key=value, got int"):
        getattr(mp, entry)(None, None, None, "train.steps=1", 5)
    assert list(tmp_path.iterdir()) == []


def test_a_step_model_the_run_would_ignore_or_could_not_call_is_one_line(tmp_path, monkeypatch):
    """``step_model=`` without the online tuner was ignored; one without ``step_time`` was
    accepted and failed mid-run (AttributeError: no attribute 'observe')."""
    monkeypatch.chdir(tmp_path)
    tiny = ["model.n_layers=1", "model.d_model=16", "model.n_heads=2", "model.seq_len=8", "train.steps=1",
            "data.source=synthetic", "train.progress=false"]
    with pytest.raises(ConfigError, match=r"^step_model= is read only by the online tuner.*enabled=true"):
        mp.train(None, None, None, *tiny, step_model=object())
    with pytest.raises(ConfigError, match=r"^step_model object has no method step_time\(\)"):
        mp.train(None, None, None, *tiny, "tuner.enabled=true", step_model=object())
    assert list(tmp_path.iterdir()) == []


def test_a_data_path_selects_its_source(tmp_path):
    assert mp.load_config(None, ["data.path=corpus.txt"]).data.source == "text"
    assert mp.load_config(None, ["data.path=ids.npy"]).data.source == "tokens"
    assert mp.load_config(None, ["data.path=ids.bin", "data.token_dtype=uint32"]).data.source == "tokens"
    assert mp.Config().replace("data.path=a.txt").replace("data.path=b.npy").data.source == "tokens"
    # A chosen source stays (and is read as such); a full config file's default "stdlib" is no choice.
    assert mp.load_config(None, ["data.source=text", "data.path=ids.npy"]).data.source == "text"
    full = tmp_path / "full.toml"
    full.write_text('[data]\nsource = "stdlib"\npath = "ids.npy"\n')
    assert mp.load_config(full).data.source == "tokens"
    assert mp.load_config(full, ["data.path=more.txt"]).data.source == "text"
    # Every key at its default value is no mistake, whatever the other settings.
    assert mp.load_config(None, ["parallel.schedule=1f1b", "tuner.every=50", "model.top_k=2",
                                 "data.seed=0", "train.virtual_shards=8"]) == mp.Config()
