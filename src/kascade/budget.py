"""The spec's budget formulas, in one place.

Every count here is in *keys*. ``N`` is the number of valid keys a sequence has in this call (prompt length in
prefill, cache length in decode); ``s`` is the absolute position of a tile's first query, which is also the
number of keys strictly before the tile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Budget:
    """How many keys Kascade keeps.

    ratio:   fraction of the context kept (``0 < ratio <= 1``).
    k_min:   floor on the number of keys kept (``>= 1``).
    tile:    prefill query tile ``T`` (``>= 1``).
    rolling: in prefill, let the budget grow with the causal prefix (the authors' default).
    """

    ratio: float = 0.10
    k_min: int = 128
    tile: int = 32
    rolling: bool = True

    def __post_init__(self):
        if not isinstance(self.ratio, (int, float)) or not (0.0 < self.ratio <= 1.0):
            raise ValueError(f"ratio must be in (0, 1], got {self.ratio!r}")
        if not isinstance(self.k_min, int) or self.k_min < 1:
            raise ValueError(f"k_min must be an integer >= 1, got {self.k_min!r}")
        if not isinstance(self.tile, int) or self.tile < 1:
            raise ValueError(f"tile must be an integer >= 1, got {self.tile!r}")

    def k(self, n: int) -> int:
        """``k(N) = min(N, max(k_min, floor(ratio * N)))``: keys kept for a context of ``n`` keys."""
        return min(n, max(self.k_min, math.floor(self.ratio * n)))

    def decode(self, n: int) -> int:
        """Keys a decode query selects among all ``n`` keys: ``k(N)``.

        The authors' release selects ``k(N) - T`` here; the spec allows either and we keep the full ``k(N)``.
        """
        return self.k(n)

    def prefill_tile(self, s: int, n: int) -> int:
        """Keys a prefill tile starting at position ``s`` selects among its ``s`` earlier keys.

        Non-rolling: ``min(s, k(N) - T)``; rolling: ``min(s, k(N) - T, max(k_min, floor(ratio * s)))``.
        The tile's own keys are attended on top of these.
        """
        b = min(s, self.k(n) - self.tile)
        if self.rolling:
            b = min(b, max(self.k_min, math.floor(self.ratio * s)))
        return max(b, 0)
