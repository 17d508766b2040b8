"""The train state: what it holds, its shardings, and how it is created.

The state is a plain pytree ``{"step", "params", "opt", "rng"}`` whose params are
a pure nested dict (no Flax metadata), so checkpoints stay readable by any tool
and restore onto any mesh. The model's structure (``graphdef``) and the
non-trainable variables are static and live in ``ModelSpec``.

Creation follows the abstract-first path: ``nnx.eval_shape`` gives shapes and
logical names without allocating, the rules table turns them into shardings, and
one jitted init writes every parameter directly into its shard.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import traceback
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mindpipe_jax.config import Config, OptimConfig
from mindpipe_jax.errors import ConfigError
from mindpipe_jax.models.bridge import from_linen, is_linen
from mindpipe_jax.parallel.pipeline.parts import merged
from mindpipe_jax.parallel.rules import state_shardings
from mindpipe_jax.train.checkpoint import config_changes

ModelFactory = Callable[[nnx.Rngs], nnx.Module]
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # mindpipe_jax/


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Static facts about a model: structure, abstract params and their shardings."""

    graphdef: Any
    # Non-trainable variables (an nnx State): constant buffers (``is_buffer``) with their
    # values, held fixed and not checkpointed (the factory rebuilds them), and empty ones.
    rest: Any
    abstract_params: Any  # pure dict of ShapeDtypeStruct with storage shardings
    storage: Any  # pure dict of NamedSharding (between steps)
    compute: Any  # pure dict of NamedSharding (inside the step)
    decay_mask: Any  # pure dict of bool: which params get weight decay
    loss_takes_key: bool
    has_loss: bool

    def merge(self, params):
        return merged(self.graphdef, params, self.rest)  # fresh variables for each model built

    def fingerprint(self) -> dict[str, list[int]]:
        """Parameter paths and shapes: how a checkpoint recognises its model."""
        flat = jax.tree_util.tree_flatten_with_path(self.abstract_params)[0]
        return {jax.tree_util.keystr(path): list(leaf.shape) for path, leaf in flat}


def probe_factory(spec: ModelSpec) -> Callable[[Any], Any]:
    """A factory ``rngs -> nnx.Module`` rebuilding ``spec``'s model (a user's factory,
    module or Linen model alike) on one host's values of its parameter shapes: what
    measuring a layer's costs needs (``measure_layer_costs``); the values do not change
    what a layer costs, and a run's trained ones may live on other processes' devices."""
    rng = np.random.default_rng(0)

    def leaf(a):
        if jnp.issubdtype(a.dtype, jnp.floating):
            return (rng.standard_normal(a.shape) * 0.02).astype(a.dtype)
        return np.zeros(a.shape, a.dtype)

    values = jax.tree.map(leaf, spec.abstract_params)
    return lambda rngs: spec.merge(values)


def _pure(tree):
    return nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else tree


def _decays(variable) -> bool:
    """Weight decay for matrices only: norms, biases and scalars are left alone.

    Decided from logical names when present so a stacked bias (layers, embed) is
    still a bias; otherwise from the array rank.
    """
    names = (variable.get_metadata() or {}).get("out_sharding")
    shape = variable.get_value().shape
    if names is not None:
        return sum(1 for n in names if n not in ("layers", "stages")) >= 2
    return len(shape) >= 2


# Variables the model updates as it runs, or that hold no constant: not buffers.
_NOT_BUFFERS = (nnx.Param, nnx.RngState, nnx.BatchStat, nnx.Cache, nnx.Intermediate, nnx.Perturbation)


def is_buffer(variable) -> bool:
    """A constant the model keeps beside its parameters (``nnx.Variable(inv_freq)``, a
    subclass of it of the user's): held fixed through training, as a non-trainable
    buffer is elsewhere."""
    return isinstance(variable, nnx.Variable) and not isinstance(variable, _NOT_BUFFERS)


def buffers(state) -> list:
    """(path, variable) of every buffer holding values in ``state`` (an nnx State)."""
    return [(path, var) for path, var in nnx.to_flat_state(state) if is_buffer(var) and jax.tree.leaves(var)]


def _refuse_extra_state(rest) -> None:
    """Name every variable that is neither an ``nnx.Param`` nor a constant buffer (the
    train state holds Params; buffers stay as built, ``is_buffer``)."""
    flat = [(path, var) for path, var in nnx.to_flat_state(rest)
            if jax.tree.leaves(var) and not is_buffer(var)]
    if flat:
        names = ", ".join(f"{'/'.join(map(str, path))} ({type(var).__name__})" for path, var in flat[:6])
        more = f" and {len(flat) - 6} more" if len(flat) > 6 else ""
        # Random streams (dropout built with rngs=) and running statistics need other fixes
        # than a buffer does.
        if any(isinstance(var, nnx.RngState) for _, var in flat):
            fix = ("the train step draws no random numbers: build dropout and other random layers "
                   "without rngs=, e.g. nnx.Dropout(rate, deterministic=True)")
        elif any(isinstance(var, nnx.BatchStat) for _, var in flat):
            fix = ("the train step keeps no running statistics: normalise without them, e.g. "
                   "nnx.LayerNorm or nnx.RMSNorm")
        else:
            fix = ("make a trained array nnx.Param, and keep a constant (rotary frequencies, a mask) "
                   "as an nnx.Variable or compute it inside __call__")
        raise ConfigError(f"the model has variables that are not nnx.Param: {names}{more}; mindpipe_jax "
                          f"trains models whose state is nnx.Param only ({fix})")


# The parameter dtypes the step and its AdamW train (float64 where jax_enable_x64 is on).
_TRAINED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float64)


def refuse_untrainable_params(abstract_state) -> None:
    """An ``nnx.Param`` the step cannot train, named by its path: integers or booleans
    (a step counter, a mask: ``jax.grad`` stopped at them with a traceback, after the run
    directory was made), float16 (Adam's eps of 1e-8 is 0 there, so a parameter with a
    zero gradient, an embedding row no batch touched, became NaN at the first update)
    and other dtypes (complex: the checkpoint's checksum crashed on them)."""
    flat = [(path, var.get_value()) for path, var in nnx.to_flat_state(abstract_state)]
    bad = [(path, leaf) for path, leaf in flat if leaf.dtype not in _TRAINED_DTYPES]
    if not bad:
        return
    names = ", ".join(f"{'/'.join(map(str, path))} ({leaf.dtype}{list(leaf.shape)})"
                      for path, leaf in bad[:6])
    names += f" and {len(bad) - 6} more" if len(bad) > 6 else ""
    dtypes = {leaf.dtype for _, leaf in bad}
    if all(not jnp.issubdtype(d, jnp.inexact) for d in dtypes):
        why = ("the train step differentiates every nnx.Param, which needs floats: keep a constant one as "
               "an nnx.Variable (held fixed), or make it a float")
    elif dtypes == {jnp.dtype(jnp.float16)}:
        why = ("AdamW's eps (1e-8) is 0 in float16, so a parameter whose gradient is 0 becomes NaN at the "
               "first update: store parameters in bfloat16 or float32 (a layer may still compute in float16)")
    else:
        why = "mindpipe_jax trains float32 and bfloat16 parameters: store them in one of those"
    raise ConfigError(f"the model has nnx.Param it cannot train: {names}; {why}")


def _refuse_bare_arrays(model) -> None:
    """Arrays kept as plain module attributes (``self.inv_freq = jnp.array(...)``): Flax
    makes them state that is no Variable, which the train state cannot place (it crashed
    tracing the model, with a leaked tracer or a pytree metadata error)."""
    bare = [(path, leaf) for path, leaf in nnx.iter_graph(model) if isinstance(leaf, (jax.Array, np.ndarray))]
    if bare:
        names = ", ".join(f"{'/'.join(map(str, path))} ({leaf.dtype}{list(leaf.shape)})"
                          for path, leaf in bare[:6])
        more = f" and {len(bare) - 6} more" if len(bare) > 6 else ""
        raise ConfigError(f"the model keeps arrays as plain attributes: {names}{more}; mindpipe_jax trains "
                          f"models whose state is nnx.Param and constant nnx.Variable buffers: make a "
                          f"trained array nnx.Param, and a constant (rotary frequencies, a mask) an "
                          f"nnx.Variable")


def abstract_model(factory, seed: int = 0):
    """``factory(nnx.Rngs(seed))`` built abstractly (``nnx.eval_shape``, without eager
    sharding: annotated modules build outside a mesh), with a factory that raises or returns
    something other than an ``nnx.Module`` refused in one line naming where in the user's
    code it raised."""
    name = getattr(factory, "__qualname__", type(factory).__name__)
    try:
        inspect.signature(factory).bind(None)
    except TypeError as err:
        raise ConfigError(f"the model factory {name} cannot be called as {name}(rngs) ({err}): give it "
                          f"an rngs parameter (an nnx.Rngs to build its parameters from), or pass the "
                          f"model itself (an nnx.Module, or a Linen module)") from None
    except ValueError:  # no signature to read (a builtin): calling it will tell
        pass

    def checked():
        with nnx.use_eager_sharding(False):
            model = factory(nnx.Rngs(seed))
        if is_linen(model):
            raise ConfigError(f"the model factory {name}(rngs) returned a Linen module "
                              f"({type(model).__name__}); pass the Linen module itself (or "
                              f"mindpipe_jax.from_linen(module, example_input)), not a factory of it")
        if not isinstance(model, nnx.Module):
            raise ConfigError(f"the model factory {name}(rngs) returned {type(model).__name__}; it must "
                              f"return an nnx.Module")
        _refuse_bare_arrays(model)
        return model

    try:
        return nnx.eval_shape(checked)
    except ConfigError:
        raise
    except Exception as err:  # the user's own code: one line, its place in their file
        raise user_code_error(err, f"building the model, {name}(rngs)") from None


def user_code_error(err: Exception, doing: str) -> ConfigError:
    """``err``, raised by the user's own code while ``doing``, as one line naming the last
    place in their files it passed through."""
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if "site-packages" not in f.filename and PACKAGE_DIR not in f.filename]
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return ConfigError(f"{doing} raised {type(err).__name__}: {first}{where}")


def model_spec(model_or_factory, mesh, seed: int, example_input=None
               ) -> tuple[ModelSpec, Callable[[], Any] | None]:
    """Abstract model → ModelSpec, plus a zero-argument function that creates params.

    ``model_or_factory`` is an ``nnx.Module`` (its current values are used), a
    callable ``rngs -> nnx.Module`` (created sharded, never whole on one device), or
    a Linen module, wrapped through ``nnx.bridge`` and initialised on
    ``example_input`` (``models/bridge.py``).
    """
    if is_linen(model_or_factory):
        if example_input is None:
            raise ConfigError(f"a Linen model ({type(model_or_factory).__name__}) needs an example input "
                              f"to initialise it: pass example_input=, or use "
                              f"mindpipe_jax.from_linen(module, example_input)")
        model_or_factory = from_linen(model_or_factory, example_input)
    if isinstance(model_or_factory, nnx.Module):
        _refuse_bare_arrays(model_or_factory)
        graphdef, params, rest = nnx.split(model_or_factory, nnx.Param, ...)
        _refuse_extra_state(rest)
        abstract_state = nnx.eval_shape(lambda: params)
        concrete = _pure(params)
        create = lambda: concrete  # noqa: E731
        probe = model_or_factory
    elif callable(model_or_factory):
        def build():
            with nnx.use_eager_sharding(False):
                return model_or_factory(nnx.Rngs(seed))

        probe = abstract_model(model_or_factory, seed)
        graphdef, abstract_state, rest = nnx.split(probe, nnx.Param, ...)
        _refuse_extra_state(rest)
        if buffers(rest):  # their values, once: the step holds them as constants
            rest = jax.jit(lambda: nnx.split(build(), nnx.Param, ...)[2])()

        def create():
            return _pure(nnx.split(build(), nnx.Param, ...)[1])
    else:
        raise ConfigError(f"model must be an nnx.Module or a callable rngs -> nnx.Module, "
                          f"got {type(model_or_factory).__name__}")
    if not jax.tree.leaves(abstract_state):
        raise ConfigError("the model has no nnx.Param to train")
    refuse_untrainable_params(abstract_state)
    storage = _pure(state_shardings(abstract_state, mesh, "storage"))
    compute = _pure(state_shardings(abstract_state, mesh, "compute"))
    mask = _pure(nnx.map_state(lambda _, v: v.replace(_decays(v)), abstract_state))
    shapes = _pure(abstract_state)
    abstract_params = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, storage)
    loss = getattr(probe, "loss", None)
    takes_key = loss is not None and "dropout_key" in inspect.signature(loss).parameters
    spec = ModelSpec(graphdef, rest, abstract_params, storage, compute, mask, takes_key, loss is not None)
    return spec, create


def lr_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0 if warmup else cfg.lr, peak_value=cfg.lr, warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1), end_value=cfg.lr * cfg.min_lr_ratio)


def resumed_lr_note(saved_config: dict, cfg: OptimConfig, total_steps: int, step: int) -> str | None:
    """One line where a resume re-times the learning-rate schedule: the warmup is capped
    by, and the cosine decays over, ``train.steps``, so extending a run (or shortening
    it) changes the lr of the steps still to come. ``None`` where the next step's lr is
    unchanged. ``saved_config``: the checkpoint's ``Config.to_dict()``."""
    saved_steps = (saved_config.get("train") or {}).get("steps")
    if not isinstance(saved_steps, int) or saved_steps == total_steps:
        return None
    before = float(lr_schedule(cfg, saved_steps)(step))
    after = float(lr_schedule(cfg, total_steps)(step))
    if math.isclose(before, after, rel_tol=1e-3):
        return None
    return (f"train.steps {saved_steps} -> {total_steps} re-times the learning-rate schedule: step "
            f"{step + 1} trains at lr {after:.2e} ({before:.2e} with train.steps={saved_steps})")


def resume_lines(saved_meta: dict, cfg: Config, step: int) -> list[str]:
    """What a resume from ``step`` prints before it trains: the config keys that changed
    since the checkpoint's run, and the learning-rate schedule it re-times (both the train
    loop's and SPara's)."""
    saved = saved_meta.get("config") or {}
    lines = []
    if changed := config_changes(saved, cfg.to_dict()):
        lines.append(f"resuming step {step} with a changed config: {', '.join(changed)}")
    if note := resumed_lr_note(saved, cfg.optim, cfg.train.steps, step):
        lines.append(note)
    return lines


def make_optimizer(cfg: OptimConfig, total_steps: int, decay_mask) -> optax.GradientTransformation:
    parts = [optax.clip_by_global_norm(cfg.clip_norm)] if cfg.clip_norm > 0 else []
    parts.append(optax.adamw(lr_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                             weight_decay=cfg.weight_decay, mask=decay_mask))
    return optax.chain(*parts)


def state_shardings_for(spec: ModelSpec, tx, mesh):
    """Shardings of the whole train state.

    An optimizer leaf found under a parameter's path with that parameter's shape
    (optax keeps Adam's ``mu`` and ``nu`` as trees mirroring the params, under any
    chain or mask) is stored as that parameter is; anything else (step counts) is
    replicated. Not read off the compiled ``tx.init``: ``zeros_like`` inside ``jit``
    has no input to inherit a sharding from, and XLA replicated every moment (with
    ``fsdp=8`` each device held all of Adam's state).
    """
    rep = NamedSharding(mesh, P())
    params = {_path_keys(path): (leaf.shape, sharding) for (path, leaf), sharding in zip(
        jax.tree_util.tree_flatten_with_path(spec.abstract_params)[0], jax.tree.leaves(spec.storage),
        strict=True)}

    def one(path, leaf):
        keys = _path_keys(path)
        for start in range(len(keys)):  # the longest suffix that names a parameter
            shape, sharding = params.get(keys[start:], (None, None))
            if shape is not None:
                return sharding if shape == leaf.shape else rep
        return rep

    opt = jax.tree_util.tree_map_with_path(one, jax.eval_shape(tx.init, spec.abstract_params))
    return {"step": rep, "params": spec.storage, "opt": opt, "rng": rep}


def _path_keys(path) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path)


def abstract_train_state(spec: ModelSpec, tx, mesh, shardings=None):
    shardings = shardings or state_shardings_for(spec, tx, mesh)
    shapes = {
        "step": jax.ShapeDtypeStruct((), jnp.int32),
        "params": spec.abstract_params,
        "opt": jax.eval_shape(tx.init, spec.abstract_params),
        "rng": jax.ShapeDtypeStruct((2,), jnp.uint32),
    }
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, shardings)


def init_train_state(spec: ModelSpec, create, tx, mesh, seed: int, shardings=None):
    """Create params and optimizer state directly in their shards (one jitted call)."""
    shardings = shardings or state_shardings_for(spec, tx, mesh)

    def init():
        params = create()
        params = jax.tree.map(lambda p, a: p.astype(a.dtype), params, spec.abstract_params)
        return {"step": jnp.zeros((), jnp.int32), "params": params, "opt": tx.init(params),
                "rng": jax.random.key_data(jax.random.key(seed)).astype(jnp.uint32)}

    return jax.jit(init, out_shardings=shardings)()
