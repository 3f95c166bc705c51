"""Triton prefill kernels (kascade.ops.triton.prefill) against the reference ops, on the test device (the Triton
interpreter on the CPU, or CUDA with KASCADE_TEST_DEVICE=cuda: tests/conftest.py).

Fresh random inputs at small, deliberately odd sizes: odd N, tiles that do not divide N, every G in 1..16 that
real models use, D in {64, 128, 256}, T in {16, 32, 64}, fp16 and bf16, different lengths in one batch (left
padding), chunked prefill (q_offset > 0, first query mid-tile) and unused cache slots after the queries. Cache slots
that no sequence may read hold NaN and outputs start as NaN, so a stray read or an unwritten output cannot pass.
Tolerance (STYLE.md): the error against the fp64 reference is at most twice the error of the reference's own
result rounded to the low precision, plus a tiny atol. Selections are compared as sets; a difference passes only
where the reference's pooled scores of the differing keys tie the tile's k-th largest within rounding. Inputs are
drawn on the CPU, kernels run on the device (kernel_checks.dev), references on the CPU.
"""

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be tested")
import triton.language as tl  # noqa: E402

from kascade.budget import Budget  # noqa: E402
from kernel_checks import (FP8_RTOL, check_close, check_lse, check_prefill_selection, dev,  # noqa: E402
                           dev_selection, host_selection, masters, nan_like, poison, pooled_prefill_rows, scoring_hist,
                           sized)
from kascade.ops import prefill_chunks, reference  # noqa: E402
from kascade.ops.triton import prefill as tp  # noqa: E402
from kascade.ops.triton import topk  # noqa: E402

# (B, H, G, N, L, D, T, dtype, chunked): L < N - tail leaves a cached prefix (chunked prefill) when chunked. N and L
# grow with the test device's size scale.
CASES = [
    (2, 2, 1, 77, 77, 64, 16, torch.bfloat16, False),
    (2, 1, 2, 101, 57, 128, 32, torch.float16, True),
    (2, 1, 3, 93, 93, 64, 16, torch.float16, False),
    (2, 2, 4, 131, 70, 128, 32, torch.bfloat16, True),
    (1, 1, 4, 83, 83, 256, 16, torch.float16, False),
    (2, 1, 6, 99, 60, 64, 32, torch.bfloat16, True),
    (2, 1, 8, 71, 71, 128, 16, torch.bfloat16, False),
    (2, 1, 16, 80, 45, 64, 32, torch.float16, True),
    (1, 1, 5, 143, 143, 64, 64, torch.bfloat16, False),
]
CASES = [(B, H, G, sized(N), sized(L), *rest) for B, H, G, N, L, *rest in CASES]


def _id(c):
    B, H, G, N, L, D, T, dt, ch = c
    return f"B{B}-H{H}-G{G}-N{N}-L{L}-D{D}-T{T}-{str(dt).split('.')[-1]}{'-chunked' if ch else ''}"


def _budget(T):
    return Budget(ratio=0.5, k_min=5, tile=T)  # k(N) > T at these sizes: tiles select keys


def _inputs(case, seed):
    """fp64 masters q, k, v; kv_start (sequence 0 full, others left-padded, one possibly past q_offset so some
    queries are padding); q_offset; the number of unused slots after the queries."""
    B, H, G, N, L, D, T, dt, chunked = case
    g = torch.Generator().manual_seed(seed)
    tail = 3 if chunked else 0  # unused cache slots after the last query
    q_offset = N - L - tail
    q, k, v = masters(g, B, H, G, L, N, D)
    hi = q_offset + L - 2 * T - 1  # every sequence keeps at least two tiles of keys
    starts = [0] + [int(torch.randint(1, max(2, hi), (1,), generator=g)) for _ in range(B - 1)]
    return q, k, v, torch.tensor(starts), q_offset


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_prefill_kernels_match_reference(case):
    B, H, G, N, L, D, T, dt, chunked = case
    seed = N * 31 + G * 7 + D
    q64, k64, v64, kv_start, q_offset = _inputs(case, seed)
    q, k, v = q64.to(dt), k64.to(dt), v64.to(dt)
    scale = D**-0.5
    budget = _budget(T)
    end = q_offset + L
    qd, kk, vv = dev(q), dev(poison(k, kv_start, end)), dev(poison(v, kv_start, end))
    pos = {"scale": scale, "kv_start": kv_start, "q_offset": q_offset}
    # small blocks so that several query / key blocks and row blocks are exercised at these tiny sizes
    blk = {"block_m": 32 if G * 8 <= 32 else 64, "block_n": 16}

    # dense (+ LSE)
    want = reference.dense_attention(q64, k64, v64, **pos)
    lowp = reference.dense_attention(q, k, v, **pos)
    got, lse = tp.dense_prefill(qd, kk, vv, return_lse=True, out=nan_like(qd), **pos, **blk)
    check_close(got, want, lowp, "dense", floor=1e-5)
    lse_only = tp.prefill_lse(qd, kk, **pos, **blk)
    # the LSE against fp64 logsumexp of the valid causal rows
    check_lse(lse, q, k, kv_start, q_offset, scale, "LSE")
    check_lse(lse_only, q, k, kv_start, q_offset, scale, "QK-only LSE")

    # selection: given the LSE, computing its own, with a buffer so small that every chunk is one tile, with
    # chunks of a few tiles (their budgets differ: the chunk's largest one sizes its top-k), and int32 indices
    want_sel = reference.select(q, k, budget=budget, **pos)
    pooled = pooled_prefill_rows(q, k, kv_start, q_offset, scale, T)
    # about 3 tiles per chunk: a row's buffer plus its top-k temporaries (the radix select's histograms, or
    # torch.topk's values and indices)
    few = B * H * 3 * (4 * N + 4 * topk.NHIST + 64 * budget.k(N))
    few_topk = B * H * 3 * (4 * N + 40 * budget.k(N))
    for what, kw in (("given lse", {"lse": lse}), ("own lse", {}), ("one-tile chunks", {"max_chunk_bytes": 1}),
                     ("few-tile chunks", {"max_chunk_bytes": few}), ("int32", {"index_dtype": torch.int32}),
                     ("16-row scoring blocks", {"scoring": {"block_m": 16}}),
                     ("exponentials on the FMA pipes", {"scoring": {"fma_exp": 1}}),
                     ("every other group on them", {"scoring": {"fma_exp": 2}}),
                     ("torch.topk", {"method": "topk"}),
                     ("torch.topk, few-tile chunks", {"method": "topk", "max_chunk_bytes": few_topk})):
        kw = {**kw, "scoring": tp.Launch(block_n=16, **kw.get("scoring", {}))}
        sel = tp.select_prefill(qd, kk, budget=budget, **pos, **kw)
        if what == "int32":
            assert sel.indices.dtype == torch.int32
            sel = type(sel)(sel.indices.long(), sel.row_start, sel.tile, sel.decode)
        check_prefill_selection(sel, want_sel, pooled, kv_start, q_offset, L, budget, f"select/{what}")

    # sparse over the reference's selection, int64 and int32 indices, each block's indices loaded in its iteration
    # or the iteration before (prefetch; the launcher picks one per head dim)
    want = reference.sparse_attention(q64, k64, v64, want_sel, **pos)
    lowp = reference.sparse_attention(q, k, v, want_sel, **pos)
    for idt, prefetch in ((torch.int64, False), (torch.int32, False), (torch.int32, True)):
        s = type(want_sel)(want_sel.indices.to(idt), want_sel.row_start, want_sel.tile, False)
        got = tp.sparse_prefill(qd, kk, vv, dev_selection(s), out=nan_like(qd), prefetch=prefetch, **pos, **blk)
        check_close(got, want, lowp, f"sparse {idt}{' prefetch' if prefetch else ''}", floor=1e-5)

    # the anchor path end to end: its output over its own selection
    out_a, sel_a = tp.anchor_prefill(qd, kk, vv, budget=budget, **pos)
    check_prefill_selection(sel_a, want_sel, pooled, kv_start, q_offset, L, budget, "anchor selection")
    sel_a = host_selection(sel_a)
    want = reference.sparse_attention(q64, k64, v64, sel_a, **pos)
    check_close(out_a, want, reference.sparse_attention(q, k, v, sel_a, **pos), "anchor output", floor=1e-5)


def test_padding_queries_get_zeros_and_chunk_starts_mid_tile():
    """A sequence whose first valid key comes after the first query slot (queries at padding slots), in a
    chunked call whose first query sits mid-tile: outputs of padding queries are exactly zero."""
    B, H, G, D, T = 2, 1, 2, 64, 16
    N, L = 90, 50
    q_offset = N - L  # 40: mid-tile for sequence 0 (tile 2 starts at 32)
    kv_start = torch.tensor([0, 55])  # sequence 1: slots 40..54 are padding queries
    g = torch.Generator().manual_seed(11)
    q = torch.randn(B, H * G, L, D, generator=g).to(torch.bfloat16)
    k = torch.randn(B, H, N, D, generator=g).to(torch.bfloat16)
    v = torch.randn(B, H, N, D, generator=g).to(torch.bfloat16)
    qd, kk, vv = dev(q), dev(poison(k, kv_start, N)), dev(poison(v, kv_start, N))
    pos = {"scale": D**-0.5, "kv_start": kv_start, "q_offset": q_offset}
    budget = _budget(T)
    sel = reference.select(q, k, budget=budget, **pos)
    assert int(sel.row_start[0]) == 2 and int(sel.row_start[1]) == 0
    dense = tp.dense_prefill(qd, kk, vv, out=nan_like(qd), **pos).cpu()
    sparse = tp.sparse_prefill(qd, kk, vv, dev_selection(sel), out=nan_like(qd), **pos).cpu()
    for got in (dense, sparse):
        assert torch.equal(got[1, :, :15], torch.zeros_like(got[1, :, :15]))
        assert not torch.isnan(got).any() and bool((got[1, :, 15:] != 0).any())
    check_close(sparse, reference.sparse_attention(q.double(), k.double(), v.double(), sel, **pos),
                reference.sparse_attention(q, k, v, sel, **pos), "sparse with padding queries", floor=1e-5)


def test_selection_chunks_bound_the_buffer(monkeypatch):
    """The score buffer of one chunk never exceeds max_chunk_bytes (the top-k temporaries counted), and splitting
    the tiles into many chunks gives the same selection as one chunk."""
    B, H, G, D, T = 1, 2, 2, 64, 16
    N = 160
    g = torch.Generator().manual_seed(5)
    q = dev(torch.randn(B, H * G, N, D, generator=g).to(torch.float16))
    k = dev(torch.randn(B, H, N, D, generator=g).to(torch.float16))
    budget = Budget(ratio=0.25, k_min=4, tile=T)
    sizes = []
    real_empty = torch.empty

    def spy(*shape, **kw):
        t = real_empty(*shape, **kw)
        if kw.get("dtype") == torch.float32 and len(shape) == 4 and shape[:2] == (B, H):
            sizes.append(t.numel() * 4)
        return t

    lse = tp.prefill_lse(q, k, scale=D**-0.5)
    one = tp.select_prefill(q, k, budget=budget, scale=D**-0.5, lse=lse)
    monkeypatch.setattr(tp.torch, "empty", spy)
    many = tp.select_prefill(q, k, budget=budget, scale=D**-0.5, lse=lse, max_chunk_bytes=8192)
    monkeypatch.undo()
    assert len(sizes) > 2, "the small bound should split the tiles into several chunks"
    assert max(sizes) <= 8192
    assert torch.equal(one.indices, many.indices)


def test_selection_scratch_stays_within_the_bound(monkeypatch):
    """Everything the selection allocates besides its result -- the LSE it computes, the per-row metadata of all
    chunks, and each chunk's score buffer, histograms, bin-search state and counts -- adds up to at most
    max_chunk_bytes (less the allocator's reserve), for bounds that make a few chunks or many."""
    B, H, G, D, T = 2, 2, 2, 64, 16
    N = sized(200)
    g = torch.Generator().manual_seed(6)
    q = dev(torch.randn(B, H * G, N, D, generator=g).to(torch.float16))
    k = dev(torch.randn(B, H, N, D, generator=g).to(torch.float16))
    budget = Budget(ratio=0.25, k_min=4, tile=T)
    want = tp.select_prefill(q, k, budget=budget, scale=D**-0.5)
    lse_bytes = 4 * B * H * G * N
    row = 4 * topk.NHIST + 4 * N + 64  # a chunk row's histograms and buffer, about
    for bound in (lse_bytes + 3 * B * H * row, lse_bytes + 7 * B * H * row):
        allocs = []
        real_empty, real_zeros = torch.empty, torch.zeros

        def spy(real):
            def make(*shape, **kw):
                t = real(*shape, **kw)
                allocs.append((t.dtype, tuple(t.shape), t.numel() * t.element_size()))
                return t
            return make

        monkeypatch.setattr(torch, "empty", spy(real_empty))
        monkeypatch.setattr(torch, "zeros", spy(real_zeros))
        got = tp.select_prefill(q, k, budget=budget, scale=D**-0.5, max_chunk_bytes=bound)
        monkeypatch.undo()
        assert torch.equal(got.indices.cpu(), want.indices.cpu())
        # the allocations in order: the LSE, the metadata, then per chunk its buffer [B, H, C, W] and the rest
        fixed, chunks = 0, []
        for dtype, shape, nbytes in allocs:
            if dtype == torch.float32 and len(shape) == 4 and shape[:2] == (B, H):
                chunks.append(nbytes)  # a chunk's score buffer opens its group
            elif chunks:
                chunks[-1] += nbytes
            else:
                fixed += nbytes
        assert len(chunks) > 1 and fixed >= lse_bytes
        reserve = int(bound * prefill_chunks.ALLOCATOR_RESERVE)
        assert fixed + max(chunks) <= bound - reserve, (bound, fixed, max(chunks))


def test_selection_makes_the_lse_a_group_of_sequences_at_a_time(monkeypatch):
    """With a bound too small for the whole batch's LSE, the selection makes it for one sequence at a time (left
    padding and chunked prefill included) and selects the same keys; each LSE made covers one sequence."""
    case = (3, 2, 3, sized(90), sized(60), 64, 16, torch.bfloat16, True)
    B, H, G, N, L, D, T, dt, _ = case
    q64, k64, _, kv_start, q_offset = _inputs(case, 11)
    q, k = dev(q64.to(dt)), dev(k64.to(dt))
    pos = {"scale": D**-0.5, "kv_start": kv_start, "q_offset": q_offset, "budget": _budget(T)}
    whole = tp.select_prefill(q, k, **pos)
    assert prefill_chunks.lse_group(B, H * G, L, 64 << 20) == B
    made = []
    real = tp.prefill_lse
    monkeypatch.setattr(prefill_chunks, "lse_group", lambda *a: 1)
    monkeypatch.setattr(tp, "prefill_lse", lambda q, *a, **kw: made.append(q.shape[0]) or real(q, *a, **kw))
    grouped = tp.select_prefill(q, k, **pos)
    assert made == [1] * B
    assert torch.equal(grouped.indices.cpu(), whole.indices.cpu())
    assert torch.equal(grouped.row_start.cpu(), whole.row_start.cpu())


def test_selection_hands_its_lse_launch_to_the_lse_pass_and_refuses_it_with_the_lse_given(monkeypatch):
    """lse_launch= goes to the LSE pass (its fields set, as keywords); with the LSE given there is no such pass, and
    a launch for it would be dropped without a word (a sweep timing "options" that change nothing): refused."""
    B, H, G, N, D, T = 1, 1, 2, 40, 64, 16
    g = torch.Generator().manual_seed(5)
    q = dev(torch.randn(B, H * G, N, D, generator=g))
    k = dev(torch.randn(B, H, N, D, generator=g))
    lse = tp.prefill_lse(q, k, scale=D**-0.5)
    with pytest.raises(AssertionError, match="LSE is given"):
        tp.select_prefill(q, k, scale=D**-0.5, budget=_budget(T), lse=lse, lse_launch=tp.Launch(block_m=64))
    seen = []
    real = tp.prefill_lse
    monkeypatch.setattr(tp, "prefill_lse", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    tp.select_prefill(q, k, scale=D**-0.5, budget=_budget(T), lse_launch=tp.Launch(block_m=64, num_warps=2))
    assert len(seen) == 1 and seen[0]["block_m"] == 64 and seen[0]["num_warps"] == 2 and "block_n" not in seen[0]


def test_sparse_prefill_with_counts_attends_each_rows_prefix():
    """counts=: row r of sequence b attends only the first counts[b, r] entries of its index row, whatever their
    order (a ranked selection's prefix): the same output as the rows cut to that prefix, sorted, -1 padded."""
    from kascade.ops.selection import Selection

    B, H, G, D, T = 2, 2, 2, 64, 16
    N = L = 96
    g = torch.Generator().manual_seed(13)
    q = torch.randn(B, H * G, L, D, generator=g)
    k = torch.randn(B, H, N, D, generator=g)
    v = torch.randn(B, H, N, D, generator=g)
    pos = {"scale": D**-0.5, "kv_start": torch.tensor([0, 20]), "q_offset": 0}
    R, K = N // T, 40
    idx = torch.full((B, H, R, K), -1, dtype=torch.int32)
    counts = torch.zeros(B, R, dtype=torch.int32)
    for b, start in enumerate((0, 20)):
        for r in range(R):
            before = r * T  # keys strictly before tile r (positions relative to the sequence's first key)
            if before == 0 or before >= N - start:
                continue
            m = min(K, before)
            counts[b, r] = int(torch.randint(1, m + 1, (1,), generator=g))
            for h in range(H):
                idx[b, h, r, :m] = (torch.randperm(before, generator=g)[:m] + start).to(torch.int32)
    cut = torch.where(torch.arange(K) < counts[:, None, :, None], idx, -1).long()
    big = torch.iinfo(torch.long).max
    cut = torch.where(cut < 0, big, cut).sort(-1).values
    cut = torch.where(cut == big, -1, cut)
    rs = torch.zeros(B, dtype=torch.long)
    q, k, v, counts = dev(q), dev(k), dev(v), dev(counts)
    got = tp.sparse_prefill(q, k, v, dev_selection(Selection(idx, rs, T, False)), counts=counts, **pos)
    want = tp.sparse_prefill(q, k, v, dev_selection(Selection(cut, rs, T, False)), **pos)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    full = tp.sparse_prefill(q, k, v, dev_selection(Selection(idx, rs, T, False)), **pos)
    assert not torch.allclose(got, full), "the counts changed nothing"


@pytest.mark.parametrize("src_heads,hmap", [(2, (1, 1)), (3, (2, 0))], ids=["own", "more-heads"])
def test_a_head_map_is_read_in_place_by_the_sparse_prefill_pass(monkeypatch, src_heads, hmap):
    """sparse_attention(heads=map) on a Triton prefill step: the kernel reads the selection through the map (no
    copy: Selection.take_heads is not called), with the output of the selection taken through it (bit for bit),
    the reference's within the tolerance; the selection may have more heads than the layer."""
    from kascade.ops import plan_step, select, sparse_attention
    from kascade.ops.selection import Selection

    B, H, G, D, T = 2, 2, 2, 64, 16
    N = L = 96
    g = torch.Generator().manual_seed(17)
    q64, k64, v64 = masters(g, B, H, G, L, N, D)
    qb, kb, vb = (x.to(torch.bfloat16) for x in (q64, k64, v64))
    budget = Budget(ratio=0.25, k_min=8, tile=T)
    kv_start = torch.tensor([0, 20])
    pos = dict(scale=D**-0.5, kv_start=kv_start, q_offset=0)
    sel = select(qb, kb, budget=budget, **pos)
    if src_heads > H:  # a rank's gathered selection: more heads than it runs
        sel = Selection(torch.cat([sel.indices, sel.indices[:, :1]], 1), sel.row_start, T, False)
    hm = torch.tensor(hmap)
    q, k, v = dev(qb), dev(kb), dev(vb)
    step = plan_step(q, k, budget=budget, kv_start=kv_start, q_offset=0, backend="triton")
    dsel = dev_selection(Selection(sel.indices.to(torch.int32), sel.row_start, T, False))
    want = sparse_attention(q, k, v, dsel.take_heads(dev(hm)), scale=D**-0.5, step=step)
    taken = []
    monkeypatch.setattr(Selection, "take_heads", lambda self, m: taken.append(m))
    got = sparse_attention(q, k, v, dsel, scale=D**-0.5, step=step, heads=dev(hm))
    assert taken == [] and torch.equal(got, want)
    monkeypatch.undo()
    exact = sparse_attention(qb.double(), kb.double(), vb.double(), sel, heads=hm, **pos)
    check_close(got, exact, sparse_attention(qb, kb, vb, sel.take_heads(hm), **pos), "sparse prefill through a map")


def test_rows_into_writes_offset_slots_into_strided_rows():
    """topk.rows_into, prefill's radix select of a chunk of rows in place: each row's top keys as offset slots
    (meta's first column) written into a strided view of a larger index tensor (row r at out[r // out_rows,
    r % out_rows]), -1 padded to kc, the rest of that tensor untouched; two chunks of different widths side by
    side, int32 and int64 outputs. Against a sort on the host."""
    g = torch.Generator().manual_seed(9)
    G_, C_, K = 3, 4, 40  # out: [G_, 2 * C_, K]: two chunks of C_ rows per group, side by side
    for dtype in (torch.int64, torch.int32):
        out = dev(torch.full((G_, 2 * C_, K), -7, dtype=dtype))
        want = torch.full((G_, 2 * C_, K), -7, dtype=dtype)
        for part, W in enumerate((sized(300), sized(120) + 3)):
            R = G_ * C_
            vals = torch.rand(R, W, generator=g) ** 6
            vals[0, : W // 2] = vals[0, 0]  # ties across the threshold
            cand = torch.randint(W // 2, W + 1, (R,), generator=g)
            for r in range(R):
                vals[r, int(cand[r]):] = float("-inf")
            counts = torch.minimum(cand, torch.randint(0, K - 5, (R,), generator=g))
            offsets = torch.randint(0, 1000, (R,), generator=g)
            meta = torch.stack([offsets, torch.full((R,), W), counts, torch.zeros(R, dtype=torch.long)], -1)
            kc = K - 2  # the write pads to kc, leaving the last two entries of each row as they were
            hist = dev(torch.zeros(R, topk.NHIST, dtype=torch.int32))
            mass = float(vals.clamp(min=0).sum(-1).max())
            topk.rows_into(dev(vals), dev(meta.to(torch.int32)), hist, kc, out[:, part * C_:(part + 1) * C_],
                           out_rows=C_, mass=mass, chunk=64)
            for r in range(R):
                c = int(counts[r])
                top = sorted(sorted(range(int(cand[r])), key=lambda j: (-float(vals[r, j]), j))[:c])
                row = want[r // C_, part * C_ + r % C_]
                row[:kc] = -1
                row[:c] = torch.tensor(top, dtype=dtype) + int(offsets[r])
        assert torch.equal(out.cpu(), want), dtype


@pytest.mark.parametrize("mass", ["row-sum", "none"])
def test_rows_into_needs_only_the_hot_bins_zeroed(mass):
    """The scoring passes zero only the histogram bins every selection counts into and the tickets
    (topk.zero_hist: topk.HOT of them); a row that takes the fallback path (no bound: every row) zeroes the others
    itself before counting into them. Bins beyond HOT hold garbage here; the selection is exact all the same."""
    g = torch.Generator().manual_seed(21)
    R, W = 6, sized(500) + 5
    vals = torch.rand(R, W, generator=g) ** 4
    counts = torch.randint(1, W // 3, (R,), generator=g)
    zeros = torch.zeros(R, dtype=torch.long)
    meta = torch.stack([zeros, torch.full((R,), W), counts, zeros], -1)
    hist = scoring_hist(R)
    kc = int(counts.max())
    out = dev(torch.full((R, 1, kc), -7, dtype=torch.long))
    bound = float(vals.sum(-1).max()) if mass == "row-sum" else None
    topk.rows_into(dev(vals), dev(meta.to(torch.int32)), dev(hist), kc, out, mass=bound, chunk=64)
    for r in range(R):
        c = int(counts[r])
        top = sorted(sorted(range(W), key=lambda j: (-float(vals[r, j]), j))[:c])
        assert out[r, 0, :c].cpu().tolist() == top, f"row {r}"
        assert (out[r, 0, c:] == -1).all()


@pytest.mark.parametrize("mass", ["row-sum", "none", "too-small"])
@pytest.mark.parametrize("ranked", [False, True], ids=["sets", "ranked"])
def test_row_topk_is_exact_with_ties_and_padding(ranked, mass):
    """The radix select over rows of candidates (prefill's top-k, method="radix") against a sort on the host: rows
    with -inf tails (keys at or after the tile), counts from 0 to every candidate, runs of equal values across the
    threshold (ties go to the earliest positions), values of very different magnitudes, several programs per row
    (the last one to finish each pass makes the next pass's bin search). ``mass``: a true bound of the rows' sums
    (the exponent window decides most rows), none (the fallback path for every row) or one far too small (the
    k-th key above the window: the fallback again); all exact."""
    g = torch.Generator().manual_seed(5)
    R, W = 12, sized(300) + 7
    vals = torch.rand(R, W, generator=g) ** 8  # many exponents
    vals[1] = 0.25  # one value everywhere: every candidate ties
    vals[2, ::3] = vals[2, 0]  # a run of equal values spread along the row
    vals[3] = (torch.rand(W, generator=g) * 4).floor() / 4  # four levels, many ties at each
    cand = torch.randint(0, W + 1, (R,), generator=g)
    cand[0], cand[4], cand[5] = W, 0, 1
    for r in range(R):
        vals[r, int(cand[r]):] = float("-inf")
    counts = torch.minimum(cand, torch.randint(0, W, (R,), generator=g))
    counts[0], counts[1], counts[2] = W, int(cand[1]) // 2, int(cand[2]) // 3
    counts[6] = 0
    kc = int(counts.max()) + 3
    total = float(vals.clamp(min=0).sum(-1).max())
    bound = {"row-sum": total, "none": None, "too-small": total * 2.0**-80}[mass]
    got = topk.row_topk(dev(vals), dev(counts.to(torch.int32)), kc, ranked=ranked, chunk=64, mass=bound).cpu()
    assert got.shape == (R, kc) and got.dtype == torch.long
    for r in range(R):
        c = int(counts[r])
        # the expected keys: by value descending, ties by position ascending
        order = sorted(range(int(cand[r])), key=lambda j: (-float(vals[r, j]), j))[:c]
        want = order if ranked else sorted(order)
        assert got[r, :c].tolist() == want, f"row {r}"
        assert (got[r, c:] == -1).all(), f"row {r}: padding"


@triton.jit
def _exp2_fma_kernel(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, tp._exp2_fma(tl.load(X + offs, mask=offs < n, other=0.0)), mask=offs < n)


def test_exp2_on_the_fma_pipes_is_as_accurate_as_the_sfu():
    """The scoring pass's polynomial 2**x (``fma_exp``) for its x <= 0: relative error within 2.5e-7 over the
    normal range (MUFU.EX2's is about 2e-7), 0 where the result would be subnormal and at -inf."""
    x = torch.cat([torch.linspace(-126.0, 0.0, sized(20001)), torch.rand(sized(4000)) * -126.0,
                   torch.tensor([0.0, -0.0, -1e-30, -0.5, -0.75, -125.5, -126.0, -126.001, -200.0,
                                 float("-inf")])])
    y = torch.empty_like(x)
    xd, yd = dev(x), dev(y)
    _exp2_fma_kernel[(triton.cdiv(x.numel(), 1024),)](xd, yd, x.numel(), BLOCK=1024)
    y = yd.cpu().double()
    want = torch.exp2(x.double())
    normal = x >= -126.0
    rel = ((y - want).abs() / want)[normal]
    assert rel.max() <= 2.5e-7, (float(rel.max()), float(x[normal][rel.argmax()]))
    assert (y[~normal] == 0).all()


# Layer 0 of a prompt read from its first slot (no left padding, q_offset 0), with and without tp.CUDNN_LAYER0: on a
# Hopper GPU with it, its dense pass is cuDNN's attention with its LSE (tp._cudnn_dense), elsewhere dense_prefill; both
# against the reference, cache slots after the prompt poisoned.
FROM_START = [(2, 2, 4, 96, 96, 128, 32, torch.bfloat16), (1, 3, 3, 77, 77, 64, 16, torch.float16),
              (2, 1, 1, 70, 70, 64, 32, torch.bfloat16), (1, 1, 4, 83, 83, 256, 16, torch.float16)]


@pytest.mark.parametrize("cudnn", [True, False], ids=["cudnn-on", "cudnn-off"])
@pytest.mark.parametrize("case", FROM_START, ids=[_id((*c, False)) for c in FROM_START])
def test_layer0_of_a_prompt_from_its_start_matches_reference(case, cudnn, monkeypatch):
    B, H, G, N, L, D, T, dt = case
    q64, k64, v64 = masters(torch.Generator().manual_seed(N * 13 + D), B, H, G, L, N + 5, D)
    q, k, v = q64.to(dt), k64.to(dt), v64.to(dt)
    kv_start = torch.zeros(B, dtype=torch.long)
    pos = {"scale": D**-0.5, "kv_start": kv_start, "q_offset": 0}
    served = []
    fast = tp._cudnn_dense
    monkeypatch.setattr(tp, "_cudnn_dense", lambda *a: served.append(fast(*a)) or served[-1])
    monkeypatch.setattr(tp, "CUDNN_LAYER0", cudnn)
    budget = _budget(T)
    qd = dev(q.transpose(1, 2).contiguous()).transpose(1, 2)  # [B, HQ, L, D] as a model's view hands it
    out, sel = tp.dense_select_prefill(qd, dev(poison(k, kv_start, L)), dev(poison(v, kv_start, L)), budget=budget,
                                       **pos)
    ref = {"kv_start": kv_start, "q_offset": 0, "scale": pos["scale"]}
    k64, v64, k, v = k64[:, :, :L], v64[:, :, :L], k[:, :, :L], v[:, :, :L]
    check_close(out, reference.dense_attention(q64, k64, v64, **ref), reference.dense_attention(q, k, v, **ref),
                "layer 0 output", floor=1e-5)
    check_prefill_selection(sel, reference.select(q, k, budget=budget, **ref),
                            pooled_prefill_rows(q, k, kv_start, 0, pos["scale"], T), kv_start, 0, L, budget,
                            "layer 0 selection")
    hopper = qd.is_cuda and torch.cuda.get_device_capability()[0] >= 9
    assert (served[0] is not None) == (cudnn and hopper and D in (64, 128)), "cuDNN serves layer 0 where it should"


# FP8 scoring (kascade.ops.fp8): the kernels quantise q and k once and both passes score in e4m3; by definition the
# selection is the reference's on the rounded vectors (fp8.rounded), up to the order of the fp32 sums.
FP8_CASES = [case for i, case in enumerate(CASES) if i in (0, 1, 3, 4, 7)]


@pytest.mark.parametrize("case", FP8_CASES, ids=[_id(c) for c in FP8_CASES])
def test_fp8_scoring_selects_what_the_reference_selects_on_rounded_vectors(case):
    from kascade.ops import fp8

    B, H, G, N, L, D, T, dt, chunked = case
    q64, k64, _, kv_start, q_offset = _inputs(case, N * 17 + G * 3 + D)
    q, k = q64.to(dt), k64.to(dt)
    pos = {"scale": D**-0.5, "kv_start": kv_start, "q_offset": q_offset}
    exact, by_fp8 = _budget(T), Budget(ratio=0.5, k_min=5, tile=T, score_dtype="fp8")
    qr, kr = fp8.rounded(q), fp8.rounded(k)
    kk = dev(poison(k, kv_start, q_offset + L))  # a NaN key's vector gets a NaN scale: it must stay unread
    pooled = pooled_prefill_rows(qr, kr, kv_start, q_offset, pos["scale"], T)

    # the LSE pass of e4m3 inputs against fp64 logsumexp of the rounded vectors' scores
    q8, k8, sq, sk = tp.quantized(dev(q), kk)
    check_lse(tp.prefill_lse(q8, k8, fp8=(sq, sk), block_m=32, block_n=16, **pos), qr, kr, kv_start, q_offset,
              pos["scale"], "FP8 LSE", atol=max(1e-4, FP8_RTOL))
    want = reference.select(qr, kr, budget=exact, **pos)
    assert not torch.equal(want.indices, reference.select(q, k, budget=exact, **pos).indices), \
        "rounding to e4m3 changes no selection here: the case cannot tell FP8 scoring from exact scoring"
    for what, kw in (("one chunk", {}), ("one-tile chunks", {"max_chunk_bytes": 1}),
                     ("16-row scoring blocks", {"scoring": {"block_m": 16}}), ("torch.topk", {"method": "topk"})):
        kw = {**kw, "scoring": tp.Launch(block_n=16, **kw.get("scoring", {}))}
        sel = tp.select_prefill(dev(q), kk, budget=by_fp8, **pos, **kw)
        check_prefill_selection(sel, want, pooled, kv_start, q_offset, L, exact, f"fp8 select/{what}",
                                rtol=FP8_RTOL)
    ranked = tp.select_prefill(dev(q), kk, budget=by_fp8, rank_factor=0.5, **pos)
    check_prefill_selection(ranked, reference.select(qr, kr, budget=exact, rank_factor=0.5, **pos), pooled, kv_start,
                            q_offset, L, exact, "fp8 ranked", rank_factor=0.5, rtol=FP8_RTOL)
    # layer 0's one pass stays exact whatever the budget says
    _, sel0 = tp.dense_select_prefill(dev(q), kk, dev(poison(k, kv_start, q_offset + L)), budget=by_fp8, **pos)
    check_prefill_selection(sel0, reference.select(q, k, budget=exact, **pos),
                            pooled_prefill_rows(q, k, kv_start, q_offset, pos["scale"], T), kv_start, q_offset, L,
                            exact, "layer 0")


def test_fp8_quantize_kernel_rounds_as_torch_does():
    """The one-pass quantisation kernel against kascade.ops.fp8.quantize, bit for bit: every binade of e4m3 (the
    subnormals included), ties, negative values that round to -0, a zero vector, a strided view."""
    from kascade.ops import fp8
    from kascade.ops.triton import fp8 as tf

    g = torch.Generator().manual_seed(7)
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.randn(2, 3, 41, 64, generator=g) * torch.logspace(-3, 3, 41)[None, None, :, None]
        x[0, 0, 0] = 0.0
        x[0, 0, 1, :4] = torch.tensor([200.0, 9.5, 1.0625, -1e-6])  # ties to even, -0
        x = x.to(dt)
        for view in (x, x.transpose(1, 2)):
            a8, sa = fp8.quantize(view)
            b8, sb = tf.quantize(dev(view))
            assert torch.equal(sb.cpu(), sa), dt
            assert torch.equal(b8.cpu().view(torch.uint8), a8.view(torch.uint8)), dt


@pytest.mark.parametrize("case", FP8_CASES, ids=[_id(c) for c in FP8_CASES])
def test_int8_scoring_selects_what_the_reference_selects_on_rounded_vectors(case):
    """INT8 scoring (kascade.ops.int8) in prefill's LSE and scoring passes: the reference's selection on the rounded
    vectors (integer dots, exact: the usual tolerance for ties), in one chunk and in one-tile chunks, set and ranked;
    layer 0's one pass stays exact."""
    from kascade.ops import int8

    B, H, G, N, L, D, T, dt, chunked = case
    q64, k64, _, kv_start, q_offset = _inputs(case, N * 19 + G * 3 + D)
    q, k = q64.to(dt), k64.to(dt)
    pos = {"scale": D**-0.5, "kv_start": kv_start, "q_offset": q_offset}
    exact, by_int8 = _budget(T), Budget(ratio=0.5, k_min=5, tile=T, score_dtype="int8")
    qr, kr = int8.rounded(q), int8.rounded(k)
    kk = dev(poison(k, kv_start, q_offset + L))  # a NaN key's vector gets a NaN scale: it must stay unread
    pooled = pooled_prefill_rows(qr, kr, kv_start, q_offset, pos["scale"], T)
    q8, k8, sq, sk = tp.quantized(dev(q), kk, "int8")
    assert q8.dtype == k8.dtype == torch.int8
    check_lse(tp.prefill_lse(q8, k8, fp8=(sq, sk), block_m=32, block_n=16, **pos), qr, kr, kv_start, q_offset,
              pos["scale"], "INT8 LSE")
    want = reference.select(qr, kr, budget=exact, **pos)
    for what, kw in (("one chunk", {}), ("one-tile chunks", {"max_chunk_bytes": 1})):
        kw = {**kw, "scoring": tp.Launch(block_n=16)}
        sel = tp.select_prefill(dev(q), kk, budget=by_int8, **pos, **kw)
        check_prefill_selection(sel, want, pooled, kv_start, q_offset, L, exact, f"int8 select/{what}")
    ranked = tp.select_prefill(dev(q), kk, budget=by_int8, rank_factor=0.5, **pos)
    check_prefill_selection(ranked, reference.select(qr, kr, budget=exact, rank_factor=0.5, **pos), pooled, kv_start,
                            q_offset, L, exact, "int8 ranked", rank_factor=0.5)
    _, sel0 = tp.dense_select_prefill(dev(q), kk, dev(poison(k, kv_start, q_offset + L)), budget=by_int8, **pos)
    check_prefill_selection(sel0, reference.select(q, k, budget=exact, **pos),
                            pooled_prefill_rows(q, k, kv_start, q_offset, pos["scale"], T), kv_start, q_offset, L,
                            exact, "layer 0")


def test_int8_scoring_is_not_exact_scoring_on_these_cases():
    """Somewhere on the INT8 cases' inputs the rounding changes the reference's selection."""
    from kascade.ops import int8

    differs = []
    for case in FP8_CASES:
        B, H, G, N, L, D, T, dt, chunked = case
        q64, k64, _, kv_start, q_offset = _inputs(case, N * 19 + G * 3 + D)
        q, k = q64.to(dt), k64.to(dt)
        pos = {"scale": D**-0.5, "kv_start": kv_start, "q_offset": q_offset}
        differs.append(not torch.equal(reference.select(int8.rounded(q), int8.rounded(k), budget=_budget(T),
                                                        **pos).indices,
                                       reference.select(q, k, budget=_budget(T), **pos).indices))
    assert any(differs), differs


def test_int8_quantize_kernel_rounds_as_torch_does():
    """The one-pass INT8 quantisation kernel against kascade.ops.int8.quantize, bit for bit: ties to even, a zero
    vector, values over many binades, a strided view."""
    from kascade.ops import int8
    from kascade.ops.triton import int8 as ti

    g = torch.Generator().manual_seed(7)
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.randn(2, 3, 41, 64, generator=g) * torch.logspace(-3, 3, 41)[None, None, :, None]
        x[0, 0, 0] = 0.0
        x[0, 0, 1, :4] = torch.tensor([127.0, 63.5, 62.5, -1.5])  # scale 1: ties to even
        x = x.to(dt)
        for view in (x, x.transpose(1, 2)):
            a8, sa = int8.quantize(view)
            b8, sb = ti.quantize(dev(view))
            assert torch.equal(sb.cpu(), sa), dt
            assert torch.equal(b8.cpu(), a8), dt
