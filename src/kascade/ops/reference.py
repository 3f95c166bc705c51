"""Kascade attention in plain PyTorch: the specification every fast path is tested against.

Layout everywhere: ``q [B, HQ, L, D]``, ``k, v [B, H, N, D]``, output ``[B, HQ, L, D]``; query head ``hq`` reads
KV head ``hq // G`` with ``G = HQ / H`` (the order of transformers' ``repeat_kv``).

Which keys a sequence may see is given by two numbers (see :mod:`kascade.ops`): key slots
``[kv_start[b], q_offset + L)`` are valid for sequence ``b`` (left padding before, unused cache slots after) and
query ``i`` sits at key slot ``q_offset + i``. Inside this module each sequence is cut out and handled on its own in
*compact* coordinates: keys ``0..n-1`` and queries at positions ``n - l .. n - 1``. Queries at padding slots get
a zero output.

Math is done in fp32 (fp64 for fp64 inputs); outputs have the input dtype. Queries are processed in chunks so
that no ``[HQ, L, N]`` tensor is ever built whole (``_CHUNK_ELEMS`` bounds the largest temporary).
"""

from __future__ import annotations

import torch

from .. import _renamed
from ..budget import Budget, at_factor, mass_counts
from . import fp8, int8
from .selection import Selection, sort_padded, stack_rows

# Largest temporary score tensor, in elements (fp32: 256 MB).
_CHUNK_ELEMS = 1 << 26


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _scored(q: torch.Tensor, k: torch.Tensor, budget: Budget) -> tuple[torch.Tensor, torch.Tensor]:
    """The query and key vectors an anchor's scores are computed from: ``q``, ``k`` themselves, or with
    ``budget.score_dtype`` "fp8" / "int8" each head vector (one head, one position) rounded as FP8 / INT8 scoring
    sees it (:func:`kascade.ops.fp8.rounded`, :func:`kascade.ops.int8.rounded`, in the math dtype). Only the
    selection ops call this: outputs stay exact."""
    if budget.score_dtype is None:
        return q, k
    rounded = {"fp8": fp8.rounded, "int8": int8.rounded}[budget.score_dtype]
    return rounded(q), rounded(k)


def _valid_span(kv_start: torch.Tensor, q_offset: int, L: int, b: int) -> tuple[int, int, int]:
    """Compact view of sequence ``b``: (first valid key slot, n valid keys, l real queries)."""
    start = int(kv_start[b])
    n = q_offset + L - start
    return start, n, min(L, n)


# ----------------------------------------------------------------------------------------------------------------
# Dense
# ----------------------------------------------------------------------------------------------------------------
def _dense_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence: ``q [HQ, l, D]`` at positions ``n-l..n-1``, ``k, v [H, n, D]`` -> ``[HQ, l, D]``."""
    HQ, l, D = q.shape
    H, n, _ = k.shape
    G = HQ // H
    out = torch.empty_like(q)
    step = max(1, _CHUNK_ELEMS // (HQ * n))
    kpos = torch.arange(n, device=q.device)
    for i0 in range(0, l, step):
        i1 = min(l, i0 + step)
        qpos = torch.arange(n - l + i0, n - l + i1, device=q.device)
        m = int(qpos[-1]) + 1  # keys this chunk can see
        s = torch.einsum("hgqd,hkd->hgqk", q[:, i0:i1].view(H, G, i1 - i0, D), k[:, :m]) * scale
        s = s.masked_fill(kpos[:m][None, :] > qpos[:, None], float("-inf"))
        out[:, i0:i1] = torch.einsum("hgqk,hkd->hgqd", s.softmax(-1), v[:, :m]).reshape(HQ, i1 - i0, D)
    return out


def dense_attention(q, k, v, *, scale: float, kv_start: torch.Tensor, q_offset: int) -> torch.Tensor:
    """Causal GQA attention over all valid keys. Arguments as in :func:`kascade.ops.dense_attention`."""
    B, HQ, L, D = q.shape
    md = _math_dtype(q.dtype)
    out = torch.zeros(B, HQ, L, D, dtype=md, device=q.device)
    for b in range(B):
        start, n, l = _valid_span(kv_start, q_offset, L, b)
        out[b, :, L - l :] = _dense_one(
            q[b, :, L - l :].to(md), k[b, :, start : start + n].to(md), v[b, :, start : start + n].to(md), scale
        )
    return out.to(q.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Pooled probabilities (shared by selection and calibration)
# ----------------------------------------------------------------------------------------------------------------
def iter_pooled_prefill(q: torch.Tensor, k: torch.Tensor, scale: float, tile: int, shared: bool = False):
    """Exact post-softmax probabilities of one sequence, pooled per KV head over the G heads and each tile.

    ``q [HQ, l, D]`` at positions ``n-l..n-1``, ``k [H, n, D]``. Yields ``(t0, pooled)`` for consecutive chunks of
    tiles: ``pooled [H, c, m]`` (fp32/fp64) holds, for absolute tiles ``t0..t0+c-1``, the sum over the tile's queries
    that are in this call and the group's heads of ``softmax(q k^T * scale)`` over the causal prefix, for keys
    ``0..m-1`` (every key the chunk's queries can see, own tiles included). ``shared=True`` also sums over the
    KV heads (every head gets the same pooled row: the non-head-aware baseline).
    """
    HQ, l, D = q.shape
    H, n, _ = k.shape
    G = HQ // H
    p0 = n - l
    t_first, t_last = p0 // tile, (n - 1) // tile
    tiles_per_chunk = max(1, _CHUNK_ELEMS // (HQ * tile * n))
    kpos = torch.arange(n, device=q.device)
    for t0 in range(t_first, t_last + 1, tiles_per_chunk):
        t1 = min(t_last + 1, t0 + tiles_per_chunk)
        a, e = max(t0 * tile, p0), min(t1 * tile, n)  # positions of this chunk's queries
        m = e  # keys visible to the chunk
        pooled = None
        step = max(1, _CHUNK_ELEMS // (HQ * m))  # queries per block: more than the chunk's unless one tile is huge
        for qa in range(a, e, step):
            qe = min(e, qa + step)
            qpos = torch.arange(qa, qe, device=q.device)
            s = torch.einsum("hgqd,hkd->hgqk", q[:, qa - p0 : qe - p0].view(H, G, qe - qa, D), k[:, :m]) * scale
            s = s.masked_fill(kpos[:m][None, :] > qpos[:, None], float("-inf"))
            per_query = s.softmax(-1).sum(1)  # [H, qe-qa, m]
            if shared:
                per_query = per_query.sum(0, keepdim=True).expand(H, -1, -1)
            if pooled is None:
                pooled = per_query.new_zeros(H, t1 - t0, m)
            pooled.index_add_(1, qpos // tile - t0, per_query)
        yield t0, pooled


def pooled_decode(q: torch.Tensor, k: torch.Tensor, scale: float, shared: bool = False) -> torch.Tensor:
    """One decode query of one sequence, ``q [HQ, 1, D]``, ``k [H, n, D]`` -> pooled probabilities ``[H, n]``."""
    HQ, _, D = q.shape
    H, n, _ = k.shape
    s = torch.einsum("hgd,hkd->hgk", q.view(H, HQ // H, D), k) * scale
    p = s.softmax(-1).sum(1)
    return p.sum(0, keepdim=True).expand(H, -1) if shared else p


def _topk_sorted(scores: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Row ``r`` of ``scores [H, R, m]`` keeps its ``counts[r]`` largest entries: indices ``[H, R, max(counts)]``,
    ascending, padded with -1 at the end."""
    H, R, m = scores.shape
    K = max(counts) if counts else 0
    idx = scores.topk(K, dim=-1).indices if K > 0 else scores.new_zeros(H, R, 0, dtype=torch.long)
    keep = torch.arange(K, device=scores.device)[None, :] < torch.tensor(counts, device=scores.device)[:, None]
    return sort_padded(idx, keep)


def _topk_ranked(scores: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """:func:`_topk_sorted` in rank order: row ``r`` holds its ``counts[r]`` largest entries' indices in descending
    score, -1 padded."""
    H, R, m = scores.shape
    K = max(counts) if counts else 0
    top = scores.topk(K, dim=-1).indices if K else scores.new_zeros(H, R, 0, dtype=torch.long)
    keep = torch.arange(K, device=scores.device)[None, :] < torch.tensor(counts, device=scores.device)[:, None]
    return torch.where(keep[None], top, -1)


# ----------------------------------------------------------------------------------------------------------------
# Selection
# ----------------------------------------------------------------------------------------------------------------
def _select_prefill_one(q, k, scale: float, budget: Budget, shared: bool = False,
                        rank_factor: float | None = None) -> tuple[torch.Tensor, int]:
    """One sequence in prefill: indices ``[H, R, K]`` (compact key positions) and the first row's tile; ranked to
    ``rank_factor`` times each row's budget when ``rank_factor`` is given."""
    H, n, _ = k.shape
    T = budget.tile
    t_first = (n - q.shape[1]) // T
    rows, counts = [], []
    for t0, pooled in iter_pooled_prefill(q, k, scale, T, shared):
        c, m = pooled.shape[1], pooled.shape[2]
        s = torch.arange(t0, t0 + c, device=q.device) * T  # first position of each tile
        cand = pooled.masked_fill(torch.arange(m, device=q.device)[None, :] >= s[:, None], float("-inf"))
        if rank_factor is None:
            cnt = [budget.prefill_tile(int(x), n) for x in s]
            rows.append(_topk_sorted(cand, cnt))
        else:
            cnt = [at_factor(budget.prefill_tile(int(x), n), rank_factor, int(x)) for x in s]
            rows.append(_topk_ranked(cand, cnt))
        counts += cnt
    K = max(counts)
    idx = torch.full((H, len(counts), K), -1, dtype=torch.long, device=q.device)
    r = 0
    for part in rows:
        idx[:, r : r + part.shape[1], : part.shape[2]] = part
        r += part.shape[1]
    return idx, t_first


@_renamed.keywords(_renamed.RANK_FACTOR, depth="rank_factor")
def select(q, k, *, budget: Budget, scale: float, kv_start: torch.Tensor, q_offset: int,
           shared: bool = False, rank_factor: float | None = None) -> Selection:
    """Anchor selection. Arguments as in :func:`kascade.ops.select`; with ``rank_factor`` a ranked selection. The
    scores are those of :func:`_scored` (FP8- or INT8-rounded vectors with a ``budget.score_dtype``)."""
    q, k = _scored(q, k, budget)
    B, HQ, L, D = q.shape
    md = _math_dtype(q.dtype)
    decode = L == 1
    per_seq, row_start = [], []
    for b in range(B):
        start, n, l = _valid_span(kv_start, q_offset, L, b)
        qb, kb = q[b, :, L - l :].to(md), k[b, :, start : start + n].to(md)
        if decode:
            p = pooled_decode(qb, kb, scale, shared)
            if rank_factor is None:
                idx = _topk_sorted(p[:, None, :], [budget.decode(n)])
            else:
                idx = p.topk(budget.decode_counts(n, rank_factor), dim=-1).indices[:, None, :]
            t = 0
        else:
            idx, t = _select_prefill_one(qb, kb, scale, budget, shared, rank_factor)
        per_seq.append(torch.where(idx >= 0, idx + start, -1))
        row_start.append(t)
    return Selection(
        indices=stack_rows(per_seq, q.device),
        row_start=torch.tensor(row_start, dtype=torch.long, device=q.device),
        tile=budget.tile,
        decode=decode,
        ranked=rank_factor is not None,
    )


# ----------------------------------------------------------------------------------------------------------------
# Selection by attention mass (Budget.mass)
# ----------------------------------------------------------------------------------------------------------------
def _mass_rows(cand: torch.Tensor, total: torch.Tensor, cands, budget: Budget, lo, hi, factor: float | None):
    """Rows of one sequence chosen by mass: ``cand [H, c, m]`` the candidates' pooled probabilities (0 for keys a
    row may not choose), ``total [H, c]`` each row's whole pooled mass (its own tile's included), ``cands``,
    ``lo``, ``hi``: ``[c]`` candidates and count bounds per row. Returns (indices ``[H, c, K]``: ascending, or at
    ``factor`` the ``at_factor(kept, factor, cands)`` best in rank order; -1 padded) and kept ``[H, c]``."""
    ranked, order = cand.sort(dim=-1, descending=True, stable=True)  # ties: the earlier key first
    kept = mass_counts(ranked, total, total - cand.sum(-1), budget.mass, lo, hi)
    take = kept if factor is None else at_factor(kept, factor, cands)
    K = int(take.max()) if take.numel() else 0
    keep = torch.arange(K, device=cand.device) < take[..., None]
    idx = order[..., :K]
    return (torch.where(keep, idx, -1) if factor is not None else sort_padded(idx, keep)), kept


def select_by_mass(q, k, *, budget: Budget, scale: float, kv_start: torch.Tensor, q_offset: int,
                   shared: bool = False, factor: float | None = None) -> Selection:
    """Anchor selection with ``budget.mass`` set: per (sequence, KV head, row) the fewest best keys by pooled
    probability holding ``budget.mass`` of the row's pooled probability (a prefill row counts its own tile's mass,
    which it attends anyway), at least the row's count at ratio 0 and at most its count
    (:func:`kascade.budget.mass_counts`). Pooling, candidates and layout as in :func:`select`; the counts are in
    the selection's ``kept``. The scores are those of :func:`_scored`, as in :func:`select`."""
    assert budget.mass is not None
    q, k = _scored(q, k, budget)
    B, HQ, L, D = q.shape
    md = _math_dtype(q.dtype)
    decode = L == 1
    floor, T = budget.floor, budget.tile
    per_seq, kept_seq, row_start = [], [], []
    for b in range(B):
        start, n, l = _valid_span(kv_start, q_offset, L, b)
        qb, kb = q[b, :, L - l :].to(md), k[b, :, start : start + n].to(md)
        if decode:
            p = pooled_decode(qb, kb, scale, shared)[:, None, :]  # [H, 1, n]
            idx, kept = _mass_rows(p, p.sum(-1), n, budget, floor.decode(n), budget.decode(n), factor)
            t = 0
        else:
            t = (n - l) // T
            parts = []
            for t0, pooled in iter_pooled_prefill(qb, kb, scale, T, shared):
                c, m = pooled.shape[1], pooled.shape[2]
                s = torch.arange(t0, t0 + c, device=q.device) * T  # each row's candidates: the keys before its tile
                cand = pooled.masked_fill(torch.arange(m, device=q.device)[None, :] >= s[:, None], 0.0)
                parts.append(_mass_rows(cand, pooled.sum(-1), s, budget, floor.prefill_tile(s, n),
                                        budget.prefill_tile(s, n), factor))
            K = max(x.shape[-1] for x, _ in parts)
            idx = torch.cat([torch.nn.functional.pad(x, (0, K - x.shape[-1]), value=-1) for x, _ in parts], 1)
            kept = torch.cat([x for _, x in parts], 1)
        per_seq.append(torch.where(idx >= 0, idx + start, -1))
        kept_seq.append(kept)
        row_start.append(t)
    R = max(x.shape[1] for x in kept_seq)
    kept = torch.stack([torch.nn.functional.pad(x, (0, R - x.shape[1])) for x in kept_seq])
    return Selection(indices=stack_rows(per_seq, q.device),
                     row_start=torch.tensor(row_start, dtype=torch.long, device=q.device),
                     tile=T, decode=decode, ranked=factor is not None, kept=kept)


# ----------------------------------------------------------------------------------------------------------------
# Sparse attention over a selection
# ----------------------------------------------------------------------------------------------------------------
def _gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x [H, n, D]``, ``idx [H, c, K]`` (-1 = none) -> ``[H, c, K, D]`` (rows for -1 are row 0, masked later)."""
    H, c, K = idx.shape
    flat = idx.clamp_min(0).reshape(H, c * K, 1).expand(H, c * K, x.shape[-1])
    return x.gather(1, flat).view(H, c, K, x.shape[-1])


def _tile_block(q, k, v, rid: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor, p0: int, scale: float):
    """Queries at positions ``qpos [c, Tq]`` (row ``i`` of a chunk of ``c`` tiles), each attending its tile's
    selected keys ``rid [H, c, K]`` and, causally, the keys of its own tile at positions ``kpos [c, Tk]``. Returns
    ``[HQ, c * Tq, D]``; rows of positions outside ``[p0, n)`` (not in this call) hold garbage."""
    HQ, l, D = q.shape
    H, n, _ = k.shape
    G = HQ // H
    c, Tq = qpos.shape
    Tk = kpos.shape[1]
    K = rid.shape[-1]
    qi = (qpos - p0).clamp(0, l - 1)
    qt = q[:, qi.flatten()].view(H, G, c, Tq, D)
    s_sel = torch.einsum("hgctd,hckd->hgctk", qt, _gather_rows(k, rid)) * scale
    s_sel = s_sel.masked_fill((rid < 0)[:, None, :, None, :], float("-inf"))
    kin = kpos.clamp(max=n - 1)  # own-tile key positions, in range
    k_own = k[:, kin.flatten()].view(H, c, Tk, D)
    s_own = torch.einsum("hgctd,hcjd->hgctj", qt, k_own) * scale
    own_ok = (kpos[:, None, :] <= qpos[:, :, None]) & (kpos[:, None, :] < n)  # [c, Tq (query), Tk (key)]
    s_own = s_own.masked_fill(~own_ok[None, None], float("-inf"))
    w = torch.cat([s_sel, s_own], -1).softmax(-1)
    o = torch.einsum("hgctk,hckd->hgctd", w[..., :K], _gather_rows(v, rid))
    o = o + torch.einsum("hgctj,hcjd->hgctd", w[..., K:], v[:, kin.flatten()].view(H, c, Tk, D))
    return o.reshape(HQ, c * Tq, D)


def _sparse_prefill_one(q, k, v, idx: torch.Tensor, t_first: int, scale: float, T: int) -> torch.Tensor:
    """One sequence in prefill. ``idx [H, R, K]`` compact positions, row ``r`` = tile ``t_first + r``.

    Chunks of whole tiles (queries laid out by tile) bound the temporaries; a chunk of a single tile lays out only
    the queries this call has, in blocks, so that neither a large tile nor a short call allocates a tile squared."""
    HQ, l, D = q.shape
    H, n, _ = k.shape
    p0 = n - l
    K = idx.shape[-1]
    out = torch.zeros_like(q)
    t_last = (n - 1) // T
    tiles_per_chunk = max(1, _CHUNK_ELEMS // (HQ * T * (K + T)))
    for t0 in range(t_first, t_last + 1, tiles_per_chunk):
        t1 = min(t_last + 1, t0 + tiles_per_chunk)
        rid = idx[:, t0 - t_first : t1 - t_first]  # [H, c, K]: the selected keys of each tile
        if t1 - t0 == 1:
            a, e = max(t0 * T, p0), min(t1 * T, n)  # this call's queries in the tile
            step = max(1, _CHUNK_ELEMS // (HQ * (K + e - t0 * T)))
            for qa in range(a, e, step):
                qe = min(e, qa + step)
                qpos = torch.arange(qa, qe, device=q.device)[None]
                kpos = torch.arange(t0 * T, qe, device=q.device)[None]
                out[:, qa - p0 : qe - p0] = _tile_block(q, k, v, rid, qpos, kpos, p0, scale)
            continue
        # Queries of the chunk laid out by tile: [c, T] positions, some outside [p0, n) (not in this call).
        qpos = torch.arange(t0 * T, t1 * T, device=q.device).view(t1 - t0, T)
        o = _tile_block(q, k, v, rid, qpos, qpos, p0, scale)
        keep = ((qpos >= p0) & (qpos < n)).flatten()
        out[:, (qpos - p0).flatten()[keep]] = o[:, keep]
    return out


def _sparse_decode_one(q, k, v, idx: torch.Tensor, scale: float) -> torch.Tensor:
    """One decode query: ``q [HQ, 1, D]``, ``idx [H, 1, K]`` -> ``[HQ, 1, D]``."""
    HQ, _, D = q.shape
    H = k.shape[0]
    G = HQ // H
    kk, vv = _gather_rows(k, idx)[:, 0], _gather_rows(v, idx)[:, 0]  # [H, K, D]
    s = torch.einsum("hgd,hkd->hgk", q.view(H, G, D), kk) * scale
    s = s.masked_fill((idx[:, 0] < 0)[:, None, :], float("-inf"))
    return torch.einsum("hgk,hkd->hgd", s.softmax(-1), vv).reshape(HQ, 1, D)


def sparse_attention(q, k, v, selection: Selection, *, scale: float, kv_start: torch.Tensor, q_offset: int):
    """Attention over selected keys (plus the own tile in prefill). Arguments as in
    :func:`kascade.ops.sparse_attention`."""
    B, HQ, L, D = q.shape
    md = _math_dtype(q.dtype)
    out = torch.zeros(B, HQ, L, D, dtype=md, device=q.device)
    selection = selection.as_set()
    for b in range(B):
        start, n, l = _valid_span(kv_start, q_offset, L, b)
        qb = q[b, :, L - l :].to(md)
        kb, vb = k[b, :, start : start + n].to(md), v[b, :, start : start + n].to(md)
        idx = selection.indices[b].long()
        idx = torch.where(idx >= 0, idx - start, -1)
        if selection.decode:
            out[b, :, L - l :] = _sparse_decode_one(qb, kb, vb, idx, scale)
        else:
            out[b, :, L - l :] = _sparse_prefill_one(
                qb, kb, vb, idx, int(selection.row_start[b]), scale, selection.tile
            )
    return out.to(q.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Decode with the geometry on the device
# ----------------------------------------------------------------------------------------------------------------
# A static-cache decode step knows each sequence's keys only on the device (``meta [B, 4]`` int32: first valid
# slot, valid keys ``n_b``, budget ``k_b``, 0; :class:`kascade.ops.step.DecodeMeta`). These forms compute what the
# per-sequence functions above compute, over every key slot of the cache with the invalid ones masked: fixed
# shapes, no value read back to the host, so a compiled or graph-captured step can run them.
def _decode_scores(q, k, meta, scale):
    """``(p [B, H, G, N], valid [B, N])``: softmax of each decode query over its sequence's valid slots (zero
    elsewhere), in the math dtype."""
    B, HQ, _, D = q.shape
    H, N = k.shape[1], k.shape[2]
    md = _math_dtype(q.dtype)
    s = torch.einsum("bhgd,bhnd->bhgn", q.to(md).view(B, H, HQ // H, D), k.to(md)) * scale
    start = meta[:, 0].long()[:, None]
    slot = torch.arange(N, device=q.device)[None, :]
    valid = (slot >= start) & (slot < start + meta[:, 1].long()[:, None])
    return s.masked_fill(~valid[:, None, None, :], float("-inf")).softmax(-1), valid


def _decode_out(p, v, q, valid):
    """``p @ v`` with the values of invalid slots taken as zeros (whatever they hold: a weight of 0 times a NaN
    would still be a NaN)."""
    B, HQ, _, D = q.shape
    v = v.to(p.dtype).masked_fill(~valid[:, None, :, None], 0.0)
    return torch.einsum("bhgn,bhnd->bhgd", p, v).reshape(B, HQ, 1, D).to(q.dtype).contiguous()


def _decode_top(p, valid, meta, budget: Budget, width: int, rank_factor):
    """The top keys of each (sequence, KV head) by pooled probability: ``[B, H, 1, width]`` int64 slots, ascending
    (ranked: descending probability), -1 after each sequence's count."""
    pooled = p.sum(2).masked_fill(~valid[:, None, :], float("-inf"))  # [B, H, N]
    count = meta[:, 2].long() if rank_factor is None else budget.decode_counts(meta[:, 1].long(), rank_factor)
    top = pooled.topk(width, dim=-1).indices
    keep = (torch.arange(width, device=p.device)[None, :] < count[:, None])[:, None, :]
    idx = torch.where(keep, top, -1) if rank_factor is not None else sort_padded(top, keep)
    return idx[:, :, None, :].contiguous()


def dense_decode(q, k, v, *, scale: float, meta: torch.Tensor) -> torch.Tensor:
    """:func:`dense_attention` of a decode step whose geometry is ``meta``."""
    p, valid = _decode_scores(q, k, meta, scale)
    return _decode_out(p, v, q, valid)


@_renamed.keywords(_renamed.RANK_FACTOR, depth="rank_factor")
def select_decode(q, k, *, scale: float, meta: torch.Tensor, budget: Budget, width: int,
                  rank_factor=None) -> torch.Tensor:
    """:func:`select` of a decode step whose geometry is ``meta``: indices ``[B, H, 1, width]`` (``width``: a host
    bound of every sequence's count); the count is ``meta``'s budget, or at ``rank_factor`` a ranked selection. The
    scores are those of :func:`_scored`, as in :func:`select`."""
    p, valid = _decode_scores(*_scored(q, k, budget), meta, scale)
    return _decode_top(p, valid, meta, budget, width, rank_factor)


@_renamed.keywords(_renamed.RANK_FACTOR, depth="rank_factor")
def dense_select_decode(q, k, v, *, scale: float, meta: torch.Tensor, budget: Budget, width: int, rank_factor=None):
    """:func:`dense_decode` and :func:`select_decode` from one softmax. ``-> (out, indices)``. Layer 0's pass:
    exact scores whatever ``budget.score_dtype`` says (FP8 scoring is the anchors' only)."""
    p, valid = _decode_scores(q, k, meta, scale)
    return _decode_out(p, v, q, valid), _decode_top(p, valid, meta, budget, width, rank_factor)


def sparse_decode(q, k, v, indices: torch.Tensor, *, scale: float, counts=None) -> torch.Tensor:
    """Decode attention over absolute key slots ``indices [B, H, 1, K]`` (-1: none; with ``counts [B]`` only each
    row's first ``counts[b]`` entries), in any order."""
    B, HQ, _, D = q.shape
    H = k.shape[1]
    md = _math_dtype(q.dtype)
    idx = indices[:, :, 0].long()  # [B, H, K]
    ok = idx >= 0
    if counts is not None:  # [B], or [B, H, 1] per head (a selection by attention mass)
        c = counts.long()[:, None, None] if counts.dim() == 1 else counts.long()
        ok = ok & (torch.arange(idx.shape[-1], device=q.device)[None, None, :] < c)
    rows = idx.clamp_min(0)[..., None].expand(-1, -1, -1, D)
    s = torch.einsum("bhgd,bhkd->bhgk", q.to(md).view(B, H, HQ // H, D), k.gather(2, rows).to(md)) * scale
    p = s.masked_fill(~ok[:, :, None, :], float("-inf")).softmax(-1)
    vv = v.gather(2, rows).to(md).masked_fill(~ok[..., None], 0.0)  # a padding entry's row: any slot's, unused
    return torch.einsum("bhgk,bhkd->bhgd", p, vv).reshape(B, HQ, 1, D).to(q.dtype).contiguous()
