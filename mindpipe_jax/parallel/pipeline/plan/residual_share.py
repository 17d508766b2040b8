"""What a forward keeps for its backward, per device, when ``tensor`` splits the layer.

The profile measures a layer whole on one device. Over ``tensor`` devices the runtime's
residual slots hold what XLA lays out there: the attention heads and the MLP's hidden
units split, the residual stream and the norms' statistics whole. ``residual_sizer``
reads that layout instead of guessing it: the forward that fills a residual slot
(``runtime.residuals.ResidualStore``) is compiled on a mesh of ``tensor`` of this
machine's devices with the parameters at their compute shardings, and each residual is
counted at the shard its output sharding gives one device.
"""

from __future__ import annotations

import math
from collections.abc import Callable


def residual_sizer(split, state, tensor: int) -> tuple[Callable, bool]:
    """(``size(fn, params, x, part) -> bytes one device keeps``, whether that is per
    device over ``tensor``). ``split``: the model's ``contract.PipelineModel``;
    ``state``: its ``nnx.Param`` state (logical names give the compute shardings);
    ``part``: "embed", "blocks" (one unit) or "head". Where the layout cannot be read
    (``tensor`` 1, fewer local devices than ``tensor``, or a stack the step builds
    itself) the residuals are counted whole: an upper bound."""
    import jax
    import numpy as np
    from flax import nnx
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from mindpipe_jax.parallel.mesh import MESH_ORDER
    from mindpipe_jax.parallel.pipeline.plan.profile import residual_bytes
    from mindpipe_jax.parallel.pipeline.runtime.residuals import ResidualStore
    from mindpipe_jax.parallel.rules import state_shardings

    def whole(fn, params, x, part):
        return residual_bytes(fn, params, x)

    # This process's devices only: another process's would make the compile a collective
    # one (the online repartition measures on process 0 alone).
    devices = jax.local_devices()
    if tensor <= 1 or len(devices) < tensor or split.stacks_in_step:
        return whole, False
    shape = tuple(tensor if a == "tensor" else 1 for a in MESH_ORDER)
    mesh = Mesh(np.asarray(devices[:tensor]).reshape(shape), MESH_ORDER,
                axis_types=(AxisType.Auto,) * len(MESH_ORDER))
    embed, stack, head = split.split(nnx.to_pure_dict(state_shardings(state, mesh, "compute")))
    # One unit: its shardings without the stack's leading layer axis.
    unit = jax.tree.map(lambda s: NamedSharding(mesh, P(*tuple(s.spec)[1:])), stack)
    shardings = {"embed": embed, "blocks": unit, "head": head}
    replicated = NamedSharding(mesh, P())

    def size(fn, params, x, part):
        store = ResidualStore(fn, params, x)
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (params, x))
        with jax.set_mesh(mesh):  # the model's activation constraints read it
            compiled = jax.jit(lambda p, h: store.forward(p, h)[1],
                               in_shardings=(shardings[part], replicated)).lower(*abstract).compile()
        return float(sum(math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize
                         for s, a in zip(compiled.output_shardings, store.buffer_avals, strict=True)))

    return size, True
