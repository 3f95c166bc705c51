"""How fast can a decode step read the rows a reuse layer gathers, with no attention at all? (One GPU.)

    python -m benchmarks.gather_floor [--n 131072] [--b 1] [--shape 32,8,128]

Prints, for one shape, the reuse layer's time beside its floors (``benchmarks.common.gather``): the replay of a graph
of one empty kernel, a kernel that only reads the selected K / V rows, and one that reads as many consecutive rows.
``python -m benchmarks.decode`` records the same per shape.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common.gather import gather_times, graph_floor
from benchmarks.common.shapes import DECODE_BUDGET
from benchmarks.common.timing import graph_us
from kascade.ops.triton import decode as td


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=131072, help="keys per sequence (default 128K)")
    ap.add_argument("--b", type=int, default=1, help="batch (default 1)")
    ap.add_argument("--shape", default="32,8,128", help="query heads, KV heads, head dim (default Llama-3.1-8B's)")
    args = ap.parse_args(argv)
    HQ, H, D = map(int, args.shape.split(","))
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(args.b, HQ, 1, D, generator=g, device=dev, dtype=torch.bfloat16)
    k = torch.randn(args.b, H, args.n, D, generator=g, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    idx = td.select_decode(q, k, budget=DECODE_BUDGET, scale=D**-0.5).indices
    reuse = graph_us(lambda: td.sparse_decode(q, k, v, idx, scale=D**-0.5))
    t = gather_times(k, v, idx, graph_us)
    gathered = 2 * k.shape[0] * H * idx.shape[-1] * D * k.element_size()
    print(f"B={args.b} N={args.n} heads {HQ}/{H} D={D}: graph floor {graph_floor(dev, graph_us):.1f} us; "
          f"reuse {reuse:.1f} us; "
          f"gather only {t['gather_only']:.1f} us ({gathered / t['gather_only'] / 1e6:.2f} TB/s, {t['gather_cfg']}); "
          f"stream only {t['stream_only']:.1f} us ({gathered / t['stream_only'] / 1e6:.2f} TB/s, {t['stream_cfg']})")


if __name__ == "__main__":
    main()
