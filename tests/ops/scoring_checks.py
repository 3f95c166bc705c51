"""What the low-precision scoring tests (test_fp8_scoring.py, test_int8_scoring.py) share: their inputs and the
equality of two selections."""

import torch


def inputs(B, HQ, H, N, L, D, dtype=torch.float32, seed=0):
    """Standard-normal ``q [B, HQ, L, D]``, ``k``, ``v [B, H, N, D]`` drawn in fp64, in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=torch.float64).to(dtype) for s in ((B, HQ, L, D), (B, H, N, D),
                                                                                 (B, H, N, D))]


def same_selection(a, b):
    """Two selections are equal: kind, tile, indices, row starts and (where either has them) the kept counts."""
    assert a.decode == b.decode and a.ranked == b.ranked and a.tile == b.tile
    assert torch.equal(a.indices, b.indices) and torch.equal(a.row_start, b.row_start)
    if a.kept is not None or b.kept is not None:
        assert torch.equal(a.kept, b.kept)
