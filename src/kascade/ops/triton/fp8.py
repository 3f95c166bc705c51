"""FP8 scoring's quantisation on the device (:mod:`kascade.ops.fp8` defines it; this rounds to the same bits).

:func:`quantize` writes each ``D``-vector of ``x [..., D]`` as e4m3 with its power-of-two scale in one pass (read
``x``, write one byte per element and a float per vector), where :func:`kascade.ops.fp8.quantize`'s torch ops
would take several passes and an fp32 copy of ``x``. The rounding to e4m3's grid is done on the fp32 bits (round
to nearest even) and the already-rounded value is converted, so that Triton's interpreter, whose conversion to
fp8 rounds differently, gives the same bits as the GPU and as torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fp8 import E4M3
from .common import interpreting


# Whether FP8 scoring's dots may use the FP8 tensor cores (see fp8_mma); a switch for the benchmark to compare.
FP8_TENSOR_CORES = True


def fp8_mma(device: torch.device, D: int) -> bool:
    """Whether the kernels' FP8 dots run on FP8 tensor cores (sm_89 and later, at least 32 along D) rather than on
    bf16 ones (the same products: e4m3 values are bf16 values)."""
    return (FP8_TENSOR_CORES and not interpreting() and device.type == "cuda" and D >= 32
            and torch.cuda.get_device_capability(device) >= (8, 9))


@triton.jit
def fp8_operand(x, NATIVE: tl.constexpr):
    """An e4m3 (or int8: INT8 scoring, :mod:`kascade.ops.triton.int8`) tile as a dot operand: as it is where the
    tensor cores take it (:func:`fp8_mma`, ``int8_mma``), else widened to bf16 (exact: every e4m3 value is a bf16
    value), int8 to fp16 (exact up to 2048; the interpreter converts integers to bf16 wrongly); the products are
    exact either way."""
    if NATIVE:
        return x
    elif x.dtype == tl.int8:
        return x.to(tl.float16)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def _e4m3_grid(y):
    """``y`` (fp32, ``|y| < 256``) rounded to the nearest e4m3 value (ties to even), still in fp32."""
    bits = y.to(tl.int32, bitcast=True)
    # normal range (|y| >= 2**-6): keep 3 of the 23 mantissa bits, round to nearest even on the dropped 20
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    # subnormals: multiples of 2**-9 (adding 1.5 * 2**23 rounds to an integer, ties to even), of |y|, then y's
    # sign bit put back (a negative value rounding to zero is -0, as torch's conversion gives)
    a = tl.abs(y)
    sub = ((a * 512.0 + 12582912.0) - 12582912.0) * 0.001953125
    sub = (sub.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)
    return tl.where(a < 0.015625, sub, normal)


@triton.jit
def _quantize_kernel(X, X8, Scale, rows, stride_r, D: tl.constexpr, DP: tl.constexpr, BLOCK_R: tl.constexpr):
    """One program = BLOCK_R vectors (rows of ``x`` viewed as ``[rows, D]``, row stride ``stride_r``)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, DP)
    rm = r < rows
    m = rm[:, None] & (d < D)[None, :]
    x = tl.load(X + r.to(tl.int64)[:, None] * stride_r + d[None, :], mask=m, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), 1)
    # max|x| = f * 2**E (0.5 <= f < 1): for a normal float E = biased exponent - 126; scale 2**(E - 8)
    be = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    e = tl.where(amax > 0, be - 126, 0)  # a zero vector: E = 0 (torch.frexp(0)), subnormal maxima: not supported
    scale = ((e - 8 + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((127 - (e - 8)) << 23).to(tl.float32, bitcast=True)
    y = _e4m3_grid(x * inv[:, None])
    tl.store(X8 + r.to(tl.int64)[:, None] * D + d[None, :], y.to(tl.float8e4nv), mask=m)
    tl.store(Scale + r, scale, mask=rm)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kascade.ops.fp8.quantize` in one kernel: ``x [..., D]`` (last dim contiguous, the others viewable as
    rows) -> ``(x8 [..., D] float8_e4m3fn contiguous, scale [...] fp32)``."""
    return launch_quantize(_quantize_kernel, x, E4M3)


def launch_quantize(kernel, x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch of a one-pass quantisation ``kernel`` (this module's, or INT8 scoring's) over the ``D``-vectors of
    ``x [..., D]`` (last dim contiguous, the others viewable as rows): ``(x8 [..., D] dtype contiguous, scale [...]
    fp32)``. The kernels take ``(X, X8, Scale, rows, stride_r, D, DP, BLOCK_R)``."""
    D = x.shape[-1]
    assert x.stride(-1) == 1
    lead = x.shape[:-1]
    flat = x.reshape(-1, D)  # a view for the layouts the ops take (a copy otherwise)
    rows = flat.shape[0]
    x8 = torch.empty(lead + (D,), dtype=dtype, device=x.device)
    s = torch.empty(lead, dtype=torch.float32, device=x.device)
    if rows:
        block_r = max(1, min(64, 4096 // D))
        kernel[(triton.cdiv(rows, block_r),)](flat, x8, s, rows, flat.stride(0), D=D, DP=triton.next_power_of_2(D),
                                              BLOCK_R=block_r, num_warps=4)
    return x8, s
