"""The spec written as directly as possible: full probability matrices and an explicit boolean mask per query.

Slow and memory-hungry on purpose; only for small shapes in tests. Same argument conventions as kascade.ops.
"""

from __future__ import annotations

import torch

from kascade.budget import Budget


def _compact(q, k, v, kv_start, q_offset, b):
    L = q.shape[2]
    start = int(kv_start[b])
    n = q_offset + L - start
    l = min(L, n)
    return q[b, :, L - l :].double(), k[b, :, start : start + n].double(), v[b, :, start : start + n].double(), start, n, l


def full_probs(qb, kb, scale):
    """``[HQ, l, n]`` causal softmax probabilities, queries at positions n-l..n-1."""
    HQ, l, _ = qb.shape
    H, n, _ = kb.shape
    krep = kb.repeat_interleave(HQ // H, dim=0)
    s = qb @ krep.transpose(-1, -2) * scale
    pos = torch.arange(n - l, n)[:, None]
    s = s.masked_fill(torch.arange(n)[None, :] > pos, float("-inf"))
    return s.softmax(-1)


def masks(q, k, *, budget: Budget, scale, kv_start, q_offset):
    """Per sequence, the boolean mask ``[HQ, l, n]`` of keys each query attends to under Kascade's anchor rule,
    and the per-KV-head selected sets ``{(h, row): set(compact key positions)}``."""
    B, HQ, L, _ = q.shape
    H = k.shape[1]
    G = HQ // H
    T = budget.tile
    out = []
    for b in range(B):
        qb, kb, _, start, n, l = _compact(q, k, k, kv_start, q_offset, b)
        P = full_probs(qb, kb, scale)
        M = torch.zeros(HQ, l, n, dtype=torch.bool)
        sets = {}
        for h in range(H):
            ph = P[h * G : (h + 1) * G].sum(0)  # [l, n], pooled over the group
            if L == 1:
                order = torch.argsort(ph[0], descending=True)
                sel = set(order[: budget.decode(n)].tolist())
                sets[(h, 0)] = sel
                M[h * G : (h + 1) * G, 0, sorted(sel)] = True
                continue
            for i in range(l):
                p = n - l + i
                t = p // T
                s = t * T
                if (h, t) not in sets:
                    rows = [j for j in range(l) if (n - l + j) // T == t]
                    pooled = ph[rows].sum(0)[:s]
                    order = torch.argsort(pooled, descending=True)
                    sets[(h, t)] = set(order[: budget.prefill_tile(s, n)].tolist())
                allowed = sets[(h, t)] | set(range(s, p + 1))
                M[h * G : (h + 1) * G, i, sorted(allowed)] = True
        out.append((M, sets, start, n, l))
    return out


def masked_attention(q, k, v, mask_list, *, scale, kv_start, q_offset):
    """Dense attention restricted by per-sequence masks ``[HQ, l, n]``; zeros at padding queries."""
    B, HQ, L, D = q.shape
    H = k.shape[1]
    out = torch.zeros(B, HQ, L, D, dtype=torch.float64)
    for b in range(B):
        qb, kb, vb, start, n, l = _compact(q, k, v, kv_start, q_offset, b)
        krep = kb.repeat_interleave(HQ // H, 0)
        vrep = vb.repeat_interleave(HQ // H, 0)
        s = (qb @ krep.transpose(-1, -2) * scale).masked_fill(~mask_list[b], float("-inf"))
        out[b, :, L - l :] = s.softmax(-1) @ vrep
    return out


def causal_masks(q, k, *, kv_start, q_offset):
    L = q.shape[2]
    res = []
    for b in range(q.shape[0]):
        start = int(kv_start[b])
        n = q_offset + L - start
        l = min(L, n)
        res.append((torch.arange(n)[None, :] <= torch.arange(n - l, n)[:, None]).expand(q.shape[1], l, n))
    return res
