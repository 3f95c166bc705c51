"""Needle retrieval in `kascade demo`'s format: tasks the default model (135M) answers densely, so a sparse strategy's
score can be read against dense's.

Every prompt is one chat message (the tokenizer's chat template, generation prompt added, as the demo and every
generated task of `kascade eval` are): a haystack of real English from the evaluation split of ``pydoc_data.topics``
(:func:`kascade.text.windows`, never the calibration split), cut at a needle's depth, the needle sentence set apart
by blank lines, and a question in the demo's form ("What is ...? Answer with the ... only."). A sample is fixed by
``(task, length, seed, index)``; its needles' depths follow the index: sample ``i``'s needle (the asked one, where
there are two) sits at depth ``(i mod 5) / 4`` of the haystack (0: its start, 1: its end), moved by a seeded jitter
of at most ``JITTER`` and kept in [0, 1], so any run of 5 consecutive samples covers the haystack's start, quarters,
middle and end. The depths are in the sample's ``meta``.

Scoring is RULER's ``string_match_all`` (the expected value contained in the answer, case-insensitively); a sample
whose meta names ``distractors`` (values of the other needles) scores 0 when the answer contains one of them, so
answering with every value in the haystack does not pass.
"""

from __future__ import annotations

import random

from .. import text
from .ruler import Sample, string_match_all

DEPTHS = 5  # sample i's needle at depth (i mod DEPTHS) / (DEPTHS - 1), jittered
JITTER = 0.05
MAX_NEW_TOKENS = 16
SAMPLES = 100  # per length, by default: a pass rate's 95% interval is then at most about +-0.1 (Wilson, at 50%)

# Values and keys that do not occur in the haystacks' corpus (checked by the tests), so an answer copied from the
# haystack cannot contain one by chance.
WORDS = ("apricot", "avocado", "badger", "beaver", "bison", "blueberry", "camel", "cherry", "cobra",
         "coconut", "cricket", "dolphin", "donkey", "falcon", "ferret", "flamingo", "gazelle", "giraffe", "gorilla",
         "hamster", "hedgehog", "jaguar", "kangaroo", "kiwi", "koala", "lemur", "leopard", "lobster", "mango",
         "meerkat", "octopus", "ostrich", "otter", "panda", "papaya", "peacock", "pelican", "pineapple",
         "plum", "raccoon", "raspberry", "reindeer", "salmon", "squirrel", "strawberry", "tangerine", "tiger",
         "toucan", "turtle", "walnut", "walrus", "zebra")
NAMES = ("Alice", "Benjamin", "Camila", "Daniel", "Elena", "Farid", "Grace", "Hiroshi", "Isabel", "Jonas", "Keira",
         "Lucas", "Maya", "Nikolai", "Olivia", "Pedro", "Quinn", "Rosa", "Samuel", "Tamara", "Umar", "Valerie",
         "Wesley", "Ximena", "Yusuf", "Zoe")
CITIES = ("Lisbon", "Nairobi", "Oslo", "Lima", "Hanoi", "Dublin", "Quito", "Cairo", "Manila", "Vienna", "Santiago",
          "Helsinki", "Bogota", "Kyoto", "Marseille", "Krakow", "Tbilisi", "Montevideo", "Reykjavik", "Casablanca")
PLACES = ("archive", "vault", "citadel", "museum", "observatory", "lighthouse", "greenhouse", "harbor")


def _value(rng: random.Random, form: str) -> str:
    if form == "digits5":
        return str(rng.randint(10_000, 99_999))
    if form == "digits7":
        return str(rng.randint(1_000_000, 9_999_999))
    if form == "word":
        return rng.choice(WORDS)
    if form == "compound":  # the demo's value form: blue-harbor-7421
        a, b = rng.sample(WORDS, 2)
        return f"{a}-{b}-{rng.randint(1000, 9999)}"
    raise AssertionError(form)  # generate checks the form


def depth_of(index: int, rng: random.Random) -> float:
    """The (asked) needle's depth for sample ``index`` (module docstring)."""
    base = (index % DEPTHS) / (DEPTHS - 1)
    return min(1.0, max(0.0, base + rng.uniform(-JITTER, JITTER)))


def _chat_len(tokenizer, content: str) -> int:
    return len(tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False))


def _compose(tokenizer, length: int, hay_seed: int, needles: list[tuple[float, str]], question: str):
    """The message: the needles (``(depth, sentence)``, in depth order) set into a haystack of the evaluation split,
    then the question, so that the chat-formatted prompt has at most ``length`` tokens."""
    frame = "".join("\n\n" + n + "\n\n" for _, n in needles) + "\n\n" + question
    room = length - _chat_len(tokenizer, frame)
    # Decoding and re-encoding a cut haystack may change its token count a little: the haystack shrinks by the tokens
    # over, and after three tries by more each time (a cut that re-encodes one token long whatever the room).
    for attempt in range(12):
        if room < 16:
            raise ValueError(f"a prompt of {length} tokens has no room for a haystack around the needles")
        hay = text.windows(tokenizer, "eval", room, 1, seed=hay_seed)[0]
        cuts = [0] + [round(d * room) for d, _ in needles] + [room]
        parts = [tokenizer.decode(hay[a:b], clean_up_tokenization_spaces=False) for a, b in zip(cuts, cuts[1:])]
        content = parts[0]
        for (_, n), part in zip(needles, parts[1:]):
            content += "\n\n" + n + "\n\n" + part
        content += "\n\n" + question
        over = _chat_len(tokenizer, content) - length
        if over <= 0:
            return content
        room -= over + (0 if attempt < 3 else 2 ** (attempt - 3))
    raise AssertionError("the haystack does not fit")  # pragma: no cover


def generate(task: str, tokenizer, length: int, seed: int, index: int, *, form: str | None = None) -> Sample:
    """Sample ``index`` of ``task`` for a chat-formatted prompt of at most ``length`` tokens; the same
    ``(task, length, seed, index)`` always gives the same sample. ``form``: a value form other than the suite's
    (``FORMS``), one of ``CANDIDATES[task]``, for trials of candidate forms (``benchmarks.needle_forms``)."""
    if task not in FORMS:
        raise ValueError(f"unknown needle task {task!r}; choose from {', '.join(TASKS)}")
    if form is not None and form not in CANDIDATES[task]:
        raise ValueError(f"{task} has no form {form!r}; choose from {', '.join(CANDIDATES[task])}")
    rng = random.Random(f"{task}/{length}/{seed}/{index}")
    hay_seed = rng.randint(0, 10**6)
    d = depth_of(index, rng)
    form = form or FORMS[task]
    meta = dict(length=length, seed=seed, index=index, form=form)
    if task == "needle_passkey":
        v = _value(rng, form)
        needles = [(d, f"The secret passphrase of the archive is {v}.")]
        question = "What is the secret passphrase of the archive? Answer with the passphrase only."
        answers = [v]
    elif task == "needle_fact":
        name = rng.choice(NAMES)
        if form == "city":
            v = rng.choice(CITIES)
            needles = [(d, f"The home city of {name} is {v}.")]
            question = f"What is the home city of {name}? Answer with the city only."
        elif form == "pet":
            v = rng.choice(WORDS)
            needles = [(d, f"The favorite animal of {name} is the {v}.")]
            question = f"What is the favorite animal of {name}? Answer with the animal only."
        else:  # a number
            v = str(rng.randint(10_000, 99_999))
            needles = [(d, f"The locker number of {name} is {v}.")]
            question = f"What is the locker number of {name}? Answer with the number only."
        answers = [v]
    elif task == "needle_multikey":
        if form == "city":  # two people's home cities
            asked, other = rng.sample(NAMES, 2)
            v, w = rng.sample(CITIES, 2)
            sentence = "The home city of {} is {}."
            question = f"What is the home city of {asked}? Answer with the city only."
        else:  # two places' passphrases
            asked, other = rng.sample(PLACES, 2)
            v, w = _value(rng, form), _value(rng, form)
            while w == v:
                w = _value(rng, form)
            sentence = "The secret passphrase of the {} is {}."
            question = f"What is the secret passphrase of the {asked}? Answer with the passphrase only."
        # the asked needle at the sample's depth, the other half a haystack away
        needles = sorted([(d, sentence.format(asked, v)), ((d + 0.5) % 1.0, sentence.format(other, w))])
        answers = [v]
        meta["distractors"] = [w]
    meta.update(depth=d, depths=[p for p, _ in needles])
    content = _compose(tokenizer, length, hay_seed, needles, question)
    return Sample(task=task, prompt=content, answers=answers, max_new_tokens=MAX_NEW_TOKENS, meta=meta)


# each task's form in the suite: those the default model answered densely in >= 80% of a trial's samples
# (benchmarks/needle_forms.py; docs/calibration.md has the figures)
FORMS = {"needle_passkey": "digits5", "needle_fact": "city", "needle_multikey": "city"}
TASKS = tuple(FORMS)
_VALUES = ("digits5", "digits7", "word", "compound")
CANDIDATES = {"needle_passkey": _VALUES, "needle_fact": ("city", "pet", "number"),
              "needle_multikey": ("city", *_VALUES)}


def score(sample: Sample, prediction: str) -> float:
    """``string_match_all`` of the answers; 0 when the prediction contains a distractor (module docstring)."""
    p = prediction.lower()
    if any(x.lower() in p for x in sample.meta.get("distractors", ())):
        return 0.0
    return string_match_all(prediction, sample.answers)
