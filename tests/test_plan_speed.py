"""benchmarks.plan_speed (a plan's whole-model attention time against the cost model) at tiny sizes on the CPU:
the transplanted plans keep what a plan costs, and a run writes every plan's row."""

import json

import pytest

from benchmarks import plan_speed
from kascade import costs
from kascade.costs_measure import shape_named


def test_transplant_keeps_layers_budgets_and_the_number_of_sources():
    shape = shape_named("llama-3.1-8b")
    plan = plan_speed.load_plan("default")
    t = plan_speed.transplant(plan, shape)
    assert t.anchors == plan.anchors and t.reuse.factor == plan.reuse.factor and t.num_layers == plan.num_layers
    assert (t.fingerprint.num_q_heads, t.fingerprint.num_kv_heads, t.fingerprint.head_dim) == (32, 8, 128)
    assert all(row == tuple(range(8)) for row in t.head_map)
    # the cost model sees the same plan: same layer fractions, same modelled speedup at Llama costs
    assert costs.layer_fractions(t, 131072) == costs.layer_fractions(plan, 131072)
    kw = dict(length=131072, batch=32, shape="llama-3.1-8b")
    assert costs.plan_speedup(t, "decode", **kw) == pytest.approx(costs.plan_speedup(plan, "decode", **kw))
    two = plan.with_reuse(sources=tuple(tuple(((a, h),) if plan.is_anchor(l) or a == 0 else ((0, h), (a, h))
                                              for h in range(3)) for l, a in
                                        ((l, plan.anchor_of(l)) for l in range(plan.num_layers))))
    t2 = plan_speed.transplant(two, shape)
    assert [len(p) for p in t2.reuse.sources[5]] == [2] * 8 and t2.reuse.sources[5][7] == ((0, 7), (2, 7))  # anchor of layer 5: 2


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_a_run_writes_every_plan(tmp_path, mode, capsys):
    r = plan_speed.main(["--device", "cpu", "--mode", mode, "--batch", "1", "--length", "160", "--shape", "4,2,8",
                         "--plans", "fast", "balanced", "--repeats", "1", "--out", str(tmp_path)])
    assert [row["plan"] for row in r["plans"]] == ["fast", "balanced"]
    assert all(row["ms"] > 0 and row["measured"] > 0 for row in r["plans"])
    assert json.loads((tmp_path / "plan_speed.json").read_text())["plans"][1]["anchors"] == [0, 1, 3, 14, 24]
    assert "| balanced |" in (tmp_path / "plan_speed.md").read_text()
