"""Executing a schedule table inside ``jax.shard_map`` (``grads.pipeline_grads``), the
per-tick arrays it indexes (``tickplan``), what it keeps between a forward and a
backward (``residuals``), which layers each stage runs (``layout``), the chunk-wise
gradient ring (``ringsync``) and the GPipe-autodiff baseline (``gpipe_autodiff``)."""

from mindpipe_jax.parallel.pipeline.runtime.grads import pipeline_grads
from mindpipe_jax.parallel.pipeline.runtime.layout import StageLayout
from mindpipe_jax.parallel.pipeline.runtime.spmd import AXIS, BATCH, MANUAL, StageFns, needs_lockstep
from mindpipe_jax.parallel.pipeline.runtime.tickplan import REMAT_POLICIES, Plan, make_plan

__all__ = ["AXIS", "BATCH", "MANUAL", "REMAT_POLICIES", "Plan", "StageFns", "StageLayout", "make_plan",
           "needs_lockstep", "pipeline_grads"]
