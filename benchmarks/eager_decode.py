"""Eager decoding at batch 1 on one GPU: where the host, not the GPU, sets the pace. Dense against Kascade, alternated
in one process, at Llama-3.1-8B's attention shapes (32 query / 8 KV heads of 128, bf16, B=1, 32K and 128K keys).

    python -m benchmarks.eager_decode [--out DIR] [--rounds 3] [--lengths 32768,131072] [--layers 8] [--quick]

(a) One attention layer of a decode step: Kascade's reuse layer and anchor layer (``kascade.Attention``'s per-layer
call on the Triton backend, a static-cache step: the geometry on the device) against
``torch.nn.functional.scaled_dot_product_attention`` and transformers' SDPA attention function. Per call: the host's time (the call's wall time, the GPU idle
before it), the device's span (CUDA events around the call: the GPU's time including its waits for the launches),
back-to-back eager calls (wall time per call over many, synchronised at the end: what an eager decode step pays) and
the CUDA-graph replay (the GPU's time alone, ``benchmarks.common.timing``).

(b) ``generate``'s inter-token latency, eager (transformers' dynamic cache, no compile), for a random-weight Llama of
``--layers`` layers at those shapes, dense against Kascade (the bench's uniform plan: its anchors spread as the 8B
bench's 5 of 32; default 10% budget): ``kascade.bench.timing.measure_generate_modes`` (``kascade bench
--decode-modes eager``'s code).

Writes eager_decode.json and summary.txt under --out (default out/eager_decode). ``--quick``: tiny shapes on any
machine (a CPU runs the kernels in Triton's interpreter and generate on the reference backend), for the smoke test.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from types import SimpleNamespace

from benchmarks.common.plans import add_plan_options, uniform_plan


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="output folder (default out/eager_decode)")
    p.add_argument("--rounds", type=int, default=3, help="dense / Kascade alternations per length")
    p.add_argument("--lengths", default="32768,131072", help="comma list of key counts")
    p.add_argument("--layers", type=int, default=8, help="layers of the generate model")
    p.add_argument("--calls", type=int, default=100, help="timed calls per layer measurement")
    p.add_argument("--decode-steps", type=int, default=32, help="generate's timed decode steps")
    p.add_argument("--no-generate", action="store_true", help="only the layer timings")
    p.add_argument("--launch", choices=("direct", "triton", "both"), default="direct",
                   help="how Kascade's decode kernels are launched: direct (kascade.ops.triton.launch, the default), "
                   "triton (Triton's own path, KASCADE_TRITON_LAUNCH=triton), or both, alternated every round "
                   "(each layer table then names its launch path)")
    add_plan_options(p)
    p.add_argument("--quick", action="store_true", help="tiny shapes, a few calls: a smoke run on any machine")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------------------------
# (a) one layer
# ----------------------------------------------------------------------------------------------------------------
def _sync(dev):
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize()


def _time_call(fn, dev, calls: int) -> dict:
    """Host us (median), device span us (median; None on a CPU), back-to-back us per call, graph replay us (CUDA)."""
    import torch

    host, span = [], []
    for _ in range(calls):
        _sync(dev)
        if dev.type == "cuda":
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        if dev.type == "cuda":
            e1.record()
            e1.synchronize()
            span.append(e0.elapsed_time(e1) * 1e3)
        host.append((t1 - t0) * 1e6)
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync(dev)
    r = dict(host_us=statistics.median(host), span_us=statistics.median(span) if span else None,
             back_to_back_us=(time.perf_counter() - t0) * 1e6 / calls, graph_us=None)
    if dev.type == "cuda":
        from benchmarks.common.timing import graph_us

        try:
            r["graph_us"] = graph_us(fn)
        except Exception as e:  # noqa: BLE001 - the eager numbers stand without it
            r["graph_error"] = f"{type(e).__name__}: {e}"
    return r


def layer_timings(N: int, dev, *, calls: int, rounds: int, shapes: dict, head_maps: str = "identity",
                  budgets: str = "uniform") -> dict:
    """Dense SDPA, Kascade's reuse and anchor layers at ``N`` keys, alternated ``rounds`` times."""
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    import kascade
    from kascade.plan import ModelFingerprint

    cfg = LlamaConfig(**{k: v for k, v in shapes.items() if k != "anchors"})
    plan = uniform_plan(ModelFingerprint.from_config(cfg), shapes["anchors"], head_maps, budgets)
    HQ, H, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, HQ, 1, D, device=dev, generator=g, dtype=torch.bfloat16)
    k = torch.randn(1, H, N, D, device=dev, generator=g, dtype=torch.bfloat16)
    v = torch.randn(1, H, N, D, device=dev, generator=g, dtype=torch.bfloat16)
    attn = kascade.Attention(plan, backend="triton")
    reuse_layer = next(i for i in range(1, cfg.num_hidden_layers) if not plan.is_anchor(i))
    anchor_layer = next(a for a in plan.anchors if a)

    def step():  # a decode step's pass over a static cache (the geometry on the device); layer 0 plans it
        fwd = kascade.Forward(q_offset=torch.tensor(N - 1, device=dev))
        attn(0, q, k, v, fwd)
        return fwd

    def sdpa():
        return lambda: F.scaled_dot_product_attention(q, k, v, scale=D**-0.5, enable_gqa=True)

    def sdpa_function():  # what transformers' LlamaAttention calls for dense decode (no mask: one query)
        mod = SimpleNamespace(is_causal=True, num_key_value_groups=HQ // H, training=False)
        return lambda: sdpa_attention_forward(mod, q, k, v, None, scaling=D**-0.5, dropout=0.0)

    def reuse():
        fwd = step()
        return lambda: attn(reuse_layer, q, k, v, fwd)

    def anchor():
        fwd = step()
        return lambda: attn(anchor_layer, q, k, v, fwd)

    fns = {"dense (SDPA)": sdpa, "dense (transformers' SDPA function)": sdpa_function, "reuse": reuse,
           "anchor": anchor}
    rows: dict = {name: [] for name in fns}
    with torch.no_grad():
        for name, make in fns.items():  # compile every kernel before timing
            make()()
        for _ in range(rounds):
            for name, make in fns.items():
                rows[name].append(_time_call(make(), dev, calls))
    return {"N": N, "reuse_layer": reuse_layer, "anchor_layer": anchor_layer, "rounds": rows, "median": _medians(rows)}


def _medians(rows: dict) -> dict:
    """Per call, the median over its rounds of each figure."""
    keys = ("host_us", "span_us", "back_to_back_us", "graph_us")
    return {name: {key: _median([r[key] for r in rs]) for key in keys} for name, rs in rows.items()}


def _alternated(paths: tuple, rounds: int, measure) -> dict:
    """``measure()`` ``rounds`` times per launch path (``"direct"``: :mod:`kascade.ops.triton.launch`, ``"triton"``:
    Triton's own), the paths alternated round by round: path -> results. The library's switch is put back after."""
    from kascade.ops.triton import launch

    fast, out = launch.FAST, {path: [] for path in paths}
    try:
        for _ in range(rounds):
            for path in paths:
                launch.FAST = path == "direct"
                out[path].append(measure())
    finally:
        launch.FAST = fast
    return out


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


# ----------------------------------------------------------------------------------------------------------------
# (b) generate
# ----------------------------------------------------------------------------------------------------------------
def generate_itl(N: int, dev, *, layers: int, shapes: dict, rounds: int, decode_steps: int, backend: str,
                 head_maps: str = "identity", budgets: str = "uniform") -> dict:
    """Eager ``generate`` ITL and TTFT, dense against Kascade, ``rounds`` alternations (the bench's code)."""
    import torch

    from kascade.bench.models import random_llama
    from kascade.bench.settings import Settings
    from kascade.bench.timing import measure_generate_modes, prompt
    from kascade.plan import ModelFingerprint

    overrides = {k: v for k, v in shapes.items() if k != "anchors"} | {"num_hidden_layers": layers}
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = random_llama(overrides, device=str(dev), dtype=dtype, max_positions=N + 4 * decode_steps + 64)
    plan = uniform_plan(ModelFingerprint.from_model(model), shapes["anchors"], head_maps, budgets)
    settings = Settings(lengths=(N,), batches=(1,), decode_steps=decode_steps, warmup_decode_steps=16,
                        generate=("eager",), backend=backend, device=str(dev), time_budget_s=None)
    ids = prompt(1, N, overrides["vocab_size"], settings.seed, dev)
    runs = []
    for _ in range(rounds):
        r = measure_generate_modes(model, plan, ids, settings)["eager"]
        runs.append({"dense_itl_ms": r["dense"]["itl_s"] * 1e3, "kascade_itl_ms": r["kascade"]["itl_s"] * 1e3,
                     "dense_ttft_s": r["dense"]["ttft_s"], "kascade_ttft_s": r["kascade"]["ttft_s"],
                     "itl_speedup": r["itl_speedup"], "backend": r["kascade"]["backend"]})
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return {"N": N, "layers": layers, "anchors": list(plan.anchors), "runs": runs,
            "itl_speedup_median": statistics.median(r["itl_speedup"] for r in runs)}


# ----------------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------------
def _f(x, fmt="{:.1f}"):
    return "-" if x is None else fmt.format(x)


def summary(result: dict) -> str:
    lines = [f"eager decode, B=1, {result['setup'].get('head_maps', 'identity')} head maps, "
             f"{result['setup'].get('budgets', 'uniform')} budgets; {result['environment']}",
             ""]
    for lt in result["layers"]:
        m = lt["median"]
        dense = m["dense (SDPA)"]
        lines += [f"one layer, N={lt['N']}, {lt['launch']} launches (median of {len(lt['rounds']['reuse'])} rounds; "
                  "us)",
                  "| call | host | device span | back to back | graph replay | back to back / dense |",
                  "|---|---|---|---|---|---|"]
        for name, r in m.items():
            ratio = r["back_to_back_us"] / dense["back_to_back_us"] if dense["back_to_back_us"] else None
            lines.append(f"| {name} | {_f(r['host_us'])} | {_f(r['span_us'])} | {_f(r['back_to_back_us'])} | "
                         f"{_f(r['graph_us'])} | {_f(ratio, '{:.2f}x')} |")
        lines.append("")
    for gt in result["generate"]:
        runs = gt["runs"]
        lines.append(f"generate (eager, {gt['launch']} launches), N={gt['N']}, {gt['layers']} layers, anchors "
                     f"{gt['anchors']}: ITL dense "
                     + ", ".join(f"{r['dense_itl_ms']:.2f}" for r in runs) + " ms; Kascade "
                     + ", ".join(f"{r['kascade_itl_ms']:.2f}" for r in runs)
                     + f" ms; dense / Kascade (median) {gt['itl_speedup_median']:.3f}x (>= 1: Kascade faster)")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    args = _parse(argv)
    import torch

    quick = args.quick
    if not torch.cuda.is_available():
        if not quick:
            raise SystemExit("eager_decode times a GPU: run it on one (or --quick for a smoke run)")
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported: the kernels on CPU tensors
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    from benchmarks.common.report import out_folder
    from kascade.bench.models import LLAMA8B, LLAMA8B_ANCHORS, TINY

    out_dir = out_folder(args.out, "eager_decode")
    if quick:
        shapes = {**TINY, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "anchors": 2}
        lengths, calls, rounds, layers, steps = [300], 3, 1, 4, 2
    else:
        shapes = {**LLAMA8B, "anchors": LLAMA8B_ANCHORS}
        lengths = [int(x) for x in args.lengths.split(",")]
        calls, rounds, layers, steps = args.calls, args.rounds, args.layers, args.decode_steps
    import platform

    import transformers
    import triton

    where = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU (Triton interpreter)"
    env = f"{where}; torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}"
    result = {"environment": env, "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M"),
              "setup": {"lengths": lengths, "calls": calls, "rounds": rounds, "layers": layers, "quick": quick,
                        "launch": args.launch, "head_maps": args.head_maps, "budgets": args.budgets},
              "layers": [], "generate": []}
    t0 = time.perf_counter()
    layer_shapes = {**shapes, "num_hidden_layers": 32 if not quick else shapes["num_hidden_layers"]}
    paths = ("triton", "direct") if args.launch == "both" else (args.launch,)
    for N in lengths:
        measure = functools.partial(layer_timings, N, dev, calls=calls, rounds=1, shapes=layer_shapes,
                                    head_maps=args.head_maps, budgets=args.budgets)
        for path, rs in _alternated(paths, rounds, measure).items():
            rows = {name: [r["rounds"][name][0] for r in rs] for name in rs[0]["rounds"]}
            result["layers"].append({**rs[0], "launch": path, "rounds": rows, "median": _medians(rows)})
        print(summary(result), flush=True)
    if not args.no_generate:
        gen_shapes = {**shapes, "anchors": max(2, round(shapes["anchors"] * layers / 32))} if not quick else shapes
        backend = "triton" if dev.type == "cuda" else "auto"
        for N in lengths:
            measure = functools.partial(generate_itl, N, dev, layers=layers, shapes=gen_shapes, rounds=1,
                                        decode_steps=steps, backend=backend, head_maps=args.head_maps,
                                        budgets=args.budgets)
            for path, rs in _alternated(paths, min(rounds, 2), measure).items():
                runs = [x for r in rs for x in r["runs"]]
                result["generate"].append({**rs[0], "launch": path, "runs": runs, "itl_speedup_median":
                                           statistics.median(x["itl_speedup"] for x in runs)})
            (out_dir / "eager_decode.json").write_text(json.dumps(result, indent=1))
    result["wall_s"] = time.perf_counter() - t0
    text = summary(result)
    (out_dir / "eager_decode.json").write_text(json.dumps(result, indent=1))
    (out_dir / "summary.txt").write_text(text)
    print(text)
    return result


if __name__ == "__main__":
    main()
