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

The stack is either a module created stacked (``nnx.vmap``: every parameter has
a leading layer axis; its ``__call__`` is one layer), or an ``nnx.List`` of
layers. A list whose layers repeat with period k (local/global attention,
dense/MoE every k-th layer) is split as a stack of groups of k layers: the
group is the unit, so the depth must be a multiple of k.

``PipelineModel`` turns a model into what the runtime executes: the three pure
functions (``StageFns``), and the parameters cut into the prologue's part, the
stacked units and the epilogue's part. A parameter both ends use (a tied
embedding) is in both parts; its gradient is the sum of both uses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from mindpipe_jax.errors import ConfigError
from mindpipe_jax.parallel.pipeline.autosplit import TracedSplit, live_inputs
from mindpipe_jax.parallel.pipeline.runtime.spmd import StageFns

HOOK = "pipeline_parts"


@dataclasses.dataclass(frozen=True)
class PipelineParts:
    """What ``model.pipeline_parts()`` returns (see the module docstring)."""

    stack: str  # attribute path of the layer stack, dots between names: "decoder.layers"
    prologue: Callable[[Any, jax.Array], jax.Array]  # (model, tokens) -> hidden
    epilogue: Callable[[Any, jax.Array, jax.Array], jax.Array]  # (model, hidden, targets) -> loss
    # Units that return (hidden, aux), a scalar auxiliary loss each (an MoE block's load
    # balancing): the model's loss adds aux_weight x their mean over the units.
    aux_weight: float | None = None
    # (model, tokens) -> each layer's static arguments besides the hidden state, [(args,
    # kwargs)], run once abstractly before a run: raises ConfigError where the parts would
    # not compute the model's loss (set for a found nnx.List, _list_parts).
    check: Callable[[Any, jax.Array], list] | None = None


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
        return _list_parts(model)
    if not callable(getattr(model.head, "loss", None)):
        raise ConfigError(f"{_how_to(name)} ({name}.head has no loss(h, targets) method)")
    return PipelineParts("blocks", lambda m, tokens: m.embed(tokens), lambda m, h, t: m.head.loss(h, t))


class _Reached(Exception):  # noqa: N818 (a control-flow signal, not an error)
    def __init__(self, x, extra):
        super().__init__()
        self.x, self.extra = x, extra


class _Stop(nnx.Module):
    """Stands in for the first layer: stops the model there with its input."""

    def __call__(self, x, *args, **kwargs):
        raise _Reached(x, None)  # the layers' other arguments: checked by _list_parts' check


class _Link(nnx.Module):
    """Stands in for a layer: records the array it is called on and the new one it
    returns, so that a chain (each layer called on the previous one's output) shows."""

    def __init__(self, calls: list):
        self.calls = nnx.data(calls)

    def __call__(self, x, *args, **kwargs):
        out = x + jnp.zeros((), x.dtype)  # a new array: the next layer must be called on it
        self.calls.append((x, out, args, kwargs))
        return out


def _check_own_params(layers, where: str) -> None:
    """Each layer of a found ``nnx.List`` holds parameters of its own: a pipeline puts the
    layers on different stages, each stage with its layers' parameters only. Refuses a
    module listed twice (ALBERT-style sharing) and a parameter two layers reach. (One a
    layer shares with the rest of the model gives that layer another structure than the
    others, which the period check refuses.)"""
    fix = ("a pipeline places the layers on different stages, each holding only its own layers' "
           "parameters: give each layer its own (or train it without parallel.pipe)")
    owner: dict[int, int] = {}
    for i, layer in enumerate(layers):
        same = next((j for j in range(i) if layers[j] is layer), None)
        if same is not None:
            raise ConfigError(f"{where}[{i}] is {where}[{same}] (one module listed twice: shared "
                              f"weights); {fix}")
        for sub, var in nnx.iter_graph(layer):
            if isinstance(var, nnx.Param):
                if id(var) in owner:
                    raise ConfigError(f"{where}[{i}] and {where}[{owner[id(var)]}] share the parameter "
                                      f"{_name(sub)}; {fix}")
                owner[id(var)] = i


class _Pass(nnx.Module):
    """Stands in for a layer: the hidden state goes through unchanged, or is replaced
    by the one the pipeline delivers (the last layer)."""

    def __init__(self, h=None):
        self.h = nnx.data(h)

    def __call__(self, x, *args, **kwargs):
        return x if self.h is None else self.h


def _list_parts(model) -> PipelineParts | None:
    """Parts of a model whose layers are one ``nnx.List`` that it calls in order: the
    prologue is the model's loss stopped at the first layer, the epilogue its loss
    with every layer passing the hidden state through and the last one replaced by
    the pipeline's output. None if the model has no such list."""
    lists = [(path, node) for path, node in nnx.iter_graph(model)
             if isinstance(node, nnx.List) and len(node) > 1
             and all(isinstance(x, nnx.Module) for x in node)]
    if len(lists) != 1:
        return None
    path = lists[0][0]
    name = type(model).__name__

    def stack_of(m):
        for k in path:
            m = m[k] if isinstance(k, int) else getattr(m, k)
        return m

    def prologue(m, tokens):
        layers = stack_of(m)
        layers[0] = _Stop()
        try:
            model_loss(m, tokens, jnp.zeros_like(tokens))
        except _Reached as reached:
            return reached.x
        raise ConfigError(f"{name}'s loss never calls {_name(path)}[0]; give {name} a {HOOK}() method")

    def epilogue(m, h, targets):
        layers = stack_of(m)
        for i in range(len(layers)):
            layers[i] = _Pass(h if i == len(layers) - 1 else None)
        return model_loss(m, jnp.zeros(h.shape[:2], jnp.int32), targets)

    def check(m, tokens):
        _check_own_params(stack_of(m), f"{name}.{_name(path)}")
        # The parts run the layers back to back: the model must call each layer, once, on
        # the previous one's output. A loop computing between them (h = h + f(layer(h)))
        # would lose that computation in the pipeline.
        layers, calls = stack_of(m), []
        for i in range(len(layers)):
            layers[i] = _Link(calls)
        model_loss(m, tokens, jnp.zeros_like(tokens))
        where = f"{name}.{_name(path)}"
        if len(calls) != len(layers):
            raise ConfigError(f"{where}: the model's loss calls its {len(layers)} layers {len(calls)} times; "
                              f"the pipeline runs each once, in order: give {name} a {HOOK}() method")
        for i in range(1, len(calls)):
            if calls[i][0] is not calls[i - 1][1]:
                raise ConfigError(f"{where}[{i}] is not called on the output of {where}[{i - 1}]: the model "
                                  f"computes something between its layers (in its loop, e.g. a residual "
                                  f"or an activation), which a pipeline running the layers back to back "
                                  f"would lose; move it into the layer, or give {name} a {HOOK}() method")
        # Arguments besides the hidden state: static ones (flags such as deterministic=True,
        # None) are passed again to each unit; arrays are side inputs the pipeline lacks.
        extras = [(args, kwargs) for _, _, args, kwargs in calls]
        if any(isinstance(leaf, (jax.Array, np.ndarray)) for leaf in jax.tree.leaves(extras)):
            raise ConfigError(f"{where}: its layers are called with arrays besides the hidden state; the "
                              f"pipeline passes one hidden state between stages and no side inputs yet: "
                              f"compute positions or masks inside the layer from its input")
        return extras

    return PipelineParts(_name(path), prologue, epilogue, check=check)


def _calls_period(calls: list, k: int, where: str) -> int:
    """The smallest multiple of the structural period k (dividing the depth) with which the
    layers' static arguments repeat too: a loop passing is_local=(i % 2 == 0) to like layers
    makes groups of two. None dividing the depth below it: refused, naming the first layer
    called otherwise than its place in a group of k."""
    depth = len(calls)
    for m in range(k, depth, k):
        if depth % m == 0 and all(calls[i] == calls[i % m] for i in range(depth)):
            return m
    i = next((i for i in range(depth) if calls[i] != calls[i % k]), None)
    if i is None:
        return k
    raise ConfigError(f"{where}[{i}] is called with {_shown_call(calls[i])} but {where}[{i % k}], its "
                      f"place in the repeating group of {k}, with {_shown_call(calls[i % k])}, and the calls "
                      f"repeat in no group dividing the depth; the pipeline calls every unit alike: compute "
                      f"the difference inside the layer")


def _shown_call(call) -> str:
    args, kwargs = call
    return "(" + ", ".join(["h", *map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())]) + ")"


def model_loss(model, inputs, targets):
    """A model's mean loss: ``model.loss`` if it has one, else token cross-entropy of its
    logits."""
    if callable(getattr(model, "loss", None)):
        return model.loss(inputs, targets)
    logits = model(inputs).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


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


def _name(path: tuple) -> str:
    return ".".join(map(str, path))


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


def _carrying_aux(fns: StageFns, weight: float, units: int) -> StageFns:
    """``fns`` whose hidden state carries the units' auxiliary losses to the epilogue.

    A stage passes its neighbour one array, and only the last stage computes the loss,
    so the running sum of the units' aux losses rides along as one more feature of the
    hidden state (``[..., d + 1]``; every position holds the same sum). The epilogue
    adds ``weight`` x the mean over the units to the loss, so the loss and every
    gradient are the model's own, aux included, through the runtime unchanged: the
    backward of the epilogue's read of that feature is what reaches each unit's aux
    (Megatron injects it with a custom backward instead; here autodiff does it). The
    sum is kept in the hidden state's dtype: with bf16 activations the loss *value*
    rounds its aux term, while the gradient each unit's aux receives (a constant) does
    not.
    """
    def embed(p, tokens):
        h = fns.embed(p, tokens)
        return jnp.concatenate([h, jnp.zeros((*h.shape[:-1], 1), h.dtype)], axis=-1)

    def layer(unit, h):
        out = fns.layer(unit, h[..., :-1])
        if not (isinstance(out, tuple) and len(out) == 2 and jnp.ndim(out[1]) == 0):
            raise ConfigError(f"PipelineParts(aux_weight={weight}) needs each unit to return (hidden, "
                              f"a scalar aux loss); a unit returned {jax.tree.structure(out)}")
        out, aux = out
        return jnp.concatenate([out, h[..., -1:] + aux.astype(h.dtype)], axis=-1)

    def head_loss(p, h, targets):
        total = h[..., -1].reshape(-1)[0].astype(jnp.float32)
        return fns.head_loss(p, h[..., :-1], targets) + weight * total / units

    return StageFns(embed=embed, layer=layer, head_loss=head_loss)


def _returning_hidden(fns: StageFns, where: str) -> StageFns:
    """``fns`` whose units are checked, when traced, to return one array shaped like their
    input: the pipeline hands that array to the next unit (and stage). A unit returning
    anything else (e.g. ``(hidden, aux)`` of an MoE block without ``aux_weight``) is
    refused here in one line rather than failing inside the runtime's transfers."""
    def layer(unit, h):
        out = fns.layer(unit, h)
        if not (hasattr(out, "shape") and hasattr(out, "dtype")) or tuple(out.shape) != tuple(h.shape):
            what = f"an array of shape {tuple(out.shape)}" if hasattr(out, "shape") else \
                f"{type(out).__name__} {jax.tree.structure(out)}"
            extra = (" (a unit that also returns an auxiliary loss, (hidden, scalar), needs "
                     "PipelineParts(aux_weight=...))" if isinstance(out, tuple) and len(out) == 2 else "")
            raise ConfigError(f"{where}: a unit returned {what}; the pipeline passes one hidden array of "
                              f"shape {tuple(h.shape)} from unit to unit{extra}")
        return out

    return StageFns(embed=fns.embed, layer=layer, head_loss=fns.head_loss)


class PipelineModel:
    """A model as the runtime executes it. ``merge(params) -> model`` rebuilds a
    model from a pure parameter dict; ``params`` is that dict (arrays or shapes);
    ``tokens`` an example microbatch of token ids (its length and dtype count)."""

    def __init__(self, model, params: dict, merge: Callable[[dict], Any], tokens):
        self.name = type(model).__name__
        self._merge = merge
        flat = _flat(params)
        self._paths = {_name(p): p for p in flat}
        self._abstract = {n: _abstract(flat[p]) for n, p in self._paths.items()}
        self._length = tokens.shape[-1]
        self._traced: dict[int, TracedSplit] = {}
        self.group = 1
        # An nnx.List of layers: ``split`` stacks its groups (even groups of one layer) in
        # the step, so a tree of shardings cannot go through it.
        self.stacks_in_step = False
        self._unit_calls: list = []  # an nnx.List stack's static arguments, per place in a group
        self.parts = parts = pipeline_parts(model)
        if parts is None:
            split = self._split_for(tokens.shape[0])
            self.stack_names, self.num_units = split.stack_names, split.num_units
            embed, head = split.prologue_names, split.epilogue_names
            self.fns = StageFns(embed=lambda p, t: self._split_for(t.shape[0], t).prologue(p, t),
                                layer=lambda u, h: self._split_for(h.shape[0], h).unit(u, h),
                                head_loss=lambda p, h, t: self._split_for(h.shape[0], h).epilogue(p, h, t))
        else:
            layer = self._stack_from_parts(model, parts)
            prologue = lambda p, t: parts.prologue(self._model(p), t)  # noqa: E731
            epilogue = lambda p, h, t: parts.epilogue(self._model(p), h, t)  # noqa: E731
            example = _abstract(tokens)
            if parts.check is not None:
                found = []
                jax.eval_shape(lambda p, t: found.extend(parts.check(self._model(p), t)),
                               self._outer_abstract(), example)
                self._set_group(_calls_period(found, self.group, f"{self.name}.{parts.stack}"), found,
                                parts.stack)
            hidden = jax.eval_shape(prologue, self._outer_abstract(), example)
            embed = self._used(prologue, example)
            head = self._used(epilogue, hidden, jax.ShapeDtypeStruct(example.shape, jnp.int32))
            self.fns = StageFns(embed=prologue, layer=layer, head_loss=epilogue)
            if parts.aux_weight is not None:
                self.fns = _carrying_aux(self.fns, parts.aux_weight, self.num_units)
            else:
                self.fns = _returning_hidden(self.fns, f"{self.name}.{parts.stack}")
        self._embed_names, self._head_names = tuple(sorted(embed)), tuple(sorted(head))
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
        prefix = _name(path) + "."
        self.stack_names = [n for n in self._paths if n.startswith(prefix)]
        if not isinstance(stack, nnx.Module) or not self.stack_names:
            raise ConfigError(f"{self.name}: pipeline stack {parts.stack!r} is not a module with "
                              f"parameters in the model")
        self._stack_path = path
        if isinstance(stack, nnx.List):
            self.stacks_in_step = True
            self._layer_defs = [nnx.graphdef(x) for x in stack]
            self._set_group(_period(list(stack)), [((), {})] * len(stack), parts.stack)

            def layer(unit, h):
                for j in range(self.group):
                    args, kwargs = self._unit_calls[j]
                    h = nnx.merge(self._layer_defs[j], unit[j])(h, *args, **kwargs)
                return h
            return layer
        leading = {n: self._abstract[n].shape[:1] for n in self.stack_names}
        if len(set(leading.values())) != 1 or () in leading.values():
            shapes = ", ".join(f"{n} {self._abstract[n].shape}" for n in self.stack_names)
            raise ConfigError(f"{self.name}.{parts.stack} is neither a stacked module (nnx.vmap: "
                              f"every parameter has the same leading layer axis) nor an nnx.List of "
                              f"layers; its parameters: {shapes}")
        self.num_units = next(iter(leading.values()))[0]
        gdef = nnx.graphdef(stack)
        return lambda unit, h: nnx.merge(gdef, unit)(h)

    def _set_group(self, k: int, calls: list, stack: str) -> None:
        """An nnx.List stack split as groups of k layers, each layer called with ``calls``'
        static arguments (per layer; they repeat with period k)."""
        depth = len(self._layer_defs)
        if k == depth and depth > 1:
            raise ConfigError(f"{self.name}.{stack}: its {depth} layers do not repeat in groups (layer i "
                              f"must have the structure of layer i - k for a k dividing the depth); the "
                              f"pipeline splits a stack of like units")
        self.group, self.num_units, self._unit_calls = k, depth // k, calls[:k]

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
            out.update({_name(self._stack_path + p): x for p, x in _flat(d_stack).items()})
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
