"""Kascade under tensor parallelism (transformers' ``from_pretrained(..., tp_plan="auto")`` under ``torchrun``).

Each rank holds a contiguous slice of the query and KV heads (q / k / v projections sharded by rows): its attention
layers see only those heads, and Kascade runs every layer on them. A plan stays global (one file for any size); a
reuse head follows its anchor head through the global head map, which may name a head of another rank. Two ways to
serve that:

- shard-local plans (:meth:`kascade.KascadePlan.for_tensor_parallel`): every link stays within a rank, nothing is
  exchanged;
- exchange: every anchor's selection is all-gathered across the ranks (:func:`gather_heads`), so any head map works,
  at the cost of ``B x H x rows x k`` indices (4 bytes each) per anchor and step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .ops import Selection


@dataclass(frozen=True)
class HeadShard:
    """The KV heads one tensor-parallel rank holds: global heads ``start .. start + count - 1`` of ``total``."""

    start: int
    count: int
    total: int
    size: int  # ranks
    rank: int  # this rank's position among them
    group: object = field(default=None, compare=False, repr=False)  # torch.distributed process group

    def local(self, head: int) -> int | None:
        """The local index of global KV head ``head``, or None when another rank holds it."""
        return head - self.start if self.start <= head < self.start + self.count else None


def head_shard(modules, num_kv_heads: int, head_dim: int) -> HeadShard | None:
    """The slice of KV heads these attention modules hold, read from their sharded key projection (a DTensor
    sharded by rows over a device mesh), or None for a model that is not tensor-parallel. ValueError for a
    tensor-parallel layout Kascade cannot read."""
    try:
        from torch.distributed.tensor import DTensor, Shard
    except ImportError:  # a torch without DTensor: no tensor parallelism
        return None
    weights = [getattr(getattr(m, "k_proj", None), "weight", None) for m in modules]
    sharded = [w for w in weights if isinstance(w, DTensor)]
    if not sharded:
        if any(isinstance(p, DTensor) for m in modules for p in m.parameters()):
            raise ValueError("this tensor-parallel model shards its attention in a way Kascade cannot read (it needs "
                             "separate q / k / v projections sharded by rows, as in transformers' tp_plan='auto' for "
                             "Llama-style models)")
        return None
    if len(sharded) != len(weights):
        raise ValueError("some of this model's attention layers are tensor-parallel and some are not")
    w = sharded[0]
    dims = [i for i, p in enumerate(w.placements) if isinstance(p, Shard) and p.dim == 0]
    if len(dims) != 1 or any(not isinstance(p, Shard) and not p.is_replicate() for p in w.placements):
        raise ValueError(f"the key projection is placed as {w.placements}; Kascade needs it sharded by rows over one "
                         "mesh dimension")
    mesh, dim = w.device_mesh, dims[0]
    size, rank = mesh.size(dim), mesh.get_coordinate()[dim]
    rows = w.to_local().shape[0]
    if rows * size != w.shape[0] or rows % head_dim or num_kv_heads % size:
        raise ValueError(f"{num_kv_heads} KV heads do not split evenly over {size} tensor-parallel ranks "
                         f"({rows} of {w.shape[0]} key-projection rows here)")
    count = rows // head_dim
    return HeadShard(start=rank * count, count=count, total=num_kv_heads, size=size, rank=rank,
                     group=mesh.get_group(dim))


def gather_heads(sel: Selection, shard: HeadShard) -> Selection:
    """Every rank's heads of a selection made on the local heads, in global head order (an all-gather over the
    tensor-parallel group; every rank runs the same inputs, so the rows and widths agree)."""
    import torch.distributed as dist

    idx = sel.indices.contiguous()
    parts = [torch.empty_like(idx) for _ in range(shard.size)]
    dist.all_gather(parts, idx, group=shard.group)
    return Selection(torch.cat(parts, 1), sel.row_start, sel.tile, sel.decode, sel.ranked, sel.counts)


def exchange_bytes(batch: int, num_kv_heads: int, rows: int, keys: int, anchors: int, index_bytes: int = 4) -> int:
    """Bytes each rank receives per forward step with exchange: every anchor's selection of the other ranks' heads
    (``batch x heads x rows x keys`` indices; the local part is not sent). Divide by the ranks' count for what one
    rank contributes."""
    return batch * num_kv_heads * rows * keys * index_bytes * anchors
