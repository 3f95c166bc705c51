"""The reuse rule a plan carries: how its reuse layers build their key sets (the value; :mod:`kascade.reuse` applies
it)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from .. import _renamed


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


@dataclass(frozen=True)
class Reuse:
    """How the reuse layers of a plan build their key sets from the anchors' selections (:mod:`kascade.reuse`).

    The default is the paper's rule: KV head ``h`` of a reuse layer attends the set that head ``head_map[l][h]`` of
    the nearest anchor below chose, at the plan's budget. Each field changes one thing:

    factor:  per layer, a multiplier of the row budget (layer 0, dense, keeps 1.0): the layer attends the first
             ``round(factor * c)`` keys of its source's ranking (``c`` the row's budget). Anchors then rank their
             keys as deep as the largest factor among the layers they serve (:meth:`KascadePlan.rank_factor`). Not
             the softmax scale, which the attention calls take as ``scale``.
    sources: per layer, per KV head, the ``(anchor layer, anchor KV head)`` pairs whose rankings the head reuses
             (one: follow that head, which may belong to any earlier anchor; two: their union, merged rank by
             rank). Anchor layers list themselves. When set it replaces the head map for reuse layers.
    sinks, recent: a reuse row keeps the first ``sinks`` keys plus the most recent keys, ``recent`` of its budget
             in all (sinks included), and fills the rest from its sources' rankings.

    A plan with any field set is *ranked*: its anchors keep their keys in rank order (descending pooled
    probability) instead of as a set.
    """

    factor: tuple[float, ...] | None = None
    sources: tuple | None = None
    sinks: int = 0
    recent: float = 0.0
    scale = _renamed.attribute("factor", _renamed.FACTOR)

    def __post_init__(self):
        if self.factor is not None:
            if isinstance(self.factor, (str, bytes)) or not hasattr(self.factor, "__iter__"):
                raise TypeError(f"reuse factor must be a sequence of numbers, got {self.factor!r}")
            bad = [x for x in self.factor if not _is_number(x)]
            if bad:
                raise TypeError(f"reuse factor must hold numbers, got {bad[0]!r}")
            object.__setattr__(self, "factor", tuple(float(x) for x in self.factor))
            if not all(math.isfinite(x) and x > 0 for x in self.factor):
                raise ValueError(f"reuse factor entries must be finite and > 0, got {list(self.factor)}")
        if self.sources is not None:
            try:
                src = tuple(tuple(tuple(_pair(pair) for pair in head) for head in row)
                            for row in self.sources)
            except TypeError as e:
                raise TypeError(f"reuse sources must be [layer][head][(anchor layer, anchor head), ...]: {e}") from None
            for row in src:
                for head in row:
                    if any(len(p) != 2 for p in head):
                        raise ValueError(f"reuse sources must name (anchor layer, anchor head) pairs, got {head}")
            object.__setattr__(self, "sources", src)
        if not _is_int(self.sinks) or self.sinks < 0:
            raise ValueError(f"reuse sinks must be an integer >= 0, got {self.sinks!r}")
        if not _is_number(self.recent) or not 0.0 <= self.recent <= 1.0:
            raise ValueError(f"reuse recent must be a number in [0, 1], got {self.recent!r}")
        if self.sinks and not self.recent:
            raise ValueError("reuse sinks > 0 needs recent > 0: the sinks are counted inside the recent share of "
                             "the budget")

    @property
    def ranked(self) -> bool:
        """Whether any field departs from the paper's rule (anchors then keep rank order)."""
        return self.factor is not None or self.sources is not None or self.recent > 0

    def to_dict(self) -> dict:
        """The fields that are set, JSON-ready (empty for the paper's rule)."""
        d = {}
        if self.factor is not None:
            d["factor"] = list(self.factor)
        if self.sources is not None:
            d["sources"] = [[[list(p) for p in head] for head in row] for row in self.sources]
        if self.recent:
            d["sinks"], d["recent"] = self.sinks, self.recent
        return d


Reuse.__init__ = _renamed.keywords(_renamed.FACTOR, scale="factor")(Reuse.__init__)


def _pair(pair) -> tuple[int, ...]:
    if isinstance(pair, (str, bytes)) or not hasattr(pair, "__iter__"):
        raise TypeError(f"a source pair must be (anchor layer, anchor head), got {pair!r}")
    pair = tuple(pair)
    if not all(_is_int(x) for x in pair):
        raise TypeError(f"a source pair must hold integers, got {pair!r}")
    return tuple(int(x) for x in pair)
