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


# -- kascade-plan/2: issue 8's variant fields ---------------------------------------------------------------------
def _v2():
    base = KascadePlan(FP, (0, 2, 5), (IDENT,) * 8, calibrated=True, source="base")
    src = [tuple(((a, h),) for h in range(3)) if a in (0, 2, 5) else None for a in range(8)]
    for l in (1, 3, 4, 6, 7):
        src[l] = (((0, 1),), ((0, 2), (0, 0)), (((2 if l > 2 else 0), 0),))
    short = dataclasses.replace(base, anchors=(0, 3), sinks=4, recent=0.5)
    return dataclasses.replace(base, sources=tuple(src), layer_scale=(1.0, 1.2, 1, 0.8, 1, 1, 1.1, 0.9),
                               by_length=((1024, short),))


def test_v2_json_round_trip_and_v1_stays_v1(tmp_path):
    p = _v2()
    d = p.to_dict()
    assert d["format"] == "kascade-plan/2" and d["by_length"][0]["max_n"] == 1024
    p.save(tmp_path / "p.json")
    q = KascadePlan.load(tmp_path / "p.json")
    assert q == p and q.ranked and q.by_length[0][1].recent == 0.5 and q.sources[1][1] == ((0, 2), (0, 0))
    assert q.for_length(1024).anchors == (0, 3) and q.for_length(1025) is q
    assert q.rank_depth(0) == 1.2 and q.rank_depth(2) == 1.1 and q.rank_depth(5) == 1.0  # layers drawing on each
    v1 = KascadePlan.uniform(FP, 3)
    assert v1.to_dict()["format"] == "kascade-plan/1" and not v1.ranked
    assert set(v1.to_dict()) == {"format", "fingerprint", "anchors", "head_map", "ratio", "k_min", "tile", "rolling",
                                 "calibrated", "source"}  # an old reader still reads it
    assert KascadePlan.from_dict(v1.to_dict()) == v1
    assert p.with_budget(ratio=0.2).by_length[0][1].ratio == 0.2  # sub-plans follow budget changes


def test_shipped_plans_load_in_both_formats():
    from kascade.plan import shipped_plans

    v1 = shipped_plans("searched") + shipped_plans("faithful")  # kascade-plan/1 files: anchors + head map
    assert v1 and all(not p.ranked and p.calibrated for p in v1)
    v2 = shipped_plans()  # the default: kascade-plan/2 with per-layer budgets
    assert v2 and all(p.ranked and p.layer_scale is not None and p.calibrated for p in v2)


@pytest.mark.parametrize("changes,needle", [
    (dict(sources=((((0, 0),), ((0, 1),), ((0, 2),)),) * 8), "is an anchor"),
    (dict(layer_scale=(1.0,) * 7), "one entry per layer"), (dict(layer_scale=(1.0, 0, 1, 1, 1, 1, 1, 1)), "> 0"),
    (dict(layer_scale=(0.5,) + (1.0,) * 7), "layer 0 is dense"),
    (dict(recent=1.5), "recent"), (dict(sinks=4, recent=0.0), "sinks > 0 needs recent"),
    (dict(by_length=((0, KascadePlan.uniform(FP, 2)),)), "positive and increasing"),
    (dict(by_length=((100, KascadePlan.uniform(FP, 2, ratio=0.2)),)), "one budget per plan"),
], ids=lambda x: str(x)[:40])
def test_bad_v2_fields_are_refused(changes, needle):
    with pytest.raises(ValueError, match=needle):
        dataclasses.replace(KascadePlan.uniform(FP, 3), **changes)


def test_bad_sources_are_refused():
    base = _v2()
    src = list(base.sources)
    src[1] = (((2, 0),), ((0, 1),), ((0, 2),))  # layer 1 cannot draw on anchor 2, which comes after it
    with pytest.raises(ValueError, match="not an anchor at or below layer 1"):
        dataclasses.replace(base, sources=tuple(src))
    src[1] = (((0, 0), (0, 0)),) * 3
    with pytest.raises(ValueError, match="distinct"):
        dataclasses.replace(base, sources=tuple(src))
    src[1] = (((0, 3),),) * 3
    with pytest.raises(ValueError, match="outside"):
        dataclasses.replace(base, sources=tuple(src))
    d = KascadePlan.uniform(FP, 3).to_dict()
    d["recent"] = 0.5
    with pytest.raises(ValueError, match="kascade-plan/1 has no fields"):
        KascadePlan.from_dict(d)
