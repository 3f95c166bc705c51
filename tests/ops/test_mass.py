"""Budgets by attention mass (Budget.mass): the rule, the reference selection by hand, and its way through the
reuse layers, the runtime and the plan file."""

import math

import pytest
import torch

import kascade
from kascade import ops
from kascade.budget import Budget, mass_counts, at_factor
from kascade.ops import reference as R
from kascade.plan import KascadePlan, ModelFingerprint, Reuse
from tiny_model import tiny_llama


def _zeros(B=1):
    return torch.zeros(B, dtype=torch.long)


# -- the rule --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mass, own, lo, hi, want", [
    (0.75, 0.0, 0, 4, 2),   # 0.5 + 0.25 reaches 0.75 exactly
    (0.76, 0.0, 0, 4, 3),   # just past it: one key more
    (0.75, 0.25, 0, 4, 1),  # a quarter attended anyway (the own tile): 0.5 more is enough
    (0.2, 0.25, 0, 4, 0),   # the own tile alone holds the share
    (0.2, 0.25, 3, 4, 3),   # ... but the floor keeps three
    (1.0, 0.0, 0, 2, 2),    # the cap
])
def test_mass_counts_by_hand(mass, own, lo, hi, want):
    ranked = torch.tensor([[0.5, 0.25, 0.125, 0.125]])
    total = torch.tensor([1.0])
    assert mass_counts(ranked, total, own, mass, lo, hi).tolist() == [want]


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.5, True, "0.9", float("nan")])
def test_budget_refuses_a_bad_mass(bad):
    with pytest.raises(ValueError, match="mass"):
        Budget(mass=bad)


def test_the_floor_is_the_budget_at_ratio_0():
    b = Budget(ratio=0.3, k_min=64, tile=16, rolling=False, mass=0.9)
    f = b.floor
    assert (f.ratio, f.k_min, f.tile, f.rolling, f.mass) == (0.0, 64, 16, False, None)
    assert f.decode(10_000) == 64 and b.decode(10_000) == 3000


# -- the reference selection, by hand --------------------------------------------------------------------------------
def _decode_keys(probs):
    """One KV head, one query head, D = 1, softmax scale 1: keys whose softmax with q = 1 is ``probs``."""
    k = torch.log(torch.tensor(probs, dtype=torch.float64)).view(1, 1, -1, 1)
    return torch.ones(1, 1, 1, 1, dtype=torch.float64), k


@pytest.mark.parametrize("mass, k_min, ratio, want", [
    (0.75, 1, 1.0, [1, 3]),     # 8/16 + 4/16
    (0.8, 1, 1.0, [0, 1, 3]),   # + 2/16
    (0.75, 3, 1.0, [0, 1, 3]),  # the floor: k_min keys
    (0.75, 1, 0.2, [1]),        # the cap: floor(0.2 * 5) = 1 key
])
def test_decode_selection_by_hand(mass, k_min, ratio, want):
    q, k = _decode_keys([2 / 16, 8 / 16, 1 / 16, 4 / 16, 1 / 16])
    sel = R.select_by_mass(q, k, budget=Budget(ratio=ratio, k_min=k_min, mass=mass), scale=1.0, kv_start=_zeros(),
                           q_offset=4)
    assert sel.indices[0, 0, 0].tolist() == want
    assert sel.kept.tolist() == [[[len(want)]]]
    assert sel.decode and not sel.ranked


def test_prefill_selection_by_hand_counts_the_own_tile():
    """q = 0: uniform attention. Tile 1 (queries 2, 3; T = 2) pools 1/3 + 1/4 = 7/12 on keys 0, 1 and 2, 1/4 on key 3:
    2 in all, 10/12 of it on its own tile. A share of 0.4 (0.8) needs no earlier key, 0.5 (1.0) needs one (ties:
    the earlier key), 0.95 (1.9) needs both. Tile 0 has no earlier keys."""
    q = torch.zeros(1, 1, 4, 3, dtype=torch.float64)
    k = torch.randn(1, 1, 4, 3, dtype=torch.float64)
    for mass, want in ((0.4, []), (0.5, [0]), (0.95, [0, 1])):
        b = Budget(ratio=1.0, k_min=1, tile=2, rolling=False, mass=mass)
        sel = R.select_by_mass(q, k, budget=b, scale=1.0, kv_start=_zeros(), q_offset=0)
        assert sel.kept.tolist() == [[[0, len(want)]]]
        assert [x for x in sel.indices[0, 0, 1].tolist() if x >= 0] == want
        assert (sel.indices[0, 0, 0] < 0).all()


def test_ranked_selection_by_mass_holds_the_deepest_factor_in_rank_order():
    q, k = _decode_keys([2 / 16, 8 / 16, 1 / 16, 4 / 16, 1 / 16])
    sel = R.select_by_mass(q, k, budget=Budget(ratio=1.0, k_min=1, mass=0.75), scale=1.0, kv_start=_zeros(),
                           q_offset=4, factor=1.5)
    assert sel.ranked and sel.kept.tolist() == [[[2]]]
    assert sel.indices[0, 0, 0].tolist() == [1, 3, 0]  # round(1.5 * 2) = 3 keys, best first


def _brute_force(q, k, budget, kv_start, q_offset, scale):
    """Per (sequence, head, row): the sets by the definition, one row at a time in float64."""
    B, HQ, L, D = q.shape
    H = k.shape[1]
    G, T = HQ // H, budget.tile
    out = {}
    for b in range(B):
        st = int(kv_start[b])
        n = q_offset + L - st
        l = min(L, n)
        qq, kk = q[b, :, L - l:].double(), k[b, :, st: st + n].double()
        for h in range(H):
            rows = {}
            for i in range(l):
                pos = n - l + i
                s = (qq[h * G:(h + 1) * G, i] @ kk[h, : pos + 1].T) * scale
                p = s.softmax(-1).sum(0)
                r = 0 if L == 1 else pos // T
                rows.setdefault(r, torch.zeros(n, dtype=torch.float64))[: pos + 1] += p
            for r, p in rows.items():
                cands = n if L == 1 else r * T
                lo = budget.floor.decode(n) if L == 1 else budget.floor.prefill_tile(cands, n)
                hi = budget.decode(n) if L == 1 else budget.prefill_tile(cands, n)
                own = float(p[cands:].sum())
                need = budget.mass * float(p.sum()) - own
                order = sorted(range(cands), key=lambda j: (-float(p[j]), j))
                c, acc = 0, 0.0
                while c < cands and acc < need:
                    acc += float(p[order[c]])
                    c += 1
                c = min(max(c, lo), hi)
                out[b, h, r] = sorted(j + st for j in order[:c])
    return out


@pytest.mark.parametrize("B, HQ, H, L, N, T, mass", [
    (2, 6, 3, 1, 37, 4, 0.8),     # decode, G = 2
    (2, 3, 1, 23, 23, 5, 0.9),    # prefill of a whole prompt, odd tile
    (1, 4, 2, 9, 30, 4, 0.6),     # a chunk of prefill after 21 cached keys
])
def test_reference_matches_the_definition_on_random_inputs(B, HQ, H, L, N, T, mass):
    g = torch.Generator().manual_seed(7)
    q = torch.randn(B, HQ, L, 8, generator=g, dtype=torch.float64) * 2
    k = torch.randn(B, H, N, 8, generator=g, dtype=torch.float64)
    kv_start = torch.tensor([0, 3][:B])
    budget = Budget(ratio=0.5, k_min=3, tile=T, mass=mass)
    sel = R.select_by_mass(q, k, budget=budget, scale=0.4, kv_start=kv_start, q_offset=N - L)
    want = _brute_force(q, k, budget, kv_start, N - L, 0.4)
    for (b, h, r), keys in want.items():
        row = r - int(sel.row_start[b])
        assert sorted(x for x in sel.indices[b, h, row].tolist() if x >= 0) == keys, (b, h, r)
        assert int(sel.kept[b, h, row]) == len(keys)


def test_mass_one_keeps_the_count_selection():
    """Every candidate holds some mass, so a share of 1 takes every one the cap allows: the selection by count."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 40, 16, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, 40, 16, generator=g, dtype=torch.float64)
    kw = dict(scale=0.25, kv_start=torch.tensor([0, 5]), q_offset=0)
    by_count = R.select(q, k, budget=Budget(ratio=0.3, k_min=4, tile=8), **kw)
    by_mass = R.select_by_mass(q, k, budget=Budget(ratio=0.3, k_min=4, tile=8, mass=1.0), **kw)
    assert torch.equal(by_mass.as_set().indices, by_count.indices)


# -- through the public ops, the reuse layers and the runtime --------------------------------------------------------
def test_public_select_dispatches_by_mass_and_triton_refuses_it(monkeypatch):
    q, k = _decode_keys([2 / 16, 8 / 16, 1 / 16, 4 / 16, 1 / 16])
    sel = ops.select(q, k, budget=Budget(ratio=1.0, k_min=1, mass=0.75), scale=1.0)
    assert sel.indices[0, 0, 0].tolist() == [1, 3] and sel.kept is not None
    monkeypatch.setattr(ops, "triton_unavailable_reason", lambda *a, **kw: None)
    with pytest.raises(ValueError, match="attention mass"):
        ops.plan_step(q, k, budget=Budget(mass=0.9), backend="triton")
    assert ops.resolve_backend("auto", "cuda", torch.bfloat16, 64, 3, Budget(mass=0.9)) == "reference"
    assert ops.resolve_backend("auto", "cuda", torch.bfloat16, 64, 3, Budget()) == "triton"
    with pytest.raises(ValueError, match="attention mass"):
        ops.resolve_backend("triton", "cuda", torch.bfloat16, 64, 3, Budget(mass=0.9))


def test_reuse_prefix_scales_each_heads_kept_count():
    """A ranked selection by mass through a layer's factor: each head's own count, scaled (3 KV heads whose
    attention differs: one sharp, one flat, one between)."""
    from kascade import reuse

    g = torch.Generator().manual_seed(1)
    N = 64
    q = torch.randn(1, 3, 1, 8, generator=g, dtype=torch.float64) * torch.tensor([8.0, 0.0, 2.0]).view(1, 3, 1, 1)
    k = torch.randn(1, 3, N, 8, generator=g, dtype=torch.float64)
    budget = Budget(ratio=0.5, k_min=2, mass=0.7)
    step = ops.plan_step(q, k, budget=budget)
    sel = ops.select(q, k, scale=1.0, step=step, rank_factor=2.0)
    kept = sel.kept[0, :, 0]
    assert kept[0] < kept[2] < kept[1]  # sharp < between < flat
    half = reuse.prefix(sel, 0.5, step)
    assert half.counts.tolist() == [[[int(at_factor(int(c), 0.5, N))] for c in kept]]
    sets = half.as_set().indices[0, :, 0]
    for h in range(3):
        assert sorted(x for x in sets[h].tolist() if x >= 0) == sorted(sel.indices[0, h, 0, : half.counts[0, h, 0]].tolist())


@pytest.mark.parametrize("scales", [None, (1.0, 0.5, 2.0, 1.0)])
def test_a_plan_by_mass_runs_a_model_and_attends_fewer_keys_than_its_cap(scales):
    model = tiny_llama()
    fp = ModelFingerprint.from_model(model)
    reuse_rule = Reuse() if scales is None else Reuse(factor=scales)
    by_count = KascadePlan(fp, (0, 2), ((0, 1),) * 4, ratio=0.5, k_min=4, tile=8, reuse=reuse_rule)
    by_mass = by_count.with_budget(mass=0.5)
    ids = torch.randint(0, 97, (2, 96), generator=torch.Generator().manual_seed(0))
    out = {}
    for name, plan in (("count", by_count), ("mass", by_mass)):
        with torch.no_grad(), kascade.enable(model, plan, account=True, warn_uncalibrated=False) as h:
            logits = model(ids).logits
            gen = model.generate(ids[:1, :40], max_new_tokens=4, do_sample=False)
        assert torch.isfinite(logits).all() and gen.shape == (1, 44)
        assert h.runtime.backend == "reference"
        out[name] = sum(a for a, _ in h.runtime.attended.values())
    assert out["mass"] < out["count"]


def test_plan_with_mass_round_trips_and_refuses_merged_rules():
    fp = ModelFingerprint("llama", 4, 6, 2, 8)
    plan = KascadePlan(fp, (0, 2), ((0, 1),) * 4, ratio=0.3, mass=0.95)
    back = KascadePlan.from_dict(plan.to_dict())
    assert back == plan and back.budget.mass == 0.95
    assert "mass" not in plan.with_budget(mass=None).to_dict()
    with pytest.raises(ValueError, match="attention mass"):
        KascadePlan(fp, (0, 2), ((0, 1),) * 4, mass=0.9, reuse=Reuse(sinks=2, recent=0.2))
    assert math.isclose(plan.with_budget(mass=0.5).mass, 0.5)


# -- calibration and costs --------------------------------------------------------------------------------------------
def test_mass_for_fraction_finds_the_largest_share_within_the_budget():
    from kascade.calibrate.budgets import attended_fraction, mass_for_fraction

    model = tiny_llama()
    fp = ModelFingerprint.from_model(model)
    plan = KascadePlan(fp, (0, 2), ((0, 1),) * 4, ratio=0.8, k_min=2, tile=8)
    wins = [torch.randint(0, 97, (160,), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    f_low = attended_fraction(model, plan.with_budget(mass=0.3), wins)
    f_high = attended_fraction(model, plan.with_budget(mass=1.0), wins)
    assert f_low < f_high
    target = (f_low + f_high) / 2
    mass, f = mass_for_fraction(model, plan, wins, target, low=0.3, steps=5, progress=False)
    assert f_low <= f <= target and 0.3 <= mass < 1.0
    assert f == attended_fraction(model, plan.with_budget(mass=mass), wins)
    # one step of the grid above it is over the budget (the bisection's bracket)
    assert attended_fraction(model, plan.with_budget(mass=mass + 0.7 / 32), wins) > target or mass + 0.7 / 32 > 1
    with pytest.raises(ValueError, match="already attends"):
        mass_for_fraction(model, plan, wins, f_low / 2, low=0.3, steps=1, progress=False)


def test_costs_of_a_plan_by_mass_need_its_measured_fractions():
    from kascade import costs

    fp = ModelFingerprint("llama", 32, 32, 8, 128)
    plan = KascadePlan.uniform(fp, 5)
    with pytest.raises(ValueError, match="measured"):
        costs.plan_speedup(plan.with_budget(mass=0.9, ratio=0.3), "decode")
    # the measured fractions of a count plan reproduce its modelled speed
    n = 131072
    counted = {l: [plan.budget.decode_counts(n, plan.layer_factor(l)), n] for l in range(32)}
    assert costs.plan_speedup(plan, "decode", attended=counted) == pytest.approx(costs.plan_speedup(plan, "decode"))
    half = {l: [a // 2, d] for l, (a, d) in counted.items()}
    assert costs.plan_speedup(plan.with_budget(mass=0.9, ratio=0.3), "decode", attended=half) > \
        costs.plan_speedup(plan, "decode")
