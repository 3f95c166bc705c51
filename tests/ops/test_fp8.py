"""FP8 scoring's quantisation (kascade.ops.fp8), by hand."""

import pytest
import torch

from kascade.budget import Budget
from kascade.ops import fp8


def test_scale_is_the_power_of_two_that_puts_the_largest_element_in_128_256():
    x = torch.tensor([[1.0, -3.0, 0.5], [0.0, 0.0, 0.0], [256.0, 1.0, 0.0]])
    x8, s = fp8.quantize(x)
    # max 3 = 0.75 * 2**2 -> scale 2**-6; a zero vector -> 2**-8; max 256 = 0.5 * 2**9 -> scale 2**1
    assert s.tolist() == [2.0**-6, 2.0**-8, 2.0]
    assert x8.float().tolist() == [[64.0, -192.0, 32.0], [0.0, 0.0, 0.0], [128.0, 0.5, 0.0]]
    assert x8.dtype == torch.float8_e4m3fn


def test_rounding_is_to_nearest_even_on_e4m3s_grid():
    # max 200 -> 0.78125 * 2**8 -> scale 2**0: the values are rounded on e4m3's grid as they are.
    # 200 (between 192 and 208, spacing 16 in [128, 256)) -> 192 or 208: 200 is the midpoint -> even mantissa 192;
    # 9.5 (spacing 1 in [8, 16)): midpoint of 9 and 10 -> 10 (even); 1.0625 (spacing 0.125 in [1, 2)) -> 1.0
    # (midpoint of 1.0 and 1.125 -> even); 2**-8 (e4m3 subnormal spacing 2**-9) is exact.
    x = torch.tensor([[200.0, 9.5, 1.0625, 2.0**-8]])
    x8, s = fp8.quantize(x)
    assert s.tolist() == [1.0]
    assert x8.float().tolist() == [[192.0, 10.0, 1.0, 2.0**-8]]


def test_rounded_keeps_three_mantissa_bits_and_the_dtype():
    torch.manual_seed(0)
    x = torch.randn(5, 9, 64, dtype=torch.float64) * torch.logspace(-4, 4, 9, dtype=torch.float64)[None, :, None]
    r = fp8.rounded(x)
    assert r.dtype == torch.float64
    big = x.abs() >= x.abs().amax(-1, keepdim=True) * 2.0**-13  # normal range: relative error <= 2**-4
    assert ((r - x).abs() <= x.abs() * 2.0**-4)[big].all()
    assert ((r - x).abs() > 0).any()  # it does round
    assert torch.equal(fp8.rounded(r), r)  # idempotent


def test_budget_names_the_score_dtype():
    assert Budget(score_dtype="fp8").floor.score_dtype == "fp8"
    with pytest.raises(ValueError, match="score_dtype"):
        Budget(score_dtype="bf16")
