"""Rule plans: how a reuse layer builds its index set (see :mod:`kascade.reuse`), from calibration statistics.

A rule keeps a plan's anchors (the DP's, :mod:`kascade.calibrate.dp`, or any given set) and budget and changes only
*how reuse layers build their index sets*; ``length_plan`` makes one sub-plan per sequence length. Rules:

- ``faithful``:     a reuse head follows the most similar head of its nearest anchor (the argmax head map; the
                    paper's method).
- ``any-anchor``:   a reuse head follows the best (anchor, head) among *all* anchors at or below it, by the
                    calibrated similarity ``S[a, b, hb, ha]``, not only the nearest anchor.
- ``union2``:       the union of its two best (anchor, head) sources, merged rank by rank at the same budget.
- ``sinks``:        its anchor head's ranking for half the budget, the first 4 keys plus the most recent ones for
                    the other half.
- ``layer-budget``: per-layer budgets: a reuse layer gets ``1 + alpha (d_b / mean d - 1)`` times the row budget
                    (clipped to [0.5, 2], renormalised so the mean over layers 1..L-1 stays 1), with
                    ``d_b = imp(b) (1 - sim_b)`` its importance-weighted dissimilarity to its source; anchors keep 1.

Several rules join with ``+`` (``any-anchor+layer-budget``). Anchors chosen by measured fidelity instead of the DP:
:mod:`kascade.calibrate.search`; per-layer budgets from measured sensitivity: :mod:`kascade.calibrate.budgets`.
"""

from __future__ import annotations

import dataclasses
import math

from .. import _renamed
from ..plan import KascadePlan, ModelFingerprint
from .dp import dp_anchors, head_maps
from .stats import CalibrationStats

RULES = ("faithful", "any-anchor", "union2", "sinks", "layer-budget")
SINKS, RECENT = 4, 0.5
ALPHA, FACTOR_RANGE = 1.0, (0.5, 2.0)


def fingerprint(model_or_fp) -> ModelFingerprint:
    return model_or_fp if isinstance(model_or_fp, ModelFingerprint) else ModelFingerprint.from_model(model_or_fp)


def ranked_sources(stats: CalibrationStats, anchors, count: int = 1, nearest_only: bool = False):
    """``sources`` for a plan: per reuse layer and KV head the ``count`` best (anchor, anchor head) pairs by
    ``S[a, b, hb, ha]`` among anchors ``a < b`` (only the nearest one if ``nearest_only``)."""
    L, H = stats.similarity.shape[0], stats.similarity.shape[-1]
    anchors = sorted(anchors)
    rows = []
    for b in range(L):
        if b in anchors:
            rows.append(tuple(((b, h),) for h in range(H)))
            continue
        cands = [max(a for a in anchors if a < b)] if nearest_only else [a for a in anchors if a < b]
        row = []
        for hb in range(H):
            scored = sorted(((float(stats.similarity[a, b, hb, ha]), -a, ha) for a in cands for ha in range(H)),
                            reverse=True)  # ties: the later anchor
            row.append(tuple((-na, ha) for _, na, ha in scored[:count]))
        rows.append(tuple(row))
    return tuple(rows)


def layer_factors(stats: CalibrationStats, plan: KascadePlan, alpha: float = ALPHA,
                 clip: tuple[float, float] = FACTOR_RANGE) -> tuple[float, ...]:
    """Per-layer budget multipliers for ``plan``'s anchors and sources (the ``layer-budget`` rule, module docstring)."""
    L = plan.num_layers
    reuse = [b for b in range(L) if not plan.is_anchor(b)]
    if not reuse:
        return (1.0,) * L
    d = {}
    for b in reuse:
        sim = sum(float(stats.similarity[p[0][0], b, hb, p[0][1]]) for hb, p in enumerate(plan.sources_of(b)))
        d[b] = float(stats.importance[b]) * max(0.0, 1.0 - sim / len(plan.sources_of(b)))
    mean = sum(d.values()) / len(d)
    raw = {b: 1.0 + alpha * (d[b] / mean - 1.0) if mean > 0 else 1.0 for b in reuse}
    lo, hi = clip
    # Renormalise so the reuse layers' mean stays 1 (anchors keep 1): a few rounds of clip-and-rescale.
    s = dict(raw)
    for _ in range(50):
        s = {b: min(hi, max(lo, x)) for b, x in s.items()}
        tot = sum(s.values())
        if abs(tot - len(reuse)) < 1e-9:
            break
        free = [b for b in reuse if lo < s[b] < hi] or reuse
        adj = (len(reuse) - tot) / len(free)
        s = {b: x + adj if b in free else x for b, x in s.items()}
    return tuple(1.0 if plan.is_anchor(b) else round(s[b], 4) for b in range(L))


def rule_problem(rule) -> str | None:
    """Why ``rule`` is not a reuse rule (one of :data:`RULES`, or several joined by ``+``), or None if it is."""
    if not isinstance(rule, str):
        return f"a reuse rule must be a string, got {rule!r}"
    parts = rule.split("+")
    bad = [p for p in parts if p not in RULES]
    if bad:
        return f"unknown reuse rule(s) {bad}; choose from {', '.join(RULES)} (join several with '+')"
    if "any-anchor" in parts and "union2" in parts:
        return f"{rule!r}: any-anchor and union2 both choose the sources: use one of them"
    return None


def plan_for_rule(model_or_fp, stats: CalibrationStats, anchors, rule: str = "faithful", *, alpha: float = ALPHA,
                  budget: dict | None = None, source: str = "") -> KascadePlan:
    """The plan of a reuse ``rule`` (one of :data:`RULES`, or several joined by ``+``, e.g.
    ``any-anchor+layer-budget``) for a given anchor set; ``budget`` sets the plan's ratio / k_min / tile / rolling
    (default: the plan's defaults)."""
    fp = fingerprint(model_or_fp)
    why = rule_problem(rule)
    if why:
        raise ValueError(why)
    parts = rule.split("+")
    anchors = tuple(sorted(anchors))
    hm = head_maps(stats, anchors, fp.num_layers)
    plan = KascadePlan(fp, anchors, hm, calibrated=True, source=source or f"calibrated ({rule}): anchors "
                       f"{list(anchors)}, {stats.windows} windows of {stats.seq_len} tokens", **(budget or {}))
    changes = {}
    if "any-anchor" in parts:
        changes["sources"] = ranked_sources(stats, anchors, 1)
    if "union2" in parts:
        changes["sources"] = ranked_sources(stats, anchors, 2)
    if "sinks" in parts:
        changes.update(sinks=SINKS, recent=RECENT)
    if changes:
        plan = plan.with_reuse(**changes)
    if "layer-budget" in parts:
        plan = plan.with_reuse(factor=layer_factors(stats, plan, alpha))
    return plan


def length_plan(model_or_fp, stats_by_length: dict[int, CalibrationStats], num_anchors: int, rule: str = "faithful",
                anchors_by_length: dict[int, tuple[int, ...]] | None = None, **kw) -> KascadePlan:
    """A length-aware plan: one sub-plan per calibration length (its own DP anchors, or ``anchors_by_length``),
    switching at the geometric mean of neighbouring lengths; the longest length's plan is the top level."""
    lengths = sorted(stats_by_length)
    if not lengths:
        raise ValueError("length_plan needs statistics for at least one length")
    plans = []
    for n in lengths:
        st = stats_by_length[n]
        anchors = (anchors_by_length or {}).get(n) or dp_anchors(st, num_anchors)
        plans.append(plan_for_rule(model_or_fp, st, anchors, rule, **kw))
    bounds = [int(math.sqrt(a * b)) for a, b in zip(lengths, lengths[1:])]
    top = plans[-1]
    src = "length-aware: " + "; ".join(f"N <= {m}: {list(p.anchors)}" for m, p in zip(bounds, plans)) + \
          f"; longer: {list(top.anchors)} ({rule}, calibrated at {lengths} tokens)"
    return dataclasses.replace(top, by_length=tuple(zip(bounds, plans[:-1])), source=src)


__getattr__ = _renamed.module_getattr(__name__, _renamed.FACTOR, layer_scales="layer_factors")
