"""The reference ops against the brute-force reading of the spec (tests/ops/brute_force.py)."""

import pytest
import torch

import brute_force as bf
from tolerance import assert_close_to_reference
from kascade.budget import Budget
from kascade.ops import dense_attention, reference, select, sparse_attention

# (B, HQ, H, N, L, D, tile, k_min, ratio): odd N, T not dividing N, G in {1, 2, 3, 4, 8}, D in {16, 64, 100, 128}.
# Every case with more than one tile selects keys, and in the five marked ones the rolling budget binds (the tile
# budgets differ between rolling and fixed; test_the_cases_exercise_selection_and_the_rolling_budget checks both).
CASES = [
    (1, 4, 4, 1, 1, 16, 32, 8, 0.1),
    (1, 2, 1, 37, 37, 16, 8, 2, 0.6),  # rolling binds
    (2, 6, 2, 97, 97, 64, 16, 8, 0.4),  # rolling binds
    (3, 9, 3, 130, 130, 100, 16, 16, 0.35),  # rolling binds
    (2, 8, 2, 257, 257, 16, 32, 8, 0.3),  # rolling binds
    (1, 8, 1, 700, 700, 128, 32, 128, 0.1),  # k_min dominates
    (2, 16, 2, 311, 311, 64, 64, 20, 0.45),  # rolling binds
    (2, 4, 4, 150, 150, 16, 32, 128, 0.1),  # budget capped by k(N) - T near the end
]
ROLLING_BINDS = {1, 2, 3, 4, 6}


def _inputs(B, HQ, H, N, L, D, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, L, D, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(B, H, N, D, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(B, H, N, D, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v


def _kv_start(B, N, L, q_offset, seed):
    """Different lengths per sequence: sequence 0 uses every slot, the others are left-padded."""
    g = torch.Generator().manual_seed(seed + 1)
    last = q_offset + L - 1
    return torch.tensor([0] + [int(torch.randint(0, last + 1, (1,), generator=g)) for _ in range(B - 1)])


def _ids(case):
    return "B{}-HQ{}-H{}-N{}-L{}-D{}-T{}-kmin{}-r{}".format(*case)


def _check_sets(sel, sets_per_seq, kv_start):
    for b, (M, sets, start, n, l) in enumerate(sets_per_seq):
        for (h, t), want in sets.items():
            row = t - int(sel.row_start[b])
            got = sel.indices[b, h, row]
            got = set((got[got >= 0] - start).tolist())
            assert got == want, f"seq {b} head {h} row {t}: {sorted(got ^ want)[:10]} differ"


def test_the_cases_exercise_selection_and_the_rolling_budget():
    """The prefill cases are not vacuous: each with a second tile selects keys in every sequence (left padding
    included), and where marked the rolling and fixed budgets select different keys."""
    for i, case in enumerate(CASES):
        B, HQ, H, N, L, D, T, k_min, ratio = case
        q, k, _ = _inputs(B, HQ, H, N, L, D, seed=N)
        kv_start = _kv_start(B, N, L, N - L, seed=N)
        sels = {r: select(q, k, budget=Budget(ratio=ratio, k_min=k_min, tile=T, rolling=r), scale=D**-0.5,
                          kv_start=kv_start) for r in (True, False)}
        counts = {r: (s.indices >= 0).sum(dim=(1, 2, 3)) for r, s in sels.items()}  # keys selected per sequence
        for b in range(B):
            if N - int(kv_start[b]) > T:
                assert counts[True][b] > 0 and counts[False][b] > 0, (case, b)
        if i in ROLLING_BINDS:
            assert counts[True][0] < counts[False][0], case
        else:
            assert torch.equal(counts[True], counts[False]), case


@pytest.mark.parametrize("rolling", [True, False], ids=["rolling", "fixed"])
@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_prefill_matches_brute_force(case, rolling):
    B, HQ, H, N, L, D, T, k_min, ratio = case
    budget = Budget(ratio=ratio, k_min=k_min, tile=T, rolling=rolling)
    q, k, v = _inputs(B, HQ, H, N, L, D, seed=N)
    kv_start = _kv_start(B, N, L, N - L, seed=N)
    scale = D**-0.5
    sel = select(q, k, budget=budget, scale=scale, kv_start=kv_start)
    want_masks = bf.masks(q, k, budget=budget, scale=scale, kv_start=kv_start, q_offset=N - L)
    _check_sets(sel, want_masks, kv_start)
    out = sparse_attention(q, k, v, sel, scale=scale, kv_start=kv_start)
    want = bf.masked_attention(q, k, v, [m[0] for m in want_masks], scale=scale, kv_start=kv_start, q_offset=N - L)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_decode_matches_brute_force(case):
    B, HQ, H, N, _, D, T, k_min, ratio = case
    budget = Budget(ratio=ratio, k_min=k_min, tile=T)
    q, k, v = _inputs(B, HQ, H, N, 1, D, seed=N + 7)
    kv_start = _kv_start(B, N, 1, N - 1, seed=N)
    sel = select(q, k, budget=budget, kv_start=kv_start)
    assert sel.decode and sel.indices.shape[2] == 1
    want_masks = bf.masks(q, k, budget=budget, scale=D**-0.5, kv_start=kv_start, q_offset=N - 1)
    _check_sets(sel, want_masks, kv_start)
    out = sparse_attention(q, k, v, sel, kv_start=kv_start)
    want = bf.masked_attention(q, k, v, [m[0] for m in want_masks], scale=D**-0.5, kv_start=kv_start, q_offset=N - 1)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("N,L,q_offset", [(200, 45, 155), (300, 77, 100), (129, 64, 65)], ids=str)
def test_chunked_prefill_matches_brute_force(N, L, q_offset):
    """A chunk of new queries attending to a cached prefix (and maybe unused cache slots after it)."""
    B, HQ, H, D = 2, 6, 3, 16
    budget = Budget(ratio=0.2, k_min=16, tile=16)
    q, k, v = _inputs(B, HQ, H, N, L, D, seed=L)
    kv_start = torch.tensor([0, 11])
    sel = select(q, k, budget=budget, kv_start=kv_start, q_offset=q_offset)
    want_masks = bf.masks(q, k, budget=budget, scale=D**-0.5, kv_start=kv_start, q_offset=q_offset)
    _check_sets(sel, want_masks, kv_start)
    out = sparse_attention(q, k, v, sel, kv_start=kv_start, q_offset=q_offset)
    want = bf.masked_attention(q, k, v, [m[0] for m in want_masks], scale=D**-0.5, kv_start=kv_start, q_offset=q_offset)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("L", [1, 33, 120], ids=lambda x: f"L{x}")
def test_dense_matches_brute_force(L):
    B, HQ, H, N, D = 3, 8, 2, 120, 100
    q, k, v = _inputs(B, HQ, H, N, L, D, seed=L)
    kv_start = _kv_start(B, N, L, N - L, seed=L)
    out = dense_attention(q, k, v, kv_start=kv_start)
    want = bf.masked_attention(q, k, v, bf.causal_masks(q, k, kv_start=kv_start, q_offset=N - L),
                               scale=D**-0.5, kv_start=kv_start, q_offset=N - L)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)


def test_padded_sequence_equals_running_alone():
    """Left padding changes nothing: a padded sequence gets exactly what it gets alone."""
    HQ, H, N, D, pad = 4, 2, 150, 16, 23
    budget = Budget(ratio=0.1, k_min=16, tile=16)
    q, k, v = _inputs(2, HQ, H, N, N, D, seed=3)
    kv_start = torch.tensor([0, pad])
    out = sparse_attention(q, k, v, select(q, k, budget=budget, kv_start=kv_start), kv_start=kv_start)
    qa, ka, va = q[1:, :, pad:], k[1:, :, pad:], v[1:, :, pad:]
    alone = sparse_attention(qa, ka, va, select(qa, ka, budget=budget))
    torch.testing.assert_close(out[1:, :, pad:], alone, rtol=0, atol=0)
    assert bool((out[1, :, :pad] == 0).all()), "padding queries must get zeros"


@pytest.mark.parametrize("rolling", [True, False], ids=["rolling", "fixed"])
@pytest.mark.parametrize("N", [1, 64, 256], ids=lambda n: f"N{n}")
def test_full_budget_is_dense(N, rolling):
    """ratio = 1 (k = N) reproduces dense attention in prefill (N a multiple of T, see test below) and decode."""
    B, HQ, H, D = 2, 6, 2, 16
    budget = Budget(ratio=1.0, k_min=1, tile=32, rolling=rolling)
    q, k, v = _inputs(B, HQ, H, N, N, D, seed=N)
    dense = dense_attention(q, k, v)
    torch.testing.assert_close(sparse_attention(q, k, v, select(q, k, budget=budget)), dense, rtol=1e-12, atol=1e-12)
    qd = q[:, :, -1:]
    torch.testing.assert_close(sparse_attention(qd, k, v, select(qd, k, budget=budget)), dense[:, :, -1:],
                               rtol=1e-12, atol=1e-12)


def test_full_budget_last_partial_tile_follows_the_spec():
    """With N not a multiple of T the spec's prefill budget min(s, k(N) - T) leaves the last, partial tile
    N - T earlier keys, not all s of them: ratio = 1 is then dense everywhere except that tile."""
    N, T = 100, 32
    budget = Budget(ratio=1.0, k_min=1, tile=T)
    q, k, _ = _inputs(1, 2, 1, N, N, 16, seed=5)
    counts = select(q, k, budget=budget).attended_counts()[0, 0]
    assert counts.tolist() == [0, 32, 64, N - T]


def test_chunking_does_not_change_results(monkeypatch):
    """Force many small chunks: the outputs must be the same as in one chunk."""
    B, HQ, H, N, D = 2, 6, 3, 203, 16
    budget = Budget(ratio=0.2, k_min=16, tile=16)
    q, k, v = _inputs(B, HQ, H, N, N, D, seed=9)
    kv_start = torch.tensor([0, 30])
    sel = select(q, k, budget=budget, kv_start=kv_start)
    out = sparse_attention(q, k, v, sel, kv_start=kv_start)
    dense = dense_attention(q, k, v, kv_start=kv_start)
    monkeypatch.setattr(reference, "_CHUNK_ELEMS", 5000)
    sel2 = select(q, k, budget=budget, kv_start=kv_start)
    assert torch.equal(sel.indices, sel2.indices)
    torch.testing.assert_close(sparse_attention(q, k, v, sel2, kv_start=kv_start), out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dense_attention(q, k, v, kv_start=kv_start), dense, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_low_precision_inputs(dtype):
    """fp32 math inside, input dtype out; error against fp64 within twice the error of rounding the output."""
    B, HQ, H, N, D = 1, 4, 2, 160, 64
    budget = Budget(ratio=0.25, k_min=16, tile=32)
    q, k, v = _inputs(B, HQ, H, N, N, D, seed=1)
    sel = select(q, k, budget=budget)
    want = sparse_attention(q, k, v, sel)
    ql, kl, vl = q.to(dtype), k.to(dtype), v.to(dtype)
    got = sparse_attention(ql, kl, vl, sel)
    assert got.dtype == dtype
    assert_close_to_reference(got, want, sparse_attention(ql.double(), kl.double(), vl.double(), sel).to(dtype))


def test_huge_tile_and_short_call_allocate_only_what_the_call_needs(monkeypatch):
    """A chunk of one tile lays out only the call's queries, in blocks: a tile of 10**6 for 40 tokens works (it
    used to lay out 10**6 query rows squared) and every block size gives the brute-force result."""
    B, HQ, H, N, D = 1, 4, 2, 40, 16
    q, k, v = _inputs(B, HQ, H, N, N, D, seed=21)
    huge = Budget(ratio=0.5, k_min=4, tile=10**6)
    sel = select(q, k, budget=huge)
    assert sel.indices.shape[2] == 1 and (sel.indices >= 0).sum() == 0  # one tile, no earlier keys: all own tile
    torch.testing.assert_close(sparse_attention(q, k, v, sel), dense_attention(q, k, v), rtol=1e-12, atol=1e-12)
    # a chunked call inside one tile of 64: selected keys before it would be none; own-tile keys before the chunk
    budget = Budget(ratio=0.5, k_min=4, tile=64)
    qc = q[:, :, 25:]
    scale = D**-0.5
    sel = select(qc, k, budget=budget, q_offset=25)
    masks = bf.masks(qc, k, budget=budget, scale=scale, kv_start=torch.tensor([0]), q_offset=25)
    want = bf.masked_attention(qc, k, v, [m for m, *_ in masks], scale=scale, kv_start=torch.tensor([0]), q_offset=25)
    for elems in (1 << 26, 300, 1):  # one block, a few, one query per block
        monkeypatch.setattr(reference, "_CHUNK_ELEMS", elems)
        got = sparse_attention(qc, k, v, sel, q_offset=25)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        pooled = list(reference.iter_pooled_prefill(qc[0], k[0], scale, 64))
        assert len(pooled) == 1 and pooled[0][1].shape == (H, 1, N)
        full = bf.full_probs(qc[0], k[0], scale).view(H, HQ // H, 15, N).sum((1, 2))
        torch.testing.assert_close(pooled[0][1][:, 0], full, rtol=1e-10, atol=1e-10)
