"""The kernel benchmarks' shapes, budgets and random inputs (``[B, H, N, D]`` layout, bf16)."""

from __future__ import annotations

import torch

from kascade.budget import Budget
from kascade.ops.selection import Selection

MODELS = {"llama-3.1-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}  # query heads, KV heads, head dim
DECODE_BUDGET = Budget(ratio=0.1, k_min=128)
PREFILL_BUDGET = Budget(ratio=0.1, k_min=128, tile=32)
DT = torch.bfloat16


def decode_inputs(B, HQ, H, N, D, dev, seed=0):
    """q ``[B, HQ, 1, D]``, k, v ``[B, H, N, D]``, drawn on ``dev``."""
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(B, HQ, 1, D, generator=g, device=dev, dtype=DT)
    k = torch.randn(B, H, N, D, generator=g, device=dev, dtype=DT)
    v = torch.randn(B, H, N, D, generator=g, device=dev, dtype=DT)
    return q, k, v


def prefill_inputs(HQ, H, D, N, seed=0, B=1, device="cuda"):
    """q ``[B, HQ, N, D]``, k, v ``[B, H, N, D]`` (drawn in fp32, then cast)."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, HQ, N, D, device=device, generator=g).to(DT)
    k = torch.randn(B, H, N, D, device=device, generator=g).to(DT)
    v = torch.randn(B, H, N, D, device=device, generator=g).to(DT)
    return q, k, v


def first_keys(sel: Selection) -> Selection:
    """The same number of keys per tile, but the sequence's first ones (no gather): the sparse kernel's own cost."""
    idx = sel.indices
    ar = torch.arange(idx.shape[-1], device=idx.device, dtype=idx.dtype)
    return Selection(indices=torch.where(idx >= 0, ar, -1), row_start=sel.row_start, tile=sel.tile, decode=False)
