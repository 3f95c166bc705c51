"""Triton kernels of Kascade. Importing this package imports Triton; ``kascade`` and ``kascade.ops`` never do.

``common`` (numerics helpers shared by the kernels), ``decode`` (split-K decode: dense, sparse, scoring), ``prefill``
(flash forward with LSE, tile-pooled scoring, tile-gather sparse attention) and ``topk`` (the selections: decode's
radix select, prefill's per-tile top-k). Kernels and their launchers only; :mod:`kascade.ops` validates and
dispatches.
"""

from . import common, decode, prefill, topk

__all__ = ["common", "decode", "prefill", "topk"]
