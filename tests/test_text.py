"""The text windows (kascade.text): the development and evaluation splits of pydoc_data.topics never overlap,
and windows cut from a user's texts stay inside one text."""

from types import SimpleNamespace

import pytest
import torch

from kascade import text


class PositionTokenizer:
    """A tokenizer whose token ids are character positions: a window's ids say where in the corpus it lies."""

    def __call__(self, s, add_special_tokens=False):
        return SimpleNamespace(input_ids=list(range(len(s))))


@pytest.mark.filterwarnings("ignore:4 windows of 50000 tokens overlap")
def test_the_splits_partition_the_corpus_and_their_windows_stay_inside():
    tok = PositionTokenizer()
    n = len(text.corpus_text())
    dev, ev = text.split_ids(tok, "dev"), text.split_ids(tok, "eval")
    cut = int(n * 0.6)  # the first 60% for calibration, the last 40% for evaluation
    assert torch.equal(dev, torch.arange(cut)) and torch.equal(ev, torch.arange(cut, n))
    for seed in range(3):
        for length, count in ((2048, 8), (50_000, 4)):  # disjoint windows; more than the split holds (overlapping)
            assert all(int(w.max()) < cut for w in text.windows(tok, "dev", length, count, seed))
            assert all(int(w.min()) >= cut for w in text.windows(tok, "eval", length, count, seed))
    with pytest.raises(ValueError, match="split must be one of"):
        text.split_ids(tok, "test")


def test_cut_windows_take_texts_in_order_and_never_span_two():
    class Words:
        def __call__(self, s, add_special_tokens=False):
            return SimpleNamespace(input_ids=[int(w) for w in s.split()])

    texts = [" ".join(str(i) for i in range(100, 107)), "1 2", " ".join(str(i) for i in range(200, 209))]
    got = [w.tolist() for w in text.cut_windows(Words(), texts, 3, 10)]
    assert got == [[100, 101, 102], [103, 104, 105], [200, 201, 202], [203, 204, 205], [206, 207, 208]]
    assert [w.tolist() for w in text.cut_windows(Words(), texts, 3, 2)] == got[:2]


def _positions(ws):
    return [set(w.tolist()) for w in ws]


def test_windows_that_overlap_each_other_say_so():
    tok = PositionTokenizer()
    with pytest.warns(UserWarning, match=r"4 windows of 100000 tokens overlap: the dev split holds \d+ tokens, 7\d% "):
        text.windows(tok, "dev", 100_000, 4)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        text.windows(tok, "dev", 2048, 8)  # disjoint: no warning


def test_windows_avoid_the_windows_they_are_told_to():
    """The anchor search scores plans on other windows than the statistics': away from them wherever the seeded
    windows would share tokens with them, the seeded ones kept where they do not."""
    tok = PositionTokenizer()
    moved = 0
    for seed in range(6):
        stats = text.windows(tok, "dev", 30_000, 4, seed=seed)
        seeded = text.windows(tok, "dev", 30_000, 2, seed=seed + 11)
        search = text.windows(tok, "dev", 30_000, 2, seed=seed + 11, avoid=stats)
        taken = set().union(*_positions(stats))
        assert all(not (p & taken) for p in _positions(search)) and len(set().union(*_positions(search))) == 60_000
        if any(p & taken for p in _positions(seeded)):
            moved += 1
        else:
            assert all(torch.equal(a, b) for a, b in zip(search, seeded))
    assert moved, "no seed made the seeded windows overlap the statistics': the test checks nothing"


def test_windows_that_cannot_avoid_say_how_much_they_share():
    tok = PositionTokenizer()
    stats = text.windows(tok, "dev", 30_000, 9)  # 270K of the dev split's 279K tokens
    with pytest.warns(UserWarning, match=r"2 windows of 30000 tokens share \d+ tokens with the 9 windows"):
        text.windows(tok, "dev", 30_000, 2, seed=11, avoid=stats)
