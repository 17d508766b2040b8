"""Meshes, the logical-axis rules table, and (later) the pipeline runtime."""

from mindpipe_jax.parallel.mesh import MESH_ORDER, make_mesh, setup_runtime
from mindpipe_jax.parallel.rules import RULES, check_sharded_as_rules, constrain, spec_for, state_shardings

__all__ = ["MESH_ORDER", "make_mesh", "setup_runtime", "RULES", "check_sharded_as_rules",
           "constrain", "spec_for", "state_shardings"]
