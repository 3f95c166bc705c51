import pytest
import torch

import kascade
from conftest import tiny_model
from kascade.budget import Budget
from kascade.calibrate import collect_stats, rules
from kascade.eval.strategies import STRATEGIES, VARIANTS, make_strategy, quest_select, streaming_select
from kascade.ops import plan_step


# kascade-faithful needs a shipped plan: test_shipped_variants_serve_the_default_model
TINY = [s for s in STRATEGIES if s not in ("dense", "kascade-faithful")]


@pytest.mark.parametrize("name", TINY)
def test_every_strategy_at_full_budget_equals_dense(name):
    model = tiny_model("llama", num_key_value_heads=3)
    ids = torch.randint(3, 97, (1, 128), generator=torch.Generator().manual_seed(0))
    plan, selector = make_strategy(name, model, budget=dict(ratio=1.0, k_min=1))
    with torch.no_grad():
        dense = model(ids).logits
        with kascade.enable(model, plan, selector=selector, account=True, warn_uncalibrated=False) as h:
            got = model(ids).logits
    torch.testing.assert_close(got, dense, rtol=1e-5, atol=1e-5)
    assert all(a == d for a, d in h.runtime.attended.values())  # every layer attended every causal key


def test_small_budget_strategies_attend_exactly_the_budget():
    """At 10% of 400 keys (tile 16, k_min 16) every strategy's sparse layers attend exactly what the budget allows:
    per query, its tile's selected keys plus the causal keys of its own tile; Quest whole 16-key pages of that
    budget only. Counts per KV head, summed over queries (the accounting counts each of the 3 KV heads)."""
    model = tiny_model("llama", num_key_value_heads=3)
    N, T = 400, 16
    ids = torch.randint(3, 97, (1, N), generator=torch.Generator().manual_seed(0))
    # by hand: k(400) = 40, so a tile at s selects min(s, 40 - 16, max(16, floor(0.1 s))) keys (rolling)
    tile_keys = [min(s, 24, max(16, s // 10)) for s in range(0, N, T)]
    own = sum(i % T + 1 for i in range(N))
    want = 3 * (sum(tile_keys[i // T] for i in range(N)) + own)
    want_quest = 3 * (sum(16 * min(tile_keys[i // T] // 16, i // T) for i in range(N)) + own)
    dense = 3 * N * (N + 1) // 2
    assert (want, want_quest, dense) == (33144, 28632, 240600)  # 13.8% and 11.9% of dense
    for name in TINY:
        plan, selector = make_strategy(name, model, budget=dict(ratio=0.1, k_min=16, tile=16))
        with torch.no_grad(), kascade.enable(model, plan, selector=selector, account=True,
                                             warn_uncalibrated=False) as h:
            model(ids)
        assert tuple(h.runtime.attended[0]) == (dense, dense), name  # layer 0 dense
        for layer in (1, 2, 3):
            assert tuple(h.runtime.attended[layer]) == (want_quest if name == "quest" else want, dense), (name, layer)


def test_streamingllm_selects_sinks_and_recent_window():
    q = torch.randn(1, 2, 100, 8)
    k = torch.randn(1, 1, 100, 8)
    budget = Budget(ratio=0.1, k_min=10, tile=20, rolling=False)
    sel = streaming_select(q, k, step=plan_step(q, k, budget=budget))
    # tile 3 starts at s = 60: budget min(60, k(100) - T) = min(60, -10 -> 0)... k(100) = 10, so 0 keys
    assert sel.indices.shape[2] == 5
    budget = Budget(ratio=0.5, k_min=10, tile=20, rolling=False)  # k(100) = 50: tiles select min(s, 30)
    sel = streaming_select(q, k, step=plan_step(q, k, budget=budget))
    row = sel.indices[0, 0, 3]  # s = 60, 30 keys: sinks 0..3 + recent 34..59
    assert row.tolist() == [0, 1, 2, 3] + list(range(34, 60))
    row1 = sel.indices[0, 0, 1]  # s = 20 <= 30: dense, 0..19
    assert row1[row1 >= 0].tolist() == list(range(20))
    qd = q[:, :, -1:]
    d = streaming_select(qd, k, step=plan_step(qd, k, budget=budget)).indices[0, 0, 0]
    assert d.tolist() == [0, 1, 2, 3] + list(range(54, 100))  # decode: k(100) = 50 keys


def test_quest_picks_the_page_with_the_largest_bound():
    """Keys are zero except one page with large values along the query's direction: Quest must take it."""
    T, page = 16, 16
    n = 80
    k = torch.zeros(1, 1, n, 4)
    k[0, 0, 16:32, 0] = 5.0  # page 1
    k[0, 0, 48:64, 0] = -5.0  # page 3: large magnitude, but against the query
    q = torch.zeros(1, 2, 1, 4)
    q[..., 0] = 1.0
    budget = Budget(ratio=0.2, k_min=16, tile=T)  # decode: k(80) = 16 keys = one page
    sel = quest_select(q, k, step=plan_step(q, k, budget=budget), page=page)
    assert sel.indices[0, 0, 0].tolist() == list(range(16, 32))
    q[..., 0] = -1.0  # now page 3 is the one aligned with the query
    assert quest_select(q, k, step=plan_step(q, k, budget=budget), page=page).indices[0, 0, 0].tolist() == list(range(48, 64))


def test_unknown_strategy_is_refused():
    with pytest.raises(ValueError, match="unknown strategy"):
        make_strategy("magic", tiny_model("llama"))


def test_variant_strategies_on_a_tiny_model():
    model = tiny_model("llama", num_key_value_heads=3)
    g = torch.Generator().manual_seed(0)
    wins = [torch.randint(3, 97, (200,), generator=g) for _ in range(2)]
    st = collect_stats(model, wins, k=16, tile=16, progress=False)
    base = rules.plan_for_rule(model, st, (0, 2), "faithful", budget=dict(k_min=8, tile=16))
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
        with torch.no_grad(), kascade.enable(model, plan, account=True, warn_uncalibrated=False) as h:
            model(ids)
        a, d = h.runtime.attended[3]
        assert 0.05 < a / d < 0.5, (name, a / d)
    with pytest.raises(ValueError, match="needs calibration statistics"):
        make_strategy("kascade-union2", model, base)


def test_shipped_variants_serve_the_default_model(default_model):
    from kascade.eval.strategies import available
    from kascade.plan import SHIPPED_VARIANTS, shipped_plan

    model, _ = default_model
    plans = {v: shipped_plan(model, v) for v in SHIPPED_VARIANTS}
    assert plans["default"] == kascade.default_plan(model)
    assert plans["faithful"].anchors != plans["searched"].anchors  # the search moved an anchor
    assert not plans["faithful"].ranked and not plans["searched"].ranked and plans["searched-budgets"].ranked
    # searched-budgets = searched + per-layer budgets; the default = searched-budgets with anchor 1 moved to 7
    assert plans["searched"].anchors == plans["searched-budgets"].anchors
    assert set(plans["searched-budgets"].anchors) - set(plans["default"].anchors) == {1}
    assert set(plans["default"].anchors) - set(plans["searched-budgets"].anchors) == {7}
    assert plans["default"].reuse == plans["searched-budgets"].reuse and plans["retrieval"] == plans["default"]
    factors = plans["default"].reuse.factor
    assert factors[0] == 1.0 and abs(sum(factors[1:]) / (len(factors) - 1) - 1.0) < 1e-9  # same average budget
    assert all(len(plans[v].anchors) == 6 for v in ("default", "searched-budgets", "searched", "faithful"))
    assert len(plans["fast"].anchors) < len(plans["balanced"].anchors) < 6  # faster named plans: fewer anchors
    assert "kascade-faithful" in available(model)
    assert "kascade-faithful" not in available(tiny_model("llama"))
    plan, _ = make_strategy("kascade-faithful", model)
    assert plan == plans["faithful"]
    ids = torch.randint(3, 1000, (1, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with kascade.enable(model, "faithful") as h:
            a = model(ids).logits
        assert h.runtime.plan == plans["faithful"]
        with kascade.enable(model) as h:
            b = model(ids).logits
        assert h.runtime.plan == plans["default"]
    assert not torch.equal(a, b)
    with pytest.raises(ValueError, match="'fastest' is neither a shipped plan .* nor a plan file"):
        kascade.enable(model, "fastest")
    with pytest.raises(ValueError, match="no shipped 'faithful' plan"):
        make_strategy("kascade-faithful", tiny_model("llama"))
