"""What one device computes for one task: the branches of a fused tick's parts.

Every branch of a part returns the same structure (``lax.switch`` and the lockstep
``cond``s need it), and only what that part makes:

* F part: ``{"send": activation for the next stage, "res": residual slots}``;
* backward part (BW or B): ``{"send": input gradient, "grads": ...}``;
* W part: ``{"grads": ...}``;

where ``grads`` holds this task's contribution (``"chunk"``: the chunk's weight
gradient, ``"embed"`` / ``"head"``: the first / last stage's, ``"loss"``). The
accumulators never enter a branch: ``ticks.py`` adds a contribution under a
``cond`` on the table, so idle and forward ticks touch no accumulator.

Remat policies (``tickplan.REMAT_POLICIES``): "none" keeps the forward's
residuals (``residuals.py``); "dots" keeps the residuals of each layer under
``jax.checkpoint`` with ``dots_with_no_batch_dims_saveable``; "full" keeps only the
stage input and re-runs the stage's forward in its backward. The last stage's
forward is folded into its backward (the loss and its gradient are one vjp), so
its F computes nothing.

Known cost: with a split backward (ZB-H1) the B and the W task each form the
whole vjp of the stage and keep their half; XLA drops the unused weight half of
a B, but a W still costs about a full backward (benchmarks/pipeline.py).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from mindpipe_jax.parallel.pipeline.runtime.residuals import ResidualStore
from mindpipe_jax.parallel.pipeline.runtime.spmd import _take, _vary, _zeros_like
from mindpipe_jax.parallel.pipeline.runtime.tickplan import FIRST, LAST, Plan
from mindpipe_jax.parallel.pipeline.schedules import Kind


def layers_runner(layer, counts, width, lockstep):
    """``run(chunk params, h) -> h``: a chunk's layers in a ``lax.scan``. With uneven
    stages (``counts`` not None) the params carry the real layer count ``n`` and
    padded layers are skipped (``cond``) or, in lockstep, computed and dropped."""
    def run_layers(c, x):
        if counts is None:
            return lax.scan(lambda h, lp: (layer(lp, h), None), x, c)[0]

        def one(h, xs):
            lp, i = xs
            if lockstep:  # the layer count differs per stage: compute, then keep or drop
                return jnp.where(i < c["n"], layer(lp, h), h), None
            return lax.cond(i < c["n"], layer, lambda _, hh: hh, lp, h), None
        return lax.scan(one, x, (c["w"], jnp.arange(width)))[0]
    return run_layers


class StageTasks:
    """The branch functions of every part, for one device inside ``shard_map``.

    ``params``: this device's ``embed``, ``chunks`` (``[v, L_chunk, ...]``) and
    ``head``; ``counts``: ``[p, v]`` layer counts of uneven stages (None: even);
    ``data``: the device's ``inputs`` and ``targets`` (``[m, rows, length]``)."""

    def __init__(self, fns, plan: Plan, params, data, counts, width, stage_idx, *, lockstep, fill,
                 num_microbatches):
        self.fns, self.plan = fns, plan
        self.embed_p, self.chunks, self.head_p = params["embed"], params["chunks"], params["head"]
        self.inputs, self.targets = data
        self.counts, self.stage_idx = counts, stage_idx
        self.run_layers = layers_runner(fns.layer, counts, width, lockstep)
        # What a stage under each residual policy differentiates (per layer, so the
        # policy applies inside the scan over the chunk's layers). A backward that
        # re-runs the forward uses "dots" per layer: the vjp then holds one layer's
        # full residuals at a time instead of the whole chunk's (measured: 32 -> 20 MB
        # per device for 1F1B p=4 with two GPT blocks per stage) for the price of
        # re-running attention and elementwise work, a few percent of a layer.
        dots = jax.checkpoint(fns.layer, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
        self.recompute_layers = layers_runner(dots, counts, width, lockstep)
        residual_fns = {"none": self.run_layers, "dots": self.recompute_layers}
        h_shape = jax.eval_shape(fns.embed, self.embed_p, self.inputs[0])
        self.zero_h = _vary(jnp.zeros(h_shape.shape, h_shape.dtype))
        self.h_shape = h_shape
        self.stores = {r: ResidualStore(residual_fns[r], self.chunk_params(0), self.zero_h)
                       for r in plan.res_slots}
        self.fill = fill
        self.seed = _vary(jnp.asarray(1.0 / num_microbatches, jnp.float32))

    # ------------------------------------------------------------------ helpers
    def chunk_params(self, chunk):
        if self.counts is None:
            return _take(self.chunks, chunk)
        return {"w": _take(self.chunks, chunk), "n": self.counts[self.stage_idx, chunk]}

    def weights(self, d_c):  # drop the (float0) cotangent of the layer count
        return d_c if self.counts is None else d_c["w"]

    def zero_grads(self):
        return {"chunk": _zeros_like(_take(self.chunks, 0), jnp.float32),
                "embed": _zeros_like(self.embed_p, jnp.float32),
                "head": _zeros_like(self.head_p, jnp.float32), "loss": jnp.zeros((), jnp.float32)}

    def residual_buffers(self):
        return {r: self.stores[r].empty(n, self.fill) for r, n in self.plan.res_slots.items()}

    def first_fwd(self, e_params, c_params, tokens, layers):
        return layers(c_params, self.fns.embed(e_params, tokens))

    # ------------------------------------------------------------- the parts
    def forward_branches(self):
        """F: ``op = {task, x, res}`` -> ``{send, res}``."""
        def idle(op):
            return {"send": self.zero_h, "res": op["res"]}

        def make(pos, policy):
            def run(op):
                task, x, res = op["task"], op["x"], op["res"]
                if pos == LAST:  # the last stage's forward runs inside its backward
                    return idle(op)
                c_params = self.chunk_params(task["chunk"])
                tokens = _take(self.inputs, task["microbatch"])
                if policy == "full":  # the stage input stays in its slot until the backward
                    y = (self.first_fwd(self.embed_p, c_params, tokens, self.run_layers) if pos == FIRST
                         else self.run_layers(c_params, x))
                    return {"send": y, "res": res}
                h = self.fns.embed(self.embed_p, tokens) if pos == FIRST else x
                y, kept = self.stores[policy].forward(c_params, h)
                return {"send": y, "res": {**res, policy: kept}}
            return run

        return self._branches(0, idle, make)

    def backward_branches(self):
        """BW or B: ``op = {task, x, dy, res}`` -> ``{send, grads}``."""
        return self._branches(1, lambda op: {"send": self.zero_h, "grads": self.zero_grads()},
                              lambda pos, policy, kind: self._backward(pos, policy, kind))

    def weight_branches(self):
        """W: ``op = {task, x, dy, res}`` -> ``{grads}``."""
        def make(pos, policy, kind):
            run = self._backward(pos, policy, kind)
            return lambda op: {"grads": run(op)["grads"]}
        return self._branches(2, lambda op: {"grads": self.zero_grads()}, make)

    def _branches(self, part, idle, make):
        keys = self.plan.parts[part].keys
        takes_kind = part != 0
        made = [make(pos, policy, kind) if takes_kind else make(pos, policy) for kind, pos, policy in keys]
        return [lambda op: _vary(idle(op))] + [lambda op, fn=fn: _vary(fn(op)) for fn in made]

    def _backward(self, pos, policy, kind):
        """A backward task of any kind: BW forms both halves, B keeps the input
        gradient (and the loss), W keeps the weight gradients."""
        want_w = kind in (Kind.BW, Kind.W)
        want_x = kind in (Kind.BW, Kind.B)

        def run(op):
            task, x, dy, res = op["task"], op["x"], op["dy"], op["res"]
            c_params = self.chunk_params(task["chunk"])
            tokens = _take(self.inputs, task["microbatch"])
            grads = self.zero_grads()
            if pos == LAST:
                # The last stage's forward runs here, inside its vjp: its policy only
                # decides whether that vjp holds plain or "dots" residuals.
                layers = self.run_layers if policy == "none" else self.recompute_layers
                tgt = _take(self.targets, task["microbatch"])
                fn = lambda c, h, xx: self.fns.head_loss(h, layers(c, xx), tgt)  # noqa: E731
                loss, vjp = jax.vjp(fn, c_params, self.head_p, x)
                d_c, d_h, d_x = vjp(self.seed)
                if want_x:  # B or BW: counted once per microbatch
                    grads["loss"] = loss.astype(jnp.float32)
                if want_w:
                    grads["head"], grads["chunk"] = d_h, self.weights(d_c)
                return {"send": d_x if want_x else self.zero_h, "grads": grads}
            d_e, d_c, d_x = self._stage_vjp(op, c_params, tokens, pos, policy, x, dy, res)
            if want_w:
                grads["chunk"] = self.weights(d_c)
                if d_e is not None:
                    grads["embed"] = d_e
            return {"send": d_x if want_x and pos != FIRST else self.zero_h, "grads": grads}
        return run

    def _stage_vjp(self, op, c_params, tokens, pos, policy, x, dy, res):
        """(embed grad or None, chunk grad, input grad) of a first or middle stage."""
        if policy == "full":
            if pos == FIRST:
                _, vjp = jax.vjp(partial(self.first_fwd, layers=self.recompute_layers),
                                 self.embed_p, c_params, tokens)
                d_e, d_c, _ = vjp(dy)
                return d_e, d_c, self.zero_h
            d_c, d_x = jax.vjp(self.recompute_layers, c_params, x)[1](dy)
            return None, d_c, d_x
        d_c, d_x = self.stores[policy].backward(c_params, res[policy], dy)
        if pos == FIRST:  # re-running the embedding lookup is cheaper than keeping it
            _, vjp = jax.vjp(self.fns.embed, self.embed_p, tokens)
            return vjp(d_x.astype(self.zero_h.dtype))[0], d_c, self.zero_h
        return None, d_c, d_x
