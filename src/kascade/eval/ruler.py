"""RULER-style synthetic long-context tasks, generated offline and deterministically from a seed.

Haystacks are real English from the evaluation split of ``pydoc_data.topics`` (never the calibration split).
Scoring follows RULER's ``string_match_all``: the fraction of expected values that appear (case-insensitively)
in the model's answer. Each sample is ``{task, prompt (user message), answers: [str], max_new_tokens}``.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from .. import text

TASKS = ("niah_single_number", "niah_single_word", "niah_multikey", "niah_multivalue", "niah_multiquery",
         "variable_tracking", "common_words", "frequent_words")


@dataclass
class Sample:
    task: str
    prompt: str
    answers: list[str]
    max_new_tokens: int = 32
    meta: dict = field(default_factory=dict)


def string_match_all(prediction: str, answers: list[str]) -> float:
    """RULER's metric: the share of expected strings found in the prediction (case-insensitive)."""
    if not answers:
        raise ValueError("a sample needs at least one expected answer")
    p = prediction.lower()
    return sum(a.lower() in p for a in answers) / len(answers)


_WORDS: list[str] | None = None


def vocabulary() -> list[str]:
    """Distinct lowercase alphabetic words (5-10 letters) of the corpus, in sorted order: the needle keys and
    the word lists of the extraction tasks."""
    global _WORDS
    if _WORDS is None:
        _WORDS = sorted({w.lower() for w in re.findall(r"\b[A-Za-z]{5,10}\b", text.corpus_text())})
    return _WORDS


def _haystack_sentences(tokenizer, tokens: int, seed: int) -> list[str]:
    ids = text.windows(tokenizer, "eval", tokens, 1, seed=seed)[0]
    hay = tokenizer.decode(ids, clean_up_tokenization_spaces=False)
    parts = re.split(r"(?<=[.!?])\s+", hay)
    return [p for p in parts if p]


def _insert(sentences: list[str], needles: list[str], rng: random.Random) -> str:
    """Needles at random sentence boundaries (depths spread over the haystack)."""
    out = list(sentences)
    for nd in needles:
        out.insert(rng.randint(0, len(out)), nd)
    return " ".join(out)


def _budget(tokenizer, length: int, overhead: str) -> int:
    return max(32, length - len(tokenizer(overhead).input_ids) - 64)


def _niah(tokenizer, length, rng, seed, *, kind, n_keys=1, n_values=1, n_queries=1):
    words = vocabulary()
    keys = rng.sample(words, n_keys)
    def value():
        return str(rng.randint(1_000_000, 9_999_999)) if kind == "number" else rng.choice(words)
    values = {k: [value() for _ in range(n_values)] for k in keys}
    noun = "number" if kind == "number" else "word"
    needles = [f"One of the special magic {noun}s for {k} is: {v}." for k in keys for v in values[k]]
    asked = keys[:n_queries]
    if n_queries > 1:
        q = f"What are all the special magic {noun}s for {', '.join(asked[:-1])} and {asked[-1]} mentioned in the provided text?"
    elif n_values > 1:
        q = f"What are all the special magic {noun}s for {asked[0]} mentioned in the provided text?"
    else:
        q = f"What is the special magic {noun} for {asked[0]} mentioned in the provided text?"
    head = f"Some special magic {noun}s are hidden within the following text. Make sure to memorize them. I will quiz you about the {noun}s afterwards.\n"
    hay = _haystack_sentences(tokenizer, _budget(tokenizer, length, head + q + " ".join(needles)), seed)
    prompt = head + _insert(hay, needles, rng) + "\n" + q + f" The special magic {noun}s for the asked keys are:"
    return prompt, [v for k in asked for v in values[k]]


def _variable_tracking(tokenizer, length, rng, seed, hops=4, chains=2):
    words = vocabulary()
    names = [w.upper()[:5] for w in rng.sample(words, hops * chains * 2)]
    names = list(dict.fromkeys(names))[: hops * chains]
    needles, answer = [], None
    for c in range(chains):
        val = str(rng.randint(10000, 99999))
        chain = names[c * hops : (c + 1) * hops]
        needles.append(f"VAR {chain[0]} = {val}.")
        needles += [f"VAR {chain[i]} = VAR {chain[i - 1]}." for i in range(1, len(chain))]
        if c == 0:
            answer, asked_val = chain, val
    q = f"Find all variables that are assigned the value {asked_val} in the text above."
    head = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n"
    hay = _haystack_sentences(tokenizer, _budget(tokenizer, length, head + q + " ".join(needles)), seed)
    # keep the order of each chain: insert at increasing positions
    out = list(hay)
    positions = sorted(rng.randint(0, len(out)) for _ in needles)
    for off, (pos, nd) in enumerate(zip(positions, needles)):
        out.insert(pos + off, nd)
    prompt = head + " ".join(out) + "\n" + q + " Answer: According to the chain(s) of variable assignment, the variables are:"
    return prompt, answer


def _word_list_fitting(tokenizer, length: int, make) -> list[str]:
    """Grow the list until it nearly fills the length (binary search on the item count)."""
    lo, hi = 1, 8 * length
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(tokenizer(" ".join(make(mid))).input_ids) <= length:
            lo = mid
        else:
            hi = mid - 1
    return make(lo)


def _common_words(tokenizer, length, rng, seed, n_common=10):
    words = rng.sample(vocabulary(), min(2000, len(vocabulary())))
    common, rare = words[:n_common], words[n_common:]
    q = f"What are the {n_common} most common words in the above list?"
    budget = _budget(tokenizer, length, q + "Below is a numbered list of words.")

    def make(n_items):
        reps = max(2, n_items // (n_common * 5))  # common words fill a fifth of the list; rare ones appear once
        items = common * reps + rare[: max(0, n_items - n_common * reps)]
        r = random.Random(seed)
        r.shuffle(items)
        return [f"{i + 1}. {w}" for i, w in enumerate(items)]

    lst = _word_list_fitting(tokenizer, budget, make)
    prompt = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize "
              "the ones that appear most often.\n" + " ".join(lst) + "\nQuestion: " + q +
              f" Answer: The top {n_common} words that appear most often in the list are:")
    return prompt, common


def _frequent_words(tokenizer, length, rng, seed, top=3, alpha=2.0):
    words = rng.sample(vocabulary(), min(1000, len(vocabulary())))
    weights = [1.0 / (i + 1) ** alpha for i in range(len(words))]
    q = f"What are the {top} most frequently appearing coded words in the above text?"
    budget = _budget(tokenizer, length, q + "Read the following coded text and track the frequency of each coded word.")

    def make(n):
        r = random.Random(seed)
        return r.choices(words, weights=weights, k=n)

    lst = _word_list_fitting(tokenizer, budget, make)
    counts = {}
    for w in lst:
        counts[w] = counts.get(w, 0) + 1
    answer = sorted(counts, key=lambda w: (-counts[w], w))[:top]
    prompt = ("Read the following coded text and track the frequency of each coded word. Find the three most "
              "frequently appearing coded words.\n" + " ".join(lst) + "\nQuestion: " + q +
              f" Answer: According to the coded text above, the {top} most frequently appearing words are:")
    return prompt, answer


def generate(task: str, tokenizer, length: int, seed: int) -> Sample:
    """One sample of ``task`` for a prompt of about ``length`` tokens; the same (task, length, seed) always
    gives the same sample."""
    if task not in TASKS:
        raise ValueError(f"unknown RULER task {task!r}; choose from {', '.join(TASKS)}")
    rng = random.Random(f"{task}/{length}/{seed}")
    hay_seed = rng.randint(0, 10**6)
    if task == "niah_single_number":
        prompt, ans = _niah(tokenizer, length, rng, hay_seed, kind="number")
    elif task == "niah_single_word":
        prompt, ans = _niah(tokenizer, length, rng, hay_seed, kind="word")
    elif task == "niah_multikey":
        prompt, ans = _niah(tokenizer, length, rng, hay_seed, kind="number", n_keys=4)
    elif task == "niah_multivalue":
        prompt, ans = _niah(tokenizer, length, rng, hay_seed, kind="number", n_values=4)
    elif task == "niah_multiquery":
        prompt, ans = _niah(tokenizer, length, rng, hay_seed, kind="number", n_keys=4, n_queries=2)
    elif task == "variable_tracking":
        prompt, ans = _variable_tracking(tokenizer, length, rng, hay_seed)
    elif task == "common_words":
        prompt, ans = _common_words(tokenizer, length, rng, hay_seed)
    else:
        prompt, ans = _frequent_words(tokenizer, length, rng, hay_seed)
    new = 48 if task in ("common_words", "variable_tracking", "niah_multivalue", "niah_multiquery") else 24
    return Sample(task=task, prompt=prompt, answers=ans, max_new_tokens=new, meta=dict(length=length, seed=seed))
