"""SPara through the pipeline: the subnets of a step on a ``pipe`` axis (the fourth dimension
composed with the other three).

How a subnet goes through the stages
------------------------------------
The vPipe runtime (``parallel/pipeline/runtime``) runs a model of three parts: embed,
a stack of blocks split over the stages, head. A supernet block also needs to know the
subnet: whether it runs, which FFN candidate, what width, how many heads
(``SuperGPT.stage_conditions``: ``float32[layers, 4]``). Those numbers enter the
runtime as per-microbatch block inputs (``pipeline_grads(block_context=...)``): each
stage holds its own blocks' rows for every microbatch, and a task's layers read the
rows of its microbatch beside their weights, under every schedule (1F1B, interleaved,
the zero-bubble ones with their equation-level B/W split), with remat, ``tensor`` and
``data`` as the runtime does them. No gradient is formed for them.

Each subnet's batch is cut into ``parallel.microbatches`` = m microbatches. A pipeline
pass carries n subnets as n·m microbatches, subnet after subnet, with the runtime's
*gradient groups*: each subnet's gradient (the mean over its own m microbatches,
averaged over the batch axes) is kept apart, so it is clipped on its own norm before
the lazy AdamW of ``optimizer.py`` uses it.

Semantics
---------
``sequential``
    Subnet k+1 reads the weights subnet k's update left, on every stage: its forward
    on a stage waits for that update, and the update waits for subnet k's norm, which
    needs its whole backward. Every subnet reads the shared weights (embedding,
    attention, norms, head), so no two subnets overlap: a pass is one subnet (n = 1),
    its m microbatches fill the pipeline and it drains between subnets (a bubble of
    (p-1)/(m+p-1) of each subnet's time, for p stages; NASPipe overlaps subnets only
    where they share no layer, which a supernet with shared attention never allows).
    ``parallel.subnet`` must be 1.
``sync``
    All K subnets read the step's weights, so they are the pipeline's microbatches
    (NASPipe's design): one pass per step, in which each of the S = ``parallel.subnet``
    device groups sends its K/S subnets through its own pipeline (n = K/S; the groups'
    pipelines are a vmapped axis split over ``subnet``). The bubble is
    (p-1)/(n·m+p-1) of the step; the price is n gradient accumulators per device, and
    the gradients are synced over the batch axes after the last tick in fp32 (no
    chunk-wise ring: refused in one line). The clipped gradients are summed in subnet
    order, one update from their mean.
``operator-causal`` is not offered here (its waves have varying sizes; the masked and
sliced steps run it).

Subnets run masked here (every block computes at the supernet's size);
``pipelined_sliced.py`` builds on this class to run each pass at its subnets' width
and heads (the default where the supernet offers it). Parameters are stored as the rules table says
(blocks split over ``pipe`` by their ``layers`` axis, ``embed``-named dimensions over
``fsdp``); with ``fsdp`` they enter the pipeline as stored, each stage gathers its
weights once per step and the gradients leave reduce-scattered over ``fsdp`` (the
runtime's ``param_specs``), except in deterministic mode (below). Between steps the
AdamW moments are raveled vectors split over (subnet, pipe, fsdp, data)
(``layout.moment_axes``: the same state as the other SPara steps, so a checkpoint
restores onto any of them);
during a step they are unraveled into the parameters' tree and layout once, and the
lazy AdamW updates run leaf by leaf on each device's own shards (``adamw_tree``: the
raveled update's formula).

Bits
----
With ``train.deterministic=true`` the parameters are bitwise the same on any number of
batch devices (``fsdp`` x ``data``) for a given pipeline (stages, schedule): each
device's microbatches are its contiguous virtual shards of every subnet's batch
(``parallel.microbatches`` x fsdp x data = ``train.virtual_shards``), and the runtime
sums them in one balanced tree over the shards' global order
(``pipeline_grads(deterministic=True)``); everything after it (norms, clipping, the
subnet-order mean, AdamW) is elementwise or a reduction whose program does not
depend on the batch devices (the norms are taken over gradients whole over fsdp).
Changing the number of stages changes which layers one stage's program fuses, and
``subnet`` > 1 runs its groups' pipelines vmapped (batched matmuls): both change the
last bits. Without it, the sums over microbatches
and data devices are the runtime's (``psum``), as in any pipelined step.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mindpipe_jax.config import OptimConfig, ParallelConfig
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.parallel.pipeline import get_schedule
from mindpipe_jax.parallel.pipeline.runtime import StageFns, pipeline_grads
from mindpipe_jax.supernet.layout import compute_shardings, param_shardings, state_shardings
from mindpipe_jax.supernet.optimizer import adamw_tree, clip
from mindpipe_jax.supernet.plan import DATA_AXES, check_axes, check_semantics, data_devices, step_waves
from mindpipe_jax.supernet.spec import SupernetSpec
from mindpipe_jax.train.state import lr_schedule
from mindpipe_jax.train.step import check_deterministic_pipeline, unit_microbatches

__all__ = ["PIPELINE_SEMANTICS", "PipelinedPlan", "PipelinedStep", "check_pipelined", "stage_fns",
           "supports_pipeline"]

PIPELINE_SEMANTICS = ("sync", "sequential")
PIPELINE_MEMBERS = ("embed", "blocks", "head", "stage_conditions(subnet)",
                    "conditioned_block(block, h, condition)", "head_loss(head, h, targets)")
PARTS = ("blocks", "embed", "head")  # the parameters' top level, in tree (sorted) order


def supports_pipeline(module) -> bool:
    """Whether a supernet module can run through the pipeline (``SuperGPT`` can)."""
    return all(hasattr(module, m.split("(")[0]) for m in PIPELINE_MEMBERS)


def stage_fns(spec: SupernetSpec) -> StageFns:
    """The pipeline contract's three functions for a supernet; a block's parameters are
    ``{"weights": its weights, "condition": its row of stage_conditions}``."""
    module = spec.module
    embed_def, blocks_def, head_def = (nnx.graphdef(getattr(module, a)) for a in ("embed", "blocks", "head"))

    def layer(p, h):
        # The row is data, not a weight: no gradient flows into it.
        block = nnx.merge(blocks_def, p["weights"])
        return module.conditioned_block(block, h, lax.stop_gradient(p["condition"]))

    return StageFns(embed=lambda p, tokens: nnx.merge(embed_def, p)(tokens), layer=layer,
                    head_loss=lambda p, h, targets: module.head_loss(nnx.merge(head_def, p), h, targets))


def check_pipelined(spec: SupernetSpec | None, mesh, par: ParallelConfig, *, semantics: str,
                    subnets_per_step: int, vmap_width: int, global_batch: int, n_layers: int | None,
                    deterministic: bool = False, virtual_shards: int = 0) -> None:
    """What SPara through a pipeline supports; a ConfigError naming the value otherwise.
    ``n_layers``: the supernet's blocks (None: not known yet, a user's supernet before
    it is built; checked again with its spec)."""
    check_axes(mesh, "supernet training through a pipeline", pipe_ok=True)
    check_semantics(semantics)
    pipe, groups = mesh.shape["pipe"], mesh.shape["subnet"]
    if semantics not in PIPELINE_SEMANTICS:
        raise ConfigError(f"supernet.semantics={semantics!r} does not run through a pipeline (parallel.pipe="
                          f"{pipe}); use {' or '.join(PIPELINE_SEMANTICS)}, or parallel.pipe=1")
    if semantics == "sequential" and groups > 1:
        raise ConfigError(f"parallel.subnet={groups} with supernet.semantics='sequential' through a "
                          f"pipeline: each subnet waits for the update before it, so subnet groups would "
                          f"idle; set parallel.subnet=1 (give the devices to data or pipe) or use "
                          f"semantics 'sync'")
    if vmap_width != 1:
        raise ConfigError(f"supernet.vmap_width={vmap_width} has no effect through a pipeline (a round holds "
                          f"parallel.subnet subnets); set supernet.vmap_width=1")
    if subnets_per_step % groups:
        raise ConfigError(f"supernet.subnets_per_step={subnets_per_step} must be divisible by "
                          f"parallel.subnet={groups}")
    if semantics == "sync" and subnets_per_step // groups > 1 and \
            (par.grad_sync_mode != "end" or par.grad_sync_dtype != "fp32"):
        raise ConfigError(f"parallel.grad_sync={par.grad_sync!r} / grad_sync_dtype={par.grad_sync_dtype!r} "
                          f"with supernet.semantics='sync' through a pipeline: each subnet's gradient is "
                          f"kept apart for its own clipping and synced after the last tick in fp32; set "
                          f"parallel.grad_sync='end' and grad_sync_dtype='fp32'")
    stages = pipe * par.virtual_stages
    if n_layers is not None and n_layers % stages:
        raise ConfigError(f"model.n_layers={n_layers} must be divisible by parallel.pipe x "
                          f"parallel.virtual_stages = {pipe} x {par.virtual_stages} = {stages}")
    rows = par.microbatches * data_devices(mesh)
    if global_batch % rows:
        raise ConfigError(f"train.global_batch={global_batch} must be divisible by parallel.microbatches x "
                          f"fsdp x data = {par.microbatches} x {data_devices(mesh)} = {rows}")
    if deterministic:
        check_deterministic_pipeline(par, virtual_shards, data_devices(mesh), mesh.shape["fsdp"])
    if par.stage_layers or par.repartition_after:
        raise ConfigError("parallel.stage_layers / repartition_after are for `mindpipe train`; a supernet's "
                          "blocks are split evenly over the stages: leave them unset")
    if spec is not None and not supports_pipeline(spec.module):
        lacks = [m for m in PIPELINE_MEMBERS if not hasattr(spec.module, m.split("(")[0])]
        raise ConfigError(f"{type(spec.module).__name__} cannot run through a pipeline: it lacks "
                          f"{', '.join(lacks)} (SuperGPT has them); set parallel.pipe=1")


@dataclasses.dataclass(frozen=True)
class PipelinedPlan:
    """A step's subnets (``int32[K, genes]``), their waves and the units any of them reads."""

    subnets: np.ndarray
    waves: np.ndarray
    used: np.ndarray

    @property
    def num_waves(self) -> int:
        return int(self.waves.max()) + 1


class PipelinedStep:
    """``step(state, plan, batch) -> (state, metrics)``: SPara with ``pipe`` > 1.

    The same state (``layout.state_shardings``), batch (split over ``DATA_AXES``) and
    metrics (per-subnet ``loss`` and ``grad_norm``, ``lr``) as the other SPara steps;
    ``plan`` is ``self.plan(subnets)``. One program, compiled on first call.
    ``keep_fsdp_sharded=False`` hands the pipeline whole weights even with fsdp (what
    deterministic mode does; the benchmark's baseline)."""

    def __init__(self, spec: SupernetSpec, mesh, par: ParallelConfig, *, semantics: str,
                 subnets_per_step: int, vmap_width: int, global_batch: int, optim: OptimConfig,
                 total_steps: int, deterministic: bool = False, virtual_shards: int = 0,
                 keep_fsdp_sharded: bool = True):
        n_layers = jax.tree.leaves(spec.abstract_params["blocks"])[0].shape[0]
        check_pipelined(spec, mesh, par, semantics=semantics, subnets_per_step=subnets_per_step,
                        vmap_width=vmap_width, global_batch=global_batch, n_layers=n_layers,
                        deterministic=deterministic, virtual_shards=virtual_shards)
        self.deterministic, self.n_layers = deterministic, n_layers
        if set(spec.abstract_params) != set(PARTS):
            raise ConfigError(f"a supernet through a pipeline has parameters {list(PARTS)} at its top level; "
                              f"{type(spec.module).__name__} has {sorted(spec.abstract_params)}")
        self.spec, self.mesh, self.semantics, self.k = spec, mesh, semantics, subnets_per_step
        # A pass carries one subnet (sequential) or a subnet group's K/S subnets, each
        # parallel.microbatches microbatches, its gradient kept apart (sync).
        self.per_pass = subnets_per_step // mesh.shape["subnet"] if semantics == "sync" else 1
        self._params_layout = param_shardings(mesh, spec)
        self._compute_layout = compute_shardings(mesh, spec)
        # Weights stored split over fsdp stay so going into the pipeline: gathered once per
        # step on their stage, gradients reduce-scattered back (the runtime's kept-sharded
        # path). Deterministic mode takes them whole: its gradients are then the same
        # replicated values on every split of the batch devices, and so are the norms.
        specs = None
        if mesh.shape["fsdp"] > 1 and not deterministic and keep_fsdp_sharded:
            layout = self._params_layout
            specs = {"embed": layout["embed"], "blocks": {"weights": layout["blocks"]},
                     "head": layout["head"]}
        self.par, self._param_specs, self._runs = par, specs, {}
        self.microbatches = par.microbatches
        self.optim, self.lr = optim, lr_schedule(optim, total_steps)
        shardings = state_shardings(mesh, spec)
        rows = NamedSharding(mesh, P(DATA_AXES))
        rep = NamedSharding(mesh, P())
        self._compiled = None
        self._step = jax.jit(self._step_fn, in_shardings=(shardings, rep, rows),
                             out_shardings=(shardings, rep), donate_argnums=(0,))

    def plan(self, subnets) -> PipelinedPlan:
        subnets = self.spec.space.validate(subnets)
        units = self.spec.units(subnets)
        waves = step_waves(self.semantics, units, self.spec.shares_weights)
        return PipelinedPlan(np.asarray(subnets, np.int32), waves, units.any(0))

    def __call__(self, state, plan: PipelinedPlan, batch):
        """One step. ``state`` is consumed (its buffers are donated)."""
        with jax.set_mesh(self.mesh):
            return (self._compiled or self._step)(state, jnp.asarray(plan.subnets), batch)

    def lower(self, state, plan: PipelinedPlan, batch):
        """The step lowered for these (possibly abstract) arguments."""
        with jax.set_mesh(self.mesh):
            return self._step.lower(state, jnp.asarray(plan.subnets), batch)

    def compile(self, state, plan: PipelinedPlan, batch):
        """Compile ahead of time (later calls run that program: step times are step times);
        returns the compiled program."""
        self._compiled = self.lower(state, plan, batch).compile()
        return self._compiled

    # --- the program ---------------------------------------------------------------------------

    def _run_for(self, n: int, depth: int | None = None):
        """The runtime for a pass of ``n`` subnets (n·m microbatches, n gradient groups)
        running the first ``depth`` blocks (None: all)."""
        if depth is not None and depth >= self.n_layers:
            depth = None
        if (n, depth) not in self._runs:
            par = self.par
            schedule = get_schedule(par.schedule, self.mesh.shape["pipe"], n * par.microbatches,
                                    par.virtual_stages, par.split_last)
            self._runs[n, depth] = pipeline_grads(
                stage_fns(self.spec), schedule, self.mesh, remat=par.stage_remat, active_layers=depth,
                param_specs=self._param_specs, grad_sync=par.grad_sync_mode,
                sync_bucket_bytes=int(par.sync_bucket_mb * 2**20) or None,
                grad_sync_dtype=par.grad_sync_dtype, fuse_mode=par.fuse_ticks, gradient_groups=n,
                deterministic=self.deterministic)
        return self._runs[n, depth]

    def _grads(self, params, conditions, micro, depth: int | None = None):
        """A pass of ``conditions`` (``[n, layers, C]``: n subnets' rows) through the
        pipeline, each subnet on the whole batch as ``microbatches`` microbatches (the
        subnets one after another in the pass): per subnet its mean loss and norm (``[n]``)
        and its clipped gradient (a leading ``[n]`` on every leaf), in the parameters' tree
        (raveled only for the update: a concatenation of leaves split over different axes
        costs a gather). ``depth``: only the first blocks run (every subnet's depth <= it;
        None: all, past a subnet's depth masked)."""
        n, m = conditions.shape[0], self.microbatches
        rows = {"condition": jnp.repeat(jnp.swapaxes(conditions, 0, 1), m, axis=1)}  # [layers, n·m, C]
        tokens = jax.tree.map(lambda x: jnp.tile(x, (n,) + (1,) * (x.ndim - 1)), micro)
        loss, g = self._run_for(n, depth)(params["embed"], {"weights": params["blocks"]}, params["head"],
                                   tokens["inputs"], tokens["targets"], rows)
        g = {"blocks": g["blocks"]["weights"], "embed": g["embed"], "head": g["head"]}
        if n == 1:  # one gradient group: the runtime's plain (unbatched) results
            loss, g = loss[None], jax.tree.map(lambda x: x[None], g)
        if self.deterministic:
            # Norms of gradients whole over fsdp (as the rules compute in), never of fsdp
            # shards: partial sums over 4 shards rounded otherwise than over 2 (measured).
            g = jax.tree.map(lambda x, s: lax.with_sharding_constraint(
                x, NamedSharding(self.mesh, P(None, *s.spec))), g, self._compute_layout)
        norms = jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32)), axis=tuple(range(1, x.ndim)))
                             for x in jax.tree.leaves(g)))
        return loss, norms, clip(g, norms, self.optim.clip_norm)

    def _placed(self, tree):
        """``tree`` (shaped like the parameters) in the parameters' stored layout."""
        return jax.tree.map(lambda x, s: lax.with_sharding_constraint(x, s), tree, self._params_layout)

    def _micro(self, batch):
        """The batch as ``[m, rows/m, ...]`` microbatches."""
        m = self.microbatches
        if self.deterministic:  # device d's microbatch j: virtual shard d·m + j of the batch
            return unit_microbatches(batch, m, data_devices(self.mesh))
        # Row b goes to microbatch b mod m: a device's rows stay on it (a reshape to
        # [m, B/m] would move the split from the rows to the microbatch axis).
        return jax.tree.map(lambda x: jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1), batch)

    def _unraveled_moments(self, opt):
        """The moments in the parameters' tree and layout for the step (each stage updates
        its own blocks with no communication), raveled again at its end."""
        return {name: self._placed(self.spec.unravel(opt[name], jnp.float32)) for name in ("mu", "nu")}

    def _update(self, lr, params, grads, moments, count, used):
        """Lazy AdamW on each device's own shards; the results in the stored layout."""
        params, moments, count = adamw_tree(self.spec, params, grads, moments, count, used, True, lr,
                                            self.optim)
        return self._placed(params), {n: self._placed(t) for n, t in moments.items()}, count

    def _step_fn(self, state, subnets, batch):
        module, k = self.spec.module, self.k
        lr = self.lr(state["step"])
        micro = self._micro(batch)
        conditions = jax.vmap(module.stage_conditions)(subnets)  # [K, layers, C]
        units = jax.vmap(module.units)(subnets)  # [K, *unit_grid]
        spec, params = self.spec, state["params"]
        moments = self._unraveled_moments(state["opt"])
        count = state["opt"]["count"]
        update = partial(self._update, lr)

        if self.semantics == "sync":
            # One pass: each subnet group's K/S subnets are its pipeline's microbatches
            # (the groups' pipelines are a vmapped axis split over subnet).
            groups = self.mesh.shape["subnet"]
            by_group = conditions.reshape(groups, k // groups, *conditions.shape[1:])
            by_group = lax.with_sharding_constraint(by_group, NamedSharding(self.mesh, P("subnet")))
            losses, norms, grads = jax.vmap(partial(self._grads, params, micro=micro))(by_group)
            grads = jax.tree.map(lambda x: x.reshape(k, *x.shape[2:]), grads)  # subnet order
            total = self._placed(jax.tree.map(lambda x: x[0].astype(jnp.float32), grads))
            for i in range(1, k):  # summed in subnet order
                total = jax.tree.map(lambda t, g, i=i: t + g[i].astype(jnp.float32), total, grads)
            mean = jax.tree.map(lambda t: t / k, total)
            params, moments, count = update(params, mean, moments, count, units.any(0))
        else:
            def one_subnet(carry, xs):
                # The carry in the parameters' layout at the body's start too: with the
                # constraints at its end only, XLA carried parts of it split over data and
                # gathered them back every subnet (measured: 26.3 -> 18.5 MB a step on
                # pipe2 x data4 with this).
                params, moments, count = carry
                params = self._placed(params)
                moments = {n: self._placed(t) for n, t in moments.items()}
                condition, used = xs
                loss, norm, grads = self._grads(params, condition[None], micro)
                return update(params, jax.tree.map(lambda x: x[0], grads), moments, count, used), (loss, norm)

            (params, moments, count), (losses, norms) = lax.scan(one_subnet, (params, moments, count),
                                                                 (conditions, units))
        opt = {"mu": spec.ravel(moments["mu"]), "nu": spec.ravel(moments["nu"]), "count": count}
        metrics = {"loss": losses.reshape(k), "grad_norm": norms.reshape(k), "lr": lr}
        return {"step": state["step"] + 1, "params": params, "opt": opt}, metrics
