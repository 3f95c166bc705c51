"""INT8 scoring: how an anchor ranks keys when its budget says ``score_dtype="int8"``.

Like FP8 scoring (:mod:`kascade.ops.fp8`) only the anchors' ranking passes change; the keys a layer attends are
attended exactly. Each query vector and each key vector (one head, one position: ``D`` values) becomes 8-bit
integers with its own scale, and a score is the integer dot product times both scales::

    scale(x) = max|x| / 127                       (fp32, correctly rounded; a zero vector: 1)
    x8       = clamp(rint(x / scale), -127, 127)  (fp32 division, round half to even)
    s(q, k)  = (q8 . k8) * scale(q) * scale(k) * softmax_scale

The integer dot is exact (int32; in fp32 too while ``D * 127**2 < 2**24``, ``D <= 1040``). Where e4m3 keeps 3
mantissa bits of every element, 8-bit integers keep a vector's largest elements to 7 bits and lose its smallest:
what that changes in the selection, against FP8 scoring's, is measured by ``python -m benchmarks.fp8_selection``
(the manual's concepts page). Hopper's tensor cores multiply int8 at the FP8 rate.
"""

from __future__ import annotations

import torch


def scales(x: torch.Tensor) -> torch.Tensor:
    """Each vector's scale: ``x [..., D]`` -> ``[...]`` fp32, ``max|x| / 127`` (1 for a zero vector)."""
    m = x.abs().amax(-1).float()
    return torch.where(m > 0, m / 127.0, torch.ones_like(m))


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., D]`` -> ``(x8 [..., D] int8, scale [...] fp32)`` (see the module docstring)."""
    s = scales(x)
    return (x.float() / s[..., None]).round().clamp(-127, 127).to(torch.int8), s


def dequantize(x8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values INT8 scoring computes with, ``x8 * scale``, formed in fp64 (exact) and given in ``dtype``."""
    return (x8.to(torch.float64) * scale.to(torch.float64)[..., None]).to(dtype)


def rounded(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x`` as INT8 scoring sees it (:func:`quantize` then :func:`dequantize`), in ``dtype`` (default: fp32, or
    fp64 for fp64 inputs). ``rounded(q) . rounded(k)`` is INT8 scoring's score up to the rounding of the products
    and sums in ``dtype``."""
    x8, s = quantize(x)
    return dequantize(x8, s, dtype or (torch.float64 if x.dtype == torch.float64 else torch.float32))
