"""The index sets an anchor layer hands to the reuse layers after it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Selection:
    """Top-k key indices chosen by an anchor layer, one set per (sequence, KV head, row).

    indices:   ``[B, H, R, K]`` int64 key slots (absolute, i.e. into the ``N`` axis of the KV cache), ascending,
               padded with -1 at the end. In prefill a row is a query tile: row ``r`` of sequence ``b`` is tile
               ``row_start[b] + r``, counted in positions from the sequence's first valid key. In decode there is
               one row, for the single new query.
    row_start: ``[B]`` int64, the tile number of row 0 (zeros in decode).
    tile:      the tile size ``T`` the rows were made with.
    decode:    whether this is a decode step (one query per sequence, no own tile).
    """

    indices: torch.Tensor
    row_start: torch.Tensor
    tile: int
    decode: bool

    def remap(self, head_map) -> "Selection":
        """The selection as seen by a reuse layer: its KV head ``h`` takes the anchor's head ``head_map[h]``."""
        hm = torch.as_tensor(list(head_map), dtype=torch.long, device=self.indices.device)
        if hm.numel() != self.indices.shape[1]:
            raise ValueError(f"head map has {hm.numel()} entries for {self.indices.shape[1]} KV heads")
        if bool(((hm < 0) | (hm >= self.indices.shape[1])).any()):
            raise ValueError(f"head map {list(head_map)} has heads outside 0..{self.indices.shape[1] - 1}")
        return Selection(self.indices.index_select(1, hm), self.row_start, self.tile, self.decode)

    def shared_across_heads(self) -> "Selection":
        """Every KV head takes head 0's set (used by the non-head-aware baseline after pooling heads)."""
        return self.remap([0] * self.indices.shape[1])

    def attended_counts(self) -> torch.Tensor:
        """Number of selected keys per (sequence, head, row): ``[B, H, R]``."""
        return (self.indices >= 0).sum(-1)
