"""Host time of an eager decode step's attention, per layer kind, with the Triton kernels stubbed: what Python, the
checks and the launch bookkeeping cost around the kernels, on any machine (a CPU included).

    python -m benchmarks.host_overhead [--device cpu|cuda] [--steps 300] [--keys 4096] [--cache static|dynamic]
                                       [--head-maps identity|rotated] [--budgets uniform|per-layer] [--launch]
                                       [--no-gc] [--json FILE]

A static-cache decode step (the geometry on the device, as ``generate`` with a static cache or GraphDecoder gives
it; with ``--cache dynamic`` the keys grow by one a step and K and V are new tensors each step, as transformers'
default DynamicCache hands them to eager ``generate``) at Llama-3.1-8B's attention shapes (32 query / 8 KV heads of
128, 32 layers, 5 anchors: the uniform plan ``kascade bench`` runs), B=1, bf16, Kascade's Triton backend, with
every kernel launch replaced by a no-op that counts it (on a CPU Triton's interpreter switch lets the launchers take
CPU tensors; the kernels never run). Per layer the
time of transformers' call of the attention function (what ``LlamaAttention.forward`` calls), median over the steps,
for layer 0 (dense + selection, and the step's plan), the other anchors and the reuse layers; once per step the mask
function (its geometry). Not included: a launch's own host cost in Triton's launcher (a few microseconds each on a
GPU host: count the launches), the rest of the layer (projections, RoPE, cache update, MLP), and the GPU.

Dense, for comparison: transformers' SDPA attention function on the same static cache with its 4-D mask (the call
``generate`` makes for dense decode), with ``scaled_dot_product_attention`` stubbed the same way (a no-op returning an
output of its shape: its C++ dispatch and launch are left out, like Triton's launches).

On a CPU, torch runs one thread here (on a busy machine the idle threads' spinning dominates microsecond ops).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import time
from types import SimpleNamespace

from benchmarks.common.plans import add_plan_options, uniform_plan


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--steps", type=int, default=300, help="decode steps timed (after 20 untimed)")
    p.add_argument("--keys", type=int, default=4096, help="static cache slots of the Kascade step")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--anchors", type=int, default=5)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--cache", choices=("static", "dynamic"), default="static",
                   help="static: every step over the same --keys slots (a static cache, generate's compiled path); "
                   "dynamic: the keys grow by one a step, each step's K and V new tensors (transformers' default "
                   "DynamicCache, what eager generate uses): the step's geometry and the tensors' strides change")
    add_plan_options(p)
    p.add_argument("--launch", action="store_true",
                   help="CUDA only: launch the kernels (their launches' host cost counted: Triton's and SDPA's; the "
                   "GPU's time is not, the host does not wait for it)")
    p.add_argument("--no-gc", action="store_true",
                   help="Python's garbage collector off while timing: its pauses otherwise land on whichever call "
                   "allocates when they come, which makes a comparison of two trees noisy")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results here")
    return p.parse_args(argv)


class _Stub:
    """A kernel whose launches (``kernel[grid](...)``) do nothing but count."""

    def __init__(self, name: str, counts: dict):
        self.name, self.counts = name, counts

    def __getitem__(self, grid):
        return self._launch

    def _launch(self, *args, **kwargs):
        self.counts[self.name] = self.counts.get(self.name, 0) + 1


def stub_kernels(counts: dict) -> list:
    """Replace every ``@triton.jit`` function of the decode step's modules by a :class:`_Stub`; returns what to
    restore. Not the mask geometry kernel: the mask check reads its flags back (on a GPU; a CPU step does not use
    it), and a stub's would be whatever the allocator left there."""
    from kascade.ops.triton import decode, step, topk

    saved = []
    for mod in (decode, topk, step):
        for name, obj in list(vars(mod).items()):
            if mod is step and name == "_mask_kernel":
                continue
            if type(obj).__name__ in ("JITFunction", "InterpretedFunction", "Autotuner"):
                saved.append((mod, name, obj))
                setattr(mod, name, _Stub(f"{mod.__name__.rsplit('.', 1)[-1]}.{name}", counts))
    return saved


def measure(*, device: str, steps: int, keys: int, layers: int, anchors: int, batch: int,
            launch: bool = False, cache: str = "static", head_maps: str = "identity", budgets: str = "uniform") -> dict:
    import torch
    from transformers import LlamaConfig
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import causal_mask_function

    import kascade
    from kascade.bench.models import LLAMA8B
    from kascade.integration.functions import kascade_attention_forward, kascade_mask
    from kascade.plan import ModelFingerprint

    dev = torch.device(device)
    cfg = LlamaConfig(**{**LLAMA8B, "num_hidden_layers": layers})
    plan = uniform_plan(ModelFingerprint.from_config(cfg), anchors, head_maps, budgets)
    B, HQ, H, D = batch, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    dt = torch.bfloat16
    runtime = kascade.Attention(plan, backend="triton")
    mods = [SimpleNamespace(_kascade_runtime=runtime, layer_idx=i, training=False, is_causal=True,
                            num_key_value_groups=HQ // H) for i in range(layers)]
    counts: dict = {}
    saved = [] if launch else stub_kernels(counts)
    try:
        def qkv(n):
            q = torch.randn(B, 1, HQ, D, dtype=dt, device=dev).transpose(1, 2)  # as the model's view hands it
            return q, torch.randn(B, H, n, D, dtype=dt, device=dev), torch.randn(B, H, n, D, dtype=dt, device=dev)

        dynamic = cache == "dynamic"
        q, kf, vf = qkv(keys + (20 + steps if dynamic else 0))
        k, v = kf[:, :, :keys], vf[:, :, :keys]
        slot = torch.tensor(keys // 2, device=dev)  # the static cache's length: a device tensor
        mask2d = torch.ones(B, kf.shape[2], dtype=torch.bool, device=dev)  # sliced to each step's keys
        kinds = {0: "layer 0"} | {a: "anchor" for a in plan.anchors if a} | \
            {i: "reuse" for i in range(layers) if not plan.is_anchor(i)}
        per: dict = {kind: [] for kind in ("mask function (per step)", "layer 0", "anchor", "reuse")}
        launches: dict = {}
        scale = D ** -0.5
        with torch.no_grad():
            for s in range(20 + steps):
                n = keys + s if dynamic else keys
                if dynamic:  # a DynamicCache's step: K and V new tensors of n slots (outside the timings)
                    slot = torch.tensor(n - 1, device=dev)
                    if launch:
                        k, v = kf[:, :, :n].clone(), vf[:, :, :n].clone()
                    else:  # the same strides, without copying (which would leave the CPU's caches cold)
                        shape, strides = (B, H, n, D), (H * n * D, n * D, D, 1)
                        k, v = kf.as_strided(shape, strides), vf.as_strided(shape, strides)
                t0 = time.perf_counter_ns()
                m = kascade_mask(batch_size=B, q_length=1, kv_length=n, q_offset=slot, kv_offset=0,
                                 mask_function=causal_mask_function, attention_mask=mask2d[:, :n])
                t1 = time.perf_counter_ns()
                if s >= 20:
                    per["mask function (per step)"].append(t1 - t0)
                for i, mod in enumerate(mods):
                    before = dict(counts)
                    t0 = time.perf_counter_ns()
                    kascade_attention_forward(mod, q, k, v, m, scaling=scale, dropout=0.0)
                    t1 = time.perf_counter_ns()
                    if s >= 20:
                        per[kinds[i]].append(t1 - t0)
                    if s == 20:
                        launches.setdefault(kinds[i], {k2: counts.get(k2, 0) - before.get(k2, 0) for k2 in counts})
                if launch:  # keep the queue of launches short: its time is the GPU's, not the host's
                    torch.cuda.synchronize()
        k, v = kf[:, :, :keys], vf[:, :, :keys]
        dmask = torch.ones(B, 1, 1, keys, dtype=torch.bool, device=dev)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        if not launch:
            torch.nn.functional.scaled_dot_product_attention = \
                lambda query, key, value, **kw: query.new_empty(query.shape[:-1] + value.shape[-1:])
        dense = []
        with torch.no_grad():
            for s in range(20 + steps):
                t0 = time.perf_counter_ns()
                sdpa_attention_forward(mods[1], q, k, v, dmask, scaling=scale, dropout=0.0)
                t1 = time.perf_counter_ns()
                if s >= 20:
                    dense.append(t1 - t0)
                if launch and s % 32 == 31:
                    torch.cuda.synchronize()
    finally:
        for mod, name, obj in saved:
            setattr(mod, name, obj)
        if "sdpa" in locals():
            torch.nn.functional.scaled_dot_product_attention = sdpa
    us = {kind: statistics.median(ts) / 1e3 for kind, ts in per.items()}
    us["dense (SDPA function)"] = statistics.median(dense) / 1e3
    n_anchor, n_reuse = len(plan.anchors) - 1, layers - len(plan.anchors)
    step_kascade = us["mask function (per step)"] + us["layer 0"] + n_anchor * us["anchor"] + n_reuse * us["reuse"]
    return dict(us=us, launches={k2: sum(v2.values()) for k2, v2 in launches.items()}, launch_detail=launches,
                step_us=dict(kascade=step_kascade, dense=layers * us["dense (SDPA function)"]),
                setup=dict(device=str(dev), launched=launch, batch=B, keys=keys, layers=layers,
                           anchors=list(plan.anchors), steps=steps, dtype="bf16", cache=cache, head_maps=head_maps,
                           budgets=budgets))


def environment(device: str) -> str:
    import torch
    import transformers

    try:
        import triton

        tv = triton.__version__
    except ImportError:
        tv = None
    if device.startswith("cuda"):
        where = torch.cuda.get_device_name()
    else:
        from kascade.bench.report import cpu_name

        where = f"CPU {cpu_name()}"
    return (f"{where} ({platform.node()}); torch {torch.__version__}, triton {tv}, transformers "
            f"{transformers.__version__}, python {platform.python_version()}")


def table(r: dict, env: str) -> str:
    s = r["setup"]
    how = "kernels launched" if s.get("launched") else "kernels stubbed"
    lines = [f"host time per layer, {how}; {env}",
             f"{s.get('cache', 'static')}-cache decode step, B={s['batch']}, {s['keys']} "
             f"{'slots' if s.get('cache', 'static') == 'static' else 'keys and one more a step'}, {s['layers']} "
             f"layers, anchors {s['anchors']}, {s.get('head_maps', 'identity')} head maps, "
             f"{s.get('budgets', 'uniform')} budgets, bf16, Triton backend; "
             f"median of {s['steps']} steps"
             + ("" if s.get("gc", True) else ", garbage collector off"), "",
             "| layer | host us | kernel launches |", "|---|---|---|"]
    for kind, t in r["us"].items():
        n = r["launches"].get(kind)
        lines.append(f"| {kind} | {t:.1f} | {'-' if n is None or s.get('launched') else n} |")
    lines += ["", f"whole step's attention: Kascade {r['step_us']['kascade']:.0f} us, dense "
              f"{r['step_us']['dense']:.0f} us ({how} in both)"]
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = _parse(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not device.startswith("cuda"):
        # the launchers take CPU tensors only in the interpreter's mode; set before triton is first imported
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        torch.set_num_threads(1)
    if args.launch and not device.startswith("cuda"):
        raise SystemExit("--launch needs a CUDA device")
    if args.no_gc:
        gc.collect()
        gc.disable()
    try:
        r = measure(device=device, steps=args.steps, keys=args.keys, layers=args.layers,
                    anchors=args.anchors, batch=args.batch, launch=args.launch, cache=args.cache,
                    head_maps=args.head_maps, budgets=args.budgets)
    finally:
        gc.enable()
    r["setup"]["gc"] = not args.no_gc
    env = environment(device)
    print(table(r, env))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(environment=env, **r), f, indent=1)
    return r


if __name__ == "__main__":
    main()
