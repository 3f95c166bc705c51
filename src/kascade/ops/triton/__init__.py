"""Triton kernels of Kascade. Importing this package imports Triton; ``kascade`` and ``kascade.ops`` never do."""

from .decode import (
    DecodeMeta,
    anchor_decode,
    decode_meta,
    dense_decode,
    dense_select_decode,
    select_decode,
    sparse_decode,
)

__all__ = [
    "DecodeMeta",
    "anchor_decode",
    "decode_meta",
    "dense_decode",
    "dense_select_decode",
    "select_decode",
    "sparse_decode",
]
