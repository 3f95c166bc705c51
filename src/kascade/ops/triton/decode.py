"""Triton decode kernels (one new query per sequence, ``L == 1``) and their launchers.

Layouts (``G = HQ / H``; query head ``hq`` reads KV head ``hq // G``):

* ``q [B, HQ, 1, D]``; outputs ``[B, HQ, 1, D]`` in ``q``'s dtype.
* **Contiguous** KV (what transformers' cache holds): ``k, v [B, H, N, D]`` (last dim contiguous). The valid keys of
  sequence ``b`` are slots ``[kv_start[b], q_offset + 1)``; the new query sits at slot ``q_offset`` (its own key is
  already in the cache). Selection indices are absolute slots.
* **Paged** KV (vLLM / FlashInfer layout): ``k, v [num_pages, page_size, H, D]``, ``block_table [B, max_pages]``
  int32 (logical page ``i`` of sequence ``b`` is physical page ``block_table[b, i]``) and ``seq_lens [B]``: the valid
  keys of sequence ``b`` are its logical positions ``0 .. seq_lens[b] - 1`` and the new query is the last of them.
  ``kv_start`` / ``q_offset`` are not used; selection indices are logical positions.

Kernels only: these functions assert, they do not validate (that is :mod:`kascade.ops`' job). Every launcher takes
an optional ``meta`` (:func:`decode_meta`) so that a decode step can build the per-sequence metadata once and reuse
it in every layer (plan / run split); without it the metadata is built from the arguments on each call.

Numerics: scores and softmax in fp32 (log2 domain); ``p @ v`` on the tensor cores with ``p`` split into two
value-dtype parts (high + low), so the weights keep ~16 bits instead of bf16's 8; split-K partials merged by
log-sum-exp in fp32. The error is then that of rounding an exact result to the output dtype.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from ...budget import Budget
from ..selection import Selection

LOG2E = 1.4426950408889634

# Radix selection on the bit pattern of the (non-negative) fp32 pooled probabilities: 12 + 12 + 7 bits.
_NB1, _NB2, _NB3 = 4096, 4096, 128
_NHIST = _NB1 + _NB2 + _NB3
# Keys per program in the selection passes.
SELECT_CHUNK = 2048


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_SM_COUNT: dict = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter: a few programs are enough to exercise the split-K paths
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SM_COUNT:
        _SM_COUNT[key] = torch.cuda.get_device_properties(key).multi_processor_count
    return _SM_COUNT[key]


# ----------------------------------------------------------------------------------------------------------------
# Per-step metadata (plan)
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DecodeMeta:
    """Per-sequence metadata of one decode step, shared by every layer of the step.

    tensor: ``[B, 4]`` int32 on the device: first valid slot (0 when paged), valid keys ``n_b``, budget ``k_b``, 0.
    n, k:   the same ``n_b`` and ``k_b`` on the host (``k`` is ``None`` when no budget was given).
    paged:  whether it describes a paged cache.
    derived: tensors computed from it once per step (:func:`ranked_counts`, :func:`ranked_meta`).
    """

    tensor: torch.Tensor
    n: tuple
    k: tuple | None
    paged: bool
    derived: dict = field(default_factory=dict, compare=False, repr=False)  # memo of ranked_counts / ranked_meta

    @property
    def n_max(self) -> int:
        return max(self.n)

    @property
    def k_max(self) -> int:
        return max(self.k)


def decode_meta(B: int, *, device, kv_start=None, q_offset=None, seq_lens=None, budget: Budget | None = None,
                paged: bool = False) -> DecodeMeta:
    """Build :class:`DecodeMeta`. Contiguous: ``kv_start`` (``None`` = zeros, list or tensor) and ``q_offset``.
    Paged: ``seq_lens`` (list or tensor; read on the host once)."""
    if paged:
        assert seq_lens is not None, "a paged cache needs seq_lens"
        n = [int(x) for x in torch.as_tensor(seq_lens).reshape(-1).tolist()]
        base = [0] * B
    else:
        assert q_offset is not None
        base = [0] * B if kv_start is None else [int(x) for x in torch.as_tensor(kv_start).reshape(-1).tolist()]
        n = [q_offset + 1 - s for s in base]
    assert len(n) == B and min(n) >= 1
    k = None if budget is None else [budget.decode(x) for x in n]
    rows = [[base[b], n[b], 0 if k is None else k[b], 0] for b in range(B)]
    t = torch.tensor(rows, dtype=torch.int32).to(device)
    return DecodeMeta(tensor=t, n=tuple(n), k=None if k is None else tuple(k), paged=paged)


def decode_meta_static(B: int, kv_start, q_offset: torch.Tensor, capacity: int, budget: Budget) -> DecodeMeta:
    """:class:`DecodeMeta` of a decode step over a static KV cache, computed on the device with no host
    synchronisation, so the step can be captured in a CUDA graph and replayed.

    ``q_offset``: the new query's slot (0-d integer tensor on the device, the same for every sequence);
    ``kv_start``: ``[B]`` integer tensor on the device, or ``None`` (no left padding); ``capacity``: the cache's
    slots. The host-side ``n`` and ``k`` are then launch bounds (the capacity and its budget: grid sizes and index
    widths); the kernels read each sequence's true ``n_b`` and ``k_b`` from the device tensor."""
    dev = q_offset.device
    start = torch.zeros(B, dtype=torch.long, device=dev) if kv_start is None else kv_start.to(torch.long)
    n = q_offset.to(torch.long) + 1 - start  # [B] valid keys
    # k(N) = min(N, max(k_min, floor(ratio N))), in float64 like the host formula (Budget.k)
    kb = torch.minimum(n, torch.clamp(torch.floor(n.double() * budget.ratio).long(), min=budget.k_min))
    t = torch.stack([start, n, kb, torch.zeros_like(n)], 1).to(torch.int32)
    return DecodeMeta(tensor=t, n=(int(capacity),) * B, k=(budget.decode(int(capacity)),) * B, paged=False)


# ----------------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _dot(a, b, F32: tl.constexpr):
    # F32: fp32 inputs (exact ieee dot) or the interpreter, whose bf16 dot is not usable: upcast, products of
    # low-precision operands are exact in fp32 either way.
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _to_out(x, dtype: tl.constexpr, RNE: tl.constexpr):
    # The interpreter converts fp32 to bf16 by truncation, the GPU rounds to nearest even: with RNE set (only
    # under the interpreter) round the bits first so that both give the same output.
    if RNE:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _split_kernel(
    Q, K, V, Idx, Cnt, Meta, BT, Out, Acc, Mx, Ls, Sc, Hist,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_kn,  # contiguous: batch, head, slot; paged: page, head, slot-in-page
    stride_vb, stride_vh, stride_vn,
    stride_ib, stride_ih,
    stride_btb,
    stride_ob, stride_oh,
    n_idx,  # SPARSE: entries per index row
    keys_per_split,
    sc_row,  # length of one score row (WRITE_SCORES)
    qk_scale,  # scale * log2(e)
    H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, PAGED: tl.constexpr, SPARSE: tl.constexpr, HAS_V: tl.constexpr,
    WRITE_SCORES: tl.constexpr, DIRECT: tl.constexpr, F32: tl.constexpr, NHIST: tl.constexpr, RNE: tl.constexpr,
    HAS_CNT: tl.constexpr,
):
    """One program = (split, KV head, sequence), all G query heads of the group (padded to GP rows)."""
    split = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    S = tl.num_programs(0)
    b64 = b.to(tl.int64)
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, D)
    gm = offs_g < G
    hq = h * G + offs_g  # [GP]

    q = tl.load(Q + b64 * stride_qb + hq[:, None] * stride_qh + offs_d[None, :], mask=gm[:, None], other=0.0)

    if SPARSE:
        base = 0
        n = n_idx
        if HAS_CNT:  # attend only the first Cnt[b] entries of each index row (a prefix of a ranked selection)
            n = tl.minimum(n, tl.load(Cnt + b))
    else:
        base = tl.load(Meta + b * 4)
        n = tl.load(Meta + b * 4 + 1)
    lo = split * keys_per_split
    hi = tl.minimum(lo + keys_per_split, n)

    if WRITE_SCORES:
        if split == 0:  # the selection's histograms for this row start from zero
            offs_hz = tl.arange(0, 1024)
            for z in range(0, NHIST, 1024):
                tl.store(Hist + (b * H + h) * NHIST + z + offs_hz, tl.zeros([1024], tl.int32),
                         mask=z + offs_hz < NHIST)

    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        jm = j < hi
        # ---- which rows: positions (contiguous: relative to the first valid slot) ----
        if SPARSE:
            pos = tl.load(Idx + b64 * stride_ib + h * stride_ih + j, mask=jm, other=-1).to(tl.int64)
            valid = pos >= 0
            pos = tl.where(valid, pos, 0)
        else:
            pos = j.to(tl.int64)
            valid = jm
        if PAGED:
            page = tl.load(BT + b64 * stride_btb + pos // PAGE, mask=valid, other=0).to(tl.int64)
            slot = pos % PAGE
            row_k = page * stride_kb + slot * stride_kn
            row_v = page * stride_vb + slot * stride_vn
        else:
            row_k = b64 * stride_kb + (base + pos) * stride_kn
            row_v = b64 * stride_vb + (base + pos) * stride_vn
        # ---- scores [GP, BLOCK_N], log2 domain ----
        kt = tl.load(K + h * stride_kh + row_k[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        s = _dot(q, tl.trans(kt), F32) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        if WRITE_SCORES:
            sp = Sc + ((b * H * G + hq).to(tl.int64) * sc_row)[:, None] + pos[None, :]
            tl.store(sp, s, mask=gm[:, None] & valid[None, :])
        # ---- online softmax ----
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        if HAS_V:
            vt = tl.load(V + h * stride_vh + row_v[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
            # p as the sum of two value-dtype parts: the output then keeps ~16 bits of each weight instead of
            # the 8 of a single bf16 rounding (an extra MMA, free in this memory-bound loop).
            p_hi = p.to(vt.dtype)
            pv = _dot(p_hi, vt, F32) + _dot((p - p_hi.to(tl.float32)).to(vt.dtype), vt, F32)
            acc = acc * alpha[:, None] + pv

    st = (b * H * G + hq) * S + split  # [GP] into [B, HQ, S]
    tl.store(Mx + st, m_i, mask=gm)
    tl.store(Ls + st, l_i, mask=gm)
    if HAS_V:
        if DIRECT:
            o = acc / l_i[:, None]
            tl.store(Out + b64 * stride_ob + hq[:, None] * stride_oh + offs_d[None, :],
                     _to_out(o, Out.dtype.element_ty, RNE), mask=gm[:, None])
        else:
            tl.store(Acc + st[:, None].to(tl.int64) * D + offs_d[None, :], acc, mask=gm[:, None])


@triton.jit
def _merge_kernel(Out, Acc, Mx, Ls, stride_ob, stride_oh, S, HQ: tl.constexpr, D: tl.constexpr,
                  S_PAD: tl.constexpr, RNE: tl.constexpr):
    """Log-sum-exp merge of the split partials of one (sequence, query head)."""
    hq = tl.program_id(0)
    b = tl.program_id(1)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D)
    sm = offs_s < S
    st = (b * HQ + hq) * S + offs_s
    m = tl.load(Mx + st, mask=sm, other=float("-inf"))
    l = tl.load(Ls + st, mask=sm, other=0.0)
    mx = tl.max(m, 0)
    w = tl.exp2(m - mx)  # splits without keys have m = -inf: weight 0
    acc = tl.load(Acc + st[:, None].to(tl.int64) * D + offs_d[None, :], mask=sm[:, None], other=0.0)
    o = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(Out + b.to(tl.int64) * stride_ob + hq * stride_oh + offs_d, _to_out(o, Out.dtype.element_ty, RNE))


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
def _pool_kernel(Sc, Mx, Ls, Meta, Pooled, Hist, sc_row, S,
                 H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, S_PAD: tl.constexpr,
                 CH: tl.constexpr, NHIST: tl.constexpr, NB1: tl.constexpr, HIST: tl.constexpr):
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
        # One relaxed global atomic per key (tl.histogram with 4096 bins costs O(bins) per warp step: 4x slower
        # than the scoring pass in our measurement); the bins of one row are spread over ~2^4 per exponent.
        key = p.to(tl.int32, bitcast=True)
        tl.atomic_add(Hist + row * NHIST + (key >> 19), tl.full([CH], 1, tl.int32), mask=pm, sem="relaxed")


@triton.jit
def _radix_kernel(Pooled, Meta, Hist, State, Cnt, sc_row, C,
                  H: tl.constexpr, CH: tl.constexpr, NHIST: tl.constexpr, LEVEL: tl.constexpr):
    """LEVEL 2 / 3: histogram of the next bits among the elements that share the prefix found so far.
    LEVEL 4: count, per chunk, the elements above the exact threshold and equal to it."""
    c = tl.program_id(0)
    row = tl.program_id(1)
    b = row // H
    n = tl.load(Meta + b * 4 + 1)
    pos = c * CH + tl.arange(0, CH)
    pm = pos < n
    key = tl.load(Pooled + row.to(tl.int64) * sc_row + pos, mask=pm, other=0.0).to(tl.int32, bitcast=True)
    hrow = Hist + row * NHIST
    if LEVEL == 2:
        kk = tl.load(Meta + b * 4 + 2)
        b1, r1 = _find_bin(hrow, kk, 4096)
        tl.store(State + row * 4 + 0, b1)
        tl.store(State + row * 4 + 1, r1)
        match = pm & ((key >> 19) == b1)
        tl.atomic_add(hrow + 4096 + ((key >> 7) & 4095), tl.full([CH], 1, tl.int32), mask=match, sem="relaxed")
    elif LEVEL == 3:
        b1 = tl.load(State + row * 4 + 0)
        r1 = tl.load(State + row * 4 + 1)
        b2, r2 = _find_bin(hrow + 4096, r1, 4096)
        prefix = (b1 << 12) | b2
        tl.store(State + row * 4 + 2, prefix)
        tl.store(State + row * 4 + 3, r2)
        match = pm & ((key >> 7) == prefix)
        tl.atomic_add(hrow + 8192 + (key & 127), tl.full([CH], 1, tl.int32), mask=match, sem="relaxed")
    else:
        prefix = tl.load(State + row * 4 + 2)
        r2 = tl.load(State + row * 4 + 3)
        b3, r3 = _find_bin(hrow + 8192, r2, 128)
        thr = (prefix << 7) | b3
        tl.store(State + row * 4 + 0, thr)
        tl.store(State + row * 4 + 1, r3)
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
    tl.store(Out + row.to(tl.int64) * KMAX + dst, (base + pos).to(tl.int64), mask=sel)
    if c == 0:
        for p0 in range(kb, KMAX, CH):
            pp = p0 + tl.arange(0, CH)
            tl.store(Out + row.to(tl.int64) * KMAX + pp, tl.full([CH], -1, tl.int64), mask=pp < KMAX)


# ----------------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------------
def _gp(G: int) -> int:
    return max(16, triton.next_power_of_2(G))


def _default_config(D: int, sparse: bool) -> tuple[int, int, int, int]:
    """(BLOCK_N, num_warps, num_stages, programs per SM): the fastest of a sweep on an H200 (Llama shapes, B 1-32,
    N 32K-128K; benchmarks/decode.py, docs/benchmarks/decode_run1_tlhistogram.json)."""
    if sparse:
        return (64 if D <= 128 else 32), 4, 3, 4
    return 32, 4, 3, 2


# Split-K aims at this many programs per multiprocessor (the benchmark sweeps it).
PROGRAMS_PER_SM = 4


def _splits(rows: int, n: int, block_n: int, device, num_splits=None, programs_per_sm=None) -> tuple[int, int]:
    """(splits, keys per split): enough programs to fill the GPU, each a whole number of blocks."""
    if num_splits is None:
        want = max(1, triton.cdiv((programs_per_sm or PROGRAMS_PER_SM) * _num_sms(device), rows))
        num_splits = max(1, min(want, triton.cdiv(n, 2 * block_n)))
    per = triton.cdiv(triton.cdiv(n, num_splits), block_n) * block_n
    return triton.cdiv(n, per), per


def _kv_args(k, v, block_table):
    """Strides (batch-or-page, head, slot) of K and V, and the page size (0 when contiguous)."""
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "the head dim must be contiguous"
    if block_table is None:
        return (k.stride(0), k.stride(1), k.stride(2)), (v.stride(0), v.stride(1), v.stride(2)), 0
    assert block_table.dtype == torch.int32 and block_table.dim() == 2
    return (k.stride(0), k.stride(2), k.stride(1)), (v.stride(0), v.stride(2), v.stride(1)), k.shape[1]


def _heads(q, k, block_table):
    B, HQ, L, D = q.shape
    assert L == 1, "decode kernels take one query per sequence"
    H = k.shape[2] if block_table is not None else k.shape[1]
    assert HQ % H == 0 and k.shape[-1] == D and D in (16, 32, 64, 128, 256)
    return B, HQ, H, HQ // H, D


def _run_split(q, k, v, idx, meta, block_table, out, *, scale, n_keys, sparse, has_v, write_scores, sc_row,
               counts=None, num_splits=None, block_n=None, num_warps=None, num_stages=None, programs_per_sm=None):
    """Launch the split-K kernel and, if needed, the merge. Returns (out, Mx, Ls, Sc, Hist, S)."""
    B, HQ, H, G, D = _heads(q, k, block_table)
    dev = q.device
    bn, nw, ns, ppsm = _default_config(D, sparse)
    bn = block_n or bn
    nw = num_warps or nw
    num_stages = num_stages or ns
    programs_per_sm = programs_per_sm or ppsm
    if _interpreting():
        num_stages = None
    S, per = _splits(B * H, n_keys, bn, dev, num_splits, programs_per_sm)
    direct = S == 1
    f32 = _interpreting() or q.dtype == torch.float32
    rne = _interpreting() and q.dtype == torch.bfloat16
    ks, vs, page = _kv_args(k, v if v is not None else k, block_table)
    Mx = torch.empty(B, HQ, S, dtype=torch.float32, device=dev)
    Ls = torch.empty_like(Mx)
    Acc = Mx if (direct or not has_v) else torch.empty(B, HQ, S, D, dtype=torch.float32, device=dev)
    Sc = torch.empty(B, HQ, sc_row, dtype=torch.float32, device=dev) if write_scores else Mx
    Hist = torch.empty(B * H, _NHIST, dtype=torch.int32, device=dev) if write_scores else Mx
    if has_v and out is None:
        out = torch.empty_like(q)
    if sparse:
        assert idx.dim() == 4 and idx.shape[2] == 1 and idx.stride(-1) == 1
    dummy = Mx
    extra = {} if num_stages is None else {"num_stages": num_stages}
    if counts is not None:
        assert sparse and counts.dtype == torch.int32 and counts.shape == (B,) and counts.is_contiguous()
    _split_kernel[(S, H, B)](
        q, k, v if v is not None else k, idx if sparse else dummy, counts if counts is not None else dummy,
        meta.tensor if meta is not None else dummy,
        block_table if block_table is not None else dummy, out if out is not None else dummy, Acc, Mx, Ls, Sc, Hist,
        q.stride(0), q.stride(1), *ks, *vs,
        idx.stride(0) if sparse else 0, idx.stride(1) if sparse else 0,
        block_table.stride(0) if block_table is not None else 0,
        out.stride(0) if out is not None else 0, out.stride(1) if out is not None else 0,
        n_keys, per, sc_row, scale * LOG2E,
        H=H, G=G, GP=_gp(G), D=D, BLOCK_N=bn, PAGE=max(page, 1), PAGED=block_table is not None, SPARSE=sparse,
        HAS_V=has_v, WRITE_SCORES=write_scores, DIRECT=direct, F32=f32, NHIST=_NHIST, RNE=rne,
        HAS_CNT=counts is not None, num_warps=nw,
        **extra,
    )
    if has_v and not direct:
        _merge_kernel[(HQ, B)](out, Acc, Mx, Ls, out.stride(0), out.stride(1), S, HQ=HQ, D=D,
                               S_PAD=triton.next_power_of_2(S), RNE=rne)
    return out, Mx, Ls, Sc, Hist, S


def _meta_for(q, meta, kv_start, q_offset, seq_lens, block_table, budget, N):
    if meta is not None:
        return meta
    if block_table is None and q_offset is None:
        q_offset = N - 1
    return decode_meta(q.shape[0], device=q.device, kv_start=kv_start, q_offset=q_offset, seq_lens=seq_lens,
                       budget=budget, paged=block_table is not None)


def dense_decode(q, k, v, *, scale, kv_start=None, q_offset=None, block_table=None, seq_lens=None, meta=None,
                 out=None, **cfg):
    """Exact decode attention over every valid key (split-K flash-decoding). ``-> [B, HQ, 1, D]``."""
    meta = _meta_for(q, meta, kv_start, q_offset, seq_lens, block_table, None, k.shape[2])
    out, *_ = _run_split(q, k, v, None, meta, block_table, out, scale=scale, n_keys=meta.n_max, sparse=False,
                         has_v=True, write_scores=False, sc_row=0, **cfg)
    return out


def sparse_decode(q, k, v, indices, *, scale, kv_start=None, block_table=None, out=None, counts=None, **cfg):
    """Decode attention over the selected keys only (softmax renormalised over them). ``-> [B, HQ, 1, D]``.

    indices: ``[B, H, 1, K]`` int32 or int64, ascending, -1 padding at the end (a :class:`Selection`'s ``indices``
    are used as they are: loading int64 costs 8 bytes per selected row against the 4*D bytes of its K and V rows,
    less than a conversion launch per layer). Contiguous: absolute slots (``kv_start`` is not needed and ignored);
    paged: logical positions. Every row must hold at least one index.

    counts: ``[B]`` int32 on the device (optional): sequence ``b`` attends only the first ``counts[b]`` entries of
    its rows (the prefix of a ranked selection, :func:`ranked_counts`), as if the rest were -1; the order of the
    entries does not matter.
    """
    del kv_start
    if indices.stride(-1) != 1:
        indices = indices.contiguous()
    out, *_ = _run_split(q, k, v, indices, None, block_table, out, scale=scale, n_keys=indices.shape[-1],
                         sparse=True, has_v=True, write_scores=False, sc_row=0, counts=counts, **cfg)
    return out


def ranked_counts(meta: DecodeMeta, scale: float) -> torch.Tensor:
    """Per sequence of the step, the keys a layer with budget multiplier ``scale`` attends from a ranked
    selection: ``min(n_b, round(scale * k_b))`` (:func:`kascade.reuse.row_counts`' rule, in float64 like it),
    ``[B]`` int32 on the device, computed from the step's metadata with device ops only (graph-capturable).
    Memoised on ``meta`` (one computation per step and scale)."""
    key = ("counts", float(scale))
    if key not in meta.derived:
        n, kb = meta.tensor[:, 1], meta.tensor[:, 2]
        cnt = torch.floor(kb.double() * float(scale) + 0.5)
        meta.derived[key] = torch.minimum(cnt.to(torch.int32), n).contiguous()
    return meta.derived[key]


def ranked_meta(meta: DecodeMeta, depth: float) -> DecodeMeta:
    """The step's metadata with each sequence's budget ``k_b`` replaced by ``min(n_b, round(depth * k_b))`` (the
    count a ranked selection of that depth keeps), memoised on ``meta``."""
    key = ("depth", float(depth))
    if key not in meta.derived:
        t = meta.tensor.clone()
        t[:, 2] = ranked_counts(meta, depth)
        meta.derived[key] = DecodeMeta(tensor=t, n=meta.n, k=tuple(min(n, math.floor(depth * x + 0.5)) for n, x in
                                                                   zip(meta.n, meta.k)), paged=meta.paged)
    return meta.derived[key]


def _select_from_scores(Sc, Mx, Ls, Hist, S, meta, B, H, G, budget, method, ch=None, depth=None):
    """Pooling and top-k over the scores the split kernel wrote. Returns a decode :class:`Selection`; with
    ``depth`` a *ranked* one (see :func:`select_decode`)."""
    dev = Sc.device
    sc_row = Sc.shape[-1]
    KMAX = meta.k_max
    if depth is not None:
        # ranked: round(depth * k_b) keys, capped by n_b (reuse.row_counts' rule); the radix select reads its
        # count from the metadata, so it gets a copy with that count (device ops: graph-capturable)
        meta = ranked_meta(meta, depth)
        KMAX = meta.k_max
    ch = ch or min(SELECT_CHUNK, triton.next_power_of_2(meta.n_max))
    C = triton.cdiv(meta.n_max, ch)
    rows = B * H
    Pooled = torch.empty(rows, sc_row, dtype=torch.float32, device=dev)
    radix = method == "radix"
    _pool_kernel[(C, rows)](Sc, Mx, Ls, meta.tensor, Pooled, Hist, sc_row, S, H=H, G=G,
                            GP=triton.next_power_of_2(G), S_PAD=triton.next_power_of_2(S), CH=ch, NHIST=_NHIST,
                            NB1=_NB1, HIST=radix)
    if radix:
        State = torch.empty(rows, 4, dtype=torch.int32, device=dev)
        Cnt = torch.empty(rows, C, 2, dtype=torch.int32, device=dev)
        for level in (2, 3, 4):
            _radix_kernel[(C, rows)](Pooled, meta.tensor, Hist, State, Cnt, sc_row, C, H=H, CH=ch, NHIST=_NHIST,
                                     LEVEL=level)
        indices = torch.empty(B, H, 1, KMAX, dtype=torch.long, device=dev)
        _write_kernel[(C, rows)](Pooled, meta.tensor, State, Cnt, indices, sc_row, C, KMAX, H=H, CH=ch,
                                 C_PAD=triton.next_power_of_2(C), PAGED=meta.paged)
        if depth is not None:  # rank the selected keys only: a sort of K values, not a top-k over all n
            base = 0 if meta.paged else meta.tensor[:, 0].long()[:, None, None]
            sel = indices[:, :, 0]  # [B, H, KMAX], ascending slots, -1 padded
            vals = Pooled.view(B, H, sc_row).gather(-1, (sel - base).clamp(min=0))
            vals = torch.where(sel >= 0, vals, float("-inf"))
            order = vals.argsort(dim=-1, descending=True, stable=True)  # ties keep the earlier key first
            indices = sel.gather(-1, order)[:, :, None, :]
    else:
        assert method == "topk", method
        top = Pooled.view(B, H, sc_row).topk(KMAX, dim=-1).indices  # descending scores
        kb = meta.tensor[:, 2].long()  # on the device: no host copy, so this path can be captured in a graph
        keep = torch.arange(KMAX, device=dev)[None, :] < kb[:, None]  # [B, KMAX]
        big = torch.iinfo(torch.long).max
        top = torch.where(keep[:, None, :], top, big)
        if depth is None:
            top = top.sort(-1).values
        base = meta.tensor[:, 0].long()[:, None, None]
        indices = torch.where(top == big, -1, top + (0 if meta.paged else base))[:, :, None, :]
    return Selection(indices=indices, row_start=torch.zeros(B, dtype=torch.long, device=dev), tile=budget.tile,
                     decode=True)


def select_decode(q, k, *, budget: Budget, scale, kv_start=None, q_offset=None, block_table=None, seq_lens=None,
                  meta=None, method="radix", chunk=None, depth=None, **cfg) -> Selection:
    """Anchor selection of a decode step: pooled post-softmax probabilities of the G heads of each group, top
    ``budget.decode(n_b)`` keys per (sequence, KV head). ``method``: "radix" (Triton radix select, exact: ties at
    the threshold go to the earliest keys) or "topk" (torch.topk on the pooled scores).

    ``depth`` (a float): a *ranked* selection instead, for plans whose reuse layers take different budgets
    (:mod:`kascade.reuse`): the top ``round(depth * k_b)`` keys (capped by ``n_b``) in descending pooled
    probability, not sorted by slot, -1 padded at the end (the sparse kernels need only the padding at the end).
    With "radix" the keys are selected by the radix select and then only they are sorted by probability."""
    B, HQ, H, G, D = _heads(q, k, block_table)
    meta = _meta_for(q, meta, kv_start, q_offset, seq_lens, block_table, budget, k.shape[2])
    assert meta.k is not None, "meta built without a budget"
    _, Mx, Ls, Sc, Hist, S = _run_split(q, k, None, None, meta, block_table, None, scale=scale, n_keys=meta.n_max,
                                        sparse=False, has_v=False, write_scores=True, sc_row=meta.n_max, **cfg)
    return _select_from_scores(Sc, Mx, Ls, Hist, S, meta, B, H, G, budget, method, chunk, depth)


def dense_select_decode(q, k, v, *, budget: Budget, scale, kv_start=None, q_offset=None, block_table=None,
                        seq_lens=None, meta=None, method="radix", out=None, chunk=None, depth=None, **cfg):
    """Layer 0: the dense output and the selection (ranked with ``depth``, see :func:`select_decode`) from one pass
    over K and V. ``-> (out, Selection)``."""
    B, HQ, H, G, D = _heads(q, k, block_table)
    meta = _meta_for(q, meta, kv_start, q_offset, seq_lens, block_table, budget, k.shape[2])
    out, Mx, Ls, Sc, Hist, S = _run_split(q, k, v, None, meta, block_table, out, scale=scale, n_keys=meta.n_max,
                                          sparse=False, has_v=True, write_scores=True, sc_row=meta.n_max, **cfg)
    return out, _select_from_scores(Sc, Mx, Ls, Hist, S, meta, B, H, G, budget, method, chunk, depth)


def anchor_decode(q, k, v, *, budget: Budget, scale, kv_start=None, q_offset=None, block_table=None,
                  seq_lens=None, meta=None, method="radix", out=None):
    """Anchor layer: selection, then attention over the selected keys. ``-> (out, Selection)``."""
    sel = select_decode(q, k, budget=budget, scale=scale, kv_start=kv_start, q_offset=q_offset,
                        block_table=block_table, seq_lens=seq_lens, meta=meta, method=method)
    return sparse_decode(q, k, v, sel.indices, scale=scale, block_table=block_table, out=out), sel
