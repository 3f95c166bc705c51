"""The budget rules against tables worked out by hand (not from the code they check), on ints and on tensors."""

import pytest
import torch

from kascade.budget import Budget, at_factor
from kascade.ops.step import decode_meta, decode_meta_static

B = Budget(ratio=0.1, k_min=128, tile=32, rolling=True)


@pytest.mark.parametrize("n,k", [(1, 1), (100, 100), (128, 128), (1000, 128), (1279, 128), (1289, 128),
                                 (1290, 129), (5000, 500), (5009, 500), (131072, 13107)])
def test_k_of_n(n, k):
    # k(N) = min(N, max(128, floor(0.1 N))): 1289 -> floor(128.9) = 128; 5009 -> floor(500.9) = 500 (not 501)
    assert B.k(n) == k and B.decode(n) == k
    assert B.k(torch.tensor([n])).tolist() == [k]


@pytest.mark.parametrize("s,n,rolling,want", [
    (0, 5000, True, 0),        # the first tile has no earlier keys
    (32, 5000, True, 32),      # min(s=32, k-T=468, max(128, 3)=128)
    (160, 5000, True, 128),    # min(160, 468, 128): the rolling floor k_min
    (1310, 5000, True, 131),   # min(1310, 468, floor(131.0)=131): the rolling term
    (4992, 5000, True, 468),   # min(4992, 468, 499): k(N) - T
    (1280, 5000, False, 468),  # without rolling: min(s, k(N) - T)
    (32, 5000, False, 32),
    (96, 100, True, 68),       # k(100) = 100: min(96, 100 - 32, 128)
    (64, 40, True, 8),         # k(40) = 40: 40 - 32 = 8
    (64, 20, True, 0),         # k(20) - T < 0: no keys
])
def test_prefill_tile(s, n, rolling, want):
    b = Budget(ratio=0.1, k_min=128, tile=32, rolling=rolling)
    assert b.prefill_tile(s, n) == want
    assert b.prefill_tile(torch.tensor([s]), torch.tensor([n])).tolist() == [want]


def test_row_counts_of_a_prefill_call():
    # n = 300: k(300) = 128, k - T = 96; ten tiles at s = 0, 32, ..., 288
    n, first = torch.tensor([300, 70]), torch.tensor([0, 0])
    rows = B.row_counts(n, first, 10)
    assert rows[0].tolist() == [0, 32, 64, 96, 96, 96, 96, 96, 96, 96]
    # n = 70: k(70) = 70, k - T = 38: tiles at 0, 32, 64 -> 0, 32, 38; rows past the last tile keep nothing
    assert rows[1].tolist() == [0, 32, 38, 0, 0, 0, 0, 0, 0, 0]
    # factor 0.5: round(c / 2); factor 1.5: round(1.5 c), capped by the s candidates
    assert B.row_counts(n, first, 10, 0.5)[0].tolist() == [0, 16, 32, 48, 48, 48, 48, 48, 48, 48]
    assert B.row_counts(n, first, 10, 1.5)[0].tolist() == [0, 32, 64, 96, 128, 144, 144, 144, 144, 144]
    # a chunk: the last 100 of 300 tokens are tiles 6..9
    assert B.tiles(300, 100) == (6, 4) and B.tiles(300, 300) == (0, 10) and B.tiles(33, 1) == (1, 1)
    f, c = B.tiles(torch.tensor([300, 150]), 100)
    assert f.tolist() == [6, 1] and c.tolist() == [4, 4]
    assert B.row_counts(torch.tensor([300]), torch.tensor([6]), 4)[0].tolist() == [96, 96, 96, 96]


@pytest.mark.parametrize("count,factor,limit,want", [
    (500, 1.0, 5000, 500), (500, 0.5, 5000, 250), (500, 2.0, 5000, 1000), (100, 1.5, 100, 100),
    (5, 0.5, 100, 3),    # round half up: 2.5 -> 3
    (7, 0.5, 100, 4),    # 3.5 -> 4
    (500, 0.001, 5000, 1),  # a tiny factor still keeps one key
    (0, 2.0, 64, 0),     # a row without a budget stays empty
])
def test_counts_at_a_factor(count, factor, limit, want):
    assert at_factor(count, factor, limit) == want
    assert at_factor(torch.tensor([count]), factor, torch.tensor([limit])).tolist() == [want]


def test_decode_counts_and_the_device_metadata_use_one_rule():
    assert B.decode_counts(5000, 0.5) == 250 and B.decode_counts(100, 1.5) == 100 and B.decode_counts(5000, 1e-4) == 1
    n = torch.tensor([1, 127, 128, 1289, 1290, 5009, 131072])
    assert B.decode(n).tolist() == [B.decode(int(x)) for x in n]
    # a static-cache decode step computes each k_b on the device; the host metadata of the same step agrees
    for q_offset in (200, 1500, 6000):
        starts = torch.tensor([0, 37, 199])
        host = decode_meta(3, device="cpu", kv_start=starts, q_offset=q_offset, budget=B)
        dev = decode_meta_static(3, starts, torch.tensor(q_offset), 8192, B)
        assert torch.equal(dev.tensor, host.tensor)
        assert dev.k_max >= host.k_max  # the launch bound covers every sequence
        for s in (0.5, 1.7):
            assert torch.equal(dev.counts(B, s), host.counts(B, s))


def test_the_budget_multiplier_by_its_former_names_is_a_type_error_naming_factor():
    n = torch.tensor([300])
    with pytest.raises(TypeError, match="'factor', not 'scale'"):
        B.decode_counts(1000, scale=2.0)
    with pytest.raises(TypeError, match="'factor', not 'scale'"):
        B.row_counts(n, torch.tensor([0]), 10, scale=2.0)
    with pytest.raises(TypeError, match="'at_factor', not 'scaled'"):
        from kascade.budget import scaled  # noqa: F401
    assert B.decode_counts(1000, factor=2.0) == 256  # k(1000) = k_min = 128, twice
    assert B.row_counts(n, torch.tensor([0]), 10, factor=1.0).shape == (1, 10)
