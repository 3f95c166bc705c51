"""The benchmarks package (benchmarks/): the GPU-only scripts do not run in CI, so they must at least parse (a device
call is never spent on a syntax error), keep the package's layering (a script imports only kascade and
benchmarks.common, never another script, and edits no sys.path), name no machine's paths, stay readable in size,
and write their tables outside the documentation."""

import ast
import pathlib
import py_compile
import re
import subprocess

import pytest

BENCHMARKS = pathlib.Path(__file__).parents[1] / "benchmarks"
SOURCES = sorted(BENCHMARKS.rglob("*.py"))
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if p.name != "__init__.py")
ALLOWED = re.compile(r"^benchmarks\.common(\.|$)")  # the one part of the benchmarks package a script imports


def _rel(path):
    return str(path.relative_to(BENCHMARKS))


@pytest.mark.parametrize("path", SOURCES, ids=_rel)
def test_python_files_compile(path, tmp_path):
    py_compile.compile(str(path), cfile=str(tmp_path / "x.pyc"), doraise=True)


@pytest.mark.parametrize("path", sorted(BENCHMARKS.glob("*.sh")), ids=_rel)
def test_shell_scripts_parse(path):
    subprocess.run(["bash", "-n", str(path)], check=True)


def _imports(path):
    """(module, level) of every import in the file, those inside functions too."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, 0) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append((node.module or "", node.level))
    return out


@pytest.mark.parametrize("path", SCRIPTS, ids=_rel)
def test_a_script_imports_kascade_and_the_common_floor_only(path):
    """Of the project's code a script imports kascade and benchmarks.common, nothing else: no other script (by
    package, relative or plain name) and no benchmarks package but the common one."""
    names = {p.stem for p in SCRIPTS}
    for module, level in _imports(path):
        assert level == 0, f"{path.name}: a relative import"
        top = module.split(".")[0]
        assert top not in names, f"{path.name} imports the script {module}"
        if top == "benchmarks":
            assert ALLOWED.match(module), f"{path.name} imports {module}"


@pytest.mark.parametrize("path", sorted((BENCHMARKS / "common").glob("*.py")), ids=_rel)
def test_the_common_floor_imports_no_script(path):
    names = {p.stem for p in SCRIPTS}
    for module, level in _imports(path):
        if level:  # relative: within benchmarks.common
            assert level == 1, f"{path.name}: from {'.' * level}{module} leaves benchmarks.common"
        else:
            assert module.split(".")[0] not in names, f"{path.name} imports the script {module}"
            assert module.split(".")[0] != "benchmarks" or ALLOWED.match(module), f"{path.name} imports {module}"


def _text_files():
    return [p for p in sorted(BENCHMARKS.rglob("*")) if p.suffix in (".py", ".sh")]


def test_no_file_edits_sys_path():
    for path in _text_files():
        assert not re.search(r"sys\.path\.(insert|append)|syspath_prepend", path.read_text()), path.name


def test_no_machine_paths():
    """Usage lines and defaults name no folder of one machine (the GPU machine's /root/..., a home folder)."""
    for path in _text_files():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            assert not re.search(r"/root\b|/home/\w|/work/\w", line), f"{path.name}:{n}: {line.strip()}"


@pytest.mark.parametrize("path", SOURCES, ids=_rel)
def test_no_file_is_over_500_lines(path):
    assert len(path.read_text().splitlines()) <= 500, path.name


@pytest.mark.parametrize("path", SCRIPTS, ids=_rel)
def test_a_script_runs_as_a_module_with_usage_lines_that_say_so(path):
    """Every script has a ``__main__`` entry, and the command lines in its docstring are ``python -m benchmarks.NAME``
    (the package's imports need it), not a path to the file."""
    text = path.read_text()
    assert 'if __name__ == "__main__":' in text, path.name
    doc = ast.get_docstring(ast.parse(text)) or ""
    assert f"benchmarks.{path.stem}" in doc, f"{path.name}: its docstring shows no python -m command"
    assert not re.search(r"python3? benchmarks/\w+\.py", text), path.name


def test_tables_are_written_outside_the_documentation():
    """Every --out default is ``out/<name>`` (``benchmarks.common.out_folder``) or required, and no script names a
    folder of the documentation (docs/) or of the package's data: committed figures are curated into
    src/kascade/results by hand (the scripts once wrote their tables over the pages that explained every run). The one
    exception is benchmarks.tables, whose job is to rewrite the marked results tables of the README and the manual."""
    for path in (p for p in SCRIPTS if p.name != "tables.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert not re.search(r"(^|\s)(docs|src/kascade/results)/", node.value), (path.name, node.value)
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument" and node.args
                    and getattr(node.args[0], "value", None) == "--out"):
                kw = {k.arg: k.value for k in node.keywords}
                default = getattr(kw.get("default"), "value", None)
                required = getattr(kw.get("required"), "value", False)
                assert required or default is None, f"{path.name}: --out default {default!r}"


def test_prefill_sweep_entries_all_run(monkeypatch):
    """Every entry of benchmarks.prefill's sweep runs (once, untimed, at N = 96 on the test device: the Triton
    interpreter in CI): a device call's sweep loses no entry to a keyword, an assert or a launch the CPU could have
    caught (a failed entry is logged and timed as NaN, not fatal, so only this test would say)."""
    pytest.importorskip("triton", reason="triton is not installed")
    import math

    from kernel_checks import DEVICE

    from benchmarks import prefill

    ran = []
    monkeypatch.setattr(prefill, "bench", lambda fn: ran.append(fn()) or 1.0)
    monkeypatch.setattr(prefill, "log", lambda *a: None)
    results = {}
    prefill.sweep(results, N=96, device=str(DEVICE))
    failed = [name for name, t in results["sweep_32k"].items() if math.isnan(t)]
    assert not failed
    assert len(ran) == len(results["sweep_32k"]) >= 56


@pytest.mark.parametrize("stream", [False, True])
def test_gather_floor_kernel_reads_the_selected_rows(stream):
    """The floor kernel under the reuse layer (benchmarks.common.gather, which benchmarks.decode records per shape)
    reads exactly the rows of each index row (or, streaming, as many consecutive rows), every split of them once:
    its sums equal torch's."""
    pytest.importorskip("triton", reason="triton is not installed")
    import torch
    from kernel_checks import DEVICE

    from benchmarks.common import gather

    g = torch.Generator().manual_seed(3)
    B, H, N, D, K = 2, 3, 300, 64, 77
    k = torch.randn(B, H, N, D, generator=g).to(DEVICE)
    v = torch.randn(B, H, N, D, generator=g).to(DEVICE)
    idx = torch.stack([torch.randperm(N, generator=g)[:K].sort().values for _ in range(B * H)]).view(B, H, 1, K)
    idx = idx.to(torch.int32).to(DEVICE)
    run, out = gather.gather_launch(k, v, idx, block_n=32, num_warps=4, programs_per_sm=1, stream=stream, sms=18)
    assert out.shape[2] > 1  # several splits
    run()
    rows = torch.arange(K, device=DEVICE).expand(B, H, K) if stream else idx[:, :, 0].long()
    want = (k.gather(2, rows[..., None].expand(B, H, K, D)) + v.gather(2, rows[..., None].expand(B, H, K, D))).sum(2)
    torch.testing.assert_close(out.sum(2).cpu(), want.float().cpu(), rtol=1e-5, atol=1e-4)


def test_host_overhead_runs_and_times_every_layer_kind(capsys):
    """python -m benchmarks.host_overhead at a tiny size (untimed here: timing goals are not unit tests): every layer kind
    and the dense comparison get a time, the stubs count each kind's launches (layer 0 and the anchors select,
    so launch more than a reuse layer), and the kernels are put back."""
    from benchmarks import host_overhead
    from kascade.ops.triton import decode

    kernel = decode._split_kernel
    r = host_overhead.main(["--steps", "3", "--keys", "300", "--layers", "6", "--anchors", "2", "--device", "cpu"])
    assert set(r["us"]) == {"mask function (per step)", "layer 0", "anchor", "reuse", "dense (SDPA function)"}
    assert all(t > 0 for t in r["us"].values())
    n = r["launches"]
    assert n["reuse"] >= 1 and n["anchor"] > n["reuse"] and n["layer 0"] > n["reuse"]
    assert r["setup"]["anchors"] == [0, 3] and decode._split_kernel is kernel
    assert "| reuse |" in capsys.readouterr().out


def test_host_overhead_grows_a_dynamic_cache_through_rotated_head_maps(monkeypatch):
    """--cache dynamic --head-maps rotated: every step one key more (the mask function sees each length), and the
    reuse layers read their anchors' selections through rotated head maps (benchmarks.common.plans)."""
    from benchmarks import host_overhead
    from benchmarks.common.plans import uniform_plan
    from kascade.integration import functions
    from kascade.plan import ModelFingerprint
    from transformers import LlamaConfig

    lengths, mask = [], functions.kascade_mask
    monkeypatch.setattr(functions, "kascade_mask", lambda **kw: (
        lengths.append((kw["kv_length"], kw["attention_mask"].shape[1])), mask(**kw))[1])
    r = host_overhead.main(["--steps", "3", "--keys", "300", "--layers", "6", "--anchors", "2", "--device", "cpu",
                            "--cache", "dynamic", "--head-maps", "rotated"])
    assert lengths == [(n, n) for n in range(300, 323)] and r["setup"]["cache"] == "dynamic"  # the mask as long
    assert r["setup"]["head_maps"] == "rotated" and r["us"]["reuse"] > 0
    fp = ModelFingerprint.from_config(LlamaConfig(num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                                                  hidden_size=64))
    plan = uniform_plan(fp, 2, "rotated")
    assert plan.anchors == (0, 3) and plan.head_map[3] == (0, 1) and plan.head_map[1] == plan.head_map[5] == (1, 0)


def test_host_overhead_times_a_ranked_plan_with_its_kernels_stubbed():
    """--budgets per-layer (the default model's kind of plan: ranked anchors, reuse layers on prefixes): the stubbed
    step runs (before, ranking gathered pooled values at the stubs' unwritten indices and failed), the kernels are put
    back, and the plan keeps (1, 0.5, 1.5, 2) times the budget per layer, its anchors ranking as deep as their readers."""
    from benchmarks import host_overhead
    from benchmarks.common.plans import uniform_plan
    from kascade.ops.triton import topk
    from kascade.plan import ModelFingerprint

    write = topk._write_kernel
    r = host_overhead.main(["--steps", "3", "--keys", "300", "--layers", "6", "--anchors", "2", "--device", "cpu",
                            "--cache", "dynamic", "--head-maps", "rotated", "--budgets", "per-layer"])
    assert r["setup"]["budgets"] == "per-layer" and all(t > 0 for t in r["us"].values())
    assert topk._write_kernel is write
    plan = uniform_plan(ModelFingerprint("llama", 6, 4, 2, 16), 2, "rotated", "per-layer")
    assert plan.ranked and plan.reuse.factor == (1.0, 0.5, 1.5, 2.0, 1.0, 0.5)
    assert [plan.rank_factor(a) for a in plan.anchors] == [1.5, 2.0]


def test_eager_decode_quick_runs_every_measurement(tmp_path):
    """python -m benchmarks.eager_decode --quick (tiny shapes; on a CPU the kernels in Triton's interpreter): every
    layer call and both generate runs get a time, and the JSON and the summary are written."""
    from benchmarks import eager_decode

    r = eager_decode.main(["--quick", "--out", str(tmp_path)])
    m = r["layers"][0]["median"]
    assert set(m) == {"dense (SDPA)", "dense (transformers' SDPA function)", "reuse", "anchor"}
    assert all(row["host_us"] > 0 and row["back_to_back_us"] > 0 for row in m.values())
    (gen,) = r["generate"]
    assert gen["runs"] and all(run["dense_itl_ms"] > 0 and run["kascade_itl_ms"] > 0 for run in gen["runs"])
    assert (tmp_path / "eager_decode.json").exists()
    assert "| reuse |" in (tmp_path / "summary.txt").read_text()


def test_generate_host_quick_times_every_part_of_both_paths(tmp_path):
    """python -m benchmarks.generate_host --quick: inside generate, dense's step times its mask and attention
    functions, Kascade's its mask function and each layer kind, both their forward and step; the registries are
    restored afterwards (a later enable times nothing)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from benchmarks import generate_host
    from kascade.integration import functions

    sdpa, attn = ALL_ATTENTION_FUNCTIONS._global_mapping["sdpa"], functions.kascade_attention_forward
    r = generate_host.main(["--quick", "--rounds", "1", "--profile", "--out", str(tmp_path)])
    (run,) = r["runs"]
    assert set(run["dense"]) == {"step_us", "tokens", "forward", "mask", "dense"}
    assert set(run["kascade"]) == {"step_us", "tokens", "forward", "mask", "layer 0", "anchor", "reuse"}
    assert all(run[p][k]["median_us"] > 0 for p in run for k in run[p] if k not in ("step_us", "tokens"))
    assert run["kascade"]["reuse"]["per_step"] == 2 and len(run["kascade"]["tokens"]) == r["steps"]
    assert ALL_ATTENTION_FUNCTIONS._global_mapping["sdpa"] is sdpa and functions.kascade_attention_forward is attn
    assert "| kascade |" in (tmp_path / "summary.md").read_text()
    assert "kascade" in (tmp_path / "profile.txt").read_text()


def test_eager_decode_launch_both_alternates_the_paths(tmp_path, monkeypatch):
    """--launch both: the layer timings and generate each once per launch path, named, and the library's launch
    switch left as it was (a benchmark must not leave the process on another path)."""
    from benchmarks import eager_decode
    from kascade.ops.triton import launch

    seen = []
    timings = eager_decode.layer_timings
    monkeypatch.setattr(eager_decode, "layer_timings", lambda *a, **kw: seen.append(launch.FAST) or timings(*a, **kw))
    r = eager_decode.main(["--quick", "--launch", "both", "--out", str(tmp_path)])
    assert seen == [False, True]
    assert [x["launch"] for x in r["layers"]] == ["triton", "direct"]
    assert [x["launch"] for x in r["generate"]] == ["triton", "direct"]
    assert all(g["runs"] for g in r["generate"]) and launch.FAST
    text = (tmp_path / "summary.txt").read_text()
    assert "triton launches" in text and "direct launches" in text


def test_fp8_selection_measures_by_hand():
    """benchmarks.fp8_selection's two measures on rows built by hand: one row whose FP8 ranking swaps the exact
    second and third keys (count 2: kept 1/2, mass (0.4 + 0.2) / (0.4 + 0.3)), one identical row (1, 1), one row that
    selects nothing (left out); and sequences whose FP8, bf16 or INT8 rounding changes nothing measure 1 everywhere."""
    import torch

    from benchmarks import fp8_selection as f
    from kascade.budget import Budget

    inf = float("-inf")
    exact = torch.tensor([[[0.4, 0.3, 0.2, 0.1], [0.5, 0.2, 0.2, 0.1], [inf, inf, inf, inf]]])
    low = torch.tensor([[[0.4, 0.2, 0.3, 0.1], [0.5, 0.3, 0.1, 0.1], [inf, inf, inf, inf]]])
    kept, mass = f.compare_rows(exact, low, torch.tensor([2, 1, 0]))
    assert kept.tolist() == [0.5, 1.0]
    assert torch.allclose(mass, torch.tensor([0.6 / 0.7, 1.0], dtype=torch.float64))
    # values e4m3 holds exactly (small integers times a power of two): FP8 scoring changes nothing
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (4, 40, 8), generator=g).float() / 8
    k = torch.randint(-8, 8, (2, 40, 8), generator=g).float() / 4
    rows = f.measure_sequence(q, k, Budget(ratio=0.3, k_min=4, tile=8), 0.35, scorings=("fp8", "bf16", "int8"))
    for kind in ("decode", "prefill"):
        for s in ("fp8", "bf16"):
            kept, mass = rows[kind, s]
            assert len(kept) and (kept == 1).all() and torch.allclose(mass, torch.ones_like(mass)), (kind, s)
    # integers times 1/16 whose largest magnitude is 127/16 (scale 1/16 exactly): INT8 scoring changes nothing
    q = torch.randint(-127, 128, (4, 40, 8), generator=g).float().index_fill_(-1, torch.tensor([0]), 127.0) / 16
    k = torch.randint(-127, 128, (2, 40, 8), generator=g).float().index_fill_(-1, torch.tensor([0]), -127.0) / 16
    rows = f.measure_sequence(q, k, Budget(ratio=0.3, k_min=4, tile=8), 0.35, scorings=("int8",))
    for kind in ("decode", "prefill"):
        kept, mass = rows[kind, "int8"]
        assert len(kept) and (kept == 1).all() and torch.allclose(mass, torch.ones_like(mass)), kind


def test_fp8_scoring_kept_share_by_hand():
    """benchmarks.fp8_scoring's agreement measure on index rows built by hand: 2 of 3 keys kept, 2 of 2 (in another
    order), and a row without keys left out: (2/3 + 1) / 2; any row split across chunks counts the same."""
    import torch

    from benchmarks import fp8_scoring

    a = torch.tensor([[[0, 1, 2, -1]], [[3, 4, -1, -1]], [[-1, -1, -1, -1]]])
    b = torch.tensor([[[0, 2, 5, -1]], [[4, 3, -1, -1]], [[1, -1, -1, -1]]])
    for chunk in (1, 2, 2048):
        assert abs(fp8_scoring.kept_share(a, b, 6, rows_per_chunk=chunk) - (2 / 3 + 1) / 2) < 1e-6


def test_row_log_resumes_only_the_rows_of_its_key(tmp_path):
    from benchmarks.common import RowLog

    log = RowLog(tmp_path / "rows.jsonl", length=2048, seed=0)
    log.add(sample=0, way="dense", score=1.0)
    RowLog(tmp_path / "rows.jsonl", length=4096, seed=0).add(sample=0, way="dense", score=0.0)
    again = RowLog(tmp_path / "rows.jsonl", length=2048, seed=0)  # a rerun: the same key's rows, the other's left
    assert again.rows == [dict(length=2048, seed=0, sample=0, way="dense", score=1.0)]
    assert again.has(sample=0, way="dense") and not again.has(sample=1, way="dense")
