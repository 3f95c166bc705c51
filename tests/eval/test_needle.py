"""The needle tasks (kascade.eval.needle): deterministic samples in the demo's chat format, haystacks from the
evaluation split only, needles at the documented depths, scoring with distractors; and the intervals the report gives
every score (kascade.eval.results)."""

import math
import re
from types import SimpleNamespace

import pytest
import torch

from kascade import text
from kascade.eval import needle, results

CORPUS = text.corpus_text()


class PositionChatTokenizer:
    """Token ids are character positions (of the corpus, for the corpus): a haystack's ids say where in the corpus
    it lies, and decode gives its text back. The chat template wraps the message in ``<user>`` ... ``<assistant>``;
    every call is recorded."""

    def __init__(self):
        self.chats = []

    def __call__(self, s, add_special_tokens=False):
        return SimpleNamespace(input_ids=list(range(len(s))))

    def decode(self, ids, clean_up_tokenization_spaces=False, skip_special_tokens=False):
        return "".join(CORPUS[i] for i in ids.tolist())

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True, return_dict=False):
        self.chats.append(add_generation_prompt)
        (m,) = messages
        s = f"<user>\n{m['content']}\n" + ("<assistant>\n" if add_generation_prompt else "")
        return list(range(len(s))) if tokenize else s


@pytest.fixture(scope="module")
def tok():
    return PositionChatTokenizer()


def _needle_sentences(task, sample):
    """The needle sentences of a sample, in the order they stand in the prompt."""
    pattern = {"needle_passkey": r"The secret passphrase of the \w+ is [^\n]+?\.",
               "needle_fact": r"The home city of \w+ is \w+\.",
               "needle_multikey": r"The home city of \w+ is \w+\."}[task]
    return re.findall(r"\n\n(" + pattern + r")\n\n", sample.prompt)


def test_a_haystack_whose_count_shrinks_slowly_still_fits(tok, monkeypatch):
    """needle_multikey 2K sample 95 with the default model's tokenizer under transformers 5.25 counted 2,049 tokens
    however the haystack was cut at rooms 1 to 4 tokens smaller: the sample raised. Stubbed here: every prompt
    within 5 tokens of the length counts one over it."""
    length, real = 600, needle._chat_len

    def stubborn(tokenizer, content):
        n = real(tokenizer, content)
        return length + 1 if n > length - 6 else n

    monkeypatch.setattr(needle, "_chat_len", stubborn)
    s = needle.generate("needle_multikey", tok, length, seed=0, index=95)
    assert length - 20 <= real(tok, s.prompt) <= length - 6


@pytest.mark.parametrize("task", needle.TASKS)
def test_samples_are_deterministic_per_seed_and_index(tok, task):
    a = needle.generate(task, tok, 600, seed=3, index=2)
    assert a == needle.generate(task, tok, 600, seed=3, index=2)
    assert a.prompt != needle.generate(task, tok, 600, seed=4, index=2).prompt
    assert a.prompt != needle.generate(task, tok, 600, seed=3, index=7).prompt
    assert a.task == task and a.meta["seed"] == 3 and a.meta["index"] == 2


@pytest.mark.parametrize("task", needle.TASKS)
@pytest.mark.parametrize("length", [300, 2048])
def test_the_chat_formatted_prompt_fills_the_length_and_ends_with_the_question(tok, task, length):
    tok.chats.clear()
    s = needle.generate(task, tok, length, seed=0, index=1)
    n = len(tok.apply_chat_template([{"role": "user", "content": s.prompt}], add_generation_prompt=True))
    assert length - 8 <= n <= length
    assert tok.chats and all(tok.chats)  # counted as the chat-formatted prompt, generation prompt added
    assert re.search(r"\n\nWhat is the [\w ]+\? Answer with the \w+ only\.$", s.prompt), s.prompt[-120:]
    for a in s.answers:
        assert a in s.prompt
    assert needle.score(s, f"It is {s.answers[0]}.") == 1.0 and needle.score(s, "I do not know.") == 0.0


@pytest.mark.parametrize("task", needle.TASKS)
def test_haystacks_come_from_the_evaluation_split_only(tok, task):
    """The calibration (dev) split is the corpus's first 60%: no haystack may reach into it."""
    eval_start = int(len(CORPUS) * text.DEV_FRACTION)  # the position tokenizer: one token per character
    for index in range(6):
        s = needle.generate(task, tok, 1500, seed=index, index=index)
        hay = s.prompt[: s.prompt.rindex("\n\nWhat is")]
        for nd in _needle_sentences(task, s):
            hay = hay.replace("\n\n" + nd + "\n\n", "", 1)
        assert len(hay) > 1000
        at = CORPUS.find(hay)
        assert at >= eval_start, (task, index, at)  # one contiguous window of the evaluation split


@pytest.mark.parametrize("task", needle.TASKS)
def test_needles_sit_at_their_documented_depths(tok, task):
    for index in range(10):
        s = needle.generate(task, tok, 2048, seed=0, index=index)
        depths = s.meta["depths"]
        base = (index % 5) / 4
        if task == "needle_multikey":  # the asked needle's depth is the sample's; the other lies half a haystack away
            assert abs(s.meta["depth"] - base) <= needle.JITTER
            assert s.meta["depth"] in depths and abs(abs(depths[1] - depths[0]) - 0.5) < 1e-9
        else:
            assert abs(s.meta["depth"] - base) <= needle.JITTER and depths == [s.meta["depth"]]
        # where the needles stand: the share of the haystack before each
        sentences = _needle_sentences(task, s)
        assert len(sentences) == len(depths)
        hay_len = len(s.prompt) - len(s.prompt[s.prompt.rindex("\n\nWhat is"):]) - sum(len(x) + 4 for x in sentences)
        before = 0
        rest = s.prompt
        for k, (d, nd) in enumerate(zip(sorted(depths), sentences)):
            cut = rest.index("\n\n" + nd + "\n\n")
            before += cut
            assert abs(before / hay_len - d) < 0.01, (index, k, before / hay_len, d)
            rest = rest[cut + len(nd) + 4:]
    spread = [needle.generate("needle_passkey", tok, 600, seed=0, index=i).meta["depth"] for i in range(5)]
    assert spread[0] <= needle.JITTER and spread[-1] >= 1 - needle.JITTER
    assert all(0 <= d <= 1 for d in spread) and spread == sorted(spread)


@pytest.mark.parametrize("form", ["city", "digits5"])
def test_a_distractor_in_the_answer_scores_zero(tok, form):
    s = needle.generate("needle_multikey", tok, 600, seed=0, index=0, form=form)
    (other,) = s.meta["distractors"]
    assert other != s.answers[0] and other in s.prompt
    assert needle.score(s, s.answers[0]) == 1.0
    assert needle.score(s, f"{s.answers[0]} or {other}") == 0.0
    assert needle.score(s, other) == 0.0


def test_values_and_keys_do_not_occur_in_the_corpus():
    """An answer copied from the haystack cannot contain the expected value by chance."""
    words = {w.lower() for w in re.findall(r"[A-Za-z]+", CORPUS)}
    for name in ("WORDS", "NAMES", "CITIES", "PLACES"):
        found = [w for w in getattr(needle, name) if w.lower() in words]
        assert not found, (name, found)


def test_unknown_tasks_and_lengths_without_room_are_refused(tok):
    with pytest.raises(ValueError, match="unknown needle task 'needle_nope'"):
        needle.generate("needle_nope", tok, 600, 0, 0)
    with pytest.raises(ValueError, match="needle_fact has no form 'digits5'; choose from city, pet, number"):
        needle.generate("needle_fact", tok, 600, 0, 0, form="digits5")
    with pytest.raises(ValueError, match="no room for a haystack"):
        needle.generate("needle_passkey", tok, 120, 0, 0)


# -- confidence intervals and the report ---------------------------------------------------------------------------

def test_wilson_interval_against_hand_computed_values():
    # 8 / 10, z = 1.96: centre (0.8 + 0.19207) / 1.38415 = 0.71674, half 1.41600 * sqrt(0.016 + 0.0096037) = 0.22658
    lo, hi = results.wilson(8, 10)
    assert lo == pytest.approx(0.49016, abs=5e-5) and hi == pytest.approx(0.94332, abs=5e-5)
    lo, hi = results.wilson(0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.27753, abs=5e-5)
    lo, hi = results.wilson(10, 10)
    assert lo == pytest.approx(0.72247, abs=5e-5) and hi == 1.0
    lo, hi = results.wilson(95, 100)
    assert lo == pytest.approx(0.88825, abs=5e-5) and hi == pytest.approx(0.97846, abs=5e-5)
    with pytest.raises(ValueError, match="0 <= passed <= n"):
        results.wilson(3, 2)


def test_fractional_scores_get_the_normal_interval():
    # mean 0.5, s = sqrt(0.2 / 3) = 0.258199, half = 1.959964 * 0.258199 / 2 = 0.253030
    assert results.interval([0.2, 0.4, 0.6, 0.8]) == dict(ci_low=pytest.approx(0.246970, abs=1e-6),
                                                          ci_high=pytest.approx(0.753030, abs=1e-6), ci_method="normal")
    assert results.interval([0.0, 0.5, 1.0]) == dict(ci_low=0.0, ci_high=1.0, ci_method="normal")  # clipped
    assert results.interval([0.5]) == dict(ci_low=None, ci_high=None, ci_method="normal")
    w = results.interval([1, 0, 1.0, 1, 1, 1, 1, 0, 1, 1])
    assert w["ci_method"] == "wilson" and (w["ci_low"], w["ci_high"]) == pytest.approx(results.wilson(8, 10))


def _rows(strategy, task, scores, length=2048):
    return [dict(strategy=strategy, task=task, length=length, sample=i, score=s, attended_fraction=1.0 if
                 strategy == "dense" else 0.1) for i, s in enumerate(scores)]


def test_the_report_gives_dense_beside_every_strategy_with_intervals(tmp_path):
    # niah_multikey: mean 0.58333, s = 0.38188, half = 1.959964 * 0.38188 / sqrt(3) = 0.43213
    rows = (_rows("kascade", "needle_passkey", [1] * 6 + [0] * 4) + _rows("dense", "needle_passkey", [1] * 8 + [0] * 2)
            + _rows("oracle", "needle_passkey", [1] * 9 + [0]) + _rows("dense", "niah_multikey", [0.5, 0.25, 1.0]))
    summary = results.summarize(rows)
    by = {(r["strategy"], r["task"]): r for r in summary}
    k = by[("kascade", "needle_passkey")]
    assert k["score"] == 0.6 and k["ci_method"] == "wilson"
    assert (k["ci_low"], k["ci_high"]) == pytest.approx((0.31267, 0.83182), abs=5e-5)
    assert k["dense_score"] == 0.8 and (k["dense_ci_low"], k["dense_ci_high"]) == pytest.approx(results.wilson(8, 10))
    assert "dense_score" not in by[("dense", "needle_passkey")]
    assert by[("dense", "niah_multikey")]["ci_method"] == "normal"
    md = results.write(rows, tmp_path, chart=False)["markdown"]
    assert "| task | length | samples | dense | kascade | oracle |" in md  # dense first, each strategy beside it
    assert "| needle_passkey | 2048 | 10 | 0.800 [0.490, 0.943] | 0.600 [0.313, 0.832] | 0.900 [0.596, 0.982] |" in md
    assert "| niah_multikey | 2048 | 3 | 0.583 [0.151, 1.000] |  |  |" in md
    assert "Wilson score interval" in md and "normal approximation" in md
    saved = {(r["strategy"], r["task"]): r for r in __import__("json").loads((tmp_path / "results.json").read_text())
             ["summary"]}
    assert saved[("kascade", "needle_passkey")]["dense_score"] == 0.8
    assert math.isclose(saved[("oracle", "needle_passkey")]["ci_low"], results.wilson(9, 10)[0])


@pytest.mark.model
@pytest.mark.parametrize("task", needle.TASKS)
def test_prompts_of_the_default_tokenizer_fill_their_length(default_model, task):
    tok = default_model[1]
    for length in (2048, 4096):
        s = needle.generate(task, tok, length, seed=0, index=3)
        ids = tok.apply_chat_template([{"role": "user", "content": s.prompt}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        assert length - 16 <= len(ids) <= length
        assert ids[-3:] == tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True,
                                                   tokenize=True, return_dict=False)[-3:]  # the generation prompt
        assert s.prompt.count(s.answers[0]) == 1 + sum(s.answers[0] in d for d in s.meta.get("distractors", []))
