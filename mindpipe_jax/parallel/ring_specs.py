"""Which dimensions a collective matmul's rings split over ``tensor``, read from the one
rules table (a user's ``parallel.rules`` rows included), and the one-line refusal of a
row the rings cannot run (parallel/overlap.py uses these)."""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

from mindpipe_jax.errors import ConfigError
from mindpipe_jax.parallel.rules import spec_for, user_row_names

TENSOR = "tensor"


def tensor_spec(names) -> P:
    """The ``tensor`` part of the rules table's compute spec for logical ``names``.

    Inside these ``shard_map``s only ``tensor`` is manual; the batch axes stay as
    they were (automatic in the plain step, already manual in the pipeline), so a
    spec here names ``tensor`` alone -- taken from the one rules table, so the
    collective matmul splits weights exactly as the plain path does.
    """
    def tensor_part(entry):
        return TENSOR if entry == TENSOR or (isinstance(entry, tuple) and TENSOR in entry) else None

    # spec_for reads the active table (a user's parallel.rules rows included) and
    # records the lookup, as the plain path's parameters and constraints do.
    return P(*(tensor_part(entry) for entry in spec_for(names, "compute")))


def ring_specs(mm, w_names, other_names, column: bool):
    """The ``tensor`` specs of a collective matmul's weight and of its other split
    operand (the result of a column-parallel one, the input of a row-parallel one),
    from the rules table. Refused where they are something the ring cannot run (the
    weight whole, split on the wrong kind of dimension, the other operand split
    differently): in one line when a ``parallel.rules`` row made them so, else as the
    caller's bug (names that do not fit the equation)."""
    kind = "column" if column else "row"
    user_rows = user_row_names() & {n for n in (*w_names, *other_names) if n is not None}

    def refuse(problem: str):
        if user_rows:
            raise ConfigError(f"model.collective_matmul=true: the {kind}-parallel collective matmul "
                              f"{mm.equation!r} {problem} (parallel.rules rows for "
                              f"{', '.join(map(repr, sorted(user_rows)))}); drop those rows or set "
                              f"model.collective_matmul=false")
        raise ValueError(f"{kind}-parallel collective matmul {mm.equation!r}: {problem}")

    w_spec = tensor_spec(w_names)
    dims = [d for d, entry in enumerate(w_spec) if entry == TENSOR]
    if len(dims) != 1:
        refuse(f"needs its weight {tuple(w_names)} split over {TENSOR!r} on one dimension, but the rules "
               f"table gives {w_spec}")
    index = mm.w[dims[0]]
    if (index in mm.out) != column:
        refuse(f"needs its weight split over {TENSOR!r} on {'an output' if column else 'a contracted'} "
               f"dimension, but the rules table splits {w_names[dims[0]]!r}")
    other_term = mm.out if column else mm.x
    expected = P(*(TENSOR if i == index else None for i in other_term))
    other_spec = tensor_spec(other_names)
    if other_spec != expected:
        refuse(f"computes {tuple(other_names)} split over {TENSOR!r} as {expected}, but the rules table "
               f"gives {other_spec}")
    return w_spec, other_spec
