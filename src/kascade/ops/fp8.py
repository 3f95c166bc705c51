"""FP8 scoring: how an anchor ranks keys when its budget says ``score_dtype="fp8"``.

An anchor's QK passes only *rank* keys (which keys a row keeps); the keys it then attends are attended exactly. With
FP8 scoring each query vector and each key vector (one head, one position: ``D`` values) is quantised to e4m3 with
its own power-of-two scale, and a score is the FP8 dot product times both scales::

    scale(x) = 2 ** (E - 8),  where 2 ** (E - 1) <= max|x| < 2 ** E      (torch.frexp's exponent of max|x|)
    x8       = e4m3(x / scale(x))                                         (round to nearest even; |x / scale| < 256)
    s(q, k)  = (q8 . k8) * scale(q) * scale(k) * softmax_scale            (products exact, sums in fp32)

Everything else (softmax, pooling over the group and the tile, the budget's counts, ties) is unchanged. A
power-of-two scale makes ``x / scale`` exact, so the reference and the kernels quantise to the same bits (the
kernels take tensors quantised by :func:`quantize` or by a kernel that rounds the same way). The largest element
lands in [128, 256): e4m3's 3 mantissa bits whatever the scale, 14 binades of normal range below it (smaller
values, under 2**-14 of the largest, round to e4m3's subnormals or to 0).

Layer 0's one pass (dense output and selection) and every attention output stay exact: only the anchors' scoring
passes (:func:`kascade.ops.select`: prefill's LSE and scoring passes, decode's scoring pass) use FP8.
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn


def scales(x: torch.Tensor) -> torch.Tensor:
    """Each vector's power-of-two scale: ``x [..., D]`` -> ``[...]`` fp32, ``2 ** (E - 8)`` with ``E`` the exponent
    of ``max|x|`` (``max|x| = m * 2**E``, ``0.5 <= m < 1``; a zero vector gets ``2**-8``)."""
    _, e = torch.frexp(x.abs().amax(-1).float())
    return torch.ldexp(torch.ones_like(e, dtype=torch.float32), e - 8)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., D]`` -> ``(x8 [..., D] float8_e4m3fn, scale [...] fp32)`` with ``x8 * scale`` the e4m3 rounding of
    ``x`` (see the module docstring)."""
    s = scales(x)
    return (x.float() / s[..., None]).to(E4M3), s


def dequantize(x8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values FP8 scoring computes with: ``x8 * scale`` (exact in fp32)."""
    return (x8.to(torch.float32) * scale[..., None]).to(dtype)


def rounded(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x`` as FP8 scoring sees it (:func:`quantize` then :func:`dequantize`), in ``dtype`` (default: fp32, or
    fp64 for fp64 inputs). A score of rounded vectors, ``rounded(q) . rounded(k)``, is FP8 scoring's score up to the
    order of the fp32 sums."""
    x8, s = quantize(x)
    return dequantize(x8, s, dtype or (torch.float64 if x.dtype == torch.float64 else torch.float32))
