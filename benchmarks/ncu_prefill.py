"""Run the prefill sparse (reuse) kernel a few times, for Nsight Compute to read its hardware counters (GPU machine).

    ncu --clock-control none -k regex:_sparse_kernel -s 2 -c 1 --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats --section LaunchStats --section MemoryWorkloadAnalysis \\
        python3 -m benchmarks.ncu_prefill 32768 --block-m 64

Llama-3.1-8B shapes (32 query heads, 8 KV heads, D = 128), bf16, B = 1, 10 % budget, over the anchor selection of
random inputs (``--contiguous``: the same number of keys per tile, but the first ones, to tell the gather's cost from
the kernel's); launch configuration as the library makes it unless given.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common.shapes import MODELS
from benchmarks.common.shapes import PREFILL_BUDGET as BUDGET
from benchmarks.common.shapes import first_keys
from benchmarks.common.shapes import prefill_inputs as inputs
from kascade.ops.triton import prefill as tp


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("N", type=int)
    ap.add_argument("--model", default="llama-3.1-8b", choices=sorted(MODELS))
    ap.add_argument("--block-m", type=int, default=None)
    ap.add_argument("--block-n", type=int, default=None)
    ap.add_argument("--warps", type=int, default=None)
    ap.add_argument("--stages", type=int, default=None)
    ap.add_argument("--contiguous", action="store_true")
    ap.add_argument("--repeat", type=int, default=4)
    args = ap.parse_args(argv)
    HQ, H, D = MODELS[args.model]
    q, k, v = inputs(HQ, H, D, args.N)
    sc = D**-0.5
    sel = tp.select_prefill(q, k, budget=BUDGET, scale=sc, index_dtype=torch.int32)
    if args.contiguous:
        sel = first_keys(sel)
    for _ in range(args.repeat):
        tp.sparse_prefill(q, k, v, sel, scale=sc, block_m=args.block_m, block_n=args.block_n,
                          num_warps=args.warps, num_stages=args.stages)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
