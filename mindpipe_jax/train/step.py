"""Pure step functions: ``(state, batch) -> (state, metrics)`` and the eval loss.

Built once per run and jitted once by the loop with explicit shardings and a
donated state. Two ways to compute the gradient:

* default — the batch is split over ``data`` × ``fsdp`` and XLA reduces the
  gradient (fast; bits depend on the device count, ~1e-7 relative);
* deterministic — the global batch is cut into a fixed number of virtual shards,
  each shard's gradient computed with ``lax.map`` (whose per-shard program does
  not depend on how many shards a device holds), and the shard gradients summed
  in one fixed pairwise tree. Each device reduces a contiguous, power-of-two run
  of shards (a subtree), then the partial sums are all-gathered and the top of
  the same tree is summed. The association is identical on 1, 2, 4 or 8
  devices, so the parameters are bitwise identical too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from mindpipe_jax.config import Config
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.train.state import ModelSpec, lr_schedule

BATCH_AXES = ("data", "fsdp")


def model_loss(spec: ModelSpec, params, batch, key):
    """Mean loss of the model on a batch: ``model.loss`` if it has one, else token CE."""
    model = spec.merge(params)
    if spec.has_loss:
        kwargs = {"dropout_key": key} if spec.loss_takes_key else {}
        return model.loss(batch["inputs"], batch["targets"], **kwargs)
    logits = model(batch["inputs"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def _to_compute(spec: ModelSpec, params):
    # Storage → compute layout: all-gathers FSDP shards once per step, not per use.
    return jax.tree.map(jax.lax.with_sharding_constraint, params, spec.compute)


def _accumulated_grad(spec: ModelSpec, params, batch, key, accum: int):
    """Loss and gradient averaged over ``accum`` sequential microbatches (fp32 sum)."""
    grad_fn = jax.value_and_grad(lambda p, b, k: model_loss(spec, p, b, k))
    if accum == 1:
        return grad_fn(params, batch, key)

    def split(x):
        # Row k·accum + j goes to microbatch j: each device keeps its own rows.
        x = x.reshape(x.shape[0] // accum, accum, *x.shape[1:])
        return jnp.swapaxes(x, 0, 1)

    micro = jax.tree.map(split, batch)
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)

    def body(carry, xs):
        loss_sum, grad_sum = carry
        mb, j = xs
        loss, grads = grad_fn(params, mb, jax.random.fold_in(key, j))
        grad_sum = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grad_sum, grads)
        return (loss_sum + loss, grad_sum), None

    (loss, grads), _ = lax.scan(body, (jnp.zeros((), jnp.float32), zeros), (micro, jnp.arange(accum)))
    return loss / accum, jax.tree.map(lambda g, p: (g / accum).astype(p.dtype), grads, params)


def _pairwise_sum(stacked):
    """Sum a leading axis of power-of-two length as a fixed balanced tree."""
    n = jax.tree.leaves(stacked)[0].shape[0]
    while n > 1:
        stacked = jax.tree.map(lambda x: x[0::2] + x[1::2], stacked)
        n //= 2
    return jax.tree.map(lambda x: x[0], stacked)


def _deterministic_grad(spec: ModelSpec, params, batch, key, mesh, shards: int):
    grad_fn = jax.value_and_grad(lambda p, b, k: model_loss(spec, p, b, k))
    n_dev = mesh.shape["data"] * mesh.shape["fsdp"]

    def per_device(p, local, base_key):
        # Per-device gradients, not the psum shard_map would add for invariant params.
        p = jax.tree.map(lambda x: lax.pcast(x, BATCH_AXES, to="varying"), p)
        first = lax.axis_index(BATCH_AXES) * (shards // n_dev)
        idx = first + jnp.arange(shards // n_dev)
        losses, grads = lax.map(
            lambda xs: grad_fn(p, xs[0], jax.random.fold_in(base_key, xs[1])), (local, idx))
        partial = _pairwise_sum((losses, grads))
        gathered = jax.tree.map(
            lambda x: lax.all_gather(x, BATCH_AXES, tiled=False, to="invarying"), partial)
        loss, total = _pairwise_sum(gathered)
        return loss / shards, jax.tree.map(lambda g: g / shards, total)

    vbatch = jax.tree.map(lambda x: x.reshape(shards, x.shape[0] // shards, *x.shape[1:]), batch)
    fn = jax.shard_map(per_device, mesh=mesh, axis_names=set(BATCH_AXES),
                       in_specs=(P(), P(BATCH_AXES), P()), out_specs=(P(), P()))
    return fn(params, vbatch, key)


def check_step_config(cfg: Config, mesh) -> None:
    """Batch divisibility for the mesh; deterministic-mode requirements."""
    tr = cfg.train
    n_batch = mesh.shape["data"] * mesh.shape["fsdp"]
    stages = mesh.shape["pipe"] * cfg.parallel.virtual_stages
    if cfg.model.n_layers % stages:
        raise ConfigError(
            f"model.n_layers={cfg.model.n_layers} must be divisible by parallel.pipe x "
            f"parallel.virtual_stages = {mesh.shape['pipe']} x {cfg.parallel.virtual_stages} = {stages}")
    unused = {a: mesh.shape[a] for a in ("pipe", "subnet", "expert") if mesh.shape[a] > 1}
    if unused:
        # Refuse rather than silently replicate the work over axes the step ignores.
        raise ConfigError(
            f"parallel {', '.join(f'{a}={n}' for a, n in unused.items())}: the dense train step "
            f"does not use these axes yet (pipeline, supernet and expert parallelism are not "
            f"built); set them to 1")
    micro = tr.grad_accum * cfg.parallel.microbatches
    if tr.global_batch % (n_batch * micro):
        raise ConfigError(
            f"train.global_batch={tr.global_batch} must be divisible by data x fsdp x grad_accum x "
            f"microbatches = {mesh.shape['data']} x {mesh.shape['fsdp']} x {tr.grad_accum} x "
            f"{cfg.parallel.microbatches} = {n_batch * micro}")
    if tr.deterministic:
        if tr.global_batch % tr.virtual_shards or tr.virtual_shards % n_batch:
            raise ConfigError(
                f"deterministic mode needs train.global_batch={tr.global_batch} divisible by "
                f"train.virtual_shards={tr.virtual_shards}, and virtual_shards divisible by "
                f"data x fsdp = {n_batch}")
        if n_batch & (n_batch - 1):
            raise ConfigError(f"deterministic mode needs data x fsdp = {n_batch} to be a power of two")
        others = {a: mesh.shape[a] for a in ("tensor", "pipe", "subnet", "expert") if mesh.shape[a] > 1}
        if others:
            raise ConfigError(f"deterministic mode splits only the batch (data, fsdp); got "
                              f"{', '.join(f'{a}={n}' for a, n in others.items())}; set them to 1")
        if tr.grad_accum != 1:
            raise ConfigError(f"deterministic mode already accumulates over train.virtual_shards; "
                              f"set train.grad_accum=1 (got {tr.grad_accum})")


def make_train_step(spec: ModelSpec, tx, cfg: Config, mesh, total_steps: int):
    schedule = lr_schedule(cfg.optim, total_steps)
    tr = cfg.train

    def train_step(state, batch):
        key = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"])
        params = _to_compute(spec, state["params"])
        if tr.deterministic:
            loss, grads = _deterministic_grad(spec, params, batch, key, mesh, tr.virtual_shards)
        else:
            loss, grads = _accumulated_grad(spec, params, batch, key, tr.grad_accum)
        # Back to storage layout: a reduce-scatter for FSDP instead of a full all-reduce.
        grads = jax.tree.map(jax.lax.with_sharding_constraint, grads, spec.storage)
        grad_norm = optax.global_norm(grads)
        updates, opt = tx.update(grads, state["opt"], state["params"])
        new_state = {"step": state["step"] + 1, "params": optax.apply_updates(state["params"], updates),
                     "opt": opt, "rng": state["rng"]}
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(state["step"])}
        return new_state, metrics

    return train_step


def make_eval_step(spec: ModelSpec):
    def eval_step(params, batch):
        return model_loss(spec, _to_compute(spec, params), batch, None)

    return eval_step
