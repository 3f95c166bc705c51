"""Plans for issue 8's variants of Kascade, from calibration statistics (and, for the search, measured fidelity).

Each builder keeps the faithful plan's anchor count and budget; the variant changes only *how reuse layers build
their index sets* (see :mod:`kascade.reuse`) or *which anchors* (search, length-aware). Methods:

- ``faithful``:     the DP's anchors and the argmax head map (:func:`kascade.calibrate.plan_from_stats`).
- ``any-anchor``:   a reuse head follows the best (anchor, head) among *all* anchors at or below it, by the
                    calibrated similarity ``S[a, b, hb, ha]``, not only the nearest anchor.
- ``union2``:       the union of its two best (anchor, head) sources, merged rank by rank at the same budget.
- ``sinks``:        its anchor head's ranking for half the budget, the first 4 keys plus the most recent ones for
                    the other half.
- ``layer-budget``: per-layer budgets: a reuse layer gets ``1 + alpha (d_b / mean d - 1)`` times the row budget
                    (clipped to [0.5, 2], renormalised so the mean over layers 1..L-1 stays 1), with
                    ``d_b = imp(b) (1 - sim_b)`` its importance-weighted dissimilarity to its source; anchors keep 1.
- ``length``:       one sub-plan per calibration length (``by_length``), chosen from N at run time.
- ``search``:       anchors chosen by measured teacher-forced KL on development windows (coordinate search from
                    the DP's set: move one anchor at a time), any reuse rule above.
- ``measured``:     the shipped default's method: anchors by that search (faithful reuse) on the development
                    windows of every length together, then per-layer budgets allocated from each layer's *measured*
                    sensitivity on the same windows (:func:`layer_sensitivity`, :func:`allocate_scales`).
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch
from tqdm.auto import tqdm

from ..plan import KascadePlan, ModelFingerprint
from . import layer_weights
from .dp import choose_anchors
from .stats import CalibrationStats

RULES = ("faithful", "any-anchor", "union2", "sinks", "layer-budget")
METHODS = (*RULES, "length", "search", "measured")
SINKS, RECENT = 4, 0.5
ALPHA, SCALE_RANGE = 1.0, (0.5, 2.0)


def _fp(model_or_fp) -> ModelFingerprint:
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


def layer_scales(stats: CalibrationStats, plan: KascadePlan, alpha: float = ALPHA,
                 clip: tuple[float, float] = SCALE_RANGE) -> tuple[float, ...]:
    """Per-layer budget multipliers for ``plan``'s anchors and sources (see the module docstring)."""
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


def plan_for_rule(model_or_fp, stats: CalibrationStats, anchors, rule: str = "faithful", *, alpha: float = ALPHA,
                  budget: dict | None = None, source: str = "") -> KascadePlan:
    """The plan of a reuse ``rule`` (one of :data:`RULES`, or several joined by ``+``, e.g.
    ``any-anchor+layer-budget``) for a given anchor set."""
    fp = _fp(model_or_fp)
    parts = rule.split("+")
    bad = [p for p in parts if p not in RULES]
    if bad:
        raise ValueError(f"unknown reuse rule(s) {bad}; choose from {', '.join(RULES)} (join several with '+')")
    if "any-anchor" in parts and "union2" in parts:
        raise ValueError("any-anchor and union2 both choose the sources: use one of them")
    anchors = tuple(sorted(anchors))
    plan_anchor = [max(a for a in anchors if a <= b) for b in range(fp.num_layers)]
    hm = tuple(stats.head_map(plan_anchor[b], b) for b in range(fp.num_layers))
    b = {**dict(ratio=0.10, k_min=128, tile=32, rolling=True), **(budget or {})}
    plan = KascadePlan(fp, anchors, hm, calibrated=True, source=source or f"calibrated ({rule}): anchors "
                       f"{list(anchors)}, {stats.windows} windows of {stats.seq_len} tokens", **b)
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
        plan = plan.with_reuse(scale=layer_scales(stats, plan, alpha))
    return plan


def dp_anchors(stats: CalibrationStats, num_anchors: int) -> tuple[int, ...]:
    return choose_anchors(layer_weights(stats), num_anchors)[0]


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


# ----------------------------------------------------------------------------------------------------------------
# Fidelity-driven search
# ----------------------------------------------------------------------------------------------------------------
class DevScorer:
    """Teacher-forced KL / agreement of plans against dense on fixed development windows (dense logits cached)."""

    def __init__(self, model, windows: list[torch.Tensor], backend: str = "reference"):
        from ..eval.fidelity import scored_logits

        if not windows:
            raise ValueError("DevScorer needs at least one window")
        self.model, self.backend = model, backend
        self.dev = next(model.parameters()).device
        self.ids = [w[None].to(self.dev) for w in windows]
        with torch.no_grad():
            self.dense = [scored_logits(model, ids)[0] for ids in self.ids]
        self.evals = 0

    @torch.no_grad()
    def __call__(self, plan: KascadePlan) -> dict:
        from ..eval.fidelity import scored_logits
        from ..eval.metrics import fidelity
        from ..integration.hf import enable

        agree = kl = pos = 0.0
        for ids, d in zip(self.ids, self.dense):
            with enable(self.model, plan, backend=self.backend, warn_uncalibrated=False):
                s = scored_logits(self.model, ids)[0]
            f = fidelity(d, s)
            agree += f.top1_agreement * f.positions
            kl += f.kl * f.positions
            pos += f.positions
        self.evals += 1
        return dict(agreement=agree / pos, kl=kl / pos)


def search_anchors(build, scorer, start, num_layers: int, *, max_evals: int = 40, moves=(-2, -1, 1, 2),
                   progress: bool = True, log=None):
    """Coordinate search over anchor sets, scored by measured KL (``scorer(build(anchors))['kl']``).

    ``build(anchors) -> KascadePlan``. From ``start`` (the DP's set), repeatedly try moving one anchor (not layer 0)
    by each of ``moves`` (keeping anchors distinct and in range), take the best improvement of a sweep, and stop
    when a sweep improves nothing or ``max_evals`` plans have been scored. Returns ``(best anchors, best score,
    history [(anchors, score)])``.
    """
    cache = {}

    def score(anchors):
        if anchors not in cache:
            cache[anchors] = scorer(build(anchors))
            if log:
                log(f"    search: {list(anchors)} KL {cache[anchors]['kl']:.4f} agree "
                    f"{cache[anchors]['agreement']:.4f}")
        return cache[anchors]

    best = tuple(sorted(start))
    best_s = score(best)
    bar = tqdm(total=max_evals, desc="anchor search", unit="plan", disable=not progress)
    improved = True
    while improved and len(cache) < max_evals:
        improved = False
        sweep_best, sweep_s = best, best_s
        for i in range(1, len(best)):
            for m in moves:
                a = best[i] + m
                if not 0 < a < num_layers or a in best:
                    continue
                cand = tuple(sorted(best[:i] + (a,) + best[i + 1 :]))
                if cand in cache:
                    s = cache[cand]
                else:
                    if len(cache) >= max_evals:
                        break
                    s = score(cand)
                    bar.update(1)
                if s["kl"] < sweep_s["kl"]:
                    sweep_best, sweep_s = cand, s
        if sweep_s["kl"] < best_s["kl"]:
            best, best_s, improved = sweep_best, sweep_s, True
    bar.close()
    return best, best_s, [(list(a), s) for a, s in cache.items()]


def searched_plan(model, stats: CalibrationStats, windows, num_anchors: int, rule: str = "faithful", *,
                  max_evals: int = 40, progress: bool = True, log=None, scorer: DevScorer | None = None,
                  **kw) -> tuple[KascadePlan, list]:
    """Anchors by :func:`search_anchors` from the DP's set, reuse ``rule``, scored on ``windows`` (development;
    or by a ``scorer`` already built on them)."""
    fp = _fp(model)
    scorer = scorer or DevScorer(model, windows)
    t0 = time.perf_counter()
    best, s, hist = search_anchors(lambda a: plan_for_rule(fp, stats, a, rule, **kw), scorer,
                                   dp_anchors(stats, num_anchors), fp.num_layers, max_evals=max_evals,
                                   progress=progress, log=log)
    sizes = "/".join(map(str, sorted({w.numel() for w in windows})))
    plan = plan_for_rule(fp, stats, best, rule, source=(
        f"calibrated + searched ({rule}): anchors {list(best)} by measured KL {s['kl']:.4f} on {len(windows)} dev "
        f"windows of {sizes} tokens ({len(hist)} plans in {time.perf_counter() - t0:.0f} s), from the "
        f"DP over {stats.windows} windows of {stats.seq_len} tokens"), **kw)
    return plan, hist


def plan_from_method(method: str, model, stats_by_length: dict[int, CalibrationStats], num_anchors: int, *,
                     rule: str | None = None, search_windows: dict[int, list] | None = None, max_evals: int = 40,
                     budget: dict | None = None, progress: bool = True, log=None) -> KascadePlan:
    """One plan for ``kascade calibrate --method``: a reuse rule (``faithful``, ``any-anchor``, ... or several
    joined by ``+``) on the longest length's statistics, ``length`` (sub-plans per length with ``rule``), or
    ``search`` (measured search on ``search_windows``, per length when several lengths are given)."""
    fp = _fp(model)
    lengths = sorted(stats_by_length)
    kw = dict(budget=budget)
    if method == "length":
        return length_plan(fp, stats_by_length, num_anchors, rule or "faithful", **kw)
    if method == "measured":
        if not search_windows:
            raise ValueError("method 'measured' needs development windows to score plans on")
        wins = [w for n in lengths for w in search_windows[n]]
        scorer = DevScorer(model, wins)
        plan, _ = searched_plan(model, stats_by_length[lengths[-1]], wins, num_anchors, "faithful",
                                max_evals=max_evals, progress=progress, log=log, scorer=scorer, **kw)
        sens = layer_sensitivity(scorer, plan, progress=progress, log=log)
        return measured_budget_plan(plan, sens, source=f"{plan.source}; per-layer budgets {list(MEASURED_GRID)} "
                                    "from each layer's measured sensitivity on the same windows (measured budgets)")
    if method == "search":
        if not search_windows:
            raise ValueError("method 'search' needs development windows to score plans on")
        plans = {}
        for n in lengths:
            plans[n], _ = searched_plan(model, stats_by_length[n], search_windows[n], num_anchors, rule or "faithful",
                                        max_evals=max_evals, progress=progress, log=log, **kw)
        if len(lengths) == 1:
            return plans[lengths[0]]
        return length_plan(fp, stats_by_length, num_anchors, rule or "faithful",
                           anchors_by_length={n: p.anchors for n, p in plans.items()}, **kw)
    return plan_for_rule(fp, stats_by_length[lengths[-1]], dp_anchors(stats_by_length[lengths[-1]], num_anchors),
                         method if rule is None else rule, **kw)


# ----------------------------------------------------------------------------------------------------------------
# Per-layer budgets from measured sensitivity
# ----------------------------------------------------------------------------------------------------------------
MEASURED_GRID = (0.5, 1.0, 1.5, 2.0)  # anchors then rank at most 2x deep


def _with_scales(plan: KascadePlan, scales: dict[int, float]) -> KascadePlan:
    L = plan.num_layers
    return plan.with_reuse(scale=tuple(float(scales.get(l, 1.0)) for l in range(L)))


def layer_sensitivity(scorer, plan: KascadePlan, grid=MEASURED_GRID, *, progress: bool = True, log=None) -> dict:
    """Measured KL of ``plan`` with one layer's budget changed at a time: ``{"base": kl, "current": {layer: scale},
    "kl": {layer: {scale: kl}}}`` for every layer 1..L-1 (anchors too: their own sets) and every ``scale`` of
    ``grid`` but the layer's current one (``plan``'s reuse scale, 1 without it; the other layers keep theirs)."""
    if plan.reuse.sources is not None or plan.reuse.recent > 0 or plan.by_length:
        raise ValueError("layer_sensitivity takes a plan with anchors and head map only (no sources / sinks / "
                         "sub-plans per length)")
    cur = {l: plan.scale(l) for l in range(plan.num_layers)}
    base = scorer(plan)["kl"]
    layers = range(1, plan.num_layers)
    todo = {l: [s for s in grid if s != cur[l]] for l in layers}
    table = {}
    bar = tqdm(total=sum(map(len, todo.values())), desc="layer sensitivity", unit="plan", disable=not progress)
    for l in layers:
        table[l] = {}
        for s in todo[l]:
            table[l][s] = scorer(_with_scales(plan, {**cur, l: s}))["kl"]
            bar.update(1)
        if log:
            log(f"    sensitivity layer {l} (at {cur[l]}x): " +
                ", ".join(f"{s}x {v - base:+.4f}" for s, v in table[l].items()))
    bar.close()
    return dict(base=base, current={l: cur[l] for l in layers}, kl=table)


def monotone_costs(sens: dict, grid=MEASURED_GRID) -> dict[int, dict[float, float]]:
    """Per layer and scale of ``grid``, the measured KL change against the base plan (0 at the layer's current
    scale, ``sens["current"]``, 1 if absent), made monotone: more keys never cost fidelity (above the current scale
    a scale's change is at most the next smaller one's, and at most 0; below it at least the next larger one's, and
    at least 0). A measured change against that order is noise of the finite windows, and the allocation would
    otherwise spend budget on it."""
    out = {}
    for l, row in sens["kl"].items():
        c = float(sens.get("current", {}).get(l, sens.get("current", {}).get(str(l), 1.0)))
        d = {c: 0.0, **{float(s): v - sens["base"] for s, v in row.items()}}
        up, down = sorted(s for s in d if s > c), sorted((s for s in d if s < c), reverse=True)
        prev = 0.0
        for s in up:
            prev = d[s] = min(d[s], prev)
        prev = 0.0
        for s in down:
            prev = d[s] = max(d[s], prev)
        out[int(l)] = {s: d[s] for s in grid if s in d}
    return out


def allocate_scales(sens: dict, num_layers: int, grid=MEASURED_GRID, *, unit: float = 0.5) -> tuple[float, ...]:
    """Per-layer budget multipliers from :func:`layer_sensitivity`'s table: one scale of ``grid`` per layer 1..L-1
    minimising the sum of the measured KL changes (each layer's change measured alone: an additive model, made
    monotone by :func:`monotone_costs`), with the mean scale over layers 1..L-1 exactly 1 (the same average
    budget). Exact, by dynamic programming over the budget in units of ``unit`` (every grid value must be a
    multiple of it). Layer 0 (dense) keeps 1."""
    units = {}
    for s in grid:
        u = s / unit
        if abs(u - round(u)) > 1e-9 or u <= 0:
            raise ValueError(f"grid value {s} is not a positive multiple of unit {unit}")
        units[s] = int(round(u))
    if 1.0 not in units:
        raise ValueError("the grid must contain 1.0")
    layers = list(range(1, num_layers))
    total = units[1.0] * len(layers)
    costs = monotone_costs(sens, grid)
    missing = [(l, s) for l in layers for s in grid if s not in costs.get(l, {})]
    if missing:
        raise ValueError(f"the sensitivity table has no measurement for (layer, scale) {missing[:4]}")

    # best[c] = (cost, choices) over the layers so far using c units
    best = {0: (0.0, ())}
    for l in layers:
        nxt = {}
        for c, (v, ch) in best.items():
            for s, u in units.items():
                c2 = c + u
                if c2 > total:
                    continue
                v2 = v + costs[l][s]
                if c2 not in nxt or v2 < nxt[c2][0]:
                    nxt[c2] = (v2, ch + (s,))
        best = nxt
    if total not in best:
        raise ValueError("no allocation of the grid reaches the mean budget exactly")
    return (1.0, *(float(s) for s in best[total][1]))


def measured_budget_plan(plan: KascadePlan, sens: dict, grid=MEASURED_GRID, source: str = "") -> KascadePlan:
    """``plan`` with per-layer budgets from :func:`allocate_scales` over ``grid``."""
    scales = allocate_scales(sens, plan.num_layers, grid)
    return dataclasses.replace(plan.with_reuse(scale=scales), source=source or (
        f"{plan.source}; per-layer budgets from measured sensitivity (grid {list(grid)}, base KL {sens['base']:.4f})"))
