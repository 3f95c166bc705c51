"""GPU timing of the kernel benchmarks: a CUDA graph's replay timed by ``triton.testing.do_bench`` (median, L2
flushed before every call), as a serving engine runs decode; and event-timed medians for long ops."""

from __future__ import annotations

import torch
from triton.testing import do_bench

from kascade.costs_measure import cuda_us


def graphed(fn):
    """Capture fn in a CUDA graph (after a warm-up call that compiles); return the replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def graph_us(fn, graph=True, warmup=10, rep=60) -> float:
    """Median us of ``fn`` captured in a CUDA graph and replayed (``graph=False``: eager calls)."""
    f = graphed(fn) if graph else fn
    if not graph:
        fn()
    return do_bench(f, warmup=warmup, rep=rep, return_mode="median") * 1e3


def median_ms(fn) -> float:
    """Median ms (:func:`kascade.costs_measure.cuda_us`: do_bench for short ops, three event-timed runs for long
    ones)."""
    return cuda_us(fn) / 1e3


def copy_bandwidth(dev) -> float:
    """TB/s of a device-to-device copy, read + write: the ceiling of a memory-bound kernel."""
    x = torch.empty(2 << 30, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    t = do_bench(lambda: y.copy_(x), warmup=10, rep=100, return_mode="median") * 1e-3
    del x, y
    return 2 * (2 << 30) / t / 1e12
