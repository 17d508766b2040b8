"""Find a model's pipeline parts in its traced loss: the scan over its layer stack.

A model that neither has ``pipeline_parts()`` nor the reference attributes is
traced once (``jax.make_jaxpr`` of its loss) and cut at equation level around
the ``scan`` whose per-iteration inputs are parameters with a leading layer axis
— what ``nnx.scan``, ``lax.scan`` over ``nnx.split`` blocks and Linen's
``nn.scan`` all lower to, whatever the attribute is called:

* prologue: the equations that compute the scan's carry (the hidden state) from
  the parameters and the tokens;
* unit: the scan body, with its loop-invariant inputs (constants such as rotary
  tables) recomputed from nothing in every call;
* epilogue: the equations from the scan's output to the loss, with whatever
  they need from before the scan recomputed from the parameters.

What cannot be cut so is refused with the reason and the hook that avoids it: a
loop-invariant input that depends on the tokens or on a parameter (it would have
to travel to every stage), per-layer outputs, more than one carried value, an
epilogue that reads the tokens. A jaxpr has fixed shapes, so each new microbatch
shape is traced once more (cached per row count).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax._src.interpreters.partial_eval import dce_jaxpr
from jax.extend.core import Literal, Var

from mindpipe_jax.errors import ConfigError

_ROOT_PARAMS, _ROOT_TOKENS, _ROOT_TARGETS = "params", "tokens", "targets"


def live_inputs(jaxpr) -> set:
    """The input vars a jaxpr's outputs really depend on (dead reads do not count).
    JAX's own dead-code elimination: it follows values into scan, cond and jit bodies
    (a key split over a layer scan and never drawn from is dead), where an
    equation-level walk counts every input of such an equation as read."""
    used = dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))[1]
    return {v for v, u in zip(jaxpr.invars, used, strict=True) if u}


def needed_eqns(eqns, outputs, stop_eqn=None):
    """Equations needed for ``outputs``, in order (never ``stop_eqn``), and the vars
    they read that no included equation defines."""
    needed = {v for v in outputs if isinstance(v, Var)}
    keep = []
    for eqn in reversed(eqns):
        if eqn is stop_eqn or not any(v in needed for v in eqn.outvars):
            continue
        keep.append(eqn)
        needed |= {v for v in eqn.invars if isinstance(v, Var)}
    keep.reverse()
    defined = {v for e in keep for v in e.outvars}
    return keep, needed - defined


def run_eqns(eqns, env: dict) -> dict:
    def read(v):
        return v.val if isinstance(v, Literal) else env[v]
    for eqn in eqns:
        with eqn.ctx.manager:  # as jax's own evaluator does (e.g. compute-on / metadata contexts)
            out = eqn.primitive.bind(*map(read, eqn.invars), **eqn.primitive.get_bind_params(eqn.params))
        for var, val in zip(eqn.outvars, out if eqn.primitive.multiple_results else [out], strict=True):
            env[var] = val
    return env


class TracedSplit:
    """The cut of one traced loss (one microbatch shape). ``loss(leaves, tokens,
    targets)`` takes the parameter leaves in ``names`` order."""

    def __init__(self, loss: Callable, names: list[str], leaves, tokens, targets, model_name: str,
                 hook: str):
        closed = jax.make_jaxpr(loss)(leaves, tokens, targets)
        jaxpr = closed.jaxpr
        self._consts = dict(zip(jaxpr.constvars, closed.consts, strict=True))
        params = jaxpr.invars[:len(names)]
        self._param_vars = dict(zip(names, params, strict=True))
        self._tokens, self._targets = jaxpr.invars[len(names):]
        name_of = {v: n for n, v in self._param_vars.items()}

        def refuse(why: str):
            raise ConfigError(f"model {model_name} does not follow the pipeline contract and cannot be "
                              f"split into stages automatically: {why}; keep its layers in one nnx.List "
                              f"(or nnx.Sequential) that it calls in order, or give it a {hook}() method "
                              f"(mindpipe_jax.PipelineParts) or attributes embed, blocks (stacked) and head")

        scans = []
        for eqn in jaxpr.eqns:
            if eqn.primitive.name != "scan":
                continue
            k = eqn.params["num_consts"] + eqn.params["num_carry"]
            stacked = [v for v in eqn.invars[k:] if v in name_of]
            if stacked:
                scans.append((len(stacked), eqn))
        if not scans:
            refuse("its loss has no scan over stacked parameters (a layer stack created with nnx.vmap "
                   "and run with nnx.scan / lax.scan, or Linen's nn.scan)")
        scan = max(scans, key=lambda s: s[0])[1]
        n_consts, n_carry = scan.params["num_consts"], scan.params["num_carry"]
        if n_carry != 1:
            refuse(f"its layer scan carries {n_carry} values; the pipeline passes one hidden state")
        xs = scan.invars[n_consts + 1:]
        if not all(v in name_of for v in xs):
            refuse("its layer scan also iterates over values that are not parameters (per-layer "
                   "inputs such as keys, or stacked nnx.Variable buffers)")
        self.stack_names = [name_of[v] for v in xs]
        self.num_units = scan.params["length"]

        # Loop invariants: recomputed in every unit call, so they may depend on nothing but
        # the tokens (a padding mask), which the hidden state then carries (carry_tokens.py).
        self._const_eqns, free = needed_eqns(jaxpr.eqns, scan.invars[:n_consts])
        if free - set(self._consts) - {self._tokens}:
            refuse("its layer scan reads values computed from parameters outside the stack (they "
                   "would have to travel to every stage)")
        self.unit_reads_tokens = self._tokens in free
        self._const_vars = scan.invars[:n_consts]
        self._body = scan.params["jaxpr"]
        self._prologue, free = needed_eqns(jaxpr.eqns, [scan.invars[n_consts]])
        if self._targets in free:
            refuse("what runs before its layer stack reads the targets")
        self._prologue_out = scan.invars[n_consts]
        self.prologue_names = sorted(name_of[v] for v in free if v in name_of)
        self._epilogue, free = needed_eqns(jaxpr.eqns, jaxpr.outvars[:1], stop_eqn=scan)
        self.loss_reads_tokens = self._tokens in free  # (a loss mask from the inputs)
        if free & set(scan.outvars[1:]):
            refuse("its loss uses the layer scan's per-layer outputs")
        self._hidden, self._loss = scan.outvars[0], jaxpr.outvars[0]
        self.epilogue_names = sorted(name_of[v] for v in free if v in name_of)
        self.hidden = self._prologue_out.aval

    def prologue(self, params: dict, tokens):
        env = {**self._consts, self._tokens: tokens}
        env.update({self._param_vars[n]: params[n] for n in self.prologue_names})
        return run_eqns(self._prologue, env)[self._prologue_out]

    def unit(self, unit: dict, h, tokens=None):
        """One layer on ``h``; ``tokens``: the microbatch's, where its invariants read them."""
        given = {} if tokens is None else {self._tokens: tokens}
        consts = run_eqns(self._const_eqns, {**self._consts, **given})
        body = self._body
        args = [consts[v] if isinstance(v, Var) else v.val for v in self._const_vars]
        env = dict(zip(body.jaxpr.constvars, body.consts, strict=True))
        env.update(zip(body.jaxpr.invars, [*args, h, *(unit[n] for n in self.stack_names)], strict=True))
        out = run_eqns(body.jaxpr.eqns, env)
        v = body.jaxpr.outvars[0]
        return v.val if isinstance(v, Literal) else out[v]

    def epilogue(self, params: dict, h, targets, tokens=None):
        given = {} if tokens is None else {self._tokens: tokens}
        env = {**self._consts, self._hidden: h, self._targets: targets, **given}
        env.update({self._param_vars[n]: params[n] for n in self.epilogue_names})
        v = self._loss
        return v.val if isinstance(v, Literal) else run_eqns(self._epilogue, env)[v]
