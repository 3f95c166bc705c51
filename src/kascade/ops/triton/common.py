"""What the Triton kernels share: numerics helpers (``@triton.jit``), the interpreter switch, the SM count."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for the launchers: ``triton.cdiv`` is a constexpr function whose host call costs microseconds
    (Triton 3.9: ~4 us on a CPU of 2 cores), and a decode layer's launch configuration takes several."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` as a plain function (0 for 0), for the same reason as :func:`cdiv`."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


# Triton decides when it decorates a kernel (at this package's import) whether the interpreter runs it.
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreting() -> bool:
    """Whether the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` when they were imported: CPU tensors,
    for tests)."""
    return _INTERPRETING


_SM_COUNT: dict = {}


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter: a few programs are enough to exercise the split-K paths
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SM_COUNT:
        _SM_COUNT[key] = torch.cuda.get_device_properties(key).multi_processor_count
    return _SM_COUNT[key]


def flags(q: torch.Tensor) -> tuple[bool, bool]:
    """``(F32, RNE)`` for a kernel on ``q``'s dtype: exact fp32 dots (fp32 inputs, or the interpreter, whose
    low-precision dot is not usable), and round-to-nearest-even output conversion (the interpreter truncates)."""
    return interpreting() or q.dtype == torch.float32, interpreting() and q.dtype == torch.bfloat16


@triton.jit
def dot(a, b, F32: tl.constexpr):
    # F32: fp32 inputs (exact ieee dot) or the interpreter, whose bf16 dot is not usable: upcast, products of
    # low-precision operands are exact in fp32 either way.
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def to_out(x, dtype: tl.constexpr, RNE: tl.constexpr):
    # The interpreter converts fp32 to bf16 by truncation, the GPU rounds to nearest even: with RNE set (only
    # under the interpreter) round the bits first so that both give the same output.
    if RNE:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)
