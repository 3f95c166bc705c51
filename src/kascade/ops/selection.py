"""The index sets an anchor layer hands to the reuse layers after it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Selection:
    """Top-k key indices chosen by an anchor layer, one set per (sequence, KV head, row).

    indices:   ``[B, H, R, K]`` int64 key slots (absolute, i.e. into the ``N`` axis of the KV cache), ascending,
               padded with -1 at the end. (The Triton runtime path also makes int32 indices, for its own kernels,
               and, for plans with per-layer budgets, *ranked* rows: descending pooled probability instead of
               ascending; attention does not depend on the order, and the Triton sparse kernels need only the -1
               padding at the end.) In prefill a row is a
               query tile: row ``r`` of sequence ``b`` is tile
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
        H = self.indices.shape[1]
        hm = [int(h) for h in head_map]  # checked on the host: no device synchronisation
        if len(hm) != H:
            raise ValueError(f"head map has {len(hm)} entries for {H} KV heads")
        if any(h < 0 or h >= H for h in hm):
            raise ValueError(f"head map {hm} has heads outside 0..{H - 1}")
        return self.take_heads(torch.tensor(hm, dtype=torch.long).to(self.indices.device))

    def take_heads(self, head_map: torch.Tensor) -> "Selection":
        """:meth:`remap` with a checked ``[H]`` int64 tensor on the indices' device (the runtime's hot path)."""
        return Selection(self.indices.index_select(1, head_map), self.row_start, self.tile, self.decode)

    def shared_across_heads(self) -> "Selection":
        """Every KV head takes head 0's set (used by the non-head-aware baseline after pooling heads)."""
        return self.remap([0] * self.indices.shape[1])

    def attended_counts(self) -> torch.Tensor:
        """Number of selected keys per (sequence, head, row): ``[B, H, R]``."""
        return (self.indices >= 0).sum(-1)


def stack_rows(per_seq: list[torch.Tensor], device) -> torch.Tensor:
    """Per-sequence ``[H, R_b, K_b]`` index tensors -> one ``[B, H, max R, max K]`` tensor, -1 padded."""
    R = max(x.shape[1] for x in per_seq)
    K = max(x.shape[2] for x in per_seq)
    out = torch.full((len(per_seq), per_seq[0].shape[0], R, K), -1, dtype=torch.long, device=device)
    for b, x in enumerate(per_seq):
        out[b, :, : x.shape[1], : x.shape[2]] = x
    return out
