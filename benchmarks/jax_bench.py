"""The JAX path on a GPU: Kascade's JAX ops (``kascade.jax``, backend "triton": the Triton kernels through DLPack)
against JAX's own dense attention, and against the same kernels called from torch (the bridge's overhead).

    XLA_PYTHON_CLIENT_PREALLOCATE=false python -m benchmarks.jax_bench --out OUT

For each configuration (shape, mode, batch, length; bf16, random inputs, 10% budget):
- JAX dense: ``jax.nn.dot_product_attention`` (cuDNN, and XLA), jitted, on ``[B, N, heads, D]`` arrays;
- JAX Kascade: ``kascade.jax.dense_attention`` (layer 0's output), ``select`` + ``sparse_attention`` (an anchor
  layer) and ``sparse_attention`` alone (a reuse layer), backend "triton", eager;
- torch Kascade: the same three through :mod:`kascade.ops` (backend "triton") on torch tensors, each call planning
  its own step as the JAX ops do (the difference is the bridge: argument checks in JAX and DLPack views);
- for decode, ``kascade.jax`` backend "reference" under ``jax.jit`` (XLA's code for the specification);
- the planned path, as a model's forward runs it: :class:`kascade.jax.Attention` (backend "triton") and
  :class:`kascade.Attention` (the PyTorch runtime it hands the buffers to), one step plan per pass, no value checks,
  layer 1 an anchor and layer 2 a reuse layer of a 3-layer plan; with torch's dense attention (SDPA, cuDNN first)
  timed the same way, so that the per-layer ratios of both frameworks can be set side by side.
Each time is the mean of a loop of calls synchronised once (host dispatch included, as a decode loop pays it), the
median of five loops after warm-up. Before timing, the JAX outputs are checked against the torch ops' (same kernels:
equal) and, at the smallest configuration, against the JAX reference (dtype tolerance). Writes OUT/jax.json and
OUT/jax_table.md after every configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import kascade  # noqa: E402
import kascade.jax as kj  # noqa: E402
from kascade import Budget, KascadePlan, ModelFingerprint, ops  # noqa: E402
from kascade.bench.report import environment  # noqa: E402

SHAPES = {"llama-3.1-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}
CONFIGS = (  # shape, mode, batch, length
    ("llama-3.1-8b", "decode", 1, 1024),  # small: what a call costs beyond its kernels
    ("llama-3.1-8b", "prefill", 1, 8192), ("llama-3.1-8b", "decode", 1, 131072), ("llama-3.1-8b", "decode", 8, 32768),
    ("smollm2-135m", "prefill", 1, 8192), ("smollm2-135m", "decode", 8, 32768),
)


def _sync(x=None):
    if x is not None:
        jax.block_until_ready(x)
    torch.cuda.synchronize()


def time_us(fn, loops: int = 5, calls: int | None = None) -> float:
    out = fn()
    _sync(out)
    t = time.perf_counter()
    out = fn()
    _sync(out)
    once = time.perf_counter() - t
    calls = calls or max(1, min(50, int(0.05 / max(once, 1e-6))))
    ts = []
    for _ in range(loops):
        t = time.perf_counter()
        for _ in range(calls):
            out = fn()
        _sync(out)
        ts.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(ts)


def _leaves(x):
    return [x.indices, x.row_start] if isinstance(x, kj.Selection) else [x]


def run_config(shape: str, mode: str, B: int, N: int, budget: Budget, check_reference: bool) -> dict:
    HQ, H, D = SHAPES[shape]
    L = 1 if mode == "decode" else N
    g = torch.Generator(device="cuda").manual_seed(0)
    tq = torch.randn(B, HQ, L, D, device="cuda", dtype=torch.bfloat16, generator=g)
    tk = torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
    tv = torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, v = (jax.dlpack.from_dlpack(t) for t in (tq, tk, tv))  # the same bytes on both sides
    row = {"shape": shape, "mode": mode, "batch": B, "length": N, "us": {}, "checks": {}}

    # correctness before timing
    sel_j = kj.select(q, k, budget=budget, backend="triton")
    out_j = kj.sparse_attention(q, k, v, sel_j, backend="triton")
    sel_t = ops.select(tq, tk, budget=budget, backend="triton")
    out_t = ops.sparse_attention(tq, tk, tv, sel_t, backend="triton")
    got = torch.from_dlpack(out_j)
    row["checks"]["sparse_jax_vs_torch_max_abs"] = float((got.float() - out_t.float()).abs().max())
    dj = torch.from_dlpack(kj.dense_attention(q, k, v, backend="triton"))
    row["checks"]["dense_jax_vs_torch_max_abs"] = float((dj.float() - ops.dense_attention(tq, tk, tv, backend="triton").float()).abs().max())
    if check_reference:
        ref_sel = kj.select(q.astype(jnp.float32), k.astype(jnp.float32), budget=budget)
        ref = kj.sparse_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), ref_sel)
        row["checks"]["sparse_vs_jax_reference_max_abs"] = float(jnp.max(jnp.abs(out_j.astype(jnp.float32) - ref)))

    # JAX dense, [B, N, heads, D]
    qb, kb, vb = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    for impl in ("cudnn", "xla"):
        f = jax.jit(lambda a, b, c, impl=impl: jax.nn.dot_product_attention(a, b, c, is_causal=mode == "prefill",
                                                                             implementation=impl))
        try:
            row["us"][f"jax_dense_{impl}"] = time_us(lambda: f(qb, kb, vb))
        except Exception as e:  # noqa: BLE001 -- an implementation that does not take this shape: recorded
            row["us"][f"jax_dense_{impl}"] = None
            row.setdefault("notes", []).append(f"jax.nn.dot_product_attention({impl}): {type(e).__name__}: "
                                               f"{str(e).splitlines()[0][:200]}")
    # Kascade through JAX (triton, eager) and through torch
    row["us"]["jax_layer0_dense"] = time_us(lambda: kj.dense_attention(q, k, v, backend="triton"))
    row["us"]["jax_anchor"] = time_us(lambda: kj.sparse_attention(
        q, k, v, kj.select(q, k, budget=budget, backend="triton"), backend="triton"))
    row["us"]["jax_reuse"] = time_us(lambda: kj.sparse_attention(q, k, v, sel_j, backend="triton"))
    tri = dict(backend="triton")
    row["us"]["torch_layer0_dense"] = time_us(lambda: ops.dense_attention(tq, tk, tv, **tri))
    row["us"]["torch_anchor"] = time_us(lambda: ops.sparse_attention(tq, tk, tv, ops.select(tq, tk, budget=budget,
                                                                                             **tri), **tri))
    row["us"]["torch_reuse"] = time_us(lambda: ops.sparse_attention(tq, tk, tv, sel_t, **tri))
    if mode == "decode":
        sel_r = jax.jit(kj.select, static_argnames=("budget",))
        att_r = jax.jit(kj.sparse_attention)
        row["us"]["jax_reference_jit_anchor"] = time_us(lambda: att_r(q, k, v, sel_r(q, k, budget=budget)))
        sel_ref = sel_r(q, k, budget=budget)
        row["us"]["jax_reference_jit_reuse"] = time_us(lambda: att_r(q, k, v, sel_ref))
    planned(row, (q, k, v), (tq, tk, tv), budget, causal=mode == "prefill")
    dense = [t for key, t in row["us"].items() if key.startswith("jax_dense") and t is not None]
    row["jax_dense_best_us"] = min(dense) if dense else None
    return row


def planned(row: dict, jax_qkv, torch_qkv, budget: Budget, causal: bool) -> None:
    """The planned path of both frameworks (module docstring) and torch's dense attention, into ``row``."""
    (q, k, v), (tq, tk, tv) = jax_qkv, torch_qkv
    HQ, H, D = tq.shape[1], tk.shape[1], tq.shape[-1]
    plan = KascadePlan(ModelFingerprint("bench", 3, HQ, H, D), (0, 1), (tuple(range(H)),) * 3, ratio=budget.ratio,
                       k_min=budget.k_min, tile=budget.tile)
    jattn, tattn = kj.Attention(plan, backend="triton"), kascade.Attention(plan, backend="triton")
    jf, tf = kj.Forward(), kascade.Forward()
    outs = [(jattn(layer, q, k, v, jf), tattn(layer, tq, tk, tv, tf)) for layer in range(3)]
    row["checks"]["planned_jax_vs_torch_max_abs"] = max(
        float((torch.from_dlpack(j).float() - t.float()).abs().max()) for j, t in outs)
    row["us"]["jax_planned_anchor"] = time_us(lambda: jattn(1, q, k, v, jf))
    row["us"]["jax_planned_reuse"] = time_us(lambda: jattn(2, q, k, v, jf))
    row["us"]["torch_planned_anchor"] = time_us(lambda: tattn(1, tq, tk, tv, tf))
    row["us"]["torch_planned_reuse"] = time_us(lambda: tattn(2, tq, tk, tv, tf))
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    best = []
    for backends in ([SDPBackend.CUDNN_ATTENTION], None):  # cuDNN alone, then PyTorch's own choice
        try:
            if backends is None:
                best.append(time_us(lambda: sdpa(tq, tk, tv, is_causal=causal, enable_gqa=True)))
            else:
                with sdpa_kernel(backends):
                    best.append(time_us(lambda: sdpa(tq, tk, tv, is_causal=causal, enable_gqa=True)))
        except RuntimeError as e:  # a backend that does not take this shape: recorded
            row.setdefault("notes", []).append(f"torch SDPA {backends}: {str(e).splitlines()[0][:200]}")
    row["us"]["torch_dense_best"] = min(best) if best else None


def write(result: dict, out: Path) -> None:
    (out / "jax.json").write_text(json.dumps(result, indent=1) + "\n")
    env = result["environment"]
    lines = [f"# The JAX path on a GPU ({env['device']})", "",
             f"jax {result['jax']}, torch {env['torch']}, triton {env['triton']}; bf16, 10% budget; "
             "times in us (mean per call in a loop, host dispatch included; median of 5 loops). Ratios: to the "
             "faster of JAX's cuDNN and XLA dense attention.", "",
             "| shape | mode | B | N | JAX dense best | JAX anchor | JAX reuse | anchor / dense | reuse / dense | "
             "torch anchor | torch reuse | JAX ref (jit) anchor | JAX ref (jit) reuse |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(x, fmt=".1f"):
        return "-" if x is None else format(x, fmt)

    for r in result["rows"]:
        u, d = r["us"], r["jax_dense_best_us"]
        ra = None if d is None else u["jax_anchor"] / d
        rr = None if d is None else u["jax_reuse"] / d
        lines.append(f"| {r['shape']} | {r['mode']} | {r['batch']} | {r['length']} | {f(d)} | {f(u['jax_anchor'])} | "
                     f"{f(u['jax_reuse'])} | {f(ra, '.2f')}x | {f(rr, '.2f')}x | {f(u['torch_anchor'])} | "
                     f"{f(u['torch_reuse'])} | {f(u.get('jax_reference_jit_anchor'))} | "
                     f"{f(u.get('jax_reference_jit_reuse'))} |")
    lines += ["", "The planned path (a pass of `kascade.jax.Attention` / `kascade.Attention`, one step plan per pass; "
              "us per layer call; ratios to each framework's best dense attention in this run):", "",
              "| shape | mode | B | N | JAX anchor | JAX reuse | torch anchor | torch reuse | JAX / torch anchor | "
              "JAX / torch reuse | JAX anchor / dense | JAX reuse / dense | torch anchor / dense | "
              "torch reuse / dense |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        u, dj, dt = r["us"], r["jax_dense_best_us"], r["us"].get("torch_dense_best")
        if "jax_planned_anchor" not in u:
            continue
        ja, jr, ta, tr = (u[f"{w}_planned_{x}"] for w in ("jax", "torch") for x in ("anchor", "reuse"))
        lines.append(f"| {r['shape']} | {r['mode']} | {r['batch']} | {r['length']} | {f(ja)} | {f(jr)} | {f(ta)} | "
                     f"{f(tr)} | {f(ja / ta, '.2f')}x | {f(jr / tr, '.2f')}x | "
                     f"{f(None if dj is None else ja / dj, '.2f')}x | {f(None if dj is None else jr / dj, '.2f')}x | "
                     f"{f(None if dt is None else ta / dt, '.2f')}x | {f(None if dt is None else tr / dt, '.2f')}x |")
    lines += ["", "Checks (max abs difference): " + "; ".join(
        f"{r['shape']} {r['mode']} B={r['batch']} N={r['length']}: " +
        ", ".join(f"{k} {v:.3g}" for k, v in r["checks"].items()) for r in result["rows"])]
    notes = [n for r in result["rows"] for n in r.get("notes", [])]
    if notes:
        lines += ["", "Notes:", *[f"- {n}" for n in notes]]
    (out / "jax_table.md").write_text("\n".join(lines) + "\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output folder")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or jax.default_backend() != "gpu":
        raise SystemExit(f"needs a CUDA GPU seen by torch and by JAX (torch: {torch.cuda.is_available()}, "
                         f"jax backend: {jax.default_backend()})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"environment": environment("cuda"), "jax": jax.__version__, "rows": []}
    budget = Budget(ratio=0.1)
    for i, (shape, mode, B, N) in enumerate(CONFIGS):
        row = run_config(shape, mode, B, N, budget, check_reference=(i == len(CONFIGS) - 1))
        result["rows"].append(row)
        print(shape, mode, B, N, {k: (None if v is None else round(v, 1)) for k, v in row["us"].items()},
              row["checks"], flush=True)
        write(result, out)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])
