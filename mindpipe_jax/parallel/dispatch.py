"""How far the host may dispatch ahead of the devices.

JAX dispatches asynchronously: a Python loop that calls a jitted step queues
programs and returns at once. XLA:CPU lets each device queue at most 32
computations (the PjRt CPU client's ``max_inflight_computations_per_device``),
and past that a program with collectives can deadlock: the dispatching thread
waits on one device's queue while the programs already queued wait in a
collective for peers that thread has not reached. XLA then aborts the process
after its 40 s rendezvous timeout. Measured on jax 0.10.2 with 8 CPU devices: a
jitted ``psum`` called 100 times without a sync aborts (kept to 33 in flight it
still did; to 17, never), and so did the train loop with 55-100 steps between its host
syncs (``train.log_every``). A GPU queues deeper, but nothing is gained there
from more than a step or two of look-ahead either.

So the loops keep at most ``STEPS_AHEAD`` steps queued (``DispatchWindow``), and a
step that is several programs (SPara's sliced steps: one program per round or
pass) waits for its carry every ``PROGRAMS_AHEAD`` programs (``throttle``).
"""

from __future__ import annotations

import collections

import jax

STEPS_AHEAD = 2  # one step running, the next one queued behind it
PROGRAMS_AHEAD = 8  # well under XLA:CPU's 32 per device


class DispatchWindow:
    """At most ``limit`` dispatched steps not yet finished: ``push`` each step's
    outputs (not donated later, e.g. its metrics); once more than ``limit`` are
    queued it waits for the oldest."""

    def __init__(self, limit: int = STEPS_AHEAD):
        if limit < 1:
            raise ValueError(f"a dispatch window of {limit} steps: must be >= 1")
        self.limit = limit
        self._queued: collections.deque = collections.deque()

    def push(self, outputs) -> None:
        self._queued.append(outputs)
        while len(self._queued) > self.limit:
            jax.block_until_ready(self._queued.popleft())

    def __len__(self) -> int:
        return len(self._queued)


def throttle(index: int, carry, every: int = PROGRAMS_AHEAD):
    """Inside a step made of several programs: before dispatching program ``index``
    (0-based) with ``carry`` (the previous program's output, about to be donated),
    wait for it every ``every`` programs. Returns ``carry``."""
    if index and index % every == 0:
        jax.block_until_ready(carry)
    return carry
