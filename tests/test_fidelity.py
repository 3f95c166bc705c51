"""Teacher-forced fidelity (kascade.fidelity): the metrics by hand, pooling, and the one comparison loop."""

import pytest
import torch

import kascade
from conftest import tiny_model
from kascade import KascadePlan, ModelFingerprint
from kascade.fidelity import DenseReference, Fidelity, compare_plans, fidelity, pool, scored_logits


def test_fidelity_by_hand():
    d = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    s = torch.tensor([[2.0, 0.0, 0.0], [4.0, 0.0, -4.0]])
    t = torch.tensor([0, 2])
    f = fidelity(d, s, targets=t)
    pd, ps = d.double().softmax(-1), s.double().softmax(-1)
    kl = (pd * (pd.log() - ps.log())).sum(-1)  # KL(dense || sparse)
    assert abs(float(kl.mean()) - float((ps * (ps.log() - pd.log())).sum(-1).mean())) > 0.5  # the direction shows
    assert f.top1_agreement == 0.5 and f.positions == 2
    assert f.kl == pytest.approx(float(kl.mean()), rel=1e-5) and f.kl > 0
    assert f.nll == pytest.approx(float(-(ps[0, 0].log() + ps[1, 2].log()) / 2), rel=1e-5)
    first = fidelity(d, s, mask=torch.tensor([True, False]), targets=t)
    assert first.top1_agreement == 1.0 and first.kl == 0.0 and first.positions == 1
    assert fidelity(d, s).nll is None
    with pytest.raises(ValueError, match="shapes differ"):
        fidelity(d, s[:1])
    with pytest.raises(ValueError, match="no positions"):
        fidelity(d, s, mask=torch.zeros(2, dtype=torch.bool))


def test_pool_weights_windows_by_positions():
    a, b = Fidelity(1.0, 0.2, 3, nll=1.0), Fidelity(0.0, 1.0, 1, nll=3.0)
    p = pool([a, b])
    assert p.positions == 4 and p.top1_agreement == 0.75
    assert p.kl == pytest.approx(0.4) and p.nll == pytest.approx(1.5)
    assert pool([a, Fidelity(0.5, 0.1, 2)]).nll is None  # a window without NLL: none pooled
    with pytest.raises(ValueError, match="no fidelities"):
        pool([])


def test_scored_positions_are_the_last_ones_of_the_window():
    model = tiny_model("llama")
    ids = torch.randint(3, 97, (1, 41), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids).logits[0]
        logits, t = scored_logits(model, ids)  # int(41 / 2) = 20 positions, predicting the last 20 tokens
        assert logits.shape == (20, 97) and torch.equal(t, ids[0, -20:])
        torch.testing.assert_close(logits, full[-21:-1])
        logits, t = scored_logits(model, ids, positions=7)
        assert logits.shape[0] == 7 and torch.equal(t, ids[0, -7:])
        logits, t = scored_logits(model, ids, positions=100)  # at most every position with a target
        assert logits.shape[0] == 40 and torch.equal(t, ids[0, 1:])


def test_dense_reference_is_the_explicit_loop():
    """compare(plan) per window = the window's dense and sparse forwards (enabled for that window alone) compared;
    the pooled, called and compare_plans forms give the same numbers."""
    model = tiny_model("llama", num_key_value_heads=3)
    g = torch.Generator().manual_seed(1)
    wins = [torch.randint(3, 97, (n,), generator=g) for n in (150, 97)]
    plan = KascadePlan.uniform(ModelFingerprint.from_model(model), 2, k_min=8, tile=16)
    ref = DenseReference(model, wins)
    got = ref.compare(plan)
    want = []
    with torch.no_grad():
        for w in wins:
            d, t = scored_logits(model, w[None])
            with kascade.enable(model, plan, backend="reference", warn_uncalibrated=False):
                s, _ = scored_logits(model, w[None])
            want.append(fidelity(d, s, targets=t))
    assert got == want
    assert all(f.kl > 0 and f.nll is not None for f in got)  # the plan is sparse: it differs from dense
    with kascade.enable(model, plan, backend="reference", warn_uncalibrated=False):
        assert ref.measure() == got  # the model as it runs now
    p = pool(got)
    assert p.positions == 75 + 48
    assert ref(plan) == dict(agreement=p.top1_agreement, kl=p.kl)
    assert compare_plans(model, {"uniform": plan}, wins, progress=False) == {"uniform": p}
    base = ref.baseline()
    assert [(f.top1_agreement, f.kl) for f in base] == [(1.0, 0.0), (1.0, 0.0)]
    assert [f.nll for f in base] == [fidelity(d, d, targets=t).nll for d, t in ref.dense]
    with pytest.raises(ValueError, match="at least one window"):
        DenseReference(model, [])


def test_compare_counts_the_attended_keys_per_window():
    from conftest import tiny_model
    from kascade import KascadePlan, ModelFingerprint
    from kascade.fidelity import DenseReference, pool

    model = tiny_model("llama")
    fp = ModelFingerprint.from_model(model)
    wins = [torch.randint(3, 97, (n,), generator=torch.Generator().manual_seed(n)) for n in (200, 256)]
    ref = DenseReference(model, wins)
    full = ref.compare(KascadePlan.all_anchors(fp, ratio=1.0, k_min=1, tile=8), account=True)
    assert [f.attended for f in full] == [1.0, 1.0] and all(f.top1_agreement == 1.0 for f in full)
    sparse = ref.compare(KascadePlan.uniform(fp, 2, ratio=0.1, k_min=8, tile=16), account=True)
    assert all(0.05 < f.attended < 0.5 for f in sparse) and sparse[0].attended != sparse[1].attended
    pooled = pool(sparse)
    w = [f.positions for f in sparse]
    assert abs(pooled.attended - (sparse[0].attended * w[0] + sparse[1].attended * w[1]) / sum(w)) < 1e-12
    assert ref.compare(KascadePlan.uniform(fp, 2))[0].attended is None  # counted only when asked
