"""FP8 scoring of the anchors' selection (Budget.score_dtype="fp8"): the reference selects what the exact reference
selects on FP8-rounded vectors, a hand-built case where the rounding changes the selected key, and its way through
the public ops, the backends' rule, a plan and a model."""

import dataclasses

import pytest
import torch

import brute_force as bf
import kascade
from kascade import ops
from kascade.budget import Budget
from kascade.ops import fp8, reference as R
from kascade.plan import KascadePlan, ModelFingerprint, Reuse
from scoring_checks import inputs, same_selection
from tiny_model import tiny_llama


def _fp8(budget: Budget) -> Budget:
    return dataclasses.replace(budget, score_dtype="fp8")


# (B, HQ, H, N, L, q_offset, D, tile, k_min, ratio); kv_start [0, 5, ...]: every sequence after the first is left-padded
CASES = [
    (2, 6, 2, 57, 1, 56, 16, 8, 4, 0.2),        # decode, G = 3
    (1, 4, 4, 65, 1, 64, 8, 8, 9, 0.0),         # decode, G = 1, a fixed top-k
    (2, 3, 1, 61, 61, 0, 16, 4, 4, 0.3),        # prefill of a whole prompt, G = 3
    (2, 10, 2, 70, 23, 47, 24, 6, 3, 0.25),     # a chunk after 47 cached keys, its first query inside a tile, G = 5
    (1, 4, 2, 80, 80, 0, 100, 16, 24, 0.5),     # D = 100, the budget capped by k(N) - T
]
IDS = ["B{}-HQ{}-H{}-N{}-L{}-off{}-D{}-T{}-kmin{}-r{}".format(*c) for c in CASES]


@pytest.mark.parametrize("rank_factor", [None, 1.5], ids=["set", "ranked"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_fp8_selection_is_the_exact_selection_of_the_rounded_vectors(case, rank_factor):
    B, HQ, H, N, L, off, D, T, k_min, ratio = case
    q, k, _ = inputs(B, HQ, H, N, L, D, seed=N + L)
    exact = Budget(ratio=ratio, k_min=k_min, tile=T)
    kw = dict(scale=D ** -0.5, kv_start=torch.tensor([0, 5][:B]), q_offset=off, rank_factor=rank_factor)
    got = R.select(q, k, budget=_fp8(exact), **kw)
    want = R.select(fp8.rounded(q), fp8.rounded(k), budget=exact, **kw)
    same_selection(got, want)
    # the public op (host geometry) selects the same
    same_selection(ops.select(q, k, budget=_fp8(exact), **kw), want)


def test_the_cases_are_not_vacuous():
    """On every case's inputs FP8 rounding selects other keys than exact scoring somewhere: the equalities above
    compare selections that differ from the exact one."""
    differs = []
    for B, HQ, H, N, L, off, D, T, k_min, ratio in CASES:
        q, k, _ = inputs(B, HQ, H, N, L, D, seed=N + L)
        kw = dict(scale=D ** -0.5, kv_start=torch.tensor([0, 5][:B]), q_offset=off)
        exact = Budget(ratio=ratio, k_min=k_min, tile=T)
        differs.append(not torch.equal(R.select(q, k, budget=exact, **kw).indices,
                                       R.select(q, k, budget=_fp8(exact), **kw).indices))
    assert all(differs), differs


@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=[IDS[0], IDS[3]])
def test_fp8_selection_matches_the_brute_force_spec_on_rounded_vectors(case):
    """Sets against tests/ops/brute_force.py on the rounded vectors (fp64), and the sparse output over them is the
    masked attention of the *exact* q, k, v: FP8 picks keys, it does not compute outputs."""
    B, HQ, H, N, L, off, D, T, k_min, ratio = case
    q, k, v = inputs(B, HQ, H, N, L, D, dtype=torch.float64, seed=N + L)
    budget = Budget(ratio=ratio, k_min=k_min, tile=T, score_dtype="fp8")
    kw = dict(kv_start=torch.tensor([0, 5][:B]), q_offset=off)
    sel = ops.select(q, k, budget=budget, scale=D ** -0.5, **kw)
    want = bf.masks(fp8.rounded(q), fp8.rounded(k), budget=budget, scale=D ** -0.5, **kw)
    for b, (M, sets, start, n, l) in enumerate(want):
        for (h, t), keys in sets.items():
            row = sel.indices[b, h, t - int(sel.row_start[b])]
            assert set((row[row >= 0] - start).tolist()) == keys, (b, h, t)
    out = ops.sparse_attention(q, k, v, sel, scale=D ** -0.5, **kw)
    torch.testing.assert_close(out, bf.masked_attention(q, k, v, [m[0] for m in want], scale=D ** -0.5, **kw),
                               rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[3]], ids=[IDS[0], IDS[2], IDS[3]])
@pytest.mark.parametrize("rank_factor", [None, 0.5], ids=["set", "ranked"])
def test_fp8_selection_by_mass_is_the_exact_one_of_the_rounded_vectors(case, rank_factor):
    B, HQ, H, N, L, off, D, T, k_min, ratio = case
    q, k, _ = inputs(B, HQ, H, N, L, D, seed=N + L)
    exact = Budget(ratio=ratio, k_min=k_min, tile=T, mass=0.7)
    kw = dict(scale=D ** -0.5, kv_start=torch.tensor([0, 5][:B]), q_offset=off)
    got = R.select_by_mass(q, k, budget=_fp8(exact), factor=rank_factor, **kw)
    same_selection(got, R.select_by_mass(fp8.rounded(q), fp8.rounded(k), budget=exact, factor=rank_factor, **kw))
    same_selection(ops.select(q, k, budget=_fp8(exact), rank_factor=rank_factor, **kw), got)
    # layer 0 selects exactly, by mass too
    _, sel0 = ops.dense_select(q, k, k, budget=_fp8(exact), rank_factor=rank_factor, **kw)
    same_selection(sel0, R.select_by_mass(q, k, budget=exact, factor=rank_factor, **kw))


@pytest.mark.parametrize("rank_factor", [None, 2.0], ids=["set", "ranked"])
def test_static_cache_decode_scores_fp8_like_the_host_form(rank_factor):
    """The decode form over every slot of a static cache (geometry on the device, ``select_decode(meta=...)``):
    the keys of the per-sequence form, unused slots holding NaN."""
    B, N, slot = 3, 50, 41
    kv_start = [0, 9, 30]
    q, k, v = inputs(B, 6, 3, N, 1, 16, seed=4)
    k[:, :, slot + 1:] = float("nan")
    budget = Budget(ratio=0.25, k_min=4, score_dtype="fp8")
    host = ops.plan_step(q, k, budget=budget, kv_start=torch.tensor(kv_start), q_offset=slot)
    device = ops.plan_step(q, k, budget=budget, kv_start=torch.tensor(kv_start), q_offset=torch.tensor(slot))
    assert device.meta is not None and host.meta is None
    want = ops.select(q, k, scale=0.3, step=host, rank_factor=rank_factor)
    got = ops.select(q, k, scale=0.3, step=device, rank_factor=rank_factor)
    width = want.indices.shape[-1]
    assert torch.equal(got.indices[..., :width], want.indices) and (got.indices[..., width:] == -1).all()
    exact = ops.plan_step(q, k, budget=Budget(ratio=0.25, k_min=4), kv_start=torch.tensor(kv_start),
                          q_offset=torch.tensor(slot))
    assert not torch.equal(ops.select(q, k, scale=0.3, step=exact, rank_factor=rank_factor).indices, got.indices)


# -- by hand: FP8 rounding changes the selected key ------------------------------------------------------------------
def _hand_case():
    """One KV head, one query head, D = 2, softmax scale 1, a budget of one key. q = (1, 1) is exact in e4m3.
    Key 0 = (1.1, 0): its scale is 2**-7 (max 1.1 = 0.55 * 2**1), 1.1 / 2**-7 = 140.8 rounds to 144 (spacing 16 in
    [128, 256)): 1.125, so its FP8 score is 1.125 (exact: 1.1). Key 1 = (1, 0.11): scale 2**-7, 1 -> 128 exactly,
    0.11 / 2**-7 = 14.08 rounds to 14 (spacing 1 in [8, 16)): 0.109375, FP8 score 1.109375 (exact: 1.11). Key 2
    (the query's own slot) scores -2 either way. Exact scoring keeps key 1, FP8 scoring key 0."""
    q = torch.tensor([1.0, 1.0], dtype=torch.float64).view(1, 1, 1, 2)
    k = torch.tensor([[1.1, 0.0], [1.0, 0.11], [-2.0, 0.0]], dtype=torch.float64).view(1, 1, 3, 2)
    return q, k


def test_fp8_rounding_changes_which_key_is_selected_by_hand():
    q, k = _hand_case()
    assert fp8.rounded(k)[0, 0].tolist() == [[1.125, 0.0], [1.0, 0.109375], [-2.0, 0.0]]
    exact, low = Budget(ratio=0.0, k_min=1), Budget(ratio=0.0, k_min=1, score_dtype="fp8")
    assert ops.select(q, k, budget=exact, scale=1.0).indices.tolist() == [[[[1]]]]
    assert ops.select(q, k, budget=low, scale=1.0).indices.tolist() == [[[[0]]]]
    static = ops.plan_step(q, k, budget=low, q_offset=torch.tensor(2))
    assert ops.select(q, k, scale=1.0, step=static).indices.tolist() == [[[[0]]]]
    # layer 0 scores exactly: its selection keeps key 1 under either budget
    for b in (exact, low):
        assert ops.dense_select(q, k, k, budget=b, scale=1.0)[1].indices.tolist() == [[[[1]]]]
        step = ops.plan_step(q, k, budget=b, q_offset=torch.tensor(2))
        assert ops.dense_select(q, k, k, scale=1.0, step=step)[1].indices.tolist() == [[[[1]]]]
    # in prefill: a second tile (T = 2, queries 2 and 3 both (1, 1)) picks one of keys 0 and 1 the same way
    qq = q.expand(1, 1, 4, 2).contiguous()
    kk = torch.cat([k[:, :, :2], torch.tensor([[-2.0, 0.0], [-2.0, 0.0]], dtype=torch.float64).view(1, 1, 2, 2)], 2)
    for b, key in ((exact, 1), (low, 0)):
        prefill = Budget(ratio=0.0, k_min=3, tile=2, score_dtype=b.score_dtype)  # tile 1 keeps k(4) - T = 1 key
        assert ops.select(qq, kk, budget=prefill, scale=1.0).indices[0, 0, 1].tolist() == [key]


# -- the backends ----------------------------------------------------------------------------------------------------
def test_triton_serves_fp8_scoring_through_the_public_op(monkeypatch):
    """auto keeps the Triton backend for a budget with FP8 scoring (it refuses only budgets by mass), and the public
    op's Triton selection (the interpreter on the CPU) is the reference's, prefill and decode."""
    pytest.importorskip("triton")
    from kernel_checks import TEST_DEVICE, dev

    if TEST_DEVICE != "cpu":
        pytest.skip("the interpreter's exact sums: compiled, the kernel tests check FP8 selections (FP8_RTOL)")
    monkeypatch.setattr(ops, "triton_unavailable_reason", lambda *a, **kw: None)  # as on a GPU
    assert ops.resolve_backend("auto", "cuda", torch.bfloat16, 64, 3, Budget(score_dtype="fp8")) == "triton"
    assert ops.resolve_backend("auto", "cuda", torch.bfloat16, 64, 3, Budget(mass=0.9)) == "reference"
    monkeypatch.undo()

    for L in (1, 40):  # decode, prefill
        q, k, _ = inputs(2, 6, 2, 70, L, 32, dtype=torch.bfloat16, seed=L)
        kv = {"kv_start": torch.tensor([0, 9]), "q_offset": 70 - L}
        budget = Budget(ratio=0.25, k_min=6, tile=8, score_dtype="fp8")
        want = ops.select(q, k, budget=budget, backend="reference", **kv)
        got = ops.select(dev(q), dev(k), budget=budget, backend="triton", **kv)
        assert torch.equal(got.indices.cpu().long(), want.indices), f"L={L}"
        assert not torch.equal(want.indices, ops.select(q, k, budget=Budget(ratio=0.25, k_min=6, tile=8),
                                                        backend="reference", **kv).indices)


def test_the_jax_ops_refuse_fp8_scoring():
    pytest.importorskip("jax")
    import numpy as np

    from kascade import jax as kjax

    q, k = (np.asarray(x, dtype=np.float32) for x in _hand_case())
    with pytest.raises(ValueError, match="FP8 scoring"):
        kjax.select(q, k, budget=Budget(score_dtype="fp8"))
    with pytest.raises(ValueError, match="attention mass"):  # (it used to select by count, silently)
        kjax.select(q, k, budget=Budget(mass=0.9))


# -- a plan and a model ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("factors", [None, (1.0, 0.5, 2.0, 1.0)], ids=["paper", "per-layer"])
def test_a_plan_with_fp8_scoring_runs_a_model_and_selects_otherwise(factors, monkeypatch):
    model = tiny_llama()
    fp = ModelFingerprint.from_model(model)
    exact = KascadePlan(fp, (0, 2), ((0, 1),) * 4, ratio=0.25, k_min=4, tile=8,
                        reuse=Reuse() if factors is None else Reuse(factor=factors))
    plan = exact.with_budget(score_dtype="fp8")
    assert plan.budget.score_dtype == "fp8"
    ids = torch.randint(0, 97, (2, 96), generator=torch.Generator().manual_seed(0))
    seen = []  # the anchors' selections (layer 2), per plan
    orig = ops.select
    monkeypatch.setattr(ops, "select", lambda *a, **kw: (seen.append(orig(*a, **kw)), seen[-1])[1])
    logits = {}
    for name, p in (("exact", exact), ("fp8", plan)):
        with torch.no_grad(), kascade.enable(model, p, warn_uncalibrated=False) as h:
            logits[name] = model(ids).logits
            gen = model.generate(ids[:1, :40], max_new_tokens=4, do_sample=False)
        assert torch.isfinite(logits[name]).all() and gen.shape == (1, 44)
        assert h.runtime.backend == "reference"
    exact_sel, fp8_sel = seen[0], seen[len(seen) // 2]  # each plan's prefill anchor
    assert not torch.equal(exact_sel.indices, fp8_sel.indices)
    assert not torch.equal(logits["exact"], logits["fp8"])


def test_enabling_fp8_scoring_on_triton_says_what_decode_costs(recwarn):
    """On the Triton backend a plan with FP8 scoring warns that decode re-quantises each anchor's keys every step (no
    silent slowdown); on the reference, which has no speed to lose, it does not."""
    pytest.importorskip("triton")
    from kernel_checks import DEVICE

    # a head dim the Triton kernels serve, on their device (the interpreter's CPU, or the GPU in GPU mode)
    model = tiny_llama(head_dim=16).to(DEVICE)
    fp = ModelFingerprint.from_model(model)
    plan = KascadePlan(fp, (0, 2), ((0, 1),) * 4, ratio=0.25, k_min=4, tile=8).with_budget(score_dtype="fp8")
    with pytest.warns(UserWarning, match="FP8 scoring .* quantises its layer's whole key cache"):
        kascade.enable(model, plan, backend="triton", warn_uncalibrated=False).disable()
    with pytest.warns(UserWarning, match="INT8 scoring .* quantises its layer's whole key cache"):
        kascade.enable(model, plan.with_budget(score_dtype="int8"), backend="triton", warn_uncalibrated=False).disable()
    recwarn.clear()
    kascade.enable(model, plan, backend="reference", warn_uncalibrated=False).disable()
    assert not [w for w in recwarn if "FP8 scoring" in str(w.message)]
