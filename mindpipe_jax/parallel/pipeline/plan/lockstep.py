"""What the tick loop costs when the stages run in lockstep (tensor > 1,
``runtime.spmd.needs_lockstep``): in each fused tick every device runs every branch some
device takes (a branch is a task kind at a stage position: first, middle or last;
``tickplan.PartPlan.active``), each on its own stage's weights, so a tick costs the sum of
its active branches on every device. The runtime merges every stage's tasks of a kind
into one branch (``make_plan(merge_first, merge_last)``: the last stage's forward runs
its layers and the loss), which costs the dearest of the stages sharing it (the widest
middle stage's work for a middle position). Used by the partitioner's plan and the
tuner's cost model alike.
"""

from __future__ import annotations

import numpy as np


def lockstep_ticks_seconds(plan, costs) -> float:
    """Seconds of the tick loop of ``plan`` (``tickplan.make_plan``, merged as the
    lockstep runtime makes it) with per-global-stage ``costs`` (``sim.StageCosts``:
    ``F``, ``B``, ``W``, ``BW``), compute only."""
    from mindpipe_jax.parallel.pipeline.runtime.tickplan import EITHER, FIRST, LAST, MID
    from mindpipe_jax.parallel.pipeline.schedules import Kind

    last = len(costs.F) - 1
    middle = max(range(1, last), key=lambda g: costs.BW[g]) if last > 1 else 0  # the widest
    stage_at = {FIRST: 0, LAST: last}
    inside = not plan.merge_last  # the last stage's forward runs inside its backward

    def cost(kind, pos) -> float:
        if pos == EITHER:  # the stages sharing the branch: the dearest of them
            return max(cost(kind, q) for q in ((FIRST, MID) if inside else (FIRST, MID, LAST)))
        g = stage_at.get(pos, middle)
        if kind is Kind.F:
            return 0.0 if pos == LAST and inside else costs.F[g]
        work = {Kind.B: costs.B[g], Kind.W: costs.W[g], Kind.BW: costs.BW[g]}[kind]
        return work + (costs.F[g] if pos == LAST and inside and kind is not Kind.W else 0.0)

    return sum(float((part.active() @ np.array([cost(kind, pos) for kind, pos, _ in part.keys])).sum())
               for part in plan.parts if part.keys)
