import dataclasses
import json

import pytest

from kascade import Budget, KascadePlan, ModelFingerprint
from kascade.plan import Reuse, default_plan, shipped_plans

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
    (dict(ratio=1.5), "ratio"), (dict(ratio=-0.1), "ratio"),
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
    d = KascadePlan.uniform(FP, 2).to_dict()
    d["anchors"] = [1, 4]  # well-typed, but not a plan: the plan's own check, named
    with pytest.raises(ValueError, match="malformed Kascade plan.*layer 0"):
        KascadePlan.from_dict(d)


def test_a_key_given_twice_in_plan_json_is_refused():
    text = KascadePlan.uniform(FP, 2).to_json()
    assert KascadePlan.from_json(text) == KascadePlan.uniform(FP, 2)
    with pytest.raises(ValueError, match="'ratio' is given twice"):
        KascadePlan.from_json('{"ratio": 0.5, ' + text.lstrip()[1:])


@pytest.mark.parametrize("tp", [0, -3, 1.5, True, "2"])
def test_a_tensor_parallel_size_that_is_not_a_count_is_refused_by_name(tp):
    with pytest.raises(ValueError, match="tensor-parallel size must be an integer >= 1"):
        KascadePlan.uniform(FP, 2).for_tensor_parallel(tp)


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


# -- reuse rules and the JSON formats ------------------------------------------------------------------------------
def _ranked():
    base = KascadePlan(FP, (0, 2, 5), (IDENT,) * 8, calibrated=True, source="base")
    src = [tuple(((a, h),) for h in range(3)) if a in (0, 2, 5) else None for a in range(8)]
    for l in (1, 3, 4, 6, 7):
        src[l] = (((0, 1),), ((0, 2), (0, 0)), (((2 if l > 2 else 0), 0),))
    short = base.with_reuse(sinks=4, recent=0.5)
    short = dataclasses.replace(short, anchors=(0, 3))
    return dataclasses.replace(base.with_reuse(sources=tuple(src), factor=(1.0, 1.2, 1, 0.8, 1, 1, 1.1, 0.9)),
                               by_length=((1024, short),))


def test_ranked_plan_json_round_trip(tmp_path):
    p = _ranked()
    d = p.to_dict()
    assert d["format"] == "kascade-plan/4" and d["by_length"][0]["max_n"] == 1024
    assert set(d["reuse"]) == {"factor", "sources"} and d["by_length"][0]["plan"]["reuse"] == {"sinks": 4, "recent": 0.5}
    p.save(tmp_path / "p.json")
    q = KascadePlan.load(tmp_path / "p.json")
    assert q == p and q.ranked and q.by_length[0][1].reuse.recent == 0.5 and q.reuse.sources[1][1] == ((0, 2), (0, 0))
    assert q.for_length(1024).anchors == (0, 3) and q.for_length(1025) is q
    assert q.rank_factor(0) == 1.2 and q.rank_factor(2) == 1.1 and q.rank_factor(5) == 1.0  # the layers drawing on each
    assert q.last_reader(0) == 7 and q.last_reader(2) == 7 and q.last_reader(5) == 5  # sources: any earlier anchor
    plain = KascadePlan.uniform(FP, 3)
    assert not plain.ranked and "reuse" not in plain.to_dict() and KascadePlan.from_dict(plain.to_dict()) == plain
    assert plain.anchors == (0, 2, 5) and plain.rank_factor(0) == 1.0
    assert [plain.last_reader(a) for a in plain.anchors] == [1, 4, 7]  # the layers before the next anchor
    assert p.with_budget(ratio=0.2).by_length[0][1].ratio == 0.2  # sub-plans follow budget changes


def _as_v2(d: dict) -> dict:
    """A plan dict written the way kascade-plan/2 files were: reuse fields at the top level, the budget multiplier
    named layer_scale."""
    d = dict(d, format="kascade-plan/2")
    r = d.pop("reuse", {})
    names = {"factor": "layer_scale"}
    d.update({names.get(k, k): v for k, v in r.items()})
    if "by_length" in d:
        d["by_length"] = [dict(e, plan=_as_v2(e["plan"])) for e in d["by_length"]]
    return d


def _as_v3(d: dict) -> dict:
    """A plan dict written the way kascade-plan/3 files were: the budget multiplier named scale."""
    d = dict(d, format="kascade-plan/3")
    if "reuse" in d:
        d["reuse"] = {("scale" if k == "factor" else k): v for k, v in d["reuse"].items()}
    if "by_length" in d:
        d["by_length"] = [dict(e, plan=_as_v3(e["plan"])) for e in d["by_length"]]
    return d


def test_older_formats_still_load():
    p = _ranked()
    assert KascadePlan.from_dict(_as_v2(p.to_dict())) == p
    v3 = _as_v3(p.to_dict())
    assert v3["reuse"]["scale"] == list(p.reuse.factor) and "factor" not in v3["reuse"]
    assert KascadePlan.from_dict(v3) == p
    with pytest.raises(ValueError, match=r"plan.reuse.scale\[7\] must be a number"):
        KascadePlan.from_dict(dict(v3, reuse=dict(v3["reuse"], scale=[1] * 7 + ["1"])))
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['scale'\]"):
        KascadePlan.from_dict(dict(p.to_dict(), reuse={"scale": list(p.reuse.factor)}))  # /4 names it factor
    v1 = dict(KascadePlan.uniform(FP, 3).to_dict(), format="kascade-plan/1")
    assert KascadePlan.from_dict(v1) == KascadePlan.uniform(FP, 3)
    bad = dict(v1, recent=0.5)
    with pytest.raises(ValueError, match="unknown field"):
        KascadePlan.from_dict(bad)  # kascade-plan/1 had no reuse fields


def test_shipped_plans_load():
    from kascade.plan import shipped_plans

    plain = shipped_plans("searched") + shipped_plans("faithful")  # anchors + head map
    assert plain and all(not p.ranked and p.calibrated for p in plain)
    ranked = shipped_plans()  # the default: per-layer budgets
    assert ranked and all(p.ranked and p.reuse.factor is not None and p.calibrated for p in ranked)


def test_every_reuse_layer_of_the_default_models_plan_follows_other_heads():
    """What getting started and benchmarks.common.plans say of a calibrated plan's head maps."""
    from kascade.plan import shipped_plans

    (plan,) = [p for p in shipped_plans() if p.fingerprint.num_layers == 30]  # SmolLM2-135M's
    reuse = [layer for layer in range(30) if not plan.is_anchor(layer)]
    assert len(reuse) == 24
    assert all(plan.head_map[layer] != tuple(range(plan.fingerprint.num_kv_heads)) for layer in reuse)


@pytest.mark.parametrize("changes,needle", [
    (dict(sources=((((0, 0),), ((0, 1),), ((0, 2),)),) * 8), "is an anchor"),
    (dict(factor=(1.0,) * 7), "one entry per layer"), (dict(factor=(1.0, 0, 1, 1, 1, 1, 1, 1)), "> 0"),
    (dict(factor=(0.5,) + (1.0,) * 7), "layer 0 is dense"),
    (dict(recent=1.5), "recent"), (dict(sinks=4, recent=0.0), "sinks > 0 needs recent"),
], ids=lambda x: str(x)[:40])
def test_bad_reuse_fields_are_refused(changes, needle):
    with pytest.raises(ValueError, match=needle):
        KascadePlan.uniform(FP, 3).with_reuse(**changes)


@pytest.mark.parametrize("changes,needle", [
    (dict(by_length=((0, KascadePlan.uniform(FP, 2)),)), "positive and increasing"),
    (dict(by_length=((100, KascadePlan.uniform(FP, 2, ratio=0.2)),)), "one budget per plan"),
], ids=lambda x: str(x)[:40])
def test_bad_sub_plans_are_refused(changes, needle):
    with pytest.raises(ValueError, match=needle):
        dataclasses.replace(KascadePlan.uniform(FP, 3), **changes)


def test_bad_sources_are_refused():
    base = _ranked()
    src = list(base.reuse.sources)
    src[1] = (((2, 0),), ((0, 1),), ((0, 2),))  # layer 1 cannot draw on anchor 2, which comes after it
    with pytest.raises(ValueError, match="not an anchor at or below layer 1"):
        base.with_reuse(sources=tuple(src))
    src[1] = (((0, 0), (0, 0)),) * 3
    with pytest.raises(ValueError, match="distinct"):
        base.with_reuse(sources=tuple(src))
    src[1] = (((0, 3),),) * 3
    with pytest.raises(ValueError, match="outside"):
        base.with_reuse(sources=tuple(src))


# -- strict parsing: a file that says something else is refused, naming the field --------------------------------
@pytest.mark.parametrize("edit,needle", [
    (lambda d: d.update(anchors=[0, 2.9]), r"plan.anchors\[1\] must be an integer, got 2.9"),
    (lambda d: d.update(anchors="02"), r"plan.anchors must be a list, got '02'"),
    (lambda d: d.update(anchors=[0, True]), r"plan.anchors\[1\] must be an integer, got True"),
    (lambda d: d.update(rolling="false"), r"plan.rolling must be true or false, got 'false'"),
    (lambda d: d.update(calibrated="no"), r"plan.calibrated must be true or false, got 'no'"),
    (lambda d: d.update(k_min=128.0), r"plan.k_min must be an integer, got 128.0"),
    (lambda d: d.update(tile="32"), r"plan.tile must be an integer, got '32'"),
    (lambda d: d.update(ratio="0.1"), r"plan.ratio must be a number, got '0.1'"),
    (lambda d: d["head_map"].__setitem__(1, [0, 1, "2"]), r"plan.head_map\[1\]\[2\] must be an integer"),
    (lambda d: d["fingerprint"].update(num_layers=8.0), r"plan.fingerprint.num_layers must be an integer"),
    (lambda d: d.update(reuse={"factor": [1] * 7 + ["1"]}), r"plan.reuse.factor\[7\] must be a number"),
    (lambda d: d.update(reuse={"sinks": 4.0, "recent": 0.5}), r"plan.reuse.sinks must be an integer"),
    (lambda d: d.update(reuse={"surprise": 1}), r"plan.reuse has unknown field"),
    (lambda d: d.update(surprise=1), r"plan has unknown field\(s\) \['surprise'\]"),
    (lambda d: d.pop("anchors"), r"plan lacks field\(s\) \['anchors'\]"),
    (lambda d: d.update(format="kascade-plan/9"), r"not a Kascade plan"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_plan_files_are_parsed_strictly(edit, needle):
    d = KascadePlan.uniform(FP, 3).to_dict()
    edit(d)
    with pytest.raises(ValueError, match=needle):
        KascadePlan.from_dict(d)


@pytest.mark.parametrize("text,needle", [("5", "must be a JSON object, got int"), ("[1, 2]", "got list"),
                                         ("{", "invalid JSON"), ('"plan"', "got str")])
def test_plan_files_that_are_not_objects_are_refused(tmp_path, text, needle):
    (tmp_path / "p.json").write_text(text)
    with pytest.raises(ValueError, match=needle):
        KascadePlan.load(tmp_path / "p.json")
    with pytest.raises(ValueError, match="is a folder"):
        KascadePlan.load(tmp_path)


def test_plans_built_in_code_are_strict_too():
    with pytest.raises(TypeError, match="anchors must hold integers, got 2.9"):
        KascadePlan(FP, (0, 2.9), (IDENT,) * 8)
    with pytest.raises(TypeError, match="rolling must be true or false"):
        KascadePlan(FP, (0, 2), (IDENT,) * 8, rolling="false")
    with pytest.raises(ValueError, match="k_min must be an integer"):
        Budget(k_min=True)


# -- tensor parallelism: shard-local plans --------------------------------------------------------------------------
FP4 = ModelFingerprint("llama", 4, 8, 4, 16)  # 4 KV heads: shards {0, 1} and {2, 3} at tensor_parallel=2


def _plan_with_sources(sources_of_layer):
    """Anchors 0 and 2; layers 1 and 3 reuse through ``sources`` (one row of per-head pairs per reuse layer)."""
    ident = tuple(range(4))
    rows = tuple(tuple(((l, h),) for h in ident) if l in (0, 2) else sources_of_layer[l] for l in range(4))
    return KascadePlan(FP4, (0, 2), (ident,) * 4, calibrated=True).with_reuse(sources=rows)


def test_a_plan_whose_sources_cross_ranks_is_made_shard_local():
    """Reuse sources (any-anchor / union2 plans) that cross shards are moved into the reuse head's shard: before the
    fix, for_tensor_parallel raised "the plan says it is shard-local" on every such plan."""
    crossing = {
        1: (((0, 2),), ((0, 1),), ((0, 0), (0, 3)), ((0, 3),)),  # head 0 crosses; head 2's union crosses once
        3: (((2, 1), (0, 3)), ((2, 0),), ((2, 2),), ((0, 1),)),  # head 0 crosses once (layer 0); head 3 crosses
    }
    plan = _plan_with_sources(crossing)
    assert plan.crossing_links(2) == [(1, 0, 0, 2), (1, 2, 0, 0), (3, 0, 0, 3), (3, 3, 0, 1)]
    local = plan.for_tensor_parallel(2)  # no statistics: a crossing source moves to the reuse head's own index
    assert local.tensor_parallel == 2 and local.crossing_links(2) == []
    assert local.reuse.sources[1] == (((0, 0),), ((0, 1),), ((0, 2), (0, 3)), ((0, 3),))
    assert local.reuse.sources[3] == (((2, 1), (0, 0)), ((2, 0),), ((2, 2),), ((0, 3),))
    assert KascadePlan.from_dict(local.to_dict()) == local


def test_a_union_whose_moved_source_meets_the_other_collapses_to_one():
    plan = _plan_with_sources({1: (((0, 0),), ((0, 1),), ((0, 2), (0, 0)), ((0, 3),)),
                               3: tuple(((2, h),) for h in range(4))})
    assert plan.for_tensor_parallel(2).reuse.sources[1][2] == ((0, 2),)  # (0, 0) moved onto (0, 2)


def test_shard_local_links_follow_the_similarity_read_as_a_b_hb_ha():
    """``similarity[a, b, hb, ha]``: how well anchor ``a``'s head ``ha`` serves layer ``b``'s head ``hb`` (``a < b``).
    The entries below differ under every swap of two axes, so a reading with swapped axes picks other heads."""
    import torch

    ident = tuple(range(4))
    flip = (2, 3, 0, 1)  # every reuse head follows the other shard: all links cross at tensor_parallel=2
    plan = KascadePlan(FP4, (0, 2), (ident, flip, ident, flip), calibrated=True)
    sim = torch.zeros(4, 4, 4, 4)
    sim[0, 1, 0, 1] = 0.9  # layer 1, head 0: anchor 0's head 1 (its shard: 0, 1) serves it best
    sim[0, 1, 0, 0] = 0.2
    sim[0, 1, 1, 0] = 0.8  # head 1: head 0 of anchor 0
    sim[0, 1, 2, 2] = 0.7  # head 2: itself
    sim[0, 1, 3, 2] = 0.6  # head 3: head 2
    sim[2, 3, 0, 0] = 0.5  # layer 3 (anchor 2): head 0 -> 0, head 1 -> 0, head 2 -> 3, head 3 -> 3
    sim[2, 3, 1, 0] = 0.5
    sim[2, 3, 2, 3] = 0.5
    sim[2, 3, 3, 3] = 0.5
    sim[1, 0] = sim[3, 2] = 1.0 - torch.eye(4)  # the undefined a > b half: read, it would pick other heads
    local = plan.for_tensor_parallel(2, sim)
    assert local.head_map[1] == (1, 0, 2, 2)
    assert local.head_map[3] == (0, 0, 3, 3)


def test_a_plan_is_given_as_a_plan_a_shipped_name_or_a_file(tmp_path, monkeypatch):
    from kascade.plan import SHIPPED_VARIANTS, resolve_plan, shipped_plan

    smol = ModelFingerprint("llama", 30, 9, 3, 64)  # the default model: its plans ship with the package
    assert resolve_plan(None, smol) == default_plan(smol) and default_plan(smol).calibrated
    assert resolve_plan(None, FP) == KascadePlan.uniform(FP, 6)  # nothing shipped for this shape
    for name in SHIPPED_VARIANTS:
        assert resolve_plan(name, smol) == shipped_plan(smol, name)
    assert resolve_plan("searched", smol) != resolve_plan("faithful", smol)
    plan = KascadePlan.uniform(FP, 3)
    assert resolve_plan(plan, smol) is plan  # not checked against the model here (enable does)
    (tmp_path / "cal").mkdir()
    plan.save(tmp_path / "cal" / "plan.json")
    monkeypatch.chdir(tmp_path)
    for given in ("cal/plan.json", tmp_path / "cal" / "plan.json", str(tmp_path / "cal" / "plan.json")):
        assert resolve_plan(given, FP) == plan
    with pytest.raises(ValueError, match="no plan file at other.json"):
        resolve_plan("other.json", FP)
    with pytest.raises(ValueError, match=r"'fastest' is neither a shipped plan \(default, searched-budgets, searched, .*\) nor a plan "
                                         "file"):
        resolve_plan("fastest", FP)
    with pytest.raises(ValueError, match="no shipped 'searched' plan for this model"):
        resolve_plan("searched", FP)
    with pytest.raises(TypeError, match="got int"):
        resolve_plan(3, FP)


def test_a_plan_file_that_is_not_utf8_is_named(tmp_path):
    bad = tmp_path / "plan.json"
    bad.write_bytes(b'\xff\xfe{"format": "kascade-plan/3"}')
    with pytest.raises(ValueError, match=f"the plan file {bad} is not UTF-8 text"):  # was a bare UnicodeDecodeError
        KascadePlan.load(bad)


def test_the_papers_one_call_form_is_a_plan():
    """``kascade_attention(q, k, v, topk=64, anchors=[2, 6, 10])``: a fixed top-k (ratio 0: always k_min keys)."""
    p = KascadePlan.from_anchors(FP, anchors=[2, 6], topk=64)
    assert p.anchors == (0, 2, 6) and p.head_map == (IDENT,) * 8 and not p.calibrated
    assert p.budget == Budget(ratio=0.0, k_min=64) and [p.budget.k(n) for n in (10, 64, 1000, 10**6)] == [10, 64, 64, 64]
    assert KascadePlan.from_json(p.to_json()) == p
    q = KascadePlan.from_anchors(FP, anchors=(0, 4), ratio=0.2, tile=16)
    assert q.budget == Budget(ratio=0.2, k_min=128, tile=16) and q.anchors == (0, 4)
    for kw, needle in ((dict(), "give one of topk"), (dict(topk=8, ratio=0.1), "give one of topk"),
                       (dict(topk=0), "topk must be"), (dict(topk=8, k_min=4), "give one of them")):
        with pytest.raises(ValueError, match=needle):
            KascadePlan.from_anchors(FP, anchors=[2], **kw)
    with pytest.raises(ValueError, match="out of range"):
        KascadePlan.from_anchors(FP, anchors=[8], topk=8)


def test_a_plan_round_trips_through_the_written_format(tmp_path):
    for p in (_ranked(), KascadePlan.uniform(FP, 3), _ranked().for_tensor_parallel(3)):
        d = json.loads(json.dumps(p.to_dict()))
        assert d["format"] == "kascade-plan/4" and KascadePlan.from_dict(d) == p
    p = _ranked()
    assert p.to_dict()["reuse"]["factor"] == [1.0, 1.2, 1.0, 0.8, 1.0, 1.0, 1.1, 0.9]
    p.save(tmp_path / "p.json")
    assert KascadePlan.load(tmp_path / "p.json") == p


def test_the_shipped_plans_load_as_before():
    """The shipped files keep their format (/2, /3): each loads to the plan its /4 form loads to."""
    for p in shipped_plans():
        assert KascadePlan.from_dict(p.to_dict()) == p


@pytest.mark.parametrize("use,new", [
    (lambda: Reuse(scale=(1.0,) * 8), "factor"),
    (lambda: _ranked().with_reuse(scale=(1.0,) * 8), "factor"),
    (lambda: _ranked().reuse.scale, "factor"),
    (lambda: _ranked().scale(1), "layer_factor"),
    (lambda: _ranked().depth(0), "rank_factor"),
], ids=["Reuse", "with_reuse", "Reuse.scale", "plan.scale", "plan.depth"])
def test_the_budget_multiplier_by_its_former_names_is_a_type_error_naming_the_current(use, new):
    with pytest.raises(TypeError, match=f"'{new}', not '(scale|depth)'"):
        use()
    assert not hasattr(_ranked(), "scale") and not hasattr(Reuse(), "scale")  # absent, for getattr(x, name, default)


def test_score_dtype_is_a_budget_field_written_only_when_set(tmp_path):
    p = KascadePlan.uniform(FP, 3)
    assert p.score_dtype is None and "score_dtype" not in p.to_dict()
    fp8 = p.with_budget(score_dtype="fp8")
    assert fp8.budget == Budget(ratio=p.ratio, k_min=p.k_min, tile=p.tile, rolling=p.rolling, score_dtype="fp8")
    d = json.loads(json.dumps(fp8.to_dict()))
    assert d["format"] == "kascade-plan/4" and d["score_dtype"] == "fp8"
    assert KascadePlan.from_dict(d) == fp8
    fp8.save(tmp_path / "p.json")
    assert KascadePlan.load(tmp_path / "p.json").budget.score_dtype == "fp8"
    assert fp8.with_budget(score_dtype=None) == p
    # sub-plans of a length-aware plan follow the budget change
    aware = dataclasses.replace(p, by_length=((64, KascadePlan.uniform(FP, 2)),)).with_budget(score_dtype="fp8")
    assert aware.by_length[0][1].score_dtype == "fp8"
    assert KascadePlan.from_dict(json.loads(json.dumps(aware.to_dict()))) == aware
    # an older format without the field loads exact; a bad value is refused naming the field
    old = dict(p.to_dict(), format="kascade-plan/3")
    assert KascadePlan.from_dict(old).score_dtype is None
    for bad in ("bf16", 8):
        with pytest.raises(ValueError, match="score_dtype"):
            KascadePlan.from_dict(dict(d, score_dtype=bad))
    with pytest.raises(ValueError, match="score_dtype"):
        KascadePlan.uniform(FP, 3).with_budget(score_dtype="e4m3")


def test_dense_tail_is_a_budget_field_written_only_when_set(tmp_path):
    p = KascadePlan.uniform(FP, 3)
    assert p.dense_tail == 0 and "dense_tail" not in p.to_dict()
    tail = p.with_budget(dense_tail=32)
    assert tail.budget.dense_tail == 32
    d = json.loads(json.dumps(tail.to_dict()))
    assert d["format"] == "kascade-plan/4" and d["dense_tail"] == 32
    assert KascadePlan.from_dict(d) == tail
    tail.save(tmp_path / "p.json")
    assert KascadePlan.load(tmp_path / "p.json").dense_tail == 32
    assert tail.with_budget(dense_tail=0) == p
    for bad in (-1, 2.5, True, "32"):
        with pytest.raises(ValueError, match="dense_tail"):
            p.with_budget(dense_tail=bad)
    with pytest.raises(ValueError, match="dense_tail"):
        KascadePlan.from_dict(dict(d, dense_tail=-3))
