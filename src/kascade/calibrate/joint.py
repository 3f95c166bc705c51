"""Anchors and per-layer budgets searched together for a speed target (``kascade calibrate --method measured
--target-speedup X``).

An anchor costs a selection; a reuse layer costs its budget. One anchor fewer therefore frees time that larger
budgets in other layers can spend at the same modelled speed, and which of the two buys more fidelity differs from
model to model. For each anchor count from the most that meets the target at one budget
(:func:`kascade.calibrate.target.most_anchors_within`) down to ``span`` fewer:

1. the anchors of the measured search (:func:`~kascade.calibrate.search.searched_plan`);
2. each layer's measured sensitivity to its budget (:func:`~kascade.calibrate.budgets.layer_sensitivity`);
3. the per-layer budgets of the largest total budget whose plan still meets the target
   (:func:`~kascade.calibrate.budgets.allocations`: one DP gives every total's best budgets; the cost model of
   :mod:`kascade.costs` judges the totals from the largest down);

then the candidate with the lowest KL against dense on the same development windows. Held-out windows are never
used, so ``kascade eval`` on them stays an honest test of the choice.
"""

from __future__ import annotations

import dataclasses

from ..fidelity import DenseReference
from ..plan import KascadePlan
from . import target
from .budgets import MEASURED_GRID, allocations, budgeted_plan, layer_sensitivity
from .search import searched_plan

UNIT = 0.5  # the grid's step: totals are counted in it


def largest_within(base: KascadePlan, sens: dict, s, grid=MEASURED_GRID) -> tuple[KascadePlan | None, int | None]:
    """``base`` with the per-layer budgets of the largest total (in units of ``UNIT`` over layers 1..L-1) whose plan
    meets ``s.target_speedup``; ``(None, None)`` when even the smallest total misses it."""
    table = allocations(sens, base.num_layers, grid, unit=UNIT)
    for total in sorted(table, reverse=True):
        plan = budgeted_plan(base, table[total], sens, grid)
        if target.meets(plan, s):
            return plan, total
    return None, None


def joint_plan(model, stats, windows, s, most: int, *, span: int = 2, progress: bool = True,
               log=print) -> tuple[KascadePlan, list[dict]]:
    """The most faithful plan (lowest KL on ``windows``) among the candidates of ``most`` .. ``most - span`` anchors
    (module docstring), and every candidate tried: ``{anchors, mean_factor, kl, speedups}``."""
    scorer = DenseReference(model, windows)
    candidates = []  # (row, plan)
    for a in range(most, max(1, most - span) - 1, -1):
        base, _ = searched_plan(model, stats, windows, a, "faithful", max_evals=s.search_evals, progress=progress,
                                log=log, scorer=scorer, budget=s.budget)
        sens = layer_sensitivity(scorer, base, progress=progress, log=log)
        plan, total = largest_within(base, sens, s)
        if plan is None:
            log(f"  {a} anchors: no per-layer budgets of the grid meet {s.target_speedup:g}x")
            continue
        row = dict(anchors=list(plan.anchors), mean_factor=total * UNIT / max(1, plan.num_layers - 1),
                   kl=scorer(plan)["kl"], speedups=target.speedups(plan, s))
        log(f"  {a} anchors {row['anchors']}, mean budget x{row['mean_factor']:.2f}: KL {row['kl']:.4f} ("
            + ", ".join(f"{m} {x:.2f}x" for m, x in row["speedups"].items()) + ")")
        candidates.append((row, plan))
    if not candidates:
        raise ValueError(f"no plan of {max(1, most - span)}..{most} anchors meets --target-speedup "
                         f"{s.target_speedup:g} with per-layer budgets")
    row, best = min(candidates, key=lambda c: c[0]["kl"])
    note = (f"; anchors and per-layer budgets searched together for {s.target_speedup:g}x ({s.speedup_mode}): "
            f"{len(candidates)} candidates of {max(1, most - span)}..{most} anchors, lowest KL {row['kl']:.4f} "
            f"at mean budget x{row['mean_factor']:.2f}")
    return dataclasses.replace(best, source=best.source + note), [r for r, _ in candidates]
