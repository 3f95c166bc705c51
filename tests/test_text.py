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
