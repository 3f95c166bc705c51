"""Richer reuse (issue 8): index sets built from anchors' *rankings* instead of their fixed top-k sets.

The faithful method hands a reuse layer its anchor's top-k set through the head map. A plan with variant fields
(:attr:`kascade.KascadePlan.ranked`) instead has every anchor rank its keys (descending pooled probability, the
same exact pooling as :func:`kascade.ops.select`) as deep as the largest budget among the layers it serves, and
builds each reuse row from those rankings:

- ``layer_scale``: a layer keeps ``round(scale * c)`` keys of a row whose faithful budget is ``c`` (never more
  than the row's candidates): the prefix of its source's ranking.
- ``sources``: a reuse head may follow any earlier anchor's head, or two of them; two rankings are merged rank by
  rank (first, second, first, second, ...), skipping keys already taken, so the union has exactly the budget.
- ``sinks`` / ``recent``: the first ``sinks`` keys and the most recent ones, ``floor(recent * c)`` keys in all,
  are taken first; the rest of the budget comes from the rankings.

Every result is a standard :class:`~kascade.ops.Selection` (ascending, -1 padded), so sparse attention (reference
or Triton) runs on it unchanged. This module is the specification of these variants, in plain PyTorch.

Extra kernel work a fast path would need: the anchor's top-k must emit its indices in rank order (or with their
scores) to depth ``max scale * c`` instead of sorted ascending at depth ``c`` (the radix top-k already finds
them; only the final ordering and a larger k change), and reuse layers need a small per-(head, row) kernel that
takes a prefix / merges two prefixes with the forced keys, deduplicates and sorts: O(k log k) per row, against the
O(k D) attention over the same row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .budget import Budget
from .ops import reference
from .ops.selection import Selection, stack_rows

_BIG = torch.iinfo(torch.long).max


@dataclass(frozen=True)
class RankedSelection(Selection):
    """An anchor's selection (``indices``: its own set, as in :class:`Selection`) plus ``order [B, H, R, Kr]``:
    key slots in descending pooled probability, -1 padded, deep enough for every layer that draws on it."""

    order: torch.Tensor | None = None


def _scaled(count: int, scale: float, limit: int) -> int:
    return min(limit, int(math.floor(scale * count + 0.5)))


def row_counts(budget: Budget, scale: float, *, kv_start: torch.Tensor, q_offset: int, L: int, rows: int,
               row_start: torch.Tensor, decode: bool) -> list[list[int]]:
    """Keys each (sequence, row) keeps at budget multiplier ``scale``: ``round(scale * faithful count)``, capped
    by the row's candidates (``s`` keys before a prefill tile at position ``s``, all ``n`` keys in decode)."""
    out = []
    for b in range(len(kv_start)):
        n = q_offset + L - int(kv_start[b])
        if decode:
            out.append([_scaled(budget.decode(n), scale, n)])
            continue
        r0 = int(row_start[b])
        row = []
        for r in range(rows):
            s = (r0 + r) * budget.tile
            row.append(0 if s >= n else _scaled(budget.prefill_tile(s, n), scale, s))
        out.append(row)
    return out


def prefill_counts(budget: Budget, scale: float, *, kv_start: torch.Tensor, q_offset: int, L: int,
                   rows: int) -> torch.Tensor:
    """:func:`row_counts` for prefill, vectorised (the Triton path's per-layer prefix lengths): ``[B, rows]``
    int64 on the host. Rows are the tiles of this call, from each sequence's first tile with a query in it."""
    kv_start = torch.as_tensor(kv_start, dtype=torch.long).cpu()
    T = budget.tile
    n = q_offset + L - kv_start  # [B]
    t_first = (q_offset - kv_start).clamp(min=0) // T
    s = (t_first[:, None] + torch.arange(rows)[None, :]) * T  # [B, R] tile starts (positions)
    kn = torch.minimum(n, torch.floor(n.double() * budget.ratio).long().clamp(min=budget.k_min))  # k(N)
    c = torch.minimum(s, kn[:, None] - T)
    if budget.rolling:
        c = torch.minimum(c, torch.floor(s.double() * budget.ratio).long().clamp(min=budget.k_min))
    c = c.clamp(min=0)
    cnt = torch.minimum(s, torch.floor(c.double() * scale + 0.5).long())
    return torch.where(s < n[:, None], cnt, 0)


def _take(order: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The first ``counts[b, r]`` entries of each ranked row ``order [B, H, R, Kr]``, ascending, -1 padded."""
    K = int(counts.max()) if counts.numel() else 0
    K = min(K, order.shape[-1])
    head = order[..., :K]
    keep = torch.arange(K, device=order.device) < counts[:, None, :, None]
    head = torch.where(keep & (head >= 0), head, _BIG).sort(-1).values
    return torch.where(head == _BIG, -1, head)


def ranked_select(q, k, *, budget: Budget, depth: float = 1.0, own: float = 1.0, scale: float,
                  kv_start: torch.Tensor, q_offset: int, backend: str = "reference") -> RankedSelection:
    """Anchor selection that also keeps its ranking: rows ranked to ``round(depth * c)`` keys, own set the first
    ``round(own * c)`` of them (``c``: the faithful row budget). At ``depth = own = 1`` the own set is
    :func:`kascade.ops.select`'s (up to ties). Pooled probabilities come from the reference on any device
    (``backend`` is accepted for the runtime's uniform call and does not change the result)."""
    B, HQ, L, D = q.shape
    H = k.shape[1]
    md = reference._math_dtype(q.dtype)
    kv_start = torch.as_tensor(kv_start, dtype=torch.long).cpu()
    decode = L == 1
    T = budget.tile
    per_seq, row_start = [], []
    for b in range(B):
        start, n, l = reference._valid_span(kv_start, q_offset, L, b)
        qb, kb = q[b, :, L - l :].to(md), k[b, :, start : start + n].to(md)
        if decode:
            p = reference.pooled_decode(qb, kb, scale)  # [H, n]
            kr = _scaled(budget.decode(n), depth, n)
            rows = [p.topk(kr, dim=-1).indices[:, None, :]]
            t_first = 0
        else:
            t_first = (n - l) // T
            rows = []
            for t0, pooled in reference.iter_pooled_prefill(qb, kb, scale, T):
                c, m = pooled.shape[1], pooled.shape[2]
                s = torch.arange(t0, t0 + c, device=q.device) * T
                cand = pooled.masked_fill(torch.arange(m, device=q.device)[None, :] >= s[:, None], float("-inf"))
                cnt = [_scaled(budget.prefill_tile(int(x), n), depth, int(x)) for x in s]
                K = max(cnt)
                top = cand.topk(K, dim=-1).indices if K else cand.new_zeros(H, c, 0, dtype=torch.long)
                keep = torch.arange(K, device=q.device)[None, :] < torch.tensor(cnt, device=q.device)[:, None]
                rows.append(torch.where(keep[None], top, -1))
        Kr = max(r.shape[-1] for r in rows)
        idx = torch.cat([torch.nn.functional.pad(r, (0, Kr - r.shape[-1]), value=-1) for r in rows], 1)
        per_seq.append(torch.where(idx >= 0, idx + start, -1))
        row_start.append(t_first)
    order = stack_rows(per_seq, q.device)
    R = order.shape[2]
    rs = torch.tensor(row_start, dtype=torch.long, device=q.device)
    counts = torch.tensor(row_counts(budget, own, kv_start=kv_start, q_offset=q_offset, L=L, rows=R, row_start=rs,
                                     decode=decode), dtype=torch.long, device=q.device)
    return RankedSelection(_take(order, counts), rs, T, decode, order=order)


def merge_ranked(cands: torch.Tensor, prio: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Per row of ``cands [..., M]`` (key slots, -1 = none) with priorities ``prio [..., M]`` (lower first), the
    ``counts [...]`` distinct keys of lowest priority (a repeated key counts once, at its best priority):
    ``[..., K]`` ascending, -1 padded."""
    valid = cands >= 0
    idx = torch.where(valid, cands, _BIG)
    pr = torch.where(valid, prio, _BIG)
    o = pr.argsort(dim=-1, stable=True)  # by priority, then (stable) by key: duplicates end up adjacent, best first
    idx, pr = idx.gather(-1, o), pr.gather(-1, o)
    o = idx.argsort(dim=-1, stable=True)
    idx, pr = idx.gather(-1, o), pr.gather(-1, o)
    dup = torch.zeros_like(valid)
    dup[..., 1:] = idx[..., 1:] == idx[..., :-1]
    pr = torch.where(dup | (idx == _BIG), _BIG, pr)
    K = min(int(counts.max()) if counts.numel() else 0, idx.shape[-1])
    val, pos = pr.topk(K, dim=-1, largest=False, sorted=True)
    chosen = idx.gather(-1, pos)
    keep = (torch.arange(K, device=idx.device) < counts[..., None]) & (val != _BIG)
    chosen = torch.where(keep, chosen, _BIG).sort(-1).values
    return torch.where(chosen == _BIG, -1, chosen)


def _forced(budget_rows: torch.Tensor, ends: torch.Tensor, starts: torch.Tensor, sinks: int, recent: float):
    """Sinks + recent window per row: ``[B, R, F]`` key slots (-1 = none) for rows with ``budget_rows [B, R]`` keys
    whose candidates are compact positions ``[0, ends[b, r])``."""
    nf = torch.floor(budget_rows.double() * recent).long().clamp(max=budget_rows)
    ns = nf.clamp(max=sinks)
    F = int(nf.max()) if nf.numel() else 0
    j = torch.arange(F, device=ends.device)
    w = (nf - ns)[..., None]
    pos = torch.where(j < ns[..., None], j, ends[..., None] - w + (j - ns[..., None]))
    ok = (j < nf[..., None]) & (pos >= 0) & (pos < ends[..., None])
    return torch.where(ok, pos + starts[:, None, None], -1)


def reuse_selection(plan, layer: int, selections: dict, *, budget: Budget, kv_start: torch.Tensor, q_offset: int,
                    L: int) -> Selection:
    """Reuse layer ``layer``'s selection under a ranked ``plan``, from the anchors' :class:`RankedSelection` s."""
    pairs_per_head = plan.sources_of(layer)
    for pairs in pairs_per_head:
        for al, _ in pairs:
            got = selections.get(al)
            if not isinstance(got, RankedSelection):
                raise RuntimeError(f"Kascade: reuse layer {layer} found no ranking from anchor {al}")
    ref = selections[pairs_per_head[0][0][0]]
    B, _, R, _ = ref.order.shape
    dev = ref.order.device
    kv_start = torch.as_tensor(kv_start, dtype=torch.long).cpu()
    counts = torch.tensor(row_counts(budget, plan.scale_of(layer), kv_start=kv_start, q_offset=q_offset, L=L,
                                     rows=R, row_start=ref.row_start.cpu(), decode=ref.decode),
                          dtype=torch.long, device=dev)  # [B, R]
    forced = None
    if plan.recent > 0:
        n = q_offset + L - kv_start
        if ref.decode:
            ends = n[:, None]
        else:
            ends = (ref.row_start.cpu()[:, None] + torch.arange(R)[None, :]) * budget.tile
            ends = torch.minimum(ends, n[:, None])
        forced = _forced(counts.cpu(), ends, kv_start, plan.sinks, plan.recent).to(dev)  # [B, R, F]
    heads = []
    for pairs in pairs_per_head:
        orders = [selections[al].order[:, ah] for al, ah in pairs]  # each [B, R, Kr]
        if forced is None and len(orders) == 1:
            heads.append(_take(orders[0][:, None], counts)[:, 0])
            continue
        cand, prio = [], []
        if forced is not None:
            cand.append(forced)
            prio.append(torch.zeros_like(forced))
        for i, o in enumerate(orders):
            rank = torch.arange(o.shape[-1], device=dev).expand_as(o)
            cand.append(o)
            prio.append(1 + rank * len(orders) + i)  # interleave the sources rank by rank
        heads.append(merge_ranked(torch.cat(cand, -1), torch.cat(prio, -1), counts))
    K = max(h.shape[-1] for h in heads)
    idx = torch.stack([torch.nn.functional.pad(h, (0, K - h.shape[-1]), value=-1) for h in heads], 1)
    return Selection(idx, ref.row_start, ref.tile, ref.decode)
