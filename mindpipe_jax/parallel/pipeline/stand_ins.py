"""Stand-ins for a model's layers, and the marks they record: how ``list_parts.py`` runs a
model's own loss to find its pipeline parts without running its layers.

A stand-in replaces one layer of the model's list while the model's loss runs: ``Stop``
(the first layer: the prologue ends there), ``Pass`` (hands the pipeline's hidden state
on: the epilogue), ``Link`` (records how the model calls the layer and returns new
arrays, so the chain of calls shows) and ``Probed`` (runs the real layer and marks what it
sows). A call is recorded as a ``LayerCall`` with ``HIDDEN`` where the hidden state goes
and ``SideInput`` marks where other arrays go. The model's own rematerialisation is
switched off while stand-ins run (``loss_with_stand_ins``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.typing import Missing

from mindpipe_jax.errors import ConfigError
from mindpipe_jax.parallel.pipeline.parts import model_loss


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


def marked(calls: list) -> tuple[list, list]:
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


def loss_with_stand_ins(m, tokens, targets):
    with _without_remat():
        return model_loss(m, tokens, targets)


class Reached(Exception):  # noqa: N818 (a control-flow signal, not an error)
    def __init__(self, x):
        super().__init__()
        self.x = x


_RETURNED: dict = {}  # StandIn.returned's cache


class StandIn(nnx.Module):
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


class Probed(StandIn):
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


class Stop(StandIn):
    """Stands in for the first layer: stops the model there with its input."""

    def __call__(self, *args, **kwargs):
        raise Reached(self.hidden_in(args, kwargs)[0])


class Link(StandIn):
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
        self.calls.append(Called(self.index, x, fresh, LayerCall(marked_args, marked_kwargs, at), others,
                                  self.sows(args, kwargs)))
        return out


@dataclasses.dataclass
class Called:
    """One layer call as a ``Link`` saw it."""

    index: int  # the layer's place in the list
    x: jax.Array  # the hidden state it was called on
    out: jax.Array  # the one it returned
    call: LayerCall
    others: list  # the rest of what it returned
    sows: bool  # it stores values in itself (``self.sow``)


class Pass(StandIn):
    """Stands in for a layer: the hidden state goes through unchanged, or is replaced
    by the one the pipeline delivers (the last layer); its other outputs are zeros (the
    check has made sure the loss does not read them)."""

    def __init__(self, real, h=None):
        super().__init__(real)
        self.h = nnx.data(h)

    def __call__(self, *args, **kwargs):
        x = self.hidden_in(args, kwargs)[0]
        return self.like_real(args, kwargs, x if self.h is None else self.h, jnp.zeros)[0]
