"""Per-layer budgets from measured sensitivity: the allocation DP, monotone costs, the sensitivity table."""

import pytest
import torch

from kascade import KascadePlan, ModelFingerprint
from kascade.calibrate import budgets

FP = ModelFingerprint("llama", 6, 6, 2, 8)


def _sens(base, table):
    return dict(base=base, kl={l: dict(row) for l, row in table.items()})



def test_allocate_factors_is_the_exact_minimum_at_the_same_mean_budget():
    """The DP's allocation equals a brute force over every grid assignment with mean factor 1 over layers 1..L-1,
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
    got = budgets.allocate_factors(sens, L, grid)
    assert got[0] == 1.0 and len(got) == L and abs(sum(got[1:]) - (L - 1)) < 1e-12
    costs = budgets.monotone_costs(sens, grid)
    best = min((sum(costs[l][s] for l, s in zip(range(1, L), combo)), combo)
               for combo in itertools.product(grid, repeat=L - 1) if abs(sum(combo) - (L - 1)) < 1e-12)
    assert abs(sum(costs[l][s] for l, s in zip(range(1, L), got[1:])) - best[0]) < 1e-12
    assert got != (1.0,) * L  # the gains differ: budget moves



def test_monotone_costs_treat_inverted_measurements_as_noise():
    sens = _sens(0.1, {1: {0.5: 0.09, 1.5: 0.105, 2.0: 0.095}})  # fewer keys "helped", more "hurt": noise
    c = budgets.monotone_costs(sens, (0.5, 1.0, 1.5, 2.0))[1]
    assert c[0.5] == 0.0 and c[1.0] == 0.0 and c[1.5] == 0.0 and c[2.0] == pytest.approx(-0.005)
    with pytest.raises(ValueError, match="no measurement"):
        budgets.allocate_factors(sens, 3, (0.5, 1.0, 2.0))
    with pytest.raises(ValueError, match="multiple of unit"):
        budgets.allocate_factors(sens, 2, (0.3, 1.0))



def test_layer_sensitivity_changes_one_layer_at_a_time():
    """Each measured plan differs from the base in one layer's factor; a scorer that rewards keys in layer 3 only
    gets layer 3 the largest budget."""
    plan = KascadePlan(FP, (0, 3), ((0, 1),) * 6, k_min=8, tile=16)
    seen = []

    def scorer(p):
        seen.append(p.reuse.factor)
        s = 1.0 if p.reuse.factor is None else p.reuse.factor[3]
        return dict(kl=0.1 / s, agreement=0.9)

    sens = budgets.layer_sensitivity(scorer, plan, (0.5, 1.0, 2.0), progress=False)
    assert seen[0] is None and len(seen) == 1 + 5 * 2
    for ls in seen[1:]:
        assert sum(x != 1.0 for x in ls) == 1 and ls[0] == 1.0
    assert sens["kl"][3] == {0.5: 0.2, 2.0: 0.05} and sens["kl"][1] == {0.5: 0.1, 2.0: 0.1}
    out = budgets.measured_budget_plan(plan, sens, (0.5, 1.0, 2.0))
    assert out.reuse.factor[3] == 2.0 and max(out.reuse.factor) == 2.0 and out.anchors == plan.anchors
    assert abs(sum(out.reuse.factor[1:]) - 5) < 1e-12
    seen.clear()  # a second round measures around the plan's own factors, the other layers keeping theirs
    again = budgets.layer_sensitivity(scorer, out, (0.5, 1.0, 2.0), progress=False)
    assert again["current"][3] == 2.0 and set(again["kl"][3]) == {0.5, 1.0} and len(seen) == 1 + 5 * 2
    for ls in seen[1:]:
        assert sum(x != y for x, y in zip(ls, out.reuse.factor)) == 1
    assert budgets.monotone_costs(again, (0.5, 1.0, 2.0))[3][2.0] == 0.0
    assert budgets.allocate_factors(again, 6, (0.5, 1.0, 2.0))[3] == 2.0
    with pytest.raises(ValueError, match="anchors and head map only"):
        budgets.layer_sensitivity(scorer, KascadePlan(FP, (0, 3), ((0, 1),) * 6).with_reuse(recent=0.5), progress=False)


def test_the_calibration_functions_by_their_former_names_are_type_errors_naming_the_current():
    import kascade.calibrate as calibrate

    for module, old, new in ((calibrate, "allocate_scales", "allocate_factors"),
                             (calibrate, "layer_scales", "layer_factors"), (budgets, "allocate_scales", "allocate_factors")):
        with pytest.raises(TypeError, match=f"'{new}', not '{old}'"):
            getattr(module, old)
    with pytest.raises(AttributeError):
        calibrate.no_such_function
