"""Variant plans from calibration statistics, and the measured anchor search (with a synthetic scorer)."""

import pytest
import torch

from conftest import tiny_model
from kascade import KascadePlan, ModelFingerprint
from kascade.calibrate import collect_stats
from kascade.calibrate import variants as cv
from kascade.calibrate.stats import CalibrationStats
from kascade.eval.strategies import VARIANTS, make_strategy

FP = ModelFingerprint("llama", 6, 6, 2, 8)


def _stats(seed=0):
    g = torch.Generator().manual_seed(seed)
    return CalibrationStats(similarity=torch.rand(6, 6, 2, 2, generator=g), importance=torch.rand(6, generator=g) + .1,
                            windows=1, seq_len=512, k=16, tile=16)


def test_any_anchor_sources_take_the_best_pair_over_all_earlier_anchors():
    st = _stats()
    st.similarity[0, 5, 1, 0] = 5.0  # layer 5 head 1 matches layer 0 head 0 best, though anchor 3 is nearer
    src = cv.ranked_sources(st, (0, 3), 1)
    assert src[5][1] == ((0, 0),)
    assert src[3] == (((3, 0),), ((3, 1),)) and src[0] == (((0, 0),), ((0, 1),))
    two = cv.ranked_sources(st, (0, 3), 2)
    assert two[5][1][0] == (0, 0) and len(two[5][1]) == 2
    near = cv.ranked_sources(st, (0, 3), 1, nearest_only=True)
    assert all(p[0][0] == 3 for p in near[5])
    KascadePlan(FP, (0, 3), ((0, 1),) * 6).with_reuse(sources=two)  # valid for the plan


def test_layer_scales_favour_dissimilar_layers_and_keep_the_mean():
    st = _stats(1)
    plan = cv.plan_for_rule(FP, st, (0, 3), "faithful", budget=dict(k_min=8, tile=16))
    sc = cv.layer_scales(st, plan)
    reuse = [b for b in range(6) if not plan.is_anchor(b)]
    assert sc[0] == 1.0 and sc[3] == 1.0
    assert abs(sum(sc[b] for b in reuse) / len(reuse) - 1.0) < 1e-3
    assert all(0.5 <= x <= 2.0 for x in sc)
    d = {b: float(st.importance[b]) * (1 - float(st.similarity[plan.anchor_of(b), b].gather(
        1, torch.tensor(plan.head_map[b])[:, None]).mean())) for b in reuse}
    hi, lo = max(d, key=d.get), min(d, key=d.get)
    assert sc[hi] > sc[lo]


def test_plan_for_rule_names_and_combinations():
    st = _stats()
    for rule in cv.RULES:
        p = cv.plan_for_rule(FP, st, (0, 2, 4), rule)
        assert p.anchors == (0, 2, 4) and p.ranked == (rule != "faithful"), rule
    p = cv.plan_for_rule(FP, st, (0, 2, 4), "any-anchor+sinks+layer-budget")
    assert p.reuse.sources is not None and p.reuse.recent == cv.RECENT and p.reuse.scale is not None
    with pytest.raises(ValueError, match="unknown reuse rule"):
        cv.plan_for_rule(FP, st, (0, 2), "magic")
    with pytest.raises(ValueError, match="use one of them"):
        cv.plan_for_rule(FP, st, (0, 2), "any-anchor+union2")


def test_length_plan_has_one_sub_plan_per_shorter_length():
    p = cv.length_plan(FP, {1024: _stats(0), 4096: _stats(1), 2048: _stats(2)}, 3)
    assert [m for m, _ in p.by_length] == [1448, 2896]
    assert p.for_length(1000) is p.by_length[0][1] and p.for_length(3000) is p
    assert len(p.for_length(2000).anchors) == 3


def test_search_finds_the_minimum_of_a_synthetic_objective():
    target = (0, 2, 7, 9)

    def scorer(plan):  # KL = distance to the target anchor set
        return dict(kl=float(sum(abs(a - b) for a, b in zip(plan.anchors, target))), agreement=0.0)

    fp = ModelFingerprint("llama", 12, 6, 2, 8)
    build = lambda a: KascadePlan(fp, a, ((0, 1),) * 12)  # noqa: E731
    best, s, hist = cv.search_anchors(build, scorer, (0, 3, 5, 10), 12, max_evals=200, progress=False)
    assert best == target and s["kl"] == 0 and len(hist) < 200
    best, _, hist = cv.search_anchors(build, scorer, (0, 3, 5, 10), 12, max_evals=5, progress=False)
    assert len(hist) <= 5 and best != target  # the budget of scored plans is respected


def test_variant_strategies_on_a_tiny_model():
    model = tiny_model("llama", num_key_value_heads=3)
    g = torch.Generator().manual_seed(0)
    wins = [torch.randint(3, 97, (200,), generator=g) for _ in range(2)]
    st = collect_stats(model, wins, k=16, tile=16, progress=False)
    base = cv.plan_for_rule(model, st, (0, 2), "faithful", budget=dict(k_min=8, tile=16))
    ids = wins[0][None]
    for name in VARIANTS:
        if name in ("kascade-search", "kascade-best"):
            with pytest.raises(ValueError, match="made beforehand"):
                make_strategy(name, model, base, stats=st)
            plan, sel = make_strategy(name, model, base, variant_plans={name: base})
            assert plan == base and sel is None
            continue
        plan, sel = make_strategy(name, model, base, stats={200: st})
        assert sel is None and len(plan.anchors) == 2 and plan.k_min == 8
        import kascade

        with torch.no_grad(), kascade.enable(model, plan, account=True, warn_uncalibrated=False) as h:
            model(ids)
        a, d = h.runtime.attended[3]
        assert 0.05 < a / d < 0.5, (name, a / d)
    with pytest.raises(ValueError, match="needs calibration statistics"):
        make_strategy("kascade-union2", model, base)


def _sens(base, table):
    return dict(base=base, kl={l: dict(row) for l, row in table.items()})


def test_allocate_scales_is_the_exact_minimum_at_the_same_mean_budget():
    """The DP's allocation equals a brute force over every grid assignment with mean scale 1 over layers 1..L-1,
    under the additive model of the (monotone) measured changes."""
    import itertools

    g = torch.Generator().manual_seed(5)
    grid = (0.5, 1.0, 1.5, 2.0)
    L = 6
    table = {}
    for l in range(1, L):
        gain = float(torch.rand(1, generator=g)) * 0.01
        table[l] = {0.5: 0.1 + gain * 1.5, 1.5: 0.1 - gain * 0.6, 2.0: 0.1 - gain}
    sens = _sens(0.1, table)
    got = cv.allocate_scales(sens, L, grid)
    assert got[0] == 1.0 and len(got) == L and abs(sum(got[1:]) - (L - 1)) < 1e-12
    costs = cv.monotone_costs(sens, grid)
    best = min((sum(costs[l][s] for l, s in zip(range(1, L), combo)), combo)
               for combo in itertools.product(grid, repeat=L - 1) if abs(sum(combo) - (L - 1)) < 1e-12)
    assert abs(sum(costs[l][s] for l, s in zip(range(1, L), got[1:])) - best[0]) < 1e-12
    assert got != (1.0,) * L  # the gains differ: budget moves


def test_monotone_costs_treat_inverted_measurements_as_noise():
    sens = _sens(0.1, {1: {0.5: 0.09, 1.5: 0.105, 2.0: 0.095}})  # fewer keys "helped", more "hurt": noise
    c = cv.monotone_costs(sens, (0.5, 1.0, 1.5, 2.0))[1]
    assert c[0.5] == 0.0 and c[1.0] == 0.0 and c[1.5] == 0.0 and c[2.0] == pytest.approx(-0.005)
    with pytest.raises(ValueError, match="no measurement"):
        cv.allocate_scales(sens, 3, (0.5, 1.0, 2.0))
    with pytest.raises(ValueError, match="multiple of unit"):
        cv.allocate_scales(sens, 2, (0.3, 1.0))


def test_layer_sensitivity_changes_one_layer_at_a_time():
    """Each measured plan differs from the base in one layer's scale; a scorer that rewards keys in layer 3 only
    gets layer 3 the largest budget."""
    plan = KascadePlan(FP, (0, 3), ((0, 1),) * 6, k_min=8, tile=16)
    seen = []

    def scorer(p):
        seen.append(p.reuse.scale)
        s = 1.0 if p.reuse.scale is None else p.reuse.scale[3]
        return dict(kl=0.1 / s, agreement=0.9)

    sens = cv.layer_sensitivity(scorer, plan, (0.5, 1.0, 2.0), progress=False)
    assert seen[0] is None and len(seen) == 1 + 5 * 2
    for ls in seen[1:]:
        assert sum(x != 1.0 for x in ls) == 1 and ls[0] == 1.0
    assert sens["kl"][3] == {0.5: 0.2, 2.0: 0.05} and sens["kl"][1] == {0.5: 0.1, 2.0: 0.1}
    out = cv.measured_budget_plan(plan, sens, (0.5, 1.0, 2.0))
    assert out.reuse.scale[3] == 2.0 and max(out.reuse.scale) == 2.0 and out.anchors == plan.anchors
    assert abs(sum(out.reuse.scale[1:]) - 5) < 1e-12
    seen.clear()  # a second round measures around the plan's own scales, the other layers keeping theirs
    again = cv.layer_sensitivity(scorer, out, (0.5, 1.0, 2.0), progress=False)
    assert again["current"][3] == 2.0 and set(again["kl"][3]) == {0.5, 1.0} and len(seen) == 1 + 5 * 2
    for ls in seen[1:]:
        assert sum(x != y for x, y in zip(ls, out.reuse.scale)) == 1
    assert cv.monotone_costs(again, (0.5, 1.0, 2.0))[3][2.0] == 0.0
    assert cv.allocate_scales(again, 6, (0.5, 1.0, 2.0))[3] == 2.0
    with pytest.raises(ValueError, match="anchors and head map only"):
        cv.layer_sensitivity(scorer, KascadePlan(FP, (0, 3), ((0, 1),) * 6).with_reuse(recent=0.5), progress=False)


def test_measured_method_searches_then_allocates_budgets_on_a_tiny_model():
    """plan_from_method('measured'): searched anchors with faithful reuse, then budgets from the measured
    sensitivity (mean 1 over layers 1..L-1, grid values only), on the given development windows."""
    model = tiny_model("llama", num_key_value_heads=3, num_hidden_layers=6)
    g = torch.Generator().manual_seed(1)
    wins = [torch.randint(3, 97, (160,), generator=g) for _ in range(2)]
    st = collect_stats(model, wins[:1], k=16, tile=16, progress=False)
    plan = cv.plan_from_method("measured", model, {160: st}, 3, search_windows={160: wins[1:]}, max_evals=3,
                               budget=dict(k_min=8, tile=16), progress=False)
    assert len(plan.anchors) == 3 and plan.reuse.scale is not None and plan.reuse.sources is None and plan.k_min == 8
    assert set(plan.reuse.scale) <= set(cv.MEASURED_GRID) and abs(sum(plan.reuse.scale[1:]) - 5) < 1e-9
    assert "measured budgets" in plan.source
    with pytest.raises(ValueError, match="needs development windows"):
        cv.plan_from_method("measured", model, {160: st}, 3)
