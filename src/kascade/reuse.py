"""Reuse: which keys each layer attends, given the selections its plan's anchors made in this forward step.

Every rule of the plan's :class:`~kascade.plan.Reuse` (the value, in :mod:`kascade.plan.reuse_rule`) lives here, each one function with the reference semantics;
:func:`layer_selection` applies them. What comes out is a :class:`~kascade.ops.Selection` the sparse attention op
runs on (reference or Triton), so the rules cost nothing beyond building it:

- **head map** (the paper): KV head ``h`` of a reuse layer takes its anchor's head ``head_map[l][h]``
  (:func:`head_map`; an identity map is none: the anchor's indices as they are). :func:`layer_keys` hands the map
  over unapplied, for the sparse attention op's Triton kernels to read in place (``heads=``: no copy of the
  indices); :func:`layer_selection` applies it (``Selection.take_heads``).
- **per-layer budgets** (``factor``): the anchors rank their keys (descending pooled probability) as deep as the
  largest budget among the layers they serve; a layer attends the first ``round(factor * c)`` keys of its row's
  ranking (:func:`prefix`, ``c`` the row's faithful budget, counted by :meth:`kascade.ops.Step.counts`). The
  result is a *prefix view*: the Triton kernels cut each row themselves, the reference reads it as a set.
- **sources** (any earlier anchor's head, or the union of two) and **sinks + recent** (the first keys and the most
  recent ones take a share of the budget): the rankings are merged rank by rank, skipping keys already taken, so
  the union has exactly the budget (:func:`merged`; materialised, ascending).
"""

from __future__ import annotations

import torch

from . import _renamed
from .budget import at_factor
from .ops.selection import Selection, sort_padded
from .ops.step import Step

from .plan import KascadePlan, Reuse  # noqa: F401  (Reuse: the value these rules read)


_BIG = torch.iinfo(torch.long).max


class Heads:
    """Which KV heads a layer runs and how the stored selections are laid out: all heads (one device), a tensor-
    parallel rank's ``shard`` with selections of its own heads (shard-local plans), or a rank's shard with
    selections gathered from every rank (``gathered``: exchange). Translates a plan's global head numbers."""

    def __init__(self, shard=None, gathered: bool = False):
        self.shard, self.gathered = shard, gathered

    def own(self, total: int) -> range:
        """The global heads this layer computes."""
        return range(total) if self.shard is None else range(self.shard.start, self.shard.start + self.shard.count)

    def stored(self, head: int, layer: int, anchor: int) -> int:
        """Where global head ``head`` of ``anchor``'s selection sits in the stored selection."""
        if self.shard is None or self.gathered:
            return head
        local = self.shard.local(head)
        if local is None:
            raise RuntimeError(f"Kascade: layer {layer} follows head {head} of anchor {anchor}, which another "
                               "tensor-parallel rank holds; use a shard-local plan or exchange=True")
        return local

    def key(self):
        return None if self.shard is None else (self.shard, self.gathered)


ALL_HEADS = Heads()


def _head_map(plan: KascadePlan, layer: int, device: torch.device, heads_key) -> torch.Tensor | None:
    heads = ALL_HEADS if heads_key is None else Heads(*heads_key)
    anchor = plan.anchor_of(layer)
    row = [heads.stored(plan.head_map[layer][h], layer, anchor) for h in heads.own(plan.fingerprint.num_kv_heads)]
    if row == list(range(len(row))) and not heads.gathered:
        return None
    return torch.tensor(row, dtype=torch.long, device=device)  # made on the device: no host constant in a graph


# The head maps made so far, per plan (by identity: hashing a plan hashes every field, a per-layer cost) and then
# per (layer, device, head layout). The entry holds its plan, so an id is never reused while it is there.
_HEAD_MAPS: dict[int, tuple[KascadePlan, dict]] = {}


def head_map(plan: KascadePlan, layer: int, device, heads: Heads = ALL_HEADS) -> torch.Tensor | None:
    """``layer``'s head map as ``[H]`` int64 on ``device``: the stored selection's head each of the layer's KV heads
    reads; None for the identity. Made once per plan, layer, device and head layout."""
    key = (layer, device, heads.key())
    if torch.compiler.is_compiling():  # a constant of the graph
        return _head_map(plan, *key)
    entry = _HEAD_MAPS.get(id(plan))
    if entry is None or entry[0] is not plan:
        if len(_HEAD_MAPS) >= 256:
            _HEAD_MAPS.clear()
        entry = _HEAD_MAPS[id(plan)] = (plan, {})
    memo = entry[1]
    if key not in memo:
        memo[key] = _head_map(plan, *key)
    return memo[key]


@_renamed.keywords(_renamed.FACTOR, scale="factor")
def prefix(sel: Selection, factor: float, step: Step) -> Selection:
    """The first ``at_factor(c, factor, candidates)`` keys of each row of the ranked ``sel``: a prefix view whose
    counts come from the step (memoised per step and factor; device ops only in a graph-captured decode step), or,
    for a selection by attention mass, from each row's kept count (``c = sel.kept``: per head, read back once)."""
    if sel.kept is not None:
        counts = at_factor(sel.kept, factor, step.candidates()[:, None, :]).to(torch.int32)
        return sel.prefix(counts, min(sel.indices.shape[-1], int(counts.max()) if counts.numel() else 0))
    counts, most = step.counts(factor)
    return sel.prefix(counts, min(sel.indices.shape[-1], most))


def layer_selection(plan: KascadePlan, layer: int, selections: dict[int, Selection], step: Step,
                    heads: Heads = ALL_HEADS) -> Selection:
    """The keys ``layer`` attends: an anchor its own selection (``selections[layer]``), a reuse layer by the
    plan's rule from the anchors' selections. For a ranked plan the anchors' selections must be ranked
    (:func:`kascade.ops.select` with ``rank_factor=plan.rank_factor(anchor)``). ``heads``: see :class:`Heads`."""
    sel, hm = layer_keys(plan, layer, selections, step, heads)
    return sel if hm is None else sel.take_heads(hm)


def layer_keys(plan: KascadePlan, layer: int, selections: dict[int, Selection], step: Step,
               heads: Heads = ALL_HEADS) -> tuple[Selection, torch.Tensor | None]:
    """:func:`layer_selection` as ``(selection, head map)``: KV head ``h`` attends the keys of the selection's head
    ``map[h]`` (None: its own head's). A reuse layer of the head-map rule returns its anchor's selection (a prefix
    view for a ranked plan) and its map unapplied, for ``kascade.ops.sparse_attention(..., heads=map)``; every
    other layer and rule a selection of its own heads and None."""
    if plan.is_anchor(layer):
        own = selections[layer]
        if heads.gathered:
            own = own.narrow_heads(heads.shard.start, heads.shard.count)
        return (prefix(own, plan.layer_factor(layer), step) if plan.ranked else own), None
    r = plan.reuse
    if r.sources is None and not r.recent:
        anchor = plan.anchor_of(layer)
        if anchor not in selections:
            raise RuntimeError(f"Kascade: reuse layer {layer} found no selection from anchor {anchor}")
        sel = selections[anchor]
        # a prefix counts keys per sequence (or, by attention mass, per head from each row's own count): it
        # commutes with the head map
        return (prefix(sel, plan.layer_factor(layer), step) if plan.ranked else sel), \
            head_map(plan, layer, sel.indices.device, heads)
    return merged(plan, layer, selections, step, heads), None


# ----------------------------------------------------------------------------------------------------------------
# Sources and sinks + recent: rankings merged rank by rank
# ----------------------------------------------------------------------------------------------------------------
def _take(order: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The first ``counts[b, r]`` entries of each ranked row ``order [B, H, R, Kr]``, ascending, -1 padded."""
    K = int(counts.max()) if counts.numel() else 0
    K = min(K, order.shape[-1])
    keep = torch.arange(K, device=order.device) < counts[:, None, :, None]
    return sort_padded(order[..., :K], keep)


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
    return sort_padded(torch.where(val != _BIG, chosen, -1),
                       torch.arange(K, device=idx.device) < counts[..., None])


def forced_keys(budget_rows: torch.Tensor, ends: torch.Tensor, starts: torch.Tensor, sinks: int, recent: float):
    """Sinks + recent window per row: ``[B, R, F]`` key slots (-1 = none) for rows with ``budget_rows [B, R]`` keys
    whose candidates are compact positions ``[0, ends[b, r])``: the first ``sinks`` keys and the latest ones,
    ``floor(recent * budget)`` keys in all."""
    nf = torch.floor(budget_rows.double() * recent).long().clamp(max=budget_rows)
    ns = nf.clamp(max=sinks)
    F = int(nf.max()) if nf.numel() else 0
    j = torch.arange(F, device=ends.device)
    w = (nf - ns)[..., None]
    pos = torch.where(j < ns[..., None], j, ends[..., None] - w + (j - ns[..., None]))
    ok = (j < nf[..., None]) & (pos >= 0) & (pos < ends[..., None])
    return torch.where(ok, pos + starts[:, None, None], -1)


def merged(plan: KascadePlan, layer: int, selections: dict[int, Selection], step: Step,
           heads: Heads = ALL_HEADS) -> Selection:
    """A reuse layer's set under the ``sources`` and ``sinks`` / ``recent`` rules, from the anchors' ranked
    selections (needs the step's geometry on the host)."""
    every = plan.sources_of(layer)
    pairs_per_head = [tuple((al, heads.stored(ah, layer, al)) for al, ah in every[h])
                      for h in heads.own(plan.fingerprint.num_kv_heads)]
    for pairs in pairs_per_head:
        for al, _ in pairs:
            got = selections.get(al)
            if got is None or not got.ranked:
                raise RuntimeError(f"Kascade: reuse layer {layer} found no ranking from anchor {al}")
    ref = selections[pairs_per_head[0][0][0]]
    B, _, R, _ = ref.indices.shape
    dev = ref.indices.device
    counts = step.counts(plan.layer_factor(layer))[0].long().reshape(B, -1)  # [B, R]
    forced = None
    if plan.reuse.recent > 0:
        n = step.n
        if ref.decode:
            ends = n[:, None]
        else:
            ends = (ref.row_start.cpu()[:, None] + torch.arange(R)[None, :]) * plan.tile
            ends = torch.minimum(ends, n[:, None])
        forced = forced_keys(counts.cpu(), ends, step.kv_start, plan.reuse.sinks, plan.reuse.recent).to(dev)
    heads = []
    for pairs in pairs_per_head:
        orders = [selections[al].indices[:, ah].long() for al, ah in pairs]  # each [B, R, Kr]
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
