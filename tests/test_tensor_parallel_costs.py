"""The exchange's cost model (kascade.tensor_parallel: exchange_bytes, selection_shape, step_exchange_bytes) against
numbers computed by hand, and against the bytes a 2-rank gloo run actually gathers (this file is also that run's
worker: ``torchrun ... tests/test_tensor_parallel_costs.py --model DIR --out FILE``)."""

import argparse
import json
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from kascade import Budget, KascadePlan, ModelFingerprint
from kascade.tensor_parallel import bytes_per_index, exchange_bytes, selection_shape, step_exchange_bytes

# Llama-3.1-8B: 32 layers, 8 KV heads, head dim 128; the benchmarks' plan has 5 anchors (layer 0 among them).
LLAMA8B = ModelFingerprint("llama", num_layers=32, num_q_heads=32, num_kv_heads=8, head_dim=128)
N128K = 131072
K128K = 13107  # k(131072) = floor(0.1 * 131072)


def _llama8b_plan(**budget):
    return KascadePlan.uniform(LLAMA8B, 5, **budget)


# -- by hand -------------------------------------------------------------------------------------------------------
def test_decode_bytes_at_llama_shapes_by_hand():
    # whole selection of one anchor, B=1: 8 heads x 1 row x 13107 keys x 4 bytes = 419,424 bytes; 5 anchors:
    # 2,097,120; one rank receives (ranks - 1) / ranks of it
    for ranks, want in ((1, 0), (2, 1_048_560), (4, 1_572_840), (8, 1_834_980)):
        got = exchange_bytes(ranks, batch=1, kv_heads=8, rows=1, width=K128K, index_bytes=4, anchors=5)
        assert got == want, ranks
    # B=32: 32 times as much
    for ranks, want in ((2, 33_553_920), (4, 50_330_880), (8, 58_719_360)):
        assert exchange_bytes(ranks, batch=32, kv_heads=8, rows=1, width=K128K, index_bytes=4, anchors=5) == want


def test_triton_sends_int32_and_the_reference_int64():
    """What the exchange sends is the selection as the ops made it: int32 on the Triton backend (prefill and decode:
    Step.index_dtype), int64 on the reference."""
    assert bytes_per_index("reference") == 8 and bytes_per_index("triton") == 4
    with pytest.raises(ValueError, match="backend"):
        bytes_per_index("cuda")
    plan = _llama8b_plan()
    assert plan.anchors == (0, 6, 12, 19, 25)
    # decode at 128K: 5 anchors x 8 heads x 13107 x 4 bytes = 2,097,120 per step in all; TP 2 receives half
    for ranks, want in ((2, 1_048_560), (4, 1_572_840), (8, 1_834_980)):
        assert step_exchange_bytes(plan, ranks, batch=1, keys=N128K, backend="triton") == want
        assert step_exchange_bytes(plan, ranks, batch=32, keys=N128K, backend="triton") == 32 * want
    # prefill at 128K on Triton: 4096 tiles x 13075 keys (k(N) - T = 13107 - 32; the last tile's rolling cap
    # floor(0.1 x 131040) = 13104 is larger) x 8 heads x 4 bytes = 1,713,766,400 bytes per anchor, 5 anchors
    whole = 4096 * 13075 * 8 * 4 * 5
    assert whole == 8_568_832_000
    for ranks in (2, 4, 8):
        got = step_exchange_bytes(plan, ranks, batch=1, keys=N128K, queries=N128K, backend="triton")
        assert got == whole * (ranks - 1) // ranks
    # at 32K: k = 3276, the last tile keeps 3244, 1024 tiles
    assert step_exchange_bytes(plan, 2, batch=1, keys=32768, queries=32768, backend="triton") == \
        1024 * 3244 * 8 * 4 * 5 // 2
    assert step_exchange_bytes(plan, 4, batch=1, keys=32768, backend="triton") == 3276 * 8 * 4 * 5 * 3 // 4


def test_selection_shape_counts_tiles_and_pads_rows_by_hand():
    # ratio 0.5, k_min 2, tile 4, rolling; 24 keys: k = 12, k - T = 8; tiles start at s = 0, 4, 8, 12, 16, 20 with
    # rolling caps max(2, floor(s / 2)) = 2, 2, 4, 6, 8, 10: rows keep 0, 2, 4, 6, 8, 8 keys (28 in all), but the
    # tensor is 6 rows x 8 (48 entries)
    b = Budget(ratio=0.5, k_min=2, tile=4, rolling=True)
    assert [b.prefill_tile(s, 24) for s in range(0, 24, 4)] == [0, 2, 4, 6, 8, 8]
    assert selection_shape(b, 24, 24) == (6, 8)
    assert selection_shape(b, 24, 10) == (3, 8)  # a chunk whose first query (position 14) sits in tile 3
    assert selection_shape(b, 24, 4) == (1, 8)
    assert selection_shape(b, 10, 10) == (3, 1)  # k(10) = 5, k - T = 1: rows keep 0, 1, 1
    assert selection_shape(b, 24, 1) == (1, 12)  # decode: k(24) = 12
    assert selection_shape(b, 24, 24, rank_factor=2.0) == (6, 16)  # ranked 2 deep: min(s, 2 c) = 0, 4, 8, 12, 16, 16
    assert selection_shape(Budget(ratio=0.1, k_min=4, tile=4), 100, 1, rank_factor=1.5) == (1, 15)
    assert selection_shape(Budget(ratio=0.5, k_min=2, tile=4, rolling=False), 24, 24) == (6, 8)
    whole = 6 * 8 * 3 * 8  # rows x width x heads x int64
    assert exchange_bytes(3, batch=1, kv_heads=3, rows=6, width=8, index_bytes=8) == whole * 2 // 3
    with pytest.raises(ValueError, match="do not split evenly"):
        exchange_bytes(3, batch=1, kv_heads=8, rows=1, width=1, index_bytes=4)
    with pytest.raises(ValueError, match="queries"):
        selection_shape(b, 24, 25)


# -- measured: what a 2-rank gloo run gathers ------------------------------------------------------------------------
def _plans(model):
    """Anchors 0, 2 of 4 layers, every link crossing at TP 2; and the same with per-layer budgets (ranked: anchor 0
    is ranked 1.5 deep)."""
    fp = ModelFingerprint.from_model(model)
    H = fp.num_kv_heads
    ident, flip = tuple(range(H)), tuple((h + H // 2) % H for h in range(H))
    plan = KascadePlan(fp, (0, 2), tuple(ident if l in (0, 2) else flip for l in range(fp.num_layers)),
                       ratio=0.25, k_min=16, tile=8, calibrated=True, source="test: crossing links")
    return {"faithful": plan, "ranked": plan.with_reuse(factor=(1.0, 1.5, 1.0, 0.5))}


BATCH, LENGTH = 2, 96


def _worker() -> None:
    """One rank: a prefill and a decode step of each plan with exchange, counting the bytes all_gather brings in."""
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, DynamicCache

    import kascade
    from kascade.models import cache_kwargs

    model = AutoModelForCausalLM.from_pretrained(args.model, tp_plan="auto", dtype=torch.float32).eval()
    received = []
    gather = dist.all_gather

    def counting(parts, tensor, group=None, **kw):
        out = gather(parts, tensor, group=group, **kw)
        me = dist.get_rank(group)
        received.append(sum(t.numel() * t.element_size() for i, t in enumerate(parts) if i != me))
        return out

    dist.all_gather = counting
    ids = torch.randint(3, model.config.vocab_size, (BATCH, LENGTH), generator=torch.Generator().manual_seed(0))
    report = {}
    for name, plan in _plans(model).items():
        steps = {}
        with torch.no_grad(), kascade.enable(model, plan, exchange=True, warn_uncalibrated=False):
            cache = DynamicCache()
            for step, x in (("prefill", ids), ("decode", ids[:, :1])):
                received.clear()
                model(x, use_cache=True, **cache_kwargs(model, cache))
                steps[step] = dict(bytes=sum(received), gathers=len(received))
        report[name] = steps
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_gather_what_the_model_predicts(tmp_path):
    from conftest import tiny_model

    model = tiny_model("llama", num_attention_heads=8, num_key_value_heads=4, head_dim=8, hidden_size=64)
    model.save_pretrained(tmp_path / "model")
    out = tmp_path / "bytes.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()),
           __file__, "--model", str(tmp_path / "model"), "--out", str(out)]
    r = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    for name, plan in _plans(model).items():
        for step, keys, queries in (("prefill", LENGTH, LENGTH), ("decode", LENGTH + 1, 1)):
            got = report[name][step]
            assert got["gathers"] == len(plan.anchors), (name, step)
            want = step_exchange_bytes(plan, 2, batch=BATCH, keys=keys, queries=queries, backend="reference")
            assert got["bytes"] == want > 0, (name, step)
    # by hand, the faithful plan's prefill: k(96) = 24, k - T = 16, 12 tiles of 8 keep up to 16 keys; the other rank's
    # 2 heads of 2 sequences, int64, 2 anchors
    assert report["faithful"]["prefill"]["bytes"] == 2 * BATCH * 2 * 12 * 16 * 8
    # decode: k(97) = 24 keys; the ranked plan's anchor 0 keeps round(1.5 x 24) = 36
    assert report["faithful"]["decode"]["bytes"] == 2 * BATCH * 2 * 24 * 8
    assert report["ranked"]["decode"]["bytes"] == (36 + 24) * BATCH * 2 * 8


if __name__ == "__main__":
    _worker()
