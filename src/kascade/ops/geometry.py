"""The argument checks every attention op makes, on torch tensors and JAX arrays alike (:mod:`kascade.ops`,
:mod:`kascade.jax`): the shapes and dtypes of ``q [B, HQ, L, D]``, ``k, v [B, H, N, D]`` and a given softmax scale.
Each library checks first that its arguments are its arrays of a floating-point dtype."""

from __future__ import annotations

import math
import numbers


def check_shapes(q, k, v=None) -> None:
    """ValueError / TypeError naming what is wrong: 4-D arrays, ``k`` and ``v`` of one shape, one dtype, batch and
    head dim shared, ``HQ`` a multiple of ``H``, and at least one query head, query, key and head-dim entry (``B == 0`` is an
    empty batch: allowed)."""
    arrays = [("q", q), ("k", k)] + ([("v", v)] if v is not None else [])
    for name, x in arrays:
        if len(x.shape) != 4:
            raise ValueError(f"{name} must be 4-D ([B, heads, len, D]), got shape {tuple(x.shape)}")
    if v is not None and tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    check_dtypes(q, k, v)
    B, HQ, L, D = q.shape
    Bk, H, N, Dk = k.shape
    if Bk != B or Dk != D:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head dim")
    if HQ == 0:
        raise ValueError(f"q has no query heads (HQ == 0), got shape {tuple(q.shape)}")
    if H == 0 or HQ % H:
        raise ValueError(f"query heads ({HQ}) must be a multiple of KV heads ({H})")
    if L < 1:
        raise ValueError("q has no queries (L == 0)")
    if N < 1:
        raise ValueError("k has no keys (N == 0)")
    if D < 1:
        raise ValueError("q, k have an empty head dim (D == 0)")


def check_dtypes(q, k, v=None) -> None:
    """TypeError unless ``q``, ``k`` (and ``v``) have one dtype."""
    arrays = [x for x in (q, k, v) if x is not None]
    if any(x.dtype != q.dtype for x in arrays):
        raise TypeError(f"q, k, v must have one dtype, got {', '.join(str(x.dtype) for x in arrays)}")


def check_scale(scale) -> float:
    """A given softmax scale as a float: a finite real number (a one-element array is read as its value)."""
    if hasattr(scale, "shape") and math.prod(scale.shape) == 1 and not _is_complex(scale):
        scale = scale.item()
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite real number, got {scale!r}")
    return float(scale)


def _is_complex(x) -> bool:
    return "complex" in str(x.dtype)
