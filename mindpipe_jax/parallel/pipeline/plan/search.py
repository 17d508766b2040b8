"""The partitioner's split search: contiguous layers onto ``G`` stages so that the
slowest stage is as fast as possible (an exact dynamic program over all contiguous
splits, not a heuristic), then, among the fastest splits, the least total work
and the most even.

Pure Python over a cost function ``cost(g, i, j)`` (global stage ``g`` holding
layers ``[i, j)``); ``partition`` gives it stage times from ``memory``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

_REL = 1e-9          # relative tolerance for "as fast as the optimum"


def lex_less(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Lexicographic ``a < b`` with the first entries equal within a relative tolerance."""
    if abs(a[0] - b[0]) > _REL * max(abs(a[0]), abs(b[0]), 1e-30):
        return a[0] < b[0]
    return a[1] < b[1] * (1 - 1e-12)


def split_dp(L: int, G: int, cost: Callable[[int, int, int], float]) -> list[int] | None:
    """Boundaries ``b[0]=0 <= ... <= b[G]=L`` minimising the largest ``cost(g, i, j)``
    (exact), then, among splits within a relative ``1e-9`` of that optimum, the sum of
    costs and then the sum of their squares (the most even of the fastest splits).
    Every stage gets >= 1 layer when L >= G. ``None`` if every split costs inf."""
    lo = 1 if L >= G else 0
    inf = math.inf
    cache: dict[tuple[int, int, int], float] = {}

    def c(g, i, j):
        key = (g, i, j)
        if key not in cache:
            cache[key] = cost(g, i, j)
        return cache[key]

    # Pass 1: the optimal bottleneck. best[k][j]: first j layers on k stages.
    best = [[inf] * (L + 1) for _ in range(G + 1)]
    best[0][0] = 0.0
    for k in range(1, G + 1):
        for j in range(L + 1):
            for i in range(0, j - lo + 1):
                if best[k - 1][i] < inf:
                    value = max(best[k - 1][i], c(k - 1, i, j))
                    if value < best[k][j]:
                        best[k][j] = value
    target = best[G][L]
    if target == inf:
        return None
    limit = target * (1 + _REL) + 1e-300
    # Pass 2: among splits whose every stage is <= the optimum, (sum, sum of squares).
    score: list[list[tuple[float, float] | None]] = [[None] * (L + 1) for _ in range(G + 1)]
    back = [[-1] * (L + 1) for _ in range(G + 1)]
    score[0][0] = (0.0, 0.0)
    for k in range(1, G + 1):
        for j in range(L + 1):
            for i in range(0, j - lo + 1):
                prev = score[k - 1][i]
                t = c(k - 1, i, j)
                if prev is None or t > limit:
                    continue
                cand = (prev[0] + t, prev[1] + t * t)
                if score[k][j] is None or lex_less(cand, score[k][j]):
                    score[k][j], back[k][j] = cand, i
    bounds = [L]
    for k in range(G, 0, -1):
        bounds.append(back[k][bounds[-1]])
    return bounds[::-1]
