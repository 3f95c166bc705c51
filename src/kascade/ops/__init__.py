"""Public Kascade attention ops: argument checks, defaults and backend dispatch.

Tensor layout: ``q [B, HQ, L, D]``, ``k, v [B, H, N, D]``, outputs ``[B, HQ, L, D]`` in the input dtype; ``HQ`` a
multiple of ``H`` (``G = HQ / H``); query head ``hq`` reads KV head ``hq // G``.

Which keys a sequence sees: key slots ``[kv_start[b], q_offset + L)`` are valid for sequence ``b`` (left padding
sits before ``kv_start[b]``; slots from ``q_offset + L`` on are unused cache space), and query ``i`` sits at slot
``q_offset + i``. Defaults: ``kv_start = 0`` for all sequences, ``q_offset = N - L`` (the new queries are the last
``L`` keys, as in a dynamic KV cache). Positions, tiles and budgets count from a sequence's first valid key, so
a left-padded sequence is treated exactly as if it ran alone.

A call with ``L == 1`` is a decode step; ``L > 1`` is (chunked) prefill in tiles of ``budget.tile`` queries.

Backends: ``"reference"`` (pure PyTorch, any device: the specification) and ``"triton"`` (CUDA tensors, fp16 /
bf16 / fp32, ``D`` in {16, 32, 64, 128, 256}, ``G <= 16``; decode and prefill kernels in :mod:`kascade.ops.triton`).
Asking for ``"triton"`` where it cannot run is an error, never a silent fallback. With ``TRITON_INTERPRET=1`` the
Triton kernels also run on CPU tensors (slowly: for tests).
"""


from __future__ import annotations

import os

import torch

from ..budget import Budget
from . import reference
from .selection import Selection

__all__ = ["Budget", "Selection", "attended_keys", "dense_attention", "select", "sparse_attention"]

BACKENDS = ("reference", "triton")
TRITON_HEAD_DIMS = (16, 32, 64, 128, 256)
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TRITON_MAX_GROUP = 16


def triton_unavailable_reason(device, dtype=None, head_dim=None, group=None) -> str | None:
    """Why the Triton backend cannot serve these inputs (None if it can)."""
    interpreting = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if torch.device(device).type != "cuda" and not interpreting:
        return f"backend='triton' needs CUDA tensors, got {torch.device(device).type} (use backend='reference')"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "backend='triton' needs triton: pip install 'kascade[triton]'"
    if dtype is not None and dtype not in TRITON_DTYPES:
        return f"backend='triton' supports fp16, bf16 and fp32, got {dtype}"
    if head_dim is not None and head_dim not in TRITON_HEAD_DIMS:
        return f"backend='triton' supports head dims {TRITON_HEAD_DIMS}, got {head_dim}"
    if group is not None and group > TRITON_MAX_GROUP:
        return f"backend='triton' supports GQA groups up to {TRITON_MAX_GROUP} query heads per KV head, got {group}"
    return None


def _triton(q, k):
    why = triton_unavailable_reason(q.device, q.dtype, q.shape[-1], q.shape[1] // k.shape[1])
    if why:
        raise ValueError(why)
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("backend='triton' needs the head dim contiguous (stride 1) in q, k and v")
    from .triton import decode, prefill

    return decode if q.shape[2] == 1 else prefill


def _check(q, k, v, scale, kv_start, q_offset, backend):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x is None and name == "v":
            continue  # selection needs no values
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D ([B, heads, len, D]), got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if v is not None and k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    B, HQ, L, D = q.shape
    Bk, H, N, Dk = k.shape
    if Bk != B or Dk != D:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head dim")
    if H == 0 or HQ % H:
        raise ValueError(f"query heads ({HQ}) must be a multiple of KV heads ({H})")
    if L < 1:
        raise ValueError("q has no queries (L == 0)")
    devs = {x.device for x in (q, k, v) if x is not None}
    if len(devs) > 1:
        raise ValueError(f"q, k, v are on different devices: {sorted(map(str, devs))}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    if q_offset is None:
        q_offset = N - L
    if not (0 <= q_offset <= N - L):
        raise ValueError(f"q_offset={q_offset} puts the {L} queries outside the {N} key slots")
    if kv_start is None:
        kv_start = torch.zeros(B, dtype=torch.long)
    kv_start = torch.as_tensor(kv_start, dtype=torch.long).cpu()
    if kv_start.shape != (B,):
        raise ValueError(f"kv_start must have shape [B]=[{B}], got {tuple(kv_start.shape)}")
    if bool((kv_start < 0).any()) or bool((kv_start > q_offset + L - 1).any()):
        raise ValueError(f"kv_start {kv_start.tolist()} leaves a sequence without keys (valid range 0..{q_offset + L - 1})")
    if scale is None:
        scale = D**-0.5
    return float(scale), kv_start, int(q_offset)


def dense_attention(q, k, v, *, scale=None, kv_start=None, q_offset=None, backend="reference") -> torch.Tensor:
    """Exact causal GQA attention. Returns ``[B, HQ, L, D]``; queries at padding slots get zeros."""
    scale, kv_start, q_offset = _check(q, k, v, scale, kv_start, q_offset, backend)
    if backend == "triton":
        mod = _triton(q, k)
        fn = mod.dense_decode if q.shape[2] == 1 else mod.dense_prefill
        return fn(q, k, v, scale=scale, kv_start=kv_start, q_offset=q_offset)
    return reference.dense_attention(q, k, v, scale=scale, kv_start=kv_start, q_offset=q_offset)


def select(q, k, *, budget: Budget = Budget(), scale=None, kv_start=None, q_offset=None, shared: bool = False,
           backend="reference") -> Selection:
    """Anchor selection: exact post-softmax probabilities pooled per KV head (over the ``G`` heads of the group,
    and over each tile of ``budget.tile`` queries in prefill), then the top-k keys per (sequence, KV head, row)
    with the spec's budget (``kascade.budget.Budget``). Prefill tiles choose among keys strictly before the tile;
    a decode query chooses among all keys. ``shared=True`` pools over all KV heads too and gives every head the
    same set (the non-head-aware baseline; not Kascade's default)."""
    if not isinstance(budget, Budget):
        raise TypeError(f"budget must be a kascade.Budget, got {type(budget).__name__}")
    scale, kv_start, q_offset = _check(q, k, None, scale, kv_start, q_offset, backend)
    if backend == "triton":
        if shared:
            raise ValueError("backend='triton' has no shared-across-heads selection (a baseline): use 'reference'")
        mod = _triton(q, k)
        fn = mod.select_decode if q.shape[2] == 1 else mod.select_prefill
        return fn(q, k, budget=budget, scale=scale, kv_start=kv_start, q_offset=q_offset)
    return reference.select(q, k, budget=budget, scale=scale, kv_start=kv_start, q_offset=q_offset, shared=shared)


def sparse_attention(q, k, v, selection: Selection, *, scale=None, kv_start=None, q_offset=None, backend="reference"):
    """Attention of each query over its row's selected keys (softmax renormalised over them), plus, in prefill,
    causal attention within its own tile. Returns ``[B, HQ, L, D]``."""
    scale, kv_start, q_offset = _check(q, k, v, scale, kv_start, q_offset, backend)
    if not isinstance(selection, Selection):
        raise TypeError(f"selection must be a kascade.ops.Selection, got {type(selection).__name__}")
    B, HQ, L, D = q.shape
    _, H, N, _ = k.shape
    idx = selection.indices
    if idx.dim() != 4 or idx.shape[0] != B or idx.shape[1] != H:
        raise ValueError(f"selection indices must be [B={B}, H={H}, R, K], got {tuple(idx.shape)}")
    if idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"selection indices must be int32 or int64, got {idx.dtype}")
    if selection.decode != (L == 1):
        raise ValueError(f"a {'decode' if selection.decode else 'prefill'} selection cannot serve {L} queries")
    if idx.numel() and (int(idx.max()) >= q_offset + L or int(idx.min()) < -1):
        raise ValueError(f"selection indices must lie in [-1, {q_offset + L}), got [{int(idx.min())}, {int(idx.max())}]")
    if backend == "triton":
        mod = _triton(q, k)
        if L == 1:
            return mod.sparse_decode(q, k, v, selection.indices, scale=scale, kv_start=kv_start)
        return mod.sparse_prefill(q, k, v, selection, scale=scale, kv_start=kv_start, q_offset=q_offset)
    return reference.sparse_attention(q, k, v, selection, scale=scale, kv_start=kv_start, q_offset=q_offset)


def attended_keys(selection: Selection | None, *, kv_start, q_offset: int, L: int, num_kv_heads: int) -> tuple[int, int]:
    """``(attended, dense)``: keys attended by all (sequence, KV head, real query) triples under ``selection``
    (selected keys plus, in prefill, the causal part of the own tile), and what dense attention would attend.
    ``selection=None`` means dense. Counts are per KV head: the G query heads of a group share a set."""
    kv_start = torch.as_tensor(kv_start, dtype=torch.long).cpu()
    att = dense = 0
    for b in range(kv_start.shape[0]):
        n = q_offset + L - int(kv_start[b])
        pos = torch.arange(max(0, n - L), n)  # positions of this sequence's real queries
        d = int((pos + 1).sum()) * num_kv_heads
        dense += d
        if selection is None:
            att += d
            continue
        cnt = (selection.indices[b] >= 0).sum(-1).cpu()  # [H, R]
        if selection.decode:
            att += int(cnt[:, 0].sum())
            continue
        T = selection.tile
        rows = pos // T - int(selection.row_start[b])
        own = pos - (pos // T) * T + 1
        att += int(cnt[:, rows].sum()) + int(own.sum()) * cnt.shape[0]
    return att, dense
