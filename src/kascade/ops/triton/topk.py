"""Top-k selection over pooled probabilities, the step that decides an anchor layer's cost.

* Decode (:func:`select_rows`): one row of pooled probabilities per (sequence, KV head), from the scores and
  softmax statistics the split-K scoring pass wrote. A radix select on the bit pattern of the (non-negative) fp32
  probabilities: the pooling kernel builds the histogram of the top 12 bits, two passes refine the next 12 and 7
  bits among the elements sharing the prefix, then an ordered compaction writes every element above the exact
  threshold and the first ones equal to it, in key order (exact; ties at the threshold go to the earliest keys).
* Prefill (:func:`tile_topk`): the rows of a chunk of tiles, over the chunk's score buffer: the same radix select
  as decode (``method="radix"``, :func:`row_topk`: a histogram pass over the rows, then the decode passes with one
  row per "sequence"; what :func:`kascade.ops.triton.prefill.select_prefill` uses by default), or ``torch.topk``
  (``method="topk"``).

The histograms are counted with one global atomic per key; between the passes, with many programs, a program per
row finds the bin holding the row's k-th element (FIND_ONCE_PROGRAMS).

Kernels and launchers only: they assert, they do not validate.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Radix selection on the bit pattern of the (non-negative) fp32 pooled probabilities: 12 + 12 + 7 bits.
_NB1, _NB2, _NB3 = 4096, 4096, 128
NHIST = _NB1 + _NB2 + _NB3  # histogram bins per row (the scoring pass zeroes them)
# Keys per program in the selection passes.
SELECT_CHUNK = 2048
# The radix passes need the bin holding each row's k-th element. With many programs (rows x chunks) a program per
# row finds it once before each pass; with few, every program finds it itself (two launches fewer, which is what
# counts at B = 1). H200: once per row saves ~150 us of 3,300 at B=32, N=128K (16,384 programs) and costs ~4 us at
# B=1, N=32K (128 programs); docs/benchmarks/decode.md.
FIND_ONCE_PROGRAMS = 1024


# ----------------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _find_bin(Hrow, kneed, NB: tl.constexpr):
    """Bin holding the kneed-th largest element of a histogram, and how many of that bin are still needed."""
    offs = tl.arange(0, NB)
    cnt = tl.load(Hrow + offs)
    incl = tl.cumsum(cnt, 0)
    total = tl.sum(cnt, 0)
    at_or_above = total - incl + cnt  # elements in bins >= i, non-increasing in i
    sel = tl.sum((at_or_above >= kneed).to(tl.int32), 0) - 1
    above = tl.sum(tl.where(offs > sel, cnt, 0), 0)
    return sel, kneed - above


@triton.jit
def _count_bins(Hrow, bins, ok):
    """Add the ``bins`` (int32 >= 0, where ``ok``) to the histogram ``Hrow``: one relaxed global atomic per key.
    (Tried on the H200 and slower: one atomic per distinct bin of a warp, found with ``match.any``; one per run of
    a sorted chunk; ``tl.histogram`` with 4096 bins. docs/benchmarks/decode.md.)"""
    tl.atomic_add(Hrow + bins, tl.full(bins.shape, 1, tl.int32), mask=ok, sem="relaxed")


@triton.jit
def _pool_kernel(Sc, Mx, Ls, Meta, Pooled, Hist, sc_row, S,
                 H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, S_PAD: tl.constexpr,
                 CH: tl.constexpr, NHIST: tl.constexpr, HIST: tl.constexpr):
    """Pooled probabilities of one chunk of one (sequence, KV head) row, and the first radix histogram."""
    c = tl.program_id(0)
    row = tl.program_id(1)
    b = row // H
    h = row % H
    n = tl.load(Meta + b * 4 + 1)
    offs_g = tl.arange(0, GP)
    gm = offs_g < G
    hq = row * G + offs_g  # = b * HQ + h * G + g
    offs_s = tl.arange(0, S_PAD)
    sm = offs_s < S
    # softmax statistics of each head of the group, merged over splits
    stp = (hq * S)[:, None] + offs_s[None, :]
    m = tl.load(Mx + stp, mask=gm[:, None] & sm[None, :], other=float("-inf"))  # [GP, S_PAD]
    l = tl.load(Ls + stp, mask=gm[:, None] & sm[None, :], other=0.0)
    mx = tl.where(gm, tl.max(m, 1), 0.0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - mx[:, None]))
    inv_l = tl.where(gm, 1.0 / tl.sum(l * w, 1), 0.0)
    # pooled probabilities [CH]
    pos = c * CH + tl.arange(0, CH)
    pm = pos < n
    s = tl.load(Sc + (hq.to(tl.int64) * sc_row)[:, None] + pos[None, :], mask=gm[:, None] & pm[None, :],
                other=float("-inf"))
    p = tl.sum(tl.exp2(s - mx[:, None]) * inv_l[:, None], 0)
    p = tl.where(pm, p, -1.0)  # below every probability: never selected by torch.topk
    tl.store(Pooled + row.to(tl.int64) * sc_row + pos, p, mask=pos < sc_row)
    if HIST:
        # Global atomics (tl.histogram with 4096 bins costs O(bins) per warp step: 4x slower than the scoring pass
        # in our measurement); the bins of one row are spread over ~2^4 per exponent.
        key = p.to(tl.int32, bitcast=True)
        _count_bins(Hist + row * NHIST, key >> 19, pm)


@triton.jit
def _hist_kernel(Vals, Meta, Hist, sc_row, CH: tl.constexpr, NHIST: tl.constexpr):
    """The first radix histogram of one chunk of one row of candidate values (>= 0; -inf: not a candidate), for
    rows that come without a pooling pass (prefill's score buffer)."""
    c = tl.program_id(0)
    row = tl.program_id(1)
    n = tl.load(Meta + row * 4 + 1)
    pos = c * CH + tl.arange(0, CH)
    pm = pos < n
    key = tl.load(Vals + row.to(tl.int64) * sc_row + pos, mask=pm, other=float("-inf")).to(tl.int32, bitcast=True)
    ok = pm & (key >= 0)  # -inf (and any negative value) is no candidate
    _count_bins(Hist + row * NHIST, key >> 19, ok)


@triton.jit
def _find_level(Meta, Hist, State, row, H: tl.constexpr, NHIST: tl.constexpr, LEVEL: tl.constexpr):
    """The bin search before radix pass LEVEL, from the histograms so far, into ``State`` (row: bin, still
    needed, prefix, still needed): LEVEL 2, the 12-bit bin of the row's k-th element; 3, the 24-bit prefix; 4, the
    exact 31-bit threshold and how many elements equal to it to take. Returns what the pass needs: the bin, the
    prefix, the threshold."""
    hrow = Hist + row * NHIST
    if LEVEL == 2:
        kk = tl.load(Meta + (row // H) * 4 + 2)
        b1, r1 = _find_bin(hrow, kk, 4096)
        tl.store(State + row * 4 + 0, b1)
        tl.store(State + row * 4 + 1, r1)
        return b1
    elif LEVEL == 3:
        b1 = tl.load(State + row * 4 + 0)
        r1 = tl.load(State + row * 4 + 1)
        b2, r2 = _find_bin(hrow + 4096, r1, 4096)
        prefix = (b1 << 12) | b2
        tl.store(State + row * 4 + 2, prefix)
        tl.store(State + row * 4 + 3, r2)
        return prefix
    else:
        prefix = tl.load(State + row * 4 + 2)
        r2 = tl.load(State + row * 4 + 3)
        b3, r3 = _find_bin(hrow + 8192, r2, 128)
        thr = (prefix << 7) | b3
        tl.store(State + row * 4 + 0, thr)
        tl.store(State + row * 4 + 1, r3)
        return thr


@triton.jit
def _find_kernel(Meta, Hist, State, H: tl.constexpr, NHIST: tl.constexpr, LEVEL: tl.constexpr):
    """:func:`_find_level` once per row (with many programs: FIND_ONCE_PROGRAMS)."""
    _find_level(Meta, Hist, State, tl.program_id(0), H, NHIST, LEVEL)


@triton.jit
def _radix_kernel(Pooled, Meta, Hist, State, Cnt, sc_row, C,
                  H: tl.constexpr, CH: tl.constexpr, NHIST: tl.constexpr, LEVEL: tl.constexpr,
                  FOUND: tl.constexpr):
    """LEVEL 2 / 3: histogram of the next bits among the elements that share the prefix found so far.
    LEVEL 4: count, per chunk, the elements above the exact threshold and equal to it.
    FOUND: ``State`` already holds this level's bin search (:func:`_find_kernel`); else every program makes it
    (and stores the same values)."""
    c = tl.program_id(0)
    row = tl.program_id(1)
    b = row // H
    n = tl.load(Meta + b * 4 + 1)
    pos = c * CH + tl.arange(0, CH)
    pm = pos < n
    key = tl.load(Pooled + row.to(tl.int64) * sc_row + pos, mask=pm, other=0.0).to(tl.int32, bitcast=True)
    hrow = Hist + row * NHIST
    if FOUND:
        found = tl.load(State + row * 4 + (0 if LEVEL != 3 else 2))
    else:  # (the bin search reads State written by the previous level's launch, never by this one)
        found = _find_level(Meta, Hist, State, row, H, NHIST, LEVEL)
    if LEVEL == 2:
        _count_bins(hrow + 4096, (key >> 7) & 4095, pm & ((key >> 19) == found))
    elif LEVEL == 3:
        _count_bins(hrow + 8192, key & 127, pm & ((key >> 7) == found))
    else:
        thr = found
        gt = tl.sum((pm & (key > thr)).to(tl.int32), 0)
        eq = tl.sum((pm & (key == thr)).to(tl.int32), 0)
        tl.store(Cnt + (row * C + c) * 2 + 0, gt)
        tl.store(Cnt + (row * C + c) * 2 + 1, eq)


@triton.jit
def _write_kernel(Pooled, Meta, State, Cnt, Out, sc_row, C, KMAX,
                  H: tl.constexpr, CH: tl.constexpr, C_PAD: tl.constexpr, PAGED: tl.constexpr):
    """Ordered compaction: every element above the threshold, and the first ones equal to it, in key order."""
    c = tl.program_id(0)
    row = tl.program_id(1)
    b = row // H
    n = tl.load(Meta + b * 4 + 1)
    kb = tl.load(Meta + b * 4 + 2)
    if PAGED:
        base = 0
    else:
        base = tl.load(Meta + b * 4)
    thr = tl.load(State + row * 4 + 0)
    need = tl.load(State + row * 4 + 1)  # elements equal to thr to take
    offs_c = tl.arange(0, C_PAD)
    before = offs_c < c
    gt_before = tl.sum(tl.load(Cnt + (row * C + offs_c) * 2, mask=before, other=0), 0)
    eq_before = tl.sum(tl.load(Cnt + (row * C + offs_c) * 2 + 1, mask=before, other=0), 0)
    pos = c * CH + tl.arange(0, CH)
    pm = pos < n
    key = tl.load(Pooled + row.to(tl.int64) * sc_row + pos, mask=pm, other=0.0).to(tl.int32, bitcast=True)
    gt = pm & (key > thr)
    eq = pm & (key == thr)
    eqi = eq.to(tl.int32)
    eq_rank = tl.cumsum(eqi, 0) - eqi + eq_before
    sel = gt | (eq & (eq_rank < need))
    seli = sel.to(tl.int32)
    dst = gt_before + tl.minimum(eq_before, need) + tl.cumsum(seli, 0) - seli
    tl.store(Out + row.to(tl.int64) * KMAX + dst, (base + pos).to(Out.dtype.element_ty), mask=sel)
    if c == 0:
        for p0 in range(kb, KMAX, CH):
            pp = p0 + tl.arange(0, CH)
            tl.store(Out + row.to(tl.int64) * KMAX + pp, tl.full([CH], -1, Out.dtype.element_ty), mask=pp < KMAX)


# ----------------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------------
def _radix_passes(vals, meta, Hist, out, sc_row, rows, H, ch, C, KMAX, paged):
    """After the first histogram: the two refining passes, the per-chunk counts at the exact threshold and the
    ordered write of each row's top keys into ``out`` (``rows`` rows of ``KMAX`` slots)."""
    dev = vals.device
    State = torch.empty(rows, 4, dtype=torch.int32, device=dev)
    Cnt = torch.empty(rows, C, 2, dtype=torch.int32, device=dev)
    once = rows * C >= FIND_ONCE_PROGRAMS
    for level in (2, 3, 4):
        if once:
            _find_kernel[(rows,)](meta, Hist, State, H=H, NHIST=NHIST, LEVEL=level)
        _radix_kernel[(C, rows)](vals, meta, Hist, State, Cnt, sc_row, C, H=H, CH=ch, NHIST=NHIST, LEVEL=level,
                                 FOUND=once)
    _write_kernel[(C, rows)](vals, meta, State, Cnt, out, sc_row, C, KMAX, H=H, CH=ch,
                             C_PAD=triton.next_power_of_2(C), PAGED=paged)


def select_rows(Sc, Mx, Ls, Hist, S, meta, B, H, G, *, method="radix", chunk=None, ranked=False,
                index_dtype=torch.long) -> torch.Tensor:
    """Top-k keys of every (sequence, KV head) row of a decode step: ``[B, H, 1, KMAX]`` key slots in
    ``index_dtype`` (int64 or int32; logical positions when paged), -1 padded; ``meta``
    (:class:`kascade.ops.step.DecodeMeta`) gives each row's count ``k_b``. ``Sc [B, HQ, sc_row]``: fp32 scores
    (log2 domain), ``Mx, Ls [B, HQ, S]``: per-split softmax maxima and sums, ``Hist [B*H, NHIST]`` zeroed.
    ``method``: "radix" (exact, ties to the earliest keys) or "topk" (``torch.topk`` on the pooled row). Ascending
    slots, or with ``ranked`` in descending pooled probability (the radix select picks the keys, then only they are
    sorted)."""
    dev = Sc.device
    sc_row = Sc.shape[-1]
    KMAX = meta.k_max
    ch = chunk or min(SELECT_CHUNK, triton.next_power_of_2(meta.n_max))
    C = triton.cdiv(meta.n_max, ch)
    rows = B * H
    Pooled = torch.empty(rows, sc_row, dtype=torch.float32, device=dev)
    radix = method == "radix"
    _pool_kernel[(C, rows)](Sc, Mx, Ls, meta.tensor, Pooled, Hist, sc_row, S, H=H, G=G,
                            GP=triton.next_power_of_2(G), S_PAD=triton.next_power_of_2(S), CH=ch, NHIST=NHIST,
                            HIST=radix)
    if radix:
        indices = torch.empty(B, H, 1, KMAX, dtype=index_dtype, device=dev)
        _radix_passes(Pooled, meta.tensor, Hist, indices, sc_row, rows, H, ch, C, KMAX, meta.paged)
        if ranked:
            base = 0 if meta.paged else meta.tensor[:, 0].long()[:, None, None]
            sel = indices[:, :, 0]  # [B, H, KMAX], ascending slots, -1 padded
            indices = _by_value(sel, Pooled.view(B, H, sc_row).gather(-1, (sel.long() - base).clamp(min=0)))
            indices = indices[:, :, None, :]
        return indices
    assert method == "topk", method
    top = Pooled.view(B, H, sc_row).topk(KMAX, dim=-1).indices  # descending scores
    kb = meta.tensor[:, 2].long()  # on the device: no host copy, so this path can be captured in a graph
    keep = torch.arange(KMAX, device=dev)[None, :] < kb[:, None]  # [B, KMAX]
    big = torch.iinfo(torch.long).max
    top = torch.where(keep[:, None, :], top, big)
    if not ranked:
        top = top.sort(-1).values
    base = meta.tensor[:, 0].long()[:, None, None]
    return torch.where(top == big, -1, top + (0 if meta.paged else base))[:, :, None, :].to(index_dtype)


def row_topk(vals: torch.Tensor, counts: torch.Tensor, kc: int, *, ranked: bool = False,
             chunk: int | None = None) -> torch.Tensor:
    """Exact top ``counts[r]`` of every row of ``vals [R, W]`` (fp32, candidates >= 0, -inf elsewhere) by radix
    select: ``counts [R]`` int32 on the device, ``kc >= counts.max()`` (a host bound, no read-back). ``-> [R, kc]``
    int64 positions, -1 padded; ascending (ties at the threshold: the earliest positions), or with ``ranked`` in
    descending value (ties: the earlier position first). A row must have at least ``counts[r]`` candidates.

    The decode passes with one row per "sequence" (``H = 1``, a per-row ``meta``: 0, the span ``W``, the count, 0),
    after a histogram pass of their own (decode's comes from its pooling kernel)."""
    R, W = vals.shape
    assert vals.dtype == torch.float32 and vals.is_contiguous() and counts.shape == (R,)
    dev = vals.device
    meta = torch.zeros(R, 4, dtype=torch.int32, device=dev)
    meta[:, 1] = W
    meta[:, 2] = counts
    ch = chunk or min(SELECT_CHUNK, triton.next_power_of_2(W))
    C = triton.cdiv(W, ch)
    Hist = torch.zeros(R, NHIST, dtype=torch.int32, device=dev)
    _hist_kernel[(C, R)](vals, meta, Hist, W, CH=ch, NHIST=NHIST)
    out = torch.empty(R, kc, dtype=torch.long, device=dev)
    _radix_passes(vals, meta, Hist, out, W, R, 1, ch, C, kc, False)
    return _by_value(out, vals.gather(-1, out.clamp(min=0))) if ranked else out


def _by_value(sel: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    """Rows of selected keys ``sel`` (ascending, -1 padded) reordered by their values ``vals`` (same shape),
    descending; ties keep the earlier key first, the padding stays at the end: ranking only the selected keys,
    a sort of K values rather than a top-k over all n."""
    vals = torch.where(sel >= 0, vals, float("-inf"))
    return sel.gather(-1, vals.argsort(dim=-1, descending=True, stable=True))


def tile_topk(buf: torch.Tensor, counts: torch.Tensor, kc: int, *, ranked: bool = False,
              method: str = "topk") -> torch.Tensor:
    """Top keys of a chunk of prefill rows: ``buf [B, H, C, W]`` fp32 pooled probabilities (-inf where a key is
    not a candidate), ``counts [B, C]`` (on the device) keys per row, ``kc >= counts.max()`` (a host bound).
    ``-> [B, H, C, kc]`` int64 positions into the buffer, -1 padded; ascending, or with ``ranked`` in descending
    probability. ``method``: "topk" (``torch.topk``) or "radix" (:func:`row_topk`; exact, ties at the threshold to
    the earliest keys)."""
    if method == "radix":
        B, H, C, W = buf.shape
        rows = counts.to(torch.int32)[:, None, :].expand(B, H, C).reshape(-1)
        return row_topk(buf.view(B * H * C, W), rows, kc, ranked=ranked).view(B, H, C, kc)
    assert method == "topk", method
    top = buf.topk(kc, dim=-1, sorted=True).indices  # [B, H, C, kc], descending scores
    keep = torch.arange(kc, device=buf.device)[None, None, :] < counts[:, :, None]  # [B, C, kc]
    big = torch.iinfo(torch.long).max
    top = torch.where(keep[:, None], top, big)
    if not ranked:
        top = top.sort(-1).values
    return torch.where(top == big, -1, top)
