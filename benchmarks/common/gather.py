"""The floor under a decode reuse layer: how fast a decode step can read the rows a reuse layer gathers, with no
attention at all, measured on the same GPU in the same run (CUDA-graph replay, as every decode op is timed):

* ``graph_floor``: the replay of a graph holding one empty kernel (what any one-launch op costs at least);
* ``gather_only``: a kernel that only reads the K and V rows of the selection's index rows (and sums them, so that
  the loads are kept) in the reuse kernel's split structure -- (split, KV head, sequence) programs over runs of
  index entries -- at the best of a small launch sweep (keys per block, warps, programs per multiprocessor);
* ``stream_only``: the same kernel over as many *consecutive* rows from the start of each (sequence, KV head): the
  same bytes, streamed; the gap between the two is the cost of the rows being scattered.

``python -m benchmarks.decode`` records all three per shape; ``python -m benchmarks.gather_floor`` runs them alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _empty_kernel(X):
    pass


@triton.jit
def _gather_kernel(K, V, Idx, Out, stride_kb, stride_kh, stride_kn, stride_ib, stride_ih, n_idx, per,
                   H: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, STREAM: tl.constexpr):
    """One program = (split, KV head, sequence): reads the K and V rows of entries [lo, hi) of its index row."""
    split = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    S = tl.num_programs(0)
    offs_d = tl.arange(0, D)
    lo = split * per
    hi = tl.minimum(lo + per, n_idx)
    base_k = K + b.to(tl.int64) * stride_kb + h * stride_kh
    base_v = V + b.to(tl.int64) * stride_kb + h * stride_kh
    acc = tl.zeros([BLOCK_N, D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        jm = j < hi
        if STREAM:
            pos = j.to(tl.int64)
        else:
            pos = tl.load(Idx + b.to(tl.int64) * stride_ib + h * stride_ih + j, mask=jm, other=0).to(tl.int64)
        kt = tl.load(base_k + pos[:, None] * stride_kn + offs_d[None, :], mask=jm[:, None], other=0.0)
        vt = tl.load(base_v + pos[:, None] * stride_kn + offs_d[None, :], mask=jm[:, None], other=0.0)
        acc += kt.to(tl.float32) + vt.to(tl.float32)
    tl.store(Out + ((b * H + h) * S + split) * D + offs_d, tl.sum(acc, 0))


def graph_floor(dev, bench) -> float:
    """us: the replay of a graph of one empty kernel (``bench``: :func:`.timing.graph_us`, which times a graph's
    replay)."""
    x = torch.empty(1, device=dev)
    return bench(lambda: _empty_kernel[(1,)](x))


def gather_launch(k, v, idx, block_n, num_warps, programs_per_sm, stream=False, sms=None):
    """-> (run, out): a launch of the gather kernel over ``idx``'s rows (``stream``: as many consecutive rows) and its
    output ``[B, H, S, D]`` fp32, after ``run()`` the sum of each split's K and V rows."""
    B, H, N, D = k.shape
    n = idx.shape[-1]
    assert v.stride() == k.stride() and idx.stride(-1) == 1
    sms = sms or torch.cuda.get_device_properties(k.device).multi_processor_count
    # the split count as kascade.ops.triton.decode._splits rounds it up, but down to one block a program (its floor
    # is two), so that the sweep also tries the shortest programs
    splits = max(1, min(triton.cdiv(programs_per_sm * sms, B * H), triton.cdiv(n, block_n)))
    per = triton.cdiv(triton.cdiv(n, splits), block_n) * block_n
    S = triton.cdiv(n, per)
    out = torch.empty(B, H, S, D, dtype=torch.float32, device=k.device)

    def run():
        _gather_kernel[(S, H, B)](k, v, idx, out, k.stride(0), k.stride(1), k.stride(2), idx.stride(0), idx.stride(1),
                                  n, per, H=H, D=D, BLOCK_N=block_n, STREAM=stream, num_warps=num_warps)

    return run, out


def gather_times(k, v, idx, bench, sweep=((32, 4), (64, 4), (64, 8), (128, 8)), per_sm=(2, 4, 8, 16)) -> dict:
    """{"gather_only": us, "stream_only": us, "gather_cfg": ..., "stream_cfg": ...}: the fastest launch of each over
    ``sweep`` ((keys per block, warps)) x ``per_sm``, timed by ``bench`` (:func:`.timing.graph_us`: a graph's replay).
    ``k, v [B, H, N, D]``; ``idx [B, H, 1, K]`` (no padding)."""
    assert bool((idx >= 0).all()), "index rows without padding"
    res = {}
    for stream in (False, True):
        best = None
        for bn, nw in sweep:
            for pps in per_sm:
                run, out = gather_launch(k, v, idx, bn, nw, pps, stream)
                us = bench(run)
                if best is None or us < best[0]:
                    best = (us, {"block_n": bn, "num_warps": nw, "programs_per_sm": pps, "splits": out.shape[2]})
        key = "stream_only" if stream else "gather_only"
        res[key], res[key.replace("_only", "_cfg")] = best
    return res
