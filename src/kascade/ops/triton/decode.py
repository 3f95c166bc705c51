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

Kernels only: these functions assert, they do not validate (that is :mod:`kascade.ops`' job). The launchers that
read each sequence's keys (dense, selection) take an optional ``meta`` (:class:`kascade.ops.step.DecodeMeta`) so
that a decode step builds the per-sequence metadata once and reuses it in every layer (plan / run split); without
it the metadata is built from the arguments on each call. The sparse launcher reads only its index rows. The
top-k selection itself lives in :mod:`kascade.ops.triton.topk`.

Numerics: scores and softmax in fp32 (log2 domain); ``p @ v`` on the tensor cores with ``p`` split into two
value-dtype parts (high + low), so the weights keep ~16 bits instead of bf16's 8; split-K partials merged by
log-sum-exp in fp32. The error is then that of rounding an exact result to the output dtype.

One launch a pass when eager: a pass with V over several splits writes each split's partial (max, sum, accumulator)
and the last program of each (sequence, KV head) to finish (an acquire-release ticket on a per-device row counter)
merges them and writes the output; it puts the counter back to zero, so the counters, zeroed once when allocated,
stay zero between launches (no memset). Eager decoding at batch 1 is bound by the host's time per launch and per
allocation (tens of microseconds against a few of GPU time), hence also one scratch allocation a pass
(:class:`_Plan`). While a CUDA graph is captured, where a launch costs nothing, the merge is a launch of its own
(:func:`_merge_kernel`, one program a query head, the same arithmetic): a KV head's last program merging its G heads
in turn made the reuse pass 15-20% slower at batch 1 on an H100.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from ... import _renamed
from ...budget import Budget
from ..selection import Selection
from ..step import decode_meta
from . import topk
from .common import LOG2E, cdiv, dot, flags, interpreting, next_power_of_2, num_sms, to_out
from .fp8 import fp8_operand as _fp8_operand
from .int8 import quantizer, scoring_mma
from .launch import launch


# ----------------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _split_kernel(
    Q, K, V, Idx, Cnt, HM, Meta, BT, Out, Ws, Done, Sc, Hist, SQ, SK,
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
    stride_skb, stride_skh,  # FP8: SK's batch and head strides (its slot stride is 1)
    H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, PAGED: tl.constexpr, SPARSE: tl.constexpr, HAS_V: tl.constexpr,
    WRITE_SCORES: tl.constexpr, DIRECT: tl.constexpr, F32: tl.constexpr, NHIST: tl.constexpr, RNE: tl.constexpr,
    HAS_CNT: tl.constexpr, MAXB: tl.constexpr, SB: tl.constexpr, FP8: tl.constexpr = False,
    FP8_MMA: tl.constexpr = False, MERGE: tl.constexpr = True, HAS_HM: tl.constexpr = False,
):
    """One program = (split, KV head, sequence), all G query heads of the group (padded to GP rows). FP8 (the
    scoring pass of FP8 or INT8 scoring, contiguous caches): ``Q``, ``K`` e4m3 or int8, ``SQ [B, HQ]`` and ``SK [B,
    H, N]`` their scales.

    ``Ws``: the pass's fp32 scratch, ``[Mx [B, HQ, S]] [Ls [B, HQ, S]] [Acc [B, HQ, S, D] (with V and S > 1)]``, Acc
    at the first multiple of 64 elements.
    ``Done [>= B * H]`` int32, zero between launches: with V and S > 1, the row's last program to finish merges
    (MERGE; else :func:`_merge_kernel`, launched after, does).
    ``HM [H]`` (SPARSE, HAS_HM): KV head ``h`` reads index row ``HM[h]`` of ``Idx`` (a reuse layer's head map)."""
    split = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    S = tl.num_programs(0)
    n_st = tl.num_programs(2) * H * G * S  # partials of the launch
    Mx = Ws
    Ls = Ws + n_st
    Acc = Ws + ((2 * n_st + 63) // 64) * 64  # aligned (the compiler sees the factor 64: vector loads and stores)
    b64 = b.to(tl.int64)
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, D)
    gm = offs_g < G
    hq = h * G + offs_g  # [GP]

    q = tl.load(Q + b64 * stride_qb + hq[:, None] * stride_qh + offs_d[None, :], mask=gm[:, None], other=0.0)
    qk = qk_scale
    if FP8:
        q = _fp8_operand(q, FP8_MMA)
        qk = (tl.load(SQ + b * H * G + hq, mask=gm, other=1.0) * qk_scale)[:, None]

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
    if SPARSE:  # the split's entries up to the row's -1 padding (which is at the end): the blocks that hold any
        # index (one strided load), then the last of them. A mask from positions alone, not from the indices
        # loaded in the loop, leaves the loop one chain (index -> address -> K / V rows) for the software
        # pipeliner to prefetch stages ahead.
        hs = h
        if HAS_HM:  # a reuse layer's head map: this KV head reads the index row of the anchor's head HM[h]
            hs = tl.load(HM + h).to(tl.int32)
        row_idx = Idx + b64 * stride_ib + hs * stride_ih
        jb = lo + tl.arange(0, MAXB) * BLOCK_N
        nblk = tl.sum((tl.load(row_idx + jb, mask=jb < hi, other=-1) >= 0).to(tl.int32), 0)
        j_last = lo + (nblk - 1) * BLOCK_N + tl.arange(0, BLOCK_N)
        last = tl.load(row_idx + j_last, mask=(j_last >= lo) & (j_last < hi), other=-1)
        hi = tl.minimum(hi, lo + tl.maximum(nblk - 1, 0) * BLOCK_N + tl.sum((last >= 0).to(tl.int32), 0))

    if WRITE_SCORES:
        if split == 0:  # the selection's histograms for this row start from zero
            topk.zero_hist(Hist + (b * H + h) * NHIST)

    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        jm = j < hi
        # ---- which rows: positions (contiguous: relative to the first valid slot) ----
        if SPARSE:
            pos = tl.load(row_idx + j, mask=jm, other=0).to(tl.int64)
            valid = jm
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
        if FP8:
            sk = tl.load(SK + b64 * stride_skb + h * stride_skh + base + pos, mask=valid, other=1.0)
            s = dot(q, tl.trans(_fp8_operand(kt, FP8_MMA)), F32) * sk[None, :] * qk
        else:
            s = dot(q, tl.trans(kt), F32) * qk
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
            pv = dot(p_hi, vt, F32) + dot((p - p_hi.to(tl.float32)).to(vt.dtype), vt, F32)
            acc = acc * alpha[:, None] + pv

    st = (b * H * G + hq) * S + split  # [GP] into [B, HQ, S]
    tl.store(Mx + st, m_i, mask=gm)
    tl.store(Ls + st, l_i, mask=gm)
    if HAS_V:
        if DIRECT:
            o = acc / l_i[:, None]
            tl.store(Out + b64 * stride_ob + hq[:, None] * stride_oh + offs_d[None, :],
                     to_out(o, Out.dtype.element_ty, RNE), mask=gm[:, None])
        else:
            tl.store(Acc + st[:, None].to(tl.int64) * D + offs_d[None, :], acc, mask=gm[:, None])
        if not DIRECT and MERGE:
            # ---- the row's last program merges the S partials (no merge launch) ----
            # Every thread's partial stores come before the one thread's ticket (a CTA barrier; the release is then
            # cumulative over them). The tickets are read-modify-writes of one counter, one release sequence: the
            # program that reads S - 1 synchronises with every other program's release, then reads their partials
            # past L1 (.cg). It puts the counter back to 0: the next launch (or a CUDA graph's replay) finds it so.
            tl.debug_barrier()
            done = Done + b * H + h
            if tl.atomic_add(done, 1, sem="acq_rel") == S - 1:
                _merge(Out, Acc, Mx, Ls, b64, h, S, stride_ob, stride_oh, H, G, D, SB, RNE)
                tl.store(done, 0)


@triton.jit
def _merge(Out, Acc, Mx, Ls, b64, h, S, stride_ob, stride_oh, H: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
           SB: tl.constexpr, RNE: tl.constexpr):
    """Log-sum-exp merge of the S split partials of each of the G query heads of KV head ``h``."""
    for g in range(G):
        _merge_head(Out, Acc, Mx, Ls, b64, h * G + g, S, stride_ob, stride_oh, H, G, D, SB, RNE)


@triton.jit
def _merge_head(Out, Acc, Mx, Ls, b64, hq, S, stride_ob, stride_oh, H: tl.constexpr, G: tl.constexpr,
                D: tl.constexpr, SB: tl.constexpr, RNE: tl.constexpr):
    """The merge of query head ``hq``: its partials in blocks of SB splits (one block when S <= SB: loads issued
    together, one round trip to L2 a head)."""
    offs_d = tl.arange(0, D)
    offs_s = tl.arange(0, SB)
    row = (b64 * (H * G) + hq) * S  # the head's first partial
    mx = tl.full([], float("-inf"), tl.float32)
    num = tl.zeros([D], tl.float32)
    den = tl.zeros([], tl.float32)
    for s0 in range(0, S, SB):
        s = s0 + offs_s
        ok = s < S
        acc = tl.load(Acc + (row + s)[:, None] * D + offs_d[None, :], mask=ok[:, None], other=0.0,
                      cache_modifier=".cg")  # [SB, D]
        m = tl.load(Mx + row + s, mask=ok, other=float("-inf"), cache_modifier=".cg")
        l = tl.load(Ls + row + s, mask=ok, other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(mx, tl.max(m, 0))  # finite from the first block on: split 0 holds keys
        alpha = tl.exp2(mx - m_new)  # 0 at the first block: one block is the plain merge
        w = tl.exp2(m - m_new)  # splits without keys have m = -inf: weight 0
        num = num * alpha + tl.sum(acc * w[:, None], 0)
        den = den * alpha + tl.sum(l * w, 0)
        mx = m_new
    tl.store(Out + b64 * stride_ob + hq * stride_oh + offs_d, to_out(num / den, Out.dtype.element_ty, RNE))


@triton.jit
def _merge_kernel(Out, Ws, S, stride_ob, stride_oh, H: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                  SB: tl.constexpr, RNE: tl.constexpr):
    """The merge as a launch of its own, one program a (query head, sequence): what a CUDA graph runs (a launch
    costs nothing there, and the merge of each head runs in parallel instead of a KV head's last program merging
    its G heads one after the other: at B = 1 that tail cost the reuse pass 15% on an H100)."""
    hq = tl.program_id(0)
    b64 = tl.program_id(1).to(tl.int64)
    n_st = tl.num_programs(1) * H * G * S
    _merge_head(Out, Ws + ((2 * n_st + 63) // 64) * 64, Ws, Ws + n_st, b64, hq, S, stride_ob, stride_oh, H, G, D,
                SB, RNE)


# ----------------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------------
def _gp(G: int) -> int:
    return max(16, next_power_of_2(G))


@dataclass(frozen=True)
class PassLaunch:
    """One pass's launch of the split-K kernel."""

    block_n: int  # keys a block at D <= 128 (halved at D = 256 but in the dense pass: the same bytes a stage)
    num_warps: int
    num_stages: int
    per_sm: int  # programs per multiprocessor the split count aims at
    round_up: bool  # whether the split count rounds up to reach them (down: never more, one wave)
    why: str = field(default="", compare=False, repr=False)


# The launch of each pass: "dense" (plain dense decode), "score" (the anchor's scoring pass: K only, writes the G
# score rows), "dense_scores" (layer 0: dense output and score rows), "sparse" (the reuse pass over gathered rows;
# "sparse_full" once the (sequence, KV head) rows alone fill the GPU). In the whys: an H200's per-shape sweep
# (``python -m benchmarks.decode_configs``: Llama and default-model shapes, B 1-32, N 32K-128K, bf16), times in us;
# launches as (block_n, num_warps, num_stages). A second, partly filled wave costs up to 30% in that sweep: the splits
# round down unless said.
PASS_CONFIG = {
    "dense": PassLaunch(32, 4, 3, 2, True,
                        why="not swept (SDPA is the dense baseline); rounds up: down, it takes one split instead of "
                            "two at B = 32, 128K and 3,988 against 3,758"),
    "score": PassLaunch(128, 4, 3, 2, False,
                        why="128-key blocks keep enough bytes in flight: 27-32% faster than (32, 4, 3) at B = 1-8 "
                            "(81 against 109 at B = 1, 128K; 540 against 749 at B = 8, 128K)"),
    "dense_scores": PassLaunch(64, 4, 3, 2, False,
                               why="the fastest or within 1% of it at every swept shape (B = 8, 128K: 1,054 "
                                   "against 1,044 for (64, 8, 3))"),
    "sparse": PassLaunch(64, 4, 3, 3, False,
                         why="3 programs an SM while the rows are fewer than the SMs: 45 against 50 at B = 8, 32K "
                             "(6 splits, not 9); the default model's B = 8, 32K: 19.3 against 18.1 at 4 rounded up"),
    "sparse_full": PassLaunch(64, 4, 3, 4, True,
                              why="only its programs per SM count (the blocks are the sparse pass's): once the rows "
                                  "alone fill the GPU, more than one wave: 426 against 502 at B = 32, 128K"),
}


def _default_config(D: int, kind: str) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of one pass (:data:`PASS_CONFIG`)."""
    c = PASS_CONFIG[kind]
    return (c.block_n // 2 if D > 128 and kind != "dense" else c.block_n), c.num_warps, c.num_stages


def _per_sm(kind: str, rows: int, device) -> tuple[int, bool]:
    """(programs per multiprocessor, round the split count up) of one pass over ``rows`` (sequence, KV head) rows."""
    c = PASS_CONFIG["sparse_full" if kind == "sparse" and rows >= num_sms(device) else kind]
    return c.per_sm, c.round_up


def _splits(rows: int, n: int, block_n: int, device, num_splits=None, per_sm=2, round_up=True) -> tuple[int, int]:
    """(splits, keys per split), each split a whole number of blocks: ``num_splits`` or, by default, about ``per_sm``
    programs per multiprocessor (rounded up, or down: never more)."""
    if num_splits is None:
        programs = per_sm * num_sms(device)
        want = cdiv(programs, rows) if round_up else programs // rows
        num_splits = max(1, min(want, cdiv(n, 2 * block_n)))
    per = cdiv(cdiv(n, num_splits), block_n) * block_n
    return cdiv(n, per), per


def _kv_args(k, v, block_table):
    """Strides (batch-or-page, head, slot) of K and V, and the page size (0 when contiguous)."""
    ks, vs = k.stride(), v.stride()
    assert ks[-1] == 1 and vs[-1] == 1, "the head dim must be contiguous"
    if block_table is None:
        return ks[:3], vs[:3], 0
    assert block_table.dtype == torch.int32 and block_table.dim() == 2
    return (ks[0], ks[2], ks[1]), (vs[0], vs[2], vs[1]), k.shape[1]


def _heads(q, k, block_table):
    B, HQ, L, D = q.shape
    assert L == 1, "decode kernels take one query per sequence"
    H = k.shape[2] if block_table is not None else k.shape[1]
    assert HQ % H == 0 and k.shape[-1] == D and D in (16, 32, 64, 128, 256)
    return B, HQ, H, HQ // H, D


# Launch plans of the split-K kernel, by shape and pass: a decode step launches the same few configurations in every
# layer, and working one out (launch configuration, splits, constexprs, scratch layout) costs more host time than the
# launch itself. (A dynamic cache's launch bound moves every 256 steps, ops.step.launch_bound; the memo is emptied
# when it grows large.)
_PLANS: dict = {}
_MAX_PLANS = 4096


@dataclass(frozen=True)
class _Plan:
    """One pass's launch: splits, keys per split, the kernel's constexprs and launch keywords, and its fp32 scratch
    (one allocation): ``[Mx, Ls [B, HQ, S]] [Acc [B, HQ, S, D] (merged passes)] [Sc [B, HQ, sc_row]] [Pooled [B*H,
    sc_row]]`` (scores and pooled rows: the scoring passes), each region at a multiple of 64 elements."""

    S: int
    per: int
    consts: dict
    sc: int  # offset of Sc
    pooled: int  # offset of Pooled
    size: int  # elements of the scratch
    variants: dict = field(default_factory=dict, compare=False)  # (page, merged, head map) -> the launch's constexprs


def _merge_block(S: int, D: int) -> int:
    """Splits a block of the merge (:func:`_merge`) takes at once: all of them up to 8,192 accumulator values (64
    registers a thread at 4 warps)."""
    return min(next_power_of_2(S), max(1, 8192 // D))


def _align(n: int) -> int:
    return -(-n // 64) * 64


def _plan(kind, B, H, G, D, n_keys, device, dtype, paged, counts, cfg) -> _Plan:
    """The launch of one pass, memoised. An e4m3 / int8 ``dtype``: FP8 / INT8 scoring."""
    key = (kind, B, H, G, D, n_keys, device, dtype, paged, counts, cfg)
    plan = _PLANS.get(key)
    if plan is None:
        num_splits, block_n, num_warps, num_stages, programs_per_sm = cfg
        bn, nw, ns = _default_config(D, kind)
        bn = block_n or bn
        nw = num_warps or nw
        num_stages = None if interpreting() else (num_stages or ns)
        per_sm, round_up = _per_sm(kind, B * H, device)
        S, per = _splits(B * H, n_keys, bn, device, num_splits, programs_per_sm or per_sm, round_up)
        f32, rne = flags(torch.empty(0, dtype=dtype))
        sparse, has_v, scores = kind == "sparse", kind != "score", kind in ("score", "dense_scores")
        consts = dict(H=H, G=G, GP=_gp(G), D=D, BLOCK_N=bn, PAGED=paged, SPARSE=sparse, HAS_V=has_v,
                      WRITE_SCORES=scores, DIRECT=S == 1, F32=f32, NHIST=topk.NHIST, RNE=rne, HAS_CNT=counts,
                      MAXB=next_power_of_2(cdiv(per, bn)) if sparse else 1, SB=_merge_block(S, D), num_warps=nw)
        if dtype in (torch.float8_e4m3fn, torch.int8):
            consts.update(FP8=True, FP8_MMA=scoring_mma(dtype, device, D))
        if num_stages is not None:
            consts["num_stages"] = num_stages
        n_st = B * H * G * S
        sc = _align(_align(2 * n_st) + (n_st * D if has_v and S > 1 else 0))
        pooled = _align(sc + B * H * G * n_keys) if scores else sc
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        plan = _PLANS[key] = _Plan(S, per, consts, sc, pooled, pooled + B * H * n_keys if scores else sc)
    return plan


# The row counters of the merged passes (:func:`_split_kernel`'s ``Done``), per device: zero between launches (the
# row's last program puts its counter back), so they are allocated (zeroed) once, not per call. A CUDA graph records
# their address: a buffer outgrown stays alive (``_DONE_ALL``), and none is made while a graph is being captured (the
# capture's warm-up call makes it). Launches on one device share them, so the merged passes of two streams of one
# device must not run at the same time.
_DONE: dict = {}
_DONE_ALL: list = []


def _done(device, rows: int) -> torch.Tensor:
    buf = _DONE.get(device)
    if buf is None or buf.numel() < rows:
        buf = _DONE[device] = _counters(device, max(rows, 1024))
        _DONE_ALL.append(buf)
    return buf


def _counters(device, n: int) -> torch.Tensor:
    """``n`` zeroed int32 counters on ``device``, in the caching allocator's own pool. On CUDA they are made on a
    stream of their own: allocations of the current stream may be going to a CUDA graph's private pool (torch.compile's
    "reduce-overhead" runs its warm-up calls there), whose memory later graphs reuse."""
    if device.type != "cuda":
        return torch.zeros(n, dtype=torch.int32, device=device)
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"the decode kernels' row counters ({n}) are made outside CUDA-graph capture: run the "
                           "decode step once eagerly at this batch size before capturing it")
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        buf = torch.zeros(n, dtype=torch.int32, device=device)
    side.synchronize()
    return buf


def _run_split(q, k, v, idx, meta, block_table, out, *, scale, n_keys, sparse, has_v, write_scores, sc_row,
               counts=None, heads=None, num_splits=None, block_n=None, num_warps=None, num_stages=None,
               programs_per_sm=None, fp8=None, fused_merge=None):
    """Launch the split-K kernel (one launch: the partials of several splits are merged by the row's last program).
    Returns (out, Stats, Sc, Pooled, Hist, S); for the scoring passes (``write_scores``, else None) what the
    selection reads: ``Stats`` (the scratch: Mx ``[B, HQ, S]`` then Ls), the scores ``Sc`` and room for the pooled
    rows (1-d views of it, rows of ``sc_row``), the histograms ``[B*H, NHIST]`` int32. ``fp8``: ``(sq [B, HQ, 1],
    sk [B, H, N])``, the scales of e4m3 / int8 ``q`` and ``k`` (the scoring pass of FP8 / INT8 scoring).
    ``fused_merge``: whether the row's last program merges (one launch) or :func:`_merge_kernel` does (a second
    launch); default: fused, but while a CUDA graph is being captured. ``heads``: the sparse pass's head map
    (:func:`sparse_decode`)."""
    B, HQ, H, G, D = _heads(q, k, block_table)
    dev = q.device
    kind = "sparse" if sparse else ("dense_scores" if has_v else "score") if write_scores else "dense"
    paged = block_table is not None
    assert not write_scores or sc_row == n_keys
    p = _plan(kind, B, H, G, D, n_keys, dev, q.dtype, paged, counts is not None,
              (num_splits, block_n, num_warps, num_stages, programs_per_sm))
    ks, vs, page = _kv_args(k, v if v is not None else k, block_table)
    ws = torch.empty(p.size, dtype=torch.float32, device=dev)
    if has_v and out is None:
        out = torch.empty_like(q)
    istr = idx.stride() if sparse else (0, 0)
    if sparse:
        assert idx.dim() == 4 and idx.shape[2] == 1 and istr[-1] == 1
    if counts is not None:
        assert sparse and counts.dtype == torch.int32 and counts.shape == (B,) and counts.is_contiguous()
    if heads is not None:
        assert sparse and heads.dtype in (torch.int32, torch.int64) and heads.shape == (H,) and heads.is_contiguous()
    if write_scores:
        Sc = ws[p.sc:p.pooled]
        Hist = torch.empty(B * H, topk.NHIST, dtype=torch.int32, device=dev)
    else:
        Sc = Hist = ws
    merged = has_v and p.S > 1
    # one launch when eager (the host's time per launch is what eager decoding waits for); two inside a CUDA graph
    fused = merged and (fused_merge if fused_merge is not None
                        else not (dev.type == "cuda" and torch.cuda.is_current_stream_capturing()))
    done = _done(dev, B * H) if fused else ws
    qs = q.stride()
    os_ = out.stride() if out is not None else (0, 0)
    assert (fp8 is not None) == (q.dtype in (torch.float8_e4m3fn, torch.int8))
    assert fp8 is None or not (has_v or paged)
    sq, sk = fp8 if fp8 is not None else (ws, ws)
    hm = heads is not None
    consts = p.variants.get((page, fused, hm))
    if consts is None:
        consts = p.variants[(page, fused, hm)] = dict(PAGE=max(page, 1), MERGE=fused, HAS_HM=hm, **p.consts)
    launch(_split_kernel, (p.S, H, B), (
        q, k, v if v is not None else k, idx if sparse else ws, counts if counts is not None else ws,
        heads if hm else ws, meta.tensor if meta is not None else ws, block_table if paged else ws,
        out if out is not None else ws, ws,
        done, Sc, Hist, sq, sk,
    ), (
        qs[0], qs[1], *ks, *vs,
        istr[0], istr[1],
        block_table.stride(0) if paged else 0, os_[0], os_[1],
        n_keys, p.per, sc_row, scale * LOG2E, *(sk.stride()[:2] if fp8 is not None else (0, 0)),
    ), consts)
    if merged and not fused:
        c = p.consts
        _merge_kernel[(H * G, B)](out, ws, p.S, os_[0], os_[1], H=H, G=G, D=D, SB=c["SB"], RNE=c["RNE"],
                                  num_warps=4)
    if not write_scores:
        return out, None, None, None, None, p.S
    return out, ws, Sc, ws[p.pooled:], Hist, p.S


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


def sparse_decode(q, k, v, indices, *, scale, kv_start=None, block_table=None, out=None, counts=None, heads=None,
                  **cfg):
    """Decode attention over the selected keys only (softmax renormalised over them). ``-> [B, HQ, 1, D]``.

    indices: ``[B, H, 1, K]`` int32 or int64, ascending, -1 padding at the end (a :class:`Selection`'s ``indices``
    are used as they are: loading int64 costs 8 bytes per selected row against the 4*D bytes of its K and V rows,
    less than a conversion launch per layer). Contiguous: absolute slots (``kv_start`` is not needed and ignored);
    paged: logical positions. Every row must hold at least one index.

    counts: ``[B]`` int32 on the device (optional): sequence ``b`` attends only the first ``counts[b]`` entries of
    its rows (the prefix of a ranked selection, :meth:`kascade.ops.Step.counts`), as if the rest were -1; the order
    of the entries does not matter.

    heads: ``[H]`` int32 or int64 on the device (optional): KV head ``h`` attends row ``heads[h]`` of ``indices``
    (whose head count may differ from ``k``'s): a reuse layer's head map read in place, what ``indices[:,
    heads]`` would give without making it (a launch and an allocation a layer).
    """
    del kv_start
    if indices.stride(-1) != 1:
        indices = indices.contiguous()
    out, *_ = _run_split(q, k, v, indices, None, block_table, out, scale=scale, n_keys=indices.shape[-1],
                         sparse=True, has_v=True, write_scores=False, sc_row=0, counts=counts, heads=heads, **cfg)
    return out


def _indices(Sc, Stats, Pooled, Hist, S, meta, B, H, G, budget, method, chunk, rank_factor, index_dtype):
    if rank_factor is not None:  # ranked: each sequence keeps Budget.decode_counts(n_b, rank_factor) keys (device ops)
        meta = meta.with_counts(budget, rank_factor)
    return topk.select_rows(Sc, Stats, Hist, S, meta, B, H, G, method=method, chunk=chunk, pooled=Pooled,
                            ranked=rank_factor is not None, index_dtype=index_dtype)


def _selection(indices, budget: Budget, rank_factor) -> Selection:
    return Selection(indices=indices, row_start=torch.zeros(indices.shape[0], dtype=torch.long, device=indices.device),
                     tile=budget.tile, decode=True, ranked=rank_factor is not None)


@_renamed.keywords(_renamed.RANK_FACTOR, depth="rank_factor")
def select_decode(q, k, *, budget: Budget, scale, rank_factor=None, **kw) -> Selection:
    """Anchor selection of a decode step: pooled post-softmax probabilities of the G heads of each group, top
    ``budget.decode(n_b)`` keys per (sequence, KV head): :func:`select_decode_indices` as a :class:`Selection`."""
    return _selection(select_decode_indices(q, k, budget=budget, scale=scale, rank_factor=rank_factor, **kw), budget,
                      rank_factor)


@_renamed.keywords("the keys quantised for the budget's score_dtype, e4m3 or int8", k_fp8="k_quant")
def select_decode_indices(q, k, *, budget: Budget, scale, kv_start=None, q_offset=None, block_table=None,
                          seq_lens=None, meta=None, method="radix", chunk=None, rank_factor=None,
                          index_dtype=torch.long, k_quant=None, **cfg) -> torch.Tensor:
    """The indices ``[B, H, 1, KMAX]`` of :func:`select_decode`'s selection (no ``row_start``: a launch of its own
    that :mod:`kascade.ops`, which has the step's, does not need). ``method``: "radix" (Triton radix select, exact:
    ties at the threshold go to the earliest keys) or "topk" (torch.topk on the pooled scores). ``index_dtype``: of
    the selection's indices, int64 (default) or int32 (the Triton steps' :attr:`kascade.ops.Step.index_dtype`: half
    the memory, and the sparse kernel reading them 2-3% faster, the decode benchmark's ``reuse_int32``).

    ``rank_factor`` (a float): a *ranked* selection instead, for plans whose layers keep different numbers of keys
    (:mod:`kascade.reuse`): the top ``Budget.decode_counts(n_b, rank_factor)`` keys in descending pooled probability,
    not sorted by slot, -1 padded at the end (the sparse kernels need only the padding at the end). With "radix"
    the keys are selected by the radix select and then only they are sorted by probability.

    FP8 / INT8 scoring (``budget.score_dtype`` "fp8" / "int8", :mod:`kascade.ops.fp8`, :mod:`kascade.ops.int8`;
    contiguous caches): the query is quantised here and the keys too, unless ``k_quant = (k8, sk)`` holds them
    already (:func:`kascade.ops.triton.fp8.quantize` / :func:`kascade.ops.triton.int8.quantize` of ``k``: a decode
    step that keeps its anchors' keys in 8 bits reads half the bytes; quantising the whole cache on every call reads
    it all and costs more than it saves)."""
    B, HQ, H, G, D = _heads(q, k, block_table)
    meta = _meta_for(q, meta, kv_start, q_offset, seq_lens, block_table, budget, k.shape[2])
    assert meta.k is not None, "meta built without a budget"
    fp8 = None
    if budget.score_dtype is not None:
        assert block_table is None, "FP8 / INT8 scoring of a paged cache is not supported"
        quantize = quantizer(budget.score_dtype)
        q, sq = quantize(q)
        k8, sk = k_quant if k_quant is not None else quantize(k)
        assert k8.dtype == q.dtype and k8.shape == k.shape and sk.shape == k.shape[:3] and sk.stride(-1) == 1, k8.dtype
        k, fp8 = k8, (sq, sk)
    _, Stats, Sc, Pooled, Hist, S = _run_split(q, k, None, None, meta, block_table, None, scale=scale,
                                               n_keys=meta.n_max, sparse=False, has_v=False, write_scores=True,
                                               sc_row=meta.n_max, fp8=fp8, **cfg)
    return _indices(Sc, Stats, Pooled, Hist, S, meta, B, H, G, budget, method, chunk, rank_factor, index_dtype)


@_renamed.keywords(_renamed.RANK_FACTOR, depth="rank_factor")
def dense_select_decode(q, k, v, *, budget: Budget, scale, rank_factor=None, **kw):
    """Layer 0: the dense output and the selection (ranked with ``rank_factor``, see :func:`select_decode`) from one
    pass over K and V. ``-> (out, Selection)``."""
    out, indices = dense_select_decode_indices(q, k, v, budget=budget, scale=scale, rank_factor=rank_factor, **kw)
    return out, _selection(indices, budget, rank_factor)


def dense_select_decode_indices(q, k, v, *, budget: Budget, scale, kv_start=None, q_offset=None, block_table=None,
                                seq_lens=None, meta=None, method="radix", out=None, chunk=None, rank_factor=None,
                                index_dtype=torch.long, **cfg):
    """:func:`dense_select_decode` with the selection's indices alone. ``-> (out, indices)``."""
    B, HQ, H, G, D = _heads(q, k, block_table)
    meta = _meta_for(q, meta, kv_start, q_offset, seq_lens, block_table, budget, k.shape[2])
    out, Stats, Sc, Pooled, Hist, S = _run_split(q, k, v, None, meta, block_table, out, scale=scale,
                                                 n_keys=meta.n_max, sparse=False, has_v=True, write_scores=True,
                                                 sc_row=meta.n_max, **cfg)
    return out, _indices(Sc, Stats, Pooled, Hist, S, meta, B, H, G, budget, method, chunk, rank_factor, index_dtype)


def anchor_decode(q, k, v, *, budget: Budget, scale, kv_start=None, q_offset=None, block_table=None,
                  seq_lens=None, meta=None, method="radix", out=None):
    """Anchor layer: selection, then attention over the selected keys. ``-> (out, Selection)``."""
    sel = select_decode(q, k, budget=budget, scale=scale, kv_start=kv_start, q_offset=q_offset,
                        block_table=block_table, seq_lens=seq_lens, meta=meta, method=method)
    return sparse_decode(q, k, v, sel.indices, scale=scale, block_table=block_table, out=out), sel
