"""Choosing the anchor layers: an exact dynamic program over contiguous runs of layers.

Each anchor ``a`` covers the layers from ``a`` up to (not including) the next anchor. With ``w[a, b] =
imp(b) * sim(a, b)`` (``sim(b, b) = 1``), the objective of an anchor set is ``sum_b w[anchor(b), b]``; layer 0 is
always an anchor. ``best[c][e]`` is the best value for layers ``0..e-1`` covered by ``c`` anchors whose last run
ends just before ``e``; the answer for ``A`` anchors is ``best[A][L]``.
"""

from __future__ import annotations

import itertools

import torch


def _segment_values(weights: torch.Tensor) -> torch.Tensor:
    """``seg[a, e] = sum_{b=a}^{e-1} w[a, b]`` for ``a < e <= L``."""
    L = weights.shape[0]
    upper = torch.triu(weights.double())
    cums = torch.cat([torch.zeros(L, 1, dtype=torch.float64), upper.cumsum(1)], 1)  # [L, L+1]
    return cums  # seg[a, e] = cums[a, e] - cums[a, a]; cums[a, a] == 0 by triu


def choose_anchors(weights: torch.Tensor, num_anchors: int) -> tuple[tuple[int, ...], float]:
    """Best anchor set of size ``num_anchors`` (0 included) for ``weights [L, L]`` (``w[a, b]``, used for a <= b).

    Returns ``(anchors, objective)``.
    """
    L = weights.shape[0]
    if not 1 <= num_anchors <= L:
        raise ValueError(f"the number of anchors must be in 1..{L} (the layer count), got {num_anchors}")
    seg = _segment_values(weights)
    neg = float("-inf")
    best = [[neg] * (L + 1) for _ in range(num_anchors + 1)]
    back = [[-1] * (L + 1) for _ in range(num_anchors + 1)]
    for e in range(1, L + 1):
        best[1][e] = float(seg[0, e])
    for c in range(2, num_anchors + 1):
        for e in range(c, L + 1):
            for a in range(c - 1, e):  # the c-th anchor; runs a..e-1
                if best[c - 1][a] == neg:
                    continue
                v = best[c - 1][a] + float(seg[a, e])
                if v > best[c][e]:
                    best[c][e], back[c][e] = v, a
    anchors, e = [], L
    for c in range(num_anchors, 1, -1):
        a = back[c][e]
        anchors.append(a)
        e = a
    return (0, *sorted(anchors)), best[num_anchors][L]


def objective(weights: torch.Tensor, anchors) -> float:
    """``sum_b w[anchor(b), b]`` for a given anchor set."""
    L = weights.shape[0]
    anchors = sorted(anchors)
    return sum(float(weights[max(a for a in anchors if a <= b), b]) for b in range(L))


def brute_force_anchors(weights: torch.Tensor, num_anchors: int) -> tuple[tuple[int, ...], float]:
    """Exhaustive search (for tests): every anchor set of the given size containing 0."""
    L = weights.shape[0]
    best = max(((0, *rest) for rest in itertools.combinations(range(1, L), num_anchors - 1)),
               key=lambda a: objective(weights, a))
    return best, objective(weights, best)
