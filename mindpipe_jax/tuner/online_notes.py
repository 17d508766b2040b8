"""What a tuned run says when it starts about settings the online tuner cannot act on,
so that none is ignored without a word: batch sizes of ``tuner.batch_sizes`` no
candidate can run, and a run that ends before the tuner's first decision."""

from __future__ import annotations

import dataclasses

from mindpipe_jax.tuner.space import check_candidate


def first_decision_step(warmup: int, every: int) -> int:
    """The first step count after which ``OnlineTuner.due`` holds (steps counted from 1)."""
    return -(-max(warmup, 1) // every) * every   # the first multiple of every >= max(warmup, 1)


def start_notes(tuner, steps: int, start: int = 0) -> list[str]:
    """Lines for the run's log: the batch sizes asked for and left out (each with the
    reason on the current layout), and that no decision falls before ``steps``."""
    tc, cur = tuner.cfg.tuner, tuner.current
    notes = []
    if tc.batch_sizes:
        have = {c.global_batch for c in tuner.candidates}
        missing = sorted(set(tc.batch_sizes) - have)
        if missing:
            why = check_candidate(tuner.cfg, dataclasses.replace(cur, global_batch=missing[0]),
                                  tuner.num_devices, tuner.facts)
            where = "no layout the tuner may choose can run" if tc.meshes else "the run's layout cannot run"
            notes.append(f"tuner: tuner.batch_sizes {', '.join(map(str, missing))} left out: {where} "
                         f"{'it' if len(missing) == 1 else 'them'}"
                         + (f" (batch {missing[0]}: {why})" if why else ""))
    first = first_decision_step(tc.warmup, tc.every)
    while first <= start:
        first += tc.every
    if first >= steps:
        notes.append(f"tuner: no decision in this run: the first would follow step {first} (tuner.warmup="
                     f"{tc.warmup}, tuner.every={tc.every}) and the run ends at step {steps}; lower "
                     f"tuner.warmup or tuner.every")
    elif len(tuner.candidates) == 1:
        notes.append(f"tuner: nothing to compare: {cur.label()} is the only candidate (tuner.batch_sizes, "
                     f"tuner.min_batch/max_batch, tuner.meshes={str(tc.meshes).lower()})")
    return notes
