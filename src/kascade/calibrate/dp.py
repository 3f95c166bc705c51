"""Choosing the anchor layers: an exact dynamic program over contiguous runs of layers.

Each anchor ``a`` covers the layers from ``a`` up to (not including) the next anchor. With ``w[a, b] =
imp(b) * sim(a, b)`` (``sim(b, b) = 1``), the objective of an anchor set is ``sum_b w[anchor(b), b]``; layer 0 is
always an anchor. ``best[c][e]`` is the best value for layers ``0..e-1`` covered by ``c`` anchors whose last run
ends just before ``e``; the answer for ``A`` anchors is ``best[A][L]``.

Each reuse layer's KV head then follows the head of its anchor with the highest similarity (the argmax head map).

    plan = plan_from_stats(model, stats, num_anchors=6)
"""

from __future__ import annotations

import torch

from ..plan import KascadePlan, ModelFingerprint
from .stats import CalibrationStats


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


def layer_weights(stats: CalibrationStats) -> torch.Tensor:
    """``w[a, b] = imp(b) * sim(a, b)``: the DP's per-layer reward for letting anchor ``a`` serve layer ``b``."""
    return stats.layer_similarity() * stats.importance[None, :]


def dp_anchors(stats: CalibrationStats, num_anchors: int) -> tuple[int, ...]:
    """The DP's anchor set of size ``num_anchors`` for the statistics."""
    return choose_anchors(layer_weights(stats), num_anchors)[0]


def head_maps(stats: CalibrationStats, anchors, num_layers: int) -> tuple[tuple[int, ...], ...]:
    """Per layer, the argmax head map towards its anchor (the nearest one at or below it; identity on anchors)."""
    return tuple(stats.head_map(max(a for a in anchors if a <= b), b) for b in range(num_layers))


def plan_from_stats(model_or_fp, stats: CalibrationStats, num_anchors: int, *, ratio: float = 0.10,
                    k_min: int = 128, tile: int = 32, rolling: bool = True, head_map: bool = True,
                    source: str = "") -> KascadePlan:
    """The DP's anchor set for ``num_anchors`` and the argmax head map (identity if ``head_map=False``)."""
    fp = model_or_fp if isinstance(model_or_fp, ModelFingerprint) else ModelFingerprint.from_model(model_or_fp)
    if stats.similarity.shape[0] != fp.num_layers or stats.similarity.shape[-1] != fp.num_kv_heads:
        raise ValueError("calibration statistics do not match the model's layer or KV-head count")
    if not 1 <= num_anchors <= fp.num_layers:
        raise ValueError(f"--anchors must be in 1..{fp.num_layers} (the model's layer count), got {num_anchors}")
    anchors, value = choose_anchors(layer_weights(stats), num_anchors)
    ident = (tuple(range(fp.num_kv_heads)),) * fp.num_layers
    hm = head_maps(stats, anchors, fp.num_layers) if head_map else ident
    src = source or (f"calibrated: DP over {stats.windows} windows of {stats.seq_len} tokens, k={stats.k}, "
                     f"objective {value:.4f}{'' if head_map else ', identity head map'}")
    return KascadePlan(fp, anchors, hm, ratio=ratio, k_min=k_min, tile=tile, rolling=rolling, calibrated=True,
                       source=src)


def objective_table(stats: CalibrationStats, max_anchors: int) -> list[dict]:
    """DP objective (absolute and as a fraction of ``sum imp``, i.e. of an all-anchor model) for A = 1..max."""
    w = layer_weights(stats)
    total = float(stats.importance.sum())
    rows = []
    for A in range(1, max_anchors + 1):
        anchors, value = choose_anchors(w, A)
        rows.append(dict(anchors=A, layers=list(anchors), objective=value, fraction=value / total if total else 0.0))
    return rows
