"""The prefill selection's chunk planner (kascade.ops.prefill_chunks): host arithmetic, no kernel, no Triton.

Hand-computed cases (the bytes of each case written out in its test), then a seeded property test over random
groups: the chunks tile the rows without gap or overlap, each fits the bound unless it is a single row, each is the
longest that fits, and its width and top-k slots are those of its rows.
"""

import random
import subprocess
import sys

import pytest

from kascade.ops import prefill_chunks as pc
from kascade.ops.prefill_chunks import Chunk


def plan(budgets, *, first_tiles=None, heads=1, tile=4, max_chunk_bytes, fixed=0, method="topk", ranked=False,
         hist_bins=8, keys_per_program=4):
    """Chunks of a group whose sequence ``b`` has rows of budgets ``budgets[b]`` (padded with zeros to the longest,
    as the selection's budget table is); every sequence's first row is tile 0 unless ``first_tiles`` says."""
    rows = [len(x) for x in budgets]
    R = max(rows)
    return pc.plan_chunks(heads=heads, tile=tile, first_tiles=first_tiles or [0] * len(budgets), rows=rows,
                          budgets=[list(x) + [0] * (R - len(x)) for x in budgets], max_chunk_bytes=max_chunk_bytes,
                          fixed=fixed, method=method, ranked=ranked, hist_bins=hist_bins,
                          keys_per_program=keys_per_program)


def test_the_module_imports_without_triton():
    code = "import sys, kascade.ops.prefill_chunks; assert 'triton' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_scratch_arithmetic():
    # 640 bytes: the allocator's reserve int(640 * 3 / 64) = 30, the floor a quarter, 160
    assert pc.chunk_scratch(640, 154) == 640 - 30 - 154 == 456
    assert pc.chunk_scratch(640, 600) == 160
    # torch.topk: 4 bytes a key of the row, 40 a kept key
    assert pc.row_bytes(8, 3, method="topk", ranked=False, hist_bins=8, keys_per_program=4) == 32 + 120
    # radix, direct: the row, 8 histogram bins, 2 programs' counts of 8 bytes, the 32-byte state
    assert pc.row_bytes(8, 3, method="radix", ranked=False, hist_bins=8, keys_per_program=4) == 32 + 32 + 16 + 32
    # radix, ranked: also 49 bytes a kept key (the int64 result, values, order, the write-back)
    assert pc.row_bytes(8, 3, method="radix", ranked=True, hist_bins=8, keys_per_program=4) == 112 + 147
    assert pc.is_direct("radix", False) and not pc.is_direct("radix", True) and not pc.is_direct("topk", False)


def test_lse_group():
    # a Llama-8B sequence of 128K tokens: 32 query heads x 131,072 x 4 bytes = 16 MB, a quarter of 64 MB
    assert pc.lse_group(4, 32, 131072, 64 << 20) == 1
    assert pc.lse_group(4, 32, 65536, 64 << 20) == 2
    assert pc.lse_group(4, 9, 1000, 64 << 20) == 4
    assert pc.lse_group(3, 32, 10**6, 1000) == 1  # at least one sequence, whatever the bound


# One sequence, tile 4, rows of budgets 1, 2, 3, 4 (growing, as the tiles' starts do), torch.topk (4 bytes a key of
# the buffer row, 40 a kept key). Rows [0, r1) are scored over the keys before tile r1 - 1, at least 4: widths 4,
# 4, 8, 12. So from row 0: one row 4*4 + 40*1 = 56 bytes, two 2 * (16 + 80) = 192, three 3 * (32 + 120) = 456, four
# 4 * (48 + 160) = 832. A bound of 640 bytes leaves 640 - 30 - fixed to the chunks.
BUDGETS = [[1, 2, 3, 4]]


def test_a_chunk_ends_where_its_bytes_reach_the_bound_exactly():
    # 456 bytes: rows 0-2 exactly; row 3 alone (208 bytes) then
    assert pc.chunk_scratch(640, 154) == 456
    assert plan(BUDGETS, max_chunk_bytes=640, fixed=154) == [(0, 3, 8, 3), (3, 4, 12, 4)]


def test_one_byte_under_the_bound_moves_the_boundary():
    # 455 bytes: rows 0-1 (192); then rows 2-3: 2 * (48 + 160) = 416
    assert plan(BUDGETS, max_chunk_bytes=640, fixed=155) == [(0, 2, 4, 2), (2, 4, 12, 4)]


def test_a_row_larger_than_the_bound_is_a_chunk_of_its_own():
    # 1 byte for the chunks: no row fits, each is scored alone
    want = [(0, 1, 4, 1), (1, 2, 4, 2), (2, 3, 8, 3), (3, 4, 12, 4)]
    assert plan(BUDGETS, max_chunk_bytes=1) == want
    # 61 bytes (64 - 3): row 0 fits (56), every later row alone exceeds it
    assert plan(BUDGETS, max_chunk_bytes=64) == want


def test_the_whole_group_in_one_chunk():
    assert plan(BUDGETS, max_chunk_bytes=64 << 20) == [Chunk(0, 4, 12, 4)]


def test_a_chunk_is_sized_by_every_sequence_and_head():
    # Two sequences, two KV heads: sequence 1 has one row, tile 2 (keys before it: 8), budget 5; sequence 0 rows of
    # budgets 1, 2, 3 from tile 0. Rows [0, r1): width 8 for every r1; the largest budget 5 while sequence 1's row is
    # in the chunk. From row 0: 2 x 2 x C x (32 + 200) = 928 C bytes; rows [2, 3): 4 x (32 + 120) = 608.
    got = plan([[1, 2, 3], [5]], first_tiles=[0, 2], heads=2, max_chunk_bytes=6400, fixed=4100)  # 2000 bytes
    assert got == [(0, 2, 8, 5), (2, 3, 8, 3)]


def test_ranked_rows_count_their_temporaries_and_direct_rows_their_metadata():
    # radix with 8 histogram bins and 4 keys a program: 4w + 8 * ceil(w / 4) + 64 bytes a row, direct (sorted rows
    # written in place) or + 49 per kept key, ranked. From row 0, direct: 88, 176, 336, 544; ranked: 137, 372, 777.
    # Direct rows also hold 16 bytes of metadata per row of the group (4 rows: 64) for all chunks.
    direct = plan(BUDGETS, method="radix", max_chunk_bytes=640, fixed=146)  # 640 - 30 - 146 - 64 = 400
    ranked = plan(BUDGETS, method="radix", ranked=True, max_chunk_bytes=640, fixed=146)  # 464
    assert direct == [(0, 3, 8, 3), (3, 4, 12, 4)]
    # ranked: rows 2-3 would take 2 * (136 + 196) = 664
    assert ranked == [(0, 2, 4, 2), (2, 3, 8, 3), (3, 4, 12, 4)]


def test_budgets_must_not_decrease_along_a_sequences_rows():
    with pytest.raises(AssertionError, match="must not decrease"):
        plan([[3, 2]], max_chunk_bytes=1 << 20)


def test_no_rows_no_chunks():
    assert plan([[], []], max_chunk_bytes=1 << 20) == []


def _group(rng: random.Random) -> dict:
    B = rng.randint(1, 4)
    R = rng.randint(1, 40)
    rows = [rng.randint(0, R) for _ in range(B)]
    rows[rng.randrange(B)] = R
    budgets = []
    for c in rows:
        x, row = rng.randint(0, 60), []
        for _ in range(c):
            x += rng.choice([0, 0, 1, 7, 50])
            row.append(x)
        budgets.append(row + [0] * (R - c))
    method = rng.choice(["radix", "topk"])
    bound = rng.choice([1, 2000, 30000, 300000, rng.randint(1, 1 << 22)])
    return dict(heads=rng.choice([1, 2, 8]), tile=rng.choice([1, 16, 32, 64]),
                first_tiles=[rng.randint(0, 200) for _ in range(B)], rows=rows, budgets=budgets,
                max_chunk_bytes=bound, fixed=rng.choice([0, rng.randint(0, bound)]), method=method,
                ranked=rng.random() < 0.5, hist_bins=rng.choice([8, 12552]), keys_per_program=rng.choice([4, 2048]))


@pytest.mark.parametrize("seed", range(8))
def test_chunks_tile_the_rows_and_fit_the_bound(seed):
    """Random groups: the chunks cover rows [0, R) in order without gap or overlap; each one's scratch (B x heads x
    its rows x row_bytes) fits chunk_scratch, unless it is a single row; one row more would not fit (the chunks are
    the longest); its width is the keys before its last tile (rounded up to 4, at least 4) and kc its largest
    budget."""
    rng = random.Random(seed)
    for _ in range(200):
        g = _group(rng)
        B, R, T = len(g["rows"]), max(g["rows"]), g["tile"]
        direct = pc.is_direct(g["method"], g["ranked"])
        scratch = pc.chunk_scratch(g["max_chunk_bytes"], g["fixed"] + (16 * B * g["heads"] * R if direct else 0))
        kw = dict(method=g["method"], ranked=g["ranked"], hist_bins=g["hist_bins"],
                  keys_per_program=g["keys_per_program"])

        def width(r1):
            w = max((t + min(r1, c) - 1) * T if c > 0 else 0 for t, c in zip(g["first_tiles"], g["rows"]))
            return max(4, -(-w // 4) * 4)

        def kc(r0, r1):
            return max([x[r] for x, c in zip(g["budgets"], g["rows"]) for r in range(r0, min(r1, c))] or [0])

        def need(r0, r1):
            return B * g["heads"] * (r1 - r0) * pc.row_bytes(width(r1), kc(r0, r1), **kw)

        chunks = pc.plan_chunks(**g)
        assert [c.r0 for c in chunks] == [0] + [c.r1 for c in chunks[:-1]] and chunks[-1].r1 == R, chunks
        for c in chunks:
            assert c.r1 > c.r0
            assert c.width == width(c.r1) and c.kc == kc(c.r0, c.r1), (c, g)
            assert need(c.r0, c.r1) <= scratch or c.r1 - c.r0 == 1, (c, scratch, g)
            if c.r1 < R:
                assert need(c.r0, c.r1 + 1) > scratch, (c, scratch, g)
