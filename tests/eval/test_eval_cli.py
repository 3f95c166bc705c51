import csv
import json

import pytest

from kascade.cli import build_parser, main


def test_eval_help_explains_every_option(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval", "--help"])
    out = capsys.readouterr().out
    for opt in ("--strategies", "--tasks", "--lengths", "--samples", "--seed", "--device", "--plan", "--longbench",
                "--out", "streamingllm", "quest", "omnikv", "fidelity", "niah_multikey"):
        assert opt in out


@pytest.mark.model
def test_eval_end_to_end(tmp_path, default_model, monkeypatch, capsys):
    import kascade.models

    monkeypatch.setattr(kascade.models, "load_model", lambda *a, **k: default_model)
    lb = tmp_path / "lb.jsonl"
    lb.write_text(json.dumps(dict(context="The meeting is on Tuesday. " * 10, input="When is the meeting?",
                                  answers=["Tuesday"], dataset="hotpotqa")) + "\n")
    out = tmp_path / "ev"
    rc = main(["eval", "--strategies", "dense,kascade,streamingllm", "--tasks", "fidelity,niah_single_number",
               "--lengths", "300", "--samples", "1", "--longbench", str(lb), "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    strategies = {r["strategy"] for r in res["rows"]}
    assert strategies == {"dense", "kascade", "streamingllm"}
    fid = {r["strategy"]: r for r in res["rows"] if r["task"] == "fidelity"}
    assert fid["dense"]["agreement"] == 1.0 and fid["dense"]["kl"] == 0.0
    assert fid["kascade"]["attended_fraction"] < 1.0
    assert (out / "scores.png").stat().st_size > 1000
    with open(out / "results.csv", newline="") as f:
        assert len(list(csv.DictReader(f))) == len(res["rows"])
    assert "| kascade |" in capsys.readouterr().out
