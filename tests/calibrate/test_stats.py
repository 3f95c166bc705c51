"""Streaming calibration statistics against a naive computation from full attention tensors."""


import pytest
import torch

from conftest import tiny_model
from kascade import ModelFingerprint
from kascade.calibrate import collect_stats, min_window_tokens, plan_from_stats
from kascade.calibrate.stats import CalibrationStats


def _naive_stats(model, windows, k, tile):
    """Full post-softmax attention of every layer (eager), then the spec's formulas with explicit loops."""
    fp = ModelFingerprint.from_model(model)
    L, H, G = fp.num_layers, fp.num_kv_heads, fp.num_q_heads // fp.num_kv_heads
    model.set_attn_implementation("eager")
    S_sum = torch.zeros(L, L, H, H, dtype=torch.float64)
    imp_sum = torch.zeros(L, dtype=torch.float64)
    imp_n = 0
    xs, outs = {}, {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: xs.__setitem__(i, a[0])))
        hooks.append(layer.self_attn.register_forward_hook(lambda m, a, o, i=i: outs.__setitem__(i, o[0])))
    try:
        for w in windows:
            with torch.no_grad():
                res = model(w[None], output_attentions=True, use_cache=False)
            n = len(w)
            tiles = (n + tile - 1) // tile
            P = torch.zeros(L, H, tiles, n, dtype=torch.float64)  # pooled probabilities, all layers at once
            for layer, att in enumerate(res.attentions):
                a = att[0].double().view(H, G, n, n).sum(1)  # [H, n, n]
                for t in range(tiles):
                    P[layer, :, t] = a[:, t * tile : (t + 1) * tile].sum(1)
            I = {}
            for layer in range(L):
                for h in range(H):
                    for t in range(tiles):
                        s = t * tile
                        if s >= k:
                            I[layer, h, t] = torch.argsort(P[layer, h, t, :s], descending=True)[:k]
            for b in range(1, L):
                for a in range(b):
                    for hb in range(H):
                        for ha in range(H):
                            vals = []
                            for t in range(tiles):
                                s = t * tile
                                if s < k:
                                    continue
                                own = P[b, hb, t, s : s + tile].sum()
                                num = P[b, hb, t, I[a, ha, t]].sum() + own
                                den = P[b, hb, t, I[b, hb, t]].sum() + own
                                vals.append(num / den)
                            S_sum[a, b, hb, ha] += min(vals)
            for layer in range(L):
                x, o = xs[layer].double(), outs[layer].double()
                imp_sum[layer] += (1 - torch.nn.functional.cosine_similarity(x, x + o, dim=-1)).sum()
            imp_n += n
    finally:
        for h in hooks:
            h.remove()
        model.set_attn_implementation("sdpa")
    return S_sum / len(windows), imp_sum / imp_n


def test_streaming_stats_equal_naive_full_attention():
    model = tiny_model("llama", num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=3)
    k, tile = 8, 8
    g = torch.Generator().manual_seed(0)
    windows = [torch.randint(3, 97, (n,), generator=g) for n in (70, 53)]
    stats = collect_stats(model, windows, k=k, tile=tile, progress=False)
    S, imp = _naive_stats(model, windows, k, tile)
    upper = torch.triu(torch.ones(4, 4, dtype=torch.bool), diagonal=1)
    torch.testing.assert_close(stats.similarity[upper].double(), S[upper], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats.importance.double(), imp, rtol=1e-4, atol=1e-6)
    assert bool((stats.similarity[upper] <= 1 + 1e-6).all()) and bool((stats.similarity[upper] > 0).all())


def test_head_map_is_argmax_and_plan_uses_it():
    L, H = 4, 3
    sim = torch.rand(L, L, H, H, generator=torch.Generator().manual_seed(1))
    stats = CalibrationStats(similarity=sim, importance=torch.ones(L), windows=1, seq_len=100, k=8, tile=8)
    plan = plan_from_stats(ModelFingerprint("llama", L, 6, H, 8), stats, 2)
    for b in range(L):
        a = plan.anchor_of(b)
        want = tuple(range(H)) if a == b else tuple(int(x) for x in sim[a, b].argmax(-1))
        assert plan.head_map[b] == want
    assert plan.calibrated
    ident = plan_from_stats(ModelFingerprint("llama", L, 6, H, 8), stats, 2, head_map=False)
    assert ident.anchors == plan.anchors and all(r == (0, 1, 2) for r in ident.head_map)


def test_too_short_or_too_many_is_refused():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=f"at least {min_window_tokens(64, 32)}"):
        collect_stats(model, [torch.arange(3, 60)], k=64, tile=32, progress=False)
    with pytest.raises(ValueError, match="no calibration windows"):
        collect_stats(model, [], progress=False)
    stats = CalibrationStats(torch.rand(4, 4, 2, 2), torch.ones(4), 1, 100, 8, 8)
    with pytest.raises(ValueError, match=r"1\.\.4"):
        plan_from_stats(ModelFingerprint.from_model(model), stats, 5)


def test_shipped_plan_matches_default_model_fingerprint():
    from kascade.plan import shipped_plans

    plans = shipped_plans()
    fp = ModelFingerprint("llama", 30, 9, 3, 64)
    assert [p.fingerprint for p in plans].count(fp) == 1
    plan = next(p for p in plans if p.fingerprint == fp)
    assert plan.calibrated and len(plan.anchors) <= 6 and plan.anchors[0] == 0
