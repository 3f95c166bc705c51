"""The measured anchor search, with a synthetic scorer."""

from kascade import KascadePlan, ModelFingerprint
from kascade.calibrate.search import search_anchors


def test_search_finds_the_minimum_of_a_synthetic_objective():
    target = (0, 2, 7, 9)

    def scorer(plan):  # KL = distance to the target anchor set
        return dict(kl=float(sum(abs(a - b) for a, b in zip(plan.anchors, target))), agreement=0.0)

    fp = ModelFingerprint("llama", 12, 6, 2, 8)
    build = lambda a: KascadePlan(fp, a, ((0, 1),) * 12)  # noqa: E731
    best, s, hist = search_anchors(build, scorer, (0, 3, 5, 10), 12, max_evals=200, progress=False)
    assert best == target and s["kl"] == 0 and len(hist) < 200
    best, _, hist = search_anchors(build, scorer, (0, 3, 5, 10), 12, max_evals=5, progress=False)
    assert len(hist) <= 5 and best != target  # the budget of scored plans is respected
