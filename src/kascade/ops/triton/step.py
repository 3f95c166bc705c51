"""A decode step's key geometry and per-sequence metadata, each in one launch (eager decoding on a GPU).

Eager ``generate`` at batch 1 waits for the host, and on a GPU host every small torch op costs 10-25 us. Before
its layers, a decode step read its geometry from the padding mask (each sequence's first valid slot, and whether
every row is left padding) in about 20 small ops, and layer 0 planned the kernels' metadata
(:class:`kascade.ops.step.DecodeMeta`) in about 10 more. These kernels do each in one launch, with the same
results (tested against the torch forms they replace: :func:`kascade.integration.functions._left_padded` and
:func:`kascade.ops.step.decode_meta_static`):

* :func:`mask_geometry`: ``kv_start [B]``, the query's slot and each row's left-padding check from the 2-D
  padding mask;
* :func:`meta_tensor`: ``[B, 4]`` int32 ``(first valid slot, valid keys n_b, budget k(n_b), 0)``, the budget
  ``k(n) = min(n, max(k_min, floor(ratio * n)))`` in float64 as :meth:`kascade.budget.Budget.k` computes it;
* :func:`counts_tensor`: a plan with per-layer budgets keeps ``at_factor(k(n_b), factor, n_b)`` keys per sequence
  in a layer of budget multiplier ``factor`` (:meth:`kascade.ops.step.DecodeMeta.counts` and ``with_counts``): about
  18 torch ops per factor and step before, one launch here.

Not while ``torch.compile`` traces (its graphs take the torch forms) and not in the interpreter's absence of a GPU:
the callers decide (:func:`usable`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import interpreting, next_power_of_2
from .launch import config, launch

_BLOCK = 1024  # mask slots a program reads at a time


@triton.jit
def _mask_kernel(M, Qp, Out, W, stride_b, q_given, kv_offset, HAS_Q: tl.constexpr, B: tl.constexpr,
                 BLOCK: tl.constexpr):
    # One program a sequence. Out (int64): [0, B) first valid slot (argmax of the row: 0 if it has none),
    # [B, 2B) whether the row is padding then tokens through slot q with a token at q (slots at or past W count as
    # tokens), [2B] the query's slot q. Within [0, min(q, W - 1)] the row is left padding iff its valid slots there
    # are exactly those from its first valid one.
    # (a scalar argument equal to 1 arrives as a constant, without .to: hence the additions to int64 zeros)
    b = tl.program_id(0)
    if HAS_Q:
        q = tl.load(Qp).to(tl.int64) - kv_offset
    else:
        q = tl.zeros((), dtype=tl.int64) + q_given
    first = tl.zeros((), dtype=tl.int64) + W
    ones = tl.zeros((), dtype=tl.int64)
    at_q = tl.zeros((), dtype=tl.int64)
    for j0 in range(0, W, BLOCK):
        j = j0 + tl.arange(0, BLOCK).to(tl.int64)
        v = tl.load(M + b * stride_b + j, mask=j < W, other=0) != 0
        first = tl.minimum(first, tl.min(tl.where(v, j, W), 0))
        ones += tl.sum((v & (j <= q)).to(tl.int64), 0)
        at_q += tl.sum((v & (j == q)).to(tl.int64), 0)
    last = tl.minimum(q, W - 1)
    ok = (ones == last + 1 - first) & ((at_q > 0) | (q >= W)) & (q >= 0)
    tl.store(Out + b, tl.where(first < W, first, 0))
    tl.store(Out + B + b, ok.to(tl.int64))
    if b == 0:
        tl.store(Out + 2 * B, q)


@triton.jit
def _budget_k(n, Ratio, k_min):
    # k(n) = min(n, max(k_min, floor(ratio * n))) of int64 n, in float64 as kascade.budget.Budget.k computes it
    return tl.minimum(n, tl.maximum(tl.floor(n.to(tl.float64) * tl.load(Ratio)).to(tl.int64), k_min))


@triton.jit
def _meta_kernel(Start, Qp, Ratio, Out, k_min, HAS_START: tl.constexpr, B: tl.constexpr, BP: tl.constexpr):
    i = tl.arange(0, BP)
    inside = i < B
    if HAS_START:
        start = tl.load(Start + i, mask=inside, other=0).to(tl.int64)
    else:
        start = tl.zeros((BP,), dtype=tl.int64)
    n = tl.load(Qp).to(tl.int64) + 1 - start
    k = _budget_k(n, Ratio, k_min)
    row = Out + 4 * i
    tl.store(row, start.to(tl.int32), mask=inside)
    tl.store(row + 1, n.to(tl.int32), mask=inside)
    tl.store(row + 2, k.to(tl.int32), mask=inside)
    tl.store(row + 3, tl.zeros((BP,), dtype=tl.int32), mask=inside)


@triton.jit
def _counts_kernel(Meta, Ratio, Factor, Out, k_min, ROWS: tl.constexpr, B: tl.constexpr, BP: tl.constexpr):
    # at_factor(k(n), factor, n) = min(n, max(floor(factor * k + 0.5), min(k, 1))), in float64 as kascade.budget
    # computes it. ROWS: Out is Meta's [B, 4] with column 2 replaced; else [B].
    i = tl.arange(0, BP)
    inside = i < B
    n = tl.load(Meta + 4 * i + 1, mask=inside, other=0).to(tl.int64)
    k = _budget_k(n, Ratio, k_min)
    c = tl.floor(k.to(tl.float64) * tl.load(Factor) + 0.5).to(tl.int64)
    c = tl.minimum(tl.maximum(c, tl.minimum(k, 1)), n)
    if ROWS:
        row = Out + 4 * i
        tl.store(row, tl.load(Meta + 4 * i, mask=inside, other=0), mask=inside)
        tl.store(row + 1, n.to(tl.int32), mask=inside)
        tl.store(row + 2, c.to(tl.int32), mask=inside)
        tl.store(row + 3, tl.load(Meta + 4 * i + 3, mask=inside, other=0), mask=inside)
    else:
        tl.store(Out + i, c.to(tl.int32), mask=inside)


def usable(device: torch.device) -> bool:
    """Whether these kernels serve a step on ``device`` eagerly: a CUDA device (or the interpreter, for tests), and
    not while ``torch.compile`` traces."""
    return (device.type == "cuda" or interpreting()) and not torch.compiler.is_compiling()


def mask_geometry(mask: torch.Tensor, q_offset, kv_offset: int = 0):
    """From ``mask [B, W]`` (0 / non-zero, any integer or bool dtype; its slot ``j`` is key slot ``kv_offset + j``)
    and the query's key slot ``q_offset`` (an int, or a one-element integer tensor on the mask's device):
    ``(kv_start [B] int64, q [] int64, ok [B] int64)``, all on the device, one launch: each sequence's first valid
    slot (0 if none), the query's slot in the mask (``q_offset - kv_offset``) and whether the row is left padding up to
    it with a token there (:func:`kascade.integration.functions._left_padded`, per row)."""
    B, W = mask.shape
    if mask.stride(1) != 1:
        mask = mask.contiguous()
    out = torch.empty(2 * B + 1, dtype=torch.long, device=mask.device)
    has_q = isinstance(q_offset, torch.Tensor)
    tensors = (mask, q_offset if has_q else out, out)
    launch(_mask_kernel, (B,), tensors, (W, mask.stride(0), 0 if has_q else int(q_offset) - int(kv_offset),
                                         int(kv_offset) if has_q else 0),
           config(HAS_Q=has_q, B=B, BLOCK=min(_BLOCK, max(16, next_power_of_2(W)))))
    return out[:B], out[2 * B], out[B : 2 * B]


_FLOAT64: dict = {}  # (value, device) -> the value as a float64 tensor on the device (Triton passes floats as fp32)


def _float64(x: float, device) -> torch.Tensor:
    """``x`` as a float64 tensor on ``device``, made once (a kernel's exact float argument)."""
    key = (float(x), device)
    r = _FLOAT64.get(key)
    if r is None:
        r = _FLOAT64[key] = torch.tensor(float(x), dtype=torch.float64, device=device)
    return r


def meta_tensor(kv_start, q: torch.Tensor, B: int, ratio: float, k_min: int) -> torch.Tensor:
    """``[B, 4]`` int32 on ``q``'s device: ``(kv_start[b], n_b, k(n_b), 0)`` with ``n_b = q + 1 - kv_start[b]`` and
    ``k(n) = min(n, max(k_min, floor(ratio * n)))`` (float64), one launch. ``q``: the query's slot, a one-element
    integer tensor; ``kv_start``: ``[B]`` integer tensor on that device, or None (zeros)."""
    dev = q.device
    out = torch.empty(B, 4, dtype=torch.int32, device=dev)
    has_start = kv_start is not None
    launch(_meta_kernel, (1,), (kv_start if has_start else out, q, _float64(ratio, dev), out), (int(k_min),),
           config(HAS_START=has_start, B=B, BP=max(2, next_power_of_2(B))))
    return out


def counts_tensor(meta: torch.Tensor, ratio: float, k_min: int, factor: float, *, rows: bool = False) -> torch.Tensor:
    """The keys each sequence keeps at budget multiplier ``factor``, ``at_factor(k(n_b), factor, n_b)``
    (:func:`kascade.budget.at_factor`, float64), from a decode step's ``meta [B, 4]`` int32 (its ``n_b`` column), one
    launch: ``[B]`` int32, or with ``rows`` the ``[B, 4]`` metadata with its budget column replaced by them."""
    B = meta.shape[0]
    dev = meta.device
    assert meta.dtype == torch.int32 and meta.shape == (B, 4) and meta.is_contiguous()
    out = torch.empty((B, 4) if rows else (B,), dtype=torch.int32, device=dev)
    launch(_counts_kernel, (1,), (meta, _float64(ratio, dev), _float64(factor, dev), out), (int(k_min),),
           config(ROWS=rows, B=B, BP=max(2, next_power_of_2(B))))
    return out
