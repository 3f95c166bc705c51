"""The calibration pipeline's plan per method, and its settings."""

import pytest
import torch

from conftest import tiny_model
from kascade.calibrate import collect_stats, pipeline
from kascade.calibrate.budgets import MEASURED_GRID


def test_measured_method_searches_then_allocates_budgets_on_a_tiny_model():
    """plan_from_method('measured'): searched anchors with faithful reuse, then budgets from the measured
    sensitivity (mean 1 over layers 1..L-1, grid values only), on the given development windows."""
    model = tiny_model("llama", num_key_value_heads=3, num_hidden_layers=6)
    g = torch.Generator().manual_seed(1)
    wins = [torch.randint(3, 97, (160,), generator=g) for _ in range(2)]
    st = collect_stats(model, wins[:1], k=16, tile=16, progress=False)
    plan = pipeline.plan_from_method("measured", model, {160: st}, 3, search_windows={160: wins[1:]}, max_evals=3,
                                     budget=dict(k_min=40, tile=16), progress=False)
    # k_min 40 > tile 16: reuse layers attend selected keys (with k_min <= tile no prefill tile selects any, every
    # plan scores the same KL and the search and the budgets have nothing to measure)
    assert len(plan.anchors) == 3 and plan.reuse.factor is not None and plan.reuse.sources is None and plan.k_min == 40
    assert set(plan.reuse.factor) <= set(MEASURED_GRID) and abs(sum(plan.reuse.factor[1:]) - 5) < 1e-9
    assert len(set(plan.reuse.factor[1:])) > 1, plan.reuse.factor  # the layers' measured sensitivities differ
    assert "measured budgets" in plan.source
    with pytest.raises(ValueError, match="needs development windows"):
        pipeline.plan_from_method("measured", model, {160: st}, 3)


@pytest.mark.parametrize("changes,needle", [
    (dict(method="any-anchor+union2"), "--method: 'any-anchor\\+union2': any-anchor and union2 both choose"),
    (dict(method="search", rule="union2+any-anchor"), "--rule: 'union2\\+any-anchor': any-anchor and union2"),
    (dict(method="length", rule="length"), r"--rule: unknown reuse rule\(s\) \['length'\]"),
    (dict(method="search", rule="search"), r"--rule: unknown reuse rule\(s\) \['search'\]"),
    (dict(method="length", rule="measured"), r"--rule: unknown reuse rule\(s\) \['measured'\]"),
])
def test_settings_refuse_rules_that_fail_only_after_the_statistics(changes, needle):
    """Each of these passed the settings' check and was refused after the statistics (83 s on the default model)."""
    with pytest.raises(ValueError, match=needle):
        pipeline.Settings(**changes)


def test_settings_refuse_what_cannot_run():
    with pytest.raises(ValueError, match="--seq-len 40 is too short: at least 96"):
        pipeline.Settings(seq_len=40)
    with pytest.raises(ValueError, match="--seq-len 65 is too short: at least 96"):  # 65 passed, 1 query scored
        pipeline.Settings(seq_len=65)
    assert pipeline.Settings(seq_len=96).seq_len == 96  # --help: "at least one --tile after --k keys"
    with pytest.raises(ValueError, match="--seq-len 79 is too short: at least 80"):
        pipeline.Settings(seq_len=79, k=50, tile=16)
    with pytest.raises(ValueError, match="unknown method 'magic'"):
        pipeline.Settings(method="magic")
    with pytest.raises(ValueError, match=r"--rule: unknown reuse rule\(s\) \['magic'\]"):
        pipeline.Settings(method="length", rule="sinks+magic")
    s = pipeline.Settings(method="any-anchor+sinks", lengths=[300, 200], rolling=False)
    assert s.lengths == (300, 200) and s.budget == dict(ratio=0.10, k_min=128, tile=32, rolling=False)
    assert s.holdout_windows == 0 and pipeline.Settings(target_agreement=0.9).holdout_windows == 2


def test_the_search_scores_plans_on_other_windows_than_the_statistics():
    """--method search: its windows share no token with the statistics' and the holdout's (they did, e.g. 19% at
    --seq-len 8192 on the default model, where another seed's windows fell on them)."""
    from test_text import PositionTokenizer, _positions

    for seed in range(6):
        s = pipeline.Settings(method="search", seq_len=30_000, samples=3, holdout=1, target_agreement=0.9,
                              search_windows=2, seed=seed)
        w = pipeline._windows(s, PositionTokenizer(), None)
        taken = set().union(*_positions(w.stats))
        assert len(w.stats) == 4 and not any(p & taken for ws in w.search.values() for p in _positions(ws))


def test_the_report_marks_the_dp_row_chosen_only_when_the_plan_has_its_layers(tmp_path):
    """--method search moves the DP's anchors: its row was marked chosen beside layers the plan does not have."""
    from kascade import KascadePlan, ModelFingerprint

    plan = KascadePlan.uniform(ModelFingerprint("llama", 6, 4, 2, 8), 2)  # anchors 0, 3
    row = dict(anchors=2, objective=0.5, fraction=0.9)
    r = dict(plan=plan, out=tmp_path, pictures=[])
    assert "[0, 3] <- chosen\n" in pipeline.report({**r, "table": [{**row, "layers": [0, 3]}]})
    moved = pipeline.report({**r, "table": [{**row, "layers": [0, 2]}]})
    assert "[0, 2] <- chosen count (the plan's below)" in moved and "plan: anchors [0, 3]" in moved
