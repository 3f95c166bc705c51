"""What the Triton kernel tests share: the device they run on, inputs, NaN-poisoned caches and buffers, paged caches,
the reference's pooled rows, and the checks of outputs (tests/ops/tolerance.py's rule) and of selections.

Device (tests/conftest.py): by default the kernels run in Triton's interpreter on CPU tensors; with
``KASCADE_TEST_DEVICE=cuda`` they are compiled and run on CUDA tensors. Inputs are drawn on the CPU from CPU generators
(the same values in both modes) and every tensor a test hands to a kernel goes through :func:`dev`; the kernel tests
compute their references on the CPU from the same low-precision values, and the checks here bring kernel results back
to the CPU before comparing them (the dispatch and model tests run the reference backend on the device instead, as a
user would).
"""

from __future__ import annotations

import contextlib

import torch

from conftest import TEST_DEVICE, TEST_SCALE
from kascade.budget import Budget, at_factor
from kascade.ops import reference
from kascade.ops.selection import Selection
from tolerance import assert_close_to_reference

DEVICE = torch.device(TEST_DEVICE)
SCALE = TEST_SCALE
NAN = float("nan")
# How near a tie two pooled probabilities of FP8 scoring may be and still rank either way, compiled on a GPU: Hopper's
# FP8 tensor cores keep fewer bits of a dot's running sum than fp32 (DeepSeek-V3 reports about 14), and the LSE pass
# of e4m3 inputs on them differs from the same pass on bf16 tensor cores (exact products, fp32 sums) by up to 7.4e-4
# (H100, Llama shapes, 4,096 queries; the kernel notes' FP8 section). The interpreter sums in fp32: the usual 1e-4.
FP8_RTOL = 2e-3 if TEST_DEVICE != "cpu" else 1e-4
# Fills the integer buffers a launcher allocates inside poisoned_allocations(): far outside any index range.
JUNK = 0x2A2A2A2A


# ----------------------------------------------------------------------------------------------------------------
# Device and sizes
# ----------------------------------------------------------------------------------------------------------------
def dev(x):
    """``x`` (a tensor, or a module) on the device the kernels under test run on: the one way tests get there."""
    return x.to(DEVICE)


def dev_selection(sel: Selection) -> Selection:
    """A selection (from the reference, on the CPU) with its tensors on the kernels' device."""
    return Selection(dev(sel.indices), dev(sel.row_start), sel.tile, sel.decode, sel.ranked,
                     None if sel.counts is None else dev(sel.counts))


def host_selection(sel: Selection) -> Selection:
    """A selection (from a kernel) with its tensors on the CPU, where the reference's are."""
    return Selection(sel.indices.cpu(), sel.row_start.cpu(), sel.tile, sel.decode, sel.ranked,
                     None if sel.counts is None else sel.counts.cpu())


def sized(n: int) -> int:
    """A test's length ``n`` (keys, queries) at the session's size scale; odd when scaled up, so that a length that
    divides no tile or block stays one."""
    return n if SCALE == 1 else n * SCALE + 1


# ----------------------------------------------------------------------------------------------------------------
# Inputs, poison and pages
# ----------------------------------------------------------------------------------------------------------------
def masters(g: torch.Generator, B: int, H: int, G: int, L: int, N: int, D: int):
    """fp64 masters on the CPU: ``q [B, H*G, L, D]``, ``k, v [B, H, N, D]`` (keys spread a bit wider, so that the
    softmax is not flat and selections are not ties)."""
    q = torch.randn(B, H * G, L, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, H, N, D, generator=g, dtype=torch.float64) * 1.5
    v = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
    return q, k, v


def nan_like(x: torch.Tensor) -> torch.Tensor:
    """An output buffer full of NaN (on ``x``'s device): an output the kernel never writes cannot pass."""
    return torch.full_like(x, NAN)


def poison(x: torch.Tensor, kv_start, end: int) -> torch.Tensor:
    """A copy of a contiguous cache ``[B, H, N, D]`` with NaN in every slot outside ``[kv_start[b], end)`` (left
    padding, unused slots after the queries): a stray read cannot pass."""
    x = x.clone()
    for b in range(x.shape[0]):
        x[b, :, : int(kv_start[b])] = NAN
        x[b, :, end:] = NAN
    return x


def poison_queries(q: torch.Tensor, kv_start, q_offset: int) -> torch.Tensor:
    """A copy of ``q [B, HQ, L, D]`` with NaN at the queries that sit at padding slots (slot < kv_start[b]): their
    outputs are zeros, and nothing else may depend on them."""
    q = q.clone()
    for b in range(q.shape[0]):
        q[b, :, : max(0, int(kv_start[b]) - q_offset)] = NAN
    return q


def paged_cache(x: torch.Tensor, kv_start, end: int, page: int, g: torch.Generator):
    """Scatter the valid rows ``[kv_start[b], end)`` of a contiguous ``[B, H, N, D]`` cache into random pages of a
    NaN-filled ``[num_pages, page, H, D]`` cache. Returns (cache, block_table ``[B, max_pages]`` int32, seq_lens
    ``[B]``), on the CPU; table entries past a sequence's pages point at a spare (NaN) page."""
    B, H, N, D = x.shape
    lens = [end - int(s) for s in kv_start]
    need = [-(-n // page) for n in lens]
    total = sum(need) + 3  # spare pages stay NaN
    perm = torch.randperm(total, generator=g)
    cache = torch.full((total, page, H, D), NAN, dtype=x.dtype)
    table = torch.full((B, max(need) + 2), int(perm[sum(need)]), dtype=torch.int32)
    used = 0
    for b in range(B):
        table[b, : need[b]] = perm[used : used + need[b]].to(torch.int32)
        used += need[b]
        for i in range(lens[b]):
            cache[table[b, i // page], i % page] = x[b, :, int(kv_start[b]) + i]
    return cache, table, torch.tensor(lens)


@contextlib.contextmanager
def poisoned_allocations():
    """While open, ``torch.empty`` / ``torch.empty_like`` return tensors filled with NaN (floating) or :data:`JUNK`
    (int32 / int64): the buffers a launcher allocates itself (outputs without ``out=``, indices, scratch) then fail
    the checks where a kernel leaves them partly unwritten or reads them before writing. Wrap kernel calls only."""
    empty, empty_like = torch.empty, torch.empty_like

    def fill(t):
        if t.is_floating_point():
            t.fill_(NAN)
        elif t.dtype in (torch.int32, torch.int64):
            t.fill_(JUNK)
        return t

    torch.empty = lambda *a, **kw: fill(empty(*a, **kw))
    torch.empty_like = lambda *a, **kw: fill(empty_like(*a, **kw))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


def scoring_hist(rows: int) -> torch.Tensor:
    """Radix-select histograms ``[rows, NHIST]`` as a scoring pass leaves them (``topk.zero_hist``): the bins every
    selection counts into and the tickets zeroed, every other counter 777 (a fallback row zeroes what it needs
    itself; a count that large, not :data:`JUNK`, so that a selection misled by it fails its check instead of
    writing out of its row's bounds under the interpreter)."""
    from kascade.ops.triton import topk

    hist = torch.full((rows, topk.NHIST), 777, dtype=torch.int32)
    hist[:, : topk.HOT] = 0
    hist[:, topk.TICKETS:] = 0
    return hist


# ----------------------------------------------------------------------------------------------------------------
# The reference's pooled probabilities and log-sum-exp
# ----------------------------------------------------------------------------------------------------------------
def pooled_decode_rows(q, k, kv_start, q_offset: int, scale: float) -> list[torch.Tensor]:
    """Per sequence, the reference's pooled probabilities of its decode query ``[H, n_b]`` (fp32 math on the
    low-precision inputs, on the CPU), compact key positions."""
    q, k = q.cpu(), k.cpu()
    out = []
    for b in range(q.shape[0]):
        s = int(kv_start[b])
        out.append(reference.pooled_decode(q[b].float(), k[b, :, s : q_offset + 1].float(), scale))
    return out


def pooled_prefill_rows(q, k, kv_start, q_offset: int, scale: float, T: int) -> list[torch.Tensor]:
    """Per sequence: the reference's pooled probabilities of every tile of the call, ``[H, R_b, n_b]`` (fp32 on the
    low-precision inputs, on the CPU), keys at or after the tile at -inf."""
    q, k = q.cpu(), k.cpu()
    B, HQ, L, D = q.shape
    out = []
    for b in range(B):
        s0 = int(kv_start[b])
        n = q_offset + L - s0
        l = min(L, n)
        parts = []
        for t0, pooled in reference.iter_pooled_prefill(q[b, :, L - l :].float(), k[b, :, s0 : s0 + n].float(),
                                                        scale, T):
            c = pooled.shape[1]
            full = pooled.new_full((pooled.shape[0], c, n), float("-inf"))
            full[:, :, : pooled.shape[2]] = pooled
            s = torch.arange(t0, t0 + c) * T
            full = full.masked_fill(torch.arange(n)[None, :] >= s[:, None], float("-inf"))
            parts.append(full)
        out.append(torch.cat(parts, 1))
    return out


def check_lse(lse, q, k, kv_start, q_offset: int, scale: float, what: str = "LSE", atol: float = 1e-4) -> None:
    """A prefill LSE ``[B, HQ, L]`` against fp64 logsumexp of each valid causal row (of the low-precision inputs);
    ``-inf`` at padding queries. ``atol``: FP8 scoring's on the GPU is :data:`FP8_RTOL` (its tensor cores' sums)."""
    lse, q, k = lse.cpu(), q.cpu(), k.cpu()
    B, HQ, L, D = q.shape
    G = HQ // k.shape[1]
    for b in range(B):
        s0 = int(kv_start[b])
        pad = max(0, min(L, s0 - q_offset))  # queries at padding slots
        assert torch.isinf(lse[b, :, :pad]).all() and (lse[b, :, :pad] < 0).all(), f"{what}: padding query LSE"
        if pad == L:
            continue
        kb = k[b, :, s0 : q_offset + L].double().repeat_interleave(G, 0)  # [HQ, n, D]
        sc = torch.einsum("hid,hkd->hik", q[b, :, pad:].double(), kb) * scale
        slots = torch.arange(q_offset + pad, q_offset + L)[:, None]
        sc = sc.masked_fill(torch.arange(s0, q_offset + L)[None, :] > slots, float("-inf"))
        ref = torch.logsumexp(sc, -1)
        got = lse[b, :, pad:].double()
        bad = ~torch.isclose(got, ref, rtol=1e-5, atol=atol)
        assert not bad.any(), f"{what}: seq {b} query {pad + int(bad.nonzero()[0, 1])}"


# ----------------------------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------------------------
def check_close(got, exact, lowp, what: str = "output", floor: float = 1e-6) -> None:
    """:func:`tolerance.assert_close_to_reference` on the CPU (``got`` may be on the kernels' device)."""
    assert_close_to_reference(got.cpu(), exact.cpu(), lowp.cpu(), what, floor=floor)


def _check_row(row, ref, p, kb: int, limit: int, offset: int, ranked: bool, what: str, rtol: float) -> None:
    """One selection row ``row`` (slots; ``offset`` is the sequence's first, 0 when they are positions already)
    against the reference's ``ref`` (absolute slots, -1 padded): its first ``kb`` entries are keys among the
    ``limit`` candidates, the rest -1; ascending (or, ``ranked``, distinct and in descending pooled probability
    ``p``); the same set as the reference's except for keys whose ``p`` ties the k-th largest within ``rtol``."""
    assert bool((row[kb:] == -1).all()), f"{what}: padding is not -1"
    got = row[:kb] - offset
    if kb:
        assert int(got.min()) >= 0 and int(got.max()) < limit, f"{what}: index out of range"
    if ranked:
        assert got.unique().numel() == kb, f"{what}: a key twice"
        pv = p[got]
        assert bool((pv[1:] <= pv[:-1] * (1 + rtol)).all()), f"{what}: not in descending pooled probability"
    else:
        assert bool((got[1:] > got[:-1]).all()), f"{what}: not strictly ascending"
    diff = set(got.tolist()) ^ set((ref[ref >= 0] - offset).tolist())
    if diff:
        kth = p.topk(kb).values[-1]
        gap = (p[sorted(diff)] - kth).abs().max()
        assert gap <= rtol * kth, f"{what}: {len(diff)} keys differ, {gap:.3g} from the k-th"


def check_decode_selection(sel, want, pooled, kv_start, q_offset: int, budget: Budget, *, paged: bool, what: str,
                           rank_factor: float | None = None, rtol: float = 1e-4) -> tuple[int, int]:
    """A decode selection (a kernel's, any device) against the reference's ``want`` (absolute slots): same shape,
    the reference's sets except where its pooled scores (``pooled``, :func:`pooled_decode_rows`) tie the k-th
    largest within rounding; count, order, range and -1 padding exact. Paged: logical positions. ``rank_factor``: a ranked
    selection (``Budget.decode_counts(n, rank_factor)`` keys, descending probability). Returns (keys selected, rows that
    kept fewer keys than they had)."""
    sel = host_selection(sel)
    assert sel.decode and sel.indices.dtype == torch.long
    assert sel.ranked == (rank_factor is not None), f"{what}: ranked is {sel.ranked}"
    assert sel.indices.shape == want.indices.shape, f"{what}: shape {tuple(sel.indices.shape)}"
    assert torch.equal(sel.row_start, torch.zeros_like(sel.row_start))
    B, H = sel.indices.shape[:2]
    selected = strict = 0
    for b in range(B):
        start = int(kv_start[b])
        n = q_offset + 1 - start
        kb = budget.decode(n) if rank_factor is None else budget.decode_counts(n, rank_factor)
        for h in range(H):
            # paged rows hold positions already: the reference's slots are shifted instead
            ref = want.indices[b, h, 0]
            ref = torch.where(ref >= 0, ref - start, -1) if paged else ref
            _check_row(sel.indices[b, h, 0], ref, pooled[b][h], kb, n, 0 if paged else start, rank_factor is not None,
                       f"{what}: seq {b} head {h}", rtol)
            selected += kb
            strict += kb < n
    return selected, strict


def check_prefill_selection(sel, want, pooled, kv_start, q_offset: int, L: int, budget: Budget, what: str,
                            rank_factor: float | None = None, rtol: float = 1e-4) -> tuple[int, int]:
    """A prefill selection (a kernel's, any device, int64) against the reference's ``want``: same row layout and -1
    padding, each row's ``Budget.prefill_tile`` (or, ``rank_factor``, ranked ``row_counts``) keys strictly before its tile,
    ascending (ranked: descending pooled probability), and the reference's sets except for keys whose reference score
    (``pooled``, :func:`pooled_prefill_rows`) ties the k-th largest within rounding; rows past a sequence's last tile
    all -1. Returns (keys selected, rows that kept fewer keys than they had); asserts some key was selected."""
    sel = host_selection(sel)
    assert not sel.decode and sel.tile == budget.tile and sel.indices.dtype == torch.long
    assert sel.ranked == (rank_factor is not None), f"{what}: ranked is {sel.ranked}"
    assert sel.indices.shape == want.indices.shape, \
        f"{what}: shape {tuple(sel.indices.shape)} vs {tuple(want.indices.shape)}"
    assert torch.equal(sel.row_start, want.row_start.cpu()), f"{what}: row_start"
    B, H, R, K = sel.indices.shape
    T = budget.tile
    selected = strict = 0
    for b in range(B):
        s0 = int(kv_start[b])
        n = q_offset + L - s0
        t_first = int(want.row_start[b])
        for r in range(pooled[b].shape[1]):
            s = (t_first + r) * T
            kb = budget.prefill_tile(s, n) if rank_factor is None else at_factor(budget.prefill_tile(s, n), rank_factor, s)
            for h in range(H):
                _check_row(sel.indices[b, h, r], want.indices[b, h, r], pooled[b][h, r], kb, s, s0,
                           rank_factor is not None, f"{what}: seq {b} row {r} head {h}", rtol)
                selected += kb
                strict += 0 < kb < s
        for r in range(pooled[b].shape[1], R):  # rows past this sequence's last tile
            assert bool((sel.indices[b, :, r] == -1).all()), f"{what}: seq {b} row {r} beyond its tiles"
    assert selected > 0, f"{what}: no key selected at all: the case tests nothing"
    return selected, strict
