"""A stage's forward residuals, traced once and kept per microbatch in slot buffers.

``jax.vjp`` returns the backward as a pytree whose leaves are the residuals. The
forward of a later tick and the backward of an even later one run in different
``lax.switch`` branches, so both must agree on that pytree. It is traced once,
with ``jax.make_jaxpr`` inside the ``shard_map`` body (the residual tree differs
between inside and outside), and every forward evaluates that same jaxpr, so the
leaves always come in the same order and the backward is rebuilt with the same
treedef.

Residuals that are the stage's own weights (JAX forwards them straight through)
are not buffered per microbatch: the backward reads them from the parameters.

The slot buffers never enter the runtime's ``lax.switch``: one slot is read
before it and written back after it, so each branch handles one microbatch's
residuals, not copies of every slot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Literal

from mindpipe_jax.parallel.pipeline.runtime.jaxpr_tools import replay


class ResidualStore:
    def __init__(self, stage_fn, params_example, x_example):
        flat, self._params_tree = jax.tree_util.tree_flatten(params_example)
        captured = {}

        def forward(flat_params, x):
            params = jax.tree_util.tree_unflatten(self._params_tree, flat_params)
            y, vjp_fn = jax.vjp(stage_fn, params, x)
            leaves, captured["treedef"] = jax.tree_util.tree_flatten(vjp_fn)
            return y, leaves

        self._closed = jax.make_jaxpr(forward)(flat, x_example)
        self._treedef = captured["treedef"]
        n_params = len(flat)
        param_index = {var: i for i, var in enumerate(self._closed.jaxpr.invars[:n_params])}
        self._sources = []  # per residual leaf: ("param", i) | ("buffer", j) | ("const", value)
        self.buffer_avals = []
        outvars = self._closed.jaxpr.outvars[1:]
        for var, aval in zip(outvars, self._closed.out_avals[1:], strict=True):
            if isinstance(var, Literal):
                self._sources.append(("const", var.val))
            elif var in param_index:
                self._sources.append(("param", param_index[var]))
            else:
                self._sources.append(("buffer", len(self.buffer_avals)))
                self.buffer_avals.append(aval)

    def empty(self, slots: int, fill: float):
        return [jnp.full((slots, *a.shape), fill, a.dtype) for a in self.buffer_avals]

    def forward(self, params, x):
        """(stage output, this microbatch's residuals to keep): one slot's worth."""
        y, *leaves = replay(self._closed)(*jax.tree_util.tree_leaves(params), x)
        kept = [leaf for leaf, (kind, _) in zip(leaves, self._sources, strict=True) if kind == "buffer"]
        return y, kept

    def backward(self, params, kept, dy):
        """(parameter gradient, input gradient) from one microbatch's kept residuals."""
        flat = jax.tree_util.tree_leaves(params)
        leaves = []
        for kind, where in self._sources:
            if kind == "param":
                leaves.append(flat[where])
            elif kind == "buffer":
                leaves.append(kept[where])
            else:
                leaves.append(where)
        return jax.tree_util.tree_unflatten(self._treedef, leaves)(dy)

    @staticmethod
    def read(buffers, slot):
        return [lax.dynamic_index_in_dim(b, slot, 0, keepdims=False) for b in buffers]

    @staticmethod
    def write(buffers, slot, kept):
        return [lax.dynamic_update_index_in_dim(b, k.astype(b.dtype), slot, 0)
                for b, k in zip(buffers, kept, strict=True)]
