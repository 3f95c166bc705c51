"""The project's tolerance rule for fast paths (../shared/STYLE.md, after flash-attention's): the error of an output
against an exact (fp64) reference must be at most twice the error of the reference computed in the output's low
precision, plus a small absolute floor for outputs that the low-precision reference happens to get exactly."""

from __future__ import annotations

import torch


def assert_close_to_reference(got: torch.Tensor, exact: torch.Tensor, lowp: torch.Tensor, what: str = "output",
                              floor: float = 1e-6) -> None:
    """``got`` (fast path, low precision) vs ``exact`` (fp64 reference) given ``lowp`` (the reference in the low
    precision); also: same dtype as ``lowp``, same shape, no NaN (an output the kernel never wrote, or a stray read)."""
    assert got.dtype == lowp.dtype and got.shape == exact.shape, f"{what}: {got.dtype} {tuple(got.shape)}"
    assert not torch.isnan(got).any(), f"{what}: NaN in the output (unwritten or stray read)"
    err = (got.double() - exact).abs().max().item()
    ref_err = (lowp.double() - exact).abs().max().item()
    assert err <= 2 * ref_err + floor, f"{what}: max error {err:.3g} > 2 x {ref_err:.3g} (low-precision reference)"
