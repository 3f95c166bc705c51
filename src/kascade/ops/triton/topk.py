"""Top-k selection over pooled probabilities, the step that decides an anchor layer's cost.

* Decode (:func:`select_rows`): one row of pooled probabilities per (sequence, KV head), from the scores and
  softmax statistics the split-K scoring pass wrote. A radix select on the bit pattern of the (non-negative) fp32
  probabilities: the pooling kernel builds a histogram of exponents (below), passes refine the mantissa bits among
  the elements sharing the prefix, then an ordered compaction writes every element above the exact threshold and
  the first ones equal to it, in key order (exact; ties at the threshold go to the earliest keys).
* Prefill (:func:`tile_topk`): the rows of a chunk of tiles, over the chunk's score buffer: the same radix select
  as decode (``method="radix"``, :func:`row_topk`: a histogram pass over the rows, then the decode passes with one
  row per "sequence"; what :func:`kascade.ops.triton.prefill.select_prefill` uses by default), or ``torch.topk``
  (``method="topk"``).

Between the passes, the last program of each row to finish a histogram (an atomic ticket) finds the bin holding
the row's k-th element for the next pass: no launch of its own, no search repeated per program.

Kernels and launchers only: they assert, they do not validate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from .common import cdiv, next_power_of_2
from .launch import config, launch

# Radix selection on the bit pattern of the (non-negative) fp32 values (pooled probabilities). The first
# histogram counts the exponent and the top FIRST_BITS mantissa bits, relative to an upper bound of the k-th largest
# value (a row's values sum to at most ``mass``, so its k-th largest is at most mass / k): FIRST_BINS - 2 bins of a
# 2**-FIRST_BITS octave each below the bound, one for everything above (fewer than k keys), one for everything far
# below (63 octaves down); it is counted per program in registers (tl.histogram) and added with one atomic per
# non-empty bin, not one per key. Two passes then refine 12 and 11 - FIRST_BITS bits of the mantissa among the keys
# sharing the prefix (one atomic per such key: the finer the first histogram, the fewer). When the k-th key falls
# outside the window (a rare, extremely peaked row, or no bound given) a fallback path radixes the whole pattern
# instead (12 + 12 + 7 bits, one atomic per matching key); a third refining pass does nothing otherwise. The
# histograms tried against this one, and what each cost: docs/design/kernels.md.
FIRST_BITS = 2
FIRST_BINS = 64 << FIRST_BITS
# Histogram bins per row, as the kernels lay them out: the first histogram's, three refining histograms of 4096, then
# the tickets of the passes (one counter per level, see _last_finds).
TICKETS = FIRST_BINS + 3 * 4096
NHIST = TICKETS + 8
# The bins a row's common path uses, which the scoring pass zeroes (zero_hist): the first histogram, the first
# refining one (12 bits) and the start of the second (the 11 - FIRST_BITS bits left), then the tickets. A row whose
# k-th key falls outside the first histogram's window (the fallback: 12 + 12 + 7 bits) zeroes the rest of the second
# and the start of the third in its bin search, before the passes that count into them (_find_level).
HOT = FIRST_BINS + 4096 + (1 << (11 - FIRST_BITS))
_FB = tl.constexpr(FIRST_BITS)  # the kernels' copies (a kernel reads only constexpr globals)
_NB = tl.constexpr(FIRST_BINS)
_TK = tl.constexpr(TICKETS)
_HOT = tl.constexpr(HOT)
_LAST = tl.constexpr(1 << (11 - FIRST_BITS))  # bins of the common path's last refining histogram


@dataclass(frozen=True)
class SelectLaunch:
    """The selection passes' launch (Triton's default warps and stages: 4, 3)."""

    keys_per_program: int  # every pass of a row takes the same chunks of keys (the threshold's counts feed the write)
    why: str = field(default="", compare=False, repr=False)


# The launch of the selection passes (the first histogram, with decode's pooling; the refining, threshold and write
# passes), for decode's rows (a (sequence, KV head) each, :func:`select_rows`) and prefill's (a tile and KV head
# each, :func:`rows_into`); a row shorter than a chunk takes one program of the next power of two >= its length.
TOPK_LAUNCH = {
    "decode": SelectLaunch(2048, why="fastest of 1,024-8,192 in an H200 sweep of three Llama shapes (2,946 us in all; "
                                     "3,318 at 4,096), with a 4,096-bin tl.histogram first pass; not swept since"),
    "prefill": SelectLaunch(2048, why="H200 sweep at 32K, the selection given the LSE: 13.58 ms; 4,096 13.71, 8,192 "
                                      "16.20 (Llama shapes); the default model's 4.41 against 5.58 at 8,192"),
}


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
def _zero(hrow, lo: tl.constexpr, hi: tl.constexpr):
    """Zeroes counters ``[lo, hi)`` of one row's histograms."""
    offs = tl.arange(0, 1024)
    for z in range(lo, hi, 1024):
        tl.store(hrow + z + offs, tl.zeros([1024], tl.int32), mask=z + offs < hi)


@triton.jit
def zero_hist(hrow):
    """Zeroes the bins of one row's histograms that every selection counts into (:data:`HOT`) and its tickets."""
    _zero(hrow, 0, _HOT)
    _zero(hrow, _TK, _TK + 8)


@triton.jit
def _bound_exp(mass, kk):
    """Exponent field of an upper bound of a row's kk-th largest value (its values sum to at most ``mass``), with
    a factor 4 of margin for rounding; mass <= 0: no bound (every key in the first histogram's bin 0)."""
    bound = mass / tl.maximum(kk, 1).to(tl.float32)
    e = ((bound.to(tl.int32, bitcast=True) >> 23) & 255) + 2
    return tl.where(mass > 0, e, 320)  # 320: above every exponent (255) by more than the window: all keys in bin 0


@triton.jit
def _first_histogram(Hrow, key, ok, e_hi, CH: tl.constexpr):
    """The first histogram of a chunk's keys (int32 bit patterns of values >= 0, where ``ok``), on their top
    ``8 + FIRST_BITS`` bits ``v`` (exponent and leading mantissa bits) against ``v_hi = e_hi << FIRST_BITS``: the
    last bin for ``v >= v_hi``, bin ``NB - 2 - i`` for ``v = v_hi - 1 - i`` (``i < NB - 2``), 0 below; one atomic
    per non-empty bin."""
    b = tl.minimum(tl.maximum((key >> (23 - _FB)) - (e_hi << _FB) + _NB - 1, 0), _NB - 1)
    h = tl.histogram(tl.where(ok, b, 0), _NB)
    offs = tl.arange(0, _NB)
    h = tl.where(offs == 0, h - (CH - tl.sum(ok.to(tl.int32), 0)), h)  # the keys that are not: counted in bin 0
    tl.atomic_add(Hrow + offs, h, mask=h > 0, sem="relaxed")


@triton.jit
def _pool_kernel(Sc, Stats, Meta, Pooled, Hist, State, sc_row, S,
                 H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, S_PAD: tl.constexpr,
                 CH: tl.constexpr, NHIST: tl.constexpr, HIST: tl.constexpr):
    """Pooled probabilities of one chunk of one (sequence, KV head) row, and the first radix histogram (then the
    row's last program finds the bin of its k-th element). ``Stats``: the scoring pass's split maxima ``[B, HQ, S]``
    followed by its sums."""
    c = tl.program_id(0)
    row = tl.program_id(1)
    Mx = Stats
    Ls = Stats + tl.num_programs(1) * G * S
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
        mass = tl.full([], G, tl.float32)  # a row's probabilities sum to G
        e_hi = _bound_exp(mass, tl.load(Meta + b * 4 + 2))
        _first_histogram(Hist + row.to(tl.int64) * NHIST, p.to(tl.int32, bitcast=True), pm, e_hi, CH)
        _last_finds(Meta, Hist, State, mass, row, tl.num_programs(0), H, NHIST, 2)


@triton.jit
def _hist_kernel(Vals, Meta, Hist, State, sc_row, mass, CH: tl.constexpr, NHIST: tl.constexpr):
    """The first radix histogram of one chunk of one row of candidate values (>= 0; -inf: not a candidate), for
    rows that come without a pooling pass (prefill's score buffer); a row's values sum to at most ``mass`` (<= 0:
    no bound). Then the row's last program finds the bin of its k-th element."""
    c = tl.program_id(0)
    row = tl.program_id(1)
    n = tl.load(Meta + row * 4 + 1)
    e_hi = _bound_exp(mass, tl.load(Meta + row * 4 + 2))
    pos = c * CH + tl.arange(0, CH)
    pm = pos < n
    key = tl.load(Vals + row.to(tl.int64) * sc_row + pos, mask=pm, other=float("-inf")).to(tl.int32, bitcast=True)
    _first_histogram(Hist + row.to(tl.int64) * NHIST, key, pm & (key >= 0), e_hi, CH)  # -inf (any negative): no candidate
    _last_finds(Meta, Hist, State, mass, row, tl.num_programs(0), 1, NHIST, 2)


@triton.jit
def _find_level(Meta, Hist, State, mass, row, H: tl.constexpr, NHIST: tl.constexpr, LEVEL: tl.constexpr):
    """The bin search before pass LEVEL (2-4: refining, 5: threshold counts), from the histogram of the pass
    before, into ``State`` (per row, 8 int32: two sets of (prefix, its number of known bits from bit 30 down, how
    many keys equal to it are still needed) at 0 and 4). LEVEL writes set LEVEL % 2 and reads the other, which the
    programs of the pass before LEVEL (whose last program makes this search) are still reading. After LEVEL 5
    (set 1) the prefix is the exact threshold. ``mass``: the bound the first histogram was counted under. Returns
    (prefix, known bits)."""
    hrow = Hist + row.to(tl.int64) * NHIST
    rd = State + row * 8 + 4 * ((LEVEL + 1) % 2)
    wr = State + row * 8 + 4 * (LEVEL % 2)
    if LEVEL == 2:
        kk = tl.load(Meta + (row // H) * 4 + 2)
        e_hi = _bound_exp(mass, kk)
        sel, r = _find_bin(hrow, kk, _NB)
        inside = (sel > 0) & (sel < _NB - 1)  # the 8 exponent bits and FIRST_BITS mantissa bits are known
        prefix = tl.where(inside, (e_hi << _FB) - (_NB - 1) + sel, 0)
        known = tl.where(inside, 8 + _FB, 0)  # else the fallback: the whole pattern from the top, every key
        r = tl.where(inside, r, kk)
        if (sel <= 0) | (sel >= _NB - 1):  # the fallback counts into bins that zero_hist left: zero them (the
            # third refining histogram's first _LAST: its bin search reads no more)
            _zero(hrow, _HOT, _NB + 2 * 4096 + _LAST)
    else:
        prefix = tl.load(rd + 0)
        known = tl.load(rd + 1)
        r = tl.load(rd + 2)
        if known < 31:
            bits = tl.minimum(12, 31 - known)
            if bits <= 11 - _FB:  # the common path's last pass (or the fallback's): only the first bins can count
                sel, r2 = _find_bin(hrow + _NB + (LEVEL - 3) * 4096, r, _LAST)
            else:
                sel, r2 = _find_bin(hrow + _NB + (LEVEL - 3) * 4096, r, 4096)
            prefix = (prefix << bits) | sel
            known = known + bits
            r = r2
    tl.store(wr + 0, prefix)
    tl.store(wr + 1, known)
    tl.store(wr + 2, r)
    if LEVEL < 5:
        if known >= 31:  # the threshold is exact already (the common path's last refining pass): the next search
            # would only copy it, and the next pass skips its ticket (_radix_kernel), so write its set now (the
            # pass before LEVEL, whose programs read that set, has finished reading it: this is its last program)
            nx = State + row * 8 + 4 * ((LEVEL + 1) % 2)
            tl.store(nx + 0, prefix)
            tl.store(nx + 1, known)
            tl.store(nx + 2, r)
    return prefix, known


@triton.jit
def _last_finds(Meta, Hist, State, mass, row, n_programs, H: tl.constexpr, NHIST: tl.constexpr,
                LEVEL: tl.constexpr):
    """After this program's histogram atomics: its ticket for the row (a release); the row's last program then
    acquires every program's counts and makes the bin search of LEVEL, which the next launch reads from ``State``."""
    # Every thread's histogram atomics come before the one thread's ticket (a CTA barrier; the release is then
    # cumulative over them). The tickets are read-modify-writes of one counter, so they form one release sequence:
    # the last program's acquire, which reads the final count, synchronises with every program's release (C++'s
    # rule, which the PTX memory model keeps). Only that program pays for the acquire (its L1 invalidated); the
    # acquire's result is used, so every thread waits for it (Triton broadcasts a scalar atomic's result through
    # shared memory behind a barrier) before the bin search loads the histogram.
    tl.debug_barrier()
    ticket = Hist + row.to(tl.int64) * NHIST + _TK + LEVEL
    t = tl.atomic_add(ticket, 1, sem="release")
    if t == n_programs - 1:
        if tl.atomic_add(ticket, 0, sem="acquire") == n_programs:
            _find_level(Meta, Hist, State, mass, row, H, NHIST, LEVEL)


@triton.jit
def _radix_kernel(Pooled, Meta, Hist, State, Cnt, sc_row, C, mass,
                  H: tl.constexpr, CH: tl.constexpr, NHIST: tl.constexpr, LEVEL: tl.constexpr):
    """LEVEL 2-4: histogram of the next (up to 12) bits among the keys that share the prefix found so far, then the
    row's last program finds the bin for LEVEL + 1 (nothing once all 31 bits are known). LEVEL 5: count, per chunk,
    the keys above the exact threshold and equal to it."""
    c = tl.program_id(0)
    row = tl.program_id(1)
    b = row // H
    n = tl.load(Meta + b * 4 + 1)
    prefix = tl.load(State + row * 8 + 4 * (LEVEL % 2) + 0)  # this level's bin search (the launch before's)
    known = tl.load(State + row * 8 + 4 * (LEVEL % 2) + 1)
    pos = c * CH + tl.arange(0, CH)
    pm = pos < n
    if LEVEL < 5:
        if known < 31:
            key = tl.load(Pooled + row.to(tl.int64) * sc_row + pos, mask=pm, other=-1.0).to(tl.int32, bitcast=True)
            bits = tl.minimum(12, 31 - known)
            match = pm & ((key >> (31 - known)) == prefix)  # known = 0: every key >= 0 (a negative one is no key)
            digit = (key >> (31 - known - bits)) & ((1 << bits) - 1)
            tl.atomic_add(Hist + row.to(tl.int64) * NHIST + _NB + (LEVEL - 2) * 4096 + digit, tl.full([CH], 1, tl.int32),
                          mask=match, sem="relaxed")
            _last_finds(Meta, Hist, State, mass, row, C, H, NHIST, LEVEL + 1)
        # else: all 31 bits known (the common path's third refining pass): no counts, no ticket; the search before
        # this pass wrote the next one's state (_find_level)
    else:
        key = tl.load(Pooled + row.to(tl.int64) * sc_row + pos, mask=pm, other=-1.0).to(tl.int32, bitcast=True)
        gt = tl.sum((pm & (key > prefix)).to(tl.int32), 0)
        eq = tl.sum((pm & (key == prefix)).to(tl.int32), 0)
        tl.store(Cnt + (row * C + c) * 2 + 0, gt)
        tl.store(Cnt + (row * C + c) * 2 + 1, eq)


@triton.jit
def _write_kernel(Pooled, Meta, State, Cnt, Out, sc_row, C, KMAX, out_rows, stride_og, stride_or,
                  H: tl.constexpr, CH: tl.constexpr, C_PAD: tl.constexpr, PAGED: tl.constexpr,
                  RANK: tl.constexpr = False):
    """Ordered compaction: every element above the threshold, and the first ones equal to it, in key order, into
    row ``row`` of ``Out`` at ``(row // out_rows) * stride_og + (row % out_rows) * stride_or``. RANK: each one as its
    int64 sort key (:func:`_rank_keys`) instead of its key slot, the padding as the largest key."""
    c = tl.program_id(0)
    row = tl.program_id(1)
    out_row = Out + (row // out_rows).to(tl.int64) * stride_og + (row % out_rows).to(tl.int64) * stride_or
    b = row // H
    n = tl.load(Meta + b * 4 + 1)
    kb = tl.load(Meta + b * 4 + 2)
    if PAGED:
        base = 0
    else:
        base = tl.load(Meta + b * 4)
    thr = tl.load(State + row * 8 + 4)  # set 1, written by the threshold pass
    need = tl.load(State + row * 8 + 6)  # elements equal to thr to take
    offs_c = tl.arange(0, C_PAD)
    before = offs_c < c
    gt_before = tl.sum(tl.load(Cnt + (row * C + offs_c) * 2, mask=before, other=0), 0)
    eq_before = tl.sum(tl.load(Cnt + (row * C + offs_c) * 2 + 1, mask=before, other=0), 0)
    pos = c * CH + tl.arange(0, CH)
    pm = pos < n
    key = tl.load(Pooled + row.to(tl.int64) * sc_row + pos, mask=pm, other=-1.0).to(tl.int32, bitcast=True)
    gt = pm & (key > thr)
    eq = pm & (key == thr)
    eqi = eq.to(tl.int32)
    eq_rank = tl.cumsum(eqi, 0) - eqi + eq_before
    sel = gt | (eq & (eq_rank < need))
    seli = sel.to(tl.int32)
    dst = gt_before + tl.minimum(eq_before, need) + tl.cumsum(seli, 0) - seli
    if RANK:  # descending value first (a value's bits, >= 0, rise with it), then ascending slot
        rank = ((0x7FFFFFFF - key).to(tl.int64) << 32) | (base + pos).to(tl.int64)
        tl.store(out_row + dst, rank, mask=sel)
    else:
        tl.store(out_row + dst, (base + pos).to(Out.dtype.element_ty), mask=sel)
    if c == 0:
        for p0 in range(kb, KMAX, CH):
            pp = p0 + tl.arange(0, CH)
            if RANK:
                tl.store(out_row + pp, tl.full([CH], 0x7FFFFFFFFFFFFFFF, tl.int64), mask=pp < KMAX)
            else:
                tl.store(out_row + pp, tl.full([CH], -1, Out.dtype.element_ty), mask=pp < KMAX)


# ----------------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------------
def _radix_passes(vals, meta, Hist, State, mass, out, out_rows, sc_row, rows, H, ch, C, KMAX, paged, rank=False):
    """After the first histogram (counted under the bound ``mass``, its bin search in ``State [rows, 8]``): the
    refining passes, the per-chunk counts at the exact threshold and the ordered write of each row's top keys
    (``KMAX`` slots) into ``out``, a 3-d view whose last dim is contiguous: row ``r`` at ``out[r // out_rows,
    r % out_rows]``. ``rank``: their sort keys instead, into an int64 ``out`` (:func:`_rank_keys`)."""
    assert not rank or out.dtype == torch.int64
    Cnt = torch.empty(rows, C, 2, dtype=torch.int32, device=vals.device)
    for level in (2, 3, 4, 5):
        launch(_radix_kernel, (C, rows), (vals, meta, Hist, State, Cnt), (sc_row, C, mass),
               config(H=H, CH=ch, NHIST=NHIST, LEVEL=level))
    launch(_write_kernel, (C, rows), (vals, meta, State, Cnt, out),
           (sc_row, C, KMAX, out_rows, out.stride(0), out.stride(1)),
           config(H=H, CH=ch, C_PAD=next_power_of_2(C), PAGED=paged, RANK=rank))


def _rank_keys(keys: torch.Tensor, index_dtype: torch.dtype) -> torch.Tensor:
    """The selected slots in descending value (ties: the earlier slot first), -1 padded at the end, from the write
    kernel's sort keys (RANK): ``(0x7FFFFFFF - bits(value)) << 32 | slot`` per selected key (a value is >= 0, so its
    fp32 bits rise with it) and the largest int64 for padding. One sort of the keys orders them; the low 32 bits are
    the slots (padding: all ones, -1), taken by an integer conversion (it keeps the low bits). Two launches where
    ranking by gathered values took about ten (eager decoding waits for the host's launches)."""
    slots = keys.sort(dim=-1).values.to(torch.int32)
    return slots if index_dtype == torch.int32 else slots.to(index_dtype)


def select_rows(Sc, Stats, Hist, S, meta, B, H, G, *, method="radix", chunk=None, ranked=False,
                index_dtype=torch.long, pooled=None) -> torch.Tensor:
    """Top-k keys of every (sequence, KV head) row of a decode step: ``[B, H, 1, KMAX]`` key slots in
    ``index_dtype`` (int64 or int32; logical positions when paged), -1 padded; ``meta``
    (:class:`kascade.ops.step.DecodeMeta`) gives each row's count ``k_b``. ``Sc``: fp32 scores (log2 domain),
    ``[B, HQ, sc_row]`` contiguous (any shape) with ``sc_row = meta.n_max``; ``Stats``: per-split softmax maxima
    ``[B, HQ, S]`` followed by the sums ``[B, HQ, S]``; ``Hist [B*H, NHIST]`` zeroed (its :data:`HOT` bins and
    tickets at least, :func:`zero_hist`); ``pooled``: room for the pooled rows (``B*H*sc_row`` fp32, contiguous;
    allocated here if None).
    ``method``: "radix" (exact, ties to the earliest keys) or "topk" (``torch.topk`` on the pooled row). Ascending
    slots, or with ``ranked`` in descending pooled probability (the radix select picks the keys, then only they are
    sorted)."""
    dev = Sc.device
    sc_row = meta.n_max
    KMAX = meta.k_max
    ch = chunk or min(TOPK_LAUNCH["decode"].keys_per_program, next_power_of_2(meta.n_max))
    C = cdiv(meta.n_max, ch)
    rows = B * H
    Pooled = pooled if pooled is not None else torch.empty(rows * sc_row, dtype=torch.float32, device=dev)
    State = torch.empty(rows, 8, dtype=torch.int32, device=dev)
    radix = method == "radix"
    launch(_pool_kernel, (C, rows), (Sc, Stats, meta.tensor, Pooled, Hist, State), (sc_row, S),
           config(H=H, G=G, GP=next_power_of_2(G), S_PAD=next_power_of_2(S), CH=ch, NHIST=NHIST, HIST=radix))
    if radix:
        indices = torch.empty(B, H, 1, KMAX, dtype=torch.int64 if ranked else index_dtype, device=dev)
        # the pooling kernel counted its histogram under the bound G (a row's probabilities sum to G)
        _radix_passes(Pooled, meta.tensor, Hist, State, float(G), indices.view(rows, 1, KMAX), 1, sc_row, rows, H,
                      ch, C, KMAX, meta.paged, rank=ranked)
        return _rank_keys(indices, index_dtype) if ranked else indices
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


def rows_into(vals: torch.Tensor, meta: torch.Tensor, hist: torch.Tensor, kc: int, out: torch.Tensor, *,
              out_rows: int = 1, mass: float | None = None, chunk: int | None = None, rank: bool = False) -> None:
    """Row ``r`` of ``vals [R, W]`` (fp32, candidates >= 0, -inf elsewhere) keeps its top ``meta[r, 2]`` values
    (exact; ties at the threshold: the earliest positions) as ascending positions plus ``meta[r, 0]``, written with
    -1 padding to ``kc`` straight into ``out`` (int32 or int64; row ``r`` at ``out[r // out_rows, r % out_rows]`` of
    a 3-d view whose last dim is contiguous: a chunk of a prefill selection's rows in place). ``meta [R, 4]`` int32
    on the device: (offset, W, count, 0) per row; ``hist [R, NHIST]`` int32 zeroed (its :data:`HOT` bins and
    tickets at least); ``kc >=`` every count;
    ``mass``: as :func:`row_topk`'s; ``rank``: each kept value's sort key instead, into an int64 ``out``
    (:func:`_rank_keys`). No memset, copy or write-back launches beside the kernels: a prefill selection
    at 128K tokens runs ~250 chunks, and the host's launches, not the GPU, set its pace (docs/design/kernels.md)."""
    R, W = vals.shape
    assert vals.dtype == torch.float32 and vals.is_contiguous() and meta.shape == (R, 4) and meta.is_contiguous()
    assert hist.shape == (R, NHIST) and hist.dtype == torch.int32 and hist.is_contiguous()
    assert out.dim() == 3 and out.stride(-1) == 1 and out.shape[0] * out_rows >= R and out.shape[-1] >= kc
    ch = chunk or min(TOPK_LAUNCH["prefill"].keys_per_program, next_power_of_2(W))
    C = cdiv(W, ch)
    bound = float(mass or 0.0)
    State = torch.empty(R, 8, dtype=torch.int32, device=vals.device)
    _hist_kernel[(C, R)](vals, meta, hist, State, W, bound, CH=ch, NHIST=NHIST)
    _radix_passes(vals, meta, hist, State, bound, out, out_rows, W, R, 1, ch, C, kc, False, rank=rank)


def row_topk(vals: torch.Tensor, counts: torch.Tensor, kc: int, *, ranked: bool = False,
             chunk: int | None = None, mass: float | None = None) -> torch.Tensor:
    """Exact top ``counts[r]`` of every row of ``vals [R, W]`` (fp32, candidates >= 0, -inf elsewhere) by radix
    select: ``counts [R]`` int32 on the device, ``kc >= counts.max()`` (a host bound, no read-back). ``-> [R, kc]``
    int64 positions, -1 padded; ascending (ties at the threshold: the earliest positions), or with ``ranked`` in
    descending value (ties: the earlier position first). A row must have at least ``counts[r]`` candidates.
    ``mass``: an upper bound of every row's sum of candidates (faster: the exponent-window first histogram); a
    wrong bound still selects exactly, by the fallback path; None: always the fallback path.

    The decode passes with one row per "sequence" (``H = 1``, a per-row ``meta``: 0, the span ``W``, the count, 0),
    after a histogram pass of their own (decode's comes from its pooling kernel)."""
    R, W = vals.shape
    assert vals.dtype == torch.float32 and vals.is_contiguous() and counts.shape == (R,)
    dev = vals.device
    meta = torch.zeros(R, 4, dtype=torch.int32, device=dev)
    meta[:, 1] = W
    meta[:, 2] = counts
    out = torch.empty(R, 1, kc, dtype=torch.long, device=dev)
    rows_into(vals, meta, torch.zeros(R, NHIST, dtype=torch.int32, device=dev), kc, out, mass=mass, chunk=chunk,
              rank=ranked)
    return _rank_keys(out[:, 0], torch.long) if ranked else out[:, 0]


def tile_topk(buf: torch.Tensor, counts: torch.Tensor, kc: int, *, ranked: bool = False,
              method: str = "topk", mass: float | None = None) -> torch.Tensor:
    """Top keys of a chunk of prefill rows: ``buf [B, H, C, W]`` fp32 pooled probabilities (-inf where a key is
    not a candidate), ``counts [B, C]`` (on the device) keys per row, ``kc >= counts.max()`` (a host bound).
    ``-> [B, H, C, kc]`` int64 positions into the buffer, -1 padded; ascending, or with ``ranked`` in descending
    probability. ``method``: "topk" (``torch.topk``) or "radix" (:func:`row_topk`; exact, ties at the threshold to
    the earliest keys; ``mass``: a bound of a row's sum, as there)."""
    if method == "radix":
        B, H, C, W = buf.shape
        rows = counts.to(torch.int32)[:, None, :].expand(B, H, C).reshape(-1)
        return row_topk(buf.view(B * H * C, W), rows, kc, ranked=ranked, mass=mass).view(B, H, C, kc)
    assert method == "topk", method
    top = buf.topk(kc, dim=-1, sorted=True).indices  # [B, H, C, kc], descending scores
    keep = torch.arange(kc, device=buf.device)[None, None, :] < counts[:, :, None]  # [B, C, kc]
    big = torch.iinfo(torch.long).max
    top = torch.where(keep[:, None], top, big)
    if not ranked:
        top = top.sort(-1).values
    return torch.where(top == big, -1, top)
