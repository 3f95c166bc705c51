"""The GPU-only benchmark scripts (benchmarks/) do not run in CI; at least they must parse, so that a device call is
never spent on a syntax error."""

import ast
import pathlib
import py_compile
import subprocess

import pytest

BENCHMARKS = pathlib.Path(__file__).parents[1] / "benchmarks"


@pytest.mark.parametrize("path", sorted(BENCHMARKS.glob("*.py")), ids=lambda p: p.name)
def test_python_scripts_compile(path, tmp_path):
    py_compile.compile(str(path), cfile=str(tmp_path / "x.pyc"), doraise=True)


@pytest.mark.parametrize("path", sorted(BENCHMARKS.glob("*.sh")), ids=lambda p: p.name)
def test_shell_scripts_parse(path):
    subprocess.run(["bash", "-n", str(path)], check=True)


def test_tables_written_do_not_replace_the_documentation_pages():
    """The scripts write their tables under --out, which for some defaults to docs/benchmarks/: no file name they
    write (a ".md" string in their source) may be one of the hand-written pages there (prefill.py once wrote
    prefill.md, decode.py decode.md, over the pages that explain every run)."""
    docs = BENCHMARKS.parent / "docs" / "benchmarks"
    pages = {p.name for p in docs.glob("*.md") if p.read_text().startswith("# ")}
    assert {"prefill.md", "decode.md", "jax.md"} <= pages
    for path in BENCHMARKS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.endswith(".md"):
                assert node.value not in pages, f"{path.name} writes {node.value}, a documentation page"


def test_prefill_sweep_entries_all_run(monkeypatch):
    """Every entry of benchmarks/prefill.py's sweep runs (once, untimed, at N = 96 on the test device: the Triton
    interpreter in CI): a device call's sweep loses no entry to a keyword, an assert or a launch the CPU could have
    caught (a failed entry is logged and timed as NaN, not fatal, so only this test would say)."""
    pytest.importorskip("triton", reason="triton is not installed")
    import math
    import sys

    from kernel_checks import DEVICE

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sys.modules.pop("prefill", None)
    import prefill

    ran = []
    monkeypatch.setattr(prefill, "bench", lambda fn: ran.append(fn()) or 1.0)
    monkeypatch.setattr(prefill, "log", lambda *a: None)
    results = {}
    prefill.sweep(results, N=96, device=str(DEVICE))
    failed = [name for name, t in results["sweep_32k"].items() if math.isnan(t)]
    assert not failed
    assert len(ran) == len(results["sweep_32k"]) >= 56


@pytest.mark.parametrize("stream", [False, True])
def test_gather_floor_kernel_reads_the_selected_rows(monkeypatch, stream):
    """benchmarks/gather_floor.py's kernel (decode.py's floor under the reuse layer) reads exactly the rows of each
    index row (or, streaming, as many consecutive rows), every split of them once: its sums equal torch's."""
    pytest.importorskip("triton", reason="triton is not installed")
    import sys

    import torch
    from kernel_checks import DEVICE

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sys.modules.pop("gather_floor", None)
    import gather_floor

    g = torch.Generator().manual_seed(3)
    B, H, N, D, K = 2, 3, 300, 64, 77
    k = torch.randn(B, H, N, D, generator=g).to(DEVICE)
    v = torch.randn(B, H, N, D, generator=g).to(DEVICE)
    idx = torch.stack([torch.randperm(N, generator=g)[:K].sort().values for _ in range(B * H)]).view(B, H, 1, K)
    idx = idx.to(torch.int32).to(DEVICE)
    run, out = gather_floor.gather_launch(k, v, idx, block_n=32, num_warps=4, programs_per_sm=1, stream=stream, sms=18)
    assert out.shape[2] > 1  # several splits
    run()
    rows = torch.arange(K, device=DEVICE).expand(B, H, K) if stream else idx[:, :, 0].long()
    want = (k.gather(2, rows[..., None].expand(B, H, K, D)) + v.gather(2, rows[..., None].expand(B, H, K, D))).sum(2)
    torch.testing.assert_close(out.sum(2).cpu(), want.float().cpu(), rtol=1e-5, atol=1e-4)


def test_host_overhead_runs_and_times_every_layer_kind(capsys):
    """benchmarks/host_overhead.py at a tiny size (untimed here: timing goals are not unit tests): every layer kind
    and the dense comparison get a time, the stubs count each kind's launches (layer 0 and the anchors select,
    so launch more than a reuse layer), and the kernels are put back."""
    import importlib.util

    from kascade.ops.triton import decode

    kernel = decode._split_kernel
    spec = importlib.util.spec_from_file_location("host_overhead", BENCHMARKS / "host_overhead.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    r = mod.main(["--steps", "3", "--keys", "300", "--layers", "6", "--anchors", "2", "--device", "cpu"])
    assert set(r["us"]) == {"mask function (per step)", "layer 0", "anchor", "reuse", "dense (SDPA function)"}
    assert all(t > 0 for t in r["us"].values())
    n = r["launches"]
    assert n["reuse"] >= 1 and n["anchor"] > n["reuse"] and n["layer 0"] > n["reuse"]
    assert r["setup"]["anchors"] == [0, 3] and decode._split_kernel is kernel
    assert "| reuse |" in capsys.readouterr().out
