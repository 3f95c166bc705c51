"""Measured vs modelled: the whole-model attention time of a plan, timed layer after layer, against the cost model.

    python -m benchmarks.plan_speed --device cuda --plans default fast balanced faithful PLAN.json \
        --mode decode --batch 32 --length 131072 --out OUT

The cost model (:func:`kascade.costs.plan_speedup`) adds up per-layer kernel times measured one layer kind at a time.
This script checks that sum on the GPU: every plan is run as one forward pass of ``kascade.Attention`` over all its
layers (layer 0 dense + selection, its anchors, its reuse layers with their per-layer budgets and reuse rule), on
random inputs of an attention shape (default: Llama-3.1-8B's, as the frontier's modelled speedups use), and timed
against the same number of dense layers (the faster of torch's SDPA -- cuDNN first for prefill -- and Kascade's own
dense kernel, as the cost model's ``best`` baseline).

A plan made for another model (the default model's: 3 KV heads) is *transplanted* to the shape: same layers, anchors,
budgets and per-layer budget factors; head map identity and every reuse source follows the same head (which head a reuse
layer follows does not change what it costs). The layers alternate between two sets of random q / k / v, each larger
than the L2 cache. Times (:func:`kascade.costs_measure.cuda_us`) are medians of ``--repeats`` CUDA-event timed
passes after a warm-up pass (passes under 15 ms: ``triton.testing.do_bench``). Writes OUT/plan_speed.json and
OUT/plan_speed.md after every plan.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import kascade
from kascade import costs, ops
from kascade.bench.report import environment
from kascade.costs_measure import cuda_us, shape_named, wall_us
from kascade.plan import KascadePlan, ModelFingerprint
from kascade.plan.shipped import shipped_plans


PREFILL_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def load_plan(spec: str) -> KascadePlan:
    """A shipped plan of the default model by variant name ('default', 'fast', ...), or a plan JSON file."""
    if spec.endswith(".json") or "/" in spec:
        return KascadePlan.load(spec)
    plans = shipped_plans(spec)
    if len(plans) != 1:
        raise SystemExit(f"variant {spec!r}: expected one shipped plan, found {len(plans)}")
    return plans[0]


def transplant(plan: KascadePlan, shape) -> KascadePlan:
    """``plan``'s layer roles, budgets and reuse rule on ``shape``'s heads (head map identity, sources per head)."""
    fp = plan.fingerprint
    new_fp = ModelFingerprint(fp.architecture, fp.num_layers, shape.num_q_heads, shape.num_kv_heads, shape.head_dim)
    H, old_H = shape.num_kv_heads, fp.num_kv_heads
    reuse = plan.reuse
    if reuse.sources is not None:
        # head h keeps the anchor layers (and their number) of old head h % old_H, each pair on head h itself
        sources = tuple(tuple(tuple((al, h) for al, _ in row[h % old_H]) for h in range(H)) for row in reuse.sources)
        reuse = dataclasses.replace(reuse, sources=sources)
    by_length = tuple((n, transplant(p, shape)) for n, p in plan.by_length)
    return dataclasses.replace(plan, fingerprint=new_fp, head_map=tuple(tuple(range(H)) for _ in plan.head_map),
                               reuse=reuse, by_length=by_length)


def _time_ms(fn, device, repeats: int) -> float:
    """Median ms after a warm-up: CUDA-event timed passes on a GPU (do_bench below 15 ms), wall clock on the CPU."""
    return (cuda_us(fn, long_repeats=repeats) if device.type == "cuda" else wall_us(fn, repeats)) / 1e3


def inputs(shape, mode: str, batch: int, length: int, device, dtype, sets: int = 2):
    g = torch.Generator(device=device).manual_seed(0)
    L = 1 if mode == "decode" else length
    out = []
    for _ in range(sets):
        q = torch.randn(batch, shape.num_q_heads, L, shape.head_dim, device=device, dtype=dtype, generator=g)
        k = torch.randn(batch, shape.num_kv_heads, length, shape.head_dim, device=device, dtype=dtype, generator=g)
        v = torch.randn(batch, shape.num_kv_heads, length, shape.head_dim, device=device, dtype=dtype, generator=g)
        out.append((q, k, v))
    return out


def dense_pass(layers: int, data, mode: str, kernel: str):
    causal = mode == "prefill"

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

    def ours(q, k, v):  # Kascade's dense kernel (the public ops default to the reference backend)
        return ops.dense_attention(q, k, v, backend="triton" if q.device.type == "cuda" else "reference")

    fn = {"sdpa": sdpa, "ours": ours}[kernel]
    on_cuda = data[0][0].device.type == "cuda"

    def run():
        # prefill SDPA: cuDNN first (the dense baseline of the kernel benchmarks), chosen once for the whole pass
        with sdpa_kernel(PREFILL_BACKENDS) if causal and on_cuda and kernel == "sdpa" else contextlib.nullcontext():
            for layer in range(layers):
                fn(*data[layer % len(data)])
    return run


def kascade_pass(plan: KascadePlan, data, backend: str):
    attn = kascade.Attention(plan, backend=backend)

    def run():
        fwd = kascade.Forward()
        for layer in range(plan.num_layers):
            attn(layer, *data[layer % len(data)], fwd)
    return run


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plans", nargs="+", default=["default", "fast", "balanced", "faithful"],
                   help="shipped variants of the default model or plan JSON files (default: default fast balanced "
                        "faithful)")
    p.add_argument("--mode", choices=costs.MODES, default="decode", help="decode (one query) or prefill (causal)")
    p.add_argument("--batch", type=int, default=None, help="batch size (default: 32 decode, 1 prefill)")
    p.add_argument("--length", type=int, default=costs.DEFAULT_LENGTH, help="keys per sequence (default: 131072)")
    p.add_argument("--shape", default=costs.DEFAULT_SHAPE, help="attention shape (default: llama-3.1-8b)")
    p.add_argument("--device", default="cuda", help="device (default: cuda)")
    p.add_argument("--backend", default="auto", choices=("auto", *ops.BACKENDS), help="Kascade backend")
    p.add_argument("--dense", nargs="+", choices=("sdpa", "ours"), default=["sdpa", "ours"],
                   help="dense kernels timed; the faster is the baseline (default: both)")
    p.add_argument("--repeats", type=int, default=5, help="timed passes per measurement of a pass over 15 ms; shorter ones: do_bench (default: 5)")
    p.add_argument("--out", required=True, help="output folder")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batch = args.batch or costs.DEFAULT_BATCH[args.mode]
    shape = shape_named(args.shape)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plans = [(spec, load_plan(spec)) for spec in args.plans]  # every plan loads before any timing
    layers = {p.num_layers for _, p in plans}
    if len(layers) != 1:
        raise SystemExit(f"the plans have different layer counts {sorted(layers)}: time them in separate runs")
    (num_layers,) = layers
    data = inputs(shape, args.mode, batch, args.length, device, dtype)
    result = {"environment": environment(device), "mode": args.mode, "batch": batch, "length": args.length,
              "shape": dataclasses.asdict(shape), "layers": num_layers, "dtype": str(dtype), "dense_ms": {}, "plans": []}
    for kernel in args.dense:
        result["dense_ms"][kernel] = _time_ms(dense_pass(num_layers, data, args.mode, kernel), device, args.repeats)
        print(f"dense {kernel}: {result['dense_ms'][kernel]:.3f} ms for {num_layers} layers", flush=True)
    dense = min(result["dense_ms"].values())
    for spec, plan in plans:
        t = _time_ms(kascade_pass(transplant(plan, shape), data, args.backend), device, args.repeats)
        try:
            modelled = costs.plan_speedup(plan, args.mode, length=args.length, batch=batch, shape=args.shape)
        except (KeyError, ValueError) as e:  # the shipped table has no such configuration
            modelled, why = None, str(e)
        row = {"plan": spec, "anchors": list(plan.anchors), "ms": t, "measured": dense / t, "modelled": modelled}
        if modelled is None:
            row["modelled_missing"] = why
        result["plans"].append(row)
        print(f"{spec}: {t:.3f} ms, measured {dense / t:.2f}x, modelled "
              f"{'-' if modelled is None else f'{modelled:.2f}x'}", flush=True)
        write(result, out)
    return result


def write(result: dict, out: Path) -> None:
    (out / "plan_speed.json").write_text(json.dumps(result, indent=1) + "\n")
    r = result
    lines = [f"# Plans: measured vs modelled attention speedup ({r['mode']}, B={r['batch']}, N={r['length']}, "
             f"{r['shape']['name']} shape, {r['layers']} layers)", "",
             f"Machine: {r['environment']['device']}, torch {r['environment']['torch']}, triton "
             f"{r['environment']['triton']}; dense per pass: " +
             ", ".join(f"{k} {v:.3f} ms" for k, v in r["dense_ms"].items()) + " (the faster is the baseline)." +
             (f" {r['note']}" if r.get("note") else ""), "",
             "| plan | anchors | Kascade ms | measured | modelled | measured / modelled |", "|---|---|---|---|---|---|"]
    for row in r["plans"]:
        m, got = row["modelled"], row["measured"]
        model_s = "-" if m is None else f"{m:.2f}x"
        ratio_s = "-" if m is None else f"{got / m:.2f}"
        lines.append(f"| {row['plan']} | {len(row['anchors'])}: {row['anchors']} | {row['ms']:.3f} | "
                     f"{got:.2f}x | {model_s} | {ratio_s} |")
    (out / "plan_speed.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
