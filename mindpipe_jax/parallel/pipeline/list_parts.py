"""The pipeline parts of a model whose layers are one ``nnx.List`` (or a plain list kept with
``nnx.data``) that it calls in order.

No method or attribute names are needed: the prologue is the model's loss stopped at the
first layer, the epilogue its loss with the layers passing the hidden state through and
the last one replaced by the pipeline's output. Before a run, ``check`` traces the loss
once with stand-in layers: each layer must hold its own parameters and be called once,
on the previous one's output; static arguments the model passes besides the hidden state
(``deterministic=True``) are recorded so each unit is called with them. Arrays passed
besides it (side inputs: a causal mask, positions) are recorded as ``SideInput`` marks
and ``sides`` computes them; ``contract.py`` lets the units recompute the ones that depend
on nothing but the microbatch's shape and refuses the rest.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mindpipe_jax.errors import ConfigError
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


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray))


def _marked(calls: list) -> tuple[list, list]:
    """Each recorded call's (args, kwargs) with every array replaced by its ``SideInput``
    mark (one per distinct array object: a mask computed once and passed to every layer is
    one side input), and those arrays in order of first use."""
    arrays: list = []

    def mark(x):
        if not _is_array(x):
            return x
        index = next((i for i, a in enumerate(arrays) if a is x), None)
        if index is None:
            arrays.append(x)
            index = len(arrays) - 1
        return SideInput(index)
    return [jax.tree.map(mark, (args, kwargs)) for _, _, args, kwargs in calls], arrays


class _Reached(Exception):  # noqa: N818 (a control-flow signal, not an error)
    def __init__(self, x):
        super().__init__()
        self.x = x


class _Stop(nnx.Module):
    """Stands in for the first layer: stops the model there with its input."""

    def __call__(self, x, *args, **kwargs):
        raise _Reached(x)  # the layers' other arguments: list_parts' check reads them


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
                                      f"{dotted(sub)}; {fix}")
                owner[id(var)] = i


class _Pass(nnx.Module):
    """Stands in for a layer: the hidden state goes through unchanged, or is replaced
    by the one the pipeline delivers (the last layer)."""

    def __init__(self, h=None):
        self.h = nnx.data(h)

    def __call__(self, x, *args, **kwargs):
        return x if self.h is None else self.h


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
        layers[0] = _Stop()
        try:
            model_loss(m, tokens, jnp.zeros_like(tokens))
        except _Reached as reached:
            return reached.x
        raise ConfigError(f"{name}'s loss never calls {dotted(path)}[0]; give {name} a {HOOK}() method")

    def epilogue(m, h, targets):
        layers = stack_of(m)
        for i in range(len(layers)):
            layers[i] = _Pass(h if i == len(layers) - 1 else None)
        return model_loss(m, jnp.zeros(h.shape[:2], jnp.int32), targets)

    def linked_calls(m, tokens) -> list:
        layers, calls = stack_of(m), []
        for i in range(len(layers)):
            layers[i] = _Link(calls)
        model_loss(m, tokens, jnp.zeros_like(tokens))
        return calls

    def sides(m, tokens) -> tuple:
        return tuple(_marked(linked_calls(m, tokens))[1])

    def check(m, tokens):
        where = f"{name}.{dotted(path)}"
        _check_own_params(stack_of(m), where)
        # The parts run the layers back to back: the model must call each layer, once, on
        # the previous one's output. A loop computing between them (h = h + f(layer(h)))
        # would lose that computation in the pipeline.
        layers, calls = stack_of(m), linked_calls(m, tokens)
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
        # None) are passed again to each unit, arrays as marks of the side inputs.
        return _marked(calls)[0]

    return PipelineParts(dotted(path), prologue, epilogue, check=check, sides=sides)


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
    raise ConfigError(f"{where}[{i}] is called with {_shown_call(calls[i])} but {where}[{i % k}], its "
                      f"place in the repeating group of {k}, with {_shown_call(calls[i % k])}, and the calls "
                      f"repeat in no group dividing the depth; the pipeline calls every unit alike: compute "
                      f"the difference inside the layer")


def _shown_call(call) -> str:
    args, kwargs = call
    return "(" + ", ".join(["h", *map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())]) + ")"
