"""What a scheduled program runs between each asynchronous collective's start and done.

XLA:GPU splits a collective into a start and a done; the latency-hiding
scheduler places independent work between them, and the compiled module's text lists
each computation's instructions in the order they were scheduled. So "this gradient
sync overlaps backward compute" is checkable on the program itself: the instructions
between its start and its done, in the same computation, include compute (fusions,
GEMM custom calls, dots, convolutions). ``async_pairs(hlo)`` lists every pair with
those instructions' opcodes. (XLA:CPU runs collectives synchronously: its programs have
no such pairs.) Two spellings are read: ``<kind>-start`` / ``<kind>-done`` (older XLA), and
the generic ``async-start(...), calls=%async_computation`` / ``async-done`` whose called
computation's root is the collective (XLA:GPU in jax 0.11).

Pure Python; nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses
import re

from mindpipe_jax.parallel.collectives import KINDS, _type_and_op, split_computations

COMPUTE_OPS = frozenset({"fusion", "custom-call", "dot", "convolution"})


@dataclasses.dataclass(frozen=True)
class AsyncPair:
    """One asynchronous collective: its start, its done, and what ran between them."""

    kind: str            # all-reduce, all-gather, reduce-scatter, collective-permute, all-to-all
    start: str           # the start instruction's name
    done: str
    computation: str
    between: tuple[str, ...]  # opcodes scheduled between start and done, in order
    collective: str = ""  # the name ``collectives()`` gives it: the start, or the wrapped op

    def __post_init__(self):
        if not self.collective:
            object.__setattr__(self, "collective", self.start)

    @property
    def compute_between(self) -> int:
        """Compute instructions between start and done (other collectives' parts excluded)."""
        return sum(op in COMPUTE_OPS for op in self.between)


def async_pairs(hlo: str) -> list[AsyncPair]:
    """Every ``<kind>-start`` / ``<kind>-done`` pair of a compiled program's HLO text, with
    the opcodes scheduled between them (module docstring)."""
    comps = split_computations(hlo)
    wrapped = {}  # computation -> (kind, name) of its root, where that root is a collective
    for name, lines, _ in comps:
        for line in lines:
            parsed = _type_and_op(line)
            if parsed and line.lstrip().startswith("ROOT") and parsed[2] in KINDS:
                wrapped[name] = (parsed[2], parsed[0])
    out = []
    for name, lines, _ in comps:
        open_starts: dict[str, tuple[str, int, str]] = {}
        ops: list[str] = []
        for line in lines:
            parsed = _type_and_op(line)
            if parsed is None:
                continue
            inst, _, op = parsed
            called = re.search(r"calls=%?([\w.\-]+)", line) if op == "async-start" else None
            if op.endswith("-start") and op[:-len("-start")] in KINDS:
                open_starts[inst] = (op[:-len("-start")], len(ops), inst)
            elif called and called.group(1) in wrapped:
                kind, inner = wrapped[called.group(1)]
                open_starts[inst] = (kind, len(ops), inner)
            elif op.endswith("-done") and (op[:-len("-done")] in KINDS or op == "async-done"):
                # its operand is the start (printed with or without its type and a %)
                operands = line[line.index(op + "(") + len(op) + 1:]
                start = next((s for s in open_starts if re.search(
                    r"(?:^|[%\s(,])" + re.escape(s) + r"(?=[\s),])", operands)), None)
                if start is not None:
                    kind, at, inner = open_starts.pop(start)
                    out.append(AsyncPair(kind, start, inst, name, tuple(ops[at + 1:]), inner))
            ops.append(op)
    return out
