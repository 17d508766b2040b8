"""A checkpoint's guard against bytes changed on the disk: one ``uint32`` sum of each
array's bits, saved with the checkpoint and compared after a restore. Any single flipped
bit changes its array's sum (tests/test_reliability.py)."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp


def _bits_sum(x):
    x = jnp.asarray(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[x.dtype.itemsize]
    bits = jax.lax.bitcast_convert_type(x, unsigned)
    if x.dtype.itemsize == 8:
        bits = jax.lax.bitcast_convert_type(bits, jnp.uint32)  # [..., 2] halves
    return jnp.sum(bits.astype(jnp.uint32), dtype=jnp.uint32)


_checksums = jax.jit(lambda tree: jax.tree.map(_bits_sum, tree))


def state_checksums(state) -> dict[str, int]:
    """``{path: uint32 sum of the array's bits}`` for every leaf of ``state``."""
    sums = _checksums(state)
    flat = jax.tree_util.tree_flatten_with_path(sums)[0]
    local = [x.addressable_data(0) if not x.is_fully_addressable else x for _, x in flat]
    return {jax.tree_util.keystr(path): int(v) for (path, _), v in zip(flat, jax.device_get(local),
                                                                         strict=True)}


def verify_checksums(state, meta: dict) -> str | None:
    """The first leaf whose bits differ from the checksum saved in ``meta``, or None."""
    saved = meta.get("checksums")
    if not saved:
        return None  # written before checksums existed
    for path, value in state_checksums(state).items():
        if saved.get(path) != value:
            return path
    return None


def dtype_change(state_dir, state, leaf: str) -> tuple[str, str] | None:
    """(saved dtype, restored dtype) of the leaf at key path ``leaf`` of ``state``, restored
    from the orbax item ``state_dir``, where they differ, else None: orbax casts to the
    target's dtype on restore, so a run that changed a parameter's dtype fails its
    checksum without any byte on the disk changed."""
    def plain(path: str) -> str:  # ".mu" (a named tuple's field) as "['mu']", as orbax keeps it
        return re.sub(r"\.(\w+)", r"['\1']", path)

    try:
        # The handler's own read: a Checkpointer looks for a checkpoint-level metadata file
        # in the item's directory and logs a warning on the user's one-line error.
        saved = ocp.StandardCheckpointHandler().metadata(Path(state_dir))
    except Exception:  # unreadable metadata: the damage the caller reports
        return None
    tree = getattr(getattr(saved, "item_metadata", saved), "tree", None)
    if not isinstance(tree, dict):
        return None
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    saved_dtype = {plain(jax.tree_util.keystr(path)): getattr(v, "dtype", None) for path, v in flat}
    now = {plain(jax.tree_util.keystr(path)): v.dtype for path, v in
           jax.tree_util.tree_flatten_with_path(state)[0]}.get(plain(leaf))
    before = saved_dtype.get(plain(leaf))
    if before is None or now is None or jnp.dtype(before) == jnp.dtype(now):
        return None
    return str(jnp.dtype(before)), str(jnp.dtype(now))
