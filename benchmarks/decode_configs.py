"""Per-shape launch sweep of the decode split-K kernel (one GPU call): which (BLOCK_N, warps, stages, splits) each
shape wants, for the anchor's scoring pass, the sparse (reuse) pass and the dense / layer-0 pass.

    python -m benchmarks.decode_configs [--out DIR] [--only model:B:N,...] [--budget-s 300]

``python -m benchmarks.decode`` (without --no-tune) picks the one configuration that is best summed over three shapes; this sweeps each
shape on its own, the number of splits included (the programs launched against what fits on the GPU at once), so
that the launchers can choose per pass (``PASS_CONFIG`` in :mod:`kascade.ops.triton.decode`). For every shape and
pass: the time of the current launch choice, the best found, and the full grid (a pass over several splits includes
its merge, made by each row's last program). Also the graph replay of an empty kernel (the floor of one launch).

Timing as in benchmarks.decode: the op captured in a CUDA graph, replay timed by do_bench (median), L2 flushed.
Writes decode_configs.json under --out (default out/decode_configs).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton
import triton.language as tl

from benchmarks.common import log, out_folder
from benchmarks.common.shapes import DECODE_BUDGET as BUDGET
from benchmarks.common.shapes import MODELS
from benchmarks.common.shapes import decode_inputs as make
from benchmarks.common.timing import graph_us
from kascade.ops.triton import decode as td

SHAPES = ("llama-3.1-8b:1:32768,llama-3.1-8b:1:131072,llama-3.1-8b:8:32768,llama-3.1-8b:8:131072,"
          "llama-3.1-8b:32:131072,smollm2-135m:1:131072,smollm2-135m:8:32768")


def bench(fn):  # a shorter timing window than benchmarks.decode's: the sweep times ~1,000 launches
    return graph_us(fn, warmup=5, rep=25)


@triton.jit
def _empty(X):
    pass


def split_grid(rows: int, n: int, bn: int, sms: int) -> list[int]:
    """Splits that put about 0.5 .. 8 programs per multiprocessor, each at least two blocks of keys."""
    cap = max(1, n // (2 * bn))
    return sorted({min(cap, max(1, round(c * sms / rows))) for c in (0.5, 1, 2, 3, 4, 8)})


PASSES = {
    # name: (has_v, write_scores, sparse)
    "score": (False, True, False),
    "sparse": (True, False, True),
    "dense_scores": (True, True, False),  # layer 0 (dense output + the selection's score rows)
}
CONFIGS = {
    "score": [(bn, nw, ns) for bn in (32, 64, 128) for nw, ns in ((4, 2), (4, 3), (4, 4), (8, 3))],
    # Triton 3.6 prefetches the gathered rows an iteration ahead only from 5 stages on (the manual's design notes)
    "sparse": [(64, 4, 3), (64, 4, 5), (32, 4, 5), (64, 8, 5), (32, 4, 6), (128, 4, 5), (32, 8, 5), (16, 4, 6)],
    "dense_scores": [(32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 8, 3)],
}


def run_pass(name, q, k, v, meta, idx, **cfg):
    has_v, write_scores, sparse = PASSES[name]
    if sparse:
        return td.sparse_decode(q, k, v, idx, scale=0.1, **cfg)
    return td._run_split(q, k, v if has_v else None, None, meta, None, None, scale=0.1, n_keys=meta.n_max,
                         sparse=False, has_v=has_v, write_scores=write_scores, sc_row=meta.n_max if write_scores else 0,
                         **cfg)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="output folder (default out/decode_configs)")
    ap.add_argument("--only", default=SHAPES, help="comma list of model:B:N")
    ap.add_argument("--passes", default="score,sparse,dense_scores")
    ap.add_argument("--budget-s", type=float, default=300.0, help="sweeping time, shared out among shapes and passes")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    out_dir = out_folder(args.out, "decode_configs")
    x = torch.zeros(1, device=dev)
    result = {"header": {"gpu": torch.cuda.get_device_name(dev), "sms": sms, "torch": torch.__version__,
                         "triton": triton.__version__, "date": time.strftime("%Y-%m-%d %H:%M")},
              "empty_kernel_us": bench(lambda: _empty[(1,)](x)), "shapes": []}
    log(f"# {result['header']}; empty kernel graph replay {result['empty_kernel_us']:.2f} us")
    specs = args.only.split(",")
    passes = args.passes.split(",")
    for spec in specs:
        model, B, N = spec.split(":")
        B, N = int(B), int(N)
        HQ, H, D = MODELS[model]
        q, k, v = make(B, HQ, H, N, D, dev)
        meta = td.decode_meta(B, device=dev, q_offset=N - 1, budget=BUDGET)
        idx = td.select_decode(q, k, budget=BUDGET, scale=0.1, meta=meta, index_dtype=torch.int32).indices
        row = {"model": model, "B": B, "N": N, "passes": {}}
        for name in passes:
            t_end = time.time() + args.budget_s / (len(specs) * len(passes))
            n_keys = idx.shape[-1] if PASSES[name][2] else meta.n_max
            cur = bench(lambda: run_pass(name, q, k, v, meta, idx))
            grid = []
            for bn, nw, ns in CONFIGS[name]:
                if time.time() > t_end:
                    break
                for S in split_grid(B * H, n_keys, bn, sms):
                    c = dict(block_n=bn, num_warps=nw, num_stages=ns, num_splits=S)
                    try:
                        us = bench(lambda: run_pass(name, q, k, v, meta, idx, **c))
                    except Exception as e:  # noqa: BLE001 - a config that does not fit (shared memory) is skipped
                        log(f"  {name} {c}: {type(e).__name__}")
                        continue
                    grid.append({**c, "us": us})
            best = min(grid, key=lambda r: r["us"]) if grid else None
            row["passes"][name] = {"current_us": cur, "best": best, "grid": grid}
            log(f"{model} B={B} N={N} {name}: current {cur:.1f} us, best {best}")
        result["shapes"].append(row)
        (out_dir / "decode_configs.json").write_text(json.dumps(result, indent=1))
        del q, k, v, idx
        torch.cuda.empty_cache()
    (out_dir / "decode_configs.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
