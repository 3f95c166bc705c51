"""Run one decode pass a few times, for Nsight Compute to read its hardware counters (GPU machine).

    ncu --clock-control none -k regex:_split_kernel -s 2 -c 1 --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats --section LaunchStats --section MemoryWorkloadAnalysis \\
        python3 -m benchmarks.ncu_decode sparse 8 32768

PASS is "sparse" (a reuse layer), "score" (an anchor's scoring pass) or "dense"; Llama-3.1-8B shapes (32 query
heads, 8 KV heads, D = 128), bf16, 10 % budget, launches as the library makes them.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common.shapes import DECODE_BUDGET as BUDGET
from benchmarks.common.shapes import MODELS
from benchmarks.common.shapes import decode_inputs as make
from kascade.ops.triton import decode as td


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pass_", metavar="PASS", choices=("sparse", "score", "dense"))
    ap.add_argument("B", type=int)
    ap.add_argument("N", type=int)
    ap.add_argument("--repeat", type=int, default=4)
    args = ap.parse_args(argv)
    B, N = args.B, args.N
    HQ, H, D = MODELS["llama-3.1-8b"]
    q, k, v = make(B, HQ, H, N, D, torch.device("cuda"))
    meta = td.decode_meta(B, device=q.device, q_offset=N - 1, budget=BUDGET)
    idx = td.select_decode(q, k, budget=BUDGET, scale=D**-0.5, meta=meta, index_dtype=torch.int32).indices
    for _ in range(args.repeat):
        if args.pass_ == "sparse":
            td.sparse_decode(q, k, v, idx, scale=D**-0.5)
        elif args.pass_ == "score":
            td.select_decode(q, k, budget=BUDGET, scale=D**-0.5, meta=meta)
        else:
            td.dense_decode(q, k, v, scale=D**-0.5, meta=meta)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
