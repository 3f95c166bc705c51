"""`kascade costs` and :mod:`kascade.costs_measure`: a cost table measured on this machine (the CPU, reference ops,
a tiny shape), read back by :mod:`kascade.costs` and by `kascade calibrate --cost-table`; malformed tables and bad
outputs refused before anything is measured."""

import copy
import json

import pytest

from kascade import KascadePlan, ModelFingerprint, costs
from kascade import costs_measure as cm
from kascade.calibrate import pipeline, target
from kascade.cli import build_parser, main

TINY_FP = ModelFingerprint("llama", 4, 4, 2, 16)
SMOL = ModelFingerprint("llama", 30, 9, 3, 64)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """One tiny table measured by the command: both modes, B=1, N=256, HQ 4, H 2, D 16, on the CPU."""
    out = tmp_path_factory.mktemp("costs") / "sub" / "cpu.json"
    rc = main(["costs", "--out", str(out), "--shape", "4,2,16", "--lengths", "256", "--batches", "1", "--k-min", "16",
               "--device", "cpu"])
    assert rc == 0
    return out


def test_the_measured_table_loads_and_models_a_plan(measured):
    table = costs.load_table(measured)
    assert list(table) == ["format", "cpu"] and table["format"] == costs.FORMAT
    g = table["cpu"]
    assert "CPU" in g["gpu"] and "not a GPU" in g["gpu"] and g["ratio"] == 0.1
    assert g["shapes"] == {"hq4-h2-d16": dict(num_q_heads=4, num_kv_heads=2, head_dim=16)}
    for mode in costs.MODES:
        (row,) = g[mode]["rows"]
        assert (row["shape"], row["batch"], row["length"]) == ("hq4-h2-d16", 1, 256) and not g[mode]["skipped"]
        assert row["dense"] == min(row["dense"], row["dense_ours"]) and row["select"] <= row["anchor"]
        plan = KascadePlan.uniform(TINY_FP, 2, ratio=0.1, k_min=16)
        x = costs.plan_speedup(plan, mode, length=256, batch=1, table=table)
        c = costs.layer_costs(mode, length=256, batch=1, shape="hq4-h2-d16", table=table)
        assert c.gpu == "cpu" and x == pytest.approx(TINY_FP.num_layers / costs.plan_cost(plan, c))
    with pytest.raises(ValueError, match=r"measured at \(batch, length\) \(1, 256\); not at \(32, 131072\)"):
        costs.layer_costs("decode", shape="hq4-h2-d16", table=table)


def test_progress_is_printed_per_configuration(measured, tmp_path, capsys):
    out = tmp_path / "d.json"
    assert main(["costs", "--out", str(out), "--shape", "2,1,16", "--modes", "decode", "--lengths", "128", "256",
                 "--batches", "1", "--k-min", "8", "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert "[1/2] decode B=1 N=128: dense" in text and "[2/2] decode B=1 N=256: dense" in text
    assert f"--cost-table {out}" in text
    assert [r["length"] for r in costs.load_table(out)["cpu"]["decode"]["rows"]] == [128, 256]


def _toy():
    """A hand-made table: the SmolLM2 shape measured at 64K tokens only, with round numbers."""
    row = dict(shape="smol", batch=32, length=65536, dense=100.0, dense_ours=110.0, layer0=150.0, select=40.0,
               anchor=60.0, reuse=10.0)
    mode = dict(unit="us", rows=[row])
    return {"format": costs.FORMAT, "toy-gpu": dict(gpu="Toy GPU", ratio=0.1, shapes={"smol": dict(
        num_q_heads=9, num_kv_heads=3, head_dim=64)}, decode=mode, prefill=copy.deepcopy(mode) | dict(
        rows=[row | dict(batch=1)]))}


@pytest.mark.parametrize("edit, field", [
    (lambda t: t.pop("format"), "'format'"),
    (lambda t: t.update(format="kascade-costs/9"), "'format'"),
    (lambda t: t["toy-gpu"].update(ratio=0), "'toy-gpu.ratio'"),
    (lambda t: t["toy-gpu"].pop("gpu"), "'toy-gpu.gpu'"),
    (lambda t: t["toy-gpu"]["shapes"]["smol"].update(head_dim="64"), "'toy-gpu.shapes.smol.head_dim'"),
    (lambda t: t["toy-gpu"]["decode"].pop("unit"), "'toy-gpu.decode.unit'"),
    (lambda t: t["toy-gpu"]["decode"]["rows"][0].pop("reuse"), r"'toy-gpu.decode.rows\[0\].reuse'"),
    (lambda t: t["toy-gpu"]["prefill"]["rows"][0].update(length=1.5), r"'toy-gpu.prefill.rows\[0\].length'"),
    (lambda t: t["toy-gpu"]["decode"]["rows"][0].update(shape="gpt"), r"'toy-gpu.decode.rows\[0\].shape'"),
    (lambda t: t["toy-gpu"]["decode"]["rows"][0].update(dense=float("nan")), r"'toy-gpu.decode.rows\[0\].dense'"),
    (lambda t: [t["toy-gpu"].pop(m) for m in costs.MODES], "'toy-gpu.decode'"),
])
def test_a_malformed_table_is_refused_naming_the_field(tmp_path, edit, field):
    t = _toy()
    costs.check_table(t)  # the unedited table is fine
    edit(t)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(t))
    with pytest.raises(ValueError, match=f"cost table {path}: field {field}"):
        costs.load_table(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not a readable JSON file"):
        costs.load_table(path)


def test_the_shipped_table_passes_the_same_checks():
    costs.check_table(costs._table(), "costs.json")


def test_costs_help_explains_every_option(capsys):
    with pytest.raises(SystemExit):
        main(["costs", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["costs"]
    options = [a for a in sub._actions if a.option_strings and a.dest != "help"]
    assert {a.dest for a in options} == {"out", "model", "shape", "modes", "batches", "lengths", "ratio", "k_min",
                                         "device", "backend"}
    for a in options:
        assert a.option_strings[0] in text and len(a.help) > 30, a.dest
    for phrase in ("--cost-table", "interrupted run keeps what it measured", "skipped", "CPU"):
        assert phrase in text


@pytest.mark.parametrize("bad, why", [("folder", "is a folder"), ("under-a-file", "cannot make its folder")])
def test_the_command_refuses_a_bad_out_before_measuring(tmp_path, monkeypatch, capsys, bad, why):
    monkeypatch.setattr(cm, "measure_one", lambda *a, **k: pytest.fail("measured before checking --out"))
    (tmp_path / "file").write_text("")
    out = tmp_path if bad == "folder" else tmp_path / "file" / "costs.json"
    assert main(["costs", "--out", str(out), "--device", "cpu", "--lengths", "256"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kascade costs: error: --out") and why in err and err.count("\n") == 1


def test_configurations_that_do_not_fit_are_skipped_with_a_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(cm, "measure_one", lambda *a, **k: pytest.fail("measured a configuration that does not fit"))
    monkeypatch.setattr(cm, "_free_bytes", lambda device: 1 << 20)
    out = tmp_path / "c.json"
    cm.measure(out, cm.shape_named("llama-3.1-8b"), modes=("decode",), lengths=(131072,), device="cpu",
               log=lambda *a: None)
    d = costs.load_table(out)["cpu"]["decode"]
    assert d["rows"] == [] and len(d["skipped"]) == 1
    assert d["skipped"][0]["length"] == 131072 and d["skipped"][0]["reason"].startswith("needs about")


def test_an_interrupted_run_keeps_what_it_measured(tmp_path, monkeypatch, capsys):
    row = dict(_toy()["toy-gpu"]["decode"]["rows"][0], shape="hq4-h2-d16")
    calls = []

    def fake(mode, shape, batch, length, **kw):
        calls.append(length)
        if len(calls) > 1:
            raise KeyboardInterrupt
        return dict(row, batch=batch, length=length)

    monkeypatch.setattr(cm, "measure_one", fake)
    out = tmp_path / "c.json"
    assert main(["costs", "--out", str(out), "--shape", "4,2,16", "--modes", "decode", "--lengths", "256", "512",
                 "--device", "cpu"]) == 130
    assert "configurations measured so far are in" in capsys.readouterr().err
    assert [r["length"] for r in costs.load_table(out)["cpu"]["decode"]["rows"]] == [256]


@pytest.fixture
def toy_file(tmp_path):
    path = tmp_path / "toy.json"
    path.write_text(json.dumps(_toy()))
    return path


def test_calibrate_reads_the_cost_table(toy_file, monkeypatch):
    seen = []
    monkeypatch.setattr(pipeline, "run", lambda s: seen.append(s) or s)
    monkeypatch.setattr(pipeline, "report", lambda r: "")
    assert main(["calibrate", "--cost-table", str(toy_file), "--target-speedup", "3"]) == 0
    s = seen[0]
    assert s == pipeline.Settings(target_speedup=3.0, cost_table=str(toy_file))
    table = costs.load_table(toy_file)
    assert target.table(s) == table and target.cost_shape(s, SMOL) == "smol"
    assert target.config(s, "decode", "smol") == (32, 65536)  # no 128K row: the longest measured
    a = target.most_anchors_within(s, SMOL)
    plan = KascadePlan.uniform(SMOL, a, **s.budget)
    c = costs.layer_costs("decode", length=65536, batch=32, shape="smol", table=table)
    assert c.select_x == 0.4 and c.anchor_sparse_x == pytest.approx(0.2) and c.reuse_x == 0.1
    x = target.speedups(plan, s)["decode"]
    assert x == pytest.approx(30 / costs.plan_cost(plan, c)) and x >= 3
    assert not target.meets(KascadePlan.uniform(SMOL, a + 1, **s.budget), s)
    assert x != pytest.approx(costs.plan_speedup(plan, "decode", length=131072))  # not the H200 times
    assert f"measured in {toy_file}" in target.describe_costs(s, SMOL)
    assert "decode" in target.report_line(plan, s) and "prefill" in target.report_line(plan, s)


def test_calibrate_refuses_a_malformed_or_unreachable_table_before_loading(toy_file, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_toy() | {"format": "x"}))
    for argv, msg in ((["--cost-table", str(bad)], f"cost table {bad}: field 'format'"),
                      (["--cost-table", str(toy_file), "--target-speedup", "50"],
                       (f"is out of reach: decode attention at --ratio 0.1 is at most 10.00x faster than dense even "
                        f"with every layer but the first reusing (modelled, measured in {toy_file})")),
                      (["--cost-table", str(toy_file), "--cost-shape", "llama-3.1-8b"],
                       "--cost-shape 'llama-3.1-8b' was not measured; choose from smol")):
        assert main(["calibrate", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("kascade calibrate: error: ") and msg in err, err


def test_the_shape_comes_from_a_model_folder_or_a_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(
        model_type="llama", num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096,
        intermediate_size=64, vocab_size=64)))
    assert cm.model_shape(tmp_path) == cm.Shape("llama-3.1-8b", 32, 8, 128)  # a shipped shape keeps its name
    assert cm.shape_named("12, 4, 64") == cm.Shape("hq12-h4-d64", 12, 4, 64)
    with pytest.raises(ValueError, match="no config.json"):
        cm.model_shape(tmp_path / "nowhere")
    for bad, why in (("gpt", "give one of"), ("12,5,64", "must be a multiple")):
        with pytest.raises(ValueError, match=why):
            cm.shape_named(bad)
