"""Measured per-layer budgets: each layer's sensitivity to its budget, then the allocation that minimises it.

``layer_sensitivity`` measures the KL against dense of a plan with one layer's budget multiplier changed at a time
(any scorer with ``scorer(plan)["kl"]``, e.g. :class:`kascade.fidelity.DenseReference`); ``allocate_factors`` picks
one multiplier of the grid per layer minimising the summed changes at the same mean budget, by an exact dynamic
program over the budget; ``measured_budget_plan`` applies it to the plan (``plan.reuse.factor``).

    sens = layer_sensitivity(DenseReference(model, dev_windows), plan)
    plan = measured_budget_plan(plan, sens)
"""

from __future__ import annotations

import dataclasses

from tqdm.auto import tqdm

from .. import _renamed
from ..plan import KascadePlan

MEASURED_GRID = (0.5, 1.0, 1.5, 2.0)  # anchors then rank at most 2x deep


def _with_factors(plan: KascadePlan, factors: dict[int, float]) -> KascadePlan:
    L = plan.num_layers
    return plan.with_reuse(factor=tuple(float(factors.get(l, 1.0)) for l in range(L)))


def layer_sensitivity(scorer, plan: KascadePlan, grid=MEASURED_GRID, *, progress: bool = True, log=None) -> dict:
    """Measured KL of ``plan`` with one layer's budget changed at a time: ``{"base": kl, "current": {layer: factor},
    "kl": {layer: {factor: kl}}}`` for every layer 1..L-1 (anchors too: their own sets) and every ``factor`` of
    ``grid`` but the layer's current one (``plan``'s reuse factor, 1 without it; the other layers keep theirs)."""
    if plan.reuse.sources is not None or plan.reuse.recent > 0 or plan.by_length:
        raise ValueError("layer_sensitivity takes a plan with anchors and head map only (no sources / sinks / "
                         "sub-plans per length)")
    cur = {l: plan.layer_factor(l) for l in range(plan.num_layers)}
    base = scorer(plan)["kl"]
    layers = range(1, plan.num_layers)
    todo = {l: [s for s in grid if s != cur[l]] for l in layers}
    table = {}
    bar = tqdm(total=sum(map(len, todo.values())), desc="layer sensitivity", unit="plan", disable=not progress)
    for l in layers:
        table[l] = {}
        for s in todo[l]:
            table[l][s] = scorer(_with_factors(plan, {**cur, l: s}))["kl"]
            bar.update(1)
        if log:
            log(f"    sensitivity layer {l} (at {cur[l]}x): " +
                ", ".join(f"{s}x {v - base:+.4f}" for s, v in table[l].items()))
    bar.close()
    return dict(base=base, current={l: cur[l] for l in layers}, kl=table)


def monotone_costs(sens: dict, grid=MEASURED_GRID) -> dict[int, dict[float, float]]:
    """Per layer and factor of ``grid``, the measured KL change against the base plan (0 at the layer's current
    factor, ``sens["current"]``, 1 if absent), made monotone: more keys never cost fidelity (above the current factor
    a factor's change is at most the next smaller one's, and at most 0; below it at least the next larger one's, and
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


def allocations(sens: dict, num_layers: int, grid=MEASURED_GRID, *, unit: float = 0.5) -> dict[int, tuple]:
    """For every reachable total budget (in units of ``unit`` over layers 1..L-1), the per-layer multipliers from
    :func:`layer_sensitivity`'s table that minimise the sum of the measured KL changes (each layer's change measured
    alone: an additive model, made monotone by :func:`monotone_costs`): ``{total: (1.0, scale_1, ...)}``. Exact, by
    one dynamic program over the budget (every grid value must be a multiple of ``unit``). Layer 0 (dense) keeps 1."""
    units = {}
    for s in grid:
        u = s / unit
        if abs(u - round(u)) > 1e-9 or u <= 0:
            raise ValueError(f"grid value {s} is not a positive multiple of unit {unit}")
        units[s] = int(round(u))
    if 1.0 not in units:
        raise ValueError("the grid must contain 1.0")
    layers = list(range(1, num_layers))
    costs = monotone_costs(sens, grid)
    missing = [(l, s) for l in layers for s in grid if s not in costs.get(l, {})]
    if missing:
        raise ValueError(f"the sensitivity table has no measurement for (layer, factor) {missing[:4]}")

    # best[c] = (cost, choices) over the layers so far using c units
    best = {0: (0.0, ())}
    for l in layers:
        nxt = {}
        for c, (v, ch) in best.items():
            for s, u in units.items():
                v2 = v + costs[l][s]
                if c + u not in nxt or v2 < nxt[c + u][0]:
                    nxt[c + u] = (v2, ch + (s,))
        best = nxt
    return {c: (1.0, *(float(s) for s in ch)) for c, (_, ch) in best.items()}


def allocate_factors(sens: dict, num_layers: int, grid=MEASURED_GRID, *, unit: float = 0.5,
                    total: int | None = None) -> tuple[float, ...]:
    """:func:`allocations` at one total: the factors over layers 1..L-1 summing to exactly ``total`` units of ``unit``
    (default: a mean of 1, the same average budget)."""
    table = allocations(sens, num_layers, grid, unit=unit)
    n = num_layers - 1
    if total is None:
        total = int(round(1.0 / unit)) * n
    lo, hi = min(table), max(table)
    if isinstance(total, bool) or not isinstance(total, int) or not lo <= total <= hi:
        raise ValueError(f"total must be a whole number of units in [{lo}, {hi}] for {n} layers, got {total!r}")
    if total not in table:
        raise ValueError(f"no allocation of the grid sums to {total} units exactly")
    return table[total]


@_renamed.keywords(_renamed.FACTOR, scales="factors")
def budgeted_plan(plan: KascadePlan, factors, sens: dict, grid=MEASURED_GRID, source: str = "") -> KascadePlan:
    """``plan`` with per-layer budget multipliers ``factors`` (one per layer) chosen from ``sens`` over ``grid``."""
    return dataclasses.replace(plan.with_reuse(factor=factors), source=source or (
        f"{plan.source}; per-layer budgets from measured sensitivity (grid {list(grid)}, base KL {sens['base']:.4f})"))


def measured_budget_plan(plan: KascadePlan, sens: dict, grid=MEASURED_GRID, source: str = "",
                         total: int | None = None) -> KascadePlan:
    """``plan`` with per-layer budgets from :func:`allocate_factors` over ``grid`` (``total``: its sum of units)."""
    return budgeted_plan(plan, allocate_factors(sens, plan.num_layers, grid, total=total), sens, grid, source)


def attended_fraction(model, plan: KascadePlan, windows, *, backend: str = "reference") -> float:
    """The fraction of the causal (query, key) pairs dense attention attends that ``plan`` attends on ``windows``
    (1-D token tensors; layer 0, dense, included), counted from its selections."""
    import torch

    from ..integration.hf import enable

    att = den = 0
    dev = next(model.parameters()).device
    for w in windows:
        with torch.no_grad(), enable(model, plan, backend=backend, account=True, warn_uncalibrated=False) as h:
            model(w[None].to(dev))
        att += sum(a for a, _ in h.runtime.attended.values())
        den += sum(d for _, d in h.runtime.attended.values())
    return att / den


def mass_for_fraction(model, plan: KascadePlan, windows, fraction: float, *, low: float = 0.5, high: float = 1.0,
                      steps: int = 7, backend: str = "reference", progress: bool = True) -> tuple[float, float]:
    """The share of attention (:attr:`kascade.Budget.mass`) at which ``plan`` (its ``ratio`` the cap) attends at most
    ``fraction`` of the keys on ``windows``, by bisection over ``[low, high]`` in ``steps`` measurements (the attended
    fraction grows with the share). Returns ``(mass, measured fraction)``, the largest share tried within the
    fraction; ValueError when even ``low`` attends more (lower ``k_min``, or aim higher)."""
    if not 0 < low < high <= 1:
        raise ValueError(f"need 0 < low < high <= 1, got low={low!r}, high={high!r}")
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
    bar = tqdm(total=steps + 1, desc="mass for a budget", unit="measurement", disable=not progress)
    best = (low, attended_fraction(model, plan.with_budget(mass=low), windows, backend=backend))
    bar.update(1)
    if best[1] > fraction:
        bar.close()
        raise ValueError(f"at mass={low} the plan already attends {best[1]:.4f} of the keys, above {fraction}: its "
                         "floor (k_min, the own tiles, layer 0) takes that much")
    lo, hi = low, high
    for _ in range(steps):
        mid = (lo + hi) / 2
        f = attended_fraction(model, plan.with_budget(mass=mid), windows, backend=backend)
        bar.update(1)
        if f <= fraction:
            lo, best = mid, (mid, f)
        else:
            hi = mid
    bar.close()
    return best


__getattr__ = _renamed.module_getattr(__name__, _renamed.FACTOR, allocate_scales="allocate_factors")
