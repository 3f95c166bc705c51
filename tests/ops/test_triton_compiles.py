"""Every Triton kernel compiles for an H100 / H200 (sm_90) through Triton's GPU compiler, on a CPU machine.

The interpreter that runs the other kernel tests accepts code the GPU compiler refuses (a kernel reading a plain
Python global was one: it passed every CPU test and failed on the H200, 2026-12-04), so CI compiles each kernel
variant the launchers make (tests/ops/compile_sm90.py, in a subprocess: the interpreter must be off there) and checks
that it fits in an H100's shared memory per block (227 KB) and that ptxas does not serialise its wgmma instructions
(each waited for before the next: the prefill sparse kernel lost a third of its speed that way under the GPU
machine's Triton, 3.6.0, and not under 3.9). It runs with the installed Triton and, where ``KASCADE_GPU_TRITON``
names a folder holding the GPU machine's (``.ci/run`` installs Triton 3.6.0 there), with that one too."""

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


GPU_TRITON = os.environ.get("KASCADE_GPU_TRITON", "")


@pytest.mark.skipif(not _have_cuda_backend(), reason="this Triton has no NVIDIA back end")
@pytest.mark.parametrize("compiler", ["installed", "gpu"])
def test_every_kernel_variant_compiles_for_sm90(compiler):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    path = [str(pathlib.Path(__file__).resolve().parents[2] / "src")]
    if compiler == "gpu":
        if not GPU_TRITON:
            pytest.skip("KASCADE_GPU_TRITON unset: the GPU machine's Triton is not installed here (.ci/run does it)")
        path.insert(0, GPU_TRITON)
    env["PYTHONPATH"] = os.pathsep.join(path + [env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    names = [r["kernel"] for r in rows]
    # every kernel of the three modules, in the variants the launchers make
    for part in ("decode score", "decode sparse", "decode dense_scores", "prefill dense",
                 "prefill lse", "prefill score", "prefill sparse", "topk pool", "topk hist", "topk radix L2",
                 "topk radix L3", "topk radix L5", "topk write", "step mask q", "step mask ones", "step meta start",
                 "step meta ones"):
        assert any(n.startswith(part) for n in names), (part, names)
    failed = [r for r in rows if not r["ok"]]
    assert not failed, failed
    too_big = [r for r in rows if r["shared"] > 227 * 1024]
    assert not too_big, too_big
    serialised = [r["kernel"] for r in rows if r["serialised"]]
    assert not serialised, serialised
