"""Triton prefill kernels (``L > 1`` queries, causal, tiles of ``T`` queries) and their launchers.

Layout (as in :mod:`kascade.ops`): ``q [B, HQ, L, D]``, ``k, v [B, H, N, D]`` (head dim contiguous), outputs
``[B, HQ, L, D]`` in ``q``'s dtype; query head ``hq`` reads KV head ``hq // G``. Sequence ``b`` owns key slots
``[kv_start[b], q_offset + L)`` (left padding before); query ``i`` sits at slot ``q_offset + i`` and, relative to
the sequence's first valid key, at position ``q_offset + i - kv_start[b]``. Tiles count positions: tile ``t`` holds
positions ``[t*T, (t+1)*T)``. Queries at padding slots get zeros.

Every kernel works on one KV head and a block of *rows*, a row being one (query, head of the group) pair flattened
as ``row = query * G + g``, so that the K/V rows loaded once serve all ``G`` heads (an MMA-sized block of rows
whatever ``G``).

* :func:`dense_prefill`: causal flash attention forward, optionally the per-row log-sum-exp (natural log).
* :func:`select_prefill`: anchor selection. Row statistics (the LSE, from a QK-only pass unless given), then for a
  chunk of tiles the pooled probabilities ``sum_{g, query in tile} exp(s - lse)`` against every key before the tile,
  written to a buffer bounded by ``max_chunk_bytes`` (the chunks: :mod:`kascade.ops.prefill_chunks`), then each
  row's top keys (:func:`kascade.ops.triton.topk.tile_topk`) with the budget's row counts.
* :func:`sparse_prefill`: per (tile, KV head), attention of the tile's rows to its selected keys (loaded in the
  kernel from the index list) plus causal attention within the tile.

Kernels only: these functions assert, they do not validate (that is :mod:`kascade.ops`' job). The geometry comes
from ``kv_start`` / ``q_offset`` or, once per forward, from a :class:`kascade.ops.Step` (``step=``). Each pass's
launch comes from one table, :data:`LAUNCH` (per head dim, each entry with what it was measured against).

Numerics: scores, softmax and pooling in fp32 (log2 domain); ``p @ v`` on the tensor cores with ``p`` rounded to
the value dtype, as in every flash-attention forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch
import triton
import triton.language as tl

from ... import _renamed
from ...budget import Budget
from .. import prefill_chunks
from ..selection import Selection
from . import topk
from . import fp8 as fp8_kernels
from .common import LOG2E, cdiv, dot, flags, next_power_of_2, num_sms, to_out
from .fp8 import fp8_operand as _fp8_operand
from .int8 import quantizer, scoring_mma


# ----------------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _exp2_fma(x):
    """``2**x`` on the FMA pipes, for the scoring pass's ``x <= 0`` (``-inf`` included): ``x = j + f`` with ``j``
    an integer (rounded by adding 1.5 * 2**23, whose low mantissa bits then hold it) and ``f`` in [-0.5, 0.5], a
    degree-5 polynomial for ``2**f`` (relative error 2.2e-7, as ``MUFU.EX2``'s own) and ``j`` added into its exponent
    bits; 0 below 2**-126, where the result would be subnormal (``MUFU.EX2`` flushes those too). 13 instructions,
    each one issue cycle of a warp, where the SFU takes 8 cycles per warp for one ``MUFU.EX2``."""
    xc = tl.maximum(x, -127.0)
    t = xc + 12582912.0
    f = xc - (t - 12582912.0)
    p = 0.001326697412878275 * f + 0.009675459936261177
    p = p * f + 0.05550742521882057
    p = p * f + 0.24022121727466583
    p = p * f + 0.6931469440460205
    p = p * f + 1.0000001192092896
    y = (p.to(tl.int32, bitcast=True) + (t.to(tl.int32, bitcast=True) << 23)).to(tl.float32, bitcast=True)
    return tl.where(x < -126.0, 0.0, y)


@triton.jit
def _exp2_cols(x, POLY: tl.constexpr):
    """``2**x`` of a ``[R, C]`` MMA-layout tile: every POLY-th group of 8 columns on the FMA pipes
    (:func:`_exp2_fma`), the others on the SFU (0: all on the SFU, whose 16 exponentials per SM and cycle bound the
    scoring pass). A thread of the wgmma accumulator layout holds whole groups of 8 columns, so the choice folds per
    register at compile time; ``mma.sync``'s layout (the D = 256 scoring pass) does not fold it: both are computed,
    then selected."""
    if POLY > 0:
        cols = tl.arange(0, x.shape[1])
        return tl.where(((cols // 8) % POLY == 0)[None, :], _exp2_fma(x), tl.exp2(x))
    else:
        return tl.exp2(x)


@triton.jit
def _online_step(q, kt, vt, ok, m_i, l_i, acc, qk_scale, HAS_V: tl.constexpr, F32: tl.constexpr,
                 RNE: tl.constexpr, GUARD: tl.constexpr, ALL_VALID: tl.constexpr = False, sk=None,
                 FP8: tl.constexpr = False):
    """One block of keys of the online softmax. ``q [M, D]``, ``kt, vt [BN, D]``. GUARD: some row may have seen no
    key yet (all -inf), so keep exp2 finite. ``ok``: a boolean ``[M, BN]`` (or broadcastable) mask, ignored with
    ALL_VALID (every key valid): the scale then goes into the exponential's fused multiply-add and the row maximum
    is taken before it (exact: scaling by a positive number keeps the order), a multiply, compare and select per
    score fewer. FP8 (FP8 or INT8 scoring, :mod:`kascade.ops.fp8`, :mod:`kascade.ops.int8`): ``q``, ``kt`` are
    e4m3 or int8, ``sk [BN]`` the keys' scales and ``qk_scale [M]`` each row's (its query's scale times the softmax
    scale, log2 domain)."""
    s = dot(q, tl.trans(kt), F32)  # [M, BN]
    if FP8:
        s = s * sk[None, :]
        qk = qk_scale[:, None]
    else:
        qk = qk_scale
    if ALL_VALID:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)  # log2 domain
    else:
        s = tl.where(ok, s * qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
    if GUARD:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    if ALL_VALID:
        p = tl.exp2(s * qk - m_use[:, None])
    else:
        p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if HAS_V:
        pv = to_out(p, vt.dtype, RNE)
        acc = acc * alpha[:, None] + dot(pv, vt, F32)
    return m_new, l_i, acc


@triton.jit
def _dense_kernel(
    Q, K, V, Out, Lse, KvStart, SQ, SK,
    stride_qb, stride_qh, stride_ql,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_ol,
    L, q_offset, qk_scale, n_keys,
    G: tl.constexpr, D: tl.constexpr, BQ: tl.constexpr, M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_V: tl.constexpr, WRITE_LSE: tl.constexpr, F32: tl.constexpr, RNE: tl.constexpr,
    FP8: tl.constexpr = False, FP8_MMA: tl.constexpr = False,
):
    """One program = (block of BQ queries, KV head, sequence): M >= BQ*G rows (query-major). FP8 (the LSE pass of
    FP8 or INT8 scoring, no values): ``Q``, ``K`` e4m3 or int8, ``SQ [B, HQ, L]`` and ``SK [B, H, n_keys]`` their
    scales."""
    qb = tl.num_programs(0) - 1 - tl.program_id(0)  # longest blocks first
    h = tl.program_id(1)
    b = tl.program_id(2)
    b64 = b.to(tl.int64)
    start = tl.load(KvStart + b).to(tl.int32)

    f = tl.arange(0, M)
    qi = f // G
    g = f % G
    i = qb * BQ + qi  # query index in this call
    slot = q_offset + i  # its key slot
    row_ok = (qi < BQ) & (i < L) & (slot >= start)
    hq = (h * G + g).to(tl.int64)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + b64 * stride_qb + hq[:, None] * stride_qh + i[:, None].to(tl.int64) * stride_ql
                + offs_d[None, :], mask=row_ok[:, None], other=0.0)  # [M, D]
    qk = qk_scale
    sk_base = SK
    if FP8:
        q = _fp8_operand(q, FP8_MMA)
        qk = tl.load(SQ + (b64 * tl.num_programs(1) * G + hq) * L + i, mask=row_ok, other=1.0) * qk_scale
        sk_base = SK + (b64 * tl.num_programs(1) + h) * n_keys

    hi = tl.minimum(q_offset + qb * BQ + BQ, q_offset + L)  # one past the block's last query slot
    first = tl.maximum(q_offset + qb * BQ, start)  # the block's first real query slot
    n_full = tl.maximum(first + 1 - start, 0) // BLOCK_N  # blocks every row sees whole
    k_base = K + b64 * stride_kb + h * stride_kh
    v_base = V + b64 * stride_vb + h * stride_vh
    offs_n = tl.arange(0, BLOCK_N)

    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, D], tl.float32)
    # ---- keys before the block: no mask ----
    k_ptr = k_base + (start + offs_n).to(tl.int64)[:, None] * stride_kn + offs_d[None, :]
    v_ptr = v_base + (start + offs_n).to(tl.int64)[:, None] * stride_vn + offs_d[None, :]
    sk_ptr = sk_base + start + offs_n
    for jb in range(0, n_full):  # (pointers advanced, not recomputed: a fifth of the QK-only loop's instructions)
        kt = tl.load(k_ptr)
        if HAS_V:
            vt = tl.load(v_ptr)
            v_ptr += BLOCK_N * stride_vn
        else:
            vt = kt
        sk = None
        if FP8:
            kt = _fp8_operand(kt, FP8_MMA)
            sk = tl.load(sk_ptr)
            sk_ptr += BLOCK_N
        m_i, l_i, acc = _online_step(q, kt, vt, None, m_i, l_i, acc, qk, HAS_V, F32, RNE, False, True, sk, FP8)
        k_ptr += BLOCK_N * stride_kn
    # ---- diagonal blocks: causal mask ----
    for j0 in range(start + n_full * BLOCK_N, hi, BLOCK_N):
        kpos = j0 + offs_n
        km = kpos < hi
        kp64 = kpos.to(tl.int64)
        kt = tl.load(k_base + kp64[:, None] * stride_kn + offs_d[None, :], mask=km[:, None], other=0.0)
        if HAS_V:
            vt = tl.load(v_base + kp64[:, None] * stride_vn + offs_d[None, :], mask=km[:, None], other=0.0)
        else:
            vt = kt
        sk = None
        if FP8:
            kt = _fp8_operand(kt, FP8_MMA)
            sk = tl.load(sk_base + kpos, mask=km, other=1.0)
        ok = (kpos[None, :] <= slot[:, None]) & km[None, :]
        m_i, l_i, acc = _online_step(q, kt, vt, ok, m_i, l_i, acc, qk, HAS_V, F32, RNE, True, False, sk, FP8)

    has = l_i > 0
    if HAS_V:
        o = acc / tl.where(has, l_i, 1.0)[:, None]
        o = tl.where(has[:, None], o, 0.0)  # padding queries: zeros
        st = (qi < BQ) & (i < L)
        tl.store(Out + b64 * stride_ob + hq[:, None] * stride_oh + i[:, None].to(tl.int64) * stride_ol
                 + offs_d[None, :], to_out(o, Out.dtype.element_ty, RNE), mask=st[:, None])
    if WRITE_LSE:
        lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
        tl.store(Lse + (b64 * tl.num_programs(1) * G + hq) * L + i, lse, mask=(qi < BQ) & (i < L))


@triton.jit
def _tile_q(Q, Lse, SQ, b64, h, start, t, f, offs_d, stride_qb, stride_qh, stride_ql, L, q_offset, qk_scale,
            HQ: tl.constexpr, G: tl.constexpr, T: tl.constexpr, FP8: tl.constexpr, FP8_MMA: tl.constexpr):
    """Rows ``f`` (of the tile's G*T, query-major) of tile ``t``: their queries ``[len(f), D]`` (zeros beyond the
    tile or the call), log2-domain LSE (+inf there, so that they pool nothing) and score scale: ``qk_scale``, or
    with FP8 each row's query scale times it (``[len(f)]``)."""
    qi = f // G
    i = start + t * T + qi - q_offset
    row_ok = (f < G * T) & (i >= 0) & (i < L)
    hq = (h * G + f % G).to(tl.int64)
    q = tl.load(Q + b64 * stride_qb + hq[:, None] * stride_qh + i[:, None].to(tl.int64) * stride_ql + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    lse2 = tl.load(Lse + (b64 * HQ + hq) * L + i, mask=row_ok, other=float("inf")) * 1.4426950408889634
    if FP8:
        qs = tl.load(SQ + (b64 * HQ + hq) * L + i, mask=row_ok, other=1.0) * qk_scale
        return _fp8_operand(q, FP8_MMA), lse2, qs
    else:
        return q, lse2, qk_scale


@triton.jit
def _pool(kt, q, lse2, qk_scale, sk, F32: tl.constexpr, POLY: tl.constexpr, FP8: tl.constexpr):
    """Pooled probabilities of keys ``kt [BN, D]`` over rows ``q`` with log2 LSE ``lse2``: ``[BN]``. Scores
    transposed, [BN keys, rows], so that pooling over rows is the cheap in-thread / in-warp reduction of the MMA
    layout rather than one across warps. POLY: every POLY-th group of 8 rows takes its exponentials on the FMA
    pipes (:func:`_exp2_cols`). FP8: e4m3 ``kt`` and ``q``, the keys' scales ``sk [BN]`` and the rows' score scales
    ``qk_scale [rows]``."""
    if FP8:
        s = dot(kt, tl.trans(q), F32) * sk[:, None] * qk_scale[None, :]
    else:
        s = dot(kt, tl.trans(q), F32) * qk_scale
    return tl.sum(_exp2_cols(s - lse2[None, :], POLY), 1)


@triton.jit
def _pool_rows(kt, sk, q, lse2, qs, q_r, lse2_r, qs_r, Q, Lse, SQ, b64, h, start, t, f0, offs_d, stride_qb,
               stride_qh, stride_ql, L, q_offset, qk_scale, HQ: tl.constexpr, G: tl.constexpr, T: tl.constexpr,
               M: tl.constexpr, NSUB: tl.constexpr, MR: tl.constexpr, F32: tl.constexpr, POLY: tl.constexpr,
               FP8: tl.constexpr, FP8_MMA: tl.constexpr):
    """Pooled probabilities of keys ``kt [BN, D]`` (FP8: scales ``sk``) over all the tile's rows: the held block
    ``q`` (NSUB = 1) or NSUB blocks reloaded, plus the remainder block ``q_r`` (MR > 0)."""
    if NSUB == 1:
        pooled = _pool(kt, q, lse2, qs, sk, F32, POLY, FP8)
    else:  # several blocks of M rows: reloaded for every key block (pipelining would hold each in every stage)
        pooled = tl.zeros([kt.shape[0]], tl.float32)
        for sb in tl.static_range(NSUB):
            qb, ls, qsb = _tile_q(Q, Lse, SQ, b64, h, start, t, sb * M + f0, offs_d, stride_qb, stride_qh,
                                  stride_ql, L, q_offset, qk_scale, HQ, G, T, FP8, FP8_MMA)
            pooled += _pool(kt, qb, ls, qsb, sk, F32, POLY, FP8)
    if MR > 0:
        pooled += _pool(kt, q_r, lse2_r, qs_r, sk, F32, POLY, FP8)
    return pooled


@triton.jit
def _score_kernel(
    Q, K, Lse, KvStart, RowStart, Buf, Hist, SQ, SK,
    stride_qb, stride_qh, stride_ql,
    stride_kb, stride_kh, stride_kn,
    stride_bb, stride_bh, stride_bc,
    L, q_offset, r0, C, W, keys_per_split, qk_scale, n_keys,
    HQ: tl.constexpr, G: tl.constexpr, T: tl.constexpr, D: tl.constexpr, M: tl.constexpr, NSUB: tl.constexpr,
    MR: tl.constexpr, BLOCK_N: tl.constexpr, F32: tl.constexpr, NHIST: tl.constexpr, ZERO_HIST: tl.constexpr,
    POLY: tl.constexpr, FP8: tl.constexpr = False, FP8_MMA: tl.constexpr = False,
):
    """One program = (key split, tile c of the chunk's C, KV head, sequence). Writes ``Buf[b, h, c, j]`` = pooled
    probability of key position j (relative) for j < s = tile start, -inf for s <= j < W. The tile's G*T rows:
    NSUB blocks of M, then one of MR (none if 0; :func:`_score_rows`). ZERO_HIST: the first split zeroes the top-k's
    histograms of its buffer row (``Hist [B * H * C, NHIST]``, rows in buffer order), a memset launch less per
    chunk. FP8 (FP8 or INT8 scoring): ``Q``, ``K`` e4m3 or int8, ``SQ [B, HQ, L]`` and ``SK [B, H, n_keys]`` their
    scales."""
    split = tl.program_id(0)
    c = tl.program_id(1)
    hb = tl.program_id(2)
    if ZERO_HIST:
        if split == 0:
            topk.zero_hist(Hist + (hb * C + c).to(tl.int64) * NHIST)
    H = HQ // G
    h = hb % H
    b = hb // H
    b64 = b.to(tl.int64)
    start = tl.load(KvStart + b).to(tl.int32)
    t = tl.load(RowStart + b).to(tl.int32) + r0 + c
    n_b = q_offset + L - start
    s_len = tl.where(t * T < n_b, t * T, 0)  # keys before the tile (0: no such tile in this sequence)
    lo = split * keys_per_split
    hi = tl.minimum(lo + keys_per_split, W)
    hi_s = tl.minimum(hi, s_len)

    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    k_base = K + b64 * stride_kb + h * stride_kh
    buf = Buf + b64 * stride_bb + h * stride_bh + c * stride_bc
    f0 = tl.arange(0, M)
    q, lse2, qs, q_r, lse2_r, qs_r = 0, 0, 0, 0, 0, 0  # (placeholders for the blocks that are reloaded or absent)
    if NSUB == 1:  # one block of M rows (and the remainder's): held for the whole loop
        q, lse2, qs = _tile_q(Q, Lse, SQ, b64, h, start, t, f0, offs_d, stride_qb, stride_qh, stride_ql, L, q_offset,
                              qk_scale, HQ, G, T, FP8, FP8_MMA)
    if MR > 0:
        q_r, lse2_r, qs_r = _tile_q(Q, Lse, SQ, b64, h, start, t, NSUB * M + tl.arange(0, MR), offs_d, stride_qb,
                                    stride_qh, stride_ql, L, q_offset, qk_scale, HQ, G, T, FP8, FP8_MMA)
    sk_base = SK + (b64 * H + h) * n_keys + start
    # Whole blocks of candidate keys unmasked (every key's pooled value is its own: no mask enters the sums), then
    # the partial block (at most one), masked.
    n_whole = tl.maximum(hi_s - lo, 0) // BLOCK_N
    k_ptr = k_base + (start + lo + offs_n).to(tl.int64)[:, None] * stride_kn + offs_d[None, :]
    for j in range(0, n_whole):
        kt = tl.load(k_ptr)
        kpos = lo + j * BLOCK_N + offs_n
        sk = None
        if FP8:
            kt = _fp8_operand(kt, FP8_MMA)
            sk = tl.load(sk_base + kpos)
        pooled = _pool_rows(kt, sk, q, lse2, qs, q_r, lse2_r, qs_r, Q, Lse, SQ, b64, h, start, t, f0, offs_d,
                            stride_qb, stride_qh, stride_ql, L, q_offset, qk_scale, HQ, G, T, M, NSUB, MR, F32, POLY,
                            FP8, FP8_MMA)
        tl.store(buf + kpos, pooled)
        k_ptr += BLOCK_N * stride_kn
    for j0 in range(lo + n_whole * BLOCK_N, hi_s, BLOCK_N):
        kpos = j0 + offs_n
        km = kpos < hi_s
        kt = tl.load(k_base + (start + kpos).to(tl.int64)[:, None] * stride_kn + offs_d[None, :],
                     mask=km[:, None], other=0.0)
        sk = None
        if FP8:
            kt = _fp8_operand(kt, FP8_MMA)
            sk = tl.load(sk_base + kpos, mask=km, other=1.0)
        pooled = _pool_rows(kt, sk, q, lse2, qs, q_r, lse2_r, qs_r, Q, Lse, SQ, b64, h, start, t, f0, offs_d,
                            stride_qb, stride_qh, stride_ql, L, q_offset, qk_scale, HQ, G, T, M, NSUB, MR, F32, POLY,
                            FP8, FP8_MMA)
        tl.store(buf + kpos, pooled, mask=km)
    for j0 in range(tl.maximum(lo, s_len), hi, BLOCK_N):  # keys at or after the tile: never candidates
        kpos = j0 + offs_n
        tl.store(buf + kpos, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=kpos < hi)


@triton.jit
def _sparse_kernel(
    Q, K, V, Out, Idx, Cnt, HM, KvStart, RowStart,
    stride_qb, stride_qh, stride_ql,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_ol,
    stride_ib, stride_ih, stride_ir,
    stride_cb,
    L, q_offset, n_idx, qk_scale,
    G: tl.constexpr, T: tl.constexpr, TP: tl.constexpr, D: tl.constexpr, M: tl.constexpr, NRB: tl.constexpr,
    BLOCK_N: tl.constexpr, MAXB: tl.constexpr, F32: tl.constexpr, RNE: tl.constexpr, HAS_CNT: tl.constexpr,
    PREFETCH: tl.constexpr, HAS_HM: tl.constexpr = False,
):
    """One program = (row block of a tile, selection row r, KV head, sequence): M rows of the tile's G*T.
    HAS_HM: KV head ``h`` reads the index rows of head ``HM[h]`` of ``Idx`` (a reuse layer's head map).
    PREFETCH: each block's indices are loaded an iteration ahead, into registers; the gathered K / V rows then no
    longer depend on a load of the same iteration, and Triton's pipeliner keeps them ``num_stages - 1`` blocks in
    flight (without it: one, issued at the end of the iteration before) at the price of that much more shared
    memory per program."""
    pid = tl.num_programs(0) - 1 - tl.program_id(0)  # later tiles (larger budgets) first
    r = pid // NRB
    rb = pid % NRB
    h = tl.program_id(1)
    b = tl.program_id(2)
    b64 = b.to(tl.int64)
    start = tl.load(KvStart + b).to(tl.int32)
    t = tl.load(RowStart + b).to(tl.int32) + r
    n_b = q_offset + L - start
    if t * T < n_b:
        offs_d = tl.arange(0, D)
        f = rb * M + tl.arange(0, M)
        qi = f // G
        pos = t * T + qi  # query position (relative)
        i = start + pos - q_offset
        row_ok = (f < G * T) & (i >= 0) & (i < L)
        hq = (h * G + f % G).to(tl.int64)
        q = tl.load(Q + b64 * stride_qb + hq[:, None] * stride_qh + i[:, None].to(tl.int64) * stride_ql
                    + offs_d[None, :], mask=row_ok[:, None], other=0.0)  # [M, D]
        k_base = K + b64 * stride_kb + h * stride_kh
        v_base = V + b64 * stride_vb + h * stride_vh
        hs = h
        if HAS_HM:
            hs = tl.load(HM + h).to(tl.int32)
        idx_row = Idx + b64 * stride_ib + hs * stride_ih + r.to(tl.int64) * stride_ir

        n_row = n_idx
        if HAS_CNT:  # only the first Cnt[b, r] entries of the row (the prefix of a ranked selection)
            n_row = tl.minimum(n_row, tl.load(Cnt + b64 * stride_cb + r))
        # The row's length (-1 padding at the end): the blocks that hold any index (one strided load), then the
        # last of them. Masks computed from it, not from the indices loaded in the loop, leave the loop one chain
        # (index -> address -> K / V rows) that the software pipeliner prefetches stages ahead.
        offs_n = tl.arange(0, BLOCK_N)
        jb = tl.arange(0, MAXB) * BLOCK_N
        firsts = tl.load(idx_row + jb, mask=jb < n_row, other=-1)
        nblk = tl.sum((firsts >= 0).to(tl.int32), 0)
        j_last = (nblk - 1) * BLOCK_N + offs_n
        last = tl.load(idx_row + j_last, mask=(j_last >= 0) & (j_last < n_row), other=-1)
        n_row = tl.maximum(nblk - 1, 0) * BLOCK_N + tl.sum((last >= 0).to(tl.int32), 0)

        m_i = tl.full([M], float("-inf"), tl.float32)
        l_i = tl.zeros([M], tl.float32)
        acc = tl.zeros([M, D], tl.float32)
        # Key order does not matter to the softmax: the masked blocks come first, straight-line, and the loop over the
        # row's full blocks needs no mask at all (a compare and a select per score were an eighth of its
        # instructions). The own tile comes before the pipelined loop: after it, ptxas serialises every wgmma of the
        # kernel (its warning C7515: each waited for before the next is issued).
        # ---- own tile, causal ----
        offs_t = tl.arange(0, TP)
        kpos = t * T + offs_t
        km = (offs_t < T) & (kpos < n_b)
        kslot = (start + kpos).to(tl.int64)
        kt = tl.load(k_base + kslot[:, None] * stride_kn + offs_d[None, :], mask=km[:, None], other=0.0)
        vt = tl.load(v_base + kslot[:, None] * stride_vn + offs_d[None, :], mask=km[:, None], other=0.0)
        ok = km[None, :] & (kpos[None, :] <= pos[:, None])
        m_i, l_i, acc = _online_step(q, kt, vt, ok, m_i, l_i, acc, qk_scale, True, F32, RNE, True)
        # ---- the row's last block of selected keys, full or not (none when the row is empty) ----
        n_loop = tl.maximum(n_row - 1, 0) // BLOCK_N  # the full blocks before it
        j = n_loop * BLOCK_N + offs_n
        ok_n = j < n_row
        slot = tl.load(idx_row + j, mask=ok_n, other=0).to(tl.int64)
        kt = tl.load(k_base + slot[:, None] * stride_kn + offs_d[None, :], mask=ok_n[:, None], other=0.0)
        vt = tl.load(v_base + slot[:, None] * stride_vn + offs_d[None, :], mask=ok_n[:, None], other=0.0)
        m_i, l_i, acc = _online_step(q, kt, vt, ok_n[None, :], m_i, l_i, acc, qk_scale, True, F32, RNE, True)
        # ---- the other selected keys (all strictly before the tile), whole blocks ----
        if PREFETCH:
            nxt = tl.load(idx_row + offs_n, mask=offs_n < n_loop * BLOCK_N, other=0)
        for kb in range(0, n_loop):
            j = kb * BLOCK_N + offs_n
            if PREFETCH:
                slot = nxt.to(tl.int64)
                nxt = tl.load(idx_row + j + BLOCK_N, mask=j + BLOCK_N < n_loop * BLOCK_N, other=0)
            else:
                slot = tl.load(idx_row + j).to(tl.int64)
            kt = tl.load(k_base + slot[:, None] * stride_kn + offs_d[None, :])
            vt = tl.load(v_base + slot[:, None] * stride_vn + offs_d[None, :])
            m_i, l_i, acc = _online_step(q, kt, vt, None, m_i, l_i, acc, qk_scale, True, F32, RNE, False, True)

        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(Out + b64 * stride_ob + hq[:, None] * stride_oh + i[:, None].to(tl.int64) * stride_ol
                 + offs_d[None, :], to_out(o, Out.dtype.element_ty, RNE), mask=row_ok[:, None])


# ----------------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------------
def _heads(q, k):
    B, HQ, L, D = q.shape
    H = k.shape[1]
    assert k.shape[0] == B and k.shape[-1] == D and HQ % H == 0 and D in (16, 32, 64, 128, 256)
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "the head dim must be contiguous"
    return B, HQ, H, HQ // H, L, D


def _geometry(q, k, step, kv_start, q_offset) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(kv_start as int32 on the device, kv_start as int64 on the host, q_offset)`` from a step (copied to the
    device once per step) or from the arguments (``None``: zeros / ``N - L``)."""
    if step is not None:
        return step.starts_on_device(), step.kv_start, step.q_offset
    B, L, N = q.shape[0], q.shape[2], k.shape[2]
    host = torch.zeros(B, dtype=torch.long) if kv_start is None else torch.as_tensor(kv_start).reshape(-1).long().cpu()
    assert host.shape == (B,)
    return host.to(torch.int32).to(q.device), host, N - L if q_offset is None else int(q_offset)


# ----------------------------------------------------------------------------------------------------------------
# Launch configurations
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Launch:
    """A prefill pass's launch. An entry of :data:`LAUNCH` sets the fields its pass uses; given to
    :func:`select_prefill` (``scoring``, ``lse_launch``), the fields set replace the table's."""

    block_m: int | None = None  # rows a program (dense, QK-only); the scoring pass's blocks of a tile's rows
    block_n: int | None = None  # keys a block
    num_warps: int | None = None
    num_stages: int | None = None
    prefetch: bool | None = None  # sparse: each block's indices loaded an iteration ahead
    maxnreg: int | None = None  # sparse: the registers a thread may use at most
    fma_exp: int | None = None  # scoring: every fma_exp-th group of 8 rows' exponentials on the FMA pipes (0: none)
    why: str = field(default="", compare=False, repr=False)

    def set_fields(self) -> dict:
        """The launch fields that are set, as keywords."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name != "why" and getattr(self, f.name) is not None}


# The launch of each pass by head dim: ``(pass, D_max)`` holds for D up to D_max (above the pass's next smaller
# D_max). Passes: "dense" (flash forward with values, 16-bit), "lse" (the QK-only LSE pass, 16-bit), "fp32" (either of
# them on fp32 inputs), "score" (the scoring pass, a tile's rows in one block and a remainder held for the loop),
# "score_reloaded" (a tile's rows in several blocks, reloaded for every key block), "sparse". In the whys: times in ms
# at N = 32K, bf16, B = 1, Llama-3.1-8B's shapes at D = 128 (32 query / 8 KV heads), the default model's at D = 64
# (9 / 3); other launches as (block_m, block_n, num_warps, num_stages) for dense and lse, (block_n, num_warps,
# num_stages) otherwise. ``python -m benchmarks.prefill`` sweeps them (docs/design/kernels.md).
LAUNCH = {
    ("dense", 64): Launch(block_m=128, block_n=64, num_warps=4, num_stages=3,
                          why="not swept at D <= 64"),
    ("dense", 128): Launch(block_m=128, block_n=128, num_warps=8, num_stages=3,
                           why="fastest of the H200 sweep: 17.1; (128, 64, 8, 3) 17.5, (128, 64, 8, 4) 18.6"),
    ("dense", 256): Launch(block_m=64, block_n=64, num_warps=4, num_stages=2,
                           why="not swept at D = 256: 64 x 256 K / V blocks in two stages"),
    ("lse", 64): Launch(block_m=128, block_n=64, num_warps=4, num_stages=3,
                        why="not swept at D <= 64 (2.04 on an H200)"),
    ("lse", 128): Launch(block_m=256, block_n=64, num_warps=8, num_stages=3,
                         why="fastest of the H200 sweep: 9.00 (64 queries x 4 heads: each K block feeds twice the "
                             "rows); (256, 64, 8, 2) 9.05, (128, 64, 8, 4) 9.19; the dense pass spills at 256 rows"),
    ("lse", 256): Launch(block_m=64, block_n=64, num_warps=4, num_stages=2,
                         why="not swept at D = 256: the dense pass's"),
    ("fp32", 64): Launch(block_m=128, block_n=64, num_warps=4, num_stages=3,
                         why="the 16-bit launch: fp32 64 x 64 blocks fit its shared memory (not timed)"),
    ("fp32", 256): Launch(block_m=64, block_n=64, num_warps=4, num_stages=2,
                          why="fp32 128 x 128 K / V blocks in 3 stages (the 16-bit launch) run out of shared memory on "
                              "an H200 at D = 128; this needs about half of it (not timed)"),
    ("score", 64): Launch(block_n=64, num_warps=4, num_stages=3, fma_exp=8,
                          why="H200 sweep: 3.62 with every 8th group's exponentials on the FMA pipes, 4.12 without, "
                              "4.50 every 4th (the SFU limits the pass at D = 64)"),
    ("score", 128): Launch(block_n=64, num_warps=4, num_stages=3, fma_exp=0,
                           why="fastest of the H200 sweep: 11.0; (128, 8, 2) 11.8, (64, 4, 2) 13.4, (64, 8, 3) 14.4; "
                               "FMA exponentials 13.1 (the pass is issue-bound)"),
    ("score", 256): Launch(block_n=32, num_warps=4, num_stages=2, fma_exp=0,
                           why="not swept at D = 256; its mma.sync layout does not fold fma_exp per register"),
    ("score_reloaded", 64): Launch(block_n=64, num_warps=4, num_stages=3, fma_exp=8,
                                   why="the 'score' launch (not timed)"),
    ("score_reloaded", 128): Launch(block_n=64, num_warps=4, num_stages=1, fma_exp=0,
                                    why="pipelining holds every reloaded block in every stage: more stages run out "
                                        "of shared memory on an H200 (G * T > 128, 16-bit); not timed"),
    ("score_reloaded", 256): Launch(block_n=32, num_warps=4, num_stages=1, fma_exp=0,
                                    why="as at D = 128 (not timed)"),
    ("sparse", 64): Launch(block_n=64, num_warps=8, num_stages=3, prefetch=True, maxnreg=128,
                           why="fastest of the H200 sweep: 0.63 (two programs an SM); (64, 8, 4) 0.65; prefetch "
                               "without the register bound: (64, 4, 4) 0.73, (64, 8, 4) 0.87"),
    ("sparse", 128): Launch(block_n=64, num_warps=8, num_stages=3, prefetch=True,
                            why="fastest of the H200 sweep: 2.62; (64, 8, 4) 2.70, without prefetch 3.12, (64, 4, 3) "
                                "4.05"),
    ("sparse", 256): Launch(block_n=32, num_warps=8, num_stages=3, prefetch=False,
                            why="fastest at D = 256 on an H200 (16 query / 8 KV heads): 6.60; (64, 8, 2) 7.44, "
                                "(32, 4, 2) 7.50 (spills), (32, 8, 2) 8.46"),
}


def _launch(kind: str, D: int) -> Launch:
    """The table's launch of pass ``kind`` at head dim ``D``."""
    return LAUNCH[kind, min(d for p, d in LAUNCH if p == kind and D <= d)]


def _rows(G: int, M: int) -> tuple[int, int]:
    """(queries per block BQ, rows M): BQ*G <= M with M a power of two >= 16."""
    M = max(M, 16, next_power_of_2(G))
    return max(1, M // G), M


def dense_prefill(q, k, v, *, scale, kv_start=None, q_offset=None, step=None, return_lse=False, out=None,
                  block_m=None, block_n=None, num_warps=None, num_stages=None):
    """Exact causal GQA attention. ``-> out [B, HQ, L, D]``, or ``(out, lse)`` with ``lse [B, HQ, L]`` fp32, the
    natural log-sum-exp of each row's ``scale * q k^T`` (``-inf`` at padding queries)."""
    out, lse = _dense_run(q, k, v, scale=scale, kv_start=kv_start, q_offset=q_offset, step=step, has_v=True,
                          write_lse=return_lse, out=out, block_m=block_m, block_n=block_n, num_warps=num_warps,
                          num_stages=num_stages)
    return (out, lse) if return_lse else out


def prefill_lse(q, k, *, scale, kv_start=None, q_offset=None, step=None, **cfg) -> torch.Tensor:
    """Only the per-row log-sum-exp ``[B, HQ, L]`` (a QK pass without values: the anchor's first pass). Other
    keywords: the launch (block_m, block_n, num_warps, num_stages), and ``fp8=(sq, sk)``: ``q``, ``k`` are e4m3
    or int8 (:func:`quantized`) and these their scales, the LSE of FP8 / INT8 scoring's scores."""
    return _dense_run(q, k, None, scale=scale, kv_start=kv_start, q_offset=q_offset, step=step, has_v=False,
                      write_lse=True, **cfg)[1]


def _dense_run(q, k, v, *, scale, kv_start=None, q_offset=None, step=None, has_v, write_lse, out=None, block_m=None,
               block_n=None, num_warps=None, num_stages=None, geometry=None, fp8=None):
    B, HQ, H, G, L, D = _heads(q, k)
    dev = q.device
    ks, _, q_offset = geometry or _geometry(q, k, step, kv_start, q_offset)
    f32, rne = flags(q)
    cfg = _launch("fp32" if q.dtype == torch.float32 else "dense" if has_v else "lse", D)
    assert fp8 is None or (not has_v and q.dtype == k.dtype and q.dtype in (fp8_kernels.E4M3, torch.int8)), \
        "FP8 / INT8: the LSE pass of quantised q, k"
    BQ, M = _rows(G, block_m or cfg.block_m)
    bn = block_n or cfg.block_n
    if has_v:
        assert v.shape == k.shape and v.stride(-1) == 1
        out = torch.empty_like(q) if out is None else out
    lse = torch.empty(B, HQ, L, dtype=torch.float32, device=dev) if write_lse else ks
    vv = v if has_v else k
    oo = out if has_v else q
    sq, sk = fp8 if fp8 is not None else (lse, lse)
    _dense_kernel[(cdiv(L, BQ), H, B)](
        q, k, vv, oo, lse, ks, sq, sk,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        vv.stride(0), vv.stride(1), vv.stride(2), oo.stride(0), oo.stride(1), oo.stride(2),
        L, q_offset, scale * LOG2E, k.shape[2],
        G=G, D=D, BQ=BQ, M=M, BLOCK_N=bn, HAS_V=has_v, WRITE_LSE=write_lse, F32=f32, RNE=rne,
        FP8=fp8 is not None, FP8_MMA=fp8 is not None and scoring_mma(q.dtype, q.device, D),
        num_warps=num_warps or cfg.num_warps, num_stages=num_stages or cfg.num_stages,
    )
    return (out if has_v else None), (lse if write_lse else None)


def quantized(q, k, score_dtype: str = "fp8") -> tuple:
    """FP8 / INT8 scoring's inputs (:mod:`kascade.ops.fp8`, :mod:`kascade.ops.int8`): ``(q8, k8, sq [B, HQ, L], sk
    [B, H, N])``, each head vector e4m3 with its power-of-two scale or int8 with its scale, by the one-pass kernels
    (:func:`kascade.ops.triton.fp8.quantize`, :func:`kascade.ops.triton.int8.quantize`)."""
    quantize = quantizer(score_dtype)
    (q8, sq), (k8, sk) = quantize(q), quantize(k)
    return q8, k8, sq, sk


def _tile_rows(G: int, T: int, M: int | None = None) -> tuple[int, int]:
    """(rows per block M, blocks per tile): the tile's G*T rows in blocks of at most 128 (or M)."""
    M = M or min(128, max(16, next_power_of_2(G * T)))
    return M, cdiv(G * T, M)


def _score_rows(G: int, T: int, M: int | None = None) -> tuple[int, int, int]:
    """The scoring pass's rows of a tile: ``(M, NSUB, MR)``, NSUB blocks of M rows then one of MR (0: none), powers
    of two >= 16 covering the tile's G*T rows with the least padding: 96 = 64 + 32 (the default model's, which one
    block of 128 padded by a quarter: a quarter of the pass's MMAs and exponentials), 160 = 128 + 32, 192 = 128 + 64.
    ``M`` given: blocks of M rows, the last one padded."""
    n = G * T
    if M:
        return M, cdiv(n, M), 0
    if n <= 16:
        return 16, 1, 0
    M = min(128, 1 << (n.bit_length() - 1))  # the largest power of two <= n, at most 128
    NSUB, rem = divmod(n, M)
    MR = max(16, next_power_of_2(rem)) if rem else 0
    if MR == M:  # e.g. 224 = 128 + 96: a second block of M rows
        return M, NSUB + 1, 0
    return M, NSUB, MR


# The radix top-k's first histogram counts exponents under a bound of each row's k-th value (a row pools G x T
# queries' probabilities, so it sums to at most G x T); False: the whole bit pattern from the top, no bound
# (python -m benchmarks.prefill times both).
TOPK_BOUND = True


@_renamed.keywords(_renamed.RANK_FACTOR, depth="rank_factor")
def select_prefill(q, k, *, scale, budget: Budget | None = None, kv_start=None, q_offset=None, step=None, lse=None,
                   rank_factor=None, index_dtype=None, max_chunk_bytes=64 << 20, method="radix",
                   scoring: Launch | None = None, lse_launch: Launch | None = None,
                   scores_only=False) -> Selection:
    """Anchor selection in prefill (see the module docstring). ``lse [B, HQ, L]`` from :func:`dense_prefill`
    (layer 0) or ``None`` (computed here by a QK-only pass). Returns a prefill :class:`Selection` with the same
    shape as the reference's: ``[B, H, R, K]`` absolute slots, ascending, -1 padded, in ``index_dtype`` (default:
    the step's, else int64 like the reference; int32 is half the memory, which the sparse kernel reads as well).
    ``budget``: the step's unless given.

    ``rank_factor`` (a float): a *ranked* selection instead, for plans whose layers keep different numbers of keys
    (:mod:`kascade.reuse`): per row the top ``Budget.row_counts(..., factor=rank_factor)`` keys in descending pooled
    probability, not sorted by slot, -1 padded at the end.

    ``max_chunk_bytes``: the scratch bound. Extra memory, whatever ``B`` and ``N``: at most ``max_chunk_bytes`` in
    all (:mod:`kascade.ops.prefill_chunks`: 3/64 of it kept for the caching allocator). When the LSE is not given it
    is made for a group of sequences at a time (at most a quarter of the bound, or one sequence), and each group's
    selection then holds its LSE (``4 * HQ * L`` bytes a sequence), its per-row metadata (16 bytes a row) and the
    score buffer of a chunk of tiles with its top-k temporaries; the bound is exceeded only by a single sequence
    whose LSE takes more than 3/4 of it (the chunks still get 1/4), or by one tile's rows alone. The returned
    indices are not counted.

    Tuning (the defaults are the fastest measured, docs/design/kernels.md):

    * ``method``: how each row's top keys are found in the chunk's score buffer (:func:`kascade.ops.triton.topk.
      tile_topk`): "radix" (the Triton radix select, the default: faster than ``torch.topk`` at every measured
      shape) or "topk" (``torch.topk``).
    * ``scoring``: the scoring pass's launch; the fields set replace :data:`LAUNCH`'s (``block_n``, ``num_warps``,
      ``num_stages``, ``block_m``: blocks of a tile's rows, a power of two, by default :func:`_score_rows`' blocks,
      which pad the fewest rows; ``fma_exp``: every ``fma_exp``-th group of 8 rows takes its exponentials on the FMA
      pipes, :func:`_pool`, 0: none).
    * ``lse_launch``: the QK-only LSE pass's (``block_m``, ``block_n``, ``num_warps``, ``num_stages``, as
      :func:`prefill_lse` takes them; an assertion when ``lse`` is given).
    * ``scores_only``: score every chunk but find no top keys (the indices stay -1): the benchmark's breakdown.

    FP8 / INT8 scoring (``budget.score_dtype`` "fp8" / "int8", :mod:`kascade.ops.fp8`, :mod:`kascade.ops.int8`):
    ``q`` and ``k`` are quantised once (:func:`quantized`: an e4m3 / int8 copy of each, a byte an element, and a
    float per head vector), and both passes score with them; ``lse`` must not be given (it would be the exact
    scores')."""
    assert method in ("topk", "radix"), method
    B, HQ, H, G, L, D = _heads(q, k)
    budget = budget or step.budget
    index_dtype = index_dtype or (step.index_dtype if step is not None else torch.long)
    T = budget.tile
    dev = q.device
    ks, host_start, q_offset = _geometry(q, k, step, kv_start, q_offset)
    if lse is not None:
        assert lse.shape == (B, HQ, L) and lse.dtype == torch.float32 and lse.is_contiguous()
        assert lse_launch is None, "a launch of the LSE pass, but the LSE is given"
    n_t = q_offset + L - host_start
    first_t, count_t = budget.tiles(n_t, L)
    R = int(count_t.max())
    budgets_host = budget.row_counts(n_t, first_t, R, 1.0 if rank_factor is None else rank_factor)  # [B, R]
    K = int(budgets_host.max())
    rs = first_t.to(torch.int32).to(dev)
    indices = torch.full((B, H, R, K), -1, dtype=index_dtype, device=dev)
    if K == 0:
        return Selection(indices=indices, row_start=rs.long(), tile=T, decode=False, ranked=rank_factor is not None)
    cfg = dict(scale=scale, q_offset=q_offset, T=T, max_chunk_bytes=max_chunk_bytes, method=method,
               rank_factor=rank_factor, scoring=scoring or Launch(), scores_only=scores_only)
    lse_cfg = lse_launch.set_fields() if lse_launch is not None else {}
    fp8 = budget.score_dtype is not None  # FP8 or INT8 scoring: quantised operands with a scale per vector
    if fp8:
        assert lse is None, "FP8 / INT8 scoring makes its LSE from its own scores"
        q, k, sq, sk = quantized(q, k, budget.score_dtype)
    g = B if lse is not None else prefill_chunks.lse_group(B, HQ, L, max_chunk_bytes)
    for b0 in range(0, B, g):
        sl = slice(b0, min(B, b0 + g))
        scales = (sq[sl], sk[sl]) if fp8 else None
        if lse is None:
            lse_g = prefill_lse(q[sl], k[sl], scale=scale, geometry=(ks[sl], host_start[sl], q_offset), fp8=scales,
                                **lse_cfg)
            fixed = lse_g.numel() * 4
        else:
            lse_g, fixed = lse[sl], 0
        _select_group(q[sl], k[sl], lse_g, ks[sl], rs[sl], host_start[sl], first_t[sl], count_t[sl],
                      budgets_host[sl], indices[sl], fixed, fp8=scales, **cfg)
        del lse_g
    return Selection(indices=indices, row_start=rs.long(), tile=T, decode=False, ranked=rank_factor is not None)


def _select_group(q, k, lse, ks, rs, host_start, first_t, count_t, budgets_host, indices, fixed, *, scale, q_offset,
                  T, max_chunk_bytes, method, rank_factor, scoring, scores_only, fp8=None):
    """The selection of a group of sequences (``q``, ``k``, ``lse`` and the per-sequence tensors sliced to it) into
    ``indices`` (its slice of the selection): chunks of tiles (:func:`kascade.ops.prefill_chunks.plan_chunks`), each
    scored into a buffer whose top keys are found per row. ``fixed``: bytes of the bound already taken (the group's
    LSE when made for it). ``fp8``: ``(sq, sk)``, the scales of e4m3 / int8 ``q`` and ``k`` (FP8 / INT8 scoring)."""
    B, HQ, H, G, L, D = _heads(q, k)
    dev = q.device
    K = indices.shape[3]
    count = count_t.tolist()
    R = max(count)  # the group's rows (the batch's other sequences may have more)
    if R == 0:
        return
    # Radix select of unranked rows: each chunk's slots go straight into `indices` (topk.rows_into), with per-row
    # metadata made once; the ranked rows and torch.topk go through temporaries and a write-back.
    direct = prefill_chunks.is_direct(method, rank_factor is not None)
    chunks = prefill_chunks.plan_chunks(heads=H, tile=T, first_tiles=first_t.tolist(), rows=count,
                                        budgets=budgets_host.tolist(), max_chunk_bytes=max_chunk_bytes, fixed=fixed,
                                        method=method, ranked=rank_factor is not None, hist_bins=topk.NHIST,
                                        keys_per_program=topk.TOPK_LAUNCH["prefill"].keys_per_program)
    f32, _ = flags(q)
    M, NSUB, MR = _score_rows(G, T, scoring.block_m)
    launch = replace(_launch("score_reloaded" if NSUB > 1 else "score", D), **scoring.set_fields())
    bn = launch.block_n
    native = fp8 is not None and scoring_mma(q.dtype, dev, D)
    sms = num_sms(dev)
    if direct:  # per row (b, h, c) of every chunk, in launch order: (the sequence's first slot, the buffer width,
        # the row's count, 0), made on the host and copied once (not a copy per chunk for the host to launch)
        full = torch.zeros(B, H, R, 4, dtype=torch.int32)
        full[..., 0] = host_start[:, None, None]
        full[..., 1] = torch.tensor([W for r0, r1, W, _ in chunks for _ in range(r0, r1)])
        full[..., 2] = budgets_host[:, None, :R]
        meta_host = torch.cat([full[:, :, r0:r1].reshape(-1, 4) for r0, r1, _, _ in chunks])
        meta_all = meta_host.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else meta_host.to(dev)
    else:
        budgets_t, start_t = budgets_host.to(dev), host_start.to(dev)  # [B, R], [B]
    mass = G * T if TOPK_BOUND else None  # a row pools G x T queries' probabilities
    m0 = 0
    for r0, r1, W, kc in chunks:
        C = r1 - r0
        if kc > 0:
            buf = torch.empty(B, H, C, W, dtype=torch.float32, device=dev)
            hist = torch.empty(B * H * C, topk.NHIST, dtype=torch.int32, device=dev) if direct else buf
            per = W if dev.type != "cuda" else max(bn, cdiv(W, max(1, cdiv(4 * sms, B * H * C))))
            per = cdiv(per, bn) * bn
            sq, sk = fp8 if fp8 is not None else (lse, lse)
            _score_kernel[(cdiv(W, per), C, B * H)](
                q, k, lse, ks, rs, buf, hist, sq, sk,
                q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                buf.stride(0), buf.stride(1), buf.stride(2),
                L, q_offset, r0, C, W, per, scale * LOG2E, k.shape[2],
                HQ=HQ, G=G, T=T, D=D, M=M, NSUB=NSUB, MR=MR, BLOCK_N=bn, F32=f32, NHIST=topk.NHIST,
                ZERO_HIST=direct, POLY=launch.fma_exp, FP8=fp8 is not None, FP8_MMA=native,
                num_warps=launch.num_warps, num_stages=launch.num_stages,
            )
            if scores_only:  # the benchmark's breakdown: the scoring kernels alone
                pass
            elif direct:
                topk.rows_into(buf.view(B * H * C, W), meta_all[m0:m0 + B * H * C], hist, kc,
                               indices[:, :, r0:r1].view(B * H, C, K), out_rows=C, mass=mass)
                del hist
            else:
                top = topk.tile_topk(buf, budgets_t[:, r0:r1], kc, ranked=rank_factor is not None, method=method,
                                     mass=mass)
                indices[:, :, r0:r1, :kc] = torch.where(top >= 0, top + start_t[:, None, None, None], -1)
                del top
            del buf
        m0 += B * H * C


def sparse_prefill(q, k, v, selection: Selection, *, scale, kv_start=None, q_offset=None, step=None, out=None,
                   counts=None, heads=None, block_n=None, block_m=None, num_warps=None, num_stages=None,
                   prefetch=None, maxnreg=None):
    """Attention of each tile's queries to the tile's selected keys plus causally to the tile's own keys (softmax
    renormalised over both). ``selection``: a prefill :class:`Selection` (int32 or int64 absolute slots, rows
    ascending with -1 padding at the end). ``counts`` (optional, ``[B, R]`` int32 on the device): row ``r`` of
    sequence ``b`` attends only its first ``counts[b, r]`` entries (the prefix of a ranked selection, whose rows
    are in rank order: the order does not matter). ``heads`` (optional, ``[H]`` int32 or int64 on the device): KV
    head ``h`` attends the rows of the selection's head ``heads[h]`` (a reuse layer's head map, read in place; the
    selection may have any number of heads). The launch (``block_n``, ``block_m``: rows a program, by default
    a tile's G*T up to 128; ``num_warps``, ``num_stages``) defaults to :data:`LAUNCH`'s per head dim; ``prefetch``
    (default: the table's): load each block's indices an iteration ahead. ``maxnreg``: a bound on the registers per
    thread that ptxas may use (more programs per SM, at the risk of spills; default: the table's, and none with a
    launch of one's own). ``-> [B, HQ, L, D]``."""
    B, HQ, H, G, L, D = _heads(q, k)
    T = selection.tile
    dev = q.device
    ks, host_start, q_offset = _geometry(q, k, step, kv_start, q_offset)
    idx = selection.indices
    if idx.stride(-1) != 1:
        idx = idx.contiguous()
    assert idx.dim() == 4 and idx.shape[0] == B and (idx.shape[1] == H or heads is not None) and not selection.decode
    if heads is not None:
        assert heads.dtype in (torch.int32, torch.int64) and heads.shape == (H,) and heads.is_contiguous()
    R, KI = idx.shape[2], idx.shape[3]
    rs = selection.row_start.to(device=dev, dtype=torch.int32)
    f32, rne = flags(q)
    M, NRB = _tile_rows(G, T, block_m)
    cfg = _launch("sparse", D)
    regs = None if block_n or num_warps or num_stages else cfg.maxnreg  # a launch of one's own: no register bound
    bn, nw, ns = block_n or cfg.block_n, num_warps or cfg.num_warps, num_stages or cfg.num_stages
    maxnreg = maxnreg or regs
    ahead = cfg.prefetch if prefetch is None else prefetch
    out = torch.empty_like(q) if out is None else out
    maxb = max(1, next_power_of_2(cdiv(max(KI, 1), bn)))
    if counts is not None:
        assert counts.dtype == torch.int32 and counts.shape == (B, R) and counts.stride(-1) == 1
    _sparse_kernel[(R * NRB, H, B)](
        q, k, v, out, idx, counts if counts is not None else rs, heads if heads is not None else rs, ks, rs,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        idx.stride(0), idx.stride(1), idx.stride(2), counts.stride(0) if counts is not None else 0,
        L, q_offset, KI, scale * LOG2E,
        G=G, T=T, TP=max(16, next_power_of_2(T)), D=D, M=M, NRB=NRB, BLOCK_N=bn, MAXB=maxb, F32=f32, RNE=rne,
        HAS_CNT=counts is not None, PREFETCH=ahead, HAS_HM=heads is not None, num_warps=nw, num_stages=ns,
        **({"maxnreg": maxnreg} if maxnreg else {}),
    )
    for b, s in enumerate(host_start.tolist()):  # queries at padding slots belong to no tile
        if s > q_offset:
            out[b, :, : min(L, s - q_offset)].zero_()
    return out


def anchor_prefill(q, k, v, *, budget: Budget, scale, kv_start=None, q_offset=None, max_chunk_bytes=64 << 20):
    """Anchor layer: selection, then attention over it. ``-> (out, Selection)``."""
    sel = select_prefill(q, k, budget=budget, scale=scale, kv_start=kv_start, q_offset=q_offset,
                         max_chunk_bytes=max_chunk_bytes)
    return sparse_prefill(q, k, v, sel, scale=scale, kv_start=kv_start, q_offset=q_offset), sel


# True: layer 0's dense pass (its output and LSE) through cuDNN's attention where that serves (:func:`_cudnn_dense`),
# else through :func:`dense_prefill`. Off until measured on a GPU: ``python -m benchmarks.fp8_scoring --parts prefill``
# times layer 0 both ways, and the kernel tests compiled on a GPU (KASCADE_TEST_DEVICE=cuda) check it against the
# reference.
CUDNN_LAYER0 = False


def _cudnn_dense(q, k, v, scale, host_start, q_offset):
    """``(out, lse [B, HQ, L] fp32)`` of exact causal attention from cuDNN's fused kernel (the fastest dense prefill on
    Hopper: run 12's baseline), or None where it does not serve: a prompt read from its first slot (``q_offset`` 0, no
    left padding; later cache slots are not read), bf16 / fp16, D 64 or 128, a Hopper or later GPU with cuDNN. The KV
    heads are repeated to the query heads for it (a copy of K and V while it runs). Its LSE is the natural log, as
    :func:`dense_prefill`'s."""
    B, HQ, L, D = q.shape
    if not (CUDNN_LAYER0 and q.is_cuda and q_offset == 0 and not bool(host_start.any()) and D in (64, 128)
            and q.dtype in (torch.bfloat16, torch.float16) and k.dtype == q.dtype and v.dtype == q.dtype
            and torch.backends.cudnn.is_available() and torch.cuda.get_device_capability(q.device)[0] >= 9):
        return None
    G = HQ // k.shape[1]
    k, v = k[:, :, :L], v[:, :, :L]
    if G > 1:
        k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False,
                                                                  scale=scale)[:2]
    return out, lse.reshape(B, HQ, L).float().contiguous()


@_renamed.keywords(_renamed.RANK_FACTOR, depth="rank_factor")
def dense_select_prefill(q, k, v, *, scale, budget: Budget | None = None, kv_start=None, q_offset=None, step=None,
                         max_chunk_bytes=64 << 20, index_dtype=None, rank_factor=None):
    """Layer 0: the dense output (with its LSE), then the selection (ranked with ``rank_factor``, see
    :func:`select_prefill`), both exact whatever the budget's ``score_dtype`` (FP8 scoring is the anchors').
    ``-> (out, Selection)``."""
    geometry = _geometry(q, k, step, kv_start, q_offset)
    fast = _cudnn_dense(q, k, v, scale, geometry[1], geometry[2])
    if fast is not None:
        out, lse = fast
    else:
        out, lse = _dense_run(q, k, v, scale=scale, has_v=True, write_lse=True, geometry=geometry)
    budget = replace(budget or step.budget, score_dtype=None)
    sel = select_prefill(q, k, budget=budget, scale=scale, kv_start=kv_start, q_offset=q_offset, step=step, lse=lse,
                         max_chunk_bytes=max_chunk_bytes, index_dtype=index_dtype, rank_factor=rank_factor)
    return out, sel


__all__ = ["anchor_prefill", "dense_prefill", "dense_select_prefill", "prefill_lse", "select_prefill",
           "sparse_prefill"]
