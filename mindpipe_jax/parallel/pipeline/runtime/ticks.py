"""One fused tick on one device: read the slots, run the parts, accumulate, transfer, store.

Order within a tick, the same on every device:

1. every operand is read from the buffers (the task's input, output gradient and
   residual slot), so all reads precede all writes and a slot read for the last time
   can take a new value at the end of the same tick (``tickplan``'s colouring);
2. the parts run, F then backward then W, each a ``lax.switch`` on this device's
   cell of the table (a branch holds no collective the other devices would miss:
   ``pipe`` and the batch axes are manual, and ``needs_lockstep`` handles the rest),
   or in lockstep every task kind some device runs in this tick, each a ``cond``
   on the table (the same predicate on every device), chained through their
   outputs so that every device issues their collectives in the same order;
3. weight-gradient contributions are added to the accumulators, each under a
   ``cond`` on the table: a tick that makes none touches no accumulator, and no
   accumulator enters a branch (a branch's outputs are new buffers; an
   accumulator passed through one was copied every tick);
4. the ring transfers, outside every branch: one ``ppermute`` per direction the
   schedule uses (activations forward, gradients backward; V placements use both
   ways and keep the turn on the device);
5. what arrived and the forward's residuals are stored in their slots: in each
   residual buffer the F writes one slot, its own where it keeps residuals in that
   buffer, else the buffer's spare slot ``n`` (``StageTasks.residual_buffers``), with
   what it was handed: the backward's slot, read in step 1. The F reads no slot of
   its own (in lockstep it does, see ``make_tick``); being handed the backward's read
   is what orders that read before the in-place write (an F whose output did not
   depend on the read made XLA copy the whole buffer every tick).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mindpipe_jax.parallel.collectives import runs_tag
from mindpipe_jax.parallel.pipeline.runtime.residuals import ResidualStore
from mindpipe_jax.parallel.pipeline.runtime.spmd import AXIS, _add_at, _put, _take
from mindpipe_jax.parallel.pipeline.runtime.stage import StageTasks
from mindpipe_jax.parallel.pipeline.runtime.tickplan import FIRST, LAST, MID, Plan, residual_readers, shift
from mindpipe_jax.parallel.pipeline.schedules import Kind


def _lockstep(branch_fns, branch, active_row, operand, after=None):
    """Every device runs every branch some device takes in this tick (``active_row``:
    the table's, the same everywhere) and keeps the outputs of its own (``branch``).
    ``after``: values the first branch must wait for (the previous part's outputs)."""
    if after is not None:  # issue this part's collectives after the previous part's
        operand, _ = lax.optimization_barrier((operand, after))
    out = branch_fns[0](operand)
    for k, fn in enumerate(branch_fns[1:], start=1):
        # Each cond takes the previous one's outputs, so every device runs them in the
        # same order: XLA:CPU starts independent ops in any order per device, and two
        # conds with collectives started in different orders deadlock.
        def run(prev, fn=fn, k=k):
            return jax.tree.map(lambda n, o: jnp.where(branch == k, n, o), fn(operand), prev)
        out = lax.cond(active_row[k - 1], run, lambda prev: prev, out)
    return out


def _weights_of(kind, mode):
    """Does this task form the embedding's / head's gradient? A split stage forms them
    in its B or BW (they hang off the B's own values, see ``stage._split_b``)."""
    return kind in ((Kind.B, Kind.BW) if mode.startswith("split-") else (Kind.BW, Kind.W))


_ADDS_TO = {"chunk": lambda kind, pos, mode: kind in (Kind.BW, Kind.W),
            "embed": lambda kind, pos, mode: pos == FIRST and _weights_of(kind, mode),
            "head": lambda kind, pos, mode: pos == LAST and _weights_of(kind, mode),
            "loss": lambda kind, pos, mode: kind in (Kind.BW, Kind.B) and pos == LAST}
# A merged last stage (``Plan.merge_last``) forms the loss and the head's gradient in its F.
_ADDS_TO_MERGED = {**_ADDS_TO, "head": lambda kind, pos, mode: pos == LAST and kind is Kind.F,
                   "loss": lambda kind, pos, mode: pos == LAST and kind is Kind.F}


def _gates(plan: Plan) -> dict[tuple[int, str], np.ndarray]:
    """``[ticks, p]`` bool per (part, accumulator): does this device's task add to it?
    Pairs no task of the schedule adds to are left out."""
    gates = {}
    for i, part in enumerate(plan.parts):
        for name, adds in (_ADDS_TO_MERGED if plan.merge_last else _ADDS_TO).items():
            # Per cell, at the task's own position: a branch shared by the first and the
            # middle stages (``EITHER``) adds the embedding's gradient on the first only.
            gate = np.zeros(part.branch.shape, bool)
            for k, (kind, _, mode) in enumerate(part.keys, start=1):
                for pos in (MID, FIRST, LAST):
                    if adds(kind, pos, mode):
                        gate |= (part.branch == k) & (part.position == pos)
            if gate.any():
                gates[(i, name)] = gate
    return gates


def _needs_params(part, i: int):
    """``[ticks, p]`` bool: does this device's task in part ``i`` run a chunk's layers?
    (Not an idle cell, nor the last stage's forward, which runs inside its backward.)
    None where no task of the part does."""
    runs = np.asarray([False] + [not (i == 0 and pos == LAST) for _, pos, _ in part.keys])
    return runs[part.branch] if runs.any() else None


def _rows(buf, slots):
    """``buf[slots]`` as one gather (see ``make_tick``)."""
    return jnp.take(buf, jnp.stack(slots), axis=0)


def _after(x, before):
    """``x``, issued after ``before`` is computed (``before`` None: as it is)."""
    return x if before is None else lax.optimization_barrier((x, before))[0]


def _pairwise_add(acc, base, unit, value):
    """Add ``value``, a group's contribution number ``unit`` (from 0, in arrival order),
    to the group's pairwise accumulator: ``acc`` rows ``base .. base + levels - 1`` hold
    the sums of the finished power-of-two blocks of contributions (a binary counter).
    This one closes as many blocks as ``unit`` has trailing one bits; their sum goes one
    level up. After 2^k contributions row ``base + k`` holds
    ``parallel.ordered_sum.pairwise_sum`` of them, bit for bit, with k + 1 rows instead
    of 2^k."""
    closes = lax.population_count(unit ^ (unit + 1)) - 1  # trailing one bits of unit
    value = jax.tree.map(lambda a, u: u.astype(a.dtype), acc, value)
    total = lax.fori_loop(0, closes, lambda lvl, x: jax.tree.map(jnp.add, _take(acc, base + lvl), x), value)
    return jax.tree.map(lambda a, x: _put(a, base + closes, x), acc, total)


def _forward_writes(plan: Plan, buffer: str) -> np.ndarray:
    """``[ticks, p]`` bool: the F part's task keeps residuals in ``buffer`` (its mode's)
    for a later task to read."""
    part = plan.parts[0]
    mode_of = np.asarray([False] + [mode == buffer for _, _, mode in part.keys])
    return mode_of[part.branch] & (part.res_slot >= 0)


def arrival_ranks(plan: Plan, groups: int = 1) -> dict | None:
    """Per (part, accumulator) of ``_gates``: ``[ticks, p]`` int, the place of each add
    among its accumulator's adds (ticks in order; within a tick the backward part before
    the weight part, as ``make_tick`` adds them), for ``_pairwise_add``. None when some
    accumulator's arrival order would change the balanced tree over its microbatches:
    every aligned block of 2^k arrivals must be an aligned block of 2^k microbatches
    (in order, reversed as GPipe's backward runs, or any order that keeps the blocks;
    addition commutes, so the same pairs give the same bits)."""
    per_group = plan.fused.schedule.num_microbatches // groups
    gates = _gates(plan)
    ranks = {key: np.zeros(gate.shape, np.int32) for key, gate in gates.items()}
    arrived: dict = {}
    for t in range(plan.num_ticks):
        for (i, name), gate in sorted(gates.items()):
            for s in np.flatnonzero(gate[t]):
                mb = int(plan.parts[i].microbatch[t, s])
                chunk = int(plan.parts[i].chunk[t, s]) if name == "chunk" else 0
                order = arrived.setdefault((name, s, chunk, mb // per_group), [])
                ranks[(i, name)][t, s] = len(order)
                order.append(mb % per_group)
    for order in arrived.values():
        size = 1
        while size <= len(order):
            for at in range(0, len(order) - size + 1, size):
                block = sorted(order[at:at + size])
                if block[0] % size or block != list(range(block[0], block[0] + size)):
                    return None
            size *= 2
    return ranks


def make_tick(plan: Plan, tasks: StageTasks, stage_idx, *, lockstep: bool, per_chunk=None, groups: int = 1,
              levels: int = 1, ranks: dict | None = None, ordered: bool = False):
    """``tick((acc, x_buf, g_buf, res_buf, stash_buf), t) -> (carry, None)`` for ``lax.scan``.

    ``groups`` > 1: the m microbatches are that many consecutive groups, each with its own
    accumulators (``pipeline_grads(gradient_groups=...)``): ``acc["blocks"]`` leaves are
    ``[groups · v, ...]`` (group-major), the others ``[groups, ...]``.

    ``levels`` > 1: each accumulator is that many rows (``_pairwise_add``, the pipeline's
    deterministic mode): row ``(group · v + chunk) · levels + level`` of ``acc["blocks"]``,
    ``group · levels + level`` of the others; ``ranks`` (``arrival_ranks``) places each
    contribution among its accumulator's.

    ``per_chunk``: the stage's layers kept as ``fsdp`` shards through the loop (``fsdp.py``),
    a pair ``(gather, scatter)``: ``gather(c)`` all-gathers chunk ``c``'s layers whole,
    ``scatter(grads)`` reduce-scatters a chunk's weight gradient to this device's shard.
    Each part then runs on the chunk gathered for its task just before it, and its
    weight gradient enters the (sharded) accumulator scattered. The collectives are
    outside the task branches, chained (each after the previous one's inputs are
    computed) so every device issues them in one order, each under a ``cond`` on this
    stage's cell of the table: the same on every device of the stage's fsdp group, the
    only devices in the collective, so a tick whose task does not run a chunk (or adds
    no weight gradient) moves nothing; a part no task of the schedule uses gathers
    nothing.

    ``ordered``: the branches hold collectives among one stage's devices
    (``spmd.branch_collectives``): each part starts after the previous part's outputs
    and the transfers after the last part's, so every device issues them in one order."""
    p = plan.fused.num_stages
    tables = [part.arrays() for part in plan.parts]
    actives = [jnp.asarray(part.active()) for part in plan.parts]
    branch_fns = [tasks.forward_branches(), tasks.backward_branches(), tasks.weight_branches()]
    gate_tables = _gates(plan)
    gates = {k: jnp.asarray(g) for k, g in gate_tables.items()}
    rank_tables = {k: jnp.asarray(r) for k, r in (ranks or {}).items()}
    send = {w: {d: jnp.asarray(a) for d, a in dirs.items()} for w, dirs in plan.send.items()}
    recv = {w: {d: jnp.asarray(a) for d, a in dirs.items()} for w, dirs in plan.recv.items()}

    inline = bool(plan.parts[1].inline.any())
    res_readers = residual_readers(plan, lockstep)
    f_writes = {r: jnp.asarray(_forward_writes(plan, r)) for r in plan.res_slots}
    v = plan.fused.schedule.virtual_stages
    per_group = plan.fused.schedule.num_microbatches // groups
    if per_chunk is not None:
        gather, scatter = per_chunk
        need_tables = [_needs_params(part, i) for i, part in enumerate(plan.parts)]
        needs = [None if n is None else jnp.asarray(n) for n in need_tables]
        gathered = tasks.example  # what an idle part is handed instead (never read)

        def tagged(fn, table):
            """``fn`` named for ``parallel.collectives``: its collectives run in as many
            ticks as the busiest stage has ``table`` set (an upper bound for the others)."""
            runs = int(table.sum(axis=0).max())

            def run(x):
                with jax.named_scope(runs_tag(runs, plan.num_ticks)):
                    return fn(x)
            return run

    def run_part(i, t, operand, after):
        task = operand["task"]
        if per_chunk is not None and needs[i] is not None:
            # Gathered only where this stage's task runs the chunk: the predicate is the same
            # on every device of the fsdp group (one stage), which alone takes part in it.
            chunk = _after(jnp.clip(task["chunk"], 0, v - 1), after)
            params = lax.cond(needs[i][t, stage_idx], tagged(gather, need_tables[i]),
                              lambda c: gathered, chunk)
            operand = {**operand, "params": params}
        if lockstep:
            return _lockstep(branch_fns[i], task["branch"], actives[i][t], operand, after)
        if ordered:  # this part's branch (its collectives) after the previous part's
            operand = _after(operand, after)
        return lax.switch(task["branch"], branch_fns[i], operand)

    def tick(carry, t):
        acc, x_buf, g_buf, res_buf, stash_buf = carry
        cells = [{k: v[t, stage_idx] for k, v in table.items()} for table in tables]

        # Every slot the three parts read, gathered at once per buffer: reads of one
        # buffer feeding different switches made XLA copy the whole buffer every tick.
        res_at = [{r: jnp.clip(c["res_slot"], 0, max(n - 1, 0)) for r, n in plan.res_slots.items()}
                  for c in cells]
        xs = _rows(x_buf, [jnp.maximum(c["x_slot"], 0) for c in cells])
        dys = _rows(g_buf, [jnp.maximum(c["g_slot"], 0) for c in cells[1:]])
        kept = {r: [_rows(leaf, [res_at[i][r] for i in res_readers]) for leaf in res_buf[r]] for r in res_buf}
        stash_at = [{r: jnp.clip(c["stash_slot"], 0, n - 1) for r, n in plan.stash_slots.items()}
                    for c in cells[1:]]
        stashed = {r: [_rows(leaf, [at[r] for at in stash_at]) for leaf in stash_buf[r]] for r in stash_buf}
        # A buffer a task does not use lends its slot 0 (a forward hands it back unchanged);
        # a W part that reads no residuals (every W split, or none) gets placeholders.
        blank = {r: [jnp.zeros(leaf.shape[1:], leaf.dtype) for leaf in res_buf[r]] for r in res_buf}
        def res_of(i):
            if i == 0 and 0 not in res_readers:  # the F hands back the backward's read
                i = 1
            if i not in res_readers:
                return blank
            return {r: [leaf[res_readers.index(i)] for leaf in kept[r]] for r in kept}

        ops = [{"task": c, "x": xs[i], "res": res_of(i)} for i, c in enumerate(cells)]
        for i in (1, 2):
            ops[i]["dy"] = dys[i - 1]
            ops[i]["stash"] = {r: [leaf[i - 1] for leaf in stashed[r]] for r in stashed}
        f_op, b_op, w_op = ops
        res_at, stash_at = res_at[0], stash_at[0]
        chained = ordered or lockstep or per_chunk is not None  # collectives between the parts
        f_out = run_part(0, t, f_op, None)
        if inline:  # a merged last stage's backward in its F's tick reads what that F made
            here = cells[1]["inline"] == 1
            b_op = {**b_op, "dy": jnp.where(here, f_out["dy"], b_op["dy"]),
                    "res": {r: [jnp.where(here, new, old) for new, old in zip(f_out["res"][r], b_op["res"][r],
                                                                              strict=True)]
                            for r in b_op["res"]}}
        b_out = run_part(1, t, b_op, f_out if chained else None)
        w_out = run_part(2, t, w_op, b_out if chained else None)
        made = {(i, name): (f_out, b_out, w_out)[i]["grads"][name] for (i, name) in gates}
        if per_chunk is not None:  # each part's chunk gradient to this device's shard, in order
            last = w_out
            for key in sorted(k for k in made if k[1] == "chunk"):
                shard = jax.tree.map(jnp.zeros_like, _take(acc["blocks"], 0))
                made[key] = last = lax.cond(gates[key][t, stage_idx], tagged(scatter, gate_tables[key]),
                                            lambda g, z=shard: z, _after(made[key], last))
            f_out, b_out = _after((f_out, b_out), last)  # the transfers after them
        elif ordered:  # the transfers after the branches' collectives
            f_out, b_out = _after((f_out, b_out), w_out)

        acc = dict(acc)
        for (i, name), gate in gates.items():
            made_here = made[(i, name)]
            group = cells[i]["microbatch"] // per_group
            if levels > 1:  # pairwise: the group's rows, this microbatch's place among them
                at = ((cells[i]["chunk"] + v * group) if name == "chunk" else group) * levels
                unit = rank_tables[(i, name)][t, stage_idx]
                add = lambda a, g=made_here, b=at, u=unit: _pairwise_add(a, b, u, g)  # noqa: E731
            elif name == "chunk":
                at = cells[i]["chunk"] + (v * group if groups > 1 else 0)
                add = lambda a, g=made_here, c=at: _add_at(a, c, g)  # noqa: E731
            elif groups > 1:
                add = lambda a, g=made_here, c=group: _add_at(a, c, g)  # noqa: E731
            else:
                add = lambda a, g=made_here: jax.tree.map(lambda x, y: x + y.astype(x.dtype), a, g)  # noqa: E731
            key = "blocks" if name == "chunk" else name
            acc[key] = lax.cond(gate[t, stage_idx], add, lambda a: a, acc[key])

        if plan.merge_last:  # a merged last stage's F writes its loss's gradient for its backward
            slot = cells[0]["g_slot"]
            keep = _take(g_buf, jnp.maximum(slot, 0))
            g_buf = _put(g_buf, jnp.maximum(slot, 0), jnp.where(slot >= 0, f_out["dy"], keep))
        res_buf = {r: ResidualStore.write(res_buf[r], jnp.where(f_writes[r][t, stage_idx], res_at[r],
                                                                plan.res_slots[r]), f_out["res"][r])
                   for r in res_buf}
        stash_buf = {r: ResidualStore.write(stash_buf[r], stash_at[r], b_out["stash"][r]) for r in stash_buf}
        # Every device takes part in every transfer of every tick (outside the branches).
        for what, made, buf_name in (("x", f_out["send"], "x"), ("g", b_out["send"], "g")):
            buf = x_buf if buf_name == "x" else g_buf
            both_ways = len(recv[what]) > 1  # then each direction carries only its own sends
            for d, slots in recv[what].items():
                out = made
                if both_ways:
                    out = jnp.where(send[what][d][t, stage_idx], made, jnp.zeros_like(made))
                arrived = out if d == "self" else lax.ppermute(out, AXIS, shift(d, p))
                slot = slots[t, stage_idx]
                keep = _take(buf, jnp.maximum(slot, 0))
                buf = _put(buf, jnp.maximum(slot, 0), jnp.where(slot >= 0, arrived, keep))
            if buf_name == "x":
                x_buf = buf
            else:
                g_buf = buf
        return (acc, x_buf, g_buf, res_buf, stash_buf), None

    return tick
