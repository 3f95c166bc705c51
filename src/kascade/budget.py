"""The spec's budget formulas, in one place: every count of keys Kascade keeps is computed here.

Every count is in *keys*. ``N`` (``n``) is the number of valid keys a sequence has in this call (prompt length in
prefill, cache length in decode); ``s`` is the absolute position of a tile's first query, which is also the number
of keys strictly before the tile. The rules take Python ints or integer tensors (host or device, broadcasting),
with the same float64 arithmetic either way, so the host, the reference ops and the device metadata of a
CUDA-graph decode step all count the same keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import _renamed

# How an anchor's scoring passes may compute the scores they rank keys by (Budget.score_dtype): None is exact.
SCORE_DTYPES = (None, "fp8", "int8")


def _floor_mul(x, r: float):
    """``floor(r * x)`` in float64, for an int or an integer tensor."""
    if isinstance(x, torch.Tensor):
        return torch.floor(x.double() * r).long()
    return math.floor(r * x)


def _min(a, b):
    if isinstance(a, torch.Tensor):
        return torch.minimum(a, b) if isinstance(b, torch.Tensor) else a.clamp(max=b)
    return b.clamp(max=a) if isinstance(b, torch.Tensor) else min(a, b)


def _max(a, b):
    if isinstance(a, torch.Tensor):
        return torch.maximum(a, b) if isinstance(b, torch.Tensor) else a.clamp(min=b)
    return b.clamp(min=a) if isinstance(b, torch.Tensor) else max(a, b)


def at_factor(count, factor: float, limit):
    """A count at budget multiplier ``factor``: ``min(limit, round(factor * count))`` (halves round up), the keys a
    layer with a per-layer budget keeps of a row whose faithful count is ``count`` and whose candidates number
    ``limit``; at least one key when the row keeps any (a small factor never leaves a query without keys)."""
    if isinstance(count, torch.Tensor):
        c = torch.floor(count.double() * factor + 0.5).long()
        return _min(torch.maximum(c, count.clamp(max=1)), limit)
    return _min(limit, max(math.floor(factor * count + 0.5), min(count, 1)))


@dataclass(frozen=True)
class Budget:
    """How many keys Kascade keeps.

    ratio:   fraction of the context kept (``0 <= ratio <= 1``; 0: a fixed top-k of ``k_min`` keys).
    k_min:   floor on the number of keys kept (``>= 1``).
    tile:    prefill query tile ``T`` (``>= 1``).
    rolling: in prefill, let the budget grow with the causal prefix (the authors' default).
    mass:    ``None`` (a row keeps its count, above) or a share ``0 < mass <= 1`` of attention: a row then keeps the
             fewest of its best keys that hold ``mass`` of its pooled probability, at least its count at ratio 0
             (the ``k_min`` floor) and at most its count (``ratio`` becomes the cap); see :func:`mass_counts`.
    score_dtype: how the anchors' scoring passes compute the scores they rank keys by: ``None`` (in the inputs'
             dtype, exact), ``"fp8"`` (e4m3 with a power-of-two scale per query and key vector,
             :mod:`kascade.ops.fp8`) or ``"int8"`` (8-bit integers with a scale per vector, :mod:`kascade.ops.int8`).
             The keys a layer attends are attended exactly either way.
    dense_tail: in a pass of more than one query (a prefill, or a chunk of one), its last ``dense_tail`` queries
             attend every valid key in every layer (``>= 0``; 0: none). A prompt ends with the question and the
             chat template's turn marks; attended densely they cost one tile's dense attention per layer. Decode
             steps (one query) are unchanged. Applied by :class:`kascade.Attention`, not by the selection ops.
    """

    ratio: float = 0.10
    k_min: int = 128
    tile: int = 32
    rolling: bool = True
    mass: float | None = None
    score_dtype: str | None = None
    dense_tail: int = 0

    def __post_init__(self):
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) or not (0.0 <= self.ratio <= 1.0):
            raise ValueError(f"ratio must be a number in [0, 1] (0: always k_min keys), got {self.ratio!r}")
        if isinstance(self.k_min, bool) or not isinstance(self.k_min, int) or self.k_min < 1:
            raise ValueError(f"k_min must be an integer >= 1, got {self.k_min!r}")
        if isinstance(self.tile, bool) or not isinstance(self.tile, int) or self.tile < 1:
            raise ValueError(f"tile must be an integer >= 1, got {self.tile!r}")
        if not isinstance(self.rolling, bool):
            raise ValueError(f"rolling must be True or False, got {self.rolling!r}")
        if self.mass is not None and (isinstance(self.mass, bool) or not isinstance(self.mass, (int, float))
                                      or not 0.0 < self.mass <= 1.0):
            raise ValueError(f"mass must be None (keep each row's count) or a share of attention in (0, 1], "
                             f"got {self.mass!r}")
        if self.score_dtype not in SCORE_DTYPES:
            raise ValueError(f"score_dtype must be None (score in the inputs' dtype), 'fp8' (e4m3 scoring) or "
                             f"'int8' (8-bit integer scoring), got {self.score_dtype!r}")
        if isinstance(self.dense_tail, bool) or not isinstance(self.dense_tail, int) or self.dense_tail < 0:
            raise ValueError(f"dense_tail must be an integer >= 0 (a prefill's last queries attended densely), "
                             f"got {self.dense_tail!r}")

    @property
    def floor(self) -> "Budget":
        """The same budget at ratio 0 and by count: its counts are the least a row keeps by mass."""
        return Budget(ratio=0.0, k_min=self.k_min, tile=self.tile, rolling=self.rolling, score_dtype=self.score_dtype)

    def k(self, n):
        """``k(N) = min(N, max(k_min, floor(ratio * N)))``: keys kept for a context of ``n`` keys."""
        return _min(n, _max(_floor_mul(n, self.ratio), self.k_min))

    def decode(self, n):
        """Keys a decode query selects among all ``n`` keys: ``k(N)``.

        The authors' release selects ``k(N) - T`` here; the spec allows either and we keep the full ``k(N)``.
        """
        return self.k(n)

    def prefill_tile(self, s, n):
        """Keys a prefill tile starting at position ``s`` selects among its ``s`` earlier keys.

        Non-rolling: ``min(s, k(N) - T)``; rolling: ``min(s, k(N) - T, max(k_min, floor(ratio * s)))``.
        The tile's own keys are attended on top of these.
        """
        b = _min(s, self.k(n) - self.tile)
        if self.rolling:
            b = _min(b, _max(_floor_mul(s, self.ratio), self.k_min))
        return _max(b, 0)

    # -- the rows of one call ------------------------------------------------------------------------------------
    def tiles(self, n, queries: int):
        """``(first tile, tiles)`` of a prefill call whose ``queries`` queries are the last of a sequence's ``n``
        keys (ints, or ``[B]`` tensors): the tiles holding a query of this call, from the first."""
        first = (n - _min(n, queries)) // self.tile
        return first, (n - 1) // self.tile - first + 1

    @_renamed.keywords(_renamed.FACTOR, scale="factor")
    def row_counts(self, n, first_tile, rows: int, factor: float = 1.0) -> torch.Tensor:
        """Keys each prefill row of a call keeps, ``[B, rows]`` int64: row ``r`` of sequence ``b`` is tile
        ``first_tile[b] + r`` (``n``, ``first_tile``: ``[B]`` integer tensors), keeping
        ``at_factor(prefill_tile(s, n), factor, s)`` keys, 0 for rows past the sequence's last tile."""
        s = (first_tile[:, None] + torch.arange(rows, device=first_tile.device)[None, :]) * self.tile
        c = at_factor(self.prefill_tile(s, n[:, None]), factor, s)
        return torch.where(s < n[:, None], c, 0)

    @_renamed.keywords(_renamed.FACTOR, scale="factor")
    def decode_counts(self, n, factor: float = 1.0):
        """Keys a decode query keeps at budget multiplier ``factor``: ``at_factor(decode(n), factor, n)``."""
        return at_factor(self.decode(n), factor, n)


def mass_counts(ranked, total, own, mass: float, lo, hi):
    """Keys a row keeps by attention mass: the fewest of its candidates, taken best first, whose pooled probability
    plus ``own`` (what the row attends anyway: its own tile in prefill) reaches ``mass * total``, clamped to
    ``[lo, hi]`` (the row's count at ratio 0 and at the budget's ratio; ``lo <= hi``).

    ``ranked [..., m]``: each row's candidate probabilities in descending order (padding: 0); ``total``, ``own``,
    ``lo``, ``hi``: ``[...]`` (or scalars). Sums in float64, so that a hand-computed share is met exactly.
    Returns ``[...]`` int64.
    """
    need = mass * total.double() - (own.double() if isinstance(own, torch.Tensor) else own)
    before = ranked.double().cumsum(-1) - ranked.double()  # mass of the keys ranked above each one
    c = (before < need[..., None]).sum(-1)  # keys needed: every one the mass before it has not reached ``need``
    return _min(_max(c, lo), hi)


__getattr__ = _renamed.module_getattr(__name__, _renamed.FACTOR, scaled="at_factor")
