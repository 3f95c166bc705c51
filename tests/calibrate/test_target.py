"""`kascade calibrate --target-speedup` / `--target-agreement`: the plan chosen for a target, refusals of targets
out of reach before the model is loaded, and the order in which agreement targets try plans."""

import json
from types import SimpleNamespace

import pytest
from test_calibrate_cli import TINY, _error, tiny  # noqa: F401, F811  (tiny: the fixture)

from kascade import KascadePlan, ModelFingerprint, costs
from kascade.calibrate import pipeline, target
from kascade.cli import main

SMOL = ModelFingerprint("llama", 30, 9, 3, 64)


def test_flags_become_the_settings(monkeypatch):
    seen = []
    monkeypatch.setattr(pipeline, "run", lambda s: seen.append(s) or s)
    monkeypatch.setattr(pipeline, "report", lambda r: "")
    assert main(["calibrate", "--target-speedup", "3", "--speedup-mode", "both", "--cost-shape", "llama-3.1-8b"]) == 0
    assert seen[0] == pipeline.Settings(target_speedup=3.0, speedup_mode="both", cost_shape="llama-3.1-8b")


@pytest.mark.parametrize("x", [1.5, 2.5, 3.0, 4.0, 5.5])
@pytest.mark.parametrize("mode", target.SPEEDUP_MODES)
def test_the_most_anchors_that_meet_the_target(x, mode):
    """The chosen count meets the target in every mode asked for; one anchor more misses it."""
    try:  # refused by the settings (beyond any model) or for this model
        s = pipeline.Settings(target_speedup=x, speedup_mode=mode)
        a = target.most_anchors_within(s, SMOL)
    except ValueError as e:
        assert "out of reach" in str(e)
        assert not target.meets(KascadePlan.uniform(SMOL, 1), SimpleNamespace(target_speedup=x, speedup_mode=mode,
                                                                               cost_shape=None, cost_table=None))
        return
    assert target.meets(KascadePlan.uniform(SMOL, a), s)
    assert a == SMOL.num_layers or not target.meets(KascadePlan.uniform(SMOL, a + 1), s)


def test_defaults_read_the_models_own_shape():
    """Decode at B=32, 128K: 6 anchors of the default model cost 2.6x at its own shape's kernel times (weaker
    kernels at head dim 64, 3 KV heads), 3.2x at Llama-3.1-8B's."""
    plan = KascadePlan.uniform(SMOL, 6)
    own = target.speedups(plan, pipeline.Settings())["decode"]
    llama = target.speedups(plan, pipeline.Settings(cost_shape="llama-3.1-8b"))["decode"]
    assert own == pytest.approx(costs.plan_speedup(plan, shape="smollm2-135m")) and own < llama
    assert a_for(3.0, "llama-3.1-8b") > a_for(3.0, None)


def a_for(x, shape):
    return target.most_anchors_within(pipeline.Settings(target_speedup=x, cost_shape=shape), SMOL)


@pytest.mark.parametrize("argv, message", [
    (["--target-speedup", "20"], "--target-speedup 20 is out of reach: decode attention at --ratio 0.1 is at most "
                                 "8.90x faster"),
    (["--target-speedup", "5", "--speedup-mode", "prefill"], "prefill attention at --ratio 0.1 is at most 4.48x"),
    (["--target-speedup", "0"], "--target-speedup must be a positive number"),
    (["--target-speedup", "3"], "out of reach for this model: its fastest plan (layer 0 the only anchor) is "
                                "modelled at decode 2.23x"),
    (["--target-speedup", "2", "--anchors", "2"], "argument --anchors: not allowed with argument --target-speedup"),
    (["--cost-shape", "gpt"], "argument --cost-shape: invalid choice"),
])
def test_targets_out_of_reach_are_refused_before_the_model_is_loaded(tmp_path, tiny, capsys, argv, message):
    err = _error([*TINY, "--out", str(tmp_path / "out"), *argv], capsys)
    assert message in err
    assert tiny.loads == []


def test_target_speedup_end_to_end_on_a_tiny_model(tmp_path, tiny, capsys):
    """4 layers at Llama-shape decode costs: 1 anchor 2.23x, 2 anchors 1.49x, 3 anchors 1.19x."""
    for x, anchors in ((2.0, 1), (1.2, 2)):
        out = tmp_path / f"x{x}"
        assert main(["calibrate", *TINY, "--target-speedup", str(x), "--out", str(out)]) == 0
        plan = KascadePlan.load(out / "plan.json")
        assert len(plan.anchors) == anchors, x
        printed = capsys.readouterr().out
        assert f"target {x:g}x (decode) met" in printed and "<- chosen" in printed


@pytest.mark.model
def test_target_speedup_on_the_default_model(tmp_path, default_model, monkeypatch, capsys):
    monkeypatch.setattr(pipeline, "load_model", lambda *a, **k: default_model)
    out = tmp_path / "cal"
    assert main(["calibrate", "--seq-len", "300", "--samples", "1", "--target-speedup", "3",
                 "--cost-shape", "llama-3.1-8b", "--out", str(out)]) == 0
    plan = KascadePlan.load(out / "plan.json")
    s = pipeline.Settings(target_speedup=3.0, cost_shape="llama-3.1-8b")
    assert target.meets(plan, s) and not target.meets(KascadePlan.uniform(plan.fingerprint, len(plan.anchors) + 1), s)
    assert json.loads((out / "plan.json").read_text())["calibrated"]
    assert "target 3x (decode) met" in capsys.readouterr().out


def test_target_agreement_tries_the_fastest_plans_first(monkeypatch):
    """The first plan (in modelled speed order) that reaches the target wins; slower ones are never measured."""
    tried = []

    class Ref:
        def __init__(self, model, windows):
            pass

        def compare(self, plan):
            tried.append(len(plan.anchors))
            return [SimpleNamespace(top1_agreement=0.80 + 0.02 * len(plan.anchors), kl=0.1, positions=10,
                                    nll=None, attended=None)]

    monkeypatch.setattr(target, "DenseReference", Ref)
    monkeypatch.setattr(target, "pool", lambda fids: fids[0])
    monkeypatch.setattr(target, "plan_from_stats", lambda fp, stats, a, **kw: KascadePlan.uniform(fp, a))
    s = pipeline.Settings(target_agreement=0.89)
    measured = {}
    assert target.fastest_reaching(None, SMOL, None, [], s, 12, measured) == 5
    assert tried == [2, 3, 4, 5] and sorted(measured) == [2, 3, 4, 5]
    with pytest.raises(ValueError, match="no plan with up to 4 anchors reached agreement 0.99"):
        target.fastest_reaching(None, SMOL, None, [], pipeline.Settings(target_agreement=0.99), 4, {})
