"""What a run builds from its config's mesh and batch, and how to rebuild it mid-run.

``build_layout`` turns a config into the mesh, the model's shardings, the
optimizer (with the tuner's learning-rate gain) and the state's shardings;
``make_feed`` into the loader and evaluation batches for that mesh and batch.
``switch`` moves a running job to another candidate (tuner/space.py): a new
global batch, microbatch count or mesh shape. Parameters and optimizer state are
copied onto the new shardings with ``jax.device_put`` (bit for bit: only their
placement changes), the step is rebuilt and compiled, and the loader continues
where the samples seen so far put it.

The loader's state is the index of the next global batch. After ``k`` batches of
``B`` rows, ``k·B`` samples were seen; a batch of ``B'`` continues at batch
``floor(k·B / B')``, whose records start at or before sample ``k·B``: up to
``B' - 1`` samples of the current epoch are seen twice, none is skipped. (Each
batch size drops a different remainder at the end of an epoch, so in later
epochs the position is the same to within one such remainder.)
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mindpipe_jax.config import Config
from mindpipe_jax.data import Loader, TokenSplits, eval_batches
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.parallel.cpu_guard import lower_checked, platform_of
from mindpipe_jax.parallel.mesh import make_mesh
from mindpipe_jax.train.pipeline_storage import split_ends_over_pipe
from mindpipe_jax.train.state import abstract_train_state, make_optimizer, model_spec, state_shardings_for
from mindpipe_jax.train.step import BATCH_AXES, check_step_config, make_eval_step, make_train_step
from mindpipe_jax.train.step_checks import check_model_outputs, check_user_model_keys


def row_block(sharding: NamedSharding, global_batch: int) -> tuple[int, int]:
    """(block, blocks): this process feeds rows ``[block*B/blocks, (block+1)*B/blocks)``
    of every global batch.

    Read off the batch sharding, not the process count: with ``pipe`` spanning the
    processes, each of them holds every batch row (on its own stage's devices).
    """
    rows: dict[int, set[tuple[int, int]]] = {}
    for device, index in sharding.devices_indices_map((global_batch, 1)).items():
        start, stop, _ = index[0].indices(global_batch)
        rows.setdefault(device.process_index, set()).add((start, stop))
    spans = {}
    for process, ranges in rows.items():
        ordered = sorted(ranges)
        if any(a[1] != b[0] for a, b in itertools.pairwise(ordered)):
            raise ConfigError(f"the mesh gives process {process} batch rows that are not contiguous "
                              f"({ordered}); reorder the parallel axes")
        spans[process] = (ordered[0][0], ordered[-1][1])
    blocks = sorted(set(spans.values()))
    size = global_batch // len(blocks)
    if blocks != [(i * size, (i + 1) * size) for i in range(len(blocks))]:
        raise ConfigError(f"the mesh splits the batch rows unevenly over processes ({blocks})")
    return blocks.index(spans[jax.process_index()]), len(blocks)


class Batches:
    """Host batches → global arrays sharded over the batch axes (multi-host aware)."""

    def __init__(self, mesh, global_batch: int, seq_len: int):
        self.sharding = NamedSharding(mesh, P(BATCH_AXES))
        self.shape = (global_batch, seq_len)

    def __call__(self, host_batch: dict) -> dict:
        return {k: jax.make_array_from_process_local_data(self.sharding, np.asarray(v), self.shape)
                for k, v in host_batch.items()}

    def spec(self) -> dict:
        one = jax.ShapeDtypeStruct(self.shape, np.int32, sharding=self.sharding)
        return {"inputs": one, "targets": one}


def scale_updates(tx: optax.GradientTransformation, gain) -> optax.GradientTransformation:
    """``tx`` with its updates multiplied by ``gain``: a constant, or a function called
    when the update is traced (the tuned step's gain argument, ``Layout.compile``). With
    AdamW the update is lr x (Adam direction + weight decay x param), so this scales the
    learning rate, weight decay included. The optimizer state keeps exactly the same
    structure (nothing is added to it), so checkpoints do not depend on the gain."""
    if isinstance(gain, (int, float)) and gain == 1.0:
        return tx

    def update(grads, opt_state, params=None):
        updates, opt_state = tx.update(grads, opt_state, params)
        g = gain() if callable(gain) else gain
        return jax.tree.map(lambda u: u * g, updates), opt_state

    return optax.GradientTransformation(tx.init, update)


class GainedStep:
    """A tuned run's compiled step, ``(state, batch) -> (state, metrics)``: the program
    takes the learning-rate gain as a third argument, read from its layout at each call,
    so a layout switched away from and back to under another gain runs the same program."""

    def __init__(self, compiled, layout: Layout):
        self.compiled, self.layout = compiled, layout

    def __call__(self, state, batch):
        return self.compiled(state, batch, self.layout.gain_array)


@dataclasses.dataclass
class Layout:
    """Everything that depends on the mesh and the batch. ``lr_gain``: the learning-rate
    gain of a tuned run (an argument of its compiled step, ``set_gain``), None for a run
    without the tuner (its step is exactly the default one)."""

    cfg: Config
    mesh: Any
    spec: Any  # ModelSpec
    create: Callable[[], Any] | None  # the model's initial params
    tx: optax.GradientTransformation  # the optimizer without the gain (the state's structure)
    shardings: Any
    abstract_state: Any
    batches: Batches
    lr_gain: float | None = None
    # What ``compile`` and ``eval_fn`` built, kept for a switch back to this layout
    # (``dataclasses.replace``, e.g. another stage split, starts without them).
    _step: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)
    _compiled: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)
    _eval: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)
    gain_array: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.lr_gain is not None:
            self.set_gain(self.lr_gain)

    def set_gain(self, gain: float) -> None:
        """The learning-rate gain the compiled step applies from its next call."""
        self.lr_gain = float(gain)
        # Built from the host value on every process (the mesh may span several; every
        # process applies process 0's decision, so the value is the same on each).
        value = np.float32(gain)
        self.gain_array = jax.make_array_from_callback((), NamedSharding(self.mesh, P()), lambda _: value)

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.train.global_batch * self.cfg.model.seq_len

    def make_step(self, cfg: Config | None = None, tx=None):
        """The train step (not jitted); the layout's own (no ``cfg``, no ``tx``) is built once."""
        if cfg is None and tx is None:
            if self._step is None:
                self._step = make_train_step(self.spec, self.tx, self.cfg, self.mesh, self.cfg.train.steps)
            return self._step
        cfg = cfg or self.cfg
        return make_train_step(self.spec, tx or self.tx, cfg, self.mesh, cfg.train.steps)

    def compile(self, cfg: Config | None = None, step=None):
        """(ahead-of-time compiled step, seconds it took); ``cfg`` changes what only the
        step sees (a pipeline's stage split), never the mesh or the batch; ``step``: another
        step function for this layout (untuned only: a tuned layout builds its step around
        the gain argument). The layout's own step (neither given) is compiled once: asked
        again, it returns that program and 0 seconds."""
        own = cfg is None and step is None
        if own and self._compiled is not None:
            return self._compiled, 0.0
        if step is not None and self.lr_gain is not None:
            raise ValueError("a tuned layout compiles its own step around the gain: pass no step")
        t0 = time.perf_counter()
        rep = NamedSharding(self.mesh, P())
        if self.lr_gain is None:
            fn = jax.jit(step or self.make_step(cfg), in_shardings=(self.shardings, self.batches.sharding),
                         out_shardings=(self.shardings, None), donate_argnums=0)
            args = (self.abstract_state, self.batches.spec())
        else:
            # The step is built here, outside any trace (a pipeline's sets its mesh); its
            # optimizer reads the gain argument of the call being traced.
            traced = []
            step = self.make_step(cfg, scale_updates(self.tx, lambda: traced[-1]))

            def gained(state, batch, gain):
                traced.append(gain)
                try:
                    return step(state, batch)
                finally:
                    traced.pop()

            fn = jax.jit(gained, in_shardings=(self.shardings, self.batches.sharding, rep),
                         out_shardings=(self.shardings, None), donate_argnums=0)
            gain = jax.ShapeDtypeStruct((), np.float32, sharding=rep)
            args = (self.abstract_state, self.batches.spec(), gain)
        with jax.set_mesh(self.mesh):  # the model's activation constraints read it
            compiled = lower_checked(fn, *args, platform=platform_of(self.mesh)).compile()
        if self.lr_gain is not None:
            compiled = GainedStep(compiled, self)
        if own:
            self._compiled = compiled
        return compiled, time.perf_counter() - t0

    def eval_fn(self, feed: Feed):
        shardings = (self.spec.storage, feed.val_to_device.sharding)
        if self._eval is None or self._eval[0] != shardings:
            self._eval = (shardings, jax.jit(make_eval_step(self.spec), in_shardings=shardings))
        return self._eval[1]


def build_layout(cfg: Config, factory_for: Callable[[Config], Any], lr_gain: float | None = None) -> Layout:
    """Mesh → model spec → optimizer → state shardings for ``cfg`` (nothing allocated).
    ``factory_for(cfg)`` is the model (or its factory) the config describes; ``lr_gain``
    a tuned run's learning-rate gain (None: no tuner, the default step)."""
    mesh = make_mesh(cfg.parallel)
    check_step_config(cfg, mesh)
    with jax.set_mesh(None):  # abstract shapes keep logical names; an ambient mesh would bind them
        example = np.zeros((1, cfg.model.seq_len), np.int32)  # what initialises a Linen model
        try:
            spec, create = model_spec(factory_for(cfg), mesh, cfg.train.seed, example)
        except ConfigError as err:
            auto_tensor = cfg.parallel.tensor == 0 and mesh.shape["tensor"] > 1
            if auto_tensor and "not divisible by mesh axes" in str(err):
                # The user asked for no tensor split: say where it came from and how to avoid it.
                raise ConfigError(f"{err}; parallel.tensor=0 (auto) chose tensor={mesh.shape['tensor']} on "
                                  f"these devices: set parallel.tensor=1 to keep the model whole") from None
            raise
        check_user_model_keys(cfg.model, spec)
        spec = split_ends_over_pipe(spec, cfg.model.seq_len, mesh)
        check_model_outputs(spec, cfg.model.seq_len, cfg.model.vocab_size, mesh)
    tx = make_optimizer(cfg.optim, cfg.train.steps, spec.decay_mask)
    shardings = state_shardings_for(spec, tx, mesh)
    return Layout(cfg, mesh, spec, create, tx, shardings, abstract_train_state(spec, tx, mesh, shardings),
                  Batches(mesh, cfg.train.global_batch, cfg.model.seq_len), lr_gain)


@dataclasses.dataclass
class Feed:
    """The training batches and the fixed evaluation batches of one layout."""

    loader: Loader
    val: list
    val_to_device: Batches

    def close(self) -> None:
        self.loader.close()


def make_feed(splits: TokenSplits, layout: Layout, *, val_rows: int = 0, position: int = 0) -> Feed:
    """Loader at global batch ``position``; evaluation batches of ``val_rows`` rows
    (0 or a size the mesh cannot split: the training batch), so evaluations before
    and after a batch switch see the same rows."""
    cfg, mesh = layout.cfg, layout.mesh
    tr, seq = cfg.train, cfg.model.seq_len
    block, blocks = row_block(layout.batches.sharding, tr.global_batch)
    loader = Loader(splits.train, seq_len=seq, batch_size=tr.global_batch, seed=tr.seed,
                    process_index=block, process_count=blocks, name="train")
    if position:
        state = loader.get_state()
        loader.set_state({**state, "step": position})
    shards = math.prod(mesh.shape[a] for a in BATCH_AXES)
    val_rows = val_rows if val_rows and val_rows % shards == 0 else tr.global_batch
    val_to_device = Batches(mesh, val_rows, seq)
    vblock, vblocks = row_block(val_to_device.sharding, val_rows)
    val = (eval_batches(splits.val, seq_len=seq, batch_size=val_rows, num_batches=tr.eval_batches,
                        process_index=vblock, process_count=vblocks) if tr.eval_every > 0 else [])
    return Feed(loader, val, val_to_device)


def rebatched(data_state: dict, global_batch: int) -> dict:
    """A loader state saved at another global batch (a tuned run resumed on another device
    count, tuner/elastic.py) for batches of ``global_batch``: the samples seen, rounded
    down to whole batches, as ``switch`` continues a running job."""
    if data_state.get("global_batch") in (None, global_batch):
        return data_state
    seen = int(data_state["step"]) * int(data_state["global_batch"])
    return {**data_state, "global_batch": global_batch, "step": seen // global_batch}


def switch(state, layout: Layout, feed: Feed, cfg: Config, lr_gain: float, *,
           factory_for: Callable[[Config], Any], splits: TokenSplits, val_rows: int = 0,
           reuse: Layout | None = None):
    """Move a running job to ``cfg`` (another candidate's config) with ``lr_gain``.

    ``reuse``: the layout this run had for ``cfg`` before (its compiled step is kept:
    switching back compiles nothing). Returns (state on the new shardings, new layout,
    new feed); the old feed is closed. The caller compiles the new layout's step.
    """
    if reuse is not None:
        new = reuse
        new.set_gain(lr_gain)
    else:
        new = build_layout(cfg, factory_for, lr_gain)
    # Same devices, another placement: a copy of the same bytes (no arithmetic).
    moved = jax.device_put(state, new.shardings)
    seen = feed.loader.step * feed.loader.global_batch
    feed.close()
    return moved, new, make_feed(splits, new, val_rows=val_rows, position=seen // cfg.train.global_batch)
