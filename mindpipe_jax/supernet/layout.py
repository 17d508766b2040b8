"""Where SPara's state lives on the mesh, and the layout its subnets compute in.

Between steps (``state_shardings``): the parameters as the rules table stores them
(``embed`` split over ``fsdp``; ``mlp``, ``heads``, ``vocab`` over ``tensor``), the
AdamW moments (raveled vectors) split over every device of the step's manual axes,
the step and the per-unit counts replicated.

Inside the step's ``shard_map`` (manual over ``plan.AXES``; ``tensor`` left to the
compiler): ``STATE_SPECS`` takes the parameters whole over the manual axes, so their
``fsdp`` shards are all-gathered once per step going in; ``tensor_split`` puts
parameters the step rebuilt itself (all-gathered from the devices' chunks after an
update) back into their ``tensor`` split, so the partitioner splits the subnets'
matmuls over ``tensor`` rather than repeating them on every tensor rank.

Separate because the masked step (``spara.py``), the sliced one (``sliced.py``), the
trainer's initialisation and its checkpoint restore all need the same layouts.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mindpipe_jax.parallel.mesh import manual_axis_names
from mindpipe_jax.parallel.rules import state_shardings as rules_shardings
from mindpipe_jax.supernet.plan import AXES
from mindpipe_jax.supernet.spec import SupernetSpec

STATE_SPECS = {"step": P(), "params": P(), "opt": {"mu": P(AXES), "nu": P(AXES), "count": P()}}


def _rules_layout(mesh, spec: SupernetSpec, kind: str):
    if spec.abstract_state is None:  # a spec built by hand: no logical names to read
        return jax.tree.map(lambda _: NamedSharding(mesh, P()), spec.abstract_params)
    return nnx.to_pure_dict(rules_shardings(spec.abstract_state, mesh, kind))


def param_shardings(mesh, spec: SupernetSpec):
    """How the parameters are stored between steps (the rules' storage layout): with
    fsdp = F a device keeps 1/F of every ``embed``-named weight, with tensor = T 1/T of
    the ``mlp``/``heads``/``vocab``-named ones."""
    return _rules_layout(mesh, spec, "storage")


def compute_shardings(mesh, spec: SupernetSpec):
    """The rules' compute layout of the parameters: whole over ``fsdp`` (``tensor``
    and, for stacked blocks, ``pipe`` as stored)."""
    return _rules_layout(mesh, spec, "compute")


def moment_axes(mesh) -> tuple[str, ...]:
    """The axes the raveled AdamW moments are split over: ``AXES``, and ``pipe`` when the
    step runs through a pipeline (``pipelined.py``)."""
    return ("subnet", "pipe", "fsdp", "data") if mesh.shape.get("pipe", 1) > 1 else AXES


def state_shardings(mesh, spec: SupernetSpec) -> dict:
    """The SPara state on ``mesh``: parameters as stored, moments split over
    ``moment_axes``, step and counts replicated."""
    out = jax.tree.map(lambda p: NamedSharding(mesh, p), STATE_SPECS, is_leaf=lambda x: isinstance(x, P))
    out["params"] = param_shardings(mesh, spec)
    moments = NamedSharding(mesh, P(moment_axes(mesh)))
    out["opt"].update(mu=moments, nu=moments)
    return out


def tensor_split(params, mesh, spec: SupernetSpec):
    """Inside the step: ``params`` (whole on the manual axes) constrained to their
    ``tensor`` split (the rules' compute layout, which never names ``fsdp``). A no-op
    when tensor = 1."""
    if mesh.shape["tensor"] == 1:
        return params
    layout = compute_shardings(mesh, spec)
    manual = manual_axis_names(mesh, AXES)

    def one(x, sharding):
        # Only the automatic axes may be named inside the shard_map: the manual ones are
        # dropped (the parameters are whole over them here).
        entries = [None if e is None else tuple(a for a in ((e,) if isinstance(e, str) else e)
                                                if a not in manual) or None
                   for e in sharding.spec]
        return jax.lax.with_sharding_constraint(x, P(*entries))

    return jax.tree.map(one, params, layout)


def global_array(host, sharding: NamedSharding) -> jax.Array:
    """``host`` (a NumPy array every process holds alike: the deterministic loader's
    global batch, the search's subnets and validation rows) as one array laid out by
    ``sharding``: each process places exactly the pieces its devices hold, whatever the
    process/device layout (jit refuses a NumPy input sharded over several processes)."""
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
