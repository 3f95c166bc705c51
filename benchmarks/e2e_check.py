"""GPU checks of the whole-model Triton path, one call:

    python -m benchmarks.e2e_check --model MODEL.gguf --out OUT [--skip-llama]

1. Fidelity: the default model's teacher-forced top-1 agreement (and KL) between the Triton and the reference
   backend with the shipped plan, on held-out 4K windows, in fp32 and bf16; positions where the reference's two
   best logits are within ``--tie`` of each other are counted apart ("ties").
2. Generation: greedy tokens of eager ``generate`` (dynamic cache) vs :class:`GraphDecoder` (static cache, CUDA
   graph replay), Triton backend.
3. Decode latency per token, batch 1: eager dense (SDPA, dynamic cache), eager Kascade, graph dense (SDPA, static
   cache), graph Kascade: the default model at 4K and a random Llama-3.1-8B-shaped model at 32K / 128K.
Writes e2e_check.json and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch


import kascade
from benchmarks.common import log, out_folder
from kascade import bench
from kascade import KascadePlan, ModelFingerprint, text
from kascade.fidelity import fidelity, scored_logits
from kascade.integration.graphs import GraphDecoder, enable_dense
from kascade.models import load_model


@torch.no_grad()
def backend_agreement(model, windows, tie):
    plan = kascade.plan.default_plan(model)
    agree = ties = n = 0
    kl_ref = kl_tri = 0.0
    for w in windows:
        ids = w[None].cuda()
        dense, _ = scored_logits(model, ids)
        with kascade.enable(model, plan, backend="reference"):
            ref, _ = scored_logits(model, ids)
        with kascade.enable(model, plan, backend="triton"):
            tri, _ = scored_logits(model, ids)
        top2 = ref.topk(2, -1).values
        tied = (top2[:, 0] - top2[:, 1]) < tie
        same = ref.argmax(-1) == tri.argmax(-1)
        agree += int(same[~tied].sum())
        ties += int(tied.sum())
        n += ref.shape[0]
        kl_ref += fidelity(dense, ref).kl * ref.shape[0]
        kl_tri += fidelity(dense, tri).kl * ref.shape[0]
    return dict(agreement_ties_aside=agree / max(1, n - ties), positions=n, ties=ties,
                kl_dense_vs_reference=kl_ref / n, kl_dense_vs_triton=kl_tri / n)


def _sync_time(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


@torch.no_grad()
def decode_latency(model, plan, prompt_len, steps, batch=1, seed=0):
    """ms per decode step for dense/kascade x eager/graph. Eager: DynamicCache, dense = transformers' SDPA.
    Graph: static cache, dense = DenseRuntime (Triton split-K decode; SDPA cannot be captured at its best)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, model.config.vocab_size - 1, (batch, prompt_len), generator=g).cuda()
    out = {}
    for name in ("dense", "kascade"):
        handle = kascade.enable(model, plan, backend="triton", warn_uncalibrated=False) if name == "kascade" else None
        try:
            # eager: prefill once, then time decode steps with the dynamic cache (kascade.bench's helpers)
            cache, nxt, _, _ = bench.prefill(model, ids, 0)
            _, nxt = bench.decode(model, cache, nxt, 16)  # warm-up: the kernels specialise on N % 16
            out[f"{name}_eager_ms"] = bench.decode(model, cache, nxt, steps)[0] * 1e3
            del cache
            dense_handle = enable_dense(model) if name == "dense" else None
            try:
                dec = GraphDecoder(model, batch, prompt_len + steps + 8)
                dec.prefill(ids)
                for _ in range(3):
                    dec.step()  # 2 eager warm-up steps, then capture + first replay
                out[f"{name}_graph_ms"] = _sync_time(lambda: [dec.step() for _ in range(steps)]) / steps * 1e3
                del dec
            except Exception as e:  # recorded, not hidden: the summary shows it
                out[f"{name}_graph_error"] = f"{type(e).__name__}: {e}"[:500]
            finally:
                if dense_handle is not None:
                    dense_handle.disable()
            torch.cuda.empty_cache()
        finally:
            if handle is not None:
                handle.disable()
    out["eager_speedup"] = out["dense_eager_ms"] / out["kascade_eager_ms"]
    if "dense_graph_ms" in out and "kascade_graph_ms" in out:
        out["graph_speedup"] = out["dense_graph_ms"] / out["kascade_graph_ms"]
        out["graph_saves_dense"] = out["dense_eager_ms"] / out["dense_graph_ms"]
        out["graph_saves_kascade"] = out["kascade_eager_ms"] / out["kascade_graph_ms"]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default=None, help="output folder (default out/e2e_check)")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--tie", type=float, default=1e-3)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--skip-llama", action="store_true")
    a = ap.parse_args(argv)
    out = out_folder(a.out, "e2e_check")
    import transformers
    import triton

    res = dict(machine=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               transformers=transformers.__version__, python=platform.python_version())

    def save():
        (out / "e2e_check.json").write_text(json.dumps(res, indent=1))

    model, tok = load_model(a.model, device="cuda", dtype=torch.float32)
    wins = text.windows(tok, "eval", 4096, a.windows, seed=1)
    for dt in (torch.float32, torch.bfloat16):
        model.to(dt)
        t = time.perf_counter()
        res[f"fidelity_4k_{str(dt)[6:]}"] = r = backend_agreement(model, wins, a.tie)
        log(f"triton vs reference, {dt}, 4K: {r} ({time.perf_counter() - t:.1f} s)")
        save()
    # generation: eager dynamic cache vs graph replay, Triton backend, bf16
    ids = wins[0][None, :4096].cuda()
    try:
        with torch.no_grad(), kascade.enable(model, backend="triton"):
            eager = model.generate(ids, max_new_tokens=48, do_sample=False)[:, 4096:]
            graph = GraphDecoder(model, 1, 4096 + 56).generate(ids, 48)
        res["generate_eager_vs_graph_same_tokens"] = float((eager == graph).float().mean())
        diff = (eager != graph)
        res["generate_first_divergence"] = int(diff.int().argmax()) if bool(diff.any()) else None
        log("generate eager vs graph:", res["generate_eager_vs_graph_same_tokens"], res["generate_first_divergence"])
    except Exception as e:
        res["generate_error"] = f"{type(e).__name__}: {e}"[:500]
        log("generate failed:", res["generate_error"])
    save()
    res["decode_default_4k_b1"] = r = decode_latency(model, kascade.plan.default_plan(model), 4096, a.steps)
    log("decode default model 4K:", r)
    save()
    del model
    torch.cuda.empty_cache()
    if not a.skip_llama:
        m = bench.random_llama(bench.LLAMA8B, device="cuda", dtype=torch.bfloat16, max_positions=131072 + 64)
        plan = KascadePlan.uniform(ModelFingerprint.from_model(m), 5)
        for n in (32768, 131072):
            res[f"decode_llama8b_{n // 1024}k_b1"] = r = decode_latency(m, plan, n, a.steps)
            log(f"decode llama8b {n}:", r)
            save()
    log(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
