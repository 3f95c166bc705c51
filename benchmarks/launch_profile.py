"""Where an eager decode layer's host time goes on a GPU: Kascade's reuse and anchor layers taken apart (Python and
checks, each kernel launch, and inside a launch Triton's binding, cache key, launch metadata and compiled launcher).

    python -m benchmarks.launch_profile [--keys 32768] [--calls 300] [--out DIR]

One static-cache decode step (``kascade.Attention``, Triton backend, the geometry on the device) at Llama-3.1-8B
attention shapes (32 query / 8 KV heads of 128, bf16, B=1, the bench's uniform plan of 5 anchors in 32 layers). Per
call, median of ``--calls`` after warm-up, the GPU idle before each:

* ``sdpa``: one ``scaled_dot_product_attention`` call (for scale); ``empty``: one ``torch.empty`` on the device;
  ``tiny_triton``: a one-program Triton kernel of 2 arguments through Triton's launch;
* ``reuse`` / ``anchor``: the layer's call, with the launch path the library uses (``KASCADE_TRITON_LAUNCH``);
* ``*_stubbed``: the same with every launch through Triton's path and replaced there by a no-op
  (``JITFunction.run``): Python, checks, allocations; ``*_launches``: the kernels launched;
* ``*_each_launch``: each of the layer's launches replayed alone through Triton's ``kernel[grid]`` path;
* ``*_launch_parts``: each launch's parts in Triton 3.6's launch path: ``binder`` (every argument bound and
  specialised), ``cache_key``, ``launch_metadata``, ``c_launch`` (the compiled launcher, tensors as arguments),
  ``device_stream``.

Writes launch_profile.json, and cProfile and torch profiler tables of each layer, under --out (default
out/launch_profile). The parts follow Triton 3.6's ``JITFunction.run``; under another release a part that does not
apply is recorded as its error.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--keys", type=int, default=32768, help="keys in the cache (default 32768)")
    p.add_argument("--calls", type=int, default=300, help="timed calls per figure (default 300)")
    p.add_argument("--out", default=None, help="output folder (default out/launch_profile)")
    return p.parse_args(argv)


def _host(fn, n: int, sync) -> dict:
    """Median host us of ``fn`` with the device idle before each call, and back-to-back us per call."""
    for _ in range(min(20, n)):
        fn()
    ts = []
    for _ in range(n):
        sync()
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return dict(host_us=statistics.median(ts), b2b_us=(time.perf_counter() - t0) * 1e6 / n)


def _parts(rec, host) -> dict:
    """Each recorded launch ``(jit_fn, args, kwargs)`` taken apart as Triton 3.6's ``JITFunction.run`` does it."""
    from triton import knobs
    from triton.runtime.driver import driver
    from triton.runtime.jit import compute_cache_key

    out = {}
    for i, (fn, a, kw) in enumerate(rec):
        name = f"{i}:{fn.fn.__name__}"
        try:
            kw2 = {x: y for x, y in kw.items() if x not in ("grid", "warmup")}
            kw2["debug"] = kw2.get("debug", fn.debug) or knobs.runtime.debug
            kw2["instrumentation_mode"] = knobs.compilation.instrumentation_mode
            device = driver.active.get_current_device()
            kernels, keys, _, _, binder = fn.device_caches[device]
            bound, spec, opts = binder(*a, **kw2)
            kernel = kernels[compute_cache_key(keys, spec, opts)]
            g = tuple(kw["grid"]) + (1,) * (3 - len(kw["grid"]))
            stream = driver.active.get_current_stream(device)
            vals = tuple(bound.values())
            out[name] = dict(
                n_params=len(vals),
                device_stream=host(lambda: driver.active.get_current_stream(driver.active.get_current_device())),
                binder=host(lambda: binder(*a, **kw2)),
                cache_key=host(lambda: compute_cache_key(keys, spec, opts)),
                launch_metadata=host(lambda: kernel.launch_metadata(g, stream, *vals)),
                c_launch=host(lambda: kernel.run(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata,
                                                 None, None, None, *vals)))
        except Exception as e:  # noqa: BLE001 - another Triton release: record what did not apply
            out[name] = f"{type(e).__name__}: {e}"
    return out


def main(argv=None) -> dict:
    args = _parse(argv)
    import torch
    import torch.nn.functional as F
    import triton
    import triton.language as tl
    import triton.runtime.jit as jit
    from torch.profiler import ProfilerActivity, profile
    from transformers import LlamaConfig

    import kascade
    from benchmarks.common import out_folder
    from kascade.bench.models import LLAMA8B, LLAMA8B_ANCHORS
    from kascade.ops.triton import launch
    from kascade.plan import KascadePlan, ModelFingerprint

    if not torch.cuda.is_available():
        raise SystemExit("launch_profile times a GPU's launches: run it on one")
    out_dir = out_folder(args.out, "launch_profile")
    dev, N, n = torch.device("cuda"), args.keys, args.calls
    sync = torch.cuda.synchronize
    cfg = LlamaConfig(**{**LLAMA8B, "num_hidden_layers": 32})
    plan = KascadePlan.uniform(ModelFingerprint.from_config(cfg), LLAMA8B_ANCHORS)
    HQ, H, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(1, h, L, D, device=dev, generator=g, dtype=torch.bfloat16)
               for h, L in ((HQ, 1), (H, N), (H, N)))
    attn = kascade.Attention(plan, backend="triton")
    reuse_layer = next(i for i in range(1, 32) if not plan.is_anchor(i))
    anchor_layer = next(a for a in plan.anchors if a)
    fwd = kascade.Forward(q_offset=torch.tensor(N - 1, device=dev))
    attn(0, q, k, v, fwd)

    def anchor():  # keeps the selections the reuse layer reads (an anchor drops those no later layer needs)
        kept = dict(fwd.selections)
        fwd.selections.pop(anchor_layer, None)
        out = attn(anchor_layer, q, k, v, fwd)
        fwd.selections.clear()
        fwd.selections.update(kept)
        return out

    @triton.jit
    def _tiny(X, m, BLOCK: tl.constexpr):
        o = tl.arange(0, BLOCK)
        tl.store(X + o, tl.load(X + o, mask=o < m), mask=o < m)

    xt = torch.zeros(128, device=dev)
    layers = {"reuse": lambda: attn(reuse_layer, q, k, v, fwd), "anchor": anchor}
    host = lambda fn: _host(fn, n, sync)["host_us"]  # noqa: E731
    result = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, keys=N,
                  calls=n, reuse_layer=reuse_layer, anchor_layer=anchor_layer)
    with torch.no_grad():
        for name, fn in [("sdpa", lambda: F.scaled_dot_product_attention(q, k, v, scale=D**-0.5, enable_gqa=True)),
                         ("empty", lambda: torch.empty(1024, device=dev)),
                         ("tiny_triton", lambda: _tiny[(1,)](xt, 128, BLOCK=128)), *layers.items()]:
            result[name] = _host(fn, n, sync)
        run = jit.JITFunction.run
        counts: dict = {}

        def stub(self, *a, **kw):
            counts[self.fn.__name__] = counts.get(self.fn.__name__, 0) + 1

        def record(self, *a, **kw):
            rec.append((self, a, kw))
            return run(self, *a, **kw)

        fast, launch.FAST = launch.FAST, False  # from here every launch through kernel[grid]: stubbed or recorded
        try:
            for name, fn in layers.items():
                jit.JITFunction.run = stub
                counts.clear()
                fn()
                result[name + "_launches"] = dict(counts)
                result[name + "_stubbed"] = _host(fn, n, sync)
                rec: list = []
                jit.JITFunction.run = record
                fn()
                sync()
                jit.JITFunction.run = run
                result[name + "_each_launch"] = {f"{i}:{s.fn.__name__}": host(lambda s=s, a=a, kw=kw: run(s, *a, **kw))
                                                 for i, (s, a, kw) in enumerate(rec)}
                result[name + "_launch_parts"] = _parts(rec, host)
        finally:
            jit.JITFunction.run = run
            launch.FAST = fast
        for name, fn in layers.items():
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(n):
                fn()
            prof.disable()
            sync()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(35)
            (out_dir / f"cprofile_{name}.txt").write_text(text.getvalue())
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
                for _ in range(50):
                    fn()
                sync()
            (out_dir / f"torchprof_{name}.txt").write_text(p.key_averages().table(sort_by="self_cpu_time_total",
                                                                                  row_limit=40))
    (out_dir / "launch_profile.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: (round(v["host_us"], 1) if isinstance(v, dict) and "host_us" in v else v)
                      for k, v in result.items()}, indent=1))
    return result


if __name__ == "__main__":
    main()
