"""FP8 and INT8 scoring on the GPU: the anchors' speed with e4m3 and int8 scoring against exact scoring and the best
dense kernel in the same run, and what each selection keeps of the exact one on random inputs (one GPU call).

    python -m benchmarks.fp8_scoring [--out DIR] [--quick]

For Llama-3.1-8B attention shapes (32 query heads, 8 KV heads, D = 128) and the default model's (9 / 3, D = 64),
bf16, Budget(ratio=0.1, k_min=128, tile=32), exact and with ``score_dtype`` "fp8" (:mod:`kascade.ops.fp8`) and
"int8" (:mod:`kascade.ops.int8`); every figure of a quantised scoring carries its suffix, ``_fp8`` or ``_int8``:

* prefill, B = 1, N in 32K / 128K: cuDNN SDPA (the dense baseline), the anchor layer (selection with its own LSE
  pass, then the sparse pass), its parts (quantising q and k, the LSE pass, the selection), layer 0 (``layer0``:
  its dense pass ours; ``layer0_cudnn``: cuDNN's, ``prefill.CUDNN_LAYER0``; ``layer0_peak_mb*``: the memory each
  allocates at its peak, in MiB) and a reuse layer, and the model average
  of 5 anchors in 32 layers (1 layer 0 + 4 anchors + 27 reuse layers; ``model_avg_cudnn*``: with ``layer0_cudnn``);
* decode, B in 1 / 32, N in 32K / 128K, each call captured in a CUDA graph and replayed: dense (the faster of SDPA
  and our split-K kernel), the anchor layer with exact scoring and with FP8 / INT8 scoring over an 8-bit copy of the
  keys (what a decode step keeping its anchors' keys in 8 bits reads; the copy's bytes are reported), its selection
  alone, layer 0, a reuse layer, and the model average;
* selection agreement (random inputs, whose near-uniform attention is a hard case for ranking): per row the share of
  the exact selection's keys that the FP8 (INT8) selection keeps, ``kept_share`` (``kept_share_int8``), and
  (decode) the share of the exact selection's pooled probability that it holds, ``mass_share`` (``mass_share_int8``).

Writes fp8_scoring.json and a text summary under --out (default out/fp8_scoring). ``--quick``: small shapes only (a
smoke test that runs on any CUDA GPU in seconds).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch
import torch.nn.functional as F
import triton

from benchmarks.common import log, out_folder
from benchmarks.common.shapes import DECODE_BUDGET, MODELS, PREFILL_BUDGET, decode_inputs, prefill_inputs
from benchmarks.common.timing import graph_us, median_ms
from kascade.ops import reference
from kascade.ops.step import decode_meta
from kascade.ops.triton import decode as td
from kascade.ops.triton import fp8 as tf
from kascade.ops.triton import int8 as ti

QUANTISED = {"_fp8": "fp8", "_int8": "int8"}  # a figure's suffix -> its score_dtype
from kascade.ops.triton import prefill as tp


def kept_share(a: torch.Tensor, b: torch.Tensor, n: int, rows_per_chunk: int = 2048) -> float:
    """Mean over rows of |a ∩ b| / |a| for index rows ``a``, ``b`` ``[..., K]`` (-1 padding) of keys ``< n``."""
    a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    shares = []
    for r0 in range(0, a.shape[0], rows_per_chunk):
        ra, rb = a[r0:r0 + rows_per_chunk].long(), b[r0:r0 + rows_per_chunk].long()
        mask = torch.zeros(ra.shape[0], n + 1, dtype=torch.bool, device=a.device)
        mask.scatter_(1, torch.where(rb >= 0, rb, n), True)
        mask[:, n] = False
        hit = mask.gather(1, torch.where(ra >= 0, ra, n)).sum(1)
        size = (ra >= 0).sum(1)
        ok = size > 0
        shares.append((hit[ok].float() / size[ok].float()))
    return float(torch.cat(shares).mean())


def _ratios(row: dict, dense: float) -> None:
    """The anchor's ratio to ``dense`` and the model average (32 dense layers over layer 0 + 4 anchors + 27 reuse
    layers), exact, FP8 and INT8, into ``row``."""
    for tag in ("", *QUANTISED):
        row["anchor_x" + tag] = row["anchor" + tag] / dense
        for l0 in ("", "_cudnn"):  # prefill has layer 0 with cuDNN's dense pass too (layer0_cudnn)
            if "layer0" + l0 in row:
                row["model_avg" + l0 + tag] = 32 * dense / (row["layer0" + l0] + 4 * row["anchor" + tag]
                                                            + 27 * row["reuse"])


def prefill_row(name, HQ, H, D, N) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = prefill_inputs(HQ, H, D, N, seed=N)
    sc, G = D**-0.5, HQ // H
    exact = PREFILL_BUDGET
    budgets = {"": exact, **{tag: replace(exact, score_dtype=sd) for tag, sd in QUANTISED.items()}}
    row = dict(model=name, B=1, N=N)
    ke, ve = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        row["cudnn"] = median_ms(lambda: F.scaled_dot_product_attention(q, ke, ve, is_causal=True))
    del ke, ve
    row["lse"] = median_ms(lambda: tp.prefill_lse(q, k, scale=sc))
    for tag, sd in QUANTISED.items():
        row["quantize_qk" + ("" if sd == "fp8" else tag)] = median_ms(lambda: tp.quantized(q, k, sd))
        q8, k8, sq, sk = tp.quantized(q, k, sd)
        row["lse" + tag] = median_ms(lambda: tp.prefill_lse(q8, k8, scale=sc, fp8=(sq, sk)))
        del q8, k8, sq, sk
    for tag, b in budgets.items():
        row["select" + tag] = median_ms(lambda: tp.select_prefill(q, k, budget=b, scale=sc))
        row["select_scores_only" + tag] = median_ms(lambda: tp.select_prefill(q, k, budget=b, scale=sc,
                                                                             scores_only=True))
        row["anchor" + tag] = median_ms(lambda: tp.anchor_prefill(q, k, v, budget=b, scale=sc))
    for tag, on in (("", False), ("_cudnn", True)):  # layer 0's dense pass ours, then cuDNN's (tp.CUDNN_LAYER0)
        was, tp.CUDNN_LAYER0 = tp.CUDNN_LAYER0, on
        try:
            row["layer0" + tag] = median_ms(lambda: tp.dense_select_prefill(q, k, v, budget=exact, scale=sc))
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            tp.dense_select_prefill(q, k, v, budget=exact, scale=sc)
            row["layer0_peak_mb" + tag] = (torch.cuda.max_memory_allocated() - base) / 2**20  # above the inputs'
        finally:
            tp.CUDNN_LAYER0 = was
    sel = tp.select_prefill(q, k, budget=exact, scale=sc)
    row["reuse"] = median_ms(lambda: tp.sparse_prefill(q, k, v, sel, scale=sc))
    for tag in QUANTISED:
        sel8 = tp.select_prefill(q, k, budget=budgets[tag], scale=sc)
        row["kept_share" + ("" if tag == "_fp8" else tag)] = kept_share(sel.indices, sel8.indices, N)
        del sel8
    del sel
    _ratios(row, row["cudnn"])
    log(f"prefill {name} N={N}: cudnn {row['cudnn']:.2f} ms | anchor {row['anchor']:.2f} ({row['anchor_x']:.2f}x) "
        f"fp8 {row['anchor_fp8']:.2f} ({row['anchor_x_fp8']:.2f}x) | lse {row['lse']:.2f} / {row['lse_fp8']:.2f} | "
        f"quantize {row['quantize_qk']:.2f} | model {row['model_avg']:.2f}x / {row['model_avg_fp8']:.2f}x | "
        f"kept {row['kept_share']:.4f} | int8: anchor {row['anchor_int8']:.2f} ({row['anchor_x_int8']:.2f}x) lse "
        f"{row['lse_int8']:.2f} model {row['model_avg_int8']:.2f}x kept {row['kept_share_int8']:.4f} | layer 0 "
        f"{row['layer0']:.2f}, cuDNN's dense pass {row['layer0_cudnn']:.2f}")
    return row


def decode_row(name, HQ, H, D, B, N) -> dict:
    q, k, v = decode_inputs(B, HQ, H, N, D, "cuda", seed=N + B)
    sc, dev = D**-0.5, q.device
    exact = DECODE_BUDGET
    budgets = {"": exact, **{tag: replace(exact, score_dtype=sd) for tag, sd in QUANTISED.items()}}
    meta = decode_meta(B, device=dev, q_offset=N - 1, budget=exact)
    row = dict(model=name, B=B, N=N)
    out = torch.empty_like(q)
    row["sdpa"] = graph_us(lambda: F.scaled_dot_product_attention(q, k, v, scale=sc, enable_gqa=True))
    row["dense_ours"] = graph_us(lambda: td.dense_decode(q, k, v, scale=sc, meta=meta, out=out))
    row["dense"] = min(row["sdpa"], row["dense_ours"])
    copies = {"_fp8": tf.quantize(k), "_int8": ti.quantize(k)}  # the anchors' keys kept in 8 bits
    row["fp8_copy_mb"] = (copies["_fp8"][0].numel() + 4 * copies["_fp8"][1].numel()) / 2**20  # (int8's the same)
    sel = td.select_decode(q, k, budget=exact, scale=sc, meta=meta)
    row["reuse"] = graph_us(lambda: td.sparse_decode(q, k, v, sel.indices, scale=sc, out=out))
    row["layer0"] = graph_us(lambda: td.dense_select_decode(q, k, v, budget=exact, scale=sc, meta=meta, out=out))
    for tag, b in budgets.items():
        kw = {"k_quant": copies[tag]} if tag else {}
        row["select" + tag] = graph_us(lambda: td.select_decode(q, k, budget=b, scale=sc, meta=meta, **kw))

        def anchor():
            s = td.select_decode(q, k, budget=b, scale=sc, meta=meta, **kw)
            td.sparse_decode(q, k, v, s.indices, scale=sc, out=out)

        row["anchor" + tag] = graph_us(anchor)
    for tag in QUANTISED:
        sel8 = td.select_decode(q, k, budget=budgets[tag], scale=sc, meta=meta, k_quant=copies[tag])
        suffix = "" if tag == "_fp8" else tag
        row["kept_share" + suffix] = kept_share(sel.indices, sel8.indices, N)
        # the exact pooled probabilities (the reference's) each selection holds, a sequence at a time
        shares = []
        for i in range(B):
            p = reference.pooled_decode(q[i].float(), k[i].float(), sc)  # [H, N]
            m = [torch.where(s.indices[i, :, 0] >= 0, p.gather(-1, s.indices[i, :, 0].long().clamp_min(0)), 0)
                 .sum(-1) for s in (sel, sel8)]
            shares.append(m[1] / m[0])
        row["mass_share" + suffix] = float(torch.cat(shares).mean())
    _ratios(row, row["dense"])
    log(f"decode {name} B={B} N={N}: dense {row['dense']:.1f} us | anchor {row['anchor']:.1f} ({row['anchor_x']:.2f}x)"
        f" fp8 {row['anchor_fp8']:.1f} ({row['anchor_x_fp8']:.2f}x) | select {row['select']:.1f} / "
        f"{row['select_fp8']:.1f} | model {row['model_avg']:.2f}x / {row['model_avg_fp8']:.2f}x | kept "
        f"{row['kept_share']:.4f} mass {row['mass_share']:.5f} | int8: anchor {row['anchor_int8']:.1f} "
        f"({row['anchor_x_int8']:.2f}x) select {row['select_int8']:.1f} model {row['model_avg_int8']:.2f}x kept "
        f"{row['kept_share_int8']:.4f}")
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--out", default=None, help="folder for fp8_scoring.json (default out/fp8_scoring)")
    ap.add_argument("--quick", action="store_true", help="small shapes only: a smoke test")
    ap.add_argument("--parts", default="prefill,decode", help="comma list of prefill, decode")
    args = ap.parse_args(argv)
    out = out_folder(args.out, "fp8_scoring")
    assert torch.cuda.is_available(), "this benchmark times kernels on a CUDA GPU"
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.cuda.get_device_name()
    res = dict(device=dev, torch=torch.__version__, triton=triton.__version__, prefill=[], decode=[])
    log(f"{dev}, torch {torch.__version__}, triton {triton.__version__}")
    ns = (4096,) if args.quick else (32768, 131072)
    parts = args.parts.split(",")
    for name, (HQ, H, D) in MODELS.items():
        if "prefill" in parts:
            for N in ns:
                res["prefill"].append(prefill_row(name, HQ, H, D, N))
                torch.cuda.empty_cache()
                (out / "fp8_scoring.json").write_text(json.dumps(res, indent=1))  # an interrupted run keeps its rows
        if "decode" in parts:
            for B in ((1,) if args.quick else (1, 32)):
                for N in ns:
                    res["decode"].append(decode_row(name, HQ, H, D, B, N))
                    torch.cuda.empty_cache()
                    (out / "fp8_scoring.json").write_text(json.dumps(res, indent=1))
    log("wrote", out / "fp8_scoring.json")


if __name__ == "__main__":
    main()
