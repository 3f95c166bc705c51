"""INT8 scoring of the anchors' selection (Budget.score_dtype="int8"): the quantisation by hand, the reference
selects what the exact reference selects on INT8-rounded vectors, a hand-built case where the rounding changes the
selected key, its way through the public ops and the Triton backend, and a model. The kernels' own tests:
tests/ops/test_triton_decode.py and test_triton_prefill.py (test_int8_*)."""

import dataclasses

import pytest
import torch

import brute_force as bf
import kascade
from kascade import ops
from kascade.budget import Budget
from kascade.ops import int8, reference as R
from kascade.plan import KascadePlan, ModelFingerprint
from scoring_checks import inputs, same_selection
from tiny_model import tiny_llama


# -- the quantisation, by hand -----------------------------------------------------------------------------------
def test_scale_maps_the_largest_element_to_127():
    x = torch.tensor([[1.0, -3.0, 0.5], [0.0, 0.0, 0.0], [127.0, 1.0, 0.0]])
    x8, s = int8.quantize(x)
    assert x8.dtype == torch.int8 and s.dtype == torch.float32
    # max 3 -> scale 3 / 127: 1 / s = 42.33 -> 42, 0.5 / s = 21.17 -> 21; a zero vector -> scale 1; max 127 -> 1
    assert s.tolist() == [torch.tensor(3.0 / 127, dtype=torch.float32).item(), 1.0, 1.0]
    assert x8.tolist() == [[42, -127, 21], [0, 0, 0], [127, 1, 0]]


def test_rounding_is_to_the_nearest_integer_ties_to_even():
    # scale 1 (max 127): 63.5 -> 64, 62.5 -> 62 (the even neighbours), -0.49 -> 0, -1.5 -> -2
    x8, s = int8.quantize(torch.tensor([[127.0, 63.5, 62.5, -0.49, -1.5]]))
    assert s.tolist() == [1.0] and x8.tolist() == [[127, 64, 62, 0, -2]]


def test_rounded_is_within_half_a_step_of_each_element_and_keeps_the_dtype():
    torch.manual_seed(0)
    x = torch.randn(5, 9, 64, dtype=torch.float64) * torch.logspace(-4, 4, 9, dtype=torch.float64)[None, :, None]
    r = int8.rounded(x)
    assert r.dtype == torch.float64 and int8.rounded(x.float()).dtype == torch.float32
    step = x.abs().amax(-1, keepdim=True) / 127
    assert ((r - x).abs() <= step * (0.5 + 1e-6)).all()
    assert ((r - x).abs() > 0).any()  # it does round
    assert torch.equal(int8.quantize(r)[0], int8.quantize(x)[0])  # the rounded vectors quantise to the same integers


def test_budget_takes_int8_and_names_the_choices():
    assert Budget(score_dtype="int8").floor.score_dtype == "int8"
    with pytest.raises(ValueError, match="'int8'"):
        Budget(score_dtype="int4")


# -- the selection ------------------------------------------------------------------------------------------------


def _int8(budget: Budget) -> Budget:
    return dataclasses.replace(budget, score_dtype="int8")


# (B, HQ, H, N, L, q_offset, D, tile, k_min, ratio); kv_start [0, 5]: the second sequence is left-padded
CASES = [
    (2, 6, 2, 300, 1, 299, 16, 8, 4, 0.2),      # decode, G = 3
    (1, 4, 4, 257, 1, 256, 8, 8, 60, 0.0),      # decode, G = 1, a fixed top-k
    (2, 3, 1, 161, 161, 0, 16, 4, 4, 0.3),      # prefill of a whole prompt, G = 3
    (2, 10, 2, 170, 23, 147, 24, 6, 3, 0.25),   # a chunk after 147 cached keys, its first query inside a tile, G = 5
    (1, 4, 2, 180, 180, 0, 100, 16, 24, 0.5),   # D = 100
]
IDS = ["B{}-HQ{}-H{}-N{}-L{}-off{}-D{}-T{}-kmin{}-r{}".format(*c) for c in CASES]


@pytest.mark.parametrize("rank_factor", [None, 1.5], ids=["set", "ranked"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_int8_selection_is_the_exact_selection_of_the_rounded_vectors(case, rank_factor):
    B, HQ, H, N, L, off, D, T, k_min, ratio = case
    q, k, _ = inputs(B, HQ, H, N, L, D, seed=N + L)
    exact = Budget(ratio=ratio, k_min=k_min, tile=T)
    kw = dict(scale=D ** -0.5, kv_start=torch.tensor([0, 5][:B]), q_offset=off, rank_factor=rank_factor)
    want = R.select(int8.rounded(q), int8.rounded(k), budget=exact, **kw)
    same_selection(R.select(q, k, budget=_int8(exact), **kw), want)
    same_selection(ops.select(q, k, budget=_int8(exact), **kw), want)  # the public op


def test_the_cases_are_not_vacuous():
    """On every case's inputs INT8 rounding selects other keys than exact scoring somewhere."""
    differs = []
    for B, HQ, H, N, L, off, D, T, k_min, ratio in CASES:
        q, k, _ = inputs(B, HQ, H, N, L, D, seed=N + L)
        kw = dict(scale=D ** -0.5, kv_start=torch.tensor([0, 5][:B]), q_offset=off)
        exact = Budget(ratio=ratio, k_min=k_min, tile=T)
        differs.append(not torch.equal(R.select(q, k, budget=exact, **kw).indices,
                                       R.select(q, k, budget=_int8(exact), **kw).indices))
    assert all(differs), differs


def test_int8_selection_matches_the_brute_force_spec_on_rounded_vectors():
    """Sets against tests/ops/brute_force.py on the rounded vectors (fp64); the sparse output over them is the
    masked attention of the *exact* q, k, v: INT8 picks keys, it does not compute outputs."""
    B, HQ, H, N, L, off, D, T, k_min, ratio = CASES[3]
    q, k, v = inputs(B, HQ, H, N, L, D, dtype=torch.float64, seed=N + L)
    budget = Budget(ratio=ratio, k_min=k_min, tile=T, score_dtype="int8")
    kw = dict(kv_start=torch.tensor([0, 5][:B]), q_offset=off)
    sel = ops.select(q, k, budget=budget, scale=D ** -0.5, **kw)
    want = bf.masks(int8.rounded(q), int8.rounded(k), budget=budget, scale=D ** -0.5, **kw)
    for b, (M, sets, start, n, l) in enumerate(want):
        for (h, t), keys in sets.items():
            row = sel.indices[b, h, t - int(sel.row_start[b])]
            assert set((row[row >= 0] - start).tolist()) == keys, (b, h, t)
    out = ops.sparse_attention(q, k, v, sel, scale=D ** -0.5, **kw)
    torch.testing.assert_close(out, bf.masked_attention(q, k, v, [m[0] for m in want], scale=D ** -0.5, **kw),
                               rtol=1e-10, atol=1e-10)


def test_static_cache_decode_scores_int8_like_the_host_form():
    B, N, slot = 3, 200, 181
    kv_start = [0, 9, 30]
    q, k, _ = inputs(B, 6, 3, N, 1, 16, seed=4)
    k[:, :, slot + 1:] = float("nan")  # unused slots of a static cache
    budget = Budget(ratio=0.25, k_min=4, score_dtype="int8")
    host = ops.plan_step(q, k, budget=budget, kv_start=torch.tensor(kv_start), q_offset=slot)
    device = ops.plan_step(q, k, budget=budget, kv_start=torch.tensor(kv_start), q_offset=torch.tensor(slot))
    assert device.meta is not None and host.meta is None
    want = ops.select(q, k, scale=0.3, step=host)
    got = ops.select(q, k, scale=0.3, step=device)
    width = want.indices.shape[-1]
    assert torch.equal(got.indices[..., :width], want.indices) and (got.indices[..., width:] == -1).all()


def test_int8_rounding_changes_which_key_is_selected_by_hand():
    """One KV head, one query head, D = 2, softmax scale 1, a budget of one key; q = (1, 1) quantises to (127, 127).
    Key 0 = (1, 0.0035): 0.0035 * 127 = 0.44 rounds to 0, so its INT8 score is 1 (exact: 1.0035). Key 1 = (1.002,
    0): (127, 0) at scale 1.002 / 127, INT8 score 1.002 (exact too). Key 2 (the query's own slot) scores -2. Exact
    scoring keeps key 0, INT8 scoring key 1; layer 0 scores exactly under either budget."""
    q = torch.tensor([1.0, 1.0], dtype=torch.float64).view(1, 1, 1, 2)
    k = torch.tensor([[1.0, 0.0035], [1.002, 0.0], [-2.0, 0.0]], dtype=torch.float64).view(1, 1, 3, 2)
    assert int8.quantize(k)[0][0, 0].tolist() == [[127, 0], [127, 0], [-127, 0]]
    exact, low = Budget(ratio=0.0, k_min=1), Budget(ratio=0.0, k_min=1, score_dtype="int8")
    assert ops.select(q, k, budget=exact, scale=1.0).indices.tolist() == [[[[0]]]]
    assert ops.select(q, k, budget=low, scale=1.0).indices.tolist() == [[[[1]]]]
    for b in (exact, low):
        assert ops.dense_select(q, k, k, budget=b, scale=1.0)[1].indices.tolist() == [[[[0]]]]


# -- the backends -------------------------------------------------------------------------------------------------
def test_triton_serves_int8_scoring_through_the_public_op(monkeypatch):
    """auto keeps the Triton backend for a budget with INT8 scoring, and the public op's Triton selection (the
    interpreter on the CPU) is the reference's, prefill and decode, static-cache decode included."""
    pytest.importorskip("triton")
    from kernel_checks import TEST_DEVICE, dev

    if TEST_DEVICE != "cpu":
        pytest.skip("the interpreter's exact sums: compiled, the kernel tests check INT8 selections with ties")
    monkeypatch.setattr(ops, "triton_unavailable_reason", lambda *a, **kw: None)  # as on a GPU
    assert ops.resolve_backend("auto", "cuda", torch.bfloat16, 64, 3, Budget(score_dtype="int8")) == "triton"
    monkeypatch.undo()
    budget = Budget(ratio=0.25, k_min=6, tile=8, score_dtype="int8")
    for L in (1, 40):  # decode, prefill
        q, k, _ = inputs(2, 6, 2, 170, L, 32, dtype=torch.bfloat16, seed=L)
        kv = {"kv_start": torch.tensor([0, 9]), "q_offset": 170 - L}
        want = ops.select(q, k, budget=budget, backend="reference", **kv)
        got = ops.select(dev(q), dev(k), budget=budget, backend="triton", **kv)
        assert torch.equal(got.indices.cpu().long(), want.indices), f"L={L}"
        assert not torch.equal(want.indices, ops.select(q, k, budget=dataclasses.replace(budget, score_dtype=None),
                                                        backend="reference", **kv).indices)
    step = ops.plan_step(dev(q[:, :, -1:]), dev(k), budget=budget, kv_start=torch.tensor([0, 9]),
                         q_offset=torch.tensor(169), backend="triton")
    got = ops.select(dev(q[:, :, -1:]), dev(k), scale=32 ** -0.5, step=step)
    want = ops.select(q[:, :, -1:], k, budget=budget, backend="reference", kv_start=torch.tensor([0, 9]), q_offset=169)
    width = want.indices.shape[-1]
    assert torch.equal(got.indices[..., :width].cpu().long(), want.indices)


def test_the_jax_ops_refuse_int8_scoring():
    pytest.importorskip("jax")
    import numpy as np

    from kascade import jax as kjax

    q, k, _ = (np.asarray(x) for x in inputs(1, 2, 1, 8, 1, 4))
    with pytest.raises(ValueError, match="INT8 scoring"):
        kjax.select(q, k, budget=Budget(score_dtype="int8"))


def test_a_plan_with_int8_scoring_runs_a_model_and_selects_otherwise(monkeypatch):
    model = tiny_llama()
    fp = ModelFingerprint.from_model(model)
    exact = KascadePlan(fp, (0, 2), ((0, 1),) * 4, ratio=0.25, k_min=4, tile=8)
    plan = exact.with_budget(score_dtype="int8")
    ids = torch.randint(0, 97, (2, 96), generator=torch.Generator().manual_seed(0))
    seen = []  # the anchors' selections (layer 2), per plan
    orig = ops.select
    monkeypatch.setattr(ops, "select", lambda *a, **kw: (seen.append(orig(*a, **kw)), seen[-1])[1])
    logits = {}
    for name, p in (("exact", exact), ("int8", plan)):
        with torch.no_grad(), kascade.enable(model, p, warn_uncalibrated=False) as h:
            logits[name] = model(ids).logits
            gen = model.generate(ids[:1, :40], max_new_tokens=4, do_sample=False)
        assert torch.isfinite(logits[name]).all() and gen.shape == (1, 44)
        assert h.runtime.backend == "reference"
    assert not torch.equal(seen[0].indices, seen[len(seen) // 2].indices)
    assert not torch.equal(logits["exact"], logits["int8"])
