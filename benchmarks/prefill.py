"""Prefill attention per layer: dense baselines vs Kascade's layer 0, anchor and reuse layers (Triton), one GPU call.

    python -m benchmarks.prefill [--out DIR] [--ns 8192,32768,65536,131072] [--batches 1,4] [--no-sweep] [--no-flex]

1. Checks every Triton prefill kernel against the reference ops on small random cases (varied lengths, chunked
   prefill offset, G = 4 and 3, D = 128 and 64, bf16).
2. Unless --no-sweep, sweeps launch configurations and options of the dense, QK-only, scoring, top-k and sparse
   kernels at N = 32K (printed, and under "sweep_32k" in prefill.json).
3. For Llama-3.1-8B shapes (HQ 32, H 8, D 128) and the default model's (HQ 9, H 3, D 64), bf16, B in --batches
   (default 1; every sequence N tokens),
   Budget(ratio=0.1, k_min=128, tile=32), N in --ns: per-layer times of dense cuDNN SDPA (the baseline), SDPA
   flash, FlexAttention (compiled; N <= 32K), our dense kernel, layer 0 (dense + LSE, then selection), anchor
   (selection with its own LSE pass, then sparse), reuse (sparse over the anchor's selection), and the model
   average for 5 anchors of 32 layers (1 layer 0 + 4 anchors + 27 reuse layers); peak extra memory of the anchor
   path (beyond inputs and the returned indices, which are reported on their own).

Timing: triton.testing.do_bench(return_mode="median") after a warm-up. Ratios are against cuDNN in the same run.
Writes prefill.json and the table prefill_table.md under --out (default out/prefill).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
import triton

from benchmarks.common import log, out_folder
from benchmarks.common.shapes import DT, MODELS
from benchmarks.common.shapes import PREFILL_BUDGET as BUDGET
from benchmarks.common.shapes import first_keys
from benchmarks.common.shapes import prefill_inputs as inputs
from benchmarks.common.timing import median_ms as bench
from kascade.ops import reference
from kascade.ops.triton import prefill as tp


# ----------------------------------------------------------------------------------------------------------------
# Correctness
# ----------------------------------------------------------------------------------------------------------------
def check():
    dev = "cuda"
    rows = []
    for HQ, H, D, N, L, starts in ((32, 8, 128, 1500, 1500, [0, 437]), (9, 3, 64, 1203, 700, [0, 611]),
                                   (32, 8, 128, 2100, 1000, [17, 0])):
        g = torch.Generator(device=dev).manual_seed(N)
        B = len(starts)
        q = torch.randn(B, HQ, L, D, device=dev, generator=g).to(DT)
        k = (torch.randn(B, H, N, D, device=dev, generator=g) * 1.5).to(DT)
        v = torch.randn(B, H, N, D, device=dev, generator=g).to(DT)
        ks = torch.tensor(starts)
        qo = N - L
        sc = D**-0.5
        pos = dict(scale=sc, kv_start=ks, q_offset=qo)
        want = reference.dense_attention(q.double(), k.double(), v.double(), **pos)
        lowp = reference.dense_attention(q, k, v, **pos)
        out, lse = tp.dense_prefill(q, k, v, return_lse=True, **pos)
        e, r = (out.double() - want).abs().max().item(), (lowp.double() - want).abs().max().item()
        ok_dense = e <= 2 * r + 1e-5 and not out.isnan().any()
        ref_sel = reference.select(q, k, budget=BUDGET, **pos)
        sel = tp.select_prefill(q, k, budget=BUDGET, lse=lse, **pos)
        sel2 = tp.select_prefill(q, k, budget=BUDGET, max_chunk_bytes=1 << 20, **pos)  # many small chunks
        same = sel.indices.shape == ref_sel.indices.shape
        diff = diff2 = -1
        if same:
            a, b_, c = ref_sel.indices, sel.indices, sel2.indices
            diff = (a != b_).float().mean().item()
            diff2 = (a != c).float().mean().item()
        want_s = reference.sparse_attention(q.double(), k.double(), v.double(), ref_sel, **pos)
        lowp_s = reference.sparse_attention(q, k, v, ref_sel, **pos)
        got_s = tp.sparse_prefill(q, k, v, ref_sel, **pos)
        es, rsd = (got_s.double() - want_s).abs().max().item(), (lowp_s.double() - want_s).abs().max().item()
        ok_sparse = es <= 2 * rsd + 1e-5 and not got_s.isnan().any()
        row = dict(shape=[HQ, H, D, N, L, starts], dense_err=e, dense_ref_err=r, dense_ok=ok_dense,
                   sel_shape_ok=same, sel_mismatch_frac=diff, sel_small_chunk_mismatch_frac=diff2,
                   sparse_err=es, sparse_ref_err=rsd, sparse_ok=ok_sparse)
        log("check", row)
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------------------------
def sweep(results, N=32768, device="cuda"):
    """Launch configurations at N = 32K, each timed (ms) into results["sweep_32k"] and printed; one that does not
    compile is reported, not fatal. (``N``, ``device``: the tests' dry run, every entry once at a small N in the
    Triton interpreter, so that no entry fails on the GPU for a mistake the CPU could have caught.)"""
    out = {}

    def timed(name, fn):
        try:
            t = bench(fn)
        except Exception as e:  # noqa: BLE001
            t = float("nan")
            log(f"sweep {name} failed:", repr(e)[:200])
        out[name] = t
        log(f"sweep {name}: {t:.2f} ms")

    HQ, H, D = MODELS["llama-3.1-8b"]
    q, k, v = inputs(HQ, H, D, N, device=device)
    sc = D**-0.5
    # bm256: 64 queries x 4 heads a program, each K block feeding twice the rows (the QK-only pass: 419 instructions
    # per warp and block against 2 x 235 at bm128, compiled; the dense pass spills there, so only the QK-only one)
    for bm, bn, nw, ns in ((128, 128, 8, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2),
                           (128, 64, 4, 4), (256, 64, 8, 2), (256, 64, 8, 3)):
        cfg = dict(block_m=bm, block_n=bn, num_warps=nw, num_stages=ns)
        if bm == 128:
            timed(f"dense bm{bm} bn{bn} w{nw} s{ns}", lambda: tp.dense_prefill(q, k, v, scale=sc, **cfg))
        timed(f"lse-only bm{bm} bn{bn} w{nw} s{ns}", lambda: tp.prefill_lse(q, k, scale=sc, **cfg))
    lse = tp.prefill_lse(q, k, scale=sc)
    # the scoring pass's launch (default (64, 4, 3)); fma: every n-th group of 8 rows' exponentials on the FMA pipes
    for bn, nw, ns, fma in ((64, 4, 3, 0), (64, 4, 3, 8), (64, 4, 3, 4), (128, 8, 2, 0), (128, 8, 3, 0), (128, 8, 3, 8),
                            (128, 4, 3, 0), (64, 8, 3, 0), (64, 4, 2, 0)):
        timed(f"scores only bn{bn} w{nw} s{ns}{f' fma{fma}' if fma else ''}",
              lambda: tp.select_prefill(q, k, budget=BUDGET, scale=sc, lse=lse, scores_only=True,
                                        scoring=tp.Launch(block_n=bn, num_warps=nw, num_stages=ns, fma_exp=fma)))
    # smaller chunks of tiles (default: the 64 MB scratch bound, a ~60 MB score buffer at 32K): a buffer that stays in
    # the 50 MB L2 between the top-k's five reads of it, at the price of more, smaller launches
    for mb in (16, 32):
        timed(f"select (given lse) {mb} MB chunks", lambda: tp.select_prefill(q, k, budget=BUDGET, scale=sc, lse=lse,
                                                                            max_chunk_bytes=mb << 20))
    sel = tp.select_prefill(q, k, budget=BUDGET, scale=sc, lse=lse)
    first = first_keys(sel)
    # bm: rows per program (None: the tile's G * T; 64: two programs per tile gathering the same keys). pf: the
    # indices loaded an iteration ahead (prefetch), after which Triton 3.6 keeps num_stages - 1 blocks of gathered K / V
    # rows in flight.
    for bn, nw, ns, bm, pf in ((64, 8, 3, None, True), (64, 8, 4, None, True), (64, 8, 3, None, False),
                               (128, 8, 2, None, True), (128, 8, 2, None, False), (128, 8, 3, None, False),
                               (32, 4, 4, None, True), (64, 4, 3, None, False), (64, 4, 3, 64, False)):
        cfg = dict(block_n=bn, num_warps=nw, num_stages=ns, block_m=bm, prefetch=pf)
        timed(f"sparse bn{bn} w{nw} s{ns} m{bm or 'tile'}{' prefetch' if pf else ''}",
              lambda: tp.sparse_prefill(q, k, v, sel, scale=sc, **cfg))
        if (bn, nw, ns, bm, pf) in ((64, 8, 3, None, True), (128, 8, 2, None, False)):
            timed(f"sparse first keys bn{bn} w{nw} s{ns} m{bm or 'tile'}",
                  lambda: tp.sparse_prefill(q, k, v, first, scale=sc, **cfg))
    HQ, H, D = MODELS["smollm2-135m"]
    q, k, v = inputs(HQ, H, D, N, device=device)
    sc = D**-0.5
    sel = tp.select_prefill(q, k, budget=BUDGET, scale=sc)
    lse = tp.prefill_lse(q, k, scale=sc)
    for mb in (16, 32):
        timed(f"smollm2 select (given lse) {mb} MB chunks", lambda: tp.select_prefill(q, k, budget=BUDGET, scale=sc,
                                                                                    lse=lse, max_chunk_bytes=mb << 20))
    # the QK-only pass at D = 64: SFU-bound (68 MUFU.EX2 per warp and block, 544 cycles, against 368 instructions)
    timed("smollm2 lse-only", lambda: tp.prefill_lse(q, k, scale=sc))
    # the scoring pass at G * T = 96 rows a tile: blocks of 64 + 32 rows held for the whole loop (the default), one
    # block of 128 (a quarter of it padding), or three of 32 reloaded per key block; fma: every n-th group of 8 rows'
    # exponentials on the FMA pipes (8 the default at D = 64)
    for rows, fma in ((None, 0), (128, 0), (32, 0), (None, 8), (None, 4), (128, 8)):
        timed(f"smollm2 scores only rows{rows or 'tile'}{f' fma{fma}' if fma else ''}",
              lambda: tp.select_prefill(q, k, budget=BUDGET, scale=sc, lse=lse, scores_only=True,
                                        scoring=tp.Launch(block_m=rows, fma_exp=fma)))
    # r128: at most 128 registers a thread (8 warps then fit two programs per SM; they need 130 at (64, 8, 4)).
    # m32: three programs of 32 rows per tile (no padding row, mma.sync instead of wgmma, each gathering the keys)
    for bn, nw, ns, pf, reg, bm in ((64, 4, 4, True, None, None), (64, 4, 3, False, None, None),
                                    (64, 8, 4, True, None, None), (64, 8, 3, False, None, None),
                                    (64, 8, 4, True, 128, None), (64, 8, 3, False, 128, None),
                                    (64, 8, 3, True, 128, None), (128, 8, 3, True, None, None),
                                    (32, 4, 4, True, None, None), (64, 2, 4, True, None, 32),
                                    (64, 4, 4, True, None, 32)):
        timed(f"smollm2 sparse bn{bn} w{nw} s{ns}{' prefetch' if pf else ''}{f' r{reg}' if reg else ''}"
              f"{f' m{bm}' if bm else ''}",
              lambda: tp.sparse_prefill(q, k, v, sel, scale=sc, block_n=bn, num_warps=nw, num_stages=ns, prefetch=pf,
                                        maxnreg=reg, block_m=bm))
    results["sweep_32k"] = out


def flex_fn(q, k, v):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    N = q.shape[2]
    bm = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, N, N, device="cuda")
    fx = torch.compile(flex_attention, dynamic=False)
    return lambda: fx(q, k, v, block_mask=bm, enable_gqa=True)


def measure(name, HQ, H, D, N, flex, B=1):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = inputs(HQ, H, D, N, seed=N, B=B)
    sc = D**-0.5
    G = HQ // H
    row = dict(model=name, B=B, HQ=HQ, H=H, D=D, N=N)
    ke = k.repeat_interleave(G, 1)
    ve = v.repeat_interleave(G, 1)
    for label, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                row[label] = bench(lambda: F.scaled_dot_product_attention(q, ke, ve, is_causal=True))
        except Exception as e:  # noqa: BLE001
            row[label] = float("nan")
            log(label, "failed", repr(e)[:200])
    del ke, ve
    if flex:
        try:
            t0 = time.time()
            fn = flex_fn(q, k, v)
            fn()
            row["flex"] = bench(fn)
            row["flex_compile_s"] = time.time() - t0
        except Exception as e:  # noqa: BLE001
            row["flex"] = float("nan")
            log("flex failed", repr(e)[:200])
    row["triton_dense"] = bench(lambda: tp.dense_prefill(q, k, v, scale=sc))
    row["triton_lse"] = bench(lambda: tp.prefill_lse(q, k, scale=sc))
    out, lse = tp.dense_prefill(q, k, v, scale=sc, return_lse=True)
    row["triton_dense_lse"] = bench(lambda: tp.dense_prefill(q, k, v, scale=sc, return_lse=True))
    row["select_given_lse"] = bench(lambda: tp.select_prefill(q, k, budget=BUDGET, scale=sc, lse=lse))
    row["select_scores_only"] = bench(lambda: tp.select_prefill(q, k, budget=BUDGET, scale=sc, lse=lse,
                                                               scores_only=True))
    row["layer0"] = bench(lambda: tp.dense_select_prefill(q, k, v, budget=BUDGET, scale=sc))
    sel = tp.select_prefill(q, k, budget=BUDGET, scale=sc, lse=lse)
    row["select"] = bench(lambda: tp.select_prefill(q, k, budget=BUDGET, scale=sc))
    row["reuse"] = bench(lambda: tp.sparse_prefill(q, k, v, sel, scale=sc))
    row["anchor"] = bench(lambda: tp.anchor_prefill(q, k, v, budget=BUDGET, scale=sc))
    # torch.topk instead of the radix top-k (the default, select_prefill(method="radix")): its time, and whether it
    # picks the same keys (rows identical as sets; a difference can only be a tie at a row's k-th score)
    sel_t = tp.select_prefill(q, k, budget=BUDGET, scale=sc, lse=lse, method="topk")
    row["radix_rows_identical"] = float((sel_t.indices == sel.indices).all(-1).float().mean())
    del sel_t
    row["select_given_lse_topk"] = bench(lambda: tp.select_prefill(q, k, budget=BUDGET, scale=sc, lse=lse,
                                                                  method="topk"))
    tp.TOPK_BOUND = False  # the radix top-k without the exponent window (every pass over the whole pattern)
    row["select_given_lse_radix_nobound"] = bench(lambda: tp.select_prefill(q, k, budget=BUDGET, scale=sc, lse=lse,
                                                                           method="radix"))
    tp.TOPK_BOUND = True
    row["anchor_topk"] = bench(lambda: tp.sparse_prefill(
        q, k, v, tp.select_prefill(q, k, budget=BUDGET, scale=sc, method="topk"), scale=sc))
    row["indices_mb"] = sel.indices.numel() * sel.indices.element_size() / 2**20
    kept = int((sel.indices >= 0).sum())
    row["kept_frac_of_causal"] = kept * BUDGET.tile / (B * H * N * (N + 1) / 2)  # selected (query, key) pairs
    del sel, out, lse
    # Peak extra memory of the anchor path beyond its inputs and outputs: the selection stage (LSE, score buffer,
    # top-k temporaries) minus the returned indices; the sparse stage allocates only its output.
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    s = tp.select_prefill(q, k, budget=BUDGET, scale=sc)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    row["anchor_extra_mb"] = (peak - base - s.indices.numel() * s.indices.element_size()) / 2**20
    del s
    c = row["cudnn"]
    for key in ("sdpa_flash", "flex", "triton_dense", "layer0", "anchor", "reuse", "select", "anchor_topk"):
        if key in row:
            row[f"{key}_x"] = row[key] / c
    avg = (row["layer0"] + 4 * row["anchor"] + 27 * row["reuse"]) / 32
    row["model_avg"] = avg
    row["model_speedup"] = c / avg
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="folder for prefill.json and prefill_table.md (default out/prefill)")
    ap.add_argument("--ns", default="8192,32768,65536,131072", help="comma list of sequence lengths N")
    ap.add_argument("--no-sweep", action="store_true",
                    help="skip the launch-configuration and option sweep at N = 32K (56 entries; with the 32K rows "
                         "about 200 s on an H200)")
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its compilation takes minutes)")
    ap.add_argument("--batches", default="1", help="comma list of batch sizes (every sequence N tokens)")
    args = ap.parse_args(argv)
    args.out = str(out_folder(args.out, "prefill"))
    t_start = time.time()
    props = torch.cuda.get_device_properties(0)
    header = (f"GPU {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, "
              f"triton {triton.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}")
    log(header)
    results = {"header": header, "budget": vars(BUDGET) if hasattr(BUDGET, "__dict__") else str(BUDGET)}
    results["checks"] = check()
    log(f"checks done at {time.time() - t_start:.0f} s")
    rows = []
    for name, (HQ, H, D) in MODELS.items():
        for B, N in [(int(b), int(n)) for b in args.batches.split(",") for n in args.ns.split(",")]:
            try:
                r = measure(name, HQ, H, D, N, flex=not args.no_flex and N <= 32768 and name.startswith("llama"), B=B)
            except Exception as e:  # noqa: BLE001 - keep the rest of the table
                log("measure failed", name, B, N, repr(e)[:300])
                continue
            rows.append(r)
            log(json.dumps(r))
            torch.cuda.empty_cache()
            with open(os.path.join(args.out, "prefill.json"), "w") as f:
                json.dump(dict(results, rows=rows), f, indent=1)
    results["rows"] = rows
    if not args.no_sweep:
        sweep(results)
        log(f"sweep done at {time.time() - t_start:.0f} s")
    results["wall_s"] = time.time() - t_start
    with open(os.path.join(args.out, "prefill.json"), "w") as f:
        json.dump(results, f, indent=1)
    cols = ["cudnn", "sdpa_flash", "flex", "triton_dense", "layer0", "anchor", "anchor_topk", "reuse", "model_avg"]
    lines = [header, f"Budget(ratio=0.1, k_min=128, tile=32), bf16; ms (x = ratio to cuDNN)", "",
             "| model | B | N | " + " | ".join(cols) + " | model speedup | anchor extra MB | indices MB |",
             "|" + "---|" * (len(cols) + 6)]
    for r in rows:
        cells = []
        for c in cols:
            t = r.get(c)
            cells.append("-" if t is None or t != t else f"{t:.2f}" + (f" ({t / r['cudnn']:.2f}x)" if c != "cudnn" else ""))
        lines.append(f"| {r['model']} | {r['B']} | {r['N']} | " + " | ".join(cells)
                     + f" | {r['model_speedup']:.2f}x | {r['anchor_extra_mb']:.0f} | {r['indices_mb']:.0f} |")
    table = "\n".join(lines)
    with open(os.path.join(args.out, "prefill_table.md"), "w") as f:
        f.write(table + "\n")
    log(table)
    log(f"total {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
