"""Bitwise comparison of two state trees, for the tests whose promise is "the same bits"."""

import jax
import numpy as np


def assert_bitwise(a, b, what: str) -> None:
    """Every leaf of ``a`` and ``b`` has the same dtype, shape and bytes; the message names
    the first leaf that differs and by how much."""
    flat_a = jax.tree_util.tree_flatten_with_path(a)[0]
    flat_b = jax.tree_util.tree_flatten_with_path(b)[0]
    assert len(flat_a) == len(flat_b) > 10
    for (path, x), (_, y) in zip(flat_a, flat_b, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, (what, path)
        assert x.tobytes() == y.tobytes(), \
            f"{what}: {jax.tree_util.keystr(path)} differs (max |diff| {np.abs(x - y).max():.3g})"
