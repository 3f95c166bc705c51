"""The rows of an evaluation folder (kascade.eval.results.Results): what it reads back, what it refuses."""

import json

import pytest

from kascade.eval import results

ROW = dict(strategy="dense", task="fidelity", length=48, sample=0, score=1.0, attended_fraction=1.0,
           attended_per_layer={0: 1.0}, agreement=1.0, kl=0.0, nll=2.0)


def test_rows_read_back_and_the_settings_are_written_with_the_first_row(tmp_path):
    res = results.Results(tmp_path, dict(seed=0), "header")
    assert not (tmp_path / results.RUN).exists()  # nothing is written until a row is finished
    res.add([ROW, {**ROW, "strategy": "oracle"}])
    again = results.Results(tmp_path, dict(seed=0))
    assert again.rows == res.rows and again.done == {("dense", "fidelity", 48, 0), ("oracle", "fidelity", 48, 0)}
    assert again.rows[0]["attended_per_layer"] == {"0": 1.0}  # as JSON has it, in memory and on disk alike
    with pytest.raises(ValueError, match=r"holds results of other settings \(--seed 0 there, 1 now\)"):
        results.Results(tmp_path, dict(seed=1))


def test_a_row_cut_short_by_an_interrupt_is_dropped(tmp_path):
    results.Results(tmp_path, dict(seed=0)).add([ROW])
    with open(tmp_path / results.ROWS, "a") as f:
        f.write('{"strategy": "ora')  # the write the interrupt cut
    res = results.Results(tmp_path, dict(seed=0))
    assert len(res.rows) == 1 and (tmp_path / results.ROWS).read_text() == json.dumps(ROW) + "\n"
    res.add([{**ROW, "sample": 1}])
    assert len(results.Results(tmp_path, dict(seed=0)).rows) == 2


def test_folders_that_cannot_be_resumed_are_refused(tmp_path):
    (tmp_path / results.ROWS).write_text(json.dumps(ROW) + "\n")
    with pytest.raises(ValueError, match="holds rows.jsonl without run.json"):
        results.Results(tmp_path, dict(seed=0))
    (tmp_path / results.RUN).write_text(json.dumps(dict(seed=0)))
    (tmp_path / results.ROWS).write_text("garbage\n" + json.dumps(ROW) + "\n")
    with pytest.raises(ValueError, match="rows.jsonl:1: not a result row"):
        results.Results(tmp_path, dict(seed=0))
