"""Decode attention per layer: dense vs Kascade's layer 0, anchor and reuse layers (Triton kernels), one GPU call.

    python -m benchmarks.decode [--out DIR] [--quick] [--no-tune] [--only model:B:N,...]

1. Checks every kernel against the reference ops on small random cases (contiguous and paged, varied lengths).
2. Measures the device-to-device copy bandwidth (the ceiling for memory-bound kernels).
3. Sweeps a few launch configurations of the split-K kernel (dense, sparse, and the anchor's scoring pass) and the
   selection's chunk on representative shapes and keeps the fastest over all of them (printed); also records, per
   shape, the best configuration of that shape alone beside the overall one (sweep["per_shape_best"]). The
   defaults in kascade/ops/triton/decode.py (PASS_CONFIG) come from the finer per-shape, per-pass sweep of
   python -m benchmarks.decode_configs.
4. For Llama-3.1-8B shapes (HQ 32, H 8, D 128) and the default model's (HQ 9, H 3, D 64), bf16, 10 % budget
   (Budget(ratio=0.1, k_min=128)), B in {1, 8, 32}, N in {8K, 32K, 128K, 512K} (where memory allows): per-layer
   times of dense (the faster of SDPA(enable_gqa=True) and our split-K kernel), layer 0 (dense output + selection),
   anchor (selection + sparse), reuse (sparse), and the model average for 5 anchors of 32 layers
   (1 layer 0 + 4 anchors + 27 reuse layers).

Timing: triton.testing.do_bench(return_mode="median"), which flushes the L2 before every timed call; every op is
captured in a CUDA graph and the graph replay is timed (how a serving engine runs decode: launch gaps between the
small kernels are then the GPU's, not Python's). Eager times of the main ops are recorded too.
Beside each reuse layer it records the floor of reading its rows (``benchmarks.common.gather``).
Writes decode.json and the table decode_table.md under --out (default out/decode).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
import triton

from benchmarks.common import log, out_folder
from benchmarks.common.gather import gather_times, graph_floor
from benchmarks.common.shapes import DECODE_BUDGET as BUDGET
from benchmarks.common.shapes import DT, MODELS
from benchmarks.common.shapes import decode_inputs as make
from benchmarks.common.timing import copy_bandwidth
from benchmarks.common.timing import graph_us as bench
from kascade.ops import dense_attention, select, sparse_attention
from kascade.ops.triton import decode as td
from kascade.ops.triton import topk


# ----------------------------------------------------------------------------------------------------------------
# Correctness on small cases
# ----------------------------------------------------------------------------------------------------------------
def _paged(x, kv_start, q_offset, page, gen):
    B, H, N, D = x.shape
    lens = [q_offset + 1 - int(s) for s in kv_start]
    need = [-(-n // page) for n in lens]
    total = sum(need) + 2
    perm = torch.randperm(total, generator=gen).to(x.device)
    cache = torch.full((total, page, H, D), float("nan"), dtype=x.dtype, device=x.device)
    table = torch.zeros(len(lens), max(need), dtype=torch.int32, device=x.device)
    used = 0
    for b in range(len(lens)):
        table[b, : need[b]] = perm[used : used + need[b]].int()
        used += need[b]
        rows = x[b, :, int(kv_start[b]) : q_offset + 1].transpose(0, 1)  # [n, H, D]
        pad = need[b] * page - lens[b]
        rows = torch.cat([rows, rows.new_full((pad, H, D), float("nan"))])
        cache[table[b, : need[b]].long()] = rows.view(need[b], page, H, D)
    return cache, table, torch.tensor(lens)


CHECKS = (((32, 8, 128), 5001, 0), ((9, 3, 64), 3333, 0), ((32, 8, 128), 4099, 64), ((16, 2, 256), 2049, 16))


def check(dev, cases=CHECKS):
    """Every kernel vs the reference; returns a list of result rows and raises on a failure."""
    rows = []
    for (HQ, H, D), N, page in cases:
        gen = torch.Generator().manual_seed(N)
        B = 3
        q = torch.randn(B, HQ, 1, D, generator=gen).to(DT).to(dev)
        k = torch.randn(B, H, N, D, generator=gen).to(DT).to(dev)
        v = torch.randn(B, H, N, D, generator=gen).to(DT).to(dev)
        kv_start = torch.tensor([0, 1000, 2500 if N > 3000 else 1500])
        qo = N - 1
        scale = D**-0.5
        pos = dict(kv_start=kv_start, q_offset=qo)
        if page:
            kc, table, lens = _paged(k, kv_start, qo, page, torch.Generator().manual_seed(N + 1))
            vc, table_v, _ = _paged(v, kv_start, qo, page, torch.Generator().manual_seed(N + 1))  # same pages
            assert torch.equal(table, table_v)
            lay = dict(block_table=table, seq_lens=lens)
            kk, vv = kc, vc
        else:
            lay, kk, vv = pos, k, v
        res = {"HQ": HQ, "H": H, "D": D, "N": N, "paged": page}

        def err(got, want64, lowp):
            e = (got.double() - want64).abs().max().item()
            r = (lowp.double() - want64).abs().max().item()
            assert not torch.isnan(got).any()
            return e, r

        want = dense_attention(q.double(), k.double(), v.double(), **pos)
        res["dense"] = err(td.dense_decode(q, kk, vv, scale=scale, **lay), want, dense_attention(q, k, v, **pos))
        rsel = select(q, k, budget=BUDGET, **pos)
        idx = rsel.indices if not page else torch.where(rsel.indices >= 0,
                                                         rsel.indices - kv_start.to(dev)[:, None, None, None], -1)
        want = sparse_attention(q.double(), k.double(), v.double(), rsel, **pos)
        res["sparse"] = err(td.sparse_decode(q, kk, vv, idx, scale=scale, block_table=lay.get("block_table")),
                            want, sparse_attention(q, k, v, rsel, **pos))
        for method in ("radix", "topk"):
            sel = td.select_decode(q, kk, budget=BUDGET, scale=scale, method=method, **lay)
            got = sel.indices if not page else torch.where(sel.indices >= 0,
                                                            sel.indices + kv_start.to(dev)[:, None, None, None], -1)
            assert got.shape == rsel.indices.shape
            same = (got.sort(-1).values == rsel.indices.sort(-1).values).all(-1).float().mean().item()
            res[f"select_{method}_rows_identical"] = same
            # rows that differ must differ only at near-ties of the reference's pooled scores
            worst = 0.0
            for b in range(B):
                s = int(kv_start[b])
                p = torch.einsum("hgd,hkd->hgk", q[b].float().view(H, HQ // H, D), k[b, :, s:].float()).mul(scale)
                p = p.softmax(-1).sum(1)
                kb = BUDGET.decode(N - s)
                kth = p.topk(kb, -1).values[:, -1]
                for h in range(H):
                    a = set(got[b, h, 0][got[b, h, 0] >= 0].tolist())
                    r = set(rsel.indices[b, h, 0][rsel.indices[b, h, 0] >= 0].tolist())
                    d = sorted(a ^ r)
                    if d:
                        gap = ((p[h, torch.tensor(d, device=dev) - s] - kth[h]).abs().max() / kth[h]).item()
                        worst = max(worst, gap)
            res[f"select_{method}_worst_rel_gap"] = worst
            assert worst <= 1e-4, (res, method)
        for name in ("dense", "sparse"):
            e, r = res[name]
            assert e <= 2 * r + 1e-6, (name, res)
        rows.append(res)
        log(f"check ok: {res}")
    return rows


# ----------------------------------------------------------------------------------------------------------------
# One shape
# ----------------------------------------------------------------------------------------------------------------
def measure(B, HQ, H, N, D, dev, cfg, eager=True):
    q, k, v = make(B, HQ, H, N, D, dev)
    scale = D**-0.5
    meta = td.decode_meta(B, device=dev, q_offset=N - 1, budget=BUDGET)
    kb = meta.k_max
    sc, rc, ch = cfg["split"], cfg["sparse"], cfg["chunk"]
    sel = td.select_decode(q, k, budget=BUDGET, scale=scale, meta=meta, chunk=ch, **sc)
    idx64 = sel.indices
    idx32 = idx64.to(torch.int32)
    out = torch.empty_like(q)

    t = {}
    t["sdpa"] = bench(lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True))
    t["dense_ours"] = bench(lambda: td.dense_decode(q, k, v, scale=scale, meta=meta, out=out, **sc))
    t["dense"] = min(t["sdpa"], t["dense_ours"])
    t["reuse"] = bench(lambda: td.sparse_decode(q, k, v, idx64, scale=scale, out=out, **rc))
    t["reuse_int32"] = bench(lambda: td.sparse_decode(q, k, v, idx32, scale=scale, out=out, **rc))
    floors = gather_times(k, v, idx64, bench)  # the same rows read by a kernel that does nothing else
    t["gather_only"], t["stream_only"] = floors["gather_only"], floors["stream_only"]
    t["score_only"] = bench(lambda: td._run_split(q, k, None, None, meta, None, None, scale=scale, n_keys=meta.n_max,
                                                  sparse=False, has_v=False, write_scores=True, sc_row=meta.n_max,
                                                  **sc))
    t["select_radix"] = bench(lambda: td.select_decode(q, k, budget=BUDGET, scale=scale, meta=meta, chunk=ch, **sc))
    t["select_topk"] = bench(lambda: td.select_decode(q, k, budget=BUDGET, scale=scale, meta=meta, method="topk",
                                                      **sc))
    t.update(pool_parts(q, k, meta, scale, sc, ch))
    # at full size: the radix selection (defaults) keeps the same keys as torch.topk (rows identical as sets)
    a = td.select_decode(q, k, budget=BUDGET, scale=scale, meta=meta, chunk=ch, **sc).indices
    b = td.select_decode(q, k, budget=BUDGET, scale=scale, meta=meta, method="topk", **sc).indices
    a, b = a.sort(-1).values, b.sort(-1).values
    same = float((a == b).all(-1).float().mean())
    tie_gap = tie_gaps(q, k, scale, a, b)
    del a, b
    t["select"] = min(t["select_radix"], t["select_topk"])
    method = "radix" if t["select_radix"] <= t["select_topk"] else "topk"

    def anchor():
        s = td.select_decode(q, k, budget=BUDGET, scale=scale, meta=meta, method=method, chunk=ch, **sc)
        td.sparse_decode(q, k, v, s.indices, scale=scale, out=out, **rc)

    def layer0_fused():
        td.dense_select_decode(q, k, v, budget=BUDGET, scale=scale, meta=meta, method=method, out=out, chunk=ch, **sc)

    def layer0_sdpa():
        F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
        td.select_decode(q, k, budget=BUDGET, scale=scale, meta=meta, method=method, chunk=ch, **sc)

    t["anchor"] = bench(anchor)
    t["layer0_fused"] = bench(layer0_fused)
    t["layer0_sdpa_select"] = bench(layer0_sdpa)
    t["layer0"] = min(t["layer0_fused"], t["layer0_sdpa_select"])
    if eager:
        t["eager_sdpa"] = bench(lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True), False)
        t["eager_reuse"] = bench(lambda: td.sparse_decode(q, k, v, idx64, scale=scale, out=out, **rc), False)
        t["eager_anchor"] = bench(anchor, False)
    kv_bytes = 2 * B * H * N * D * 2
    gathered = 2 * B * H * kb * D * 2
    r = {
        "B": B, "HQ": HQ, "H": H, "D": D, "N": N, "k": kb, "select_method": method,
        "radix_rows_identical_to_topk": same, "radix_topk_worst_rel_gap": tie_gap,
        "times_us": t,
        "dense_TBps": kv_bytes / (t["dense"] * 1e-6) / 1e12,
        "reuse_gathered_TBps": gathered / (t["reuse"] * 1e-6) / 1e12,
        "gather_only_TBps": gathered / (t["gather_only"] * 1e-6) / 1e12,
        "stream_only_TBps": gathered / (t["stream_only"] * 1e-6) / 1e12,
        "gather_cfg": floors["gather_cfg"], "stream_cfg": floors["stream_cfg"],
        "score_TBps": kv_bytes / 2 / (t["score_only"] * 1e-6) / 1e12,
        "reuse_x": t["reuse"] / t["dense"], "anchor_x": t["anchor"] / t["dense"], "layer0_x": t["layer0"] / t["dense"],
    }
    r["model_speedup"] = 32 * t["dense"] / (t["layer0"] + 4 * t["anchor"] + 27 * t["reuse"])
    del q, k, v
    return r


def tie_gaps(q, k, scale, a, b, most=16):
    """Where two selections of every key (``a``, ``b``: ``[B, H, 1, K]`` ascending slots, no padding) differ: the
    worst relative gap between the pooled probability (fp32, torch) of a key in one and not the other and the k-th
    largest of its row (the smallest that ``a`` kept); ~1e-6 or less is a tie within rounding, where either choice is
    exact. 0.0 when they agree; over at most ``most`` rows."""
    G = q.shape[1] // k.shape[1]
    worst = 0.0
    for bi, h, _ in (a != b).any(-1).nonzero().tolist()[:most]:
        s = (q[bi, h * G:(h + 1) * G, 0].float() @ k[bi, h].float().T) * scale  # [G, N]: every key is valid
        p = torch.softmax(s, -1).sum(0)
        kth = p[a[bi, h, 0]].min()
        sym = torch.tensor(sorted(set(a[bi, h, 0].tolist()) ^ set(b[bi, h, 0].tolist())), device=p.device)
        worst = max(worst, float(((p[sym] - kth).abs() / kth).max()))
    return worst


def pool_parts(q, k, meta, scale, sc, ch):
    """The selection's first kernel alone (pooling over the group, writing the pooled row): without the first radix
    histogram and with it (exponents counted in registers, one global atomic per bin). The rest of a radix selection
    (the refining passes, the threshold counts, the ordered write) is select_radix - score_only - pool_hist."""
    B, HQ = q.shape[:2]
    H = k.shape[1]
    _, Stats, Sc, _, Hist, S = td._run_split(q, k, None, None, meta, None, None, scale=scale, n_keys=meta.n_max,
                                           sparse=False, has_v=False, write_scores=True, sc_row=meta.n_max, **sc)
    chunk = ch or min(topk.TOPK_LAUNCH["decode"].keys_per_program, triton.next_power_of_2(meta.n_max))
    pooled = torch.empty(B * H, meta.n_max, dtype=torch.float32, device=q.device)
    state = torch.empty(B * H, 8, dtype=torch.int32, device=q.device)

    def pool(hist):
        Hist.zero_()
        topk._pool_kernel[(triton.cdiv(meta.n_max, chunk), B * H)](
            Sc, Stats, meta.tensor, pooled, Hist, state, meta.n_max, S, H=H, G=HQ // H,
            GP=triton.next_power_of_2(HQ // H), S_PAD=triton.next_power_of_2(S), CH=chunk, NHIST=topk.NHIST,
            HIST=hist)

    return {"pool_nohist": bench(lambda: pool(False)), "pool_hist": bench(lambda: pool(True))}


def tune(dev):
    """Sweep launch parameters on representative Llama shapes; return the best and the full sweep."""
    shapes = [(1, 32, 8, 131072, 128), (8, 32, 8, 32768, 128), (32, 32, 8, 32768, 128)]
    sweep = {"sparse": [], "split": [], "score": [], "chunk": [], "shapes": [list(x) for x in shapes],
             "per_shape_best": {}}
    data = []
    for B, HQ, H, N, D in shapes:
        q, k, v = make(B, HQ, H, N, D, dev, seed=1)
        meta = td.decode_meta(B, device=dev, q_offset=N - 1, budget=BUDGET)
        sel = td.select_decode(q, k, budget=BUDGET, scale=D**-0.5, meta=meta)
        data.append((q, k, v, meta, sel.indices))
    out = None

    def per_shape(fn):
        return [bench(lambda d=d: fn(*d)) for d in data]

    def total(fn):
        return sum(per_shape(fn))

    def score(q, k, v, meta, idx, **c):  # the anchor's scoring pass alone (it runs on the split kernel's config)
        return td._run_split(q, k, None, None, meta, None, None, scale=0.1, n_keys=meta.n_max, sparse=False,
                             has_v=False, write_scores=True, sc_row=meta.n_max, **c)

    best = {}
    for name, run in (
        ("sparse", lambda c, ppsm: (lambda q, k, v, meta, idx: td.sparse_decode(q, k, v, idx, scale=0.1, **c))),
        ("split", lambda c, ppsm: (lambda q, k, v, meta, idx: td.dense_decode(q, k, v, scale=0.1, meta=meta, **c))),
        ("score", lambda c, ppsm: (lambda q, k, v, meta, idx: score(q, k, v, meta, idx, **c))),
    ):
        res = []
        for bn in (32, 64, 128):
            for nw in (4, 8):
                for ns in (1, 3):
                    for ppsm in (2, 4, 8):
                        c = {"block_n": bn, "num_warps": nw, "num_stages": ns, "programs_per_sm": ppsm}
                        try:
                            each = per_shape(run(c, ppsm))
                        except Exception as e:  # a config that does not compile (shared memory) is skipped
                            log(f"tune {name} {c} ppsm={ppsm}: {type(e).__name__}")
                            continue
                        us = sum(each)
                        res.append((us, c, ppsm, each))
                        sweep[name].append({"cfg": c, "programs_per_sm": ppsm, "sum_us": us, "us_per_shape": each})
        res.sort(key=lambda x: x[0])
        best[name] = res[0][:3]
        # per shape: the best config of that shape alone against the one config that is best over all shapes
        sweep["per_shape_best"][name] = [
            {"shape": list(shapes[i]), "best_cfg": min(res, key=lambda x: x[3][i])[1],
             "best_us": min(x[3][i] for x in res), "overall_cfg_us": res[0][3][i]} for i in range(len(shapes))]
        log(f"tune {name}: best {res[0][:3]}, worst {res[-1][:3]}; per shape: {sweep['per_shape_best'][name]}")
    for chs in (1024, 2048, 4096, 8192):
        us = total(lambda q, k, v, meta, idx: td.select_decode(q, k, budget=BUDGET, scale=0.1, meta=meta, chunk=chs,
                                                                **best["split"][1]))
        sweep["chunk"].append({"chunk": chs, "sum_us": us})
    best_chunk = min(sweep["chunk"], key=lambda x: x["sum_us"])["chunk"]
    log(f"tune chunk: {sweep['chunk']}")
    del data
    torch.cuda.empty_cache()
    return best, best_chunk, sweep


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="output folder (default out/decode)")
    ap.add_argument("--quick", action="store_true", help="two checks, the targets' shapes first")
    ap.add_argument("--no-tune", action="store_true")
    ap.add_argument("--only", default=None, help="comma list of model:B:N, e.g. llama-3.1-8b:8:32768 (one check)")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    header = {
        "gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
        "triton": triton.__version__, "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%d %H:%M"),
        "budget": {"ratio": BUDGET.ratio, "k_min": BUDGET.k_min}, "dtype": "bf16",
    }
    log(f"# {header}")
    t0 = time.time()
    checks = check(dev, CHECKS[:1] if args.only else CHECKS[::2] if args.quick else CHECKS)
    log(f"checks passed in {time.time() - t0:.1f}s")
    header["copy_TBps"] = copy_bandwidth(dev)
    header["graph_floor_us"] = graph_floor(dev, bench)
    log(f"replay of a graph of one empty kernel: {header['graph_floor_us']:.1f} us")
    log(f"device copy bandwidth (read + write): {header['copy_TBps']:.2f} TB/s")

    cfg = {"split": {}, "sparse": {}, "chunk": None}
    sweep = None
    if not args.no_tune:
        best, best_chunk, sweep = tune(dev)
        cfg = {"split": best["split"][1], "sparse": best["sparse"][1], "chunk": best_chunk}
        log(f"using {cfg}")
    header["config"] = cfg

    free = torch.cuda.mem_get_info()[0]
    rows = []
    out_dir = out_folder(args.out, "decode")

    def write():  # after every shape, so that a run cut short keeps what it measured
        result = {"header": header, "checks": checks, "rows": rows, "sweep": sweep}
        (out_dir / "decode.json").write_text(json.dumps(result, indent=1))

    shapes = [(m, B, N) for m in MODELS for B in (1, 8, 32) for N in (8192, 32768, 131072, 524288)]
    if args.quick:  # the targets' shapes first (Llama, N >= 32K), then the rest
        shapes.sort(key=lambda x: (x[0] != "llama-3.1-8b", x[2] < 32768))
    if args.only:
        shapes = [(m, int(b), int(n)) for m, b, n in (x.split(":") for x in args.only.split(","))]
    for model, B, N in shapes:
        HQ, H, D = MODELS[model]
        need = 2 * B * H * N * D * 2 + B * HQ * N * 4 * 2 + B * H * N * 4 * 2
        if need > 0.8 * free:
            log(f"skip {model} B={B} N={N}: {need / 2**30:.0f} GiB")
            continue
        r = measure(B, HQ, H, N, D, dev, cfg, eager=not args.quick)
        r["model"] = model
        rows.append(r)
        t = r["times_us"]
        log(f"{model} B={B} N={N}: dense {t['dense']:.1f} (sdpa {t['sdpa']:.1f}, ours {t['dense_ours']:.1f}) "
            f"reuse {t['reuse']:.1f} anchor {t['anchor']:.1f} layer0 {t['layer0']:.1f} "
            f"select radix {t['select_radix']:.1f} topk {t['select_topk']:.1f} score {t['score_only']:.1f} "
            f"pool nohist/hist {t['pool_nohist']:.1f}/{t['pool_hist']:.1f} "
            f"gather only {t['gather_only']:.1f} stream only {t['stream_only']:.1f} "
            f"-> model {r['model_speedup']:.2f}x")
        write()
        torch.cuda.empty_cache()

    write()

    lines = [
        f"GPU {header['gpu']} ({header['sms']} SMs), torch {header['torch']}, triton {header['triton']}, "
        f"CUDA {header['cuda']}, bf16, Budget(ratio=0.1, k_min=128), copy {header['copy_TBps']:.2f} TB/s",
        "times in us (CUDA-graph replay, do_bench median, L2 flushed); x = ratio to dense in the same run",
        "| model | B | N | dense (SDPA / ours) | layer 0 | anchor | reuse | reuse x | anchor x | select radix / topk / score"
        " | reuse TB/s gathered | model avg |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t = r["times_us"]
        lines.append(
            f"| {r['model']} | {r['B']} | {r['N'] // 1024}K | {t['dense']:.1f} ({t['sdpa']:.1f} / {t['dense_ours']:.1f}) "
            f"| {t['layer0']:.1f} | {t['anchor']:.1f} | {t['reuse']:.1f} | {r['reuse_x']:.3f} | {r['anchor_x']:.3f} "
            f"| {t['select_radix']:.1f} / {t['select_topk']:.1f} / {t['score_only']:.1f} "
            f"| {r['reuse_gathered_TBps']:.2f} "
            f"| {r['model_speedup']:.2f}x |")
    table = "\n".join(lines)
    (out_dir / "decode_table.md").write_text(table + "\n")
    log(table)


if __name__ == "__main__":
    main()
