"""The index sets an anchor layer hands to the reuse layers after it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_BIG = torch.iinfo(torch.long).max


def sort_padded(idx: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """The entries of each row of ``idx [..., K]`` that are ``>= 0`` (and ``keep``, broadcastable to it), ascending,
    padded with -1 at the end."""
    ok = idx >= 0 if keep is None else keep & (idx >= 0)
    out = torch.where(ok, idx.long(), _BIG).sort(-1).values
    return torch.where(out == _BIG, -1, out).to(idx.dtype)


@dataclass(frozen=True)
class Selection:
    """Top-k key indices chosen by an anchor layer, one row per (sequence, KV head, query tile or decode query).

    indices:   ``[B, H, R, K]`` int64 or int32 key slots (absolute, i.e. into the ``N`` axis of the KV cache), padded
               with -1 at the end of each row; ascending, or in rank order (descending pooled probability) when
               ``ranked``. In prefill row ``r`` of sequence ``b`` is tile ``row_start[b] + r``, counted in positions
               from the sequence's first valid key; in decode there is one row, for the single new query.
    row_start: ``[B]`` int64, the tile number of row 0 (zeros in decode).
    tile:      the tile size ``T`` the rows were made with.
    decode:    whether this is a decode step (one query per sequence, no own tile).
    ranked:    rows in rank order (an anchor of a plan whose layers keep different numbers of keys).
    counts:    a *prefix view* of a ranked selection: only the first ``counts`` entries of a row are its keys;
               ``[B]`` (decode) or ``[B, R]`` (prefill) int32 on the indices' device, ``[B, H, R]`` where each head's
               rows differ (a selection by attention mass), or None (the whole row).
    kept:      a selection by attention mass (:attr:`kascade.budget.Budget.mass`): ``[B, H, R]`` int64, the keys
               each row keeps at factor 1 (a ranked row may hold more: the reuse layers' prefixes scale this);
               None for a selection by count, whose rows' counts follow from the geometry alone.

    Attention does not depend on the order of a row's keys: the reference ops read a ranked or prefix selection
    through :meth:`as_set`, the Triton kernels read it as it is.
    """

    indices: torch.Tensor
    row_start: torch.Tensor
    tile: int
    decode: bool
    ranked: bool = False
    counts: torch.Tensor | None = None
    kept: torch.Tensor | None = None

    def take_heads(self, head_map: torch.Tensor) -> "Selection":
        """The selection as seen by a reuse layer whose KV head ``h`` takes this selection's head ``head_map[h]``
        (``[H]`` int64 on the indices' device)."""
        def heads(x):
            return x.index_select(1, head_map) if x is not None and x.dim() == 3 else x

        return Selection(self.indices.index_select(1, head_map), self.row_start, self.tile, self.decode,
                         self.ranked, heads(self.counts), heads(self.kept))

    def narrow_heads(self, start: int, count: int) -> "Selection":
        """Heads ``start .. start + count - 1`` (a view: no copy)."""
        def heads(x):
            return x.narrow(1, start, count) if x is not None and x.dim() == 3 else x

        return Selection(self.indices.narrow(1, start, count), self.row_start, self.tile, self.decode, self.ranked,
                         heads(self.counts), heads(self.kept))

    def prefix(self, counts: torch.Tensor, width: int) -> "Selection":
        """The first ``counts`` entries of each row of this ranked selection (``[B]``, ``[B, R]`` or ``[B, H, R]``),
        stored in the first ``width`` columns (``width >= counts.max()``; no data is copied)."""
        assert self.ranked, "only a ranked selection has meaningful prefixes"
        return Selection(self.indices[..., :width], self.row_start, self.tile, self.decode, True, counts, self.kept)

    def _row_mask(self, width: int) -> torch.Tensor | None:
        """``[B, 1 or H, R, width]`` (``R`` = 1 in decode): entries inside the prefix."""
        if self.counts is None:
            return None
        rows = self.counts[:, None] if self.counts.dim() == 1 else self.counts  # [B, R] or [B, H, R]
        rows = rows if rows.dim() == 3 else rows[:, None]
        return torch.arange(width, device=self.indices.device) < rows[..., None]

    def as_set(self) -> "Selection":
        """The keys of every row, ascending and -1 padded (a ranked selection or prefix view made a plain one)."""
        if not self.ranked and self.counts is None:
            return self
        return Selection(sort_padded(self.indices, self._row_mask(self.indices.shape[-1])), self.row_start,
                         self.tile, self.decode)

    def attended_counts(self) -> torch.Tensor:
        """Number of selected keys per (sequence, head, row): ``[B, H, R]``."""
        ok = self.indices >= 0
        mask = self._row_mask(self.indices.shape[-1])
        return (ok if mask is None else ok & mask).sum(-1)


def stack_rows(per_seq: list[torch.Tensor], device) -> torch.Tensor:
    """Per-sequence ``[H, R_b, K_b]`` index tensors -> one ``[B, H, max R, max K]`` tensor, -1 padded."""
    R = max(x.shape[1] for x in per_seq)
    K = max(x.shape[2] for x in per_seq)
    out = torch.full((len(per_seq), per_seq[0].shape[0], R, K), -1, dtype=torch.long, device=device)
    for b, x in enumerate(per_seq):
        out[b, :, : x.shape[1], : x.shape[2]] = x
    return out
