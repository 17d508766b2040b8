"""SPara: supernet parallelism — many weight-sharing subnets trained at once, bitwise reproducible.

* ``space.py``   — genes, search spaces, ``Candidate`` parameters, one-hot selection and masks;
* ``model.py``   — ``SuperGPT``, the reference supernet (the GPT with searchable blocks);
* ``sampler.py`` — the subnets of step t as a pure function of (seed, t): uniform, sandwich;
* ``spec.py``    — ``SupernetSpec``: the supernet's parameters as flat vectors, its loss and gradient;
* ``plan.py``    — layout checks and each step's rounds and waves (host NumPy);
* ``optimizer.py`` — the fixed-order gradient reduction, clipping and the lazy sharded AdamW;
* ``spara.py``   — the vectorized multi-subnet step on the ``subnet`` × ``data`` mesh, its
  ``sync``, ``sequential`` and ``operator-causal`` semantics, and the plain-loop reference
  they are tested against;
  every subnet computed masked at full size (one program);
* ``sliced.py``  — the same step with each subnet computed from slices of the weights at
  its own depth and (ladder-rounded) widths / heads: one program per shape, cached;
* ``search.py``  — validation scores with inherited weights and the evolutionary search;
* ``trainer.py`` — ``train_supernet(config=...)``: the whole run from a config (checkpoints
  with ``checkpoint=True``); re-exports the two modules below;
* ``run_setup.py`` — a run's supernet and data from its config, a checkpoint's kind and
  fingerprint, the ``train.out_dir`` checks;
* ``run_search.py`` — the search at the end of training; ``search_checkpoint(run_dir)``: the
  search of a saved run.
"""

from mindpipe_jax.supernet.model import SuperGPT
from mindpipe_jax.supernet.sampler import STRATEGIES, Sampler, sample_subnets
from mindpipe_jax.supernet.search import SearchResult, evolutionary_search, make_evaluator
from mindpipe_jax.supernet.sliced import SlicedPlan, SlicedStep, plan_sliced
from mindpipe_jax.supernet.space import Candidate, Gene, SearchSpace, prefix_mask, select
from mindpipe_jax.supernet.spara import (
    SEMANTICS,
    StepPlan,
    causal_waves,
    init_state,
    jit_step,
    make_spara_step,
    plan_step,
    reference_step,
    sequential_waves,
    supernet_spec,
)
from mindpipe_jax.supernet.spec import Supernet, check_supernet
from mindpipe_jax.supernet.trainer import SupernetResult, search_checkpoint, supernet_factory, train_supernet

__all__ = [
    "Supernet", "check_supernet",
    "SuperGPT", "STRATEGIES", "Sampler", "sample_subnets", "SearchResult", "evolutionary_search",
    "make_evaluator", "SlicedPlan", "SlicedStep", "plan_sliced",
    "Candidate", "Gene", "SearchSpace", "prefix_mask", "select", "SEMANTICS",
    "StepPlan", "causal_waves", "sequential_waves", "init_state", "jit_step", "make_spara_step", "plan_step",
    "reference_step", "supernet_spec", "SupernetResult", "search_checkpoint", "supernet_factory",
    "train_supernet",
]
