import dataclasses

import pytest

from kascade import Budget, KascadePlan, ModelFingerprint
from kascade.plan import default_plan

FP = ModelFingerprint("llama", 8, 6, 3, 16)
IDENT = (0, 1, 2)


def test_uniform_plan_is_labelled_and_spaced():
    p = KascadePlan.uniform(FP, num_anchors=4)
    assert p.anchors == (0, 2, 4, 6) and not p.calibrated and "uncalibrated" in p.source
    assert p.anchor_of(5) == 4 and p.anchor_of(0) == 0 and p.is_anchor(6) and not p.is_anchor(7)
    assert KascadePlan.uniform(ModelFingerprint("llama", 30, 9, 3, 64), 6).anchors == (0, 5, 10, 15, 20, 25)


def test_json_round_trip(tmp_path):
    hm = [IDENT] * 8
    hm[3] = (2, 2, 0)
    p = KascadePlan(FP, (0, 2, 5), tuple(hm), ratio=0.2, k_min=64, tile=16, rolling=False, calibrated=True,
                    source="test")
    p.save(tmp_path / "p.json")
    q = KascadePlan.load(tmp_path / "p.json")
    assert q == p and q.fingerprint == FP and q.head_map[3] == (2, 2, 0)
    assert q.budget == Budget(ratio=0.2, k_min=64, tile=16, rolling=False)


@pytest.mark.parametrize("changes,needle", [
    (dict(ratio=0.0), "ratio"), (dict(ratio=1.5), "ratio"), (dict(ratio=-0.1), "ratio"),
    (dict(tile=0), "tile"), (dict(k_min=0), "k_min"),
    (dict(anchors=(1, 4)), "layer 0"), (dict(anchors=(0, 8)), "out of range"), (dict(anchors=(0, 4, 2)), "increasing"),
    (dict(head_map=(IDENT,) * 7), "one row per layer"), (dict(head_map=((0, 1),) * 8), "3 entries"),
    (dict(head_map=((0, 1, 3),) * 8), "outside"), (dict(head_map=((0, 1, -1),) * 8), "outside"),
    (dict(head_map=((0, 0, 1),) + (IDENT,) * 7), "identity"),
], ids=lambda x: str(x)[:40])
def test_bad_plans_are_refused(changes, needle):
    base = KascadePlan.uniform(FP, 3)
    with pytest.raises(ValueError, match=needle):
        dataclasses.replace(base, **changes)


def test_bad_json_is_refused():
    with pytest.raises(ValueError, match="not a Kascade plan"):
        KascadePlan.from_json('{"anchors": [0]}')
    d = KascadePlan.uniform(FP, 2).to_dict()
    d["surprise"] = 1
    with pytest.raises(ValueError, match="malformed"):
        KascadePlan.from_dict(d)


def test_fingerprint_mismatch_names_the_field():
    from conftest import tiny_model

    model = tiny_model("llama")
    fp = ModelFingerprint.from_model(model)
    assert fp == ModelFingerprint("llama", 4, 6, 2, 8)
    with pytest.raises(ValueError, match="num_layers: plan has 5, model has 4"):
        KascadePlan.uniform(dataclasses.replace(fp, num_layers=5), 2).check_model(model)
    with pytest.raises(ValueError, match="num_kv_heads"):
        KascadePlan.uniform(ModelFingerprint("llama", 4, 6, 3, 8), 2).check_model(model)
    assert default_plan(model).fingerprint == fp
