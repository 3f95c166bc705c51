"""`kascade calibrate` end to end on the default model at tiny settings, and its input errors."""

import json

import pytest

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
    two = tmp_path / "two.jsonl"
    two.write_text("".join(json.dumps({"text": f"Text {i}: " + "the quick brown fox jumps over it. " * 40}) + "\n"
                           for i in range(2)))
    cases = [
        # the search scores plans on other texts than the statistics': with --data, the ones after them
        (["--data", str(two), "--samples", "2", "--seq-len", "120", "--method", "search", "--search-windows", "1"],
         "3 are needed (--samples, --holdout and --search-windows)"),
        (["--data", str(empty)], "empty"),
        (["--data", str(nofield), "--samples", "2"], "nofield.jsonl:2: no 'text' field"),
        (["--data", str(short), "--samples", "1", "--seq-len", "200"], "at least 65"),
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
    assert json.loads((out / "plan.json").read_text())["format"] == "kascade-plan/3"
    assert plan.ranked and plan.reuse.sources is not None and plan.reuse.scale is not None and plan.k_min == 32
    assert len(plan.anchors) == 4
    with pytest.raises(SystemExit):
        main(["calibrate", "--out", str(out), "--method", "magic"])
