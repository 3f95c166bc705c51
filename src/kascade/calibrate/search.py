"""Measured anchor search: anchors chosen by teacher-forced KL against dense on development windows.

From the DP's anchor set (:mod:`kascade.calibrate.dp`), a coordinate search moves one anchor at a time and keeps the
move that lowers the measured ``KL(dense || plan)`` most (:class:`kascade.fidelity.DenseReference` scores plans).

    plan, history = searched_plan(model, stats, dev_windows, num_anchors=6)
"""

from __future__ import annotations

import time

from tqdm.auto import tqdm

from ..fidelity import DenseReference
from ..plan import KascadePlan
from .dp import dp_anchors
from .rules import fingerprint, plan_for_rule
from .stats import CalibrationStats


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

    bar = tqdm(total=max_evals, desc="anchor search", unit="plan", disable=not progress)
    best = tuple(sorted(start))
    best_s = score(best)
    bar.update(1)
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
                  max_evals: int = 40, progress: bool = True, log=None, scorer: DenseReference | None = None,
                  **kw) -> tuple[KascadePlan, list]:
    """Anchors by :func:`search_anchors` from the DP's set, reuse ``rule``, scored on ``windows`` (development;
    or by a ``scorer`` already built on them)."""
    fp = fingerprint(model)
    scorer = scorer or DenseReference(model, windows)
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
