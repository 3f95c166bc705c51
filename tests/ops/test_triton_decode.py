"""Triton decode kernels (kascade.ops.triton.decode) against the reference ops, on the test device (the Triton
interpreter on the CPU, or CUDA with KASCADE_TEST_DEVICE=cuda: tests/conftest.py).

Every kernel runs on fresh random inputs at small, deliberately odd sizes, for each supported G and D, fp16 and
bf16, contiguous and paged KV, with different lengths in one batch. Cache slots that no sequence may read (left
padding, unused slots after the query, unused page space) hold NaN, and outputs start as NaN, so a stray read or
an unwritten output cannot pass. Tolerance (STYLE.md): the error against the fp64 reference is at most twice the
error of the reference's own result rounded to the low precision, plus a tiny atol. Inputs are drawn on the CPU,
kernels run on the device (kernel_checks.dev), references on the CPU.
"""

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be tested")

from kascade.budget import Budget  # noqa: E402
from kernel_checks import (FP8_RTOL, DEVICE, check_close, check_decode_selection, dev, host_selection,  # noqa: E402
                           masters, nan_like, paged_cache, poison, pooled_decode_rows, scoring_hist, sized)
from kascade.ops import dense_attention, select, sparse_attention  # noqa: E402
from kascade.ops.step import decode_meta  # noqa: E402
from kascade.ops.triton import decode as td  # noqa: E402
from kascade.ops.triton import topk  # noqa: E402

# (B, H, G, N, D, dtype, page, num_splits): every G in 1..16 that divides as in real models, each D, both dtypes,
# paged and contiguous, splits chosen by the launcher (None), forced to one (no merge) or to many. N grows with the
# test device's size scale.
CASES = [
    (3, 2, 1, 97, 64, torch.bfloat16, 0, None),
    (2, 1, 2, 301, 128, torch.float16, 16, None),
    (3, 3, 3, 133, 64, torch.bfloat16, 32, 1),
    (2, 2, 4, 257, 128, torch.bfloat16, 0, 5),
    (2, 2, 4, 211, 256, torch.float16, 0, None),
    (2, 1, 8, 199, 64, torch.float16, 0, None),
    (3, 1, 8, 161, 128, torch.bfloat16, 64, None),
    (2, 1, 16, 127, 256, torch.bfloat16, 16, 3),
    (2, 2, 16, 75, 64, torch.float16, 256, None),
    (2, 1, 6, 333, 128, torch.float32, 32, None),
]
CASES = [(B, H, G, sized(N), *rest) for B, H, G, N, *rest in CASES]


def _id(c):
    B, H, G, N, D, dt, page, S = c
    return f"B{B}-H{H}-G{G}-N{N}-D{D}-{str(dt).split('.')[-1]}-{'paged' + str(page) if page else 'contig'}-S{S}"


BUDGET = Budget(ratio=0.2, k_min=9)


def _inputs(case, seed):
    """q, k, v (fp64 masters), kv_start (varied lengths) and q_offset (< N - 1: unused slots after the query)."""
    B, H, G, N, D, dt, page, _ = case
    g = torch.Generator().manual_seed(seed)
    q, k, v = masters(g, B, H, G, 1, N, D)
    q_offset = N - 1 - int(torch.randint(0, 4, (1,), generator=g))
    kv_start = torch.tensor([0] + [int(torch.randint(1, q_offset - 10, (1,), generator=g)) for _ in range(B - 1)])
    return q, k, v, kv_start, q_offset


def _layout(case, k, v, kv_start, q_offset, seed):
    """The kernel-side K, V (on the device) and layout arguments for this case."""
    page = case[6]
    if not page:
        return (dev(poison(k, kv_start, q_offset + 1)), dev(poison(v, kv_start, q_offset + 1)),
                {"kv_start": kv_start, "q_offset": q_offset})
    g = torch.Generator().manual_seed(seed)
    kc, table, lens = paged_cache(k, kv_start, q_offset + 1, page, g)
    vc, table2, _ = paged_cache(v, kv_start, q_offset + 1, page, torch.Generator().manual_seed(seed))
    assert torch.equal(table, table2)
    return dev(kc), dev(vc), {"block_table": dev(table), "seq_lens": lens}


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_decode_kernels_match_reference(case):
    B, H, G, N, D, dt, page, S = case
    seed = N * 31 + G
    q64, k64, v64, kv_start, q_offset = _inputs(case, seed)
    q, k, v = q64.to(dt), k64.to(dt), v64.to(dt)
    scale = D**-0.5
    kk, vv, lay = _layout(case, k, v, kv_start, q_offset, seed)
    qd = dev(q)
    cfg = {} if S is None else {"num_splits": S}
    pos = {"kv_start": kv_start, "q_offset": q_offset, "backend": "reference"}

    # dense
    want = dense_attention(q.double(), k.double(), v.double(), **pos)
    lowp = dense_attention(q, k, v, **pos)
    got = td.dense_decode(qd, kk, vv, scale=scale, out=nan_like(qd), **lay, **cfg)
    check_close(got, want, lowp, "dense")

    # sparse over the reference's selection (varied k_b: rows padded with -1)
    ref_sel = select(q, k, budget=BUDGET, **pos)
    want = sparse_attention(q.double(), k.double(), v.double(), ref_sel, **pos)
    lowp = sparse_attention(q, k, v, ref_sel, **pos)
    idx = ref_sel.indices
    if page:
        idx = torch.where(idx >= 0, idx - kv_start[:, None, None, None], -1)
    for idt in (torch.int32, torch.int64):
        got = td.sparse_decode(qd, kk, vv, dev(idx.to(idt)), scale=scale, out=nan_like(qd),
                               **({"block_table": lay["block_table"]} if page else {}), **cfg)
        check_close(got, want, lowp, f"sparse {idt}")

    # selection, both methods, and the fused layer-0 / anchor paths
    pooled = pooled_decode_rows(q, k, kv_start, q_offset, scale)
    sel_kw = dict(pooled=pooled, kv_start=kv_start, q_offset=q_offset, budget=BUDGET, paged=bool(page))
    for method in ("radix", "topk"):
        sel = td.select_decode(qd, kk, budget=BUDGET, scale=scale, method=method, **lay, **cfg)
        check_decode_selection(sel, ref_sel, what=f"select/{method}", **sel_kw)

    want_dense = dense_attention(q.double(), k.double(), v.double(), **pos)
    out0, sel0 = td.dense_select_decode(qd, kk, vv, budget=BUDGET, scale=scale, out=nan_like(qd), **lay, **cfg)
    check_close(out0, want_dense, dense_attention(q, k, v, **pos), "layer 0 output")
    check_decode_selection(sel0, ref_sel, what="layer 0 selection", **sel_kw)

    out_a, sel_a = td.anchor_decode(qd, kk, vv, budget=BUDGET, scale=scale, out=nan_like(qd), **lay)
    check_decode_selection(sel_a, ref_sel, what="anchor selection", **sel_kw)
    sel_a = host_selection(sel_a)
    # the anchor's output over its own selection, which may differ from the reference's only at ties
    sel_abs = sel_a if not page else type(sel_a)(
        torch.where(sel_a.indices >= 0, sel_a.indices + kv_start[:, None, None, None], -1), sel_a.row_start,
        sel_a.tile, True)
    want = sparse_attention(q.double(), k.double(), v.double(), sel_abs, **pos)
    check_close(out_a, want, sparse_attention(q, k, v, sel_abs, **pos), "anchor output")


@pytest.mark.parametrize("ranked", [False, True], ids=["sets", "ranked"])
@pytest.mark.parametrize("index_dtype", [torch.long, torch.int32])
@pytest.mark.parametrize("scores", ["four-levels", "peaked"])
def test_radix_selection_breaks_exact_ties_by_position(scores, index_dtype, ranked):
    """Scores drawn from a few levels, so the pooled probabilities tie exactly, across several selection chunks:
    the radix select keeps every key above the k-th value and the earliest keys equal to it (several programs per
    row: the last one to finish each pass makes the next pass's bin search). "peaked": a few keys hold nearly all
    the mass and the k-th key's probability (~2^-90) lies far below the first histogram's exponent window, so the
    fallback path (the whole bit pattern radixed from the top) decides. ``ranked``: the same keys in descending
    probability, ties by position (the write kernel's sort keys, sorted), -1 padding after them."""
    B, H, G, D = 2, 2, 3, 64
    N = 700
    n = [N, 333]
    g = torch.Generator().manual_seed(3)
    meta = decode_meta(B, device=DEVICE, kv_start=[0, N - n[1]], q_offset=N - 1, budget=BUDGET)
    if scores == "peaked":  # 3% of keys at 0, the rest on 32 levels from -90 down (distinct fp32 probabilities)
        low = -90.0 - 0.25 * torch.randint(0, 32, (B, H * G, N), generator=g).float()
        sc = torch.where(torch.rand(B, H * G, N, generator=g) < 0.03, 0.0, low)
    else:
        levels = torch.tensor([-2.0, 0.0, 1.0, 1.5])
        sc = levels[torch.randint(0, 4, (B, H * G, N), generator=g)]
    sc[:, :, :] = sc[:, :1, :]  # every head of a group scores alike: pooled = G x one head's probabilities
    mx = sc.amax(-1, keepdim=True)
    ls = torch.exp2(sc - mx).sum(-1, keepdim=True)
    for b in range(B):  # sequence 1 has only n[1] valid keys: its statistics cover those
        mx[b] = sc[b, :, : n[b]].amax(-1, keepdim=True)
        ls[b] = torch.exp2(sc[b, :, : n[b]] - mx[b]).sum(-1, keepdim=True)
    hist = scoring_hist(B * H)  # garbage beyond the bins the scoring pass zeroes: a fallback row zeroes its own
    stats = torch.cat([mx.flatten(), ls.flatten()])  # the split maxima [B, HQ, 1], then the sums
    indices = topk.select_rows(dev(sc.contiguous()), dev(stats), dev(hist), 1, meta, B, H, G, method="radix",
                               chunk=64, ranked=ranked, index_dtype=index_dtype).cpu()
    assert indices.dtype == index_dtype and indices.shape == (B, H, 1, BUDGET.decode(N))
    for b in range(B):
        kb = BUDGET.decode(n[b])
        s = sc[b, 0, : n[b]]
        order = torch.sort(-s, stable=True).indices[:kb]  # higher level first, then earlier position
        want = (order if ranked else order.sort().values) + (N - n[b] if b else 0)
        for h in range(H):
            assert torch.equal(indices[b, h, 0, :kb], want), f"seq {b} head {h}"
            assert bool((indices[b, h, 0, kb:] == -1).all())


def test_selection_covers_large_rows_and_many_chunks():
    """More keys than one selection chunk (4096), so the cross-chunk prefix and three radix levels all matter;
    G = 5 and a budget of exactly k_min on the short sequence."""
    B, H, G, N, D = 2, 1, 5, 9001, 64
    g = torch.Generator().manual_seed(7)
    q = torch.randn(B, H * G, 1, D, generator=g).to(torch.float16)
    k = torch.randn(B, H, N, D, generator=g).to(torch.float16)
    kv_start = torch.tensor([0, N - 300])
    budget = Budget(ratio=0.1, k_min=128)
    scale = D**-0.5
    want = select(q, k, budget=budget, kv_start=kv_start, q_offset=N - 1)
    pooled = pooled_decode_rows(q, k, kv_start, N - 1, scale)
    for method in ("radix", "topk"):
        sel = td.select_decode(dev(q), dev(k), budget=budget, scale=scale, kv_start=kv_start, q_offset=N - 1,
                               method=method)
        sel = host_selection(sel)
        assert sel.indices.shape == want.indices.shape
        for b in range(B):
            kb = budget.decode(N - int(kv_start[b]))
            got = sel.indices[b, 0, 0]
            assert bool((got[kb:] == -1).all()) and bool((got[1:kb] > got[: kb - 1]).all())
            ref = want.indices[b, 0, 0]
            diff = set(got[:kb].tolist()) ^ set(ref[ref >= 0].tolist())
            if diff:
                rel = torch.tensor(sorted(diff)) - int(kv_start[b])
                kth = pooled[b][0].topk(kb).values[-1]
                assert (pooled[b][0][rel] - kth).abs().max() <= 1e-4 * kth, f"{method} seq {b}: {len(diff)} differ"


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_ranked_selection_is_the_deeper_top_k_in_descending_probability(paged):
    """rank_factor=: the top round(rank_factor * k_b) keys in descending pooled probability (-1 at the end). The radix path
    (select, then sort only the selected) and the torch.topk path agree, and both match the reference pooling."""
    B, H, G, N, D = 2, 2, 3, 700, 64
    g = torch.Generator().manual_seed(11)
    q = torch.randn(B, H * G, 1, D, generator=g)
    k = torch.randn(B, H, N, D, generator=g)
    kv_start = torch.tensor([0, 250])
    budget = Budget(ratio=0.1, k_min=16)
    scale = D**-0.5
    pooled = pooled_decode_rows(q, k, kv_start, N - 1, scale)
    kw = dict(budget=budget, scale=scale, rank_factor=1.7)
    if paged:
        kp, bt, lens = paged_cache(k, kv_start, N, 32, g)
        kw.update(block_table=dev(bt), seq_lens=lens)
        kk = kp
    else:
        kw.update(kv_start=kv_start, q_offset=N - 1)
        kk = k
    got = {m: td.select_decode(dev(q), dev(kk), method=m, **kw).indices.cpu() for m in ("radix", "topk")}
    assert torch.equal(got["radix"], got["topk"])
    for b in range(B):
        n = N - int(kv_start[b])
        kr = min(n, int(1.7 * budget.decode(n) + 0.5))
        for h in range(H):
            row = got["radix"][b, h, 0]
            assert bool((row[kr:] == -1).all()) and bool((row[:kr] >= 0).all())
            rel = row[:kr] - (0 if paged else int(kv_start[b]))
            p = pooled[b][h][rel]
            assert bool((p[1:] <= p[:-1] * (1 + 1e-5)).all()), "not in descending probability"
            assert p[-1] >= pooled[b][h].topk(kr).values[-1] * (1 - 1e-5), "not the top keys"


@pytest.mark.parametrize("rank_factor", [None, 1.7], ids=["sets", "ranked"])
def test_int32_selections_hold_the_same_keys(rank_factor):
    """index_dtype=torch.int32 (what the runtime's Triton steps ask for): the same keys as int64, from both top-k
    methods, contiguous with left padding and paged; the sparse kernel reads either to the same output."""
    B, H, G, N, D = 2, 2, 3, 500, 64
    g = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(B, H * G if i == 0 else H, 1 if i == 0 else N, D, generator=g) for i in range(3))
    kv_start = torch.tensor([0, 170])
    budget = Budget(ratio=0.1, k_min=16)
    kp, bt, lens = paged_cache(k, kv_start, N, 32, g)
    for kw, kk in ((dict(kv_start=kv_start, q_offset=N - 1), k), (dict(block_table=dev(bt), seq_lens=lens), kp)):
        for method in ("radix", "topk"):
            sel = {dt: td.select_decode(dev(q), dev(kk), budget=budget, scale=D**-0.5, method=method, rank_factor=rank_factor,
                                        index_dtype=dt, **kw).indices for dt in (torch.long, torch.int32)}
            assert sel[torch.int32].dtype == torch.int32 and sel[torch.long].dtype == torch.long
            assert torch.equal(sel[torch.int32].cpu().long(), sel[torch.long].cpu()), method
            assert bool((sel[torch.int32] >= 0).any()) and bool((sel[torch.int32] == -1).any())
        if "kv_start" in kw:
            outs = [td.sparse_decode(dev(q), dev(k), dev(v), sel[dt], scale=D**-0.5).cpu() for dt in sel]
            assert torch.equal(outs[0], outs[1])


def test_sparse_decode_with_counts_attends_each_sequences_prefix():
    """counts=: sequence b attends only the first counts[b] entries of its rows, in whatever order they are (a
    ranked selection's prefix): the same output as the rows cut to that prefix and -1 padded; the step's counts
    are Budget.decode_counts of each sequence's keys, from the device metadata."""
    from kascade.ops import plan_step

    B, H, G, N, D = 3, 2, 4, 600, 64
    g = torch.Generator().manual_seed(12)
    q = torch.randn(B, H * G, 1, D, generator=g)
    k = torch.randn(B, H, N, D, generator=g)
    v = torch.randn(B, H, N, D, generator=g)
    kv_start = torch.tensor([0, 100, 430])
    budget = Budget(ratio=0.1, k_min=16)
    q, k, v = dev(q), dev(k), dev(v)
    step = plan_step(q, k, budget=budget, kv_start=kv_start, q_offset=N - 1, backend="triton")
    K = 90
    idx = torch.full((B, H, 1, K), -1, dtype=torch.long)
    for b in range(B):
        for h in range(H):
            perm = torch.randperm(N - int(kv_start[b]), generator=g)[:K] + int(kv_start[b])  # not sorted
            idx[b, h, 0, : perm.numel()] = perm
    for s in (0.5, 1.3, 2.0):
        cnt, most = step.counts(s)
        n = [N - int(x) for x in kv_start]
        want_cnt = [min(m, int(s * budget.decode(m) + 0.5)) for m in n]  # round(s * k(n)), capped by n
        assert cnt.dtype == torch.int32 and cnt.tolist() == want_cnt and most == max(want_cnt)
        assert step.counts(s)[0] is cnt, "memoised per step and scale"
        cut = idx.clone()
        for b in range(B):
            cut[b, :, :, int(cnt[b]) :] = -1
        big = torch.iinfo(torch.long).max
        cut = torch.where(cut < 0, big, cut).sort(-1).values  # the documented input: ascending, -1 at the end
        cut = torch.where(cut == big, -1, cut)
        got = td.sparse_decode(q, k, v, dev(idx), scale=D**-0.5, counts=cnt)
        ref = td.sparse_decode(q, k, v, dev(cut), scale=D**-0.5)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        assert not torch.equal(got, td.sparse_decode(q, k, v, dev(idx), scale=D**-0.5)), "the counts changed nothing"


def test_a_growing_cache_keeps_its_launch_bound_and_selects_as_the_reference():
    """A dynamic cache's decode steps (K and V one key longer each step, the geometry on the device): the step's
    launch bound moves only at multiples of LAUNCH_BOUND_STEP, and past the tensors' slots the kernels read nothing:
    outputs and selections are the host-planned reference step's (slots past each step's keys hold NaN)."""
    from kascade.ops import dense_select, plan_step
    from kascade.ops.step import LAUNCH_BOUND_STEP, launch_bound

    B, H, G, D = 2, 2, 3, 64
    M = LAUNCH_BOUND_STEP + 8
    g = torch.Generator().manual_seed(21)
    q, k, v = (x.float() for x in masters(g, B, H, G, 1, M, D))
    budget = Budget(ratio=0.1, k_min=9)
    bounds = []
    for n in (LAUNCH_BOUND_STEP - 1, LAUNCH_BOUND_STEP, LAUNCH_BOUND_STEP + 1):
        kn, vn = poison(k, torch.zeros(B, dtype=torch.long), n), poison(v, torch.zeros(B, dtype=torch.long), n)
        kd, vd = dev(kn)[:, :, :n], dev(vn)[:, :, :n]  # views: the NaN slots lie just past each row's last key
        step = plan_step(dev(q), kd, budget=budget, q_offset=dev(torch.tensor(n - 1)), backend="triton")
        assert step.on_device and step.meta.n == (launch_bound(n),) * B
        bounds.append(step.meta.n[0])
        out, sel = dense_select(dev(q), kd, vd, scale=D**-0.5, step=step)
        host = plan_step(q, kn[:, :, :n], budget=budget, q_offset=n - 1)
        want_out, want = dense_select(q, kn[:, :, :n], vn[:, :, :n], scale=D**-0.5, step=host)
        torch.testing.assert_close(out.cpu(), want_out, rtol=1e-4, atol=1e-5)
        w = want.indices.shape[-1]
        assert sel.indices.shape[-1] == budget.decode(launch_bound(n)) >= w
        assert torch.equal(host_selection(sel).indices[..., :w].long(), want.indices)
        assert (sel.indices[..., w:] == -1).all()
        torch.testing.assert_close(sparse_attention(dev(q), kd, vd, sel, scale=D**-0.5, step=step).cpu(),
                                   sparse_attention(q, kn[:, :, :n], vn[:, :, :n], want, scale=D**-0.5, step=host),
                                   rtol=1e-4, atol=1e-5)
    assert bounds == [LAUNCH_BOUND_STEP, LAUNCH_BOUND_STEP, 2 * LAUNCH_BOUND_STEP]


def test_launch_plans_are_memoised_and_bounded(monkeypatch):
    """The split-K launch plan of a shape is worked out once (every layer of a step reuses it), and the memo is
    emptied when it grows large: a dynamic cache's steps each have another length."""
    monkeypatch.setattr(td, "_PLANS", {})
    monkeypatch.setattr(td, "_MAX_PLANS", 3)
    args = ("sparse", 1, 8, 4, 128)
    rest = (DEVICE, torch.bfloat16, False, False, (None,) * 5)
    first = td._plan(*args, 1000, *rest)
    assert td._plan(*args, 1000, *rest) is first and len(td._PLANS) == 1
    for n in range(1001, 1010):
        td._plan(*args, n, *rest)
        assert len(td._PLANS) <= 3
    assert td._plan(*args, 1000, *rest) == first  # worked out again, the same


class _Counted:
    """A kernel that runs as before and logs each launch (``kernel[grid](...)``) by name."""

    def __init__(self, name, kernel, log):
        self.name, self.kernel, self.log = name, kernel, log

    def __getitem__(self, grid):
        self.log.append(self.name)
        return self.kernel[grid]


@pytest.fixture
def launches(monkeypatch):
    """The names of the Triton kernels launched while the test runs, in order (every kernel of the decode modules;
    the ``@triton.jit`` helpers that kernels call are not launched)."""
    from kascade.ops.triton import launch

    log = []
    # every launch through Triton's own path, where the wrapper sees it (a direct launch calls the compiled launcher)
    monkeypatch.setattr(launch, "FAST", False)
    for mod in (td, topk):
        for name, obj in list(vars(mod).items()):
            if name.endswith("_kernel"):
                monkeypatch.setattr(mod, name, _Counted(name, obj, log))
    return log


def test_a_decode_layer_launches_one_kernel_per_pass(launches):
    """A reuse layer is one launch even over several splits (the row's last program merges the partials), an anchor
    eight (scoring, pooling with the first histogram, three refining passes, the threshold counts, the ordered
    write, the sparse pass), layer 0 seven; the merged passes leave their row counters at zero."""
    g = torch.Generator().manual_seed(5)
    B, H, G, N, D = 2, 2, 4, 300, 64
    q64, k64, v64 = masters(g, B, H, G, 1, N, D)
    q, k, v = dev(q64.to(torch.bfloat16)), dev(k64.to(torch.bfloat16)), dev(v64.to(torch.bfloat16))
    meta = decode_meta(B, device=q.device, q_offset=N - 1, budget=BUDGET)
    sel = td.select_decode(q, k, budget=BUDGET, scale=D**-0.5, meta=meta)
    launches.clear()
    out = td.sparse_decode(q, k, v, sel.indices, scale=D**-0.5, num_splits=4, block_n=16)
    assert launches == ["_split_kernel"]
    assert td._plan("sparse", B, H, G, D, sel.indices.shape[-1], q.device, q.dtype, False, False,
                    (4, 16, None, None, None)).S == 4, "the merge was not exercised"
    assert not td._DONE[q.device].any(), "a row counter left non-zero"
    torch.testing.assert_close(out, td.sparse_decode(q, k, v, sel.indices, scale=D**-0.5, num_splits=1),
                               rtol=2e-2, atol=2e-2)

    passes = ["_split_kernel", "_pool_kernel"] + ["_radix_kernel"] * 4 + ["_write_kernel"]
    launches.clear()
    td.anchor_decode(q, k, v, budget=BUDGET, scale=D**-0.5, meta=meta)
    assert launches == passes + ["_split_kernel"]
    launches.clear()
    td.dense_select_decode(q, k, v, budget=BUDGET, scale=D**-0.5, meta=meta, num_splits=4)
    assert launches == passes
    assert not td._DONE[q.device].any()


@pytest.mark.parametrize("src_heads,hmap,ranked", [(3, (2, 0, 0), False), (5, (4, 1, 3), False),
                                                   (3, (1, 2, 1), True)], ids=["own", "more-heads", "ranked-prefix"])
def test_a_head_map_is_read_in_place_by_the_sparse_pass(launches, src_heads, hmap, ranked):
    """sparse_attention(heads=map) on a Triton decode step: one launch, no copy of the indices through the map, and
    the output of the selection taken through the map (bit for bit: the same kernel reads the same rows), which is
    the reference's. The selection may have more heads than the layer (a tensor-parallel rank's gathered one)."""
    from kascade.ops import plan_step
    from kascade.ops.selection import Selection

    B, H, G, N, D = 2, 3, 2, 300, 64
    g = torch.Generator().manual_seed(31)
    q64, k64, v64 = masters(g, B, H, G, 1, N, D)
    q, k, v = (dev(x.to(torch.bfloat16)) for x in (q64, k64, v64))
    kv_start = torch.tensor([0, 41])
    step = plan_step(q, k, budget=BUDGET, kv_start=kv_start, q_offset=N - 1, backend="triton")
    K = 40
    idx = torch.full((B, src_heads, 1, K), -1, dtype=torch.int32)
    for b in range(B):
        for h in range(src_heads):
            keys = torch.randperm(N - int(kv_start[b]), generator=g)[: K - 3 * h] + int(kv_start[b])
            idx[b, h, 0, : keys.numel()] = keys if ranked else keys.sort().values
    counts = dev(torch.tensor([25, 31], dtype=torch.int32)) if ranked else None
    sel = Selection(dev(idx), dev(torch.zeros(B, dtype=torch.long)), BUDGET.tile, True, ranked, counts)
    hm = dev(torch.tensor(hmap))
    launches.clear()
    got = sparse_attention(q, k, v, sel, scale=D**-0.5, step=step, heads=hm)
    assert launches == ["_split_kernel"]
    want = sparse_attention(q, k, v, sel.take_heads(hm), scale=D**-0.5, step=step)
    assert torch.equal(got, want)
    # the reference, unchecked calls (the head map's values checked too): exact on the bf16 inputs, and in bf16
    qb, kb, vb = (x.to(torch.bfloat16) for x in (q64, k64, v64))
    pos = dict(scale=D**-0.5, kv_start=kv_start, q_offset=N - 1)
    hsel = host_selection(sel)
    exact = sparse_attention(qb.double(), kb.double(), vb.double(), hsel, heads=hm.cpu(), **pos)
    check_close(got, exact, sparse_attention(qb, kb, vb, hsel.take_heads(hm.cpu()), **pos), "sparse through a map")


def test_row_counters_are_made_once_and_outgrown_ones_stay_alive(monkeypatch):
    """The merged passes' row counters: one zeroed buffer per device, reused by every launch (no allocation or
    memset per call), replaced by a larger one when a launch has more rows; the one replaced stays alive (a CUDA
    graph may hold its address)."""
    monkeypatch.setattr(td, "_DONE", {})
    monkeypatch.setattr(td, "_DONE_ALL", [])
    first = td._done(DEVICE, 10)
    assert first.dtype == torch.int32 and first.numel() >= 10 and not first.any()
    assert td._done(DEVICE, first.numel()) is first
    larger = td._done(DEVICE, first.numel() + 1)
    assert larger.numel() > first.numel() and not larger.any() and td._done(DEVICE, 10) is larger
    assert [b is first for b in td._DONE_ALL] == [True, False] and td._DONE_ALL[1] is larger


@pytest.mark.parametrize("block", [None, 2], ids=["one-block", "blocks-of-2"])
def test_the_merge_launch_of_a_cuda_graph_gives_the_fused_merges_bits(block, monkeypatch):
    """Inside a CUDA graph the split partials are merged by a launch of their own (_merge_kernel, one program a query
    head); eagerly by the row's last program: the same arithmetic per head, the same output bits, dense and sparse."""
    monkeypatch.setattr(td, "_PLANS", {})
    if block:
        monkeypatch.setattr(td, "_merge_block", lambda S, D: block)
    case = (2, 2, 4, sized(257), 128, torch.bfloat16, 0, 5)
    B, H, G, N, D, dt, _, S = case
    q64, k64, v64, kv_start, q_offset = _inputs(case, 17)
    q, k, v = dev(q64.to(dt)), dev(k64.to(dt)), dev(v64.to(dt))
    idx = dev(select(q64.to(dt), k64.to(dt), budget=BUDGET, kv_start=kv_start, q_offset=q_offset,
                     backend="reference").indices.to(torch.int32))
    launched, kernel = [], td._merge_kernel

    class Spy:  # records the merge launches' grids
        def __getitem__(self, grid):
            launched.append(grid)
            return kernel[grid]

    monkeypatch.setattr(td, "_merge_kernel", Spy())
    pos = {"scale": D**-0.5, "kv_start": kv_start, "q_offset": q_offset, "num_splits": S}
    for name, fn in (("dense", lambda **kw: td.dense_decode(q, k, v, **pos, **kw)),
                     ("sparse", lambda **kw: td.sparse_decode(q, k, v, idx, scale=D**-0.5, num_splits=S, block_n=16,
                                                              **kw))):
        fused, apart = fn(fused_merge=True), fn(fused_merge=False)
        assert torch.equal(fused, apart), name
    assert len(launched) == 2 and all(g == (H * G, B) for g in launched)


@pytest.mark.parametrize("page", [0, 16], ids=["contig", "paged16"])
def test_the_merge_takes_many_splits_in_blocks(page, monkeypatch):
    """More splits than the merge takes at once (forced here: 2 a block, 5 splits): the blocks are combined by
    rescaling, and the outputs still match the reference."""
    monkeypatch.setattr(td, "_PLANS", {})
    monkeypatch.setattr(td, "_merge_block", lambda S, D: 2)
    case = (2, 2, 4, sized(257), 128, torch.bfloat16, page, 5)
    B, H, G, N, D, dt, _, S = case
    q64, k64, v64, kv_start, q_offset = _inputs(case, 11)
    q, k, v = q64.to(dt), k64.to(dt), v64.to(dt)
    kk, vv, lay = _layout(case, k, v, kv_start, q_offset, 11)
    pos = {"kv_start": kv_start, "q_offset": q_offset, "backend": "reference"}
    got = td.dense_decode(dev(q), kk, vv, scale=D**-0.5, out=nan_like(dev(q)), num_splits=S, **lay)
    check_close(got, dense_attention(q.double(), k.double(), v.double(), **pos), dense_attention(q, k, v, **pos),
                "dense")
    sel = select(q, k, budget=BUDGET, **pos)
    idx = sel.indices if not page else torch.where(sel.indices >= 0, sel.indices - kv_start[:, None, None, None], -1)
    got = td.sparse_decode(dev(q), kk, vv, dev(idx.to(torch.int32)), scale=D**-0.5, out=nan_like(dev(q)),
                           num_splits=S, block_n=16, **({"block_table": lay["block_table"]} if page else {}))
    check_close(got, sparse_attention(q.double(), k.double(), v.double(), sel, **pos),
                sparse_attention(q, k, v, sel, **pos), "sparse")
    plan = td._plan("sparse", B, H, G, D, idx.shape[-1], DEVICE, dt, bool(page), False, (S, 16, None, None, None))
    assert plan.S > 2 and plan.consts["SB"] == 2, "the blocks were not exercised"
    n_max = q_offset + 1  # sequence 0 starts at slot 0
    assert td._plan("dense", B, H, G, D, n_max, DEVICE, dt, bool(page), False, (S, None, None, None, None)).S > 2
    assert not td._DONE[dev(q).device].any()  # (cuda:0, as the launch keys it, not DEVICE's "cuda")


FP8_CASES = [c for c in CASES if not c[6]]  # FP8 scoring reads contiguous caches


@pytest.mark.parametrize("case", FP8_CASES, ids=[_id(c) for c in FP8_CASES])
def test_fp8_scoring_selects_what_the_reference_selects_on_rounded_vectors(case):
    """FP8 scoring (kascade.ops.fp8) in the decode scoring pass: the reference's selection on the rounded vectors,
    with the keys quantised by the launcher or handed to it already quantised (a step's e4m3 copy of the cache);
    layer 0's one pass stays exact."""
    from kascade.ops import fp8, reference
    from kascade.ops.triton import fp8 as tf

    B, H, G, N, D, dt, page, S = case
    q64, k64, v64, kv_start, q_offset = _inputs(case, N * 13 + G + D)
    q, k = q64.to(dt), k64.to(dt)
    pos = {"scale": D**-0.5, "kv_start": kv_start, "q_offset": q_offset}
    by_fp8 = Budget(ratio=BUDGET.ratio, k_min=BUDGET.k_min, score_dtype="fp8")
    qr, kr = fp8.rounded(q), fp8.rounded(k)
    want = reference.select(qr, kr, budget=BUDGET, **pos)
    assert not torch.equal(want.indices, reference.select(q, k, budget=BUDGET, **pos).indices), \
        "rounding to e4m3 changes no selection here: the case cannot tell FP8 scoring from exact scoring"
    pooled = pooled_decode_rows(qr, kr, kv_start, q_offset, pos["scale"])
    kk = dev(poison(k, kv_start, q_offset + 1))
    for what, kw in (("quantised here", {}), ("e4m3 keys given", {"k_quant": tf.quantize(kk)})):
        sel = td.select_decode(dev(q), kk, budget=by_fp8, num_splits=S, **pos, **kw)
        check_decode_selection(sel, want, pooled, kv_start, q_offset, BUDGET, paged=False, what=f"fp8 {what}",
                               rtol=FP8_RTOL)
    ranked = td.select_decode(dev(q), kk, budget=by_fp8, rank_factor=0.5, **pos)
    check_decode_selection(ranked, reference.select(qr, kr, budget=BUDGET, rank_factor=0.5, **pos), pooled, kv_start,
                           q_offset, BUDGET, paged=False, what="fp8 ranked", rank_factor=0.5,
                           rtol=FP8_RTOL)
    _, sel0 = td.dense_select_decode(dev(q), kk, dev(poison(v64.to(dt), kv_start, q_offset + 1)), budget=by_fp8,
                                     **pos)
    check_decode_selection(sel0, reference.select(q, k, budget=BUDGET, **pos),
                           pooled_decode_rows(q, k, kv_start, q_offset, pos["scale"]), kv_start, q_offset, BUDGET,
                           paged=False, what="layer 0")


@pytest.mark.parametrize("case", FP8_CASES, ids=[_id(c) for c in FP8_CASES])
def test_int8_scoring_selects_what_the_reference_selects_on_rounded_vectors(case):
    """INT8 scoring (kascade.ops.int8) in the decode scoring pass: the reference's selection on the rounded vectors
    (the kernel's integer dots are exact: ties within the usual tolerance), set and ranked; layer 0's one pass stays
    exact."""
    from kascade.ops import int8, reference
    from kascade.ops.triton import int8 as ti

    B, H, G, N, D, dt, page, S = case
    q64, k64, v64, kv_start, q_offset = _inputs(case, N * 17 + G + D)
    q, k = q64.to(dt), k64.to(dt)
    pos = {"scale": D**-0.5, "kv_start": kv_start, "q_offset": q_offset}
    by_int8 = Budget(ratio=BUDGET.ratio, k_min=BUDGET.k_min, score_dtype="int8")
    qr, kr = int8.rounded(q), int8.rounded(k)
    want = reference.select(qr, kr, budget=BUDGET, **pos)
    pooled = pooled_decode_rows(qr, kr, kv_start, q_offset, pos["scale"])
    kk = dev(poison(k, kv_start, q_offset + 1))
    for what, kw in (("quantised here", {}), ("int8 keys given", {"k_quant": ti.quantize(kk)})):
        sel = td.select_decode(dev(q), kk, budget=by_int8, num_splits=S, **pos, **kw)
        check_decode_selection(sel, want, pooled, kv_start, q_offset, BUDGET, paged=False, what=f"int8 {what}")
    ranked = td.select_decode(dev(q), kk, budget=by_int8, rank_factor=0.5, **pos)
    check_decode_selection(ranked, reference.select(qr, kr, budget=BUDGET, rank_factor=0.5, **pos), pooled, kv_start,
                           q_offset, BUDGET, paged=False, what="int8 ranked", rank_factor=0.5)
    _, sel0 = td.dense_select_decode(dev(q), kk, dev(poison(v64.to(dt), kv_start, q_offset + 1)), budget=by_int8,
                                     **pos)
    check_decode_selection(sel0, reference.select(q, k, budget=BUDGET, **pos),
                           pooled_decode_rows(q, k, kv_start, q_offset, pos["scale"]), kv_start, q_offset, BUDGET,
                           paged=False, what="layer 0")


def test_int8_decode_scoring_is_not_exact_scoring_on_these_cases():
    """Somewhere on the INT8 cases' inputs the rounding changes the reference's selection: the test above compares
    selections that differ from exact scoring's."""
    from kascade.ops import int8, reference

    differs = []
    for case in FP8_CASES:
        B, H, G, N, D, dt, page, S = case
        q64, k64, _, kv_start, q_offset = _inputs(case, N * 17 + G + D)
        q, k = q64.to(dt), k64.to(dt)
        pos = {"scale": D**-0.5, "kv_start": kv_start, "q_offset": q_offset}
        differs.append(not torch.equal(reference.select(int8.rounded(q), int8.rounded(k), budget=BUDGET, **pos).indices,
                                       reference.select(q, k, budget=BUDGET, **pos).indices))
    assert any(differs), differs


def test_the_quantised_key_copy_is_named_k_quant():
    """``k_fp8`` became ``k_quant`` (the keys quantised for the budget's score_dtype, e4m3 or int8): the former name is
    an error naming the current one, and a copy of the other type is refused."""
    from kascade._renamed import RenamedError
    from kascade.ops.triton import fp8 as tf

    q, k = torch.randn(1, 2, 1, 16, dtype=torch.bfloat16), torch.randn(1, 1, 40, 16, dtype=torch.bfloat16)
    pos = {"scale": 0.25, "kv_start": torch.tensor([0]), "q_offset": 39}
    with pytest.raises(RenamedError, match="k_quant"):
        td.select_decode(dev(q), dev(k), budget=Budget(score_dtype="fp8"), k_fp8=tf.quantize(dev(k)), **pos)
    with pytest.raises(AssertionError, match="float8_e4m3fn"):
        td.select_decode(dev(q), dev(k), budget=Budget(score_dtype="int8"), k_quant=tf.quantize(dev(k)), **pos)
