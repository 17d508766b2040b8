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

A split backward (B and W tasks: ZB-H1, ZB-V, DualPipeV's B/W) is split at the
level of its equations (``bwsplit.ChunkSplit``): the F keeps the split's residuals,
the B computes the input gradient and stashes exactly what the W reads, the W forms
the weight gradients from that stash alone; B + W execute one backward's work. A BW
on such a stage (DualPipeV's, or an unsplit microbatch's under ``parallel.split_last``)
runs the unsplit backward on the split's residuals (``ChunkSplit.fused``).
Uneven stages (padded layer stacks) and a shallow subnet's pass skip the layers
past their count in the F, the B and the W alike.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from mindpipe_jax.parallel.pipeline.runtime.bwsplit import ChunkSplit
from mindpipe_jax.parallel.pipeline.runtime.residuals import ResidualStore
from mindpipe_jax.parallel.pipeline.runtime.spmd import _take, _vary, _zeros_like
from mindpipe_jax.parallel.pipeline.runtime.tickplan import EITHER, FIRST, LAST, Plan, split_mode
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
        self.fns, self.plan, self.lockstep = fns, plan, lockstep
        self.embed_p, self.chunks, self.head_p = params["embed"], params["chunks"], params["head"]
        # One chunk's layers, whole: the shapes the branches trace with (with ``chunks``
        # kept as fsdp shards, the tick hands each task its gathered chunk).
        self.example = params.get("chunk_example", _take(self.chunks, 0))
        # Per-microbatch block inputs (``pipeline_grads(block_context=...)``): leaves
        # ``[v, L_chunk, m, ...]``; a task's layers see its microbatch's rows beside their
        # weights. Not weights: their cotangents are dropped.
        self.context = params.get("context")
        self.layer_example = self.example if self.context is None else \
            {**self.example, **jax.tree.map(lambda a: a[0][:, 0], self.context)}
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
        self.stores = {r: ResidualStore(residual_fns[r], self.chunk_params(0, self.layer_example),
                                        self.zero_h) for r in plan.res_slots if not r.startswith("split-")}
        # Split backwards (B, then W): one equation-level split per mode (``bwsplit``).
        layer_of = {"none": fns.layer, "dots": dots, "full": dots}
        modes = {r.removeprefix("split-") for r in plan.res_slots if r.startswith("split-")}
        modes |= {r.removeprefix("stash-") for r in plan.stash_slots}
        self.splits = {mode: ChunkSplit(layer_of[mode], {"layers": self.layer_example}, self.zero_h,
                                        policy="full" if mode == "full" else "none", lockstep=lockstep)
                       for mode in modes}
        self.fill = fill
        self.seed = _vary(jnp.asarray(1.0 / num_microbatches, jnp.float32))

    # ------------------------------------------------------------------ helpers
    def chunk_params(self, chunk, layers):
        """What ``run_layers`` takes for chunk ``chunk``: its ``layers`` (weights, and
        context rows if any), with the number of them that run where stages are uneven."""
        if self.counts is None:
            return layers
        return {"w": layers, "n": self.counts[self.stage_idx, chunk]}

    def _params(self, op):
        """A task's chunk: ``op["params"]`` (what the tick gathered for it, ``fsdp.py``'s
        per-chunk use) or this device's copy, its microbatch's context rows beside."""
        task = op["task"]
        layers = _take(self.chunks, task["chunk"]) if op.get("params") is None else op["params"]
        if self.context is not None:
            layers = {**layers, **jax.tree.map(lambda a: lax.dynamic_index_in_dim(
                _take(a, task["chunk"]), task["microbatch"], axis=1, keepdims=False), self.context)}
        return self.chunk_params(task["chunk"], layers)

    def split_params(self, op):
        """A task's chunk as a split backward takes it (``bwsplit.ChunkSplit``): the layers,
        with ``n``, how many of them run, where stages are uneven or a subnet is shallow."""
        c = self._params(op)
        return {"layers": c} if self.counts is None else {"layers": c["w"], "n": c["n"]}

    def weights(self, d_c):
        """The weights' part of a chunk's cotangent: without the (float0) cotangent of the
        layer count, or the context rows'."""
        if self.counts is not None:
            d_c = d_c["w"]
        return self.without_context(d_c)

    def without_context(self, d_layers):
        return d_layers if self.context is None else {k: d_layers[k] for k in self.example}

    def zero_grads(self):
        return {"chunk": _zeros_like(self.example, jnp.float32),
                "embed": _zeros_like(self.embed_p, jnp.float32),
                "head": _zeros_like(self.head_p, jnp.float32), "loss": jnp.zeros((), jnp.float32)}

    def residual_buffers(self):
        """Each residual buffer with its plan's slots and one spare (slot ``n``): where a
        forward that keeps nothing in the buffer writes what it hands back (``ticks``)."""
        def empty(r, n):
            if r.startswith("split-"):
                return [jnp.full((n, *a.shape), self.fill, a.dtype)
                        for a in self.splits[r.removeprefix("split-")].kept_avals]
            return self.stores[r].empty(n, self.fill)
        return {r: empty(r, n + 1) for r, n in self.plan.res_slots.items()}

    def stash_buffers(self):
        """What each split mode's B leaves for its W: the kept values the W reads, then the cut."""
        def avals(mode):
            split = self.splits[mode]
            kept = [] if mode == "full" else [a for a, r in zip(split.kept_avals, split.w_reads_kept,
                                                                  strict=True) if r]
            return [*kept, *split.cut_avals]
        return {r: [jnp.full((n, *a.shape), self.fill, a.dtype) for a in avals(r.removeprefix("stash-"))]
                for r, n in self.plan.stash_slots.items()}

    def first_fwd(self, e_params, c_params, tokens, layers):
        return layers(c_params, self.fns.embed(e_params, tokens))

    # A branch at position EITHER (``make_plan(merge_first=True)``) serves the first stage
    # and the middle ones: the embedding is computed on every device that runs it and kept
    # where the task is the first stage's (``task["position"]``), and so is its gradient.
    def _stage_input(self, pos, op, tokens):
        if pos == FIRST:
            return self.fns.embed(self.embed_p, tokens)
        if pos != EITHER:
            return op["x"]
        first = op["task"]["position"] == FIRST
        return jnp.where(first, self.fns.embed(self.embed_p, tokens).astype(op["x"].dtype), op["x"])

    def _embed_grad(self, tokens, d_h):
        """The embedding's gradient from the gradient at the stage input (re-running the
        lookup is cheaper than keeping it). On a middle stage running an EITHER branch it
        is formed and not added: ``ticks._gates`` adds it at the first stage's cells only."""
        _, vjp = jax.vjp(self.fns.embed, self.embed_p, tokens)
        return vjp(d_h.astype(self.zero_h.dtype))[0]

    def _sent_back(self, pos, op, d_x):
        """The input gradient a backward sends to the previous stage (none from the first)."""
        if pos == FIRST:
            return self.zero_h
        if pos != EITHER:
            return d_x
        return jnp.where(op["task"]["position"] == FIRST, self.zero_h, d_x)

    def _loss_at_output(self, pos, op, y):
        """A merged last stage's F (``Plan.merge_last``): ``{dy, grads: {head, loss}}``, the
        loss's gradient at the stage output (what its backward reads) and the head's. Run
        in a tick where some device runs the last stage's forward (in lockstep: the same
        predicate on every device, so the head's collectives are everyone's) and kept
        where the task is the last stage's (``ticks``: its ``g`` slot, its gates)."""
        none = {"dy": self.zero_h, "grads": {"head": _zeros_like(self.head_p, jnp.float32),
                                             "loss": jnp.zeros((), jnp.float32)}}
        if pos != EITHER:
            return none
        task = op["task"]
        tgt = _take(self.targets, task["microbatch"])

        def head(yy):
            loss, vjp = jax.vjp(lambda hp, h: self.fns.head_loss(hp, h, tgt), self.head_p, yy)
            d_head, d_y = vjp(self.seed)
            d_head = jax.tree.map(lambda g: g.astype(jnp.float32), d_head)
            return {"dy": d_y.astype(self.zero_h.dtype),
                    "grads": {"head": d_head, "loss": loss.astype(jnp.float32)}}
        now = task["head_now"] == 1 if self.lockstep else task["position"] == LAST
        return lax.cond(now, lambda yy: _vary(head(yy)), lambda yy: _vary(none), y)

    # ------------------------------------------------------------- the parts
    def forward_branches(self):
        """F: ``op = {task, x, res}`` -> ``{send, res}``, and with ``Plan.merge_last``
        ``{dy, grads}`` (``_loss_at_output``)."""
        merged = self.plan.merge_last

        def idle(op):
            out = {"send": self.zero_h, "res": op["res"]}
            return {**out, **self._loss_at_output(None, op, self.zero_h)} if merged else out

        def make(pos, policy):
            def run(op):
                task, res = op["task"], op["res"]
                if pos == LAST:  # the last stage's forward runs inside its backward
                    return idle(op)
                tokens = _take(self.inputs, task["microbatch"])
                if policy.startswith("split-") and policy != "split-full":
                    h = self._stage_input(pos, op, tokens)
                    y, kept = self.splits[policy.removeprefix("split-")].fwd(self.split_params(op), h)
                    return {"send": y, "res": {**res, policy: kept}}
                c_params = self._params(op)
                if policy in ("full", "split-full"):  # the stage input stays in its slot until the backward
                    y = (self.first_fwd(self.embed_p, c_params, tokens, self.run_layers) if pos == FIRST
                         else self.run_layers(c_params, self._stage_input(pos, op, tokens)))
                    return {"send": y, "res": res}
                h = self._stage_input(pos, op, tokens)
                y, kept = self.stores[policy].forward(c_params, h)
                return {"send": y, "res": {**res, policy: kept}}

            def run_with_loss(op):
                out = run(op)
                return {**out, **self._loss_at_output(pos, op, out["send"])}
            return run_with_loss if merged else run

        return self._branches(0, idle, make)

    def backward_branches(self):
        """BW or B: ``op = {task, x, dy, res, stash}`` -> ``{send, grads, stash}``."""
        def idle(op):
            return {"send": self.zero_h, "grads": self.zero_grads(), "stash": op["stash"]}

        def make(pos, policy, kind):
            if policy.startswith("split-"):
                # B, or a BW of a stage whose other backwards are split (DualPipeV's, or a
                # table that splits only its last microbatches): the unsplit backward on
                # the same residuals, at the fused vjp's cost, with no stash.
                return self._split_b(pos, policy.removeprefix("split-"), whole=kind is Kind.BW)
            run = self._backward(pos, policy, kind)
            return lambda op: {**run(op), "stash": op["stash"]}
        return self._branches(1, idle, make)

    def weight_branches(self):
        """W: ``op = {task, stash}`` (split) or ``{task, x, dy, res}`` -> ``{grads}``."""
        def make(pos, policy, kind):
            if policy.startswith("split-"):
                return self._split_w(pos, policy.removeprefix("split-"))
            run = self._backward(pos, policy, kind)
            return lambda op: {"grads": run(op)["grads"]}
        return self._branches(2, lambda op: {"grads": self.zero_grads()}, make)

    # ------------------------------------------------- split backward (B, then W)
    def _split_b(self, pos, policy, whole: bool = False):
        """B of a split stage: the input gradient now, and a stash of exactly what its W
        reads (``bwsplit``). The first stage's embedding gradient and the last stage's
        head gradient and loss are formed here (they hang off the B's own values).
        ``whole``: the stage's unsplit backward instead (a BW task): the input gradient
        and the chunk's weight gradients, nothing stashed."""
        mode = split_mode(policy, pos)
        split = self.splits[mode]
        name = "stash-" + mode

        def run(op):
            task, x, dy, res = op["task"], op["x"], op["dy"], op["res"]
            c_params = self.split_params(op)
            tokens = _take(self.inputs, task["microbatch"])
            grads = self.zero_grads()
            if pos == LAST:  # the stage's forward runs here: its layers, then the head's loss
                tgt = _take(self.targets, task["microbatch"])
                y, kept = split.fwd(c_params, x)
                loss, head_vjp = jax.vjp(lambda hp, yy: self.fns.head_loss(hp, yy, tgt), self.head_p, y)
                grads["head"], dy = head_vjp(self.seed)
                grads["loss"] = loss.astype(jnp.float32)
            elif mode == "full":
                kept = [self._stage_input(pos, op, tokens)]
            else:
                kept = res["split-" + policy]
            if whole:
                d_x, d_c = split.fused(c_params, kept, dy)
                grads["chunk"] = self.without_context(d_c["layers"])
                stash = op["stash"]
            else:
                d_x, cut = split.b(c_params, kept, dy)
                stash = {**op["stash"], name: cut if mode == "full" else [
                    k for k, r in zip(kept, split.w_reads_kept, strict=True) if r] + list(cut)}
            if pos in (FIRST, EITHER):
                grads["embed"] = self._embed_grad(tokens, d_x)
            send = self._sent_back(pos, op, d_x)
            return {"send": send, "grads": grads, "stash": stash}
        return run

    def _split_w(self, pos, policy):
        """W of a split stage: the chunk's weight gradients from its B's stash alone."""
        mode = split_mode(policy, pos)
        split = self.splits[mode]
        name = "stash-" + mode
        reads = split.w_reads_kept
        n_kept = 0 if mode == "full" else sum(reads)

        def run(op):
            c_params = self.split_params(op)
            stash = op["stash"][name]
            it = iter(stash[:n_kept])
            kept = [None] * len(reads) if mode == "full" else [next(it) if r else None for r in reads]
            grads = self.zero_grads()
            grads["chunk"] = self.without_context(split.w(c_params, kept, stash[n_kept:])["layers"])
            return {"grads": grads}
        return run

    def _branches(self, part, idle, make):
        keys = self.plan.parts[part].keys
        takes_kind = part != 0
        made = [make(pos, policy, kind) if takes_kind else make(pos, policy) for kind, pos, policy in keys]
        return [lambda op: _vary(idle(op))] + [lambda op, fn=fn: _vary(_grads_in_f32(fn(op))) for fn in made]

    def _backward(self, pos, policy, kind):
        """A backward task of any kind: BW forms both halves, B keeps the input
        gradient (and the loss), W keeps the weight gradients."""
        want_w = kind in (Kind.BW, Kind.W)
        want_x = kind in (Kind.BW, Kind.B)

        def run(op):
            task, x, dy, res = op["task"], op["x"], op["dy"], op["res"]
            c_params = self._params(op)
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
            d_e, d_c, d_x = self._stage_vjp(op, c_params, tokens, pos, policy, dy, res)
            if want_w:
                grads["chunk"] = self.weights(d_c)
                if d_e is not None:
                    grads["embed"] = d_e
            return {"send": self._sent_back(pos, op, d_x) if want_x else self.zero_h, "grads": grads}
        return run

    def _stage_vjp(self, op, c_params, tokens, pos, policy, dy, res):
        """(embed grad or None, chunk grad, input grad) of a first or middle stage."""
        if policy == "full":
            if pos == FIRST:
                _, vjp = jax.vjp(partial(self.first_fwd, layers=self.recompute_layers),
                                 self.embed_p, c_params, tokens)
                d_e, d_c, _ = vjp(dy)
                return d_e, d_c, self.zero_h
            h = self._stage_input(pos, op, tokens)
            d_c, d_x = jax.vjp(self.recompute_layers, c_params, h)[1](dy)
            return (self._embed_grad(tokens, d_x) if pos == EITHER else None), d_c, d_x
        d_c, d_x = self.stores[policy].backward(c_params, res[policy], dy)
        if pos == FIRST:
            return self._embed_grad(tokens, d_x), d_c, self.zero_h
        return (self._embed_grad(tokens, d_x) if pos == EITHER else None), d_c, d_x


def _grads_in_f32(out: dict) -> dict:
    """A branch's output with its gradients in float32, the accumulators' dtype (and what
    an idle branch returns): a model with bf16 parameters has bf16 gradients."""
    if "grads" not in out:
        return out
    return {**out, "grads": jax.tree.map(lambda g: g.astype(jnp.float32), out["grads"])}
