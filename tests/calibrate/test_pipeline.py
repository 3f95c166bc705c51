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
    assert len(plan.anchors) == 3 and plan.reuse.scale is not None and plan.reuse.sources is None and plan.k_min == 40
    assert set(plan.reuse.scale) <= set(MEASURED_GRID) and abs(sum(plan.reuse.scale[1:]) - 5) < 1e-9
    assert len(set(plan.reuse.scale[1:])) > 1, plan.reuse.scale  # the layers' measured sensitivities differ
    assert "measured budgets" in plan.source
    with pytest.raises(ValueError, match="needs development windows"):
        pipeline.plan_from_method("measured", model, {160: st}, 3)


def test_settings_refuse_what_cannot_run():
    with pytest.raises(ValueError, match="--seq-len 40 is too short: at least 65"):
        pipeline.Settings(seq_len=40)
    with pytest.raises(ValueError, match="unknown method 'magic'"):
        pipeline.Settings(method="magic")
    with pytest.raises(ValueError, match="unknown method 'sinks\\+magic'"):
        pipeline.Settings(method="length", rule="sinks+magic")
    s = pipeline.Settings(method="any-anchor+sinks", lengths=[300, 200], rolling=False)
    assert s.lengths == (300, 200) and s.budget == dict(ratio=0.10, k_min=128, tile=32, rolling=False)
    assert s.holdout_windows == 0 and pipeline.Settings(target_agreement=0.9).holdout_windows == 2
