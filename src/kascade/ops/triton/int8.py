"""INT8 scoring's quantisation on the device (:mod:`kascade.ops.int8` defines it; this gives the same bits).

:func:`quantize` writes each ``D``-vector of ``x [..., D]`` as 8-bit integers with its scale ``max|x| / 127`` in one
pass. Both divisions are correctly rounded (``div_rn``, as torch's fp32 division) and the quotient is rounded to an
integer, ties to even, by adding and subtracting ``1.5 * 2**23`` (exact for ``|y| <= 2**22``), so the interpreter,
the GPU and torch agree bit for bit.

The scoring kernels take the int8 tiles where they take e4m3 ones (their ``FP8`` switch: quantised operands with a
scale per vector): a dot of two int8 tiles accumulates in int32 (exact) on the tensor cores, or, where those are not
used, the tiles are widened to bf16 (exact: ``|x| <= 127``) and summed in fp32 (exact below ``2**24``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import interpreting
from .fp8 import E4M3, fp8_mma, launch_quantize, quantize as fp8_quantize

# Whether INT8 scoring's dots may use the int8 tensor cores (see int8_mma); a switch for a benchmark to compare.
INT8_TENSOR_CORES = True


def int8_mma(device: torch.device, D: int) -> bool:
    """Whether the kernels' INT8 dots run on int8 tensor cores (sm_80 and later, at least 32 along D) rather than
    on bf16 ones."""
    return (INT8_TENSOR_CORES and not interpreting() and device.type == "cuda" and D >= 32
            and torch.cuda.get_device_capability(device) >= (8, 0))


def quantizer(score_dtype: str):
    """The one-pass quantiser of ``Budget.score_dtype`` "fp8" or "int8": ``x -> (x8, scale)``."""
    return {"fp8": fp8_quantize, "int8": quantize}[score_dtype]


def scoring_mma(dtype: torch.dtype, device: torch.device, D: int) -> bool:
    """The kernels' ``FP8_MMA`` switch for quantised operands of ``dtype`` (e4m3 or int8): dots on the tensor cores
    of that type."""
    assert dtype in (E4M3, torch.int8), dtype
    return fp8_mma(device, D) if dtype == E4M3 else int8_mma(device, D)


@triton.jit
def _quantize_kernel(X, X8, Scale, rows, stride_r, D: tl.constexpr, DP: tl.constexpr, BLOCK_R: tl.constexpr):
    """One program = BLOCK_R vectors (rows of ``x`` viewed as ``[rows, D]``, row stride ``stride_r``)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, DP)
    rm = r < rows
    m = rm[:, None] & (d < D)[None, :]
    x = tl.load(X + r.to(tl.int64)[:, None] * stride_r + d[None, :], mask=m, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), 1)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32)), 1.0)
    y = tl.math.div_rn(x, scale[:, None])
    y = (y + 12582912.0) - 12582912.0  # to the nearest integer, ties to even
    y = tl.minimum(tl.maximum(y, -127.0), 127.0)
    tl.store(X8 + r.to(tl.int64)[:, None] * D + d[None, :], y.to(tl.int8), mask=m)
    tl.store(Scale + r, scale, mask=rm)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kascade.ops.int8.quantize` in one kernel: ``x [..., D]`` (last dim contiguous, the others viewable as
    rows) -> ``(x8 [..., D] int8 contiguous, scale [...] fp32)``."""
    return launch_quantize(_quantize_kernel, x, torch.int8)
