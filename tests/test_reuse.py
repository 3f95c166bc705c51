"""Reuse rules (kascade.reuse): the sets they build, and whole-model behaviour on tiny random models."""

import dataclasses

import pytest
import torch

import kascade
from conftest import tiny_model
from kascade import Budget, KascadePlan, ModelFingerprint
from kascade.ops import plan_step, reference
from kascade.reuse import layer_keys, layer_selection, merge_ranked

HM = ((0, 1, 2), (2, 0, 0), (0, 1, 2), (1, 1, 2))
# Union of two sources for the reuse layers of a (0, 2)-anchor plan: layer 1 draws on two heads of layer 0,
# layer 3 on a head of layer 0 and one of layer 2.
UNION = (((0, 0),), ((0, 1),), ((0, 2),)), (((0, 2), (0, 0)),) * 3, (((2, 0),), ((2, 1),), ((2, 2),)), \
    (((0, 1), (2, 2)),) * 3


def _ids(n, seed=0):
    return torch.randint(3, 97, (1, n), generator=torch.Generator().manual_seed(seed))


def _model():
    return tiny_model("llama", num_key_value_heads=3)


def _run(model, plan, ids):
    with torch.no_grad(), kascade.enable(model, plan, account=True, warn_uncalibrated=False) as h:
        out = model(ids).logits
    return out, h.runtime.attended


def _base(model, **budget):
    b = dict(ratio=0.1, k_min=8, tile=16, **budget)
    return KascadePlan(ModelFingerprint.from_model(model), (0, 2), HM, **b)


def test_layer_keys_hands_a_reuse_layers_head_map_over_unapplied():
    """The head-map rule's layer keys: the anchor's own selection (no copy) and the map, which layer_selection
    applies; an anchor's keys need no map."""
    plan = _base(_model())
    torch.manual_seed(1)
    q, k = torch.randn(1, 6, 1, 16), torch.randn(1, 3, 90, 16)
    step = plan_step(q, k, budget=plan.budget)
    sels = {0: reference.select(q, k, budget=plan.budget, scale=0.25, kv_start=torch.zeros(1, dtype=torch.long),
                                q_offset=89)}
    sel, hm = layer_keys(plan, 1, sels, step)
    assert sel is sels[0] and hm.tolist() == list(HM[1])
    assert torch.equal(layer_selection(plan, 1, sels, step).indices, sel.take_heads(hm).indices)
    assert layer_keys(plan, 0, sels, step) == (sels[0], None)


def test_merge_ranked_dedups_by_best_priority_and_pads():
    cands = torch.tensor([[5, 3, 9, 3, -1, 7, 5]])
    prio = torch.tensor([[4, 1, 2, 0, 0, 3, 5]])
    got = merge_ranked(cands, prio, torch.tensor([3]))
    assert got.tolist() == [[3, 7, 9]]  # 3 (prio 0), 9 (2), 7 (3); 5 (4) left out
    got = merge_ranked(cands, prio, torch.tensor([6]))
    assert got.tolist() == [[3, 5, 7, 9, -1, -1]]  # only 4 distinct keys exist


def test_ranked_select_prefix_equals_select_and_ranking_is_deeper():
    torch.manual_seed(0)
    q, k = torch.randn(2, 6, 200, 8), torch.randn(2, 3, 200, 8)
    kv_start = torch.tensor([0, 37])
    budget = Budget(ratio=0.1, k_min=8, tile=16)
    kw = dict(budget=budget, scale=8**-0.5, kv_start=kv_start, q_offset=0)
    ref = reference.select(q, k, **kw)
    r = reference.select(q, k, rank_factor=2.0, **kw)
    assert r.ranked and torch.equal(r.row_start, ref.row_start)
    assert r.indices.shape[-1] > ref.indices.shape[-1]
    # the ranking is in descending pooled probability: its prefix of each row's budget is the top-k set
    step = plan_step(q, k, budget=budget, kv_start=kv_start, q_offset=0)
    counts, most = step.counts(1.0)
    own = r.prefix(counts, most).as_set()
    assert torch.equal(own.indices, ref.indices)
    for b in range(2):
        for row in range(r.indices.shape[2]):
            c = int(counts[b, row])
            assert sorted(r.indices[b, 1, row, :c].tolist()) == [x for x in ref.indices[b, 1, row].tolist() if x >= 0]
            assert (r.indices[b, 1, row, c:] >= 0).sum() == (budget.row_counts(step.n, step.tiles()[0], step.rows, 2.0)[b, row] - c)


def test_union_and_sink_sets_are_sorted_distinct_padded_and_on_budget():
    torch.manual_seed(1)
    model = _model()
    fp = ModelFingerprint.from_model(model)
    q, k = torch.randn(1, 6, 300, 8), torch.randn(1, 3, 300, 8)
    budget = Budget(ratio=0.1, k_min=8, tile=16)
    kw = dict(budget=budget, scale=8**-0.5, kv_start=torch.tensor([0]), q_offset=0)
    sels = {0: reference.select(q, k, rank_factor=1.0, **kw), 2: reference.select(q * 0.5 + 1, k, rank_factor=1.0, **kw)}
    plan = KascadePlan(fp, (0, 2), HM, ratio=0.1, k_min=8, tile=16).with_reuse(sources=UNION, sinks=4, recent=0.5)
    step = plan_step(q, k, budget=budget)
    sel = layer_selection(plan, 3, sels, step)
    counts = step.counts(1.0)[0][0].tolist()
    assert min(counts) == 0 and max(counts) > 8  # the first tile keeps nothing, the last ones more than the sinks
    for h in range(3):
        for r, c in enumerate(counts):
            row = sel.indices[0, h, r].tolist()
            keys = [x for x in row if x >= 0]
            assert row == keys + [-1] * (len(row) - len(keys))  # -1 padding at the end
            assert keys == sorted(set(keys)) and len(keys) == c  # ascending, distinct, exactly the budget
            s = (int(sel.row_start[0]) + r) * 16
            assert all(0 <= x < s for x in keys)  # strictly before the tile
            if c >= 8:  # floor(0.5 c) >= 4: the 4 sinks and the most recent keys are in
                nf = c // 2
                assert keys[:4] == [0, 1, 2, 3] and set(range(s - (nf - 4), s)) <= set(keys)


def test_faithful_fields_in_ranked_form_reproduce_faithful_logits_exactly():
    """sources equal to the head map and factors of 1 take the ranked path but must pick the same keys."""
    model = _model()
    ids = _ids(300)
    base = _base(model)
    src = tuple(tuple(((base.anchor_of(l), h),) for h in base.head_map[l]) for l in range(4))
    ranked = base.with_reuse(sources=src, factor=(1.0,) * 4)
    assert ranked.ranked and not base.ranked
    a, acc_a = _run(model, base, ids)
    b, acc_b = _run(model, ranked, ids)
    assert torch.equal(a, b) and acc_a == acc_b


@pytest.mark.parametrize("fields", [
    dict(sources=UNION),
    dict(sinks=4, recent=0.5),
    dict(factor=(1.0, 1.0, 1.5, 2.0)),  # factors >= 1: at full budget every row is still capped at dense
], ids=["union2", "sinks", "layer-budget"])
def test_variants_at_full_budget_equal_dense(fields):
    model = _model()
    ids = _ids(128)
    plan = _base(model).with_budget(ratio=1.0, k_min=1).with_reuse(**fields)
    with torch.no_grad():
        dense = model(ids).logits
    got, acc = _run(model, plan, ids)
    torch.testing.assert_close(got, dense, rtol=1e-5, atol=1e-5)
    assert all(a == d for a, d in acc.values())


def test_union_and_sinks_attend_exactly_the_faithful_budget():
    model = _model()
    ids = _ids(400)
    base = _base(model)
    _, faithful = _run(model, base, ids)
    src = UNION
    for fields in (dict(sources=src), dict(sinks=4, recent=0.5), dict(sources=src, sinks=4, recent=0.5)):
        out, acc = _run(model, base.with_reuse(**fields), ids)
        assert acc == faithful, fields  # the same keys per row, counted from the selections
        assert not torch.allclose(out, _run(model, base, ids)[0])  # a different set, not the faithful one


def test_layer_budget_moves_keys_between_layers_and_keeps_the_average():
    model = _model()
    ids = _ids(400)
    base = _base(model)
    _, faithful = _run(model, base, ids)
    _, acc = _run(model, base.with_reuse(factor=(1.0, 1.5, 1.0, 0.5)), ids)
    assert acc[1][0] > faithful[1][0] and acc[3][0] < faithful[3][0] and acc[2] == faithful[2]
    tot = sum(a for a, _ in acc.values())
    ref = sum(a for a, _ in faithful.values())
    # the average is kept up to rounding and the cap at a row's candidates (which only lowers it): within 2%
    assert 0.98 * ref <= tot <= ref * 1.001


def test_decode_with_a_ranked_plan_matches_generation_shapes_and_differs_from_faithful(forwards):
    model = _model()
    base = _base(model)
    ids = _ids(200)
    plan = base.with_reuse(sinks=4, recent=0.5, factor=(1.0, 1.3, 1.0, 0.7))
    with torch.no_grad(), kascade.enable(model, plan, warn_uncalibrated=False, account=True):
        out = model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert out.shape == (1, 205) and len(forwards) == 5  # the prefill and 4 decode steps
    last = forwards[-1]
    assert last.step.decode and sorted(last.selections) == [2]  # the last forward: a decode step, ranked
    assert last.selections[2].ranked and last.selections[2].decode


def test_length_aware_plan_switches_sub_plan_from_n(forwards):
    model = _model()
    fp = ModelFingerprint.from_model(model)
    short = KascadePlan(fp, (0, 1), ((0, 1, 2),) * 4, ratio=0.1, k_min=8, tile=16)
    long = _base(model)
    plan = dataclasses.replace(long, by_length=((256, short),))
    assert plan.for_length(256) is short and plan.for_length(257) is plan and plan.for_length(10) is short
    for n, sub in ((200, short), (300, plan)):
        with torch.no_grad(), kascade.enable(model, plan, warn_uncalibrated=False):
            model(_ids(n))
        assert forwards[-1].plan is sub
    a, _ = _run(model, plan, _ids(200))
    b, _ = _run(model, short, _ids(200))
    assert torch.equal(a, b)


def test_ranked_plan_refuses_a_custom_selector():
    model = _model()
    plan = _base(model).with_reuse(sinks=4, recent=0.5)
    with pytest.raises(ValueError, match="ranked reuse rule"):
        kascade.enable(model, plan, selector=kascade.ops.select, warn_uncalibrated=False)


def test_enable_uses_a_shipped_variant_plan(monkeypatch):
    """Making a variant the default is shipping its plan: enable(model) with no plan runs whatever it holds."""
    import kascade.plan.shipped as shipped_mod

    model = _model()
    shipped = dataclasses.replace(_base(model).with_reuse(sinks=4, recent=0.5), calibrated=True)
    monkeypatch.setattr(shipped_mod, "shipped_plans", lambda: [KascadePlan.from_json(shipped.to_json())])
    ids = _ids(300)
    with torch.no_grad(), kascade.enable(model) as h:
        got = model(ids).logits
    assert h.runtime.plan == shipped and h.runtime.plan.ranked
    ref, _ = _run(model, shipped, ids)
    assert torch.equal(got, ref)


# -- sources and sinks + recent, hand-computed ---------------------------------------------------------------------
# One decode query over 40 keys at ratio 0.1, k_min 6: a faithful row keeps k(40) = max(6, 4) = 6 keys; a layer at
# factor 0.5 keeps round(0.5 * 6) = 3. Anchor 0 ranks its keys (most probable first):
RANK_A = [30, 5, 17, 2, 33, 8, 11, 25, 1, 39]  # head 0
RANK_B = [7, 30, 21, 3, 9, 12, 14, 0, 36, 22]  # head 1


def _hand_case(factor, **reuse):
    from kascade.ops import Selection

    fp = ModelFingerprint("llama", 4, 2, 2, 8)
    sources = tuple(tuple(((l, h),) for h in range(2)) if l in (0, 2) else
                    (((0, 0), (0, 1)), ((0, 1),)) for l in range(4))
    plan = KascadePlan(fp, (0, 2), ((0, 1),) * 4, ratio=0.1, k_min=6, tile=8)
    plan = plan.with_reuse(sources=sources, factor=(1.0, factor, 1.0, 1.0), **reuse)
    q, k = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 40, 8)
    step = plan_step(q, k, budget=plan.budget)
    ranked = Selection(torch.tensor([[[RANK_A], [RANK_B]]]), torch.zeros(1, dtype=torch.long), 8, decode=True,
                       ranked=True)
    return layer_selection(plan, 1, {0: ranked}, step).indices[0, :, 0].tolist()


@pytest.mark.parametrize("factor,head0,head1", [
    # the union merges the two rankings rank by rank (A0, B0, A1, B1 = A0 again, A2, B2, A3, ...)
    (1.0, [2, 5, 7, 17, 21, 30], [3, 7, 9, 12, 21, 30]),  # head 1 has one source: its first 6
    (0.5, [5, 7, 30], [7, 21, 30]),  # the layer's own budget: 3 keys
])
def test_a_union_of_two_sources_interleaves_their_rankings_at_the_layers_budget(factor, head0, head1):
    assert _hand_case(factor) == [head0, head1]


@pytest.mark.parametrize("factor,head0", [
    # 6 keys: recent share floor(0.5 * 6) = 3 = sinks 0, 1 + the newest key 39; then the union's ranking 30, 7, 5
    (1.0, [0, 1, 5, 7, 30, 39]),
    # 3 keys: floor(0.5 * 3) = 1 forced key, a sink (0); then 30, 7
    (0.5, [0, 7, 30]),
])
def test_sinks_and_recent_take_their_share_of_the_layers_budget(factor, head0):
    assert _hand_case(factor, sinks=2, recent=0.5)[0] == head0
