"""benchmarks.tp_bench as the two-GPU run will use it, on CPUs: torchrun, 2 gloo ranks, the tiny model. It must
run end to end (random weights written by rank 0, a reference, the sharded model, the one-device baseline), find
tensor-parallel Kascade equal to one process (shard-local and exchange), count the exchange's bytes as the cost model
says, and time every mode."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]  # python -m benchmarks.tp_bench runs from the repository root


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tp_bench_runs_on_two_gloo_ranks(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()),
           "-m", "benchmarks.tp_bench", "--tiny", "--out", str(out), "--weights-dir", str(tmp_path / "weights"),
           "--lengths", "64", "--batches", "2", "--check-lengths", "40", "130", "--check-tokens", "3",
           "--repeats", "2", "--decode-steps", "3", "--exchange-iters", "5"]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=path)
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert res["status"] == "done" and res["machine"]["ranks"] == 2
    assert res["machine"]["env"] == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                                     "NVSHMEM_DISABLE_NVLS": "1"}
    assert res["plan"]["crossing_links"] > 0  # the exchange has links to serve

    checks = {(c["length"], c["mode"]): c for c in res["correctness"]}
    assert set(checks) == {(n, m) for n in (40, 130) for m in ("dense", "shard-local", "exchange")}
    for key, c in checks.items():
        assert c["passed"] and c["tokens_equal"] and c["max_logit_diff"] < 1e-4, (key, c)
        assert len(c["tokens"][0]) == 4  # the prefill's token and 3 decode steps
    counted = res["exchange_bytes_check"]
    assert len(counted) == 2 * 4 and all(e["counted"] == e["model"] for e in counted), counted
    assert all(e["counted"] > 0 for e in counted)  # the tiny budget selects in prefill and decode alike

    (cfg,) = res["configs"]
    assert (cfg["batch"], cfg["length"]) == (2, 64)
    for setup, modes in (("tp", ("dense", "shard-local", "exchange")), ("one_gpu", ("dense", "kascade"))):
        assert set(cfg[setup]) == set(modes), setup
        for mode in modes:
            m = cfg[setup][mode]
            assert m["ttft_s"] > 0 and m["itl_s"] > 0 and len(m["itl_all_s"]) == 3, (setup, mode, m)
            assert m["decode"] == "eager" and len(m["ttft_all_s"]) == 2
    assert cfg["tp"]["shard-local"]["backend"] == cfg["tp"]["exchange"]["backend"] == "reference"
    ex = cfg["exchange_cost"]
    assert ex["counted_bytes"] == ex["model_bytes"] > 0
    assert ex["alone"]["bytes_received_per_step"] == ex["model_bytes"] and ex["alone"]["seconds_per_step"] > 0
    assert ex["itl_difference_s"] is not None
    md = (out / "results.md").read_text()
    assert "| 2 | 64 | TP 2 | exchange |" in md and "| 2 | 64 | 1 device | kascade |" in md
    assert (out / "results.png").stat().st_size > 0
