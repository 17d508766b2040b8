"""The pipeline model contract: where a model's layer stack is, and what runs around it.

A pipelined model is three parts: a **prologue** (tokens -> hidden, on the first
stage), a **stack** of units that the stages split (each unit: hidden -> hidden)
and an **epilogue** (hidden, targets -> mean loss, on the last stage). A model
says where they are in one of two ways:

* ``pipeline_parts()`` — a method returning ``PipelineParts(stack, prologue,
  epilogue)``: the stack's attribute path (``"model.layers"``) and two functions
  of the *whole* model, so an epilogue may use any parameter, e.g. the input
  embedding's table as the output projection (tied embeddings);
* the reference shape: attributes ``embed``, ``blocks`` and ``head`` with
  ``head.loss(h, targets)`` (what ``models/gpt.py`` has).

Without either, a model calling one ``nnx.List`` of layers in order gets its parts
from ``list_parts.py``; failing that, the stack is found in its traced loss
(``autosplit.py``).

The stack is either a module created stacked (``nnx.vmap``: every parameter has
a leading layer axis; its ``__call__`` is one layer), or an ``nnx.List`` of
layers. A list whose layers repeat with period k (local/global attention,
dense/MoE every k-th layer) is split as a stack of groups of k layers: the
group is the unit, so the depth must be a multiple of k.

``PipelineModel`` turns a model into what the runtime executes: the three pure
functions (``StageFns``), and the parameters cut into the prologue's part, the
stacked units and the epilogue's part. A parameter both ends use (a tied
embedding) is in both parts; its gradient is the sum of both uses. A model whose
side inputs, loop invariants or loss read the tokens (a padding mask, a loss mask
from the inputs) gets them carried in the hidden state (``carry_tokens.py``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.extend.core import Literal

from mindpipe_jax.errors import ConfigError
from mindpipe_jax.parallel.pipeline import dropout_keys
from mindpipe_jax.parallel.pipeline.autosplit import TracedSplit, live_inputs, needed_eqns, run_eqns
from mindpipe_jax.parallel.pipeline.carry_tokens import carrying_tokens
from mindpipe_jax.parallel.pipeline.list_parts import LAYER_LISTS, calls_period, check_the_loss, list_parts
from mindpipe_jax.parallel.pipeline.parts import HOOK, PipelineParts, dotted, merged, model_loss
from mindpipe_jax.parallel.pipeline.runtime.spmd import StageFns
from mindpipe_jax.parallel.pipeline.stand_ins import HIDDEN, LayerCall, SideInput
from mindpipe_jax.parallel.pipeline.unit_wrappers import carrying_aux, returning_hidden


def _how_to(name: str) -> str:
    return (f"model {name} does not follow the pipeline contract: give it a {HOOK}() method returning "
            f"mindpipe_jax.PipelineParts(stack='<attribute of the layer stack>', prologue=(model, "
            f"tokens) -> hidden, epilogue=(model, hidden, targets) -> loss), or attributes embed, "
            f"blocks (stacked) and head with head.loss(h, targets)")


def pipeline_parts(model) -> PipelineParts | None:
    """The model's parts: its ``pipeline_parts()``, else the reference shape, else None
    (the stack is then found in the traced loss, ``autosplit.py``)."""
    name = type(model).__name__
    hook = getattr(model, HOOK, None)
    if callable(hook):
        parts = hook()
        if not isinstance(parts, PipelineParts):
            raise ConfigError(f"{name}.{HOOK}() returned {type(parts).__name__}; it must return "
                              f"mindpipe_jax.PipelineParts(stack, prologue, epilogue)")
        return parts
    present = [a for a in ("embed", "blocks", "head") if hasattr(model, a)]
    if len(present) < 3:
        return list_parts(model)
    if not callable(getattr(model.head, "loss", None)):
        raise ConfigError(f"{_how_to(name)} ({name}.head has no loss(h, targets) method)")
    return PipelineParts("blocks", lambda m, tokens: m.embed(tokens), lambda m, h, t: m.head.loss(h, t))


def stage_fns(model) -> StageFns:
    """The reference shape as three functions of its own subtrees (embed params,
    one block's params, head params): the runtime's low-level form, for tests and
    benchmarks that pass ``params["embed"]``, ``params["blocks"]``, ``params["head"]``."""
    if pipeline_parts(model) is None or hasattr(model, HOOK):
        raise ConfigError(_how_to(type(model).__name__))
    embed_def, blocks_def, head_def = (nnx.graphdef(getattr(model, a)) for a in ("embed", "blocks", "head"))
    return StageFns(embed=lambda p, tokens: nnx.merge(embed_def, p)(tokens),
                    layer=lambda p, h: nnx.merge(blocks_def, p)(h),
                    head_loss=lambda p, h, targets: nnx.merge(head_def, p).loss(h, targets))


def _key(k) -> Any:
    return getattr(k, "key", getattr(k, "idx", k))


def _flat(tree) -> dict[tuple, Any]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {tuple(_key(k) for k in path): leaf for path, leaf in flat}


def _get(tree, path: tuple):
    for k in path:
        tree = tree[k]
    return tree


def _unflatten(flat: dict[tuple, Any]) -> dict:
    out: dict = {}
    for path, leaf in flat.items():
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = leaf
    return out


def _abstract(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def _period(layers) -> int:
    """Smallest k such that layer i has the structure of layer i mod k (k divides n)."""
    n = len(layers)
    sigs = [(nnx.graphdef(layer), jax.tree.map(lambda a: (a.shape, a.dtype),
                                               nnx.to_pure_dict(nnx.state(layer, nnx.Param))))
            for layer in layers]
    for k in range(1, n + 1):
        if n % k == 0 and all(sigs[i] == sigs[i % k] for i in range(n)):
            return k
    return n


class PipelineModel:
    """A model as the runtime executes it. ``merge(params) -> model`` rebuilds a
    model from a pure parameter dict; ``params`` is that dict (arrays or shapes);
    ``tokens`` an example microbatch of token ids (its length and dtype count)."""

    def __init__(self, model, params: dict, merge: Callable[[dict], Any], tokens):
        self.name = type(model).__name__
        self._merge = merge
        flat = _flat(params)
        self._paths = {dotted(p): p for p in flat}
        self._abstract = {n: _abstract(flat[p]) for n, p in self._paths.items()}
        self._length, self._token_dtype = tokens.shape[-1], tokens.dtype
        self._traced: dict[int, TracedSplit] = {}
        self.group = 1
        # An nnx.List of layers: ``split`` stacks its groups (even groups of one layer) in
        # the step, so a tree of shardings cannot go through it.
        self.stacks_in_step = False
        self._unit_calls: list = []  # an nnx.List stack: how the model calls each place in a group
        self._sides: dict[tuple, tuple] | None = None  # side inputs' traced computation, by rows
        # The model reads its tokens past the first layer (a padding mask for its layers, a
        # loss mask from the inputs): the hidden state carries them (carry_tokens.py).
        self._sides_read_tokens = self._loss_reads_tokens = False
        self.parts = parts = pipeline_parts(model)
        if parts is None:
            split = self._split_for(tokens.shape[0])
            self.stack_names, self.num_units = split.stack_names, split.num_units
            embed, head = split.prologue_names, split.epilogue_names
            self.fns = StageFns(embed=lambda p, t: self._split_for(t.shape[0], t).prologue(p, t),
                                layer=lambda u, h, *tk: self._split_for(h.shape[0], h).unit(u, h, *tk),
                                head_loss=lambda p, h, t, *tk: self._split_for(h.shape[0], h).epilogue(
                                    p, h, t, *tk))
            if split.unit_reads_tokens or split.loss_reads_tokens:
                self.fns = carrying_tokens(self.fns, self._token_dtype, self.name)
        else:
            layer = self._stack_from_parts(model, parts)
            prologue = lambda p, t: parts.prologue(self._model(p), t)  # noqa: E731
            # (only list_parts' epilogue takes the tokens: ``tokens`` is empty for the others)
            epilogue = lambda p, h, t, *tokens: parts.epilogue(self._model(p), h, t, *tokens)  # noqa: E731
            example = _abstract(tokens)
            if parts.check is not None:
                found = []
                jax.eval_shape(lambda p, t: found.append(parts.check(self._model(p), t)),
                               self._outer_abstract(), example)
                checked, = found
                found = checked.calls
                self._loss_reads_tokens = check_the_loss(
                    checked, self._merge, _unflatten({self._paths[n]: a for n, a in self._abstract.items()}),
                    example)
                self._set_group(calls_period(found, self.group, f"{self.name}.{parts.stack}"), found,
                                parts.stack)
                if any(isinstance(x, SideInput) for c in found for x in jax.tree.leaves((c.args, c.kwargs))):
                    self._sides = {}
                    self._side_trace(tokens.shape[0])  # refuses side inputs a unit cannot recompute
            hidden = jax.eval_shape(prologue, self._outer_abstract(), example)
            embed = self._used(prologue, example)
            head = self._used(epilogue, hidden, jax.ShapeDtypeStruct(example.shape, jnp.int32),
                              *([example] if self._loss_reads_tokens else []))
            self.fns = StageFns(embed=prologue, layer=layer, head_loss=epilogue)
            if parts.aux_weight is not None:
                self.fns = carrying_aux(self.fns, parts.aux_weight, self.num_units)
            else:
                self.fns = returning_hidden(self.fns, f"{self.name}.{parts.stack}")
            if self._sides_read_tokens or self._loss_reads_tokens:
                self.fns = carrying_tokens(self.fns, self._token_dtype, f"{self.name}.{parts.stack}")
        self._embed_names, self._head_names = tuple(sorted(embed)), tuple(sorted(head))
        if self.stacks_in_step:
            self._check_buffers(parts.stack)
        if parts is not None:  # trace one unit now: a contract mistake is refused before a run starts
            stack = jax.eval_shape(lambda p: self.split(p)[1], params)
            unit = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), stack)
            jax.eval_shape(self.fns.layer, unit, jax.eval_shape(self.fns.embed, self._outer_abstract(),
                                                                example))

    # -- finding the stack ------------------------------------------------------------

    def _stack_from_parts(self, model, parts: PipelineParts):
        path = tuple(int(k) if k.isdigit() else k for k in parts.stack.split("."))
        try:
            stack = model
            for k in path:
                stack = stack[k] if isinstance(k, int) else getattr(stack, k)
        except (AttributeError, KeyError, IndexError, TypeError):
            stack = None
        prefix = dotted(path) + "."
        self.stack_names = [n for n in self._paths if n.startswith(prefix)]
        if not isinstance(stack, (nnx.Module, *LAYER_LISTS)) or not self.stack_names:
            raise ConfigError(f"{self.name}: pipeline stack {parts.stack!r} is not a module with "
                              f"parameters in the model")
        self._stack_path = path
        if isinstance(stack, LAYER_LISTS):
            self.stacks_in_step = True
            self._layer_defs = [nnx.graphdef(x) for x in stack]
            self._layer_kinds = [type(x).__name__ for x in stack]
            # What a layer holds besides its parameters: constant buffers (rotary
            # frequencies; train/state.is_buffer) that every unit closes over, checked to be
            # the same at every place of a group once the group is known (_check_buffers).
            self._layer_rest = [nnx.state(x, nnx.Not(nnx.Param)) for x in stack]
            self._set_group(_period(list(stack)), [LayerCall((HIDDEN,), {})] * len(stack), parts.stack)

            def layer(unit, h, tokens=None):  # tokens: the microbatch's, where side inputs read them
                sides = self._side_values(h.shape[0], tokens) if self._sides is not None else ()
                for j in range(self.group):
                    h = self._unit_calls[j].run(merged(self._layer_defs[j], unit[j], self._layer_rest[j]),
                                                h, sides)
                return h
            return layer
        if jax.tree.leaves(nnx.state(stack, nnx.Not(nnx.Param))):
            raise ConfigError(f"{self.name}.{parts.stack} is a stacked module holding constants besides "
                              f"its parameters (nnx.Variable buffers); the pipeline's units hold parameters "
                              f"only: keep the layers in an nnx.List, or compute the constants inside "
                              f"__call__")
        leading = {n: self._abstract[n].shape[:1] for n in self.stack_names}
        if len(set(leading.values())) != 1 or () in leading.values():
            shapes = ", ".join(f"{n} {self._abstract[n].shape}" for n in self.stack_names)
            raise ConfigError(f"{self.name}.{parts.stack} is neither a stacked module (nnx.vmap: "
                              f"every parameter has the same leading layer axis) nor an nnx.List of "
                              f"layers; its parameters: {shapes}")
        self.num_units = next(iter(leading.values()))[0]
        gdef = nnx.graphdef(stack)

        def layer(unit, h):
            if dropout_keys.ROWS not in unit:
                return nnx.merge(gdef, unit)(h)
            # The reference GPT's blocks under model.dropout: their keys ride with the weights.
            weights = {k: v for k, v in unit.items() if k != dropout_keys.ROWS}
            return dropout_keys.call_with_keys(nnx.merge(gdef, weights), h, unit[dropout_keys.ROWS])
        return layer

    def _check_buffers(self, stack: str) -> None:
        """Every unit closes over the constants of the first group's layers: each layer's
        must equal those of its place in the first group (the same rotary frequencies in
        every layer). Refuses, naming the first that differs."""
        k = self.group
        for i, rest in enumerate(self._layer_rest):
            first = self._layer_rest[i % k]
            same = jax.tree.structure(rest) == jax.tree.structure(first) and all(
                a.shape == b.shape and bool(np.array_equal(np.asarray(a), np.asarray(b)))
                for a, b in zip(jax.tree.leaves(rest), jax.tree.leaves(first), strict=True))
            if not same:
                raise ConfigError(f"{self.name}.{stack}[{i}] holds other constants (nnx.Variable buffers) "
                                  f"than {self.name}.{stack}[{i % k}], its place in the repeating group of "
                                  f"{k}; the pipeline's units share one copy of them: compute them inside "
                                  f"__call__, or make a per-layer array an nnx.Param")

    def _set_group(self, k: int, calls: list, stack: str) -> None:
        """An nnx.List stack split as groups of k layers, each layer called with ``calls``'
        static arguments (per layer; they repeat with period k)."""
        depth = len(self._layer_defs)
        if k == depth and depth > 1:
            runs = [(kind, len(list(same))) for kind, same in itertools.groupby(self._layer_kinds)]
            kinds = ", ".join(kind if n == 1 else f"{kind} x{n}" for kind, n in runs)
            raise ConfigError(f"{self.name}.{stack}: its {depth} layers ({kinds}) do not repeat in groups "
                              f"(layer i must have the structure of layer i - k for a k dividing the "
                              f"depth); the pipeline splits a stack of like units: keep the repeated layers "
                              f"in an nnx.List of their own (the embedding and the head outside it), or "
                              f"train without parallel.pipe")
        self.group, self.num_units, self._unit_calls = k, depth // k, calls[:k]

    def _side_values(self, rows: int, tokens=None) -> tuple:
        """The arrays the model passes its layers besides the hidden state, for a microbatch
        of ``rows`` rows, computed where the unit runs (each stage, every call). Those that
        depend on nothing but the microbatch's shape (a causal mask, positions) are
        computed from constants (XLA folds them); those that read the tokens' values (a
        padding mask) from ``tokens``, the microbatch's ids the hidden state carries
        (``carry_tokens.py``). One that reads a parameter is refused, naming what it
        reads: the parameter lives on another stage."""
        closed, eqns, token_var = self._side_trace(rows, tokens)
        env = dict(zip(closed.jaxpr.constvars, closed.consts, strict=True))
        if tokens is not None:
            env[token_var] = tokens
        env = run_eqns(eqns, env)
        return tuple(v.val if isinstance(v, Literal) else env[v] for v in closed.jaxpr.outvars)

    def _side_trace(self, rows: int, tokens=None):
        """(the side inputs' computation traced for ``rows`` rows, with ``tokens``' typing,
        the equations they need, the tokens' variable in it); refuses a parameter read."""
        manual = jax.typeof(tokens).manual_axis_type if tokens is not None else None
        key = (rows, manual)
        if key not in self._sides:
            example = jax.ShapeDtypeStruct((rows, self._length), self._token_dtype)
            if manual is not None and manual.varying:  # typed as inside the shard_map (see _split_for)
                example = jax.lax.pcast(jnp.zeros(example.shape, example.dtype),
                                        tuple(sorted(manual.varying)), to="varying")
            closed = jax.make_jaxpr(lambda p, t: self.parts.sides(self._model(p), t))(
                self._outer_abstract(), example)
            eqns, reads = needed_eqns(closed.jaxpr.eqns, closed.jaxpr.outvars)
            reads -= set(closed.jaxpr.constvars)
            token_var = closed.jaxpr.invars[-1]
            if reads - {token_var}:
                what = "the tokens' values and parameters (e.g. the embedded input)" if token_var in reads \
                    else "parameters (e.g. a learned bias)"
                raise ConfigError(f"{self.name}.{self.parts.stack}: its layers are called with an array "
                                  f"computed from {what} besides the hidden state; the pipeline passes one "
                                  f"hidden state between stages and recomputes side inputs from the "
                                  f"microbatch's tokens and shape only (a padding or causal mask, "
                                  f"positions): compute it inside the layer from its input, or train "
                                  f"without parallel.pipe")
            self._sides_read_tokens |= token_var in reads
            self._sides[key] = (closed, eqns, token_var)
        return self._sides[key]

    def _split_for(self, rows: int, like=None) -> TracedSplit:
        """The traced cut for microbatches of ``rows`` rows (a jaxpr has fixed shapes),
        traced with the manual-axis typing of ``like``: inside the pipeline's shard_map
        every value varies over its manual axes, and a jaxpr traced outside would mix
        varying and invariant operands that tracing there reconciles itself."""
        manual = jax.typeof(like).manual_axis_type if like is not None else None
        key = (rows, manual)
        if key not in self._traced:
            names = list(self._paths)

            def loss(leaves, tokens, targets):
                return model_loss(self._merge(_unflatten({self._paths[n]: x for n, x in
                                                          zip(names, leaves, strict=True)})),
                                  tokens, targets)
            varying = tuple(sorted(manual.varying)) if manual is not None else ()

            def typed(shape, dtype):  # a value, not a shape: only values carry the typing
                zeros = jnp.zeros(shape, dtype)
                return jax.lax.pcast(zeros, varying, to="varying") if varying else _abstract(zeros)
            example = typed((rows, self._length), jnp.int32)
            leaves = [typed(self._abstract[n].shape, self._abstract[n].dtype) for n in names]
            self._traced[key] = TracedSplit(loss, names, leaves, example, example, self.name, HOOK)
        return self._traced[key]

    # -- parameters -------------------------------------------------------------------

    def _outer_abstract(self) -> dict:
        return {n: a for n, a in self._abstract.items() if n not in set(self.stack_names)}

    def _model(self, part: dict):
        """A model holding ``part``'s parameters. The stack's are shapes only (reading one
        fails); other parameters ``part`` lacks are zeros, which only dead code reads
        (a part is given every parameter that reaches its result, ``_used``)."""
        stack = set(self.stack_names)
        flat = {self._paths[n]: part[n] if n in part else a if n in stack else jnp.zeros(a.shape, a.dtype)
                for n, a in self._abstract.items()}
        return self._merge(_unflatten(flat))

    def _used(self, fn, *args) -> list[str]:
        """The outer parameters whose values reach ``fn``'s result."""
        outer = self._outer_abstract()
        jaxpr = jax.make_jaxpr(fn)(outer, *args).jaxpr
        live = live_inputs(jaxpr)
        return [n for n, v in zip(outer, jaxpr.invars[:len(outer)], strict=True) if v in live]

    def split(self, params: dict):
        """(prologue's params, stacked units [num_units, ...], epilogue's params)."""
        flat = {n: _get(params, p) for n, p in self._paths.items()}
        if self.parts is None:
            stack = {n: flat[n] for n in self.stack_names}
        else:
            stack = _get(params, self._stack_path)
            if self.stacks_in_step:  # {layer i: params} -> {j: layers j, j + k, ... stacked}
                k = self.group
                stack = {j: jax.tree.map(lambda *xs: jnp.stack(xs),
                                         *[stack[j + g * k] for g in range(self.num_units)])
                         for j in range(k)}
        return ({n: flat[n] for n in self._embed_names}, stack, {n: flat[n] for n in self._head_names})

    def ends(self, tree: dict) -> tuple[dict, dict]:
        """The prologue's and the epilogue's leaves of ``tree`` (the params, or a tree
        shaped like them, e.g. their shardings), by name as ``split`` gives them."""
        return ({n: _get(tree, self._paths[n]) for n in self._embed_names},
                {n: _get(tree, self._paths[n]) for n in self._head_names})

    def end_paths(self) -> list[tuple]:
        """Paths (in the params dict) of every parameter the prologue or epilogue uses."""
        return [self._paths[n] for n in sorted({*self._embed_names, *self._head_names})]

    def merge_grads(self, params: dict, d_embed: dict, d_stack, d_head: dict) -> dict:
        """Gradients shaped like ``params``: a parameter both ends use gets the sum of both
        uses; one neither uses gets zeros."""
        out = {}
        if self.parts is None:
            out.update(d_stack)
        else:
            if self.stacks_in_step:
                k = self.group
                d_stack = {j + g * k: jax.tree.map(lambda x, g=g: x[g], d_stack[j])
                           for j in range(k) for g in range(self.num_units)}
            out.update({dotted(self._stack_path + p): x for p, x in _flat(d_stack).items()})
        for n in self._paths:
            if n not in out:
                uses = [d[n] for d in (d_embed, d_head) if n in d]
                out[n] = sum(uses[1:], uses[0]) if uses else jnp.zeros_like(_get(params, self._paths[n]))
        return _unflatten({self._paths[n]: out[n] for n in self._paths})

    def sequential_loss(self, params: dict, inputs, targets):
        """The loss without a pipeline: prologue, every unit in order, epilogue."""
        embed_p, stack, head_p = self.split(params)
        h = self.fns.embed(embed_p, inputs)
        h = jax.lax.scan(lambda x, unit: (self.fns.layer(unit, x), None), h, stack)[0]
        return self.fns.head_loss(head_p, h, targets)
