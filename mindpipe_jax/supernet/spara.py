"""SPara: K subnets per step in one jitted program, bitwise equal on any device count.

The step
--------
A step trains K subnets (``int32[K, genes]``, from ``sampler.py``) on one global
batch. Mesh axes split the work: ``subnet`` (S device groups, each takes its
share of the K subnets) and ``fsdp`` × ``data`` (the D devices of a group split the
batch; ``plan.DATA_AXES``), manual in the step's ``shard_map``. The
work is cut into fixed **cells**: (subnet, virtual data shard), with
``train.virtual_shards`` = V shards of the batch. A device computes, per
*round*, ``vmap_width`` = W subnets (``jax.vmap``, parameters shared, not
batched) on each of its V/D shards (``lax.map``). Rounds hold R = S·W slots.

Every cell's gradient is summed in one fixed order, never by an all-reduce: a
balanced pairwise tree over the V shards whose lower levels are a device's own
contiguous shards and whose upper levels run over the data devices in order
(for power-of-two V and D that is the same tree on every mesh). One
``all_to_all`` gives each of the N = S·D devices every device's partial
gradient of every slot of the round for the 1/N of the raveled parameters it
owns, and it sums the data devices' partials in device order; per-subnet
norms are sums of 64 fixed chunks (``PARAM_CHUNKS``) in a fixed order; clipping,
the ``[K, P/N]`` buffer, the pairwise sum over the K subnets and AdamW run on that
1/N; the new parameters are all-gathered. Each cell is
computed by the same per-device program (the vmap width W and the shard shape
are fixed by the config, not by the mesh; ``vmap`` of a different width *does*
change the bits, measured), and every later operation is elementwise on the
same values or a fixed-shape reduction, so the parameters after N steps are
bitwise identical for every split of the devices between ``subnet`` and
``data``. The cost is memory: a device holds the unreduced gradients of its
cells, ``[V/D, W, P]``, before the exchange.

With ``fsdp`` and ``tensor``
----------------------------
``fsdp`` = F is a data-parallel axis whose devices also keep the stored
parameters split (``param_shardings``: the rules table's storage layout, ``embed``
over ``fsdp``). The step takes them whole, so they are all-gathered once per step
going in (MaxText's gather-once), and the new parameters leave whole and are cut
back to their shards (no communication); gradients already leave the exchange
split over every device and the AdamW moments are split over all N (ZeRO-1), so
between steps a device holds 1/F of the parameters and 1/N of the moments.
Subnet S × fsdp F × data D runs the program of S × (F·D) data devices: the same
bits.

``tensor`` = T is left to the compiler inside each device group: the
parameters enter split over ``tensor`` as stored (``mlp``, ``heads``, ``vocab``),
and the partitioner splits each subnet's matmuls Megatron-style from them. The
raveled gradient is whole on every tensor rank (raveling gathers the split
leaves), so each tensor rank repeats its group's exchange and optimizer chunk:
the optimizer's work and the gradient bytes are T× those of an exchange that
sends only what each rank owns (not done). For a fixed T the parameters are
the same bits on every split of the other devices; against T = 1 they differ
by the rounding of the split matmuls' partial sums.

Selecting a subnet never scatters: candidate weights are chosen by a one-hot
contraction and widths/depth by masks (``space.py``), so each candidate's
gradient is a dense array, exactly zero where the subnet did not read it.

Optimizer: lazy AdamW (``optimizer.py``): every parameter has AdamW moments, but a
Candidate parameter's unit is updated only where a subnet used it; each subnet's
gradient is clipped on its own before it is combined; a device updates only the
1/N of the raveled parameters it owns.

Three semantics
---------------
``sync``
    All K subnets read the weights of the step start. Gradients (each clipped)
    are averaged over the K subnets in a fixed pairwise order; one lazy AdamW
    update (units: those any subnet used).
    *Reference*: compute each subnet's gradient one by one, combine, update.

``sequential``
    Training the K subnets one after another, in sampling order: subnet k reads
    the weights the updates of subnets 0..k-1 left, and takes a full lazy AdamW
    step of its own (its clipped gradient) on every parameter it touches: the
    units it used and the shared weights. Every subnet reads the shared weights,
    so no two subnets of a step can run together: K waves of one subnet each
    (the data axis still splits each subnet's batch; subnet-axis devices without
    a subnet compute nothing). All K updates of a step use that step's learning
    rate.
    *Reference*: for k = 0..K-1: gradient of subnet k at the current weights,
    clip, update its units and the shared weights.

``operator-causal``
    Sequential for the **searchable** weights (operator candidates), averaged for
    the **shared** ones: subnet k's candidates include the updates of subnets
    0..k-1, while the shared weights are those of the step start for all K and
    take one update at the end of the step from the average of the K subnets'
    gradients (fixed pairwise order). (Called ``causal`` before; renamed because
    it is not one-after-another training of the whole subnet.)
    *Reference*: for k = 0..K-1: gradient of subnet k at the current weights,
    clip, apply a lazy AdamW update to the units it used (a full step with its
    own gradient), keep its shared gradient; then average the K shared
    gradients and update the shared weights.

    Executed in **waves** (``plan.py``): subnets of a wave use disjoint units, so
    computing them together at the wave's start weights and updating each unit
    from its one user equals the sequential loop. The unit gradients of a wave
    are summed over its slots: every element has at most one nonzero term, so
    that sum is exact in any order.

    Why the shared layers are averaged here: every subnet reads the embedding,
    attention, norms and head, so if they defined conflicts, every pair of
    subnets would conflict and the step would be ``sequential`` (NASPipe
    separates them for the same reason). Only the operator choices define
    conflicts; the shared weights follow the sync rule inside a step, and the
    steps themselves are sequential.

Modules
-------
``spec.py`` (the supernet as raveled vectors), ``plan.py`` (layout checks, rounds
and waves, on the host), ``optimizer.py`` (the fixed-order reduction and the lazy
AdamW); this module builds the step from them, holds the optimizer state's layout
and the sequential reference, and re-exports the names of the others (callers
import them from here).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mindpipe_jax.config import OptimConfig
from mindpipe_jax.parallel.mesh import manual_axis_names
from mindpipe_jax.supernet.layout import STATE_SPECS, param_shardings, state_shardings, tensor_split
from mindpipe_jax.supernet.optimizer import adamw, clip, global_norm, pairwise_sum, reduce_round
from mindpipe_jax.supernet.plan import (
    AXES,
    DATA_AXES,
    SEMANTICS,
    StepPlan,
    causal_waves,
    check_layout,
    check_semantics,
    data_devices,
    plan_step,
    sequential_waves,
    skips_padding,
    updates_shared_per_wave,
)
from mindpipe_jax.supernet.spec import PARAM_CHUNKS, SupernetSpec, supernet_spec
from mindpipe_jax.train.state import lr_schedule

__all__ = ["SEMANTICS", "AXES", "DATA_AXES", "PARAM_CHUNKS", "SupernetSpec", "supernet_spec", "init_state",
           "adamw", "global_norm", "clip", "pairwise_sum", "reduce_round", "StepPlan", "plan_step",
           "causal_waves", "sequential_waves", "check_layout", "make_spara_step", "state_shardings",
           "param_shardings", "jit_step", "reference_step"]


# --- the optimizer state --------------------------------------------------------------------------


def init_state(spec: SupernetSpec, params) -> dict:
    """``{"step", "params", "opt": {"mu", "nu", "count"}}``.

    ``mu``/``nu`` are ``float32[padded_size]`` over all parameters raveled in tree
    order (the step keeps them split over the devices); ``count`` is
    ``int32[U + 1]``: one AdamW step count per unit of the grid (raveled) and,
    last, the count of the shared parameters.
    """
    zeros = jnp.zeros((spec.padded_size,), jnp.float32)
    return {"step": jnp.zeros((), jnp.int32), "params": params,
            "opt": {"mu": zeros, "nu": jnp.zeros_like(zeros),
                    "count": jnp.zeros((spec.num_units + 1,), jnp.int32)}}


# --- the step -------------------------------------------------------------------------------------


def make_spara_step(spec: SupernetSpec, mesh, *, semantics: str, subnets_per_step: int,
                    vmap_width: int, virtual_shards: int, global_batch: int, optim: OptimConfig,
                    total_steps: int):
    """``step(state, plan_arrays, batch) -> (state, metrics)``, to be jitted once (``jit_step``).

    ``batch`` is ``{"inputs", "targets"}`` of ``int32[global_batch, T]`` (every
    subnet of the step trains on it); ``plan_arrays`` is ``StepPlan.arrays()``.
    Metrics: per-subnet ``loss`` and ``grad_norm`` (``[K]``), ``lr``.

    Per round, each device computes its W slots on its V/D shards, sums its shards
    (the lower levels of the fixed pairwise tree over V), and one ``all_to_all`` gives
    it, for the 1/N of the raveled parameters it owns (N devices), every device's
    partial gradient of every slot of the round; it sums the data devices' partials in
    device order (the upper levels of the tree). One ``all_gather`` brings the norms'
    chunk sums and the slots' losses. Norms, clipping, the K-buffer, the sums over
    subnets and AdamW then run on that 1/N only; the new parameters are all-gathered.
    """
    check_semantics(semantics)
    check_layout(mesh, subnets_per_step=subnets_per_step, vmap_width=vmap_width,
                 virtual_shards=virtual_shards, global_batch=global_batch)
    k, w, v = subnets_per_step, vmap_width, virtual_shards
    n_sub, n_data = mesh.shape["subnet"], data_devices(mesh)
    r_slots = n_sub * w
    chunk = spec.padded_size // (n_sub * n_data)  # this device's share of the raveled parameters
    schedule = lr_schedule(optim, total_steps)
    units_of = jax.vmap(spec.module.units)
    # W subnets on one shard; gradients kept in the parameters' tree until the shards are
    # summed (raveling concatenates tensor-split leaves: once per round, not per shard).
    slot_grads = jax.vmap(functools.partial(spec.loss_and_grad, ravel=False), in_axes=(None, 0, None))
    no_units = jnp.zeros(spec.unit_grid, bool)
    shared_per_wave = updates_shared_per_wave(semantics)
    skip = skips_padding(mesh)

    def per_device(state, plan, vbatch):
        lr = schedule(state["step"])
        group = lax.axis_index("subnet")
        me = lax.axis_index(AXES)  # = group * n_data + data index: owner of chunk `me`
        subnets = plan["subnets"]

        def round_grads(params, r):
            """Loss and norm of every slot of round r (``[R]``), and its clipped gradient on
            this device's chunk (``[R, chunk]``)."""
            local = jax.tree.map(lambda p: lax.pcast(p, AXES, to="varying"), params)
            ids = lax.dynamic_slice_in_dim(plan["slot_subnet"][r], group * w, w)
            valid = lax.dynamic_slice_in_dim(plan["slot_valid"][r], group * w, w)
            subs = jnp.take(subnets, ids, axis=0)

            def compute(_):
                losses, grads = lax.map(lambda shard: slot_grads(local, subs, shard), vbatch)
                # The fixed pairwise tree over the V shards: its lower levels on this device's
                # contiguous shards (here), its upper levels over the devices, in device order.
                losses, grads = pairwise_sum((losses, grads))
                return losses, jax.vmap(spec.ravel)(grads)  # [W], [W, Pp]

            def padding(_):
                return jax.tree.map(lambda a: lax.pcast(jnp.zeros(a.shape, a.dtype), AXES, to="varying"),
                                    jax.eval_shape(compute, None))

            # A device whose slots are all padding (a wave smaller than the round)
            # computes nothing: only the taken branch runs (when no collective is inside).
            if skip:
                losses, grads = lax.optimization_barrier(lax.cond(jnp.any(valid), compute, padding, None))
            else:
                losses, grads = lax.optimization_barrier(compute(None))
            return reduce_round(losses, grads, n_sub=n_sub, n_data=n_data, virtual_shards=v,
                                clip_norm=optim.clip_norm)

        def store(buffers, values, slot_ids):
            # Each slot's row goes to its subnet's index (K: padding). Indices are unique
            # per step, so these are plain writes, never an add.
            out = []
            for buf, val in zip(buffers, values, strict=True):
                for i in range(r_slots):
                    buf = lax.dynamic_update_index_in_dim(buf, val[i], slot_ids[i], 0)
                out.append(buf)
            return out

        def gather_params(p_mine):
            # The next wave's subnets compute in the tensor split, as the step's input does.
            return tensor_split(spec.unravel(lax.all_gather(p_mine, AXES, tiled=True, to="invarying")),
                                mesh, spec)

        p_mine = lax.dynamic_slice_in_dim(spec.ravel(state["params"]), me * chunk, chunk)
        opt0 = state["opt"]  # mu, nu: this device's chunk; count: whole
        bufs0 = [lax.pcast(jnp.zeros((k + 1, chunk), jnp.float32), AXES, to="varying"),
                 jnp.zeros((k + 1,), jnp.float32), jnp.zeros((k + 1,), jnp.float32)]

        def update(p, g, opt, unit_mask, shared):
            return adamw(spec, p, g, opt, unit_mask, shared, lr, optim, offset=me * chunk)

        if semantics == "sync":
            def body(r, bufs):
                losses, norms, grads = round_grads(state["params"], r)
                return store(bufs, [grads, losses, norms], plan["slot_subnet"][r])

            bufs = lax.fori_loop(0, plan["n_rounds"], body, bufs0)
            opt, last_units = opt0, jnp.any(units_of(subnets[:k]), axis=0)  # the units anyone used
        else:
            def body(r, carry):
                params, p_mine, opt, acc, wave_used, bufs = carry
                losses, norms, grads = round_grads(params, r)
                ids, valid = plan["slot_subnet"][r], plan["slot_valid"][r]
                # No two subnets of a wave share a unit, so each unit element has at most
                # one nonzero term here: the sum is exact in any order. (Shared elements:
                # a sequential wave has one subnet; operator-causal never applies them
                # here, they come from the buffer at the end of the step.)
                # Row by row: elementwise adds; a reduce over the slot axis was the slowest
                # part of a causal round on the CPU.
                for i in range(r_slots):
                    acc = acc + jnp.where(valid[i], grads[i], 0)
                used = units_of(jnp.take(subnets, ids, axis=0)) & valid.reshape((-1,) + (1,) * no_units.ndim)
                wave_used = wave_used | jnp.any(used, axis=0)
                bufs = store(bufs, [grads, losses, norms], ids)

                def end_wave(c):
                    p_mine, opt, acc, wave_used = c
                    p_mine, opt = update(p_mine, acc, opt, wave_used, shared_per_wave)
                    return p_mine, opt, jnp.zeros_like(acc), jnp.zeros_like(wave_used)

                p_mine, opt, acc, wave_used = lax.cond(plan["wave_end"][r], end_wave, lambda c: c,
                                                       (p_mine, opt, acc, wave_used))
                # Every device gathers every round (a collective never sits in one branch).
                return gather_params(p_mine), p_mine, opt, acc, wave_used, bufs

            carry = (state["params"], p_mine, opt0, jnp.zeros_like(p_mine), no_units, bufs0)
            _, p_mine, opt, _, _, bufs = lax.fori_loop(0, plan["n_rounds"], body, carry)
            last_units = no_units  # the waves updated the units: only the mean's shared elements apply
        if not shared_per_wave:  # sequential: every update happened in its wave
            mean = pairwise_sum(bufs[0][:k]) * (1.0 / k)
            p_mine, opt = update(p_mine, mean, opt, last_units, True)
        new_state = {"step": state["step"] + 1, "params": gather_params(p_mine), "opt": opt}
        return new_state, {"loss": bufs[1][:k], "grad_norm": bufs[2][:k], "lr": lr}

    def step(state, plan, batch):
        vbatch = jax.tree.map(lambda x: x.reshape(v, x.shape[0] // v, *x.shape[1:]), batch)
        fn = jax.shard_map(per_device, mesh=mesh, axis_names=manual_axis_names(mesh, AXES),
                           in_specs=(STATE_SPECS, P(), P(DATA_AXES)), out_specs=(STATE_SPECS, P()))
        return fn(state, plan, vbatch)

    return step


def jit_step(step, mesh, spec: SupernetSpec, donate: bool = True):
    """The step jitted with its state shardings (``state_shardings``), the plan replicated,
    the batch split over ``DATA_AXES``."""
    rep = NamedSharding(mesh, P())
    batch = NamedSharding(mesh, P(DATA_AXES))
    shardings = state_shardings(mesh, spec)
    return jax.jit(step, in_shardings=(shardings, rep, batch), out_shardings=(shardings, rep),
                   donate_argnums=(0,) if donate else ())


# --- the oracle -----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _reference_fns(spec: SupernetSpec, optim: OptimConfig, total_steps: int):
    schedule = lr_schedule(optim, total_steps)

    @jax.jit
    def grad(params, subnet, batch):
        loss, flat = spec.loss_and_grad(params, subnet, batch)
        norm = global_norm(flat)
        return loss, norm, clip(flat, norm, optim.clip_norm)

    @functools.partial(jax.jit, static_argnums=4)
    def update(params, grads, opt, unit_mask, shared, step):
        p, opt = adamw(spec, spec.ravel(params), grads, opt, unit_mask, shared, schedule(step), optim)
        return spec.unravel(p), opt

    return grad, update


def reference_step(spec: SupernetSpec, state, subnets, batch, *, semantics: str, optim: OptimConfig,
                   total_steps: int):
    """The definition of the three semantics as a plain Python loop over the K subnets.

    No mesh, no vmap, no virtual shards: each subnet's gradient is ``jax.grad``
    of its mean loss over the whole batch, one subnet at a time, in order.
    Returns ``(state, metrics)`` like the SPara step.
    """
    check_semantics(semantics)
    grad, update = _reference_fns(spec, optim, total_steps)
    subnets = spec.space.validate(subnets)
    used = spec.units(subnets)
    params, opt, step = state["params"], state["opt"], state["step"]
    none = np.zeros(spec.unit_grid, bool)
    losses, norms, grads = [], [], []
    for i, subnet in enumerate(subnets):
        loss, norm, g = grad(params, subnet, batch)
        losses.append(loss), norms.append(norm), grads.append(g)
        if semantics != "sync":  # a full step of its own on the units it used (and, sequential, the shared)
            params, opt = update(params, g, opt, used[i], semantics == "sequential", step)
    mean = functools.reduce(jnp.add, grads) / len(grads)
    if semantics == "sync":  # one step on the mean: the units anyone used, and the shared params
        params, opt = update(params, mean, opt, used.any(0), True, step)
    elif semantics == "operator-causal":  # the shared params: one step on the mean of the K gradients
        params, opt = update(params, mean, opt, none, True, step)
    return ({"step": step + 1, "params": params, "opt": opt},
            {"loss": jnp.stack(losses), "grad_norm": jnp.stack(norms)})
