"""Sliced SPara: each subnet computes at (close to) its own size, from slices of the shared weights.

Why
---
The masked step (``spara.py``) runs every subnet at the supernet's full size, so a
small subnet costs the largest. Here a subnet runs at its **shape**: its depth
(blocks past it are not computed at all), and in every block the largest FFN width
and head count of its blocks rounded **up** to a ladder of at most
``supernet.ladder_levels`` sizes (``SuperGPT.sliced_shape``). Widths and heads below
the shape's are masked inside the slice, exactly as the masked path does, so the
result is the masked path's (the same function of the same weights).

Programs
--------
One program computes one **round** of one shape: R = S·W slots (S: ``subnet`` axis,
W: ``vmap_width``), each device its W slots vmapped over the same weight slices on
its V/D virtual shards, then the same fixed-order exchange and per-subnet clipping as
the masked step (``reduce_round``). The host groups a step's K subnets by shape
(``plan_sliced``) and calls the round program of each group's shape once per R
subnets (the last round of a group padded; a device whose slots are all padding
computes nothing). Two more programs start the step (this device's chunk of the
parameters) and finish it (the mean over K, the update, the all-gather). Programs are
jitted once per shape and cached: at most ``len(depths) x len(width ladder) x
len(head ladder) + 2`` per step function (``max_programs``); the default space of
``mindpipe supernet`` (depths 1..L, 4 FFN ratios, heads 1..H rounded to 4 levels)
gives ``L x 4 x min(H, 4) + 2``.

Determinism
-----------
Which subnets share a round depends on R (the mesh), but a slot's gradient does
not: each device runs the same per-shape program on each of its shards (W and the
shard shape are fixed by the config; the blocks of a shape run as one scan, as in the
masked model: unrolled, they rounded differently on 1 and 2 data devices), and every
later operation is the masked step's (elementwise, or fixed-shape reductions in a fixed order, rows written to
their subnet's index). So the parameters are bitwise the same on every split of the
devices between ``subnet`` and ``data``, as for the masked step.

Semantics: ``sync``, ``sequential`` and ``operator-causal`` as in ``spara.py``; the
subnets of an operator-causal wave are grouped by shape inside the wave (they share
no unit: any order is exact); a sequential wave is one subnet.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mindpipe_jax.config import OptimConfig
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.parallel.dispatch import throttle
from mindpipe_jax.parallel.mesh import manual_axis_names
from mindpipe_jax.supernet.layout import STATE_SPECS, state_shardings, tensor_split
from mindpipe_jax.supernet.optimizer import adamw, pairwise_sum, reduce_round
from mindpipe_jax.supernet.plan import (
    AXES,
    DATA_AXES,
    check_layout,
    check_semantics,
    data_devices,
    skips_padding,
    step_waves,
    updates_shared_per_wave,
)
from mindpipe_jax.supernet.spec import SupernetSpec
from mindpipe_jax.train.state import lr_schedule

__all__ = ["SlicedPlan", "SlicedStep", "plan_sliced", "supports_slicing", "sliced_loss_and_grad"]

SLICED_MEMBERS = ("sliced_shape(subnet, levels)", "sliced_loss(inputs, targets, subnet, shape)",
                  "ladders(levels)")


def supports_slicing(module) -> bool:
    """Whether a supernet module offers the sliced path (``SuperGPT`` does)."""
    return all(callable(getattr(module, m.split("(")[0], None)) for m in SLICED_MEMBERS)


def sliced_loss_and_grad(spec: SupernetSpec, params, subnet, batch, shape, unroll: bool = False,
                         ravel: bool = True):
    """``subnet``'s loss through the sliced path at ``shape``, and its gradient (of the
    whole supernet's parameters: zero outside the slices), raveled unless ``ravel=False``.
    ``unroll``: for FLOP counts only (the same values, other rounding)."""
    loss, grads = jax.value_and_grad(lambda p: spec.merge(p).sliced_loss(
        batch["inputs"], batch["targets"], subnet, shape, unroll=unroll))(params)
    return loss, spec.ravel(grads) if ravel else grads


def max_shapes(module, levels: int) -> int | None:
    """How many shapes the sliced path can meet: depths x width ladder x head ladder
    (None for a supernet that does not list its depths)."""
    widths, heads = module.ladders(levels)
    return len(module.depths) * len(widths) * len(heads) if hasattr(module, "depths") else None


@dataclasses.dataclass(frozen=True)
class SlicedPlan:
    """A step's rounds, decided on the host.

    ``subnets``: ``int32[K + 1, genes]`` (row K: padding, a copy of row 0);
    ``rounds``: ``(shape, slot_subnet int32[R], slot_valid bool[R], wave_end)`` in the
    order they run (K in ``slot_subnet``: padding); ``shapes``: each subnet's shape;
    ``waves``: each subnet's wave (all 0 in ``sync``).
    """

    subnets: np.ndarray
    rounds: tuple
    shapes: tuple
    waves: np.ndarray
    used: np.ndarray  # bool[*unit_grid]: the units any subnet of the step reads

    @property
    def num_waves(self) -> int:
        return int(self.waves.max()) + 1

    @property
    def num_rounds(self) -> int:
        return len(self.rounds)


def plan_sliced(spec: SupernetSpec, subnets, semantics: str, round_slots: int, levels: int) -> SlicedPlan:
    """Group the step's subnets by shape (shapes in order of first appearance, subnets
    in sampling order) into rounds of ``round_slots``; in ``sequential`` and
    ``operator-causal``, wave by wave."""
    check_semantics(semantics)
    subnets = spec.space.validate(subnets)
    k = len(subnets)
    shapes = tuple(spec.module.sliced_shape(s, levels) for s in subnets)
    units = spec.units(subnets)
    waves = step_waves(semantics, units, spec.shares_weights)
    rounds = []
    for wave in range(int(waves.max()) + 1):
        groups: dict = {}
        for i in np.flatnonzero(waves == wave):
            groups.setdefault(shapes[i], []).append(int(i))
        wave_rounds = []
        for shape, members in groups.items():
            for start in range(0, len(members), round_slots):
                row = np.full(round_slots, k, np.int32)
                part = members[start:start + round_slots]
                row[:len(part)] = part
                wave_rounds.append([shape, row, row < k, False])
        wave_rounds[-1][3] = True  # after the wave's last round its gradients are applied
        rounds += [tuple(r) for r in wave_rounds]
    return SlicedPlan(np.concatenate([subnets, subnets[:1]]).astype(np.int32), tuple(rounds), shapes, waves,
                      units.any(0))


class SlicedStep:
    """``step(state, plan, batch) -> (state, metrics)``: the SPara step on the sliced path.

    The same arguments and results as ``make_spara_step`` + ``jit_step`` (state sharded
    by ``spara.state_shardings``, batch split over ``DATA_AXES``), except that ``plan`` is a
    ``SlicedPlan`` (``self.plan(subnets)``). Programs are compiled on first use of a
    shape and cached (``programs``: how many so far; ``max_programs``: the bound).
    """

    def __init__(self, spec: SupernetSpec, mesh, *, semantics: str, subnets_per_step: int, vmap_width: int,
                 virtual_shards: int, global_batch: int, optim: OptimConfig, total_steps: int,
                 levels: int):
        check_semantics(semantics)
        check_layout(mesh, subnets_per_step=subnets_per_step, vmap_width=vmap_width,
                     virtual_shards=virtual_shards, global_batch=global_batch)
        if not supports_slicing(spec.module):
            raise ConfigError(f"{type(spec.module).__name__} has no sliced path (it lacks "
                              f"{', '.join(SLICED_MEMBERS)}); set supernet.ladder_levels=0 (masked)")
        if levels < 1:
            raise ConfigError(f"supernet.ladder_levels={levels}: the sliced path needs >= 1 level")
        self.spec, self.mesh, self.semantics, self.levels = spec, mesh, semantics, levels
        self.k, self.w, self.v, self.optim = subnets_per_step, vmap_width, virtual_shards, optim
        self.n_sub, self.n_data = mesh.shape["subnet"], data_devices(mesh)
        self.round_slots = self.n_sub * vmap_width
        self.chunk = spec.padded_size // (self.n_sub * self.n_data)
        self.schedule = lr_schedule(optim, total_steps)
        shapes = max_shapes(spec.module, levels)
        self.max_programs = None if shapes is None else shapes + 2
        self._rounds: dict = {}  # shape -> jitted round program
        self._start, self._finish = self._jit_start(), self._jit_finish()

    # --- host side -----------------------------------------------------------------------------

    def plan(self, subnets) -> SlicedPlan:
        return plan_sliced(self.spec, subnets, self.semantics, self.round_slots, self.levels)

    @property
    def programs(self) -> int:
        """Programs compiled so far: one per shape met, plus start and finish."""
        return len(self._rounds) + 2

    def __call__(self, state, plan: SlicedPlan, batch):
        """One step. ``state`` is consumed (its buffers are donated), as with ``jit_step``."""
        subnets = jnp.asarray(plan.subnets)
        carry = self._start(state)  # holds the parameters the rounds read (gathered once)
        for i, (shape, slot_subnet, slot_valid, wave_end) in enumerate(plan.rounds):
            rnd = {"slot_subnet": slot_subnet, "slot_valid": slot_valid, "wave_end": np.asarray(wave_end)}
            carry = self._round(shape)(throttle(i + 1, carry), state["step"], rnd, subnets, batch)
        return self._finish(state["step"], carry, plan.used)

    def lower(self, state, plan: SlicedPlan, batch) -> list:
        """The programs a step of ``plan`` runs, lowered for these (possibly abstract)
        arguments: start, one per shape (every round of a shape runs the same program),
        finish. The step compiles the same programs on first use (a compile of these is
        the one it then finds in JAX's cache); this is for inspection: memory, FLOPs."""
        subnets = jnp.asarray(plan.subnets)
        start = self._start.lower(state)
        carry = self._abstract_carry(state, start.compile())
        programs, seen = [start], set()
        for shape, slot_subnet, slot_valid, wave_end in plan.rounds:
            if shape not in seen:
                seen.add(shape)
                rnd = {"slot_subnet": slot_subnet, "slot_valid": slot_valid, "wave_end": np.asarray(wave_end)}
                programs.append(self._round(shape).lower(carry, state["step"], rnd, subnets, batch))
        return [*programs, self._finish.lower(state["step"], carry, plan.used)]

    def flops(self, state, plan: SlicedPlan, batch) -> float:
        """XLA's FLOP count of one step (``cost_analysis``), per device, summed over the
        programs the step calls (a round program once per round), with the scan over blocks
        unrolled (XLA counts a loop body once; these counting programs are compiled apart and
        never run). On one device with ``virtual_shards=1`` it is the step's whole work (a
        conditional counts at its larger branch). ``state`` and ``batch`` may be abstract."""
        def count(lowered):
            compiled = lowered.compile() if hasattr(lowered, "compile") else lowered
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, (list, tuple)) else cost
            return float(cost.get("flops", 0.0))

        subnets = jnp.asarray(plan.subnets)
        start = self._start.lower(state).compile()
        carry = self._abstract_carry(state, start)
        total = count(start)
        # Every round of a shape runs the same program (its slots are arguments): one count each.
        per_shape: dict = {}
        for shape, slot_subnet, slot_valid, wave_end in plan.rounds:
            if shape not in per_shape:
                rnd = {"slot_subnet": slot_subnet, "slot_valid": slot_valid, "wave_end": np.asarray(wave_end)}
                counting = self._jit_round(shape, unroll=True)
                per_shape[shape] = count(counting.lower(carry, state["step"], rnd, subnets, batch))
            total += per_shape[shape]
        return total + count(self._finish.lower(state["step"], carry, plan.used))

    def _abstract_carry(self, state, start):
        """The carry as the compiled ``start`` program lays it out (eval_shape alone drops
        the shardings, and a round compiled for replicated parameters would not split
        over tensor)."""
        return jax.tree.map(lambda a, sharding: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                            jax.eval_shape(self._start, state), start.output_shardings)

    # --- the programs --------------------------------------------------------------------------

    def _carry_specs(self):
        # Per device: its chunk of the parameters, of the AdamW moments and of the wave's
        # unit gradients, and its columns of the [K+1] gradient buffer; counts, losses,
        # norms and the parameters the rounds read are the same on every device.
        specs = {"p_mine": P(AXES), "mu": P(AXES), "nu": P(AXES), "count": P(),
                 "grads": P(None, AXES), "losses": P(), "norms": P(), "params": P()}
        if self.semantics != "sync":
            specs.update(acc=P(AXES), wave_used=P())
        return specs

    def _jit_start(self):
        fn = jax.shard_map(self._start_fn(), mesh=self.mesh, axis_names=manual_axis_names(self.mesh, AXES),
                           in_specs=(STATE_SPECS,), out_specs=self._carry_specs())
        return jax.jit(fn)

    def _jit_finish(self):
        fn = jax.shard_map(self._finish_fn(), mesh=self.mesh, axis_names=manual_axis_names(self.mesh, AXES),
                           in_specs=(P(), self._carry_specs(), P()), out_specs=(STATE_SPECS, P()))
        # The new state leaves as stored (parameters split over fsdp/tensor). Nothing of the
        # carry can hold it (other shapes), so nothing is donated.
        shardings = (state_shardings(self.mesh, self.spec), NamedSharding(self.mesh, P()))
        return jax.jit(fn, out_shardings=shardings)

    def _jit_round(self, shape, unroll: bool = False):
        v = self.v
        fn = jax.shard_map(self._round_fn(shape, unroll), mesh=self.mesh,
                           axis_names=manual_axis_names(self.mesh, AXES),
                           in_specs=(self._carry_specs(), P(), P(), P(), P(DATA_AXES)),
                           out_specs=self._carry_specs())

        def outer(carry, step, rnd, subnets, batch):
            vbatch = jax.tree.map(lambda x: x.reshape(v, x.shape[0] // v, *x.shape[1:]), batch)
            return fn(carry, step, rnd, subnets, vbatch)

        return jax.jit(outer, donate_argnums=(0,))

    def _start_fn(self):
        spec, chunk, k, mesh = self.spec, self.chunk, self.k, self.mesh
        waves = self.semantics != "sync"

        def per_device(state):
            me = lax.axis_index(AXES)
            p_mine = lax.dynamic_slice_in_dim(spec.ravel(state["params"]), me * chunk, chunk)
            opt = state["opt"]
            carry = {"p_mine": p_mine, "mu": opt["mu"], "nu": opt["nu"], "count": opt["count"],
                     "grads": lax.pcast(jnp.zeros((k + 1, chunk), jnp.float32), AXES, to="varying"),
                     "losses": jnp.zeros((k + 1,), jnp.float32), "norms": jnp.zeros((k + 1,), jnp.float32),
                     # What the rounds read: the step's input (its fsdp shards gathered going in).
                     "params": tensor_split(state["params"], mesh, spec)}
            if waves:
                carry.update(acc=jnp.zeros_like(p_mine), wave_used=jnp.zeros(spec.unit_grid, bool))
            return carry

        return per_device

    def _round(self, shape):
        if shape not in self._rounds:
            self._rounds[shape] = self._jit_round(shape)
        return self._rounds[shape]

    def _round_fn(self, shape, unroll: bool):
        spec, optim, w, chunk = self.spec, self.optim, self.w, self.chunk
        n_sub, n_data, r_slots = self.n_sub, self.n_data, self.round_slots
        waves = self.semantics != "sync"
        shared_per_wave = updates_shared_per_wave(self.semantics)
        # W subnets of one shape on one shard; raveled once the shards are summed (spara.py).
        slot_grads = jax.vmap(functools.partial(sliced_loss_and_grad, spec, shape=shape, unroll=unroll,
                                                ravel=False), in_axes=(None, 0, None))
        units_of = jax.vmap(spec.module.units)
        skip = skips_padding(self.mesh)

        def per_device(carry, step, rnd, subnets, vbatch):
            lr = self.schedule(step)
            group, me = lax.axis_index("subnet"), lax.axis_index(AXES)
            params = carry["params"]
            local = jax.tree.map(lambda p: lax.pcast(p, AXES, to="varying"), params)
            ids = lax.dynamic_slice_in_dim(rnd["slot_subnet"], group * w, w)
            valid = lax.dynamic_slice_in_dim(rnd["slot_valid"], group * w, w)
            subs = jnp.take(subnets, ids, axis=0)

            def compute(_):
                losses, grads = lax.map(lambda shard: slot_grads(local, subs, shard), vbatch)
                losses, grads = pairwise_sum((losses, grads))  # the fixed tree's lower levels
                return losses, jax.vmap(spec.ravel)(grads)  # [W], [W, Pp]

            def padding(_):
                # The shapes compute returns, written out: tracing it again to learn them
                # (eval_shape) doubled the model's trace time in every round program.
                zeros = (jnp.zeros((w,), jnp.float32), jnp.zeros((w, spec.padded_size), jnp.float32))
                return jax.tree.map(lambda a: lax.pcast(a, AXES, to="varying"), zeros)

            # A device whose slots are all padding computes nothing, when no collective is
            # inside the compute (plan.skips_padding).
            if skip:
                losses, grads = lax.optimization_barrier(lax.cond(jnp.any(valid), compute, padding, None))
            else:
                losses, grads = lax.optimization_barrier(compute(None))
            losses, norms, grads = reduce_round(losses, grads, n_sub=n_sub, n_data=n_data,
                                                virtual_shards=self.v, clip_norm=optim.clip_norm)
            out = dict(carry)
            # Each slot's row goes to its subnet's index (K: padding): plain writes.
            for key, val in (("grads", grads), ("losses", losses), ("norms", norms)):
                buf = out[key]
                for i in range(r_slots):
                    buf = lax.dynamic_update_index_in_dim(buf, val[i], rnd["slot_subnet"][i], 0)
                out[key] = buf
            if not waves:
                return out
            # Waves: the wave's gradients (at most one nonzero term per unit element: exact in
            # any order; a sequential wave has one subnet), applied after its last round.
            acc = carry["acc"]
            for i in range(r_slots):
                acc = acc + jnp.where(rnd["slot_valid"][i], grads[i], 0)
            used = units_of(jnp.take(subnets, rnd["slot_subnet"], axis=0))
            used = used & rnd["slot_valid"].reshape((-1,) + (1,) * (used.ndim - 1))
            wave_used = carry["wave_used"] | jnp.any(used, axis=0)
            opt = {"mu": carry["mu"], "nu": carry["nu"], "count": carry["count"]}

            def end_wave(c):
                p_mine, opt, acc, wave_used = c
                p_mine, opt = adamw(spec, p_mine, acc, opt, wave_used, shared_per_wave, lr, optim,
                                    offset=me * chunk)
                return p_mine, opt, jnp.zeros_like(acc), jnp.zeros_like(wave_used)

            p_mine, opt, acc, wave_used = lax.cond(rnd["wave_end"], end_wave, lambda c: c,
                                                   (carry["p_mine"], opt, acc, wave_used))
            # Every device gathers (a collective never sits in one branch).
            params = tensor_split(spec.unravel(lax.all_gather(p_mine, AXES, tiled=True, to="invarying")),
                                  self.mesh, spec)
            out.update(params=params, p_mine=p_mine, acc=acc, wave_used=wave_used, **opt)
            return out

        return per_device

    def _finish_fn(self):
        spec, optim, k, chunk = self.spec, self.optim, self.k, self.chunk
        shared_per_wave = updates_shared_per_wave(self.semantics)
        averaged_units = self.semantics == "sync"

        def per_device(step, carry, last_units):
            lr = self.schedule(step)
            me = lax.axis_index(AXES)
            opt = {"mu": carry["mu"], "nu": carry["nu"], "count": carry["count"]}
            # sync: the units anyone used and the shared elements; operator-causal: the waves
            # updated the units, only the mean's shared elements apply; sequential: the waves
            # applied everything.
            p_mine = carry["p_mine"]
            if not shared_per_wave:
                units = last_units if averaged_units else jnp.zeros_like(last_units)
                mean = pairwise_sum(carry["grads"][:k]) * (1.0 / k)
                p_mine, opt = adamw(spec, p_mine, mean, opt, units, True, lr, optim, offset=me * chunk)
            params = spec.unravel(lax.all_gather(p_mine, AXES, tiled=True, to="invarying"))
            new_state = {"step": step + 1, "params": params, "opt": opt}
            return new_state, {"loss": carry["losses"][:k], "grad_norm": carry["norms"][:k], "lr": lr}

        return per_device

