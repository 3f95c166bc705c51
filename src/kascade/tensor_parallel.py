"""Kascade under tensor parallelism (transformers' ``from_pretrained(..., tp_plan="auto")`` under ``torchrun``).

Each rank holds a contiguous slice of the query and KV heads (q / k / v projections sharded by rows): its attention
layers see only those heads, and Kascade runs every layer on them. A plan stays global (one file for any size); a
reuse head follows its anchor head through the global head map, which may name a head of another rank. Two ways to
serve that:

- shard-local plans (:meth:`kascade.KascadePlan.for_tensor_parallel`): every link stays within a rank, nothing is
  exchanged;
- exchange: every anchor's selection (layer 0's included) is all-gathered across the ranks (:func:`gather_heads`), so
  any head map works; each rank receives the other ranks' index tensors, ``(ranks - 1) / ranks`` of the whole
  selection, per anchor and forward step (:func:`exchange_bytes`, :func:`step_exchange_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from . import _renamed
from .budget import Budget
from .ops import Selection

if TYPE_CHECKING:
    from .plan import KascadePlan


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


# -- what the exchange costs ----------------------------------------------------------------------------------------
def bytes_per_index(backend: str) -> int:
    """Bytes of one index in the selections an anchor makes (what :func:`gather_heads` sends): int32 (4) on the
    Triton backend, prefill and decode alike (:attr:`kascade.ops.Step.index_dtype`), int64 (8) on the reference."""
    if backend not in ("reference", "triton"):
        raise ValueError(f"backend must be 'reference' or 'triton', got {backend!r}")
    return 4 if backend == "triton" else 8


@_renamed.keywords(_renamed.RANK_FACTOR, depth="rank_factor")
def selection_shape(budget: Budget, keys: int, queries: int = 1, rank_factor: float | None = None) -> tuple[int, int]:
    """``(rows, width)`` of the index rows one KV head of an anchor sends for a sequence with ``keys`` valid keys
    whose last ``queries`` are this step's queries (from :mod:`kascade.budget`). Decode (``queries == 1``): one row
    of ``decode_counts(keys, rank_factor)`` keys. Prefill: a row per query tile of the call, every row padded to the
    widest (the last tile's count under the rolling budget): the tensor is rectangular, so the exchange sends
    ``rows x width`` entries, not the sum of the rows' counts. ``rank_factor``: the anchor's
    :meth:`kascade.KascadePlan.rank_factor` in a ranked plan (None: 1). For a batch, the selection is as wide and as
    tall as its longest sequence's; for a decode step planned on the device on the Triton backend, ``keys`` is its
    launch bound (:func:`kascade.ops.step.launch_bound` of the cache's slots)."""
    if isinstance(keys, bool) or not isinstance(keys, int) or keys < 1:
        raise ValueError(f"keys must be a positive integer, got {keys!r}")
    if isinstance(queries, bool) or not isinstance(queries, int) or not 1 <= queries <= keys:
        raise ValueError(f"queries must be an integer in 1..keys={keys}, got {queries!r}")
    factor = 1.0 if rank_factor is None else float(rank_factor)
    if queries == 1:
        return 1, int(budget.decode_counts(keys, factor))
    n = torch.tensor([keys])
    first, rows = budget.tiles(n, queries)
    rows = int(rows[0])
    counts = budget.row_counts(n, first, rows, factor)
    return rows, int(counts.max()) if counts.numel() else 0


def exchange_bytes(ranks: int, *, batch: int, kv_heads: int, rows: int, width: int, index_bytes: int,
                   anchors: int = 1) -> int:
    """Bytes one rank receives in one forward step with ``exchange=True``: for each of ``anchors`` anchor layers
    (layer 0 counts: its selection is gathered too) the other ``ranks - 1`` ranks' selections of their
    ``kv_heads / ranks`` heads, each ``[batch, kv_heads / ranks, rows, width]`` indices of ``index_bytes`` bytes
    (:func:`selection_shape`, :func:`bytes_per_index`). That is ``(ranks - 1) / ranks`` of the whole selection; a rank
    sends its own part to each of the others, ``1 / ranks`` of it per peer. 0 for one rank."""
    for name, v in (("ranks", ranks), ("batch", batch), ("kv_heads", kv_heads), ("index_bytes", index_bytes)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    for name, v in (("rows", rows), ("width", width), ("anchors", anchors)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
    if kv_heads % ranks:
        raise ValueError(f"{kv_heads} KV heads do not split evenly over {ranks} tensor-parallel ranks")
    return anchors * batch * (kv_heads // ranks) * (ranks - 1) * rows * width * index_bytes


def step_exchange_bytes(plan: KascadePlan, ranks: int, *, batch: int, keys: int, queries: int = 1,
                        backend: str = "reference") -> int:
    """:func:`exchange_bytes` of one forward step of ``plan`` (every anchor at its own rank factor; the sub-plan that
    serves ``keys``): ``batch`` sequences of ``keys`` valid keys each, the last ``queries`` of them this step's
    (1: decode), on ``backend``."""
    p = plan.for_length(keys)
    size = bytes_per_index(backend)
    total = 0
    for a in p.anchors:
        rows, width = selection_shape(p.budget, keys, queries, p.rank_factor(a) if p.ranked else None)
        total += exchange_bytes(ranks, batch=batch, kv_heads=p.fingerprint.num_kv_heads, rows=rows, width=width,
                                index_bytes=size)
    return total
