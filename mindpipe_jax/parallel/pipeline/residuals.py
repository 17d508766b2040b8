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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Literal, jaxpr_as_fun


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

    def forward(self, params, x, buffers, slot):
        """Stage output; this microbatch's residuals written into ``slot``."""
        y, *leaves = jaxpr_as_fun(self._closed)(*jax.tree_util.tree_leaves(params), x)
        kept = [leaf for leaf, (kind, _) in zip(leaves, self._sources, strict=True) if kind == "buffer"]
        buffers = [lax.dynamic_update_index_in_dim(buf, leaf.astype(buf.dtype), slot, 0)
                   for buf, leaf in zip(buffers, kept, strict=True)]
        return y, buffers

    def backward(self, params, buffers, slot, dy):
        """(parameter gradient, input gradient) of the microbatch held in ``slot``."""
        flat = jax.tree_util.tree_leaves(params)
        leaves = []
        for kind, where in self._sources:
            if kind == "param":
                leaves.append(flat[where])
            elif kind == "buffer":
                leaves.append(lax.dynamic_index_in_dim(buffers[where], slot, 0, keepdims=False))
            else:
                leaves.append(where)
        return jax.tree_util.tree_unflatten(self._treedef, leaves)(dy)
