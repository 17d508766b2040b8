"""What the tuner needs to know of a user's model: ``cfg.model`` describes the built-in
GPT only, so a candidate layout of a user's model is judged on the model itself.

``ModelFacts.of(model, cfg)`` builds the model abstractly once (``train.state.model_spec``
on a one-device abstract mesh: a factory, an ``nnx.Module`` or a Linen module, as
``train`` takes it) and keeps its parameters' logical names and shapes, so a candidate's
mesh is checked against the rules table as the run would build it (a dimension that does
not divide is named in one line, before anything is compiled); its stack's depth for the
pipeline split; and a factory rebuilding it for the cost measurements.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, AxisType

from mindpipe_jax.config import Config
from mindpipe_jax.errors import ConfigError


def _abstract_mesh(axes: dict[str, int]) -> AbstractMesh:
    from mindpipe_jax.parallel.mesh import MESH_ORDER

    return AbstractMesh(tuple(axes.get(a, 1) for a in MESH_ORDER), MESH_ORDER,
                        axis_types=(AxisType.Auto,) * len(MESH_ORDER))


@dataclasses.dataclass(eq=False)
class ModelFacts:
    """A user's model as the tuner judges candidates for it (``of``)."""

    spec: Any  # train.state.ModelSpec on a one-device mesh
    params: Any  # abstract nnx.State of its nnx.Params, logical names kept
    seq_len: int

    @classmethod
    def of(cls, model, cfg: Config) -> ModelFacts:
        from mindpipe_jax.train.state import model_spec

        with jax.set_mesh(None):  # abstract shapes keep logical names; an ambient mesh would bind them
            example = np.zeros((1, cfg.model.seq_len), np.int32)  # what initialises a Linen model
            spec, _ = model_spec(model, _abstract_mesh({}), cfg.train.seed, example)
            shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), spec.abstract_params)
            params = nnx.state(nnx.eval_shape(lambda: spec.merge(shapes)), nnx.Param)
        return cls(spec, params, cfg.model.seq_len)

    @functools.cached_property
    def _depth(self) -> tuple[int, str, int] | ConfigError:
        from mindpipe_jax.train.step import pipeline_model

        try:
            with jax.set_mesh(None):
                model = pipeline_model(self.spec, self.seq_len)
        except ConfigError as err:  # kept: every pipeline candidate gets the same answer
            return err
        return model.num_units, model.name, model.group

    @property
    def depth(self) -> tuple[int, str, int]:
        """(units of its layer stack, the model's name, layers per unit), as the pipeline
        splits it; ConfigError (the contract's reason) when the model cannot be pipelined."""
        if isinstance(self._depth, ConfigError):
            raise self._depth
        return self._depth

    def unshardable(self, axes: dict[str, int]) -> str | None:
        """Why the model's parameters cannot be laid out on a mesh of ``axes`` (the rules
        table's one line), or None."""
        from mindpipe_jax.parallel.rules import state_shardings

        mesh = _abstract_mesh(axes)
        try:
            for kind in ("storage", "compute"):
                state_shardings(self.params, mesh, kind)
        except ConfigError as err:
            return str(err)
        return None

    def factory(self):
        """A factory ``rngs -> nnx.Module`` of the model, for the cost measurements."""
        from mindpipe_jax.train.state import probe_factory

        return probe_factory(self.spec)


def facts_of(model, cfg: Config) -> ModelFacts | None:
    """``ModelFacts`` of a user's model; None for the built-in one (``cfg.model``)."""
    return None if model is None else ModelFacts.of(model, cfg)
