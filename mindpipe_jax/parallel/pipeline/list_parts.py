"""The pipeline parts of a model whose layers are one ``nnx.List`` (or a plain list kept with
``nnx.data``) that it calls in order.

No method or attribute names are needed: the prologue is the model's loss stopped at the
first layer, the epilogue its loss with the layers passing the hidden state through and
the last one replaced by the pipeline's output. Before a run, ``check`` traces the loss
with stand-in layers: each layer must hold its own parameters and be called once, in the
list's order, on the previous one's output, and what follows the layers may read the last
one's output and the tokens only (not another layer's output, what a layer returns
besides the hidden state, or what it sows). How the model calls each layer is recorded
(``LayerCall``) and replayed by each unit: the hidden state positional or by keyword,
static arguments (``deterministic=True``), the leaf of a returned tuple that is the
hidden state. Arrays passed besides it (side inputs: a causal mask, positions, a padding
mask) are recorded as ``SideInput`` marks and ``sides`` computes them; ``contract.py``
lets the units recompute the ones that depend on nothing but the microbatch's shape and
tokens and refuses the rest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.typing import Missing

from mindpipe_jax.errors import ConfigError
from mindpipe_jax.parallel.pipeline.autosplit import live_inputs
from mindpipe_jax.parallel.pipeline.parts import HOOK, PipelineParts, dotted, model_loss

# What holds a model's layers as a list: nnx.List, or a plain list the model keeps as data
# (``nnx.data([...])``, one of the fixes Flax's own error for a list of modules offers).
LAYER_LISTS = (nnx.List, list)


@dataclasses.dataclass(frozen=True)
class SideInput:
    """In a layer's recorded arguments, the place of an array the model passes besides the
    hidden state: the ``index``-th distinct one (``PipelineParts.sides`` computes them)."""

    index: int

    def __repr__(self) -> str:
        return f"<side input {self.index}>"


@dataclasses.dataclass(frozen=True)
class _Hidden:
    """In a layer's recorded arguments, the place of the hidden state (first positional, or
    the keyword the model names it by: ``layer(hidden_states=h)``)."""

    def __repr__(self) -> str:
        return "h"


HIDDEN = _Hidden()


@dataclasses.dataclass(frozen=True)
class LayerCall:
    """How the model calls one layer, replayed by each unit: the arguments with ``HIDDEN``
    and ``SideInput`` marks where arrays go, and which leaf of what the layer returns is the
    hidden state (None: it returns the array itself; 0 for ``h, _ = layer(h)``)."""

    args: tuple
    kwargs: dict
    out_leaf: int | None = None

    def run(self, layer, h, sides: tuple = ()):
        def fill(x):
            return h if isinstance(x, _Hidden) else sides[x.index] if isinstance(x, SideInput) else x
        args, kwargs = jax.tree.map(fill, (self.args, self.kwargs))
        out = layer(*args, **kwargs)
        return out if self.out_leaf is None else jax.tree.leaves(out)[self.out_leaf]

    def __str__(self) -> str:
        return "(" + ", ".join([*map(repr, self.args), *(f"{k}={v!r}" for k, v in self.kwargs.items())]) + ")"


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray))


def _marked(calls: list) -> tuple[list, list]:
    """Each recorded ``LayerCall`` with every array besides the hidden state replaced by
    its ``SideInput`` mark (one per distinct array object: a mask computed once and passed
    to every layer is one side input), and those arrays in order of first use."""
    arrays: list = []

    def mark(x):
        if not _is_array(x):
            return x
        index = next((i for i, a in enumerate(arrays) if a is x), None)
        if index is None:
            arrays.append(x)
            index = len(arrays) - 1
        return SideInput(index)

    def marked(call: LayerCall) -> LayerCall:
        args, kwargs = jax.tree.map(mark, (call.args, call.kwargs))
        return dataclasses.replace(call, args=args, kwargs=kwargs)
    return [marked(c.call) for c in calls], arrays


def _hidden_name(layer) -> str | None:
    """The name of the first argument of ``layer.__call__`` (the hidden state's, when the
    model passes it by keyword)."""
    try:
        params = list(inspect.signature(layer).parameters.values())
    except (TypeError, ValueError):
        return None
    first = params[0] if params else None
    return first.name if first is not None and first.kind in (first.POSITIONAL_OR_KEYWORD,
                                                              first.KEYWORD_ONLY) else None


def _hidden_in(args: tuple, kwargs: dict, name: str | None, which: str = "a layer"):
    """(the hidden state, args and kwargs with ``HIDDEN`` in its place). ``which``: the
    layer, as the error names it."""
    if args:
        return args[0], (HIDDEN, *args[1:]), kwargs
    if name in kwargs:
        return kwargs[name], args, {**kwargs, name: HIDDEN}
    named = f"no {name!r} (its first parameter)" if name else "a __call__ that names no first parameter"
    raise ConfigError(f"{which} was called with no positional argument and {named}, with keywords "
                      f"{', '.join(kwargs) or 'none'}: the pipeline cannot tell which argument is the "
                      f"hidden state; pass it first")


@contextlib.contextmanager
def _without_remat():
    """The model's own rematerialisation switched off (``jax.checkpoint`` / ``jax.remat`` /
    ``nnx.remat`` calling their function as it is) while its loss runs with stand-in layers:
    a loop wrapping each layer call in one (``h = nnx.remat(lambda m, x: m(x))(layer, h)``)
    would trace the stand-ins inside another trace, where a chain of calls does not show and
    a stand-in cannot be split. The pipeline rematerialises by its own per-stage policy."""
    def plain(fun=None, *args, **kwargs):
        return fun if fun is not None and not isinstance(fun, Missing) else (lambda f: f)
    saved = [(module, name, getattr(module, name))
             for module, name in ((jax, "checkpoint"), (jax, "remat"), (nnx, "remat"))]
    for module, name, _ in saved:
        setattr(module, name, plain)
    try:
        yield
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


def _loss_with_stand_ins(m, tokens, targets):
    with _without_remat():
        return model_loss(m, tokens, targets)


class _Reached(Exception):  # noqa: N818 (a control-flow signal, not an error)
    def __init__(self, x):
        super().__init__()
        self.x = x


_RETURNED: dict = {}  # _StandIn.returned's cache


class _StandIn(nnx.Module):
    """Stands in for one of the model's layers, called as the model calls it. ``real`` is
    the layer it replaces (its signature, and the shape of what it returns)."""

    index: int | None = None  # the layer's place in the list, where the stand-in knows it

    def __init__(self, real):
        self.real = nnx.data(real)

    def hidden_in(self, args, kwargs):
        which = f"layer {self.index} of the list ({type(self.real).__name__})" if self.index is not None \
            else f"a layer ({type(self.real).__name__})"
        return _hidden_in(args, kwargs, _hidden_name(self.real), which)

    def returned(self, args, kwargs):
        """The abstract value the real layer returns for these arguments."""
        return self._traced(args, kwargs)[0]

    def sows(self, args, kwargs) -> bool:
        """Whether the real layer stores values in itself when called so (``self.sow``: an
        auxiliary loss, router statistics)."""
        return self._traced(args, kwargs)[1]

    def _traced(self, args, kwargs):
        """(what the real layer returns, what it sows), abstract. Cached by the layer's
        structure and shapes and the arguments' shapes and static values: the epilogue
        stands in for every layer each time it is traced, and like layers return alike."""
        gdef, state = nnx.split(self.real)
        leaves, tree = jax.tree.flatten((args, kwargs))
        key = (gdef, tree, tuple((x.shape, x.dtype) if hasattr(x, "shape") else x for x in leaves),
               tuple((x.shape, x.dtype) for x in jax.tree.leaves(state)))

        sows = []

        def call(st):
            layer = nnx.merge(gdef, st)
            before = _state_leaves(layer)
            with warnings.catch_warnings():  # sow outside nnx.capture: deprecated, but how to see it
                warnings.simplefilter("ignore", DeprecationWarning)
                out = layer(*args, **kwargs)
            sows.append(bool(_new_leaves(layer, before)))
            return out

        def trace():
            return jax.eval_shape(call, state), sows[-1]
        try:
            cached = key in _RETURNED
        except TypeError:  # an unhashable static argument: not cached
            return trace()
        if not cached:
            if len(_RETURNED) > 256:
                _RETURNED.clear()
            _RETURNED[key] = trace()
        return _RETURNED[key]

    def like_real(self, args, kwargs, hidden, extras) -> tuple:
        """What the real layer returns, built from ``hidden`` (at the leaf the next layer is
        called on: the first of the hidden state's shape and dtype) and ``extras(shape,
        dtype)`` for every other leaf. Returns (that, the hidden's leaf or None)."""
        out = self.returned(args, kwargs)
        leaves, tree = jax.tree.flatten(out)
        if len(leaves) == 1 and not isinstance(out, (tuple, list, dict)):
            return hidden, None
        at = next((i for i, a in enumerate(leaves) if a.shape == hidden.shape and a.dtype == hidden.dtype),
                  None)
        if at is None:
            shown = ", ".join(f"{a.dtype}{list(a.shape)}" for a in leaves)
            raise ConfigError(f"a layer ({type(self.real).__name__}) returns ({shown}) for a hidden state "
                              f"{hidden.dtype}{list(hidden.shape)}: none of it has the hidden state's shape "
                              f"and dtype, which the pipeline passes from layer to layer")
        made = [hidden if i == at else extras(a.shape, a.dtype) for i, a in enumerate(leaves)]
        return jax.tree.unflatten(tree, made), at


def _state_leaves(layer) -> set:
    """The ids of the array leaves of ``layer``'s non-parameter state."""
    return {id(x) for x in jax.tree.leaves(nnx.state(layer, nnx.Not(nnx.Param)))}


def _new_leaves(layer, before: set) -> list:
    """The leaves of ``layer``'s non-parameter state that were not there at ``before``
    (``_state_leaves``): what a call sowed (into the layer, or into ``nnx.capture``'s
    collection kept on it)."""
    return [x for x in jax.tree.leaves(nnx.state(layer, nnx.Not(nnx.Param))) if id(x) not in before]


class _Probed(_StandIn):
    """Runs the real layer, then adds ``probe`` (a scalar zero the trace takes as an
    input) to each value it sowed, so the loss's dependence on what it sows shows."""

    def __init__(self, real, probe):
        super().__init__(real)
        self.probe = nnx.data(probe)

    def __call__(self, *args, **kwargs):
        before = _state_leaves(self.real)
        out = self.real(*args, **kwargs)
        for _, var in nnx.to_flat_state(nnx.state(self.real, nnx.Not(nnx.Param))):
            var.set_value(jax.tree.map(lambda x: x if id(x) in before else x + self.probe.astype(x.dtype),
                                       var.get_value()))
        return out


class _Stop(_StandIn):
    """Stands in for the first layer: stops the model there with its input."""

    def __call__(self, *args, **kwargs):
        raise _Reached(self.hidden_in(args, kwargs)[0])


class _Link(_StandIn):
    """Stands in for a layer: records how it is called, and returns a new array where the
    real layer returns its hidden state (so a chain, each layer called on the previous
    one's output, shows) and new arrays for its other outputs, all from ``make(shape,
    dtype)``, the hidden state first."""

    def __init__(self, real, index: int, calls: list, make):
        super().__init__(real)
        self.index, self.calls, self.make = index, nnx.data(calls), nnx.data(make)

    def __call__(self, *args, **kwargs):
        x, marked_args, marked_kwargs = self.hidden_in(args, kwargs)
        fresh, others = self.make(x.shape, x.dtype), []

        def other(shape, dtype):
            others.append(self.make(shape, dtype))
            return others[-1]
        out, at = self.like_real(args, kwargs, fresh, other)
        self.calls.append(_Called(self.index, x, fresh, LayerCall(marked_args, marked_kwargs, at), others,
                                  self.sows(args, kwargs)))
        return out


@dataclasses.dataclass
class _Called:
    """One layer call as a ``_Link`` saw it."""

    index: int  # the layer's place in the list
    x: jax.Array  # the hidden state it was called on
    out: jax.Array  # the one it returned
    call: LayerCall
    others: list  # the rest of what it returned
    sows: bool  # it stores values in itself (``self.sow``)


@dataclasses.dataclass(frozen=True)
class Checked:
    """What ``PipelineParts.check`` found, and what ``check_the_loss`` traces next: how the
    model calls each layer (``calls``), each layer output (``outputs``: (kind, layer,
    abstract value)), whether a layer sows, and two losses of a model built in the
    trace: ``loss_of_outputs(model, tokens, values)`` with the layers returning
    ``values``, and ``probed_loss(model, tokens, probes)`` with the real layers, each
    one's sown values plus its probe."""

    calls: list
    outputs: list
    sows: bool
    loss_of_outputs: Callable
    probed_loss: Callable
    where: str
    name: str


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
                                      f"{dotted(sub)}; {fix}")
                owner[id(var)] = i


class _Pass(_StandIn):
    """Stands in for a layer: the hidden state goes through unchanged, or is replaced
    by the one the pipeline delivers (the last layer); its other outputs are zeros (the
    check has made sure the loss does not read them)."""

    def __init__(self, real, h=None):
        super().__init__(real)
        self.h = nnx.data(h)

    def __call__(self, *args, **kwargs):
        x = self.hidden_in(args, kwargs)[0]
        return self.like_real(args, kwargs, x if self.h is None else self.h, jnp.zeros)[0]


def list_parts(model) -> PipelineParts | None:
    """Parts of a model whose layers are one ``nnx.List`` that it calls in order: the
    prologue is the model's loss stopped at the first layer, the epilogue its loss
    with every layer passing the hidden state through and the last one replaced by
    the pipeline's output. None if the model has no such list."""
    lists = [(path, node) for path, node in nnx.iter_graph(model)
             if isinstance(node, LAYER_LISTS) and len(node) > 1
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
        layers[0] = _Stop(layers[0])
        try:
            _loss_with_stand_ins(m, tokens, jnp.zeros_like(tokens))
        except _Reached as reached:
            return reached.x
        raise ConfigError(f"{name}'s loss never calls {dotted(path)}[0]; give {name} a {HOOK}() method")

    def epilogue(m, h, targets, tokens=None):
        """``tokens``: the microbatch's, for a loss that reads them after the layers (a loss
        mask from the inputs); the pipeline carries them to the last stage only then."""
        layers = stack_of(m)
        for i in range(len(layers)):
            layers[i] = _Pass(layers[i], h if i == len(layers) - 1 else None)
        tokens = jnp.zeros(h.shape[:2], jnp.int32) if tokens is None else tokens
        return _loss_with_stand_ins(m, tokens, targets)

    def linked(m, tokens, reals, make=jnp.zeros, run=True) -> list:
        """``_Link`` stand-ins for ``reals`` put in ``m``, and the calls they record when the
        model's loss runs (``run``: now)."""
        layers, calls = stack_of(m), []
        for i in range(len(layers)):
            layers[i] = _Link(reals[i], i, calls, make)
        if run:
            _loss_with_stand_ins(m, tokens, jnp.zeros_like(tokens))
        return calls

    def sides(m, tokens) -> tuple:
        return tuple(_marked(linked(m, tokens, list(stack_of(m))))[1])

    def check(m, tokens):
        where = f"{name}.{dotted(path)}"
        reals = list(stack_of(m))
        _check_own_params(reals, where)
        # The parts run the layers back to back: the model must call each layer, once, on
        # the previous one's output. A loop computing between them (h = h + f(layer(h)))
        # would lose that computation in the pipeline.
        calls = linked(m, tokens, reals)
        if len(calls) != len(reals):
            raise ConfigError(f"{where}: the model's loss calls its {len(reals)} layers {len(calls)} times; "
                              f"the pipeline runs each once, in order: give {name} a {HOOK}() method")
        order = [c.index for c in calls]
        if order != sorted(order):
            raise ConfigError(f"{where}: the model calls its layers in the order {order}; the pipeline runs "
                              f"them in the list's order: put them in the list in the order they run")
        for i in range(1, len(calls)):
            if calls[i].x is not calls[i - 1].out:
                raise ConfigError(f"{where}[{i}] is not called on the output of {where}[{i - 1}]: the model "
                                  f"computes something between its layers (in its loop, e.g. a residual "
                                  f"or an activation), which a pipeline running the layers back to back "
                                  f"would lose; move it into the layer, or give {name} a {HOOK}() method")
        _check_one_stream(calls, where, name)
        outputs = [(kind, i, jax.ShapeDtypeStruct(a.shape, a.dtype)) for i, c in enumerate(calls)
                   for kind, a in (("hidden", c.out), *(("other", o) for o in c.others))]
        # Arguments besides the hidden state: static ones (flags such as deterministic=True,
        # None) are passed again to each unit, arrays as marks of the side inputs.
        return Checked(_marked(calls)[0], outputs, any(c.sows for c in calls), loss_of_outputs, probed_loss,
                       where, name)

    def loss_of_outputs(m, tokens, values):
        feed = list(values)
        linked(m, tokens, list(stack_of(m)), lambda shape, dtype: feed.pop(0), run=False)
        return _loss_with_stand_ins(m, tokens, jnp.zeros_like(tokens))

    def probed_loss(m, tokens, probes):
        layers = stack_of(m)
        for i in range(len(layers)):
            layers[i] = _Probed(layers[i], probes[i])
        return _loss_with_stand_ins(m, tokens, jnp.zeros_like(tokens))

    return PipelineParts(dotted(path), prologue, epilogue, check=check, sides=sides)


def _check_one_stream(calls: list, where: str, name: str) -> None:
    """A layer called with what an earlier one returned besides the hidden state (a second
    stream: Mamba's ``hidden, residual = layer(hidden, residual)``) is refused by name: the
    pipeline passes one array between layers (the side-input machinery would take the
    stand-in's placeholder for it)."""
    returned = {id(o): j for j, c in enumerate(calls) for o in c.others}
    for i, c in enumerate(calls):
        passed = jax.tree.leaves((c.call.args, c.call.kwargs))
        j = next((returned[id(a)] for a in passed if id(a) in returned), None)
        if j is not None:
            raise ConfigError(f"{where}[{i}] is called with what {where}[{j}] returned besides the hidden "
                              f"state (a second stream passed from layer to layer, e.g. a residual); the "
                              f"pipeline passes one array between layers: return one (e.g. the two "
                              f"concatenated on the feature axis), give {name} a {HOOK}() method, or train "
                              f"it without parallel.pipe")


def check_the_loss(checked: Checked, model_of, params, tokens) -> bool:
    """What follows the layers must read nothing but the last layer's hidden state and the
    microbatch's tokens: the epilogue runs on the last stage with those alone (no other
    layer's output, nothing a layer sowed). The loss is traced with every layer's outputs
    as inputs and each other output it depends on is refused by name; if a layer sows,
    traced again with the real layers and a probe added to what each sows. Returns
    whether it reads the tokens (a loss mask from the inputs, the embedded input added
    back): the pipeline then carries them to the last stage.

    Each trace builds the model itself (``model_of(params)``, ``params`` abstract): a
    model changed in a trace deeper than its own (stand-ins put in, ``nnx.capture``'s
    collections) raises Flax's TraceContextError."""
    where, name = checked.where, checked.name
    values = [a for _, _, a in checked.outputs]
    jaxpr = jax.make_jaxpr(lambda p, t, v: checked.loss_of_outputs(model_of(p), t, v))(
        params, tokens, values).jaxpr
    live, last = live_inputs(jaxpr), max(i for _, i, _ in checked.outputs)
    first = len(jaxpr.invars) - len(values)
    for (kind, i, _), var in zip(checked.outputs, jaxpr.invars[first:], strict=True):
        if var not in live or (kind, i) == ("hidden", last):
            continue
        if kind == "other":
            raise ConfigError(f"{where}: its layers return more than the hidden state and the model's loss "
                              f"reads the rest (e.g. an auxiliary loss); the pipeline passes the hidden "
                              f"state alone from layer to layer: give {name} a {HOOK}() method returning "
                              f"PipelineParts(..., aux_weight=...) for an auxiliary loss, or train it "
                              f"without parallel.pipe")
        raise ConfigError(f"{name}'s loss reads the output of {where}[{i}] besides passing it to "
                          f"{where}[{i + 1}] (e.g. every layer's hidden state kept for the loss); the "
                          f"pipeline hands each layer's output to the next layer only: train {name} "
                          f"without parallel.pipe")
    reads_tokens = jaxpr.invars[first - 1] in live
    if checked.sows:
        probes = [jax.ShapeDtypeStruct((), jnp.float32)] * (last + 1)
        jaxpr = jax.make_jaxpr(lambda p, t, probes: checked.probed_loss(model_of(p), t, probes))(
            params, tokens, probes).jaxpr
        live = live_inputs(jaxpr)
        if any(v in live for v in jaxpr.invars[len(jaxpr.invars) - len(probes):]):
            raise ConfigError(f"{where}: its layers sow values (self.sow, e.g. an auxiliary loss) that "
                              f"{name}'s loss reads; the pipeline passes the hidden state alone from layer "
                              f"to layer and computes the loss on the last stage, where nothing was sown: "
                              f"return (hidden, aux) from each layer and give {name} a {HOOK}() method "
                              f"returning PipelineParts(..., aux_weight=...), or train it without "
                              f"parallel.pipe")
    return reads_tokens


def calls_period(calls: list, k: int, where: str) -> int:
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
    raise ConfigError(f"{where}[{i}] is called with {calls[i]} but {where}[{i % k}], its "
                      f"place in the repeating group of {k}, with {calls[i % k]}, and the calls "
                      f"repeat in no group dividing the depth; the pipeline calls every unit alike: compute "
                      f"the difference inside the layer")
