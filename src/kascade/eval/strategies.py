"""Sparse-attention strategies compared by the evaluation harness.

Every strategy is a (plan, selector) pair run by the same :class:`kascade.Attention`: the
plan says which layers choose keys and which reuse them, the selector how keys are chosen (called as
``selector(q, k, scale=..., step=...)`` like :func:`kascade.ops.select`, with the step's budget and geometry). All
of them keep layer 0 dense and attend through the same sparse attention op, so they differ only in *which* keys
they attend.

- dense:               no sparsity.
- oracle:              every layer selects its own top-k (exact pooled probabilities).
- kascade:             the calibrated plan (shipped for the model, or given).
- kascade-faithful:    the paper's method as shipped for the model (the similarity DP's anchors and head map;
                       ``kascade.plan.SHIPPED_VARIANTS``); an error for a model without a shipped faithful plan.
- kascade-no-headmap:  the same anchors, identity head map.
- kascade-shared:      the same anchors, one index set per layer pooled over all heads (the paper's ablation;
                       one budget for every layer).
- streamingllm:        attention sinks (first 4 keys) plus the most recent keys, same count as the budget.
- quest:               query-aware selection of 16-key pages by the upper bound sum_d max(q_d min_d, q_d max_d)
                       of per-page key minima/maxima, pooled over the group (and the tile in prefill), as many
                       whole pages as fit in the token budget; every layer selects.
- omnikv:              one selection layer (``omnikv_layer``, default 2) pooled over all heads; every later layer
                       reuses its indices, layers before it reuse layer 0's.

Kascade with other reuse rules or anchors (:data:`VARIANTS`; same anchor count and budget as ``kascade``, see
:mod:`kascade.calibrate.rules` and :mod:`kascade.reuse`): ``kascade-sinks`` needs only the plan;
``kascade-any-anchor``, ``kascade-union2``, ``kascade-layer-budget`` keep the plan's anchors and need calibration
statistics (``stats``); ``kascade-length`` needs statistics at several lengths; ``kascade-search`` and
``kascade-best`` need a plan made beforehand (``variant_plans``, from ``kascade calibrate --method`` or
``python -m benchmarks.variants``).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import torch
from torch.nn.utils.rnn import pad_sequence

from .. import ops
from ..budget import Budget
from ..calibrate import rules
from ..ops import Step
from ..ops.selection import Selection, sort_padded
from ..plan import KascadePlan, ModelFingerprint, default_plan, shipped_plan

STRATEGIES = ("dense", "oracle", "kascade", "kascade-faithful", "kascade-no-headmap", "kascade-shared",
              "streamingllm", "quest", "omnikv")
VARIANTS = ("kascade-length", "kascade-search", "kascade-layer-budget", "kascade-any-anchor", "kascade-union2",
            "kascade-sinks", "kascade-best")
SINKS = 4
PAGE = 16


def _assemble(per_seq: list[torch.Tensor], row_start: list[int], tile: int, decode: bool, H: int, device) -> Selection:
    """Per-sequence ``[R_b, K_b]`` (same for all heads) or ``[H, R_b, K_b]`` absolute indices -> a Selection."""
    per_seq = [x.unsqueeze(0).expand(H, -1, -1) if x.dim() == 2 else x for x in per_seq]
    R = max(x.shape[1] for x in per_seq)
    K = max(x.shape[2] for x in per_seq)
    idx = torch.full((len(per_seq), H, R, K), -1, dtype=torch.long, device=device)
    for b, x in enumerate(per_seq):
        idx[b, :, : x.shape[1], : x.shape[2]] = x
    return Selection(idx, torch.tensor(row_start, dtype=torch.long, device=device), tile, decode)


def _rows(n: int, L: int, budget: Budget, decode: bool):
    """(first tile, [(cand_end, count)] per row): candidates are compact positions ``[0, cand_end)``."""
    if decode:
        return 0, [(n, budget.decode(n))]
    T = budget.tile
    t_first, t_last = (n - min(L, n)) // T, (n - 1) // T
    return t_first, [(t * T, budget.prefill_tile(t * T, n)) for t in range(t_first, t_last + 1)]


def _sorted_padded(rows: list[torch.Tensor], device) -> torch.Tensor:
    """1-D rows of key slots -> ``[len(rows), K]``, each row ascending, -1 padded."""
    return sort_padded(pad_sequence(rows, batch_first=True, padding_value=-1).to(device))


def streaming_select(q, k, *, step: Step, scale=None, sinks: int = SINKS) -> Selection:
    """StreamingLLM: the first ``sinks`` keys plus the most recent ones, ``count`` keys in all per row."""
    B, _, L, _ = q.shape
    H = k.shape[1]
    budget, kv_start, q_offset = step.budget, step.kv_start, step.q_offset
    per_seq, starts = [], []
    for b in range(B):
        start = int(kv_start[b])
        n = q_offset + L - start
        t_first, rows = _rows(n, L, budget, L == 1)
        chosen = []
        for end, cnt in rows:
            s = min(sinks, cnt)
            recent = torch.arange(max(s, end - (cnt - s)), end)
            chosen.append(torch.cat([torch.arange(s), recent]) + start)
        per_seq.append(_sorted_padded(chosen, q.device))
        starts.append(t_first)
    return _assemble(per_seq, starts, budget.tile, L == 1, H, q.device)


def quest_select(q, k, *, step: Step, scale=None, page: int = PAGE) -> Selection:
    """Quest: whole pages by their query-aware upper bound, as many as fit in the token budget."""
    B, HQ, L, D = q.shape
    H = k.shape[1]
    G = HQ // H
    budget, kv_start, q_offset = step.budget, step.kv_start, step.q_offset
    T = budget.tile
    per_seq, starts = [], []
    for b in range(B):
        start = int(kv_start[b])
        n = q_offset + L - start
        l = min(L, n)
        kb = k[b, :, start : start + n].float()  # [H, n, D]
        P = (n + page - 1) // page
        padded = torch.nn.functional.pad(kb, (0, 0, 0, P * page - n))
        valid = torch.nn.functional.pad(torch.ones(n, dtype=torch.bool, device=k.device), (0, P * page - n))
        big = torch.finfo(torch.float32).max
        kmin = padded.masked_fill(~valid[None, :, None], big).view(H, P, page, D).amin(2)
        kmax = padded.masked_fill(~valid[None, :, None], -big).view(H, P, page, D).amax(2)
        qb = q[b, :, L - l :].float().view(H, G, l, D)
        t_first, rows = _rows(n, L, budget, L == 1)
        chosen = []
        for r, (end, cnt) in enumerate(rows):
            if cnt >= end:  # dense row: everything before
                chosen.append(torch.arange(end, device=q.device).expand(H, -1))
                continue
            if L == 1:
                qt = qb  # [H, G, 1, D]
            else:
                a = max((t_first + r) * T, n - l) - (n - l)
                e = min((t_first + r + 1) * T, n) - (n - l)
                qt = qb[:, :, a:e]
            # sum over the group's heads and queries of sum_d max(q_d min_d, q_d max_d) = q+ . max + q- . min
            qp, qn = qt.clamp(min=0).sum((1, 2)), qt.clamp(max=0).sum((1, 2))  # [H, D]
            score = torch.einsum("hd,hpd->hp", qp, kmax) + torch.einsum("hd,hpd->hp", qn, kmin)  # [H, P]
            pages_before = (end + page - 1) // page  # pages holding candidates (the last may be partial)
            npages = min(cnt // page, pages_before)
            top = score[:, :pages_before].topk(npages, dim=-1).indices  # [H, npages]
            toks = (top[..., None] * page + torch.arange(page, device=q.device)).reshape(H, -1)
            toks = torch.where(toks < end, toks, -1)
            chosen.append(toks)
        K = max(c.shape[1] for c in chosen)
        idx = torch.full((H, len(chosen), K), -1, dtype=torch.long, device=q.device)
        for r, c in enumerate(chosen):
            idx[:, r, : c.shape[1]] = sort_padded(torch.where(c >= 0, c + start, -1))
        per_seq.append(idx)
        starts.append(t_first)
    return _assemble(per_seq, starts, T, L == 1, H, q.device)


def _variant(name, fp, base, b, stats, variant_plans):
    if variant_plans and name in variant_plans:
        return variant_plans[name].with_budget(**b), None
    if name == "kascade-sinks":
        return dataclasses.replace(base.with_reuse(sinks=rules.SINKS, recent=rules.RECENT),
                                   source=base.source + f"; reuse rows: {rules.SINKS} sinks + recent window for "
                                   f"{rules.RECENT:.0%} of the budget"), None
    if name in ("kascade-search", "kascade-best"):
        raise ValueError(f"strategy {name!r} needs a plan made beforehand (variant_plans={{{name!r}: plan}}; see "
                         "`kascade calibrate --method search` or python -m benchmarks.variants)")
    if not stats:
        raise ValueError(f"strategy {name!r} needs calibration statistics (stats: {{length: CalibrationStats}})")
    stats = stats if isinstance(stats, dict) else {stats.seq_len: stats}
    if name == "kascade-length":
        return rules.length_plan(fp, stats, len(base.anchors), budget=b), None
    rule = name.removeprefix("kascade-")
    return rules.plan_for_rule(fp, stats[max(stats)], base.anchors, rule, budget=b), None


def available(model) -> tuple[str, ...]:
    """The :data:`STRATEGIES` that can run on ``model`` without extra inputs (kascade-faithful needs a shipped plan)."""
    from ..plan import shipped_plans

    fp = ModelFingerprint.from_model(model)
    has_faithful = any(p.fingerprint == fp for p in shipped_plans("faithful"))
    return tuple(s for s in STRATEGIES if s != "kascade-faithful" or has_faithful)


def make_strategy(name: str, model, plan: KascadePlan | None = None, *, omnikv_layer: int = 2,
                  budget: dict | None = None, stats=None, variant_plans: dict | None = None):
    """``(plan, selector)`` for a strategy name, or ``None`` for dense. ``plan`` is the calibrated plan (default:
    the shipped one for the model); ``budget`` overrides its ratio / k_min / tile / rolling / mass / score_dtype /
    dense_tail for
    every strategy.
    ``stats`` (``{length: CalibrationStats}`` or one) and ``variant_plans`` (``{name: plan}``) serve the
    :data:`VARIANTS`; a variant's selector is None (its plan's ranked reuse selects)."""
    if name not in STRATEGIES + VARIANTS:
        raise ValueError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES + VARIANTS)}")
    if name == "dense":
        return None
    fp = ModelFingerprint.from_model(model)
    base = plan or default_plan(model)
    if budget:
        base = base.with_budget(**budget)
    b = dict(ratio=base.ratio, k_min=base.k_min, tile=base.tile, rolling=base.rolling, mass=base.mass,
             score_dtype=base.score_dtype, dense_tail=base.dense_tail)
    ident = (tuple(range(fp.num_kv_heads)),) * fp.num_layers
    if name in VARIANTS:
        return _variant(name, fp, base, b, stats, variant_plans)
    if name == "oracle":
        return KascadePlan.all_anchors(fp, **b), None
    own = None  # Kascade's own selection (exact pooled top-k; a ranked plan ranks its keys)
    if name == "kascade":
        return base, own
    if name == "kascade-faithful":
        faithful = shipped_plan(model, "faithful")
        return (faithful.with_budget(**budget) if budget else faithful), None
    if name == "kascade-no-headmap":
        return dataclasses.replace(base, head_map=ident, source=base.source + "; identity head map"), own
    if name == "kascade-shared":
        # one selection shared by all KV heads has no per-head ranking: per-layer budgets are dropped
        extra = "; per-layer budgets dropped" if base.reuse.factor is not None else ""
        return dataclasses.replace(base.with_reuse(factor=None), head_map=ident, source=base.source +
                                   "; shared across heads" + extra), partial(ops.select, shared=True)
    if name == "streamingllm":
        return KascadePlan(fp, (0,), ident, source="StreamingLLM: sinks + recent window", **b), streaming_select
    if name == "quest":
        return KascadePlan.all_anchors(fp, **b), quest_select
    if not 0 < omnikv_layer < fp.num_layers:
        raise ValueError(f"omnikv_layer must be in 1..{fp.num_layers - 1}, got {omnikv_layer}")
    return (KascadePlan(fp, (0, omnikv_layer), ident, source=f"OmniKV-style: layer {omnikv_layer} selects", **b),
            partial(ops.select, shared=True))
