"""`kascade calibrate` end to end on the default model at tiny settings, and its input errors."""

import json

import pytest
import torch

from cli_support import one_line_error, texts_file, tiny_loader
from conftest import tiny_model
from kascade import KascadePlan
from kascade.calibrate import pipeline
from kascade.cli import main


def test_flags_become_the_settings(monkeypatch, capsys):
    """argparse stays in the command: the pipeline gets a Settings built from the flags (defaults: Settings())."""
    seen = []
    monkeypatch.setattr(pipeline, "run", lambda s: seen.append(s) or s)
    monkeypatch.setattr(pipeline, "report", lambda r: "")
    assert main(["calibrate"]) == 0
    assert main(["calibrate", "--seq-len", "300", "--no-rolling", "--lengths", "200", "300", "--method", "search",
                 "--rule", "sinks", "--target-agreement", "0.9", "--k-min", "32", "--out", "x"]) == 0
    assert seen[0] == pipeline.Settings()
    assert seen[1] == pipeline.Settings(out="x", seq_len=300, rolling=False, lengths=(200, 300), method="search",
                                        rule="sinks", target_agreement=0.9, k_min=32)


@pytest.mark.model
def test_calibrate_end_to_end(tmp_path, default_model, monkeypatch, capsys):
    import kascade.calibrate.pipeline as pipeline

    monkeypatch.setattr(pipeline, "load_model", lambda *a, **k: default_model)  # loaded once per session
    out = tmp_path / "cal"
    rc = main(["calibrate", "--seq-len", "300", "--samples", "2", "--anchors", "4", "--max-anchors", "5",
               "--out", str(out)])
    assert rc == 0
    plan = json.loads((out / "plan.json").read_text())
    assert plan["anchors"][0] == 0 and len(plan["anchors"]) == 4 and plan["calibrated"]
    assert (out / "similarity.png").stat().st_size > 1000 and (out / "importance.png").stat().st_size > 1000
    rows = (out / "objective.csv").read_text().splitlines()
    assert len(rows) == 1 + 5
    printed = capsys.readouterr().out
    assert "<- chosen" in printed


@pytest.mark.model
def test_calibrate_target_agreement(tmp_path, default_model, monkeypatch):
    import kascade.calibrate.pipeline as pipeline

    monkeypatch.setattr(pipeline, "load_model", lambda *a, **k: default_model)
    out = tmp_path / "cal"
    rc = main(["calibrate", "--seq-len", "300", "--samples", "1", "--holdout", "1", "--target-agreement", "0.5",
               "--max-anchors", "4", "--out", str(out)])
    assert rc == 0
    rows = [r.split(",") for r in (out / "objective.csv").read_text().splitlines()[1:]]
    measured = [r for r in rows if r[4]]
    assert measured and float(measured[-1][4]) >= 0.5


def _bad(tmp_path, monkeypatch, default_model, argv, capsys):
    import kascade.calibrate.pipeline as pipeline

    monkeypatch.setattr(pipeline, "load_model", lambda *a, **k: default_model)
    rc = main(["calibrate", "--out", str(tmp_path / "x"), *argv])
    return rc, capsys.readouterr().err


@pytest.mark.model
def test_calibrate_input_errors(tmp_path, monkeypatch, default_model, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    nofield = tmp_path / "nofield.jsonl"
    nofield.write_text('{"text": "a b c"}\n{"body": "x"}\n')
    short = tmp_path / "short.jsonl"
    short.write_text('{"text": "only a few words"}\n')
    one = tmp_path / "one.jsonl"  # one text of several windows
    one.write_text(json.dumps({"text": "Text: " + "the quick brown fox jumps over it. " * 40}) + "\n")
    cases = [
        # the search scores plans on other texts than the statistics': with --data, the ones after them
        (["--data", str(one), "--samples", "2", "--seq-len", "120", "--method", "search", "--search-windows", "1"],
         "the texts after the first 1 hold 0 window(s) of 120 tokens (a window lies within one text); "
         "--search-windows (after the statistics' texts) need 1"),
        (["--data", str(empty)], "empty"),
        (["--data", str(nofield), "--samples", "2"], "nofield.jsonl:2: no 'text' field"),
        (["--data", str(short), "--samples", "1", "--seq-len", "200"],
         "short.jsonl: the texts hold 0 window(s) of 200 tokens (a window lies within one text); --samples need 1"),
        (["--anchors", "31"], "--anchors must be in 1..30"),
        (["--seq-len", "40"], "too short"),
    ]
    for argv, needle in cases:
        rc, err = _bad(tmp_path, monkeypatch, default_model, argv, capsys)
        assert rc == 2 and needle in err, (argv, err)


@pytest.mark.model
def test_calibrate_method_writes_that_variants_plan(tmp_path, default_model, monkeypatch):
    import kascade.calibrate.pipeline as pipeline
    from kascade import KascadePlan

    monkeypatch.setattr(pipeline, "load_model", lambda *a, **k: default_model)
    out = tmp_path / "cal"
    rc = main(["calibrate", "--seq-len", "300", "--samples", "1", "--anchors", "4", "--max-anchors", "4",
               "--k-min", "32", "--method", "any-anchor+layer-budget", "--out", str(out)])
    assert rc == 0
    plan = KascadePlan.load(out / "plan.json")
    assert json.loads((out / "plan.json").read_text())["format"] == "kascade-plan/4"
    assert plan.ranked and plan.reuse.sources is not None and plan.reuse.factor is not None and plan.k_min == 32
    assert len(plan.anchors) == 4
    with pytest.raises(SystemExit):
        main(["calibrate", "--out", str(out), "--method", "magic"])


# -- refusals before any work, on a tiny random model -------------------------------------------------------------

TINY = ["--seq-len", "96", "--k", "8", "--tile", "16", "--k-min", "8", "--samples", "2", "--max-anchors", "3"]
ANCHORS = ["--anchors", "2"]


@pytest.fixture
def tiny(monkeypatch):
    """kascade calibrate on a tiny random Llama (4 layers, 4 KV heads) behind load_model (``tiny.loads`` counts the
    weight reads)."""
    tiny = tiny_loader(tiny_model("llama", num_attention_heads=8, num_key_value_heads=4))
    monkeypatch.setattr(pipeline, "load_model", tiny.load)
    return tiny


def _error(argv, capsys) -> str:
    return one_line_error("calibrate", argv, capsys)


@pytest.mark.parametrize("argv, message", [
    (["--k", "0"], "argument --k: must be a positive integer, got '0'"),
    (["--k", "-4"], "argument --k: must be a positive integer, got '-4'"),
    (["--tile", "0"], "argument --tile: must be a positive integer, got '0'"),
    (["--ratio", "2"], "argument --ratio: must be a number in (0, 1], got '2'"),
    (["--ratio", "nan"], "argument --ratio: must be a number in (0, 1]"),
    (["--samples", "0"], "argument --samples: must be a positive integer"),
    (["--target-agreement", "1.5"], "argument --target-agreement: must be a number in (0, 1]"),
    (["--tensor-parallel", "0"], "argument --tensor-parallel: must be a positive integer"),
    (["--device", "gpu"], "argument --device: unknown device 'gpu'"),
    (["--lengths", "200"], "--lengths is for the methods other than faithful"),
    (["--rule", "sinks"], "--rule is the reuse rule of --method length or search, not of 'faithful'"),
    (["--plan", "p.json"], "unrecognized arguments: --plan p.json"),
    (["--anchors", "5"], "--anchors must be in 1..4 (the model's layer count), got 5"),
    ([*ANCHORS, "--tensor-parallel", "3"], "--tensor-parallel 3 does not divide the model's 4 KV heads"),
])
def test_bad_arguments_are_refused_in_one_line_before_any_work(tmp_path, tiny, capsys, argv, message):
    err = _error([*TINY, "--out", str(tmp_path / "out"), *argv], capsys)
    assert message in err
    assert tiny.loads == [] and not (tmp_path / "out" / "plan.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without a CUDA device")
def test_cuda_without_cuda_is_refused_in_one_line(tmp_path, tiny, capsys):
    assert "sees no CUDA device" in _error(["--device", "cuda", "--out", str(tmp_path)], capsys)


def test_the_output_folder_and_the_data_are_checked_before_the_model(tmp_path, tiny, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert f"--out {afile} is a file, not a folder" in _error([*TINY, "--out", str(afile)], capsys)
    data = texts_file(tmp_path / "d.jsonl", 1, chars=150)  # one window of 96 tokens; --samples 2 need two
    err = _error([*TINY, *ANCHORS, "--data", str(data), "--out", str(tmp_path / "o")], capsys)
    assert "d.jsonl: the texts hold 1 window(s) of 96 tokens (a window lies within one text); --samples need 2" in err
    assert "no file at" in _error([*TINY, "--data", str(tmp_path / "none.jsonl")], capsys)
    assert "(it is a folder)" in _error([*TINY, "--data", str(tmp_path)], capsys)
    short = texts_file(tmp_path / "short.jsonl", 2, chars=10)
    err = _error([*TINY, *ANCHORS, "--data", str(short), "--out", str(tmp_path / "o")], capsys)
    assert "short.jsonl: the texts hold 0 window(s) of 96 tokens (a window lies within one text)" in err
    assert tiny.loads == []


def test_an_unexpected_error_keeps_its_traceback(monkeypatch):
    def broken(settings):
        raise RuntimeError("a bug")

    monkeypatch.setattr(pipeline, "run", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["calibrate"])


def test_out_of_memory_is_reported_in_one_line(monkeypatch, capsys):
    def big(settings):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")

    monkeypatch.setattr(pipeline, "run", big)
    assert main(["calibrate"]) == 2
    assert capsys.readouterr().err == ("kascade calibrate: error: out of memory (CUDA out of memory. Tried to allocate "
                                       "9.00 GiB); shorter lengths or fewer samples need less\n")


def test_target_agreement_needs_no_anchor_count_the_model_cannot_hold(tmp_path, tiny, capsys):
    """The default --anchors (6) is not checked against a 4-layer model when --target-agreement replaces it."""
    data = texts_file(tmp_path / "d.jsonl", 3)
    rc = main(["calibrate", *TINY, "--data", str(data), "--target-agreement", "0.01", "--holdout", "1",
               "--out", str(tmp_path / "o")])
    assert rc == 0, capsys.readouterr().err
    plan = KascadePlan.load(tmp_path / "o" / "plan.json")
    assert plan.calibrated and 2 <= len(plan.anchors) <= 3
    out = capsys.readouterr().out
    # 3 windows of 96 tokens in each 300-token text: the statistics' 2 and the held-out 1 all come from text 1
    assert f"used texts 1..1 of {data}" in out and f"kascade eval --data {data} --skip-texts 1" in out


def test_calibrating_on_every_text_advises_other_texts_for_eval(tmp_path, tiny, capsys):
    """One text of the file makes every window: the advice was `kascade eval --skip-texts 1`, which eval refuses
    (nothing left)."""
    data = texts_file(tmp_path / "d.jsonl", 1, chars=700)
    assert main(["calibrate", *TINY, *ANCHORS, "--data", str(data), "--samples", "6", "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert f"used texts 1..1 of {data} (6 statistics, 0 held-out and 0 search window(s) per length)" in out
    assert "every text of" in out and "--skip-texts" not in out


@pytest.mark.parametrize("argv,needle", [
    (["--method", "any-anchor+union2"], "argument --method: 'any-anchor+union2': any-anchor and union2 both choose"),
    (["--method", "length", "--rule", "search"], "argument --rule: unknown reuse rule(s) ['search']"),
    (["--method", "search", "--rule", "measured"], "argument --rule: unknown reuse rule(s) ['measured']"),
])
def test_methods_and_rules_that_cannot_run_are_refused_before_the_model_loads(tmp_path, tiny, capsys, argv, needle):
    err = one_line_error("calibrate", [*TINY, *argv, "--out", str(tmp_path / "o")], capsys)
    assert needle in err and tiny.loads == [] and not (tmp_path / "o").exists()


def test_tensor_parallel_writes_the_shard_local_plan(tmp_path, tiny, capsys):
    """--tensor-parallel 2: the plan written is the global plan made shard-local by the statistics' similarity."""
    data = texts_file(tmp_path / "d.jsonl", 2)
    assert main(["calibrate", *TINY, *ANCHORS, "--data", str(data), "--out", str(tmp_path / "g")]) == 0
    assert main(["calibrate", *TINY, *ANCHORS, "--data", str(data), "--tensor-parallel", "2",
                 "--out", str(tmp_path / "tp")]) == 0
    glob, local = (KascadePlan.load(tmp_path / d / "plan.json") for d in ("g", "tp"))
    sim = torch.tensor(json.loads((tmp_path / "tp" / "stats.json").read_text())["similarity"])
    assert local == glob.for_tensor_parallel(2, sim)
    assert local.tensor_parallel == 2 and local.crossing_links(2) == []
    assert glob.crossing_links(2), "the test needs a global plan with links across the two shards"
    assert "shard-local for 2 tensor-parallel ranks" in capsys.readouterr().out


@pytest.mark.parametrize("method", ["any-anchor", "union2"])
def test_tensor_parallel_with_reuse_sources_writes_a_shard_local_plan(tmp_path, tiny, capsys, method):
    """A reuse rule that sets sources (any anchor's heads) made shard-local: it crashed after the statistics with
    "the plan says it is shard-local" before for_tensor_parallel applied the moved sources first."""
    data = texts_file(tmp_path / "d.jsonl", 2)
    argv = [*TINY, "--anchors", "3", "--data", str(data), "--method", method]
    assert main(["calibrate", *argv, "--out", str(tmp_path / "g")]) == 0
    assert main(["calibrate", *argv, "--tensor-parallel", "2", "--out", str(tmp_path / "tp")]) == 0, \
        capsys.readouterr().err
    glob, local = (KascadePlan.load(tmp_path / d / "plan.json") for d in ("g", "tp"))
    assert glob.crossing_links(2), "the test needs a global plan with links across the two shards"
    assert local.reuse.sources is not None and local.tensor_parallel == 2 and local.crossing_links(2) == []
    sim = torch.tensor(json.loads((tmp_path / "tp" / "stats.json").read_text())["similarity"])
    assert local == glob.for_tensor_parallel(2, sim)


def test_an_interrupted_write_leaves_the_earlier_calibration_whole(tmp_path, tiny, monkeypatch, capsys):
    """The files go in place together, plan.json last: Ctrl-C while they are written leaves the earlier run's files
    (not a new plan.json beside the earlier pictures) and no temporary file."""
    data = texts_file(tmp_path / "d.jsonl", 2)
    out = tmp_path / "cal"
    assert main(["calibrate", *TINY, *ANCHORS, "--data", str(data), "--out", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.name != ".kascade.lock"}
    assert {"plan.json", "stats.json", "objective.csv", "similarity.png", "importance.png"} <= set(before)

    def interrupted(*args):
        raise KeyboardInterrupt

    from kascade.calibrate import plots

    monkeypatch.setattr(plots, "importance_curve", interrupted)  # the last picture
    assert main(["calibrate", *TINY, "--anchors", "3", "--data", str(data), "--out", str(out)]) == 130
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name != ".kascade.lock"} == before


def test_a_folder_in_use_by_another_run_is_refused(tmp_path, tiny, capsys):
    from kascade.files import hold

    data = texts_file(tmp_path / "d.jsonl", 2)
    out = tmp_path / "cal"
    out.mkdir()
    with hold(out, "kascade calibrate"):
        err = one_line_error("calibrate", [*TINY, *ANCHORS, "--data", str(data), "--out", str(out)], capsys)
    assert f"--out {out} is in use by kascade calibrate (process " in err
    assert not (out / "plan.json").exists() and tiny.loads == []
    assert main(["calibrate", *TINY, *ANCHORS, "--data", str(data), "--out", str(out)]) == 0  # released


def test_without_matplotlib_no_earlier_pictures_stay_beside_the_new_plan(tmp_path, tiny, monkeypatch, capsys):
    data = texts_file(tmp_path / "d.jsonl", 2)
    out = tmp_path / "cal"
    assert main(["calibrate", *TINY, *ANCHORS, "--data", str(data), "--out", str(out)]) == 0
    assert (out / "similarity.png").exists()

    def no_matplotlib():
        raise ImportError("plots need matplotlib")

    monkeypatch.setattr(pipeline, "pyplot", no_matplotlib)
    assert main(["calibrate", *TINY, "--anchors", "3", "--data", str(data), "--out", str(out)]) == 0
    assert "note: no plots written (plots need matplotlib)" in capsys.readouterr().out
    assert len(KascadePlan.load(out / "plan.json").anchors) == 3
    assert sorted(p.name for p in out.iterdir()) == [".kascade.lock", "objective.csv", "plan.json", "stats.json"]


def test_a_refused_run_leaves_no_folder_it_made(tmp_path, tiny, capsys):
    """Refused after its --out was checked (a --data text shorter than the window): no empty folder left behind."""
    data = tmp_path / "short.jsonl"
    data.write_text('{"text": "too short"}\n' * 8)
    out = tmp_path / "new" / "cal"
    err = one_line_error("calibrate", [*TINY, *ANCHORS, "--data", str(data), "--out", str(out)], capsys)
    assert f"{data}: the texts hold 0 window(s) of 96 tokens" in err and "lies within one text" in err, err
    assert not (tmp_path / "new").exists()
