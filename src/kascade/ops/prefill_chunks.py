"""The prefill selection's scratch: which sequences share an LSE pass, and the chunks of rows it scores at once.

Host arithmetic on plain integers, no Triton: :func:`kascade.ops.triton.prefill.select_prefill` calls it, the CPU
tests check it without a kernel (``tests/ops/test_prefill_chunks.py``).

A selection row is one tile of queries of one sequence and one KV head; row ``r`` of sequence ``b`` is its tile
``first_tiles[b] + r`` and keeps ``budgets[b][r]`` keys (0 past the sequence's ``rows[b]`` tiles). The selection
scores a chunk of rows ``[r0, r1)`` -- for every sequence and KV head at once -- into an fp32 buffer ``[B, H, r1 - r0,
width]`` whose rows hold the pooled probabilities of every key before the chunk's last tile, then finds each row's top
keys in it. A chunk's scratch is that buffer plus the top-k's temporaries, sized by the chunk's largest budget ``kc``.
The chunks are the largest runs of rows, from the first, whose scratch fits the bound.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

# The share of the scratch bound kept for PyTorch's caching allocator: it hands out a cached block up to 1 MiB larger
# than asked for whole, and torch.cuda.max_memory_allocated counts the whole block; three allocations of a selection
# may be that large (the LSE, a chunk's score buffer and its histograms): 3 MiB of the default 64 MiB. With 1/64 an
# H200 measured 64.5 MB at the default model's 32K shapes, over the bound.
ALLOCATOR_RESERVE = 3 / 64

# Bytes of per-row metadata (first slot, buffer width, count, 0: int32) that a selection writing its rows in place
# ("direct") makes for every row of the group once.
META_BYTES = 16


class Chunk(NamedTuple):
    """Rows ``[r0, r1)`` of every sequence, scored into a buffer of ``width`` keys a row, ``kc`` slots of top keys (the
    largest budget of its rows)."""

    r0: int
    r1: int
    width: int
    kc: int


def lse_group(batch: int, q_heads: int, queries: int, max_chunk_bytes: int) -> int:
    """Sequences whose LSE (``4 * q_heads * queries`` bytes each) a selection makes at once: as many as fit in a
    quarter of the scratch bound (a Llama-8B sequence of 128K tokens takes 16 MB, the quarter of the default 64 MB), at
    least one."""
    return max(1, min(batch, (max_chunk_bytes // 4) // (4 * q_heads * queries)))


def is_direct(method: str, ranked: bool) -> bool:
    """Whether the selection writes each chunk's slots straight into its indices (the radix select of unsorted
    ascending rows, with per-row metadata made once) rather than through temporaries and a write-back."""
    return method == "radix" and not ranked


def chunk_scratch(max_chunk_bytes: int, fixed: int) -> int:
    """Bytes a chunk's buffer and top-k temporaries may take: the bound less the allocator's reserve and ``fixed``
    (what the group holds for all its chunks: its LSE when made for it, the per-row metadata), and at least a quarter
    of the bound (a single sequence whose LSE takes more than 3/4 of it exceeds the bound by what it takes beyond)."""
    return max(max_chunk_bytes - int(max_chunk_bytes * ALLOCATOR_RESERVE) - fixed, max_chunk_bytes // 4)


def row_bytes(width: int, kc: int, *, method: str, ranked: bool, hist_bins: int, keys_per_program: int) -> int:
    """Scratch of one buffer row of ``width`` keys and its top-k temporaries for ``kc`` keys. ``hist_bins``: the
    radix select's histogram counters a row (:data:`kascade.ops.triton.topk.NHIST`), ``keys_per_program``: its keys
    a program (:data:`kascade.ops.triton.topk.TOPK_LAUNCH`'s)."""
    if method == "radix":  # histograms, per-program counts, the bin-search state; ranked rows also the int64 result,
        # its values and order (32 bytes a key) and the write-back (top >= 0, top + start, the where: 17)
        return (4 * width + 4 * hist_bins + 8 * -(-width // keys_per_program) + 32
                + (0 if is_direct(method, ranked) else 49 * kc))
    assert method == "topk", method
    return 4 * width + 40 * kc  # torch.topk: values, indices, a sorted copy


def plan_chunks(*, heads: int, tile: int, first_tiles: Sequence[int], rows: Sequence[int],
                budgets: Sequence[Sequence[int]], max_chunk_bytes: int, fixed: int, method: str, ranked: bool,
                hist_bins: int, keys_per_program: int) -> list[Chunk]:
    """The chunks of a group of sequences' rows, in order, covering rows ``[0, max(rows))`` without gap or overlap.

    ``heads``: KV heads; ``tile``: queries a tile; per sequence ``b``: ``first_tiles[b]`` (its first row's tile),
    ``rows[b]`` (its rows) and ``budgets[b]`` (keys each row keeps, at least ``rows[b]`` entries, non-decreasing
    along its rows: :meth:`kascade.Budget.prefill_tile` grows with the tile's start); ``max_chunk_bytes``: the
    scratch bound, ``fixed``: bytes of it the group already holds (its LSE when made for it); ``method``: the top-k
    ("radix" or "topk"), ``ranked``: rows in rank order; ``hist_bins``, ``keys_per_program``: as :func:`row_bytes`.

    Each chunk is the longest run of rows from where the last one ended whose ``B * heads * (r1 - r0) *
    row_bytes(width, kc)`` fits :func:`chunk_scratch` (the direct path's :data:`META_BYTES` per row counted in
    ``fixed``); a single row that alone does not fit is a chunk of its own."""
    batch = len(rows)
    R = max(rows, default=0)
    if R == 0:
        return []
    # The largest budget of rows [r0, r1) is that of each sequence's last real row: O(B) per query, where slicing
    # the lists cost O(B * rows) and, with ~2,000 chunks of a B=8, 128K prefill, seconds per anchor on the host.
    assert all(x[r] <= x[r + 1] for x, c in zip(budgets, rows) for r in range(c - 1)), "budgets must not decrease"
    if is_direct(method, ranked):
        fixed += META_BYTES * batch * heads * R
    scratch = chunk_scratch(max_chunk_bytes, fixed)

    def width(r1):  # keys before the last tile of rows [.., r1), rounded up to 4: the chunk's buffer row
        w = max(((t + min(r1, c) - 1) * tile if c > 0 else 0) for t, c in zip(first_tiles, rows))
        return max(4, -(-w // 4) * 4)

    def kmax(r0, r1):
        return max((x[min(r1, c) - 1] if min(r1, c) > r0 else 0) for x, c in zip(budgets, rows))

    def need(r0, r1):
        return batch * heads * (r1 - r0) * row_bytes(width(r1), kmax(r0, r1), method=method, ranked=ranked,
                                                      hist_bins=hist_bins, keys_per_program=keys_per_program)

    chunks = []
    r0 = 0
    while r0 < R:  # binary search of the longest run that fits (need grows with r1: width and kmax do)
        n, lo, hi = 1, 1, R - r0
        while lo <= hi:
            mid = (lo + hi) // 2
            if need(r0, r0 + mid) <= scratch:
                n, lo = mid, mid + 1
            else:
                hi = mid - 1
        chunks.append(Chunk(r0, r0 + n, width(r0 + n), kmax(r0, r0 + n)))
        r0 += n
    return chunks


__all__ = ["ALLOCATOR_RESERVE", "META_BYTES", "Chunk", "chunk_scratch", "is_direct", "lse_group", "plan_chunks",
           "row_bytes"]
