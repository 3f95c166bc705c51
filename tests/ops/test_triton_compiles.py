"""Every Triton kernel compiles for an H100 / H200 (sm_90) through Triton's GPU compiler, on a CPU machine.

The interpreter that runs the other kernel tests accepts code the GPU compiler refuses (a kernel reading a plain
Python global was one: it passed every CPU test and failed on the H200, 2026-12-04), so CI compiles each kernel
variant the launchers make (tests/ops/compile_sm90.py, in a subprocess: the interpreter must be off there) and checks
that it fits in an H100's shared memory per block (227 KB)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).with_name("compile_sm90.py")


def _have_cuda_backend() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _have_cuda_backend(), reason="this Triton has no NVIDIA back end")
def test_every_kernel_variant_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = str(pathlib.Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    names = [r["kernel"] for r in rows]
    # every kernel of the three modules, in the variants the launchers make
    for part in ("decode score", "decode sparse", "decode dense_scores", "decode merge", "prefill dense",
                 "prefill lse", "prefill score", "prefill sparse", "topk pool", "topk hist", "topk radix L2",
                 "topk radix L3", "topk radix L5", "topk write"):
        assert any(n.startswith(part) for n in names), (part, names)
    failed = [r for r in rows if not r["ok"]]
    assert not failed, failed
    too_big = [r for r in rows if r["shared"] > 227 * 1024]
    assert not too_big, too_big
