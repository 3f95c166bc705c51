import itertools

import pytest
import torch

from kascade.calibrate.dp import choose_anchors, objective


def brute_force_anchors(weights: torch.Tensor, num_anchors: int) -> tuple[tuple[int, ...], float]:
    """Exhaustive search: every anchor set of the given size containing 0."""
    L = weights.shape[0]
    best = max(((0, *rest) for rest in itertools.combinations(range(1, L), num_anchors - 1)),
               key=lambda a: objective(weights, a))
    return best, objective(weights, best)


@pytest.mark.parametrize("L", [2, 3, 5, 7, 10])
def test_dp_equals_brute_force(L):
    for seed in range(4):
        g = torch.Generator().manual_seed(seed * 100 + L)
        w = torch.rand(L, L, generator=g, dtype=torch.float64)
        for A in range(1, L + 1):
            anchors, val = choose_anchors(w, A)
            bf_anchors, bf_val = brute_force_anchors(w, A)
            assert len(anchors) == A and anchors[0] == 0 and list(anchors) == sorted(set(anchors))
            assert val == pytest.approx(bf_val, abs=1e-12)
            assert objective(w, anchors) == pytest.approx(val, abs=1e-12)


def test_dp_picks_the_obvious_anchor():
    """Layers 0-4 agree with each other, 5-9 with each other, not across: the second anchor must be 5."""
    L = 10
    w = torch.full((L, L), 0.1, dtype=torch.float64)
    w[:5, :5] = 1.0
    w[5:, 5:] = 1.0
    anchors, val = choose_anchors(w, 2)
    assert anchors == (0, 5) and val == pytest.approx(10.0)


def test_dp_rejects_bad_budgets():
    w = torch.rand(4, 4)
    with pytest.raises(ValueError, match="1..4"):
        choose_anchors(w, 5)
    with pytest.raises(ValueError, match="1..4"):
        choose_anchors(w, 0)
