"""What a scheduled program runs between each asynchronous collective's start and done.

XLA:GPU splits a collective into ``<kind>-start`` and ``<kind>-done``; the latency-hiding
scheduler places independent work between them, and the compiled module's text lists
each computation's instructions in the order they were scheduled. So "this gradient
sync overlaps backward compute" is checkable on the program itself: the instructions
between its start and its done, in the same computation, include compute (fusions,
GEMM custom calls, dots, convolutions). ``async_pairs(hlo)`` lists every pair with
those instructions' opcodes. (XLA:CPU runs collectives synchronously: its programs have
no such pairs.)

Pure Python; nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses
import re

from mindpipe_jax.parallel.collectives import KINDS, _split_computations, _type_and_op

COMPUTE_OPS = frozenset({"fusion", "custom-call", "dot", "convolution"})


@dataclasses.dataclass(frozen=True)
class AsyncPair:
    """One asynchronous collective: its start, its done, and what ran between them."""

    kind: str            # all-reduce, all-gather, reduce-scatter, collective-permute, all-to-all
    start: str           # the -start instruction's name (``collectives()`` names it so too)
    done: str
    computation: str
    between: tuple[str, ...]  # opcodes scheduled between start and done, in order

    @property
    def compute_between(self) -> int:
        """Compute instructions between start and done (other collectives' parts excluded)."""
        return sum(op in COMPUTE_OPS for op in self.between)


def async_pairs(hlo: str) -> list[AsyncPair]:
    """Every ``<kind>-start`` / ``<kind>-done`` pair of a compiled program's HLO text, with
    the opcodes scheduled between them (module docstring)."""
    out = []
    for name, lines, _ in _split_computations(hlo):
        open_starts: dict[str, tuple[str, int]] = {}
        ops: list[str] = []
        for line in lines:
            parsed = _type_and_op(line)
            if parsed is None:
                continue
            inst, _, op = parsed
            if op.endswith("-start") and op[:-len("-start")] in KINDS:
                open_starts[inst] = (op[:-len("-start")], len(ops))
            elif op.endswith("-done") and op[:-len("-done")] in KINDS:
                # its operand is the start (printed with or without its type and a %)
                operands = line[line.index(op + "(") + len(op) + 1:]
                start = next((s for s in open_starts if re.search(
                    r"(?:^|[%\s(,])" + re.escape(s) + r"(?=[\s),])", operands)), None)
                if start is not None:
                    kind, at = open_starts.pop(start)
                    out.append(AsyncPair(kind, start, inst, name, tuple(ops[at + 1:])))
            ops.append(op)
    return out
