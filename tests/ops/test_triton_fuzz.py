"""Seeded fuzz of every Triton kernel launcher against the reference (kascade.ops.reference), on the test device (the
Triton interpreter on the CPU, or CUDA with KASCADE_TEST_DEVICE=cuda: tests/conftest.py).

Case ``i`` of COUNT (200 on the CPU, where they take about 75 s of one core under the interpreter; x TEST_SCALE on a
GPU, with MAX_N too) draws everything from its own seed ``SEED + i`` (reproducible in CI; the id names the shape and
the seed):
one launcher (the ten launchers in turn) and a small, odd geometry: B 1-3, KV heads 1-3, G in 1..16, D in {16, 32,
64, 128} (256 rarely), fp16 / bf16 / fp32, N about 10-200 keys (not a multiple of the tile), tile 8 / 16 / 32, left
padding, unused cache slots after the queries, a budget with a small k_min whose rows really select keys, rolling on
and off, and the launcher's options:

* decode (L = 1): contiguous KV or paged KV (random page sizes, block tables in random page order), the metadata
  built by the launcher, planned on the host or planned on the device (a static cache: launch bounds above the
  lengths), split-K counts, key blocks, radix chunks, radix / torch.topk selection, ranked selections with rank_factor,
  sparse attention over sorted rows, ranked rows, or prefixes of ranked rows (per-sequence ``counts``);
* prefill (L > 1): whole prompts and chunked calls (a cached prefix, q_offset > 0), left-padded batches with
  sequences whose padding covers some of the call's queries, row and key blocks, the LSE given or computed, score
  buffers cut into chunks of one or a few tiles, int32 indices, ranked selections, sparse attention over sorted
  rows, ranked rows, or per-row prefixes (``counts``).

Checks: outputs by the tolerance rule (tests/ops/tolerance.py) against fp64 references of the same low-precision
inputs, zeros at padding queries; selections by kernel_checks (the reference's sets except keys tied within
rounding with the row's k-th pooled probability, counts, ranges, ascending or descending-probability order, -1
padding at the end). Poison: cache slots outside the valid range, padding queries, and the index entries past a
prefix hold NaN (or name NaN slots); outputs (``out=``) and every buffer a launcher allocates start as NaN or junk.
"""

from __future__ import annotations

import collections
import math
import random
from dataclasses import dataclass

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be tested")

from kascade.budget import Budget, at_factor  # noqa: E402
from kascade.ops import reference  # noqa: E402
from kascade.ops.selection import Selection  # noqa: E402
from kascade.ops.step import decode_meta, decode_meta_static  # noqa: E402
from kascade.ops.triton import decode as td  # noqa: E402
from kascade.ops.triton import prefill as tp  # noqa: E402
from kernel_checks import (DEVICE, SCALE, check_close, check_decode_selection, check_lse,  # noqa: E402
                           check_prefill_selection, dev, host_selection, masters, nan_like, paged_cache, poison,
                           poison_queries, poisoned_allocations, pooled_decode_rows, pooled_prefill_rows)

SEED = 2512_16391  # case i draws from SEED + i
COUNT = 200 * SCALE  # cases
MIN_N, MAX_N = 10, 200 * SCALE  # keys, drawn log-uniformly: most cases small, some long
# The interpreter's time grows with the keys read per (sequence, KV head) times the queries that read them: bounds on
# B * H * N (decode) and B * H * L * N * max(1, G / 4) (prefill). A case over its bound loses sequences, then heads,
# then keys (decode) or queries (prefill: a shorter chunk).
DECODE_WORK = 300 * SCALE
PREFILL_WORK = 4_000 * SCALE**2

DECODE_OPS = ("dense_decode", "select_decode", "dense_select_decode", "sparse_decode", "anchor_decode")
PREFILL_OPS = ("dense_prefill", "select_prefill", "dense_select_prefill", "sparse_prefill", "anchor_prefill")
OPS = DECODE_OPS + PREFILL_OPS
GROUPS = (1, 2, 3, 4, 5, 6, 8, 16)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class Case:
    """One fuzz case: a launcher, its geometry (``kv_start`` per sequence, the queries at slots ``q_offset ..
    q_offset + L - 1`` of ``N``), the budget and the launcher's options."""

    index: int
    op: str
    B: int
    H: int
    G: int
    D: int
    dtype: torch.dtype
    N: int
    L: int
    q_offset: int
    kv_start: tuple
    budget: Budget
    options: tuple  # (name, value) pairs

    @property
    def seed(self) -> int:
        return SEED + self.index

    @property
    def opts(self) -> dict:
        return dict(self.options)

    @property
    def id(self) -> str:
        dt = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[self.dtype]
        bud = self.budget
        geo = f"N{self.N}-L{self.L}-off{self.q_offset}"
        opts = "-".join(k if v is True else f"{k}={v}" for k, v in self.options if v not in (None, False, 0))
        return (f"{self.index:03d}-{self.op}-B{self.B}-H{self.H}-G{self.G}-D{self.D}-{dt}-{geo}-T{bud.tile}"
                f"-r{bud.ratio}-kmin{bud.k_min}{'-rolling' if bud.rolling else ''}{'-' + opts if opts else ''}"
                f"-seed{self.seed}")


# ----------------------------------------------------------------------------------------------------------------
# Drawing the cases
# ----------------------------------------------------------------------------------------------------------------
def _keys(rng: random.Random, tile: int) -> int:
    """A cache length, log-uniform in [MIN_N, MAX_N], not a multiple of ``tile``."""
    N = round(math.exp(rng.uniform(math.log(MIN_N), math.log(MAX_N))))
    return N + (N % tile == 0)


def _decode_geometry(rng: random.Random, B: int, H: int):
    N = _keys(rng, 8)  # 8: no multiple of a tile or key block
    while B * H * N > DECODE_WORK:
        if B > 1:
            B -= 1
        elif H > 1:
            H -= 1
        else:
            N = DECODE_WORK + (DECODE_WORK % 8 == 0)
    tail = min(rng.choice((0, 0, 1, 2, 3, 6)), N - 2)  # unused slots after the query
    q_offset = N - 1 - tail
    kv_start = tuple(0 if rng.random() < 0.35 else rng.randint(1, q_offset) for _ in range(B))
    return B, H, N, 1, q_offset, kv_start


def _prefill_geometry(rng: random.Random, B: int, H: int, G: int, T: int):
    N = _keys(rng, T)
    tail = min(rng.choice((0, 0, 1, 2, 5)), N - 3)  # unused slots after the queries
    if rng.random() < 0.5:  # a whole prompt
        q_offset, L = 0, N - tail
    else:  # a chunk after a cached prefix
        L = rng.randint(2, N - tail - 1)
        q_offset = N - tail - L
    while B * H * L * N * max(1, G / 4) > PREFILL_WORK and (B > 1 or H > 1 or L > 2):
        if B > 1:
            B -= 1
        elif H > 1:
            H -= 1
        else:
            L = max(2, L // 2)
            q_offset = N - tail - L
    starts = []
    for _ in range(B):
        mode = rng.choices(("none", "before", "covers"), weights=(0.35, 0.35 if q_offset else 0.0, 0.3))[0]
        if mode == "none":
            starts.append(0)
        elif mode == "before":  # left padding before the call's queries
            starts.append(rng.randint(1, q_offset))
        else:  # left padding that covers some of the call's queries
            starts.append(rng.randint(q_offset + 1, q_offset + L - 1))
    return B, H, N, L, q_offset, tuple(starts)


def _options(rng: random.Random, op: str) -> dict:
    """The launcher options of a case (what each means: the runners below)."""
    pick = rng.choice
    o = {}
    if op in DECODE_OPS:
        o["page"] = pick((1, 5, 8, 16, 32)) if rng.random() < 0.5 else 0
        if op != "sparse_decode":
            o["meta"] = pick(("args", "host") if o["page"] else ("args", "host", "static"))
        if op != "anchor_decode":
            o["splits"] = pick((None, None, 1, 2, 3, 7))
            o["block_n"] = pick((None, None, 16, 32, 64))
        if op in ("select_decode", "dense_select_decode", "anchor_decode"):
            o["method"] = pick(("radix", "topk"))
            if op != "anchor_decode":
                o["chunk"] = pick((None, 32, 64)) if o["method"] == "radix" else None
                o["rank_factor"] = pick((None, None, 0.5, 1.0, 1.7, 3.0))
        if op != "select_decode":
            o["out"] = rng.random() < 0.7
    else:
        if op in ("dense_prefill", "sparse_prefill"):
            o["block_m"] = pick((None, 16, 32, 64))
            o["block_n"] = pick((None, 16, 32))
            o["out"] = rng.random() < 0.7
        if op in ("select_prefill", "dense_select_prefill", "anchor_prefill"):
            o["chunk_bytes"] = pick((None, 1, "few"))
        if op in ("select_prefill", "dense_select_prefill"):
            o["rank_factor"] = pick((None, None, 0.5, 1.0, 1.7))
            o["int32"] = rng.random() < 0.4
        if op == "select_prefill":
            o["lse"] = pick(("given", "own"))
            o["block_n"] = pick((None, 16, 32))
    if op in ("sparse_decode", "sparse_prefill"):
        o["rows"] = pick(("sorted", "ranked", "prefix"))
        o["int32"] = rng.random() < 0.5
        if o["rows"] == "ranked":
            o["rank_factor"] = pick((1.0, 1.6))  # the ranked rows' rank factor
        elif o["rows"] == "prefix":
            o["keep"] = pick((0.4, 0.8, 1.0, 1.3))  # the counts' budget multiplier
            o["rank_factor"] = max(o["keep"], pick((1.0, 1.6)))
    return o


def _row_counts(case: Case, factor: float | None) -> list[tuple[int, int]]:
    """(keys kept, candidates) of every selection row of the case, at budget multiplier ``factor``."""
    bud, rows = case.budget, []
    for s0 in case.kv_start:
        n = case.q_offset + case.L - s0
        if case.L == 1:
            rows.append((bud.decode(n) if factor is None else bud.decode_counts(n, factor), n))
            continue
        first, count = bud.tiles(n, case.L)
        for t in range(first, first + count):
            c = bud.prefill_tile(t * bud.tile, n)
            rows.append((c if factor is None else at_factor(c, factor, t * bud.tile), t * bud.tile))
    return rows


def _selects(case: Case) -> bool:
    """Whether some row of the case's selection keeps some but not all of its candidates."""
    o = case.opts
    factor = o.get("keep") if o.get("rows") == "prefix" else o.get("rank_factor")
    return any(0 < c < m for c, m in _row_counts(case, factor))


def draw(index: int) -> Case:
    rng = random.Random(SEED + index)
    op = OPS[index % len(OPS)]
    while True:  # redraw until the case selects (dense launchers too: their cases then look alike)
        B, H = rng.choices((1, 2, 3), weights=(4, 3, 2), k=2)  # fewer programs: the interpreter's cost
        G = rng.choice(GROUPS)
        D = 256 if rng.random() < 0.04 else rng.choice((16, 32, 64, 128))
        dtype = rng.choice(DTYPES)
        T = rng.choice((8, 16, 32))
        if op in DECODE_OPS:
            B, H, N, L, q_offset, kv_start = _decode_geometry(rng, B, H)
            budget = Budget(ratio=rng.choice((0.05, 0.1, 0.2, 0.3, 0.5)), k_min=rng.randint(1, 8), tile=T,
                            rolling=rng.random() < 0.5)
        else:
            B, H, N, L, q_offset, kv_start = _prefill_geometry(rng, B, H, G, T)
            budget = Budget(ratio=rng.choice((0.2, 0.3, 0.5, 0.7, 0.9)), k_min=rng.randint(1, 8), tile=T,
                            rolling=rng.random() < 0.5)
        options = _options(rng, op)
        if op == "select_prefill":  # both top-k methods, alternating (drawn apart from rng: the other cases stay)
            options["method"] = ("topk", "radix")[(index // len(OPS)) % 2]
            # the scoring pass's options in turn: plain, part of the exponentials on the FMA pipes
            options["scoring"] = ("plain", "fma")[(index // (2 * len(OPS))) % 2]
        options = tuple(options.items())
        case = Case(index, op, B, H, G, D, dtype, N, L, q_offset, kv_start, budget, options)
        if _selects(case):
            return case


CASES = [draw(i) for i in range(COUNT)]

# Cases that fail for a known property of a kernel, by id (drawn on the CPU's scale), expected to fail until the kernel
# changes: strict, so a fixed kernel fails them as XPASS and asks for their removal.
KNOWN_FAILURES = {
    "197-dense_select_prefill-B2-H1-G1-D16-bf16-N174-L8-off166-T32-r0.7-kmin3-rolling-chunk_bytes=few-rank_factor=1.7"
    "-seed251216588": "the prefill kernels round the softmax weights to the value dtype before p @ v (decode keeps "
                      "them as two bf16 parts): here a bf16 output of a query with 2 keys rounds to the other "
                      "neighbour, 2.6x the bf16 reference's error against the exact result of the same inputs",
}


# ----------------------------------------------------------------------------------------------------------------
# Running a case
# ----------------------------------------------------------------------------------------------------------------
class Inputs:
    """A case's tensors: low-precision ``q, k, v`` on the CPU (references), their kernel-side versions on the
    device (NaN-poisoned cache, paged or not; NaN at padding queries), and the geometry."""

    def __init__(self, case: Case):
        self.case = case
        g = torch.Generator().manual_seed(case.seed)
        q, k, v = masters(g, case.B, case.H, case.G, case.L, case.N, case.D)
        self.q, self.k, self.v = q.to(case.dtype), k.to(case.dtype), v.to(case.dtype)
        self.kv_start = torch.tensor(case.kv_start)
        self.scale = case.D**-0.5
        self.pos = {"scale": self.scale, "kv_start": self.kv_start, "q_offset": case.q_offset}
        self.end = case.q_offset + case.L
        self.page = case.opts.get("page", 0)
        self.qd = dev(poison_queries(self.q, self.kv_start, case.q_offset))
        if self.page:  # the same generator seed: K and V share the block table
            kc, self.table, self.lens = paged_cache(self.k, self.kv_start, self.end, self.page,
                                                    torch.Generator().manual_seed(case.seed))
            vc, table, _ = paged_cache(self.v, self.kv_start, self.end, self.page,
                                       torch.Generator().manual_seed(case.seed))
            assert torch.equal(table, self.table)
            self.kd, self.vd = dev(kc), dev(vc)
        else:
            self.kd = dev(poison(self.k, self.kv_start, self.end))
            self.vd = dev(poison(self.v, self.kv_start, self.end))

    # -- references (CPU) ----------------------------------------------------------------------------------------
    def dense(self):
        """(exact, low-precision) reference outputs of dense attention."""
        q, k, v = self.q, self.k, self.v
        return (reference.dense_attention(q.double(), k.double(), v.double(), **self.pos),
                reference.dense_attention(q, k, v, **self.pos))

    def sparse(self, sel: Selection):
        """(exact, low-precision) reference outputs of sparse attention over ``sel`` (absolute slots, CPU)."""
        q, k, v = self.q, self.k, self.v
        return (reference.sparse_attention(q.double(), k.double(), v.double(), sel, **self.pos),
                reference.sparse_attention(q, k, v, sel, **self.pos))

    def select(self, rank_factor=None) -> Selection:
        return reference.select(self.q, self.k, budget=self.case.budget, rank_factor=rank_factor, **self.pos)

    # -- kernel-side arguments -----------------------------------------------------------------------------------
    def decode_layout(self, meta_kind: str = "args", budget: Budget | None = None) -> dict:
        """The layout keywords of a decode launcher: the geometry itself, or metadata planned on the host or on the
        device (a static cache: its launch bounds are the capacity N, above every sequence's length)."""
        c = self.case
        paged_kw = {"block_table": dev(self.table)} if self.page else {}
        if meta_kind == "args":
            return {**paged_kw, "seq_lens": self.lens} if self.page else {"kv_start": self.kv_start,
                                                                          "q_offset": c.q_offset}
        if meta_kind == "host":
            meta = (decode_meta(c.B, device=DEVICE, seq_lens=self.lens, budget=budget, paged=True) if self.page else
                    decode_meta(c.B, device=DEVICE, kv_start=self.kv_start, q_offset=c.q_offset, budget=budget))
            return {**paged_kw, "meta": meta}
        assert meta_kind == "static" and not self.page
        meta = decode_meta_static(c.B, dev(self.kv_start), dev(torch.tensor(c.q_offset)), c.N, budget or c.budget)
        return {"meta": meta}

    def out(self):
        return {"out": nan_like(self.qd)} if self.case.opts.get("out") else {}

    def junk_slot(self, b: int) -> int | None:
        """A slot (paged: a logical position) of sequence ``b`` that holds NaN, for index entries no kernel may
        read; None when the sequence has none."""
        if self.page:
            return self.table.shape[1] * self.page - 1  # in the spare page the table's last entry names
        if self.case.kv_start[b] > 0:
            return 0
        return self.case.N - 1 if self.end < self.case.N else None

    def kernel_rows(self, sel: Selection, counts: torch.Tensor | None) -> torch.Tensor:
        """``sel``'s indices (CPU) as a kernel takes them: positions when paged, and the entries past each row's
        count naming NaN slots where the sequence has any (a kernel that reads past the prefix then fails)."""
        idx = sel.indices.clone()
        if self.page:
            idx = torch.where(idx >= 0, idx - self.kv_start[:, None, None, None], -1)
        if counts is not None:
            c = counts if counts.dim() == 2 else counts[:, None]  # [B, R]
            past = torch.arange(idx.shape[-1])[None, None, :] >= c[:, :, None]  # [B, R, K]
            for b in range(idx.shape[0]):
                slot = self.junk_slot(b)
                if slot is not None:
                    idx[b][past[b].expand_as(idx[b])] = slot
        return idx


def _int32(sel: Selection, want: bool) -> Selection:
    """A kernel's selection in int64 (as the checks take it), after checking the dtype the case asked for."""
    assert sel.indices.dtype == (torch.int32 if want else torch.long), sel.indices.dtype
    return Selection(sel.indices.long(), sel.row_start, sel.tile, sel.decode, sel.ranked, sel.counts)


def _trim(sel: Selection, width: int) -> Selection:
    """A selection planned with launch bounds (static cache) is wider than the reference's: the extra columns are
    -1 padding."""
    extra = sel.indices[..., width:]
    assert bool((extra == -1).all()), "entries past every sequence's count"
    return Selection(sel.indices[..., :width], sel.row_start, sel.tile, sel.decode, sel.ranked, sel.counts)


def _absolute(sel: Selection, x: Inputs) -> Selection:
    """A kernel's decode selection (CPU) in absolute slots (paged: it holds positions)."""
    if not x.page:
        return sel
    idx = torch.where(sel.indices >= 0, sel.indices + x.kv_start[:, None, None, None], -1)
    return Selection(idx, sel.row_start, sel.tile, sel.decode, sel.ranked)


def _check_padding_zeros(got, x: Inputs, what: str) -> None:
    got = got.cpu()
    for b, s0 in enumerate(x.case.kv_start):
        pad = max(0, min(x.case.L, s0 - x.case.q_offset))
        assert bool((got[b, :, :pad] == 0).all()), f"{what}: seq {b}: a padding query's output is not zero"


def _check_selects(stats, what: str) -> None:
    selected, strict = stats
    assert selected > 0 and strict > 0, f"{what}: no row keeps some but not all of its keys: the case tests nothing"


def _few_bytes(c: Case) -> int:
    return c.B * c.H * 3 * (4 * c.N + 40 * c.budget.k(c.N))  # about 3 tiles per chunk


def _decode_cfg(o: dict) -> dict:
    return {k: o[v] for k, v in (("num_splits", "splits"), ("block_n", "block_n")) if o.get(v) is not None}


# -- decode --------------------------------------------------------------------------------------------------------
def run_dense_decode(c: Case, x: Inputs) -> None:
    o = c.opts
    exact, lowp = x.dense()
    with poisoned_allocations():
        got = td.dense_decode(x.qd, x.kd, x.vd, scale=x.scale, **x.decode_layout(o["meta"]), **x.out(),
                              **_decode_cfg(o))
    check_close(got, exact, lowp, "dense_decode")


def _decode_selection(c: Case, x: Inputs, sel: Selection, want: Selection, rank_factor, what: str) -> Selection:
    sel = host_selection(sel)
    if c.opts.get("meta") == "static":
        sel = _trim(sel, want.indices.shape[-1])
    pooled = pooled_decode_rows(x.q, x.k, x.kv_start, c.q_offset, x.scale)
    _check_selects(check_decode_selection(sel, want, pooled, x.kv_start, c.q_offset, c.budget, paged=bool(x.page),
                                          what=what, rank_factor=rank_factor), what)
    return sel


def run_select_decode(c: Case, x: Inputs) -> None:
    o = c.opts
    rank_factor = o["rank_factor"]
    with poisoned_allocations():
        sel = td.select_decode(x.qd, x.kd, budget=c.budget, scale=x.scale, method=o["method"], chunk=o["chunk"],
                               rank_factor=rank_factor, **x.decode_layout(o["meta"], c.budget), **_decode_cfg(o))
    _decode_selection(c, x, sel, x.select(rank_factor), rank_factor, "select_decode")


def run_dense_select_decode(c: Case, x: Inputs) -> None:
    o = c.opts
    rank_factor = o["rank_factor"]
    with poisoned_allocations():
        out, sel = td.dense_select_decode(x.qd, x.kd, x.vd, budget=c.budget, scale=x.scale, method=o["method"],
                                          chunk=o["chunk"], rank_factor=rank_factor, **x.decode_layout(o["meta"], c.budget),
                                          **x.out(), **_decode_cfg(o))
    check_close(out, *x.dense(), "dense_select_decode output")
    _decode_selection(c, x, sel, x.select(rank_factor), rank_factor, "dense_select_decode selection")


def run_anchor_decode(c: Case, x: Inputs) -> None:
    o = c.opts
    with poisoned_allocations():
        out, sel = td.anchor_decode(x.qd, x.kd, x.vd, budget=c.budget, scale=x.scale, method=o["method"],
                                    **x.decode_layout(o["meta"], c.budget), **x.out())
    sel = _decode_selection(c, x, sel, x.select(), None, "anchor_decode selection")
    # its output over its own selection, which may differ from the reference's only at ties
    check_close(out, *x.sparse(_absolute(sel, x)), "anchor_decode output")


def _sparse_rows(c: Case, x: Inputs):
    """The reference's selection for a sparse case (absolute slots, CPU), and the counts of a prefix."""
    o = c.opts
    if o["rows"] == "sorted":
        sel, counts = x.select(), None
    else:
        sel = x.select(o["rank_factor"])
        counts = None
        if o["rows"] == "prefix":
            n = c.q_offset + c.L - x.kv_start
            if c.L == 1:
                counts = c.budget.decode_counts(n, o["keep"]).to(torch.int32)
            else:
                first, _ = c.budget.tiles(n, c.L)
                counts = c.budget.row_counts(n, first, sel.indices.shape[2], o["keep"]).to(torch.int32)
            sel = Selection(sel.indices, sel.row_start, sel.tile, sel.decode, True, counts)
    assert bool((sel.as_set().indices >= 0).any()), "the selection holds no key: the case tests nothing"
    return sel, counts


def run_sparse_decode(c: Case, x: Inputs) -> None:
    o = c.opts
    sel, counts = _sparse_rows(c, x)
    idx = x.kernel_rows(sel, counts).to(torch.int32 if o["int32"] else torch.long)
    with poisoned_allocations():
        got = td.sparse_decode(x.qd, x.kd, x.vd, dev(idx), scale=x.scale,
                               counts=None if counts is None else dev(counts),
                               **({"block_table": dev(x.table)} if x.page else {}), **x.out(), **_decode_cfg(o))
    check_close(got, *x.sparse(sel), f"sparse_decode ({o['rows']} rows)")


# -- prefill -------------------------------------------------------------------------------------------------------
def _prefill_selection(c: Case, x: Inputs, sel: Selection, rank_factor, int32: bool, what: str) -> Selection:
    sel = _int32(host_selection(sel), int32)
    pooled = pooled_prefill_rows(x.q, x.k, x.kv_start, c.q_offset, x.scale, c.budget.tile)
    _check_selects(check_prefill_selection(sel, x.select(rank_factor), pooled, x.kv_start, c.q_offset, c.L, c.budget,
                                           what, rank_factor=rank_factor), what)
    return sel


def _blocks(o: dict) -> dict:
    return {k: o[k] for k in ("block_m", "block_n") if o.get(k) is not None}


def _chunk_bytes(c: Case) -> dict:
    v = c.opts.get("chunk_bytes")
    return {} if v is None else {"max_chunk_bytes": _few_bytes(c) if v == "few" else v}


def run_dense_prefill(c: Case, x: Inputs) -> None:
    o = c.opts
    with poisoned_allocations():
        got, lse = tp.dense_prefill(x.qd, x.kd, x.vd, return_lse=True, **x.out(), **x.pos, **_blocks(o))
        lse_only = tp.prefill_lse(x.qd, x.kd, **x.pos, **_blocks(o))
    check_close(got, *x.dense(), "dense_prefill", floor=1e-5)
    _check_padding_zeros(got, x, "dense_prefill")
    check_lse(lse, x.q, x.k, x.kv_start, c.q_offset, x.scale, "dense_prefill LSE")
    check_lse(lse_only, x.q, x.k, x.kv_start, c.q_offset, x.scale, "prefill_lse")


def run_select_prefill(c: Case, x: Inputs) -> None:
    o = c.opts
    # the scoring pass: every other group of 8 rows' exponentials on the FMA pipes, or none
    scoring = tp.Launch(block_n=o["block_n"] or None, fma_exp=2 if o["scoring"] == "fma" else 0)
    kw = dict(_chunk_bytes(c), scoring=scoring)
    with poisoned_allocations():
        if o["lse"] == "given":
            kw["lse"] = tp.prefill_lse(x.qd, x.kd, **x.pos)
        sel = tp.select_prefill(x.qd, x.kd, budget=c.budget, rank_factor=o["rank_factor"], method=o["method"],
                                index_dtype=torch.int32 if o["int32"] else None, **x.pos, **kw)
    _prefill_selection(c, x, sel, o["rank_factor"], o["int32"],
                       f"select_prefill ({o['lse']} LSE, {o['method']}, {o['scoring']} scoring)")


def run_dense_select_prefill(c: Case, x: Inputs) -> None:
    o = c.opts
    with poisoned_allocations():
        out, sel = tp.dense_select_prefill(x.qd, x.kd, x.vd, budget=c.budget, rank_factor=o["rank_factor"],
                                           index_dtype=torch.int32 if o["int32"] else None, **x.pos,
                                           **_chunk_bytes(c))
    check_close(out, *x.dense(), "dense_select_prefill output", floor=1e-5)
    _check_padding_zeros(out, x, "dense_select_prefill output")
    _prefill_selection(c, x, sel, o["rank_factor"], o["int32"], "dense_select_prefill selection")


def run_anchor_prefill(c: Case, x: Inputs) -> None:
    with poisoned_allocations():
        out, sel = tp.anchor_prefill(x.qd, x.kd, x.vd, budget=c.budget, **x.pos, **_chunk_bytes(c))
    sel = _prefill_selection(c, x, sel, None, False, "anchor_prefill selection")
    # its output over its own selection, which may differ from the reference's only at ties
    check_close(out, *x.sparse(sel), "anchor_prefill output", floor=1e-5)
    _check_padding_zeros(out, x, "anchor_prefill output")


def run_sparse_prefill(c: Case, x: Inputs) -> None:
    o = c.opts
    sel, counts = _sparse_rows(c, x)
    idx = x.kernel_rows(sel, counts).to(torch.int32 if o["int32"] else torch.long)
    kernel_sel = Selection(dev(idx), dev(sel.row_start), sel.tile, False, sel.ranked)
    with poisoned_allocations():
        got = tp.sparse_prefill(x.qd, x.kd, x.vd, kernel_sel, counts=None if counts is None else dev(counts),
                                **x.out(), **x.pos, **_blocks(o))
    check_close(got, *x.sparse(sel), f"sparse_prefill ({o['rows']} rows)", floor=1e-5)
    _check_padding_zeros(got, x, "sparse_prefill")


RUN = {name: globals()[f"run_{name}"] for name in OPS}


def _param(case: Case):
    known = KNOWN_FAILURES.get(case.id)
    marks = [pytest.mark.xfail(strict=True, raises=AssertionError, reason=known)] if known else []
    return pytest.param(case, id=case.id, marks=marks)


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_kernel_matches_reference(case):
    RUN[case.op](case, Inputs(case))


def test_the_cases_cover_every_variant():
    """The draw reaches every launcher, each G, D, dtype and tile, both kinds of prefill call, padding that covers
    queries, and the options: every value of each option somewhere, every value of the layout and kind-of-rows
    options for each launcher, two values of every other option for each launcher. A change to the draw cannot
    quietly drop a variant."""
    seen = collections.defaultdict(set)
    for c in CASES:
        for key, value in (("op", c.op), ("G", c.G), ("D", c.D), ("dtype", c.dtype), ("tile", c.budget.tile),
                           ("rolling", c.budget.rolling), ("B", c.B), ("H", c.H)):
            seen[key].add(value)
        for k, v in c.options:
            seen[(c.op, k)].add(bool(v) if k == "page" else v)
        if c.L > 1:
            seen["prefill call"].add("chunked" if c.q_offset else "whole")
            seen["padding"].update("covers" if s > c.q_offset else "before" if s else "none" for s in c.kv_start)
        else:
            seen["decode tail"].add(c.q_offset < c.N - 1)
    assert seen["op"] == set(OPS)
    assert seen["G"] == set(GROUPS) and seen["D"] == {16, 32, 64, 128, 256} and seen["dtype"] == set(DTYPES)
    assert seen["tile"] == {8, 16, 32} and seen["rolling"] == {True, False}
    assert seen["B"] == {1, 2, 3} and seen["H"] == {1, 2, 3}
    assert seen["prefill call"] == {"chunked", "whole"} and seen["padding"] == {"none", "before", "covers"}
    assert seen["decode tail"] == {True, False}
    assert seen[("select_prefill", "scoring")] == {"plain", "fma"}
    assert seen[("select_prefill", "method")] == {"topk", "radix"}
    assert SCALE > 1 or set(KNOWN_FAILURES) <= {c.id for c in CASES}, "a known failure is no longer drawn"
    rng = random.Random(0)
    anywhere, drawn = collections.defaultdict(set), collections.defaultdict(set)
    for op in OPS:
        possible = collections.defaultdict(set)
        for _ in range(500):
            for k, v in _options(rng, op).items():
                possible[k].add(bool(v) if k == "page" else v)
        for k, values in possible.items():
            got = seen[(op, k)]
            anywhere[k] |= values
            drawn[k] |= got
            if k in ("page", "meta", "method", "rows", "lse"):
                assert got == values, f"{op}: option {k} drew {got}, can take {values}"
            else:
                assert len(got) >= min(2, len(values)), f"{op}: option {k} drew only {got} of {values}"
    for k, values in anywhere.items():
        assert drawn[k] == values, f"option {k} drew {drawn[k]}, can take {values}"
