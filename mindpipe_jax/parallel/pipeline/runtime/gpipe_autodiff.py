"""GPipe by autodiff through a scan (MaxText-style): the oracle and the baseline.

This is how the JAX world's pipelines (MaxText's circular pipeline with one
repeat, Praxis) run a pipeline: the forward is a ``lax.scan`` over ``m + p - 1``
iterations inside ``jax.shard_map``; in every iteration *every* stage applies its
layers to the state it holds (stage 0 first takes the embedding of microbatch
``i``), then one cyclic ``ppermute`` moves every state one stage down the ring.
The last stage's outputs of iterations ``p - 1 .. m + p - 2`` are microbatches
``0 .. m - 1``; the head loss runs on them after the scan. The backward is
whatever ``jax.value_and_grad`` makes of that program (a reverse scan whose
``ppermute``s go up the ring), so:

* every bubble iteration computes (garbage), forward and backward, on every
  stage: executed work is ``(m + p - 1) / m`` of the useful work, more with remat;
* without remat the scan keeps every iteration's residuals: activation memory
  grows linearly with ``m``;
* ``remat=True`` wraps the iteration's compute in ``jax.checkpoint`` with a
  policy that saves only the iteration's input (MaxText's default), so the
  backward recomputes one stage forward per iteration.

Bubble iterations are masked: a stage whose iteration holds no microbatch feeds
zeros (not the garbage it holds) to its layers and passes zeros on, so whatever
sits in a bubble (even NaN, see ``nan_bubbles``) never reaches a result, forward
or backward.

The batch axes (``data``, ``fsdp``) are manual too, as in ``runtime.py``: each
shard runs the pipeline on its rows and the loss is averaged over shards, so the
compiler never partitions the pipeline's body (XLA 0.10's SPMD partitioner
aborted on that in the runtime). The gradient is taken *outside* the
``shard_map`` like MaxText does: the parameters enter replicated (``P()``) or
sharded by stage (``P('pipe')``), are cast to device-varying once at the top of
the body, and the transpose of that cast is the one gradient ``psum`` at the end.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from mindpipe_jax.parallel.mesh import manual_axis_names
from mindpipe_jax.parallel.pipeline.runtime.spmd import AXIS, BATCH, EXPERT, MANUAL, StageFns, _vary

ITERATION_INPUT = "iteration_input"


def stage_fn(fns: StageFns):
    """``(stage params [L/p, ...], h) -> h``: the stage's layers run with ``lax.scan``."""
    if not hasattr(fns, "layer"):  # an older contract that hands over the whole stage
        return fns.stage

    def run(stage_p, h):
        return lax.scan(lambda x, layer_p: (fns.layer(layer_p, x), None), h, stage_p)[0]
    return run


def gpipe_autodiff_grads(fns: StageFns, p: int, m: int, mesh, *, remat: bool,
                         nan_bubbles: bool = False):
    """Build ``f(embed_p, blocks_p, head_p, inputs, targets) -> (loss, grads)``.

    Same contract as ``runtime.pipeline_grads``: ``blocks_p`` leaves have a leading
    layer axis ``L`` divisible by ``p`` (stage ``s`` holds layers ``s L/p .. (s+1) L/p
    - 1``); ``inputs`` and ``targets`` are ``[m, microbatch, length]``; the loss is
    the mean over the ``m`` microbatches and ``grads`` is ``{"embed", "blocks",
    "head"}`` with the structure of the parameters.
    ``remat``: save only each iteration's input and recompute the stage forward in
    the backward (MaxText's default policy).
    ``nan_bubbles``: a test mode that starts every stage's state as NaN, so a bubble
    that leaked into a result would show.
    """
    if mesh.shape.get(EXPERT, 1) > 1:  # its specs enter every weight whole (no experts.py)
        raise ValueError(f"the GPipe-autodiff baseline does not split experts: expert={mesh.shape[EXPERT]}")
    iterations = m + p - 1
    run_layers = stage_fn(fns)
    fwd_perm = [(i, (i + 1) % p) for i in range(p)]

    def compute(stage_p, embed_p, state, tokens, stage_idx, i):
        """One iteration's compute on one stage: its microbatch is ``i - stage``."""
        state = checkpoint_name(state, ITERATION_INPUT)
        valid = (i >= stage_idx) & (i - stage_idx < m)
        x = jnp.where(stage_idx == 0, fns.embed(embed_p, tokens).astype(state.dtype), state)
        x = jnp.where(valid, x, jnp.zeros_like(x))  # bubbles compute on zeros, never garbage
        y = run_layers(stage_p, x)
        return jnp.where(valid, y, jnp.zeros_like(y))

    if remat:
        compute = jax.checkpoint(
            compute, policy=jax.checkpoint_policies.save_only_these_names(ITERATION_INPUT))

    def body(embed_p, blocks_p, head_p, inputs, targets):
        stage_idx = lax.axis_index(AXIS)
        # One cast to device-varying here; its transpose is the single gradient psum.
        embed_p, head_p = _vary(embed_p), _vary(head_p)
        stage_p = _vary(jax.tree.map(lambda x: x[0], blocks_p))  # this stage's [L/p, ...]
        inputs, targets = _vary(inputs), _vary(targets)
        h = jax.eval_shape(fns.embed, embed_p, inputs[0])
        state = _vary(jnp.full(h.shape, jnp.nan if nan_bubbles else 0.0, h.dtype))

        def iteration(state, i):
            tokens = lax.dynamic_index_in_dim(inputs, jnp.minimum(i, m - 1), 0, keepdims=False)
            y = compute(stage_p, embed_p, state, tokens, stage_idx, i)
            # Every device takes part in the shift every iteration (outside any branch).
            return lax.ppermute(y, AXIS, fwd_perm), y

        _, ys = lax.scan(iteration, state, jnp.arange(iterations))
        outs = ys[p - 1:]  # on the last stage: microbatch j's output at iteration j + p - 1

        def head(outs):
            losses = jax.vmap(fns.head_loss, in_axes=(None, 0, 0))(head_p, outs, targets)
            return jnp.mean(losses.astype(jnp.float32))

        # Only the last stage holds real outputs; the others skip the head.
        loss = lax.cond(stage_idx == p - 1, head, lambda _: _vary(jnp.zeros((), jnp.float32)), outs)
        # Shards hold equal row counts: the global mean is the mean of shard means.
        return lax.pmean(lax.psum(loss, AXIS), BATCH)

    def loss_fn(params, inputs, targets):
        staged = jax.tree.map(lambda x: x.reshape(p, x.shape[0] // p, *x.shape[1:]), params["blocks"])
        rows = P(None, BATCH)
        fn = jax.shard_map(body, mesh=mesh, axis_names=manual_axis_names(mesh, MANUAL),
                           in_specs=(P(), P(AXIS), P(), rows, rows), out_specs=P())
        return fn(params["embed"], staged, params["head"], inputs, targets)

    def run(embed_p, blocks_p, head_p, inputs, targets):
        params = {"embed": embed_p, "blocks": blocks_p, "head": head_p}
        return jax.value_and_grad(loss_fn)(params, inputs, targets)

    return run
