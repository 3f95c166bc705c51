"""Rule plans from calibration statistics: sources, per-layer budget factors, rule names, length-aware plans."""

import pytest
import torch

from kascade import KascadePlan, ModelFingerprint
from kascade.calibrate import rules
from kascade.calibrate.stats import CalibrationStats

FP = ModelFingerprint("llama", 6, 6, 2, 8)


def _stats(seed=0):
    g = torch.Generator().manual_seed(seed)
    return CalibrationStats(similarity=torch.rand(6, 6, 2, 2, generator=g), importance=torch.rand(6, generator=g) + .1,
                            windows=1, seq_len=512, k=16, tile=16)



def test_any_anchor_sources_take_the_best_pair_over_all_earlier_anchors():
    st = _stats()
    st.similarity[0, 5, 1, 0] = 5.0  # layer 5 head 1 matches layer 0 head 0 best, though anchor 3 is nearer
    src = rules.ranked_sources(st, (0, 3), 1)
    assert src[5][1] == ((0, 0),)
    assert src[3] == (((3, 0),), ((3, 1),)) and src[0] == (((0, 0),), ((0, 1),))
    two = rules.ranked_sources(st, (0, 3), 2)
    assert two[5][1][0] == (0, 0) and len(two[5][1]) == 2
    near = rules.ranked_sources(st, (0, 3), 1, nearest_only=True)
    assert all(p[0][0] == 3 for p in near[5])
    KascadePlan(FP, (0, 3), ((0, 1),) * 6).with_reuse(sources=two)  # valid for the plan



def test_layer_factors_favour_dissimilar_layers_and_keep_the_mean():
    st = _stats(1)
    plan = rules.plan_for_rule(FP, st, (0, 3), "faithful", budget=dict(k_min=8, tile=16))
    sc = rules.layer_factors(st, plan)
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
    for rule in rules.RULES:
        p = rules.plan_for_rule(FP, st, (0, 2, 4), rule)
        assert p.anchors == (0, 2, 4) and p.ranked == (rule != "faithful"), rule
    p = rules.plan_for_rule(FP, st, (0, 2, 4), "any-anchor+sinks+layer-budget")
    assert p.reuse.sources is not None and p.reuse.recent == rules.RECENT and p.reuse.factor is not None
    with pytest.raises(ValueError, match="unknown reuse rule"):
        rules.plan_for_rule(FP, st, (0, 2), "magic")
    with pytest.raises(ValueError, match="use one of them"):
        rules.plan_for_rule(FP, st, (0, 2), "any-anchor+union2")



def test_length_plan_has_one_sub_plan_per_shorter_length():
    p = rules.length_plan(FP, {1024: _stats(0), 4096: _stats(1), 2048: _stats(2)}, 3)
    assert [m for m, _ in p.by_length] == [1448, 2896]
    assert p.for_length(1000) is p.by_length[0][1] and p.for_length(3000) is p
    assert len(p.for_length(2000).anchors) == 3
