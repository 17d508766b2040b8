"""SPara through the pipeline with subnets at their own width: the pipeline's sliced path.

Why
---
The masked pipelined step (``pipelined.py``) runs every subnet at the supernet's full
size through the stages. Here each pipeline pass runs at one **size**
``(FFN width, heads)``: the largest of its subnets' blocks, rounded up to the ladder of
``supernet.ladder_levels`` sizes (``SuperGPT.sliced_shape``, as on the sliced path of
``sliced.py``) and then to a multiple of ``tensor`` (the FFN and head axes are split
over it). The blocks' weights enter the pipeline cut to that size
(``SuperGPT.slice_blocks``): every stage computes, stashes, accumulates and syncs the
slice only, and the gradients are padded back with zeros to the stored shapes for the
update. Widths and heads below a pass's size are masked inside the slice, as the masked
path does, so a subnet's loss and gradient are the masked path's (the same function of
the same weights; the sums round otherwise).

**Depth**: a pass runs only the blocks its deepest subnet runs (``sliced_shape`` has
one entry per block a subnet runs, its first ones). Every stage keeps its share of the
blocks; a block past the pass's depth is skipped on its stage (the runtime's
``active_layers``: a ``cond`` on a count that depends only on the stage), so a shallow
subnet costs its depth as well as its width. Stages in lockstep (a tensor or subnet axis
> 1) still compute such a block and drop it. A skipping pipeline forms its backward
whole in B and in W (no equation-level split), as for uneven stages, so under a schedule
with W tasks (ZB-H1, ZB-V) every pass runs all blocks, masked.

Programs
--------
Host-driven, like ``sliced.py``: a *start* program (the moments unraveled into the
parameters' tree, once per step), one *pass* program per ``(size, subnets in the pass,
depth)`` met, compiled on first use and cached, and a *finish* program (the update in ``sync``,
the moments raveled). ``sequential`` runs one pass per subnet, in sampling order, each
followed by that subnet's own update (the pipeline drains between subnets, as on the
masked path): its programs are one per size and depth, at most
``len(width ladder) x len(head ladder) x len(depths)``. ``sync`` groups the step's subnets by size
(sizes in order of first appearance) and sends each group through the pipeline in one
pass, split over the ``subnet`` device groups (padded with a repeat of the group's first
subnet whose results are dropped): several shorter passes instead of one, each with
its bubble, in exchange for each subnet computing at its own size. The clipped
gradients are summed in that order (the plan's, which no mesh changes), one update
from their mean.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mindpipe_jax.config import ParallelConfig
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.parallel.dispatch import throttle
from mindpipe_jax.supernet.layout import state_shardings
from mindpipe_jax.supernet.pipelined import PipelinedStep
from mindpipe_jax.supernet.plan import DATA_AXES, step_waves
from mindpipe_jax.supernet.spec import SupernetSpec

__all__ = ["PIPELINE_SLICED_MEMBERS", "SlicedPipelinedPlan", "SlicedPipelinedStep", "pipeline_size",
           "supports_sliced_pipeline"]

# ``sliced_shape`` has one (width, heads) per block the subnet runs, and those are the
# stack's first blocks: its length is the depth a pass runs to.
PIPELINE_SLICED_MEMBERS = ("sliced_shape(subnet, levels)", "ladders(levels)", "slice_blocks(blocks, size)")


def supports_sliced_pipeline(module) -> bool:
    """Whether a supernet can run sliced through the pipeline (``SuperGPT`` can)."""
    return all(callable(getattr(module, m.split("(")[0], None)) for m in PIPELINE_SLICED_MEMBERS)


def pipeline_size(module, subnet, levels: int, tensor: int) -> tuple[int, int]:
    """``(FFN width, heads)`` a subnet runs at through the pipeline: its sliced shape's
    size (the largest of its blocks, rounded up to the ladders), then rounded up to a
    multiple of ``tensor`` (never past the supernet's largest, which the stored split
    already divides)."""
    (width, n_heads), *_ = module.sliced_shape(subnet, levels)
    return pipeline_size_of(width, n_heads, tensor, *module.ladders(levels))


@dataclasses.dataclass(frozen=True)
class SlicedPipelinedPlan:
    """A step's passes, decided on the host.

    ``passes``: ``(size, rows int32[S, n, genes], valid bool[S, n], index int32[S, n],
    used bool[*unit_grid], depth)`` in the order they run (``index``: the subnet's
    position in the step, K for padding; ``used``: the units the pass's update touches,
    sequential only; ``depth``: the blocks it runs, its deepest subnet's, or all under a
    schedule with W tasks); ``sizes``:
    each subnet's size; ``used``: the units any subnet reads."""

    subnets: np.ndarray
    passes: tuple
    sizes: tuple
    waves: np.ndarray
    used: np.ndarray

    @property
    def num_waves(self) -> int:
        return int(self.waves.max()) + 1

    @property
    def num_passes(self) -> int:
        return len(self.passes)


class SlicedPipelinedStep(PipelinedStep):
    """``step(state, plan, batch) -> (state, metrics)``: SPara through the pipeline, each
    pass at its subnets' size. The same state, batch and metrics as ``PipelinedStep``;
    ``plan`` is ``self.plan(subnets)``. Programs are compiled on first use and cached
    (``programs``: how many so far; ``max_programs``: the bound)."""

    def __init__(self, spec: SupernetSpec, mesh, par: ParallelConfig, *, levels: int, **kwargs):
        super().__init__(spec, mesh, par, **kwargs)
        module = spec.module
        if not supports_sliced_pipeline(module):
            lacks = [m for m in PIPELINE_SLICED_MEMBERS
                     if not callable(getattr(module, m.split("(")[0], None))]
            raise ConfigError(f"{type(module).__name__} has no sliced path through a pipeline (it lacks "
                              f"{', '.join(lacks)}); set supernet.ladder_levels=0 (masked)")
        if levels < 1:
            raise ConfigError(f"supernet.ladder_levels={levels}: the sliced path needs >= 1 level")
        self.levels, self.tensor = levels, mesh.shape["tensor"]
        widths, heads = module.ladders(levels)
        sizes = len({pipeline_size_of(w, h, self.tensor, widths, heads) for w in widths for h in heads})
        passes_per_size = 1 if self.semantics == "sequential" else self.per_pass
        depths = getattr(module, "depths", None) or range(1, self.n_layers + 1)
        self.max_programs = sizes * passes_per_size * len(depths) + 2
        self._passes: dict = {}
        params = self._params_layout
        moments = {"mu": params, "nu": params}
        rep = NamedSharding(mesh, P())
        self._carry_shardings = {"params": params, "moments": moments, "count": rep, "losses": rep,
                                 "norms": rep}
        if self.semantics == "sync":
            self._carry_shardings["total"] = params
        self._rows = NamedSharding(mesh, P(DATA_AXES))
        # Only the parameters are donated between programs' ends: the moments change
        # form (raveled <-> tree), so their buffers could not be reused.
        stored = state_shardings(mesh, spec)
        rest = {k: v for k, v in self._carry_shardings.items() if k != "params"}
        self._start = jax.jit(self._start_fn, in_shardings=(params, stored["opt"]), donate_argnums=(0,),
                              out_shardings=(params, rest))
        self._finish = jax.jit(self._finish_fn, in_shardings=(rep, params, rest, rep), donate_argnums=(1,),
                               out_shardings=(stored, rep))

    # --- host side -----------------------------------------------------------------------------

    def plan(self, subnets) -> SlicedPipelinedPlan:
        spec, k = self.spec, self.k
        subnets = np.asarray(spec.space.validate(subnets), np.int32)
        units = np.asarray(spec.units(subnets))
        waves = step_waves(self.semantics, units, spec.shares_weights)
        sizes = tuple(pipeline_size(spec.module, s, self.levels, self.tensor) for s in subnets)
        depths = [len(spec.module.sliced_shape(s, self.levels)) for s in subnets]
        if self.semantics == "sequential":
            members = [(sizes[i], [i]) for i in range(k)]
        else:
            groups: dict = {}
            for i, size in enumerate(sizes):
                groups.setdefault(size, []).append(i)
            members = list(groups.items())
        groups_s = self.mesh.shape["subnet"]
        passes = []
        for size, idx in members:
            n = -(-len(idx) // groups_s)
            padded = idx + [idx[0]] * (n * groups_s - len(idx))
            valid = np.arange(n * groups_s) < len(idx)
            index = np.where(valid, padded, k).astype(np.int32)
            used = units[idx].any(0)
            passes.append((size, subnets[padded].reshape(groups_s, n, -1), valid.reshape(groups_s, n),
                           index.reshape(groups_s, n), used,
                           max(depths[i] for i in idx)))
        return SlicedPipelinedPlan(subnets, tuple(passes), sizes, waves, units.any(0))

    @property
    def programs(self) -> int:
        """Programs compiled so far: one per (size, pass length, depth) met, plus start and
        finish."""
        return len(self._passes) + 2

    def __call__(self, state, plan: SlicedPipelinedPlan, batch):
        """One step. ``state`` is consumed (its buffers are donated)."""
        with jax.set_mesh(self.mesh):
            step = state["step"]
            params, rest = self._start(state["params"], state["opt"])
            carry = {"params": params, **rest}
            for i, (size, rows, valid, index, used, depth) in enumerate(plan.passes):
                program = self._pass(size, rows.shape[1], depth)
                carry = program(throttle(i + 1, carry), step, rows, valid, index, used, batch)
            params = carry.pop("params")
            return self._finish(step, params, carry, plan.used)

    def lower(self, state, plan: SlicedPipelinedPlan, batch) -> list:
        """The programs a step of ``plan`` runs, in order, lowered for these (possibly
        abstract) arguments: start, one per pass, finish. (The step itself compiles them
        on first use; this is for inspection: FLOPs, memory, collectives.)"""
        with jax.set_mesh(self.mesh):
            params, opt, step = state["params"], state["opt"], state["step"]
            programs = [self._start.lower(params, opt)]
            shapes = jax.eval_shape(self._start, params, opt)
            carry = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                                 {"params": shapes[0], **shapes[1]}, self._carry_shardings)
            for size, rows, valid, index, used, depth in plan.passes:
                programs.append(self._pass(size, rows.shape[1], depth).lower(carry, step, rows, valid, index,
                                                                             used, batch))
            rest = {k: v for k, v in carry.items() if k != "params"}
            programs.append(self._finish.lower(step, carry["params"], rest, plan.used))
        return programs

    def compile(self, state, plan: SlicedPipelinedPlan, batch) -> list:
        """``lower``'s programs compiled (for inspection; the step runs its own)."""
        return [program.compile() for program in self.lower(state, plan, batch)]

    # --- the programs --------------------------------------------------------------------------

    def _start_fn(self, params, opt):
        zeros = jnp.zeros((self.k + 1,), jnp.float32)  # row K: the padding slots' sink
        rest = {"moments": self._unraveled_moments(opt), "count": opt["count"], "losses": zeros,
                "norms": zeros}
        if self.semantics == "sync":
            rest["total"] = self._placed(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))
        return params, rest

    def _pass(self, size, n: int, depth: int):
        key = (size, n, depth)
        if key not in self._passes:
            rep = NamedSharding(self.mesh, P())
            self._passes[key] = jax.jit(
                partial(self._pass_fn, size, depth), donate_argnums=(0,),
                in_shardings=(self._carry_shardings, rep, rep, rep, rep, rep, self._rows),
                out_shardings=self._carry_shardings)
        return self._passes[key]

    def _pass_fn(self, size, depth, carry, step, rows, valid, index, used, batch):
        """One pass at ``size`` running the first ``depth`` blocks: ``rows`` (``[S, n,
        genes]``) through the pipeline, the S subnet groups vmapped as on the masked path;
        each subnet's clipped gradient padded back to the stored shapes, then its update
        (sequential) or added to the step's sum in plan order (sync)."""
        module, params = self.spec.module, carry["params"]
        sliced = {**params, "blocks": module.slice_blocks(params["blocks"], size)}
        conditions = jax.vmap(jax.vmap(module.stage_conditions))(jnp.asarray(rows))  # [S, n, layers, C]
        conditions = lax.with_sharding_constraint(conditions, NamedSharding(self.mesh, P("subnet")))
        losses, norms, grads = jax.vmap(partial(self._grads, sliced, micro=self._micro(batch),
                                                depth=depth))(conditions)
        flat = rows.shape[0] * rows.shape[1]
        losses, norms, index, valid = losses.reshape(flat), norms.reshape(flat), index.reshape(flat), \
            valid.reshape(flat)
        grads = jax.tree.map(lambda g: g.reshape(flat, *g.shape[2:]), grads)
        carry = {**carry, "losses": carry["losses"].at[index].set(losses),
                 "norms": carry["norms"].at[index].set(norms)}
        if self.semantics == "sequential":  # one subnet: its own update of what it read
            grads = _padded_to(jax.tree.map(lambda g: g[0], grads), params)
            params, moments, count = self._update(self.lr(step), params, grads, carry["moments"],
                                                  carry["count"], used)
            return {**carry, "params": params, "moments": moments, "count": count}
        total = carry["total"]
        for i in range(flat):  # plan order; a padding slot adds nothing (not even a -0.0)
            total = jax.tree.map(lambda t, g, i=i: _add_into(t, g[i].astype(jnp.float32), valid[i]),
                                 total, grads)
        return {**carry, "total": self._placed(total)}

    def _finish_fn(self, step, params, carry, used):
        moments, count = carry["moments"], carry["count"]
        if self.semantics == "sync":
            mean = jax.tree.map(lambda t: t / self.k, carry["total"])
            params, moments, count = self._update(self.lr(step), params, mean, moments, count, used)
        spec = self.spec
        opt = {"mu": spec.ravel(moments["mu"]), "nu": spec.ravel(moments["nu"]), "count": count}
        metrics = {"loss": carry["losses"][:self.k], "grad_norm": carry["norms"][:self.k],
                   "lr": self.lr(step)}
        return {"step": step + 1, "params": params, "opt": opt}, metrics


def pipeline_size_of(width: int, heads: int, tensor: int, widths, head_choices) -> tuple[int, int]:
    """A ladder size rounded up to a multiple of ``tensor`` (capped at the largest)."""
    return (min(-(-width // tensor) * tensor, max(widths)),
            min(-(-heads // tensor) * tensor, max(head_choices)))


def _padded_to(grads, params):
    """``grads`` (blocks cut to a size) padded with zeros to the parameters' shapes."""
    def pad(g, p):
        widths = [(0, f - s, 0) for s, f in zip(g.shape, p.shape, strict=True)]
        return lax.pad(g, jnp.zeros((), g.dtype), widths)

    return jax.tree.map(pad, grads, params)


def _add_into(total, g, valid):
    """``total`` with ``g`` (a prefix-sized block of it) added into its leading corner
    where ``valid``; elementwise, so each element's sums keep the plan's order."""
    corner = tuple(slice(0, s) for s in g.shape)
    return total.at[corner].set(jnp.where(valid, total[corner] + g, total[corner]))
