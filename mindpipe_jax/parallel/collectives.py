"""The collectives of a compiled program, and the bytes each device sends per call.

Read from the HLO text XLA compiled (``jax.jit(f).lower(*args).compile().as_text()``),
not from what a runtime means to issue: what the partitioner added (a resharding
all-gather, an all-to-all) counts as much as what the code asked for.

``collectives(hlo)`` lists every all-reduce, all-gather, reduce-scatter,
collective-permute and all-to-all (an async pair ``*-start``/``*-done`` is one
collective, read at its ``-start``), with its device groups (or source → target
pairs), its result shapes and dtypes, and how many times one call of the program
runs it: the product of the trip counts of the ``while`` loops around it (XLA
writes each loop's ``known_trip_count`` into its ``backend_config``; a loop without
one is counted once and its ops are marked ``trip_count_known=False``). A
collective inside a ``conditional`` branch is counted as if its branch ran
(``in_branch=True``: an upper bound), unless the code that issued it said how often
its branch runs: a collective traced under ``jax.named_scope(runs_tag(n, t))``
(its ``op_name`` metadata carries ``runs_<n>_of_<t>``) runs ``n`` times per ``t``
iterations of the loop around its branch, and is counted that often, exactly (the
pipeline runtime's tick loop picks its gradient ring's step per tick this way).

Bytes a device sends for one execution, ``N`` the bytes of the whole buffer
(the all-reduce's operand, the all-gather's result, the reduce-scatter's operand,
the all-to-all's operands together) and ``g`` the size of the device's group, as
the bandwidth-optimal ring algorithms do it:

* all-reduce: ``2 N (g - 1) / g`` (reduce-scatter, then all-gather);
* all-gather: ``N (g - 1) / g`` (each device sends its ``N / g`` to the others);
* reduce-scatter: ``N (g - 1) / g``;
* all-to-all: ``N (g - 1) / g`` (every piece but its own);
* collective-permute: ``N`` (its operand) if the device is a source, else 0.

A group of one device sends nothing. Sizes come from the result types (an
all-reduce's, all-to-all's and collective-permute's result has its operand's
size; a reduce-scatter's operand is ``g`` times its result).

Pure Python and numpy; nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections import defaultdict

import numpy as np

__all__ = ["Collective", "collectives", "bytes_sent", "per_device_bytes", "axes_of", "DTYPE_BYTES"]

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")

DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
               "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of the program."""

    kind: str                       # one of KINDS
    name: str                       # the HLO instruction's name
    computation: str                # the computation holding it
    shapes: tuple[tuple[str, tuple[int, ...]], ...]  # (dtype, dims) of its result buffers
    groups: tuple[tuple[int, ...], ...]              # device groups ( () for collective-permute)
    pairs: tuple[tuple[int, int], ...]               # collective-permute: (source, target)
    count: int                      # executions per call of the program (loop trip counts)
    in_branch: bool = False         # inside a conditional branch: counted as if it ran
    trip_count_known: bool = True

    @property
    def result_bytes(self) -> float:
        return sum(DTYPE_BYTES[dt] * math.prod(dims) for dt, dims in self.shapes)

    def group_of(self, device: int) -> tuple[int, ...]:
        for group in self.groups:
            if device in group:
                return group
        return ()

    def sent_by(self, device: int) -> float:
        """Bytes ``device`` sends in one execution (module docstring)."""
        if self.kind == "collective-permute":
            return self.result_bytes * sum(1 for src, _ in self.pairs if src == device)
        g = len(self.group_of(device))
        if g <= 1:
            return 0.0
        n = self.result_bytes * (g if self.kind == "reduce-scatter" else 1)
        return n * (g - 1) / g * (2 if self.kind == "all-reduce" else 1)

    def devices(self) -> set[int]:
        if self.kind == "collective-permute":
            return {d for pair in self.pairs for d in pair}
        return {d for group in self.groups for d in group}


# ---------------------------------------------------------------- parsing
_SHAPE = re.compile(r"\b(pred|[sucf]\d+|bf16)\[([\d,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*[({]")
_ASSIGN = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")


def split_computations(hlo: str) -> list[tuple[str, list[str], bool]]:
    """``(name, instruction lines, is_entry)`` per computation, in the text's order."""
    out = []
    for block in re.split(r"\n(?=\S)", hlo):
        first, *rest = block.split("\n")
        match = _HEADER.match(first)
        if match and first.rstrip().endswith("{"):
            out.append((match.group(1), rest, first.startswith("ENTRY")))
    return out


def _type_and_op(line: str) -> tuple[str, str, str] | None:
    """``(name, result type text, opcode)`` of an instruction line."""
    match = _ASSIGN.match(line)
    if not match:
        return None
    rest = line[match.end():]
    if rest.startswith("("):  # a tuple type: up to its matching parenthesis
        depth = np.cumsum([(ch == "(") - (ch == ")") for ch in rest])
        end = int(np.argmax(depth == 0)) + 1
        type_text, rest = rest[:end], rest[end:]
    else:
        type_text, _, rest = rest.partition(" ")
    op = re.match(r"\s*([\w\-]+)\(", rest)
    return (match.group(1), type_text, op.group(1)) if op else None


def _shapes(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(dt, tuple(int(x) for x in dims.split(",") if x)) for dt, dims in _SHAPE.findall(type_text)]


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
    ids = np.arange(math.prod(dims)).reshape(dims)
    return (ids.transpose(perm) if perm else ids).reshape(-1)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]"
                          r"(?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?\s*\{([^}]*)\}")
_CALLS = re.compile(r"(?:body|condition|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")


def _groups(line: str, num_devices: int) -> tuple[tuple[int, ...], ...]:
    """The device groups of a ``replica_groups=`` attribute, in any of XLA's three forms:
    explicit ``{{0,1},{2,3}}``, iota ``[G,S]<=[dims]T(perm)``, or mesh axes
    ``mesh['a'=2,'b'=4], device_ids=([dims]T(perm)) {'b'}``. None or ``{}``: one group of
    every device."""
    m = _MESH_GROUPS.search(line)
    if m:
        axes = [(name, int(size)) for name, size in re.findall(r"'([^']+)'=(\d+)", m.group(1))]
        sizes = [size for _, size in axes]
        ids = (_iota(_ints(m.group(2)), _ints(m.group(3)) if m.group(3) else None) if m.group(2)
               else np.arange(math.prod(sizes))).reshape(sizes)
        over = [i for i, (name, _) in enumerate(axes) if f"'{name}'" in m.group(4)]
        keep = [i for i in range(len(axes)) if i not in over]
        grouped = ids.transpose(keep + over).reshape(-1, math.prod(sizes[i] for i in over))
        return tuple(tuple(int(d) for d in g) for g in grouped)
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:
        ids = _iota(_ints(m.group(3)), _ints(m.group(4)) if m.group(4) else None)
        return tuple(tuple(int(d) for d in g) for g in ids.reshape(int(m.group(1)), int(m.group(2))))
    m = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line)
    if m and m.group(1):
        return tuple(tuple(_ints(g)) for g in re.findall(r"\{([\d,]*)\}", m.group(1)))
    return (tuple(range(num_devices)),)


def _pairs(line: str) -> tuple[tuple[int, int], ...]:
    m = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", line)
    return tuple((int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1))) if m else ()


def _trip_count(line: str) -> int | None:
    m = re.search(r"backend_config=(\{.*?\})(?:,\s*\w+=|$)", line)
    if m:
        try:
            n = json.loads(m.group(1)).get("known_trip_count", {}).get("n")
            return None if n is None else int(n)
        except json.JSONDecodeError:
            pass
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
    return int(m.group(1)) if m else None


def _num_devices(hlo: str) -> int:
    parts = re.search(r"num_partitions=(\d+)", hlo)
    replicas = re.search(r"replica_count=(\d+)", hlo)
    return (int(parts.group(1)) if parts else 1) * (int(replicas.group(1)) if replicas else 1)


def _result_of_start(kind: str, shapes: list) -> list:
    """The result buffers of an async ``-start``, whose type is a tuple holding its
    operands too: all-gather-start ``(operands..., results...)``; collective-permute-start
    ``(operand, result, u32[], u32[])``; all-reduce-start its results."""
    if kind == "all-gather":
        return shapes[len(shapes) // 2:]
    if kind == "collective-permute":
        return shapes[1:2]
    return shapes


def collectives(hlo: str) -> list[Collective]:
    """Every collective of a compiled program's HLO text (module docstring)."""
    comps = split_computations(hlo)
    num_devices = _num_devices(hlo)
    # How often one call runs each computation: callers print after their callees, so
    # walking the text backwards visits every caller before what it calls.
    count: dict[str, int] = defaultdict(int)
    branch: dict[str, bool] = defaultdict(bool)
    known: dict[str, bool] = defaultdict(lambda: True)
    for name, _, is_entry in comps:
        if is_entry:
            count[name] = 1
    for name, lines, _ in reversed(comps):
        here = count[name]
        for line in lines:
            parsed = _type_and_op(line)
            if parsed is None:
                continue
            op = parsed[2]
            times, in_branch, trips_known = here, branch[name], known[name]
            if op == "while":
                trips = _trip_count(line)
                trips_known = trips_known and trips is not None
                times = here * (trips if trips is not None else 1)
            in_branch = in_branch or op == "conditional"
            called = _CALLS.findall(line)
            for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
                called += [c.strip().lstrip("%") for c in group.split(",")]
            for callee in called:
                count[callee] += times
                branch[callee] = branch[callee] or in_branch
                known[callee] = known[callee] and trips_known
    out = []
    for name, lines, _ in comps:
        for line in lines:
            parsed = _type_and_op(line)
            if parsed is None:
                continue
            inst, type_text, op = parsed
            kind = op[:-len("-start")] if op.endswith("-start") else op
            if kind not in KINDS or count[name] == 0:
                continue
            shapes = _shapes(type_text)
            if op.endswith("-start"):
                shapes = _result_of_start(kind, shapes)
            is_permute = kind == "collective-permute"
            times, in_branch = count[name], branch[name]
            tagged = _RUNS.search(line)
            if tagged and in_branch:  # its branch runs n of every t iterations: exact
                n, t = int(tagged.group(1)), int(tagged.group(2))
                times, in_branch = times * n // t, False
            out.append(Collective(kind, inst, name, tuple(shapes),
                                  () if is_permute else _groups(line, num_devices),
                                  _pairs(line) if is_permute else (), times, in_branch, known[name]))
    return out


_RUNS = re.compile(r'op_name="[^"]*runs_(\d+)_of_(\d+)')


def runs_tag(runs: int, of: int) -> str:
    """The ``jax.named_scope`` name that tells ``collectives`` a branch's collectives run
    ``runs`` times in every ``of`` iterations of the loop around the branch."""
    return f"runs_{runs}_of_{of}"


def per_device_bytes(ops: list[Collective], num_devices: int | None = None) -> dict[int, float]:
    """Bytes each device sends per call of the program, summed over ``ops`` (times their counts)."""
    devices = set(range(num_devices)) if num_devices else set().union(*(op.devices() for op in ops))
    return {d: sum(op.sent_by(d) * op.count for op in ops) for d in sorted(devices)}


def bytes_sent(hlo: str, *, device: int | None = None, select=None) -> float:
    """Bytes one device sends per call of the compiled program ``hlo`` (its text): ``device``
    or, by default, the device that sends the most. ``select(op) -> bool`` keeps some
    collectives only (e.g. those over one mesh axis)."""
    ops = [op for op in collectives(hlo) if select is None or select(op)]
    sent = per_device_bytes(ops, _num_devices(hlo))
    if not sent:
        return 0.0
    return sent[device] if device is not None else max(sent.values())


def axes_of(op: Collective, device_ids: np.ndarray, axis_names) -> frozenset[str]:
    """The mesh axes an op's groups (or permute pairs) span: ``device_ids`` is the mesh's
    array of device ids (``np.vectorize(lambda d: d.id)(mesh.devices)``), ``axis_names`` its
    axis names."""
    where = {int(d): np.unravel_index(i, device_ids.shape) for i, d in enumerate(device_ids.reshape(-1))}
    sets = [list(g) for g in op.groups] if op.kind != "collective-permute" else [list(p) for p in op.pairs]
    out = set()
    for members in sets:
        coords = np.array([where[d] for d in members])
        out.update(axis_names[i] for i in range(coords.shape[1]) if len(set(coords[:, i])) > 1)
    return frozenset(out)
