"""Anchors and per-layer budgets searched together for a speed target (kascade.calibrate.joint): the allocation at a
given total, the largest total within the target, the choice among anchor counts, and the command end to end."""

import itertools
from types import SimpleNamespace

import pytest
from test_calibrate_cli import TINY, tiny  # noqa: F401  (tiny: the fixture)

from kascade import KascadePlan, ModelFingerprint
from kascade.calibrate import budgets, joint, pipeline, target
from kascade.cli import main

SMOL = ModelFingerprint("llama", 30, 9, 3, 64)
GRID = (0.5, 1.0, 1.5, 2.0)


def _sens(L, gain):
    """Every layer's KL falls with more keys, layer ``l`` by ``gain(l)`` per unit of factor."""
    return dict(base=0.1, kl={l: {s: 0.1 - gain(l) * (s - 1.0) for s in GRID if s != 1.0} for l in range(1, L)})


def test_allocate_factors_spends_a_larger_total_where_it_helps_most():
    """At a total above the mean of 1 the extra budget goes to the layers with the largest measured gains; the sum is
    exact and equals a brute force's optimum."""
    L = 5
    sens = _sens(L, lambda l: 0.001 * l)  # the deeper, the more a key helps
    for total in (8, 10, 12, 16):  # units of 0.5 over 4 layers: mean 1, 1.25, 1.5, 2
        got = budgets.allocate_factors(sens, L, GRID, total=total)
        assert got[0] == 1.0 and sum(got[1:]) == pytest.approx(total * 0.5)
        costs = budgets.monotone_costs(sens, GRID)
        best = min(sum(costs[l][s] for l, s in zip(range(1, L), c)) for c in itertools.product(GRID, repeat=L - 1)
                   if sum(c) == pytest.approx(total * 0.5))
        assert sum(costs[l][s] for l, s in zip(range(1, L), got[1:])) == pytest.approx(best)
        assert list(got[1:]) == sorted(got[1:])  # a layer that gains more never gets less
    assert budgets.allocate_factors(sens, L, GRID, total=10) == (1.0, 0.5, 0.5, 2.0, 2.0)
    for bad in (3, 17, 9.5, True):
        with pytest.raises(ValueError, match="whole number of units"):
            budgets.allocate_factors(sens, L, GRID, total=bad)


def test_largest_within_meets_the_target_and_one_unit_more_does_not():
    """With the H200 cost model: the chosen total's plan meets the target, the next total's misses it; fewer anchors
    leave room for a larger mean budget at the same target."""
    s = pipeline.Settings(target_speedup=3.0, cost_shape="llama-3.1-8b")
    sens = _sens(30, lambda l: 0.001)
    means = {}
    for a in (4, 6):
        base = KascadePlan.uniform(SMOL, a)
        plan, total = joint.largest_within(base, sens, s)
        assert plan is not None and target.meets(plan, s)
        assert not target.meets(budgets.measured_budget_plan(base, sens, GRID, total=total + 1), s)
        means[a] = total * 0.5 / 29
    assert means[4] > means[6] > 0.5
    too_fast = pipeline.Settings(target_speedup=4.6, cost_shape="llama-3.1-8b")
    assert joint.largest_within(KascadePlan.uniform(SMOL, 6), sens, too_fast) == (None, None)


def test_joint_plan_keeps_the_candidate_of_lowest_kl(monkeypatch):
    """Every anchor count from the most within the target down to ``span`` fewer is tried, each with its largest
    budgets within the target; the lowest KL on the development windows wins (here: fewer anchors, larger budgets)."""
    s = pipeline.Settings(target_speedup=3.0, cost_shape="llama-3.1-8b")
    scored = []

    def scorer(plan):  # KL falls with the keys the reuse layers attend, anchors count for less
        keys = sum(plan.layer_factor(l) for l in range(1, 30) if not plan.is_anchor(l))
        scored.append(len(plan.anchors))
        return {"kl": 1.0 / keys + 0.0005 * len(plan.anchors)}

    monkeypatch.setattr(joint, "DenseReference", lambda model, windows: scorer)
    monkeypatch.setattr(joint, "searched_plan", lambda model, stats, wins, a, rule, **kw: (KascadePlan.uniform(SMOL, a),
                                                                                         []))
    monkeypatch.setattr(joint, "layer_sensitivity", lambda scorer, plan, **kw: _sens(30, lambda l: 0.001))
    most = target.most_anchors_within(s, SMOL)
    plan, tried = joint.joint_plan(None, None, [], s, most, span=2, log=lambda *a: None)
    assert [len(t["anchors"]) for t in tried] == [most, most - 1, most - 2]
    assert all(min(t["speedups"].values()) >= 3.0 for t in tried)
    assert tried[0]["mean_factor"] < tried[1]["mean_factor"] < tried[2]["mean_factor"]
    best = min(tried, key=lambda t: t["kl"])
    assert list(plan.anchors) == best["anchors"] and target.meets(plan, s)
    assert "searched together for 3x" in plan.source


def test_target_speedup_with_method_measured_end_to_end(tmp_path, tiny, capsys):  # noqa: F811
    out = tmp_path / "cal"
    assert main(["calibrate", *TINY, "--method", "measured", "--target-speedup", "1.2", "--joint-span", "1",
                 "--search-windows", "1", "--search-evals", "2", "--out", str(out)]) == 0
    plan = KascadePlan.load(out / "plan.json")
    s = SimpleNamespace(target_speedup=1.2, speedup_mode="decode", cost_shape=None, cost_table=None)
    assert target.meets(plan, s) and plan.reuse.factor is not None
    printed = capsys.readouterr().out
    assert printed.count("joint search:") == 2 and "<- chosen" in printed and "target 1.2x (decode) met" in printed
