"""Programs XLA's CPU compiler would abort on, refused with one line before it sees them.

XLA's CPU pipeline widens every bfloat16 all-reduce to float32 (its ``AllReducePromotion``
pass) by cloning the reduction's body as one binary op. Inside a ``shard_map`` that
leaves some mesh axes automatic, JAX lowers that body with a sharding annotation at its
root, which the compiler has turned into a ``copy`` by then: the clone fails a CHECK and
the process dies with SIGABRT and a page of C++ stack (seen with XLA 0.10 on a bfloat16
``lax.psum``, ``pmean``, ``pmax`` or ``psum_scatter``, and on the gradient of a
replicated weight cast to bfloat16 inside such a ``shard_map``: JAX's transpose sums it
there). A shard_map manual over every mesh axis, float16, and GPUs (which promote only
16-bit integers) are not affected.

``lower_checked`` traces a jitted function, looks for such reductions in its jaxpr (the
source line of each is known there) and lowers it; on other platforms it only lowers.
"""

from __future__ import annotations

from collections.abc import Iterator

import jax
import jax.numpy as jnp
from jax._src import core, source_info_util

from mindpipe_jax.errors import ConfigError

# Collectives that lower to an all-reduce or a reduce-scatter with a reduction body.
_REDUCTIONS = frozenset({
    "psum", "psum_invariant", "psum_start", "psum_invariant_start", "pmax", "pmin",
    "reduce_scatter", "reduce_scatter_start", "unreduced_psum", "unreduced_psum_start",
    "unreduced_reduce_scatter", "unreduced_reduce_scatter_start",
})


def lower_checked(fn, *args, platform: str):
    """``fn.lower(*args)`` (``fn`` jitted) for devices of ``platform``; on ``cpu`` a
    ``ConfigError`` instead when the program holds a reduction XLA would abort on."""
    if platform != "cpu":
        return fn.lower(*args)
    traced = fn.trace(*args)
    refuse_aborting_reductions(traced.jaxpr)
    return traced.lower()


def refuse_aborting_reductions(closed: core.ClosedJaxpr) -> None:
    """A ``ConfigError`` naming where ``closed`` reduces bfloat16 values over devices
    inside a partially manual ``shard_map`` (see the module docstring), else nothing."""
    found = list(_bf16_reductions(closed.jaxpr, manual=frozenset(), mesh_axes=frozenset()))
    if not found:
        return
    where = []
    for eqn, _ in found:
        line = f"{eqn.primitive.name} at {source_info_util.summarize(eqn.source_info)}"
        if line not in where:
            where.append(line)
    auto = ", ".join(sorted(found[0][1]))
    shown = "; ".join(where[:3]) + (f" (and {len(where) - 3} more)" if len(where) > 3 else "")
    raise ConfigError(
        f"the step sums bfloat16 values over devices inside a shard_map that leaves mesh axes "
        f"automatic ({auto}), which XLA's CPU compiler aborts on: {shown}. Reduce in float32 "
        f"(cast before the collective; for a weight cast to bfloat16 inside the shard_map, "
        f"lax.pcast it to varying over the shard_map's axes first), or make the shard_map "
        f"manual over every mesh axis; GPUs compile it as it is")


def _bf16_reductions(jaxpr: core.Jaxpr, manual: frozenset, mesh_axes: frozenset) -> Iterator:
    """(equation, the mesh axes left automatic) for each bfloat16 reduction over devices
    in ``jaxpr`` that runs where some mesh axes are manual and some are not."""
    for eqn in jaxpr.eqns:
        inner_manual, inner_axes = manual, mesh_axes
        if eqn.primitive.name == "shard_map":
            mesh = eqn.params["mesh"]
            inner_axes = frozenset(mesh.axis_names)
            inner_manual = frozenset(getattr(mesh, "manual_axes", ())) | frozenset(
                eqn.params.get("newly_manual_axes", ()))
        elif (eqn.primitive.name in _REDUCTIONS and manual and manual != mesh_axes
              and any(getattr(v.aval, "dtype", None) == jnp.bfloat16 for v in eqn.invars)):
            yield eqn, mesh_axes - manual
        for sub in core.jaxprs_in_params(eqn.params):
            yield from _bf16_reductions(sub, inner_manual, inner_axes)


def platform_of(mesh: jax.sharding.Mesh) -> str:
    """The platform of ``mesh``'s devices (``cpu``, ``gpu``, ``tpu``)."""
    return mesh.devices.flat[0].platform
