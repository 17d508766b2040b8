"""The pipeline parts of a model whose layers are one ``nnx.List`` (or a plain list kept with
``nnx.data``) that it calls in order.

No method or attribute names are needed: the prologue is the model's loss stopped at the
first layer, the epilogue its loss with the layers passing the hidden state through and
the last one replaced by the pipeline's output. Before a run, ``check`` traces the loss
with stand-in layers (``stand_ins.py``): each layer must hold its own parameters and be called once, in the
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

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from mindpipe_jax.errors import ConfigError
from mindpipe_jax.parallel.pipeline.autosplit import live_inputs
from mindpipe_jax.parallel.pipeline.parts import HOOK, PipelineParts, dotted
from mindpipe_jax.parallel.pipeline.stand_ins import (
    Link,
    Pass,
    Probed,
    Reached,
    Stop,
    loss_with_stand_ins,
    marked,
)

# What holds a model's layers as a list: nnx.List, or a plain list the model keeps as data
# (``nnx.data([...])``, one of the fixes Flax's own error for a list of modules offers).
LAYER_LISTS = (nnx.List, list)


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
        layers[0] = Stop(layers[0])
        try:
            loss_with_stand_ins(m, tokens, jnp.zeros_like(tokens))
        except Reached as reached:
            return reached.x
        raise ConfigError(f"{name}'s loss never calls {dotted(path)}[0]; give {name} a {HOOK}() method")

    def epilogue(m, h, targets, tokens=None):
        """``tokens``: the microbatch's, for a loss that reads them after the layers (a loss
        mask from the inputs); the pipeline carries them to the last stage only then."""
        layers = stack_of(m)
        for i in range(len(layers)):
            layers[i] = Pass(layers[i], h if i == len(layers) - 1 else None)
        tokens = jnp.zeros(h.shape[:2], jnp.int32) if tokens is None else tokens
        return loss_with_stand_ins(m, tokens, targets)

    def linked(m, tokens, reals, make=jnp.zeros, run=True) -> list:
        """``Link`` stand-ins for ``reals`` put in ``m``, and the calls they record when the
        model's loss runs (``run``: now)."""
        layers, calls = stack_of(m), []
        for i in range(len(layers)):
            layers[i] = Link(reals[i], i, calls, make)
        if run:
            loss_with_stand_ins(m, tokens, jnp.zeros_like(tokens))
        return calls

    def sides(m, tokens) -> tuple:
        return tuple(marked(linked(m, tokens, list(stack_of(m))))[1])

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
        return Checked(marked(calls)[0], outputs, any(c.sows for c in calls), loss_of_outputs, probed_loss,
                       where, name)

    def loss_of_outputs(m, tokens, values):
        feed = list(values)
        linked(m, tokens, list(stack_of(m)), lambda shape, dtype: feed.pop(0), run=False)
        return loss_with_stand_ins(m, tokens, jnp.zeros_like(tokens))

    def probed_loss(m, tokens, probes):
        layers = stack_of(m)
        for i in range(len(layers)):
            layers[i] = Probed(layers[i], probes[i])
        return loss_with_stand_ins(m, tokens, jnp.zeros_like(tokens))

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
